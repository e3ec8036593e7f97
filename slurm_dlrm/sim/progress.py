"""How members progress under the truth: their speeds on a shared GPU (the truth's
interference model on their true profiles), a gang's common pace, the clock moving on
(progress and the run's time integrals), and who runs out of GPU memory when a member
reaches its true peak.

Apart because this is the simulator's truth, which the planner never sees (it is told
estimates, sim/planner_view.py): what really happens on a GPU lives here alone.
"""

from __future__ import annotations

from slurm_dlrm.packing.interference import predict_speeds_from_fractions
from slurm_dlrm.sim.state import GpuState, MemberState, PackState, SimState


def set_speeds(st: SimState, gpu: GpuState) -> None:
    live = [m for m in gpu.members if m.ready and not m.ended]
    if not live:
        return
    if len(live) == 1:
        live[0].speed = live[0].raw_speed = 1.0
        return
    sp = predict_speeds_from_fractions([min(1.0, m.true_sm / 100.0) for m in live],
                                       [min(1.0, m.true_bw / 100.0) for m in live], st.truth)
    for m, s in zip(live, sp, strict=True):
        m.speed = m.raw_speed = s


def sync_gangs(st: SimState) -> None:
    # The ranks of a job step together (all-to-all every step): each runs at the
    # slowest sibling's speed, none before all are ready.
    ranks: dict[int, list[MemberState]] = {}
    for pk in st.running_packs:
        for gpu in pk.gpus:
            for m in gpu.members:
                if not m.ended and m.job.world_size > 1:
                    ranks.setdefault(m.job.job_id, []).append(m)
    for group in ranks.values():
        complete = len(group) == group[0].job.world_size
        pace = min(x.raw_speed if x.ready else 0.0 for x in group) if complete else 0.0
        for x in group:
            x.speed = pace


def next_change_s(st: SimState) -> float:
    """Next thing to happen: a heap event or a member reaching a milestone (inf: none)."""
    t_next = st.events.next_s()
    for pack in st.running_packs:
        for gpu in pack.gpus:
            for m in gpu.members:
                if m.ready and not m.ended and m.speed > 0:
                    goal = m.peak_progress if not m.peaked else m.job.solo_duration_s
                    rung = st.sweep.next_goal_s(m.job) if st.sweep is not None else None
                    if rung is not None:
                        goal = min(goal, rung)
                    t_next = min(t_next, st.now + max(0.0, goal - m.progress) / m.speed)
    return t_next


def advance(st: SimState, t_next: float) -> None:
    """Move the clock to `t_next`: members progress at their speeds; the run's integrals
    (backlog, member time, busy GPU time) grow."""
    dt = t_next - st.now
    if dt > 0 and st.pending:
        st.backlog_s += dt
        for pack in st.running_packs:
            for gpu in pack.gpus:
                for m in gpu.members:
                    if m.ready and not m.ended:
                        st.backlog_work_s += m.speed * dt
    if dt > 0:
        for pack in st.running_packs:
            if pack.start_s <= st.now:
                for gpu in pack.gpus:
                    use = 0.0
                    for m in gpu.members:
                        if m.ready and not m.ended:
                            st.member_s += dt
                            m.progress += m.speed * dt
                            use += min(1.0, m.true_sm / 100.0) * m.speed
                    st.busy_gpu_s += min(1.0, use) * dt
    st.now = t_next


def oom_check(st: SimState, pack: PackState, gpu: GpuState, m: MemberState) -> bool:
    node = pack.node
    own = m.true_mem
    if m.fence_bytes is not None and own + st.ctx_bytes(node) > m.fence_bytes:
        return True
    # The GPU as a whole, fenced or not: refill counts a member past its peak at its
    # measured peak (below its fence), so fences may add up to more than the GPU.
    total = (st.ctx_bytes(node) if pack.mps else 0) + sum(
        x.true_mem + st.ctx_bytes(node) for x in gpu.members if not x.ended and (x.peaked or x is m))
    total += sum(st.ctx_bytes(node) for x in gpu.members if not x.ended and not x.peaked and x is not m)
    return total > st.gpu_bytes(node)


def oom_victim(st: SimState, pack: PackState, gpu: GpuState, m: MemberState) -> MemberState | None:
    """The member that dies when `m` reaches its peak, if any (dmem: sim/engine.py's docstring)."""
    if not st.dmem or m.soft_bytes is None:
        return m if oom_check(st, pack, gpu, m) else None
    ctx = st.ctx_bytes(pack.node)
    if m.fence_bytes is not None and m.true_mem + ctx > m.fence_bytes:
        return m  # dmem.max: the allocation fails
    live = [x for x in gpu.members if not x.ended]
    total = (ctx if pack.mps else 0) + sum(x.true_mem + ctx if (x.peaked or x is m) else ctx
                                           for x in live)
    if total <= st.gpu_bytes(pack.node):
        return None
    over = [x for x in live if (x.peaked or x is m) and x.soft_bytes is not None
            and x.true_mem + ctx > x.soft_bytes]
    if not over:
        return None
    return max(over, key=lambda x: x.true_mem + ctx - (x.soft_bytes or 0))

