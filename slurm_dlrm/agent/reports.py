"""Agent reports (docs/interfaces.md section 4): JSON lines appended in batches.

Each batch is one write of complete lines, then flush and fsync, so a reader that only
consumes complete lines never sees half a record and nothing flushed is lost on a crash.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MEMBER_STATES = ("RUNNING", "COMPLETED", "FAILED", "OOM_GPU", "OOM_HOST", "PREEMPTED", "CANCELLED")
AGENT_EVENTS = ("start", "mps_started", "mps_unavailable", "mps_stopped", "exit")


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
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._file = os.fdopen(fd, "ab")
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

    def heartbeat(self) -> None:
        self._add({"type": "heartbeat", "t": self.clock(), "pack_id": self.pack_id, "node": self.node})

    def agent(self, event: str, detail: str = "", **extra: Any) -> None:
        assert event in AGENT_EVENTS, event
        self._add({"type": "agent", "t": self.clock(), "pack_id": self.pack_id, "node": self.node,
                   "event": event, "detail": detail, **extra})

    @property
    def pending(self) -> int:
        return len(self._buffer)

    def flush(self) -> None:
        """Write the batch as one append, then flush and fsync."""
        if not self._buffer:
            return
        data = b"".join(json.dumps(r, separators=(",", ":")).encode() + b"\n" for r in self._buffer)
        self._file.write(data)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._buffer.clear()
        self.batches += 1

    def close(self) -> None:
        self.flush()
        self._file.close()


def read_reports(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Complete lines only (a line without its newline is still being written)."""
    data = Path(path).read_bytes()
    lines = data.split(b"\n")[:-1]
    return [json.loads(line) for line in lines if line.strip()]
