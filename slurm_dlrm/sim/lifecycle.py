"""A running member's life to its end and what follows: at its memory peak it may run
out of host or GPU memory (and, without `faults`, is retried from its checkpoint with a
raised estimate, resubmitted by its user, or failed); at its end it completes. A member
that ends takes its gang with it; a pack gives its allocation back when its last member
is gone; a fault (sim/faults.py) kills members and requeues or fails their jobs.

Apart from the event loop (sim/engine.py) because this is the recovery a newcomer
compares with the service's (service/recovery.py, adapt/recovery.py).
"""

from __future__ import annotations

import math

from slurm_dlrm.sim.dispatch_round import schedule_tick
from slurm_dlrm.sim.events import PACK_RELEASE, RESUBMIT
from slurm_dlrm.sim.faults import KillAction
from slurm_dlrm.sim.planner_view import job_demand, observe_error
from slurm_dlrm.sim.progress import oom_victim, set_speeds
from slurm_dlrm.sim.state import GpuState, MemberState, PackState, SimState

# The agent stops a member this far past its host share ([agent] host_mem_tolerance_pct's
# default); the kernel kills it where the pack's --mem runs out. Both are OOM_HOST.
HOST_MEM_TOLERANCE_PCT = 10.0


def siblings(st: SimState, m: MemberState) -> list[tuple[PackState, GpuState, MemberState]]:
    if m.job.world_size <= 1:
        return []
    return [(pk, gpu, x) for pk in st.running_packs for gpu in pk.gpus for x in gpu.members
            if x is not m and not x.ended and x.job.job_id == m.job.job_id]


def end_gang(st: SimState, m: MemberState) -> None:
    """A rank ended (OOM, fault, done): its siblings stop too (the agent's gang stop)."""
    for pk, gpu, x in siblings(st, m):
        end_member(st, pk, gpu, x)


def end_member(st: SimState, pack: PackState, gpu: GpuState, m: MemberState) -> None:
    m.ended = True
    m.speed = m.raw_speed = 0.0
    pack.live -= 1
    if st.shard_mode:
        # Each first-fit member is its own Slurm job: its CPUs and memory come back now.
        pack.cpus -= m.cpus
        pack.host_mem -= m.host_mem
        pack.node.free_cpus += m.cpus
        pack.node.free_mem += m.host_mem
    set_speeds(st, gpu)
    schedule_tick(st)  # a freed shard (first-fit) or, below, freed GPUs
    if pack.live == 0:
        pack.idle_since_s = st.now
        if st.slurm.pack_release_s > 0 and not st.shard_mode:
            st.events.push(st.now + st.slurm.pack_release_s, PACK_RELEASE, pack)  # a join may still come meanwhile
        else:
            release_pack(st, pack)


def release_pack(st: SimState, pack: PackState) -> None:
    if pack.live == 0 and pack in st.running_packs:
        st.alloc_gpu_s += pack.gpu_count * (st.now - pack.start_s)
        st.held_cpu_s += (pack.asked_cpus + pack.agent_cpus) * (st.now - pack.start_s)
        st.held_mem_byte_s += (pack.asked_mem + pack.agent_mem) * (st.now - pack.start_s)
        pack.node.free_gpus += pack.gpu_count
        pack.node.free_cpus += pack.cpus + pack.agent_cpus
        pack.node.free_mem += pack.host_mem + pack.agent_mem
        st.running_packs.remove(pack)
        for gi in range(pack.gpu_count):
            st.shard_gpus.pop(f"{pack.pack_id}:{gi}", None)
        schedule_tick(st)


def apply_kill(st: SimState, pack: PackState, gpu: GpuState, m: MemberState, act: KillAction) -> None:
    # A fault ended the member: requeue it from its checkpoint, or fail it. A rank
    # takes its siblings with it; the job is requeued whole.
    if m.ended:
        return
    jid = m.job.job_id
    end_member(st, pack, gpu, m)
    end_gang(st, m)
    st.progress_saved[jid] = act.saved_progress_s
    if act.requeue and act.demand is not None:
        st.est_mem[jid] = act.demand.gpu_mem_bytes
        st.pending[jid] = act.demand
        schedule_tick(st)
    else:
        st.outcome_state[jid] = "FAILED"


def kill_packs(st: SimState, name: str, packs: list[PackState]) -> None:
    assert st.faults is not None
    victims = [(pk, gpu, m) for pk in packs for gpu in pk.gpus for m in gpu.members if not m.ended]
    firsts = list({m.job.job_id: m for _, _, m in reversed(victims)}.values())  # one entry per job
    acts = st.faults.on_node_fail(st.now, name, [(m.job, m.progress, m.progress_start, st.est_mem[m.job.job_id])
                                                 for m in firsts])
    for pk, gpu, m in victims:
        apply_kill(st, pk, gpu, m, acts[m.job.job_id])


def observe_round(st: SimState) -> None:
    assert st.faults is not None
    where = {}
    groups = []
    for pk in st.running_packs:
        for gpu in pk.gpus:
            live = [m for m in gpu.members if m.ready and not m.ended]
            for m in live:
                where[m.job.job_id] = (pk, gpu, m)
            if live:
                groups.append([(m.job, m.speed, m.progress) for m in live])
    for jid, act in st.faults.observe(st.now, groups):
        apply_kill(st, *where[jid], act)


def requeue(st: SimState, jid: int) -> None:
    # Back to pending from its last checkpoint, with what is left of its run.
    job = st.jobs[jid]
    left = job.solo_duration_s - st.progress_saved.get(jid, 0.0)
    est_left = (job.est_duration_s or job.solo_duration_s) * left / job.solo_duration_s
    st.pending[jid] = job_demand(job, st.est_mem[jid], est_left)
    schedule_tick(st)


def reach_milestones(st: SimState) -> None:
    """Every running member at its memory peak (OOM or not) or at its end, now."""
    faults, limits, retry = st.faults, st.limits, st.retry
    now = st.now
    for pack in list(st.running_packs):
        for gpu in pack.gpus:
            for m in list(gpu.members):
                if not m.ready or m.ended:
                    continue
                if not m.peaked and m.progress >= m.peak_progress - 1e-6:
                    m.peaked = True
                    true_host = m.job.true_host_mem_bytes
                    if (faults is not None and true_host is not None and m.host_mem > 0
                            and true_host > m.host_mem * (1.0 + HOST_MEM_TOLERANCE_PCT / 100.0)):
                        # out of host memory at its peak (issue 43): retried like a GPU OOM
                        st.ooms += 1
                        jid = m.job.job_id
                        st.oom_of[jid] = st.oom_of.get(jid, 0) + 1
                        node_mem = max(n.memory_bytes for n in st.cluster.nodes)
                        apply_kill(st, pack, gpu, m, faults.on_oom(m.job, now, m.progress, m.progress_start,
                                                                   st.est_mem[jid], m.host_mem, node_mem, kind="host"))
                        continue
                    observe_error(st, pack, m)
                    victim = oom_victim(st, pack, gpu, m)
                    if victim is not None and victim is not m:
                        st.evictions += 1  # dmem: a neighbour above its soft limit goes instead
                        m = victim
                    if victim is not None:
                        st.ooms += 1
                        jid = m.job.job_id
                        st.oom_of[jid] = st.oom_of.get(jid, 0) + 1
                        if faults is not None:
                            ctx, whole = st.ctx_bytes(pack.node), st.gpu_bytes(pack.node)
                            limit = (m.fence_bytes if m.fence_bytes is not None else whole) - ctx
                            capacity = int((whole - 2 * ctx) / (1.0 + limits.memory_margin_pct / 100.0))
                            apply_kill(st, pack, gpu, m, faults.on_oom(m.job, now, m.progress, m.progress_start,
                                                                       st.est_mem[jid], limit, capacity))
                            continue
                        st.attempts[jid] = st.attempts.get(jid, 0) + 1
                        every = retry.checkpoint_every_frac * m.job.solo_duration_s
                        st.progress_saved[jid] = math.floor(m.progress / every) * every if every > 0 else 0.0
                        st.est_mem[jid] = math.ceil(st.est_mem[jid] * (1.0 + retry.mem_bump_pct / 100.0))
                        end_member(st, pack, gpu, m)
                        end_gang(st, m)  # a rank's OOM stops its siblings; the job goes back whole
                        if st.attempts[jid] <= retry.max_retries:
                            requeue(st, jid)
                        elif st.resubmits.get(jid, 0) < retry.user_resubmits:
                            # Failed; its user submits it again (a fresh job: the
                            # automatic retries and the memory bumps start over), its
                            # JCT still counted from the first submission, and it
                            # keeps its place in the queue (in the user's favour).
                            st.resubmits[jid] = st.resubmits.get(jid, 0) + 1
                            st.attempts[jid] = 0
                            st.est_mem[jid] = m.job.gpu_mem_bytes  # the same spec, estimated again
                            st.events.push(now + retry.user_resubmit_delay_s, RESUBMIT, jid)
                        else:
                            st.outcome_state[jid] = "FAILED"
                        continue
                if st.sweep is not None and m.job.world_size <= 1 and st.sweep.due(m.job, m.progress):
                    if at_rung(st, pack, gpu, m):
                        continue  # paused at its checkpoint
                if m.peaked and m.progress >= m.job.solo_duration_s - 1e-6:
                    st.outcome_end[m.job.job_id] = now
                    st.outcome_state[m.job.job_id] = "COMPLETED"
                    if faults is not None:
                        faults.on_complete(m.job, now)
                    end_member(st, pack, gpu, m)
                    end_gang(st, m)


def at_rung(st: SimState, pack: PackState, gpu: GpuState, m: MemberState) -> bool:
    """A sweep's variant is at its next rung (sim/sweep.py): the rule judges it. Paused,
    it ends at its checkpoint there (its share frees now) and stays STOPPED unless a
    later decision promotes it; each promoted variant is requeued from its checkpoint.
    True when `m` paused."""
    assert st.sweep is not None
    jid = m.job.job_id
    verdict, promoted = st.sweep.decide(m.job, st.now)
    if not verdict.go_on:
        st.progress_saved[jid] = m.progress
        end_member(st, pack, gpu, m)
        st.outcome_state[jid] = "STOPPED"
    for p in promoted:
        st.outcome_state.pop(p, None)
        requeue(st, p)
    return not verdict.go_on
