"""`submit --no-pack` jobs in the store (issue 23, "one job identity").

A no-pack job is a store row like any other (our id first, its Slurm id beside it), in
mode "no-pack": it is never planned into a pack; its own Slurm job carries the
`mode=no-pack,gpu_mem_mib=..,job_id=<our id>` marker (docs/interfaces.md section 6).

Nothing half-done:
- the rows are written (PENDING, one transaction) before any sbatch, so a Slurm job
  always has its row; sbatch refused -> the row is FAILED with Slurm's words;
- sbatch answered -> PLANNED with the Slurm id; if that write fails, the Slurm job is
  scancel'ed (no job runs that the store does not know);
- a `submit` killed between the two leaves a PENDING row without a Slurm id: the service
  looks for the marker's job_id in squeue after `sbatch_timeout_s` and records the Slurm
  id it finds, or fails the row ("submit stopped before Slurm answered").

The service settles them each round from squeue (start, nodes, the node's GPU index),
then squeue's or sacct's end state and exit code, as it settles packs (core.observe).
"""

from __future__ import annotations

import logging
import os
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_dlrm.errors import (
    TRAIN_EXIT_BAD_SPEC,
    TRAIN_EXIT_OOM_GPU,
    TRAIN_EXIT_OOM_HOST,
    TRAIN_EXIT_PREEMPTED,
)
from slurm_dlrm.service.sbatch_options import sbatch_line

# A multi-node job's run that ended with a lost node (the service runs it again): its seconds
EARLIER_RUN_EVENT = "earlier_run"

log = logging.getLogger(__name__)

# Endings after which Slurm requeues a batch job that allows it (ours: --requeue).
SLURM_REQUEUES = frozenset({"NODE_FAIL", "BOOT_FAIL", "PREEMPTED"})

# What queue/show print for a no-pack job in the PACK column (it has none).
NO_PACK_LABEL = "no-pack"
SUBMITTING_REASON = "submitting to Slurm"


@dataclass(frozen=True)
class NativeEnding:
    """How a no-pack job's Slurm job ended, as our lifecycle records it."""

    state: str  # a store JobState value
    reason: str
    exit_code: int | None


def exit_status(exit_code: int | None, signal: int | None) -> int | None:
    """One number like the agent records: the batch script's exit code, or 128+N for
    death by signal N (acct prints it as code:signal)."""
    if signal:
        return 128 + int(signal)
    return exit_code


def native_ending(slurm_state: str, exit_code: int | None, signal: int | None, reason: str = "") -> NativeEnding:
    """Pure: Slurm's end state and exit of a no-pack job -> our state, reason, exit code."""
    base = (slurm_state or "").split(" ", 1)[0].upper()
    code = exit_status(exit_code, signal)
    detail = f" ({reason})" if reason and reason not in ("None", "NonZeroExitCode") else ""
    if base == "COMPLETED" and (code or 0) == 0:
        return NativeEnding("COMPLETED", "exited 0", 0 if code is None else code)
    if base == "CANCELLED":
        stop = "; stopped at a checkpoint" if exit_code == TRAIN_EXIT_PREEMPTED else ""
        return NativeEnding("CANCELLED", f"cancelled in Slurm{stop}", code)
    if base == "OUT_OF_MEMORY" or code == TRAIN_EXIT_OOM_HOST:
        return NativeEnding("OOM", "out of host memory" + (" (Slurm: OUT_OF_MEMORY)" if base == "OUT_OF_MEMORY"
                                                          else f" (runner exit code {code})"), code)
    if code == TRAIN_EXIT_OOM_GPU:
        return NativeEnding("OOM", f"out of GPU memory (runner exit code {code})", code)
    if base == "TIMEOUT":  # its own limit, as Slurm records it (issue 42: was FAILED)
        stop = "; stopped at a checkpoint" if exit_code == TRAIN_EXIT_PREEMPTED else ""
        return NativeEnding("TIMEOUT", f"reached its time limit (Slurm: TIMEOUT){stop}", code)
    if code == TRAIN_EXIT_BAD_SPEC:
        return NativeEnding("FAILED", f"the spec did not validate (runner exit code {code})", code)
    what = f"exit code {code}" if code is not None and not signal else (f"signal {signal}" if signal else "")
    return NativeEnding("FAILED", f"Slurm: {base or 'UNKNOWN'}" + (f", {what}" if what else "") + detail, code)


def gpu_share(gres: str, mps_per_gpu: int) -> float:
    """The GPUs a --gres request holds: gpu:N -> N, mps:N -> N/mps_per_gpu."""
    kind, _, n = gres.rpartition(":")
    count = float(n) if n.isdigit() else 1.0
    if kind.startswith("mps"):
        return round(count / max(1, mps_per_gpu), 4)
    return count


# ---------------------------------------------------------------- submit side

@dataclass(frozen=True)
class NativeRequest:
    """One ordinary Slurm job sized from the estimate (the Slurm-native path)."""

    mem_mib: int
    cpus: int
    gres: str  # "gpu:1" or "mps:N"
    gpu_mem_mib: int  # per GPU: the fence the marker carries
    mps_pct: int | None = None  # the MPS share's thread percentage (None: whole GPUs)
    # [mps] cross_user = "one-user": an MPS share asks for --exclusive=user itself (job_submit.lua
    # sets it anyway), so `--test-only` and the script show what Slurm will do.
    exclusive_user: bool = False
    # a multi-node job (service/multinode.py): `nodes` nodes, `ranks_per_node` tasks each;
    # `gres` and `mem_mib` are per node, `cpus` per rank
    nodes: int = 1
    ranks_per_node: int = 1
    exclusive: bool = False
    # the GPUs it holds on each node: ranks_per_node, or every GPU of the node with
    # --exclusive; the charge until Slurm says what it allocated (the local cluster gives
    # a 2 x gpu:2 --exclusive job gres/gpu=4: _allocated_gpus then charges 4)
    node_gpus: int = 0

    @property
    def multinode(self) -> bool:
        return self.nodes > 1

    def comment(self, job_id: int | None = None) -> str:
        """The --comment marker job_submit.lua reads (docs/interfaces.md section 6)."""
        from slurm_dlrm.admin.marker import MODE_NO_PACK, format_marker

        return format_marker(MODE_NO_PACK, gpu_mem_mib=self.gpu_mem_mib, job_id=job_id)

    def to_dict(self) -> dict[str, Any]:
        return {"mem_mib": self.mem_mib, "cpus": self.cpus, "gres": self.gres, "gpu_mem_mib": self.gpu_mem_mib,
                "mps_pct": self.mps_pct, "exclusive_user": self.exclusive_user,
                **({"nodes": self.nodes, "ranks_per_node": self.ranks_per_node, "exclusive": self.exclusive,
                    "node_gpus": self.node_gpus} if self.multinode else {})}

    @property
    def gpus(self) -> float:
        """Whole GPUs the job holds over all its nodes (an MPS share: 0): what accounting
        charges it for its time."""
        kind, _, n = self.gres.partition(":")
        if kind != "gpu" or not n.isdigit():
            return 0.0
        return float(max(int(n), self.node_gpus) * self.nodes)

    @property
    def on_mps(self) -> bool:
        return self.gres.startswith("mps:")



def native_flags(sub: Any, req: Any, job_id: int | None = None) -> list[str]:
    """The --no-pack job's sbatch flags (unquoted), sorted; the marker names our job id."""
    if getattr(req, "multinode", False):
        from slurm_dlrm.service.multinode import multinode_flags

        return sorted([f"--comment={req.comment(job_id)}", f"--job-name={sub.name}", *multinode_flags(req),
                       *sub.options.sbatch_flags(include_job_name=False)])
    return sorted([f"--comment={req.comment(job_id)}", f"--cpus-per-task={req.cpus}", f"--gres={req.gres}",
                   f"--job-name={sub.name}", f"--mem={req.mem_mib}M", "--ntasks=1",
                   # Slurm reruns it after a node failure (whatever the site's JobRequeue);
                   # the runner resumes from its checkpoint in the job's spool folder
                   "--requeue",
                   *(["--nodes=1"] if sub.spec.world_size > 1 else []),
                   *(["--exclusive=user"] if req.exclusive_user else []),
                   *sub.options.sbatch_flags(include_job_name=False)])


def native_script(sub: Any, req: Any, spec_path: str, python: str,
                  job_id: int | None = None) -> str:
    """A plain batch script: #SBATCH lines (quoted, sorted) and the training command,
    its metrics and checkpoints in the job's spool folder (as a pack member's are)."""
    from slurm_dlrm.errors import ENV_CHECKPOINT_DIR, ENV_METRICS_FILE

    flags = native_flags(sub, req, job_id)
    command = list(sub.spec.command or [python, "-m", "slurm_dlrm", "train", spec_path])
    job_dir = os.path.dirname(spec_path)
    lines = ["#!/bin/bash", f"# slurm-dlrm --no-pack job {sub.name}"
             + (f" (slurm-dlrm job {job_id})" if job_id is not None else "") + ": one job, sized from its estimate."]
    lines += [f"#SBATCH {sbatch_line(f)}" for f in flags]
    lines += ["", f"export {ENV_METRICS_FILE}={shlex.quote(os.path.join(job_dir, 'metrics.jsonl'))}",
              f"export {ENV_CHECKPOINT_DIR}={shlex.quote(os.path.join(job_dir, 'ckpt'))}"]
    if getattr(req, "multinode", False):
        from slurm_dlrm.service.multinode import launch_lines

        lines += [*launch_lines(command), ""]
    else:
        lines += ["exec " + " ".join(shlex.quote(a) for a in command), ""]
    return "\n".join(lines)


def native_args(sub: Any, job_dir: Path) -> list[str]:
    """sbatch's own arguments: run in the job's spool folder; its output where `slurm-dlrm
    log` and `show` read a runner's (output-<node>.log), unless the user gave -o."""
    return [*([] if sub.options.output else [f"--output={job_dir}/output-%N.log"]), f"--chdir={job_dir}"]


@dataclass(frozen=True)
class NativeSubmitted:
    job_id: int  # ours
    slurm_job_id: int | None  # None: sbatch refused (the row is FAILED, `error` says why)
    sub: Any  # service.submit.Submission
    req: Any  # service.submit.NativeRequest
    error: str = ""
    # sbatch timed out: Slurm may have the job. The row stays PENDING; the service
    # records the Slurm job its marker names, or fails the row (_find_unanswered).
    unanswered: bool = False


def record_and_submit(store: Any, slurm: Any, items: Sequence[tuple[Any, Any]], *, user: str, site: Any,
                      spool_dir: Any, python: str) -> list[NativeSubmitted]:
    """Rows first (one transaction), then one sbatch per job; see the module docstring."""
    from slurm_dlrm.service.daemon import ensure_private_dir
    from slurm_dlrm.service.spool import write_job_spec
    from slurm_dlrm.store.records import MODE_NO_PACK

    ids: list[int] = []
    with store.write():
        for sub, req in items:
            sbatch = {**sub.options.to_dict(), "no_pack": req.to_dict()}
            ids.append(int(store.add_job(
                user=user, name=sub.name, spec=sub.spec_data, spec_fingerprint=sub.fingerprint,
                estimate=sub.estimate.to_dict(), gpu_model=sub.gpu.name, sbatch=sbatch, mode=MODE_NO_PACK,
                gpu_share=req.gpus if getattr(req, "multinode", False) else gpu_share(req.gres, site.mps.mps_per_gpu),
                reason=f"submitted from {sub.path} (" + (
                    f"not packed: {req.nodes} nodes x {req.ranks_per_node} GPUs, a Slurm job of its own)"
                    if getattr(req, "multinode", False) else "--no-pack: a Slurm job of its own)"))))
            if sub.draw is not None:  # a --trials variant: where it came from
                from slurm_dlrm.service.sweep import record_draw

                record_draw(store, ids[-1], sub.draw)
    ensure_private_dir(spool_dir)
    out = []
    for job_id, (sub, req) in zip(ids, items, strict=True):
        try:
            spec_path = write_job_spec(spool_dir, job_id, sub.spec_data)
            script = native_script(sub, req, str(spec_path), python, job_id=job_id)
        except OSError as exc:
            from slurm_dlrm.store.states import JobState

            store.transition_job(job_id, JobState.FAILED, f"not submitted: spool: {exc}", expect=JobState.PENDING)
            raise
        out.append(_sbatch_one(store, slurm, job_id, sub, req, script, native_args(sub, spec_path.parent)))
    return out


def _sbatch_one(store: Any, slurm: Any, job_id: int, sub: Any, req: Any, script: str,
                args: list[str]) -> NativeSubmitted:
    from slurm_dlrm.service.common import slurm_message
    from slurm_dlrm.slurm import SlurmError, SlurmTimeout
    from slurm_dlrm.store.states import JobState

    try:
        sid = int(slurm.sbatch(script, args))
    except SlurmError as exc:
        msg = slurm_message(exc)
        if isinstance(exc, SlurmTimeout) or "timed out" in msg.lower():
            # slurmctld may have taken it: not FAILED until the service looked (by marker)
            store.add_event("note", f"sbatch did not answer: {msg}", job_id=job_id)
            return NativeSubmitted(job_id, None, sub, req, error=msg, unanswered=True)
        store.transition_job(job_id, JobState.FAILED, f"sbatch refused: {msg}", expect=JobState.PENDING)
        return NativeSubmitted(job_id, None, sub, req, error=msg)
    try:
        store.transition_job(job_id, JobState.PLANNED, f"submitted to Slurm as job {sid}",
                             expect=JobState.PENDING, slurm_job_id=str(sid))
    except BaseException:
        # No Slurm job the store does not know: take it back, then say why.
        try:
            slurm.scancel([sid])
        except SlurmError as exc:
            log.error("job %d: recording Slurm job %d failed and scancel failed too: %s", job_id, sid, exc)
        raise
    return NativeSubmitted(job_id, sid, sub, req)


# ---------------------------------------------------------------- service side

def active_native_jobs(store: Any, user: str) -> list[Any]:
    from slurm_dlrm.store.states import JobState

    return [j for j in store.jobs([JobState.PENDING, JobState.PLANNED, JobState.RUNNING], user=user) if j.no_pack]


def observe_native(svc: Any, jobs: Sequence[Any], infos: Sequence[Any], stats: Any) -> None:
    """Settle the user's no-pack jobs from one squeue answer (`infos`), sacct for those
    gone from it. `svc` is the PackingService (store, Slurm client, clock, back-off)."""
    from slurm_dlrm.store.errors import StoreError

    by_id = {str(i.job_id): i for i in infos}
    for job in jobs:
        try:
            if job.slurm_job_id is None:
                _find_unanswered(svc, job, infos, stats)
                continue
            info = by_id.get(job.slurm_job_id)
            if info is not None and not info.state.is_terminal:
                _follow_live(svc, job, info, stats)
            else:
                _settle_ended(svc, job, info, stats)
        except StoreError as exc:
            # one job's refused move (e.g. a cancel landed meanwhile) must not stop the
            # round from following the packs and the other jobs; the next round retries
            log.warning("no-pack job %d (Slurm %s): %s", job.id, job.slurm_job_id, exc)


def _find_unanswered(svc: Any, job: Any, infos: Sequence[Any], stats: Any) -> None:
    """A row whose `submit` stopped before sbatch answered (killed, Ctrl-C)."""
    from slurm_dlrm.admin.marker import parse_marker
    from slurm_dlrm.errors import BadInput
    from slurm_dlrm.store.errors import StaleState
    from slurm_dlrm.store.states import JobState

    if job.state != JobState.PENDING or svc.clock() - job.submit_time < svc.settings.sbatch_timeout_s + 5.0:
        return  # its submit may still be waiting for sbatch
    found = None
    for info in infos:
        try:
            marker = parse_marker(info.comment)
        except BadInput:
            continue
        if marker is not None and marker.job_id == job.id and marker.mode == "no-pack":
            found = info
    try:
        if found is None:
            svc.store.transition_job(job.id, JobState.FAILED, "submit stopped before Slurm answered; "
                                     "not in Slurm (submit it again)", expect=JobState.PENDING)
        else:
            svc.store.transition_job(job.id, JobState.PLANNED, f"found in Slurm as job {found.job_id} "
                                     "(its submit stopped before recording it)", expect=JobState.PENDING,
                                     slurm_job_id=str(found.job_id))
    except StaleState:
        return
    stats.transitions += 1


def _follow_live(svc: Any, job: Any, info: Any, stats: Any) -> None:
    from slurm_dlrm.slurm import JobState as SJ
    from slurm_dlrm.store.states import JobState

    if info.state not in (SJ.RUNNING, SJ.COMPLETING, SJ.SUSPENDED):
        return  # pending in Slurm: `queue` shows Slurm's reason
    gpus = _allocated_gpus(job, info.tres)
    if (info.nodes and info.nodes != job.nodes) or (info.gpu_idx and info.gpu_idx != job.gpu_idx) or gpus:
        svc.store.set_job_allocation(job.id, nodes=info.nodes or None, gpu_idx=info.gpu_idx or None, gpu_share=gpus)
    if job.state == JobState.PLANNED:
        start = float(info.start_time) if info.start_time else None
        svc.store.transition_job(job.id, JobState.RUNNING, f"Slurm job {job.slurm_job_id} started"
                                 + (f" on {info.nodes}" if info.nodes else ""), expect=JobState.PLANNED,
                                 t=min(start, svc.clock()) if start else None)
        stats.transitions += 1


def _settle_ended(svc: Any, job: Any, info: Any, stats: Any) -> None:
    """Ended in squeue, or gone from it: the end from squeue, else sacct."""
    from slurm_dlrm.service.common import is_unreachable, sacct_time
    from slurm_dlrm.slurm import AccountingDisabled, SlurmError
    from slurm_dlrm.slurm.parse import parse_sacct_exit_code
    from slurm_dlrm.store.states import JobState

    state = code = sig = None
    start = end = None
    nodes = None
    reason = ""
    rows: list[Any] = []
    alloc_tres = ""  # it may have run between two polls: what Slurm allocated it
    if info is not None:
        state, code, sig, reason = info.slurm_state, info.exit_code, info.signal, info.reason or ""
        start = float(info.start_time) if info.start_time else None
        alloc_tres = info.tres if start is not None else ""
        end = float(info.end_time) if info.end_time else None
        nodes = info.nodes or None
    else:
        try:
            rows = svc.slurm.sacct([int(job.slurm_job_id)],
                                   ["JobID", "State", "ExitCode", "NodeList", "Start", "End", "AllocTRES"])
        except AccountingDisabled:
            rows = []
        except SlurmError as exc:
            if is_unreachable(exc):
                svc._slurm_failed(exc)
            else:
                log.warning("sacct for job %d (Slurm %s) failed: %s", job.id, job.slurm_job_id, exc)
            return
        # --duplicates: a job Slurm requeued has a row per run, oldest first; the last is this one's
        line = next((r for r in reversed(rows) if r.step is None), None)
        if line is None or not line.state.is_terminal:
            if line is None and svc.clock() - job.updated_time > 600.0:
                # no accounting and squeue forgot it (MinJobAge): the end is unknown
                svc.store.transition_job(job.id, JobState.FAILED, f"Slurm no longer knows job {job.slurm_job_id} "
                                         "(no accounting to say how it ended)", expect=job.state)
                stats.transitions += 1
            return  # sacct lags slurmctld by a moment: next round
        state = line.get("State")
        code, sig = parse_sacct_exit_code(line.get("ExitCode"))
        start, end = sacct_time(line.get("Start")), sacct_time(line.get("End"))
        n = line.get("NodeList")
        nodes = n if n and n != "None assigned" else None
        alloc_tres = line.get("AllocTRES")
    if info is not None and str(state).split(" ", 1)[0].upper() in SLURM_REQUEUES and not is_multinode_job(job):
        # Still in squeue: Slurm requeues it (--requeue) and runs it again, resumed from its
        # checkpoint; its end is the rerun's (issue 49: recorded FAILED at NODE_FAIL, the
        # job then ran again unseen). A multi-node job is --no-requeue: the service reruns it.
        return
    ending = native_ending(str(state), code, sig, reason)
    if str(state).split(" ", 1)[0].upper() == NODE_FAIL_STATE and is_multinode_job(job) \
            and job.attempt + 1 < svc.settings.max_attempts:
        _requeue_node_fail(svc, job, start, end, stats)
        return
    tail = _output_error(svc, job) if ending.state == "FAILED" else ""
    now = svc.clock()
    gpus = _allocated_gpus(job, alloc_tres)
    if (nodes and nodes != job.nodes) or gpus:
        svc.store.set_job_allocation(job.id, nodes=nodes, gpu_share=gpus)
    run_s = None
    if start is not None and end is not None and (info is None or info.restart_count > 0):
        run_s = _slurm_run_s(svc, job, start, end, rows if info is None else None)
    if start is not None and end is not None and is_multinode_job(job):
        # a multi-node job the service ran again after a lost node: each Slurm job's run,
        # not the waits between them (its start stays its first run's)
        earlier = sum(float((e.get("data") or {}).get("run_s") or 0.0)
                      for e in svc.store.events(job_id=job.id, kind=EARLIER_RUN_EVENT))
        if earlier > 0:
            run_s = earlier + max(0.0, end - start)
    with svc.store.write():
        if run_s is not None:
            svc.store.set_job_slurm_run_s(job.id, run_s)
        if job.state == JobState.PLANNED and (start is not None or ending.state in ("COMPLETED", "TIMEOUT")):
            # it ran between two polls
            svc.store.transition_job(job.id, JobState.RUNNING, f"Slurm job {job.slurm_job_id} started",
                                     expect=JobState.PLANNED, t=min(start or end or now, now))
        svc.store.transition_job(job.id, JobState(ending.state), ending.reason + (f": {tail}" if tail else ""),
                                 exit_code=ending.exit_code, t=None if end is None else max(min(end, now),
                                                                                           start or 0.0))
    stats.transitions += 1


def _slurm_run_s(svc: Any, job: Any, last_start: float, end: float, rows: Any = None) -> float | None:
    """Seconds a job Slurm requeued (--requeue: a node lost) ran: its earlier runs as sacct
    --duplicates lists them plus the last (`last_start` to `end`), so acct does not charge
    the waits between them (issue 49). None: it ran once, or no accounting to say."""
    from slurm_dlrm.service.common import sacct_time
    from slurm_dlrm.slurm import SlurmError

    if rows is None:
        try:
            rows = svc.slurm.sacct([int(job.slurm_job_id)], ["JobID", "State", "Start", "End"])
        except SlurmError as exc:  # AccountingDisabled too: charged start to end, as before
            log.info("sacct for job %d (Slurm %s): %s; charged from its start to its end", job.id,
                     job.slurm_job_id, exc)
            return None
    earlier = 0.0
    runs = 0
    for r in rows:
        t0, t1 = sacct_time(r.get("Start") or ""), sacct_time(r.get("End") or "")
        if r.step is None and t0 is not None and t1 is not None and t0 < last_start - 0.5:
            earlier += max(0.0, min(t1, last_start) - t0)
            runs += 1
    return earlier + max(0.0, end - last_start) if runs else None


def _output_error(svc: Any, job: Any) -> str:
    """The runner's one-line cause from the job's output in its spool folder, if any."""
    from slurm_dlrm.agent.outlog import error_line, short_reason, tail_lines
    from slurm_dlrm.service.joblog import log_paths

    for path in reversed(log_paths(svc.spool_dir, job.id)):
        line = error_line(tail_lines(path, 40))
        if line:
            return short_reason(line, 200)
    return ""


# ---------------------------------------------------------------- cancel

def cancel_native(store: Any, slurm: Any, job: Any) -> str:
    """scancel a no-pack job's Slurm job (the caller checked the owner). A job whose
    sbatch has not answered yet is cancelled in the store; the service then finds no
    Slurm job for it, or scancels the one it finds."""
    from slurm_dlrm.service.common import slurm_message
    from slurm_dlrm.slurm import SlurmError
    from slurm_dlrm.store.errors import StaleState
    from slurm_dlrm.store.states import JobState

    if job.slurm_job_id is None:
        try:
            store.transition_job(job.id, JobState.CANCELLED, "cancelled by the user before sbatch answered",
                                 expect=JobState.PENDING)
        except StaleState:
            job = store.get_job(job.id)
            if job.slurm_job_id is None:
                return f"job {job.id} already ended ({job.state})"
        else:
            return f"job {job.id} cancelled (its sbatch had not answered)"
    try:
        slurm.scancel([int(job.slurm_job_id)])
    except SlurmError as exc:
        from slurm_dlrm.errors import DlrmError

        raise DlrmError(f"job {job.id}: scancel {job.slurm_job_id}: {slurm_message(exc)}") from None
    store.add_event("note", f"scancel {job.slurm_job_id} by the user", job_id=job.id)
    if job.state == JobState.PLANNED:
        # never started: nothing will report, and Slurm's CANCELLED says only that
        try:
            store.transition_job(job.id, JobState.CANCELLED, "cancelled by the user before it started",
                                 expect=JobState.PLANNED)
            return f"job {job.id} cancelled (Slurm job {job.slurm_job_id}, was queued)"
        except StaleState:
            pass
    return f"job {job.id} cancel sent to Slurm job {job.slurm_job_id}; it checkpoints and stops"


# ---------------------------------------------------------------- requeue (multi-node jobs)

# NODE_FAIL runs of one multi-node job the service requeues before it gives up (a pack's
# members are bounded the same way: ServiceSettings.max_attempts)
NODE_FAIL_STATE = "NODE_FAIL"


def is_multinode_job(job: Any) -> bool:
    req = (job.sbatch or {}).get("no_pack") or {}
    return bool(job.no_pack and int(req.get("nodes") or 1) > 1)


def _allocated_gpus(job: Any, tres: str | None) -> float | None:
    """A multi-node job's GPUs as Slurm allocated them (its TRES), where they differ from
    what is recorded: accounting charges what Slurm gave, not nodes x the node's GPUs
    (--exclusive gives a 2 x gpu:2 job on 4-GPU nodes gres/gpu=4 on the local cluster)."""
    from slurm_dlrm.slurm.parse import allocated_gpus

    if not tres or not is_multinode_job(job):
        return None
    gpus = allocated_gpus(tres)
    return float(gpus) if gpus and float(gpus) != job.gpu_share else None


def multinode_gpus_held(job: Any) -> int:
    """The GPUs a multi-node job holds (0 for any other job): the plan view counts them."""
    if not is_multinode_job(job):
        return 0
    req = job.sbatch["no_pack"]
    return int(req["nodes"]) * max(int(req.get("ranks_per_node") or 1), int(req.get("node_gpus") or 0))


@dataclass(frozen=True)
class _Resubmission:
    """What native_script needs, rebuilt from the job's row."""

    name: str
    spec: Any
    options: Any


def resubmit_native(store: Any, slurm: Any, job: Any, *, spool_dir: Path, python: str, reason: str,
                    how: str = "") -> str:
    """Run a multi-node job's Slurm job again (the same script from its row, a new Slurm
    id): PENDING (a new attempt), sbatch, PLANNED. Its ranks resume from the last
    complete checkpoint in its spool folder. Returns what was done."""
    from slurm_dlrm.service.sbatch_options import SbatchOptions
    from slurm_dlrm.service.spool import write_job_spec
    from slurm_dlrm.spec import parse_spec
    from slurm_dlrm.store.states import JobState

    sbatch = dict(job.sbatch or {})
    req = NativeRequest(**sbatch.pop("no_pack"))
    sub = _Resubmission(name=job.name, spec=parse_spec(job.spec), options=SbatchOptions.from_dict(sbatch))
    spec_path = write_job_spec(spool_dir, job.id, job.spec)
    script = native_script(sub, req, str(spec_path), python, job_id=job.id)
    store.transition_job(job.id, JobState.PENDING, reason, expect=job.state)
    done = _sbatch_one(store, slurm, job.id, sub, req, script, native_args(sub, spec_path.parent))
    if done.slurm_job_id is None:
        return f"job {job.id}: sbatch refused: {done.error}"
    return f"job {job.id} requeued as Slurm job {done.slurm_job_id}" + (f"; it {how}" if how else "")


def _requeue_node_fail(svc: Any, job: Any, start: float | None, end: float | None, stats: Any) -> None:
    """A multi-node job's node was lost (Slurm: NODE_FAIL): run it again, bounded by
    the service's max_attempts as a pack's members are. The lost run's seconds are kept
    (an `earlier_run` event) for the job's charge at its end."""
    from slurm_dlrm.service.joblog import last_checkpoint_step
    from slurm_dlrm.store.states import JobState

    if job.state == JobState.PLANNED:  # it ran between two polls
        svc.store.transition_job(job.id, JobState.RUNNING, f"Slurm job {job.slurm_job_id} started",
                                 expect=JobState.PLANNED, t=min(start or svc.clock(), svc.clock()))
        job = svc.store.get_job(job.id)
    if start is not None and end is not None:
        svc.store.add_event(EARLIER_RUN_EVENT, f"Slurm job {job.slurm_job_id} ran {max(0.0, end - start):.0f} s "
                            "before its node was lost", job_id=job.id,
                            data={"slurm_job_id": job.slurm_job_id, "run_s": max(0.0, end - start)})
    step = last_checkpoint_step(svc.spool_dir, job.id)
    how = f"resumes from its checkpoint at step {step}" if step is not None else "starts from step 0 (no checkpoint)"
    what = resubmit_native(svc.store, svc.slurm, job, spool_dir=svc.spool_dir, python=svc.settings.python,
                           reason=f"Slurm job {job.slurm_job_id} ended NODE_FAIL (a node was lost); requeued "
                                  f"(attempt {job.attempt + 2} of {svc.settings.max_attempts}); it {how}")
    log.warning("%s", what)
    stats.transitions += 1
