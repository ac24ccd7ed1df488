#!/usr/bin/env bash
# The rankwatch demo: a real 4-rank DDP job on CPU/gloo whose rank 2 hangs in its dataloader at step 10.
# rankwatch names rank 2 and the phase within seconds, writes an incident bundle and stops the job.
set -u
cd "$(dirname "$0")/.."
out=${1:-demo-out}
rm -rf "$out"
rankwatch run --out "$out" --stall-timeout 5 --on-stall kill --quiet -- \
    --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:0 --rdzv-id rankwatch-demo \
    examples/ddp_demo.py --scenario input-hang --fault-rank 2 --fault-step 10 --steps 1000
code=$?
echo
echo "torchrun exited with $code (the job was stopped on purpose: --on-stall kill)."
echo "Inspect the evidence: rankwatch report $out   (stacks: $out/incidents/*/stacks/)"
