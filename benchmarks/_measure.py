"""Child process of estimator_accuracy.py: train a spec for a few steps, measure memory.

Runs one spec (JSON on argv[1]) the way the training runner does on a GPU, but on the
CPU: torchrec `DistributedModelParallel` (one process, gloo) over DLRM / DLRM_DCN with
fused embedding kernels (the optimizer applied in backward via
`apply_optimizer_in_backward`, as torchrec's dlrm_main does). Fused Adam is not
supported by fbgemm's CPU kernels ("Optimizer adam is not supported in CPU mode",
fbgemm-gpu-cpu 1.8.0), so a spec with `optimizer.fused: false` or Adam uses the
non-fused path: the `dense` embedding kernel (data-parallel in torchrec 1.8), full-table
gradients and a torch
optimizer over the tables.

Measures the peak of live tensor bytes with a TorchDispatchMode that records every
storage an op returns and its free (weakref finalizer on the storage), from model
construction to the end of the last step, and the peak RSS (ru_maxrss). Prints one
JSON line. The model is built here because the runner's slurm_dlrm/train/ had not
landed when this was written; keep the two in the same execution mode.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import weakref
from collections import deque
from typing import Any

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", str(20000 + os.getpid() % 20000))
os.environ.setdefault("LOCAL_WORLD_SIZE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from slurm_dlrm.spec import JobSpec, parse_spec  # noqa: E402


class LiveTensorBytes(TorchDispatchMode):
    """Peak of live storage bytes over every op that runs under it."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}
        self.phase = "init"
        self.peak_phase = "init"
        self.debug = bool(os.environ.get("MEASURE_DEBUG"))
        self._op = ""
        self._what: dict[int, str] = {}
        self.at_peak: list[str] = []

    def _track(self, t: Any) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        st = t.untyped_storage()
        key = st.data_ptr()
        n = st.nbytes()
        if n == 0 or key in self._sizes:
            return
        self._sizes[key] = n
        if self.debug:
            self._what[key] = f"{self._op} {tuple(t.shape)} {t.dtype}"
        self.live += n
        if self.live > self.peak:
            self.peak = self.live
            self.peak_phase = self.phase
            if self.debug and self.phase == "step":
                self.at_peak = [f"{self._sizes[k]} {self._what.get(k, '?')}" for k in self._sizes]
        if self.debug:
            print(f"ALLOC {n} {self._op} {tuple(t.shape)} {t.dtype} live={self.live}", file=sys.stderr)
        weakref.finalize(st, self._free, key, n)

    def _free(self, key: int, n: int) -> None:
        if self._sizes.get(key) == n:
            del self._sizes[key]
            self.live -= n
            if self.debug:
                print(f"FREE {n} live={self.live}", file=sys.stderr)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self._op = str(func)
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            self._track(t)
        return out


def rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def build(spec: JobSpec) -> tuple[Any, Any]:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType  # noqa: F401  (loads the CPU ops)
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import (
        EmbeddingShardingPlanner,
        ParameterConstraints,
        Topology,
    )
    from torchrec.distributed.types import ShardingEnv
    from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRMTrain
    from torchrec.modules.embedding_configs import DataType
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    dtypes = {"fp32": DataType.FP32, "fp16": DataType.FP16, "bf16": DataType.BF16}
    tables = [EmbeddingBagConfig(name=t.name, embedding_dim=t.dim, num_embeddings=t.rows,
                                 feature_names=[f"f{i}"], data_type=dtypes[t.dtype])
              for i, t in enumerate(spec.tables)]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    cpu = torch.device("cpu")
    if spec.interaction.type == "dcn":
        assert spec.interaction.layers is not None and spec.interaction.low_rank is not None
        dlrm: Any = DLRM_DCN(ebc, spec.dense_features, list(spec.bottom_mlp), list(spec.top_mlp),
                             dcn_num_layers=spec.interaction.layers, dcn_low_rank_dim=spec.interaction.low_rank,
                             dense_device=cpu)
    else:
        dlrm = DLRM(ebc, spec.dense_features, list(spec.bottom_mlp), list(spec.top_mlp), dense_device=cpu)
    model = DLRMTrain(dlrm)

    opt = spec.optimizer
    lr = opt.lr
    fused = opt.fused and opt.type != "adam"  # fused Adam: GPU only (see module doc)
    dense_cls = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "rowwise_adagrad": torch.optim.Adagrad,
                 "adam": torch.optim.Adam}[opt.type]
    emb_cls = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "rowwise_adagrad": RowWiseAdagrad,
               "adam": torch.optim.Adam}[opt.type]
    kernel = EmbeddingComputeKernel.FUSED.value if fused else EmbeddingComputeKernel.DENSE.value
    if fused:
        apply_optimizer_in_backward(emb_cls, model.model.sparse_arch.parameters(), {"lr": lr})
    # torchrec 1.8 offers the dense (non-fused) kernel only with data-parallel sharding.
    sharding = "table_wise" if fused else "data_parallel"
    constraints = {t.name: ParameterConstraints(sharding_types=[sharding], compute_kernels=[kernel],
                                                pooling_factors=[t.ids_per_sample])
                   for t in spec.tables}
    env = ShardingEnv.from_process_group(dist.GroupMember.WORLD)
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cpu"), constraints=constraints,
                                       batch_size=spec.batch_size)
    sharders: list[Any] = [EmbeddingBagCollectionSharder()]
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    global PLANNER_BYTES
    PLANNER_BYTES = planner_estimate_bytes(planner)
    dmp = DistributedModelParallel(model, env=env, device=cpu, sharders=sharders, plan=plan)
    params = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    dense_params = {k: v for k, v in params.items() if "embedding_bag" not in k}
    emb_params = {k: v for k, v in params.items() if "embedding_bag" in k}
    opts: list[Any] = [KeyedOptimizerWrapper(dense_params, lambda p: dense_cls(p, lr=lr))]
    if fused:
        opts.insert(0, dmp.fused_optimizer)
    else:
        opts.insert(0, KeyedOptimizerWrapper(emb_params, lambda p: emb_cls(p, lr=lr)))
    return dmp, CombinedOptimizer(opts)


PLANNER_BYTES = 0


def planner_estimate_bytes(planner: Any) -> int:
    """What torchrec's planner budgets for this job on this device: its shard storage
    (tables, optimizer state, input and output) plus its dense and KJT reservations
    (HeuristicalStorageReservation: 6x dense parameters, 20x KJT bytes). Its 15%
    margin is a margin, not an estimate, and is left out."""
    total = 0
    for so in planner._best_plan or []:  # torchrec 1.8 keeps the chosen options here
        for shard in so.shards:
            total += shard.storage.ddr + shard.storage.hbm
    res = planner._storage_reservation
    for name in ("_dense_storage", "_kjt_storage"):
        st = getattr(res, name, None)
        if st is not None:
            total += st.ddr + st.hbm
    return int(total)


def ids_per_table(spec: JobSpec) -> list[int]:
    return [int(spec.batch_size * t.ids_per_sample) for t in spec.tables]


def make_batch(spec: JobSpec) -> Any:
    """One batch as a loader delivers it: dense f32, lengths int32, values int64, labels f32."""
    from torchrec import KeyedJaggedTensor
    from torchrec.datasets.utils import Batch

    B = spec.batch_size
    lengths = torch.empty(len(spec.tables) * B, dtype=torch.int32)
    for i, t in enumerate(spec.tables):
        p = t.ids_per_sample
        # lengths whose sum is int(B * p): floor((j+1)p) - floor(jp)
        idx = torch.arange(B + 1, dtype=torch.float64).mul_(p).floor_()
        lengths[i * B:(i + 1) * B] = (idx[1:] - idx[:-1]).to(torch.int32)
        del idx
    n_ids = sum(ids_per_table(spec))
    values = torch.randint(0, min(t.rows for t in spec.tables), (n_ids,), dtype=torch.int64)
    kjt = KeyedJaggedTensor(keys=[f"f{i}" for i in range(len(spec.tables))], values=values, lengths=lengths)
    return Batch(dense_features=torch.rand(B, spec.dense_features), sparse_features=kjt,
                 labels=torch.randint(0, 2, (B,)).float())


def run(spec: JobSpec, steps: int) -> dict[str, Any]:
    t0 = time.time()
    dist.init_process_group("gloo", rank=0, world_size=1)
    rss_baseline = current_rss_bytes()
    tracker = LiveTensorBytes()
    with tracker:
        dmp, optim = build(spec)
        static_bytes = tracker.live
        dmp.train()
        tracker.phase = "step"
        if tracker.debug:
            print(f"STATIC {static_bytes}", file=sys.stderr)
        # The loader keeps `prefetch_batches` batches ready besides the one in use.
        ready = deque(make_batch(spec) for _ in range(spec.prefetch_batches))
        for _ in range(steps):
            ready.append(make_batch(spec))
            batch = ready.popleft()
            optim.zero_grad()
            loss, _out = dmp(batch)
            loss.backward()
            optim.step()
            del batch, loss, _out
            if tracker.debug:
                print(f"STEP END live={tracker.live} peak={tracker.peak}", file=sys.stderr)
    dist.destroy_process_group()
    if tracker.debug:
        for line in tracker.at_peak:
            print("ATPEAK", line, file=sys.stderr)
    return {"peak_tensor_bytes": tracker.peak, "planner_bytes": PLANNER_BYTES, "static_tensor_bytes": static_bytes,
            "peak_phase": tracker.peak_phase, "peak_rss_bytes": rss_bytes(), "rss_baseline_bytes": rss_baseline,
            "seconds": round(time.time() - t0, 2)}


def main() -> None:
    spec = parse_spec(json.loads(sys.argv[1]))
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    print(json.dumps(run(spec, steps)))


if __name__ == "__main__":
    main()
