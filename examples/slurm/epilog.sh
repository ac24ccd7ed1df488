#!/bin/sh
# Slurm Epilog (slurm.conf: Epilog=/etc/slurm/epilog.d/rankwatch.sh): runs as root on every node of a job
# when it ends, also after a step was SIGKILLed (KillWait expired) before rankwatch.sbatch's own clean-up
# ran. Removes the job's rankwatch records from the node's shm dir. SLURM_JOB_ID is set by slurmd, not by
# the user; only a numeric id is accepted, and rm never follows a symlink it is given.
case "$SLURM_JOB_ID" in '' | *[!0-9]*) exit 0 ;; esac
dir=${RANKWATCH_SHM_DIR:-/dev/shm/rankwatch}/slurm-$SLURM_JOB_ID
[ -e "$dir" ] || [ -L "$dir" ] || exit 0
rm -rf -- "$dir"
exit 0
