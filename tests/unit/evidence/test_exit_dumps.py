"""The flight recorders ranks wrote as they ended (``hooks/exit_dump.py``), read for the gone ranks of an incident
(``evidence.capture.exit_dumps``) with a live dump's trust rules: through the job owner's reader, never a
symlink, bounded, validated. Real job dirs on disk, real recorded dumps."""

from __future__ import annotations

import shutil
from pathlib import Path

from rankwatch.watchdog.core.policy import CapturePolicy
from rankwatch.watchdog.evidence.capture import AT_EXIT, exit_dumps

FR = Path(__file__).resolve().parents[2] / "fixtures" / "fr" / "gather-shape"


def plant(job: Path, pid: int, rank: int, source: Path | None = None) -> Path:
    d = job / "dumps" / f"exit-{pid}"
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = d / f"rank-{rank}.fr.json"
    if source is not None:
        shutil.copyfile(source, path)
    return path


def test_each_gone_rank_gets_the_dump_its_own_process_wrote(tmp_path):
    job = tmp_path / "job"
    job.mkdir(mode=0o700)
    plant(job, 4242, 1, FR / "rank-1.fr.json")
    plant(job, 999, 3, FR / "rank-3.fr.json")  # an earlier process of rank 3 (a restart): not this one's
    got = exit_dumps([(1, 4242), (3, 4243), (0, 4244)], str(job), CapturePolicy())
    assert set(got) == {1}
    cap = got[1]
    assert cap.fr_trace is not None and cap.fr_trace.rank == 1 and cap.notes == [AT_EXIT]
    newest = cap.fr_trace.entries[-1]
    assert (newest.collective_seq_id, newest.op, newest.input_sizes) == (23, "all_gather", ((3,),))


def test_a_planted_symlink_or_a_pickle_is_refused_with_a_note(tmp_path):
    job = tmp_path / "job"
    job.mkdir(mode=0o700)
    plant(job, 5, 2).symlink_to(FR / "rank-0.fr.json")
    plant(job, 6, 3).write_bytes(b"\x80\x04 a pickled dump")
    got = exit_dumps([(2, 5), (3, 6)], str(job), CapturePolicy())
    assert got[2].fr_trace is None and "symlink" in got[2].notes[0]
    assert got[3].fr_trace is None and "pickled dump refused" in got[3].notes[0]


def test_a_dumps_dir_that_is_a_symlink_is_never_followed(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    plant(elsewhere, 7, 0, FR / "rank-0.fr.json")
    job = tmp_path / "job"
    job.mkdir(mode=0o700)
    (job / "dumps").symlink_to(elsewhere / "dumps")
    got = exit_dumps([(0, 7)], str(job), CapturePolicy())
    assert got[0].fr_trace is None and got[0].notes, got
