"""The packing service: each round *observe* (agent reports, Slurm) then *act* (plan, submit).

Mechanism only: which jobs share which GPUs is the policy's decision
(`slurm_dlrm.packing.plan`), what to do after an OOM or a lost pack is
`slurm_dlrm.adapt.recovery`'s. Every state change goes through the store's state
machines, so each one is checked and leaves an event row.

Crash safety (the service may be killed at any instant and restarted):

- A pack row is written (SUBMITTING, with a unique name, its members PLANNED) in one
  transaction *before* sbatch runs, and `--job-name` carries that name. A pack still
  SUBMITTING on the next round is looked up in squeue by name: found -> its Slurm id is
  recorded; not found -> sbatch runs again. A marker file with the time sbatch was
  started keeps a restarted service from resubmitting while a killed service's sbatch
  may still be in flight (it waits `sbatch_timeout_s` first), so a pack is never
  submitted twice.
- Agent reports are ingested by the store exactly once (offsets move in the same
  transaction as the state changes they cause).
- Nothing is kept only in memory that a restart needs: the in-memory heartbeat times and
  back-off are rebuilt from scratch without losing a job.

Over 600 lines: one class, the round, whose observe and act halves share the service's
state (store, Slurm client, back-off, heartbeats) in nearly every method; recovery,
refill, cancel and the helpers they share already live apart (recovery.py, refill.py,
cancel.py, common.py), as do the parts `PackingService` inherits: settling ended packs
(pack_end.py), writing the pack folder (pack_folder.py) and the nodes a round plans on
(plan_view.py); its settings and a round's
figures are in settings.py.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slurm_dlrm.service.common import (
    SBATCH_MARKER,
    fault_runs,
    is_unreachable,
    job_options,
    pack_member_ids,
    slurm_message,
)
from slurm_dlrm.service.pack_end import PackEnding
from slurm_dlrm.service.pack_folder import PackFolder
from slurm_dlrm.service.plan_view import PlanView
from slurm_dlrm.service.sbatch_options import SbatchOptions
from slurm_dlrm.service.settings import RoundStats, ServiceSettings
from slurm_dlrm.site import MIB, SiteConfig

log = logging.getLogger(__name__)

STARTING_ROUND_S = 2.0  # rounds this often while packs start (next_delay_s)

# A pinned pack waits "Resources" on its node at most this long (or this many dispatch
# windows): the plan saw the node free, so a longer wait means someone else took it.
PIN_WAIT_MIN_S = 60.0
PIN_WAIT_ROUNDS = 6
# squeue's reasons for a job whose requested node cannot run it now (down, drained,
# reserved, gone from the partition): a pinned pack with one is withdrawn at once.
NODE_UNAVAILABLE_REASONS = ("ReqNodeNotAvail", "NodeDown", "Nodes required for job are DOWN",
                            "PartitionNodeLimit", "PartitionConfig")

# How often the service prunes old samples (site.sample_retention_days): a prune scans
# by time index and deletes in short transactions, so hourly is cheap and keeps the
# store's size bounded.
PRUNE_EVERY_S = 3600.0


def new_pack_name() -> str:
    """Unique across stores and users: the key a restarted service finds its pack by."""
    return f"dlrm-{secrets.token_hex(6)}"


class PackingService(PackEnding, PackFolder, PlanView):
    """One user's service. Not thread-safe; one instance per process."""

    def __init__(self, store: Any, slurm: Any, site: SiteConfig, settings: ServiceSettings, *,
                 clock: Callable[[], float] = time.time, spool_dir: Path | None = None) -> None:
        self.store = store
        self.slurm = slurm
        self.site = site
        self.settings = settings
        self.clock = clock
        self.spool_dir = spool_dir if spool_dir is not None else site.spool_dir_for(settings.user)
        self.policy = settings.policy or site.packing.policy
        self.backoff_s = 0.0
        self.slurm_retry_at = 0.0
        self.slurm_error: str | None = None
        self.heartbeats: dict[int, float] = {}
        self._slurm_cancelled: dict[Any, bool] = {}  # pack id -> its Slurm job was cancelled (scancel)
        self.waited_rounds: dict[int, int] = {}
        self.deferred_reasons: dict[int, str] = {}  # why the last round left each job waiting (queue)
        self.rounds = 0
        self._spool_ready = False
        self.last_dispatch_t: float | None = None
        self.last_prune_t: float | None = None
        # `scontrol show nodes` of this round's dispatch, read once (issue 43 item 3):
        # None until read, then the nodes or the failure's text
        self._round_nodes: list[Any] | str | None = None
        from slurm_dlrm.service.recovery import Recovery

        self.recovery = Recovery(self)  # OOM retry, lost packs, stragglers, warm start (issue 10)
        from slurm_dlrm.service.refill import Refill

        self.refill = Refill(self)  # pending jobs join running packs (docs/interfaces.md 3b)
        from slurm_dlrm.service.sweep_stop import SweepStop

        # a sweep's stopping rule: pauses and promotes variants at their rungs (issue 47)
        self.sweep_stop = SweepStop(store, settings.user, clock)

    # ------------------------------------------------------------ the round

    def run_round(self) -> RoundStats:
        """Observe, then act. Returns what happened (for logs, tests and benchmarks)."""
        t0 = time.perf_counter()
        stats = RoundStats()
        self.rounds += 1
        self.observe(stats)
        self.recovery.maybe_refit()  # the interference model from measured co-locations, every N rounds
        self.act(stats)
        self.prune_samples(stats)
        stats.slurm_ok = self.slurm_error is None
        stats.seconds = time.perf_counter() - t0
        return stats

    def prune_samples(self, stats: RoundStats) -> int:
        """Delete samples older than the site's `sample_retention_days`, once per
        PRUNE_EVERY_S (the first round after a start included). acct keeps its figures."""
        days = self.site.sample_retention_days
        now = self.clock()
        if days <= 0 or (self.last_prune_t is not None and now - self.last_prune_t < PRUNE_EVERY_S):
            return 0
        self.last_prune_t = now
        n = int(self.store.prune_samples(now - days * 86400.0))
        if n:
            stats.notes.append(f"pruned {n} samples older than {days:g} days")
        return n

    def next_delay_s(self) -> float | None:
        """A back-off hint for the loop while Slurm is unreachable; a short one while a
        pack is being submitted or its agent starts members (issue 42: queue showed
        PLANNED for 8-15 s after squeue showed the pack R, and `submit --wait` never
        showed RUNNING). A pack waiting in Slurm's queue gets no hurry: that may be hours."""
        from slurm_dlrm.store.states import JobState, PackState

        if self.slurm_error is not None:
            return max(0.1, self.slurm_retry_at - self.clock())
        if any(True for _ in self.store.packs([PackState.SUBMITTING], user=self.settings.user)):
            return STARTING_ROUND_S
        running = {p.id for p in self.store.packs([PackState.RUNNING], user=self.settings.user)}
        if any(j.pack_id in running for j in self.store.jobs([JobState.PLANNED], user=self.settings.user)):
            return STARTING_ROUND_S
        return None

    def status(self) -> dict[str, Any]:
        """What `queue` and `serve status` show about the service."""
        now = self.clock()
        return {
            "pid": os.getpid(), "user": self.settings.user, "policy": self.policy, "rounds": self.rounds,
            "interference_model": self.recovery.interference_source,
            "last_round_t": now, "slurm_ok": self.slurm_error is None, "slurm_error": self.slurm_error,
            "slurm_retry_in_s": None if self.slurm_error is None else round(max(0.0, self.slurm_retry_at - now), 1),
            "next_dispatch_in_s": 0.0 if self.last_dispatch_t is None else
            round(max(0.0, self.last_dispatch_t + self.dispatch_window_s - now), 1),
            # the policy's words for each waiting job (issue 31), the 1000 newest
            "deferred": {str(k): v for k, v in sorted(self.deferred_reasons.items())[-1000:]},
        }

    # ------------------------------------------------------------ Slurm availability

    def _slurm_available(self) -> bool:
        return self.slurm_error is None or self.clock() >= self.slurm_retry_at

    def _slurm_failed(self, exc: BaseException) -> None:
        self.backoff_s = min(self.settings.backoff_max_s, max(self.settings.backoff_min_s, self.backoff_s * 2))
        self.slurm_retry_at = self.clock() + self.backoff_s
        self.slurm_error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        log.warning("Slurm unreachable (%s); retrying in %.0f s", self.slurm_error, self.backoff_s)

    def _slurm_ok(self) -> None:
        if self.slurm_error is not None:
            log.info("Slurm reachable again")
        self.slurm_error = None
        self.backoff_s = 0.0

    # ------------------------------------------------------------ observe

    def observe(self, stats: RoundStats) -> None:
        from slurm_dlrm.service.native import active_native_jobs, observe_native
        from slurm_dlrm.store.states import PACK_ACTIVE

        active = self.store.packs(PACK_ACTIVE, user=self.settings.user)
        for pack in active:
            stats.ingested_lines += self.ingest(pack)
        native = active_native_jobs(self.store, self.settings.user)  # submit --no-pack jobs
        self.ingest_evals()
        for note in self.sweep_stop.run():  # after the evals it judges, before dispatch refills the shares
            stats.notes.append(note)
        if not (active or native) or not self._slurm_available():
            return
        from slurm_dlrm.slurm import SlurmError

        try:
            infos = self.slurm.squeue(user=self.settings.user)
        except SlurmError as exc:
            if is_unreachable(exc):
                self._slurm_failed(exc)
                return
            raise
        self._slurm_ok()
        if native:
            observe_native(self, native, infos, stats)
        by_name = {i.name: i for i in infos}
        for pack in active:
            info = by_name.get(pack.name)
            if info is None and pack.slurm_job_id:
                info = next((i for i in infos if str(i.job_id) == pack.slurm_job_id), None)
            self.observe_pack(pack, info, stats)
        self.recovery.check_heartbeats(stats)
        self.recovery.check_warmup_and_stragglers()  # also run-time re-pack and warm-up re-plan
        self.refill.check_joiners(stats)  # rewrite lost join files, requeue joiners of closed nodes

    def ingest_evals(self) -> int:
        """Held-out evaluations from the metrics files of running and lately ended jobs
        (an hour back: a job's last lines land after its end is observed)."""
        from slurm_dlrm.store.evals import ingest_job_evals

        try:
            return ingest_job_evals(self.store, self.spool_dir, since=self.clock() - 3600.0)
        except OSError as exc:  # a spool on a network filesystem that hiccups: next round
            log.warning("cannot read evaluations from the spool: %s", exc)
            return 0

    def ingest(self, pack: Any) -> int:
        """Agent reports of one pack into the store, exactly once."""
        if not pack.pack_dir:
            return 0
        from slurm_dlrm.store.ingest import ingest_pack_reports

        result = ingest_pack_reports(self.store, pack.pack_dir, self._on_record)
        return int(result.lines)

    def _on_record(self, store: Any, rec: dict[str, Any]) -> None:
        """One agent record, inside the ingestion transaction (see store.ingest)."""
        kind = rec.get("type")
        pack_id = rec.get("pack_id")
        t = float(rec.get("t") or self.clock())
        if kind == "heartbeat":
            if isinstance(pack_id, int):
                self.heartbeats[pack_id] = max(t, self.heartbeats.get(pack_id, 0.0))
            return
        if kind == "agent":
            store.add_event("agent", str(rec.get("event") or "agent"), pack_id=pack_id, data=rec, t=t)
            return
        if kind != "member":
            return
        job_id = rec.get("job_id")
        if not isinstance(job_id, int):
            return
        self._apply_member_report(job_id, pack_id, str(rec.get("state") or ""), rec.get("exit_code"),
                                  str(rec.get("reason") or ""), t, requeue=rec.get("requeue") is True)

    def _apply_member_report(self, job_id: int, pack_id: Any, state: str, exit_code: Any,
                             reason: str, t: float, requeue: bool = False) -> None:
        """One member record into the job's state. A multi-rank job has one end record
        for all its ranks (the agent writes it once they all ended, docs/agent.md
        "Multi-rank jobs"); `requeue`: one of its ranks crashed or was killed, so the job
        goes back to the queue as a whole, all ranks resuming from its checkpoint."""
        from slurm_dlrm.store.states import JOB_TERMINAL, JobState

        s = self.store
        job = s.get_job(job_id)
        if job.pack_id != pack_id:
            log.info("ignoring a report of job %d from pack %s (its pack is now %s)", job_id, pack_id, job.pack_id)
            return
        if job.state in JOB_TERMINAL or job.state == JobState.PENDING:
            return  # already settled (e.g. cancelled, or requeued after its pack was lost)
        code = exit_code if isinstance(exit_code, int) else None
        why = reason or state.lower()
        if state == "RUNNING":
            if job.state == JobState.PLANNED:
                pack = s.get_pack(job.pack_id)
                s.transition_job(job_id, JobState.RUNNING, "member started", slurm_job_id=pack.slurm_job_id, t=t)
            return
        if job.state == JobState.PLANNED and (state in ("COMPLETED", "PREEMPTED", "TIMEOUT") or requeue):
            # the start record was never written (agent killed early); it did run
            s.transition_job(job_id, JobState.RUNNING, "member started (inferred)", t=t)
            job = s.get_job(job_id)
        if state == "COMPLETED":
            s.transition_job(job_id, JobState.COMPLETED, why, exit_code=code, t=t)
        elif state == "CANCELLED":
            # a straggler asked to move is requeued; a sweep variant paused at a rung is held
            if not (self.recovery.on_member_cancelled(job, t) or self.sweep_stop.on_member_cancelled(job, t)):
                s.transition_job(job_id, JobState.CANCELLED, why, exit_code=code, t=t)
        elif state in ("OOM_GPU", "OOM_HOST"):
            s.transition_job(job_id, JobState.OOM, why, exit_code=code, t=t,
                             data={"kind": "gpu" if state == "OOM_GPU" else "host"})
            self._after_oom(job_id, "gpu" if state == "OOM_GPU" else "host", t)
        elif state == "TIMEOUT":
            s.transition_job(job_id, JobState.TIMEOUT, why, exit_code=code, t=t)
        elif state == "PREEMPTED" and self._cancelled_in_slurm(pack_id):
            # a user's scancel of the pack's Slurm job (issue 42 item 7: it was re-packed and
            # run again); the member checkpointed, so `requeue` resumes it
            s.transition_job(job_id, JobState.CANCELLED, f"its pack's Slurm job was cancelled (scancel); {why}; "
                             f"`slurm-dlrm requeue {job_id}` resumes it", exit_code=code, t=t)
        elif state == "PREEMPTED":
            self._requeue(job, f"preempted ({why}); resumes from its checkpoint", t)
        elif state == "FAILED" and requeue and self._cancelled_in_slurm(pack_id):
            # killed by a user's scancel of the pack (its SIGKILL after KillWait): theirs to requeue
            s.transition_job(job_id, JobState.CANCELLED, f"its pack's Slurm job was cancelled (scancel); {why}; "
                             f"`slurm-dlrm requeue {job_id}` resumes it", exit_code=code, t=t)
        elif state == "FAILED" and requeue:
            what = "a rank failed" if why.startswith("rank ") else "killed from outside"
            self._requeue(job, f"{what} ({why}); {'all ranks resume' if what == 'a rank failed' else 'resumes'} "
                               "from its checkpoint", t)
        elif state == "FAILED":
            s.transition_job(job_id, JobState.FAILED, why, exit_code=code, t=t)
        else:
            log.warning("job %d: unknown member state %r in a report", job_id, state)

    def _cancelled_in_slurm(self, pack_id: Any) -> bool:
        """The pack's Slurm job was cancelled, not preempted nor signalled ahead of its time
        limit (those find it RUNNING): sacct says CANCELLED, or, without accounting, Slurm
        shows it COMPLETING while its members stop. Asked again until it says cancelled
        (then final): a member killed earlier in the pack's life must not fix the answer."""
        from slurm_dlrm.slurm import AccountingDisabled, SlurmError
        from slurm_dlrm.slurm import JobState as SJ

        if pack_id in self._slurm_cancelled:
            return self._slurm_cancelled[pack_id]
        pack = self.store.get_pack(pack_id) if isinstance(pack_id, int) else None
        verdict = False
        if pack is not None and pack.slurm_job_id:
            sid = int(pack.slurm_job_id)
            try:
                line = next((r for r in self.slurm.sacct([sid], ["JobID", "State"]) if r.step is None), None)
                if line is not None:
                    verdict = line.get("State").startswith("CANCELLED")
                else:
                    info = self.slurm.show_job(sid)
                    verdict = info is not None and info.state in (SJ.COMPLETING, SJ.CANCELLED)
            except AccountingDisabled:
                try:
                    info = self.slurm.show_job(sid)
                except SlurmError:
                    info = None
                verdict = info is not None and info.state in (SJ.COMPLETING, SJ.CANCELLED)
            except SlurmError as exc:
                log.warning("pack %s: could not ask Slurm how it ended (%s); its members are requeued", pack.name, exc)
        if verdict:
            self._slurm_cancelled[pack_id] = verdict
        return verdict

    def _after_oom(self, job_id: int, kind: str, t: float) -> None:
        self.recovery.after_oom(job_id, kind, t)  # raise and requeue, or say why not (service/recovery.py)

    def _usage_peak(self, job_id: int, column: str) -> int | None:
        usage = self.store.usage(job_id)
        value = None if usage is None else getattr(usage, column)
        return None if value is None else int(value)

    def _requeue(self, job: Any, reason: str, t: float | None = None) -> None:
        """A run ended by a fault not the job's own: back to PENDING (resumes from its
        checkpoint), or FAILED once max_fault_runs runs ended so (`fault_runs`)."""
        from slurm_dlrm.store.states import JobState

        faults = fault_runs(self.store, job.id) + 1
        if job.state == JobState.RUNNING and faults >= self.settings.max_fault_runs:
            self.store.transition_job(job.id, JobState.FAILED, f"{reason}; gave up after {faults} runs ended by "
                                      f"faults", t=t, data={"fault": True})
            return
        self.store.transition_job(job.id, JobState.PENDING, reason, t=t, data={"fault": True})

    def observe_pack(self, pack: Any, info: Any, stats: RoundStats) -> None:
        from slurm_dlrm.slurm import JobState as SJ
        from slurm_dlrm.store.states import PackState

        if pack.state == PackState.SUBMITTING:
            if info is not None:
                to = PackState.RUNNING if info.state in (SJ.RUNNING, SJ.COMPLETING, SJ.SUSPENDED) else PackState.QUEUED
                if info.state.is_terminal:
                    to = PackState.QUEUED  # seen next round as ended
                self.store.transition_pack(pack.id, to, "found in Slurm by its name after a restart",
                                           slurm_job_id=str(info.job_id), nodes=info.nodes or None)
                stats.transitions += 1
            elif self._may_resubmit(pack):
                self._submit_pack(pack, stats)
            return
        if info is None:
            self._pack_vanished(pack, stats)
            return
        if info.state in (SJ.RUNNING, SJ.COMPLETING, SJ.SUSPENDED):
            if info.end_time:  # squeue's EndTime of a running job: start + time limit
                self.refill.end_t[pack.id] = float(info.end_time)
            if pack.state == PackState.QUEUED:
                start = float(info.start_time) if info.start_time else None
                self.store.transition_pack(pack.id, PackState.RUNNING, "allocation started",
                                           nodes=info.nodes or None, start_time=start)
                stats.transitions += 1
            return
        if pack.state == PackState.QUEUED and info.state == SJ.PENDING:
            self._check_pinned_wait(pack, info, stats)
            return
        if info.state.is_terminal:
            self.pack_ended(pack, info.slurm_state.split(" ", 1)[0], info.reason or "", stats,
                            exit_code=info.exit_code, nodes=info.nodes or None,
                            end_time=float(info.end_time) if info.end_time else None)

    @property
    def pin_wait_s(self) -> float:
        w = self.settings.pin_wait_s
        return max(PIN_WAIT_MIN_S, PIN_WAIT_ROUNDS * self.dispatch_window_s) if w is None else w

    def _check_pinned_wait(self, pack: Any, info: Any, stats: RoundStats) -> None:
        """A pack pinned to its planned node that cannot start there (the node went down,
        drained or was reserved: squeue's reason says so) or still waits for resources
        there after `pin_wait_s` (someone else's job took the node first) is withdrawn:
        scancel, the pack CANCELLED, its members back to PENDING without counting an
        attempt (they never ran), planned again on the next round's view. A wait the pin
        does not cause (Priority, a QOS or account limit, BeginTime) is Slurm's to end,
        as for any job: withdrawing then would only lose the pack's place in the queue."""
        from slurm_dlrm.slurm import SlurmError
        from slurm_dlrm.store.states import JobState, PackState

        node = self.pinned_node(pack)
        if node is None:
            return
        reason = info.reason or ""
        waited_s = self.clock() - float(pack.submit_time or pack.create_time)
        unavailable = any(r in reason for r in NODE_UNAVAILABLE_REASONS)
        held_back = reason.split(",", 1)[0].strip() == "Resources" and waited_s >= self.pin_wait_s
        if not (unavailable or held_back):
            return
        try:
            self.slurm.scancel([int(pack.slurm_job_id)])
        except SlurmError as exc:
            if is_unreachable(exc):
                self._slurm_failed(exc)
            else:
                log.warning("scancel of pack %s (pinned to %s) failed: %s", pack.name, node, exc)
            return  # still QUEUED: the next round tries again
        why = (f"withdrawn: pinned to {node}, which Slurm cannot give it ({reason})" if unavailable else
               f"withdrawn: pinned to {node}, not started after {waited_s:.0f} s"
               + (f" ({reason})" if reason else ""))
        self.store.transition_pack(pack.id, PackState.CANCELLED, why)
        for jid in pack_member_ids(self.store, pack.id, ("PLANNED",)):
            self.store.transition_job(jid, JobState.PENDING, f"pack {pack.name} {why}; planned again",
                                      expect=JobState.PLANNED)
        stats.transitions += 1
        self.refill.forget(pack.id)
        log.info("pack %s %s", pack.name, why)

    def _may_resubmit(self, pack: Any) -> bool:
        """sbatch for this SUBMITTING pack either never ran or cannot still be running."""
        marker = Path(pack.pack_dir or "") / SBATCH_MARKER
        try:
            started = float(marker.read_text().strip() or 0)
        except (OSError, ValueError):
            return True
        return self.clock() - started > self.settings.sbatch_timeout_s + 5.0

    # ------------------------------------------------------------ act

    def act(self, stats: RoundStats) -> None:
        from slurm_dlrm.service.depend import ready_jobs, within_array_throttle
        from slurm_dlrm.store.states import JobState

        if not self._slurm_available():
            return
        # a no-pack job is PENDING only until its own sbatch answers: never planned
        pending = [j for j in self.store.jobs([JobState.PENDING], user=self.settings.user)
                   if not j.no_pack and j.id not in self.sweep_stop.held]  # a paused sweep variant waits
        pending, never = ready_jobs(self.store, pending)  # submit --dependency
        now = self.clock()
        pending = [j for j in pending if j.begin_time is None or j.begin_time <= now]  # submit --begin
        pending = within_array_throttle(self.store, pending)  # submit --array 0-7%2
        for job, why in never:
            self.store.transition_job(job.id, JobState.FAILED, why, expect=JobState.PENDING)
            stats.transitions += 1
        pending = self.trace_custom_estimates(pending, stats)
        if not pending or not self._dispatch_due(pending):
            return
        self.last_dispatch_t = self.clock()
        self._round_nodes = None  # read at most once in this round, by the first group that plans
        groups: dict[tuple[tuple[str, str], ...], list[Any]] = {}
        for job in pending:
            groups.setdefault(job_options(job).pack_key(), []).append(job)
        for key in sorted(groups):
            if not self._slurm_available():
                break
            self._dispatch_group(groups[key], stats)

    def trace_custom_estimates(self, pending: list[Any], stats: RoundStats) -> list[Any]:
        """Custom-module jobs wait for their traced estimate (service/custom_trace.py):
        traced here, one child process per spec and GPU model; a factory that fails
        fails its job with `estimate`'s line. Returns the jobs ready to plan."""
        from slurm_dlrm.service.custom_trace import needs_trace, trace_job
        from slurm_dlrm.store.states import JobState

        ready, done = [], {}
        for job in pending:
            if not needs_trace(job):
                ready.append(job)
                continue
            # the fingerprint leaves `eval` out (a resumed run may change it); the trace counts it
            key = (job.spec_fingerprint, job.gpu_model, str(job.spec.get("custom_module")),
                   json.dumps(job.spec.get("eval"), sort_keys=True, default=str))
            if key not in done:
                done[key] = trace_job(job, self.site.gpu_model(str(job.gpu_model)), self.settings.python)
            est, error = done[key]
            if est is None:
                self.store.transition_job(job.id, JobState.FAILED, error, exit_code=2)
            else:
                self.store.set_job_estimate(job.id, est, f"traced {job.spec.get('custom_module')}: GPU peak "
                                            f"{int(est['gpu_peak_bytes']) / (1 << 30):.2f} GiB on {job.gpu_model}")
                ready.append(self.store.get_job(job.id))
            stats.transitions += 1
        return ready

    @property
    def join_grace_s(self) -> float:
        """How long an idle agent waits for joins: the site's agent.join_grace_s, else
        two dispatch rounds (one round may pass before the plan that joins)."""
        grace = self.site.agent.join_grace_s
        return 2.0 * self.dispatch_window_s if grace is None else grace

    @property
    def dispatch_window_s(self) -> float:
        w = self.settings.dispatch_window_s
        return self.site.packing.round_seconds if w is None else w

    def _dispatch_due(self, pending: list[Any]) -> bool:
        """RMixer's batched dispatch: wait for a batch of jobs or the end of the window,
        so jobs submitted one by one still share packs. The first round after a start
        plans at once. A requeued job counts as a new arrival."""
        from dataclasses import replace as dc_replace

        from slurm_dlrm.packing.dispatch import DispatchConfig, should_run_round

        cfg = dc_replace(DispatchConfig.from_site(self.site), round_seconds=self.dispatch_window_s)
        since = self.last_dispatch_t
        arrived = len(pending) if since is None else sum(
            1 for j in pending if j.submit_time >= since or j.updated_time >= since)
        return should_run_round(self.clock(), since, len(pending), arrived, cfg)

    def _dispatch_group(self, jobs: list[Any], stats: RoundStats) -> None:
        from slurm_dlrm.packing.dispatch import DispatchConfig, after_round, aged
        from slurm_dlrm.packing.model import PackingRequest, limits_from_site
        from slurm_dlrm.packing.policies import plan
        from slurm_dlrm.service.measured import learned_limits, peak_errors
        from slurm_dlrm.store.states import JobState

        options = job_options(jobs[0])
        partition = self.partition_for(options)
        nodes = self.node_shapes(partition)
        demands = [self.demand_of(j) for j in jobs]
        cfg = DispatchConfig.from_site(self.site)
        busy = self.busy_gpus(partition)
        total = sum(n.gpus * n.count for n in nodes)
        max_gpus = max(0, total - busy)
        free = self.free_capacity(partition)
        if free is not None:  # plan new packs where Slurm can start them now (service/capacity.py)
            nodes, max_gpus = free.nodes, min(max_gpus, free.free_gpus)
        pin_to = self.pinnable_nodes(free, partition, options)
        # GPUs of running packs to refill (not packs one of these jobs already ran in)
        open_gpus, where = self.refill.open_gpus(options.pack_key(), {j.id for j in jobs})
        # Gangs (world_size > 1) join too: all ranks on one node of one pack, recorded in one
        # transaction and written as one join file of W entries (docs/interfaces.md 3b).
        # The margin learned from the estimate's error at measured peaks (service/measured.py)
        errors = peak_errors(self.store, self.site, self.settings.user, self.recovery.config.warmup_s)
        request = PackingRequest(jobs=aged(demands, self.waited_rounds, cfg),
                                 gpu_models=tuple(self.site.gpu_models.values()), nodes=nodes,
                                 limits=learned_limits(limits_from_site(self.site), errors),
                                 max_gpus=max_gpus,
                                 open_gpus=open_gpus, gang_joins=True, fair=cfg.fair, now_s=self.clock())
        result = plan(request, self.policy, self.recovery.interference_params)  # refitted from samples
        self.waited_rounds.update(after_round(self.waited_rounds, result))
        for jid in result.placed_job_ids:
            self.deferred_reasons.pop(jid, None)
        self.deferred_reasons.update((d.job_id, d.reason) for d in result.deferred)
        for d in result.deferred:
            if _never_fits(d.reason):
                self.store.transition_job(d.job_id, JobState.FAILED, f"cannot run on this site: {d.reason}")
                stats.transitions += 1
        by_id = {j.id: j for j in jobs}
        if result.joins:  # recorded, then written for the agents: no Slurm call needed
            self.refill.record_joins(result.joins, where, by_id, stats)
        for pack in result.packs:
            if not self._slurm_available():
                return  # the rest stay PENDING; the next round plans them again
            pack = self.recovery.tune_shares(pack, by_id)  # MPS shares from fitted perf models
            members = [by_id[i] for i in dict.fromkeys(m.job_id for m in pack.members)]  # a job per rank once
            for m in pack.members:
                self.waited_rounds.pop(m.job_id, None)
            node = pack.node_name if pack.node_count == 1 and pack.node_name in pin_to else None
            self._create_and_submit(pack, members, options, partition, stats, node=node)

    def demand_of(self, job: Any) -> Any:
        from dataclasses import replace

        from slurm_dlrm.packing.model import demand_from_estimate
        from slurm_dlrm.service.sweep_stop import member_of

        spec = job.spec
        steps = spec.get("steps") or 0
        samples = float(steps * int(spec.get("batch_size") or 0)) if steps else None
        est = job.estimate or {}
        # --nice orders the user's own jobs (higher later); --begin starts its wait (issue 31)
        d = demand_from_estimate(est, job_id=job.id, user=job.user, submit_time_s=job.submit_time,
                                 priority=-float(job.nice or 0), name=job.name, samples_to_train=samples)
        if job.begin_time is not None:
            d = replace(d, eligible_s=job.begin_time)
        if member_of(job.id, spec) is not None:  # a sweep's variant the stopping rule may pause
            d = replace(d, may_pause=True)
        minutes = job_options(job).time_minutes
        if minutes is not None and minutes > 0:  # a joiner's own time limit must fit its pack's time left
            d = replace(d, time_limit_s=minutes * 60.0)
        # After an OOM the store holds a raised request: reserve that much.
        extra_gpu = (job.gpu_mem_request_bytes or 0) - (job.est_gpu_peak_bytes or 0)
        extra_host = (job.host_mem_request_bytes or 0) - (job.est_host_peak_bytes or 0)
        if extra_gpu > 0 or extra_host > 0:
            d = replace(d, gpu_mem_bytes=d.gpu_mem_bytes + max(0, extra_gpu),
                        host_mem_bytes=d.host_mem_bytes + max(0, extra_host))
        return self.recovery.adapt_demand(job, d)  # warm start / measured profile

    def _create_and_submit(self, pack: Any, members: list[Any], options: SbatchOptions, partition: Any,
                           stats: RoundStats, node: str | None = None) -> None:
        from slurm_dlrm.store.records import NewPlacement

        name = new_pack_name()
        pack_dir = self.spool_dir / name
        placements = [NewPlacement(job_id=m.job_id, node_index=m.node_index, gpu_index=m.gpu_index,
                                   mps_thread_pct=m.mps_thread_pct, gpu_mem_limit_bytes=m.gpu_mem_limit_mib * MIB,
                                   host_mem_limit_bytes=m.host_mem_limit_bytes, cpus=m.cpus,
                                   predicted_speed=m.predicted_speed,
                                   rank=m.rank if m.world_size > 1 else None,
                                   world_size=m.world_size if m.world_size > 1 else None)
                      for m in pack.members]
        pack_id = self.store.add_pack(
            name=name, user=self.settings.user, policy=self.policy, n_gpus=pack.gpu_count,
            n_nodes=pack.node_count, partition=options.partition or (partition.name if partition else None),
            gpu_model=pack.gpu_model, pack_dir=str(pack_dir), placements=placements,
            reason=f"planned by {self.policy}: {len(members)} members on {pack.gpu_count} GPU(s)",
            data={k: v for k, v in (("reserve_cpus", getattr(pack, "reserve_cpus", 0)),
                                    ("reserve_host_mem_bytes", getattr(pack, "reserve_host_mem_bytes", 0)),
                                    ("node", node)) if v})
        stats.jobs_planned += len(members)
        self._submit_pack(self.store.get_pack(pack_id), stats)

    def _submit_pack(self, pack: Any, stats: RoundStats) -> None:
        """Write the pack folder, then sbatch. Safe to repeat for a SUBMITTING pack."""
        from slurm_dlrm.slurm import SlurmError
        from slurm_dlrm.store.states import JobState, PackState

        pack_dir = Path(pack.pack_dir)
        members = [self.store.get_job(i) for i in pack_member_ids(self.store, pack.id, ("PLANNED",))]
        if not members:
            # every member was cancelled before sbatch: nothing to run
            self.store.transition_pack(pack.id, PackState.CANCELLED, "all members cancelled before submission")
            return
        script = self.write_pack_dir(pack, members)
        marker = pack_dir / SBATCH_MARKER
        marker.write_text(f"{self.clock()}\n")
        try:
            slurm_id = self.slurm.sbatch(script)
        except SlurmError as exc:
            if is_unreachable(exc):
                self._slurm_failed(exc)
                return  # stays SUBMITTING; the next rounds find it by name or submit again
            msg = slurm_message(exc)
            self.store.transition_pack(pack.id, PackState.FAILED, f"sbatch refused: {msg}")
            for job in members:
                self.store.transition_job(job.id, JobState.FAILED, f"Slurm refused the pack: {msg}")
            stats.transitions += 1 + len(members)
            return
        self._slurm_ok()
        self.store.transition_pack(pack.id, PackState.QUEUED, "submitted", slurm_job_id=str(slurm_id))
        stats.packs_submitted += 1
        log.info("pack %s (%d members) submitted as Slurm job %s", pack.name, len(members), slurm_id)


def _never_fits(reason: str) -> bool:
    # The policy's "too big" reasons: the job exceeds what any node offers even when
    # empty. Room or GPUs lacking *this round* is not final.
    return "largest free GPU" in reason
