"""`first-fit`: count-based slots like gres/shard (a baseline): up to `shards_per_gpu`
members per GPU in queue order, no memory awareness and no fence (gres/shard fences
nothing). Busy shard GPUs (`OpenGpu` with `pack=False`) are filled first."""

from __future__ import annotations

from slurm_dlrm.errors import BadInput
from slurm_dlrm.packing.common import (
    NO_FREE_GPU,
    NO_ROOM,
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
    Join,
    MemberPlacement,
    PackingPlan,
    PackingRequest,
    host_limit_bytes,
    member_fence_bytes,
    rank_members,
    usable_gpu_bytes,
)
from slurm_dlrm.site import MIB


def plan_first_fit(request: PackingRequest, params: InterferenceParams) -> PackingPlan:
    limits = request.limits
    nodes = expand_nodes(request)
    budget = gpu_budget(request, nodes)
    slots = max(1, min(limits.shards_per_gpu, limits.members_per_gpu))
    by_name = {n.name: n for n in nodes}
    # Busy GPUs with free shards come first, as Slurm would fill them.
    shared: list[tuple[str, Gpu]] = []
    for og in request.open_gpus:
        if og.pack:
            continue  # our packs' GPUs are not shards
        node = by_name.get(og.node_name)
        if node is None:
            raise BadInput(f"open_gpus: node {og.node_name!r} is not among the request's nodes")
        g = Gpu(node=node, usable_bytes=usable_gpu_bytes(node.gpu), slots=max(0, slots - og.members))
        shared.append((og.key, g))
    reachable = [n for n in nodes if n.free_gpus > 0 or any(g.node is n and g.slots > 0 for _, g in shared)]
    maxima = node_maxima(reachable)
    open_gpus: list[Gpu] = []
    # The GPUs with a free shard, in the order first-fit tries them (busy shared GPUs,
    # then the ones opened here); a GPU leaves when its shards are taken, so a plan does
    # not walk over full GPUs for every job (plan_scale.py).
    with_room = [g for _, g in shared if g.slots > 0]
    deferred: list[Deferred] = []
    blocked: list[JobDemand] = []
    groups: list[list[Gpu]] = []  # the plan's packs: one GPU each, a multi-GPU job's GPUs together
    for job in sorted(request.jobs, key=order_key):
        if job.is_gang:
            # W shards, one per GPU of one node, unfenced (gres/shard with --gpus-per-task
            # semantics): W fresh GPUs as one Slurm job; their other shards take later jobs.
            if defer_gang_early(job, nodes, limits, False, blocked, deferred):
                continue
            ranks = rank_members(job)
            node = next((n for n in nodes if n.free_gpus >= job.world_size and gang_host_fits(n, ranks, limits)), None)
            if node is None or len(open_gpus) + job.world_size > budget:
                deferred.append(Deferred(job.job_id, NO_FREE_GPU if len(open_gpus) < budget else NO_ROOM))
                block_if_urgent(blocked, job)
                continue
            gang: list[Gpu] = []
            for m in ranks:
                g = open_gpu(node, slots)
                add_member(g, m, member_fence_bytes(m, node.gpu, limits), limits)
                gang.append(g)
                open_gpus.append(g)
                if len(g.members) < g.slots:
                    with_room.append(g)
            groups.append(gang)
            continue
        if defer_early(job, maxima, limits, False, blocked, deferred):
            continue
        target = next((g for g in with_room if host_fits(g.node, job, limits)), None)
        if target is None and len(open_gpus) < budget:
            node = next((n for n in nodes if n.free_gpus > 0 and host_fits(n, job, limits)), None)
            if node is not None:
                target = open_gpu(node, slots)
                open_gpus.append(target)
                with_room.append(target)
                groups.append([target])
        if target is None:
            deferred.append(Deferred(job.job_id, NO_FREE_GPU if len(open_gpus) < budget else NO_ROOM))
            block_if_urgent(blocked, job)
            continue
        add_member(target, job, member_fence_bytes(job, target.node.gpu, limits), limits)
        if len(target.members) >= target.slots:
            with_room = [g for g in with_room if g is not target]
    result = finish_plan("first-fit", groups, deferred, limits, params, fenced=False, thread_caps=False)
    joins = []
    for key, g in shared:
        whole_gpu_mib = usable_gpu_bytes(g.node.gpu) // MIB
        for j in g.members:
            joins.append(Join(key, MemberPlacement(
                job_id=j.job_id, node_index=0, gpu_index=0, mps_thread_pct=100, gpu_mem_limit_mib=whole_gpu_mib,
                host_mem_limit_bytes=host_limit_bytes(j, limits), cpus=j.cpus, predicted_speed=1.0)))
    return PackingPlan(result.policy, result.packs, result.deferred, tuple(joins))
