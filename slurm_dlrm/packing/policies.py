"""The named packing policies behind one entry point, `plan(request, policy)`.

Every policy sees the same `PackingRequest` and returns a `PackingPlan`, so the
baselines are measured by the same code as ours:

- `exclusive`: one job per GPU (Slurm today).
- `first-fit`: count-based slots like gres/shard: up to `shards_per_gpu` members per GPU
  in queue order, no memory awareness (no fence either: gres/shard fences nothing).
- `mem-best-fit`: memory only: each job onto the open GPU whose memory it fills best.
- `complementary` (ours): memory-safe fences, members chosen so that their bottlenecks
  differ (SM with bandwidth, GPU with host CPU), members balanced over the GPUs of a
  multi-GPU pack, packs sized from the queue and grouped by expected duration.

Deterministic: the same request gives the same plan (ties break on job id).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from slurm_dlrm.errors import BadInput
from slurm_dlrm.packing.interference import (
    DEFAULT_PARAMS,
    InterferenceParams,
    predict_speeds_from_fractions,
)
from slurm_dlrm.packing.model import (
    Deferred,
    JobDemand,
    Join,
    MemberPlacement,
    Pack,
    PackingLimits,
    PackingPlan,
    PackingRequest,
    host_limit_bytes,
    member_fence_bytes,
    usable_gpu_bytes,
)
from slurm_dlrm.site import MIB, GpuModel

POLICY_NAMES = ("exclusive", "first-fit", "mem-best-fit", "complementary")
# Policies that refill running packs (OpenGpu.pack) and give packs refill headroom.
REFILL_POLICIES = ("mem-best-fit", "complementary")
# A priority at or above this marks a job that waited past the age bound: nothing of
# lower priority is admitted ahead of it (see slurm_dlrm.packing.dispatch).
URGENT_PRIORITY = 1e9

NO_FREE_GPU = "no free GPU this round"
NO_ROOM = "no room left this round"


# ---------------------------------------------------------------- shared plumbing

@dataclass
class _Node:
    name: str
    gpu: GpuModel
    free_gpus: int
    free_cpus: int
    free_mem_bytes: int
    # What the request offered at round start (the refill headroom's share per GPU).
    offered_gpus: int = 0
    offered_cpus: int = 0
    offered_mem_bytes: int = 0


@dataclass
class _Gpu:
    node: _Node
    usable_bytes: int
    slots: int
    members: list[JobDemand] = field(default_factory=list)
    fences: list[int] = field(default_factory=list)
    used_bytes: int = 0
    sm: float = 0.0
    bw: float = 0.0


def _order_key(job: JobDemand) -> tuple[float, float, int]:
    return (-job.priority, job.submit_time_s, job.job_id)


def _expand_nodes(request: PackingRequest) -> list[_Node]:
    nodes: list[_Node] = []
    for i, shape in enumerate(request.nodes):
        try:
            gpu = request.gpu_model(shape.gpu_model)
        except KeyError:
            raise BadInput(f"nodes[{i}].gpu_model: unknown GPU model {shape.gpu_model!r}") from None
        base = shape.name or f"{shape.gpu_model}-{shape.gpus}gpu-{i}"
        for k in range(shape.count):
            name = base if shape.count == 1 else f"{base}#{k}"
            nodes.append(_Node(name, gpu, shape.gpus, shape.cpus, shape.memory_bytes,
                               shape.gpus, shape.cpus, shape.memory_bytes))
    return nodes


def _too_big_reason(job: JobDemand, maxima: tuple[int, int, list[GpuModel]], limits: PackingLimits,
                    memory_aware: bool) -> str | None:
    """Why no free node could take this job even alone, or None."""
    max_cpus, max_mem, gpus = maxima
    if not gpus:
        return NO_FREE_GPU
    if job.cpus > max_cpus:
        return f"needs {job.cpus} CPUs; no free node has that many this round"
    if host_limit_bytes(job, limits) > max_mem:
        return f"needs {host_limit_bytes(job, limits) // MIB} MiB of host memory; no free node has that much this round"
    if memory_aware and all(member_fence_bytes(job, g, limits) > usable_gpu_bytes(g) for g in gpus):
        fence = min(member_fence_bytes(job, g, limits) for g in gpus)
        biggest = max(usable_gpu_bytes(g) for g in gpus)
        return (f"needs {math.ceil(fence / MIB)} MiB of GPU memory (estimate + margin + context); "
                f"the largest free GPU offers {biggest // MIB} MiB")
    return None


def _node_maxima(nodes: list[_Node]) -> tuple[int, int, list[GpuModel]]:
    """Largest free CPUs and host memory, and the GPU models, over `nodes` at round start."""
    models = {n.gpu.name: n.gpu for n in nodes}
    if not nodes:
        return 0, 0, []
    return (max(n.free_cpus for n in nodes), max(n.free_mem_bytes for n in nodes),
            [models[k] for k in sorted(models)])


def _is_permanent(reason: str) -> bool:
    """A "too big" reason about GPU memory: no GPU of the request's nodes can ever hold it
    (CPU and host memory reasons depend on what is free this round)."""
    return "largest free GPU" in reason


def _gpu_budget(request: PackingRequest, nodes: list[_Node]) -> int:
    total = sum(n.free_gpus for n in nodes)
    return total if request.max_gpus is None else max(0, min(total, request.max_gpus))


def _thread_pcts(sm: list[float]) -> list[int]:
    """MPS active-thread percentage per member.

    While the members' summed solo SM use fits the GPU, nobody is capped (a cap below a
    member's burst need would slow it). When it does not, each gets 1.5x its share of the
    demand, so one compute-heavy member cannot take every SM from the rest.
    """
    total = sum(sm)
    if total <= 1.0:
        return [100] * len(sm)
    return [min(100, max(10, math.ceil(150.0 * s / total))) for s in sm]


def _finish(policy: str, packs: list[list[_Gpu]], deferred: list[Deferred], limits: PackingLimits,
            params: InterferenceParams, fenced: bool, thread_caps: bool) -> PackingPlan:
    out: list[Pack] = []
    for gpus in packs:
        members: list[MemberPlacement] = []
        for gpu_index, g in enumerate(gpus):
            sm = [_frac(j.sm_util_pct) for j in g.members]
            bw = [_frac(j.membw_util_pct) for j in g.members]
            speeds = [1.0] if len(g.members) == 1 else predict_speeds_from_fractions(sm, bw, params)
            pcts = _thread_pcts(sm) if thread_caps else [100] * len(sm)
            whole_gpu_mib = usable_gpu_bytes(g.node.gpu) // MIB
            for j, fence, speed, pct in zip(g.members, g.fences, speeds, pcts, strict=True):
                members.append(MemberPlacement(
                    job_id=j.job_id, node_index=0, gpu_index=gpu_index, mps_thread_pct=pct,
                    gpu_mem_limit_mib=math.ceil(fence / MIB) if fenced else whole_gpu_mib,
                    host_mem_limit_bytes=host_limit_bytes(j, limits), cpus=j.cpus, predicted_speed=speed))
        node = gpus[0].node
        reserve_cpus = reserve_mem = 0
        if policy in REFILL_POLICIES and node.offered_gpus > 0:
            # Refill headroom: up to the pack's GPUs' share of what the node offered,
            # from what no member of this round took.
            share_cpus = node.offered_cpus * len(gpus) // node.offered_gpus
            share_mem = node.offered_mem_bytes * len(gpus) // node.offered_gpus
            reserve_cpus = max(0, min(node.free_cpus, share_cpus - sum(m.cpus for m in members)))
            reserve_mem = max(0, min(node.free_mem_bytes, share_mem - sum(m.host_mem_limit_bytes for m in members)))
            node.free_cpus -= reserve_cpus
            node.free_mem_bytes -= reserve_mem
        out.append(Pack(gpu_model=node.gpu.name, gpu_count=len(gpus), node_count=1, members=tuple(members),
                        node_name=node.name, mps=policy != "exclusive", reserve_cpus=reserve_cpus,
                        reserve_host_mem_bytes=reserve_mem))
    return PackingPlan(policy=policy, packs=tuple(out), deferred=tuple(sorted(deferred, key=lambda d: d.job_id)))


def _frac(pct: float) -> float:
    return min(max(pct / 100.0, 0.0), 1.0) if math.isfinite(pct) else 0.0


def _add(g: _Gpu, job: JobDemand, fence: int, limits: PackingLimits) -> None:
    g.members.append(job)
    g.fences.append(fence)
    g.used_bytes += fence
    g.sm += _frac(job.sm_util_pct)
    g.bw += _frac(job.membw_util_pct)
    g.node.free_cpus -= job.cpus
    g.node.free_mem_bytes -= host_limit_bytes(job, limits)


def _host_fits(node: _Node, job: JobDemand, limits: PackingLimits) -> bool:
    return job.cpus <= node.free_cpus and host_limit_bytes(job, limits) <= node.free_mem_bytes


def _open_gpu(node: _Node, slots: int) -> _Gpu:
    node.free_gpus -= 1
    return _Gpu(node=node, usable_bytes=usable_gpu_bytes(node.gpu), slots=slots)


def _held(blocked: list[JobDemand]) -> str | None:
    return f"holding room for job {blocked[0].job_id}, which waited longest" if blocked else None


def _defer_early(job: JobDemand, maxima: tuple[int, int, list[GpuModel]], limits: PackingLimits,
                 memory_aware: bool, blocked: list[JobDemand], deferred: list[Deferred]) -> bool:
    """Defer `job` if it cannot fit any free node now, or if room is held for an urgent
    job. An urgent job that does not fit *this round* holds the room for itself."""
    reason = _too_big_reason(job, maxima, limits, memory_aware)
    if reason:
        permanent = _is_permanent(reason)
        deferred.append(Deferred(job.job_id, reason, permanent=permanent))
        if not permanent:
            _block_if_urgent(blocked, job)
        return True
    held = _held(blocked)
    if held:
        deferred.append(Deferred(job.job_id, held))
        return True
    return False


def _block_if_urgent(blocked: list[JobDemand], job: JobDemand) -> None:
    if not blocked and job.priority >= URGENT_PRIORITY:
        blocked.append(job)


# ---------------------------------------------------------------- baselines

def _exclusive(request: PackingRequest, params: InterferenceParams) -> PackingPlan:
    limits = request.limits
    nodes = _expand_nodes(request)
    budget = _gpu_budget(request, nodes)
    maxima = _node_maxima([n for n in nodes if n.free_gpus > 0])
    packs: list[list[_Gpu]] = []
    deferred: list[Deferred] = []
    blocked: list[JobDemand] = []
    for job in sorted(request.jobs, key=_order_key):
        if _defer_early(job, maxima, limits, True, blocked, deferred):
            continue
        node = next((n for n in nodes if n.free_gpus > 0 and _host_fits(n, job, limits)
                     and member_fence_bytes(job, n.gpu, limits) <= usable_gpu_bytes(n.gpu)), None)
        if node is None or len(packs) >= budget:
            deferred.append(Deferred(job.job_id, NO_FREE_GPU))
            _block_if_urgent(blocked, job)
            continue
        g = _open_gpu(node, 1)
        _add(g, job, member_fence_bytes(job, node.gpu, limits), limits)
        packs.append([g])
    return _finish("exclusive", packs, deferred, limits, params, fenced=False, thread_caps=False)


def _first_fit(request: PackingRequest, params: InterferenceParams) -> PackingPlan:
    limits = request.limits
    nodes = _expand_nodes(request)
    budget = _gpu_budget(request, nodes)
    slots = max(1, min(limits.shards_per_gpu, limits.members_per_gpu))
    by_name = {n.name: n for n in nodes}
    # Busy GPUs with free shards come first, as Slurm would fill them.
    shared: list[tuple[str, _Gpu]] = []
    for og in request.open_gpus:
        if og.pack:
            continue  # our packs' GPUs are not shards
        node = by_name.get(og.node_name)
        if node is None:
            raise BadInput(f"open_gpus: node {og.node_name!r} is not among the request's nodes")
        g = _Gpu(node=node, usable_bytes=usable_gpu_bytes(node.gpu), slots=max(0, slots - og.members))
        shared.append((og.key, g))
    reachable = [n for n in nodes if n.free_gpus > 0 or any(g.node is n and g.slots > 0 for _, g in shared)]
    maxima = _node_maxima(reachable)
    open_gpus: list[_Gpu] = []
    # The GPUs with a free shard, in the order first-fit tries them (busy shared GPUs,
    # then the ones opened here); a GPU leaves when its shards are taken, so a plan does
    # not walk over full GPUs for every job (plan_scale.py).
    with_room = [g for _, g in shared if g.slots > 0]
    deferred: list[Deferred] = []
    blocked: list[JobDemand] = []
    for job in sorted(request.jobs, key=_order_key):
        if _defer_early(job, maxima, limits, False, blocked, deferred):
            continue
        target = next((g for g in with_room if _host_fits(g.node, job, limits)), None)
        if target is None and len(open_gpus) < budget:
            node = next((n for n in nodes if n.free_gpus > 0 and _host_fits(n, job, limits)), None)
            if node is not None:
                target = _open_gpu(node, slots)
                open_gpus.append(target)
                with_room.append(target)
        if target is None:
            deferred.append(Deferred(job.job_id, NO_FREE_GPU if len(open_gpus) < budget else NO_ROOM))
            _block_if_urgent(blocked, job)
            continue
        _add(target, job, member_fence_bytes(job, target.node.gpu, limits), limits)
        if len(target.members) >= target.slots:
            with_room = [g for g in with_room if g is not target]
    result = _finish("first-fit", [[g] for g in open_gpus], deferred, limits, params, fenced=False, thread_caps=False)
    joins = []
    for key, g in shared:
        whole_gpu_mib = usable_gpu_bytes(g.node.gpu) // MIB
        for j in g.members:
            joins.append(Join(key, MemberPlacement(
                job_id=j.job_id, node_index=0, gpu_index=0, mps_thread_pct=100, gpu_mem_limit_mib=whole_gpu_mib,
                host_mem_limit_bytes=host_limit_bytes(j, limits), cpus=j.cpus, predicted_speed=1.0)))
    return PackingPlan(result.policy, result.packs, result.deferred, tuple(joins))


def _mem_best_fit(request: PackingRequest, params: InterferenceParams) -> PackingPlan:
    limits = request.limits
    nodes = _expand_nodes(request)
    budget = _gpu_budget(request, nodes)
    maxima = _node_maxima([n for n in nodes if n.free_gpus > 0])
    slots = limits.members_per_gpu
    open_gpus: list[_Gpu] = []
    # Per GPU model, the open GPUs with a free slot as (free bytes, opening order), sorted:
    # the best fit is the first entry at or above the job's fence whose node has the
    # CPUs and host memory (a bisection, not a scan of every open GPU: plan_scale.py).
    by_free: dict[str, list[tuple[int, int]]] = {}
    deferred: list[Deferred] = []
    blocked: list[JobDemand] = []
    for job in sorted(request.jobs, key=_order_key):
        if _defer_early(job, maxima, limits, True, blocked, deferred):
            continue
        best: tuple[int, int] | None = None  # (bytes left after the job, opening order)
        for entries in by_free.values():
            if not entries:
                continue
            fence = member_fence_bytes(job, open_gpus[entries[0][1]].node.gpu, limits)
            for k in range(bisect.bisect_left(entries, (fence, -1)), len(entries)):
                free, index = entries[k]
                if _host_fits(open_gpus[index].node, job, limits):
                    if best is None or (free - fence, index) < best:
                        best = (free - fence, index)
                    break
        if best is None and len(open_gpus) < budget:
            node = next((n for n in nodes if n.free_gpus > 0 and _host_fits(n, job, limits)
                         and member_fence_bytes(job, n.gpu, limits) <= usable_gpu_bytes(n.gpu)), None)
            if node is not None:
                gpu = _open_gpu(node, slots)
                open_gpus.append(gpu)
                bisect.insort(by_free.setdefault(node.gpu.name, []), (gpu.usable_bytes, len(open_gpus) - 1))
                best = (0, len(open_gpus) - 1)
        if best is None:
            deferred.append(Deferred(job.job_id, NO_FREE_GPU if len(open_gpus) < budget else NO_ROOM))
            _block_if_urgent(blocked, job)
            continue
        index = best[1]
        g = open_gpus[index]
        entries = by_free[g.node.gpu.name]
        entries.remove((g.usable_bytes - g.used_bytes, index))
        _add(g, job, member_fence_bytes(job, g.node.gpu, limits), limits)
        if len(g.members) < g.slots:
            bisect.insort(entries, (g.usable_bytes - g.used_bytes, index))
    return _finish("mem-best-fit", [[g] for g in open_gpus], deferred, limits, params, fenced=True, thread_caps=False)


# ---------------------------------------------------------------- complementary (ours)

_WINDOW = 8  # candidates looked at per pick, in duration order (keeps plan() O(n))
_SKIP_LIMIT = 64  # candidates that did not fit before a pack is closed
_TOPUP_SCAN = 16
_SWAP_BUDGET = 2000  # model evaluations the swap pass may spend per plan
_EXACT_LOG_SPREAD = math.log(1.25)  # duration ratio to the GPU's first member for exact candidates
_EXACT_MAX = 12  # members + candidates up to which one GPU is solved by enumeration
_EXACT_BUDGET = 20000  # model evaluations the exact step may spend per plan
_DURATION_WEIGHT = 3.0  # weight of |ln(duration / seed duration)| against resource fill  # leftover candidates looked at per GPU in the top-up pass

# Per job, for one GPU model: (SM fraction, bandwidth fraction, fence bytes, CPUs, host bytes).
_Vec = tuple[float, float, int, int, int]


def _vectors(jobs: list[JobDemand], gpu: GpuModel, limits: PackingLimits) -> dict[int, _Vec]:
    return {j.job_id: (_frac(j.sm_util_pct), _frac(j.membw_util_pct), member_fence_bytes(j, gpu, limits),
                       j.cpus, host_limit_bytes(j, limits)) for j in jobs}


def _complementary(request: PackingRequest, params: InterferenceParams) -> PackingPlan:
    limits = request.limits
    nodes = _expand_nodes(request)
    budget = _gpu_budget(request, nodes)
    free_nodes = [n for n in nodes if n.free_gpus > 0]
    maxima = _node_maxima(free_nodes)
    deferred: list[Deferred] = []
    models = {n.gpu.name: n.gpu for n in free_nodes}

    # Seeds go in priority order, shortest expected run first within a priority: the
    # dispatcher's aging lifts long waiters into a higher priority band and, past the
    # wait bound, makes them urgent, so shortest-first cannot starve anyone.
    eligible: list[JobDemand] = []
    blocked: list[JobDemand] = []
    for job in sorted(request.jobs, key=_seed_key):
        if not _defer_early(job, maxima, limits, True, blocked, deferred):
            eligible.append(job)
    vecs = {name: _vectors(eligible, gpu, limits) for name, gpu in sorted(models.items())}

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

    packs: list[list[_Gpu]] = []
    left_budget = budget
    cursor = 0
    for node in sorted(free_nodes, key=lambda n: (-n.free_gpus, n.name)):
        vec = vecs[node.gpu.name]
        misses = 0
        probe = cursor
        while node.free_gpus > 0 and left_budget > 0:
            while cursor < len(eligible) and removed[cursor]:
                cursor += 1
            probe = max(probe, cursor)
            while probe < len(eligible) and removed[probe]:
                probe += 1
            if probe >= len(eligible):
                break
            seed = eligible[probe]
            g_max = min(node.free_gpus, limits.max_gpus_per_pack, left_budget)
            candidates = neighbours(probe, g_max * limits.members_per_gpu * 3)
            chunk = _pick_chunk(candidates, vec, node, g_max, limits)
            gpus, rejected = _balance(chunk, vec, node, g_max, limits) if chunk else ([], chunk)
            if not gpus or seed in rejected:
                # The seed does not fit what is left of this node: try a few later seeds
                # here, then the next node.
                for g in gpus:  # undo
                    for job in g.members:
                        node.free_cpus += vec[job.job_id][3]
                        node.free_mem_bytes += vec[job.job_id][4]
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
    for job in leftover:
        if held is not None and job is not held and job.priority < held.priority:
            deferred.append(Deferred(job.job_id, f"holding room for job {held.job_id}, which waited longest"))
        else:
            deferred.append(Deferred(job.job_id, NO_FREE_GPU if not packs and left_budget == 0 else NO_ROOM))
    return _finish("complementary", packs, deferred, limits, params, fenced=True, thread_caps=True)


def _top_up(packs: list[list[_Gpu]], leftover: list[JobDemand], vecs: dict[str, dict[int, _Vec]],
            limits: PackingLimits, params: InterferenceParams) -> list[JobDemand]:
    """Add leftover jobs (lightest first) to GPUs whose predicted summed speed grows by
    at least `min_gain` solo jobs. Returns the jobs still left over."""
    taken: set[int] = set()
    light = sorted(leftover, key=lambda j: (max(_frac(j.sm_util_pct), _frac(j.membw_util_pct)), _order_key(j)))
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
                s, b, fence, cpus, host = vec[job.job_id]
                if g.used_bytes + fence > g.usable_bytes or cpus > g.node.free_cpus or host > g.node.free_mem_bytes:
                    continue
                if _gain_if_added(g, s, b, params) < limits.min_gain:
                    break  # the lightest fitting job does not pay: heavier ones will not
                _add(g, job, fence, limits)
                taken.add(job.job_id)
    return [j for j in leftover if j.job_id not in taken]


def _duration_compatible(job: JobDemand, g: _Gpu) -> bool:
    """Whether `job` would end about when the GPU's first member does (a pack keeps its
    GPUs until its last member ends); unknown durations count as compatible."""
    if not g.members or job.est_duration_s is None or g.members[0].est_duration_s is None:
        return True
    return abs(_log_duration(job) - _log_duration(g.members[0])) <= _EXACT_LOG_SPREAD


def _exact_gpu(g: _Gpu, leftover: list[JobDemand], vec: dict[int, _Vec], limits: PackingLimits,
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
    fits_alone = [j for j in leftover if vec[j.job_id][2] <= g.usable_bytes and _duration_compatible(j, g)]
    cands = g.members + fits_alone
    if len(cands) > _EXACT_MAX or not fits_alone or budget[0] < (1 << len(cands)):
        return leftover
    n = len(cands)
    rows = [vec[j.job_id] for j in cands]
    fixed = sum(1 << k for k, j in enumerate(cands) if j.priority >= URGENT_PRIORITY)
    cpu_room = g.node.free_cpus + sum(vec[j.job_id][3] for j in g.members)
    host_room = g.node.free_mem_bytes + sum(vec[j.job_id][4] for j in g.members)
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
        g.node.free_cpus += vec[j.job_id][3]
        g.node.free_mem_bytes += vec[j.job_id][4]
    g.members, g.fences = [], []
    g.used_bytes, g.sm, g.bw = 0, 0.0, 0.0
    for j in chosen:
        _add(g, j, vec[j.job_id][2], limits)
    chosen_ids = {j.job_id for j in chosen}
    dropped = [j for j in cands if j.job_id not in chosen_ids]
    return [j for j in leftover if j.job_id not in chosen_ids] + [j for j in dropped if j not in leftover]


def _gpu_value(sm: list[float], bw: list[float], params: InterferenceParams) -> float:
    return sum(predict_speeds_from_fractions(sm, bw, params)) if len(sm) > 1 else float(len(sm))


def _polish(gpus: list[_Gpu], vec: dict[int, _Vec], params: InterferenceParams, budget: list[int]) -> None:
    """Moves and exchanges of members between the GPUs of one pack while they raise the
    pack's predicted summed speed (bounded by `budget[0]` model evaluations)."""
    for _sweep in range(3):
        best: tuple[float, int, int, int, int] | None = None  # (gain, a, i, b, j or -1)
        vals = [_gpu_value([vec[m.job_id][0] for m in g.members], [vec[m.job_id][1] for m in g.members], params)
                for g in gpus]
        for a, ga in enumerate(gpus):
            for b, gb in enumerate(gpus):
                if a == b:
                    continue
                for i, x in enumerate(ga.members):
                    vx = vec[x.job_id]
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
                            vy = vec[y.job_id]
                            if (ga.used_bytes - vx[2] + vy[2] > ga.usable_bytes
                                    or gb.used_bytes - vy[2] + vx[2] > gb.usable_bytes):
                                continue
                            new_a = rest_a + [y]
                            new_b = [m for k, m in enumerate(gb.members) if k != j] + [x]
                        budget[0] -= 1
                        gain = (_gpu_value([vec[m.job_id][0] for m in new_a], [vec[m.job_id][1] for m in new_a], params)
                                + _gpu_value([vec[m.job_id][0] for m in new_b], [vec[m.job_id][1] for m in new_b], params)
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
            g.sm = sum(vec[m.job_id][0] for m in g.members)
            g.bw = sum(vec[m.job_id][1] for m in g.members)


def _swap_pass(packs: list[list[_Gpu]], leftover: list[JobDemand], vecs: dict[str, dict[int, _Vec]],
               limits: PackingLimits, params: InterferenceParams) -> list[JobDemand]:
    """Local search: swap a member for a leftover job when that raises the GPU's predicted
    summed speed (memory knapsacks the greedy fill got wrong). Bounded effort
    (`_SWAP_BUDGET` model evaluations), so it refines small plans and costs large ones
    little. Returns the leftovers after swapping."""
    budget = _SWAP_BUDGET
    pool = sorted(leftover, key=_order_key)[:_TOPUP_SCAN]
    rest = [j for j in leftover if j not in pool]
    for gpus in packs:
        for g in gpus:
            vec = vecs[g.node.gpu.name]
            sm = [_frac(j.sm_util_pct) for j in g.members]
            bw = [_frac(j.membw_util_pct) for j in g.members]
            current = sum(predict_speeds_from_fractions(sm, bw, params)) if len(sm) > 1 else float(len(sm))
            for ci in range(len(pool)):
                cand = pool[ci]
                if not _duration_compatible(cand, g):
                    continue
                cs, cb, cfence, ccpus, chost = vec[cand.job_id]
                best: tuple[float, int] | None = None
                for mi, member in enumerate(g.members):
                    if budget <= 0:
                        return pool + rest
                    ms, mb, mfence, mcpus, mhost = vec[member.job_id]
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
                ms, mb, mfence, mcpus, mhost = vec[out.job_id]
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
                ms, mb, mfence, mcpus, mhost = vec[member.job_id]
                for a in range(len(pool)):
                    if not _duration_compatible(pool[a], g):
                        continue
                    for c in range(a + 1, len(pool)):
                        if budget <= 0:
                            break
                        if not _duration_compatible(pool[c], g):
                            continue
                        va, vc = vec[pool[a].job_id], vec[pool[c].job_id]
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
                ms, mb, mfence, mcpus, mhost = vec[out.job_id]
                del g.members[mi], g.fences[mi], sm[mi], bw[mi]
                g.used_bytes -= mfence
                g.sm -= ms
                g.bw -= mb
                g.node.free_cpus += mcpus
                g.node.free_mem_bytes += mhost
                for job in (pool[a], pool[c]):
                    v = vec[job.job_id]
                    _add(g, job, v[2], limits)
                    sm.append(v[0])
                    bw.append(v[1])
                current = value
                pool = [j for k, j in enumerate(pool) if k not in (a, c)] + [out]
    return pool + rest


def _seed_key(job: JobDemand) -> tuple[float, float, float, int]:
    return (-job.priority, job.est_duration_s if job.est_duration_s is not None else 0.0, job.submit_time_s, job.job_id)


def _join_key(job: JobDemand) -> tuple[float, bool, float, float, int]:
    # As `_seed_key`, but a job of unknown length goes after the known ones of its band:
    # a time-limited pack refuses such a joiner (`_times_fit`), and a front of them
    # would use up every pack GPU's scan.
    d = job.est_duration_s
    return (-job.priority, d is None, d or 0.0, job.submit_time_s, job.job_id)


def _log_duration(job: JobDemand) -> float:
    d = job.est_duration_s
    return math.log(d) if d is not None and d > 0 else 0.0


def _pick_chunk(candidates: list[JobDemand], vec: dict[int, _Vec], node: _Node, g_max: int,
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
        s, b, fence, cpus, host = vec[job.job_id]
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


def _balance(chunk: list[JobDemand], vec: dict[int, _Vec], node: _Node, g_max: int,
             limits: PackingLimits) -> tuple[list[_Gpu], list[JobDemand]]:
    """Spread `chunk` over as few GPUs as it needs (<= g_max), balancing predicted load
    (inter-GPU): heaviest first, each onto the GPU whose busier resource stays lowest."""
    usable = usable_gpu_bytes(node.gpu)
    need_sm = sum(vec[j.job_id][0] for j in chunk)
    need_bw = sum(vec[j.job_id][1] for j in chunk)
    need_mem = sum(vec[j.job_id][2] for j in chunk)
    g = max(1, math.ceil(max(need_sm / limits.target_load, need_bw / limits.target_load, need_mem / usable,
                             len(chunk) / limits.members_per_gpu) - 1e-9))
    g = min(g, g_max)
    # The seed first (the pack exists for it), then heaviest first.
    by_load = chunk[:1] + sorted(chunk[1:], key=lambda j: (-max(vec[j.job_id][0], vec[j.job_id][1]),
                                                           -vec[j.job_id][2], j.job_id))
    by_mem = chunk[:1] + sorted(chunk[1:], key=lambda j: (-vec[j.job_id][2], j.job_id))

    def assign(order: list[JobDemand], count: int, memory_first: bool) -> tuple[list[_Gpu], list[JobDemand]]:
        gpus = [_Gpu(node=node, usable_bytes=usable, slots=limits.members_per_gpu) for _ in range(count)]
        rejected: list[JobDemand] = []
        for job in order:
            s, b, fence, _cpus, _host = vec[job.job_id]
            best: _Gpu | None = None
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
            node.free_cpus -= vec[job.job_id][3]
            node.free_mem_bytes -= vec[job.job_id][4]
    return gpus, rejected


def _gain_if_added(g: _Gpu, s: float, b: float, params: InterferenceParams) -> float:
    """Predicted change of the GPU's summed relative speed if a member (s, b) joins."""
    sm = [_frac(j.sm_util_pct) for j in g.members]
    bw = [_frac(j.membw_util_pct) for j in g.members]
    before = sum(predict_speeds_from_fractions(sm, bw, params)) if len(sm) > 1 else float(len(sm))
    return sum(predict_speeds_from_fractions(sm + [s], bw + [b], params)) - before


# ---------------------------------------------------------------- refill (joins onto running packs)

_JOIN_SCAN = 24  # pending jobs looked at per pick for one pack GPU (complementary)


@dataclass
class _PackGpu:
    """A pack GPU (`OpenGpu` with `pack=True`) during a refill pass."""

    key: str
    gpu: GpuModel
    node: _Node  # shared by the GPUs of one pack node: the allocation's free CPUs and host memory
    live: list[JobDemand]
    joined: list[JobDemand]
    used_bytes: int
    slots: int  # members that may still be added (client and member limits, counting live ones)
    remaining_s: float | None

    @property
    def members(self) -> list[JobDemand]:
        return self.live + self.joined


def _pack_gpus(request: PackingRequest) -> list[_PackGpu]:
    """The request's pack GPUs, in key order. GPUs whose keys agree up to the last ':'
    (the service's f"{pack_id}:{node_index}:{gpu_index}") share one node's free CPUs and
    host memory. A pack GPU without `free_cpus` / `free_host_mem_bytes` takes no joins."""
    limits = request.limits
    out: list[_PackGpu] = []
    nodes: dict[str, _Node] = {}
    for og in sorted((o for o in request.open_gpus if o.pack), key=lambda o: o.key):
        try:
            gpu = request.gpu_model(og.gpu_model)
        except KeyError:
            raise BadInput(f"open_gpus[{og.key!r}].gpu_model: unknown GPU model {og.gpu_model!r}") from None
        if og.free_cpus is None or og.free_host_mem_bytes is None:
            continue
        group = og.key.rsplit(":", 1)[0] if og.key.count(":") >= 2 else og.key
        node = nodes.setdefault(group, _Node(og.node_name, gpu, 0, og.free_cpus, og.free_host_mem_bytes))
        used = sum(member_fence_bytes(j, gpu, limits) for j in og.live)
        running = max(og.members, len(og.live))
        out.append(_PackGpu(og.key, gpu, node, list(og.live), [], used,
                            max(0, limits.members_per_gpu - running), og.remaining_s))
    return out


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
    return predict_speeds_from_fractions([_frac(j.sm_util_pct) for j in members],
                                         [_frac(j.membw_util_pct) for j in members], params)


def _join_fits(pg: _PackGpu, job: JobDemand, limits: PackingLimits) -> bool:
    """Memory (live members' fences count), client slots, the allocation's free CPUs and
    host memory on that node."""
    return (len(pg.joined) < pg.slots
            and pg.used_bytes + member_fence_bytes(job, pg.gpu, limits) <= usable_gpu_bytes(pg.gpu)
            and _host_fits(pg.node, job, limits))


def _times_fit(pg: _PackGpu, members: list[JobDemand], speeds: list[float]) -> bool:
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


def _refill(request: PackingRequest, policy: str, params: InterferenceParams) -> tuple[list[Join], list[JobDemand]]:
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
    pgs = _pack_gpus(request)
    # complementary takes joiners in its seeds' order (priority band, then shortest
    # expected run first: aging keeps long jobs from starving), mem-best-fit first come,
    # first served.
    queue = sorted(request.jobs, key=_join_key if policy == "complementary" else _order_key)
    if not pgs or not queue:
        return [], queue
    # An urgent job that cannot join holds the room (docs/packing.md, aging): nothing of
    # lower priority joins, so no join keeps a pack alive that the urgent job waits for.
    held: list[JobDemand] = []

    def held_back(job: JobDemand) -> bool:
        return bool(held) and job.priority < held[0].priority

    placed: set[int] = set()
    if policy == "mem-best-fit":
        for job in queue:
            if held_back(job):
                break
            best: _PackGpu | None = None
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
                _join(best, job, limits)
                placed.add(job.job_id)
            elif job.priority >= URGENT_PRIORITY:
                held.append(job)
    else:
        # Urgent jobs first, each onto the pack GPU where it adds most.
        for job in queue:
            if job.priority < URGENT_PRIORITY:
                break
            best_gpu: _PackGpu | None = None
            best_gain = -math.inf
            for pg in pgs:
                if not _join_fits(pg, job, limits):
                    continue
                members = pg.members + [job]
                speeds = _join_speeds(members, params)
                gain = sum(speeds) - (sum(_join_speeds(pg.members, params)) if pg.members else 0.0)
                if gain > best_gain + 1e-12 and _times_fit(pg, members, speeds):
                    best_gpu, best_gain = pg, gain
            if best_gpu is None:
                held.append(job)
                break
            _join(best_gpu, job, limits)
            placed.add(job.job_id)
        if not held:
            _fill_by_gain(pgs, queue, placed, limits, params)
    joins: list[Join] = []
    for pg in pgs:
        members = pg.members
        speeds = _join_speeds(members, params) if members else []
        pcts = _thread_pcts([_frac(j.sm_util_pct) for j in members]) if policy == "complementary" else [100] * len(members)
        node_index, gpu_index = _key_indices(pg.key)
        for j, speed, pct in zip(members, speeds, pcts, strict=True):
            if j in pg.joined:
                joins.append(Join(pg.key, MemberPlacement(
                    job_id=j.job_id, node_index=node_index, gpu_index=gpu_index, mps_thread_pct=pct,
                    gpu_mem_limit_mib=math.ceil(member_fence_bytes(j, pg.gpu, limits) / MIB),
                    host_mem_limit_bytes=host_limit_bytes(j, limits), cpus=j.cpus,
                    predicted_speed=speed)))
    return joins, [j for j in queue if j.job_id not in placed]


def _fill_by_gain(pgs: list[_PackGpu], queue: list[JobDemand], placed: set[int], limits: PackingLimits,
                  params: InterferenceParams) -> None:
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
    sm = [_frac(j.sm_util_pct) for j in rest]
    bw = [_frac(j.membw_util_pct) for j in rest]

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

    for pg in pgs:
        if pg.gpu.name not in fences:
            f = [member_fence_bytes(j, pg.gpu, limits) for j in rest]
            fences[pg.gpu.name] = (f, suffix_min(f))
        fence, min_fence = fences[pg.gpu.name]
        usable = usable_gpu_bytes(pg.gpu)
        node = pg.node
        while len(pg.joined) < pg.slots:
            free_mem, free_cpus, free_host = usable - pg.used_bytes, node.free_cpus, node.free_mem_bytes
            live_sm = [_frac(j.sm_util_pct) for j in pg.members]
            live_bw = [_frac(j.membw_util_pct) for j in pg.members]
            current = sum(predict_speeds_from_fractions(live_sm, live_bw, params)) if len(live_sm) > 1 else len(live_sm)
            pick = -1
            pick_gain = limits.min_gain - 1e-12
            scanned = 0
            i = untaken(0)
            while i < n:
                if min_fence[i] > free_mem or min_cpus[i] > free_cpus or min_host[i] > free_host:
                    break  # nothing from here on fits
                if fence[i] > free_mem or cpus[i] > free_cpus or host[i] > free_host:
                    i = untaken(i + 1)
                    continue
                scanned += 1
                speeds = (predict_speeds_from_fractions(live_sm + [sm[i]], live_bw + [bw[i]], params)
                          if live_sm else [1.0])
                gain = sum(speeds) - current
                if gain > pick_gain and (pg.remaining_s is None or _times_fit(pg, pg.members + [rest[i]], speeds)):
                    pick, pick_gain = i, gain
                if scanned >= _JOIN_SCAN:
                    break
                i = untaken(i + 1)
            if pick < 0:
                break
            _join(pg, rest[pick], limits)
            skip[pick] = pick + 1
            placed.add(rest[pick].job_id)


def _join(pg: _PackGpu, job: JobDemand, limits: PackingLimits) -> None:
    pg.joined.append(job)
    pg.used_bytes += member_fence_bytes(job, pg.gpu, limits)
    pg.node.free_cpus -= job.cpus
    pg.node.free_mem_bytes -= host_limit_bytes(job, limits)


# ---------------------------------------------------------------- entry point

_POLICIES: dict[str, Callable[[PackingRequest, InterferenceParams], PackingPlan]] = {
    "exclusive": _exclusive,
    "first-fit": _first_fit,
    "mem-best-fit": _mem_best_fit,
    "complementary": _complementary,
}


def plan(request: PackingRequest, policy: str = "complementary", params: InterferenceParams | None = None) -> PackingPlan:
    """Decide which pending jobs share which GPUs this round (pure, deterministic)."""
    fn = _POLICIES.get(policy)
    if fn is None:
        raise BadInput(f"policy: unknown policy {policy!r} (one of {', '.join(POLICY_NAMES)})")
    ids = [j.job_id for j in request.jobs]
    if len(set(ids)) != len(ids):
        raise BadInput("jobs: job ids must be unique")
    params = params or DEFAULT_PARAMS
    if policy not in REFILL_POLICIES or not any(o.pack for o in request.open_gpus):
        return fn(request, params)
    # Refill first (docs/packing.md "Refilling running packs"); the rest of the queue goes
    # to the policy as usual, which sees no pack GPU. `exclusive` never joins.
    joins, rest = _refill(request, policy, params)
    rest_request = replace(request, jobs=tuple(rest), open_gpus=tuple(o for o in request.open_gpus if not o.pack))
    result = fn(rest_request, params)
    return PackingPlan(result.policy, result.packs, result.deferred, tuple(joins) + result.joins)
