"""The machinery every packing policy shares: the round's nodes and GPUs as the policies
fill them (`Node`, `Gpu`), the fit checks (host room, the early deferrals, the urgent
block), and `finish_plan`, which turns filled GPUs into the plan's packs (thread
shares, memory limits, CPUs and the refill headroom).

The policies themselves live one per module (`exclusive`, `first_fit`, `mem_best_fit`,
`complementary`), refill in `refill`; `slurm_dlrm.packing.policies.plan` is the entry
point. Pure: no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from slurm_dlrm.errors import BadInput
from slurm_dlrm.packing.interference import (
    InterferenceParams,
    predict_speeds_from_fractions,
    util_fraction,
)
from slurm_dlrm.packing.model import (
    Deferred,
    JobDemand,
    MemberPlacement,
    Pack,
    PackingLimits,
    PackingPlan,
    PackingRequest,
    host_limit_bytes,
    member_fence_bytes,
    rank_members,
    usable_gpu_bytes,
)
from slurm_dlrm.site import MIB, GpuModel

POLICY_NAMES = ("exclusive", "first-fit", "mem-best-fit", "complementary")
# Policies that refill running packs (OpenGpu.pack) and give packs refill headroom.
REFILL_POLICIES = ("mem-best-fit", "complementary", "exact")
# `exact` (issue 50): complementary's plan, then the round solved by CP-SAT
# (slurm_dlrm.packing.exact); not among POLICY_NAMES, the four every benchmark compares.
EXACT_POLICY = "exact"
# A priority at or above this marks a job that waited past the age bound: nothing of
# lower priority is admitted ahead of it (see slurm_dlrm.packing.dispatch).
URGENT_PRIORITY = 1e15  # above any nice (|nice| < 2^31) and the overdue band (fairness.py)

# The overdue band of the slowdown bound (slurm_dlrm.packing.fairness): above any base
# priority a nice value gives (|nice| < 2^31), below the urgent band.
OVERDUE_PRIORITY = 1e12


def is_overdue_priority(priority: float) -> bool:
    """In the overdue band (the band's base priorities spread it by +-2^31)."""
    return OVERDUE_PRIORITY / 2 <= priority < URGENT_PRIORITY

NO_FREE_GPU = "no free GPU this round"
NO_ROOM = "no room left this round"


# ---------------------------------------------------------------- shared plumbing

@dataclass
class Node:
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
class Gpu:
    node: Node
    usable_bytes: int
    slots: int
    members: list[JobDemand] = field(default_factory=list)
    fences: list[int] = field(default_factory=list)
    used_bytes: int = 0
    sm: float = 0.0
    bw: float = 0.0


def order_key(job: JobDemand) -> tuple[float, float, int]:
    return (-job.priority, job.submit_time_s, job.job_id)


def expand_nodes(request: PackingRequest) -> list[Node]:
    nodes: list[Node] = []
    for i, shape in enumerate(request.nodes):
        try:
            gpu = request.gpu_model(shape.gpu_model)
        except KeyError:
            raise BadInput(f"nodes[{i}].gpu_model: unknown GPU model {shape.gpu_model!r}") from None
        base = shape.name or f"{shape.gpu_model}-{shape.gpus}gpu-{i}"
        for k in range(shape.count):
            name = base if shape.count == 1 else f"{base}#{k}"
            nodes.append(Node(name, gpu, shape.gpus, shape.cpus, shape.memory_bytes,
                               shape.gpus, shape.cpus, shape.memory_bytes))
    return nodes


def too_big_reason(job: JobDemand, maxima: tuple[int, int, list[GpuModel]], limits: PackingLimits,
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


def node_maxima(nodes: list[Node]) -> tuple[int, int, list[GpuModel]]:
    """Largest free CPUs and host memory, and the GPU models, over `nodes` at round start."""
    models = {n.gpu.name: n.gpu for n in nodes}
    if not nodes:
        return 0, 0, []
    return (max(n.free_cpus for n in nodes), max(n.free_mem_bytes for n in nodes),
            [models[k] for k in sorted(models)])


def is_permanent(reason: str) -> bool:
    """A "too big" reason about GPU memory: no GPU of the request's nodes can ever hold it
    (CPU and host memory reasons depend on what is free this round)."""
    return "largest free GPU" in reason


def gpu_budget(request: PackingRequest, nodes: list[Node]) -> int:
    total = sum(n.free_gpus for n in nodes)
    return total if request.max_gpus is None else max(0, min(total, request.max_gpus))


def thread_pcts(sm: list[float]) -> list[int]:
    """MPS active-thread percentage per member.

    While the members' summed solo SM use fits the GPU, nobody is capped (a cap below a
    member's burst need would slow it). When it does not, each gets 1.5x its share of the
    demand, so one compute-heavy member cannot take every SM from the rest.
    """
    total = sum(sm)
    if total <= 1.0:
        return [100] * len(sm)
    return [min(100, max(10, math.ceil(150.0 * s / total))) for s in sm]


def finish_plan(policy: str, packs: list[list[Gpu]], deferred: list[Deferred], limits: PackingLimits,
            params: InterferenceParams, fenced: bool, thread_caps: bool) -> PackingPlan:
    out: list[Pack] = []
    for gpus in packs:
        members: list[MemberPlacement] = []
        for gpu_index, g in enumerate(gpus):
            sm = [util_fraction(j.sm_util_pct) for j in g.members]
            bw = [util_fraction(j.membw_util_pct) for j in g.members]
            speeds = [1.0] if len(g.members) == 1 else predict_speeds_from_fractions(sm, bw, params)
            pcts = thread_pcts(sm) if thread_caps else [100] * len(sm)
            whole_gpu_mib = usable_gpu_bytes(g.node.gpu) // MIB
            for j, fence, speed, pct in zip(g.members, g.fences, speeds, pcts, strict=True):
                members.append(MemberPlacement(
                    job_id=j.job_id, node_index=0, gpu_index=gpu_index, mps_thread_pct=pct,
                    gpu_mem_limit_mib=math.ceil(fence / MIB) if fenced else whole_gpu_mib,
                    host_mem_limit_bytes=host_limit_bytes(j, limits), cpus=j.cpus, predicted_speed=speed,
                    rank=j.rank, world_size=j.world_size))
        node = gpus[0].node
        reserve_cpus = reserve_mem = 0
        if policy in REFILL_POLICIES and node.offered_gpus > 0:
            # Refill headroom: up to the pack's GPUs' share of what the node offered,
            # from what no member of this round took.
            share_cpus = node.offered_cpus * len(gpus) // node.offered_gpus
            share_mem = node.offered_mem_bytes * len(gpus) // node.offered_gpus
            used_cpus = sum(m.cpus for m in members)
            used_mem = sum(m.host_mem_limit_bytes for m in members)
            # ... and at most `refill_headroom_pct` of the members' own (a bounded reserve:
            # issue 24; holding room for the jobs left waiting as well was measured: no
            # throughput gained, longer JCTs, more memory held).
            if limits.refill_headroom_pct is None:  # the whole share (a node nothing else uses)
                want_cpus, want_mem = share_cpus, share_mem
            else:
                want_cpus = math.ceil(used_cpus * limits.refill_headroom_pct / 100.0)
                want_mem = math.ceil(used_mem * limits.refill_headroom_pct / 100.0)
            reserve_cpus = max(0, min(node.free_cpus, share_cpus - used_cpus, want_cpus))
            reserve_mem = max(0, min(node.free_mem_bytes, share_mem - used_mem, want_mem))
            node.free_cpus -= reserve_cpus
            node.free_mem_bytes -= reserve_mem
        out.append(Pack(gpu_model=node.gpu.name, gpu_count=len(gpus), node_count=1, members=tuple(members),
                        node_name=node.name, mps=policy != "exclusive", reserve_cpus=reserve_cpus,
                        reserve_host_mem_bytes=reserve_mem))
    return PackingPlan(policy=policy, packs=tuple(out), deferred=tuple(sorted(deferred, key=lambda d: d.job_id)))



def add_member(g: Gpu, job: JobDemand, fence: int, limits: PackingLimits) -> None:
    g.members.append(job)
    g.fences.append(fence)
    g.used_bytes += fence
    g.sm += util_fraction(job.sm_util_pct)
    g.bw += util_fraction(job.membw_util_pct)
    g.node.free_cpus -= job.cpus
    g.node.free_mem_bytes -= host_limit_bytes(job, limits)


def host_fits(node: Node, job: JobDemand, limits: PackingLimits) -> bool:
    return job.cpus <= node.free_cpus and host_limit_bytes(job, limits) <= node.free_mem_bytes


def open_gpu(node: Node, slots: int) -> Gpu:
    node.free_gpus -= 1
    return Gpu(node=node, usable_bytes=usable_gpu_bytes(node.gpu), slots=slots)


def held_reason(blocked: list[JobDemand]) -> str | None:
    return f"holding room for job {blocked[0].job_id}, which waited longest" if blocked else None


def defer_early(job: JobDemand, maxima: tuple[int, int, list[GpuModel]], limits: PackingLimits,
                 memory_aware: bool, blocked: list[JobDemand], deferred: list[Deferred]) -> bool:
    """Defer `job` if it cannot fit any free node now, or if room is held for an urgent
    job. An urgent job that does not fit *this round* holds the room for itself."""
    return _defer(job, too_big_reason(job, maxima, limits, memory_aware), blocked, deferred)


def _defer(job: JobDemand, reason: str | None, blocked: list[JobDemand], deferred: list[Deferred]) -> bool:
    """Defer `job` for `reason` (a job that does not fit), else for room held for an
    urgent job; True if deferred."""
    if reason:
        permanent = is_permanent(reason)
        deferred.append(Deferred(job.job_id, reason, permanent=permanent))
        if not permanent:
            block_if_urgent(blocked, job)
        return True
    held = held_reason(blocked)
    if held:
        deferred.append(Deferred(job.job_id, held))
        return True
    return False


def defer_gang_early(job: JobDemand, nodes: list[Node], limits: PackingLimits, memory_aware: bool,
                     blocked: list[JobDemand], deferred: list[Deferred],
                     shared_gpus: dict[str, int] | None = None) -> bool:
    """`defer_early` for a multi-GPU job: every rank must fit a GPU of its own, and one
    free node must offer `world_size` GPUs and the ranks' CPUs and host memory together.
    `shared_gpus`: busy GPUs with a free shard per node name (first-fit), which count."""
    ranks = rank_members(job)
    extra = shared_gpus or {}

    def offered(n: Node) -> int:
        return n.free_gpus + extra.get(n.name, 0)

    free = [n for n in nodes if offered(n) > 0]
    maxima = node_maxima(free)
    reason = next((r for r in (too_big_reason(m, maxima, limits, memory_aware) for m in ranks) if r), None)
    if reason is None:
        need_cpus = sum(m.cpus for m in ranks)
        need_host = sum(host_limit_bytes(m, limits) for m in ranks)
        if not any(offered(n) >= job.world_size for n in free):
            reason = f"needs {job.world_size} GPUs of one node (world_size); no free node has that many this round"
        elif not any(offered(n) >= job.world_size and n.free_cpus >= need_cpus and n.free_mem_bytes >= need_host
                     for n in free):
            reason = (f"needs {need_cpus} CPUs and {need_host // MIB} MiB of host memory on one node for its "
                      f"{job.world_size} ranks; no free node has that much this round")
    return _defer(job, reason, blocked, deferred)


def gang_host_fits(node: Node, ranks: tuple[JobDemand, ...], limits: PackingLimits) -> bool:
    return (sum(m.cpus for m in ranks) <= node.free_cpus
            and sum(host_limit_bytes(m, limits) for m in ranks) <= node.free_mem_bytes)


def fenced_node(nodes: list[Node], job: JobDemand, limits: PackingLimits) -> Node | None:
    """The first node with a free GPU, the CPUs and host memory for `job`, and a GPU that
    holds its fence (the fenced baselines' fresh GPU)."""
    return next((n for n in nodes if n.free_gpus > 0 and host_fits(n, job, limits)
                 and member_fence_bytes(job, n.gpu, limits) <= usable_gpu_bytes(n.gpu)), None)


def fenced_gang_node(nodes: list[Node], job: JobDemand, ranks: tuple[JobDemand, ...],
                     limits: PackingLimits) -> Node | None:
    """The first node with `world_size` free GPUs, the CPUs and host memory for every
    rank, and a GPU that holds each rank's fence."""
    return next((n for n in nodes if n.free_gpus >= job.world_size and gang_host_fits(n, ranks, limits)
                 and all(member_fence_bytes(m, n.gpu, limits) <= usable_gpu_bytes(n.gpu) for m in ranks)), None)


def rank_load(m: JobDemand) -> tuple[float, int]:
    """Heaviest first: the busier of SM and bandwidth, then memory."""
    return (-max(util_fraction(m.sm_util_pct), util_fraction(m.membw_util_pct)), -m.gpu_mem_bytes)


def block_if_urgent(blocked: list[JobDemand], job: JobDemand) -> None:
    if not blocked and job.priority >= URGENT_PRIORITY:
        blocked.append(job)


def drain_tail(request: PackingRequest, factor: float = 1.0) -> frozenset[int]:
    """Jobs that would end after the backlog is cleared if they started late: expected
    run >= `factor` x the time the pending and running work needs on the request's GPUs
    (memory-time over GPU memory, the resource that binds DLRM packing). Starting them
    first (longest first) shortens the drain at the end of a backlog, when GPUs run a
    few long members at low fill (docs/packing.md "Drain"). Empty while the backlog is
    long: then no job is that long."""
    models = request.gpu_models
    if not request.jobs or not models:
        return frozenset()
    gpu = max(models, key=lambda g: g.memory_bytes)
    usable = usable_gpu_bytes(gpu)
    limits = request.limits
    gpus = sum(n.gpus * n.count for n in request.nodes if n.gpu_model == gpu.name)
    work = 0.0
    for og in request.open_gpus:
        if og.pack:
            gpus += 1
            work += sum((j.est_duration_s or 0.0) * member_fence_bytes(j, gpu, limits) / usable for j in og.live)
    if gpus <= 0:
        return frozenset()
    known = [j for j in request.jobs if j.est_duration_s is not None]
    work += sum((j.est_duration_s or 0.0) * member_fence_bytes(j, gpu, limits) / usable for j in known)
    clear_s = work / gpus
    return frozenset(j.job_id for j in known if (j.est_duration_s or 0.0) >= factor * clear_s)



def tail_first(job: JobDemand, tail: frozenset[int], key: tuple[object, ...]) -> tuple[object, ...]:
    """Sort key: within its priority, a drain-tail job (`drain_tail`) first, longest
    first; the others by `key` (which starts with -priority)."""
    if job.job_id in tail:
        return (-job.priority, 0, -(job.est_duration_s or 0.0), job.job_id)
    return (-job.priority, 1, *key[1:])
