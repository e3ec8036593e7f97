"""Cheap per-member host measurements: process-tree CPU % and RSS, and the metrics-file tail.

Both run every sampling interval for every member, so they avoid whole-system scans:
the tree is walked through /proc/<pid>/task/<pid>/children (Linux >= 3.5) instead of
psutil's `children()`, which reads every process's stat file, and the metrics file is
read from where the last read stopped (never the whole file).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

log = logging.getLogger(__name__)

_HAVE_CHILDREN_FILE = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists()


def tree_pids(root: int) -> list[int]:
    """root and its descendants (children forked by the main thread of each process)."""
    if not _HAVE_CHILDREN_FILE:  # pragma: no cover - kernels without CONFIG_PROC_CHILDREN
        try:
            proc = psutil.Process(root)
            return [root] + [c.pid for c in proc.children(recursive=True)]
        except psutil.Error:
            return []
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                todo.extend(int(x) for x in f.read().split())
        except (OSError, ValueError):
            continue
    return out


@dataclass(frozen=True)
class TreeSample:
    pids: tuple[int, ...]
    cpu_pct: float | None  # of one core; None on the first sample of a tree
    rss_bytes: int


class TreeSampler:
    """CPU % between two calls and the RSS sum of a process tree."""

    def __init__(self) -> None:
        self._procs: dict[int, psutil.Process] = {}
        self._cpu_s: dict[int, float] = {}
        self._last_t: float | None = None

    def sample(self, root: int) -> TreeSample | None:
        now = time.monotonic()
        pids = tree_pids(root)
        rss = 0
        cpu_delta = 0.0
        alive: list[int] = []
        for pid in pids:
            proc = self._procs.get(pid)
            try:
                if proc is None:
                    proc = self._procs[pid] = psutil.Process(pid)
                with proc.oneshot():
                    if proc.status() == psutil.STATUS_ZOMBIE:
                        # Exited, not yet reaped: /proc reports no memory (RSS 0), and it
                        # is gone next round; counting it would report a bogus sample.
                        continue
                    t = proc.cpu_times()
                    mem = proc.memory_info()
            except psutil.Error:
                self._procs.pop(pid, None)
                continue
            if mem.rss == 0:
                continue  # exited between the status and the memory read: a live process has pages
            cpu = t.user + t.system
            prev = self._cpu_s.get(pid)
            if prev is not None:
                cpu_delta += max(0.0, cpu - prev)
            elif self._last_t is not None:
                cpu_delta += cpu  # born since the last sample: all its time is in this interval
            self._cpu_s[pid] = cpu
            rss += mem.rss
            alive.append(pid)
        if not alive:
            return None
        for gone in set(self._procs) - set(alive):
            self._procs.pop(gone, None)
            self._cpu_s.pop(gone, None)
        cpu_pct = None
        if self._last_t is not None and now > self._last_t:
            cpu_pct = 100.0 * cpu_delta / (now - self._last_t)
        self._last_t = now
        return TreeSample(tuple(alive), cpu_pct, rss)


class MetricsTail:
    """Follows a JSON-lines metrics file; `poll()` returns the newest complete record."""

    def __init__(self, path: str | os.PathLike[str], max_back_bytes: int = 64 * 1024) -> None:
        self.path = Path(path)
        self.max_back_bytes = max_back_bytes
        self._ino: int | None = None
        self._offset = 0
        self._partial = b""
        self._skip_to_line = False  # started mid-file: drop the first, partial line
        self.last: dict[str, Any] | None = None
        self.last_at: float | None = None  # monotonic time the newest record was read
        self.bytes_read = 0

    def poll(self) -> dict[str, Any] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        if st.st_ino != self._ino or st.st_size < self._offset:
            # New or truncated file: start from its tail, not its beginning.
            self._ino = st.st_ino
            self._offset = max(0, st.st_size - self.max_back_bytes)
            self._partial = b""
            self._skip_to_line = self._offset > 0
        if st.st_size - self._offset > self.max_back_bytes:
            self._offset = st.st_size - self.max_back_bytes  # fell behind: jump to the tail
            self._partial = b""
            self._skip_to_line = True
        if st.st_size == self._offset:
            return None
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read(st.st_size - self._offset)
        except OSError:
            return None
        self._offset += len(data)
        self.bytes_read += len(data)
        data = self._partial + data
        if self._skip_to_line:
            cut = data.find(b"\n")
            if cut < 0:
                self._partial = b""
                return None
            data = data[cut + 1:]
            self._skip_to_line = False
        lines = data.split(b"\n")
        self._partial = lines.pop()  # no newline yet: the writer is mid-line
        newest = None
        for line in reversed(lines):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("type") is None:  # progress lines only (not eval, stop)
                newest = record
                break
        if newest is not None:
            self.last = newest
            self.last_at = time.monotonic()
        return newest

    def samples_per_s(self, stale_after_s: float) -> float | None:
        """The newest samples/s, or None when there is none or it is older than stale_after_s."""
        self.poll()
        if self.last is None or self.last_at is None or time.monotonic() - self.last_at > stale_after_s:
            return None
        value = self.last.get("samples_per_s")
        return float(value) if isinstance(value, (int, float)) else None
