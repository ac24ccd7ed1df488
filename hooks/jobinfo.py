"""Where a job's records live and who this rank is, from the launcher's environment (torchrun, Slurm)."""

from __future__ import annotations

import os
import re

DEFAULT_SHM_DIR = "/dev/shm/rankwatch"
_SAFE_ID = re.compile(r"[^A-Za-z0-9._-]")


def shm_dir(env: os._Environ[str] | dict[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    return env.get("RANKWATCH_SHM_DIR") or DEFAULT_SHM_DIR


def sanitize_job_id(raw: str) -> str:
    """Job ids become directory names: keep them to a safe alphabet and length."""
    cleaned = _SAFE_ID.sub("_", raw.strip())[:60].lstrip(".")
    return cleaned or "job"


def job_id(env: os._Environ[str] | dict[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    for key in ("RANKWATCH_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "RANKWATCH_RUN_NAME"):
        value = env.get(key, "")
        # torchrun without --rdzv-id reports the literal "none": not an identity
        if value and value != "none":
            return sanitize_job_id(value)
    port = env.get("MASTER_PORT")
    return sanitize_job_id(f"job-{port}") if port else f"pid-{os.getppid()}"


def _int(env: os._Environ[str] | dict[str, str], *keys: str, default: int) -> int:
    for key in keys:
        value = env.get(key)
        if value is not None:
            try:
                return int(value)
            except ValueError:
                continue
    return default


def rank_identity(env: os._Environ[str] | dict[str, str] | None = None) -> dict[str, int]:
    env = os.environ if env is None else env
    return {
        "global_rank": _int(env, "RANK", "SLURM_PROCID", default=0),
        "local_rank": _int(env, "LOCAL_RANK", "SLURM_LOCALID", default=0),
        "world_size": _int(env, "WORLD_SIZE", "SLURM_NTASKS", default=1),
        "local_world_size": _int(env, "LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", default=1),
        "node_rank": _int(env, "GROUP_RANK", "SLURM_NODEID", "NODE_RANK", default=0),
    }
