"""Requests from hosts that do not hold the store: a drop folder the service ingests.

Only the lease holder's host writes the store (service/hosts.py). On any other login
node `submit`, `cancel` and `requeue` write a request file into
`<store_dir>/requests/`, and the service applies it at its next round, as it ingests the
agents' report files:

- Written whole or not at all: a temporary name in the same folder, fsync, then rename
  (atomic within one folder on NFS, Lustre, GPFS, BeeGFS, CephFS), then the folder is
  fsync'ed. Names are unique (time, host, pid, random), so two hosts never collide.
- The file is one JSON line and a `sha256 <hex>` line over it: a truncated or altered
  file is refused, never half-read.
- Once only: each request carries a random `request_id`; the service applies it and
  records the id (table `requests`) in one transaction, then deletes the file. A crash
  before the commit applies it again from scratch at the next round; a crash after it
  finds the id recorded for this very file and only deletes the file. The same id under
  another file name (a copy, a replay) is refused.
- Only the user's own: the file must be a regular file owned by the service's uid, and
  name that uid and user inside. Anything else is refused.

Every refusal is an event row (`kind = "request"`, recorded once per file) and the file
moves to `requests/refused/` for the user to look at; nothing of it is applied.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import secrets
import stat
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_dlrm.errors import BadInput, DlrmError

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
KINDS = ("submit", "cancel", "requeue")
SUFFIX = ".req"
MAX_REQUEST_BYTES = 64 << 20  # a sweep of thousands of specs is a few MiB
# Counted in the bytes before json.loads builds anything (issue 41 item 5): 64 MiB of
# `[{},{},...]` decodes to 1.8 GB of dicts. A job row is about 200 tokens (a spec with many
# tables a few thousand); the worst case under these caps decodes in well under 1 GiB (the
# service job's --mem): docs/admin.md, "Threat model".
MAX_REQUEST_ROWS = 10_000
MAX_REQUEST_TOKENS = 2_000_000  # `,` `:` `{` `[` outside strings: about one Python object each
MAX_REQUEST_DEPTH = 32  # a job row nests 6 deep; json.loads recurses once per level

REQUESTS_TABLE = """CREATE TABLE IF NOT EXISTS requests (
    request_id TEXT PRIMARY KEY,
    file TEXT NOT NULL,
    kind TEXT NOT NULL,
    host TEXT NOT NULL,
    outcome TEXT NOT NULL,
    ingested_t REAL NOT NULL,
    result_json TEXT
)"""


def requests_dir(store_dir: Path) -> Path:
    return store_dir / "requests"


# ---------------------------------------------------------------- the writing side

def encode(body: Mapping[str, Any]) -> bytes:
    line = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return line + b"\nsha256 " + hashlib.sha256(line).hexdigest().encode() + b"\n"


def write_request(store_dir: Path, kind: str, payload: Mapping[str, Any], *, user: str, host: str) -> str:
    """Drop one request; returns its file name (what the user is shown)."""
    if kind not in KINDS:
        raise ValueError(kind)
    folder = requests_dir(store_dir)
    _own_drop_folder(store_dir, folder)
    body = {"version": FORMAT_VERSION, "kind": kind, "request_id": secrets.token_hex(16), "user": user,
            "uid": os.getuid(), "host": host, "created_t": time.time(), "payload": dict(payload)}
    raw = encode(body)
    try:  # what the service would refuse is refused here, before the user is told it was handed over
        if len(raw) > MAX_REQUEST_BYTES:
            raise Refused(f"too large ({len(raw)} bytes; at most {MAX_REQUEST_BYTES})")
        decode(raw, user=user, uid=os.getuid())
    except Refused as exc:
        raise BadInput(f"{kind} request: {exc}; split it into several") from None
    safe_host = "".join(c if c.isalnum() or c in "-_" else "_" for c in host)[:40]
    name = f"{time.time_ns():020d}-{kind}-{safe_host}-{os.getpid()}-{secrets.token_hex(4)}{SUFFIX}"
    tmp = folder / f".{name}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            if os.write(fd, raw) != len(raw):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        # issue 49 (chaos_live, the store's file system full): a traceback, now one line
        from slurm_dlrm.store.errors import StoreFull

        raise StoreFull(f"{kind} request: {folder}: its file system is full; nothing was handed over "
                        "(try again once there is room)") from None
    os.rename(tmp, folder / name)
    _fsync_dir(folder)
    return name


def _own_drop_folder(store_dir: Path, folder: Path) -> None:
    """The store folder and its requests/ ours alone, as the service's own host checks
    its store folder (db.ensure_private_dir): a request dropped in a folder someone else
    made first would go to them, and the user be told it was handed to a service."""
    from slurm_dlrm.store.db import ensure_private_dir, refuse_foreign

    ensure_private_dir(store_dir)
    folder.mkdir(mode=0o700, exist_ok=True)
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode):
        raise Refused(f"{folder} is not a folder (a link?); not written")
    refuse_foreign(folder, st, "request folder")
    if st.st_mode & 0o022:
        raise Refused(f"request folder {folder} can be written by others (mode {stat.S_IMODE(st.st_mode):o}); "
                      f"make it yours alone (chmod 700 {folder})")


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- the service's side

class Refused(DlrmError):
    """A request file that is not applied (its reason is recorded as an event)."""


def fatal_to_round(exc: BaseException) -> bool:
    """A fault of the store or of the service's lease, not of the request being applied."""
    from slurm_dlrm.store.db import is_busy
    from slurm_dlrm.store.errors import LeaseLost, StoreBusy

    return isinstance(exc, LeaseLost | StoreBusy) or is_busy(exc)


@dataclass
class IngestStats:
    applied: int = 0
    refused: int = 0
    leftovers: int = 0  # files of requests already applied (a crash after the commit)
    results: list[dict[str, Any]] = field(default_factory=list)


Applier = Callable[[Any, dict[str, Any]], dict[str, Any]]


def decode(raw: bytes, *, user: str, uid: int) -> dict[str, Any]:
    """The request in a file's bytes, or Refused with why."""
    parts = raw.split(b"\n")
    if len(parts) != 3 or parts[2] != b"" or not parts[1].startswith(b"sha256 "):
        raise Refused("truncated or not a request file (no checksum line)")
    if hashlib.sha256(parts[0]).hexdigest().encode() != parts[1][len(b"sha256 "):]:
        raise Refused("truncated or altered (checksum does not match)")
    check_shape(parts[0])
    try:
        body = json.loads(parts[0])
    except (ValueError, RecursionError):
        raise Refused("not JSON") from None
    if not isinstance(body, dict) or body.get("version") != FORMAT_VERSION:
        raise Refused(f"unknown request format (version {body.get('version') if isinstance(body, dict) else '?'})")
    if body.get("kind") not in KINDS or not isinstance(body.get("payload"), dict):
        raise Refused(f"unknown request kind {body.get('kind')!r}")
    rid = body.get("request_id")
    if not isinstance(rid, str) or not rid or len(rid) > 64:
        raise Refused("no request id")
    if body.get("user") != user or body.get("uid") != uid:
        raise Refused(f"foreign: made for user {body.get('user')!r} (uid {body.get('uid')!r}), this store is "
                      f"{user}'s (uid {uid})")
    rows = body["payload"].get("rows")
    if isinstance(rows, list) and len(rows) > MAX_REQUEST_ROWS:
        raise Refused(f"too many jobs ({len(rows)}; at most {MAX_REQUEST_ROWS} in one request)")
    return body


# A JSON string (escapes included), unrolled so a long one is one fast scan.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_INNERMOST = re.compile(rb"\[\]|\{\}")
_NOT_BRACKET = re.compile(rb"[^\[\]{}]+")


def check_shape(line: bytes) -> None:
    """Refused unless the JSON in `line` has at most MAX_REQUEST_TOKENS containers and
    separators and nests at most MAX_REQUEST_DEPTH deep, judged on the bytes (C-speed
    scans, no object built): json.loads would otherwise take memory in proportion to
    the count, and recurse once per level."""
    bare = _JSON_STRING.sub(b'""', line)  # brackets and commas inside strings are text
    tokens = sum(bare.count(c) for c in (b",", b":", b"{", b"["))
    if tokens > MAX_REQUEST_TOKENS:
        raise Refused(f"too large: {tokens} values (at most {MAX_REQUEST_TOKENS} in one request)")
    brackets = _NOT_BRACKET.sub(b"", bare)
    for _ in range(MAX_REQUEST_DEPTH):  # each pass takes off one level of nesting
        if not brackets:
            return
        brackets = _INNERMOST.sub(b"", brackets)
    if brackets:
        raise Refused(f"nested deeper than {MAX_REQUEST_DEPTH} levels (or unbalanced brackets)")


def _read_own_file(path: Path, uid: int) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Refused("not a regular file")
        if st.st_uid != uid:
            raise Refused(f"foreign: the file belongs to uid {st.st_uid}, not {uid}")
        if st.st_size > MAX_REQUEST_BYTES:
            raise Refused(f"too large ({st.st_size} bytes)")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def ingest_requests(store: Any, store_dir: Path, user: str, appliers: Mapping[str, Applier], *,
                    uid: int | None = None, after_commit: Callable[[], None] | None = None) -> IngestStats:
    """Apply every request file in the drop folder once, oldest first.

    `appliers[kind](store, payload)` runs inside the request's transaction and returns
    what it did (recorded with the request); any error from it refuses the request
    (nothing of it stays: its savepoint is undone), is recorded as the outcome (one
    event) and moves the file to `refused/`, so the next request is applied as usual."""
    uid = os.getuid() if uid is None else uid
    folder = requests_dir(store_dir)
    stats = IngestStats()
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(SUFFIX) and not n.startswith("."))
    except FileNotFoundError:
        return stats
    with store.write():
        store.conn.execute(REQUESTS_TABLE)
    for name in names:
        path = folder / name
        try:
            raw = _read_own_file(path, uid)
            body = decode(raw, user=user, uid=uid)
        except FileNotFoundError:
            continue  # taken meanwhile (a second service on this host cannot run: the flock)
        except Exception as exc:  # noqa: BLE001 - whatever a file does, it is refused, never retried for ever
            why = str(exc) if isinstance(exc, Refused | OSError) else f"undecodable ({type(exc).__name__})"
            _refuse(store, folder, name, None, why)
            stats.refused += 1
            continue
        rid = body["request_id"]
        refused = False
        with store.write():
            done = store.conn.execute("SELECT file, outcome FROM requests WHERE request_id = ?", (rid,)).fetchone()
            if done is not None and done[0] == name:
                stats.leftovers += 1  # applied, then the service stopped before deleting the file
                refused = str(done[1]).startswith("refused")
            elif done is not None:
                _refuse_in_tx(store, name, body, f"replayed: request {rid} was applied already (from {done[0]})")
                stats.refused += 1
                refused = True
            else:
                outcome, result = "applied", None
                try:
                    with store.savepoint("request"):
                        result = appliers[body["kind"]](store, body["payload"])
                except Exception as exc:
                    # Any fault of this one request (another slurm-dlrm version's rows, a NULL
                    # name, a wrong shape) refuses it; the store's own (busy, the lease lost,
                    # the transaction gone) stops the round without blaming the request.
                    if fatal_to_round(exc) or not store.conn.in_transaction:
                        raise
                    exc_text = str(exc) if isinstance(exc, DlrmError) else f"malformed request ({exc!r:.300})"
                    outcome = f"refused: {exc_text}"
                    refused = True
                    store.event_in_tx("request", f"request {name} from host {body.get('host')} not applied: "
                                      f"{exc_text}",
                                      data={"request_id": rid, "kind": body["kind"]})
                    stats.refused += 1
                else:
                    stats.applied += 1
                    stats.results.append({"file": name, "kind": body["kind"], **(result or {})})
                store.conn.execute(
                    "INSERT INTO requests (request_id, file, kind, host, outcome, ingested_t, result_json) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (rid, name, body["kind"], str(body.get("host", "")), outcome, store.clock(),
                     None if result is None else json.dumps(result, sort_keys=True, default=str)))
        if refused:
            _move_refused(folder, name)  # for the user to look at
        else:
            path.unlink(missing_ok=True)
        if after_commit is not None:
            after_commit()
    if names:
        _fsync_dir(folder)
    return stats


def _refuse_in_tx(store: Any, name: str, body: dict[str, Any] | None, why: str) -> None:
    key = f"file:{name}"  # once per file: a refused file is recorded under its name
    if store.conn.execute("SELECT 1 FROM requests WHERE request_id = ?", (key,)).fetchone() is not None:
        return
    host = str(body.get("host", "")) if body else ""
    store.conn.execute(
        "INSERT INTO requests (request_id, file, kind, host, outcome, ingested_t, result_json) "
        "VALUES (?, ?, ?, ?, ?, ?, NULL)",
        (key, name, str(body.get("kind", "?")) if body else "?", host, f"refused: {why}", store.clock()))
    store.event_in_tx("request", f"request file {name} refused: {why}", data={"file": name})
    log.warning("request file %s refused: %s", name, why)


def _refuse(store: Any, folder: Path, name: str, body: dict[str, Any] | None, why: str) -> None:
    with store.write():
        _refuse_in_tx(store, name, body, why)
    _move_refused(folder, name)


def _move_refused(folder: Path, name: str) -> None:
    refused = folder / "refused"
    try:
        refused.mkdir(mode=0o700, exist_ok=True)
        os.rename(folder / name, refused / name)
    except FileNotFoundError:
        pass
    except OSError as exc:  # never left in the way of the next round's requests
        log.warning("request file %s: cannot move it to %s (%s); removing it", name, refused, exc)
        (folder / name).unlink(missing_ok=True)
