"""Issue 47 item 5: the simulator plays sweeps with the stopping rule (slurm_dlrm/sim/sweep*.py),
its curve family fitted to curves real runs recorded (tests/data/sweep_curves.json). No torch."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from slurm_dlrm.adapt.asha import StopRule
from slurm_dlrm.cli import cli
from slurm_dlrm.sim import parse_cluster, simulate
from slurm_dlrm.sim.sweep import SweepRuntime
from slurm_dlrm.sim.sweep_curves import (
    fit_curve,
    fit_family,
    held_out_error,
    power_law,
    recorded_variants,
)
from slurm_dlrm.sim.sweep_play import VariantShape, play_drawn, play_sweep, sweep_workload

ROOT = Path(__file__).resolve().parents[1]
CURVES = ROOT / "tests" / "data" / "sweep_curves.json"
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


def test_fit_recovers_a_known_power_law_and_the_recorded_curves_fit_on_held_out_points():
    pts = [(s, power_law(s, 0.77, 0.4, 0.6)) for s in range(20, 541, 20)]
    f = fit_curve(pts)
    assert abs(f.a - 0.77) < 1e-3 and abs(f.c - 0.6) < 0.05 and f.rmse < 1e-4
    with pytest.raises(ValueError):
        fit_curve(pts[:2])
    data = json.loads(CURVES.read_text())
    variants = recorded_variants(data)
    assert len(variants) >= 6 and len({v.batch_size for v in variants}) >= 2
    assert all(v.curve[-1][0] == v.steps and len(v.curve) >= 20 for v in variants)
    err = held_out_error(variants)
    # measured by benchmarks/sweep_sim.py on the file: the held-out evals between the
    # fitted ones (interp) well under the spread of the variants' final AUCs
    spread = max(v.curve[-1][1] for v in variants) - min(v.curve[-1][1] for v in variants)
    assert err.interp_rmse < 0.01 and err.interp_rmse < spread / 5
    fam = fit_family(variants)
    assert fam.draw(27, seed=3) == fam.draw(27, seed=3) and fam.draw(27, seed=3) != fam.draw(27, seed=4)
    assert 0 < fam.noise_sd < 0.01 and all(not math.isnan(x) for x in fam.bandwidth)
    # curves recorded later and never fitted (benchmarks/sweep_sim.py judges the family on them)
    held = recorded_variants(json.loads((ROOT / "tests" / "data" / "sweep_curves_held_out.json").read_text()))
    assert held and not {v.sweep for v in held} & {v.sweep for v in variants}
    assert held_out_error(held).extrap_rmse < 0.03  # measured 0.0148


def test_seeded_sweeps_from_the_recorded_curves_play_to_the_end():
    fam = fit_family(recorded_variants(json.loads(CURVES.read_text())))
    o = play_drawn(fam, RULE, _cluster(), 27, seed=5)  # the sweep size
    assert o.variants == 27 and 1 <= o.completed_stop < 27 and o.gpu_hours_stop < o.gpu_hours_full


def test_simulate_sweep_cli(tmp_path):
    res = CliRunner().invoke(cli, ["simulate", "--sweep", str(CURVES), "-c",
                                   str(ROOT / "benchmarks/sim/cluster_1gpu.yaml"), "--sweeps", "2",
                                   "--variants", "9", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["summary"]["sweeps"] == 2 and len(out["sweeps"]) == 2 and out["rule"]["min_steps"] == 30  # 540 // 18
    bad = tmp_path / "bad.json"
    bad.write_text('{"sweeps": [{"name": "x"}]}')
    for args, what in ((["--sweep", str(bad)], "--sweep"),
                       (["--sweep", str(CURVES), "-w", str(bad)], "--sweep"),
                       ([], "-w/--workload")):
        res = CliRunner().invoke(cli, ["simulate", "-c", str(ROOT / "benchmarks/sim/cluster_1gpu.yaml"), *args])
        assert res.exit_code == 2 and res.output.startswith(f"slurm-dlrm: error: {what}"), res.output
        assert res.output.count("\n") == 1


def test_a_sweep_with_the_rule_is_packed_one_gpu_to_a_pack():
    # A Slurm allocation never shrinks: in a 4-GPU pack the last survivors would hold all
    # four GPUs. Variants that may pause (JobDemand.may_pause) get one GPU per pack.
    c = parse_cluster(yaml.safe_load((ROOT / "benchmarks/sim/cluster_4gpu.yaml").read_text()))
    plain = simulate(sweep_workload([3600.0] * 12, VariantShape()), c, "complementary")
    pausable = simulate(sweep_workload([3600.0] * 12, VariantShape(), may_pause=True), c, "complementary")
    assert plain.packs == 1 and pausable.packs >= 4
    assert all(j.state == "COMPLETED" for j in pausable.jobs)


def test_the_residual_splits_into_eval_noise_and_a_slow_wander():
    import random

    from slurm_dlrm.sim.sweep_curves import RecordedVariant, observed_metric, residual_parts

    rng = random.Random(1)
    steps = range(20, 541, 20)

    def recorded(wander: float) -> list[RecordedVariant]:
        out = []
        for k in range(6):
            curve = tuple((s, power_law(s, 0.75 + 0.005 * k, 0.4, 0.6) + wander * math.sin(s / 90.0 + k)
                           + rng.gauss(0.0, 0.002)) for s in steps)
            out.append(RecordedVariant("x", {}, curve, 0.01, 256, 540))
        return out

    white = recorded(0.0)
    w, wander, _ = residual_parts(white, [fit_curve(v.curve) for v in white])
    assert 0.0013 < w < 0.0027 and wander < w  # the eval noise it was given, little else
    slow = recorded(0.006)
    w2, wander2, phi2 = residual_parts(slow, [fit_curve(v.curve) for v in slow])
    assert w2 < 0.003 and wander2 > w2 and wander2 > 2 * wander and phi2 > 0.9  # the slow part is not noise
    # a slow starter's curve below the first recorded eval stays at the untrained model's AUC
    from slurm_dlrm.sim.sweep_curves import VariantDraw

    m = observed_metric(VariantDraw(0.78, 20.0, 0.5, 1.0), 0.0, 1, 0)
    assert power_law(20, 0.78, 20.0, 0.5) < 0 and m(20) == 0.5
    noisy = observed_metric(VariantDraw(0.78, 0.4, 0.5, 1.0), 0.002, 1, 0, 0.004, 0.96)
    assert noisy(100) == noisy(100) and noisy(100) != noisy(120)  # pure in (seed, variant, step)
