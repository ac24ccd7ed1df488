"""A plain torch TCPStore client, as any local process that reaches the store's port can open one: the hostile
store users of the tests connect through this (retrying while the store comes up)."""

from __future__ import annotations

import datetime
import time

import torch.distributed as dist


def connect(host: str, port: int, within_s: float = 120.0) -> dist.TCPStore:
    deadline = time.monotonic() + within_s
    while True:
        try:
            return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=10))
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
