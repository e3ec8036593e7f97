import os
import stat

from slurm_dlrm.service.daemon import (
    ServiceLock,
    ServicePaths,
    read_status,
    running_pid,
    wake,
    write_status,
)


def test_one_lock_holder_and_running_pid(tmp_path):
    paths = ServicePaths(tmp_path / "store")
    assert running_pid(paths) is None
    first = ServiceLock.acquire(paths)
    assert first is not None
    assert stat.S_IMODE(paths.store_dir.stat().st_mode) == 0o700
    assert ServiceLock.acquire(paths, attempts=2) is None
    assert running_pid(paths) == os.getpid()
    first.release()
    assert running_pid(paths) is None
    assert not paths.pid.exists()
    again = ServiceLock.acquire(paths)
    assert again is not None
    again.release()


def test_stale_pid_file_without_lock_means_not_running(tmp_path):
    paths = ServicePaths(tmp_path)
    paths.lock.touch()
    paths.pid.write_text("999999\n")
    assert running_pid(paths) is None
    assert wake(paths) is False


def test_status_round_trip(tmp_path):
    paths = ServicePaths(tmp_path)
    assert read_status(paths) == {}
    write_status(paths, {"slurm": "unreachable", "retry_in_s": 4})
    assert read_status(paths) == {"retry_in_s": 4, "slurm": "unreachable"}
    assert stat.S_IMODE(paths.status.stat().st_mode) == 0o600


def test_pid_of_a_killed_predecessor_is_not_reported(tmp_path):
    import subprocess
    import sys

    paths = ServicePaths(tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])  # noqa: S603
    dead.wait()
    lock = ServiceLock.acquire(paths)
    assert lock is not None
    paths.pid.write_text(f"{dead.pid}\n")  # as if the new holder had not written its pid yet
    assert running_pid(paths) == -1  # held, but by no live pid we know
    paths.pid.write_text(f"{os.getpid()}\n")
    assert running_pid(paths) == os.getpid()
    lock.release()
