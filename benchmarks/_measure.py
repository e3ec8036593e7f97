"""Child process of estimator_accuracy.py: train a spec for a few steps, measure memory.

Runs one spec (JSON on argv[1]) in the training runner's execution mode, on the CPU:
the runner's own model build (`slurm_dlrm.train.model.build`: torchrec
DistributedModelParallel over DLRM / DLRM_DCN, one gloo process, fused embedding
kernels with the optimizer applied in backward), its data source and prefetcher
(`slurm_dlrm.train.data`) and its step loop. Fused Adam is not supported by fbgemm's
CPU kernels ("Optimizer adam is not supported in CPU mode", fbgemm-gpu-cpu 1.8.0), so
the runner (and this) put Adam on the non-fused path: torchrec's DENSE embedding
kernel (data-parallel in torchrec 1.8), full-table gradients, torch.optim.Adam.
A spec with `backend: torch` runs the runner's plain-torch backend instead
(slurm_dlrm/train/backend_torch.py: nn.EmbeddingBag tables, sparse gradients when fused).

Measures the peak of live tensor bytes with a TorchDispatchMode that records every
storage an op takes or returns and its free (weakref finalizer on the storage), from
model construction to the end of the last step, and the peak RSS (ru_maxrss); also
torchrec's planner estimate for the same model. Prints one JSON line.
MEASURE_DEBUG=1 prints every allocation and free and what is live at the peak.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import weakref
from typing import Any

os.environ.setdefault("LOCAL_WORLD_SIZE", "1")  # torchrec asks for it

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from slurm_dlrm.spec import JobSpec, parse_spec  # noqa: E402
from slurm_dlrm.train.metrics import peak_rss_bytes  # noqa: E402


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
        if t.is_sparse:  # backend torch's sparse table gradients: their ids and rows
            self._track(t._indices())
            self._track(t._values())
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
            if self.debug and self.phase in ("step", "eval"):
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
        # Inputs too: a tensor made outside any op (torch.from_numpy of the data
        # source's pools) counts from its first use, as its device copy would on a GPU.
        for t in tree_leaves((args, kwargs)):
            self._track(t)
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            self._track(t)
        return out


def rss_bytes() -> int:
    return peak_rss_bytes()  # VmHWM: ru_maxrss would carry the parent's peak across exec


def rss_file_bytes() -> int:
    """Resident pages of mapped files (the libraries): how many are resident depends on
    the page cache, not on the job (RssFile in /proc/self/status)."""
    with open("/proc/self/status", "rb") as f:
        for line in f:
            if line.startswith(b"RssFile:"):
                return int(line.split()[1]) * 1024
    return 0


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def planner_bytes_for(spec: JobSpec, world: int = 1) -> int:
    """torchrec's planner estimate for the same model, device and kernels."""
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import (
        EmbeddingShardingPlanner,
        ParameterConstraints,
        Topology,
    )
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from slurm_dlrm.train import model as runner_model

    fused = spec.optimizer.fused and spec.optimizer.type in runner_model.CPU_FUSED_OPTIMIZERS
    unsharded = runner_model.build_dlrm(spec, torch.device("cpu"))
    if fused:
        apply_optimizer_in_backward(runner_model._sparse_optimizer_cls(spec.optimizer.type),
                                    unsharded.model.sparse_arch.parameters(), {"lr": spec.optimizer.lr})
    kernel = EmbeddingComputeKernel.FUSED.value if fused else EmbeddingComputeKernel.DENSE.value
    constraints = {t.name: ParameterConstraints(compute_kernels=[kernel], pooling_factors=[t.ids_per_sample])
                   for t in spec.tables}
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu"),
                                       constraints=constraints, batch_size=spec.batch_size)
    planner.plan(unsharded, [EmbeddingBagCollectionSharder()])
    return planner_estimate_bytes(planner)


def planner_estimate_bytes(planner: Any) -> int:
    """What torchrec's planner budgets for this job on this device: its shard storage
    (tables, optimizer state, input and output) plus its dense and KJT reservations
    (HeuristicalStorageReservation: 6x dense parameters, 20x KJT bytes). Its 15%
    margin is a margin, not an estimate, and is left out."""
    per_rank: dict[int, int] = {}
    for so in planner._best_plan or []:  # torchrec 1.8 keeps the chosen options here
        for shard in so.shards:
            r = shard.rank or 0
            per_rank[r] = per_rank.get(r, 0) + shard.storage.ddr + shard.storage.hbm
    total = max(per_rank.values(), default=0)  # the fullest rank, as the estimator reports
    res = planner._storage_reservation
    for name in ("_dense_storage", "_kjt_storage"):
        st = getattr(res, name, None)
        if st is not None:
            total += st.ddr + st.hbm
    return int(total)


def device_copy(batch: Any, tracker: LiveTensorBytes, backend: str = "torchrec") -> Any:
    """What `batch.to(device)` gives the model on a GPU: its own copy of the batch
    (made untracked, then counted), while the source keeps its host batches."""
    from torchrec import KeyedJaggedTensor
    from torchrec.datasets.utils import Batch

    with _disable_current_modes():
        kjt = batch.sparse_features
        if backend == "torch":
            kjt.length_per_key()
        # the per-table id counts the torch backend's source computes on the host travel along
        copy = Batch(dense_features=batch.dense_features.clone(), labels=batch.labels.clone(),
                     sparse_features=KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values().clone(),
                                                       lengths=kjt.lengths().clone(),
                                                       length_per_key=kjt._length_per_key))
    for t in (copy.dense_features, copy.labels, copy.sparse_features.values(), copy.sparse_features.lengths()):
        tracker._track(t)
    return copy


def tracked_eval(tracker: LiveTensorBytes, evaluator: Any, predict: Any, done: int) -> int:
    """One evaluation after `done` steps: its own peak of live bytes (returned); the run's
    peak (and the phase it was at) kept where the evaluation did not pass it."""
    tracker.phase, before = "eval", tracker.peak
    tracker.peak = tracker.live
    evaluator.run(predict, done, 0.0)
    eval_peak = tracker.peak
    if tracker.peak < before:
        tracker.peak, tracker.peak_phase = before, "step"
    tracker.phase = "step"
    return eval_peak


def run(spec: JobSpec, steps: int, rank: int = 0, world: int = 1, init_file: str | None = None) -> dict[str, Any]:
    """Train like `slurm-dlrm train` does (slurm_dlrm/train/runner.py: Trainer.run):
    the runner's model build, data source and prefetcher, and its step loop."""
    from slurm_dlrm.train.backends import TORCH, build, resolve
    from slurm_dlrm.train.data import Prefetcher, make_source
    from slurm_dlrm.train.evaluation import Evaluator
    from slurm_dlrm.train.heldout import HeldOut
    from slurm_dlrm.train.hostmem import fix_malloc_mmap_threshold
    from slurm_dlrm.train.runner import predict_clicks

    t0 = time.time()
    fix_malloc_mmap_threshold()  # as the runner's run() does
    cpu = torch.device("cpu")
    os.environ["LOCAL_WORLD_SIZE"] = str(int(spec.gpus_per_node or world))  # as srun's ranks get it
    if world == 1:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    backend, _why = resolve(spec.backend)
    planner_bytes = planner_bytes_for(spec, world) if rank == 0 and backend != TORCH else 0
    if spec.eval.enabled and backend != TORCH:  # the runner imports torchrec.metrics at start
        import torchrec.metrics.accuracy
        import torchrec.metrics.auc
        import torchrec.metrics.calibration
        import torchrec.metrics.ne  # noqa: F401
    planner_ranks: list[int] = []
    if rank == 0 and backend != TORCH and world > 1:
        from slurm_dlrm.train.planner_estimate import planner_rank_bytes

        planner_ranks = planner_rank_bytes(spec, world, int(spec.gpus_per_node or world))
    rss_baseline = current_rss_bytes()
    tracker = LiveTensorBytes()
    tracker.debug = tracker.debug and rank == 0
    # The data source (the synthetic source's ring of ready batches, numpy pools) is
    # host memory on a GPU: made outside the tracker; it shows in the peak RSS.
    # (backend torch: the runner's HostLengths counts each table's ids on the host batch;
    # device_copy does that here, untracked, since on a GPU it is host work)
    source = make_source(spec, rank, world)
    with tracker:
        torch.manual_seed(spec.seed * 1000)
        # the topology's ranks per node: the spec's gpus_per_node (a multi-node job), else one node
        built = build(backend, spec, cpu, world, int(spec.gpus_per_node or world))
        static_bytes = tracker.live
        model, optimizer = built.model, built.optimizer
        model.train()
        tracker.phase = "step"
        if tracker.debug:
            print(f"STATIC {static_bytes}", file=sys.stderr)
        # the runner's Trainer._autocast: forward under autocast when mixed precision is on
        amp = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(spec.mixed_precision)

        def autocast() -> Any:
            return torch.autocast("cpu", dtype=amp) if amp is not None else contextlib.nullcontext()

        evaluator = None
        if spec.eval.enabled:  # as the runner's setup: the held-out set after the model
            held = HeldOut(spec, rank, world)
            for kept in held.kept or []:  # Criteo TSV: parsed once and kept, host memory from here on
                for t in (kept.dense_features, kept.labels, kept.sparse_features.values(),
                          kept.sparse_features.lengths()):
                    tracker._track(t)
            evaluator = Evaluator(held, int(spec.eval.every_steps), steps, world_size=world,
                                  backend="reference" if backend == TORCH else "torchrec")
        prefetch = Prefetcher(source, 0, steps, spec.loader_workers, spec.prefetch_batches, cpu)
        loss_sum = torch.zeros(())
        eval_peak = 0
        batches = iter(prefetch)
        while True:
            # The source makes its host batches outside the tracker, as a loader thread
            # would (dispatch modes are per thread): a synthetic source makes them inline,
            # and its labels draw reads the ring's planted P(click) with `.numpy()`, a
            # `detach` dispatched here, which made the tracker count that ring entry's
            # storage (host memory, held for the whole run) from then on: steps x batch x
            # 4 bytes that no device ever holds (issue 51: the whole residual where the
            # evaluation is the peak).
            with _disable_current_modes():
                got = next(batches, None)
            if got is None:
                break
            step, host_batch = got
            batch = device_copy(host_batch, tracker, backend)
            del host_batch, got
            optimizer.zero_grad()
            with autocast():
                loss, _ = model(batch)
            loss.backward()
            optimizer.step()
            loss_sum += loss.detach()
            done = step + 1
            if evaluator is not None and evaluator.due(done):  # the runner's loop (Trainer.run)
                del batch, loss, _
                optimizer.zero_grad()
                eval_peak = max(eval_peak, tracked_eval(
                    tracker, evaluator, lambda b: predict_clicks(built, cpu, autocast, b), done))
                batch = loss = _ = None
            if tracker.debug:
                print(f"STEP END live={tracker.live} peak={tracker.peak}", file=sys.stderr)
        prefetch.close()
        del batch, loss, _, evaluator
    del source
    dist.destroy_process_group()
    if tracker.debug:
        for line in tracker.at_peak:
            print("ATPEAK", line, file=sys.stderr)
    return {"peak_tensor_bytes": tracker.peak, "planner_bytes": planner_bytes, "planner_rank_bytes": planner_ranks,
            "static_tensor_bytes": static_bytes,
            "peak_phase": tracker.peak_phase, "eval_peak_tensor_bytes": eval_peak, "peak_rss_bytes": rss_bytes(),
            "rss_baseline_bytes": rss_baseline,
            "rss_file_bytes": rss_file_bytes(),
            "seconds": round(time.time() - t0, 2)}


def run_custom(spec: JobSpec, steps: int) -> dict[str, Any]:
    """A `custom_module` spec (the traced estimator's, slurm_dlrm/estimate/traced.py): its
    factory's module trained `steps` steps on the CPU with the spec's torch optimizer,
    then evaluated as the runner evaluates (its `Evaluator` over the spec's `HeldOut`
    set, predictions from the forward's logits as torchrec's DLRMTrain returns them),
    every storage followed from the module's build on. The runner does not train custom
    modules (a job gives a `command`); this is the evaluation it would run."""
    from slurm_dlrm.estimate.traced import load_factory, make_batch
    from slurm_dlrm.train.evaluation import Evaluator
    from slurm_dlrm.train.heldout import HeldOut

    t0 = time.time()
    optimizers = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "adam": torch.optim.Adam}
    if spec.optimizer.type not in optimizers:
        raise SystemExit(f"custom module: no torch optimizer for {spec.optimizer.type}")
    factory = load_factory(spec)
    tracker = LiveTensorBytes()
    eval_peak = 0
    with tracker:
        torch.manual_seed(spec.seed * 1000)
        model = factory(spec)
        model.train()
        for t in [*model.parameters(), *model.buffers()]:
            tracker._track(t)
        static_bytes = tracker.live
        optimizer = optimizers[spec.optimizer.type](model.parameters(), lr=spec.optimizer.lr)
        evaluator = Evaluator(HeldOut(spec), int(spec.eval.every_steps), steps, backend="reference") \
            if spec.eval.enabled else None
        tracker.phase = "step"

        def predict(b: Any) -> tuple[torch.Tensor, torch.Tensor]:
            out = model(b)
            return torch.sigmoid(out[1][1].float()), b.labels

        for done in range(1, steps + 1):
            with _disable_current_modes():  # made by the source, outside (as _measure's runs)
                batch = make_batch(spec, "cpu")
            batch = device_copy(batch, tracker)
            optimizer.zero_grad()
            loss = model(batch)[0]
            loss.backward()
            optimizer.step()
            del loss, batch
            if evaluator is not None and evaluator.due(done):
                optimizer.zero_grad()
                eval_peak = max(eval_peak, tracked_eval(tracker, evaluator, predict, done))
    return {"peak_tensor_bytes": tracker.peak, "planner_bytes": 0, "static_tensor_bytes": static_bytes,
            "peak_phase": tracker.peak_phase, "eval_peak_tensor_bytes": eval_peak, "peak_rss_bytes": rss_bytes(),
            "rss_file_bytes": rss_file_bytes(), "seconds": round(time.time() - t0, 2)}


def _rank_main(rank: int, spec_json: str, steps: int, world: int, init_file: str, out_dir: str) -> None:
    result = run(parse_spec(json.loads(spec_json)), steps, rank, world, init_file)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    # Out without the teardown, as the runner's ranks leave (train/cli exit_now): freeing
    # DDP's Reducer here holds the GIL while ~ProcessGroupGloo joins its worker threads,
    # and a worker destroying its last AsyncWork waits for the GIL (its ThreadLocalState
    # holds a Python object: this tracker): a deadlock (pytorch/pytorch#56297; a 3-rank
    # backend-torch child hung here 12 min, py-spy --native showed both stacks).
    os._exit(0)


def main() -> None:
    spec = parse_spec(json.loads(sys.argv[1]))
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    if spec.custom_module:
        print(json.dumps(run_custom(spec, steps)))
        return
    if spec.world_size == 1:
        print(json.dumps(run(spec, steps)))
        return
    # world_size > 1: one process per rank (gloo, a file rendezvous), as the runner's
    # local launcher does; report the fullest rank.
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank_main, args=(sys.argv[1], steps, spec.world_size, os.path.join(tmp, "rdzv"), tmp),
                 nprocs=spec.world_size, join=True)
        ranks = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(spec.world_size)]
    out = max(ranks, key=lambda r: r["peak_tensor_bytes"])
    out["planner_bytes"] = ranks[0]["planner_bytes"]
    fullest_rss = max(ranks, key=lambda r: r["peak_rss_bytes"])
    out["peak_rss_bytes"] = fullest_rss["peak_rss_bytes"]
    out["rss_file_bytes"] = fullest_rss.get("rss_file_bytes", 0)
    out["per_rank_peak_tensor_bytes"] = [r["peak_tensor_bytes"] for r in ranks]
    out["planner_rank_bytes"] = ranks[0]["planner_rank_bytes"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
