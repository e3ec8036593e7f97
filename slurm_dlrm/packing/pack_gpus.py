"""The pack GPUs of one refill pass (`PackGpu`): each GPU of a running pack with its
live members, this round's joiners, the GPU memory they use and the client slots
left, and the allocation's free CPUs and host memory, shared by the GPUs of one pack
node. Built from the request by `pack_gpus`, changed only by `join`.

Apart because the refill choice (`refill.py`) and the reservations that hold room on
these GPUs (`reservations.py`) both read and change this one state.
"""

from __future__ import annotations

from dataclasses import dataclass

from slurm_dlrm.errors import BadInput
from slurm_dlrm.packing.common import Node
from slurm_dlrm.packing.model import (
    JobDemand,
    PackingLimits,
    PackingRequest,
    host_limit_bytes,
    live_gpu_bytes,
    member_fence_bytes,
)
from slurm_dlrm.site import GpuModel


@dataclass
class PackGpu:
    """A pack GPU (`OpenGpu` with `pack=True`) during a refill pass."""

    key: str
    gpu: GpuModel
    node: Node  # shared by the GPUs of one pack node: the allocation's free CPUs and host memory
    live: list[JobDemand]
    joined: list[JobDemand]
    used_bytes: int
    slots: int  # members that may still be added (client and member limits, counting live ones)
    remaining_s: float | None

    @property
    def members(self) -> list[JobDemand]:
        return self.live + self.joined


def pack_gpus(request: PackingRequest) -> list[PackGpu]:
    """The request's pack GPUs, in key order. GPUs whose keys agree up to the last ':'
    (the service's f"{pack_id}:{node_index}:{gpu_index}") share one node's free CPUs and
    host memory. A pack GPU without `free_cpus` / `free_host_mem_bytes` takes no joins."""
    limits = request.limits
    out: list[PackGpu] = []
    nodes: dict[str, Node] = {}
    for og in sorted((o for o in request.open_gpus if o.pack), key=lambda o: o.key):
        try:
            gpu = request.gpu_model(og.gpu_model)
        except KeyError:
            raise BadInput(f"open_gpus[{og.key!r}].gpu_model: unknown GPU model {og.gpu_model!r}") from None
        if og.free_cpus is None or og.free_host_mem_bytes is None:
            continue
        group = og.key.rsplit(":", 1)[0] if og.key.count(":") >= 2 else og.key
        node = nodes.setdefault(group, Node(og.node_name, gpu, 0, og.free_cpus, og.free_host_mem_bytes))
        used = sum(live_gpu_bytes(j, gpu, limits) for j in og.live)
        running = max(og.members, len(og.live))
        out.append(PackGpu(og.key, gpu, node, list(og.live), [], used,
                           max(0, limits.members_per_gpu - running), og.remaining_s))
    return out


def join(pg: PackGpu, job: JobDemand, limits: PackingLimits) -> None:
    """`job` joins `pg`: it takes its fence of the GPU and its CPUs and host memory of the node."""
    pg.joined.append(job)
    pg.used_bytes += member_fence_bytes(job, pg.gpu, limits)
    pg.node.free_cpus -= job.cpus
    pg.node.free_mem_bytes -= host_limit_bytes(job, limits)

