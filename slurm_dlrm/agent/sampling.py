"""How members are measured and held to their budgets: every sampling interval one row
per allocated GPU and one per running member (the GPU memory and SM share of its
process tree from NVML, host CPU and RSS from /proc, samples/s from its metrics file),
then its host-memory budget and, where no MPS daemon fences it, its GPU-memory limit.

Apart from the agent loop (loop.py), which calls these each interval; what a sample row
holds and when a member is over budget is read here (docs/agent.md "Sampling and
reports", "Enforcement and end states").
"""

from __future__ import annotations

from typing import Any

from slurm_dlrm.agent.launch import resolve_pid
from slurm_dlrm.agent.member import Member
from slurm_dlrm.agent.nvml import Nvml, NvmlSnapshot
from slurm_dlrm.agent.placement import MemberPlacement
from slurm_dlrm.agent.procstat import TreeSample
from slurm_dlrm.agent.reports import ReportWriter

MIB = 1 << 20


def sample_gpus(nvml: Nvml, nvml_indices: list[int], reports: ReportWriter) -> tuple[NvmlSnapshot | None, dict[int, Any]]:
    """One NVML snapshot of the node's GPUs and one report row per GPU (`"job_id": null`);
    the snapshot and its GPUs by NVML index, for the members' rows."""
    snap = nvml.sample([i for i in nvml_indices if i >= 0]) if nvml_indices else None
    gpu_by_nvml = {g.index: g for g in snap.gpus} if snap else {}
    for pos, nvml_index in enumerate(nvml_indices):
        g = gpu_by_nvml.get(nvml_index)
        if g is None:
            continue
        reports.sample(None, pos, sm_util_pct=g.sm_util_pct, mem_util_pct=g.mem_util_pct,
                       gpu_mem_bytes=g.memory_used_bytes, gpu_mem_total_bytes=g.memory_total_bytes,
                       nvml_index=nvml_index, gpu_lost=g.lost, **({"error": g.error} if g.error else {}))
    return snap, gpu_by_nvml


def sample_member(m: Member, snap: NvmlSnapshot | None, gpu_by_nvml: dict[int, Any], nvml_indices: list[int],
                  stale_after_s: float, reports: ReportWriter) -> tuple[TreeSample, int | None] | None:
    """One report row for a running member; its process tree and measured GPU memory
    (None: not measured), or None when it has no pid yet or has just exited."""
    p = m.placement
    resolve_pid(m)
    if m.pid is None:
        return None
    tree = m.tree.sample(m.pid)
    if tree is None:
        return None  # exited between the poll and now: reaped next round
    m.last_tree = tree
    gpu_mem = sm = mem_util = None
    nvml_index = nvml_indices[p.gpu_index] if p.gpu_index < len(nvml_indices) else -1
    gpu = gpu_by_nvml.get(nvml_index)
    if snap is not None and gpu is not None and not gpu.lost and gpu.error is None:
        gpu_mem = 0  # measured: a member without a CUDA context yet uses none
        procs = snap.by_pid()
        for pid in tree.pids:
            ps = procs.get(pid)
            if ps is None:
                continue
            if ps.gpu_mem_bytes is not None:
                gpu_mem += ps.gpu_mem_bytes
            if ps.sm_util_pct is not None:
                sm = (sm or 0.0) + ps.sm_util_pct
                mem_util = (mem_util or 0.0) + (ps.mem_util_pct or 0.0)
    sps = m.metrics.samples_per_s(stale_after_s) if m.metrics else None
    reports.sample(p.job_id, p.gpu_index, sm_util_pct=sm, mem_util_pct=mem_util, gpu_mem_bytes=gpu_mem,
                   host_cpu_pct=round(tree.cpu_pct, 2) if tree.cpu_pct is not None else None,
                   rss_bytes=tree.rss_bytes, samples_per_s=sps,
                   **({"rank": p.rank} if p.world_size > 1 else {}))
    return tree, gpu_mem


def budget_breach(p: MemberPlacement, tree: TreeSample, gpu_mem: int | None, tolerance_pct: float,
                  mps_fenced: bool) -> tuple[str, str] | None:
    """(stop reason, detail) when a member is over its host-memory budget or, without an
    MPS daemon (`mps_fenced` false), over its GPU-memory limit, each plus
    `tolerance_pct` (the placement's host_mem_tolerance_pct); else None."""
    tol = 1.0 + tolerance_pct / 100.0
    budget = int(p.host_mem_limit_bytes * tol)
    if tree.rss_bytes > budget:
        return "OOM_HOST", (f"host RSS {tree.rss_bytes} B over budget {p.host_mem_limit_bytes} B "
                            f"+ {tolerance_pct:g}%")
    gpu_budget = int(p.gpu_mem_limit_mib * MIB * tol)
    if not mps_fenced and gpu_mem is not None and gpu_mem > gpu_budget:
        # Without MPS nothing fences GPU memory; stop the member before it takes a neighbour's.
        return "OOM_GPU", (f"GPU memory {gpu_mem} B over limit {p.gpu_mem_limit_mib} MiB "
                           f"+ {tolerance_pct:g}% (no MPS fence)")
    return None
