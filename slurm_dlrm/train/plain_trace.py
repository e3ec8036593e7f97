"""The plain-torch DLRM estimated by its own rules (issue 37).

`slurm_dlrm/train/plain_dlrm.py` is the model that runs where torchrec and fbgemm do
not (the GPU check, the runner's plain-torch backend). It follows other rules than the
torchrec model the analytic estimator replays (`gpu_check.rules_that_differ`): sparse
table gradients and a torch optimizer step instead of fbgemm's fused update, int64
offsets per table, the dot interaction's upper triangle gathered by index. So it is
estimated by tracing *it*: built under `FakeTensorMode` on the CPU (no memory is
taken), one forward/backward and optimizer step over a batch shaped like its own, every
storage followed by the traced estimator's `StorageTracker` (sparse gradients by their
indices and values). As on CUDA, torch's optimizers run their foreach kernels and the
forward runs under autocast (the CPU's autocast lists; CUDA's cast a few more ops).

Fake rather than meta: autocast has no `meta` device, and this model's tracing needs
its bf16 casts. Then the GPU rules, shared with the traced path:
`plain_gpu_breakdown`. Imports torch: only tools that measure or compare it import this.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from slurm_dlrm.estimate.analytic import (
    HOST_RUNTIME_CUDA_BYTES,
    Estimate,
    allocator_rounding_bytes,
    compute_profile,
    fence_bytes,
)
from slurm_dlrm.estimate.timeline import ids_per_batch
from slurm_dlrm.estimate.traced import StorageTracker
from slurm_dlrm.site import GpuModel
from slurm_dlrm.spec import JobSpec

STEPS = 2  # the second step holds every optimizer state (Adam's and Adagrad's appear in step 1)


class _SparseAwareTracker(StorageTracker):
    """A sparse COO tensor has no storage of its own: count its indices and values.
    Also counts the aten ops of the step (each is at least one kernel launch, and
    its dispatch is host time: plain torch's step is many small ops)."""

    ops = 0
    allocated = 0  # bytes of every storage it saw created (the step's churn)

    def register(self, t: Any) -> None:
        if isinstance(t, torch.Tensor) and t.layout == torch.sparse_coo:
            self.register(t._indices())
            self.register(t._values())
            return
        before = self.live
        super().register(t)
        self.allocated += max(0, self.live - before)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


@dataclass(frozen=True)
class PlainTrace:
    peak_bytes: int  # live tensor bytes at the step's peak
    param_bytes: int
    opt_state_bytes: int
    batch_bytes: int
    ops_per_step: int = 0  # aten ops of one steady step (forward, backward, optimizer)
    churn_bytes: int = 0  # bytes allocated (and freed) over one steady step
    peak_sizes: list[int] = field(default_factory=list)

    @property
    def dynamic_bytes(self) -> int:
        """What the step allocates and frees (activations, gradients, temporaries)."""
        return self.peak_bytes - self.param_bytes - self.opt_state_bytes - self.batch_bytes


def trace_plain_step(spec: JobSpec) -> PlainTrace:
    """One traced training step (two, so the optimizer state exists) of `plain_dlrm`."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from slurm_dlrm.train import plain_dlrm

    if spec.world_size != 1 or spec.custom_module or any(t.placement != "hbm" for t in spec.tables):
        raise ValueError(f"{spec.name}: the plain-torch DLRM covers one process, HBM tables, the built-in model")
    cpu = torch.device("cpu")
    tracker = _SparseAwareTracker()
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = plain_dlrm.PlainDLRM(spec, cpu, sparse_tables=spec.optimizer.fused)
        optimizers, _ = plain_dlrm.optimizers_for(spec, model, spec.optimizer.fused)
        for opt in optimizers:
            for group in opt.param_groups:
                if "foreach" in group:  # torch picks the foreach kernels for CUDA tensors
                    group["foreach"] = True
        B = spec.batch_size
        dense, labels = torch.zeros(B, spec.dense_features), torch.zeros(B)
        ids = [torch.zeros(ids_per_batch(B, t), dtype=torch.int64) for t in spec.tables]
        offsets = [torch.zeros(B, dtype=torch.int64) for _ in spec.tables]
        amp = spec.mixed_precision in ("fp16", "bf16")
        amp_dtype = torch.float16 if spec.mixed_precision == "fp16" else torch.bfloat16
        params = list(model.parameters())
        with tracker:
            for p in params:
                tracker.register(p)
            param_bytes = tracker.live
            for t in (dense, labels, *ids, *offsets):
                tracker.register(t)
            batch = tracker.live - param_bytes
            for _step in range(STEPS):  # plain_dlrm.Trainer.step, without reading the loss back
                ops_before, churn_before = tracker.ops, tracker.allocated
                with torch.autocast("cpu", dtype=amp_dtype, enabled=amp):
                    logits = model(dense, ids, offsets)
                loss = torch.nn.functional.binary_cross_entropy_with_logits(logits.float(), labels)
                for opt in optimizers:
                    opt.zero_grad(set_to_none=True)
                loss.backward()
                for opt in optimizers:
                    opt.step()
                del loss, logits
                ops = tracker.ops - ops_before  # the last step's: the steady one
                churn = tracker.allocated - churn_before
        state = 0
        for opt in optimizers:
            for s in opt.state.values():
                state += sum(v.numel() * v.element_size() for v in s.values()
                             if isinstance(v, torch.Tensor) and v.dim() > 0)
    return PlainTrace(peak_bytes=tracker.peak, param_bytes=param_bytes, opt_state_bytes=state, batch_bytes=batch,
                      ops_per_step=ops, churn_bytes=churn, peak_sizes=tracker.peak_sizes)


# torch keeps one cuBLAS handle, each with its workspace, per thread and device: the
# training thread runs the forward's matmuls, autograd's device thread the backward's.
CUBLAS_THREADS = 2
# What a CPU trace does not see of a CUDA step, per id looked up: the embedding
# backward's sort and segment buffers and the caching allocator's split blocks
# (reserved - allocated). Fitted on the H100 run (tests/data/gpu/h100-2026-11-27,
# `gpu_calibration.fit_per_id` on its 14 configs: 1,230 B/id; leave-one-config-out in
# benchmarks/gpu_models.py). Its configs grow ids with the batch only, so "per id" and
# "per sample" are not told apart there.
CUDA_EXTRA_BYTES_PER_ID = 1230


def ids_per_step(spec: JobSpec) -> int:
    return sum(ids_per_batch(spec.batch_size, t) for t in spec.tables)


def plain_gpu_breakdown(trace: PlainTrace, spec: JobSpec, gpu: GpuModel,
                        extra_bytes_per_id: float = CUDA_EXTRA_BYTES_PER_ID) -> dict[str, int]:
    """The GPU rules on top of the traced tensors (docs/estimator.md "Memory as the GPU
    counts it"): the context as NVML counts it (measured where the site has it), one
    cuBLAS workspace per thread that runs matmuls, the caching allocator's rounding,
    and the CUDA transients per id."""
    return {
        "model_params": trace.param_bytes,
        "optimizer_state": trace.opt_state_bytes,
        "input_batches": trace.batch_bytes,
        "activations_and_grads": trace.dynamic_bytes,
        "cuda_context": gpu.context_bytes_nvml,
        "cublas_workspace": gpu.cublas_workspace_bytes * CUBLAS_THREADS,
        "allocator_rounding": allocator_rounding_bytes(trace.peak_sizes),
        "cuda_transients": int(extra_bytes_per_id * ids_per_step(spec)),
    }


def estimate_plain(spec: JobSpec, gpu: GpuModel, trace: PlainTrace | None = None,
                   extra_bytes_per_id: float = CUDA_EXTRA_BYTES_PER_ID) -> Estimate:
    """The plain-torch model's GPU peak as NVML counts it (and its fence, as MPS does)."""
    trace = trace or trace_plain_step(spec)
    bd = plain_gpu_breakdown(trace, spec, gpu, extra_bytes_per_id)
    peak = sum(bd.values())
    return Estimate(
        gpu_peak_bytes=peak, host_peak_bytes=HOST_RUNTIME_CUDA_BYTES, gpu_breakdown=bd,
        host_breakdown={"runtime": HOST_RUNTIME_CUDA_BYTES}, profile=compute_profile(spec, gpu),
        tensor_peak_bytes=trace.peak_bytes, peak_phase="step", gpu_model=gpu.name, method="traced-plain-torch",
        notes=("plain torch (slurm_dlrm/train/plain_dlrm.py) traced under FakeTensorMode: sparse table "
               "gradients, torch optimizers with foreach kernels",),
        gpu_fence_bytes=fence_bytes(peak, gpu))
