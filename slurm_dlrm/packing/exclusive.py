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
    fenced_gang_node,
    fenced_node,
    finish_plan,
    gpu_budget,
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
            node = fenced_gang_node(nodes, job, ranks, limits)
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
        node = fenced_node(nodes, job, limits)
        if node is None or used >= budget:
            deferred.append(Deferred(job.job_id, NO_FREE_GPU))
            block_if_urgent(blocked, job)
            continue
        g = open_gpu(node, 1)
        add_member(g, job, member_fence_bytes(job, node.gpu, limits), limits)
        packs.append([g])
        used += 1
    return finish_plan("exclusive", packs, deferred, limits, params, fenced=False, thread_caps=False)
