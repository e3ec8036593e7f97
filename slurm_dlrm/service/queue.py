"""What `queue` and `show` print: the user's jobs with their pack, GPU and reason."""

from __future__ import annotations

import logging
import re
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from slurm_dlrm.agent.outlog import short_reason
from slurm_dlrm.service.custom_trace import ESTIMATING_REASON, PENDING_TRACE
from slurm_dlrm.site import MIB

log = logging.getLogger(__name__)

QUEUE_COLUMNS = ("job_id", "name", "state", "pack", "slurm_job_id", "node", "gpu", "mps_pct",
                 "gpu_mem_mib", "attempt", "auc", "reason")
HEADERS = {"job_id": "JOBID", "name": "NAME", "state": "STATE", "pack": "PACK", "slurm_job_id": "SLURMID",
           "node": "NODE", "gpu": "GPU", "mps_pct": "MPS%", "gpu_mem_mib": "GPU_MiB", "attempt": "TRY",
           "auc": "AUC", "reason": "REASON", "start_time": "START_TIME", "partition": "PARTITION", "time": "TIME",
           "time_limit": "TIME_LIMIT", "user": "USER", "rung": "RUNG"}
# `queue -l`, as squeue -l adds PARTITION, TIME and TIME_LIMIT
LONG_COLUMNS = ("job_id", "partition", "name", "state", "time", "time_limit", "pack", "slurm_job_id", "node",
                "gpu", "mps_pct", "gpu_mem_mib", "attempt", "auc", "rung", "reason")
# `queue --start`, as squeue --start: waiting jobs and when each is expected to start
START_COLUMNS = ("job_id", "name", "state", "start_time", "reason")


def pending_reason(service: dict[str, Any]) -> str:
    if not service.get("running"):
        return "the packing service is not running (slurm-dlrm serve --daemon)"
    if service.get("slurm_ok") is False:
        # one short line in the table; `show` and `serve status` carry the whole error
        return (f"waiting for Slurm: {slurm_error_line(service.get('slurm_error'))} "
                f"(retry in {service.get('slurm_retry_in_s')} s)")
    nxt = service.get("next_dispatch_in_s")
    return "waiting for a dispatch round" + (f" (in {nxt:.0f} s)" if nxt else "")


def slurm_error_line(error: str | None, limit: int = 60) -> str:
    """The gist of a Slurm command's error for a REASON cell: its last stderr line
    without the `squeue: fatal:` prefix (`Could not establish a configuration source`)."""
    text = (error or "").split(" | ")[-1]
    if "): " in text and " failed (exit " in text:
        text = text.split("): ", 1)[1]
    text = re.sub(r"^\w+: (?:fatal|error): ", "", text.strip())
    return short_reason(text, limit) or "no answer"


def waiting_reason(job: Any, service: dict[str, Any], now_s: float) -> str:
    """Why a pending job waits, in words: its --begin time, else the policy's reason from
    the service's last round (no free GPU, reserved GPUs for a waiting gang, held room,
    ...), else what the service is doing."""
    import time as _time

    if job.begin_time is not None and job.begin_time > now_s:
        return f"BeginTime: not before {_time.strftime('%Y-%m-%dT%H:%M:%S', _time.localtime(job.begin_time))} (--begin)"
    base = pending_reason(service)
    why = (service.get("deferred") or {}).get(str(job.id)) if service.get("running") else None
    if why and service.get("slurm_ok") is not False:
        return f"{why} (nice {job.nice})" if job.nice else str(why)
    return base


def queue_rows(store: Any, *, user: str, service: dict[str, Any], include_ended: bool = False,
               slurm_reasons: dict[str, str] | None = None, job_ids: Sequence[int] | None = None,
               now_s: float | None = None) -> list[dict[str, Any]]:
    """One row per job (current placement), oldest first."""
    import time as _time

    from slurm_dlrm.store.states import JOB_TERMINAL, JobState, PackState

    now_s = _time.time() if now_s is None else now_s

    with store.read():
        jobs = store.jobs(None if include_ended else
                          [JobState.PENDING, JobState.PLANNED, JobState.RUNNING], user=user)
        if job_ids is not None:
            wanted = set(job_ids)
            jobs = [j for j in jobs if j.id in wanted]
        pack_ids = {j.pack_id for j in jobs if j.pack_id is not None}
        packs = {p.id: p for p in store.packs(user=user) if p.id in pack_ids}
        placements: dict[tuple[int, int], Any] = {}
        rank_rows: dict[tuple[int, int], list[Any]] = {}  # a multi-GPU job's rows, one per rank
        for pid in pack_ids:
            for pl in store.placements(pack_id=pid):
                placements[(pl.pack_id, pl.job_id)] = pl
                if (pl.world_size or 1) > 1:
                    rank_rows.setdefault((pl.pack_id, pl.job_id), []).append(pl)
        evals = _last_aucs(store, [j.id for j in jobs])
        from slurm_dlrm.service.sweep_stop import PAUSED_REASON, sweep_marks

        # a sweep variant's rung and, paused, why (issue 47)
        rungs = sweep_marks(store, [j.id for j in jobs if isinstance((j.spec or {}).get("sweep"), dict)])
    rows = []
    node_gpus: dict[tuple[str, int], list[str] | None] = {}
    for j in jobs:
        pack = packs.get(j.pack_id) if j.pack_id is not None and j.state != JobState.PENDING else None
        pl = placements.get((j.pack_id, j.id)) if pack is not None else None
        if j.no_pack:
            rows.append({**slurm_fields(j, now_s), **native_row(j, slurm_reasons), "auc": evals.get(j.id)})
            continue
        if j.state == JobState.PENDING and PENDING_TRACE in (j.estimate or {}):
            reason = ESTIMATING_REASON + f": the service traces {j.spec.get('custom_module')}"
        elif j.state == JobState.PENDING and rungs.get(j.id, ("",))[0].endswith("paused"):
            reason = f"{PAUSED_REASON}: {rungs[j.id][1].removeprefix('paused: ')}"
        elif j.state == JobState.PENDING:
            reason = waiting_reason(j, service, now_s)
            if getattr(j, "sbatch_json", None) and '"dependency"' in j.sbatch_json:
                reason = _dependency_reason(store, j) or reason
        elif j.state in JOB_TERMINAL:
            reason = j.exit_reason or ""
        elif pack is not None and pack.state == PackState.SUBMITTING:
            reason = "submitting the pack" + (f"; {pending_reason(service)}" if service.get("slurm_ok") is False else "")
        elif pack is not None and pack.state == PackState.QUEUED:
            why = (slurm_reasons or {}).get(str(pack.slurm_job_id))
            reason = f"pack {why}" if why == STARTED_IN_SLURM else "pack queued in Slurm" + (f" ({why})" if why else "")
        elif pack is not None and pack.pack_dir and (Path(pack.pack_dir) / "cancel" / str(j.id)).exists():
            reason = "cancel requested"
        elif pack is not None and pack.state == PackState.RUNNING and j.state == JobState.PLANNED:
            reason = "pack running; waiting for its agent to start it"  # also a joiner (refill)
        else:
            reason = ""
        ranks = sorted(rank_rows.get((j.pack_id, j.id), []), key=lambda r: r.rank or 0) if pack is not None else []
        if ranks:
            pl = ranks[0]
        rows.append({
            **slurm_fields(j, now_s),
            "job_id": j.id, "name": j.name, "state": str(j.state), "pack": pack.name if pack else None,
            "slurm_job_id": pack.slurm_job_id if pack else None,
            "node": (pl.node or (f"#{pl.node_index}" if pl else None)) if pl else None,
            "gpu": node_gpu(pack.pack_dir, pl.node_index, pl.gpu_index, node_gpus) if pl and pack else None,
            "mps_pct": pl.mps_thread_pct if pl else None,
            "gpu_mem_mib": (pl.gpu_mem_limit_bytes // MIB) if pl and pl.gpu_mem_limit_bytes else None,
            "attempt": j.attempt, "auc": evals.get(j.id), "rung": rungs.get(j.id, (None,))[0], "reason": reason,
            # a multi-GPU job: every rank's GPU and fence (rank 0's in the columns above)
            **({"ranks": [{"rank": r.rank or 0, "node": r.node or f"#{r.node_index}",
                           "gpu": node_gpu(pack.pack_dir, r.node_index, r.gpu_index, node_gpus),
                           "mps_pct": r.mps_thread_pct,
                           "gpu_mem_mib": (r.gpu_mem_limit_bytes // MIB) if r.gpu_mem_limit_bytes else None}
                          for r in ranks]} if ranks and pack is not None else {}),
        })
    return rows


def slurm_fields(j: Any, now_s: float) -> dict[str, Any]:
    """The columns squeue has and ours did not (issue 42): the id as squeue prints it
    (`12_3` for task 3 of array 12), PARTITION (None: the site's default, filled by the
    command), TIME (run time of the current run, s) and TIME_LIMIT (minutes)."""
    from slurm_dlrm.store.states import JobState

    opts = j.sbatch or {}
    if j.state == JobState.RUNNING and j.start_time is not None:
        time_s: float | None = now_s - j.start_time
    elif j.end_time is not None and j.start_time is not None:
        time_s = j.end_time - j.start_time
    else:
        time_s = 0.0
    return {"slurm_id": f"{j.array_job_id}_{j.array_task_id}" if j.array_job_id is not None else str(j.id),
            "partition": str(opts["partition"]).split(",")[0] if opts.get("partition") else None,
            "time_s": max(0.0, time_s or 0.0), "time_limit_min": opts.get("time_minutes")}


def _last_aucs(store: Any, job_ids: list[int]) -> dict[int, float]:
    """The last held-out AUC of each job (issue 39), rounded for the table."""
    from slurm_dlrm.store.evals import eval_summaries

    try:
        found = eval_summaries(store, job_ids)
    except sqlite3.OperationalError:  # a snapshot of a store from before the evals table
        return {}
    return {j: round(e.last_auc, 4) for j, e in found.items() if e.last_auc is not None}


def native_row(j: Any, slurm_reasons: dict[str, str] | None) -> dict[str, Any]:
    """A `submit --no-pack` job's row: its own Slurm job, node and the node's GPU index."""
    from slurm_dlrm.service.native import NO_PACK_LABEL, SUBMITTING_REASON
    from slurm_dlrm.store.states import JOB_TERMINAL, JobState

    req = (j.sbatch or {}).get("no_pack") or {}
    if j.state in JOB_TERMINAL:
        reason = j.exit_reason or ""
    elif j.slurm_job_id is None:
        reason = SUBMITTING_REASON
    elif j.state == JobState.PLANNED:
        why = (slurm_reasons or {}).get(j.slurm_job_id)
        reason = STARTED_IN_SLURM if why == STARTED_IN_SLURM else "queued in Slurm" + (f" ({why})" if why else "")
    else:
        reason = ""
    gpu = j.gpu_idx
    return {
        "job_id": j.id, "name": j.name, "state": str(j.state),
        # a multi-node job is never packed either: say over how many nodes it runs
        "pack": f"{req['nodes']}-nodes" if int(req.get("nodes") or 1) > 1 else NO_PACK_LABEL,
        "slurm_job_id": j.slurm_job_id, "node": j.nodes,
        "gpu": int(gpu) if gpu and gpu.isdigit() else gpu, "mps_pct": req.get("mps_pct"),
        "gpu_mem_mib": req.get("gpu_mem_mib"), "attempt": j.attempt, "reason": reason,
    }


def node_gpu(pack_dir: str | None, node_index: int, gpu_index: int,
             cache: dict[tuple[str, int], list[str] | None]) -> int | str:
    """The GPU as its node numbers it (Slurm's IDX), from the agent's
    `<pack_dir>/nodes/<node_index>.json`; the position in the allocation until an
    agent has written it."""
    import json

    if not pack_dir:
        return gpu_index
    key = (pack_dir, node_index)
    if key not in cache:
        try:
            gpus = json.loads((Path(pack_dir) / "nodes" / f"{node_index}.json").read_text()).get("gpus")
            cache[key] = [str(g) for g in gpus] if isinstance(gpus, list) else None
        except (OSError, ValueError, AttributeError):
            cache[key] = None
    gpus = cache[key]
    if gpus is None or not 0 <= gpu_index < len(gpus):
        return gpu_index
    g = gpus[gpu_index]
    return int(g) if g.isdigit() else g


def _dependency_reason(store: Any, job: Any) -> str:
    from slurm_dlrm.service.depend import dependency_state
    from slurm_dlrm.store.errors import UnknownEntity

    def state_of(jid: int) -> str | None:
        try:
            return str(store.get_job(jid).state)
        except UnknownEntity:
            return None

    verdict, why = dependency_state(job, state_of)
    return why if verdict != "ready" else ""


def slurm_pending_reasons(slurm: Any, user: str) -> dict[str, str]:
    """Slurm's reason for each of the user's pending jobs (empty if Slurm does not answer)."""
    from slurm_dlrm.slurm import JobState as SJ
    from slurm_dlrm.slurm import SlurmError

    try:
        infos = slurm.squeue(user=user)
    except SlurmError as exc:
        log.info("squeue failed: %s", exc)
        return {}
    # a pack the service still has QUEUED may run already (its round is up to
    # packing.round_seconds away): say so rather than "queued" (issue 42)
    return {str(i.job_id): (STARTED_IN_SLURM if i.state == SJ.RUNNING else i.reason) for i in infos
            if i.reason or i.state == SJ.RUNNING}


STARTED_IN_SLURM = "started in Slurm; its agent is starting the member"


def format_table(rows: list[dict[str, Any]], columns: Sequence[str] = QUEUE_COLUMNS) -> str:
    """Fixed-width text like squeue's (the last column unpadded)."""
    cells = [[HEADERS[c] for c in columns]]
    for r in rows:
        cells.append(["-" if r.get(c) is None else str(r[c]) for c in columns])
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns) - 1)]
    lines = []
    for row in cells:
        lines.append("  ".join([v.ljust(w) for v, w in zip(row, widths, strict=False)] + [row[-1]]).rstrip())
    return "\n".join(lines)


def job_details(store: Any, job_id: int, *, user: str, service: dict[str, Any]) -> dict[str, Any]:
    """Everything `show` prints about one job."""
    from slurm_dlrm.store.jobids import own_job

    job = own_job(store, job_id, user)
    (row,) = queue_rows(store, user=user, service=service, include_ended=True, job_ids=[job_id])
    packs = {p.id: p for p in store.packs(user=user)}
    history = []
    node_gpus: dict[tuple[str, int], list[str] | None] = {}
    for pl in store.placements(job_id=job_id):
        p = packs.get(pl.pack_id)
        history.append({"pack": p.name if p else pl.pack_id, "pack_state": str(p.state) if p else None,
                        "slurm_job_id": p.slurm_job_id if p else None, "attempt": pl.attempt, "node": pl.node,
                        "gpu": node_gpu(p.pack_dir if p else None, pl.node_index, pl.gpu_index, node_gpus),
                        "mps_pct": pl.mps_thread_pct,
                        "gpu_mem_limit_mib": (pl.gpu_mem_limit_bytes or 0) // MIB,
                        "host_mem_limit_mib": (pl.host_mem_limit_bytes or 0) // MIB, "cpus": pl.cpus,
                        "start_time": pl.start_time, "end_time": pl.end_time,
                        **({"rank": pl.rank or 0, "world_size": pl.world_size} if (pl.world_size or 1) > 1 else {})})
    raw_events = store.events(job_id=job_id)
    events = [{"t": e["t"], "kind": e["kind"], "from": e.get("from_state"), "to": e.get("to_state"),
               "reason": e["reason"]} for e in raw_events]
    # a `--trials` variant: which trial, which values, the sampler and its seed
    draw = next((e["data"] for e in raw_events if e["kind"] == "sweep_draw"), None)
    return {
        **row, "user": job.user, "submit_time": job.submit_time, "start_time": job.start_time,
        "end_time": job.end_time, "exit_code": job.exit_code, "gpu_model": job.gpu_model,
        "estimate": job.estimate, "gpu_mem_request_mib": (job.gpu_mem_request_bytes or 0) // MIB,
        "host_mem_request_mib": (job.host_mem_request_bytes or 0) // MIB,
        "options": _options(job), "spec": job.spec, "placements": history, "events": events,
        "mode": job.mode, **({"no_pack": (job.sbatch or {}).get("no_pack") or {}} if job.no_pack else {}),
        **({"draw": draw} if draw is not None else {}),
    }


def _options(job: Any) -> dict[str, Any]:
    from slurm_dlrm.service.common import job_options

    return job_options(job).to_dict()
