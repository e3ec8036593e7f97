"""Property tests of the packing policies (hypothesis) and the exhaustive-optimum check."""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from slurm_dlrm.packing import (
    POLICY_NAMES,
    JobDemand,
    NodeShape,
    PackingLimits,
    PackingRequest,
    member_fence_bytes,
    plan,
    predict_colocated_speeds,
)
from slurm_dlrm.packing.model import host_limit_bytes, usable_gpu_bytes
from slurm_dlrm.site import GIB, MIB, GpuModel

# Shrinking an exhaustive-search failure takes minutes; the failing example is reported as is.
NO_SHRINK = [Phase.explicit, Phase.reuse, Phase.generate]
H100 = GpuModel("h100", 80, 132, 3350, 67, 494, 520, 32)
A100 = GpuModel("a100", 40, 108, 1555, 19.5, 156, 450, 8)
MODELS = {"h100": H100, "a100": A100}


@st.composite
def jobs_st(draw: st.DrawFn, max_jobs: int = 30) -> list[JobDemand]:
    n = draw(st.integers(1, max_jobs))
    out = []
    for i in range(n):
        out.append(JobDemand(
            job_id=i, user="u", submit_time_s=draw(st.floats(0, 1000)), priority=draw(st.sampled_from([0.0, 1.0, 2.0])),
            gpu_mem_bytes=draw(st.integers(0, 90 * GIB)), host_mem_bytes=draw(st.integers(0, 64 * GIB)),
            sm_util_pct=draw(st.floats(0, 100)), membw_util_pct=draw(st.floats(0, 100)),
            host_cpu_cores=draw(st.floats(0.1, 12)),
            est_duration_s=draw(st.one_of(st.none(), st.floats(60, 86400)))))
    return out


@st.composite
def request_st(draw: st.DrawFn) -> PackingRequest:
    jobs = draw(jobs_st())
    shapes = []
    for k in range(draw(st.integers(1, 3))):
        model = draw(st.sampled_from(sorted(MODELS)))
        shapes.append(NodeShape(model, draw(st.integers(0, 8)), draw(st.integers(4, 128)),
                                draw(st.integers(16, 1024)) * GIB, count=draw(st.integers(1, 3)), name=f"s{k}"))
    mpg = draw(st.integers(1, 12))
    limits = PackingLimits(max_members_per_gpu=mpg, mps_client_limit=draw(st.integers(1, 48)),
                           memory_margin_pct=draw(st.floats(0, 30)), max_gpus_per_pack=draw(st.integers(1, 8)),
                           shards_per_gpu=draw(st.integers(1, 12)))
    max_gpus = draw(st.one_of(st.none(), st.integers(0, 20)))
    return PackingRequest(jobs=tuple(jobs), gpu_models=(H100, A100), nodes=tuple(shapes), limits=limits,
                          max_gpus=max_gpus)


def _check(req: PackingRequest, policy: str) -> None:
    p = plan(req, policy)
    placed = list(p.placed_job_ids)
    deferred = [d.job_id for d in p.deferred]
    # Every job exactly once: placed or deferred with a reason.
    assert sorted(placed + deferred) == sorted(j.job_id for j in req.jobs)
    assert all(d.reason for d in p.deferred)
    by_id = {j.job_id: j for j in req.jobs}
    lim = req.limits
    gpus_used = 0
    per_shape_cpus: dict[str, int] = defaultdict(int)
    per_shape_mem: dict[str, int] = defaultdict(int)
    for pk in p.packs:
        gpu = MODELS[pk.gpu_model]
        gpus_used += pk.gpu_count
        shape = next(s for s in req.nodes if pk.node_name.split("#")[0] == s.name)
        assert pk.gpu_count <= shape.gpus and pk.node_count == 1
        per_shape_cpus[pk.node_name] += pk.alloc_cpus  # members + refill headroom
        per_shape_mem[pk.node_name] += pk.alloc_host_mem_bytes
        assert per_shape_cpus[pk.node_name] <= shape.cpus
        assert per_shape_mem[pk.node_name] <= shape.memory_bytes
        assert pk.host_mem_bytes == sum(host_limit_bytes(by_id[m.job_id], lim) for m in pk.members)
        if policy in ("exclusive", "first-fit"):
            assert pk.reserve_cpus == pk.reserve_host_mem_bytes == 0
        for g in range(pk.gpu_count):
            members = pk.members_on(g)
            assert members, "a pack GPU without members"
            assert len(members) <= lim.mps_client_limit
            if policy == "first-fit":
                assert len(members) <= min(lim.shards_per_gpu, lim.members_per_gpu)
                continue
            assert len(members) <= lim.max_members_per_gpu
            # Memory-aware: the fences fit the GPU (after the MPS server's context).
            fences = sum(member_fence_bytes(by_id[m.job_id], gpu, lim) for m in members)
            assert fences <= usable_gpu_bytes(gpu)
            assert all(m.gpu_mem_limit_mib * MIB >= member_fence_bytes(by_id[m.job_id], gpu, lim) for m in members)
            assert all(1 <= m.mps_thread_pct <= 100 for m in members)
            if policy == "exclusive":
                assert len(members) == 1
    if req.max_gpus is not None:
        assert gpus_used <= req.max_gpus
    # Deterministic.
    assert plan(req, policy) == p


@settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(request_st(), st.sampled_from(POLICY_NAMES))
def test_plans_respect_memory_clients_and_account_for_every_job(req: PackingRequest, policy: str) -> None:
    _check(req, policy)


# ---------------------------------------------------------------- exhaustive optimum

def _throughput(members: list[JobDemand]) -> float:
    return sum(predict_colocated_speeds(members)) if members else 0.0


def _optimum(jobs: list[JobDemand], gpus: int, lim: PackingLimits, cpus: int) -> float:
    """Best summed predicted speed over every assignment of jobs to GPUs (or none)."""
    best = 0.0
    usable = usable_gpu_bytes(H100)
    fences = [member_fence_bytes(j, H100, lim) for j in jobs]
    for assign in itertools.product(range(gpus + 1), repeat=len(jobs)):
        if sum(j.cpus for j, a in zip(jobs, assign, strict=True) if a) > cpus:
            continue
        total = 0.0
        ok = True
        for g in range(1, gpus + 1):
            on = [k for k, a in enumerate(assign) if a == g]
            if len(on) > lim.members_per_gpu or sum(fences[k] for k in on) > usable:
                ok = False
                break
            total += _throughput([jobs[k] for k in on])
        if ok and total > best:
            best = total
    return best


@st.composite
def small_instance(draw: st.DrawFn, max_jobs: int) -> list[JobDemand]:
    n = draw(st.integers(2, max_jobs))
    return [JobDemand(job_id=i, user="u", submit_time_s=float(i), priority=0.0,
                      gpu_mem_bytes=draw(st.integers(1, 40)) * GIB, host_mem_bytes=GIB,
                      sm_util_pct=draw(st.floats(2, 60)), membw_util_pct=draw(st.floats(2, 60)),
                      host_cpu_cores=draw(st.integers(1, 6)))
            for i in range(n)]


def _within_5pct(jobs: list[JobDemand], gpus: int, cpus: int) -> None:
    lim = PackingLimits(max_members_per_gpu=8)
    req = PackingRequest(jobs=tuple(jobs), gpu_models=(H100,), nodes=(NodeShape("h100", gpus, cpus, 1024 * GIB, name="n"),),
                         limits=lim)
    p = plan(req, "complementary")
    got = p.predicted_throughput
    # Best use of the GPUs the plan takes (a plan may leave a GPU free for later jobs
    # rather than spread a few members thin; on one GPU this is the plain optimum).
    used = sum(pk.gpu_count for pk in p.packs)
    best = _optimum(jobs, max(1, used), lim, cpus)
    assert got >= 0.95 * best - 1e-9, (got, best, used)


@pytest.fixture(scope="module", autouse=True)
def _draws_independent_of_imports():
    """Hypothesis (6.1xx) mixes the literal constants of every local module in sys.modules
    into its draws, so a derandomized test drew other examples in the full suite than
    alone (a new module anywhere changed them). The optimum checks below draw from the
    global constants only, so they test the same instances wherever they run."""
    try:
        from hypothesis.internal.cache import LRUCache
        from hypothesis.internal.conjecture import providers
        from hypothesis.internal.conjecture.providers import Constants
    except ImportError:  # another Hypothesis: nothing to pin
        yield
        return
    saved = providers._get_local_constants, providers.CONSTANTS_CACHE
    empty = Constants(integers=type(providers._local_constants.integers)(),
                      floats=type(providers._local_constants.floats)(key=providers.float_to_int),
                      bytes=type(providers._local_constants.bytes)(),
                      strings=type(providers._local_constants.strings)())
    providers._get_local_constants = lambda: empty
    providers.CONSTANTS_CACHE = LRUCache(1024)
    try:
        yield
    finally:
        providers._get_local_constants, providers.CONSTANTS_CACHE = saved


@settings(max_examples=10, deadline=None, derandomize=True, phases=NO_SHRINK)
@given(small_instance(12))
def test_complementary_within_5pct_of_optimum_on_one_gpu(jobs: list[JobDemand]) -> None:
    _within_5pct(jobs, gpus=1, cpus=32)


@settings(max_examples=10, deadline=None, derandomize=True, phases=NO_SHRINK)
@given(small_instance(7))
def test_complementary_within_5pct_of_optimum_on_two_gpus(jobs: list[JobDemand]) -> None:
    _within_5pct(jobs, gpus=2, cpus=24)


def _jobs(rows: list[tuple[int, float, float, int]]) -> list[JobDemand]:
    return [JobDemand(job_id=i, user="u", submit_time_s=float(i), priority=0.0, gpu_mem_bytes=gib * GIB,
                      host_mem_bytes=GIB, sm_util_pct=sm, membw_util_pct=bw, host_cpu_cores=cores)
            for i, (gib, sm, bw, cores) in enumerate(rows)]


def test_complementary_within_5pct_when_cpus_bind_on_two_gpus() -> None:
    """Drawn by small_instance(7) once the suite had imported more modules (see the fixture
    above). CPUs bind (27 asked, 24 there): complementary planned {3,4,5} + {0,2,6} and
    deferred job 1 (5.489, 93.9 % of the optimum {0,1,2} + {3,4,5}, 5.846): its polish
    exchanged jobs 0 and 4 between the GPUs after the per-GPU exact step had run, which
    left room for job 1 in place of the CPU-heavy job 6. The exact step now runs again
    after the polish and takes it."""
    _within_5pct(_jobs([(14, 2.00001, 39.137201867986875, 3), (38, 2.0, 8.263163391430073, 5),
                        (13, 35.784194496272285, 60.0, 3), (16, 2.00001, 45.22913348835821, 4),
                        (24, 33.93790381206258, 51.41512123343732, 1), (29, 16.0, 3.172746397264433, 5),
                        (32, 2.00001, 24.102352278466785, 6)]), gpus=2, cpus=24)


# ---------------------------------------------------------------- refill (joins onto running packs)

@st.composite
def refill_request_st(draw: st.DrawFn) -> PackingRequest:
    """A queue, maybe some free nodes, and 1-2 running packs of 1-3 GPUs with live members."""
    from slurm_dlrm.packing.model import OpenGpu

    jobs = draw(jobs_st(max_jobs=20))
    live_jobs = draw(jobs_st(max_jobs=8))
    live = [JobDemand(**{**j.__dict__, "job_id": 1000 + j.job_id, "gpu_mem_bytes": j.gpu_mem_bytes // 4})
            for j in live_jobs]
    shapes = [NodeShape("h100", draw(st.integers(0, 2)), 64, 512 * GIB, name="free")] if draw(st.booleans()) else []
    open_gpus = []
    for pack_id in range(draw(st.integers(1, 2))):
        model = draw(st.sampled_from(sorted(MODELS)))
        free_cpus = draw(st.integers(0, 24))
        free_mem = draw(st.integers(0, 128)) * GIB
        remaining = draw(st.one_of(st.none(), st.floats(0, 86400)))
        for gpu_index in range(draw(st.integers(1, 3))):
            on = [j for k, j in enumerate(live) if k % 3 == gpu_index and k % 2 == pack_id][:2]
            open_gpus.append(OpenGpu(f"{pack_id}:0:{gpu_index}", f"busy{pack_id}", len(on), pack=True,
                                     gpu_model=model, live=tuple(on), free_cpus=free_cpus,
                                     free_host_mem_bytes=free_mem, remaining_s=remaining))
    limits = PackingLimits(max_members_per_gpu=draw(st.integers(1, 8)), mps_client_limit=draw(st.integers(1, 48)),
                           memory_margin_pct=draw(st.floats(0, 30)))
    if draw(st.booleans()):
        jobs = [JobDemand(**{**j.__dict__, "time_limit_s": draw(st.floats(60, 86400))}) for j in jobs]
    return PackingRequest(jobs=tuple(jobs), gpu_models=(H100, A100), nodes=tuple(shapes), limits=limits,
                          open_gpus=tuple(open_gpus))


@settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(refill_request_st(), st.sampled_from(POLICY_NAMES))
def test_refill_joins_respect_live_members_and_the_allocation(req: PackingRequest, policy: str) -> None:
    from slurm_dlrm.packing.interference import predict_speeds_from_fractions

    p = plan(req, policy)
    assert plan(req, policy) == p  # deterministic
    placed = list(p.placed_job_ids)
    assert sorted(placed + [d.job_id for d in p.deferred]) == sorted(j.job_id for j in req.jobs)
    if policy in ("exclusive", "first-fit"):
        assert not p.joins  # only our memory-aware policies refill packs
        return
    by_id = {j.job_id: j for j in req.jobs}
    lim = req.limits
    ogs = {o.key: o for o in req.open_gpus}
    cpus_by_node: dict[str, int] = defaultdict(int)
    host_by_node: dict[str, int] = defaultdict(int)
    for key, og in ogs.items():
        joined = [j for j in p.joins if j.gpu_key == key]
        if not joined:
            continue
        gpu = MODELS[og.gpu_model]
        jobs = [by_id[j.member.job_id] for j in joined]
        members = list(og.live) + jobs
        # No GPU memory or client limit exceeded, counting the live members.
        assert sum(member_fence_bytes(j, gpu, lim) for j in members) <= usable_gpu_bytes(gpu)
        assert len(members) <= min(lim.max_members_per_gpu, lim.mps_client_limit)
        for jn, job in zip(joined, jobs, strict=True):
            assert jn.member.gpu_mem_limit_mib * MIB >= member_fence_bytes(job, gpu, lim)
            assert (jn.member.node_index, jn.member.gpu_index) == (0, int(key.split(":")[2]))
        cpus_by_node[key.rsplit(":", 1)[0]] += sum(j.cpus for j in jobs)
        host_by_node[key.rsplit(":", 1)[0]] += sum(host_limit_bytes(j, lim) for j in jobs)
        # The joiners' time limits (or their expected run at the predicted speed) fit.
        if og.remaining_s is not None:
            speeds = (predict_speeds_from_fractions([min(1.0, j.sm_util_pct / 100) for j in members],
                                                    [min(1.0, j.membw_util_pct / 100) for j in members])
                      if len(members) > 1 else [1.0])
            speed_of = dict(zip([j.job_id for j in members], speeds, strict=True))
            for job in jobs:
                need = job.time_limit_s if job.time_limit_s is not None else (
                    job.est_duration_s / (speed_of[job.job_id] if policy == "complementary" else 1.0)
                    if job.est_duration_s is not None else None)
                assert need is not None and need <= og.remaining_s + 1e-6
    # Joins respect the allocation's free CPUs and host memory on each pack node.
    for group, cpus in cpus_by_node.items():
        og = ogs[f"{group}:0"] if f"{group}:0" in ogs else next(o for k, o in ogs.items() if k.startswith(group + ":"))
        assert og.free_cpus is not None and og.free_host_mem_bytes is not None
        assert cpus <= og.free_cpus
        assert host_by_node[group] <= og.free_host_mem_bytes
