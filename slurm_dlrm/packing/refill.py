"""Refill: pending jobs join the GPUs of running packs (`OpenGpu` with `pack=True`)
before the policy packs the rest (docs/packing.md "Refilling running packs").
Used by `mem-best-fit` and `complementary`.

This module makes the refill choice: who joins which pack GPU, in which order, gangs
all ranks or none. The per-GPU state of the pass is `pack_gpus.PackGpu`; the room held
for a job that cannot join yet (drain tail, waiting gangs) is in `reservations.py`."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

from slurm_dlrm.packing.common import (
    URGENT_PRIORITY,
    drain_tail,
    host_fits,
    is_overdue_priority,
    order_key,
    rank_load,
    thread_pcts,
)
from slurm_dlrm.packing.common import (
    tail_first as _tail_first,
)
from slurm_dlrm.packing.fairness import gang_reserve_bound, is_overdue
from slurm_dlrm.packing.interference import (
    InterferenceParams,
    predict_speeds_from_fractions,
    util_fraction,
)
from slurm_dlrm.packing.model import (
    JobDemand,
    Join,
    MemberPlacement,
    PackingLimits,
    PackingRequest,
    host_limit_bytes,
    live_gpu_bytes,
    member_fence_bytes,
    rank_members,
    usable_gpu_bytes,
)
from slurm_dlrm.packing.pack_gpus import PackGpu, join, pack_gpus
from slurm_dlrm.packing.reservations import (
    Reservation,
    backfills,
    gang_holds,
    reserve_for_gang,
    reserve_for_tail,
    take_slack,
)
from slurm_dlrm.site import MIB

_JOIN_SCAN = 24  # pending jobs looked at per pick for one pack GPU (complementary)
# A joiner must add at least this much priced work per unit of the priced resources it
# takes (its own speed, net of what it costs the live members), relative to what the
# GPU's live members get per unit now: below it, the room is better left to a later
# joiner (docs/packing.md "Refilling running packs").
_MIN_EFFICIENCY = 0.4
# A pending job expected to run >= this share of the time the whole backlog needs is a
# drain-tail job: it goes first and gets a reservation (`drain_tail`, `reservations.reserve_for_tail`).
_TAIL_FACTOR = 0.25
# Switches for benchmarks/bound_ablation.py (what each mechanism contributes).
_PRICED = True
_RESERVE = True
# Overdue single-GPU jobs join through the priced fill, first in its order (True), or
# each onto the GPU it adds most to, ahead of it (False: measured worse, docs/packing.md).
_PRICED_OVERDUE = True
# Issue 31, second pass: under the slowdown bound an overdue gang past its reservation
# point reserved its GPUs before single-GPU jobs joined, and held one rank's room on them
# (`reservations.gang_holds`; with `_GANG_ROOM` False the whole GPU drained, EASY on the live members'
# end). Both measured worse than the reservation every refill already makes for the
# first gang that cannot join, made under the bound only for a gang past that point
# (docs/packing.md "Every job gets its turn", the table); True restores them for
# benchmarks/fair_alternatives.py.
_GANG_HOLDS = False
_GANG_ROOM = True


def join_key(job: JobDemand) -> tuple[float, bool, float, float, int]:
    # As complementary's seed order (priority, then expected duration), but a job of
    # unknown length goes after the known ones of its band: a time-limited pack refuses
    # such a joiner (`_times_fit`), and a front of them would use up every pack GPU's scan.
    d = job.est_duration_s
    return (-job.priority, d is None, d or 0.0, job.submit_time_s, job.job_id)


def _key_indices(key: str) -> tuple[int, int]:
    """(node_index, gpu_index) from a service key f"{pack_id}:{node_index}:{gpu_index}"."""
    parts = key.split(":")
    try:
        return (int(parts[-2]), int(parts[-1])) if len(parts) >= 3 else (0, 0)
    except ValueError:
        return (0, 0)


def _join_speeds(members: list[JobDemand], params: InterferenceParams) -> list[float]:
    if len(members) == 1:
        return [1.0]
    return predict_speeds_from_fractions([util_fraction(j.sm_util_pct) for j in members],
                                         [util_fraction(j.membw_util_pct) for j in members], params)


def _join_fits(pg: PackGpu, job: JobDemand, limits: PackingLimits) -> bool:
    """Memory (live members' fences count), client slots, the allocation's free CPUs and
    host memory on that node."""
    return (len(pg.joined) < pg.slots
            and pg.used_bytes + member_fence_bytes(job, pg.gpu, limits) <= usable_gpu_bytes(pg.gpu)
            and host_fits(pg.node, job, limits))


def allocation_bound(pgs: list[PackGpu], queue: list[JobDemand], limits: PackingLimits) -> set[str]:
    """Keys of the pack GPUs that a waiting single-GPU job would fit (GPU memory) but
    their allocation never would: it has too few CPUs or too little host memory even
    with every live member ended. Slurm cannot grow a running job and the headroom is
    bounded (`refill_headroom_pct`, issue 24), so such a GPU takes no joins while that
    job waits: the pack drains and its GPU goes to a new pack sized for the queue."""
    total: dict[int, tuple[int, int]] = {}
    for pg in pgs:
        cpus, mem = total.get(id(pg.node), (pg.node.free_cpus, pg.node.free_mem_bytes))
        total[id(pg.node)] = (cpus + sum(j.cpus for j in pg.live),
                              mem + sum(host_limit_bytes(j, limits) for j in pg.live))
    out: set[str] = set()
    singles = [j for j in queue if not j.is_gang]
    for pg in pgs:
        cpus, mem = total[id(pg.node)]
        if any(member_fence_bytes(j, pg.gpu, limits) <= usable_gpu_bytes(pg.gpu)
               and (j.cpus > cpus or host_limit_bytes(j, limits) > mem) for j in singles):
            out.add(pg.key)
    return out


def _times_fit(pg: PackGpu, members: list[JobDemand], speeds: list[float]) -> bool:
    """With the allocation's time left known: every joiner's time limit (or, without one,
    its expected run time at its predicted speed) and every live member's expected rest
    at its new speed must fit in it. A joiner of unknown length does not fit."""
    if pg.remaining_s is None:
        return True
    for j, speed in zip(members, speeds, strict=True):
        joiner = j in pg.joined or j not in pg.live
        if joiner and j.time_limit_s is not None:
            need: float | None = j.time_limit_s
        elif j.est_duration_s is not None:
            need = j.est_duration_s / max(speed, 1e-6)
        else:
            need = None
        if need is None:
            if joiner:
                return False
            continue
        if need > pg.remaining_s + 1e-9:
            return False
    return True


def refill_joins(request: PackingRequest, policy: str, params: InterferenceParams) -> tuple[list[Join], list[JobDemand]]:
    """Pending jobs placed onto the GPUs of running packs (`OpenGpu.pack`) before any new
    pack is opened: those GPUs are held by their allocation anyway, so a joiner costs no
    new GPU. `complementary` fills each pack GPU with the job (among the next
    `_JOIN_SCAN` in seed order: priority band, then shortest expected run) that raises
    the GPU's predicted summed speed most, live members included, while that gain is at
    least `min_gain` (`_fill_by_gain`); `mem-best-fit` puts each
    job in queue order onto the pack GPU its fence fills best. An urgent job (aging)
    joins first; if it cannot, nothing of lower priority joins. Returns the joins and
    the jobs still pending."""
    limits = request.limits
    pgs = pack_gpus(request)
    # complementary takes joiners in its seeds' order (priority band, then shortest
    # expected run first: aging keeps long jobs from starving), mem-best-fit first come,
    # first served.
    tail: frozenset[int] = frozenset()
    if policy == "complementary":
        tail = drain_tail(request, _TAIL_FACTOR)
        queue = sorted(request.jobs, key=lambda j: _tail_first(j, tail, join_key(j)))
    else:
        queue = sorted(request.jobs, key=order_key)
    if not pgs or not queue:
        return [], queue
    # Whole-share packs (`refill_headroom_pct` None) never drain: a new pack on the GPU
    # would be no bigger.
    bound = set() if limits.refill_headroom_pct is None else allocation_bound(pgs, queue, limits)
    pgs = [pg for pg in pgs if pg.key not in bound]
    if not pgs:
        return [], queue
    # An urgent job that cannot join holds the room (docs/packing.md, aging): nothing of
    # lower priority joins, so no join keeps a pack alive that the urgent job waits for.
    held: list[JobDemand] = []

    def held_back(job: JobDemand) -> bool:
        return bool(held) and job.priority < held[0].priority

    placed: set[int] = set()
    # Overdue jobs (the slowdown bound, slurm_dlrm.packing.fairness) join first, in
    # their order, gangs and single-GPU jobs alike: otherwise the gang pass below, and
    # then the gain-driven fill, would take the room ahead of them.
    # A gang past the bound's reservation point that cannot join now reserves its W
    # GPUs of one pack node first (`reservations.reserve_for_gang`): they take no single-GPU joins
    # and drain for it; the pack's other GPUs carry on.
    reserved: set[str] = set()
    holds: dict[str, Reservation] = {}
    gang: JobDemand | None = None
    fair, now = request.fair, request.now_s
    backfill = False
    if fair is not None and now is not None and request.gang_joins and _GANG_HOLDS:
        reserve_at = gang_reserve_bound(request.jobs, now, fair)
        for job in queue:
            if job.is_gang and is_overdue(job, now, fair, reserve_at):
                _join_gangs(pgs, [job], placed, limits, params, policy == "complementary", reserved)
                if reserved:
                    gang = job
                    break
        if _GANG_ROOM and reserved and gang is not None:
            # The gang needs one rank's room on each reserved GPU, not the whole GPU:
            # a joiner may take a reserved GPU if it ends before that room is expected
            # free on all of them, or if it leaves the room (`reservations.gang_holds`).
            holds = gang_holds([pg for pg in pgs if pg.key in reserved], gang, limits,
                               policy == "complementary")
        else:
            # EASY backfill on the reserved GPUs: a joiner must end before their live
            # members do (their time left is capped there; `_times_fit`).
            for pg in pgs:
                if pg.key in reserved:
                    rest = max((j.est_duration_s if j.est_duration_s is not None else math.inf for j in pg.live), default=0.0)
                    pg.remaining_s = min(rest, pg.remaining_s if pg.remaining_s is not None else math.inf)
            reserved = {pg.key for pg in pgs if pg.key in reserved and pg.remaining_s == math.inf}
        backfill = True
    open_pgs = [pg for pg in pgs if pg.key not in reserved]
    overdue = [j for j in queue if is_overdue_priority(j.priority) and j.job_id not in placed]
    for job in overdue:
        if job.is_gang:
            if request.gang_joins:
                _join_gangs(open_pgs, [job], placed, limits, params, policy == "complementary", set())
            continue
        if _PRICED_OVERDUE:
            continue  # they lead the queue the priced fill scans (`_fill_by_gain`)
        target = _best_gain_gpu(open_pgs, job, limits, params)
        if target is not None:
            join(target, job, limits)
            placed.add(job.job_id)
    # Multi-GPU jobs first, all ranks or none (docs/packing.md "Multi-GPU jobs"). Under the
    # slowdown bound only a gang past its reservation point reserves (the overdue band
    # puts the most overdue first, so the same gang keeps its GPUs from round to round):
    # a reservation for whichever gang leads the queue costs throughput and lets gangs
    # go far ahead of one-GPU jobs (docs/packing.md, the table).
    may_reserve: Callable[[JobDemand], bool] | None = None
    if fair is not None and now is not None:
        past = gang_reserve_bound(request.jobs, now, fair)
        may_reserve = partial(is_overdue, now_s=now, cfg=fair, bound=past)
    stuck = _join_gangs(pgs, [j for j in queue if j.is_gang and j.job_id not in placed] if request.gang_joins else [],
                        placed, limits, params, policy == "complementary", reserved, may_reserve)
    # Single-GPU jobs do not join the GPUs a waiting gang reserved.
    all_pgs = pgs
    if not backfill:
        pgs = [pg for pg in pgs if pg.key not in reserved] if reserved else pgs
    if stuck is not None:
        held.append(stuck)  # an urgent gang that cannot join holds the room (as an urgent single)
    singles = [j for j in queue if not j.is_gang and j.job_id not in placed]
    if policy == "mem-best-fit":
        for job in singles:
            if held_back(job):
                break
            best: PackGpu | None = None
            best_left = 0
            for pg in pgs:
                if not _join_fits(pg, job, limits):
                    continue
                members = pg.members + [job]
                if not _times_fit(pg, members, [1.0] * len(members)):  # memory-only: no speed model
                    continue
                left = usable_gpu_bytes(pg.gpu) - pg.used_bytes - member_fence_bytes(job, pg.gpu, limits)
                if best is None or left < best_left:
                    best, best_left = pg, left
            if best is not None:
                join(best, job, limits)
                placed.add(job.job_id)
            elif job.priority >= URGENT_PRIORITY:
                held.append(job)
    else:
        # Urgent jobs first, each onto the pack GPU where it adds most.
        for job in singles:
            if job.priority < URGENT_PRIORITY:
                break
            best_gpu = _best_gain_gpu(pgs, job, limits, params)
            if best_gpu is None:
                held.append(job)
                break
            join(best_gpu, job, limits)
            placed.add(job.job_id)
        if not held and pgs:  # (a waiting gang may have reserved every pack GPU)
            # An overdue job that fits nowhere gets the reservation a drain-tail job gets.
            _fill_by_gain(pgs, singles, placed, limits, params, tail | {j.job_id for j in overdue}, holds)
    joins: list[Join] = []
    for pg in all_pgs:
        members = pg.members
        speeds = _join_speeds(members, params) if members else []
        pcts = thread_pcts([util_fraction(j.sm_util_pct) for j in members]) if policy == "complementary" else [100] * len(members)
        node_index, gpu_index = _key_indices(pg.key)
        for j, speed, pct in zip(members, speeds, pcts, strict=True):
            if j in pg.joined:
                joins.append(Join(pg.key, MemberPlacement(
                    job_id=j.job_id, node_index=node_index, gpu_index=gpu_index, mps_thread_pct=pct,
                    gpu_mem_limit_mib=math.ceil(member_fence_bytes(j, pg.gpu, limits) / MIB),
                    host_mem_limit_bytes=host_limit_bytes(j, limits), cpus=j.cpus,
                    predicted_speed=speed, rank=j.rank, world_size=j.world_size)))
    return joins, [j for j in queue if j.job_id not in placed]


def _best_gain_gpu(pgs: list[PackGpu], job: JobDemand, limits: PackingLimits,
                   params: InterferenceParams) -> PackGpu | None:
    """The pack GPU where `job` fits and adds most predicted summed speed, or None."""
    best_gpu: PackGpu | None = None
    best_gain = -math.inf
    for pg in pgs:
        if not _join_fits(pg, job, limits):
            continue
        members = pg.members + [job]
        speeds = _join_speeds(members, params)
        gain = sum(speeds) - (sum(_join_speeds(pg.members, params)) if pg.members else 0.0)
        if gain > best_gain + 1e-12 and _times_fit(pg, members, speeds):
            best_gpu, best_gain = pg, gain
    return best_gpu


def _join_gangs(pgs: list[PackGpu], gangs: list[JobDemand], placed: set[int], limits: PackingLimits,
                params: InterferenceParams, load_target: bool, reserved: set[str],
                may_reserve: Callable[[JobDemand], bool] | None = None) -> JobDemand | None:
    """Multi-GPU jobs join a running pack's node all ranks or none: each rank (heaviest
    first) onto its own pack GPU of one node, the least loaded one with room (memory,
    slots, the allocation's CPUs and host memory for all ranks, its time left);
    `load_target` (complementary): no GPU's summed SM or bandwidth use past the target.
    Returns the first urgent gang that could not join, or None; the first gang that
    could not join (and passes `may_reserve`, if given) reserves GPUs
    (`reservations.reserve_for_gang`, keys added to `reserved`)."""
    stuck: JobDemand | None = None
    groups: dict[int, list[PackGpu]] = {}
    for pg in pgs:
        groups.setdefault(id(pg.node), []).append(pg)
    for job in gangs:
        ranks = sorted(rank_members(job), key=rank_load)
        for group in groups.values():
            node = group[0].node
            if (len(group) < job.world_size or sum(m.cpus for m in ranks) > node.free_cpus
                    or sum(host_limit_bytes(m, limits) for m in ranks) > node.free_mem_bytes):
                continue
            chosen: list[PackGpu] = []
            for m in ranks:
                best: PackGpu | None = None
                best_load = math.inf
                for pg in group:
                    if any(pg is c for c in chosen) or not _join_fits(pg, m, limits):
                        continue
                    sm = sum(util_fraction(j.sm_util_pct) for j in pg.members) + util_fraction(m.sm_util_pct)
                    bw = sum(util_fraction(j.membw_util_pct) for j in pg.members) + util_fraction(m.membw_util_pct)
                    load = max(sm, bw)
                    if load_target and pg.members and load > limits.target_load + 1e-9:
                        continue
                    members = pg.members + [m]
                    if pg.remaining_s is not None and not _times_fit(pg, members, _join_speeds(members, params)):
                        continue
                    if load < best_load:
                        best, best_load = pg, load
                if best is None:
                    break
                chosen.append(best)
            if len(chosen) == len(ranks):
                for m, pg in zip(ranks, chosen, strict=True):
                    join(pg, m, limits)
                placed.add(job.job_id)
                break
        if job.job_id not in placed and stuck is None and job.priority >= URGENT_PRIORITY:
            stuck = job
        if job.job_id not in placed and not reserved and (may_reserve is None or may_reserve(job)):
            reserve_for_gang(groups, ranks, limits, reserved)
    return stuck


def _fill_by_gain(pgs: list[PackGpu], queue: list[JobDemand], placed: set[int], limits: PackingLimits,
                  params: InterferenceParams, tail: frozenset[int] = frozenset(),
                  holds: dict[str, Reservation] | None = None) -> None:
    """complementary's refill: each pack GPU in turn takes the job, among the next
    `_JOIN_SCAN` that fit in the given order, that raises its predicted summed speed most,
    while that gain is at least `min_gain`.

    A busy cluster offers many pack GPUs with little room: a scan stops as soon as no
    later job of the queue can fit (suffix minima of fence, CPUs and host memory), so a
    plan costs O(pack GPUs x jobs that fit), not O(pack GPUs x queue) (plan_scale.py)."""
    rest = [j for j in queue if j.job_id not in placed]
    n = len(rest)
    if n == 0:
        return
    cpus = [j.cpus for j in rest]
    host = [host_limit_bytes(j, limits) for j in rest]
    sm = [util_fraction(j.sm_util_pct) for j in rest]
    bw = [util_fraction(j.membw_util_pct) for j in rest]

    def suffix_min(values: list[int]) -> list[int]:
        out = values[:] + [1 << 62]
        for i in range(n - 1, -1, -1):
            out[i] = min(out[i], out[i + 1])
        return out

    min_cpus, min_host = suffix_min(cpus), suffix_min(host)
    fences: dict[str, tuple[list[int], list[int]]] = {}
    # skip[i] points at or before the first job not yet taken from index i on (union-find
    # with path compression): a scan never walks over the jobs earlier GPUs took.
    skip = list(range(n + 1))

    def untaken(i: int) -> int:
        root = i
        while skip[root] != root:
            root = skip[root]
        while skip[i] != root:
            skip[i], i = root, skip[i]
        return root

    # The first drain-tail job that fits no pack GPU now gets the GPU where it can start
    # soonest (EASY backfill): only joiners that end before then, or leave it room, join it.
    reservation = reserve_for_tail(pgs, [j for j in rest if j.job_id in tail], limits) if tail and _RESERVE else None
    # Prices of GPU memory, CPUs, SMs and bandwidth: how much of each the pending work
    # still needs (duration-weighted), the largest 1. A GPU's value is its members'
    # predicted speeds weighted by what they take of the priced resources, so joins
    # drain the resource the queue is heaviest on and the backlog's mix stays even
    # (greedy on speed alone left bandwidth- and memory-heavy jobs for the end).
    # CPUs per pack GPU: a pack node's allocation is shared by its GPUs.
    group_gpus: dict[int, int] = {}
    for pg in pgs:
        group_gpus[id(pg.node)] = group_gpus.get(id(pg.node), 0) + 1
    group_cpus = {id(pg.node): pg.node.free_cpus for pg in pgs}
    for pg in pgs:
        group_cpus[id(pg.node)] += sum(j.cpus for j in pg.live)
    cpu_per_gpu = {k: max(1.0, group_cpus[k] / group_gpus[k]) for k in group_gpus}
    # Prices: how much of each resource the pending work still needs (duration-weighted).
    g0 = pgs[0].gpu
    u0 = usable_gpu_bytes(g0)
    c0 = sum(cpu_per_gpu.values()) / len(cpu_per_gpu)
    dem = [0.0, 0.0, 0.0, 0.0]
    for k, j in enumerate(rest):
        d = j.est_duration_s or 1.0
        dem[0] += d * member_fence_bytes(j, g0, limits) / u0
        dem[1] += d * cpus[k] / c0
        dem[2] += d * sm[k]
        dem[3] += d * bw[k]
    top = max(dem) or 1.0
    price = [x / top for x in dem]
    flat = not _PRICED  # ablation: every member weighs 1 (summed speed), `min_gain` floor
    for pg in pgs:
        if pg.gpu.name not in fences:
            f = [member_fence_bytes(j, pg.gpu, limits) for j in rest]
            fences[pg.gpu.name] = (f, suffix_min(f))
        fence, min_fence = fences[pg.gpu.name]
        usable = usable_gpu_bytes(pg.gpu)
        node = pg.node
        res = reservation if reservation is not None and reservation.gpu is pg else (holds or {}).get(pg.key)
        while len(pg.joined) < pg.slots:
            free_mem, free_cpus, free_host = usable - pg.used_bytes, node.free_cpus, node.free_mem_bytes
            live_sm = [util_fraction(j.sm_util_pct) for j in pg.members]
            live_bw = [util_fraction(j.membw_util_pct) for j in pg.members]
            cpu_cap = cpu_per_gpu[id(node)]
            live_w = [1.0 if flat else price[0] * (live_gpu_bytes(j, pg.gpu, limits) if j in pg.live else member_fence_bytes(j, pg.gpu, limits)) / usable
                      + price[1] * j.cpus / cpu_cap + price[2] * util_fraction(j.sm_util_pct) + price[3] * util_fraction(j.membw_util_pct)
                      for j in pg.members]
            live_sp = predict_speeds_from_fractions(live_sm, live_bw, params) if len(live_sm) > 1 else [1.0] * len(live_sm)
            current = sum(w * x for w, x in zip(live_w, live_sp, strict=True))
            # The floor is relative to what the GPU's members get now (priced work per
            # priced resource, <= 1): a later joiner would meet the same co-runners. An
            # absolute floor was calibrated on a model that predicts no slowdown below
            # saturation; with a model that sees contention (learned, or the truth
            # itself) it turned away joins that still add work, and such a planner did
            # worse than one blind to contention (issue 16, benchmarks/robust_ceiling.py).
            live_efficiency = min(1.0, current / sum(live_w)) if live_w and sum(live_w) > 0 else 1.0
            pick = -1
            pick_gain = -math.inf
            scanned = 0
            i = untaken(0)
            while i < n:
                if min_fence[i] > free_mem or min_cpus[i] > free_cpus or min_host[i] > free_host:
                    break  # nothing from here on fits
                if (fence[i] > free_mem or cpus[i] > free_cpus or host[i] > free_host
                        or (res is not None and not backfills(res, rest[i], fence[i], cpus[i], sm[i], bw[i],
                                                              len(pg.joined), host[i]))):
                    i = untaken(i + 1)
                    continue
                scanned += 1
                speeds = (predict_speeds_from_fractions(live_sm + [sm[i]], live_bw + [bw[i]], params)
                          if live_sm else [1.0])
                weight = (1.0 if flat else
                          price[0] * fence[i] / usable + price[1] * cpus[i] / cpu_cap + price[2] * sm[i] + price[3] * bw[i])
                gain = sum(w * x for w, x in zip(live_w + [weight], speeds, strict=True)) - current
                floor = limits.min_gain if flat else _MIN_EFFICIENCY * weight * live_efficiency
                if (gain >= floor - 1e-12 and gain > pick_gain
                        and (pg.remaining_s is None or _times_fit(pg, pg.members + [rest[i]], speeds))):
                    pick, pick_gain = i, gain
                if scanned >= _JOIN_SCAN:
                    break
                i = untaken(i + 1)
            if pick < 0:
                break
            join(pg, rest[pick], limits)
            if res is not None:
                take_slack(res, rest[pick], fence[pick], cpus[pick], sm[pick], bw[pick], host[pick])
            skip[pick] = pick + 1
            placed.add(rest[pick].job_id)
