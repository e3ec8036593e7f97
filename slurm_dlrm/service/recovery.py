"""DLRover-RM's recovery and adaptation on the live path, called from the service round.

The decisions are `slurm_dlrm.adapt`'s (the simulator makes the same ones); this module
gathers what they need from the store, acts through the store's state machines and
the agent's cancel hook, and leaves an event with the reason of every decision:

- `after_oom`: a member reported OOM_GPU/OOM_HOST -> `decide_after_oom` from its
  measured peak (samples) and the fence it hit -> requeued (OOM -> PENDING, attempt+1)
  with the raised request, resuming from its checkpoint dir; the raise is recorded as a
  `learned` event for the spec fingerprint; past the retry limit (or beyond any GPU)
  it stays OOM, the store's terminal failure-by-memory state, with a `decision` event
  saying why it was not retried.
- `check_heartbeats`: a RUNNING pack whose agents have sent neither heartbeat nor sample for
  `agent.heartbeat_timeout_s` is cancelled in Slurm and ended LOST; the service's
  pack-ending path then requeues its unfinished members (finished ones are not rerun).
- `check_stragglers`: a member whose samples/s stays below `straggler_ratio` of its
  predicted co-located speed for `straggler_sustained_s` is asked to checkpoint
  (`<pack_dir>/cancel/<job_id>`, SIGTERM) and, when the agent reports it stopped, is
  requeued instead of cancelled (`on_member_cancelled`), with its measured profile.
- `check_warmup`: the first measured window replaces the predicted profile
  (`update_after_warmup`); the decision (keep or re-plan) is an event, and a re-plan
  is judged at once by `_check_repack`.
- `_check_repack` (stage 3): a running member whose fresh plan is predicted faster by
  `adapt.repack_threshold_pct`, enough to repay `adapt.repack_restart_cost_s`
  (`decide_repack`), is checkpointed and moved like a straggler.
- `maybe_refit`: every `adapt.refit_every_rounds` rounds the interference model is
  refitted from measured co-locations; the policy plans with the result, unless the
  naive rule or the neighbour model beats it clearly held out (issue 37,
  `_choose_planner_model`).
- `adapt_demand`: warm start of a job's first run from the history of its spec
  fingerprint (memory raise learned from OOMs and measured peaks; measured profile of
  similar finished jobs); a requeued job's demand takes its own measured profile. A
  fingerprint without history takes its host demand (so the pack's --mem) from the
  site-wide host calibration (`estimate.calibrate.site_host_correction` over the user's
  finished runs of any spec), which may lower it: a host OOM is retried with more.
- `tune_shares`: where every member of a GPU has a fitted resource-performance model
  (`fit_perf_model` on samples taken at different MPS shares and CPU counts), the SM
  shares are split by `allocate_shares` and CPUs trimmed by `PerfModel.cores_for`.

Predicted co-located speed: the speed measured during the member's warm-up, scaled by
the interference model's relative speed now over its relative speed then (members
that ended since make it faster). The analytic solo samples/s of the estimate is not
used: it describes the GPU the spec was estimated for, not the node it runs on.

`Recovery` is one class, the live path of every decision listed above; they share its
per-service memory (`service/recovery_state.py`: notes made once, the re-pack budget,
the refitted model, pending demands). Two parts a newcomer looks for on their own sit
in their own modules, as bases of `Recovery`: the warm start (`service/warm_start.py`)
and the interference model's refit (`service/interference_refit.py`). The decisions
themselves are `slurm_dlrm.adapt`'s.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from slurm_dlrm.adapt import (
    PerfModel,
    Profile,
    SpeedSample,
    allocate_shares,
    decide_after_oom,
    decide_repack,
    find_stragglers,
    fit_perf_model,
    update_after_warmup,
)
from slurm_dlrm.adapt.stragglers import choose_moves
from slurm_dlrm.packing.interference import predict_speeds_from_fractions
from slurm_dlrm.service.common import fault_runs
from slurm_dlrm.service.interference_refit import InterferenceRefit
from slurm_dlrm.service.recovery_state import ADAPT, LEARNED, MOVE, RecoveryConfig
from slurm_dlrm.service.warm_start import WarmStart
from slurm_dlrm.site import MIB
from slurm_dlrm.store.colocations import PackColocations

log = logging.getLogger(__name__)

FRESH_PLAN_PENDING = 32  # pending jobs a re-pack's fresh plan considers (keeps the round cheap)
REPACK_JUDGEMENTS_PER_ROUND = 64  # members judged for a re-pack per round; the rest wait a round
UNKNOWN_REMAINING_S = 1e9  # a job without a step count: only the threshold decides


def _fraction(pct: float | None) -> float:
    return min(1.0, max(0.0, (pct or 0.0) / 100.0))


class Recovery(WarmStart, InterferenceRefit):
    """State that only saves work (which events were written); a restart loses nothing."""

    def __init__(self, svc: Any, config: RecoveryConfig | None = None) -> None:
        self.svc = svc
        self.config = config or RecoveryConfig()
        self.started_at = svc.clock()
        self.announced: set[tuple[str, int, int]] = set()  # (what, job, attempt) events written
        # Per-round caches: a round with 1,000 pending jobs of a few specs asks the same
        # history questions 1,000 times.
        self._cache_round = -1
        self._history: dict[str, tuple[tuple[float, float, int], list[Profile]]] = {}
        self._site_runs: dict[str, list[Any]] = {}  # device kind -> the site's recent runs (SiteRun)
        self._ran_on: dict[int, str | None] = {}  # finished job -> the device its runner recorded
        self._learned_events: list[dict[str, Any]] | None = None
        self._perf: dict[str, PerfModel | None] = {}
        self._busy: dict[str | None, int] = {}  # partition -> GPUs the user's packs hold
        self._pending: dict[tuple[tuple[str, str], ...], list[Any]] | None = None
        self._repack_checked: dict[tuple[int, int], float] = {}  # (job, attempt) -> last re-pack check
        self._replan: set[tuple[int, int]] = set()  # warm-up said re-plan; not yet judged
        self._refit_key: tuple[tuple[int, int, int], ...] = ()  # the co-locations of the last refit
        self._judged: tuple[int, int] = (-1, 0)  # (round, re-pack judgements made in it)
        self._colocations: dict[int, PackColocations] = {}  # ended pack -> what it tells the refit
        self._learned_at = 0  # co-located GPUs the last learned fit saw
        self.interference_source = "analytic defaults"
        self.interference_params = self._initial_params()

    # ------------------------------------------------------------ OOM

    def after_oom(self, job_id: int, kind: str, t: float) -> None:
        """The job is in OOM: requeue it with a raised request, or fail it with the reason."""
        from slurm_dlrm.store.states import JobState

        s = self.store
        job = s.get_job(job_id)
        placements = [p for p in s.placements(job_id=job_id) if p.pack_id == job.pack_id]
        site = self.svc.site
        gpu = site.gpu_models.get(job.gpu_model or "") or next(iter(site.gpu_models.values()))
        usage = s.usage(job_id)
        if kind == "gpu":
            limit = max((p.gpu_mem_limit_bytes or 0) for p in placements) if placements else 0
            capacity = gpu.memory_bytes - gpu.cuda_context_bytes
            peak = usage.gpu_mem_peak_bytes if usage else None
        else:
            limit = max((p.host_mem_limit_bytes or 0) for p in placements) if placements else 0
            capacity = max(n.memory_mib for n in site.nodes) * MIB
            peak = usage.rss_peak_bytes if usage else None
        gpu_req = job.gpu_mem_request_bytes or job.est_gpu_peak_bytes or 0
        host_req = job.host_mem_request_bytes or job.est_host_peak_bytes or 0
        decision = decide_after_oom("gpu" if kind == "gpu" else "host", gpu_req, host_req, limit, peak,
                                    attempt=job.attempt + 1 - fault_runs(s, job_id),
                                    max_attempts=self.svc.settings.max_attempts,
                                    capacity_bytes=capacity)
        if decision.action == "fail":
            # OOM is terminal in the store's job lifecycle (a failure by memory): the job
            # stays there and the decision says why it is not retried.
            s.add_event("decision", f"not retried: {decision.reason}", job_id=job_id, t=t,
                        data={"kind": kind, "limit_bytes": limit, "peak_bytes": peak, "attempt": job.attempt})
            return
        est_gpu = job.est_gpu_peak_bytes or gpu_req
        est_host = job.est_host_peak_bytes or host_req
        data = {"fingerprint": job.spec_fingerprint, "kind": kind,
                "gpu_factor": decision.gpu_mem_bytes / est_gpu if est_gpu else None,
                "host_factor": decision.host_mem_bytes / est_host if est_host else None}
        s.add_event(LEARNED, f"spec {job.spec_fingerprint[:12]}: {decision.reason}", job_id=job_id, data=data, t=t)
        # The checkpoint dir is per job (service.write_pack_dir), so the next pack resumes from it.
        s.transition_job(job_id, JobState.PENDING, f"{decision.reason}; resumes from its checkpoint", t=t,
                         gpu_mem_request_bytes=decision.gpu_mem_bytes, host_mem_request_bytes=decision.host_mem_bytes)

    # ------------------------------------------------------------ heartbeats

    def check_heartbeats(self, stats: Any) -> None:
        """End RUNNING packs whose agents went silent: LOST, members requeued."""
        from slurm_dlrm.slurm import SlurmError
        from slurm_dlrm.store.states import PackState

        timeout = float(self.svc.site.agent.heartbeat_timeout_s)
        now = self.svc.clock()
        for pack in self.store.packs([PackState.RUNNING], user=self.svc.settings.user):
            # A restarted service has no heartbeat times yet: count from its start. Samples
            # are signs of life too (they come every sample_interval_s, heartbeats slower).
            row = self.store.conn.execute("SELECT max(t) FROM samples WHERE pack_id = ?", (pack.id,)).fetchone()
            last = max(self.svc.heartbeats.get(pack.id, 0.0), pack.start_time or 0.0, self.started_at,
                       float(row[0] or 0.0) if row else 0.0)
            age = now - last
            if age <= timeout:
                continue
            reason = f"no agent heartbeat for {age:.0f} s (deadline agent.heartbeat_timeout_s={timeout:.0f})"
            log.warning("pack %s: %s; cancelling and requeueing its members", pack.name, reason)
            self.store.add_event("decision", f"pack {pack.name}: {reason}: lost", pack_id=pack.id)
            if pack.slurm_job_id:
                try:
                    self.svc.slurm.scancel([int(pack.slurm_job_id)])
                except SlurmError as exc:
                    log.warning("scancel of lost pack %s: %s", pack.name, exc)
            self.svc.pack_ended(pack, "LOST", reason, stats)

    def fence_old_run(self, pack: Any, jobs: list[Any]) -> None:
        """Before members of an ended pack are rerun, tell any agent of it that still
        runs (slurmd dead or cut off: Slurm cannot kill the steps) to stop them, through
        the cancel hook; they checkpoint on SIGTERM, and their late reports are ignored
        (the job's pack has changed). Two runs must not write one checkpoint dir."""
        if not pack.pack_dir or not jobs:
            return
        cancel_dir = Path(pack.pack_dir) / "cancel"
        try:
            cancel_dir.mkdir(mode=0o700, exist_ok=True)
            for job in jobs:
                (cancel_dir / str(job.id)).write_text(f"{self.svc.clock()} fence\n")
        except OSError as exc:
            log.warning("pack %s: cannot write cancel requests: %s", pack.name, exc)

    # ------------------------------------------------------------ warm-up and stragglers

    def _pack_samples(self, pack_id: int, since: float) -> dict[int, list[tuple[float, float, float | None]]]:
        rows = self.store.conn.execute(
            "SELECT job_id, t, samples_per_s, sm_util_pct FROM samples WHERE pack_id = ? AND t >= ? "
            "AND job_id IS NOT NULL AND samples_per_s IS NOT NULL ORDER BY t", (pack_id, since)).fetchall()
        out: dict[int, list[tuple[float, float, float | None]]] = {}
        for job_id, t, sps, sm in rows:
            out.setdefault(int(job_id), []).append((float(t), float(sps), None if sm is None else float(sm)))
        return out

    def _relative_speeds(self, jobs: list[Any]) -> dict[int, float]:
        est = [(j.estimate or {}).get("profile") or {} for j in jobs]
        sp = predict_speeds_from_fractions([_fraction(p.get("sm_util_pct")) for p in est],
                                           [_fraction(p.get("membw_util_pct")) for p in est],
                                           self.interference_params)
        return {j.id: s for j, s in zip(jobs, sp, strict=True)}

    def check_warmup_and_stragglers(self) -> None:
        from slurm_dlrm.store.states import JobState, PackState

        cfg = self.config
        now = self.svc.clock()
        user = self.svc.settings.user
        running = {j.id: j for j in self.store.jobs([JobState.RUNNING], user=user)}
        for pack in self.store.packs([PackState.RUNNING], user=user):
            if not pack.start_time or now - pack.start_time < cfg.warmup_s:
                continue
            placements = self.store.placements(pack_id=pack.id)
            samples = self._pack_samples(pack.id, pack.start_time)
            by_gpu: dict[tuple[int, int], list[Any]] = {}
            planned: dict[tuple[int, int], list[Any]] = {}
            for p in placements:
                job = self.store.get_job(p.job_id)
                planned.setdefault((p.node_index, p.gpu_index), []).append(job)
                if p.job_id in running:
                    by_gpu.setdefault((p.node_index, p.gpu_index), []).append(running[p.job_id])
            for key, live in by_gpu.items():
                rel_then = self._relative_speeds(planned[key])
                rel_now = self._relative_speeds(live)
                predicted: dict[int, float] = {}
                speeds: list[SpeedSample] = []
                changes: dict[int, float] = {}
                current: dict[int, float] = {}  # median samples/s over the recent window
                measured_sm: dict[int, float] = {}
                for job in live:
                    rows = samples.get(job.id, [])
                    warm = [r for r in rows if r[0] <= rows[0][0] + cfg.warmup_s] if rows else []
                    if not warm or rows[-1][0] - rows[0][0] < cfg.warmup_s:
                        continue
                    warm_sps = statistics.median(r[1] for r in warm)
                    predicted[job.id] = warm_sps * rel_now[job.id] / max(rel_then[job.id], 1e-9)
                    speeds += [SpeedSample(job.id, t, sps) for t, sps, _ in rows if t > rows[0][0] + cfg.warmup_s]
                    self._warmup_update(job, warm, warm_sps)
                    recent_rows = [r for r in rows if r[0] >= now - cfg.straggler_sustained_s]
                    recent = [r[2] for r in recent_rows if r[2] is not None]
                    planned_sm = float(((job.estimate or {}).get("profile") or {}).get("sm_util_pct") or 0.0)
                    if recent:
                        measured_sm[job.id] = statistics.median(recent)
                    if recent and planned_sm > 0:
                        changes[job.id] = statistics.median(recent) / planned_sm
                    if recent_rows:
                        current[job.id] = statistics.median(r[1] for r in recent_rows)
                found = find_stragglers(speeds, predicted, now, cfg.straggler_ratio, cfg.straggler_sustained_s)
                gpu_of = {j.id: key for j in live}
                moves = choose_moves(found, changes, gpu_of, 1.0 + cfg.profile_change_pct / 100.0)
                for job_id, reason in moves:
                    self._ask_to_move(pack, running[job_id], reason)
                if not moves:
                    self._check_repack(pack, live, current, measured_sm, placements)

    def _warmup_update(self, job: Any, warm: list[tuple[float, float, float | None]], warm_sps: float) -> None:
        """Record the warm-up measurement against the prediction, once per run."""
        prof = (job.estimate or {}).get("profile") or {}
        sms = [r[2] for r in warm if r[2] is not None]
        planned_sm = float(prof.get("sm_util_pct") or 0.0)
        measured_sm = statistics.median(sms) if sms else planned_sm
        if self._once("warmup", job):
            predicted = Profile(planned_sm, float(prof.get("membw_util_pct") or 0.0),
                                float(prof.get("host_cpu_cores") or 1.0), float(prof.get("solo_samples_per_s") or 0.0))
            measured = replace(predicted, sm_util_pct=measured_sm, samples_per_s=warm_sps)
            upd = update_after_warmup(predicted, measured, self.config.profile_change_pct)
            self.store.add_event(ADAPT, upd.reason, job_id=job.id,
                                 data={"measured_sm_util_pct": measured_sm, "samples_per_s": warm_sps,
                                       "replan": upd.replan})
            if upd.replan:
                self._replan.add((int(job.id), int(job.attempt)))  # judged by _check_repack this round

    def _ask_to_move(self, pack: Any, job: Any, reason: str) -> None:
        if self._move_asked(pack, job):
            return  # already asked
        if not pack.pack_dir:
            return
        cancel_dir = Path(pack.pack_dir) / "cancel"
        cancel_dir.mkdir(mode=0o700, exist_ok=True)
        # The move is recorded before the agent is told, so a restart still requeues it.
        self.store.add_event(MOVE, f"{reason}: checkpoint and move in the next round", job_id=job.id,
                             pack_id=pack.id)
        (cancel_dir / str(job.id)).write_text(f"{self.svc.clock()} move\n")
        log.info("job %d: %s; asked to checkpoint and move", job.id, reason)

    def _move_asked(self, pack: Any, job: Any) -> bool:
        return any(ev.get("pack_id") == pack.id for ev in self.store.events(job_id=job.id, kind=MOVE))

    # ------------------------------------------------------------ run-time re-pack

    def _check_repack(self, pack: Any, live: list[Any], current: dict[int, float], measured_sm: dict[int, float],
                      placements: list[Any]) -> None:
        """Stage 3 (and the warm-up's re-plan): on one GPU of a running pack, move the
        member whose fresh plan is predicted fastest relative to its measured speed here,
        if `decide_repack` says the gain clears the threshold and repays the restart.

        Each member is judged at most once per `adapt.repack_interval_s` (a warm-up that
        asked for a re-plan is judged at once). Its solo speed is its measured speed here
        divided by the interference model's relative speed here (with the measured SM use
        of the GPU's live members); the candidate is that solo speed times its relative
        speed in a fresh plan of it with the pending jobs, times the perf model's ratio of
        the fresh share/CPUs to the current ones where a model is fitted."""
        site_cfg = self.svc.site.adapt
        now = self.svc.clock()
        due = []
        for job in live:
            key = (int(job.id), int(job.attempt))
            replan = key in self._replan
            last = self._repack_checked.get(key)
            if job.id not in current or (not replan and last is not None and now - last < site_cfg.repack_interval_s):
                continue
            if self._judged[0] != self.svc.rounds:
                self._judged = (self.svc.rounds, 0)
            if self._judged[1] >= REPACK_JUDGEMENTS_PER_ROUND:
                break  # packs that started together are judged over a few rounds, not in one
            self._judged = (self._judged[0], self._judged[1] + 1)
            self._repack_checked[key] = now
            self._replan.discard(key)
            due.append((job, replan))
        if not due or any(self._move_asked(pack, j) for j in live):
            return  # nobody to judge, or this GPU is already changing
        profiles = []
        for j in live:
            prof = (j.estimate or {}).get("profile") or {}
            profiles.append((_fraction(measured_sm.get(j.id, prof.get("sm_util_pct"))),
                             _fraction(prof.get("membw_util_pct"))))
        rel_here = dict(zip((j.id for j in live),
                            predict_speeds_from_fractions([p[0] for p in profiles], [p[1] for p in profiles],
                                                          self.interference_params), strict=True))
        alone = len(live) == 1
        mine = {p.job_id: p for p in placements}
        best: tuple[float, Any, str] | None = None
        max_attempts = self.svc.settings.max_attempts
        for job, replan in due:
            if job.attempt + 2 >= max_attempts:
                # A move is a run (a requeue counts against max_attempts): keep one for a failure.
                if replan:
                    self._kept(job, f"a move would leave no retry for a failure (run {job.attempt + 1} of "
                               f"at most {max_attempts})")
                continue
            here = current[job.id]
            solo = here / max(rel_here[job.id], 1e-9)
            remaining_s = self._remaining_s(job, here)
            cost = site_cfg.repack_restart_cost_s
            thr = site_cfg.repack_threshold_pct
            place = mine.get(job.id)
            model = self.perf_model(job.spec_fingerprint)
            cur_share = float(place.mps_thread_pct or 100) if place else 100.0
            cur_cpus = float(place.cpus or 1) if place else 1.0

            def share_factor(share: float, cpus: float, model: PerfModel | None = model,
                             cur_share: float = cur_share, cur_cpus: float = cur_cpus) -> float:
                if model is None:
                    return 1.0
                return model.samples_per_s(share, cpus) / max(model.samples_per_s(cur_share, cur_cpus), 1e-12)

            # Cheap bound first: alone with the whole GPU (and its CPUs) is the best a fresh plan gives.
            upper = decide_repack(here, solo * share_factor(100.0, max(cur_cpus, 1.0)), remaining_s, cost, thr)
            if not upper.repack:
                if replan:
                    self._kept(job, f"even alone on a GPU: {upper.reason}")
                continue
            fresh, where = self._fresh_placement(job, measured_sm.get(job.id), alone)
            if fresh is None:
                if replan:
                    self._kept(job, where)
                continue
            candidate = solo * fresh.predicted_speed * share_factor(float(fresh.mps_thread_pct), float(fresh.cpus))
            dec = decide_repack(here, candidate, remaining_s, cost, thr)
            stage = "warm-up re-plan" if replan else "re-pack"
            reason = (f"{stage}: {here:.0f} samples/s here, {candidate:.0f} predicted {where}; {dec.reason}")
            if not dec.repack:
                if replan:
                    self._kept(job, reason)
                continue
            if best is None or dec.gain_pct > best[0]:
                best = (dec.gain_pct, job, reason)
        if best is not None:
            self._ask_to_move(pack, best[1], best[2])

    def _kept(self, job: Any, reason: str) -> None:
        self.store.add_event(ADAPT, f"warm-up asked for a re-plan; kept in place: {reason}", job_id=job.id)

    def _remaining_s(self, job: Any, samples_per_s: float) -> float:
        """Seconds left at `samples_per_s`: the spec's steps x batch minus what was trained
        (the runner's last reported step, else the samples/s integrated over its runs)."""
        from slurm_dlrm.service.submit import job_progress

        spec = job.spec or {}
        steps, batch = spec.get("steps"), spec.get("batch_size")
        if not isinstance(steps, int) or not isinstance(batch, int) or steps <= 0 or samples_per_s <= 0:
            return UNKNOWN_REMAINING_S
        step = job_progress(self.svc.site, self.svc.settings.user, job.id)
        if step is not None:
            done = float(step * batch)
        else:
            rows = self.store.conn.execute(
                "SELECT max(t) - min(t), avg(samples_per_s) FROM samples WHERE job_id = ? "
                "AND samples_per_s IS NOT NULL GROUP BY pack_id", (job.id,)).fetchall()
            done = sum(float(span or 0.0) * float(sps or 0.0) for span, sps in rows)
        return max(0.0, steps * batch - done) / samples_per_s

    def _pending_demands(self, pack_key: tuple[tuple[str, str], ...]) -> list[Any]:
        from slurm_dlrm.service.common import job_options
        from slurm_dlrm.store.states import JobState

        self._fresh()
        if self._pending is None:
            self._pending = {}
            for j in self.store.jobs([JobState.PENDING], user=self.svc.settings.user):
                if j.no_pack:
                    continue
                group = self._pending.setdefault(job_options(j).pack_key(), [])
                if len(group) < FRESH_PLAN_PENDING:
                    group.append(j)
        return [self.svc.demand_of(j) for j in self._pending.get(pack_key, [])]

    def _fresh_placement(self, job: Any, measured_sm: float | None, alone: bool) -> tuple[Any, str]:
        """The member's placement in a fresh plan of it (with its measured SM use) and the
        pending jobs of its pack key, on the GPUs free now (plus its own if it is alone
        on it). (None, why) if the plan has no place for it."""
        from slurm_dlrm.packing.model import PackingRequest, limits_from_site
        from slurm_dlrm.packing.policies import plan
        from slurm_dlrm.service.common import job_options

        svc = self.svc
        options = job_options(job)
        partition = svc.partition_for(options)
        nodes = svc.node_shapes(partition)
        name = partition.name if partition is not None else None
        self._fresh()
        if name not in self._busy:
            self._busy[name] = svc.busy_gpus(partition)
        free = sum(n.gpus * n.count for n in nodes) - self._busy[name] + (1 if alone else 0)
        if free <= 0:
            return None, "no free GPU for a fresh plan"
        demand = svc.demand_of(job)
        if measured_sm:
            demand = replace(demand, sm_util_pct=measured_sm)
        request = PackingRequest(jobs=(demand, *self._pending_demands(options.pack_key())),
                                 gpu_models=tuple(svc.site.gpu_models.values()), nodes=nodes,
                                 limits=limits_from_site(svc.site), max_gpus=free)
        result = plan(request, svc.policy, self.interference_params)
        for pk in result.packs:
            for m in pk.members:
                if m.job_id == job.id:
                    others = sorted(o.job_id for o in pk.members
                                    if o.job_id != job.id and (o.node_index, o.gpu_index) == (m.node_index, m.gpu_index))
                    where = ("alone on a GPU" if not others else
                             "with job(s) " + ", ".join(str(o) for o in others)) + " in a fresh plan"
                    return m, where
        return None, "no place in a fresh plan"

    def on_member_cancelled(self, job: Any, t: float) -> bool:
        """The agent stopped a member: if the service had asked it to move, requeue it
        (RUNNING -> PENDING, resumes from its checkpoint) and return True."""
        from slurm_dlrm.store.states import JobState

        moves = [ev for ev in self.store.events(job_id=job.id, kind=MOVE) if ev.get("pack_id") == job.pack_id]
        if not moves or job.state != JobState.RUNNING:
            return False
        self.store.transition_job(job.id, JobState.PENDING, f"moved: {moves[-1]['reason']}; resumes from its checkpoint",
                                  t=t)
        return True

    # ------------------------------------------------------------ resource-performance model

    def perf_model(self, fingerprint: str) -> PerfModel | None:
        """Fit on runs of this fingerprint: each placement's (share, cpus) and the
        median samples/s measured while it held them. Cached for the round."""
        self._fresh()
        if fingerprint not in self._perf:
            self._perf[fingerprint] = self._fit_perf_model(fingerprint)
        return self._perf[fingerprint]

    def _fit_perf_model(self, fingerprint: str) -> PerfModel | None:
        points: list[tuple[float, float, float]] = []
        rows = self.store.conn.execute(
            "SELECT p.mps_thread_pct, p.cpus, "
            "(SELECT avg(s.samples_per_s) FROM samples s WHERE s.job_id = p.job_id AND s.pack_id = p.pack_id "
            " AND s.samples_per_s IS NOT NULL) "
            "FROM placements p JOIN jobs j ON j.id = p.job_id WHERE j.spec_fingerprint = ? "
            "ORDER BY p.id DESC LIMIT 50", (fingerprint,)).fetchall()
        for share, cpus, sps in rows:
            if share and cpus and sps:
                points.append((float(share), float(cpus), float(sps)))
        if len({(s, c) for s, c, _ in points}) < self.config.min_perf_points:
            return None
        return fit_perf_model(points)

    def tune_shares(self, pack: Any, jobs: dict[int, Any]) -> Any:
        """MPS shares and CPUs of a planned pack from the members' perf models, on the
        GPUs where every member has one (elsewhere the policy's figures stay)."""
        members = list(pack.members)
        by_gpu: dict[tuple[int, int], list[int]] = {}
        for i, m in enumerate(members):
            by_gpu.setdefault((m.node_index, m.gpu_index), []).append(i)
        changed = []
        for idx in by_gpu.values():
            models = [self.perf_model(jobs[members[i].job_id].spec_fingerprint) for i in idx]
            if any(mo is None for mo in models):
                continue
            fitted = [mo for mo in models if mo is not None]
            shares = allocate_shares(fitted, cpu_cores=[float(members[i].cpus) for i in idx])
            for i, mo, share in zip(idx, fitted, shares, strict=True):
                cpus = min(members[i].cpus, mo.cores_for(share, members[i].cpus))
                members[i] = replace(members[i], mps_thread_pct=share, cpus=cpus)
                changed.append((members[i].job_id, share, cpus))
        for job_id, share, cpus in changed:
            self.store.add_event(ADAPT, f"resource-performance model: {share}% of the SMs, {cpus} CPU(s)",
                                 job_id=job_id)
        return replace(pack, members=tuple(members)) if changed else pack
