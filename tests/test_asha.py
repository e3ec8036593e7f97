"""The pure stopping rule of a sweep (adapt/asha.py): what goes on, what pauses, what is promoted."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_dlrm.adapt.asha import (
    METRICS,
    RungResult,
    StopRule,
    eval_noise_sd,
    judge,
    noise_margin,
    promotable,
    rule_problem,
    rung_of_step,
    rung_steps,
)

AUC = StopRule(metric="auc", min_steps=40, reduction=3, max_steps=1000)


def test_rungs_are_min_steps_times_reduction_powers_below_the_end():
    assert rung_steps(AUC) == (40, 120, 360)
    assert rung_steps(StopRule(min_steps=100, reduction=2, max_steps=800)) == (100, 200, 400)  # 800 is the end
    assert rung_steps(StopRule(min_steps=0, max_steps=800)) == ()
    assert rung_of_step(AUC, 120) == 1 and rung_of_step(AUC, 121) is None


def test_problems_name_what_is_wrong():
    assert rule_problem(AUC) is None
    assert "reduction" in (rule_problem(StopRule(min_steps=10, reduction=1, max_steps=100)) or "")
    assert "min_steps" in (rule_problem(StopRule(min_steps=100, max_steps=100)) or "")
    assert "unknown" in (rule_problem(StopRule(metric="acc", min_steps=10, max_steps=100)) or "")


def test_first_arrival_goes_on_a_worse_second_pauses_a_better_one_goes_on():
    results = [RungResult("1", 0, 40, 0.70)]
    v = judge(AUC, results, "1", 0)
    assert v.go_on and v.rank == 1 and v.reached == 1 and v.keep == 1 and v.cut is None
    results.append(RungResult("2", 0, 40, 0.65))
    v = judge(AUC, results, "2", 0)
    assert not v.go_on and v.rank == 2 and v.cut == 0.70 and v.keep == 1
    results.append(RungResult("3", 0, 40, 0.75))
    assert judge(AUC, results, "3", 0).go_on


def test_keep_is_a_third_of_those_that_reached_and_the_cut_follows_it():
    results = [RungResult(str(i), 0, 40, v) for i, v in enumerate([0.60, 0.61, 0.62, 0.63, 0.64, 0.65])]
    v = judge(AUC, results, "4", 0)  # 0.64: second best of six, keep = 2
    assert v.go_on and v.keep == 2 and v.reached == 6 and v.cut == 0.64
    v = judge(AUC, results, "3", 0)
    assert not v.go_on and v.rank == 3 and v.cut == 0.64


def test_eval_noise_is_measured_from_a_variants_own_evals_with_the_trend_cancelled():
    import random

    assert eval_noise_sd([(20, 0.70), (40, 0.71)]) == 0.0  # too few to tell noise from trend
    assert eval_noise_sd([(s, 0.5 + 0.0004 * s) for s in range(20, 400, 20)]) == pytest.approx(0.0, abs=1e-12)
    rng = random.Random(7)
    curve = [(s, 0.78 - 0.2 * s ** -0.5) for s in range(20, 4020, 20)] + [(30, 0.78 - 0.2 * 30 ** -0.5)]
    noisy = [(s, y + rng.gauss(0.0, 0.003)) for s, y in curve]  # uneven spacing at 30: a rung off the schedule
    assert eval_noise_sd(noisy) == pytest.approx(0.003, rel=0.15)
    assert eval_noise_sd([*noisy, (40, float("nan"))]) == pytest.approx(eval_noise_sd(noisy), rel=0.05)
    assert noise_margin(0.003) == pytest.approx(2 * math.sqrt(2) * 0.003) and noise_margin(0.0) == 0.0


def test_a_variant_within_its_eval_noise_of_the_cut_goes_on_one_further_pauses():
    first = RungResult("1", 0, 40, 0.70)
    assert judge(AUC, [first, RungResult("2", 0, 40, 0.695, noise_sd=0.002)], "2", 0).go_on  # margin 0.0057
    v = judge(AUC, [first, RungResult("2", 0, 40, 0.69, noise_sd=0.002)], "2", 0)
    assert not v.go_on and v.margin == pytest.approx(noise_margin(0.002)) and v.cut == 0.70
    assert not judge(AUC, [first, RungResult("2", 0, 40, 0.699)], "2", 0).go_on  # no noise measured: no margin
    loss = StopRule(metric="loss", min_steps=40, reduction=3, max_steps=1000)
    lo = [RungResult("1", 0, 40, 0.50), RungResult("2", 0, 40, 0.505, noise_sd=0.002)]
    assert judge(loss, lo, "2", 0).go_on and not judge(loss, [lo[0], RungResult("2", 0, 40, 0.51, 0.002)], "2", 0).go_on
    # a margin keeps a variant going; it does not promote a paused one (promotion is by rank)
    assert promotable(AUC, [first, RungResult("2", 0, 40, 0.695, noise_sd=0.002)], {"2": 0}) == []


def test_lower_is_better_for_loss_and_ne():
    from slurm_dlrm.spec import SWEEP_METRICS

    assert not METRICS["loss"] and not METRICS["ne"] and METRICS["auc"]
    assert sorted(SWEEP_METRICS) == sorted(METRICS)
    rule = StopRule(metric="ne", min_steps=40, reduction=2, max_steps=1000)
    results = [RungResult("a", 0, 40, 0.9), RungResult("b", 0, 40, 0.8)]
    assert judge(rule, results, "b", 0).go_on
    results.append(RungResult("c", 0, 40, 0.95))
    v = judge(rule, results, "c", 0)
    assert not v.go_on and v.cut == 0.8 and v.rank == 3 and v.keep == 1


def test_rungs_are_judged_apart():
    results = [RungResult("a", 0, 40, 0.9), RungResult("a", 1, 120, 0.5), RungResult("b", 0, 40, 0.6),
               RungResult("b", 1, 120, 0.7)]
    assert judge(AUC, results, "b", 1).go_on  # 0.7 beats a's 0.5 at rung 1
    assert not judge(AUC, results, "b", 0).go_on


def test_a_paused_variant_is_promoted_once_later_arrivals_lower_the_cut():
    results = [RungResult("1", 0, 40, 0.70), RungResult("2", 0, 40, 0.68)]
    assert not judge(AUC, results, "2", 0).go_on
    paused = {"2": 0}
    assert promotable(AUC, results, paused) == []
    results += [RungResult(str(i), 0, 40, 0.5 + i / 100) for i in range(3, 7)]  # four worse ones: keep = 2
    assert promotable(AUC, results, paused) == ["2"]
    assert judge(AUC, results, "2", 0).go_on


def test_promotable_lists_best_first_and_only_paused_ones():
    results = [RungResult(str(i), 0, 40, v) for i, v in enumerate([0.9, 0.5, 0.8, 0.7, 0.6, 0.4, 0.3, 0.2, 0.1])]
    # keep = 3 of 9: variants 0, 2 and 3 are the top; 1 (0.5) is not.
    assert promotable(AUC, results, {"3": 0, "2": 0, "1": 0}) == ["2", "3"]
    assert promotable(AUC, results, {}) == []


def test_ties_rank_the_earlier_arrival_first_and_nan_last():
    results = [RungResult("a", 0, 40, 0.7), RungResult("b", 0, 40, 0.7)]
    assert judge(AUC, results, "a", 0).go_on and not judge(AUC, results, "b", 0).go_on
    results = [RungResult("n", 0, 40, math.nan), RungResult("x", 0, 40, 0.1)]
    assert judge(AUC, results, "x", 0).rank == 1


def test_a_repeated_result_counts_once_with_its_latest_value():
    results = [RungResult("a", 0, 40, 0.5), RungResult("b", 0, 40, 0.6), RungResult("a", 0, 40, 0.7)]
    v = judge(AUC, results, "a", 0)
    assert v.reached == 2 and v.rank == 1 and v.value == 0.7


def test_judging_a_variant_without_a_result_is_refused():
    with pytest.raises(ValueError):
        judge(AUC, [RungResult("a", 0, 40, 0.5)], "b", 0)


values = st.lists(st.floats(0.0, 1.0, allow_nan=False), min_size=1, max_size=40, unique=True)


@settings(max_examples=150, deadline=None)
@given(values, st.integers(2, 5))
def test_async_rule_ends_with_the_true_top_going_on_or_promotable(vals, reduction):
    """Played in arrival order, with promotions after each arrival: when all have arrived, exactly
    the top max(1, n // reduction) are going on (went on, or promoted), and no paused variant beats one that went on
    unless it is promotable."""
    rule = StopRule(metric="auc", min_steps=10, reduction=reduction, max_steps=100)
    results: list[RungResult] = []
    going: set[str] = set()
    paused: dict[str, int] = {}
    for i, v in enumerate(vals):
        name = str(i)
        results.append(RungResult(name, 0, 10, v))
        verdict = judge(rule, results, name, 0)
        assert verdict.go_on == (verdict.rank <= verdict.keep)
        if verdict.cut is not None:
            assert verdict.go_on == (v >= verdict.cut)
        (going.add(name) if verdict.go_on else paused.__setitem__(name, 0))
        for p in promotable(rule, results, paused):
            assert judge(rule, results, p, 0).go_on
            del paused[p]
            going.add(p)
    keep = max(1, len(vals) // reduction)
    top = {str(i) for i in sorted(range(len(vals)), key=lambda i: -vals[i])[:keep]}
    assert top <= going
    assert promotable(rule, results, paused) == []
    # Nothing goes on that was never in the top at its arrival: at most one per arrival beyond keep.
    assert len(going) <= len(vals)


@settings(max_examples=100, deadline=None)
@given(values)
def test_order_of_the_results_changes_nothing_but_ties(vals):
    rule = StopRule(metric="loss", min_steps=10, reduction=3, max_steps=100)
    results = [RungResult(str(i), 0, 10, v) for i, v in enumerate(vals)]
    forward = [judge(rule, results, r.variant, 0).go_on for r in results]
    backward = [judge(rule, results[::-1], r.variant, 0).go_on for r in results]
    assert forward == backward
