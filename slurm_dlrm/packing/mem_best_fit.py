"""`mem-best-fit`: memory only (a baseline): each job onto the open GPU whose memory it
fills best."""

from __future__ import annotations

import bisect

from slurm_dlrm.packing.common import (
    NO_FREE_GPU,
    NO_ROOM,
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
)


def plan_mem_best_fit(request: PackingRequest, params: InterferenceParams) -> PackingPlan:
    limits = request.limits
    nodes = expand_nodes(request)
    budget = gpu_budget(request, nodes)
    maxima = node_maxima([n for n in nodes if n.free_gpus > 0])
    slots = limits.members_per_gpu
    open_gpus: list[Gpu] = []
    # Per GPU model, the open GPUs with a free slot as (free bytes, opening order), sorted:
    # the best fit is the first entry at or above the job's fence whose node has the
    # CPUs and host memory (a bisection, not a scan of every open GPU: plan_scale.py).
    by_free: dict[str, list[tuple[int, int]]] = {}
    deferred: list[Deferred] = []
    blocked: list[JobDemand] = []
    groups: list[list[Gpu]] = []  # the plan's packs: one GPU each, a multi-GPU job's GPUs together
    for job in sorted(request.jobs, key=order_key):
        if job.is_gang:
            # W fresh GPUs of one node, one fenced rank each; their room takes later jobs.
            if defer_gang_early(job, nodes, limits, True, blocked, deferred):
                continue
            ranks = rank_members(job)
            node = fenced_gang_node(nodes, job, ranks, limits)
            if node is None or len(open_gpus) + job.world_size > budget:
                deferred.append(Deferred(job.job_id, NO_FREE_GPU if len(open_gpus) < budget else NO_ROOM))
                block_if_urgent(blocked, job)
                continue
            gang: list[Gpu] = []
            for m in ranks:
                g = open_gpu(node, slots)
                add_member(g, m, member_fence_bytes(m, node.gpu, limits), limits)
                open_gpus.append(g)
                gang.append(g)
                if len(g.members) < g.slots:
                    bisect.insort(by_free.setdefault(node.gpu.name, []), (g.usable_bytes - g.used_bytes,
                                                                           len(open_gpus) - 1))
            groups.append(gang)
            continue
        if defer_early(job, maxima, limits, True, blocked, deferred):
            continue
        best: tuple[int, int] | None = None  # (bytes left after the job, opening order)
        for entries in by_free.values():
            if not entries:
                continue
            fence = member_fence_bytes(job, open_gpus[entries[0][1]].node.gpu, limits)
            for k in range(bisect.bisect_left(entries, (fence, -1)), len(entries)):
                free, index = entries[k]
                if host_fits(open_gpus[index].node, job, limits):
                    if best is None or (free - fence, index) < best:
                        best = (free - fence, index)
                    break
        if best is None and len(open_gpus) < budget:
            node = fenced_node(nodes, job, limits)
            if node is not None:
                gpu = open_gpu(node, slots)
                open_gpus.append(gpu)
                bisect.insort(by_free.setdefault(node.gpu.name, []), (gpu.usable_bytes, len(open_gpus) - 1))
                best = (0, len(open_gpus) - 1)
                groups.append([gpu])
        if best is None:
            deferred.append(Deferred(job.job_id, NO_FREE_GPU if len(open_gpus) < budget else NO_ROOM))
            block_if_urgent(blocked, job)
            continue
        index = best[1]
        g = open_gpus[index]
        entries = by_free[g.node.gpu.name]
        entries.remove((g.usable_bytes - g.used_bytes, index))
        add_member(g, job, member_fence_bytes(job, g.node.gpu, limits), limits)
        if len(g.members) < g.slots:
            bisect.insort(entries, (g.usable_bytes - g.used_bytes, index))
    return finish_plan("mem-best-fit", groups, deferred, limits, params, fenced=True, thread_caps=False)
