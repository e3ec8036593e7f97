"""The refill reservations: room held on pack GPUs for a job that cannot join yet,
so that joiners do not take it first (EASY backfill, docs/packing.md "Refilling
running packs" and "Every job gets its turn").

- `reserve_for_tail`: the first drain-tail job that fits no pack GPU now gets the pack
  GPU where its room frees up soonest (`Reservation`); only joiners that end before
  then (`ends_before`), or leave it its room (`backfills`), join that GPU, and a
  joiner that stays takes from the reservation's slack (`take_slack`).
- `reserve_for_gang`: the first gang that could not join reserves W GPUs of one pack
  node, which then take no single-GPU joins.
- `gang_holds`: one rank's room held on each GPU a waiting gang reserved (issue 31's
  second pass, off by default: `refill._GANG_HOLDS`).

Apart from `refill.py`, which decides who joins where: this module decides what room
is held and for how long, and keeps its books. Pure, as all of `packing/`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from slurm_dlrm.packing.common import rank_load
from slurm_dlrm.packing.interference import util_fraction
from slurm_dlrm.packing.model import (
    JobDemand,
    PackingLimits,
    host_limit_bytes,
    live_gpu_bytes,
    member_fence_bytes,
    rank_members,
    usable_gpu_bytes,
)
from slurm_dlrm.packing.pack_gpus import PackGpu


@dataclass
class Reservation:
    """A pack GPU held for a drain-tail job that fits no pack GPU yet (EASY backfill)."""

    gpu: PackGpu
    start_s: float  # when enough of its live members are expected to have ended
    slack_bytes: int  # GPU memory a longer joiner may still take beside the reserved job
    slack_cpus: int
    # For a gang's rank (`gang_holds`): SM and bandwidth shares a longer joiner may
    # still take under the load target, and the joined members that leave it a slot.
    slack_sm: float = math.inf
    slack_bw: float = math.inf
    max_joined: int | None = None
    # The allocation's CPUs and host memory the gang's ranks leave on the node: one list
    # shared by the holds of that node, since a joiner on any of its GPUs takes from it.
    node_slack: list[int] | None = None


def ends_before(res: Reservation, job: JobDemand) -> bool:
    return job.est_duration_s is not None and job.est_duration_s <= res.start_s


def backfills(res: Reservation, job: JobDemand, fence: int, cpus: int, sm: float = 0.0, bw: float = 0.0,
              joined: int = 0, host_bytes: int = 0) -> bool:
    """Whether `job` may join the reserved GPU: it ends before the reservation's start,
    or it leaves the reserved job its room."""
    return ends_before(res, job) or (fence <= res.slack_bytes and cpus <= res.slack_cpus
                                     and sm <= res.slack_sm + 1e-9 and bw <= res.slack_bw + 1e-9
                                     and (res.max_joined is None or joined < res.max_joined)
                                     and (res.node_slack is None
                                          or (cpus <= res.node_slack[0] and host_bytes <= res.node_slack[1])))


def take_slack(res: Reservation, job: JobDemand, fence: int, cpus: int, sm: float, bw: float,
               host_bytes: int) -> None:
    """`job` joined the reserved GPU: unless it ends before the reservation's start, what
    it takes comes off the room the reservation leaves to later joiners."""
    if ends_before(res, job):
        return
    res.slack_bytes -= fence
    res.slack_cpus -= cpus
    res.slack_sm -= sm
    res.slack_bw -= bw
    if res.node_slack is not None:  # shared by the node's reserved GPUs
        res.node_slack[0] -= cpus
        res.node_slack[1] -= host_bytes


def gang_holds(gpus: list[PackGpu], gang: JobDemand, limits: PackingLimits,
               load_target: bool) -> dict[str, Reservation]:
    """A reservation of one rank's room on each GPU a waiting gang reserved: memory for
    its heaviest rank's fence, a client slot and (`load_target`, complementary) SM and
    bandwidth under the target, as refill's `_join_gangs` asks. Its start is when the last
    of these GPUs is expected to have that room, its live members ending in their expected
    order (unknown length: never, and then only joiners that leave the room join)."""
    ranks = rank_members(gang)
    heavy = min(ranks, key=rank_load)
    sm_r, bw_r = util_fraction(heavy.sm_util_pct), util_fraction(heavy.membw_util_pct)
    start_s = 0.0
    out: dict[str, Reservation] = {}
    node_slack: dict[int, list[int]] = {}
    for pg in gpus:
        shared = node_slack.setdefault(id(pg.node), [pg.node.free_cpus - sum(m.cpus for m in ranks),
                                                     pg.node.free_mem_bytes - sum(host_limit_bytes(m, limits)
                                                                                  for m in ranks)])
        fence = max(member_fence_bytes(m, pg.gpu, limits) for m in ranks)
        free = usable_gpu_bytes(pg.gpu) - pg.used_bytes
        sm = sum(util_fraction(j.sm_util_pct) for j in pg.members)
        bw = sum(util_fraction(j.membw_util_pct) for j in pg.members)
        target = limits.target_load if load_target else math.inf
        slots = pg.slots - len(pg.joined)
        out[pg.key] = Reservation(pg, 0.0, free - fence, 1 << 62, target - sm - sm_r, target - bw - bw_r,
                                  pg.slots - 1, shared)
        t = 0.0
        live = sorted(pg.live, key=lambda x: math.inf if x.est_duration_s is None else x.est_duration_s)
        for k, m in enumerate(live):
            if fence <= free and slots >= 1 and (k == len(pg.members) or max(sm + sm_r, bw + bw_r) <= target + 1e-9):
                break
            t = math.inf if m.est_duration_s is None else m.est_duration_s
            free += live_gpu_bytes(m, pg.gpu, limits)
            sm -= util_fraction(m.sm_util_pct)
            bw -= util_fraction(m.membw_util_pct)
            slots += 1
        if not (fence <= free and slots >= 1
                and (len(live) == len(pg.members) or max(sm + sm_r, bw + bw_r) <= target + 1e-9)):
            t = math.inf  # no room even with every live member ended (this round's joiners stay)
        start_s = max(start_s, t)
    for r in out.values():
        r.start_s = 0.0 if start_s == math.inf else start_s
    return out


def reserve_for_tail(pgs: list[PackGpu], tail: list[JobDemand], limits: PackingLimits) -> Reservation | None:
    """EASY backfill over GPU memory and CPUs: the first job of `tail` that fits no pack
    GPU now gets the pack GPU where its room frees up soonest, counting the live members
    ending in their expected order (a member of unknown length never ends). None if
    every tail job fits somewhere now, or none can ever."""
    for job in tail:
        best: Reservation | None = None
        fits_now = False
        for pg in pgs:
            fence = member_fence_bytes(job, pg.gpu, limits)
            free = usable_gpu_bytes(pg.gpu) - pg.used_bytes
            free_cpus = pg.node.free_cpus
            if fence <= free and job.cpus <= free_cpus and host_limit_bytes(job, limits) <= pg.node.free_mem_bytes:
                fits_now = True
                break
            start_s = 0.0
            for m in sorted(pg.live, key=lambda x: math.inf if x.est_duration_s is None else x.est_duration_s):
                if fence <= free and job.cpus <= free_cpus:
                    break
                if m.est_duration_s is None:
                    start_s = math.inf
                    break
                start_s = m.est_duration_s
                free += live_gpu_bytes(m, pg.gpu, limits)
                free_cpus += m.cpus
            if (fence <= free and job.cpus <= free_cpus and start_s < math.inf
                    and (best is None or start_s < best.start_s)):
                best = Reservation(pg, start_s, free - fence, free_cpus - job.cpus)
        if not fits_now:
            return best
    return None


def reserve_for_gang(groups: dict[int, list[PackGpu]], ranks: list[JobDemand], limits: PackingLimits,
                     reserved: set[str]) -> None:
    """The first gang that could not join reserves the `world_size` least loaded GPUs of
    the pack node that has them: single-GPU jobs stop joining those, so their room
    grows as members end and the gang gets in (refill would otherwise fill every
    freed share at once and the gang would never see room on W GPUs together)."""
    best: tuple[float, list[PackGpu]] | None = None
    for group in groups.values():
        if len(group) < len(ranks):
            continue
        loads = sorted(group, key=lambda pg: (max(sum(util_fraction(j.sm_util_pct) for j in pg.members),
                                                  sum(util_fraction(j.membw_util_pct) for j in pg.members)),
                                              pg.used_bytes, pg.key))
        chosen = loads[:len(ranks)]
        worst = max(max(sum(util_fraction(j.sm_util_pct) for j in pg.members),
                        sum(util_fraction(j.membw_util_pct) for j in pg.members)) for pg in chosen)
        if best is None or worst < best[0]:
            best = (worst, chosen)
    if best is not None:
        reserved.update(pg.key for pg in best[1])

