"""What a dispatch round plans on: the partition a group of jobs asks for, its GPU nodes'
shapes, their free GPUs, CPUs and memory as Slurm reports them (read once a round), the
GPUs this user's packs already hold or wait for, and the nodes a new pack may be pinned to.

Apart from the round (service/core.py) because it is where a newcomer looks when packs
are planned onto the wrong nodes or too few GPUs; the pure arithmetic is in
service/capacity.py. `PackingService` inherits it, so `svc.free_capacity(...)` and the
others stay its methods.
"""

from __future__ import annotations

import logging
from typing import Any

from slurm_dlrm.service.sbatch_options import SbatchOptions
from slurm_dlrm.service.settings import ServiceSettings
from slurm_dlrm.site import MIB, SiteConfig

log = logging.getLogger(__name__)


class PlanView:
    """The round's view of the nodes, a part of `PackingService` (which sets these attributes)."""

    store: Any
    slurm: Any
    site: SiteConfig
    settings: ServiceSettings
    refill: Any
    # `scontrol show nodes` of this round's dispatch: None until read, then the nodes
    # or the failure's text
    _round_nodes: list[Any] | str | None

    def pinnable_nodes(self, free: Any, partition: Any, options: SbatchOptions) -> frozenset[str]:
        """Nodes a pack planned this round is pinned to (`--nodelist`, issue 43 item 2):
        those of the free view Slurm gave, one host each. None when the round planned on
        whole nodes (no host chosen), when the partition is not the site's (its nodes are
        unknown) or when the user asked for node features (`-C`: the view does not know
        them; Slurm picks among the nodes that have them)."""
        from slurm_dlrm.service.capacity import pinnable

        if free is None or partition is None or options.constraint:
            return frozenset()
        return frozenset(n.name for n in free.nodes if n.count == 1 and pinnable(n.name))

    def partition_for(self, options: SbatchOptions) -> Any:
        if options.partition:
            for p in self.site.partitions:
                if p.name == options.partition.split(",")[0]:
                    return p
            return None  # unknown to the site: Slurm will judge (and refuse) it
        return self.site.default_partition

    def node_shapes(self, partition: Any) -> tuple[Any, ...]:
        from slurm_dlrm.packing.model import NodeShape
        from slurm_dlrm.site import expand_hostlist

        allowed = set(expand_hostlist(partition.nodes)) if partition is not None else None
        shapes = []
        for g in self.site.nodes:
            hosts = [h for h in g.hostnames if allowed is None or h in allowed]
            if g.gpus > 0 and hosts:
                shapes.append(NodeShape(gpu_model=g.gpu_model, gpus=g.gpus, cpus=g.cpus,
                                        memory_bytes=g.memory_mib * MIB, count=len(hosts), name=g.names))
        return tuple(shapes)

    def free_capacity(self, partition: Any) -> Any:
        """Each usable node's free GPUs, CPUs and memory as Slurm reports them, less this
        user's packs Slurm has not started; None when Slurm cannot say (the round then
        plans on whole nodes and the store's count of busy GPUs, as before)."""
        from slurm_dlrm.service.capacity import free_capacity
        from slurm_dlrm.slurm import SlurmError
        from slurm_dlrm.slurm.parse import ParseError

        if self._round_nodes is None:
            try:
                self._round_nodes = list(self.slurm.show_nodes())
            except (SlurmError, ParseError) as exc:
                self._round_nodes = str(exc) or type(exc).__name__
        if isinstance(self._round_nodes, str):
            log.warning("scontrol show nodes failed; planning on whole nodes: %s", self._round_nodes)
            return None
        infos = self._round_nodes
        name = partition.name if partition is not None else None
        waiting, held = self.waiting_packs(name)
        free = free_capacity(self.site, infos, partition, waiting, held)
        if not free.nodes:  # Slurm names none of the site's GPU nodes: the site file is off
            log.warning("scontrol show nodes lists none of the site's GPU nodes; planning on whole nodes")
            return None
        return free

    def waiting_packs(self, partition_name: str | None) -> tuple[int, dict[str, Any]]:
        """This user's packs Slurm has not started (SUBMITTING, QUEUED), in the
        partition: (GPUs of the unpinned ones, what the pinned ones take per node). Read
        from the store each time, so a pack the round's first group submitted counts for
        the next group's plan although the nodes were read once."""
        from slurm_dlrm.service.capacity import Held
        from slurm_dlrm.store.states import JobState, PackState

        unpinned = 0
        held: dict[str, Any] = {}
        for p in self.store.packs([PackState.SUBMITTING, PackState.QUEUED], user=self.settings.user):
            if partition_name is not None and p.partition not in (None, partition_name):
                continue
            node = self.pinned_node(p)
            if node is None:
                unpinned += p.n_gpus
                continue
            shape = self.refill.shape(p) if p.pack_dir else None  # the placement file: its CPUs and memory
            h = held.get(node, Held(0))
            held[node] = Held(h.gpus + p.n_gpus, h.cpus + (shape.cpus_per_node if shape else 0),
                              h.mem_bytes + (shape.mem_per_node_bytes if shape else 0))
        # this user's multi-node jobs queued in Slurm: their whole nodes will be taken
        unpinned += sum(self._multinode_gpus([JobState.PLANNED], partition_name))
        return unpinned, held

    def _multinode_gpus(self, states: list[Any], partition_name: str | None) -> list[int]:
        """The GPUs each of this user's multi-node jobs in `states` holds (issue 48)."""
        from slurm_dlrm.service.native import multinode_gpus_held

        out = []
        for j in self.store.jobs(states, user=self.settings.user):
            part = (j.sbatch or {}).get("partition")
            if j.no_pack and (partition_name is None or part in (None, partition_name)):
                out.append(multinode_gpus_held(j))
        return out

    def pinned_node(self, pack: Any) -> str | None:
        """The node a pack's batch script names (`--nodelist`), None if it names none."""
        node = self.store.pack_plan_data(pack.id).get("node")
        return node if isinstance(node, str) and node else None

    def busy_gpus(self, partition: Any) -> int:
        """GPUs the user's packs already hold or wait for: the policy plans only the rest."""
        from slurm_dlrm.store.states import PACK_ACTIVE, JobState

        name = partition.name if partition is not None else None
        packs = sum(p.n_gpus for p in self.store.packs(PACK_ACTIVE, user=self.settings.user)
                    if name is None or p.partition in (None, name))
        # and the whole nodes of its multi-node jobs, queued or running (issue 48)
        return packs + sum(self._multinode_gpus([JobState.PLANNED, JobState.RUNNING], name))
