"""Whole-node multi-node jobs in the simulator (issue 48 item 8): what they cost the packs.

A job with `nodes > 1` (SimJob.nodes) is not packed: as `submit` makes it (service/
multinode.py), it is one Slurm job over `nodes` whole nodes (--exclusive), its ranks
alone on their GPUs. Modelled as Slurm and the service treat it:

- Multi-node jobs wait in their own queue, first come first served. Each one, in that
  order, reserves the nodes that will be empty soonest (empty now, else those whose
  packs' members have the least estimated time left), as Slurm's backfill plans the top
  job's start on the nodes that free up first. A reserved node takes no new pack and no
  joiner (its packs drain): the service counts a queued multi-node job's GPUs as held
  (service/plan_view.py) and Slurm would not start a pack there that delays it.
- When all its reserved nodes are empty it starts: it holds them whole (every GPU, CPU
  and byte of memory) for `submit_to_start_s + member_startup_s` plus its solo run
  time (one rank per GPU, alone: no interference), then gives them back.

Not modelled: node failures under a multi-node job (faults leave its nodes alone), and
packs' refill headroom on a node a multi-node job later takes (the pack holds what it
holds until it drains). Pure; sim/engine.py calls `arrive`, `start_ready` and `end`.
"""

from __future__ import annotations

from slurm_dlrm.sim.dispatch_round import schedule_tick
from slurm_dlrm.sim.events import MULTINODE_END
from slurm_dlrm.sim.files import SimJob, Workload
from slurm_dlrm.sim.planner_view import est_left_s
from slurm_dlrm.sim.state import NodeState, SimState, WholeNodeJobs

__all__ = ["WholeNodeJobs", "arrive", "end", "is_whole_node", "start_ready", "with_whole_node_jobs"]


def is_whole_node(job: SimJob) -> bool:
    return job.nodes > 1


def arrive(st: SimState, job: SimJob) -> None:
    assert st.whole_node is not None
    per_node = max(1, job.world_size // job.nodes)
    if sum(1 for n in st.cluster.nodes if n.gpus >= per_node) < job.nodes:
        st.outcome_state[job.job_id] = "UNPLACEABLE"  # submit would refuse it (one line, exit 2)
        return
    st.whole_node.waiting.append(job.job_id)
    start_ready(st)


def _empty(node: NodeState) -> bool:
    return (node.free_gpus == node.gpus and node.free_cpus == node.cpus and node.free_mem == node.memory_bytes
            and not node.down)


def _free_in_s(st: SimState, node: NodeState) -> float:
    """How long until the node's packs have drained, by their members' estimates."""
    left = [est_left_s(m) for pk in st.running_packs if pk.node is node
            for gpu in pk.gpus for m in gpu.members if not m.ended]
    return 0.0 if _empty(node) else max(left, default=0.0) + st.slurm.pack_release_s


def _reserve(st: SimState, job: SimJob, taken: set[str]) -> list[str] | None:
    per_node = max(1, job.world_size // job.nodes)
    fit = [n for n in st.nodes if n.name not in taken and not n.down and n.gpus >= per_node]
    if len(fit) < job.nodes:
        return None
    fit.sort(key=lambda n: (_free_in_s(st, n), n.name))
    return [n.name for n in fit[:job.nodes]]


def start_ready(st: SimState) -> None:
    """Reserve nodes for the waiting jobs in order; start each whose nodes are all empty."""
    wn = st.whole_node
    if wn is None or not wn.waiting:
        return
    taken = {n for names, _ in wn.running.values() for n in names}
    for jid in list(wn.waiting):
        names = wn.reserved.get(jid)
        if names is None:
            names = _reserve(st, st.jobs[jid], taken)
            if names is None:
                break  # first come, first served: the ones behind it wait too
            wn.reserved[jid] = names
        taken |= set(names)
        nodes = [st.by_name[n] for n in names]
        if not all(_empty(n) for n in nodes):
            continue
        for n in nodes:
            n.free_gpus = n.free_cpus = n.free_mem = 0
        wn.waiting.remove(jid)
        del wn.reserved[jid]
        wn.running[jid] = (names, st.now)
        st.first_start.setdefault(jid, st.now)
        job = st.jobs[jid]
        st.events.push(st.now + st.slurm.submit_to_start_s + st.slurm.member_startup_s + job.solo_duration_s,
                       MULTINODE_END, jid)


def end(st: SimState, jid: int) -> None:
    wn = st.whole_node
    assert wn is not None
    names, start = wn.running.pop(jid)
    held_s = st.now - start
    for name in names:
        n = st.by_name[name]
        n.free_gpus, n.free_cpus, n.free_mem = n.gpus, n.cpus, n.memory_bytes
        st.alloc_gpu_s += n.gpus * held_s
        st.busy_gpu_s += n.gpus * st.jobs[jid].solo_duration_s
        st.held_cpu_s += n.cpus * held_s
        st.held_mem_byte_s += n.memory_bytes * held_s
    st.outcome_state[jid] = "COMPLETED"
    st.outcome_end[jid] = st.now
    start_ready(st)
    st.dirty = True  # its nodes are the packs' again
    if st.pending and st.tick_at is None:
        schedule_tick(st)


def with_whole_node_jobs(workload: Workload, count: int, nodes: int, gpus_per_node: int, duration_s: float,
                         name_suffix: str = "+multinode") -> Workload:
    """`workload` with `count` multi-node jobs (`nodes` x `gpus_per_node` ranks, each
    `duration_s` long) arriving evenly over its arrival span; the others' ids are kept."""
    from dataclasses import replace

    jobs = list(workload.jobs)
    t0, t1 = (jobs[0].arrival_s, jobs[-1].arrival_s) if jobs else (0.0, 0.0)
    next_id = max((j.job_id for j in jobs), default=0) + 1
    template = jobs[0]
    for i in range(count):
        at = t0 + (t1 - t0) * (i + 0.5) / count
        jobs.append(replace(template, job_id=next_id + i, name=f"multinode-{i}", arrival_s=at,
                            solo_duration_s=duration_s, est_duration_s=duration_s, world_size=nodes * gpus_per_node,
                            rank_scales=(), nodes=nodes, label="multi-node"))
    jobs.sort(key=lambda j: (j.arrival_s, j.job_id))
    return replace(workload, name=workload.name + name_suffix, jobs=tuple(jobs))
