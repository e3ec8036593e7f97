"""What the cluster has free right now, node by node, for a dispatch round.

The packing policies place a new pack on a node that has its GPUs, CPUs and host memory
free (the simulator tracks exactly that). Planning against whole nodes instead plans
packs Slurm cannot start: they wait in Slurm's queue behind a pack that refill keeps
alive, for minutes (issue 29: the live run's longest waits were such packs). So each
round reads `scontrol show nodes` (the CLI seam) and offers each usable node's free
GPUs (GresUsed: whole GPUs and MPS/shard shares), CPUs (less one for a new pack's
agent) and memory (less the agent's), minus what this user's own packs already asked
Slurm for and not yet got (they hold nothing yet, and will).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slurm_dlrm.packing.model import AGENT_CPUS, AGENT_MEM_MIB
from slurm_dlrm.site import MIB, SiteConfig, expand_hostlist
from slurm_dlrm.slurm.parse import busy_gpu_count


@dataclass(frozen=True)
class FreeCapacity:
    nodes: tuple[Any, ...]  # NodeShape per usable node, count 1, its free resources
    free_gpus: int  # GPUs a new pack may take this round, all nodes together


def free_capacity(site: SiteConfig, node_infos: list[Any], partition: Any, waiting_gpus: int) -> FreeCapacity:
    """Free resources per node from `scontrol show nodes` (NodeInfo), for the partition's
    GPU nodes the site describes; `waiting_gpus`: GPUs of this user's packs that Slurm
    has queued but not started."""
    from slurm_dlrm.packing.model import NodeShape

    allowed = set(expand_hostlist(partition.nodes)) if partition is not None else None
    group_of = {h: g for g in site.nodes if g.gpus > 0 for h in g.hostnames}
    shapes = []
    for info in sorted(node_infos, key=lambda n: n.name):
        g = group_of.get(info.name)
        if g is None or not info.usable or (allowed is not None and info.name not in allowed):
            continue
        gpus = max(0, g.gpus - busy_gpu_count(info.gres_used))
        cpus = max(0, min(g.cpus, info.cpus or g.cpus) - info.cpus_alloc - AGENT_CPUS)
        mem_mib = max(0, min(g.memory_mib, info.real_memory_mib or g.memory_mib) - info.alloc_memory_mib
                      - AGENT_MEM_MIB)
        shapes.append(NodeShape(gpu_model=g.gpu_model, gpus=gpus, cpus=cpus, memory_bytes=mem_mib * MIB, count=1,
                                name=info.name))
    return FreeCapacity(tuple(shapes), max(0, sum(s.gpus for s in shapes) - waiting_gpus))


__all__ = ["FreeCapacity", "free_capacity"]
