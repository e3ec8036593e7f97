"""What the Prometheus exporter reads from one store, at scrape time, read-only.

The exporter (`slurm_dlrm/exporter.py`) opens each store with `Store(path,
readonly=True)` on every scrape and calls `read_store`; nothing here writes. What a
store holds is turned into plain rows here; naming, labels and the exposition format
are the exporter's.

Cost (a scrape every 15 s, 1,000 active jobs over 50 stores, benchmarks/exporter_scrape.py):

- gauges of what is active (jobs and packs in an active state, the GPUs of running
  packs, their latest GPU sample) are read on every scrape: the `jobs_state` and
  `packs_state` indexes, the placements of RUNNING packs, and a range seek on
  `samples_job_t` over the last window of GPU samples only (never a scan of `samples`);
  so a scrape costs what is active, not the store's history;
- lifecycle counters (OOMs, requeues, recoveries, re-packs) are counted incrementally:
  each store's cursor keeps the last `events.id` it counted, so a scrape reads only
  the events written since the previous one;
- GPU-seconds (acct's definition, `queries.ACCT`), the per-job histogram figures and
  the counts of jobs and packs in terminal states scale with the store's whole history, so they are recomputed at most every
  `slow_every_s` per store (default 60 s: they move slowly, and dashboards rate them
  over minutes).
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from slurm_dlrm.store.states import JOB_TERMINAL, PACK_TERMINAL, JobState, PackState
from slurm_dlrm.store.store import Store

_JOB_ACTIVE = json.dumps(sorted(s.value for s in JobState if s not in JOB_TERMINAL))
_JOB_DONE = json.dumps(sorted(s.value for s in JOB_TERMINAL))
_PACK_ACTIVE = json.dumps(sorted(s.value for s in PackState if s not in PACK_TERMINAL))
_PACK_DONE = json.dumps(sorted(s.value for s in PACK_TERMINAL))

# (user, partition, gpu_model): the label set of the per-user counters and histograms
Key = tuple[str, str, str]


@dataclass
class GpuRow:
    """One GPU of a RUNNING pack: members now running on it and what it measured last."""

    user: str
    partition: str
    gpu_model: str
    node: str
    gpu: int
    slurm_job_id: str
    members: int
    fenced_bytes: int | None
    used_bytes: int | None = None
    sm_util_pct: float | None = None
    mem_util_pct: float | None = None
    sample_t: float | None = None


@dataclass
class EventCounts:
    ooms: float = 0.0
    requeues: float = 0.0
    recovered_oom: float = 0.0
    recovered_pack: float = 0.0
    repacks: float = 0.0


@dataclass
class StoreCursor:
    """What the exporter remembers about one store between scrapes."""

    last_event_id: int = 0
    events: dict[Key, EventCounts] = field(default_factory=lambda: defaultdict(EventCounts))
    slow_t: float | None = None  # monotonic time of the last slow refresh
    gpu_seconds: dict[Key, tuple[float, float]] = field(default_factory=dict)  # charged, exclusive
    est_error_ratios: dict[Key, list[float]] = field(default_factory=dict)
    wait_s: dict[Key, list[float]] = field(default_factory=dict)
    jobs_done: dict[tuple[str, str, str, str], int] = field(default_factory=dict)  # terminal states
    packs_done: dict[tuple[str, str, str, str], int] = field(default_factory=dict)


@dataclass
class EvalRow:
    """The last held-out evaluation of one running job (issue 39)."""

    user: str
    partition: str
    gpu_model: str
    job_id: int
    step: int
    values: dict[str, float]  # auc, ne, log_loss, calibration, accuracy (those recorded)


@dataclass
class StoreMetrics:
    jobs: dict[tuple[str, str, str, str], int]  # (user, partition, gpu_model, state) -> n
    packs: dict[tuple[str, str, str, str], int]
    gpus: list[GpuRow]
    evals: list[EvalRow] = field(default_factory=list)


def _key(row: dict[str, Any], default_user: str, default_partition: str, forced_user: str | None = None) -> Key:
    return (forced_user or str(row.get("user") or default_user), str(row.get("partition") or default_partition),
            str(row.get("gpu_model") or ""))


def read_store(store: Store, cursor: StoreCursor, *, user: str, default_partition: str, now: float,
               sample_window_s: float, slow_every_s: float, stagger_s: float = 0.0,
               monotonic: float | None = None) -> StoreMetrics:
    """Read one store's figures into `cursor` (counters, histograms) and the result (gauges).

    One read transaction, so every figure comes from the same snapshot. `user` labels
    rows without one; `default_partition` labels jobs that name none (where the service
    would send them); `store.owner_user`, when set (another user's store read by an
    admin), labels every row instead of the user its rows name. `stagger_s` (< `slow_every_s`) shifts this store's slow refreshes
    so that the stores of a cluster do not all refresh on the same scrape.
    """
    mono = time.monotonic() if monotonic is None else monotonic
    with store.read():
        if cursor.slow_t is None or mono - cursor.slow_t >= slow_every_s:
            first = cursor.slow_t is None
            _slow_refresh(store, cursor, user, default_partition, now)
            cursor.slow_t = mono - (stagger_s if first else 0.0)
        jobs = dict(cursor.jobs_done)
        _count_by_state(store, "metric_jobs", _JOB_ACTIVE, jobs, user, default_partition)
        packs = dict(cursor.packs_done)
        _count_by_state(store, "metric_packs", _PACK_ACTIVE, packs, user, default_partition)
        gpus = _gpus(store, user, default_partition, now - sample_window_s)
        _count_events(store, cursor, user, default_partition)
        evals = _evals(store, user, default_partition)
    return StoreMetrics(jobs, packs, gpus, evals)


def _evals(store: Store, user: str, default_partition: str) -> list[EvalRow]:
    out = []
    for r in store.query("metric_job_evals"):
        k = _key(r, user, default_partition, store.owner_user)
        values = {m: float(r[m]) for m in ("auc", "ne", "log_loss", "calibration", "accuracy") if r[m] is not None}
        out.append(EvalRow(k[0], k[1], k[2], int(r["job_id"]), int(r["step"]), values))
    return out


def _count_by_state(store: Store, query: str, states: str, into: dict[tuple[str, str, str, str], int],
                    user: str, default_partition: str) -> None:
    for r in store.query(query, {"states": states}):
        k = (*_key(r, user, default_partition, store.owner_user), str(r["state"]))
        into[k] = into.get(k, 0) + int(r["n"])


def _gpus(store: Store, user: str, default_partition: str, since: float) -> list[GpuRow]:
    latest: dict[tuple[int, str, int], dict[str, Any]] = {}
    by_pack_gpu: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for r in store.query("metric_gpu_latest", {"since": since}):
        latest[(int(r["pack_id"]), str(r["node"]), int(r["gpu_index"] or 0))] = r
        by_pack_gpu[(int(r["pack_id"]), int(r["gpu_index"] or 0))].append(r)
    out: list[GpuRow] = []
    for r in store.query("metric_gpus"):
        pack_id, gpu = int(r["pack_id"]), int(r["gpu_index"])
        node = str(r["node"])
        s = latest.get((pack_id, node, gpu))
        if s is None and not node and len(by_pack_gpu.get((pack_id, gpu), [])) == 1:
            # the placement's node name is not known yet (hostlist unrecorded): the
            # samples name it; unambiguous when one node reported this GPU index
            s = by_pack_gpu[(pack_id, gpu)][0]
            node = str(s["node"])
        k = _key(r, user, default_partition, store.owner_user)
        row = GpuRow(user=k[0], partition=k[1], gpu_model=k[2], node=node, gpu=gpu,
                     slurm_job_id=str(r["slurm_job_id"] or ""), members=int(r["members"] or 0),
                     fenced_bytes=None if r["fenced_bytes"] is None else int(r["fenced_bytes"]))
        if s is not None:
            row.used_bytes = None if s["gpu_mem_bytes"] is None else int(s["gpu_mem_bytes"])
            row.sm_util_pct = s["sm_util_pct"]
            row.mem_util_pct = s["mem_util_pct"]
            row.sample_t = float(s["t"])
        out.append(row)
    return out


def _count_events(store: Store, cursor: StoreCursor, user: str, default_partition: str) -> None:
    top = store.conn.execute("SELECT max(id) FROM events").fetchone()[0]
    if top is None:
        return
    top = int(top)
    if top < cursor.last_event_id:
        # the store was replaced (restored from a backup, recreated): count it afresh
        cursor.last_event_id = 0
        cursor.events.clear()
    if top == cursor.last_event_id:
        return
    for r in store.query("metric_events", {"after_id": cursor.last_event_id, "upto_id": top}):
        c = cursor.events[_key(r, user, default_partition, store.owner_user)]
        c.ooms += r["ooms"] or 0
        c.requeues += r["requeues"] or 0
        c.recovered_oom += r["recovered_oom"] or 0
        c.recovered_pack += r["recovered_pack"] or 0
        c.repacks += r["repacks"] or 0
    cursor.last_event_id = top


def _slow_refresh(store: Store, cursor: StoreCursor, user: str, default_partition: str, now: float) -> None:
    params = {"now": now, "job_ids": None, "states": None, "users": None, "pack_id": None,
              "since": None, "until": None}
    gpu_s: dict[Key, tuple[float, float]] = {}
    for r in store.query("metric_gpu_seconds", params):
        k = _key(r, user, default_partition, store.owner_user)
        c, e = gpu_s.get(k, (0.0, 0.0))
        gpu_s[k] = (c + float(r["charged_s"] or 0.0), e + float(r["exclusive_s"] or 0.0))
    ratios: dict[Key, list[float]] = defaultdict(list)
    waits: dict[Key, list[float]] = defaultdict(list)
    for r in store.query("metric_job_figures"):
        k = _key(r, user, default_partition, store.owner_user)
        if r["est_error_ratio"] is not None:
            ratios[k].append(float(r["est_error_ratio"]))
        if r["wait_s"] is not None:
            waits[k].append(float(r["wait_s"]))
    cursor.gpu_seconds = gpu_s
    cursor.est_error_ratios = dict(ratios)
    cursor.wait_s = dict(waits)
    cursor.jobs_done = {}
    _count_by_state(store, "metric_jobs", _JOB_DONE, cursor.jobs_done, user, default_partition)
    cursor.packs_done = {}
    _count_by_state(store, "metric_packs", _PACK_DONE, cursor.packs_done, user, default_partition)
