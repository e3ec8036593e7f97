"""What the cluster has free right now, node by node, for a dispatch round.

The packing policies place a new pack on a node that has its GPUs, CPUs and host memory
free (the simulator tracks exactly that). Planning against whole nodes instead plans
packs Slurm cannot start: they wait in Slurm's queue behind a pack that refill keeps
alive, for minutes (issue 29: the live run's longest waits were such packs). So each
round reads `scontrol show nodes` (the CLI seam) and offers each usable node's free
GPUs (GresUsed: whole GPUs and MPS/shard shares), CPUs (less one for a new pack's
agent) and memory (less the agent's), minus what this user's own packs already asked
Slurm for and not yet got (they hold nothing yet, and will): a pack pinned to its node
(`--nodelist`, issue 43) is taken from that node's GPUs, CPUs and memory; any other from
the GPU count only.

The service reads the nodes once per round (`PackingService.round_node_infos`), however
many pack keys it plans.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from slurm_dlrm.packing.model import AGENT_CPUS, AGENT_MEM_MIB
from slurm_dlrm.site import MIB, SiteConfig, expand_hostlist
from slurm_dlrm.slurm.parse import busy_gpu_count


@dataclass(frozen=True)
class FreeCapacity:
    nodes: tuple[Any, ...]  # NodeShape per usable node, count 1, its free resources
    free_gpus: int  # GPUs a new pack may take this round, all nodes together


@dataclass(frozen=True)
class Held:
    """What a pack Slurm has not started will take on the node it is pinned to."""

    gpus: int
    cpus: int = 0
    mem_bytes: int = 0


# A node name as `scontrol show nodes` prints it and `--nodelist` takes it whole (no
# hostlist brackets, commas or spaces): only such a name is pinned.
_NODE_NAME = r"[A-Za-z0-9][A-Za-z0-9_.-]*"


def pinnable(name: str) -> bool:
    return bool(name) and re.fullmatch(_NODE_NAME, name) is not None


def free_capacity(site: SiteConfig, node_infos: list[Any], partition: Any, waiting_gpus: int,
                  held: Mapping[str, Held] | None = None) -> FreeCapacity:
    """Free resources per node from `scontrol show nodes` (NodeInfo), for the partition's
    GPU nodes the site describes; `waiting_gpus`: GPUs of this user's unpinned packs that
    Slurm has queued but not started; `held`: per node, what this user's pinned packs
    that Slurm has not started will take there."""
    from slurm_dlrm.packing.model import NodeShape

    held = held or {}

    allowed = set(expand_hostlist(partition.nodes)) if partition is not None else None
    group_of = {h: g for g in site.nodes if g.gpus > 0 for h in g.hostnames}
    shapes = []
    for info in sorted(node_infos, key=lambda n: n.name):
        g = group_of.get(info.name)
        if g is None or not info.usable or (allowed is not None and info.name not in allowed):
            continue
        h = held.get(info.name, Held(0))
        gpus = max(0, g.gpus - busy_gpu_count(info.gres_used) - h.gpus)
        cpus = max(0, min(g.cpus, info.cpus or g.cpus) - info.cpus_alloc - h.cpus - AGENT_CPUS)
        mem_mib = max(0, min(g.memory_mib, info.real_memory_mib or g.memory_mib) - info.alloc_memory_mib
                      - h.mem_bytes // MIB - AGENT_MEM_MIB)
        shapes.append(NodeShape(gpu_model=g.gpu_model, gpus=gpus, cpus=cpus, memory_bytes=mem_mib * MIB, count=1,
                                name=info.name))
    return FreeCapacity(tuple(shapes), max(0, sum(s.gpus for s in shapes) - waiting_gpus))


__all__ = ["FreeCapacity", "Held", "free_capacity", "pinnable"]
