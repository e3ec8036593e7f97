"""The traced estimator: for specs the analytic model does not cover (`custom_module`).

Builds the model on the `meta` device (no memory, no data), runs one forward and
backward pass over a meta batch shaped like the spec's, and follows every storage the
ops take or return with a dispatch mode (sizes from the meta tensors, frees from weakref
finalizers). The optimizer step is added analytically from the parameters (state and
step temporaries per torch's optimizers), then the CUDA rules (context, cuBLAS
workspace, caching-allocator rounding) as in the analytic model.

Why `meta` and not FakeTensorMode: on the CPU build, module initialisation on a fake
`cuda` device fails, and `KeyedJaggedTensor.from_lengths_sync` calls `.tolist()`
(DESIGN.md, environment facts). The meta batch's KJT is given its per-key lengths and
offsets up front, so nothing needs data.

Contract for a custom module: `custom_module: "pkg.module:factory"`; `factory(spec)`
returns an `nn.Module` whose `forward(batch)` takes a torchrec `Batch` (dense_features,
sparse_features as a KeyedJaggedTensor keyed by table name, labels) and returns the
loss, or a tuple whose first element is the loss (as torchrec's `DLRMTrain` does).

This module imports torch; nothing on the submit path imports it unless a spec has a
custom module.
"""

from __future__ import annotations

import importlib
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from slurm_dlrm.errors import SpecError
from slurm_dlrm.estimate.analytic import (
    HOST_RUNTIME_CPU_BYTES,
    HOST_RUNTIME_CUDA_BYTES,
    Estimate,
    allocator_rounding_bytes,
    compute_profile,
    eval_host_bytes,
    fence_bytes,
    synthetic_pool_bytes,
)
from slurm_dlrm.estimate.timeline import F32, batch_bytes, ids_per_batch
from slurm_dlrm.estimate.timeline_eval import METRICS_F64_PER_SAMPLE, eval_samples
from slurm_dlrm.site import GpuModel
from slurm_dlrm.spec import JobSpec

_STATE_MULTIPLIER = {"sgd": 0, "adagrad": 1, "rowwise_adagrad": 1, "adam": 2}
_STEP_TEMPS_PER_PARAM = {"sgd": 0, "adagrad": 1, "rowwise_adagrad": 1, "adam": 2}


class StorageTracker(TorchDispatchMode):
    """Live storage bytes over every op run under it (any device, meta included).

    A storage is keyed by its StorageImpl (`_cdata`), so views count once and meta
    storages (all at address 0) stay apart; it counts from the first op that takes or
    returns it until its StorageImpl dies."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}
        self.peak_sizes: list[int] = []

    def register(self, t: Any) -> None:
        if not isinstance(t, torch.Tensor):
            return
        st = t.untyped_storage()
        key = st._cdata
        n = st.nbytes()
        if n == 0 or key in self._sizes:
            return
        self._sizes[key] = n
        self.live += n
        if self.live > self.peak:
            self.peak = self.live
            self.peak_sizes = list(self._sizes.values())
        weakref.finalize(st, self._free, key, n)

    def _free(self, key: int, n: int) -> None:
        if self._sizes.get(key) == n:
            del self._sizes[key]
            self.live -= n

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        for t in tree_leaves((args, kwargs)):
            self.register(t)
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            self.register(t)
        return out


def load_factory(spec: JobSpec) -> Callable[[JobSpec], torch.nn.Module]:
    assert spec.custom_module is not None
    mod_name, _, attr = spec.custom_module.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as exc:
        raise SpecError("custom_module", f"cannot import {mod_name}: {exc}", spec.source) from None
    except Exception as exc:  # noqa: BLE001 - the user's module failing as it loads is bad input
        first = " ".join(str(exc).split())[:200]
        raise SpecError("custom_module", f"cannot import {mod_name}: {type(exc).__name__}: {first}",
                        spec.source) from None
    factory = getattr(mod, attr, None)
    if not callable(factory):
        raise SpecError("custom_module", f"{mod_name} has no callable {attr}", spec.source)
    return factory  # type: ignore[no-any-return]


def make_batch(spec: JobSpec, device: torch.device | str = "meta") -> Any:
    """A batch shaped like the runner's for this spec, with the KJT's per-key lengths
    and offsets given up front (no `.tolist()` on meta data)."""
    from torchrec import KeyedJaggedTensor
    from torchrec.datasets.utils import Batch

    B = spec.batch_size
    ids = [ids_per_batch(B, t) for t in spec.tables]
    offsets = [0]
    for n in ids:
        offsets.append(offsets[-1] + n)
    kjt = KeyedJaggedTensor(
        keys=[t.name for t in spec.tables],
        values=torch.zeros(sum(ids), dtype=torch.int64, device=device),
        lengths=torch.ones(len(spec.tables) * B, dtype=torch.int32, device=device),
        stride=B,
        length_per_key=ids,
        offset_per_key=offsets,
    )
    return Batch(dense_features=torch.zeros(B, spec.dense_features, device=device), sparse_features=kjt,
                 labels=torch.zeros(B, device=device))


@dataclass
class TraceResult:
    param_bytes: int
    buffer_bytes: int
    opt_state_bytes: int
    batch_bytes: int
    fwd_bwd_peak_bytes: int  # live bytes at the peak of forward + backward (all of the above included)
    opt_step_peak_bytes: int
    peak_sizes: list[int] = field(default_factory=list)
    # the held-out evaluation (issue 51; 0 with `eval: false`): the peak of the no-grad
    # forward over one held-out batch, model state included, and (`on_host`) with the
    # evaluator's predictions buffer and the metrics' temporaries as the runner holds them
    eval_peak_bytes: int = 0
    eval_peak_sizes: list[int] = field(default_factory=list)

    @property
    def train_peak_bytes(self) -> int:
        return max(self.fwd_bwd_peak_bytes, self.opt_step_peak_bytes)

    @property
    def peak_bytes(self) -> int:
        return max(self.train_peak_bytes, self.eval_peak_bytes)

    @property
    def peak_phase(self) -> str:
        if self.eval_peak_bytes > self.train_peak_bytes:
            return "evaluation"
        return "optimizer step" if self.opt_step_peak_bytes > self.fwd_bwd_peak_bytes else "forward/backward"


def _unique_bytes(tensors: Sequence[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def _logits(out: Any) -> torch.Tensor | None:
    """The logits in a forward's output, where the contract gives them: torchrec's
    DLRMTrain returns (loss, (loss, logits, labels)); a module returning the loss alone
    gives none (the evaluation then has no predictions to make)."""
    if isinstance(out, tuple | list) and len(out) > 1:
        rest = out[1]
        if isinstance(rest, tuple | list) and len(rest) > 1 and isinstance(rest[1], torch.Tensor):
            return rest[1]
        if isinstance(rest, torch.Tensor):
            return rest
    return None


def trace_eval(spec: JobSpec, model: torch.nn.Module, device: str, state_bytes: int, on_host: bool) -> tuple[int, list[int]]:
    """The runner's held-out evaluation (slurm_dlrm/train/evaluation.py `Evaluator`) of
    `model`, tracked: after `zero_grad` the model state alone (`state_bytes`: weights,
    buffers, optimizer state); a held-out batch at the training batch size and the
    forward under `torch.no_grad` (train mode, as the runner's), the click probabilities
    of its logits. `on_host` (a CPU run): the evaluator's 3 x samples float32 buffer of
    predictions, labels and planted P(click) sits beside every batch after the first,
    and the metrics' float64 temporaries come after the last
    (`timeline_eval.METRICS_F64_PER_SAMPLE`). Returns (peak bytes, live sizes at it)."""
    tracker = StorageTracker()
    tracker.live = state_bytes - _unique_bytes([*model.parameters(), *model.buffers()])
    n_samples = eval_samples(spec)
    buffer = 3 * n_samples * F32 if on_host else 0
    with tracker, torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            tracker.register(t)
        tracker.live += buffer  # the worst batch is any after the first, with the buffer beside it
        tracker.peak = tracker.live
        batch = make_batch(spec, device)
        for t in [batch.dense_features, batch.labels, batch.sparse_features.values(),
                  batch.sparse_features.lengths()]:
            tracker.register(t)
        # synthetic data: the held-out batch comes with the planted model's P(click)
        planted = spec.batch_size * F32 if on_host and spec.data.type == "synthetic" else 0
        tracker.live += planted
        out = model(batch)
        logits = _logits(out)
        probs = torch.sigmoid(logits.float()) if logits is not None else None
        del out, logits, probs, batch
        tracker.live -= planted
        peak, sizes = tracker.peak, list(tracker.peak_sizes)
    if on_host:
        peak = max(peak, state_bytes + buffer + METRICS_F64_PER_SAMPLE * 8 * n_samples + 64)
    return peak, sizes


def trace_step(spec: JobSpec, factory: Callable[[JobSpec], torch.nn.Module], device: str = "meta",
               foreach: bool = False, on_host: bool = True) -> TraceResult:
    """One forward/backward of `factory(spec)` on `device`, tracked; the optimizer step
    added from the parameters; then (evaluation on) the held-out evaluation, with the
    evaluator's buffer and the metrics in the same memory where `on_host` (a CPU run)."""
    with torch.device(device):
        model = factory(spec)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    buffers = list(model.buffers())
    param_bytes = _unique_bytes(params)
    buffer_bytes = _unique_bytes(buffers)
    kind = spec.optimizer.type
    # torch's Adagrad and Adam also keep a float32 `step` scalar per parameter
    opt_state = param_bytes * _STATE_MULTIPLIER[kind] + (4 * len(params) if _STATE_MULTIPLIER[kind] else 0)
    tracker = StorageTracker()
    tracker.live = opt_state  # the optimizer state exists from the second step on
    batch = make_batch(spec, device)
    with tracker:
        for t in [*params, *buffers, batch.dense_features, batch.labels, batch.sparse_features.values(),
                  batch.sparse_features.lengths()]:
            tracker.register(t)
        b_bytes = tracker.live - opt_state - param_bytes - buffer_bytes
        out = model(batch)
        loss = out[0] if isinstance(out, tuple | list) else out
        del out
        loss.backward()
        del loss
        grads = [p.grad for p in params if p.grad is not None]
        after_bwd = tracker.live
    # torch's optimizers: one parameter at a time on the CPU (two temporaries alive at
    # the hand-over), all at once with CUDA's foreach kernels.
    per = _STEP_TEMPS_PER_PARAM[kind]
    sizes = [p.numel() * p.element_size() for p in params]
    if foreach or not per:  # SGD (no momentum): an in-place add, no temporary at all
        temps = per * sum(sizes)
    else:
        temps = max((per * b + a for a, b in zip([0, *sizes], sizes, strict=False)), default=0)
    del grads
    for p in params:  # zero_grad (set to None) before the evaluation, as the runner
        p.grad = None
    eval_peak, eval_sizes = trace_eval(spec, model, device, param_bytes + buffer_bytes + opt_state, on_host) \
        if spec.eval.enabled else (0, [])
    return TraceResult(param_bytes=param_bytes, buffer_bytes=buffer_bytes, opt_state_bytes=opt_state,
                       batch_bytes=b_bytes, fwd_bwd_peak_bytes=tracker.peak, opt_step_peak_bytes=after_bwd + temps,
                       peak_sizes=tracker.peak_sizes, eval_peak_bytes=eval_peak, eval_peak_sizes=eval_sizes)


def estimate_traced(spec: JobSpec, gpu: GpuModel | None,
                    factory: Callable[[JobSpec], torch.nn.Module] | None = None) -> Estimate:
    """Estimate a spec with a custom module (or any `factory`) by tracing it on meta."""
    if factory is None:
        factory = load_factory(spec)
    try:
        r = trace_step(spec, factory, "meta", foreach=gpu is not None, on_host=gpu is None)
    except Exception as exc:  # noqa: BLE001 - any error of the user's factory or forward
        # user code failing on meta tensors is bad input about this spec, not a crash of ours
        first = " ".join(str(exc).split())[:200]
        raise SpecError("custom_module", f"tracing {spec.custom_module} on meta tensors failed: "
                        f"{type(exc).__name__}: {first}", spec.source) from None
    dynamic = r.peak_bytes - r.param_bytes - r.buffer_bytes - r.opt_state_bytes - r.batch_bytes
    parts = {
        "model_params": r.param_bytes,
        "model_buffers": r.buffer_bytes,
        "optimizer_state": r.opt_state_bytes,
        "input_batches": r.batch_bytes,
        "activations_and_grads": dynamic,
    }
    notes = ["traced on meta tensors: one forward/backward; optimizer step from the parameters",
             "compute profile from the spec's DLRM shape (approximate for a custom module)"]
    if r.peak_phase == "evaluation":  # the held-out batch and the no-grad forward, not a step's
        parts["input_batches"] = 0
        parts["activations_and_grads"] = 0
        parts["evaluation"] = r.eval_peak_bytes - r.param_bytes - r.buffer_bytes - r.opt_state_bytes
    if spec.eval.enabled:
        notes.append("evaluation: the no-grad forward over one held-out batch traced as well"
                     + ("" if r.peak_phase != "evaluation" else " (the peak)"))
    # the metrics library, the eval stream's pools and, on a GPU, the evaluation's host side
    host = {"runtime": HOST_RUNTIME_CUDA_BYTES if gpu is not None else HOST_RUNTIME_CPU_BYTES,
            "synthetic_data_pools": synthetic_pool_bytes(spec), "evaluation": eval_host_bytes(spec, gpu is not None)}
    if gpu is not None:
        gpu_breakdown = dict(parts)
        gpu_breakdown["cuda_context"] = gpu.context_bytes_nvml
        gpu_breakdown["cublas_workspace"] = gpu.cublas_workspace_bytes
        gpu_breakdown["allocator_rounding"] = allocator_rounding_bytes(
            r.eval_peak_sizes if r.peak_phase == "evaluation" else r.peak_sizes)
        gpu_peak = sum(gpu_breakdown.values())
        host["pinned_staging"] = batch_bytes(spec)
    else:
        gpu_breakdown, gpu_peak = {}, 0
        host["tensors"] = r.peak_bytes
    return Estimate(
        gpu_peak_bytes=gpu_peak, host_peak_bytes=sum(host.values()), gpu_breakdown=gpu_breakdown,
        host_breakdown=host, profile=compute_profile(spec, gpu), tensor_peak_bytes=r.peak_bytes,
        peak_phase=r.peak_phase,
        gpu_model=gpu.name if gpu is not None else None, method="traced", notes=tuple(notes),
        gpu_fence_bytes=fence_bytes(gpu_peak, gpu),
    )
