"""Writing a pack's folder: placement.json, each member's entry in it (also a join
file's), the members' specs and the batch script sbatch runs.

Apart from the round (service/core.py) because it is what a newcomer looks for when a
member's fence, time limit, output links or the pack's `#SBATCH` lines are wrong: it
reads the store and the site and writes files, it decides nothing. `PackingService`
inherits it, so `svc.write_pack_dir(...)` and `svc.member_entry(...)` stay its methods
(recovery and refill call them).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slurm_dlrm.admin.marker import MODE_PACK, format_marker
from slurm_dlrm.service.common import AGENT_MEM_MIB, PLACEMENT_FILE, SCRIPT_FILE, job_options
from slurm_dlrm.service.daemon import ensure_private_dir
from slurm_dlrm.service.sbatch_options import (
    TIME_UNLIMITED,
    PackScript,
    SbatchOptions,
    pack_time_minutes,
    render_pack_script,
    stop_lead_s,
)
from slurm_dlrm.service.settings import ServiceSettings
from slurm_dlrm.service.spool import SPEC_FILE, write_job_spec, write_private
from slurm_dlrm.site import MIB, SiteConfig


class PackFolder:
    """The pack folder's writer, a part of `PackingService` (which sets these attributes)."""

    store: Any
    site: SiteConfig
    settings: ServiceSettings
    spool_dir: Path
    _spool_ready: bool

    if TYPE_CHECKING:
        @property
        def join_grace_s(self) -> float: ...

    def write_pack_dir(self, pack: Any, members: Sequence[Any]) -> str:
        """placement.json, the members' specs and the batch script; returns the script text.

        Rewritten in full before every sbatch attempt, each file replaced atomically
        (`write_private`: temporary file, fsync, rename), so an agent that reads the
        placement while a resubmission rewrites it, or after a crash or power loss,
        finds the whole old file or the whole new one, never a torn one.
        """
        pack_dir = Path(pack.pack_dir)
        if not self._spool_ready:
            ensure_private_dir(self.spool_dir)
            self._spool_ready = True
        # reports/ and cancel/ are made by whoever writes there first (agent, `cancel`).
        pack_dir.mkdir(mode=0o700, exist_ok=True)
        placements = self.store.placements(pack_id=pack.id)
        by_job = {j.id: j for j in members}
        out_members = []
        for p in sorted(placements, key=lambda p: (p.node_index, p.gpu_index, p.job_id, p.rank or 0)):
            job = by_job.get(p.job_id)
            if job is None:
                continue  # cancelled before submission
            out_members.append(self.member_entry(job, p, pack.gpu_model))
        agent = self.site.agent
        # the plan's refill headroom (Pack.reserve_*), kept with the pack's first event
        plan_data = self.store.pack_plan_data(pack.id)
        reserve = {k: int(plan_data.get(k) or 0) for k in ("reserve_cpus", "reserve_host_mem_bytes")}
        placement = {
            "pack_id": pack.id, "user": self.settings.user, "mps": bool(self.site.mps.enabled),
            "sample_interval_s": agent.sample_interval_s, "host_mem_tolerance_pct": agent.host_mem_tolerance_pct,
            "term_grace_s": agent.term_grace_s, "join_grace_s": self.join_grace_s, "pack_dir": str(pack_dir),
            "members": out_members, **{k: v for k, v in reserve.items() if v},
        }
        write_private(pack_dir / PLACEMENT_FILE, json.dumps(placement, indent=1, sort_keys=True) + "\n")
        node = plan_data.get("node")
        script = render_pack_script(self.pack_script(pack, out_members, [job_options(j) for j in members], reserve,
                                                     node=node if isinstance(node, str) and node else None))
        write_private(pack_dir / SCRIPT_FILE, script)
        return script

    def member_entry(self, job: Any, p: Any, gpu_model: str | None) -> dict[str, Any]:
        """One placement-file member (docs/interfaces.md 3), also a join file's content (3b);
        `gpu_model`: the pack's (its context is in the fence)."""
        from slurm_dlrm.packing.model import dmem_soft_limit_bytes, own_gpu_bytes

        job_dir = self.spool_dir / "jobs" / str(job.id)
        spec_path = job_dir / SPEC_FILE
        spec = job.spec
        if not spec_path.exists():  # `submit` wrote it, unless it died right after recording
            write_job_spec(self.spool_dir, job.id, spec)
        command = list(spec.get("command") or
                       [self.settings.python, "-m", "slurm_dlrm", "train", str(spec_path)])
        fence_mib = max(1, (p.gpu_mem_limit_bytes or 0) // MIB)
        # The dmem soft limit (docs/agent.md "Fences"): the estimate (a raised request after
        # an OOM) plus the CUDA context the fence holds; no margin, so a larger (learned)
        # margin never loosens it.
        est = max(job.gpu_mem_request_bytes or 0, job.est_gpu_peak_bytes or 0)
        own = own_gpu_bytes(job.estimate or {}) + max(0, est - (job.est_gpu_peak_bytes or 0))
        soft_mib = math.ceil(dmem_soft_limit_bytes(own, self.site.gpu_models.get(gpu_model or ""),
                                                   fence_mib * MIB) / MIB)
        return {
            "job_id": job.id, "name": job.name, "node_index": p.node_index, "gpu_index": p.gpu_index,
            "mps_thread_pct": p.mps_thread_pct or 100,
            "gpu_mem_limit_mib": fence_mib,
            **({"gpu_mem_estimate_mib": max(1, soft_mib)} if est > 0 else {}),
            "host_mem_limit_bytes": max(1, p.host_mem_limit_bytes or 0), "cpus": p.cpus or 1,
            "command": command,
            # per job, not per pack: a requeued job resumes from it in its next pack; a
            # multi-GPU job's ranks share them (its rank 0 writes)
            "checkpoint_dir": str(job_dir / "ckpt"), "metrics_path": str(job_dir / "metrics.jsonl"),
            **({"rank": p.rank or 0, "world_size": p.world_size} if (p.world_size or 1) > 1 else {}),
            **self.time_limit_entry(job),
            **self.output_links_entry(job, p),
        }

    def output_links_entry(self, job: Any, p: Any) -> dict[str, Any]:
        """`-o`/`-e` of a packed job (#SBATCH --output in its spec, or the command line):
        the agent links those paths to the member's own log (issue 43 item 8), with
        sbatch's %j as our job id, %x its name, %u the user, %A/%a its array and task."""
        opts = job_options(job)
        links = [expand_output_pattern(pat, job, self.settings.user, p.node) for pat in (opts.output, opts.error) if pat]
        return {"output_links": sorted(set(links))} if links else {}

    def time_limit_entry(self, job: Any) -> dict[str, Any]:
        """The job's own time limit for its agent to keep (issue 42), and the lead before
        it at which the member is told to checkpoint and stop."""
        minutes = job_options(job).time_minutes
        if minutes is None or minutes == TIME_UNLIMITED:
            return {}
        limit_s = 60.0 * minutes
        return {"time_limit_s": limit_s, "stop_lead_s": stop_lead_s(limit_s, self.site.agent.term_grace_s + 60.0)}

    def node_limits(self) -> tuple[int | None, int | None]:
        """(CPUs, MiB) of the smallest GPU node: a pack never asks for more per node."""
        gpu_nodes = [g for g in self.site.nodes if g.gpus > 0]
        return (min((g.cpus for g in gpu_nodes), default=None), min((g.memory_mib for g in gpu_nodes), default=None))

    def pack_script(self, pack: Any, members: list[dict[str, Any]], options: list[SbatchOptions],
                    reserve: dict[str, int] | None = None, node: str | None = None) -> PackScript:
        reserve = reserve or {}
        from slurm_dlrm.service.refill import pack_allocation

        nodes = max(1, pack.n_nodes)
        gpus_per_node = max(1, -(-pack.n_gpus // nodes))
        node_cpus, node_mem_mib = self.node_limits()
        cpus_per_node, mem_mib = pack_allocation(members, nodes, node_cpus, node_mem_mib, AGENT_MEM_MIB,
                                                 reserve.get("reserve_cpus", 0),
                                                 reserve.get("reserve_host_mem_bytes", 0))
        base = options[0]
        merged = SbatchOptions(
            partition=base.partition, account=base.account, qos=base.qos, constraint=base.constraint,
            mail_type=base.mail_type, mail_user=base.mail_user,
            # -o/-e are each member's own (member_entry's output_links), not the pack's: the
            # pack's batch output holds only its agents' lines, and %j there was the pack's id
            time_minutes=pack_time_minutes(o.time_minutes for o in options))
        return PackScript(
            pack_name=pack.name, comment=format_marker(MODE_PACK, pack_id=pack.id, extra={"pack": pack.name}),
            nodes=nodes, gpus_per_node=gpus_per_node, cpus_per_node=cpus_per_node,
            mem_per_node_mib=mem_mib, python=self.settings.python,
            placement_path=str(Path(pack.pack_dir) / PLACEMENT_FILE), pack_dir=pack.pack_dir,
            signal_before_end_s=int(self.site.agent.term_grace_s) + 60, options=merged, nodelist=node)


def expand_output_pattern(pattern: str, job: Any, user: str, node: str | None) -> str:
    """sbatch's filename pattern for one member: %j/%J our job id, %x its name, %u the
    user, %A the array's id (else the job id), %a its task (else 0), %N its node,
    %% a percent sign; a number between % and the letter pads with zeros (%4j)."""
    def one(m: Any) -> str:
        width, letter = m.group(1), m.group(2)
        values = {"j": job.id, "J": job.id, "x": job.name, "u": user, "N": node or "node",
                  "A": job.array_job_id if job.array_job_id is not None else job.id,
                  "a": job.array_task_id if job.array_task_id is not None else 0, "%": "%"}
        value = str(values.get(letter, m.group(0)))
        return value.zfill(int(width)) if width and value.isdigit() else value
    if "\\" in pattern:  # sbatch: a backslash anywhere turns the patterns off
        return pattern.replace("\\", "")
    return re.sub(r"%(\d*)([jJxuNAa%])", one, pattern)
