"""`exclusive`: one job per GPU, as Slurm runs them today (a baseline)."""

from __future__ import annotations

from slurm_dlrm.packing.common import (
    NO_FREE_GPU,
    Gpu,
    add_member,
    block_if_urgent,
    defer_early,
    defer_gang_early,
    expand_nodes,
    finish_plan,
    gang_host_fits,
    gpu_budget,
    host_fits,
    node_maxima,
    open_gpu,
    order_key,
)
from slurm_dlrm.packing.interference import (
    InterferenceParams,
)
from slurm_dlrm.packing.model import (
    Deferred,
    JobDemand,
    PackingPlan,
    PackingRequest,
    member_fence_bytes,
    rank_members,
    usable_gpu_bytes,
)


def plan_exclusive(request: PackingRequest, params: InterferenceParams) -> PackingPlan:
    limits = request.limits
    nodes = expand_nodes(request)
    budget = gpu_budget(request, nodes)
    maxima = node_maxima([n for n in nodes if n.free_gpus > 0])
    packs: list[list[Gpu]] = []
    deferred: list[Deferred] = []
    blocked: list[JobDemand] = []
    used = 0
    for job in sorted(request.jobs, key=order_key):
        if job.is_gang:
            # A multi-GPU job: W whole GPUs of one node, one rank on each (--no-pack).
            if defer_gang_early(job, nodes, limits, True, blocked, deferred):
                continue
            ranks = rank_members(job)
            node = next((n for n in nodes if n.free_gpus >= job.world_size and gang_host_fits(n, ranks, limits)
                         and all(member_fence_bytes(m, n.gpu, limits) <= usable_gpu_bytes(n.gpu) for m in ranks)),
                        None)
            if node is None or used + job.world_size > budget:
                deferred.append(Deferred(job.job_id, NO_FREE_GPU))
                block_if_urgent(blocked, job)
                continue
            gpus = []
            for m in ranks:
                g = open_gpu(node, 1)
                add_member(g, m, member_fence_bytes(m, node.gpu, limits), limits)
                gpus.append(g)
            packs.append(gpus)
            used += len(gpus)
            continue
        if defer_early(job, maxima, limits, True, blocked, deferred):
            continue
        node = next((n for n in nodes if n.free_gpus > 0 and host_fits(n, job, limits)
                     and member_fence_bytes(job, n.gpu, limits) <= usable_gpu_bytes(n.gpu)), None)
        if node is None or used >= budget:
            deferred.append(Deferred(job.job_id, NO_FREE_GPU))
            block_if_urgent(blocked, job)
            continue
        g = open_gpu(node, 1)
        add_member(g, job, member_fence_bytes(job, node.gpu, limits), limits)
        packs.append([g])
        used += 1
    return finish_plan("exclusive", packs, deferred, limits, params, fenced=False, thread_caps=False)
