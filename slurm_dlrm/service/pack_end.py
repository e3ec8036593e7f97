"""Settling a pack whose Slurm job ended: one gone from squeue asked of sacct (or judged
by its agents' reports), then the pack's end recorded and each member that did not report
its own end requeued, cancelled or failed.

Apart from the round (service/core.py) because it is where a newcomer looks when a pack
ended COMPLETED/FAILED/LOST unexpectedly or a member was requeued after its pack ended.
`PackingService` inherits it, so `svc.pack_ended(...)` stays its method (recovery calls it).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slurm_dlrm.service.common import is_unreachable, pack_member_ids, sacct_time
from slurm_dlrm.service.settings import RoundStats

log = logging.getLogger(__name__)

PACK_NOT_STARTED = "its pack failed before the member started; back to the queue"


class PackEnding:
    """Ended packs, a part of `PackingService` (which sets these attributes)."""

    store: Any
    slurm: Any
    clock: Callable[[], float]
    heartbeats: dict[int, float]
    recovery: Any
    refill: Any
    settings: Any
    site: Any

    if TYPE_CHECKING:
        def _slurm_failed(self, exc: BaseException) -> None: ...

        def ingest(self, pack: Any) -> int: ...

        def _requeue(self, job: Any, reason: str, t: float | None = None) -> None: ...

    def _pack_vanished(self, pack: Any, stats: RoundStats) -> None:
        """Gone from squeue (purged after MinJobAge): ask sacct, else judge by the reports."""
        from slurm_dlrm.slurm import AccountingDisabled, SlurmError

        ending: str | None = None
        end_time: float | None = None
        if pack.slurm_job_id:
            try:
                rows = self.slurm.sacct([int(pack.slurm_job_id)], ["JobID", "State", "ExitCode", "NodeList", "End"])
                line = next((r for r in rows if r.step is None), None)
                if line is not None and line.state.is_terminal:
                    ending = line.get("State").split(" ", 1)[0]
                    end_time = sacct_time(line.get("End"))
            except AccountingDisabled:
                pass
            except SlurmError as exc:
                if is_unreachable(exc):
                    self._slurm_failed(exc)
                    return
                log.warning("sacct for pack %s failed: %s", pack.name, exc)
        if ending is None and not self._all_members_done(pack.id) and self._agents_still_report(pack):
            return  # ended in no record, yet its agents run: judged once they fall silent
        if ending is None:
            ending = "COMPLETED" if self._all_members_done(pack.id) else "LOST"
        if end_time is None:
            # Slurm forgot it (no accounting): it ended after the agents' last words and
            # before now; charging up to the last one is closer than up to now (issue 17)
            end_time = self.last_sign_of_life(pack)
        self.pack_ended(pack, ending, "no longer in squeue", stats, end_time=end_time)

    def _agents_still_report(self, pack: Any) -> bool:
        """Gone from squeue with no end in sacct, yet its agents sampled within the last
        few sample intervals: slurmctld lost the job (SIGKILLed before it saved it; issue
        49) while its steps still run on the node, until slurmd kills them as orphans or
        they finish. Declared LOST at once, the pack was charged up to then while its
        members ran on for ~10 s (charged < their measured run time)."""
        self.ingest(pack)
        last = self.last_sign_of_life(pack)
        quiet_s = max(10.0, 3 * float(self.site.agent.sample_interval_s))
        return last is not None and self.clock() - last < quiet_s

    def last_sign_of_life(self, pack: Any) -> float | None:
        """When the pack's agents were last heard of: heartbeats, samples, member ends."""
        row = self.store.conn.execute(
            "SELECT max(t) FROM (SELECT max(t) AS t FROM samples WHERE pack_id = ? "
            "UNION ALL SELECT max(end_time) FROM placements WHERE pack_id = ?)", (pack.id, pack.id)).fetchone()
        times = [t for t in (self.heartbeats.get(pack.id), row[0] if row else None) if t]
        return float(max(times)) if times else None

    def _all_members_done(self, pack_id: int) -> bool:
        return not pack_member_ids(self.store, pack_id, ("PLANNED", "RUNNING"))

    def pack_ended(self, pack: Any, slurm_state: str, reason: str, stats: RoundStats, *,
                   exit_code: int | None = None, nodes: str | None = None, end_time: float | None = None) -> None:
        """The allocation is over: record it, then settle members that did not report an end.

        `end_time`: when Slurm says it ended. The pack's end (what `acct` charges up to) is
        that, not when this round noticed, which may be long after (a stopped service)."""
        from slurm_dlrm.adapt.recovery import RECOVERABLE_PACK_ENDINGS
        from slurm_dlrm.service.refill import JOINER_NOT_STARTED
        from slurm_dlrm.store.states import JobState, PackState

        self.ingest(pack)  # the agents' last words first
        live = [self.store.get_job(i) for i in pack_member_ids(self.store, pack.id, ("PLANNED", "RUNNING"))]
        to = {"COMPLETED": PackState.COMPLETED, "CANCELLED": PackState.CANCELLED,
              "LOST": PackState.LOST}.get(slurm_state, PackState.FAILED)
        why = f"Slurm: {slurm_state}" + (f" ({reason})" if reason else "")
        if to == PackState.FAILED and slurm_state in ("FAILED", "OUT_OF_MEMORY") and not live \
                and self._every_agent_exited(pack):
            # Under task/cgroup srun fails the agent's step for an OOM kill in the job's
            # cgroup, one the agent handled (the member is OOM_HOST, retried): the pack
            # itself did its work, so it is not a failed allocation (Slurm's word stays).
            to = PackState.COMPLETED
            why += "; every agent exited after its members had ended"
        now = self.clock()
        ended = None if end_time is None else max(min(end_time, now), pack.start_time or 0.0)
        self.store.transition_pack(pack.id, to, why, nodes=nodes, t=ended)
        stats.transitions += 1
        self.heartbeats.pop(pack.id, None)
        recoverable = slurm_state in RECOVERABLE_PACK_ENDINGS
        tail = self._output_tail(pack) if to == PackState.FAILED and not recoverable else ""
        # A failed allocation whose agents did not all report their orderly exit: an agent
        # was killed, or srun could not start its step (seen right after a slurmctld
        # restart: "Invalid generic resource (gres) specification"). Its members did not
        # fail on their own: they rerun from their checkpoints like a lost pack's, within
        # max_attempts (issue 49: they ended FAILED, work lost to one killed agent).
        agent_died = to == PackState.FAILED and not recoverable and not self._every_agent_exited(pack)
        if recoverable or agent_died:
            self.recovery.fence_old_run(pack, live)  # an agent cut off from Slurm stops its members
        for job in live:
            if job.state == JobState.PLANNED and self.refill.is_joiner(pack, job.id):
                # it joined a running pack that ended first: it never ran, no attempt is counted
                self.store.transition_job(job.id, JobState.PENDING, f"{JOINER_NOT_STARTED} "
                                          f"({pack.name} ended {slurm_state})")
            elif to == PackState.CANCELLED:
                self.store.transition_job(job.id, JobState.CANCELLED, f"pack {pack.name} cancelled in Slurm")
            elif recoverable or job.state == JobState.PLANNED and to == PackState.COMPLETED:
                self._requeue(job, f"pack {pack.name} ended {slurm_state} before the member finished")
            elif agent_died and job.state == JobState.RUNNING:
                self._requeue(job, f"pack {pack.name} ended {slurm_state} without its agent's exit, before the "
                                   f"member finished; resume from checkpoint" + (f": {tail}" if tail else ""))
            elif agent_died and self._starts_missed(job.id) + 1 < self.max_attempts():
                # never started: no attempt is counted, so the packs that failed to start it are
                self.store.transition_job(job.id, JobState.PENDING, f"{PACK_NOT_STARTED} ({pack.name} ended "
                                          f"{slurm_state}" + (f": {tail}" if tail else "") + ")")
            else:
                msg = f"pack {pack.name} ended {slurm_state} before the member reported an end"
                self.store.transition_job(job.id, JobState.FAILED, msg + (f": {tail}" if tail else ""),
                                          exit_code=exit_code)
            stats.transitions += 1
        self.refill.forget(pack.id)

    def max_attempts(self) -> int:
        return int(self.settings.max_attempts)

    def _starts_missed(self, job_id: int) -> int:
        """How many failed packs this job went back to the queue from without starting."""
        return sum(1 for e in self.store.events(job_id=job_id, kind="job_state")
                   if str(e.get("reason") or "").startswith(PACK_NOT_STARTED))

    def _every_agent_exited(self, pack: Any) -> bool:
        """Whether the agent of each of the pack's nodes reported its own orderly exit."""
        nodes = {(e.get("data") or {}).get("node") for e in self.store.events(pack_id=pack.id, kind="agent")
                 if e.get("reason") == "exit"}
        return len(nodes) >= max(1, pack.n_nodes or 1)

    def _output_tail(self, pack: Any) -> str:
        """The last line of the pack's batch output: usually why an agent could not start."""
        if not pack.pack_dir or not pack.slurm_job_id:
            return ""
        path = Path(pack.pack_dir) / f"slurm-{pack.slurm_job_id}.out"
        try:
            with open(path, "rb") as f:
                f.seek(max(0, os.path.getsize(path) - 4096))
                lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return ""
        return lines[-1][:300] if lines else ""
