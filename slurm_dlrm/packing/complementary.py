"""`complementary` (ours): memory-safe fences, members chosen so that their bottlenecks
differ (SM with bandwidth, GPU with host CPU), members balanced over the GPUs of a
multi-GPU pack, packs sized from the queue and grouped by expected duration.
See docs/packing.md.

Over 600 lines: one policy whose passes (gangs first, then complementary pairs, fill,
balance over GPUs) hand each other the same round state; split, each pass would need it
all passed in. The gang placement helpers could move to their own module next."""

from __future__ import annotations

import math

from slurm_dlrm.packing.common import (
    NO_FREE_GPU,
    NO_ROOM,
    URGENT_PRIORITY,
    Gpu,
    Node,
    add_member,
    defer_early,
    defer_gang_early,
    drain_tail,
    expand_nodes,
    finish_plan,
    gang_host_fits,
    gpu_budget,
    held_reason,
    node_maxima,
    order_key,
    rank_load,
    tail_first,
)
from slurm_dlrm.packing.interference import (
    InterferenceParams,
    predict_speeds_from_fractions,
    util_fraction,
)
from slurm_dlrm.packing.model import (
    AGENT_CPUS,
    AGENT_MEM_MIB,
    Deferred,
    JobDemand,
    PackingLimits,
    PackingPlan,
    PackingRequest,
    host_limit_bytes,
    member_fence_bytes,
    rank_members,
    usable_gpu_bytes,
)
from slurm_dlrm.site import MIB, GpuModel

_WINDOW = 8  # candidates looked at per pick, in duration order (keeps plan() O(n))
_SKIP_LIMIT = 64  # candidates that did not fit before a pack is closed
_TOPUP_SCAN = 16
_SWAP_BUDGET = 2000  # model evaluations the swap pass may spend per plan
_EXACT_LOG_SPREAD = math.log(1.25)  # duration ratio to the GPU's first member for exact candidates
_EXACT_MAX = 12  # members + candidates up to which one GPU is solved by enumeration
_EXACT_BUDGET = 20000  # model evaluations the exact step may spend per plan
_TAIL_FACTOR = 0.25  # as refill's: drain-tail jobs seed first, longest first
_DURATION_WEIGHT = 3.0  # weight of |ln(duration / seed duration)| against resource fill  # leftover candidates looked at per GPU in the top-up pass

# Per job, for one GPU model: (SM fraction, bandwidth fraction, fence bytes, CPUs, host bytes).
_Vec = tuple[float, float, int, int, int]


def _vectors(jobs: list[JobDemand], gpu: GpuModel, limits: PackingLimits) -> dict[int, _Vec]:
    return {j.key: (util_fraction(j.sm_util_pct), util_fraction(j.membw_util_pct), member_fence_bytes(j, gpu, limits),
                       j.cpus, host_limit_bytes(j, limits)) for j in jobs}


def plan_complementary(request: PackingRequest, params: InterferenceParams) -> PackingPlan:
    limits = request.limits
    nodes = expand_nodes(request)
    budget = gpu_budget(request, nodes)
    free_nodes = [n for n in nodes if n.free_gpus > 0]
    maxima = node_maxima(free_nodes)
    deferred: list[Deferred] = []
    models = {n.gpu.name: n.gpu for n in free_nodes}

    # Seeds go in priority order, shortest expected run first within a priority: the
    # dispatcher's aging lifts long waiters into a higher priority band and, past the
    # wait bound, makes them urgent, so shortest-first cannot starve anyone.
    eligible: list[JobDemand] = []
    blocked: list[JobDemand] = []
    # Near the end of a backlog the jobs that would finish last go first (`drain_tail`).
    tail = drain_tail(request, _TAIL_FACTOR)
    gangs: list[JobDemand] = []
    for job in sorted(request.jobs, key=lambda j: tail_first(j, tail, _seed_key(j))):
        if job.is_gang:
            if not defer_gang_early(job, free_nodes, limits, True, blocked, deferred):
                gangs.append(job)
        elif not defer_early(job, maxima, limits, True, blocked, deferred):
            eligible.append(job)
    rank_list = [m for job in gangs for m in rank_members(job)]
    vecs = {name: _vectors(eligible + rank_list, gpu, limits) for name, gpu in sorted(models.items())}

    # Multi-GPU jobs first (docs/packing.md "Multi-GPU jobs"): a gang needs W GPUs of one
    # node at once, which single-GPU jobs taking GPUs one by one would rarely leave free.
    # Each gang goes beside an earlier gang of this round if every rank finds its own GPU
    # there within the load target, else onto W fresh GPUs; then single-GPU jobs of a
    # similar expected duration fill those GPUs, each onto the least loaded one.
    left_budget = budget
    gang_packs: list[list[Gpu]] = []
    held_gang: JobDemand | None = None
    for job in gangs:
        gpus_of = _place_gang(job, gang_packs, free_nodes, vecs, limits, left_budget)
        if gpus_of is None:
            deferred.append(Deferred(job.job_id, NO_FREE_GPU if left_budget < job.world_size else NO_ROOM))
            if held_gang is None and job.priority >= URGENT_PRIORITY:
                held_gang = job
            continue
        if gpus_of[1]:
            gang_packs.append(gpus_of[0])
            left_budget -= len(gpus_of[0])
    if held_gang is not None:
        # An urgent gang that found no W free GPUs holds the room, as an urgent single
        # job does: single-GPU jobs of lower priority wait, so GPUs drain for it
        # (otherwise they are refilled one by one and the gang starves).
        for job in eligible:
            if job.priority < held_gang.priority:
                deferred.append(Deferred(job.job_id, held_reason([held_gang]) or NO_ROOM))
        eligible = [j for j in eligible if j.priority >= held_gang.priority]
    if gang_packs and eligible:
        eligible = _fill_gang_packs(gang_packs, eligible, vecs, limits)
    # A gang that waits can later join a running pack only if the pack spans its
    # world_size GPUs (refill, all ranks in one allocation): new packs of single-GPU jobs
    # are spread over that many GPUs while one waits (one-GPU packs kept alive by refill
    # would otherwise never leave W GPUs for it).
    waiting = [j.world_size for j in gangs if j.job_id in {d.job_id for d in deferred}]
    min_gpus = max(waiting, default=1)

    # A pack holds its GPUs until its last member ends, so a pack is built around a
    # seed from the jobs whose expected duration is nearest to the seed's.
    by_dur = sorted(range(len(eligible)), key=lambda k: (_log_duration(eligible[k]), eligible[k].job_id))
    where = [0] * len(eligible)
    for pos, k in enumerate(by_dur):
        where[k] = pos
    prev = list(range(-1, len(by_dur) - 1))
    nxt = list(range(1, len(by_dur) + 1))
    removed = [False] * len(eligible)
    index_of = {j.job_id: k for k, j in enumerate(eligible)}

    def take(k: int) -> None:
        removed[k] = True
        pos = where[k]
        p, q = prev[pos], nxt[pos]
        if p >= 0:
            nxt[p] = q
        if q < len(by_dur):
            prev[q] = p

    def neighbours(k: int, limit: int) -> list[JobDemand]:
        """Up to `limit` jobs nearest in expected duration to job k (k itself first)."""
        out = [eligible[k]]
        centre = _log_duration(eligible[k])
        pos = where[k]
        left, right = prev[pos], nxt[pos]
        while len(out) < limit and (left >= 0 or right < len(by_dur)):
            dl = centre - _log_duration(eligible[by_dur[left]]) if left >= 0 else math.inf
            dr = _log_duration(eligible[by_dur[right]]) - centre if right < len(by_dur) else math.inf
            if dl <= dr:
                out.append(eligible[by_dur[left]])
                left = prev[left]
            else:
                out.append(eligible[by_dur[right]])
                right = nxt[right]
        return out

    packs: list[list[Gpu]] = gang_packs
    cursor = 0
    for node in sorted(free_nodes, key=lambda n: (-n.free_gpus, n.name)):
        vec = vecs[node.gpu.name]
        misses = 0
        probe = cursor
        made_here = 0
        while node.free_gpus > 0 and left_budget > 0:
            while cursor < len(eligible) and removed[cursor]:
                cursor += 1
            probe = max(probe, cursor)
            while probe < len(eligible) and removed[probe]:
                probe += 1
            if probe >= len(eligible):
                break
            seed = eligible[probe]
            g_max = min(node.free_gpus, 1 if seed.may_pause else limits.max_gpus_per_pack, left_budget)
            # the free capacity left one agent's CPU and memory out per node; a second pack
            # on the node this round brings its own agent (one-GPU packs: several per node)
            agent_cpus, agent_mem = (AGENT_CPUS, AGENT_MEM_MIB * MIB) if made_here else (0, 0)
            node.free_cpus -= agent_cpus
            node.free_mem_bytes -= agent_mem
            candidates = neighbours(probe, g_max * limits.members_per_gpu * 3)
            chunk = _pick_chunk(candidates, vec, node, g_max, limits) if node.free_cpus > 0 else []
            gpus, rejected = _balance(chunk, vec, node, g_max, limits, min_gpus) if chunk else ([], chunk)
            if not gpus or seed in rejected:
                # The seed does not fit what is left of this node: try a few later seeds
                # here, then the next node.
                for g in gpus:  # undo
                    for job in g.members:
                        node.free_cpus += vec[job.key][3]
                        node.free_mem_bytes += vec[job.key][4]
                node.free_cpus += agent_cpus
                node.free_mem_bytes += agent_mem
                misses += 1
                if misses >= 8:
                    break
                probe += 1
                continue
            for g in gpus:
                for job in g.members:
                    take(index_of[job.job_id])
            node.free_gpus -= len(gpus)
            left_budget -= len(gpus)
            packs.append(gpus)
            made_here += 1
    # An urgent job that found no room on any node: nothing else may join the packs
    # (top-up), so the room that frees up next goes to it.
    held = next((eligible[k] for k in range(len(eligible)) if not removed[k]
                 and eligible[k].priority >= URGENT_PRIORITY), None)

    # Top-up: a leftover job joins a GPU past the load target only if that GPU's
    # predicted aggregate speed grows by at least `min_gain` solo jobs. Lightest first.
    leftover = [eligible[k] for k in range(len(eligible)) if not removed[k]]
    if leftover and packs and held is None:
        leftover = _top_up(packs, leftover, vecs, limits, params)
        if leftover:
            # Swapping may free memory that a leftover can then use: top up once more.
            leftover = _top_up(packs, _swap_pass(packs, leftover, vecs, limits, params), vecs, limits, params)
    polish_budget = [_SWAP_BUDGET]
    exact_budget = [_EXACT_BUDGET]
    for gpus in packs:
        vec = vecs[gpus[0].node.gpu.name]
        for g in gpus:
            if held is None and exact_budget[0] > 0:
                leftover = _exact_gpu(g, leftover, vec, limits, params, exact_budget)
        if len(gpus) > 1:
            _polish(gpus, vec, params, polish_budget)
            if leftover and held is None:
                # Polishing moves members between the GPUs, which can make room on one for
                # a job left over: each GPU's exact step again (when CPUs bind, it trades
                # a CPU-heavy member for that job, which the GPU's old members barred).
                for g in gpus:
                    leftover = _exact_gpu(g, leftover, vec, limits, params, exact_budget)
    for job in leftover:
        if held is not None and job is not held and job.priority < held.priority:
            deferred.append(Deferred(job.job_id, f"holding room for job {held.job_id}, which waited longest"))
        else:
            deferred.append(Deferred(job.job_id, NO_FREE_GPU if not packs and left_budget == 0 else NO_ROOM))
    return finish_plan("complementary", packs, deferred, limits, params, fenced=True, thread_caps=True)


def _assign_ranks(ranks: list[JobDemand], gpus: list[Gpu], vec: dict[int, _Vec],
                  limits: PackingLimits) -> list[int] | None:
    """GPU index per rank (heaviest rank first, each onto the least loaded GPU not yet
    holding a sibling) with memory, slots and the load target respected; None if a rank
    finds no GPU."""
    load = [(g.sm, g.bw, g.used_bytes, len(g.members)) for g in gpus]
    taken: set[int] = set()
    out = [0] * len(ranks)
    for i in sorted(range(len(ranks)), key=lambda i: rank_load(ranks[i])):
        s, b, fence, _c, _h = vec[ranks[i].key]
        best, best_key = -1, math.inf
        for k, (gs, gb, used, n) in enumerate(load):
            if k in taken or n >= gpus[k].slots or used + fence > gpus[k].usable_bytes:
                continue
            worst = max(gs + s, gb + b)
            if n and worst > limits.target_load + 1e-9:
                continue
            if worst < best_key:
                best, best_key = k, worst
        if best < 0:
            return None
        taken.add(best)
        out[i] = best
    return out


def _place_gang(job: JobDemand, gang_packs: list[list[Gpu]], nodes: list[Node], vecs: dict[str, dict[int, _Vec]],
                limits: PackingLimits, budget: int) -> tuple[list[Gpu], bool] | None:
    """Place a multi-GPU job's ranks: beside an earlier gang of this round, or on
    `world_size` fresh GPUs of the fullest node that has them (least fragmentation).
    Returns (its GPUs, whether they are a new pack), or None."""
    ranks = list(rank_members(job))
    for gpus in gang_packs:
        node = gpus[0].node
        if len(gpus) < job.world_size or not gang_host_fits(node, tuple(ranks), limits):
            continue
        vec = vecs[node.gpu.name]
        where = _assign_ranks(ranks, gpus, vec, limits)
        if where is not None:
            for m, k in zip(ranks, where, strict=True):
                add_member(gpus[k], m, vec[m.key][2], limits)
            return gpus, False
    if budget < job.world_size:
        return None
    fits = [n for n in nodes if n.free_gpus >= job.world_size and gang_host_fits(n, tuple(ranks), limits)
            and all(vecs[n.gpu.name][m.key][2] <= usable_gpu_bytes(n.gpu) for m in ranks)]
    if not fits:
        return None
    node = min(fits, key=lambda n: (n.free_gpus, n.name))
    node.free_gpus -= job.world_size
    vec = vecs[node.gpu.name]
    gpus = [Gpu(node=node, usable_bytes=usable_gpu_bytes(node.gpu), slots=limits.members_per_gpu)
            for _ in range(job.world_size)]
    for m, g in zip(sorted(ranks, key=rank_load), gpus, strict=True):
        add_member(g, m, vec[m.key][2], limits)
    return gpus, True


def _fill_gang_packs(gang_packs: list[list[Gpu]], eligible: list[JobDemand], vecs: dict[str, dict[int, _Vec]],
                     limits: PackingLimits) -> list[JobDemand]:
    """Single-GPU jobs nearest in expected duration to each gang pack join it, each onto
    the pack GPU whose busier resource (SM or bandwidth) stays lowest, within the load
    target: the light ranks' GPUs take more, so the node's GPUs end up balanced.
    Returns the jobs left."""
    taken: set[int] = set()
    for gpus in gang_packs:
        node = gpus[0].node
        vec = vecs[node.gpu.name]
        centre = sum(_log_duration(m) for g in gpus for m in g.members) / max(1, sum(len(g.members) for g in gpus))
        cands = sorted((j for j in eligible if j.job_id not in taken),
                       key=lambda j: (abs(_log_duration(j) - centre), j.job_id))
        for job in cands[:3 * len(gpus) * limits.members_per_gpu]:
            s, b, fence, cpus, host = vec[job.key]
            if cpus > node.free_cpus or host > node.free_mem_bytes:
                continue
            best: Gpu | None = None
            best_key = math.inf
            for g in gpus:
                worst = max(g.sm + s, g.bw + b)
                if (len(g.members) >= g.slots or g.used_bytes + fence > g.usable_bytes
                        or worst > limits.target_load + 1e-9):
                    continue
                if worst < best_key:
                    best, best_key = g, worst
            if best is not None:
                add_member(best, job, fence, limits)
                taken.add(job.job_id)
    return [j for j in eligible if j.job_id not in taken]


def _top_up(packs: list[list[Gpu]], leftover: list[JobDemand], vecs: dict[str, dict[int, _Vec]],
            limits: PackingLimits, params: InterferenceParams) -> list[JobDemand]:
    """Add leftover jobs (lightest first) to GPUs whose predicted summed speed grows by
    at least `min_gain` solo jobs. Returns the jobs still left over."""
    taken: set[int] = set()
    light = sorted(leftover, key=lambda j: (max(util_fraction(j.sm_util_pct), util_fraction(j.membw_util_pct)), order_key(j)))
    head = 0
    for gpus in packs:
        for g in gpus:
            vec = vecs[g.node.gpu.name]
            scanned = 0
            while head < len(light) and light[head].job_id in taken:
                head += 1
            for job in light[head:head + 4 * _TOPUP_SCAN]:
                if scanned >= _TOPUP_SCAN or len(g.members) >= g.slots:
                    break
                if job.job_id in taken:
                    continue
                scanned += 1
                s, b, fence, cpus, host = vec[job.key]
                if g.used_bytes + fence > g.usable_bytes or cpus > g.node.free_cpus or host > g.node.free_mem_bytes:
                    continue
                if _gain_if_added(g, s, b, params) < limits.min_gain:
                    break  # the lightest fitting job does not pay: heavier ones will not
                add_member(g, job, fence, limits)
                taken.add(job.job_id)
    return [j for j in leftover if j.job_id not in taken]


def _duration_compatible(job: JobDemand, g: Gpu) -> bool:
    """Whether `job` would end about when the GPU's first member does (a pack keeps its
    GPUs until its last member ends); unknown durations count as compatible."""
    if not g.members or job.est_duration_s is None or g.members[0].est_duration_s is None:
        return True
    return abs(_log_duration(job) - _log_duration(g.members[0])) <= _EXACT_LOG_SPREAD


def _exact_gpu(g: Gpu, leftover: list[JobDemand], vec: dict[int, _Vec], limits: PackingLimits,
               params: InterferenceParams, budget: list[int]) -> list[JobDemand]:
    """Small cases solved exactly: when a GPU's members plus the leftovers that could join
    it number at most `_EXACT_MAX`, try every subset that fits (memory, slots, the node's
    CPUs and host memory) and keep the one with the highest predicted summed speed.
    Urgent members stay. Spends at most `budget[0]` model evaluations over the plan, so
    it refines small rounds and leaves large ones to the heuristics."""
    if len(g.members) + len(leftover) > 4 * _EXACT_MAX:
        return leftover  # a large round: not worth scanning the leftovers per GPU
    # Only jobs that would end about when the GPU's first member does (a pack keeps its
    # GPUs until its last member ends); unknown durations count as compatible.
    fits_alone = [j for j in leftover if vec[j.key][2] <= g.usable_bytes and _duration_compatible(j, g)]
    cands = g.members + fits_alone
    if len(cands) > _EXACT_MAX or not fits_alone or budget[0] < (1 << len(cands)):
        return leftover
    n = len(cands)
    rows = [vec[j.key] for j in cands]
    fixed = sum(1 << k for k, j in enumerate(cands) if j.priority >= URGENT_PRIORITY or j.is_gang)
    cpu_room = g.node.free_cpus + sum(vec[j.key][3] for j in g.members)
    host_room = g.node.free_mem_bytes + sum(vec[j.key][4] for j in g.members)
    best_mask = sum(1 << k for k in range(len(g.members)))
    best_value = _gpu_value([r[0] for r in rows[:len(g.members)]], [r[1] for r in rows[:len(g.members)]], params)
    for mask in range(1, 1 << n):
        if mask & fixed != fixed:
            continue
        idx = [k for k in range(n) if mask >> k & 1]
        if (len(idx) > g.slots or sum(rows[k][2] for k in idx) > g.usable_bytes
                or sum(rows[k][3] for k in idx) > cpu_room or sum(rows[k][4] for k in idx) > host_room):
            continue
        budget[0] -= 1
        value = _gpu_value([rows[k][0] for k in idx], [rows[k][1] for k in idx], params)
        if value > best_value + 1e-9:
            best_mask, best_value = mask, value
    chosen = [cands[k] for k in range(n) if best_mask >> k & 1]
    if {j.job_id for j in chosen} == {j.job_id for j in g.members}:
        return leftover
    for j in g.members:
        g.node.free_cpus += vec[j.key][3]
        g.node.free_mem_bytes += vec[j.key][4]
    g.members, g.fences = [], []
    g.used_bytes, g.sm, g.bw = 0, 0.0, 0.0
    for j in chosen:
        add_member(g, j, vec[j.key][2], limits)
    chosen_ids = {j.job_id for j in chosen}
    dropped = [j for j in cands if j.job_id not in chosen_ids]
    return [j for j in leftover if j.job_id not in chosen_ids] + [j for j in dropped if j not in leftover]


def _gpu_value(sm: list[float], bw: list[float], params: InterferenceParams) -> float:
    return sum(predict_speeds_from_fractions(sm, bw, params)) if len(sm) > 1 else float(len(sm))


def _polish(gpus: list[Gpu], vec: dict[int, _Vec], params: InterferenceParams, budget: list[int]) -> None:
    """Moves and exchanges of members between the GPUs of one pack while they raise the
    pack's predicted summed speed (bounded by `budget[0]` model evaluations)."""
    for _sweep in range(3):
        best: tuple[float, int, int, int, int] | None = None  # (gain, a, i, b, j or -1)
        vals = [_gpu_value([vec[m.key][0] for m in g.members], [vec[m.key][1] for m in g.members], params)
                for g in gpus]
        for a, ga in enumerate(gpus):
            for b, gb in enumerate(gpus):
                if a == b:
                    continue
                for i, x in enumerate(ga.members):
                    if x.is_gang:
                        continue  # a rank stays on its GPU (its siblings hold the others)
                    vx = vec[x.key]
                    rest_a = [m for k, m in enumerate(ga.members) if k != i]
                    options = [-1] + (list(range(len(gb.members))) if a < b else [])
                    for j in options:
                        if budget[0] <= 0:
                            return
                        if j < 0:
                            if len(gb.members) >= gb.slots or gb.used_bytes + vx[2] > gb.usable_bytes or not rest_a:
                                continue
                            new_a, new_b = rest_a, gb.members + [x]
                        else:
                            y = gb.members[j]
                            if y.is_gang:
                                continue
                            vy = vec[y.key]
                            if (ga.used_bytes - vx[2] + vy[2] > ga.usable_bytes
                                    or gb.used_bytes - vy[2] + vx[2] > gb.usable_bytes):
                                continue
                            new_a = rest_a + [y]
                            new_b = [m for k, m in enumerate(gb.members) if k != j] + [x]
                        budget[0] -= 1
                        gain = (_gpu_value([vec[m.key][0] for m in new_a], [vec[m.key][1] for m in new_a], params)
                                + _gpu_value([vec[m.key][0] for m in new_b], [vec[m.key][1] for m in new_b], params)
                                - vals[a] - vals[b])
                        if gain > 1e-6 and (best is None or gain > best[0]):
                            best = (gain, a, i, b, j)
        if best is None:
            return
        _gain, a, i, b, j = best
        ga, gb = gpus[a], gpus[b]
        x, fx = ga.members.pop(i), ga.fences.pop(i)
        moved = [(x, fx)]
        if j >= 0:
            moved_back = (gb.members.pop(j), gb.fences.pop(j))
            ga.members.append(moved_back[0])
            ga.fences.append(moved_back[1])
        gb.members.append(x)
        gb.fences.append(fx)
        del moved
        for g in (ga, gb):
            g.used_bytes = sum(g.fences)
            g.sm = sum(vec[m.key][0] for m in g.members)
            g.bw = sum(vec[m.key][1] for m in g.members)


def _swap_pass(packs: list[list[Gpu]], leftover: list[JobDemand], vecs: dict[str, dict[int, _Vec]],
               limits: PackingLimits, params: InterferenceParams) -> list[JobDemand]:
    """Local search: swap a member for a leftover job when that raises the GPU's predicted
    summed speed (memory knapsacks the greedy fill got wrong). Bounded effort
    (`_SWAP_BUDGET` model evaluations), so it refines small plans and costs large ones
    little. Returns the leftovers after swapping."""
    budget = _SWAP_BUDGET
    pool = sorted(leftover, key=order_key)[:_TOPUP_SCAN]
    rest = [j for j in leftover if j not in pool]
    for gpus in packs:
        for g in gpus:
            vec = vecs[g.node.gpu.name]
            sm = [util_fraction(j.sm_util_pct) for j in g.members]
            bw = [util_fraction(j.membw_util_pct) for j in g.members]
            current = sum(predict_speeds_from_fractions(sm, bw, params)) if len(sm) > 1 else float(len(sm))
            for ci in range(len(pool)):
                cand = pool[ci]
                if not _duration_compatible(cand, g):
                    continue
                cs, cb, cfence, ccpus, chost = vec[cand.key]
                best: tuple[float, int] | None = None
                for mi, member in enumerate(g.members):
                    if budget <= 0:
                        return pool + rest
                    if member.is_gang:
                        continue  # ranks are placed all or none, never swapped out
                    ms, mb, mfence, mcpus, mhost = vec[member.key]
                    if (g.used_bytes - mfence + cfence > g.usable_bytes or ccpus - mcpus > g.node.free_cpus
                            or chost - mhost > g.node.free_mem_bytes):
                        continue
                    budget -= 1
                    sm2 = sm[:mi] + sm[mi + 1:] + [cs]
                    bw2 = bw[:mi] + bw[mi + 1:] + [cb]
                    value = sum(predict_speeds_from_fractions(sm2, bw2, params)) if len(sm2) > 1 else 1.0
                    if value > current + 1e-6 and (best is None or value > best[0]):
                        best = (value, mi)
                if best is None:
                    continue
                value, mi = best
                out = g.members[mi]
                ms, mb, mfence, mcpus, mhost = vec[out.key]
                g.members[mi], g.fences[mi] = cand, cfence
                g.used_bytes += cfence - mfence
                g.sm += cs - ms
                g.bw += cb - mb
                g.node.free_cpus -= ccpus - mcpus
                g.node.free_mem_bytes -= chost - mhost
                sm[mi], bw[mi] = cs, cb
                current = value
                pool[ci] = out
            # One member out, two leftovers in (a big member blocking two smaller ones).
            if len(g.members) >= g.slots:
                continue
            best2: tuple[float, int, int, int] | None = None
            for mi, member in enumerate(g.members):
                if member.is_gang:
                    continue
                ms, mb, mfence, mcpus, mhost = vec[member.key]
                for a in range(len(pool)):
                    if not _duration_compatible(pool[a], g):
                        continue
                    for c in range(a + 1, len(pool)):
                        if budget <= 0:
                            break
                        if not _duration_compatible(pool[c], g):
                            continue
                        va, vc = vec[pool[a].key], vec[pool[c].key]
                        if (g.used_bytes - mfence + va[2] + vc[2] > g.usable_bytes
                                or va[3] + vc[3] - mcpus > g.node.free_cpus or va[4] + vc[4] - mhost > g.node.free_mem_bytes):
                            continue
                        budget -= 1
                        value = sum(predict_speeds_from_fractions(sm[:mi] + sm[mi + 1:] + [va[0], vc[0]],
                                                                  bw[:mi] + bw[mi + 1:] + [va[1], vc[1]], params))
                        if value > current + limits.min_gain and (best2 is None or value > best2[0]):
                            best2 = (value, mi, a, c)
            if best2 is not None:
                value, mi, a, c = best2
                out = g.members[mi]
                ms, mb, mfence, mcpus, mhost = vec[out.key]
                del g.members[mi], g.fences[mi], sm[mi], bw[mi]
                g.used_bytes -= mfence
                g.sm -= ms
                g.bw -= mb
                g.node.free_cpus += mcpus
                g.node.free_mem_bytes += mhost
                for job in (pool[a], pool[c]):
                    v = vec[job.key]
                    add_member(g, job, v[2], limits)
                    sm.append(v[0])
                    bw.append(v[1])
                current = value
                pool = [j for k, j in enumerate(pool) if k not in (a, c)] + [out]
    return pool + rest


def _seed_key(job: JobDemand) -> tuple[float, float, float, int]:
    return (-job.priority, job.est_duration_s if job.est_duration_s is not None else 0.0, job.submit_time_s, job.job_id)


def _log_duration(job: JobDemand) -> float:
    d = job.est_duration_s
    return math.log(d) if d is not None and d > 0 else 0.0


def _pick_chunk(candidates: list[JobDemand], vec: dict[int, _Vec], node: Node, g_max: int,
                limits: PackingLimits) -> list[JobDemand]:
    """Members for one pack of up to `g_max` GPUs on `node`: the seed (`candidates[0]`)
    and then, among the next `_WINDOW` candidates (nearest in duration first), always the
    one with the lowest score: the pack's fullest resource after adding it (SM,
    bandwidth, GPU memory, CPUs, host memory, member slots; each relative to the pack's
    capacity) plus `_DURATION_WEIGHT` times its distance in log-duration from the seed.
    A pack heavy on SMs thus fills with bandwidth- or host-bound jobs next: the
    complementary pairing; and members end at about the same time.
    """
    cap_sm = g_max * limits.target_load
    cap_mem = float(g_max * usable_gpu_bytes(node.gpu))
    cap_cpu = float(node.free_cpus)
    cap_host = float(node.free_mem_bytes)
    cap_n = float(g_max * limits.members_per_gpu)
    if cap_cpu <= 0 or cap_host <= 0 or not candidates:
        return []
    seed_log = _log_duration(candidates[0])
    # Per candidate, normalised: (sm, bw, mem, cpu, host, duration penalty).
    rows = []
    for job in candidates:
        s, b, fence, cpus, host = vec[job.key]
        rows.append((s / cap_sm, b / cap_sm, fence / cap_mem, cpus / cap_cpu, host / cap_host,
                     _DURATION_WEIGHT * abs(_log_duration(job) - seed_log)))
    s0, b0, m0, c0, h0, _ = rows[0]
    if m0 > 1.0 + 1e-9 or c0 > 1.0 + 1e-9 or h0 > 1.0 + 1e-9:
        return []  # the seed itself does not fit (it may overrun the SM/bandwidth target alone)
    u_sm, u_bw, u_mem, u_cpu, u_host = s0, b0, m0, c0, h0
    step_n = 1.0 / cap_n
    u_n = step_n
    chunk = [candidates[0]]
    window = list(range(1, min(len(candidates), 1 + _WINDOW)))
    nxt = len(window) + 1
    skipped = 0
    limit = 1.0 + 1e-9
    while window:
        n_fill = u_n + step_n
        if n_fill > limit:
            break
        best_pos = -1
        best_score = math.inf
        for pos, k in enumerate(window):
            r = rows[k]
            # max() over a tuple, unrolled: this loop is the plan's hot path (plan_scale.py).
            worst = n_fill
            v = u_sm + r[0]
            if v > worst:
                worst = v
            v = u_bw + r[1]
            if v > worst:
                worst = v
            v = u_mem + r[2]
            if v > worst:
                worst = v
            v = u_cpu + r[3]
            if v > worst:
                worst = v
            v = u_host + r[4]
            if v > worst:
                worst = v
            if worst <= limit and worst + r[5] < best_score:
                best_pos, best_score = pos, worst + r[5]
        if best_pos < 0:
            window.pop(0)  # nothing in the window fits: look further, within a bound
            skipped += 1
            if skipped >= _SKIP_LIMIT:
                break
        else:
            k = window.pop(best_pos)
            r = rows[k]
            u_sm += r[0]
            u_bw += r[1]
            u_mem += r[2]
            u_cpu += r[3]
            u_host += r[4]
            u_n = n_fill
            chunk.append(candidates[k])
        if nxt < len(candidates):
            window.append(nxt)
            nxt += 1
    return chunk


def _balance(chunk: list[JobDemand], vec: dict[int, _Vec], node: Node, g_max: int,
             limits: PackingLimits, min_gpus: int = 1) -> tuple[list[Gpu], list[JobDemand]]:
    """Spread `chunk` over as few GPUs as it needs (<= g_max), balancing predicted load
    (inter-GPU): heaviest first, each onto the GPU whose busier resource stays lowest."""
    usable = usable_gpu_bytes(node.gpu)
    need_sm = sum(vec[j.key][0] for j in chunk)
    need_bw = sum(vec[j.key][1] for j in chunk)
    need_mem = sum(vec[j.key][2] for j in chunk)
    g = max(1, math.ceil(max(need_sm / limits.target_load, need_bw / limits.target_load, need_mem / usable,
                             len(chunk) / limits.members_per_gpu) - 1e-9))
    g = min(max(g, min(min_gpus, len(chunk))), g_max)
    # The seed first (the pack exists for it), then heaviest first.
    by_load = chunk[:1] + sorted(chunk[1:], key=lambda j: (-max(vec[j.key][0], vec[j.key][1]),
                                                           -vec[j.key][2], j.job_id))
    by_mem = chunk[:1] + sorted(chunk[1:], key=lambda j: (-vec[j.key][2], j.job_id))

    def assign(order: list[JobDemand], count: int, memory_first: bool) -> tuple[list[Gpu], list[JobDemand]]:
        gpus = [Gpu(node=node, usable_bytes=usable, slots=limits.members_per_gpu) for _ in range(count)]
        rejected: list[JobDemand] = []
        for job in order:
            s, b, fence, _cpus, _host = vec[job.key]
            best: Gpu | None = None
            best_key: tuple[float, float] = (math.inf, math.inf)
            for cand in gpus:
                if len(cand.members) >= cand.slots or cand.used_bytes + fence > cand.usable_bytes:
                    continue
                if memory_first:  # best fit on memory when memory is what binds
                    key = (float(cand.usable_bytes - cand.used_bytes - fence), max(cand.sm + s, cand.bw + b))
                else:
                    key = (max(cand.sm + s, cand.bw + b), cand.sm + s + cand.bw + b)
                if key < best_key:
                    best, best_key = cand, key
            if best is None:
                rejected.append(job)
                continue
            best.members.append(job)
            best.fences.append(fence)
            best.used_bytes += fence
            best.sm += s
            best.bw += b
        return gpus, rejected

    while True:
        gpus, rejected = assign(by_load, g, False)
        if rejected:
            alt = assign(by_mem, g, True)
            if len(alt[1]) < len(rejected):
                gpus, rejected = alt
        if not rejected or g >= g_max:
            break
        g += 1  # fragmentation: one more GPU and try again
    gpus = [x for x in gpus if x.members]
    for x in gpus:
        for job in x.members:
            node.free_cpus -= vec[job.key][3]
            node.free_mem_bytes -= vec[job.key][4]
    return gpus, rejected


def _gain_if_added(g: Gpu, s: float, b: float, params: InterferenceParams) -> float:
    """Predicted change of the GPU's summed relative speed if a member (s, b) joins."""
    sm = [util_fraction(j.sm_util_pct) for j in g.members]
    bw = [util_fraction(j.membw_util_pct) for j in g.members]
    before = sum(predict_speeds_from_fractions(sm, bw, params)) if len(sm) > 1 else float(len(sm))
    return sum(predict_speeds_from_fractions(sm + [s], bw + [b], params)) - before
