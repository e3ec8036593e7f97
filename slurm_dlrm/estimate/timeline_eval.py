"""The runner's held-out evaluation, replayed symbolically as `timeline.simulate_step`
replays a training step (issue 51). Pure Python, no torch.

What slurm_dlrm/train/runner.py and evaluation.py do when an evaluation is due, in order:
- the step's batch, outputs and (backend torch, one process) gradients are let go and
  `zero_grad` runs: what stays is the model's state (weights, optimizer state, DDP's
  buckets), as at the start of a step, with lazily made optimizer state made;
- held-out batch k is made (`heldout.HeldOut`: the synthetic eval stream's per-table lengths,
  concatenated; ids, dense rows, labels; or a slice of the npy files), copied to the
  device, and the model's forward runs under `torch.no_grad` (train mode: torchrec's
  DLRMTrain also computes the loss); sigmoid of the logits;
- from the first batch on, one 3 x samples float32 buffer holds the predictions, labels
  and planted P(click) (`Evaluator.predictions`); each batch's outputs are copied in and
  dropped before the next batch is made;
- several ranks: rank 0 receives every rank's buffer into one ranks x 3 x samples buffer;
- the metrics (`evaluation.compute`, both implementations): predictions and labels as
  float64, and the AUC/NE/calibration/accuracy temporaries; at the first evaluation the
  planted model's AUC runs the same computation again, after the first.

Without autograd nothing is saved for backward: a forward's tensor lives while a Python
variable holds it. Written against benchmarks/_measure.py's allocation log
(`MEASURE_DEBUG=1`, an eval phase) for both backends. On a GPU the held-out batch's host
copy, the buffer and the metrics are host memory (`eval_host_parts`); the device holds
the batch's device copy and the forward.
"""

from __future__ import annotations

from math import comb

from slurm_dlrm.estimate import timeline_torch
from slurm_dlrm.estimate.timeline import (
    ACT_BOTTOM,
    ACT_INTER,
    ACT_TOP,
    DENSE_GRADS,
    DENSE_OPT,
    DENSE_PARAMS,
    EMB_GRAD,
    EMB_OPT,
    EMB_OUT,
    EMB_WEIGHTS,
    F32,
    I32,
    I64,
    INDEX_OFFSETS,
    INPUTS,
    OTHER,
    Alloc,
    Shapes,
    StaticParts,
    Tape,
    batch_bytes,
    ids_per_batch,
    is_fixed_length,
    lookup_inputs,
    static_parts,
)
from slurm_dlrm.spec import JobSpec

# The part of the breakdown that the evaluation's own buffers go to.
EVAL_OUTPUTS = "evaluation_outputs"
# evaluation.compute (both implementations, torchrec.metrics 1.8 and the reference): the
# most it holds at once is 11 float64 values per sample: the predictions and labels as
# float64, the weights, NE's clamped copy and its cross-entropy terms, and AUC's sort
# (values and int64 order), the two reordered inputs and their cumulative sums
# (allocation log of `compute` over 1,000 to 16,000 samples: 11.00 x 8 bytes a sample).
METRICS_F64_PER_SAMPLE = 11

WHERE = "evaluation"


def eval_samples(spec: JobSpec) -> int:
    """Samples one rank evaluates: `eval.samples`, else `eval.batches` batches of the
    training batch size (a criteo-npy/tsv held-out set can be smaller; counted at its
    largest)."""
    if spec.eval.samples is not None:
        return int(spec.eval.samples)
    return spec.eval.batches * spec.batch_size


def simulate_eval(spec: JobSpec, device: str = "cuda", device_tables: list[int] | None = None, *,
                  rank0: bool = True) -> Tape:
    """Replay one evaluation (after at least one training step) and return the tape.
    `device` "cpu": the held-out set, the buffer and the metrics share the one memory
    with the model; "cuda": only the device's share (the batch's copy and the forward).
    `rank0`: with several ranks, rank 0 also receives the others' predictions."""
    tables = list(range(len(spec.tables))) if device_tables is None else device_tables
    torch_backend = _torch_backend(spec)
    tape = Tape()
    tape.where = f"{WHERE}: model state"
    st = timeline_torch.static_parts(spec, tables, device) if torch_backend else static_parts(spec, tables, device)
    _alloc_static(tape, st)
    if torch_backend and spec.world_size > 1 and timeline_torch.sparse_tables(spec, device):
        # DDP's reducer keeps the last step's (all-reduced) sparse table gradients past
        # zero_grad: counted as the step counts them, every id unique (an upper bound)
        for i in tables:
            t = spec.tables[i]
            n = ids_per_batch(spec.batch_size, t)
            tape.alloc(n * I64 + n * t.dim * t.dtype_bytes, EMB_GRAD)
    on_host = device == "cpu"
    n_samples = eval_samples(spec)
    B = spec.batch_size
    buffer: Alloc | None = None
    # torchrec: fbgemm's lookup keeps the int64 ids and offsets of its last call until its
    # next call (the training step's last lookup's are live as the evaluation starts)
    cache: list[Alloc] = [] if torch_backend else lookup_inputs(tape, spec, tables)
    for k in range(2):  # the first batch, then one with the buffer beside it (all others alike)
        if k == 1 and on_host:
            buffer = tape.alloc(3 * n_samples * F32, EVAL_OUTPUTS)
        tape.where = f"{WHERE}: held-out batch"
        ids, rest = _make_batch(tape, spec, on_host)
        tape.where = f"{WHERE}: forward"
        if torch_backend:
            logits, held = _forward_torch(tape, spec, tables)
        else:
            logits, held, cache = _forward_torchrec(tape, spec, tables, ids, cache)
        tape.where = f"{WHERE}: predictions"
        cast = tape.alloc(B * F32, EVAL_OUTPUTS) if _amp(spec) else None  # logits.float()
        probs = tape.alloc(B * F32, EVAL_OUTPUTS)
        tape.free(cast, logits, *held)
        if on_host:
            planted = tape.alloc(B * F32, EVAL_OUTPUTS) if spec.data.type == "synthetic" else None
            tape.free(planted)
        tape.free(probs, rest)
        if ids not in cache:
            tape.free(ids)
    if not on_host:
        return tape
    ws = max(1, spec.world_size)
    if ws > 1 and rank0:
        tape.where = f"{WHERE}: gathering the ranks' predictions"
        gathered = tape.alloc(ws * 3 * n_samples * F32, EVAL_OUTPUTS)
        tape.free(buffer)
        buffer = gathered
    tape.where = f"{WHERE}: metrics"
    if ws == 1 or rank0:
        tape.free(tape.alloc(METRICS_F64_PER_SAMPLE * 8 * ws * n_samples + 64, EVAL_OUTPUTS))
    tape.free(buffer)
    return tape


def eval_host_parts(spec: JobSpec) -> dict[str, int]:
    """Host memory of an evaluation on a GPU run (where the device holds only the batch's
    copy and the forward): the held-out batch as made on the host, the buffer of
    predictions (rank 0: every rank's) and the metrics' float64 temporaries."""
    ws = max(1, spec.world_size)
    n = eval_samples(spec)
    return {"held_out_batch": batch_bytes(spec) + _lengths_pieces_bytes(spec),
            "predictions_buffer": 3 * n * F32 * (ws + (1 if ws > 1 else 0)),
            "metrics": METRICS_F64_PER_SAMPLE * 8 * ws * n}


def _torch_backend(spec: JobSpec) -> bool:
    from slurm_dlrm.estimate.backend import TORCH, backend_for_estimate

    return backend_for_estimate(spec.backend) == TORCH


def _amp(spec: JobSpec) -> bool:
    return spec.mixed_precision in ("fp16", "bf16")


def _alloc_static(tape: Tape, st: StaticParts) -> None:
    tape.alloc(st.emb_weights, EMB_WEIGHTS)
    tape.alloc(st.emb_opt_state, EMB_OPT)
    tape.alloc(st.emb_grad_bucket, EMB_GRAD)
    tape.alloc(st.dense_params, DENSE_PARAMS)
    tape.alloc(st.dense_grads, DENSE_GRADS)
    tape.alloc(st.dense_opt_state, DENSE_OPT)
    tape.alloc(st.small, OTHER)


def _lengths_pieces_bytes(spec: JobSpec) -> int:
    """The synthetic eval stream's per-table lengths (one B-long int32 each: a window of
    the Poisson lengths pool, or a fresh tensor of the fixed count), alive until the
    concatenation of them is made."""
    if spec.data.type != "synthetic":
        return 0
    return len(spec.tables) * spec.batch_size * I32


def _make_batch(tape: Tape, spec: JobSpec, on_host: bool) -> tuple[Alloc, Alloc]:
    """Held-out batch k as the forward sees it: (its int64 ids, the rest: dense f32,
    lengths i32, labels f32)."""
    ids_bytes = Shapes.of(spec).ids * I64
    if on_host and spec.data.type == "synthetic":
        pieces = tape.alloc(_lengths_pieces_bytes(spec), INPUTS)
        lengths = tape.alloc(len(spec.tables) * spec.batch_size * I32, INPUTS)
        tape.free(pieces)
        rest = tape.alloc(batch_bytes(spec) - len(spec.tables) * spec.batch_size * I32, INPUTS)
        tape.free(lengths, rest)
    return tape.alloc(ids_bytes, INPUTS), tape.alloc(batch_bytes(spec) - ids_bytes, INPUTS)


def _mlp(tape: Tape, B: int, widths_in: int, widths: tuple[int, ...], h: int, part: str, x: Alloc | None,
         last_relu: bool, hold_input_to_end: bool) -> tuple[Alloc, list[Alloc]]:
    """An MLP without autograd: per layer the linear's output, the ReLU's (a new tensor),
    the linear's output freed; the layer's input freed once the next output exists.
    Returns (the output, what the caller's variables still hold)."""
    held: list[Alloc] = []
    prev = widths_in
    cur = x
    for i, w in enumerate(widths):
        pre = tape.alloc(B * w * h, part)
        if i < len(widths) - 1 or last_relu:
            out = tape.alloc(B * w * h, part)
            tape.free(pre)
        else:
            out = pre
        if cur is not None and (i > 0 or not hold_input_to_end):
            tape.free(cur)
        cur = out
        prev = w
    del prev
    assert cur is not None  # noqa: S101 - every MLP has a layer
    return cur, held


def _forward_torchrec(tape: Tape, spec: JobSpec, tables: list[int], ids: Alloc,
                      cache: list[Alloc]) -> tuple[Alloc, list[Alloc], list[Alloc]]:
    """DMP(DLRMTrain(DLRM or DLRM_DCN)) forward without autograd (torchrec 1.8 log):
    the bottom MLP's output and the pooled embeddings are held by DLRM.forward until it
    returns, the top MLP's input too; the KJT's offsets are cached with the batch."""
    s = Shapes.of(spec)
    B = s.B
    amp = _amp(spec)
    h = 2 if amp else F32
    wcasts = tape.alloc(_dense_weight_elems(spec) * h, ACT_BOTTOM) if amp else None  # autocast's cache
    first_in = tape.alloc(B * s.dense_in * h, ACT_BOTTOM) if amp else None
    x, _ = _mlp(tape, B, s.dense_in, s.bottom, h, ACT_BOTTOM, first_in, last_relu=True, hold_input_to_end=False)
    tape.free(first_in)
    off32 = tape.alloc((s.F * B + 1) * I32 + s.F * (B + 1) * I32, INDEX_OFFSETS)
    ws = max(1, spec.world_size)
    if ws == 1:
        # fbgemm's lookup keeps its int64 offsets and ids until its next call
        off64 = tape.alloc((s.F * B + 1) * I64, INDEX_OFFSETS)
        tape.free(*cache)
        cache = [ids, off64]
        raw = tape.alloc(B * s.F * s.D * s.out_bytes, EMB_OUT)
        pooled = tape.alloc(B * s.F * s.D * s.out_bytes, EMB_OUT)
        tape.free(raw)
    else:
        f_own = len(tables)
        ids_own = sum(ids_per_batch(B, spec.tables[i]) for i in tables)
        perm = tape.alloc(s.F * B * I32 + s.ids * I64, INDEX_OFFSETS)
        recv = tape.alloc(f_own * ws * B * I32 + ws * ids_own * I64, INDEX_OFFSETS)
        tape.free(perm)
        off64 = tape.alloc((f_own * ws * B + 1) * I64, INDEX_OFFSETS)
        tape.free(*cache)
        cache = [recv, off64]
        out_raw = tape.alloc(ws * B * f_own * s.D * s.out_bytes, EMB_OUT)
        buf1 = tape.alloc(ws * B * f_own * s.D * s.out_bytes, EMB_OUT)
        buf2 = tape.alloc(ws * B * f_own * s.D * s.out_bytes, EMB_OUT)
        tape.free(buf1, out_raw)
        tmp = tape.alloc(B * s.F * s.D * s.out_bytes, EMB_OUT)
        tape.free(buf2)
        pooled = tape.alloc(B * s.F * s.D * s.out_bytes, EMB_OUT)
        tape.free(tmp)
    n_comb = (s.F + 1) * s.D
    if s.dcn_layers:
        dcast = tape.alloc(B * s.D * F32, ACT_INTER) if amp else None
        x0 = tape.alloc(B * n_comb * F32, ACT_INTER)  # cat(dense, sparse)
        tape.free(dcast)
        top_in = _dcn(tape, s, B, n_comb, h, x0, loop_vars=True)
        if top_in is not x0:
            tape.free(x0)
        if amp:
            cast = tape.alloc(B * n_comb * h, ACT_TOP)
            tape.free(top_in)
            top_in = cast
    else:
        dcast = tape.alloc(B * s.D * F32, ACT_INTER) if amp else None
        combined = tape.alloc(B * n_comb * F32, ACT_INTER)
        tape.free(dcast)
        casts = [tape.alloc(B * n_comb * h, ACT_INTER) for _ in range(2)] if amp else []
        z = tape.alloc(B * (s.F + 1) ** 2 * h, ACT_INTER)
        zf = tape.alloc(B * comb(s.F + 1, 2) * h, ACT_INTER)
        top_in = tape.alloc(B * s.top_in * h, ACT_INTER)
        tape.free(combined, *casts, z, zf)
    logits, _ = _mlp(tape, B, s.top_in, s.top, h, ACT_TOP, top_in, last_relu=False, hold_input_to_end=True)
    loss = tape.alloc(F32, OTHER)
    tape.free(x, pooled, top_in, wcasts)
    return logits, [loss, off32], cache


def _dcn(tape: Tape, s: Shapes, B: int, n_comb: int, h: int, x0: Alloc, *, loop_vars: bool) -> Alloc:
    """The low-rank cross net without autograd: per layer v = V x_l (B x r), w = W v
    (B x n), w + b, x0 times it, plus x_l. `loop_vars` (torchrec's LowRankCrossNet): v
    and w are loop variables, held until the next layer rebinds them; else (the torch
    backend's, one expression) each temporary dies once consumed."""
    x = x0
    v_prev: Alloc | None = None
    w_prev: Alloc | None = None
    for _ in range(s.dcn_layers):
        xc = tape.alloc(B * n_comb * h, ACT_INTER) if h != F32 else None  # autocast's cast of x_l
        v = tape.alloc(B * s.dcn_rank * h, ACT_INTER)
        tape.free(xc, v_prev)
        w = tape.alloc(B * n_comb * h, ACT_INTER)
        if loop_vars:
            tape.free(w_prev)
        else:
            tape.free(v)
        sb = tape.alloc(B * n_comb * F32, ACT_INTER)
        if not loop_vars:
            tape.free(w)
        m = tape.alloc(B * n_comb * F32, ACT_INTER)
        tape.free(sb)
        new = tape.alloc(B * n_comb * F32, ACT_INTER)
        tape.free(m)
        if x is not x0:
            tape.free(x)
        x = new
        if loop_vars:
            v_prev, w_prev = v, w
    tape.free(v_prev, w_prev)
    return x


def _forward_torch(tape: Tape, spec: JobSpec, tables: list[int]) -> tuple[Alloc, list[Alloc]]:
    """PlainDLRMTrain forward without autograd (slurm_dlrm/train/backend_torch.py,
    plain_dlrm.py): the offsets (F x B int64) held by the wrapper until the loss; in
    PlainDLRM.forward the bottom output, the pooled list, the stack, the dots and the
    top input are local variables, held until it returns."""
    s = Shapes.of(spec)
    B, F, D = s.B, s.F, s.D
    amp = _amp(spec)
    h = 2 if amp else F32
    # predict_clicks reads the KJT's ids per table on the host first: torchrec's KJT
    # computes and caches its offsets ((F x B + 1) int32), which travel with the batch
    kjt_offsets = tape.alloc((F * B + 1) * I32, INDEX_OFFSETS)
    ends = tape.alloc(F * B * I64, INDEX_OFFSETS)
    offsets = tape.alloc(F * B * I64, INDEX_OFFSETS)
    tape.free(ends)
    wcasts = tape.alloc(_dense_weight_elems(spec) * h, ACT_BOTTOM) if amp else None
    first_in = tape.alloc(B * s.dense_in * h, ACT_BOTTOM) if amp else None
    x, _ = _mlp(tape, B, s.dense_in, s.bottom, h, ACT_BOTTOM, first_in, last_relu=True, hold_input_to_end=False)
    tape.free(first_in)
    dense_dtype = spec.mixed_precision if amp else "fp32"
    pooled: list[Alloc] = []
    for i in range(F):
        t = spec.tables[i]
        out = tape.alloc(B * D * t.dtype_bytes, EMB_OUT)
        bag = (tape.alloc(B * I64, INDEX_OFFSETS), tape.alloc(B * I64, INDEX_OFFSETS))  # offset2bag, bag_size
        tape.free(*bag)
        if t.dtype != dense_dtype:
            cast = tape.alloc(B * D * h, EMB_OUT)
            tape.free(out)
            out = cast
        pooled.append(out)
    n_comb = (F + 1) * D
    vectors = tape.alloc(B * n_comb * h, ACT_INTER)
    held: list[Alloc] = [vectors]
    if s.dcn_layers:
        z = _dcn(tape, s, B, n_comb, h, vectors, loop_vars=False)
        if amp:
            cast = tape.alloc(B * n_comb * h, ACT_TOP)
            tape.free(z)
            z = cast
    else:
        dots = tape.alloc(B * (F + 1) ** 2 * h, ACT_INTER)
        picked = tape.alloc(B * comb(F + 1, 2) * h, ACT_INTER)
        z = tape.alloc(B * s.top_in * h, ACT_INTER)
        tape.free(picked)
        held.append(dots)
    logits, _ = _mlp(tape, B, s.top_in, s.top, h, ACT_TOP, z, last_relu=False, hold_input_to_end=True)
    tape.free(x, *pooled, *held, z, wcasts)
    logits_f32 = tape.alloc(B * F32, ACT_TOP) if amp else None  # the loss in fp32
    loss = tape.alloc(F32, OTHER)
    tape.free(logits_f32)
    return logits, [loss, offsets, kjt_offsets]


def _dense_weight_elems(spec: JobSpec) -> int:
    from slurm_dlrm.estimate.timeline import dense_param_shapes, numel

    return sum(numel(sh) for sh in dense_param_shapes(spec))


__all__ = ["EVAL_OUTPUTS", "METRICS_F64_PER_SAMPLE", "eval_host_parts", "eval_samples", "is_fixed_length",
           "simulate_eval"]
