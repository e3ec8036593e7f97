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
    fence_bytes,
    synthetic_pool_bytes,
)
from slurm_dlrm.estimate.timeline import batch_bytes, ids_per_batch
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

    @property
    def peak_bytes(self) -> int:
        return max(self.fwd_bwd_peak_bytes, self.opt_step_peak_bytes)


def _unique_bytes(tensors: Sequence[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def trace_step(spec: JobSpec, factory: Callable[[JobSpec], torch.nn.Module], device: str = "meta",
               foreach: bool = False) -> TraceResult:
    """One forward/backward of `factory(spec)` on `device`, tracked; the optimizer step
    added from the parameters."""
    with torch.device(device):
        model = factory(spec)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    buffers = list(model.buffers())
    param_bytes = _unique_bytes(params)
    buffer_bytes = _unique_bytes(buffers)
    kind = spec.optimizer.type
    opt_state = param_bytes * _STATE_MULTIPLIER[kind]
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
    if foreach:
        temps = per * sum(sizes)
    else:
        temps = max((per * b + a for a, b in zip([0, *sizes], sizes, strict=False)), default=0)
    del grads
    return TraceResult(param_bytes=param_bytes, buffer_bytes=buffer_bytes, opt_state_bytes=opt_state,
                       batch_bytes=b_bytes, fwd_bwd_peak_bytes=tracker.peak, opt_step_peak_bytes=after_bwd + temps,
                       peak_sizes=tracker.peak_sizes)


def estimate_traced(spec: JobSpec, gpu: GpuModel | None,
                    factory: Callable[[JobSpec], torch.nn.Module] | None = None) -> Estimate:
    """Estimate a spec with a custom module (or any `factory`) by tracing it on meta."""
    if factory is None:
        factory = load_factory(spec)
    try:
        r = trace_step(spec, factory, "meta", foreach=gpu is not None)
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
    host = {"runtime": HOST_RUNTIME_CUDA_BYTES if gpu is not None else HOST_RUNTIME_CPU_BYTES,
            "synthetic_data_pools": synthetic_pool_bytes(spec)}
    if gpu is not None:
        gpu_breakdown = dict(parts)
        gpu_breakdown["cuda_context"] = gpu.context_bytes_nvml
        gpu_breakdown["cublas_workspace"] = gpu.cublas_workspace_bytes
        gpu_breakdown["allocator_rounding"] = allocator_rounding_bytes(r.peak_sizes)
        gpu_peak = sum(gpu_breakdown.values())
        host["pinned_staging"] = batch_bytes(spec)
    else:
        gpu_breakdown, gpu_peak = {}, 0
        host["tensors"] = r.peak_bytes
    return Estimate(
        gpu_peak_bytes=gpu_peak, host_peak_bytes=sum(host.values()), gpu_breakdown=gpu_breakdown,
        host_breakdown=host, profile=compute_profile(spec, gpu), tensor_peak_bytes=r.peak_bytes,
        peak_phase="optimizer step" if r.opt_step_peak_bytes > r.fwd_bwd_peak_bytes else "forward/backward",
        gpu_model=gpu.name if gpu is not None else None, method="traced", notes=tuple(notes),
        gpu_fence_bytes=fence_bytes(gpu_peak, gpu),
    )
