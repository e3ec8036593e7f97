"""Batched dispatch (RMixer's batched dispatcher) as pure functions.

The service asks the policy once per *round* with every pending job of the user. A
round runs as soon as `round_batch_size` jobs arrived since the last one, or when
`round_seconds` passed and something is pending.

Aging counts the rounds in which a job was *passed over*: the round placed other jobs
but not this one (a round that placed nothing, because nothing was free, does not
count, so a busy cluster does not make everyone old at once). Every
`max_wait_rounds // 3` such rounds raise the job's priority by `age_weight` (priority
bands: within a band the policy may prefer short jobs), and after `max_wait_rounds` it
is urgent (priority >= URGENT_PRIORITY): the policy then lets nothing of lower
priority take room ahead of it, so it gets the next room that fits it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from slurm_dlrm.packing.common import URGENT_PRIORITY
from slurm_dlrm.packing.model import FairConfig, JobDemand, PackingPlan
from slurm_dlrm.site import SiteConfig

FAIRNESS_RULES = ("slowdown", "rounds")


@dataclass(frozen=True)
class DispatchConfig:
    round_seconds: float = 10.0
    round_batch_size: int = 16
    max_wait_rounds: int = 30
    age_weight: float = 1.0  # priority added per age band
    # "slowdown" (the default, issue 40): the slowdown bound of slurm_dlrm.packing.fairness
    # orders the queue and reserves GPUs for waiting gangs; round-based aging is off.
    # "rounds": aging by passed-over rounds (docs/packing.md: what each costs).
    fairness: str = "slowdown"
    fair_config: FairConfig = FairConfig()

    @property
    def age_band_rounds(self) -> int:
        return max(1, self.max_wait_rounds // 3)

    @classmethod
    def from_site(cls, site: SiteConfig) -> DispatchConfig:
        p = site.packing
        return cls(round_seconds=p.round_seconds, round_batch_size=p.round_batch_size, max_wait_rounds=p.max_wait_rounds,
                   fairness=p.fairness,
                   fair_config=FairConfig(overdue_slowdown=p.overdue_slowdown,
                                          gang_reserve_slowdown=p.gang_reserve_slowdown,
                                          min_wait_s=p.overdue_min_wait_s))

    @property
    def fair(self) -> FairConfig | None:
        """The request's slowdown bound (None under the "rounds" rule)."""
        return self.fair_config if self.fairness == "slowdown" else None


def should_run_round(now_s: float, last_round_s: float | None, pending: int, arrived_since_last: int,
                     cfg: DispatchConfig) -> bool:
    """Whether a dispatch round is due now."""
    if pending <= 0:
        return False
    if arrived_since_last >= cfg.round_batch_size:
        return True
    return last_round_s is None or now_s - last_round_s >= cfg.round_seconds - 1e-9


def next_round_time(last_round_s: float, cfg: DispatchConfig) -> float:
    """When the time window next forces a round (if anything is pending then)."""
    return last_round_s + cfg.round_seconds


def effective_priority(base_priority: float, waited_rounds: int, cfg: DispatchConfig) -> float:
    """Base priority plus the age bonus; urgent once the wait bound is reached."""
    if waited_rounds >= cfg.max_wait_rounds:
        # Among urgent jobs, the one that waited longest still goes first.
        return URGENT_PRIORITY + waited_rounds + base_priority * 1e-6
    return base_priority + cfg.age_weight * (waited_rounds // cfg.age_band_rounds)


def aged(jobs: Sequence[JobDemand], waited_rounds: Mapping[int, int], cfg: DispatchConfig) -> tuple[JobDemand, ...]:
    """The jobs with their priority replaced by the effective (aged) priority; under the
    slowdown bound (`cfg.fairness`) unchanged: the policy applies the bound itself."""
    if cfg.fairness == "slowdown":
        return tuple(jobs)
    return tuple(replace(j, priority=effective_priority(j.priority, waited_rounds.get(j.job_id, 0), cfg))
                 for j in jobs)


def after_round(waited_rounds: Mapping[int, int], plan: PackingPlan) -> dict[int, int]:
    """Waited-round counters after a round: placed jobs drop out; deferred ones age by 1
    if the round placed anything (they were passed over), else keep their count."""
    step = 1 if plan.packs else 0
    return {d.job_id: waited_rounds.get(d.job_id, 0) + step for d in plan.deferred}

