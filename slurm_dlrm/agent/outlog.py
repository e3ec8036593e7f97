"""A member's output file, read back by its tail: the runner's own one-line cause of a
failure, for the REASON the agent reports (docs/agent.md). Shared with `show`/`log`."""

from __future__ import annotations

import os
import re
from pathlib import Path

TAIL_BYTES = 16 * 1024
REASON_MAX_CHARS = 120  # queue's REASON column: one short line; `show` has the rest

# What the runner logs when it gives up (slurm_dlrm.train.runner.run): the cause, one line.
_ERROR_LINE = re.compile(r"(?:^|\s)(?:ERROR|CRITICAL)\s+[\w.]+:\s*(?P<msg>.+)$|slurm-dlrm: error: (?P<msg2>.+)$")
_TRACEBACK_LAST = re.compile(r"^(?P<exc>[A-Za-z_][\w.]*(?:Error|Exception|Interrupt)): (?P<msg>.+)$")


def tail_lines(path: Path, n: int, max_bytes: int = TAIL_BYTES) -> list[str]:
    """The last `n` lines of a text file (decoded leniently); [] if unreadable."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return []
    lines = data.decode(errors="replace").splitlines()
    if size > max_bytes and lines:
        lines = lines[1:]  # the first one is cut
    return lines[-n:] if n > 0 else []


def error_line(lines: list[str]) -> str | None:
    """The runner's own one-line cause in its output's tail (`bad spec: data.path: ...`,
    the last line of a traceback), or None."""
    for line in reversed(lines):
        line = line.strip()
        m = _ERROR_LINE.search(line)
        if m:
            return (m.group("msg") or m.group("msg2") or "").strip() or None
        m = _TRACEBACK_LAST.match(line)
        if m:
            return f"{m.group('exc').rsplit('.', 1)[-1]}: {m.group('msg').strip()}"
    return None


def short_reason(text: str | None, limit: int = REASON_MAX_CHARS) -> str:
    """One short line for a REASON column: the first line, cut to `limit` characters."""
    if not text:
        return ""
    first = text.strip().splitlines()[0].strip() if text.strip() else ""
    return first if len(first) <= limit else first[: limit - 3].rstrip() + "..."


def newest_checkpoint_step(ckpt_dir: Path) -> int | None:
    """The newest complete checkpoint in a runner's checkpoint folder (`step-N/` with its
    manifest, which slurm_dlrm.train.checkpoint writes last), or None."""
    try:
        names = os.listdir(ckpt_dir)
    except OSError:
        return None
    steps = [int(n[5:]) for n in names if n.startswith("step-") and n[5:].isdigit()
             and (ckpt_dir / n / "manifest.json").exists()]
    return max(steps) if steps else None
