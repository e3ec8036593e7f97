"""A sweep with a stopping rule in the simulator (issue 47 item 5).

The variants of one sweep are jobs of the workload; each has a learning curve (its
held-out metric as a function of its step, sim/sweep_curves.py draws them). At every
rung step of the rule (adapt/asha.py, the same pure code the service calls) a running
variant's metric is judged: it goes on, or it is paused at its checkpoint there. A
paused member ends like any other (its share of the GPU frees, the next pending variant
takes it at the next round, the pack's allocation is given back when its last member
ends) and it is promoted, i.e. requeued from that checkpoint, when later variants make
its rung's top larger. A resumed variant continues from its checkpoint bit for bit
(issue 39), so its curve is the same whether it was paused or not.

Progress in the simulator is solo seconds: step = progress / solo_duration_s x max_steps.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from slurm_dlrm.adapt.asha import (
    RungResult,
    StopRule,
    Verdict,
    eval_noise_sd,
    judge,
    promotable,
    rung_steps,
)
from slurm_dlrm.sim.files import SimJob

# A member this close to its rung (solo seconds) is at it: the event loop's clock steps
# land on milestones up to float error.
_AT_RUNG_S = 1e-6


@dataclass(frozen=True)
class SweepDecision:
    t_s: float
    job_id: int
    verdict: Verdict
    promoted: tuple[int, ...]  # variants this decision made promotable (requeued at once)


@dataclass
class SweepRuntime:
    """The rule's state through one simulated sweep: the rung results in arrival order,
    the paused variants, each variant's next rung, and every decision."""

    rule: StopRule
    metric_at: Mapping[int, Callable[[int], float]]  # job id -> its metric at a step (a pure function)
    eval_every_steps: int = 20  # the runner's eval schedule besides the rungs (the recorded curves': 20)
    results: list[RungResult] = field(default_factory=list)
    paused: dict[str, int] = field(default_factory=dict)  # job id as text -> the rung it paused at
    next_rung: dict[int, int] = field(default_factory=dict)
    decisions: list[SweepDecision] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rungs = rung_steps(self.rule)

    def in_sweep(self, job: SimJob) -> bool:
        return job.job_id in self.metric_at

    def next_goal_s(self, job: SimJob) -> float | None:
        """The progress (solo s) of `job`'s next rung, None past its last one or outside the sweep."""
        if job.job_id not in self.metric_at:
            return None
        k = self.next_rung.get(job.job_id, 0)
        if k >= len(self.rungs):
            return None
        return job.solo_duration_s * self.rungs[k] / self.rule.max_steps

    def due(self, job: SimJob, progress_s: float) -> bool:
        goal = self.next_goal_s(job)
        return goal is not None and progress_s >= goal - _AT_RUNG_S

    def decide(self, job: SimJob, now_s: float) -> tuple[Verdict, list[int]]:
        """`job` is at its next rung: its verdict, and the paused variants now promotable
        (the caller pauses `job` when the verdict says so, then requeues those)."""
        jid = job.job_id
        k = self.next_rung.get(jid, 0)
        step = self.rungs[k]
        self.results.append(RungResult(str(jid), k, step, float(self.metric_at[jid](step)), self.noise_sd(jid, step)))
        verdict = judge(self.rule, self.results, str(jid), k)
        self.next_rung[jid] = k + 1  # judged here once: go on, or pause and (maybe) resume past it
        if not verdict.go_on:
            self.paused[str(jid)] = k
        promoted = [int(v) for v in promotable(self.rule, self.results, self.paused)]
        for p in promoted:
            del self.paused[str(p)]
        self.decisions.append(SweepDecision(now_s, jid, verdict, tuple(promoted)))
        return verdict, promoted

    def noise_sd(self, job_id: int, step: int) -> float:
        """The variant's eval noise from its own evals up to `step` (the schedule's and the rungs'), as the service measures it."""
        if self.eval_every_steps <= 0:
            return 0.0
        at = set(range(self.eval_every_steps, step + 1, self.eval_every_steps)) | {r for r in self.rungs if r <= step}
        metric = self.metric_at[job_id]
        return eval_noise_sd([(s, float(metric(s))) for s in sorted(at)])

    def last_rung(self, job_id: int) -> int:
        """The highest rung `job_id` reached (-1: none)."""
        return self.next_rung.get(job_id, 0) - 1


__all__ = ["SweepDecision", "SweepRuntime"]
