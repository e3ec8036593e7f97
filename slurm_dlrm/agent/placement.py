"""The placement file (docs/interfaces.md section 3): read and validated, nothing else."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_dlrm.errors import BadInput
from slurm_dlrm.osutil import write_atomic

PLACEMENT_FILE = "placement.json"
# Refill (docs/interfaces.md section 3b): the service writes `<pack_dir>/joins/<job_id>.json`
# (one member entry) for a job that joins the running pack; an agent about to exit
# creates `<pack_dir>/closed/<node_index>`, after which it launches no join.
JOINS_DIR = "joins"
CLOSED_DIR = "closed"
# Ranks of one torch.distributed job (issue 18): W entries with the same job_id, each with
# "rank" and "world_size", all on one node; absent fields = rank 0 of 1.


@dataclass(frozen=True)
class MemberPlacement:
    job_id: int
    name: str
    node_index: int
    gpu_index: int  # position in the node's allocated GPU list (CUDA_VISIBLE_DEVICES)
    mps_thread_pct: int
    gpu_mem_limit_mib: int
    host_mem_limit_bytes: int
    cpus: int
    command: tuple[str, ...]
    checkpoint_dir: str
    metrics_path: str
    # Optional (issue 22): the estimate, the dmem soft limit (dmem.min; absent: the fence),
    # and a static SM partition of this many chunks when the policy asks for isolation.
    gpu_mem_estimate_mib: int | None = None
    sm_chunks: int | None = None
    rank: int = 0  # this entry's rank in a job of world_size ranks (issue 18)
    world_size: int = 1
    # the job's own time limit (sbatch -t) and how long before it the agent tells the
    # member to checkpoint and stop (issue 42); None: no limit of its own
    time_limit_s: float | None = None
    stop_lead_s: float = 0.0
    # the job's -o/-e paths (issue 43 item 8): the agent links them to the member's log
    output_links: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        """Unique within a pack: the job id, plus the rank for a multi-rank job (pid files,
        MPS v3 namespaces, dmem cgroups)."""
        return str(self.job_id) if self.world_size == 1 else f"{self.job_id}-r{self.rank}"


@dataclass(frozen=True)
class Placement:
    pack_id: int
    user: str
    mps: bool
    sample_interval_s: float
    host_mem_tolerance_pct: float
    term_grace_s: float
    pack_dir: str
    members: tuple[MemberPlacement, ...]
    path: str | None = None
    # seconds an agent whose members all ended waits for joiners (docs/interfaces.md 3b);
    # absent = 0: exit at once, as before refill
    join_grace_s: float = 0.0

    def members_on(self, node_index: int) -> list[MemberPlacement]:
        return [m for m in self.members if m.node_index == node_index]


def _get(data: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str, default: Any = ...,
         min_value: float | None = None) -> Any:
    if key not in data:
        if default is ...:
            raise BadInput(f"placement {where}{key}: missing")
        return default
    value = data[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise BadInput(f"placement {where}{key}: must be {'/'.join(k.__name__ for k in kinds)}, got {value!r}")
    if min_value is not None and value < min_value:  # type: ignore[operator]
        raise BadInput(f"placement {where}{key}: must be >= {min_value:g}, got {value!r}")
    return value


def parse_member(m: Any, where: str) -> MemberPlacement:
    """One entry of `members` (also the content of a join file, docs/interfaces.md 3b)."""
    w = f"{where}."
    if not isinstance(m, dict):
        raise BadInput(f"placement {where}: must be an object")
    command = _get(m, "command", list, w)
    if not command or not all(isinstance(c, str) for c in command):
        raise BadInput(f"placement {w}command: must be a non-empty list of strings")
    member = MemberPlacement(
        job_id=_get(m, "job_id", int, w, min_value=0),
        name=_get(m, "name", str, w),
        node_index=_get(m, "node_index", int, w, 0, min_value=0),
        gpu_index=_get(m, "gpu_index", int, w, min_value=0),
        mps_thread_pct=_get(m, "mps_thread_pct", int, w, 100, min_value=1),
        gpu_mem_limit_mib=_get(m, "gpu_mem_limit_mib", int, w, min_value=1),
        host_mem_limit_bytes=_get(m, "host_mem_limit_bytes", int, w, min_value=1),
        cpus=_get(m, "cpus", int, w, 1, min_value=1),
        command=tuple(command),
        checkpoint_dir=_get(m, "checkpoint_dir", str, w),
        metrics_path=_get(m, "metrics_path", str, w),
        gpu_mem_estimate_mib=_get(m, "gpu_mem_estimate_mib", int, w, None, min_value=1),
        sm_chunks=_get(m, "sm_chunks", int, w, None, min_value=1),
        rank=_get(m, "rank", int, w, 0, min_value=0),
        world_size=_get(m, "world_size", int, w, 1, min_value=1),
        time_limit_s=_get(m, "time_limit_s", float, w, None, min_value=1),
        stop_lead_s=_get(m, "stop_lead_s", float, w, 0.0, min_value=0),
        output_links=tuple(_get(m, "output_links", list, w, [])),
    )
    if not all(isinstance(x, str) and x.startswith("/") for x in member.output_links):
        raise BadInput(f"placement {w}output_links: must be absolute paths")
    if member.mps_thread_pct > 100:
        raise BadInput(f"placement {w}mps_thread_pct: must be <= 100, got {member.mps_thread_pct}")
    if member.rank >= member.world_size:
        raise BadInput(f"placement {w}rank: must be < world_size {member.world_size}, got {member.rank}")
    return member


def check_gangs(members: list[MemberPlacement], where: str) -> None:
    """The ranks of each job: every rank 0..W-1 once, one node, distinct GPUs, one command,
    checkpoint folder and metrics file (docs/interfaces.md section 3)."""
    by_job: dict[int, list[MemberPlacement]] = {}
    for m in members:
        by_job.setdefault(m.job_id, []).append(m)
    for job_id, ranks in by_job.items():
        first = ranks[0]
        w = f"placement {where}job {job_id}"
        if len(ranks) > 1 and first.world_size == 1:
            raise BadInput(f"placement {where}job_id: {job_id} appears twice")
        if {r.world_size for r in ranks} != {first.world_size}:
            raise BadInput(f"{w}: its entries disagree on world_size")
        if sorted(r.rank for r in ranks) != list(range(first.world_size)):
            raise BadInput(f"{w}: ranks {sorted(r.rank for r in ranks)}, expected 0..{first.world_size - 1} once each")
        for field_name in ("node_index", "command", "checkpoint_dir", "metrics_path"):
            if len({getattr(r, field_name) for r in ranks}) > 1:
                raise BadInput(f"{w}: its ranks differ in {field_name} (a job's ranks share one node, "
                               "command, checkpoint folder and metrics file)")
        if len({r.gpu_index for r in ranks}) != len(ranks):
            raise BadInput(f"{w}: two ranks on one GPU (gpu_index must differ)")


def parse_join(data: Any, where: str) -> list[MemberPlacement]:
    """A join file: one member entry, or `{"members": [...]}` with the W ranks of one job."""
    if isinstance(data, dict) and "members" in data and "job_id" not in data:
        raw = data["members"]
        if not isinstance(raw, list) or not raw:
            raise BadInput(f"placement {where}.members: must be a non-empty list")
        ranks = [parse_member(m, f"{where}.members[{i}]") for i, m in enumerate(raw)]
        if len({r.job_id for r in ranks}) != 1:
            raise BadInput(f"placement {where}.members: a join holds the ranks of one job")
        check_gangs(ranks, f"{where}: ")
        return ranks
    return [parse_member(data, where)]


def parse_placement(data: Any, source: str | None = None) -> Placement:
    if not isinstance(data, dict):
        raise BadInput("placement: must be a JSON object")
    raw_members = _get(data, "members", list, "")
    members = []
    seen: set[tuple[int, int]] = set()
    for i, m in enumerate(raw_members):
        member = parse_member(m, f"members[{i}]")
        if (member.job_id, member.rank) in seen:
            what = f"{member.job_id} rank {member.rank}" if member.world_size > 1 else str(member.job_id)
            raise BadInput(f"placement members[{i}].job_id: {what} appears twice")
        seen.add((member.job_id, member.rank))
        members.append(member)
    check_gangs(members, "")
    return Placement(
        pack_id=_get(data, "pack_id", int, "", min_value=0),
        user=_get(data, "user", str, "", ""),
        mps=_get(data, "mps", bool, "", True),
        sample_interval_s=_get(data, "sample_interval_s", float, "", 2.0, min_value=0.05),
        host_mem_tolerance_pct=_get(data, "host_mem_tolerance_pct", float, "", 10.0, min_value=0),
        term_grace_s=_get(data, "term_grace_s", float, "", 60.0, min_value=0),
        join_grace_s=_get(data, "join_grace_s", float, "", 0.0, min_value=0),
        pack_dir=_get(data, "pack_dir", str, ""),
        members=tuple(members),
        path=source,
    )


def load_placement(path: str | os.PathLike[str]) -> Placement:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise BadInput(f"placement: cannot read {p}: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise BadInput(f"placement: {p} is not JSON: {exc}") from None
    return parse_placement(data, str(p))


def write_placement(placement_dict: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Atomic write (tests and the service side use the same layout)."""
    write_atomic(path, json.dumps(placement_dict, indent=1))


def allocation_gpus(env: dict[str, str]) -> list[str] | None:
    """The GPUs Slurm gave this node of the allocation, as CUDA names them (the agent's and
    the selftest's `--gpus` default)."""
    for key in ("CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "GPU_DEVICE_ORDINAL"):
        value = env.get(key, "").strip()
        if value and value != "NoDevFiles":
            return [g.strip() for g in value.split(",") if g.strip()]
    return None
