"""The analytic estimate: GPU peak, host peak and compute profile of one DLRM job.

Pure (no torch, no I/O). The device-independent part, the peak of live tensor bytes
over one training step, comes from `timeline.simulate_step`; this module adds the
device rules (CUDA context, cuBLAS workspace, caching-allocator rounding), the host
side (runtime, host/UVM tables, loader workers, pinned staging) and the compute
profile used by the packing policy. See docs/estimator.md for every term's source.
It is one module over 600 lines because every device rule, for both backends, fills
the one `Estimate` and is read beside the others; the step replays live in timeline*.py.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from functools import wraps
from typing import Any, TypeVar

from slurm_dlrm.estimate import timeline_torch
from slurm_dlrm.estimate.backend import TORCH, backend_for_estimate
from slurm_dlrm.estimate.timeline import (
    EMB_OPT,
    EMB_WEIGHTS,
    F32,
    Shapes,
    Tape,
    batch_bytes,
    embedding_optimizer_state_bytes,
    ids_per_batch,
    is_fixed_length,
    prefetch_depth,
    simulate_step,
    static_parts,
)
from slurm_dlrm.estimate.timeline_eval import eval_host_parts, simulate_eval
from slurm_dlrm.site import GpuModel
from slurm_dlrm.spec import EVAL_SAMPLE_CHUNK, MAX_WORLD_SIZE, JobSpec

MIB = 1 << 20
GIB = 1 << 30

_R = TypeVar("_R")


def _per_spec(fn: Callable[..., _R], keep: int = 8) -> Callable[..., _R]:
    """Remember a spec-wide figure for the last `keep` (spec, arguments), the spec by
    identity: a world_size W estimate asks for it once per rank, and each is a pass over
    every table (64 ranks of 10,000 tables took seconds, issue 32). Specs are frozen,
    so a figure cannot go stale; what is returned is shared, and only read."""
    recent: list[tuple[JobSpec, tuple[Any, ...], _R]] = []

    @wraps(fn)
    def once(spec: JobSpec, *args: Any) -> _R:
        for known, known_args, value in recent:
            if known is spec and known_args == args:
                return value
        value = fn(spec, *args)
        recent.insert(0, (spec, args, value))
        del recent[keep:]
        return value

    return once

# PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp): every block is
# rounded up to 512 B; small blocks (<= 1 MiB) come from 2 MiB segments, large ones
# from segments rounded up to 2 MiB.
ALLOC_BLOCK_BYTES = 512
SMALL_SIZE_BYTES = 1 * MIB
SEGMENT_BYTES = 2 * MIB

# Host side. Measured here (torch 2.13 CPU, torchrec 1.8, one gloo process): RSS of
# the training process with the model set up but before any tensor is counted. About
# 100 MiB of it are mapped library pages, whose resident share depends on the page
# cache: the same imports measured 341 and 393 MiB RSS in two venvs of identical
# packages (anonymous memory equal, 243 MiB). The constant takes the upper figure (the
# residual over 38 configs, 423-443 MiB), since an under-estimate is the defect. The
# CUDA figure adds the CUDA runtime, cuBLAS/cuDNN and fbgemm's GPU kernels mapped into
# the host process (typical for CUDA 12 builds; calibrate from history on the site).
HOST_RUNTIME_CPU_BYTES = 432 * MIB
# Of it, resident pages of the mapped libraries (RssFile at the end of training, the upper
# case): the page cache decides how many are resident (another session on this machine
# measured about 65 MiB fewer, issue 43), and a pack's members share them in the page
# cache (charged once to the job's memory cgroup). benchmarks/estimator_accuracy.py
# judges the rest, the anonymous memory, apart from them.
HOST_RUNTIME_CPU_MAPPED_FILES_BYTES = 171 * MIB
HOST_RUNTIME_CUDA_BYTES = 1536 * MIB
# torchrec.metrics and the torchmetrics it imports, loaded by a run that evaluates
# (measured: +45.7 MiB RSS over an imported torchrec, torch 2.13 / torchmetrics 1.0.3)
EVAL_LIBRARY_BYTES = 46 * MIB
# The runner's loader workers are threads (slurm_dlrm/train/data.py Prefetcher): a
# touched stack and numpy scratch each, no process of their own.
LOADER_THREAD_BYTES = 2 * MIB
# The runner's synthetic source (slurm_dlrm/train/data.py SyntheticBatches) draws pools
# once: 8 batches of dense rows, labels and lengths, and per table 8 batches of ids
# capped at one batch + 4 M. Mirrored here (that module imports torch).
# placement uvm runs fbgemm's UVM-caching kernel on a GPU (slurm_dlrm/train/model.py):
# an HBM cache of this share of the rows (torchrec batched_embedding_kernel default).
UVM_CACHE_LOAD_FACTOR = 0.2
SYNTHETIC_POOL_BATCHES = 8
SYNTHETIC_POOL_EXTRA_IDS = 4_000_000
# ... and makes up to 32 complete batches up front (at most 64 MiB by its own count),
# cycled over the steps; pinned on a GPU.
SYNTHETIC_RING_BATCHES = 32
SYNTHETIC_RING_MAX_BYTES = 64 * MIB
# The runner copies the training state to host memory for a background checkpoint
# write when it has one process and the state is at most this big.
ASYNC_CHECKPOINT_MAX_BYTES = 1 << 30
# Peak RSS runs above the live tensor bytes by this share of the step's dynamic part:
# the small blocks glibc keeps in its heap. Blocks of 1 MiB and more are returned on
# free since the runner fixes glibc's mmap threshold (slurm_dlrm/train/hostmem.py);
# before that, the heap kept freed activations of several steps (0.8 here, fitted at
# small batches, and -16% at batch 16,384, issue 17). Fitted over the configs of
# benchmarks/estimator_accuracy.py with the runtime above.
HOST_MALLOC_OVERHEAD = 0.1

# Compute profile assumptions (documented in docs/estimator.md).
GEMM_EFFICIENCY = 0.5  # small-MLP GEMMs reach about half of peak FLOP/s
EMB_BW_EFFICIENCY = 0.4  # random row gathers reach about 40% of peak HBM bandwidth
KERNEL_LAUNCH_S = 8e-6  # per kernel, launch + tail
HOST_SECONDS_PER_SAMPLE = {"synthetic": 0.3e-6, "criteo-npy": 1.5e-6, "criteo-tsv": 25e-6}
HOST_SECONDS_PER_ID = 1e-9  # gathering and concatenating int64 ids into the batch


@dataclass(frozen=True)
class ComputeProfile:
    flops_per_sample: float
    emb_bytes_per_sample: float
    solo_samples_per_s: float
    sm_util_pct: float
    membw_util_pct: float
    host_cpu_cores: float
    label: str  # "compute-bound" | "memory-bound" | "host-bound"


@dataclass(frozen=True)
class Estimate:
    gpu_peak_bytes: int
    host_peak_bytes: int
    gpu_breakdown: dict[str, int]
    host_breakdown: dict[str, int]
    profile: ComputeProfile
    tensor_peak_bytes: int  # device-independent: the peak of live tensor bytes
    peak_phase: str
    gpu_model: str | None
    method: str = "analytic"  # "analytic" | "traced"; "+calibrated" when history corrected it
    notes: tuple[str, ...] = field(default=())
    ranks: tuple[RankEstimate, ...] = field(default=())  # world_size > 1: every rank's own
    # What the MPS pinned-memory limit counts for it (the fence; issue 37): the GPU peak
    # with the fence's per-process overhead in place of NVML's. 0 without a GPU model.
    gpu_fence_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["notes"] = list(self.notes)
        if self.ranks:
            d["ranks"] = [dict(asdict(r), tables=list(r.tables)) for r in self.ranks]
        else:
            d.pop("ranks")  # one rank: the form stays as it was
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Estimate:
        """The inverse of `to_dict` (e.g. a traced estimate read back from a child process)."""
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        kw["profile"] = ComputeProfile(**d["profile"])
        kw["notes"] = tuple(d.get("notes") or ())
        kw["ranks"] = tuple(RankEstimate.from_dict(r) for r in d.get("ranks") or ())
        return cls(**kw)


def rank_tables(spec: JobSpec) -> list[list[int]]:
    """Tables each rank holds (every placement), as torchrec's planner shards table-wise.

    With world_size > 1 the runner lets torchrec's planner shard table-wise. Its
    GreedyPerfPartitioner (torchrec 1.8, default sort by storage) takes the tables
    largest first and puts each on the rank with the least lookup cost so far (ties:
    the lowest rank); a fused lookup's cost is mostly its pooled output, plus a share
    per id, and does not grow with rows. The same greedy here. One rank: all tables.
    Across nodes (a spec with `gpus_per_node`: the topology's local world size) its
    ties go to the lowest local rank first, then the lowest rank (OrderedDeviceHardware's
    order: so the nodes fill evenly), as here.
    """
    if spec.world_size <= 1 or is_torch_backend(spec):  # backend torch: DDP replicates every table
        return [list(range(len(spec.tables)))] * max(1, spec.world_size)
    local = max(1, spec.gpus_per_node or spec.world_size)
    # (cost so far, local rank, rank): the heap's least is the least cost, ties as
    # torchrec breaks them, as a scan of every rank per table would find (64 ranks x
    # 10,000 tables, issue 32)
    heap = sorted((0.0, r % local, r) for r in range(spec.world_size))
    owned: list[list[int]] = [[] for _ in range(spec.world_size)]
    for i in sorted(range(len(spec.tables)), key=lambda i: -_table_total_bytes(spec, i)):  # stable
        t = spec.tables[i]
        cost, lr, r = heap[0]
        # pooled output per table dominates, each id adds about half of it (fitted to
        # the placements torchrec 1.8 chose on the benchmark's multi-rank configs)
        heapq.heapreplace(heap, (cost + t.dim * 4 * (1 + 0.5 * t.ids_per_sample), lr, r))
        owned[r].append(i)
    return [sorted(o) for o in owned]


def device_tables(spec: JobSpec, all_placements: bool = False) -> list[int]:
    """Tables whose weights sit in device memory (placement hbm), for the fullest rank
    (`rank_tables`: the rank holding the most bytes). `all_placements`: every table
    counts (a CPU run keeps them all in one memory).
    """
    # backend torch keeps every table in device memory (it refuses uvm/host on a GPU)
    all_placements = all_placements or is_torch_backend(spec)
    chosen = [i for i, t in enumerate(spec.tables) if all_placements or t.placement == "hbm"]
    if spec.world_size <= 1:
        return chosen
    owned = rank_tables(spec)
    chosen_set = set(chosen)  # not list membership per table: quadratic at 10,000 tables
    mem = [sum(_table_total_bytes(spec, i) for i in o if i in chosen_set) for o in owned]
    return sorted(i for i in owned[mem.index(max(mem))] if i in chosen_set)


def _table_total_bytes(spec: JobSpec, i: int) -> int:
    return spec.tables[i].weight_bytes + embedding_optimizer_state_bytes(spec, [i])


def table_bytes_with_state(spec: JobSpec, i: int) -> int:
    """One table's weights plus its optimizer state: the least memory it needs."""
    return _table_total_bytes(spec, i)


def _peak_tape(spec: JobSpec, device: str, tables: list[int]) -> Tape:
    return _peak_tape_once(spec, device, tables)


def is_torch_backend(spec: JobSpec) -> bool:
    """The spec trains on the runner's plain-PyTorch backend (slurm_dlrm/estimate/backend.py)."""
    return backend_for_estimate(spec.backend) == TORCH


def _replay_peak_tape(spec: JobSpec, device: str, tables: list[int]) -> Tape:
    """The tape with the highest peak: the steady step, the first step, and (evaluation
    on) the held-out evaluation (`timeline_eval`: the device's share on a GPU)."""
    replay = timeline_torch.simulate_step if is_torch_backend(spec) else simulate_step
    steady = replay(spec, device, tables)
    first = replay(spec, device, tables, first_step=True)
    peak = first if first.peak > steady.peak else steady
    if spec.eval.enabled:
        evaluation = simulate_eval(spec, device, tables)
        peak = evaluation if evaluation.peak > peak.peak else peak
    return peak


# The tape depends on the device kind, not on the GPU model: `estimate` for each model
# of a site replays each rank's step once, not once per model.
_peak_tape_once = _per_spec(_replay_peak_tape, keep=2 * MAX_WORLD_SIZE + 4)


def allocator_rounding_bytes(live_sizes: list[int]) -> int:
    extra = 0
    for n in live_sizes:
        if n <= 0:
            continue
        if n <= SMALL_SIZE_BYTES:
            extra += -n % ALLOC_BLOCK_BYTES
        else:
            extra += -n % SEGMENT_BYTES
    return extra + SEGMENT_BYTES  # one partly used small-block segment


@dataclass(frozen=True)
class RankEstimate:
    """One rank of a multi-GPU job (world_size > 1): the tables torchrec's planner puts
    on it (`rank_tables`), its own GPU and host peak (each rank is its own process) and
    its compute profile (it looks its tables up for the global batch)."""

    rank: int
    tables: tuple[int, ...]
    gpu_peak_bytes: int
    host_peak_bytes: int
    gpu_breakdown: dict[str, int]
    profile: ComputeProfile
    # the peak of its live tensor bytes (device-independent, as Estimate.tensor_peak_bytes):
    # what a CPU run of the rank measures (benchmarks/multinode.py)
    tensor_peak_bytes: int = 0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RankEstimate:
        return cls(rank=int(d["rank"]), tables=tuple(d.get("tables") or ()), gpu_peak_bytes=int(d["gpu_peak_bytes"]),
                   host_peak_bytes=int(d["host_peak_bytes"]), gpu_breakdown=dict(d.get("gpu_breakdown") or {}),
                   profile=ComputeProfile(**d["profile"]), tensor_peak_bytes=int(d.get("tensor_peak_bytes") or 0))


def _memory(spec: JobSpec, gpu: GpuModel | None, tables: list[int],
            host_tables: list[int]) -> tuple[Tape, dict[str, int], dict[str, int]]:
    """(peak tape, GPU breakdown, host breakdown) of one process holding `tables` in
    device memory (all of them on a CPU run) and `host_tables` in host memory."""
    device = "cuda" if gpu is not None else "cpu"
    tape = _peak_tape(spec, device, tables)
    parts = {k: v for k, v in tape.at_peak.items()}
    host_table_bytes = sum(spec.tables[i].weight_bytes for i in host_tables)
    host_table_opt = embedding_optimizer_state_bytes(spec, host_tables) if host_tables else 0
    workers = spec.loader_workers
    one_batch = batch_bytes(spec)
    pools = synthetic_pool_bytes(spec)
    ring = synthetic_ring_bytes(spec, gpu is not None)
    held_out = eval_host_bytes(spec, gpu is not None)
    snapshot = checkpoint_snapshot_bytes(spec, tables, device)
    static = timeline_torch.static_bytes(spec, tables, device) if is_torch_backend(spec) else \
        static_bytes(spec, tables, device)

    if gpu is not None:
        gpu_breakdown = dict(parts)
        gpu_breakdown["uvm_cache"] = uvm_cache_bytes(spec)
        gpu_breakdown["cuda_context"] = gpu.context_bytes_nvml
        gpu_breakdown["cublas_workspace"] = gpu.cublas_workspace_bytes
        gpu_breakdown["allocator_rounding"] = allocator_rounding_bytes(tape.at_peak_sizes)
        host_breakdown = {
            "runtime": HOST_RUNTIME_CUDA_BYTES,
            "host_embedding_weights": host_table_bytes,
            "host_embedding_optimizer_state": host_table_opt,
            "pinned_staging": (prefetch_depth(spec) + 1) * one_batch,
            "loader_threads": workers * LOADER_THREAD_BYTES,
            "synthetic_data_pools": pools,
            "synthetic_batch_ring": ring,
            "evaluation": held_out,
            "checkpoint_snapshot": snapshot,
        }
    else:
        gpu_breakdown = {}
        host_breakdown = {
            "runtime": HOST_RUNTIME_CPU_BYTES,
            "tensors": tape.peak,
            "malloc_overhead": int(max(0, tape.peak - static) * HOST_MALLOC_OVERHEAD),
            "loader_prefetch": prefetch_depth(spec) * one_batch,
            "loader_threads": workers * LOADER_THREAD_BYTES,
            "synthetic_data_pools": pools,
            "synthetic_batch_ring": ring,
            "evaluation": held_out,
            "checkpoint_snapshot": snapshot,
        }
    return tape, gpu_breakdown, host_breakdown


def rank_estimates(spec: JobSpec, gpu: GpuModel | None) -> tuple[RankEstimate, ...]:
    """Every rank's own estimate (empty for one rank): its tables from `rank_tables`,
    device tables (placement hbm; every table on a CPU run) and host/UVM tables apart."""
    if spec.world_size <= 1:
        return ()
    out = []
    for r, owned in enumerate(rank_tables(spec)):
        dev = [i for i in owned if gpu is None or spec.tables[i].placement == "hbm"]
        host = [i for i in owned if gpu is not None and spec.tables[i].placement != "hbm"]
        tape, gpu_bd, host_bd = _memory(spec, gpu, dev, host)
        out.append(RankEstimate(rank=r, tables=tuple(owned), gpu_peak_bytes=sum(gpu_bd.values()),
                                host_peak_bytes=sum(host_bd.values()), gpu_breakdown=gpu_bd,
                                profile=compute_profile(spec, gpu, owned), tensor_peak_bytes=tape.peak))
    return tuple(out)


def estimate(spec: JobSpec, gpu: GpuModel | None, *, ranks: bool = True) -> Estimate:
    """Estimate one job. `gpu=None` means a CPU run (the benchmark's mode): all tensors
    then live in host memory and the GPU parts are zero. With world_size > 1 the job's
    figures are its fullest rank's (host tables counted whole) and `ranks` holds every
    rank's own (`ranks=False`: left empty, for a caller that needs only the job's
    figures, e.g. fit advice trying dozens of variants)."""
    device = "cuda" if gpu is not None else "cpu"
    # On a CPU run every table is in the one (host) memory.
    tables = device_tables(spec, all_placements=gpu is None)
    notes: list[str] = []
    if device == "cpu" and spec.optimizer.type == "adam" and spec.optimizer.fused and not is_torch_backend(spec):
        notes.append("fused Adam is GPU-only (fbgemm CPU kernels); estimated as non-fused on the CPU")
    if spec.world_size > 1 and not is_torch_backend(spec):
        notes.append(f"world_size {spec.world_size}: tables placed as torchrec's greedy partitioner would (the "
                     "fullest rank is estimated, every rank in `ranks`); NCCL's own buffers are not counted "
                     "(calibrate from history)")
    host_tables = [i for i, t in enumerate(spec.tables) if t.placement != "hbm"] \
        if gpu is not None and not is_torch_backend(spec) else []
    if is_torch_backend(spec):
        notes.append("backend torch: plain-PyTorch DLRM (nn.EmbeddingBag), every table in device memory"
                     + (", replicated on every rank (DDP)" if spec.world_size > 1 else ""))
    tape, gpu_breakdown, host_breakdown = _memory(spec, gpu, tables, host_tables)
    return Estimate(
        gpu_peak_bytes=sum(gpu_breakdown.values()), host_peak_bytes=sum(host_breakdown.values()),
        gpu_breakdown=gpu_breakdown, host_breakdown=host_breakdown, profile=compute_profile(spec, gpu),
        tensor_peak_bytes=tape.peak, peak_phase=tape.peak_where, gpu_model=gpu.name if gpu is not None else None,
        notes=tuple(notes), ranks=rank_estimates(spec, gpu) if ranks else (),
        gpu_fence_bytes=fence_bytes(sum(gpu_breakdown.values()), gpu),
    )


def fence_bytes(gpu_peak_bytes: int, gpu: GpuModel | None) -> int:
    """The GPU peak as the MPS pinned-memory limit counts it: NVML's per-process
    overhead (in the peak) swapped for the fence's (docs/estimator.md)."""
    if gpu is None:
        return 0
    return max(0, gpu_peak_bytes - gpu.context_bytes_nvml + gpu.context_bytes_fence)


@_per_spec
def synthetic_ring_bytes(spec: JobSpec, pinned: bool) -> int:
    """The runner's synthetic source keeps up to 32 ready batches (slurm_dlrm/train/data.py
    SyntheticBatches.ring). Their ids, lengths and planted click probabilities are their
    own memory, dense rows are views of the pools; pinned (GPU) copies own everything."""
    if spec.data.type != "synthetic":
        return 0
    B = spec.batch_size
    ids = sum(B * t.ids_per_sample for t in spec.tables)
    # the source's own size estimate decides how many it makes
    counted = int(ids * 8 + B * (spec.dense_features + 1) * 4 + B * len(spec.tables) * 4)
    n = min(SYNTHETIC_RING_BATCHES, SYNTHETIC_RING_MAX_BYTES // max(counted, 1))
    if n < 2:
        return 0
    own = batch_bytes(spec) if pinned else sum(ids_per_batch(B, t) for t in spec.tables) * 8 + B * len(spec.tables) * 4
    own += B * 4  # the planted click probabilities kept with each batch (labels are drawn per step)
    # the shared per-sample lengths of fixed-length tables, one tensor per count
    fixed = len({t.multi_hot or 1 for t in spec.tables if is_fixed_length(t)}) * B * 4
    return n * own + fixed


@_per_spec
def eval_host_bytes(spec: JobSpec, on_gpu: bool) -> int:
    """What evaluating adds to host memory besides the tensors of `timeline_eval`'s
    replay: the metrics library (EVAL_LIBRARY_BYTES; torchrec's backend only: the torch
    backend's runner uses the plain-torch reference metrics), the eval stream's own pools
    (synthetic data: as the training stream's, `synthetic_pool_bytes`), a Criteo TSV's
    held-out batches (parsed once and kept, slurm_dlrm/train/heldout.py `HeldOut`) and, on
    a GPU run, the evaluation's host side (the held-out batch made on the host, the
    predictions buffer and the metrics' temporaries: `timeline_eval.eval_host_parts`)."""
    if not spec.eval.enabled:
        return 0
    batches = spec.eval.batches if spec.eval.samples is None else -(-int(spec.eval.samples) // spec.batch_size)
    kept = batches * batch_bytes(spec) if spec.data.type == "criteo-tsv" else 0
    host = sum(eval_host_parts(spec).values()) if on_gpu else 0
    # with eval.samples the eval stream's pools are made at its fixed chunk size (train/heldout.py)
    pools = synthetic_pool_bytes(spec if spec.eval.samples is None else replace(spec, batch_size=EVAL_SAMPLE_CHUNK))
    # backend torch computes the metrics with the plain-torch reference: no torchrec.metrics
    library = 0 if is_torch_backend(spec) else EVAL_LIBRARY_BYTES
    return library + pools + kept + host


def checkpoint_snapshot_bytes(spec: JobSpec, tables: list[int], device: str) -> int:
    """Host copy of the state for a background checkpoint write (runner: one process,
    state <= 1 GiB, checkpoints on)."""
    if spec.world_size != 1 or spec.checkpoint_every_steps == 0:
        return 0
    if is_torch_backend(spec):  # one process: no gradient lives between steps in the state
        st = timeline_torch.static_parts(spec, tables, device)
        torch_state = st.emb_weights + st.emb_opt_state + st.dense_params + st.dense_opt_state
        return torch_state if torch_state <= ASYNC_CHECKPOINT_MAX_BYTES else 0
    state = static_bytes(spec, tables, device) - static_parts(spec, tables, device).dense_grads \
        - static_parts(spec, tables, device).emb_grad_bucket
    return state if state <= ASYNC_CHECKPOINT_MAX_BYTES else 0


def static_bytes(spec: JobSpec, tables: list[int], device: str) -> int:
    """Bytes that live for the whole run: tables, their optimizer state, dense
    parameters, their gradients and optimizer state."""
    st = static_parts(spec, tables, device)
    return (st.emb_weights + st.emb_opt_state + st.emb_grad_bucket + st.dense_params + st.dense_grads
            + st.dense_opt_state)


@_per_spec
def uvm_cache_bytes(spec: JobSpec) -> int:
    """HBM cache of UVM-cached tables: cached rows in the table's dtype, plus fbgemm's
    cache state (int64 per slot, int32 per row; torchrec planner
    `_calculate_cache_aux_state_sizes`)."""
    total = 0
    if is_torch_backend(spec):  # plain torch has no UVM cache: such tables are refused on a GPU
        return 0
    for t in spec.tables:
        if t.placement != "uvm":
            continue
        slots = int(t.rows * UVM_CACHE_LOAD_FACTOR + 0.999999)
        total += slots * t.dim * t.dtype_bytes + slots * 8 + t.rows * 4
    return total


@_per_spec
def synthetic_pool_bytes(spec: JobSpec) -> int:
    """Host bytes of the runner's synthetic data pools (numpy, outside torch)."""
    if spec.data.type != "synthetic":
        return 0
    B = spec.batch_size
    pool_rows = B * SYNTHETIC_POOL_BATCHES
    total = pool_rows * spec.dense_features * F32 + pool_rows * F32
    for t in spec.tables:
        if is_fixed_length(t):
            per_batch = B * (t.multi_hot or 1)
        else:
            p = float(t.pooling_factor or 1.0)
            per_batch = int(B * p + 8 * (B * p) ** 0.5 + 16)
            total += pool_rows * 4  # int32 lengths pool
        n_ids = per_batch + min(per_batch * (SYNTHETIC_POOL_BATCHES - 1), SYNTHETIC_POOL_EXTRA_IDS)
        total += n_ids * 8
    return total


def embedding_and_optimizer_bytes(est: Estimate) -> tuple[int, int]:
    """(embedding weights, embedding optimizer state) in device memory (or host on CPU)."""
    parts = est.gpu_breakdown
    return parts.get(EMB_WEIGHTS, 0), parts.get(EMB_OPT, 0)


# ---------------------------------------------------------------- compute profile

def dense_flops_per_sample(spec: JobSpec) -> float:
    """Training FLOPs per sample of the dense part: forward x 3 (backward is about 2x)."""
    s = Shapes.of(spec)
    fwd = 0.0
    prev = s.dense_in
    for w in s.bottom:
        fwd += 2 * prev * w
        prev = w
    if s.dcn_layers:
        n = (s.F + 1) * s.D
        fwd += s.dcn_layers * (2 * n * s.dcn_rank * 2 + 3 * n)
    else:
        fwd += 2 * (s.F + 1) ** 2 * s.D
    prev = s.top_in
    for w in s.top:
        fwd += 2 * prev * w
        prev = w
    return 3 * fwd


def emb_bytes_per_sample(spec: JobSpec, tables: list[int] | None = None) -> float:
    """Bytes of embedding memory touched per sample: forward gathers, backward
    read-modify-write of the rows (fused optimizer), optimizer state traffic, and the
    pooled outputs and their gradients. `tables`: one rank's tables, looked up for the
    global batch (world_size x its own samples), so per local sample x world_size."""
    state_rw = {"sgd": 0, "adagrad": 2 * F32, "rowwise_adagrad": 0, "adam": 4 * F32}[spec.optimizer.type]
    chosen = list(spec.tables) if tables is None else [spec.tables[i] for i in tables]
    scale = 1 if tables is None else max(1, spec.world_size)
    return _emb_bytes(spec, chosen, state_rw) * scale


def _emb_bytes(spec: JobSpec, chosen: list[Any], state_rw: int) -> float:
    total = 0.0
    for t in chosen:
        ids = t.ids_per_sample
        row = t.dim * t.dtype_bytes
        total += ids * (3 * row + t.dim * state_rw)
        if spec.optimizer.type == "rowwise_adagrad":
            total += ids * 2 * F32
        total += 2 * t.dim * F32  # pooled output written, its gradient read
    return total


@_per_spec
def _ids_per_sample(spec: JobSpec) -> float:
    return sum(t.ids_per_sample for t in spec.tables)


def _kernels_per_step(spec: JobSpec) -> int:
    s = Shapes.of(spec)
    layers = len(s.bottom) + len(s.top) + 2 * s.dcn_layers
    return 3 * 3 * layers + 30  # fwd + 2 bwd GEMMs and elementwise per layer, plus fixed ops


def gpu_step_times(spec: JobSpec, gpu: GpuModel | None, tables: list[int] | None = None
                   ) -> tuple[float, float, float, float]:
    """(GEMM seconds, memory seconds, bytes moved, launch seconds per kernel) of one step
    on `gpu` (a CPU run without one), with the model's measured efficiencies where the
    site has them."""
    flops = dense_flops_per_sample(spec)
    emb_bytes = emb_bytes_per_sample(spec, tables)
    B = spec.batch_size
    half = spec.mixed_precision != "none"
    gemm_eff, launch_s = GEMM_EFFICIENCY, KERNEL_LAUNCH_S
    if gpu is not None:
        peak_flops = (gpu.tf32_tflops * 2 if half else gpu.fp32_tflops) * 1e12
        bw = gpu.mem_bandwidth_gbps * 1e9
        gather_bw, stream_bw = bw * EMB_BW_EFFICIENCY, bw
        # Figures `slurm-dlrm selftest --write-site` measured on this model replace the assumptions.
        measured_eff = gpu.bf16_gemm_efficiency if half else gpu.gemm_efficiency
        gemm_eff = measured_eff if measured_eff is not None else gemm_eff
        gather_bw = gpu.gather_bandwidth_gbps * 1e9 if gpu.gather_bandwidth_gbps is not None else gather_bw
        stream_bw = gpu.stream_bandwidth_gbps * 1e9 if gpu.stream_bandwidth_gbps is not None else stream_bw
        launch_s = gpu.kernel_launch_us * 1e-6 if gpu.kernel_launch_us is not None else launch_s
    else:  # a CPU run: a few cores' worth of vector FLOP/s and DRAM bandwidth
        peak_flops = 0.2e12
        bw = 20e9
        gather_bw, stream_bw = bw * EMB_BW_EFFICIENCY, bw
    # dense activations also stream through memory once forward and twice backward
    act_bytes = 3 * 2 * sum(Shapes.of(spec).bottom + Shapes.of(spec).top) * F32
    t_compute = B * flops / (peak_flops * gemm_eff)
    t_memory = B * (emb_bytes / gather_bw + act_bytes / stream_bw)
    return t_compute, t_memory, B * (emb_bytes + act_bytes), launch_s


def compute_profile(spec: JobSpec, gpu: GpuModel | None, tables: list[int] | None = None) -> ComputeProfile:
    """The job's profile, or one rank's (`tables`: the rank's, see `emb_bytes_per_sample`;
    the dense part is data-parallel, the same on every rank)."""
    flops = dense_flops_per_sample(spec)
    emb_bytes = emb_bytes_per_sample(spec, tables)
    B = spec.batch_size
    bw = gpu.mem_bandwidth_gbps * 1e9 if gpu is not None else 20e9
    t_compute, t_memory, step_bytes, launch_s = gpu_step_times(spec, gpu, tables)
    t_launch = _kernels_per_step(spec) * launch_s
    t_gpu = t_compute + t_memory + t_launch
    ids_per_sample = _ids_per_sample(spec)
    per_sample_host = HOST_SECONDS_PER_SAMPLE.get(spec.data.type, 1e-6) + ids_per_sample * HOST_SECONDS_PER_ID
    inline = spec.data.type == "synthetic"  # the runner makes synthetic batches in the training thread
    workers = 1 if inline else max(spec.loader_workers, 1)
    t_host = B * per_sample_host / workers
    t_step = max(t_gpu, t_host)
    if t_host > t_gpu:
        label = "host-bound"
    elif t_compute >= t_memory:
        label = "compute-bound"
    else:
        label = "memory-bound"
    busy = min(1.0, t_host / t_step)
    host_cores = 1.0 + (spec.loader_workers * busy if spec.loader_workers and not inline else 0.0)
    # NVML's utilisation: the share of time some kernel runs.
    sm_pct = round(100 * (t_compute + t_memory) / t_step, 1)
    membw_pct = round(100 * step_bytes / (t_step * bw), 1)
    if gpu is not None and gpu.host_us_per_kernel is not None:
        sm_pct, membw_pct = calibrated_shares(gpu, t_compute + t_memory, _kernels_per_step(spec), sm_pct, membw_pct)
    return ComputeProfile(
        flops_per_sample=flops,
        emb_bytes_per_sample=emb_bytes,
        solo_samples_per_s=B / t_step,
        sm_util_pct=sm_pct,
        membw_util_pct=membw_pct,
        host_cpu_cores=round(host_cores, 2),
        label=label,
    )


def calibrated_shares(gpu: GpuModel, gpu_busy_s: float, kernels_per_step: int, est_sm_pct: float,
                      est_membw_pct: float) -> tuple[float, float]:
    """NVML's SM and bandwidth shares by the site's profile calibration (issue 37,
    `estimate.gpu_calibration.ProfileCalibration`; all six keys are set together)."""
    from slurm_dlrm.estimate.gpu_calibration import ProfileCalibration, ProfileInputs

    cal = ProfileCalibration(gpu.gpu_us_per_kernel or 0.0, gpu.host_us_per_kernel or 0.0, gpu.sm_busy_ceiling or 1.0,
                             gpu.membw_intercept_pct or 0.0, gpu.membw_per_est_membw or 0.0,
                             gpu.membw_per_est_sm or 0.0)
    return cal.shares(ProfileInputs("", gpu_busy_s, kernels_per_step, est_sm_pct, est_membw_pct))
