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


def test_status_a_neighbour_placed_is_not_read(tmp_path):
    """`queue`/`serve status` read the status file: a FIFO must not stall them (the old
    read_text blocked forever), nor a link, a file others may write, or another user's
    file forge what they show."""
    import os
    import threading

    paths = ServicePaths(tmp_path)
    os.mkfifo(paths.status)
    got: list[dict] = []
    reader = threading.Thread(target=lambda: got.append(read_status(paths)), daemon=True)
    reader.start()
    reader.join(5)
    assert got == [{}], "read_status blocked on a FIFO"
    paths.status.unlink()

    forged = tmp_path / "forged.json"
    forged.write_text('{"host": "elsewhere", "pid": 1}')
    paths.status.symlink_to(forged)
    assert read_status(paths) == {}
    paths.status.unlink()

    write_status(paths, {"host": "here"})
    os.chmod(paths.status, 0o622)
    assert read_status(paths) == {}
    os.chmod(paths.status, 0o600)
    assert read_status(paths) == {"host": "here"}
    if os.geteuid() == 0:
        os.chown(paths.status, 65534, 65534)
        assert read_status(paths) == {}

    paths.status.write_bytes(b"{" + b" " * (70 * 1024) + b"}")
    os.chown(paths.status, os.geteuid(), os.getegid())
    os.chmod(paths.status, 0o600)
    assert read_status(paths) == {}


def test_start_on_a_full_file_system_is_one_line_and_leaves_no_lock(tmp_path, monkeypatch):
    """Issue 49 noticed it: a service started while the store's file system is full died
    with an OSError traceback writing its status/pid file. Now StoreFull (one line, the
    CLI's exit code for it), the lock dropped, no pid file, no temporary file left."""
    import errno

    import pytest

    from slurm_dlrm.osutil import write_atomic
    from slurm_dlrm.service import daemon
    from slurm_dlrm.store.errors import StoreFull

    paths = ServicePaths(tmp_path / "store")

    def full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(daemon, "write_atomic", full)
    with pytest.raises(StoreFull, match="file system is full; the service did not start"):
        ServiceLock.acquire(paths)
    assert not paths.pid.exists()
    assert not [p for p in paths.store_dir.iterdir() if p.name.endswith(".tmp")]
    monkeypatch.setattr(daemon, "write_atomic", write_atomic)
    lock = ServiceLock.acquire(paths, attempts=1)  # the lock was let go
    assert lock is not None
    lock.release()


def test_other_write_errors_at_start_still_raise(tmp_path, monkeypatch):
    import errno

    import pytest

    from slurm_dlrm.service import daemon

    def denied(path, text):
        raise OSError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(daemon, "write_atomic", denied)
    with pytest.raises(PermissionError):
        ServiceLock.acquire(ServicePaths(tmp_path / "store"))
