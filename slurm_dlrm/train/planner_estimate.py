"""torchrec's own planner estimate, per rank, for a spec (issue 48: `estimate --planner`
prints it beside ours; benchmarks/multinode.py measures both against a run).

The planner is asked as the runner's model build asks it (slurm_dlrm/train/model.py:
the same kernels, the topology's world size and ranks per node), with the batch size
and pooling factors the spec gives, on a model built on the meta device (shapes only:
a terabyte-scale spec costs no memory). Per rank: its shards' storage (tables,
optimizer state, input and output) plus the planner's dense and KJT reservations
(HeuristicalStorageReservation); its 15% margin is a margin, not an estimate, and is
left out. Imports torch and torchrec: never on the submit path.
"""

from __future__ import annotations

from typing import Any


def planner_rank_bytes(spec: Any, world_size: int, local_world_size: int, *, device: str = "cpu",
                       hbm_cap_bytes: int | None = None) -> list[int]:
    """torchrec's estimate of each rank's bytes (index = rank)."""
    import torch
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import (
        EmbeddingShardingPlanner,
        ParameterConstraints,
        Topology,
    )
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from slurm_dlrm.train import model as runner_model

    fused = spec.optimizer.fused and (device != "cpu" or spec.optimizer.type in runner_model.CPU_FUSED_OPTIMIZERS)
    unsharded = runner_model.build_dlrm(spec, torch.device("meta"))
    if fused:
        apply_optimizer_in_backward(runner_model._sparse_optimizer_cls(spec.optimizer.type),
                                    unsharded.model.sparse_arch.parameters(), {"lr": float(spec.optimizer.lr)})
    kernel = EmbeddingComputeKernel.FUSED.value if fused else EmbeddingComputeKernel.DENSE.value
    constraints = {t.name: ParameterConstraints(compute_kernels=[kernel], pooling_factors=[t.ids_per_sample])
                   for t in spec.tables}
    kw: dict[str, Any] = {"hbm_cap": int(hbm_cap_bytes)} if hbm_cap_bytes else {}
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, local_world_size=local_world_size, compute_device=device, **kw),
        constraints=constraints, batch_size=int(spec.batch_size))
    planner.plan(unsharded, [EmbeddingBagCollectionSharder()])
    per_rank = [0] * world_size
    for so in planner._best_plan or []:  # torchrec 1.8 keeps the chosen options here
        for shard in so.shards:
            per_rank[shard.rank or 0] += int(shard.storage.ddr + shard.storage.hbm)
    reserved = 0
    res = planner._storage_reservation
    for name in ("_dense_storage", "_kjt_storage"):
        st = getattr(res, name, None)
        if st is not None:
            reserved += int(st.ddr + st.hbm)
    return [b + reserved for b in per_rank]
