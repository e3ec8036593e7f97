"""Agent reports (docs/interfaces.md section 4): JSON lines appended in batches.

Each batch is one write of complete lines, then flush and fsync, so a reader that only
consumes complete lines never sees half a record and nothing flushed is lost on a crash.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MEMBER_STATES = ("RUNNING", "COMPLETED", "FAILED", "OOM_GPU", "OOM_HOST", "PREEMPTED", "CANCELLED", "TIMEOUT")
AGENT_EVENTS = ("start", "mps_started", "mps_unavailable", "mps_stopped", "join_refused", "closed", "exit",
                "fence_env_only", "fence_fallback", "dmem_not_applied")


def report_path(pack_dir: str | os.PathLike[str], node: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", node) or "node"
    return Path(pack_dir) / "reports" / f"{safe}.jsonl"


class ReportWriter:
    def __init__(self, pack_dir: str | os.PathLike[str], node: str, pack_id: int,
                 clock: Callable[[], float] = time.time) -> None:
        self.path = report_path(pack_dir, node)
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path.parent.chmod(0o700)
        self.node = node
        self.pack_id = pack_id
        self.clock = clock
        self._buffer: list[dict[str, Any]] = []
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self.batches = 0

    def _add(self, record: dict[str, Any]) -> None:
        self._buffer.append(record)

    def sample(self, job_id: int | None, gpu_index: int | None, **fields: Any) -> None:
        rec = {"type": "sample", "t": self.clock(), "pack_id": self.pack_id, "job_id": job_id,
               "node": self.node, "gpu_index": gpu_index}
        for key in ("sm_util_pct", "mem_util_pct", "gpu_mem_bytes", "host_cpu_pct", "rss_bytes", "samples_per_s"):
            rec[key] = fields.pop(key, None)
        rec.update(fields)
        self._add(rec)

    def member(self, job_id: int, state: str, exit_code: int | None = None, reason: str = "", **extra: Any) -> None:
        assert state in MEMBER_STATES, state
        self._add({"type": "member", "t": self.clock(), "pack_id": self.pack_id, "job_id": job_id,
                   "node": self.node, "state": state, "exit_code": exit_code, "reason": reason, **extra})

    def rank(self, job_id: int, rank: int, world_size: int, state: str, exit_code: int | None = None,
             reason: str = "", **extra: Any) -> None:
        """How one rank of a multi-rank job ended; the job's own end is one `member` record
        written when all its ranks have ended (docs/agent.md "Multi-rank jobs")."""
        assert state in MEMBER_STATES, state
        self._add({"type": "rank", "t": self.clock(), "pack_id": self.pack_id, "job_id": job_id, "node": self.node,
                   "rank": rank, "world_size": world_size, "state": state, "exit_code": exit_code,
                   "reason": reason, **extra})

    def heartbeat(self) -> None:
        self._add({"type": "heartbeat", "t": self.clock(), "pack_id": self.pack_id, "node": self.node})

    def agent(self, event: str, detail: str = "", **extra: Any) -> None:
        assert event in AGENT_EVENTS, event
        self._add({"type": "agent", "t": self.clock(), "pack_id": self.pack_id, "node": self.node,
                   "event": event, "detail": detail, **extra})

    @property
    def pending(self) -> int:
        return len(self._buffer)

    def flush(self) -> bool:
        """Write the batch as one append, then flush and fsync; False (batch kept) on an I/O error."""
        if not self._buffer:
            return True
        data = b"".join(json.dumps(r, separators=(",", ":")).encode() + b"\n" for r in self._buffer)
        try:
            # One os.write of whole lines: a reader never sees part of this batch's last line
            # unless the disk fills mid-write, and then the next batch starts on a new line.
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
            os.fsync(self._fd)
        except OSError as exc:
            log.error("cannot write reports to %s (kept %d records for the next batch): %s",
                      self.path, len(self._buffer), exc)
            with contextlib.suppress(OSError):
                os.write(self._fd, b"\n")  # end a torn line, so the next batch starts clean
            return False
        self._buffer.clear()
        self.batches += 1
        return True

    def close(self) -> None:
        for attempt in range(3):
            if self.flush():
                break
            time.sleep(1.0 + attempt)
        os.close(self._fd)


def read_reports(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Complete lines only (a line without its newline is still being written)."""
    data = Path(path).read_bytes()
    out = []
    for line in data.split(b"\n")[:-1]:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line torn by a failed write (disk full) and then ended
    return out
