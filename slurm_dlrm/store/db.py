"""Opening the SQLite file: private folder and file modes, pragmas, write transactions.

Concurrency model: every connection runs in autocommit mode (`isolation_level=None`)
and writes only inside `Store.write()`, which starts with `BEGIN IMMEDIATE` (the write
lock is taken up front, so a transaction never has to upgrade a read lock and deadlock)
and retries with jittered exponential backoff on top of SQLite's busy timeout. In WAL
mode readers never block writers and vice versa; only writers queue.
"""

from __future__ import annotations

import errno
import logging
import os
import pwd
import random
import sqlite3
import stat
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from slurm_dlrm.store.errors import StoreBusy, StoreError, StoreNotOwned, StoreWalOnNetwork
from slurm_dlrm.store.fstype import FsInfo, filesystem_of

log = logging.getLogger(__name__)

T = TypeVar("T")

DB_FILENAME = "store.sqlite"
DIR_MODE = 0o700
FILE_MODE = 0o600


def is_busy(exc: BaseException) -> bool:
    """SQLITE_BUSY / SQLITE_LOCKED as Python's sqlite3 reports them (3.11: by message)."""
    if not isinstance(exc, sqlite3.OperationalError):
        return False
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return (code & 0xFF) in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
    msg = str(exc)
    return "locked" in msg or "busy" in msg


def _owner_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def refuse_foreign(path: Path, st: os.stat_result, what: str) -> None:
    """StoreNotOwned unless we own `path`: under a shared parent (``/shared/{user}``) a
    folder or file someone else made first would let them read and replace our data."""
    me = os.geteuid()
    if st.st_uid != me:
        raise StoreNotOwned(f"{what} {path} belongs to {_owner_name(st.st_uid)}, not to you "
                            f"({_owner_name(me)}); remove it or set another store_dir")


def check_own_dir(path: Path, what: str = "store folder", *, group_may_write: bool = False) -> bool:
    """The other hosts' check of a store folder they only read, or drop a file into
    (docs/service.md "Several login nodes"): False if it does not exist; StoreNotOwned
    if someone else owns it, StoreError if others may write in it (they could replace
    the lease or the copy). Nothing is created or changed.

    `group_may_write`: for a reader that checks the file it reads through its own
    descriptor (the lease file): a folder made with umask 002 before any service
    tightened it is not refused (the read-write path tightens it, ensure_private_dir)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(st.st_mode):
        raise StoreError(f"{what} {path} is not a folder")
    refuse_foreign(path, st, what)
    mode = stat.S_IMODE(st.st_mode)
    if mode & (stat.S_ISVTX | stat.S_IWOTH | (0 if group_may_write else stat.S_IWGRP)):
        raise StoreError(f"{what} {path} can be written by others (mode {mode:o}), who could replace the files "
                         f"in it; make it yours alone (chmod 700 {path})")
    return True


def open_own_file(path: Path, what: str) -> int:
    """A read-only descriptor of `path`: a regular file (not a link, a FIFO or a device)
    of ours that nobody else may write, as `check_own_dir` for the files in the folder.
    FileNotFoundError if there is none."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StoreError(f"{what} {path} is a symbolic link; not read") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise StoreError(f"{what} {path} is not a regular file; not read")
        refuse_foreign(path, st, what)
        if st.st_mode & 0o022:
            raise StoreError(f"{what} {path} can be written by others (mode {stat.S_IMODE(st.st_mode):o}); not read")
    except BaseException:
        os.close(fd)
        raise
    return fd


def ensure_private_dir(path: Path) -> None:
    """Create `path` as 0700 (tightened if it is open to others); refuse one we do not own."""
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    st = path.stat()
    mode = stat.S_IMODE(st.st_mode)
    if mode & (stat.S_ISVTX | stat.S_IWOTH):
        # A shared folder such as /tmp: tightening it would break every other user of it.
        raise StoreError(f"store folder {path} is shared (mode {mode:o}); give the store a folder of its own")
    refuse_foreign(path, st, "store folder")
    if mode != DIR_MODE:
        log.warning("store folder %s had mode %o; setting 0700", path, stat.S_IMODE(st.st_mode))
        os.chmod(path, DIR_MODE)


def ensure_private_file(path: Path) -> None:
    """Create the database file 0600 before SQLite does (SQLite would use the umask).

    SQLite gives the -wal and -shm files the mode of the database file, so they stay
    private too.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
    try:
        st = os.fstat(fd)
        refuse_foreign(path, st, "store file")
        if stat.S_IMODE(st.st_mode) != FILE_MODE:
            os.fchmod(fd, FILE_MODE)
    finally:
        os.close(fd)
    # a -wal or -shm file left by someone else would be opened as it is, and written to
    for suffix in ("-wal", "-shm"):
        try:
            side = os.lstat(f"{path}{suffix}")
        except FileNotFoundError:
            continue
        refuse_foreign(Path(f"{path}{suffix}"), side, "store file")


def connect(path: Path, *, readonly: bool, busy_timeout_s: float, filesystem: str = "auto",
            immutable: bool = False) -> sqlite3.Connection:
    """Open the store. Read-write: WAL on a local folder, the rollback journal on a
    network filesystem (`fstype.py`; `filesystem` is the site's `[store] filesystem`).

    `immutable`: a read-only copy nobody writes (the snapshot the service publishes for
    other hosts): SQLite then takes no locks at all, which a network filesystem may not
    honour between hosts anyway."""
    if readonly:
        if not path.is_file():
            raise StoreError(f"no store at {path}")
        uri = "file:" + urllib.parse.quote(str(path)) + ("?immutable=1" if immutable else "?mode=ro")
        # Any thread may use it: the exporter keeps its read-only connections open between
        # scrapes, and its HTTP server answers each scrape on a new thread (its collector's
        # lock keeps the uses apart).
        conn = sqlite3.connect(uri, uri=True, isolation_level=None, timeout=busy_timeout_s,
                               check_same_thread=False)
    else:
        ensure_private_dir(path.parent)
        fs = filesystem_of(path.parent, filesystem)
        ensure_private_file(path)
        conn = sqlite3.connect(str(path), isolation_level=None, timeout=busy_timeout_s)
    conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
    conn.execute("PRAGMA foreign_keys = ON")
    if readonly:
        # read-only: maybe another user's file; its views, triggers and indexes may call
        # only innocuous functions (SQLite 3.31+; store/guard.py checks the rest)
        conn.execute("PRAGMA trusted_schema = OFF")
    if not readonly:
        try:
            set_journal_mode(conn, path, fs)
            conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
        except BaseException:
            conn.close()
            raise
    return conn


def set_journal_mode(conn: sqlite3.Connection, path: Path, fs: FsInfo) -> None:
    mode = str(conn.execute("PRAGMA journal_mode").fetchone()[0]).lower()
    if not fs.network:
        if mode != "wal":
            # Persistent once set; needs the write lock, so retry like a write.
            retry_busy(lambda: conn.execute("PRAGMA journal_mode = WAL").fetchone(), 60.0)
        # WAL + NORMAL: a commit survives a process crash; a power cut may lose the
        # last commits but never corrupts, and offsets roll back with their samples.
        conn.execute("PRAGMA synchronous = NORMAL")
        return
    if mode == "wal":
        # A store made before this check (or on a folder that moved to a network mount).
        # Only the writer's host gets here (the service's, or no service anywhere): copy
        # the log into the database, then leave WAL. Both need every other connection
        # gone; if one is open, nothing changes and the user is told what to do.
        try:
            conn.execute("PRAGMA busy_timeout = 2000")
            busy, _, _ = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            new = str(conn.execute("PRAGMA journal_mode = DELETE").fetchone()[0]).lower() if not busy else "wal"
        except sqlite3.OperationalError as exc:
            if not is_busy(exc):
                raise
            new = "wal"
        if new != "delete":
            raise StoreWalOnNetwork(
                f"store {path} is in WAL mode on a network filesystem ({fs.name}), where WAL can tear it, and "
                f"another process still has it open, so it was left as it is (nothing changed, nothing lost); stop "
                f"the packing service (`slurm-dlrm serve status` names its host; `slurm-dlrm serve stop` there) "
                f"and every slurm-dlrm command using this store on every host, then run `slurm-dlrm queue` once on "
                f"one host: it switches the store to the rollback journal")
        log.warning("store %s: on a network filesystem (%s): switched from WAL to the rollback journal", path,
                    fs.name)
    elif mode != "delete":
        retry_busy(lambda: conn.execute("PRAGMA journal_mode = DELETE").fetchone(), 60.0)
    # The rollback journal: FULL syncs the journal before the database is written, so a
    # crash or power cut rolls back to the last commit.
    conn.execute("PRAGMA synchronous = FULL")


def retry_busy(fn: Callable[[], T], deadline_s: float) -> T:
    """Call `fn` until it does not fail with SQLITE_BUSY, backing off up to `deadline_s`."""
    deadline = time.monotonic() + deadline_s
    delay = 0.002
    while True:
        try:
            return fn()
        except sqlite3.OperationalError as exc:
            if not is_busy(exc):
                raise
            if time.monotonic() > deadline:
                raise StoreBusy(f"store still locked after {deadline_s:g} s: {exc}") from exc
            time.sleep(delay * random.uniform(0.5, 1.5))
            delay = min(delay * 2, 0.25)
