"""The dmem soft limit the service writes per member (`gpu_mem_estimate_mib`, issue 43
item 5): a larger margin, configured or learned, must never loosen it."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from service_harness import FakeClock, add_job, make_site

from slurm_dlrm.packing.model import (
    demand_from_estimate,
    dmem_soft_limit_bytes,
    limits_from_site,
    member_fence_bytes,
)
from slurm_dlrm.service.core import PackingService, ServiceSettings
from slurm_dlrm.site import MIB
from slurm_dlrm.slurm.fake import FakeSlurm
from slurm_dlrm.store.store import Store

USER = "root"


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dmem")
    clock = FakeClock()
    site = make_site(tmp)
    store = Store(tmp / "store.sqlite", clock=clock)
    service = PackingService(store, FakeSlurm(clock=clock, user=USER), site,
                             ServiceSettings(user=USER, python="/venv/bin/python", dispatch_window_s=0.0), clock=clock)
    yield service
    store.close()


def _placement(fence_bytes: int) -> SimpleNamespace:
    return SimpleNamespace(node_index=0, gpu_index=0, mps_thread_pct=100, gpu_mem_limit_bytes=fence_bytes,
                           host_mem_limit_bytes=1 << 30, cpus=1, rank=None, world_size=None)


@settings(max_examples=30, deadline=None)
@given(gpu_mib=st.integers(700, 60_000), raise_mib=st.sampled_from([0, 0, 512, 4096]),
       margins=st.lists(st.floats(0.0, 300.0, allow_nan=False), min_size=2, max_size=2))
def test_a_larger_margin_never_loosens_the_soft_limit(svc, gpu_mib, raise_mib, margins):
    """The fence is sized with the round's margin (the configured one, or a larger one
    learned from measured errors, service/measured.py); the soft limit beside it must not
    grow with it. Before: soft = fence - the *configured* margin, so a learned margin of
    50% over a configured 5% gave a member 45% of its estimate more before it became an
    eviction candidate."""
    store = svc.store
    jid = add_job(store, f"j{gpu_mib}-{raise_mib}", gpu_gib=gpu_mib / 1024)
    if raise_mib:  # an OOM raised the request (recovery.py)
        j = store.get_job(jid)
        store.conn.execute("UPDATE jobs SET gpu_mem_request_bytes = ? WHERE id = ?",
                           (j.est_gpu_peak_bytes + raise_mib * MIB, jid))
    job = store.get_job(jid)
    gpu = svc.site.gpu_models["h100"]
    demand = demand_from_estimate(job.estimate, job_id=jid, user=USER, submit_time_s=0.0)
    demand = replace(demand, gpu_mem_bytes=demand.gpu_mem_bytes + raise_mib * MIB)
    base = limits_from_site(svc.site)
    soft = []
    for pct in sorted(margins):
        fence = member_fence_bytes(demand, gpu, replace(base, memory_margin_pct=pct))
        entry = svc.member_entry(job, _placement(fence), "h100")
        assert entry["gpu_mem_estimate_mib"] <= entry["gpu_mem_limit_mib"]
        soft.append(entry["gpu_mem_estimate_mib"])
    assert soft[1] <= soft[0], (margins, soft)
    # and it is the estimate (with the raise) plus the context: not tighter than that
    expect_mib = -(-(demand.gpu_mem_bytes + gpu.cuda_context_bytes + gpu.cublas_workspace_bytes) // MIB)
    assert soft[0] == expect_mib


@given(own=st.integers(0, 1 << 40), m1=st.floats(0, 500), m2=st.floats(0, 500))
def test_soft_limit_is_monotone_in_the_fence_margin_and_under_the_fence(own, m1, m2):
    gpu = SimpleNamespace(cuda_context_bytes=600 * MIB, cublas_workspace_bytes=8 * MIB)
    lo, hi = sorted((m1, m2))
    fence_lo = int(own * (1 + lo / 100)) + 608 * MIB
    fence_hi = int(own * (1 + hi / 100)) + 608 * MIB
    s_lo = dmem_soft_limit_bytes(own, gpu, fence_lo)  # type: ignore[arg-type]
    s_hi = dmem_soft_limit_bytes(own, gpu, fence_hi)  # type: ignore[arg-type]
    assert s_hi <= s_lo and s_lo <= fence_lo and s_hi <= fence_hi
    # a fence below the estimate (a warm start that lowered the demand) caps it
    assert dmem_soft_limit_bytes(own, gpu, 100 * MIB) == min(100 * MIB, own + 608 * MIB)  # type: ignore[arg-type]
