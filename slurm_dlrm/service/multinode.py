"""Jobs that outgrow a node (issue 48): one Slurm job over N whole nodes, one rank per GPU.

A spec whose `world_size` passes the GPUs of the largest node of its partition (or that
names `nodes:` with `gpus_per_node:`) is not packed: it becomes one ordinary Slurm job
(a row in mode "no-pack", service/native.py) with `--nodes=N --ntasks-per-node=G
--gres=gpu:G` and, unless the site says otherwise, `--exclusive`. Its batch script finds
the rendezvous address (the first node's address as Slurm knows it) and a port derived
from the job id, then `srun` starts one runner per rank; the runner takes its rank,
local rank and world size from Slurm's task variables (commands/train.py).

Refused with one line, before anything is recorded (exit 2): a layout no partition node
set can hold, a world size that is not a multiple of the GPUs per node where the site
runs multi-node jobs on whole nodes, a rank whose fence passes a GPU, and a checkpoint
folder that not every node sees (a local file system the site does not list as shared).

Pure but for `check_shared_path` (statfs).
"""

from __future__ import annotations

import math
import os
import shlex
from dataclasses import dataclass
from typing import Any

from slurm_dlrm.errors import BadInput
from slurm_dlrm.site import MIB, SiteConfig

# Set in the batch script for the ranks `srun` starts: take rank and world size from
# SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS (train/slurm_ranks.py, no torch).
from slurm_dlrm.train.slurm_ranks import ENV_RANKS_FROM_SLURM

# MASTER_PORT = base + job id modulo the span: two jobs on one first node differ unless
# their ids are a span apart (and then one is long gone, or the port is busy: it fails).
PORT_BASE = 20000
PORT_SPAN = 20000


@dataclass(frozen=True)
class NodeLayout:
    """Where a multi-node job's ranks go: `nodes` nodes with `ranks_per_node` each."""

    nodes: int
    ranks_per_node: int

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node


def is_multinode_spec(spec: Any) -> bool:
    return spec.nodes is not None and int(spec.nodes) > 1


def node_layout(sub: Any, site: SiteConfig, where: str, part: Any, part_groups: list[Any]) -> NodeLayout | None:
    """The job's node layout, or None for a job one node holds (today's paths: packed
    or `--no-pack` on one node). Raise BadInput for a layout the partition (`part`, its
    GPU node groups `part_groups`: service/submit.py) cannot hold."""
    from slurm_dlrm.site import expand_hostlist

    spec = sub.spec
    groups = [g for g in part_groups if g.gpu_model == sub.gpu.name]
    node_gpus = max((g.gpus for g in groups), default=0)
    world = int(spec.world_size)
    if spec.nodes is not None:
        nodes, per_node = int(spec.nodes), int(spec.gpus_per_node)
        if nodes == 1:
            return None  # one node: as world_size alone
        if per_node > node_gpus:
            raise BadInput(f"{where}: gpus_per_node {per_node}: the largest {sub.gpu.name} node of partition "
                           f"{part.name} has {node_gpus} GPUs")
    else:
        if world <= node_gpus or node_gpus == 0:
            return None
        if world % node_gpus and site.multinode.whole_nodes:
            raise BadInput(f"{where}: world_size {world} is not a multiple of the {node_gpus} GPUs per "
                           f"{sub.gpu.name} node of partition {part.name} (multi-node jobs take whole nodes here: "
                           f"[multinode] whole_nodes); give nodes: and gpus_per_node: to choose the layout")
        nodes = math.ceil(world / node_gpus)
        if world % nodes:
            raise BadInput(f"{where}: world_size {world} does not split evenly over {nodes} nodes of {node_gpus} "
                           f"GPUs; give nodes: and gpus_per_node:")
        per_node = world // nodes
    hosts = {h for g in groups if g.gpus >= per_node for h in g.hostnames}
    hosts &= set(expand_hostlist(part.nodes))
    if nodes > len(hosts):
        raise BadInput(f"{where}: world_size {world}: needs {nodes} nodes with {per_node} {sub.gpu.name} GPUs each; "
                       f"partition {part.name} has {len(hosts)}")
    if world > part.max_gpus_per_job:
        raise BadInput(f"{where}: world_size {world}: partition {part.name} allows at most "
                       f"{part.max_gpus_per_job} GPUs per job")
    return NodeLayout(nodes=nodes, ranks_per_node=per_node)


def check_rank_fences(sub: Any, site: SiteConfig, layout: NodeLayout, where: str,
                      part_groups: list[Any]) -> tuple[int, int, int]:
    """Every rank's fence fits a GPU and a node's ranks fit its memory and CPUs.
    Returns (per-GPU fence MiB, host MiB per rank, CPUs per rank): the largest rank
    decides the request (every rank asks as much)."""
    from slurm_dlrm.packing.model import (
        demand_from_estimate,
        host_limit_bytes,
        limits_from_site,
        member_fence_bytes,
        rank_members,
        usable_gpu_bytes,
    )

    limits = limits_from_site(site)
    members = rank_members(demand_from_estimate(sub.estimate, job_id=0, user="", submit_time_s=0.0))
    usable = usable_gpu_bytes(sub.gpu)
    fence = 0
    for m in members:
        f = member_fence_bytes(m, sub.gpu, limits)
        if f > usable:
            raise BadInput(f"{where}: world_size {layout.world_size}: rank {m.rank} needs {math.ceil(f / MIB)} MiB "
                           f"of GPU memory with its fence (estimate + {limits.memory_margin_pct:g}% + context); a "
                           f"{sub.gpu.name} offers {usable // MIB} MiB to one rank")
        fence = max(fence, f)
    host_rank = max(host_limit_bytes(m, limits) for m in members)
    cpus_rank = max(m.cpus for m in members)
    host_mib = max(256, math.ceil(host_rank / MIB) + 256 // layout.ranks_per_node)
    groups = [g for g in part_groups if g.gpu_model == sub.gpu.name and g.gpus >= layout.ranks_per_node]
    if not any(host_mib * layout.ranks_per_node <= g.memory_mib and cpus_rank * layout.ranks_per_node <= g.cpus
               for g in groups):
        raise BadInput(f"{where}: world_size {layout.world_size}: {layout.ranks_per_node} ranks on a node need "
                       f"{host_mib * layout.ranks_per_node} MiB of host memory and {cpus_rank * layout.ranks_per_node} "
                       f"CPUs; no {sub.gpu.name} node of the partition has that much")
    return math.ceil(fence / MIB), host_mib, cpus_rank


def _under(path: str, prefix: str) -> bool:
    path, prefix = os.path.normpath(path), os.path.normpath(prefix)
    return path == prefix or path.startswith(prefix.rstrip("/") + "/")


def check_shared_path(site: SiteConfig, user: str, path: str, where: str) -> str:
    """The checkpoint folder of a multi-node job must be one every node sees: a network
    file system (statfs, as the store asks: store/fstype.py), or a folder the site lists
    in [multinode] shared_paths. Returns what made it shared; BadInput otherwise."""
    from slurm_dlrm.store.fstype import filesystem_of

    for prefix in site.multinode.shared_paths_for(user):
        if _under(path, prefix):
            return f"listed as shared ({prefix})"
    probe = path
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        fs = filesystem_of(probe)
    except OSError as exc:
        raise BadInput(f"{where}: checkpoint folder {path}: cannot tell its file system ({exc.strerror})") from None
    if not fs.network:
        raise BadInput(f"{where}: checkpoint folder {path} is on a node-local file system ({fs.name}); a multi-node "
                       f"job's ranks on other nodes would not see it (put the spool on a shared file system, or "
                       f"list the folder in the site's [multinode] shared_paths)")
    return f"on {fs.name}"


def multinode_flags(req: Any) -> list[str]:
    """The sbatch flags of a multi-node request (unquoted); the GPU request is per node."""
    # --no-requeue: on NODE_FAIL the service requeues it (bounded, recorded), not Slurm
    return [f"--nodes={req.nodes}", f"--ntasks-per-node={req.ranks_per_node}", f"--gres={req.gres}",
            f"--cpus-per-task={req.cpus}", f"--mem={req.mem_mib}M", "--no-requeue",
            *(["--exclusive"] if req.exclusive else [])]


def launch_lines(command: list[str]) -> list[str]:
    """The batch script's body: rendezvous address and port, then one rank per task.

    The address is the first node's NodeAddr as Slurm knows it (the local cluster's nodes
    all have 127.0.0.1; a real site's, the node's own), else its host name."""
    return [
        f"export {ENV_RANKS_FROM_SLURM}=1",
        'first_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        'MASTER_ADDR=$(scontrol show node "$first_node" | tr " " "\\n" | sed -n "s/^NodeAddr=//p" | head -n 1)',
        'export MASTER_ADDR="${MASTER_ADDR:-$first_node}"',
        f"export MASTER_PORT=$(( {PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN} ))",
        'echo "slurm-dlrm: $SLURM_NTASKS ranks on $SLURM_JOB_NUM_NODES nodes ($SLURM_JOB_NODELIST); '
        'rendezvous $MASTER_ADDR:$MASTER_PORT"',
        "exec srun --kill-on-bad-exit=1 " + " ".join(shlex.quote(a) for a in command),
    ]
