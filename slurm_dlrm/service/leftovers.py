"""Temporary files a killed writer leaves in the store folder, removed when the service
starts (issue 41 item 6).

Every file other hosts read is written under a temporary name in the same folder, then
renamed (snapshot.py, hosts.write_lease_file, daemon's status and pid files,
dropbox.write_request). A writer killed in between leaves the temporary behind: a
`.store.snapshot.sqlite.<pid>.tmp` is as large as the store. They are removed once the
service holds the lease, but never one a live writer may still be filling:

- `.<file>.<pid>.tmp` (the service's own files): the pid may be another host's, so only
  when the file has not changed for STALE_TMP_S and its pid is not alive here, or it
  has not changed for STALE_ANY_S (a live writer touches its file continuously).
- `requests/.<name>.req.tmp` (a command on a login node): its name holds the writer's
  host and pid; one of this host's whose pid is gone goes at once, another host's when
  it has not changed for STALE_TMP_S (a request is written in milliseconds).
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path

from slurm_dlrm.osutil import pid_alive
from slurm_dlrm.service.daemon import this_host

log = logging.getLogger(__name__)

STALE_TMP_S = 600.0
STALE_ANY_S = 86400.0

_OWN_TMP = re.compile(r"^\.(?P<file>.+)\.(?P<pid>\d+)\.tmp$")
# dropbox.write_request: .<time_ns>-<kind>-<host>-<pid>-<random>.req.tmp
_REQ_TMP = re.compile(r"^\.\d{20}-[a-z]+-(?P<host>[A-Za-z0-9_-]*)-(?P<pid>\d+)-[0-9a-f]+\.req\.tmp$")


def _safe_host(host: str) -> str:
    """The host as dropbox.write_request puts it in a file name."""
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in host)[:40]


def stale_temporaries(store_dir: Path, *, now_t: float | None = None) -> list[Path]:
    now = time.time() if now_t is None else now_t
    here = _safe_host(this_host())
    out: list[Path] = []
    for folder, pattern in ((store_dir, _OWN_TMP), (store_dir / "requests", _REQ_TMP)):
        try:
            names = os.listdir(folder)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for name in names:
            m = pattern.match(name)
            if m is None:
                continue
            path = folder / name
            try:
                age_s = now - path.lstat().st_mtime
            except FileNotFoundError:
                continue  # renamed meanwhile: it was a live writer's
            pid = int(m["pid"])
            if pattern is _REQ_TMP and m["host"] == here:
                stale = not pid_alive(pid)
            else:
                stale = age_s >= STALE_ANY_S or (age_s >= STALE_TMP_S and not pid_alive(pid))
            if stale:
                out.append(path)
    return out


def remove_stale_temporaries(store_dir: Path, *, now_t: float | None = None) -> int:
    """Remove what a killed writer left (see the module's docstring). Returns how many."""
    removed = 0
    for path in stale_temporaries(store_dir, now_t=now_t):
        try:
            size = path.lstat().st_size
            path.unlink()
        except FileNotFoundError:
            continue
        removed += 1
        log.info("removed %s (%d bytes), left by a writer that was stopped", path, size)
    return removed
