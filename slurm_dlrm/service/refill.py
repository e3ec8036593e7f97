"""Refilling running packs: pending jobs join GPUs of running packs whose members ended.

The live side of docs/interfaces.md section 3b (the pilot-job pattern: a pack's
allocation takes new work until its agents leave). Each dispatch round the service
offers the policy one `OpenGpu(pack=True)` per GPU of each RUNNING pack whose agents
are alive and whose node has no `closed/<node_index>` marker, with that GPU's live
members and the room left in the node's allocation. A join in the plan is recorded in
the store first (job PENDING -> PLANNED in that pack; a multi-GPU job's W ranks in one
transaction, all or none) and only then written as `<pack_dir>/joins/<job_id>.json`
(a gang's: `{"members": [W entries]}`), so a crash in between leaves a PLANNED joiner
whose file the next round writes again; never a file the store does not know.

A joiner that did not start is sent back to PENDING without counting an attempt when
its node's agent closed (marker, then a fresh read of the reports) or its pack ended.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from slurm_dlrm.agent.placement import CLOSED_DIR, JOINS_DIR
from slurm_dlrm.packing.model import whole_mib_bytes
from slurm_dlrm.service.common import (
    AGENT_CPUS,
    AGENT_MEM_MIB,
    PLACEMENT_FILE,
    job_options,
    pack_member_ids,
    write_atomic,
)
from slurm_dlrm.service.daemon import ensure_private_dir
from slurm_dlrm.service.measured import member_peaks
from slurm_dlrm.service.sbatch_options import pack_time_minutes
from slurm_dlrm.site import MIB, expand_hostlist

log = logging.getLogger(__name__)

JOINER_NOT_STARTED = "pack closed before the joiner started"
# Policies that place jobs on pack GPUs (docs/interfaces.md 3b); the others get none.
JOINING_POLICIES = ("complementary", "mem-best-fit", "exact")


@dataclass(frozen=True)
class PackShape:
    """What one running pack's allocation holds, from its placement file (the initial
    members: the batch script was sized from them, see `pack_allocation`)."""

    initial_job_ids: frozenset[int]
    cpus_per_node: int  # as asked from Slurm, the agent's own CPU included
    mem_per_node_bytes: int  # likewise, the agent's own memory included
    gpus_per_node: int
    key: tuple[tuple[str, str], ...]  # the members' pack key (sbatch options that must match)
    time_limit_s: float | None = None  # the batch script's --time (None: partition default or UNLIMITED)


def pack_allocation(members: list[dict[str, Any]], n_nodes: int, node_cpus: int | None, node_mem_mib: int | None,
                    agent_mem_mib: int, reserve_cpus: int = 0, reserve_mem_bytes: int = 0) -> tuple[int, int]:
    """(CPUs, MiB) per node the pack asks Slurm for: the busiest node's members, the
    plan's refill headroom (`Pack.reserve_*`, so joiners find room) and one CPU and
    `agent_mem_mib` for the agent, at most what a node has. The batch script and the
    refill's offer both use this, from the placement file."""
    nodes = max(1, n_nodes)
    cpus = [0] * nodes
    mem = [0] * nodes
    for m in members:
        cpus[m["node_index"]] += int(m["cpus"])
        mem[m["node_index"]] += int(m["host_mem_limit_bytes"])
    cpu_count = max(1, max(cpus)) + max(0, reserve_cpus) + AGENT_CPUS
    if node_cpus is not None:
        cpu_count = min(cpu_count, node_cpus)
    # Rounded up: rounded down, the allocation was up to a MiB short of the plan and the
    # joiner the plan reserved room for did not fit (sim_vs_live's GPU-hours drift, wave 5).
    mem_mib = whole_mib_bytes(max(mem) + max(0, reserve_mem_bytes)) // MIB + agent_mem_mib
    if node_mem_mib is not None:
        mem_mib = min(mem_mib, node_mem_mib)
    return max(1, cpu_count), max(1, mem_mib)


def join_path(pack_dir: str, job_id: int) -> Path:
    return Path(pack_dir) / JOINS_DIR / f"{job_id}.json"


def closed_path(pack_dir: str, node_index: int) -> Path:
    return Path(pack_dir) / CLOSED_DIR / str(node_index)


class Refill:
    """The service's refill steps; holds only caches a restart can rebuild."""

    def __init__(self, svc: Any) -> None:
        self.svc = svc
        self.shapes: dict[int, PackShape] = {}
        self.end_t: dict[int, float] = {}  # pack id -> when its allocation's time limit ends (squeue)

    # ------------------------------------------------------------ what a pack holds

    def shape(self, pack: Any) -> PackShape | None:
        cached = self.shapes.get(pack.id)
        if cached is not None:
            return cached
        try:
            data = json.loads((Path(pack.pack_dir) / PLACEMENT_FILE).read_text())
            members = list(data["members"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("pack %s: no placement file to refill from: %s", pack.name, exc)
            return None
        if not members:
            return None
        node_cpus, node_mem_mib = self.svc.node_limits()
        cpus, mem_mib = pack_allocation(members, pack.n_nodes, node_cpus, node_mem_mib, AGENT_MEM_MIB,
                                        int(data.get("reserve_cpus") or 0),
                                        int(data.get("reserve_host_mem_bytes") or 0))
        nodes = max(1, pack.n_nodes)
        options = [job_options(self.svc.store.get_job(int(m["job_id"]))) for m in members]
        minutes = pack_time_minutes(o.time_minutes for o in options)  # as the batch script asked
        shape = PackShape(initial_job_ids=frozenset(int(m["job_id"]) for m in members), cpus_per_node=cpus,
                          mem_per_node_bytes=mem_mib * MIB, gpus_per_node=max(1, -(-pack.n_gpus // nodes)),
                          key=options[0].pack_key(),
                          time_limit_s=minutes * 60.0 if minutes is not None and minutes > 0 else None)
        self.shapes[pack.id] = shape
        return shape

    def is_joiner(self, pack: Any, job_id: int) -> bool:
        shape = self.shape(pack) if pack.pack_dir else None
        return shape is not None and job_id not in shape.initial_job_ids

    def forget(self, pack_id: int) -> None:
        self.shapes.pop(pack_id, None)
        self.end_t.pop(pack_id, None)

    def _alive(self, pack: Any, now: float) -> bool:
        hb = self.svc.heartbeats.get(pack.id)
        return hb is not None and now - hb <= float(self.svc.site.agent.heartbeat_timeout_s)

    # ------------------------------------------------------------ offer

    def open_gpus(self, key: tuple[tuple[str, str], ...], pending_ids: set[int] | frozenset[int] = frozenset(),
                  ) -> tuple[tuple[Any, ...], dict[str, tuple[Any, int, int]]]:
        """OpenGpus of the running packs with this pack key, and key -> (pack, node, GPU).

        A pack that one of `pending_ids` was placed in before (moved out, requeued after
        an OOM) is not offered this round: a job never joins a pack it left (its
        placement there is history, and a move must not be undone), and the round
        plans it elsewhere; the pack is offered again once no such job waits.
        """
        from slurm_dlrm.packing.model import OpenGpu, rank_members
        from slurm_dlrm.store.states import PackState

        svc = self.svc
        if svc.policy not in JOINING_POLICIES:
            return (), {}
        now = svc.clock()
        out: list[Any] = []
        where: dict[str, tuple[Any, int, int]] = {}
        for pack in svc.store.packs([PackState.RUNNING], user=svc.settings.user):
            if not pack.pack_dir or not pack.nodes or not self._alive(pack, now):
                continue
            shape = self.shape(pack)
            if shape is None or shape.key != key:
                continue
            hosts = expand_hostlist(pack.nodes)
            placements = svc.store.placements(pack_id=pack.id)
            if any(p.job_id in pending_ids for p in placements):
                continue
            live_ids = set(pack_member_ids(svc.store, pack.id, ("PLANNED", "RUNNING")))
            # one live member per (job, rank): a multi-GPU job holds a GPU per rank
            by_rank = {(p.job_id, p.rank or 0): p for p in placements if p.job_id in live_ids}
            # A member past its warm-up counts at its measured peak, not its fence (service/measured.py)
            peaks = member_peaks(svc.store, svc.site, pack, sorted({j for j, _ in by_rank}),
                                 svc.recovery.config.warmup_s)
            demands = {}
            for j in {j for j, _ in by_rank}:
                job = svc.store.get_job(j)
                ranks = rank_members(svc.demand_of(job))
                for (jj, r), p in by_rank.items():
                    if jj == j:
                        d = self._live_demand(ranks[min(r, len(ranks) - 1)], p, now, self._steps_done(job))
                        demands[(j, r)] = replace(d, observed_gpu_mem_bytes=peaks.get((j, p.gpu_index)))
            end_t = self.end_t.get(pack.id)  # squeue's EndTime, if the parser keeps it for running jobs
            if end_t is None and shape.time_limit_s is not None and pack.start_time is not None:
                end_t = pack.start_time + shape.time_limit_s
            remaining = None if end_t is None else max(0.0, end_t - now)
            for node_index in range(max(1, pack.n_nodes)):
                if node_index >= len(hosts) or closed_path(pack.pack_dir, node_index).exists():
                    continue
                on_node = [p for p in by_rank.values() if p.node_index == node_index]
                free_cpus = shape.cpus_per_node - AGENT_CPUS - sum(p.cpus or 1 for p in on_node)
                free_mem = (shape.mem_per_node_bytes - AGENT_MEM_MIB * MIB
                            - sum(p.host_mem_limit_bytes or 0 for p in on_node))
                for gpu_index in range(shape.gpus_per_node):
                    live = tuple(demands[(p.job_id, p.rank or 0)] for p in on_node if p.gpu_index == gpu_index)
                    gpu_key = f"{pack.id}:{node_index}:{gpu_index}"
                    out.append(OpenGpu(key=gpu_key, node_name=hosts[node_index], members=len(live), pack=True,
                                       gpu_model=pack.gpu_model or "", live=live, free_cpus=max(0, free_cpus),
                                       free_host_mem_bytes=max(0, free_mem), remaining_s=remaining))
                    where[gpu_key] = (pack, node_index, gpu_index)
        return tuple(out), where

    def _steps_done(self, job: Any) -> tuple[int, int] | None:
        """(steps done, steps in all) from the runner's metrics file, if it reported."""
        from slurm_dlrm.service.submit import job_progress

        steps = (job.spec or {}).get("steps")
        if not isinstance(steps, int) or steps <= 0:
            return None
        step = job_progress(self.svc.site, self.svc.settings.user, job.id)
        return None if step is None else (step, steps)

    @staticmethod
    def _live_demand(demand: Any, placement: Any, now: float, steps_done: tuple[int, int] | None = None) -> Any:
        """A live member as the policy weighs it: its *remaining* expected solo run (as
        the simulator offers it). From the runner's last reported step when there is one
        (it counts the runs before a resume and is not fooled by a shared GPU's
        slowdown), else its solo estimate less the time it has run in this pack."""
        if demand.est_duration_s is None:
            return demand
        if steps_done is not None:
            done, total = steps_done
            return replace(demand, est_duration_s=demand.est_duration_s * max(0.0, 1.0 - done / total))
        if placement.start_time is None:
            return demand
        return replace(demand, est_duration_s=max(0.0, demand.est_duration_s - (now - placement.start_time)))

    # ------------------------------------------------------------ act on a plan

    def record_joins(self, joins: tuple[Any, ...], where: dict[str, tuple[Any, int, int]],
                     by_id: dict[int, Any], stats: Any) -> int:
        """Each joining job: into the store (PENDING -> PLANNED in the pack, a placement
        row per rank, one transaction), then its join file. A multi-GPU job's W `Join`s
        (one per rank, docs/interfaces.md 3b) are recorded together: all ranks or none."""
        from slurm_dlrm.store.errors import StoreError
        from slurm_dlrm.store.records import NewPlacement

        by_job: dict[int, list[Any]] = {}
        for join in joins:  # a gang's rank joins, in plan order, under its job
            by_job.setdefault(join.member.job_id, []).append(join)
        done = 0
        for job_id, group in by_job.items():
            targets = [t for j in group if (t := where.get(j.gpu_key)) is not None]
            if job_id not in by_id or len(targets) != len(group):
                log.warning("plan joins job %d to unknown GPU(s) %s; ignored", job_id,
                            ",".join(j.gpu_key for j in group))
                continue
            if len({t[0].id for t in targets}) != 1 or len({t[1] for t in targets}) != 1:
                log.warning("plan joins job %d over several packs or nodes; ignored", job_id)
                continue  # the policy never does this (a gang: one node of one pack)
            pack = targets[0][0]
            placements = []
            for j, (_, node_index, gpu_index) in zip(group, targets, strict=True):
                m = j.member
                gang = m.world_size > 1
                placements.append(NewPlacement(
                    job_id=job_id, node_index=node_index, gpu_index=gpu_index, mps_thread_pct=m.mps_thread_pct,
                    gpu_mem_limit_bytes=m.gpu_mem_limit_mib * MIB, host_mem_limit_bytes=m.host_mem_limit_bytes,
                    cpus=m.cpus, predicted_speed=m.predicted_speed,
                    rank=m.rank if gang else None, world_size=m.world_size if gang else None))
            speed = min(j.member.predicted_speed for j in group)
            try:
                self.svc.store.add_join(pack.id, placements[0] if len(placements) == 1 else placements,
                                        reason=f"{self.svc.policy}, predicted speed {speed:.2f}")
            except StoreError as exc:  # the pack ended or the job moved since the round began (StaleState)
                log.info("join of job %d into pack %s not recorded: %s", job_id, pack.name, exc)
                continue
            self.svc.waited_rounds.pop(job_id, None)
            self.write_join_file(pack, self.svc.store.get_job(job_id))
            done += 1
        stats.jobs_planned += done
        stats.transitions += done
        return done

    def write_join_file(self, pack: Any, job: Any) -> None:
        """`<pack_dir>/joins/<job_id>.json`, atomically: one placement-file member entry,
        or `{"members": [...]}` with a multi-GPU job's W rank entries."""
        placements = sorted((p for p in self.svc.store.placements(pack_id=pack.id, job_id=job.id)
                             if p.attempt == job.attempt), key=lambda p: p.rank or 0)
        if not placements:
            return
        entries = [self.svc.member_entry(job, p, pack.gpu_model) for p in placements]
        content: dict[str, Any] = entries[0] if len(entries) == 1 else {"members": entries}
        joins = Path(pack.pack_dir) / JOINS_DIR
        if not joins.is_dir():
            ensure_private_dir(joins)
        write_atomic(joins / f"{job.id}.json", json.dumps(content, sort_keys=True) + "\n")

    # ------------------------------------------------------------ each round

    def check_joiners(self, stats: Any) -> None:
        """PLANNED joiners of running packs: rewrite a missing join file (a crash between
        the store and the file); requeue those whose node's agent closed unstarted."""
        from slurm_dlrm.store.states import JobState, PackState

        svc = self.svc
        for pack in svc.store.packs([PackState.RUNNING], user=svc.settings.user):
            if not pack.pack_dir:
                continue
            planned = pack_member_ids(svc.store, pack.id, ("PLANNED",))
            joiners = [j for j in planned if self.is_joiner(pack, j)]
            if not joiners:
                continue
            nodes = {p.job_id: p.node_index for p in svc.store.placements(pack_id=pack.id) if p.job_id in joiners}
            closed = {n for n in set(nodes.values()) if closed_path(pack.pack_dir, n).exists()}
            if closed:
                svc.ingest(pack)  # marker first, then the reports: a launched joiner shows RUNNING now
            for job_id in joiners:
                job = svc.store.get_job(job_id)
                if job.state != JobState.PLANNED or job.pack_id != pack.id:
                    continue
                if nodes.get(job_id) in closed:
                    svc.store.transition_job(job_id, JobState.PENDING, f"{JOINER_NOT_STARTED} "
                                             f"(node {nodes[job_id]} of {pack.name} closed)", expect=JobState.PLANNED)
                    stats.transitions += 1
                elif not join_path(pack.pack_dir, job_id).exists():
                    log.info("job %d: join file of pack %s missing (restart); writing it again", job_id, pack.name)
                    self.write_join_file(pack, job)
