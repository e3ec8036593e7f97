"""Which processes belong to one local cluster instance, and stopping them safely.

Every daemon `up` starts carries a marker in its environment; `down` signals a pid
only if the process runs in our root and is ours: it carries the marker, or it is a
slurmstepd of our slurmd (from Slurm 23.x it no longer inherits the marker: its
working folder or an open log file is in the state folder), or a task of a job of
this cluster. Pid files can be stale and pids are reused, so nothing is ever picked
by name. Apart because this check is the one guard between `down` and an unrelated
process: it is read and tested on its own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# Set in the environment of every daemon we start: `down` signals a pid only if its
# /proc/PID/environ carries this marker with our state folder (pid files can be stale
# and pids are reused).
MARKER = "SLURM_DLRM_CLUSTER_INSTANCE"


@dataclass
class Daemon:
    """One process of the cluster: its name, pid file and whether it runs."""

    name: str
    pid_file: Path
    pid: int | None = None
    running: bool = False


def read_pid(pid_file: Path) -> int | None:
    try:
        return int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _same_root(pid: int) -> bool:
    """The process sees the same / as we do: not one of another chroot (a Slurm
    release root of scripts/slurm-matrix.sh) that happens to use the same state path."""
    try:
        theirs, ours = os.stat(f"/proc/{pid}/root"), os.stat("/")
    except OSError:
        return False
    return (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino)


def _inode(path: str | Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _stepd_is_ours(pid: int, state_dir: Path) -> bool:
    """A slurmstepd of one of our slurmd: its working folder or an open file (slurmd's
    log, which slurmstepd writes to) is in our state folder. Compared by inode, so a
    look-alike path in another root does not match. Needed from Slurm 23.x: slurmstepd
    no longer inherits slurmd's environment (24.11: no marker in its environ), and it
    is double-forked (parent pid 1), so neither environ nor parentage names it."""
    ours = {i for i in (_inode(state_dir), _inode(state_dir / "log"), _inode(state_dir / "spool")) if i}
    spool = state_dir / "spool"
    with contextlib.suppress(OSError):
        ours |= {i for i in (_inode(d) for d in spool.iterdir()) if i}
    if _inode(f"/proc/{pid}/cwd") in ours:
        return True
    log_files = set()
    with contextlib.suppress(OSError):
        log_files = {i for i in (_inode(f) for f in (state_dir / "log").iterdir()) if i}
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    return any(_inode(f"/proc/{pid}/fd/{fd}") in log_files for fd in fds)


def is_ours(pid: int, state_dir: Path) -> bool:
    """The process exists, is not a zombie, runs in our root, and is ours: a daemon
    carrying our marker, a slurmstepd of our slurmd (see `_stepd_is_ours`), or a task
    of a job of this cluster (slurmstepd gives every task SLURM_CONF and SLURM_JOB_ID,
    even with --export=NONE)."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes()
        st = Path(f"/proc/{pid}/stat").read_text()
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return False
    if st.rsplit(")", 1)[-1].split()[0] == "Z" or not _same_root(pid):
        return False
    entries = env.split(b"\0")
    if f"{MARKER}={state_dir}".encode() in entries:
        return True
    if comm == "slurmstepd":
        return _stepd_is_ours(pid, state_dir)
    conf = f"SLURM_CONF={state_dir / 'etc' / 'slurm.conf'}".encode()
    return conf in entries and any(e.startswith(b"SLURM_JOB_ID=") for e in entries)


def ours_by_environ(state_dir: Path) -> Iterator[int]:
    """Every live process carrying our marker (daemons and the slurmstepd they spawn)."""
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != me and is_ours(int(entry.name), state_dir):
            yield int(entry.name)



def terminate(pid: int, state_dir: Path, timeout_s: float) -> None:
    if not is_ours(pid, state_dir):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not is_ours(pid, state_dir):
            return
        time.sleep(0.1)
    log.warning("pid %d did not stop after SIGTERM within %g s; sending SIGKILL", pid, timeout_s)
    with contextlib.suppress(ProcessLookupError):
        if is_ours(pid, state_dir):
            os.kill(pid, signal.SIGKILL)


def stop_fake_mps_daemons(state_dir: Path) -> list[str]:
    """The fake MPS control daemons the rendered prolog started and no epilog stopped
    (slurmd gone first): `quit` through their pipe, then SIGKILL the pid their pid
    file names, only if that process runs the fake in our root."""
    from slurm_dlrm.emulated.mps_control import LAUNCHER_MODULES

    fake = state_dir / "admin" / "bin" / "nvidia-cuda-mps-control"
    stopped = []
    for pid_file in sorted((state_dir / "mps").glob("gpu*/pipe/nvidia-cuda-mps-control.pid")):
        pid = read_pid(pid_file)
        if pid is None or pid <= 1:
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if not any(m.encode() in cmdline for m in LAUNCHER_MODULES) or not _same_root(pid):
            continue
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run([str(fake)], input="quit\n", text=True, timeout=10, capture_output=True,  # noqa: S603
                           env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pid_file.parent)})
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
            time.sleep(0.1)
        if Path(f"/proc/{pid}").exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        stopped.append(f"fake MPS daemon {pid_file.parent.parent.name}")
    return stopped
