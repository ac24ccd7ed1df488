"""The one file writer: owner-only, whole or absent, no temp files left behind after a failure."""

from __future__ import annotations

import os
import stat
import subprocess

import pytest
from rankwatch.hooks.files import atomic_write, write_new


def test_atomic_write_is_owner_only_and_replaces(tmp_path):
    target = tmp_path / "summary.json"
    target.write_text("old")
    atomic_write(str(target), b"new")
    assert target.read_bytes() == b"new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert os.listdir(tmp_path) == ["summary.json"]


def test_write_new_refuses_existing_files_and_symlinks(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    link = tmp_path / "link"
    link.symlink_to(victim)
    for path in (victim, link):
        with pytest.raises(FileExistsError):
            write_new(str(path), b"x")
    assert victim.read_text() == "keep"


def test_failed_replace_leaves_no_temp_file(tmp_path):
    (tmp_path / "target").mkdir()  # os.replace of a file onto a directory fails
    with pytest.raises(OSError):
        atomic_write(str(tmp_path / "target"), b"data")
    assert os.listdir(tmp_path) == ["target"]


@pytest.fixture
def tiny_tmpfs(tmp_path):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_enospc_leaves_neither_a_partial_file_nor_a_temp_file(tiny_tmpfs):
    target = tiny_tmpfs / "verdict.json"
    target.write_bytes(b"previous")
    with pytest.raises(OSError) as err:
        atomic_write(str(target), b"x" * (1 << 20))
    assert err.value.errno == 28  # ENOSPC
    assert target.read_bytes() == b"previous"
    assert os.listdir(tiny_tmpfs) == ["verdict.json"]
