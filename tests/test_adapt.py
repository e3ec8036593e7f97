import itertools

import pytest

from slurm_dlrm.adapt import (
    MemberOutcome,
    PerfModel,
    Profile,
    SpeedSample,
    allocate_shares,
    decide_after_oom,
    decide_repack,
    find_stragglers,
    fit_perf_model,
    members_to_requeue,
    update_after_warmup,
    warm_start,
)

MIB = 1 << 20
GIB = 1 << 30


def test_fit_recovers_known_coefficients_from_noisy_points():
    truth = PerfModel(2e-6, 30e-6, 40e-6, 0)
    points = []
    noise = itertools.cycle([0.98, 1.02, 1.0, 0.99, 1.01])
    for share, cores in itertools.product([10, 25, 50, 100], [1, 2, 4, 8]):
        points.append((share, cores, truth.samples_per_s(share, cores) * next(noise)))
    model = fit_perf_model(points)
    assert model is not None and model.points == 16
    for share, cores in [(20, 3), (70, 6)]:
        rel = model.samples_per_s(share, cores) / truth.samples_per_s(share, cores)
        assert 0.97 < rel < 1.03
    assert model.gpu_s_at_full_share == pytest.approx(30e-6, rel=0.15)


def test_fit_needs_two_points_and_keeps_coefficients_non_negative():
    assert fit_perf_model([(50, 2, 1000.0)]) is None
    # Points where more cores look slower (noise) must not yield a negative host cost.
    model = fit_perf_model([(50, 1, 1000.0), (50, 8, 990.0), (100, 1, 1500.0)])
    assert model is not None
    assert min(model.fixed_s, model.gpu_s_at_full_share, model.host_core_s) >= 0


def test_cores_for_stops_where_more_cores_stop_helping():
    host_heavy = PerfModel(0.0, 1e-6, 80e-6, 4)
    gpu_heavy = PerfModel(0.0, 80e-6, 1e-6, 4)
    assert host_heavy.cores_for(50, max_cores=16) > gpu_heavy.cores_for(50, max_cores=16)
    assert gpu_heavy.cores_for(50, max_cores=16) == 1


def test_allocate_shares_gives_sm_to_the_gpu_bound_member():
    gpu_bound = PerfModel(1e-6, 50e-6, 1e-6, 4)
    host_bound = PerfModel(1e-6, 2e-6, 50e-6, 4)
    shares = allocate_shares([gpu_bound, host_bound], total_pct=100, min_pct=10)
    assert sum(shares) == 100
    assert shares[0] > shares[1] >= 10


def test_allocate_shares_refuses_impossible_minimum():
    with pytest.raises(ValueError):
        allocate_shares([PerfModel(0, 1e-6, 0, 2)] * 11, min_pct=10)


def test_oom_raise_follows_observed_error_not_doubling():
    d = decide_after_oom("gpu", gpu_est_bytes=2 * GIB, host_est_bytes=GIB, limit_bytes=int(2.1 * GIB),
                         measured_peak_bytes=int(2.05 * GIB), attempt=1, max_attempts=3, capacity_bytes=80 * GIB)
    assert d.action == "requeue"
    assert 2.1 * GIB * 1.09 < d.gpu_mem_bytes < 2.1 * GIB * 1.2  # a 10% raise, far from 4 GiB
    assert d.host_mem_bytes == GIB
    assert d.gpu_mem_bytes % (2 * MIB) == 0

    far_off = decide_after_oom("host", 2 * GIB, GIB, limit_bytes=2 * GIB, measured_peak_bytes=2 * GIB,
                               attempt=1, max_attempts=3, capacity_bytes=256 * GIB)
    assert far_off.host_mem_bytes >= 4 * GIB - 2 * MIB  # 100% wrong -> 100% raise
    assert "host" in far_off.reason


def test_a_retry_after_a_limit_below_the_estimate_asks_at_least_the_estimate():
    """The site calibration may lower a first run's host limit under its estimate; an OOM
    there retries with at least the estimate, and the reason says the figure it asks."""
    d = decide_after_oom("host", GIB, 3 * GIB, limit_bytes=2 * GIB, measured_peak_bytes=2 * GIB,
                         attempt=1, max_attempts=3, capacity_bytes=256 * GIB)
    assert d.action == "requeue" and d.host_mem_bytes == 3 * GIB
    assert d.reason.endswith(f"with {3 * GIB // MIB} MiB")


def test_oom_gives_up_at_retry_limit_or_capacity():
    d = decide_after_oom("gpu", GIB, GIB, GIB, GIB, attempt=3, max_attempts=3, capacity_bytes=80 * GIB)
    assert d.action == "fail" and "3 times" in d.reason
    d = decide_after_oom("gpu", 70 * GIB, GIB, 80 * GIB, 80 * GIB, attempt=1, max_attempts=3, capacity_bytes=80 * GIB)
    assert d.action == "fail" and "any placement" in d.reason
    d = decide_after_oom("gpu", 70 * GIB, GIB, 75 * GIB, None, attempt=1, max_attempts=3, capacity_bytes=80 * GIB)
    assert d.action == "requeue" and d.gpu_mem_bytes == 80 * GIB


def test_lost_pack_requeues_only_unfinished_members():
    members = [MemberOutcome(1, "COMPLETED"), MemberOutcome(2, "RUNNING"), MemberOutcome(3, "CANCELLED"),
               MemberOutcome(4, "PLANNED")]
    assert [j for j, _ in members_to_requeue("NODE_FAIL", members)] == [2, 4]
    assert members_to_requeue("COMPLETED", members) == []


def test_straggler_needs_a_sustained_covered_window():
    pred = {1: 1000.0, 2: 1000.0, 3: 1000.0}
    samples = []
    for t in range(0, 200, 10):
        samples.append(SpeedSample(1, t, 500.0))  # slow all along: straggler
        samples.append(SpeedSample(2, t, 500.0 if t != 150 else 900.0))  # one good sample: not
    samples += [SpeedSample(3, t, 100.0) for t in range(150, 200, 10)]  # too new to judge
    found = find_stragglers(samples, pred, now=200, ratio=0.7, sustained_s=120)
    assert [s.job_id for s in found] == [1]
    assert found[0].measured_samples_per_s == 500.0


def test_three_stages():
    analytic = Profile(30, 20, 2, 1000)
    assert warm_start(analytic, []).from_jobs == 0
    ws = warm_start(analytic, [Profile(10, 5, 1, 900), Profile(12, 6, 1, 950), Profile(50, 5, 1, 100)])
    assert ws.profile.sm_util_pct == 12 and ws.from_jobs == 3
    assert update_after_warmup(analytic, Profile(31, 20, 2, 1000)).replan is False
    assert update_after_warmup(analytic, Profile(60, 20, 2, 1000)).replan is True
    assert decide_repack(1000, 1050, 3600, 60).repack is False
    assert decide_repack(1000, 1500, 3600, 60).repack is True
    assert decide_repack(1000, 1500, 90, 60).repack is False  # restart would not pay off
