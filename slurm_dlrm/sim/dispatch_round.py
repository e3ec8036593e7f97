"""The dispatch round as the service runs it: when the next round is due, what it
offers the policy (the pending jobs with aged priorities, each node's free capacity,
the running packs' GPUs to refill or first-fit's shards), and how its plan is applied:
new packs submitted to Slurm, joiners started inside running packs, jobs that can
never fit marked UNPLACEABLE.

Apart from the event loop (sim/engine.py) because this is where the simulator calls
the same `packing.plan` as the service (service/core.py), and where the two must agree.
"""

from __future__ import annotations

from dataclasses import replace

from slurm_dlrm.packing.dispatch import after_round, aged
from slurm_dlrm.packing.model import (
    Join,
    NodeShape,
    OpenGpu,
    PackingRequest,
    rank_members,
    whole_mib_bytes,
)
from slurm_dlrm.packing.policies import plan as make_plan
from slurm_dlrm.sim.events import MEMBER_READY, PACK_START, TICK
from slurm_dlrm.sim.files import SimCluster, SimJob
from slurm_dlrm.sim.planner_view import est_left_s, job_demand, member_limits, round_limits
from slurm_dlrm.sim.state import GpuState, MemberState, PackState, SimState


def schedule_tick(st: SimState) -> None:
    st.dirty = True  # something changed: a round may place what the last one could not
    if st.pending and st.tick_at is None:
        base = st.now if st.last_round is None else max(st.now, st.last_round + st.dispatch.round_seconds)
        st.tick_at = base
        st.events.push(base, TICK, None)


def placed(st: SimState, jid: int) -> None:
    # The first member of a job placed this round leaves the queue (a gang has several).
    st.first_start.setdefault(jid, st.now)
    if jid in st.pending:
        if st.faults is not None:
            st.faults.on_placed(st.pending[jid], st.now)
        del st.pending[jid]


def joinable(st: SimState, pk: PackState) -> bool:
    # An idle pack takes joiners for the agent's join grace (two rounds, as the
    # service's default agent.join_grace_s), not for the rest of its release.
    if pk.node.down or pk.node.name in st.policy_nodes_closed():
        return False
    return pk.live > 0 or (pk.idle_since_s is not None and st.now - pk.idle_since_s < 2.0 * st.dispatch.round_seconds)


def capacity_free(st: SimState) -> bool:
    """Whether a round could place anything: a free GPU, a free shard (first-fit) or a
    running pack to refill."""
    slots = max(1, min(st.limits.shards_per_gpu, st.limits.members_per_gpu))
    closed = st.policy_nodes_closed()
    return (any(n.free_gpus > 0 and not n.down and n.name not in closed for n in st.nodes)
            or any(sum(1 for m in pk.gpus[gi].members if not m.ended) < slots
                   for pk, gi in st.shard_gpus.values() if pk.node.name not in closed)
            or (st.refill and any(joinable(st, pk) for pk in st.running_packs)))


def pack_gpus(st: SimState) -> tuple[OpenGpu, ...]:
    # Refill: every GPU of a running pack, with its live members and what the
    # allocation holds beyond them (it never shrinks, docs/simulate.md).
    out = []
    for pk in sorted(st.running_packs, key=lambda p: p.pack_id):
        if not joinable(st, pk):
            continue
        members = [m for gpu in pk.gpus for m in gpu.members if not m.ended]
        free_cpus = pk.cpus - sum(m.cpus for m in members)
        free_mem = pk.host_mem - sum(m.host_mem for m in members)
        for gpu_index, gpu in enumerate(pk.gpus):
            # A member past its peak reports it (the agent's NVML samples).
            live = tuple(replace(rank_members(job_demand(m.job, st.est_mem[m.job.job_id], est_left_s(m)))[m.rank],
                                 observed_gpu_mem_bytes=m.true_mem if m.peaked else None)
                         for m in gpu.members if not m.ended)
            out.append(OpenGpu(f"{pk.pack_id}:0:{gpu_index}", pk.node.name, len(live), pack=True,
                               gpu_model=pk.node.gpu_model, live=live, free_cpus=free_cpus,
                               free_host_mem_bytes=free_mem, remaining_s=None))
    return tuple(out)


def apply_join(st: SimState, jn: Join) -> None:
    # The joiner starts inside the running allocation: no Slurm submission, only its
    # own start-up; the allocation's CPUs and memory were taken when the pack started.
    pack_id, _node_index, gpu_index = (int(x) for x in jn.gpu_key.split(":"))
    pack = next(pk for pk in st.running_packs if pk.pack_id == pack_id)
    job = st.jobs[jn.member.job_id]
    start = st.progress_saved.get(job.job_id, 0.0)
    fence, soft = member_limits(st, job.job_id, pack.node, jn.member.gpu_mem_limit_mib, jn.member.rank)
    member = MemberState(job, fence, start, start, ready_at=st.now + st.slurm.join_start_s + st.slurm.member_startup_s,
                         cpus=jn.member.cpus, host_mem=jn.member.host_mem_limit_bytes, soft_bytes=soft,
                         rank=jn.member.rank)
    pack.gpus[gpu_index].members.append(member)
    pack.live += 1
    pack.idle_since_s = None
    placed(st, job.job_id)
    st.events.push(member.ready_at, MEMBER_READY, pack)


def run_round(st: SimState) -> None:
    st.rounds += 1
    st.dirty = False
    st.last_round = st.now
    st.arrived_since = 0
    open_gpus = tuple(OpenGpu(key, pk.node.name, sum(1 for m in pk.gpus[gi].members if not m.ended))
                      for key, (pk, gi) in sorted(st.shard_gpus.items(), key=lambda kv: (kv[1][0].pack_id, kv[1][1])))
    closed = st.policy_nodes_closed()  # a multi-node job's nodes (sim/multinode.py)
    open_gpus = tuple(o for o in open_gpus if o.node_name not in closed)
    with_open = {o.node_name for o in open_gpus}
    if st.refill:
        open_gpus += pack_gpus(st)
    # A new pack's agent takes a CPU and some memory beside its members (not first-fit's shards).
    free = tuple(NodeShape(gpu_model=n.gpu_model, gpus=n.free_gpus, cpus=max(0, n.free_cpus - st.agent_cpus),
                           memory_bytes=max(0, n.free_mem - st.agent_mem),
                           count=1, name=n.name) for n in st.nodes
                 if (n.free_gpus > 0 or n.name in with_open) and not n.down and n.name not in closed)
    request = PackingRequest(jobs=aged(sorted(st.pending.values(), key=lambda d: d.job_id), st.waited, st.dispatch),
                             gpu_models=st.cluster.gpu_models, nodes=free, limits=round_limits(st), open_gpus=open_gpus,
                             fair=st.dispatch.fair, now_s=st.now)
    result = make_plan(request, st.policy, st.plan_params)
    st.waited = after_round(st.waited, result)
    for jn in result.joins:
        if st.refill:
            apply_join(st, jn)
            continue
        pack, gi = st.shard_gpus[jn.gpu_key]
        job = st.jobs[jn.member.job_id]
        start = st.progress_saved.get(job.job_id, 0.0)
        member = MemberState(job, None, start, start, ready_at=st.now + st.slurm.submit_to_start_s + st.slurm.member_startup_s,
                             cpus=jn.member.cpus, host_mem=jn.member.host_mem_limit_bytes, rank=jn.member.rank)
        pack.gpus[gi].members.append(member)
        pack.live += 1
        pack.cpus += jn.member.cpus
        pack.host_mem += jn.member.host_mem_limit_bytes
        pack.node.free_cpus -= jn.member.cpus
        pack.node.free_mem -= jn.member.host_mem_limit_bytes
        placed(st, job.job_id)
        st.events.push(member.ready_at, MEMBER_READY, pack)
    for pk in result.packs:
        node = st.by_name[pk.node_name]
        # The allocation takes the members' CPUs and memory plus the policy's refill
        # headroom (Pack.reserve_*), and keeps them until its last member ends.
        # (host memory in whole MiB, as Slurm allocates what the service asks: a joiner a few
        # KiB over the reserve fits the rounding, live and here)
        mem = whole_mib_bytes(pk.alloc_host_mem_bytes)
        node.free_gpus -= pk.gpu_count
        node.free_cpus -= pk.alloc_cpus + st.agent_cpus
        node.free_mem -= mem + st.agent_mem
        gpus = [GpuState() for _ in range(pk.gpu_count)]
        pack = PackState(st.next_pack_id, node, pk.gpu_count, pk.alloc_cpus, mem, pk.mps, gpus,
                         asked_cpus=pk.alloc_cpus, asked_mem=mem, agent_cpus=st.agent_cpus,
                         agent_mem=st.agent_mem)
        st.next_pack_id += 1
        st.packs_made += 1
        for mp in pk.members:
            job = st.jobs[mp.job_id]
            fence, soft = (member_limits(st, job.job_id, node, mp.gpu_mem_limit_mib, mp.rank) if st.fenced
                           else (None, None))
            start = st.progress_saved.get(job.job_id, 0.0)
            ready_at = st.now + st.slurm.submit_to_start_s + st.slurm.member_startup_s
            gpus[mp.gpu_index].members.append(MemberState(job, fence, start, start, ready_at=ready_at, cpus=mp.cpus,
                                                          host_mem=mp.host_mem_limit_bytes, soft_bytes=soft,
                                                          rank=mp.rank))
            pack.live += 1
        for mp in pk.members:
            placed(st, mp.job_id)
        if st.shard_mode:
            for gi in range(pk.gpu_count):
                st.shard_gpus[f"{pack.pack_id}:{gi}"] = (pack, gi)
        st.events.push(st.now + st.slurm.submit_to_start_s, PACK_START, pack)
    for d in result.deferred:
        reason = d.reason
        if reason.startswith("needs "):
            # Too big for any free node: if the cluster's empty nodes cannot take it
            # either, it never will.
            job = st.jobs[d.job_id]
            if not any(could_ever_fit(job, st.est_mem[d.job_id], n, st.cluster) for n in st.cluster.nodes):
                del st.pending[d.job_id]
                st.outcome_state[d.job_id] = "UNPLACEABLE"


def could_ever_fit(job: SimJob, gpu_mem_bytes: int, node: object, cluster: SimCluster) -> bool:
    from slurm_dlrm.packing.model import host_limit_bytes, member_fence_bytes, usable_gpu_bytes

    gpu = cluster.gpu_model(node.gpu_model)  # type: ignore[attr-defined]
    ranks = rank_members(job_demand(job, gpu_mem_bytes, None))
    return (len(ranks) <= node.gpus  # type: ignore[attr-defined]
            and sum(d.cpus for d in ranks) <= node.cpus  # type: ignore[attr-defined]
            and sum(host_limit_bytes(d, cluster.limits) for d in ranks) <= node.memory_bytes  # type: ignore[attr-defined]
            and all(member_fence_bytes(d, gpu, cluster.limits) <= usable_gpu_bytes(gpu) for d in ranks))
