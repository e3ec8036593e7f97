"""Issue 47 item 5: the simulator plays sweeps with the stopping rule (slurm_dlrm/sim/sweep*.py),
its curve family fitted to curves real runs recorded (tests/data/sweep_curves.json). No torch."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import yaml

from slurm_dlrm.adapt.asha import StopRule
from slurm_dlrm.sim import parse_cluster, simulate
from slurm_dlrm.sim.sweep import SweepRuntime
from slurm_dlrm.sim.sweep_curves import (
    power_law,
)
from slurm_dlrm.sim.sweep_play import VariantShape, play_sweep, sweep_workload

ROOT = Path(__file__).resolve().parents[1]
RULE = StopRule("auc", 20, 3, 540)


def _cluster(members_per_gpu: int = 8):
    c = parse_cluster(yaml.safe_load((ROOT / "benchmarks/sim/cluster_1gpu.yaml").read_text()))
    return replace(c, limits=replace(c.limits, max_members_per_gpu=members_per_gpu))


def _ranked(n: int):
    """Variant i levels off at 0.75 - 0.01 i, same shape: 0 is the best at every step."""
    return {i: (lambda s, a=0.75 - 0.01 * i: power_law(s, a, 0.3, 0.5)) for i in range(n)}


def test_paused_variants_free_their_share_and_are_promoted_when_the_cut_moves():
    # Two at a time on the GPU, arriving best first: each newcomer is worse than those
    # before it, so it pauses at rung 0, until enough have arrived that rung 0's top
    # (reached // 3) takes in the best paused one again: promoted from its checkpoint.
    n = 9
    metric = _ranked(n)
    cluster = _cluster(members_per_gpu=2)
    runtime = SweepRuntime(RULE, metric)
    res = simulate(sweep_workload([3600.0] * n, VariantShape()), cluster, "complementary", sweep=runtime)
    state = {j.job_id: j.state for j in res.jobs}
    promoted = [p for d in runtime.decisions for p in d.promoted]
    assert promoted and state[0] == "COMPLETED"  # the best goes on at every rung
    assert set(state.values()) == {"COMPLETED", "STOPPED"}
    # ASHA's promise at the end: at every rung, the top max(1, reached // 3) went past it
    for k, step in enumerate((20, 60, 180)):
        at = sorted({r.variant for r in runtime.results if r.rung == k}, key=lambda v: -metric[int(v)](step))
        keep = max(1, len(at) // 3)
        for v in at[:keep]:
            assert runtime.last_rung(int(v)) > k or state[int(v)] == "COMPLETED", (k, v, runtime.last_rung(int(v)))
    for j in res.jobs:  # a STOPPED variant paused at its last rung and was never promoted after
        if j.state == "STOPPED":
            assert str(j.job_id) not in promoted or runtime.last_rung(j.job_id) >= 1
    full = simulate(sweep_workload([3600.0] * n, VariantShape()), cluster, "complementary")
    assert all(j.state == "COMPLETED" for j in full.jobs)
    assert res.gpu_hours < full.gpu_hours / 2  # their shares went to the next variants


def test_a_sweep_played_twice_keeps_its_best_and_saves_gpu_hours():
    o = play_sweep(_ranked(27), [3600.0] * 27, RULE, _cluster())
    assert o.same_best and o.best_full == 0 and o.saved_x > 2.0
    assert 1 <= o.completed_stop < 27 and o.gpu_hours_full > o.gpu_hours_stop
    # a late bloomer (the worst at the first rungs, the best at the end) is cut: the rule
    # cannot know, and the play says so
    metric = {**_ranked(27), 26: lambda s: power_law(s, 0.80, 10.0, 1.0)}
    assert metric[26](20) < min(metric[i](20) for i in range(26)) and metric[26](540) > metric[0](540)
    late = play_sweep(metric, [3600.0] * 27, RULE, _cluster())
    assert late.best_full == 26 and not late.same_best and late.best_value_full > late.best_value_stop
