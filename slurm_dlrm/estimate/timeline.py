"""One training step of a torchrec DLRM, replayed symbolically: every tensor the step
allocates and frees, in order, with its size. Pure Python, no torch.

The sequence mirrors what torch 2.13 / torchrec 1.8 / fbgemm 1.8 do for
`DistributedModelParallel(DLRMTrain(DLRM or DLRM_DCN))` with the embedding optimizer
fused into the backward (`apply_optimizer_in_backward`), DDP over the dense part
(`gradient_as_bucket_view=True`, so dense gradients live in DDP buckets allocated once),
and a torch optimizer on the dense parameters. It was written against the allocation
log of benchmarks/_measure.py (`MEASURE_DEBUG=1`), op by op: which outputs autograd
saves, which the Python code keeps in variables, and when each is released.

The result is the peak of live tensor bytes and, at that moment, how the live bytes
split into named parts (the breakdown). It models what torch allocates through its
operators; kernel-internal scratch (cuBLAS workspace, fbgemm sort buffers) is not a
tensor and is added by the device rules in `analytic.py`.

Over 600 lines on purpose: the replay is one ordered sequence of allocations and frees,
forward then backward then the optimizer, checked op by op against one allocation log;
split across modules, the order a reader must follow (and keep in step with torch) would
be cut in pieces.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from math import comb, sqrt

from slurm_dlrm.spec import JobSpec, TableSpec

F32 = 4
I32 = 4
I64 = 8

# Parts of the breakdown (keys of the snapshot at the peak).
EMB_WEIGHTS = "embedding_weights"
EMB_OPT = "embedding_optimizer_state"
EMB_GRAD = "embedding_gradients"  # non-fused only: DDP bucket + the full-table grad
DENSE_PARAMS = "dense_params"
DENSE_GRADS = "dense_grads"
DENSE_OPT = "dense_optimizer_state"
INPUTS = "input_batches"  # dense features, lengths, int64 ids, labels of the batch in use
INDEX_OFFSETS = "index_offsets"
EMB_OUT = "embedding_outputs"
EMB_OUT_GRAD = "embedding_output_grads"
ACT_BOTTOM = "activations_bottom_mlp"
ACT_INTER = "activations_interaction"
ACT_TOP = "activations_top_mlp"
BWD = "backward_grads"  # activation gradients and weight-gradient transients
OPT_TEMPS = "optimizer_step_temps"
OTHER = "small_buffers"

PARTS = (EMB_WEIGHTS, EMB_OPT, EMB_GRAD, DENSE_PARAMS, DENSE_GRADS, DENSE_OPT, INPUTS, INDEX_OFFSETS, EMB_OUT,
         EMB_OUT_GRAD, ACT_BOTTOM, ACT_INTER, ACT_TOP, BWD, OPT_TEMPS, OTHER)


@dataclass(slots=True)
class _T:
    nbytes: int
    part: str
    born: int  # the tape's event count when it was allocated
    died: int | None = None  # ... and when it was freed

    @property
    def live(self) -> bool:
        return self.died is None


Alloc = _T  # one allocation on a Tape, by its public name (timeline_eval.py replays with it)


@dataclass
class Tape:
    """Live bytes over time; the peak, and what was live at it (by part, by tensor).

    Every allocation is kept with when it was made and freed, and what was live at the
    peak is read back from that history: snapshotting the live list (and the split by
    part) at every new peak was quadratic in the layers (a 20,000-layer MLP took 50 s,
    and 64 ranks replay every layer, issue 32)."""

    live: int = 0
    peak: int = 0
    peak_where: str = ""
    where: str = ""
    allocs: list[_T] = field(default_factory=list)
    events: int = 0
    peak_event: int = 0

    def _live_at_peak(self) -> list[_T]:
        at = self.peak_event
        return [a for a in self.allocs if a.born <= at and (a.died is None or a.died > at)]

    @property
    def at_peak(self) -> dict[str, int]:
        """Live bytes at the peak, by part (every part of PARTS, zeros included)."""
        out = dict.fromkeys(PARTS, 0)
        for a in self._live_at_peak():  # a part outside PARTS (an evaluation's) only when live
            out[a.part] = out.get(a.part, 0) + a.nbytes
        return out

    @property
    def at_peak_sizes(self) -> list[int]:
        """Sizes of the tensors live at the peak."""
        return [a.nbytes for a in self._live_at_peak()]

    def alloc(self, nbytes: int | float, part: str) -> _T:
        self.events += 1
        t = _T(int(nbytes), part, self.events)
        self.live += t.nbytes
        self.allocs.append(t)
        if self.live > self.peak:
            self.peak = self.live
            self.peak_where = self.where
            self.peak_event = self.events
        return t

    def free(self, *ts: _T | None) -> None:
        for t in ts:
            if t is None or t.died is not None:
                continue
            self.events += 1
            t.died = self.events
            self.live -= t.nbytes


@dataclass(frozen=True)
class Shapes:
    """Sizes the step needs, derived from the spec once."""

    B: int
    F: int
    D: int
    dense_in: int
    bottom: tuple[int, ...]
    top: tuple[int, ...]
    top_in: int
    ids: int
    act_bytes: int
    out_bytes: int
    dcn_layers: int
    dcn_rank: int

    @classmethod
    def of(cls, spec: JobSpec) -> Shapes:
        # One estimate asks for a spec's shapes dozens of times and each is a pass over
        # every table: keep the last few, by identity (10,000 tables, issue 32).
        for known, shapes in _RECENT_SHAPES:
            if known is spec:
                return shapes
        shapes = cls._of(spec)
        _RECENT_SHAPES.insert(0, (spec, shapes))
        del _RECENT_SHAPES[4:]
        return shapes

    @classmethod
    def _of(cls, spec: JobSpec) -> Shapes:
        F = len(spec.tables)
        D = spec.emb_dim
        if spec.interaction.type == "dcn":
            top_in = (F + 1) * D
            layers, rank = spec.interaction.layers or 0, spec.interaction.low_rank or 0
        else:
            top_in = D + comb(F, 2) + F  # torchrec DLRM: D + F choose 2 + F
            layers, rank = 0, 0
        act = F32  # mixed precision is handled op by op in simulate_step
        return cls(B=spec.batch_size, F=F, D=D, dense_in=spec.dense_features, bottom=spec.bottom_mlp,
                   top=spec.top_mlp, top_in=top_in, ids=sum(ids_per_batch(spec.batch_size, t) for t in spec.tables),
                   act_bytes=act, out_bytes=F32, dcn_layers=layers, dcn_rank=rank)


_RECENT_SHAPES: list[tuple[JobSpec, Shapes]] = []


def dense_param_shapes(spec: JobSpec) -> list[tuple[int, ...]]:
    """Dense parameters in the order DMP lists them (bottom MLP, DCN, top MLP)."""
    s = Shapes.of(spec)
    shapes: list[tuple[int, ...]] = []
    prev = s.dense_in
    for w in s.bottom:
        shapes += [(w, prev), (w,)]
        prev = w
    if s.dcn_layers:
        n = (s.F + 1) * s.D
        shapes += [(n, s.dcn_rank)] * s.dcn_layers + [(s.dcn_rank, n)] * s.dcn_layers + [(n,)] * s.dcn_layers
    prev = s.top_in
    for w in s.top:
        shapes += [(w, prev), (w,)]
        prev = w
    return shapes


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def dense_param_bytes(spec: JobSpec) -> int:
    return sum(numel(s) for s in dense_param_shapes(spec)) * F32


def is_fixed_length(t: TableSpec) -> bool:
    """The runner's loader gives every sample the same number of ids (multi-hot, or
    one-hot when pooling_factor is 1); otherwise lengths are Poisson(pooling_factor)."""
    return t.multi_hot is not None or (t.pooling_factor or 1.0) == 1.0


def ids_per_batch(batch_size: int, t: TableSpec) -> int:
    """Ids one batch holds for one table: exact for fixed lengths; for Poisson
    lengths the mean plus two standard deviations (a window of B lengths)."""
    mean = batch_size * t.ids_per_sample
    if is_fixed_length(t):
        return int(mean)
    return int(mean + 2 * sqrt(mean))


def prefetch_depth(spec: JobSpec) -> int:
    """Batches the runner's Prefetcher keeps ready besides the one in use
    (slurm_dlrm/train/data.py): none when it has no loader threads or the source is
    made inline (synthetic data costs microseconds a batch)."""
    if spec.loader_workers == 0 or spec.data.type == "synthetic":
        return 0
    return spec.prefetch_batches


def batch_bytes(spec: JobSpec) -> int:
    """One input batch as the loader hands it over: dense f32, lengths i32, ids i64, labels f32."""
    s = Shapes.of(spec)
    return s.B * s.dense_in * F32 + s.F * s.B * I32 + s.ids * I64 + s.B * F32


@dataclass(frozen=True)
class StaticParts:
    """Bytes that live for the whole run."""

    emb_weights: int
    emb_opt_state: int
    emb_grad_bucket: int  # non-fused: DDP bucket holding full-table gradients
    dense_params: int
    dense_grads: int
    dense_opt_state: int
    small: int


def embedding_optimizer_state_bytes(spec: JobSpec, tables: list[int] | None = None) -> int:
    """Optimizer state of the tables, as fbgemm (fused) or torch (non-fused) allocates it.

    fbgemm keeps momentum in fp32 whatever the weight dtype (momentum1_dtype default).
    """
    total = 0
    # Over the indexes given, not `i in tables` per table: that was quadratic (10,000
    # tables took minutes, issue 32).
    for i in range(len(spec.tables)) if tables is None else tables:
        t = spec.tables[i]
        elems = t.rows * t.dim
        kind = spec.optimizer.type
        if kind == "sgd":
            continue
        if kind == "adagrad":
            total += elems * F32
        elif kind == "rowwise_adagrad":
            total += t.rows * F32
        elif kind == "adam":
            total += 2 * elems * F32
    return total


def dense_opt_state_multiplier(spec: JobSpec) -> int:
    """The dense optimizer's state per parameter, in parameter sizes."""
    return {"sgd": 0, "adagrad": 1, "rowwise_adagrad": 1, "adam": 2}[spec.optimizer.type]


def is_fused(spec: JobSpec, device: str = "cuda") -> bool:
    """Whether the embedding optimizer runs fused in fbgemm's backward kernel.

    fbgemm-gpu-cpu 1.8.0: "Optimizer adam is not supported in CPU mode", so Adam on
    the CPU takes the non-fused path (torchrec's dense kernel and torch.optim.Adam).
    """
    if device == "cpu" and spec.optimizer.type == "adam":
        return False
    return spec.optimizer.fused


def table_weight_bytes(t: TableSpec, device: str = "cuda") -> int:
    """fbgemm-gpu-cpu 1.8.0 has no bf16 lookup, so the runner keeps bf16 tables in fp32
    on the CPU (slurm_dlrm/train/model.py)."""
    if device == "cpu" and t.dtype == "bf16":
        return t.rows * t.dim * F32
    return t.weight_bytes


def static_parts(spec: JobSpec, device_tables: list[int], device: str = "cuda") -> StaticParts:
    emb_w = sum(table_weight_bytes(spec.tables[i], device) for i in device_tables)
    emb_opt = embedding_optimizer_state_bytes(spec, device_tables)
    grad_bucket = 0 if is_fused(spec, device) else emb_w
    dense = dense_param_bytes(spec)
    return StaticParts(emb_w, emb_opt, grad_bucket, dense, dense, dense * dense_opt_state_multiplier(spec),
                       small_buffer_bytes(spec, device_tables, device))


def small_buffer_bytes(spec: JobSpec, device_tables: list[int], device: str = "cuda") -> int:
    """The small tensors a rank keeps from its first step on: the dot interaction's
    triu_indices buffer (2 x pairs int64) and the libraries' bookkeeping. With fused
    kernels, counted item by item from what torchrec 1.8, fbgemm-gpu 1.8 and torch 2.13
    allocate (their source lines below; each checked against a traced build): a few
    hundred bytes to a few KiB, which decide whether an estimate is under where a
    job's peak is an evaluation (everything else of it counted to the byte, issue 51).
    The non-fused path (torchrec's dense kernel) keeps the allowance it had."""
    s = Shapes.of(spec)
    triu = 2 * comb(s.F + 1, 2) * I64 if spec.interaction.type == "dot" else 0
    if not is_fused(spec, device):
        return triu + 512 + 24 * s.F
    kind = spec.optimizer.type
    n_dense = len(dense_param_shapes(spec))
    # fbgemm's SplitTableBatchedEmbeddingBagsCodegen, one per weight dtype of this rank's
    # tables (torchrec groups tables by data type)
    groups: dict[int, int] = {}
    for i in device_tables:
        w = table_weight_bytes(spec.tables[i], device) // max(1, spec.tables[i].rows * spec.tables[i].dim)
        groups[w] = groups.get(w, 0) + 1
    tbe = sum(tbe_bookkeeping_bytes(n, kind) for n in groups.values())
    f_own = len(device_tables)
    # torchrec's output dist (embeddingbag.py _create_output_dist: the features' order,
    # permute_pooled_embedding_modules: 2 x (F+1) + 2 x F int64 offsets/permutes) and, at
    # the first forward, the table-wise output dist's 2 int32 (dist_data.py)
    out_dist = f_own * I64 + 2 * (f_own + 1) * I64 + 2 * f_own * I64 + 2 * I32
    # DDP's Reducer with find_unused_parameters: its local-used map and the device copy,
    # an int32 per dense parameter each (distributed.py _ddp_init_helper); the runner
    # asks for it only with several ranks (train/model.py), so one rank keeps none
    ddp = 2 * n_dense * I32 if spec.world_size > 1 else 0
    # torch.optim.Adagrad makes each parameter's `step` (a float32 scalar) at __init__: the
    # dense optimizer's, and apply_optimizer_in_backward's over every table's parameter
    # (torch Adagrad, torchrec RowWiseAdagrad); SGD has none (fused Adam's torch.optim.Adam
    # makes none until a step, which the fused tables never run)
    steps = 0
    if kind in ("adagrad", "rowwise_adagrad"):
        steps = (n_dense + len(spec.tables)) * F32
    elif kind == "adam":
        steps = n_dense * F32  # torch.optim.Adam: from the first step on
    mesh = I32  # init_device_mesh's arange
    loss_sum = F32  # the runner's running loss, from the first step on
    return triu + tbe + out_dist + ddp + steps + mesh + loss_sum


def tbe_bookkeeping_bytes(n_tables: int, optimizer: str) -> int:
    """The small buffers of one fbgemm TBE module over `n_tables` tables
    (split_table_batched_embeddings_ops_training.py, fbgemm-gpu 1.8 `__init__`): per-table
    offsets (D_offsets (T+1) int32, hash_size_cumsum (T+1) int64, rows_per_table and
    feature_dims T int64 each, bounds_check_warning), an `apply_split` (T int64 offsets,
    T int32 placements) for the weights and each optimizer state, five int64 scalars for
    each state it does not use, the learning rate, max_counter, iter and iter_cpu, the UVM
    cache statistics (int64, int32, int64), the cache state (5 int64 + 2 int64) and the
    raw-embedding-streaming buffers (2 int32)."""
    T = n_tables
    states = {"sgd": 0, "adagrad": 1, "rowwise_adagrad": 1, "adam": 2}.get(optimizer, 1)
    unused = 4 - states  # of momentum1, momentum2, prev_iter, row_counter
    if optimizer == "adam":
        unused = 2  # prev_iter, row_counter
    return ((T + 1) * I32 + (T + 1) * I64 + 2 * T * I64 + I64
            + (1 + states) * T * (I64 + I32) + unused * 5 * I64
            + F32 + F32 + 2 * I64
            + 2 * I64 + I32
            + 7 * I64
            + 2 * I32)


# The loss, its detached copy and backward's gradient seed: three float32 scalars live
# from the loss to the end of the step (allocation log: 12 bytes at every peak)
LOSS_SCALARS_BYTES = 3 * F32


def lookup_inputs(tape: Tape, spec: JobSpec, tables: list[int]) -> list[_T]:
    """The int64 ids and offsets fbgemm's lookup keeps from its last call (torchrec 1.8
    allocation log): one rank's batch ids and int64 offsets; with several ranks the ids
    its tables received and their offsets."""
    s = Shapes.of(spec)
    ws = max(1, spec.world_size)
    if ws == 1:
        return [tape.alloc(s.ids * I64, INPUTS), tape.alloc((s.F * s.B + 1) * I64, INDEX_OFFSETS)]
    ids_own = sum(ids_per_batch(s.B, spec.tables[i]) for i in tables)
    return [tape.alloc(len(tables) * ws * s.B * I32 + ws * ids_own * I64, INDEX_OFFSETS),
            tape.alloc((len(tables) * ws * s.B + 1) * I64, INDEX_OFFSETS)]


def simulate_step(spec: JobSpec, device: str = "cuda", device_tables: list[int] | None = None, *,
                  first_step: bool = False) -> Tape:
    """Replay one training step (after model set-up) and return the tape.

    `device` "cuda" or "cpu": fused Adam exists only on CUDA (fbgemm's CPU kernels
    refuse it), and CUDA's torch optimizers use the multi-tensor (foreach) kernels.
    `first_step`: DDP's first iteration keeps the weight gradients (and, non-fused,
    the full-table gradient) as separate tensors until the end of backward, and Adam's
    lazily created state does not exist yet. Take the max of both.
    """
    tables = list(range(len(spec.tables))) if device_tables is None else device_tables
    s = Shapes.of(spec)
    B, act = s.B, s.act_bytes
    fused = is_fused(spec, device)
    lazy_state_absent = first_step
    # DDP's first iteration with find_unused_parameters (the runner's, several ranks only:
    # train/model.py) keeps the gradients apart until the end of backward; one rank's DDP
    # hands each to its bucket at once from the first step on (allocation log, torch 2.13)
    grads_held = first_step and spec.world_size > 1
    full_grad_held = first_step
    foreach_optimizer = device == "cuda"
    tape = Tape()
    held: list[_T] = []  # first step: weight gradients kept until the end of backward

    def release_wgrad(t: _T) -> None:
        if grads_held:
            held.append(t)
        else:
            tape.free(t)

    st = static_parts(spec, tables, device)
    tape.alloc(st.emb_weights, EMB_WEIGHTS)
    emb_opt = st.emb_opt_state
    dense_opt = st.dense_opt_state
    if lazy_state_absent and spec.optimizer.type == "adam":
        dense_opt = 0
        if not fused:
            emb_opt = 0
    tape.alloc(emb_opt, EMB_OPT)
    tape.alloc(st.emb_grad_bucket, EMB_GRAD)
    tape.alloc(st.dense_params, DENSE_PARAMS)
    tape.alloc(st.dense_grads, DENSE_GRADS)
    tape.alloc(dense_opt, DENSE_OPT)
    tape.alloc(st.small, OTHER)

    # fbgemm's lookup keeps the int64 ids and offsets of its last call until its next call:
    # the previous step's are live until this step's lookup has made its own
    cache = [] if first_step else lookup_inputs(tape, spec, tables)

    # The batch in use. Batches the loader threads prepare ahead (`prefetch_depth`) stay
    # in host memory (pinned, on a GPU) until their step: see the host breakdown.
    one_batch = batch_bytes(spec)
    tape.where = "input"
    batch = tape.alloc(one_batch, INPUTS)

    # ---------------------------------------------------------------- forward
    # Mixed precision (the runner's forward under torch.autocast): MLP and bmm inputs,
    # weights and outputs in half precision (casts saved for backward), the embedding
    # outputs, the interaction's cat, DCN's bias adds and the loss in fp32.
    amp = spec.mixed_precision in ("fp16", "bf16")
    h = 2 if amp else act
    x_cast, relu_bottom, wcast_bottom = forward_bottom_mlp(tape, s, amp, h)

    tape.where = "forward: embeddings"
    # KJT offsets (cached with the batch) and the per-key (F x (B+1)) offsets of the input dist
    off32 = tape.alloc((s.F * B + 1) * I32 + s.F * (B + 1) * I32, INDEX_OFFSETS)
    ws = max(1, spec.world_size)
    recv: _T | None = None
    if ws == 1:
        tape.alloc((s.F * B + 1) * I64, INDEX_OFFSETS)  # the int64 offsets TBE saves (kept to the next lookup)
        tape.free(*cache)
        pooled_raw = tape.alloc(B * s.F * s.D * s.out_bytes, EMB_OUT)
        pooled = tape.alloc(B * s.F * s.D * s.out_bytes, EMB_OUT)  # KeyedTensor's cat of the groups
        tape.free(pooled_raw)
    else:
        # Table-wise sharding: the input all-to-all sends each table's ids to its rank,
        # which looks up its tables for the global batch (ws x B) and sends the pooled
        # rows back (output all-to-all). Sizes from the torchrec 1.8 allocation log.
        f_own = len(tables)
        ids_own = sum(ids_per_batch(B, spec.tables[i]) for i in tables)
        local_ids = s.ids
        perm = tape.alloc(s.F * B * I32 + local_ids * I64, INDEX_OFFSETS)  # permuted for sending
        recv = tape.alloc(f_own * ws * B * I32 + ws * ids_own * I64, INDEX_OFFSETS)  # received
        tape.free(perm)
        tape.alloc((f_own * ws * B + 1) * I64, INDEX_OFFSETS)  # kept by the lookup until the next step
        tape.free(*cache)
        out_raw = tape.alloc(ws * B * f_own * s.D * s.out_bytes, EMB_OUT)
        buf1 = tape.alloc(ws * B * f_own * s.D * s.out_bytes, EMB_OUT)
        buf2 = tape.alloc(ws * B * f_own * s.D * s.out_bytes, EMB_OUT)
        tape.free(buf1, out_raw)
        tmp = tape.alloc(B * s.F * s.D * s.out_bytes, EMB_OUT)
        tape.free(buf2)
        pooled = tape.alloc(B * s.F * s.D * s.out_bytes, EMB_OUT)
        tape.free(tmp)

    tape.where = "forward: interaction"
    n_comb = (s.F + 1) * s.D
    dcast = tape.alloc(B * s.D * act, ACT_INTER) if amp else None  # dense part promoted for the cat
    combined = tape.alloc(B * n_comb * act, ACT_INTER)  # cat(dense, sparse): B x (F+1) x D
    tape.free(dcast)
    # per DCN layer: v (B x r), s = W v + b, x_out, and (amp) the saved half cast of x_in
    dcn_saved: list[tuple[_T, _T, _T, _T | None]] = []
    dcn_wcasts: list[_T | None] = []
    bmm_casts: tuple[_T | None, _T | None] = (None, None)
    top_cast: _T | None = None
    if s.dcn_layers:
        x_prev: _T = combined
        w_prev: _T | None = None
        for _ in range(s.dcn_layers):
            xc = tape.alloc(B * n_comb * h, ACT_INTER) if amp else None
            dcn_wcasts.append(tape.alloc(2 * n_comb * s.dcn_rank * h, ACT_INTER) if amp else None)  # V, W
            v = tape.alloc(B * s.dcn_rank * h, ACT_INTER)
            w_out = tape.alloc(B * n_comb * h, ACT_INTER)
            tape.free(w_prev)  # the Python variable of the previous layer is rebound only now
            w_prev = w_out
            sb = tape.alloc(B * n_comb * act, ACT_INTER)
            m = tape.alloc(B * n_comb * act, ACT_INTER)
            x_out = tape.alloc(B * n_comb * act, ACT_INTER)
            tape.free(m)
            if amp and x_prev is not combined:
                tape.free(x_prev)  # only its half cast is saved
            dcn_saved.append((v, sb, x_out, xc))
            x_prev = x_out
        tape.free(w_prev)
        top_input = x_prev
        if amp:
            top_cast = tape.alloc(B * n_comb * h, ACT_TOP)
    else:
        npairs = comb(s.F + 1, 2)
        if amp:
            bmm_casts = (tape.alloc(B * n_comb * h, ACT_INTER), tape.alloc(B * n_comb * h, ACT_INTER))
        z = tape.alloc(B * (s.F + 1) ** 2 * h, ACT_INTER)  # bmm
        zf = tape.alloc(B * npairs * h, ACT_INTER)  # upper triangle
        top_input = tape.alloc(B * s.top_in * h, ACT_INTER)  # cat(dense, pairs)
        if amp:
            tape.free(combined)  # bmm saved its half casts instead
        tape.free(z, zf)

    relu_top, wcast_top, logits = forward_top_mlp(tape, s, amp, h)
    tape.free(pooled)  # the pooled embeddings are not saved by the cat that consumed them
    if amp:
        if top_cast is not None:
            tape.free(top_input)  # DCN's fp32 output; the top MLP saved its half cast
            top_input = top_cast
        tape.free(wcast_bottom[0])  # autocast's cache is dropped on exit; the first layer saved no weight

    # ---------------------------------------------------------------- backward
    tape.where = "backward: loss"
    scalars = tape.alloc(LOSS_SCALARS_BYTES, OTHER)
    t1 = tape.alloc(B * F32, BWD)
    t2 = tape.alloc(B * F32, BWD)
    tape.free(t2, t1)
    g = tape.alloc(B * F32, BWD)
    if amp:
        gh = tape.alloc(B * h, BWD)
        tape.free(g)
        g = gh

    def wgrad(n: int) -> _T:  # copied into the DDP bucket once released
        return weight_grad(tape, n, amp, h, BWD)

    g = backward_top_mlp(tape, s, h, g, relu_top, wcast_top, top_input, wgrad, release_wgrad)
    if amp and s.dcn_layers:  # back to fp32 for the cross network
        gf = tape.alloc(B * n_comb * act, BWD)
        tape.free(g)
        g = gf

    tape.where = "backward: interaction"
    if s.dcn_layers:
        g_comb = backward_dcn(tape, s, amp, h, g, combined, dcn_saved, dcn_wcasts, wgrad, release_wgrad,
                              x0_held_to_end=False)
        g_dense: _T | None = tape.alloc(B * s.D * h, BWD) if amp else None  # else a view of g_comb
    else:
        npairs = comb(s.F + 1, 2)
        nz = tape.alloc(B * (s.F + 1) ** 2 * h, BWD)
        ip = tape.alloc(B * (s.F + 1) ** 2 * h, BWD)
        tape.free(nz)
        gb1 = tape.alloc(B * n_comb * h, BWD)
        gb2 = tape.alloc(B * n_comb * h, BWD)
        tape.free(ip, combined, *bmm_casts)
        if amp:  # the casts' backward: both gradients back to fp32
            f1 = tape.alloc(B * n_comb * act, BWD)
            tape.free(gb1)
            f2 = tape.alloc(B * n_comb * act, BWD)
            tape.free(gb2)
            gb1, gb2 = f1, f2
        g_comb = tape.alloc(B * n_comb * act, BWD)
        tape.free(gb1, gb2)
        dc = tape.alloc(B * s.D * h, BWD) if amp else None  # the dense slice cast back to half
        g_dense = tape.alloc(B * s.D * h, BWD)  # dense path: both cats' slices added
        tape.free(g, dc)

    tape.where = "backward: embeddings"
    g_emb = tape.alloc(B * s.F * s.D * s.out_bytes, EMB_OUT_GRAD)  # contiguous grad for TBE
    if ws > 1:  # the output all-to-all backwards: this rank's tables' grads for the global batch
        g_recv = tape.alloc(ws * B * len(tables) * s.D * s.out_bytes, EMB_OUT_GRAD)
        tape.free(g_emb)
        g_emb = g_recv
    full_grad: _T | None = None
    # (the int64 offsets stay: the lookup's cache until the next step's lookup)
    if s.dcn_layers:
        if amp:
            tape.free(g_comb)
        if not fused:
            full_grad = tape.alloc(st.emb_weights, EMB_GRAD)
        tape.free(g_emb)
    else:
        tape.free(g_comb)
        if not fused:
            full_grad = tape.alloc(st.emb_weights, EMB_GRAD)
        tape.free(g_emb)
    if not full_grad_held:
        tape.free(full_grad)

    # DCN without autocast: the dense grad is a view of the interaction grad
    backward_bottom_mlp(tape, s, h, g_dense, relu_bottom, wcast_bottom, wgrad, release_wgrad, view_of=g_comb)
    tape.free(full_grad, x_cast, recv, *held)

    # ---------------------------------------------------------------- optimizer step
    tape.where = "optimizer step"
    _optimizer_temps(spec, tape, tables, foreach_optimizer, fused)
    tape.free(batch, off32, logits, scalars)
    return tape


# ---------------------------------------------------------------- the dense part
# The bottom MLP, DCN's backward and the top MLP replay the same in both backends
# (timeline_torch.py calls these too): the backends differ in the embeddings, the
# interaction's forward and where weight gradients go (`wgrad` makes one, `release`
# hands it over once its layer is done).

WeightGrad = Callable[[int], "_T"]
Release = Callable[["_T"], None]


def weight_grad(tape: Tape, n: int, amp: bool, h: int, part: str) -> _T:
    """A weight gradient of `n` elements: under autocast made in half precision and
    cast back to fp32."""
    if not amp:
        return tape.alloc(n * F32, part)
    half = tape.alloc(n * h, BWD)
    full = tape.alloc(n * F32, part)
    tape.free(half)
    return full


def forward_bottom_mlp(tape: Tape, s: Shapes, amp: bool, h: int) -> tuple[_T | None, list[_T], list[_T | None]]:
    """Returns the saved half cast of the dense input (autocast), each layer's ReLU
    output and each layer's half cast of its weights (autocast)."""
    tape.where = "forward: bottom MLP"
    B = s.B
    relu: list[_T] = []
    wcasts: list[_T | None] = []
    x_cast = tape.alloc(B * s.dense_in * h, ACT_BOTTOM) if amp else None  # dense input, saved
    prev = s.dense_in
    for w in s.bottom:
        wcasts.append(tape.alloc((w * prev + w) * h, ACT_BOTTOM) if amp else None)
        pre = tape.alloc(B * w * h, ACT_BOTTOM)
        relu.append(tape.alloc(B * w * h, ACT_BOTTOM))
        tape.free(pre)
        prev = w
    return x_cast, relu, wcasts


def forward_top_mlp(tape: Tape, s: Shapes, amp: bool, h: int) -> tuple[list[_T], list[_T | None], _T]:
    """Returns each hidden layer's ReLU output, each layer's half cast of its weights
    (autocast) and the logits."""
    tape.where = "forward: top MLP"
    B = s.B
    relu: list[_T] = []
    wcasts: list[_T | None] = []
    prev = s.top_in
    for w in s.top[:-1]:
        wcasts.append(tape.alloc((w * prev + w) * h, ACT_TOP) if amp else None)
        pre = tape.alloc(B * w * h, ACT_TOP)
        relu.append(tape.alloc(B * w * h, ACT_TOP))
        tape.free(pre)
        prev = w
    wcasts.append(tape.alloc((s.top[-1] * prev + s.top[-1]) * h, ACT_TOP) if amp else None)
    logits = tape.alloc(B * s.top[-1] * h, ACT_TOP)
    return relu, wcasts, logits


def backward_top_mlp(tape: Tape, s: Shapes, h: int, g: _T, relu: list[_T], wcasts: list[_T | None],
                     top_input: _T, wgrad: WeightGrad, release: Release) -> _T:
    """From the loss's gradient `g` down the top MLP; returns the gradient of its input."""
    tape.where = "backward: top MLP"
    B = s.B
    widths_in = [s.top_in, *s.top[:-1]]
    for j in range(len(s.top) - 1, -1, -1):
        n_out, n_in = s.top[j], widths_in[j]
        if j < len(s.top) - 1:  # hidden layer: ReLU backward first
            gp = tape.alloc(B * n_out * h, BWD)
            tape.free(g, relu[j])
            g = gp
        gin = tape.alloc(B * n_in * h, BWD)
        wg = wgrad(n_out * n_in + n_out)  # weight+bias grad
        tape.free(g, wcasts[j])
        if j == 0:
            tape.free(top_input)
        release(wg)
        g = gin
    return g


def backward_dcn(tape: Tape, s: Shapes, amp: bool, h: int, g: _T, x0: _T,
                 saved: list[tuple[_T, _T, _T, _T | None]], wcasts: list[_T | None], wgrad: WeightGrad,
                 release: Release, *, x0_held_to_end: bool) -> _T:
    """DCN's cross layers backward, from the gradient `g` of the last layer's output;
    returns the gradient of x0 (the interaction's input, accumulated over layers).
    `saved` per layer: v (B x r), s = W v + b, x_out, and the saved half cast of the
    layer's input (None where none was saved: no autocast, or torch's first layer).
    `x0_held_to_end`: torch's stack (x0) is freed after the last two gradient sums,
    torchrec's cat before them (as each allocation log shows)."""
    B, act = s.B, s.act_bytes
    n_comb = (s.F + 1) * s.D
    acc: _T | None = None
    G = g
    for layer in range(s.dcn_layers - 1, -1, -1):
        v, sb, _x_out, xc = saved[layer]
        x_in = x0 if layer == 0 else saved[layer - 1][2]
        gs = tape.alloc(B * n_comb * act, BWD)
        gx0 = tape.alloc(B * n_comb * act, BWD)
        if amp:  # s = W v + b lives until the gradient's half cast is made (allocation log)
            gsh = tape.alloc(B * n_comb * h, BWD)
            tape.free(gs, sb)
            gs = gsh
        else:
            tape.free(sb)
        if acc is None:
            acc = gx0
        else:
            new = tape.alloc(B * n_comb * act, BWD)
            tape.free(acc, gx0)
            acc = new
        wg = wgrad(n_comb * s.dcn_rank + n_comb)
        gv = tape.alloc(B * s.dcn_rank * h, BWD)
        tape.free(gs, v)
        wg2 = wgrad(n_comb * s.dcn_rank)
        gxv = tape.alloc(B * n_comb * h, BWD)
        tape.free(gv)
        if xc is not None:  # through the input's half cast, back to fp32
            tape.free(xc)
            gxf = tape.alloc(B * n_comb * act, BWD)
            tape.free(gxv)
            gxv = gxf
        release(wg)
        release(wg2)
        tape.free(wcasts[layer])
        if layer > 0:
            tape.free(x_in)
            G_next = tape.alloc(B * n_comb * act, BWD)
            tape.free(G, gxv)
            G = G_next
        else:
            if not x0_held_to_end:
                tape.free(x0)
            for extra in (G, gxv):  # identity path and V path into x0
                new = tape.alloc(B * n_comb * act, BWD)
                tape.free(acc, extra)
                acc = new
            tape.free(x0)
    assert acc is not None  # noqa: S101 - dcn_layers >= 1
    return acc


def backward_bottom_mlp(tape: Tape, s: Shapes, h: int, g_dense: _T | None, relu: list[_T],
                        wcasts: list[_T | None], wgrad: WeightGrad, release: Release, *,
                        view_of: _T | None = None) -> None:
    """From the gradient of the bottom MLP's output down to its first layer (whose input
    needs no gradient). `g_dense` None: that gradient is a view of `view_of`, freed
    with it."""
    tape.where = "backward: bottom MLP"
    B = s.B
    g_in = g_dense
    widths_in = [s.dense_in, *s.bottom[:-1]]
    for i in range(len(s.bottom) - 1, -1, -1):
        gp = tape.alloc(B * s.bottom[i] * h, BWD)
        tape.free(g_in, relu[i])
        if g_in is None:
            tape.free(view_of)
        wg = wgrad(s.bottom[i] * widths_in[i] + s.bottom[i])
        g_in = tape.alloc(B * widths_in[i] * h, BWD) if i > 0 else None
        tape.free(gp, wcasts[i])
        release(wg)


def _optimizer_temps(spec: JobSpec, tape: Tape, tables: list[int], foreach: bool, fused: bool) -> None:
    """Temporaries of the torch optimizers' step (the fused embedding update runs in backward).

    torch's single-tensor Adagrad makes `std = state.sqrt()` per parameter (two alive at
    the hand-over); Adam makes sqrt and a division per parameter. On CUDA the default
    foreach kernels make them for every parameter at once.
    """
    kind = spec.optimizer.type
    per_param = {"sgd": 0, "adagrad": 1, "rowwise_adagrad": 1, "adam": 2}[kind]
    if not per_param:
        return
    sizes = [numel(sh) * F32 for sh in dense_param_shapes(spec)]
    if not fused:
        emb_sizes = [spec.tables[i].rows * spec.tables[i].dim * F32 for i in tables]  # fp32 grads/state
        if kind == "rowwise_adagrad":  # torchrec RowWiseAdagrad: per-row temps
            emb_sizes = [spec.tables[i].rows * F32 for i in tables]
        # The runner hands the tables to the optimizer from a set (order varies from run
        # to run); ascending order puts the two largest side by side: the worst case.
        sizes = sorted(emb_sizes) + sizes
    if foreach:
        tape.alloc(sum(sizes), OPT_TEMPS)
        return
    prev: _T | None = None
    prev2: _T | None = None
    for n in sizes:
        if per_param == 1:
            cur = tape.alloc(n, OPT_TEMPS)
            tape.free(prev)
            prev = cur
        else:
            sq = tape.alloc(n, OPT_TEMPS)
            div = tape.alloc(n, OPT_TEMPS)
            tape.free(sq, prev2)
            prev2 = div
    tape.free(prev, prev2)
