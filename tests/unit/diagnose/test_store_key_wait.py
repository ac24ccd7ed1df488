"""Offline: a rank that never reached ``init_process_group`` under torch's default start-up timeout.

The console (``tests/fixtures/logs/console/pre_init_store_wait_r3.log``) is a real 4-rank torchrun job of
``benchmarks/accuracy`` class ``pre-init-default``: rank 3 blocks before ``init_process_group``; ranks 0-2
raise ``DistStoreError: wait timeout after 60000ms, keys: /default_pg/0//cpu//0/3`` (unprefixed tracebacks)
and torchrun SIGTERMs everyone. Gloo's rendezvous key names the rank whose address never came: rank 3.
Keys of another group (group ranks, not global) or NCCL's (a counter, not a rank) name nobody.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "logs" / "console" / "pre_init_store_wait_r3.log"
KEY_LINE = "keys: /default_pg/0//cpu//0/3"


def diagnose(path: Path) -> dict:  # type: ignore[type-arg]
    p = subprocess.run(
        [sys.executable, "-m", "rankwatch.watchdog.cli", "diagnose", "--json", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return json.loads(p.stdout)


def test_the_rank_whose_rendezvous_key_never_came_is_named() -> None:
    doc = diagnose(FIXTURE)
    assert doc["initiating_ranks"] == [3]
    assert doc["kind"] == "hang"
    assert doc["finding"]["rule"] == "wait_for"
    assert doc["confidence"] != "high"  # the printers are unprefixed: taken to be the others


@pytest.mark.parametrize(
    "key",
    [
        "keys: /default_pg/1//cpu//0/3",  # a subgroup: 3 is a group rank, not a global one
        "keys: /default_pg/0//cuda//0/3",  # not gloo's full-mesh key
        "keys: /default_pg/0/store_based_barrier_key:1",  # a barrier key names no rank
    ],
)
def test_keys_that_do_not_name_a_global_rank_name_nobody(tmp_path: Path, key: str) -> None:
    text = FIXTURE.read_text()
    assert KEY_LINE in text
    log = tmp_path / "console.log"
    log.write_text(text.replace(KEY_LINE, key))
    assert diagnose(log)["initiating_ranks"] == []
