"""The slowdown bound (issue 31): no job waits without bound relative to its own run
time, and a multi-GPU job gets a reservation instead of waiting for W GPUs to come
free together by chance. Pure: no I/O.

- A job's *slowdown if it started now* is (wait + expected run) / expected run (the
  wait counts from `JobDemand.eligible_s`, its --begin, else its submission). Past
  `FairConfig.overdue_slowdown` (and `min_wait_s`) it is overdue: its priority is lifted
  into the overdue band, above every job that is not overdue, with its user's order
  kept (the base priority, from --nice, still counts first) and the most overdue first
  (highest response ratio next). Below the band nothing changes: the policies keep
  their own order (complementary: drain tail, then shortest first). The band is at 100
  by default (issue 40): a backstop against starvation; at 10 it reordered most of a
  backlog and cost the one-GPU mixes 7-10% of their throughput (docs/packing.md "Fair by
  default"). A gang past its reservation point (below) is in the band too
  (`FairConfig.gang_in_band`), so the most overdue gang leads and keeps its GPUs.
- A multi-GPU job past `gang_reserve_slowdown` that no node can take now and no pack
  can take as a join gets a *reservation* on the node where W GPUs free up soonest:
  that node's free GPUs, plus the running packs on it that end first (a pack gives its
  GPUs back only when its last member ends). Those packs take only joiners expected to
  end before the reservation's time (EASY backfill: their `remaining_s` is capped at it),
  and the node's free GPUs only new packs of jobs that do. The rest of the cluster
  carries on as usual: only as much drains as the gang needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from slurm_dlrm.packing.common import OVERDUE_PRIORITY, URGENT_PRIORITY, drain_tail
from slurm_dlrm.packing.model import FairConfig, JobDemand, OpenGpu, PackingRequest

assert OVERDUE_PRIORITY * 100 <= URGENT_PRIORITY
TAIL_FACTOR = 0.25  # as refill's and complementary's `_TAIL_FACTOR`


def wait_s(job: JobDemand, now_s: float) -> float:
    start = job.submit_time_s if job.eligible_s is None else max(job.submit_time_s, job.eligible_s)
    return max(0.0, now_s - start)


def expected_run_s(job: JobDemand, cfg: FairConfig) -> float:
    d = job.est_duration_s
    return d if d is not None and d > 0 else cfg.unknown_duration_s


def slowdown_now(job: JobDemand, now_s: float, cfg: FairConfig) -> float:
    """(wait + expected run) / expected run: the job's slowdown if it started now and ran alone."""
    run = expected_run_s(job, cfg)
    return (wait_s(job, now_s) + run) / run


def is_overdue(job: JobDemand, now_s: float, cfg: FairConfig, bound: float | None = None) -> bool:
    return (wait_s(job, now_s) >= cfg.min_wait_s
            and slowdown_now(job, now_s, cfg) >= (cfg.overdue_slowdown if bound is None else bound))


def gang_reserve_bound(jobs: tuple[JobDemand, ...], now_s: float, cfg: FairConfig) -> float:
    """The slowdown past which a waiting gang gets a reservation: `gang_reserve_slowdown`,
    or `gang_vs_single` (3) x the median slowdown-so-far of the waiting single-GPU jobs if
    higher (a gang then ends, relative to its run, about as late as a typical one-GPU job
    does: a waiting job's slowdown so far is well below its final one; reserving sooner
    takes GPUs for it ahead of jobs that waited relatively longer, docs/packing.md)."""
    singles = sorted(slowdown_now(j, now_s, cfg) for j in jobs if not j.is_gang)
    median = singles[len(singles) // 2] if singles else 0.0
    return max(cfg.gang_reserve_slowdown, cfg.gang_vs_single * median)


def fair_priority(job: JobDemand, now_s: float, cfg: FairConfig, gang_bound: float | None = None) -> float:
    """The job's priority under the bound: its own (base) priority, lifted into the
    overdue band once overdue (a gang also past `gang_bound`, its reservation point,
    with `cfg.gang_in_band`); within the band the base priority first, then the
    slowdown (a fraction below 1, so one nice step outweighs any slowdown)."""
    if job.priority >= URGENT_PRIORITY:
        return job.priority
    gang_due = (cfg.gang_in_band and gang_bound is not None and job.is_gang
                and is_overdue(job, now_s, cfg, min(gang_bound, cfg.overdue_slowdown)))
    if not gang_due and not is_overdue(job, now_s, cfg):
        return job.priority
    ratio = slowdown_now(job, now_s, cfg)
    return OVERDUE_PRIORITY + job.priority + min(0.9, 0.9 * math.log(ratio) / math.log(1e6))


@dataclass(frozen=True)
class GangHold:
    """A reservation for one waiting multi-GPU job (module docstring)."""

    job_id: int
    node_name: str
    gpus: int  # world_size
    start_in_s: float  # when its GPUs are expected free, from now
    pack_ids: tuple[str, ...]  # packs on the node that drain for it
    free_gpus: int  # the node's free GPUs it holds (backfilled with short jobs only)

    @property
    def reason(self) -> str:
        return (f"reserved {self.gpus} GPUs on {self.node_name} (waits for {len(self.pack_ids)} running pack(s) "
                f"to end, expected in {self.start_in_s / 3600:.1f} h)")


def _pack_id(key: str) -> str:
    return key.split(":", 1)[0]


def _per_node(request: PackingRequest) -> bool:
    """Whether `request.nodes` names each node with its free GPUs (the simulator's view),
    rather than the site's node groups at full size with `max_gpus` free in all (the
    service's: it does not know which node a freed GPU is on)."""
    return all(n.count == 1 and n.name for n in request.nodes)


def _free_gpus(request: PackingRequest) -> tuple[dict[str, int], int]:
    """Free GPUs per named node, and the most free on one node none of those names.
    The simulator's view: its nodes, and 0. The service's view: a node running our packs
    (named in `open_gpus`) has its GPUs less theirs free (another user's job there is not
    seen, as `max_gpus` does not see it either), and a node running none has its group's
    GPUs, within what `max_gpus` leaves (queued packs count there)."""
    if _per_node(request):
        return {n.name: n.gpus for n in request.nodes if n.name}, 0
    size = {n.gpu_model: n.gpus for n in request.nodes}
    busy: dict[str, int] = {}
    model: dict[str, str] = {}
    for og in request.open_gpus:
        if og.pack:
            busy[og.node_name] = busy.get(og.node_name, 0) + 1
            model[og.node_name] = og.gpu_model
    seen = {name: max(0, size.get(model[name], 0) - n) for name, n in busy.items()}
    total = request.max_gpus if request.max_gpus is not None else sum(n.gpus * n.count for n in request.nodes)
    unseen_nodes = sum(n.count for n in request.nodes) - len(seen)
    other = min(max((n.gpus for n in request.nodes), default=0), total - sum(seen.values())) if unseen_nodes > 0 else 0
    return seen, max(0, other)


def _fits_now(job: JobDemand, request: PackingRequest) -> bool:
    """Some node offers `world_size` free GPUs (`_free_gpus`), or some pack node
    `world_size` GPUs of one pack (a join may take it; the refill checks the rest)."""
    seen, other = _free_gpus(request)
    if other >= job.world_size or any(n >= job.world_size for n in seen.values()):
        return True
    per_pack: dict[str, int] = {}
    for og in request.open_gpus:
        if og.pack:
            per_pack[og.key.rsplit(":", 1)[0]] = per_pack.get(og.key.rsplit(":", 1)[0], 0) + 1
    return False if not per_pack else max(per_pack.values()) >= job.world_size and _pack_has_room(job, request)


def _pack_has_room(job: JobDemand, request: PackingRequest) -> bool:
    # A pack spanning W GPUs is only a chance: the refill decides. Count it as room when
    # its GPUs hold fewer members than the limit allows (a full pack cannot take ranks).
    per_pack: dict[str, list[OpenGpu]] = {}
    for og in request.open_gpus:
        if og.pack:
            per_pack.setdefault(og.key.rsplit(":", 1)[0], []).append(og)
    slots = request.limits.members_per_gpu
    return any(sum(1 for og in g if og.members < slots) >= job.world_size for g in per_pack.values())


def gang_hold(request: PackingRequest, gang: JobDemand, cfg: FairConfig) -> GangHold | None:
    """The reservation for `gang`: on the node (by name) where its `world_size` GPUs are
    expected free soonest, counting the node's free GPUs (NodeShapes of count 1 named
    after it) and its running packs, shortest expected rest first (a member of unknown
    length never ends). None if no node has that many GPUs in all."""
    free = _free_gpus(request)[0]
    packs: dict[str, dict[str, tuple[int, float]]] = {}
    for og in request.open_gpus:
        if not og.pack:
            continue
        rest = max((expected_run_s(j, cfg) if j.est_duration_s is not None else math.inf for j in og.live),
                   default=0.0)
        by_pack = packs.setdefault(og.node_name, {})
        n, end = by_pack.get(_pack_id(og.key), (0, 0.0))
        by_pack[_pack_id(og.key)] = (n + 1, max(end, rest))
    best: GangHold | None = None
    for node in sorted(set(free) | set(packs)):
        have = free.get(node, 0)
        chosen: list[str] = []
        start = 0.0
        for pid, (n, end) in sorted(packs.get(node, {}).items(), key=lambda kv: (kv[1][1], kv[0])):
            if have >= gang.world_size:
                break
            chosen.append(pid)
            have += n
            start = max(start, end)
        if have < gang.world_size or start == math.inf:
            continue
        if best is None or start < best.start_in_s:
            best = GangHold(gang.job_id, node, gang.world_size, start, tuple(chosen), free.get(node, 0))
    return best


def apply_fairness(request: PackingRequest) -> tuple[PackingRequest, GangHold | None, PackingRequest | None]:
    """The request with the bound applied: overdue jobs lifted, and, for the most
    overdue gang that nothing can take now, its reservation. Returns (the main request,
    the hold or None, the backfill request for the held node's free GPUs or None): the
    caller plans the main request, then the backfill one with the jobs left over
    (`backfill_jobs`)."""
    cfg, now = request.fair, request.now_s
    if cfg is None or now is None:
        return request, None, None
    gang_bound = gang_reserve_bound(request.jobs, now, cfg)
    jobs = tuple(replace(j, priority=fair_priority(j, now, cfg, gang_bound)) for j in request.jobs)
    if cfg.tail_in_band:
        # The drain tail (jobs that would end last if started late, `drain_tail`) joins the
        # band at its top: otherwise the most overdue short jobs would push the longest
        # ones to the end of a backlog, where they run alone and cost throughput.
        tail = drain_tail(request, TAIL_FACTOR)
        jobs = tuple(replace(j, priority=OVERDUE_PRIORITY + j.priority + 0.95)
                     if j.job_id in tail and j.priority < OVERDUE_PRIORITY / 2 else j for j in jobs)
    request = replace(request, jobs=jobs)
    gangs = sorted((j for j in jobs if j.is_gang and is_overdue(j, now, cfg, gang_bound)),
                   key=lambda j: (-j.priority, -slowdown_now(j, now, cfg), j.job_id))
    hold = None
    for g in gangs:
        if _fits_now(g, request):
            break  # the highest gang can be placed or join now: no reservation this round
        hold = gang_hold(request, g, cfg)
        if hold is not None:
            break
    if hold is None:
        return request, None, None
    held_packs = set(hold.pack_ids)
    open_gpus = tuple(
        replace(og, remaining_s=min(og.remaining_s if og.remaining_s is not None else math.inf, hold.start_in_s))
        if og.pack and og.node_name == hold.node_name and _pack_id(og.key) in held_packs
        else og
        for og in request.open_gpus
        # first-fit's shard GPUs on the held node take no new shards (they drain too)
        if og.pack or og.node_name != hold.node_name)
    if not _per_node(request):
        # The service's view: a freed GPU may be on the held node, and a new pack there
        # would outlast the reservation. So every new pack is a backfill one (its jobs end
        # before the reservation); running packs elsewhere still take joins.
        main = replace(request, open_gpus=open_gpus, max_gpus=0)
        free = request.max_gpus if request.max_gpus is not None else sum(n.gpus * n.count for n in request.nodes)
        backfill = replace(request, jobs=(), open_gpus=(), max_gpus=free) if free > 0 else None
        return main, hold, backfill
    held_node = [n for n in request.nodes if n.count == 1 and n.name == hold.node_name]
    nodes = tuple(replace(n, gpus=0) if n in held_node else n for n in request.nodes)
    main = replace(request, nodes=nodes, open_gpus=open_gpus)
    backfill = None
    if held_node and held_node[0].gpus > 0:
        backfill = replace(request, jobs=(), nodes=tuple(held_node), open_gpus=(), max_gpus=None)
    return main, hold, backfill


def backfill_jobs(jobs: tuple[JobDemand, ...], hold: GangHold, cfg: FairConfig) -> tuple[JobDemand, ...]:
    """The single-GPU jobs that may start on the held node's free GPUs: expected to end
    before the reservation's time even at `backfill_speed` (their pack ends with them)."""
    return tuple(j for j in jobs if not j.is_gang and j.est_duration_s is not None
                 and j.est_duration_s / cfg.backfill_speed <= hold.start_in_s)
