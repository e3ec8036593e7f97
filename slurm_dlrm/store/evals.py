"""Held-out evaluations (issue 39): the `"type": "eval"` lines a job's runner appends to
its metrics file (`<spool>/jobs/<id>/metrics.jsonl`, docs/runner.md "Evaluation"),
read into the store's `evals` table, and what acct, queue and the exporter read back.
The same pass reads a multi-rank run's per-rank peaks (issue 48) into `rank_peaks`.

Reading is incremental and exactly once, like agent reports (store/ingest.py): the byte
offset of each metrics file is kept in `ingest_offsets`, only complete lines are read,
and rows plus offset are written in one transaction. A step evaluated again (a resume
from an older checkpoint) replaces its row: same spec and seed, same numbers.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slurm_dlrm.store.ingest import read_complete, stored_offset

if TYPE_CHECKING:
    from slurm_dlrm.store.store import Store

# Metric name -> (column, True when higher is better): what "best" means per metric.
EVAL_METRICS: dict[str, tuple[str, bool]] = {
    "auc": ("auc", True),
    "ne": ("ne", False),
    "log_loss": ("log_loss", False),
    "calibration": ("calibration", False),  # best = closest to 1, handled apart
    "accuracy": ("accuracy", True),
}
_COLUMNS = ("auc", "ne", "log_loss", "calibration", "accuracy", "samples", "planted_auc")
_CHUNK_BYTES = 1 << 20


def _row(job_id: int, rec: dict[str, Any]) -> tuple[Any, ...] | None:
    step = rec.get("step")
    if rec.get("type") != "eval" or not isinstance(step, int) or isinstance(step, bool):
        return None

    def num(key: str) -> float | None:
        v = rec.get(key)
        return float(v) if isinstance(v, int | float) and not isinstance(v, bool) and v == v else None

    t = num("t")
    samples = rec.get("eval_samples")
    return (job_id, step, t if t is not None else 0.0, num("eval_auc"), num("eval_ne"), num("eval_log_loss"),
            num("eval_calibration"), num("eval_accuracy"),
            int(samples) if isinstance(samples, int) and not isinstance(samples, bool) else None,
            num("planted_auc"))


# a rank's peaks only grow within a run; over attempts (a requeue starts afresh) the
# highest is kept, as job_usage keeps its peaks
UPSERT_RANK_PEAKS = """
INSERT INTO rank_peaks (job_id, rank, gpu_mem_peak_bytes, rss_peak_bytes, tensor_peak_bytes, t)
VALUES (?, ?, ?, ?, ?, ?)
ON CONFLICT(job_id, rank) DO UPDATE SET
    gpu_mem_peak_bytes = max(coalesce(gpu_mem_peak_bytes, excluded.gpu_mem_peak_bytes),
                             coalesce(excluded.gpu_mem_peak_bytes, gpu_mem_peak_bytes)),
    rss_peak_bytes = max(coalesce(rss_peak_bytes, excluded.rss_peak_bytes),
                         coalesce(excluded.rss_peak_bytes, rss_peak_bytes)),
    tensor_peak_bytes = max(coalesce(tensor_peak_bytes, excluded.tensor_peak_bytes),
                            coalesce(excluded.tensor_peak_bytes, tensor_peak_bytes)),
    t = max(t, excluded.t)
"""
_RANK_PEAK_KEYS = ("rank_peak_gpu_bytes", "rank_peak_rss_bytes", "rank_peak_tensor_bytes")


def rank_peak_rows(job_id: int, rec: dict[str, Any]) -> list[tuple[Any, ...]]:
    """The `rank_peaks` rows of one metrics line of a multi-rank run (rank 0 writes every
    rank's peaks so far: train/runner.py `_rank_peaks`); none for any other line."""
    lists: list[list[Any]] = [v for k in _RANK_PEAK_KEYS if isinstance(v := rec.get(k), list)]
    if len(lists) != len(_RANK_PEAK_KEYS) or len({len(v) for v in lists}) != 1:
        return []

    def size(v: Any) -> int | None:
        return int(v) if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None

    t = rec.get("t")
    at = float(t) if isinstance(t, int | float) and not isinstance(t, bool) else 0.0
    return [(job_id, rank, *(size(v[rank]) for v in lists), at) for rank in range(len(lists[0]))]


def ingest_eval_file(store: Store, job_id: int, path: str | os.PathLike[str], max_chunks: int = 16) -> int:
    """Read the eval lines new in `path` (a job's metrics file) into `evals`; their count."""
    key = os.path.realpath(path)
    added = 0
    for _ in range(max_chunks):
        try:
            st = os.stat(key)
        except OSError:
            return added
        planned, _old = stored_offset(store, key, st)
        if st.st_size <= planned:
            return added
        data, end = read_complete(key, planned, _CHUNK_BYTES)
        if end == 0:
            return added
        rows = []
        peaks: list[tuple[Any, ...]] = []
        for line in data[:end].split(b"\n"):
            # most lines are training progress: skip unparsed
            if b'"eval"' not in line and b'"rank_peak_' not in line:
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if not isinstance(rec, dict):
                continue
            row = _row(job_id, rec)
            if row is not None:
                rows.append(row)
            peaks += rank_peak_rows(job_id, rec)
        with store.write():
            offset, _ = stored_offset(store, key, st)
            if offset != planned:
                continue  # another reader moved it meanwhile: read again
            store.conn.executemany(
                "INSERT OR REPLACE INTO evals (job_id, step, t, auc, ne, log_loss, calibration, accuracy, samples, "
                "planted_auc) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
            store.conn.executemany(UPSERT_RANK_PEAKS, peaks)
            store.conn.execute(
                "INSERT INTO ingest_offsets (path, inode, offset_bytes, lines, bad_lines, updated_time) "
                "VALUES (?, ?, ?, ?, 0, ?) ON CONFLICT(path) DO UPDATE SET inode = excluded.inode, "
                "offset_bytes = excluded.offset_bytes, lines = lines + excluded.lines, "
                "updated_time = excluded.updated_time",
                (key, st.st_ino, planned + end, data[:end].count(b"\n"), store.clock()))
        added += len(rows)
        if planned + end >= st.st_size:
            return added
    return added


def ingest_job_evals(store: Store, spool_dir: Path, since: float) -> int:
    """Evals of every job running now or ended since `since` (epoch s), from the spool."""
    ids = [int(r[0]) for r in store.conn.execute(
        "SELECT id FROM jobs WHERE state = 'RUNNING' OR (end_time IS NOT NULL AND end_time >= ?)", (since,))]
    return sum(ingest_eval_file(store, job_id, spool_dir / "jobs" / str(job_id) / "metrics.jsonl")
               for job_id in ids)


@dataclass(frozen=True)
class EvalSummary:
    """A job's evaluations: the last one, the best AUC and the step it came at."""

    job_id: int
    evals: int
    last_step: int
    last_auc: float | None
    last_ne: float | None
    last_log_loss: float | None
    last_calibration: float | None
    last_accuracy: float | None
    best_auc: float | None
    best_auc_step: int | None
    best_ne: float | None
    best_ne_step: int | None
    planted_auc: float | None

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def eval_summaries(store: Store, job_ids: list[int] | None = None) -> dict[int, EvalSummary]:
    """Per job: final (last step) and best (AUC highest, NE lowest) evaluations."""
    sql = "SELECT job_id, step, auc, ne, log_loss, calibration, accuracy, planted_auc FROM evals"
    params: list[Any] = []
    if job_ids is not None:
        if not job_ids:
            return {}
        sql += f" WHERE job_id IN ({','.join('?' * len(job_ids))})"
        params = list(job_ids)
    by_job: dict[int, list[tuple[Any, ...]]] = {}
    for r in store.conn.execute(sql + " ORDER BY job_id, step", params):
        by_job.setdefault(int(r[0]), []).append(tuple(r))
    out: dict[int, EvalSummary] = {}
    for job_id, rows in by_job.items():
        last = rows[-1]
        aucs = [(r[2], r[1]) for r in rows if r[2] is not None]
        nes = [(r[3], r[1]) for r in rows if r[3] is not None]
        best_auc = max(aucs, key=lambda x: (x[0], -x[1])) if aucs else (None, None)
        best_ne = min(nes, key=lambda x: (x[0], x[1])) if nes else (None, None)
        planted = next((r[7] for r in reversed(rows) if r[7] is not None), None)
        out[job_id] = EvalSummary(job_id=job_id, evals=len(rows), last_step=int(last[1]), last_auc=last[2],
                                  last_ne=last[3], last_log_loss=last[4], last_calibration=last[5],
                                  last_accuracy=last[6], best_auc=best_auc[0], best_auc_step=best_auc[1],
                                  best_ne=best_ne[0], best_ne_step=best_ne[1], planted_auc=planted)
    return out


def eval_curve(store: Store, job_id: int) -> list[dict[str, Any]]:
    """Every evaluation of one job, in step order (report's curves)."""
    cols = ", ".join(("step", "t", *_COLUMNS))
    return [dict(zip(("step", "t", *_COLUMNS), r, strict=True))
            for r in store.conn.execute(f"SELECT {cols} FROM evals WHERE job_id = ? ORDER BY step", (job_id,))]
