"""Discrete-event replay of a workload on a cluster through one packing policy (pure).

The mechanism is the same for every policy, only `plan()` differs:

- Jobs arrive; a dispatch round runs when `round_batch_size` jobs arrived since the
  last one or every `round_seconds` while jobs are pending and a GPU is free (a round
  with no free GPU could only defer). Each round asks the policy with the pending jobs
  (aged priorities) and the free capacity of every node.
- Each planned pack is one Slurm job: its GPUs, CPUs and host memory are taken at once;
  it starts `submit_to_start_s` later (scheduler pass + prolog); every member then
  spends `member_startup_s` (imports, CUDA context) before it trains; a joiner of a
  running pack starts `join_start_s` after the round that planned it (the agent looks
  at its joins folder), then spends `member_startup_s` too. A pack gives its GPUs back
  only when its last member has ended (a Slurm allocation does not shrink), and
  `pack_release_s` after that (the agent's join grace, its exit, the epilog; a joiner
  planned meanwhile keeps the pack).
- Members of one GPU progress at the speeds the *truth* gives for their true profiles
  (`true_params`: the analytic model by default, or any `speed_model` such as the
  synthetic generator of slurm_dlrm/truth.py); the policies plan with `plan_params`.
- At `peak_at_frac` of its run a member reaches its true peak memory. With a fence
  (mem-best-fit, complementary: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT) it dies if its own
  peak passes its fence; without one (exclusive, first-fit) it dies if the GPU's
  members together pass the GPU's memory. A killed job resumes from its last checkpoint
  in a later round, its estimate raised by `mem_bump_pct`, at most `max_retries` times.
- `dmem=True` (issue 22, cgroup dmem): the policy packs on the estimates (margin 0) and
  each member keeps its usual fence as the hard limit (dmem.max); its estimate is the
  soft limit (dmem.min). A member dies past its hard limit; when the GPU's members
  together pass its memory, the member furthest above its soft limit is evicted (the
  kernel protects usage below dmem.min and reclaims from those above it).

Where each part lives (this module is the loop that drives them, how a run starts,
fresh or from a `Snapshot`, and what it records):

- sim/events.py: the event kinds and the time-ordered queue;
- sim/state.py: the nodes, packs, GPUs and members, and the run's shared `SimState`;
- sim/progress.py: the truth: speeds on a shared GPU, gangs' pace, time moving on, OOMs;
- sim/planner_view.py: what the planner is told (estimates, fences, the learned margin);
- sim/dispatch_round.py: when a round runs, what it offers `packing.plan`, its plan applied;
- sim/lifecycle.py: members at their peak or end, OOM retries, faults, packs released;
- sim/sweep.py: a sweep's variants judged at the stopping rule's rungs, paused, promoted;
- sim/multinode.py: whole-node multi-node jobs, not packed: their queue, the nodes they hold;
- sim/snapshot.py: the service's view of a moment (`take_snapshot`, `resume_state` here);
- sim/results.py: `JobOutcome` and `SimResult` with their metrics.
"""

from __future__ import annotations

import math
from dataclasses import replace

from slurm_dlrm.packing.common import REFILL_POLICIES
from slurm_dlrm.packing.dispatch import should_run_round
from slurm_dlrm.packing.interference import DEFAULT_PARAMS, InterferenceParams
from slurm_dlrm.packing.model import AGENT_CPUS, AGENT_MEM_MIB, FairConfig
from slurm_dlrm.sim.dispatch_round import capacity_free, run_round, schedule_tick
from slurm_dlrm.sim.events import (
    ARRIVAL,
    EPS,
    MEMBER_READY,
    MULTINODE_END,
    NODE_BACK,
    NODE_FAIL,
    OBSERVE,
    PACK_RELEASE,
    PACK_START,
    RESUBMIT,
    SNAPSHOT,
    TICK,
)
from slurm_dlrm.sim.faults import FaultRuntime
from slurm_dlrm.sim.files import SimCluster, Workload
from slurm_dlrm.sim.lifecycle import (
    kill_packs,
    observe_round,
    reach_milestones,
    release_pack,
    requeue,
)
from slurm_dlrm.sim.multinode import WholeNodeJobs, is_whole_node
from slurm_dlrm.sim.multinode import arrive as whole_node_arrive
from slurm_dlrm.sim.multinode import end as whole_node_end
from slurm_dlrm.sim.multinode import start_ready as start_whole_node_jobs
from slurm_dlrm.sim.planner_view import est_left_s, job_demand, measured_left_s, round_limits
from slurm_dlrm.sim.progress import advance, next_change_s, set_speeds, sync_gangs
from slurm_dlrm.sim.results import JobOutcome, SimResult
from slurm_dlrm.sim.snapshot import RunningMember, RunningPack, Snapshot
from slurm_dlrm.sim.state import GpuState, MemberState, NodeState, PackState, SimState
from slurm_dlrm.sim.sweep import SweepRuntime
from slurm_dlrm.site import MIB


def simulate(workload: Workload, cluster: SimCluster, policy: str,
             true_params: InterferenceParams | None = None, plan_params: InterferenceParams | None = None,
             max_sim_s: float = 365 * 86400.0, faults: FaultRuntime | None = None, dmem: bool = False,
             margin_from_errors: bool = True, fairness: str | None = None,
             fair_config: FairConfig | None = None, snapshot_at_s: tuple[float, ...] = (),
             resume: Snapshot | None = None, sweep: SweepRuntime | None = None) -> SimResult:
    """Replay `workload` on `cluster` through `policy`; see the module docstring.

    With `faults`, node failures and straggler checks are injected and OOMs, node
    failures and stragglers are handled by its recovery decisions (sim/faults.py).
    `margin_from_errors` (fenced policies): each round's memory margin is the larger of
    the configured one and the estimate's error observed at members' peaks so far.
    `fairness`: "slowdown" or "rounds" (DispatchConfig.fairness; None: the cluster's).
    `snapshot_at_s`: times (from the first arrival) at which to record a `Snapshot`.
    `resume` (issue 31, `queue --start`): start from that snapshot's state instead of an
    empty cluster: its packs on their nodes (each member's job in `workload` carries its
    time left as its run), its waiting jobs pending, the dispatcher's counters; the
    workload's other jobs arrive as usual.
    `sweep` (issue 47): the jobs it names are a sweep's variants, judged at its rule's
    rungs and paused or promoted (sim/sweep.py); a variant paused at the end is STOPPED."""
    truth = true_params or DEFAULT_PARAMS
    limits, dispatch = cluster.limits, cluster.dispatch
    if fairness is not None:
        dispatch = replace(dispatch, fairness=fairness)
    if fair_config is not None:
        dispatch = replace(dispatch, fair_config=fair_config)
    nodes = [NodeState(n.name, n.gpu_model, n.gpus, n.cpus, n.memory_bytes, n.gpus, n.cpus, n.memory_bytes)
             for n in cluster.nodes]
    jobs = {j.job_id: j for j in workload.jobs}
    now = workload.jobs[0].arrival_s if workload.jobs else 0.0
    if resume is not None:
        now = resume.now_s
    fenced = policy in ("mem-best-fit", "complementary", "exact")
    shard_mode = policy == "first-fit"
    dmem = dmem and fenced
    st = SimState(cluster=cluster, policy=policy, truth=truth, plan_params=plan_params, faults=faults, limits=limits,
                  dispatch=dispatch, slurm=cluster.slurm, retry=cluster.retry, jobs=jobs, nodes=nodes,
                  by_name={n.name: n for n in nodes}, fenced=fenced, shard_mode=shard_mode,
                  refill=policy in REFILL_POLICIES, dmem=dmem,
                  plan_limits=replace(limits, memory_margin_pct=0.0) if dmem else limits,
                  learn_margin=fenced and margin_from_errors and not dmem,
                  agent_cpus=0 if shard_mode else AGENT_CPUS, agent_mem=0 if shard_mode else AGENT_MEM_MIB * MIB,
                  now=now, first_arrival=now, est_mem={j.job_id: j.gpu_mem_bytes for j in workload.jobs},
                  sweep=sweep)

    resumed = ({m.job_id for pk in resume.packs for m in pk.members}
               | {jid for jid, _, _ in resume.pending if jobs[jid].arrival_s <= resume.now_s}) if resume else set()
    for j in workload.jobs:
        if j.job_id not in resumed:
            st.events.push(j.arrival_s, ARRIVAL, j.job_id)
    for t in snapshot_at_s:
        st.events.push((workload.jobs[0].arrival_s if workload.jobs else 0.0) + t, SNAPSHOT, None)
    snapshots: list[Snapshot] = []
    snap_times = sorted(snapshot_at_s)
    if faults is not None:
        for n in nodes:
            fail_in = faults.next_failure_in_s()
            if fail_in is not None:
                st.events.push(st.first_arrival + fail_in, NODE_FAIL, (n.name, True))
        for at_s, name in faults.faults.node_failures_at:
            st.events.push(at_s, NODE_FAIL, (name, False))

    if any(is_whole_node(j) for j in workload.jobs):
        st.whole_node = WholeNodeJobs()
    if resume is not None:
        resume_state(st, resume, resumed)
    gangs = any(j.world_size > 1 for j in workload.jobs)
    while True:
        if gangs:
            sync_gangs(st)
        t_next = next_change_s(st)
        if t_next == math.inf or t_next - st.first_arrival > max_sim_s:
            break
        advance(st, t_next)
        reach_milestones(st)
        # Heap events at this instant.
        while (due := st.events.pop_due(st.now)) is not None:
            _handle_event(st, *due)
        if st.whole_node is not None:
            start_whole_node_jobs(st)  # a pack released their last nodes
        while snap_times and st.now - st.first_arrival >= snap_times[0] - EPS:
            snap_times.pop(0)
            snapshots.append(take_snapshot(st))
        # Dispatch.
        any_free = capacity_free(st)
        if st.dirty and any_free and should_run_round(st.now, st.last_round, len(st.pending), st.arrived_since, dispatch):
            run_round(st)
        if st.dirty and st.pending and st.tick_at is None and any_free:
            schedule_tick(st)
        if not st.events and not st.running_packs and not st.pending:
            break
        if not st.events and not st.running_packs and st.pending and not any_free:
            break  # nothing can ever free up (cannot happen with a consistent cluster)

    # Packs still holding GPUs at the time limit count up to now.
    now = st.now
    for pack in st.running_packs:
        if pack.start_s <= now:
            st.alloc_gpu_s += pack.gpu_count * (now - pack.start_s)
            st.held_cpu_s += (pack.asked_cpus + pack.agent_cpus) * (now - pack.start_s)
            st.held_mem_byte_s += (pack.asked_mem + pack.agent_mem) * (now - pack.start_s)
    outcomes = []
    for j in workload.jobs:
        state = st.outcome_state.get(j.job_id, "PENDING")
        outcomes.append(JobOutcome(j.job_id, j.arrival_s, j.solo_duration_s, st.outcome_end.get(j.job_id), state,
                                   st.oom_of.get(j.job_id, 0), st.first_start.get(j.job_id)))
    return SimResult(policy=policy, workload=workload.name, cluster=cluster.name, gpus=cluster.gpu_count,
                     jobs=tuple(outcomes), first_arrival_s=st.first_arrival, end_s=now, alloc_gpu_s=st.alloc_gpu_s,
                     busy_gpu_s=st.busy_gpu_s, ooms=st.ooms, rounds=st.rounds, packs=st.packs_made,
                     member_s=st.member_s, backlog_s=st.backlog_s, backlog_work_s=st.backlog_work_s,
                     resubmits=sum(st.resubmits.values()), evictions=st.evictions, held_cpu_s=st.held_cpu_s,
                     held_mem_byte_s=st.held_mem_byte_s, snapshots=tuple(snapshots))


def _handle_event(st: SimState, kind: int, payload: object) -> None:
    faults, now = st.faults, st.now
    if kind == ARRIVAL:
        assert isinstance(payload, int)
        job = st.jobs[payload]
        if is_whole_node(job):
            whole_node_arrive(st, job)  # not packed: its own queue (sim/multinode.py)
            return
        st.pending[payload] = job_demand(job, job.gpu_mem_bytes, job.est_duration_s)
        if faults is not None:
            st.pending[payload] = faults.arrival_demand(job, now)
            st.est_mem[payload] = st.pending[payload].gpu_mem_bytes
        st.arrived_since += 1
        schedule_tick(st)
    elif kind == RESUBMIT:
        assert isinstance(payload, int)
        requeue(st, payload)
    elif kind == MULTINODE_END:
        assert isinstance(payload, int)
        whole_node_end(st, payload)
    elif kind == SNAPSHOT:
        pass  # recorded by the loop, once this instant's events are handled
    elif kind == PACK_RELEASE:
        assert isinstance(payload, PackState)
        release_pack(st, payload)  # unless a joiner came during the grace
    elif kind == TICK:
        st.tick_at = None
    elif kind == PACK_START:
        assert isinstance(payload, PackState)
        payload.start_s = now
        st.running_packs.append(payload)
        if payload.node.down:
            kill_packs(st, payload.node.name, [payload])  # its node failed before it started
            return
        st.events.push(now + st.slurm.member_startup_s, MEMBER_READY, payload)
        if faults is not None and not st.observe_armed and faults.recovery.enabled and faults.recovery.stragglers:
            st.observe_armed = True
            st.events.push(now + faults.recovery.observe_s, OBSERVE, None)
    elif kind == MEMBER_READY:
        assert isinstance(payload, PackState)
        for gpu in payload.gpus:
            for m in gpu.members:
                if not m.ended and not m.ready and m.ready_at <= now + EPS:
                    m.ready = True
                    m.peak_progress = min(m.progress_start + m.job.peak_at_frac * m.job.solo_duration_s,
                                          m.job.solo_duration_s)
            set_speeds(st, gpu)
    elif kind == NODE_FAIL:
        assert isinstance(payload, tuple) and faults is not None
        name, rearm = payload  # rearm: a random failure, the next is drawn when it is back
        if len(st.outcome_state) < len(st.jobs) and not st.by_name[name].down:  # all done: stop injecting
            st.by_name[name].down = True
            kill_packs(st, name, [pk for pk in st.running_packs if pk.node.name == name])
            st.events.push(now + faults.faults.node_repair_s, NODE_BACK, (name, rearm))
        elif rearm and len(st.outcome_state) < len(st.jobs):
            fail_in = faults.next_failure_in_s()
            if fail_in is not None:
                st.events.push(now + faults.faults.node_repair_s + fail_in, NODE_FAIL, (name, True))
    elif kind == NODE_BACK:
        assert isinstance(payload, tuple) and faults is not None
        name, rearm = payload
        st.by_name[name].down = False
        fail_in = faults.next_failure_in_s() if rearm else None
        if fail_in is not None:
            st.events.push(now + fail_in, NODE_FAIL, (name, True))
        schedule_tick(st)
    elif kind == OBSERVE:
        assert faults is not None
        st.observe_armed = False
        observe_round(st)
        if st.running_packs:
            st.observe_armed = True
            st.events.push(now + faults.recovery.observe_s, OBSERVE, None)


def take_snapshot(st: SimState) -> Snapshot:
    running: dict[int, tuple[int, float, int]] = {}
    planned: dict[int, float] = {}
    packs = []
    now = st.now
    starting = {p.pack_id: t for t, _, k, p in st.events.heap if k == PACK_START and isinstance(p, PackState)}
    submitted = [p for _, _, k, p in st.events.heap if k == PACK_START and isinstance(p, PackState)]
    for pk in sorted(st.running_packs + submitted, key=lambda p: p.pack_id):
        members = []
        for gi, gpu in enumerate(pk.gpus):
            for m in gpu.members:
                if m.ended:
                    continue
                jid = m.job.job_id
                left = measured_left_s(st, pk, gpu, m)
                # a gang's ranks step together at the slowest one's pace: the job's
                # solo-seconds left are the least of its ranks' (wall time x predicted pace)
                running[jid] = (jid, min(left, running[jid][1]) if jid in running else left, st.est_mem[jid])
                planned[jid] = est_left_s(m)
                # a member not past its peak reaches it that far into its run (a job
                # property: DLRM jobs peak in their first steps); not yet started: its
                # share of the run it has left
                peak_in = (max(0.0, m.peak_progress - m.progress) if m.ready
                           else m.job.peak_at_frac * m.job.solo_duration_s)
                members.append(RunningMember(jid, gi, m.rank, m.fence_bytes, m.cpus, m.host_mem,
                                             0.0 if m.ready else max(0.0, m.ready_at - now),
                                             m.true_mem if m.peaked else None,
                                             0.0 if m.peaked else peak_in * left / max(1e-9, m.job.solo_duration_s - m.progress)))
        packs.append(RunningPack(pk.node.name, pk.gpu_count, pk.cpus, pk.host_mem, pk.mps,
                                 max(0.0, starting.get(pk.pack_id, now) - now), tuple(members), pk.pack_id,
                                 None if pk.live > 0 or pk.idle_since_s is None else now - pk.idle_since_s))
    waiting = tuple((jid, d.est_duration_s if d.est_duration_s is not None else st.jobs[jid].solo_duration_s,
                     d.gpu_mem_bytes) for jid, d in sorted(st.pending.items()))
    return Snapshot(now, waiting, tuple(running[k] for k in sorted(running)), round_limits(st).memory_margin_pct,
                    packs=tuple(packs), waited_rounds=tuple(sorted(st.waited.items())), last_round_s=st.last_round,
                    arrived_since_round=st.arrived_since, planned_left_s=tuple(sorted(planned.items())),
                    round_due=st.dirty)


def resume_state(st: SimState, snap: Snapshot, resumed: set[int]) -> None:
    # The running packs stay where they are, with what their allocations hold; the
    # waiting jobs (those of `resumed`) are pending with the rounds they were passed over.
    now, slurm = st.now, st.slurm
    for rp in snap.packs:
        node = st.by_name[rp.node_name]
        node.free_gpus -= rp.gpu_count
        node.free_cpus -= rp.cpus + st.agent_cpus
        node.free_mem -= rp.host_mem_bytes + st.agent_mem
        pid = rp.pack_id if rp.pack_id >= 0 else st.next_pack_id
        pack = PackState(pid, node, rp.gpu_count, rp.cpus, rp.host_mem_bytes, rp.mps,
                         [GpuState() for _ in range(rp.gpu_count)], asked_cpus=rp.cpus, asked_mem=rp.host_mem_bytes,
                         agent_cpus=st.agent_cpus, agent_mem=st.agent_mem)
        st.next_pack_id = max(st.next_pack_id, pid) + 1
        if rp.idle_for_s is not None:  # its last member ended: Slurm frees it pack_release_s after
            pack.idle_since_s = now - rp.idle_for_s
            st.events.push(max(now, pack.idle_since_s + slurm.pack_release_s), PACK_RELEASE, pack)
        for rm in rp.members:
            m = MemberState(st.jobs[rm.job_id], rm.fence_bytes, 0.0, 0.0, ready_at=now + rm.ready_in_s, cpus=rm.cpus,
                            host_mem=rm.host_mem_bytes, rank=rm.rank)
            m.peaked = rm.peak_bytes is not None  # seen at its peak: no OOM ahead of it
            m.peak_progress = rm.peak_in_s
            pack.gpus[rm.gpu_index].members.append(m)
            pack.live += 1
            st.first_start[rm.job_id] = now
            if rm.ready_in_s <= 0:
                m.ready = True
            elif rp.start_in_s <= 0:
                st.events.push(m.ready_at, MEMBER_READY, pack)
        if st.shard_mode:
            for gi in range(rp.gpu_count):
                st.shard_gpus[f"{pack.pack_id}:{gi}"] = (pack, gi)
        if rp.start_in_s > 0:
            st.events.push(now + rp.start_in_s, PACK_START, pack)
            continue
        pack.start_s = now
        st.running_packs.append(pack)
        for gpu in pack.gpus:
            set_speeds(st, gpu)
    for jid, left, gpu_mem in snap.pending:
        if jid in resumed:
            st.pending[jid] = job_demand(st.jobs[jid], gpu_mem, left)
            st.est_mem[jid] = gpu_mem
    st.waited = dict(snap.waited_rounds)
    st.last_round, st.arrived_since = snap.last_round_s, snap.arrived_since_round
    if snap.round_due:
        schedule_tick(st)


def with_noise_free_truth(workload: Workload) -> Workload:
    """The same workload with the estimates exactly right (for sanity checks)."""
    return replace(workload, jobs=tuple(replace(j, true_gpu_mem_bytes=j.gpu_mem_bytes, true_sm_util_pct=j.sm_util_pct,
                                                true_membw_util_pct=j.membw_util_pct) for j in workload.jobs))
