"""The pack folder's files (placement.json, the batch script, spec.json) are replaced
atomically (issue 32 item 12): a reader holding or opening the file while the service
rewrites it sees the whole old content or the whole new, never a truncated file."""

from __future__ import annotations

import os
import stat

import pytest

from slurm_dlrm import osutil
from slurm_dlrm.service.spool import write_private


def test_a_rewrite_never_truncates_what_a_reader_holds(tmp_path):
    path = tmp_path / "placement.json"
    old = '{"members": [' + "1, " * 5000 + "1]}\n"
    write_private(path, old)
    with open(path) as reader:  # an agent that opened it before the rewrite
        write_private(path, '{"members": []}\n')  # today: O_TRUNC empties the reader's file
        assert reader.read() == old
    assert path.read_text() == '{"members": []}\n'
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["placement.json"]  # no temporary left


def test_a_failed_rewrite_leaves_the_old_file_whole(tmp_path, monkeypatch):
    path = tmp_path / "placement.json"
    write_private(path, "old\n")

    def fail(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(osutil.os, "fsync", fail)
    with pytest.raises(OSError, match="No space"):
        write_private(path, "new\n")
    assert path.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["placement.json"]


def test_the_temporary_file_is_private_from_its_creation(tmp_path, monkeypatch):
    seen: list[int] = []
    real_replace = os.replace

    def spy(src, dst):
        seen.append(stat.S_IMODE(os.stat(src).st_mode))
        real_replace(src, dst)

    monkeypatch.setattr(osutil.os, "replace", spy)
    old_umask = os.umask(0)
    try:
        write_private(tmp_path / "spec.json", "{}\n")
    finally:
        os.umask(old_umask)
    assert seen == [0o600]
