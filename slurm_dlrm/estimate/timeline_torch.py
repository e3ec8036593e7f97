"""One training step of the runner's `backend: torch` (slurm_dlrm/train/backend_torch.py:
the plain-PyTorch DLRM of slurm_dlrm/train/plain_dlrm.py), replayed symbolically as
`timeline.simulate_step` does for torchrec. Pure Python, no torch.

Written against benchmarks/_measure.py's allocation log (`MEASURE_DEBUG=1`, a spec
with `backend: torch`), torch 2.13 on the CPU. Where it differs from torchrec's step:
- the batch's per-table offsets are made by the model (cumsum, minus lengths: F x B
  int64, saved for backward); each `nn.EmbeddingBag` returns its pooled rows in the
  table's dtype and keeps two B-long int64 tensors for backward;
- no DDP with one process: dense and table gradients are made in backward and kept
  (until the next step's zero_grad), not copied into a bucket allocated once; with
  several ranks, DDP's buckets hold the dense gradients (`gradient_as_bucket_view`);
- fused (sparse) tables: a sparse gradient per table (ids x dim rows + int64 ids,
  uncoalesced), then the torch optimizer's sparse step (coalesce, squares, masks);
  non-fused: a full-table gradient per table;
- every rank holds every table (DDP replicates them).
The sparse optimizer's temporaries scale with the unique ids of a batch, which depend
on the data: counted as if every id were unique (an upper bound).
"""

from __future__ import annotations

from math import comb
from typing import Any

from slurm_dlrm.estimate.timeline import (
    ACT_INTER,
    ACT_TOP,
    BWD,
    DENSE_GRADS,
    DENSE_OPT,
    DENSE_PARAMS,
    EMB_GRAD,
    EMB_OPT,
    EMB_OUT,
    EMB_OUT_GRAD,
    EMB_WEIGHTS,
    F32,
    I64,
    INDEX_OFFSETS,
    INPUTS,
    LOSS_SCALARS_BYTES,
    OPT_TEMPS,
    OTHER,
    Shapes,
    StaticParts,
    Tape,
    backward_bottom_mlp,
    backward_dcn,
    backward_top_mlp,
    batch_bytes,
    dense_opt_state_multiplier,
    dense_param_bytes,
    dense_param_shapes,
    forward_bottom_mlp,
    forward_top_mlp,
    ids_per_batch,
    numel,
    weight_grad,
)
from slurm_dlrm.spec import JobSpec, TableSpec

# torch's Adagrad and Adam keep a 0-dim fp32 step counter per parameter.
STEP_COUNTER_BYTES = 4
# DistributedDataParallel's construction broadcasts rank 0's parameters and buffers in
# flattened buckets of this size (torch/nn/parallel/distributed.py `_sync_module_states`,
# 250 MiB): one flat copy of a bucket lives beside the model meanwhile.
DDP_BROADCAST_BUCKET_BYTES = 250 * (1 << 20)


def table_dtype_bytes(t: TableSpec) -> int:
    return t.dtype_bytes  # nn.EmbeddingBag keeps bf16 on the CPU too


def embedding_optimizer_state_bytes(spec: JobSpec, tables: list[int]) -> int:
    """State of the tables' torch optimizer. Adagrad, SparseAdam and non-fused Adam keep
    it in the table's dtype (zeros_like); row-wise Adagrad (fused) one fp32 per row; the
    non-fused row-wise Adagrad is torch Adagrad (full size)."""
    kind, fused = spec.optimizer.type, spec.optimizer.fused
    total = 0
    for i in tables:
        t = spec.tables[i]
        elems = t.rows * t.dim
        if kind == "adagrad" or (kind == "rowwise_adagrad" and not fused):
            total += elems * table_dtype_bytes(t) + STEP_COUNTER_BYTES
        elif kind == "rowwise_adagrad":
            total += t.rows * F32
        elif kind == "adam":
            total += 2 * elems * table_dtype_bytes(t) + (0 if fused else STEP_COUNTER_BYTES)
    return total


def _dense_opt_bytes(spec: JobSpec) -> int:
    n_params = len(dense_param_shapes(spec))
    mult = dense_opt_state_multiplier(spec)
    if not mult:
        return 0
    return dense_param_bytes(spec) * mult + n_params * STEP_COUNTER_BYTES


def sparse_tables(spec: JobSpec, device: str) -> bool:
    """Fused specs take sparse table gradients, but NCCL (CUDA, several ranks) has no
    sparse all-reduce: dense there (backend_torch.build)."""
    return spec.optimizer.fused and not (device == "cuda" and spec.world_size > 1)


def static_parts(spec: JobSpec, device_tables: list[int], device: str = "cuda") -> StaticParts:
    emb_w = sum(spec.tables[i].rows * spec.tables[i].dim * table_dtype_bytes(spec.tables[i]) for i in device_tables)
    dense = dense_param_bytes(spec)
    s = Shapes.of(spec)
    small = 2 * comb(s.F + 1, 2) * I64 if spec.interaction.type == "dot" else 0  # the triu index buffer
    ddp = spec.world_size > 1
    # DDP's buckets (gradient_as_bucket_view): the dense gradients, and non-fused the
    # tables' gradients, live for the whole run
    grad_bucket = emb_w if ddp and not sparse_tables(spec, device) else 0
    return StaticParts(emb_w, embedding_optimizer_state_bytes(spec, device_tables), grad_bucket, dense,
                       dense if ddp else 0, _dense_opt_bytes(spec), small)


def static_bytes(spec: JobSpec, device_tables: list[int], device: str) -> int:
    st = static_parts(spec, device_tables, device)
    return st.emb_weights + st.emb_opt_state + st.emb_grad_bucket + st.dense_params + st.dense_grads \
        + st.dense_opt_state + st.small


def simulate_step(spec: JobSpec, device: str = "cuda", device_tables: list[int] | None = None, *,
                  first_step: bool = False) -> Tape:
    """Replay one step of the torch backend; `first_step`: lazily created optimizer
    state (Adam, SparseAdam, row-wise Adagrad) does not exist yet."""
    tables = list(range(len(spec.tables))) if device_tables is None else device_tables
    s = Shapes.of(spec)
    B, F, D = s.B, s.F, s.D
    ddp = spec.world_size > 1
    sparse = sparse_tables(spec, device)
    kind = spec.optimizer.type
    tape = Tape()
    st = static_parts(spec, tables, device)
    lazy_tables = kind == "adam" or (kind == "rowwise_adagrad" and sparse)
    # optimizer state made at construction (Adagrad) exists when DDP broadcasts the
    # parameters; lazily made state (Adam, SparseAdam, row-wise Adagrad) only from the
    # first step
    tape.alloc(st.emb_weights, EMB_WEIGHTS)
    tape.alloc(0 if lazy_tables else st.emb_opt_state, EMB_OPT)
    tape.alloc(st.dense_params, DENSE_PARAMS)
    tape.alloc(0 if kind == "adam" else st.dense_opt_state, DENSE_OPT)
    tape.alloc(st.small, OTHER)
    if ddp:
        tape.where = "DDP set-up: broadcast of rank 0's parameters"
        tape.free(tape.alloc(ddp_broadcast_bucket_bytes(spec, tables), OTHER))
    tape.alloc(st.emb_grad_bucket, EMB_GRAD)
    tape.alloc(st.dense_grads, DENSE_GRADS)
    if lazy_tables and not first_step:
        tape.alloc(st.emb_opt_state, EMB_OPT)
    if kind == "adam" and not first_step:
        tape.alloc(st.dense_opt_state, DENSE_OPT)

    tape.where = "input"
    batch = tape.alloc(batch_bytes(spec), INPUTS)

    amp = spec.mixed_precision in ("fp16", "bf16")
    act = F32
    h = 2 if amp else act
    ids_t = [ids_per_batch(B, spec.tables[i]) for i in range(F)]

    # ---------------------------------------------------------------- forward
    tape.where = "forward: offsets"
    ends = tape.alloc(F * B * I64, INDEX_OFFSETS)
    offsets = tape.alloc(F * B * I64, INDEX_OFFSETS)
    tape.free(ends)

    x_cast, relu_bottom, wcast_bottom = forward_bottom_mlp(tape, s, amp, h)

    tape.where = "forward: embeddings"
    pooled: list[Any] = []
    bag_saved: list[tuple[Any, Any]] = []
    # the pooled rows are cast to the dense part's dtype (`.to(x.dtype)`)
    dense_dtype = spec.mixed_precision if amp else "fp32"
    cast_tables = [spec.tables[i].dtype != dense_dtype for i in range(F)]
    for i in range(F):
        t = spec.tables[i]
        out_b = B * D * table_dtype_bytes(t)
        pooled.append(tape.alloc(out_b, EMB_OUT))
        bag_saved.append((tape.alloc(B * I64, INDEX_OFFSETS), tape.alloc(B * I64, INDEX_OFFSETS)))
        if cast_tables[i]:
            cast = tape.alloc(B * D * h, EMB_OUT)
            tape.free(pooled[-1])
            pooled[-1] = cast

    tape.where = "forward: interaction"
    n_comb = (F + 1) * D
    combined = tape.alloc(B * n_comb * h, ACT_INTER)  # stack(x, *pooled)
    # per DCN layer: v (B x r), s = W v + b, x_out, and (amp) the saved half cast of x_in;
    # under autocast the bias add promotes to fp32 (b is fp32), so s, x0 * s and x_out are
    # fp32 and the next layer casts its input again
    dcn_saved: list[tuple[Any, Any, Any, Any]] = []
    dcn_wcasts: list[Any] = []
    dots: Any = None
    top_cast: Any = None
    if s.dcn_layers:
        x_prev: Any = combined
        for layer in range(s.dcn_layers):
            dcn_wcasts.append(tape.alloc(2 * n_comb * s.dcn_rank * h, ACT_INTER) if amp else None)  # V, W
            xc = tape.alloc(B * n_comb * h, ACT_INTER) if amp and layer > 0 else None
            v = tape.alloc(B * s.dcn_rank * h, ACT_INTER)
            w_out = tape.alloc(B * n_comb * h, ACT_INTER)
            sb = tape.alloc(B * n_comb * act, ACT_INTER)
            tape.free(w_out)
            m = tape.alloc(B * n_comb * act, ACT_INTER)
            x_out = tape.alloc(B * n_comb * act, ACT_INTER)
            tape.free(m)
            if amp and x_prev is not combined:
                tape.free(x_prev)  # only its half cast is saved
            dcn_saved.append((v, sb, x_out, xc))
            x_prev = x_out
        top_input = x_prev
        if amp:
            top_cast = tape.alloc(B * n_comb * h, ACT_TOP)
    else:
        npairs = comb(F + 1, 2)
        dots = tape.alloc(B * (F + 1) ** 2 * h, ACT_INTER)
        picked = tape.alloc(B * npairs * h, ACT_INTER)
        top_input = tape.alloc(B * s.top_in * h, ACT_INTER)
        tape.free(picked)

    relu_top, wcast_top, logits = forward_top_mlp(tape, s, amp, h)
    tape.free(*pooled)  # the forward's list of pooled rows goes out of scope
    tape.free(dots)  # only the index gather's indices are saved
    if top_cast is not None:
        tape.free(top_input)  # DCN's fp32 output; the top MLP saved its half cast
        top_input = top_cast
    logits_f32 = tape.alloc(B * F32, ACT_TOP) if amp else None  # the loss runs in fp32 under autocast
    if amp:
        tape.free(wcast_bottom[0])

    # ---------------------------------------------------------------- backward
    tape.where = "backward: loss"
    scalars = tape.alloc(LOSS_SCALARS_BYTES, OTHER)
    t1 = tape.alloc(B * F32, BWD)
    t2 = tape.alloc(B * F32, BWD)
    tape.free(t2)
    g = tape.alloc(B * F32, BWD)
    tape.free(t1)
    if amp:
        gh = tape.alloc(B * h, BWD)
        tape.free(g, logits_f32)
        g = gh

    def wgrad(n: int) -> Any:
        """A weight gradient: DDP copies it into its bucket at once; one process keeps it."""
        full = weight_grad(tape, n, amp, h, DENSE_GRADS)
        if ddp:
            tape.free(full)
        return full

    def keep(_: Any) -> None:  # wgrad already let go of what DDP copied
        pass

    g = backward_top_mlp(tape, s, h, g, relu_top, wcast_top, top_input, wgrad, keep)

    tape.where = "backward: interaction"
    if amp and s.dcn_layers:  # back to fp32 for the cross network
        gf = tape.alloc(B * n_comb * act, BWD)
        tape.free(g)
        g = gf
    if s.dcn_layers:
        # the first layer saved no half cast of its input (the stack is half already)
        g_stack = backward_dcn(tape, s, amp, h, g, combined, dcn_saved, dcn_wcasts, wgrad, keep,
                               x0_held_to_end=True)
        if amp:  # the stack was half: its gradient cast back
            gh = tape.alloc(B * n_comb * h, BWD)
            tape.free(g_stack)
            g_stack = gh
        g_dense = tape.alloc(B * D * h, BWD)  # the dense slice of the stack's gradient
    else:
        nz = tape.alloc(B * (F + 1) ** 2 * h, BWD)
        ip = tape.alloc(B * (F + 1) ** 2 * h, BWD)
        tape.free(nz)
        gb1 = tape.alloc(B * n_comb * h, BWD)
        gb2 = tape.alloc(B * n_comb * h, BWD)
        tape.free(ip, gb1)
        g_stack = tape.alloc(B * n_comb * h, BWD)
        tape.free(gb2, combined)
        g_dense = tape.alloc(B * D * h, BWD)  # the cat's and the stack's slices added
        tape.free(g)

    tape.where = "backward: embeddings"
    table_grads: list[Any] = []
    for i in range(F - 1, -1, -1):
        t = spec.tables[i]
        tb = table_dtype_bytes(t)
        g_out = None
        if cast_tables[i]:
            g_out = tape.alloc(B * D * tb, EMB_OUT_GRAD)  # the cast's backward
        if sparse:
            vals = tape.alloc(ids_t[i] * D * tb, EMB_GRAD)
            tape.free(*bag_saved[i])
            kept = tape.alloc(ids_t[i] * I64 + ids_t[i] * D * tb, EMB_GRAD)  # AccumulateGrad's copy
            tape.free(vals)
        else:
            kept = tape.alloc(t.rows * D * tb, EMB_GRAD)
            tape.free(*bag_saved[i])
        tape.free(g_out)
        if ddp and not sparse:
            tape.free(kept)  # copied into the bucket
        table_grads.append(kept)
    tape.free(g_stack, offsets)

    backward_bottom_mlp(tape, s, h, g_dense, relu_bottom, wcast_bottom, wgrad, keep)
    tape.free(x_cast)

    # ---------------------------------------------------------------- optimizer step
    tape.where = "optimizer step"
    _table_optimizer_temps(spec, tape, tables, ids_t, sparse, first_step)
    _dense_optimizer_temps(spec, tape, device == "cuda")
    tape.free(scalars)
    tape.free(batch, logits)
    return tape


def ddp_broadcast_bucket_bytes(spec: JobSpec, tables: list[int]) -> int:
    """The largest flat bucket of DDP's initial broadcast: the parameters (tables, then
    the dense layers) and the dot interaction's index buffer, in order, cut into
    buckets once a bucket reaches DDP_BROADCAST_BUCKET_BYTES."""
    sizes = [spec.tables[i].rows * spec.tables[i].dim * table_dtype_bytes(spec.tables[i]) for i in tables]
    sizes += [F32 * numel(sh) for sh in dense_param_shapes(spec)]
    if spec.interaction.type == "dot":
        sizes.append(2 * comb(len(spec.tables) + 1, 2) * I64)
    biggest = acc = 0
    for n in sizes:
        acc += n
        if acc >= DDP_BROADCAST_BUCKET_BYTES:
            biggest, acc = max(biggest, acc), 0
    return max(biggest, acc)


def _chain(tape: Tape, sizes: list[int], per_param: int) -> None:
    """torch's single-tensor optimizers: `per_param` temporaries per parameter, the
    previous parameter's freed once the next one's exist."""
    prev: list[Any] = []
    for n in sizes:
        cur = [tape.alloc(n, OPT_TEMPS) for _ in range(per_param)]
        tape.free(*prev)
        prev = cur
    tape.free(*prev)


def _table_optimizer_temps(spec: JobSpec, tape: Tape, tables: list[int], ids_t: list[int], sparse: bool,
                           first_step: bool) -> None:
    kind = spec.optimizer.type
    if kind == "sgd":
        return
    if not sparse:
        per = {"adagrad": 1, "rowwise_adagrad": 1, "adam": 2}[kind]
        _chain(tape, [spec.tables[i].rows * spec.tables[i].dim * spec.tables[i].dtype_bytes for i in tables], per)
        return
    # sparse: coalesce (storage of the uncoalesced size), then per-row temporaries of
    # the unique rows (counted as every id unique); the previous table's coalesced
    # gradient and mask are freed only when the next table's exist (loop variables)
    prev: list[Any] = []
    for i in tables:
        t = spec.tables[i]
        n, row = ids_t[i], t.dim * t.dtype_bytes
        coal = tape.alloc(n * I64 + n * row, OPT_TEMPS)
        tape.free(*prev)
        if kind == "adagrad":
            sq = tape.alloc(n * row, OPT_TEMPS)
            tape.free(sq)
            mask = tape.alloc(n * I64 + n * row, OPT_TEMPS)
            div = tape.alloc(n * row, OPT_TEMPS)
            tape.free(div)
            prev = [coal, mask]
        elif kind == "rowwise_adagrad":
            sq = tape.alloc(n * t.dim * F32, OPT_TEMPS)
            mean = tape.alloc(n * F32, OPT_TEMPS)
            tape.free(sq)
            picked = tape.alloc(n * F32, OPT_TEMPS)
            sqrt = tape.alloc(n * F32, OPT_TEMPS)
            tape.free(picked)
            eps = tape.alloc(n * F32, OPT_TEMPS)
            tape.free(sqrt)
            scale = tape.alloc(n * F32, OPT_TEMPS)
            tape.free(eps)
            neg = tape.alloc(n * row, OPT_TEMPS)
            upd = tape.alloc(n * row, OPT_TEMPS)
            tape.free(neg, upd, scale, mean)
            prev = [coal]
        else:  # SparseAdam: masks of both moments, their updates, the step
            masks = [tape.alloc(n * row, OPT_TEMPS) for _ in range(4)]
            tape.free(*masks[:2])
            upd = tape.alloc(n * row, OPT_TEMPS)
            tape.free(*masks[2:], upd)
            prev = [coal]
    tape.free(*prev)


def _dense_optimizer_temps(spec: JobSpec, tape: Tape, foreach: bool) -> None:
    per = {"sgd": 0, "adagrad": 1, "rowwise_adagrad": 1, "adam": 2}[spec.optimizer.type]
    if not per:
        return
    sizes = [F32 * numel(sh) for sh in dense_param_shapes(spec)]
    if foreach:
        t = tape.alloc(sum(sizes) * per, OPT_TEMPS)
        tape.free(t)
        return
    _chain(tape, sizes, per)
