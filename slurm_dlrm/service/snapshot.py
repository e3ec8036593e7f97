"""A read-only copy of the store for the other hosts: `<store_dir>/store.snapshot.sqlite`.

`queue`, `show`, `log`, `acct` and `report` on a login node without the lease never
open the live database another host writes. The service publishes this copy after
each round in which the store changed: SQLite's online backup into a temporary file in
the same folder, the copy switched to the rollback journal (so it needs no `-wal` or
`-shm` beside it), fsync, then rename over the last one. A reader opens whichever copy
the name points at, with `immutable=1` (no locks, which a network filesystem may not
share between hosts anyway), and sees one consistent moment of the store. A large store
is copied less often than every round (at most 5% of the service's time goes to copies).
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SNAPSHOT_FILE = "store.snapshot.sqlite"


def snapshot_path(store_dir: Path) -> Path:
    return store_dir / SNAPSHOT_FILE


# A copy costs about as long as reading the whole store (a 100 MB store of a busy user,
# on NFS, takes seconds): spend at most this share of the service's time on copies.
COPY_TIME_SHARE = 0.05


class SnapshotPublisher:
    """Publishes when the store changed since the last copy (its own commits, or those of
    commands on this host: SQLite's data_version counts the latter), but not sooner after
    the last copy than `COPY_TIME_SHARE` allows (a small store: every round)."""

    def __init__(self, store_dir: Path, clock: Callable[[], float] = time.monotonic) -> None:
        self.store_dir = store_dir
        self.clock = clock
        self._published: tuple[int, int] | None = None
        self._last_t = -float("inf")
        self._last_s = 0.0

    def publish_if_changed(self, store: Any) -> bool:
        version = (store.conn.total_changes, int(store.conn.execute("PRAGMA data_version").fetchone()[0]))
        exists = snapshot_path(self.store_dir).exists()
        if version == self._published and exists:
            return False
        now = self.clock()
        if exists and now - self._last_t < self._last_s / COPY_TIME_SHARE:
            return False  # changed, copied at a later round
        publish(store, self.store_dir)
        self._last_t, self._last_s = now, self.clock() - now
        self._published = version
        return True


def publish(store: Any, store_dir: Path) -> Path:
    dst = snapshot_path(store_dir)
    tmp = store_dir / f".{SNAPSHOT_FILE}.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)  # private before SQLite writes
    os.close(fd)
    try:
        copy = sqlite3.connect(str(tmp), isolation_level=None)
        try:
            store.conn.backup(copy)
            copy.execute("PRAGMA journal_mode = DELETE")  # a WAL store's copy would say WAL in its header
        finally:
            copy.close()
        fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return dst
