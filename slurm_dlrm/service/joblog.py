"""A job's own files in the spool, read back for `show` and `log`: the runner's output
(`<spool_dir>/jobs/<id>/output-<node>.log`, one per node it ran on, appended over
attempts) and the last line of its metrics (`metrics.jsonl`).

Reads only tails (a few KiB), so a long run's log costs nothing to look at."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from slurm_dlrm.agent.outlog import newest_checkpoint_step, tail_lines


def job_dir(spool_dir: Path, job_id: int) -> Path:
    return spool_dir / "jobs" / str(int(job_id))


def log_paths(spool_dir: Path, job_id: int) -> list[Path]:
    """The job's runner output files, oldest first (one per node it ran on)."""
    d = job_dir(spool_dir, job_id)
    try:
        found = [d / n for n in os.listdir(d) if n.startswith("output-") and n.endswith(".log")]
    except OSError:
        return []
    return sorted(found, key=lambda p: (p.stat().st_mtime, p.name))


def last_metrics(spool_dir: Path, job_id: int, kind: str = "train") -> dict[str, Any] | None:
    """The last metrics line of the job of this kind: "train" (step, loss,
    samples_per_s, ...), "eval" (a held-out evaluation: eval_auc, eval_ne, ...) or
    "stop" (eval.stop_when ended the job: step, reason)."""
    for line in reversed(tail_lines(job_dir(spool_dir, job_id) / "metrics.jsonl", 50, 8192)):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and (rec.get("type") or "train") == kind:
            return rec
    return None


def last_checkpoint_step(spool_dir: Path, job_id: int) -> int | None:
    """The newest complete checkpoint of the job (`<spool>/jobs/<id>/ckpt`), or None."""
    return newest_checkpoint_step(job_dir(spool_dir, job_id) / "ckpt")
