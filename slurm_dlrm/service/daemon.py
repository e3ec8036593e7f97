"""One packing service per user: a lock file, a pid file, start, stop, wake.

The service holds an exclusive `flock` on `<store_dir>/service.lock` for its whole life;
the kernel drops it when the process dies (also on kill -9), so "is it running?" is
answered by trying the lock, never by trusting a stale pid file. The pid file only
says whom to signal.

Signals: SIGTERM stops the service after its current round; SIGUSR1 wakes it for a
round now (sent by `submit`, so new jobs do not wait for the round timer).

Several login nodes share the user's home, so the store folder (and this lock) may be
seen from a host where the service does not run: the status file names the service's
host, and a pid is only ever signalled on that host (`ServiceElsewhere` otherwise: a
pid means nothing on another machine and could name anyone's process there).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_dlrm.errors import DlrmError
from slurm_dlrm.osutil import pid_alive, write_atomic
from slurm_dlrm.store.db import open_own_file, refuse_foreign
from slurm_dlrm.store.service_status import MAX_STATUS_BYTES

log = logging.getLogger(__name__)


def this_host() -> str:
    return socket.gethostname()


class ServiceElsewhere(DlrmError):
    """The user's service runs on another host: it cannot be signalled from here."""

    def __init__(self, host: str, pid: int | None) -> None:
        self.host = host
        self.pid = pid
        super().__init__(f"packing service: it runs on host {host} (pid {pid if pid and pid > 0 else '?'}), "
                         f"not on this one ({this_host()}); run this command on {host}")


@dataclass(frozen=True)
class ServicePaths:
    """Where one user's service keeps its files (all inside the private store folder)."""

    store_dir: Path

    @property
    def lock(self) -> Path:
        return self.store_dir / "service.lock"

    @property
    def pid(self) -> Path:
        return self.store_dir / "service.pid"

    @property
    def log(self) -> Path:
        return self.store_dir / "service.log"

    @property
    def status(self) -> Path:
        return self.store_dir / "service.status.json"


def ensure_private_dir(path: Path) -> Path:
    """Create `path` (and parents) and make it 0700: it holds the user's job data."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = path.stat()
    refuse_foreign(path, st, "folder")  # made first by someone else under a shared parent
    if st.st_mode & 0o077:
        path.chmod(0o700)
    return path


class ServiceLock:
    """The running service's claim; `acquire()` returns None if another one holds it."""

    def __init__(self, paths: ServicePaths, fd: int) -> None:
        self.paths = paths
        self._fd = fd

    @classmethod
    def acquire(cls, paths: ServicePaths, attempts: int = 20) -> ServiceLock | None:
        ensure_private_dir(paths.store_dir)
        fd = os.open(paths.lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        for attempt in range(attempts):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    raise
                # `running_pid` takes a shared lock for an instant; retry past it.
                if attempt == attempts - 1:
                    os.close(fd)
                    return None
                time.sleep(0.025)
        # Who holds the lock, and on which host, before the first round (read by
        # `running_pid` on every host that sees this folder). The host goes first: a
        # reader that sees the new pid must not take it for a pid of its own host. The
        # rest of the last status stays until the first round replaces it (the
        # exporter's last-round age; `queue`'s reconcile takes this lock too).
        try:
            write_status(paths, {**read_status(paths), "pid": os.getpid(), "host": this_host(),
                                 "started_t": time.time()})
            write_atomic(paths.pid, f"{os.getpid()}\n")
        except OSError as exc:
            os.close(fd)  # the lock goes with it: no service started
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            from slurm_dlrm.store.errors import StoreFull

            # (issue 49 noticed: a traceback at start-up) one line, as a full store's write
            raise StoreFull(f"packing service: {paths.store_dir}: its file system is full; the service did not "
                            "start (start it again once there is room)") from None
        return cls(paths, fd)

    def release(self) -> None:
        if self._fd < 0:
            return
        with contextlib.suppress(FileNotFoundError):
            if read_pid(self.paths) == os.getpid():
                self.paths.pid.unlink()
        os.close(self._fd)  # drops the flock
        self._fd = -1

    def __enter__(self) -> ServiceLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def read_pid(paths: ServicePaths) -> int | None:
    try:
        pid = int(paths.pid.read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if pid > 1 else None  # never let a signal go to a process group or init


def service_host(paths: ServicePaths) -> str | None:
    """The host the status file names (None: no status yet, or written before hosts were)."""
    host = read_status(paths).get("host")
    return host if isinstance(host, str) and host else None


def elsewhere(paths: ServicePaths) -> str | None:
    """The other host the running service is on, or None if it runs here (or none runs)."""
    host = service_host(paths)
    return host if host is not None and host != this_host() else None


def running_pid(paths: ServicePaths) -> int | None:
    """The pid of the user's running service, or None if none holds the lock.

    On another host (see `elsewhere`) the pid is the pid file's, unchecked: it cannot
    be checked from here, and it must not be signalled from here."""
    try:
        fd = os.open(paths.lock, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                # Held: a service runs. Right after it took the lock its pid file may
                # still be missing or name a killed predecessor: wait for a live pid.
                if elsewhere(paths) is not None:
                    return read_pid(paths) or -1
                for _ in range(100):
                    pid = read_pid(paths)
                    if pid is not None and pid_alive(pid):
                        return pid
                    time.sleep(0.01)
                return -1
            raise
        return None  # we got the lock, so nobody holds it (ours drops on close)
    finally:
        os.close(fd)


def spawn_service(paths: ServicePaths, serve_args: list[str], env: dict[str, str] | None = None) -> int:
    """Start `slurm-dlrm serve` detached (own session, output to the service log).

    Returns the child's pid without waiting: a second service started by a racing
    `submit` finds the lock taken and exits at once, so a spawn is always safe.
    """
    ensure_private_dir(paths.store_dir)
    # -v: INFO in the log; --log-file: the service rotates it (service/servicelog.py)
    argv = [sys.executable, "-m", "slurm_dlrm", "-v", "serve", "--log-file", str(paths.log), *serve_args]
    env = dict(os.environ if env is None else env)
    # The child (and the packs it submits, which inherit its environment) must run this
    # very slurm_dlrm, also from a source checkout that is not the installed one.
    package_root = str(Path(__file__).resolve().parent.parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([package_root, *filter(None, [env.get("PYTHONPATH")])])
    with open(paths.log, "ab", buffering=0) as out:
        os.chmod(paths.log, 0o600)
        proc = subprocess.Popen(  # noqa: S603 - our own interpreter and module
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
            close_fds=True, cwd=str(paths.store_dir), env=env)
    log.info("started the packing service (pid %d): %s", proc.pid, argv)
    return proc.pid


def wait_until_running(paths: ServicePaths, timeout_s: float = 10.0) -> int | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pid = running_pid(paths)
        if pid is not None and pid > 0:  # -1: held, pid not known yet (never signal -1!)
            return pid
        time.sleep(0.05)
    return None


def wake(paths: ServicePaths) -> bool:
    """Ask the running service for a round now; False if none runs here (one on
    another host takes new jobs at its next round: it cannot be signalled from here)."""
    pid = running_pid(paths)
    if pid is None or pid <= 0 or elsewhere(paths) is not None:
        return False
    try:
        os.kill(pid, signal.SIGUSR1)
    except ProcessLookupError:
        return False
    return True


def stop(paths: ServicePaths, timeout_s: float = 30.0) -> int | None:
    """SIGTERM the running service and wait until its lock is free. Returns its pid.

    Raises ServiceElsewhere, signalling nothing, if it runs on another host."""
    pid = running_pid(paths)
    if pid is None:
        return None
    host = elsewhere(paths)
    if host is not None:
        raise ServiceElsewhere(host, pid)
    if pid > 0:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while running_pid(paths) is not None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the packing service (pid {pid}) did not stop within {timeout_s:g} s")
        time.sleep(0.05)
    return pid


# ---------------------------------------------------------------- status file

def write_status(paths: ServicePaths, status: dict[str, Any]) -> None:
    """What `queue` and `serve status` show about the service (atomic replace)."""
    write_atomic(paths.status, json.dumps(status, sort_keys=True) + "\n")


def read_status(paths: ServicePaths) -> dict[str, Any]:
    """What the service last wrote, {} if nothing usable: a FIFO, a link, a file of
    another user's or one others may write is not read (a neighbour must not stall or
    forge `queue`/`serve status`; the folder checks cover the rest)."""
    try:
        fd = open_own_file(paths.status, "service status file")
    except FileNotFoundError:
        return {}
    except (OSError, DlrmError) as exc:
        log.warning("%s", exc)
        return {}
    try:
        raw = os.read(fd, MAX_STATUS_BYTES + 1)
    except OSError:
        return {}
    finally:
        os.close(fd)
    if len(raw) > MAX_STATUS_BYTES:
        log.warning("service status file %s is larger than %d bytes; not read", paths.status, MAX_STATUS_BYTES)
        return {}
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}
