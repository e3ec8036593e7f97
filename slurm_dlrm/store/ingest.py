"""Exactly-once ingestion of agent report files (docs/interfaces.md, section 4).

An agent appends JSON lines to ``<pack_dir>/reports/<node>.jsonl``. We read from the
byte offset stored in `ingest_offsets`, consume only complete lines (a partial last
line waits for the next call), and in ONE transaction per chunk: insert the samples,
hand every other record to `on_record` (which may change job/pack state through the
same store), and advance the offset. A crash at any point rolls all three back
together, so a line is applied exactly once.

`on_record(store, record)` runs inside the write transaction. If it raises a
`StoreError` (an illegal or stale transition, an unknown id), only that record's
changes are undone (a savepoint), the rejection is logged as an `ingest` event and
ingestion goes on: one late or duplicate report must not block the file forever.
Any other exception rolls back the whole chunk and propagates; the offset does not
move, so the chunk is read again next time.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slurm_dlrm.store.errors import StoreError

if TYPE_CHECKING:
    from slurm_dlrm.store.store import Store

log = logging.getLogger(__name__)

OnRecord = Callable[["Store", dict[str, Any]], None]

CHUNK_BYTES = 1 << 20  # per transaction: ~5,000 sample lines, a few tens of ms of lock
MAX_LINE_BYTES = 16 << 20  # a line longer than this is garbage: skipped


@dataclass
class IngestResult:
    lines: int = 0
    samples: int = 0
    records: int = 0
    rejected: int = 0
    bad_lines: int = 0
    offset_bytes: int = 0


def record_as_event(store: Store, record: dict[str, Any]) -> None:
    """A default `on_record`: keep member/agent records as audit events, drop heartbeats."""
    kind = record.get("type")
    if kind == "heartbeat":
        return
    reason = str(record.get("state") or record.get("event") or kind)
    store.event_in_tx(
        "agent", reason, job_id=record.get("job_id"), pack_id=record.get("pack_id"),
        data=record, t=float(record.get("t") or store.clock()),
    )


def ingest_spool_file(
    store: Store, path: str | os.PathLike[str], on_record: OnRecord | None = None, *,
    chunk_bytes: int = CHUNK_BYTES, max_chunks: int | None = None,
) -> IngestResult:
    """Read what is new in `path` since the last call; see the module docstring.

    `max_chunks` bounds the work of one call (None: until the end of the file).
    """
    # One key per file however it is named (symlinked spool folders): no double reads.
    key = os.path.realpath(path)
    result = IngestResult()
    chunks = 0
    while max_chunks is None or chunks < max_chunks:
        chunks += 1
        try:
            st = os.stat(key)
        except FileNotFoundError:
            return result
        # Read the file before taking the write lock (the spool may sit on NFS); the
        # offset is checked again under the lock and the read redone if it moved.
        planned, _ = stored_offset(store, key, st)
        result.offset_bytes = planned
        if st.st_size <= planned:
            return result
        data, end = read_complete(key, planned, chunk_bytes)
        if end == 0:
            return result  # only a partial line so far
        with store.write():
            offset, old = stored_offset(store, key, st)
            if offset != planned:
                continue  # another ingester moved it meanwhile
            if old is not None:
                # The file was replaced or truncated: what is there now is new.
                store.event_in_tx("ingest", "report file replaced; reading from the start",
                                  data={"path": key, "old_offset": old})
            bad_before = result.bad_lines
            _apply_lines(store, data[:end], on_record, result)
            result.offset_bytes = offset + end
            store.conn.execute(
                "INSERT INTO ingest_offsets (path, inode, offset_bytes, lines, bad_lines, updated_time) "
                "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT(path) DO UPDATE SET inode = excluded.inode, "
                "offset_bytes = excluded.offset_bytes, lines = lines + excluded.lines, "
                "bad_lines = bad_lines + excluded.bad_lines, updated_time = excluded.updated_time",
                (key, st.st_ino, offset + end, data[:end].count(b"\n"), result.bad_lines - bad_before,
                 store.clock()),
            )
        if offset + end >= st.st_size:
            return result
    return result


def stored_offset(store: Store, key: str, st: os.stat_result) -> tuple[int, int | None]:
    """Where to read from, and the old offset if the file was replaced or truncated."""
    row = store.conn.execute("SELECT inode, offset_bytes FROM ingest_offsets WHERE path = ?", (key,)).fetchone()
    if row is None:
        return 0, None
    inode, offset = row
    if inode != st.st_ino or st.st_size < offset:
        return 0, int(offset)
    return int(offset), None


def read_complete(path: str, offset: int, chunk_bytes: int) -> tuple[bytes, int]:
    """Bytes from `offset` and the length up to and including the last newline.

    A line longer than the chunk grows the read; one longer than MAX_LINE_BYTES is
    returned whole (up to its newline) and rejected as a bad line by the parser.
    """
    size = chunk_bytes
    with open(path, "rb") as f:
        while True:
            f.seek(offset)
            data = f.read(size)
            end = data.rfind(b"\n") + 1
            if end or len(data) < size:
                return data, end
            if size >= MAX_LINE_BYTES:
                rest = f.readline()  # skip to the end of the monster line
                if not rest.endswith(b"\n"):
                    return data, 0
                return data + rest, len(data) + len(rest)
            size *= 4


def _parse(lines: list[bytes]) -> list[Any]:
    """Decode JSON lines; `_BAD` for a line that is not JSON.

    One `json.loads` over the whole chunk as an array is ~3x faster than one call per
    line; only a chunk with a bad line pays for the per-line fallback.
    """
    text = b",".join(lines).decode("utf-8", errors="replace")
    try:
        recs = json.loads("[" + text + "]")
        if len(recs) == len(lines):
            return list(recs)
    except ValueError:
        pass
    out: list[Any] = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            out.append(_after_torn_prefix(line))
    return out


def _after_torn_prefix(line: bytes) -> Any:
    """The record at the end of a line that starts with a torn one (a writer that died
    mid-line, then the agent's next batch appended after it: issue 49, chaos_live), or
    `_BAD`. Every record the agent writes starts with its "type" key (agent/reports.py)."""
    for marker in (b'{"type":', b'{"type": '):
        at = line.rfind(marker)
        if at > 0:
            try:
                rec = json.loads(line[at:])
            except ValueError:
                continue
            if isinstance(rec, dict):
                return rec
    return _BAD


_BAD = object()


def _apply_lines(store: Store, blob: bytes, on_record: OnRecord | None, result: IngestResult) -> None:
    samples: list[dict[str, Any]] = []
    raw = blob.split(b"\n")[:-1]
    result.lines += len(raw)
    lines = [line for line in raw if line.strip()]
    for n, (line, rec) in enumerate(zip(lines, _parse(lines), strict=True)):
        kind = rec.get("type") if isinstance(rec, dict) else None
        if not isinstance(kind, str) or len(line) > MAX_LINE_BYTES:
            result.bad_lines += 1
            if result.bad_lines <= 3:
                log.warning("skipping a line that is not a report record (line %d of this chunk): %.80r", n, line)
            continue
        if kind == "sample":
            samples.append(rec)
            continue
        # Records see every sample written before them.
        if samples:
            result.samples += store.insert_samples_in_tx(samples)
            samples = []
        result.records += 1
        if on_record is None:
            continue
        try:
            with store.savepoint("ingest_record"):
                on_record(store, rec)
        except StoreError as exc:
            result.rejected += 1
            log.warning("report record rejected: %s", exc)
            store.event_in_tx("ingest", f"record rejected: {exc}",
                         pack_id=None, data={"record": rec})
    if samples:
        result.samples += store.insert_samples_in_tx(samples)


def ingest_pack_reports(store: Store, pack_dir: str | os.PathLike[str],
                        on_record: OnRecord | None = None) -> IngestResult:
    """Ingest every ``<pack_dir>/reports/*.jsonl``; totals over the files."""
    total = IngestResult()
    for f in sorted(Path(pack_dir).glob("reports/*.jsonl")):
        r = ingest_spool_file(store, f, on_record)
        for field in ("lines", "samples", "records", "rejected", "bad_lines"):
            setattr(total, field, getattr(total, field) + getattr(r, field))
    return total
