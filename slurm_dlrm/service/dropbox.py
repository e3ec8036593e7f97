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

import hashlib
import json
import logging
import os
import secrets
import stat
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_dlrm.errors import DlrmError

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
KINDS = ("submit", "cancel", "requeue")
SUFFIX = ".req"
MAX_REQUEST_BYTES = 64 << 20  # a sweep of thousands of specs is a few MiB

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
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    body = {"version": FORMAT_VERSION, "kind": kind, "request_id": secrets.token_hex(16), "user": user,
            "uid": os.getuid(), "host": host, "created_t": time.time(), "payload": dict(payload)}
    safe_host = "".join(c if c.isalnum() or c in "-_" else "_" for c in host)[:40]
    name = f"{time.time_ns():020d}-{kind}-{safe_host}-{os.getpid()}-{secrets.token_hex(4)}{SUFFIX}"
    tmp = folder / f".{name}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, encode(body))
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.rename(tmp, folder / name)
    _fsync_dir(folder)
    return name


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- the service's side

class Refused(DlrmError):
    """A request file that is not applied (its reason is recorded as an event)."""


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
    try:
        body = json.loads(parts[0])
    except ValueError:
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
    return body


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
    what it did (recorded with the request); a `DlrmError` from it refuses the request
    (nothing of it stays: its savepoint is undone) and is recorded as the outcome."""
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
        except (Refused, OSError) as exc:
            _refuse(store, folder, name, None, str(exc))
            stats.refused += 1
            continue
        rid = body["request_id"]
        with store.write():
            done = store.conn.execute("SELECT file FROM requests WHERE request_id = ?", (rid,)).fetchone()
            if done is not None and done[0] == name:
                stats.leftovers += 1  # applied, then the service stopped before deleting the file
            elif done is not None:
                _refuse_in_tx(store, name, body, f"replayed: request {rid} was applied already (from {done[0]})")
                stats.refused += 1
            else:
                outcome, result = "applied", None
                try:
                    with store.savepoint("request"):
                        result = appliers[body["kind"]](store, body["payload"])
                except (DlrmError, KeyError, TypeError, ValueError) as exc:
                    # a malformed payload must not stop every later round: refused like bad input
                    exc_text = str(exc) if isinstance(exc, DlrmError) else f"malformed request ({exc!r})"
                    outcome = f"refused: {exc_text}"
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
        if done is not None and done[0] != name:
            _move_refused(folder, name)
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
    refused.mkdir(mode=0o700, exist_ok=True)
    try:
        os.rename(folder / name, refused / name)
    except FileNotFoundError:
        pass
