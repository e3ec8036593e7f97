"""Play one sweep twice on a simulated cluster (issue 47 item 5): every variant to its
end, then with the stopping rule (sim/sweep.py), the same variants and the same curves;
what it saved in GPU-hours and whether the full sweep's best variant reached the end.

The variants are jobs alike in what they take of a GPU (one sweep of one model), all
submitted at once; their run times differ as their step times do (batch size, embedding
dims). GPU-hours are the allocations' (what Slurm charges: a pack holds its GPUs until
its last member ends).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from slurm_dlrm.adapt.asha import StopRule
from slurm_dlrm.sim.engine import simulate
from slurm_dlrm.sim.files import SimCluster, SimJob, Workload
from slurm_dlrm.sim.sweep import SweepRuntime
from slurm_dlrm.sim.sweep_curves import CurveFamily, family_metric

GIB = 1 << 30
# issue 47's live target: the stopped sweep's best AUC within 0.002 of the full sweep's
NEAR_BEST = 0.002


@dataclass(frozen=True)
class VariantShape:
    """What one variant takes of a GPU and a node (the sweep's model; estimates = truth)."""

    gpu_mem_bytes: int = 6 * GIB
    host_mem_bytes: int = 8 * GIB
    sm_util_pct: float = 30.0
    membw_util_pct: float = 20.0
    host_cpu_cores: float = 2.0


@dataclass(frozen=True)
class SweepOutcome:
    variants: int
    gpu_hours_full: float
    gpu_hours_stop: float
    best_full: int  # job id of the full sweep's best variant (final metric)
    best_stop: int  # ... of the best among those that reached the end with the rule
    best_value_full: float
    best_value_stop: float
    completed_stop: int  # variants that reached the end with the rule
    promotions: int
    makespan_full_s: float
    makespan_stop_s: float
    # every variant to the end packed as the stopped sweep is (one GPU to a pack): what
    # the rule saves by itself, without the packing of a sweep that may pause
    gpu_hours_full_same_packing: float = 0.0

    @property
    def saved_x(self) -> float:
        return self.gpu_hours_full / self.gpu_hours_stop if self.gpu_hours_stop > 0 else float("inf")

    @property
    def saved_x_same_packing(self) -> float:
        return self.gpu_hours_full_same_packing / self.gpu_hours_stop if self.gpu_hours_stop > 0 else float("inf")

    @property
    def same_best(self) -> bool:
        return self.best_full == self.best_stop


def sweep_workload(durations_s: Sequence[float], shape: VariantShape, name: str = "sweep",
                   may_pause: bool = False) -> Workload:
    """The variants as jobs; `may_pause`: submitted with a stopping rule (the planner
    packs them one GPU to a pack, JobDemand.may_pause)."""
    jobs = tuple(SimJob(job_id=i, name=f"{name}-{i}", arrival_s=0.0, solo_duration_s=d, may_pause=may_pause,
                        gpu_mem_bytes=shape.gpu_mem_bytes, host_mem_bytes=shape.host_mem_bytes,
                        sm_util_pct=shape.sm_util_pct, membw_util_pct=shape.membw_util_pct,
                        host_cpu_cores=shape.host_cpu_cores, label="sweep",
                        true_gpu_mem_bytes=shape.gpu_mem_bytes, true_sm_util_pct=shape.sm_util_pct,
                        true_membw_util_pct=shape.membw_util_pct, est_duration_s=d)
                 for i, d in enumerate(durations_s))
    return Workload(name, jobs)


def play_sweep(metric_at: Mapping[int, Callable[[int], float]], durations_s: Sequence[float], rule: StopRule,
               cluster: SimCluster, policy: str = "complementary", shape: VariantShape | None = None) -> SweepOutcome:
    """Variant i (job id i) has run time `durations_s[i]` and metric `metric_at[i](step)`;
    `rule.max_steps` is every variant's last step. Higher is better for the rule's metric
    when asha.METRICS says so; the best variant is judged by the metric at the last step."""
    from slurm_dlrm.adapt.asha import METRICS

    shape = shape or VariantShape()
    full = simulate(sweep_workload(durations_s, shape), cluster, policy)
    # one GPU per pack changes nothing where a node has one GPU
    one_gpu = all(n.gpus <= 1 for n in cluster.nodes)
    alike = full if one_gpu else simulate(sweep_workload(durations_s, shape, may_pause=True), cluster, policy)
    runtime = SweepRuntime(rule, metric_at)
    stop = simulate(sweep_workload(durations_s, shape, may_pause=True), cluster, policy, sweep=runtime)
    sign = 1.0 if METRICS[rule.metric] else -1.0
    final = {i: metric_at[i](rule.max_steps) for i in range(len(durations_s))}
    done_full = [j.job_id for j in full.jobs if j.state == "COMPLETED"]
    done_stop = [j.job_id for j in stop.jobs if j.state == "COMPLETED"]
    if len(done_full) != len(durations_s) or not done_stop:
        raise RuntimeError(f"the sweep did not finish: {len(done_full)} of {len(durations_s)} variants "
                           f"completed in full, {len(done_stop)} with the rule")
    best_full = max(done_full, key=lambda i: sign * final[i])
    best_stop = max(done_stop, key=lambda i: sign * final[i])
    return SweepOutcome(len(durations_s), full.gpu_hours, stop.gpu_hours, best_full, best_stop, final[best_full],
                        final[best_stop], len(done_stop),
                        sum(len(d.promoted) for d in runtime.decisions), full.makespan_s, stop.makespan_s,
                        alike.gpu_hours)


def play_drawn(family: CurveFamily, rule: StopRule, cluster: SimCluster, variants: int, seed: int,
               solo_s: float = 3600.0, policy: str = "complementary") -> SweepOutcome:
    """One seeded sweep of `variants` variants drawn from `family` (sim/sweep_curves.py),
    each `solo_s` alone on a GPU at its sweep's median batch size, played twice."""
    draws = family.draw(variants, seed)
    metric = {i: family_metric(family, d, seed, i) for i, d in enumerate(draws)}
    return play_sweep(metric, [solo_s * d.work_ratio for d in draws], rule, cluster, policy)


@dataclass(frozen=True)
class SweepSummary:
    sweeps: int
    variants: int
    saved_x_median: float
    saved_x_min: float
    same_best_pct: float
    regret_median: float  # best metric of the full sweep minus the rule's (0 when the same)
    regret_max: float
    completed_median: float
    near_best_pct: float  # sweeps whose best with the rule is within NEAR_BEST of the full sweep's (the live target's)
    saved_x_same_packing_median: float = 0.0

    def line(self) -> str:
        return (f"sweeps={self.sweeps} variants={self.variants} saved_x_median={self.saved_x_median:.2f} "
                f"same_best_pct={self.same_best_pct:.1f} saved_x_min={self.saved_x_min:.2f} "
                f"regret_median={self.regret_median:.4f} regret_max={self.regret_max:.4f} "
                f"near_best_pct={self.near_best_pct:.1f} completed_median={self.completed_median:.1f} "
                f"saved_x_same_packing_median={self.saved_x_same_packing_median:.2f}")


def summarize(outcomes: Sequence[SweepOutcome], higher_is_better: bool = True) -> SweepSummary:
    sign = 1.0 if higher_is_better else -1.0
    regrets = [sign * (o.best_value_full - o.best_value_stop) for o in outcomes]
    return SweepSummary(len(outcomes), outcomes[0].variants if outcomes else 0,
                        statistics.median(o.saved_x for o in outcomes), min(o.saved_x for o in outcomes),
                        100.0 * sum(o.same_best for o in outcomes) / len(outcomes), statistics.median(regrets),
                        max(regrets), statistics.median(o.completed_stop for o in outcomes),
                        100.0 * sum(r <= NEAR_BEST for r in regrets) / len(outcomes),
                        statistics.median(o.saved_x_same_packing for o in outcomes))


__all__ = ["SweepOutcome", "SweepSummary", "VariantShape", "play_drawn", "play_sweep", "summarize", "sweep_workload"]
