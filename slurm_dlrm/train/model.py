"""The model a spec describes: torchrec DLRM (or DLRM_DCN), sharded by
DistributedModelParallel, with the spec's optimizer.

Fused path (default): the embedding optimizer runs inside fbgemm's TBE kernels in the
backward pass (`apply_optimizer_in_backward`), a dense optimizer of the same family
updates the MLPs. Non-fused path (`optimizer.fused: false`, or Adam on the CPU, which
fbgemm-gpu-cpu 1.8.0 refuses with "Optimizer adam is not supported in CPU mode"):
torchrec's DENSE embedding kernel and one ordinary torch optimizer over every
parameter; same maths, more memory (full-table gradients and optimizer state).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DefaultDataParallelWrapper
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRMTrain
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.types import DataType

from slurm_dlrm.errors import SpecError
from slurm_dlrm.estimate.backend import TORCHREC
from slurm_dlrm.train.built import Built

__all__ = ["Built", "build", "build_dlrm", "plan_text", "CPU_FUSED_OPTIMIZERS"]

log = logging.getLogger(__name__)

_DATA_TYPES = {"fp32": DataType.FP32, "fp16": DataType.FP16, "bf16": DataType.BF16}
# placement -> fbgemm kernel on a GPU: HBM, host memory cached in HBM, host memory.
_GPU_KERNELS = {
    "hbm": EmbeddingComputeKernel.FUSED,
    "uvm": EmbeddingComputeKernel.FUSED_UVM_CACHING,
    "host": EmbeddingComputeKernel.FUSED_UVM,
}
# The sparse optimizers fbgemm's CPU kernels implement (fbgemm-gpu-cpu 1.8.0).
CPU_FUSED_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")


def _dense_optimizer_cls(kind: str) -> Callable[..., torch.optim.Optimizer]:
    return {
        "sgd": torch.optim.SGD,
        "adagrad": torch.optim.Adagrad,
        "rowwise_adagrad": torch.optim.Adagrad,  # row-wise only makes sense for tables
        "adam": torch.optim.Adam,
    }[kind]


def _sparse_optimizer_cls(kind: str) -> Callable[..., torch.optim.Optimizer]:
    return {
        "sgd": torch.optim.SGD,
        "adagrad": torch.optim.Adagrad,
        "rowwise_adagrad": RowWiseAdagrad,
        "adam": torch.optim.Adam,
    }[kind]


def build_dlrm(spec: Any, device: torch.device, bf16_tables_as_fp32: bool = False) -> DLRMTrain:
    """The unsharded model; embedding tables on `meta` so DMP allocates them sharded."""
    if getattr(spec, "custom_module", None):
        raise SpecError("custom_module", "the built-in runner trains torchrec DLRM only; give a `command` for a custom model")
    tables = [
        EmbeddingBagConfig(
            name=t.name,
            embedding_dim=int(t.dim),
            num_embeddings=int(t.rows),
            feature_names=[t.name],
            data_type=DataType.FP32 if bf16_tables_as_fp32 and t.dtype == "bf16" else _DATA_TYPES[t.dtype],
        )
        for t in spec.tables
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    common: dict[str, Any] = dict(
        embedding_bag_collection=ebc,
        dense_in_features=int(spec.dense_features),
        dense_arch_layer_sizes=list(spec.bottom_mlp),
        over_arch_layer_sizes=list(spec.top_mlp),
        dense_device=device,
    )
    if spec.interaction.type == "dcn":
        module: DLRM = DLRM_DCN(dcn_num_layers=int(spec.interaction.layers),
                                dcn_low_rank_dim=int(spec.interaction.low_rank), **common)
    else:
        module = DLRM(**common)
    return DLRMTrain(module)


def build(spec: Any, device: torch.device, world_size: int, local_world_size: int) -> Built:
    """Build, shard and attach optimizers. Call after init_process_group and
    torch.manual_seed (the dense layers are initialised here)."""
    opt = spec.optimizer
    notes: list[str] = []
    on_cpu = device.type == "cpu"
    fused = bool(opt.fused)
    if fused and on_cpu and opt.type not in CPU_FUSED_OPTIMIZERS:
        fused = False
        notes.append(f"optimizer {opt.type}: fbgemm's CPU kernels have no fused {opt.type}; "
                     "using the non-fused DENSE embedding kernel with torch.optim (more memory, same maths)")
    if on_cpu and any(t.placement != "hbm" for t in spec.tables):
        notes.append("table placement uvm/host applies on a GPU only; on the CPU every table is in host memory")

    # fbgemm-gpu-cpu 1.8.0: "split_embedding_cpu_forward_2" not implemented for 'BFloat16'.
    bf16_as_fp32 = on_cpu and any(t.dtype == "bf16" for t in spec.tables)
    if bf16_as_fp32:
        notes.append("bf16 tables: fbgemm's CPU kernels have no bf16 lookup; they are kept in fp32 on the CPU")
    train_model = build_dlrm(spec, device, bf16_tables_as_fp32=bf16_as_fp32)
    constraints: dict[str, ParameterConstraints] = {}
    for t in spec.tables:
        if not fused:
            kernel = EmbeddingComputeKernel.DENSE
        elif on_cpu:
            kernel = EmbeddingComputeKernel.FUSED
        else:
            kernel = _GPU_KERNELS[t.placement]
        constraints[t.name] = ParameterConstraints(compute_kernels=[kernel.value])
    if fused:
        apply_optimizer_in_backward(_sparse_optimizer_cls(opt.type),
                                    train_model.model.sparse_arch.parameters(), {"lr": float(opt.lr)})

    topology_kw: dict[str, Any] = {}
    if device.type == "cuda":
        _free, total = torch.cuda.mem_get_info(device)  # honours an MPS memory limit
        topology_kw["hbm_cap"] = int(total)
    topology = Topology(world_size=world_size, local_world_size=local_world_size,
                        compute_device=device.type, **topology_kw)
    sharders: list[Any] = [EmbeddingBagCollectionSharder()]
    planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints)
    plan = planner.collective_plan(train_model, sharders, dist.GroupMember.WORLD)
    # DDP rebuilds its gradient buckets in the order the first step's gradients arrive;
    # a run resumed from a checkpoint would then sum the dense gradients over the ranks
    # in other groupings for one step than the uninterrupted run (gloo's ring sums each
    # position of a bucket starting at another rank): last-bit differences that grow.
    # Buckets kept as built (no rebuild without static_graph and with
    # find_unused_parameters, torch 2.13's Reducer::should_rebuild_buckets) make a
    # resume bit-exact across ranks (issue 48); the cost is one graph walk per step.
    # One rank sums nothing across ranks, so the bucket order cannot change a bit there:
    # it skips the walk (issue 47: 3-6 % of a small CPU model's step, runner_overhead.py).
    wrapper = DefaultDataParallelWrapper(static_graph=False, find_unused_parameters=world_size > 1)
    model = DistributedModelParallel(module=train_model, device=device, plan=plan, sharders=sharders,
                                     data_parallel_wrapper=wrapper)

    lr = float(opt.lr)
    lazy: list[KeyedOptimizer] = []
    if fused:
        dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())),
                                      lambda ps: _dense_optimizer_cls(opt.type)(ps, lr=lr))
        optimizer: KeyedOptimizer = CombinedOptimizer([model.fused_optimizer, dense])
        lazy.append(dense)
    else:
        params = dict(model.named_parameters())
        # Model order, not set order: the optimizer's state (and so the peak memory and
        # the checkpoint's key order) must not vary with string hashing between runs.
        table_keys = [k for k in params if ".embedding_bags." in k]
        emb = KeyedOptimizerWrapper({k: params[k] for k in table_keys},
                                    lambda ps: _sparse_optimizer_cls(opt.type)(ps, lr=lr))
        dense = KeyedOptimizerWrapper({k: p for k, p in params.items() if k not in table_keys},
                                      lambda ps: _dense_optimizer_cls(opt.type)(ps, lr=lr))
        optimizer = CombinedOptimizer([("embedding", emb), ("dense", dense)])
        lazy.extend([emb, dense])
    return Built(model=model, optimizer=optimizer, fused=fused, lazy_optimizers=lazy, notes=notes, backend=TORCHREC)


def plan_text(model: DistributedModelParallel) -> str:
    """A stable description of the sharding plan (checkpoints are only loaded into the
    same plan)."""
    return str(model.plan)
