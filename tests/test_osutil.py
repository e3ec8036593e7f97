"""The one atomic writer and the one pid check (slurm_dlrm/osutil.py, issue 43 item 10)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

from slurm_dlrm.osutil import pid_alive, write_atomic


def test_pid_alive_running_zombie_and_gone():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])  # noqa: S603
    try:
        assert pid_alive(child.pid)
    finally:
        child.kill()
    deadline = time.monotonic() + 10
    # killed, not reaped yet: a zombie answers kill(0) but is not alive
    while pid_alive(child.pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not pid_alive(child.pid)
    os.kill(child.pid, 0)  # still a zombie (not reaped): kill(0) alone would say alive
    child.wait()
    assert not pid_alive(child.pid)
    assert pid_alive(1)  # another user's process (init): PermissionError or not, it runs


def test_write_atomic_is_private_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "status.json"
    write_atomic(path, "one\n")
    write_atomic(str(path), "two\n")
    assert path.read_text() == "two\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["status.json"]
