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
            # W shards on W distinct GPUs of one node (NCCL takes one rank per GPU), no
            # fence: busy GPUs with a free shard first, as for any job, then fresh ones.
            room: dict[str, int] = {}
            for g in with_room:
                room[g.node.name] = room.get(g.node.name, 0) + 1
            if defer_gang_early(job, nodes, limits, False, blocked, deferred, room):
                continue
            ranks = rank_members(job)
            chosen: list[Gpu] | None = None
            for node in nodes:
                if not gang_host_fits(node, ranks, limits):
                    continue
                cands = [g for g in with_room if g.node is node][:job.world_size]
                fresh = job.world_size - len(cands)
                if fresh <= node.free_gpus and len(open_gpus) + fresh <= budget:
                    for _ in range(fresh):
                        g = open_gpu(node, slots)
                        open_gpus.append(g)
                        with_room.append(g)
                        groups.append([g])
                        cands.append(g)
                    chosen = cands
                    break
            if chosen is None:
                deferred.append(Deferred(job.job_id, NO_FREE_GPU if len(open_gpus) < budget else NO_ROOM))
                block_if_urgent(blocked, job)
                continue
            for m, g in zip(ranks, chosen, strict=True):
                add_member(g, m, member_fence_bytes(m, g.node.gpu, limits), limits)
            with_room = [g for g in with_room if len(g.members) < g.slots]
            # The ranks on GPUs opened this round form one Slurm job: their packs merge
            # (ranks on busy shard GPUs join those, see `joins`).
            mine = [grp for grp in groups if any(g is c for g in grp for c in chosen)]
            if len(mine) > 1:
                groups = [grp for grp in groups if not any(grp is x for x in mine)] + [[g for grp in mine for g in grp]]
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
                host_mem_limit_bytes=host_limit_bytes(j, limits), cpus=j.cpus, predicted_speed=1.0,
                rank=j.rank, world_size=j.world_size)))
    return PackingPlan(result.policy, result.packs, result.deferred, tuple(joins))
