"""Two small operating-system helpers every side uses: replace a file atomically, and
tell whether a process is alive. One of each (issue 43 item 10: there were three
atomic writers and five pid checks, each a little different)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def write_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write `path` (0600) so that a reader sees the old content or the new, never a
    part: a temporary file beside it (private from creation, one per writer), fsynced,
    renamed over it (atomic within one folder, also on NFS). The temporary file is
    removed if anything fails."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs: it exists (kill(0); another user's process, which we
    may not signal, counts) and is not a zombie (a dead child not yet reaped still
    answers kill(0) and holds no lock). Without /proc, kill(0) decides."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc: trust kill(0)
    return stat.rpartition(")")[2].split()[0] != "Z"
