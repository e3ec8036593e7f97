"""Training batches: synthetic (power-law ids) and Criteo (TSV days, preprocessed npy).

Every source is addressed by step: `source.batch(step)` returns the batch of that step
for this rank, computed from (seed, rank, step) alone. A checkpoint therefore needs no
generator state beyond the step, prefetch threads can run ahead without changing what
a resumed run sees, and an interrupted run resumes onto exactly the same data.
"""

from __future__ import annotations

import collections
import gzip
import math
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any, Protocol

import numpy as np
import torch

from slurm_dlrm.errors import BadInput, SpecError
from slurm_dlrm.train.batch import Batch, KeyedJaggedTensor  # torchrec's where it imports

CRITEO_DENSE = 13
CRITEO_SPARSE = 26
# Multiplier that scatters the hot ids over a table: a bijection of [0, rows) whenever
# rows is not a multiple of it (it is prime), so the id popularity is kept.
_SCATTER_PRIME = 2654435761
# Batches of ids kept per table in the synthetic pools (each step takes random windows).
_POOL_BATCHES = 8
# Upper bound on the ids a pool holds beyond one batch, so huge multi-hot specs stay small.
_POOL_EXTRA_IDS = 4_000_000
# Complete batches made up front and cycled (like torchrec's RandomRecDataset with
# num_generated_batches): making a batch per step costs 0.1-0.5 ms of the training
# thread, measured as 4-8% of a small CPU model's samples/s. The ring is capped in
# bytes; bigger batches are made per step, where that cost is relatively small.
_RING_BATCHES = 32
_RING_MAX_BYTES = 64 * 2**20


class BatchSource(Protocol):
    # True: batch(step) must be asked in step order (one loader thread).
    sequential: bool
    # Steps per epoch for a data file; None for endless synthetic data.
    steps_per_epoch: int | None
    # True: a batch costs microseconds and no I/O; taken in the training thread, since
    # handing it over from a loader thread costs more than making it (measured: prefetch
    # threads cut a tiny CPU model from 410 to 240 steps/s, GIL hand-offs).
    inline: bool

    def batch(self, step: int) -> Batch: ...


def feature_names(spec: Any) -> list[str]:
    """One sparse feature per table, named after it (the KJT keys)."""
    return [t.name for t in spec.tables]


def zipf_ids(rng: np.random.Generator, rows: int, alpha: float, n: int) -> np.ndarray:
    """`n` ids in [0, rows) whose popularity falls off as rank^-alpha.

    Inverse-CDF sampling of the bounded continuous power law p(x) ~ (1+x)^-alpha on
    [0, rows): vectorised and needs no per-row table (rows may be 10^8)."""
    u = rng.random(n)
    if alpha <= 0.0:
        x = u * rows
    elif abs(alpha - 1.0) < 1e-9:
        x = np.expm1(u * math.log1p(rows))
    else:
        a1 = 1.0 - alpha
        x = (1.0 + u * ((rows + 1.0) ** a1 - 1.0)) ** (1.0 / a1) - 1.0
    ids = np.minimum(x.astype(np.int64), rows - 1)
    return (ids * _SCATTER_PRIME) % rows


# The planted model of synthetic labels (docs/runner.md "Synthetic data"): a logit that is
# a linear function of the dense features plus, per table, the mean of per-id weights on
# the table's hottest ids, so a model that learns the tables beats one that reads only
# the dense features. The scales put the planted AUC near 0.8.
PLANTED_DENSE_STD = 1.0  # std of the dense part of the logit
PLANTED_TABLE_STD = 1.5  # std of one hot id's weight, times 1/sqrt(tables)
PLANTED_HOT_IDS = 128  # ids per table (by popularity rank) that carry a weight
_PLANTED_TAG = 0x91A7ED
_TRAIN_LABEL_TAG = 0x1ABE1
_EVAL_TAG = 0xE7A1  # the eval stream's pools and labels


def _mix64(*parts: int) -> int:
    """A 63-bit seed from integers (splitmix64 steps): distinct tuples, unrelated seeds."""
    h = 0x9E3779B97F4A7C15
    for part in parts:
        h = (h ^ (int(part) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 29
    return h & 0x7FFFFFFFFFFFFFFF


class PlantedModel:
    """The hidden model behind synthetic labels: P(click) = sigmoid(logit(dense, ids)).

    A function of the spec's seed, tables and dense width only (every rank, the
    training and the eval stream share it), so its AUC on the eval stream is the best
    any model can reach there."""

    def __init__(self, spec: Any) -> None:
        rng = np.random.default_rng([int(spec.seed), _PLANTED_TAG])
        k = int(spec.dense_features)
        v = rng.standard_normal(k)
        self.dense_w = (PLANTED_DENSE_STD * v / max(float(np.linalg.norm(v)), 1e-12)).astype(np.float64)
        n_tables = max(1, len(spec.tables))
        # Per table: the hot ids (scattered as zipf_ids scatters ranks), sorted, and their weights.
        self.hot: list[tuple[np.ndarray, np.ndarray]] = []
        for t in spec.tables:
            rows = int(t.rows)
            ranks = np.arange(min(rows, PLANTED_HOT_IDS), dtype=np.int64)
            ids = (ranks * _SCATTER_PRIME) % rows
            w = rng.standard_normal(len(ids)) * PLANTED_TABLE_STD / math.sqrt(n_tables)
            order = np.argsort(ids)
            self.hot.append((ids[order], w[order]))

    def id_weights(self, table: int, ids: np.ndarray) -> np.ndarray:
        """The planted weight of each id (0 for ids outside the table's hot set)."""
        hot_ids, hot_w = self.hot[table]
        pos = np.minimum(np.searchsorted(hot_ids, ids), len(hot_ids) - 1)
        return np.where(hot_ids[pos] == ids, hot_w[pos], 0.0)

    def probabilities(self, dense: np.ndarray, tables: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
        """P(click) per sample; `tables` holds each table's (lengths per sample, ids)."""
        logit = dense.astype(np.float64) @ self.dense_w
        for i, (lengths, ids) in enumerate(tables):
            w = self.id_weights(i, ids)
            ends = np.cumsum(lengths, dtype=np.int64)
            sums = np.concatenate([[0.0], np.cumsum(w)])
            n = np.maximum(lengths, 1)
            logit += (sums[ends] - sums[ends - lengths]) / n  # mean weight of the sample's ids
        return (1.0 / (1.0 + np.exp(-logit))).astype(np.float32)


class SyntheticBatches:
    """Random batches shaped like the spec: pooling factors or fixed multi-hot sizes,
    power-law ids (`data.zipf_alpha`), and labels drawn from a planted model
    (`PlantedModel`) over the dense features and the table ids.

    Pools of ids, lengths and dense rows are drawn once from (seed, rank, stream);
    batch k takes random windows of them with a generator seeded by (seed, rank, k), so
    one batch's features cost a few slices and one concatenation. Up to 32 batches of
    features (and their planted click probabilities) are made at start (at most 64 MiB,
    fewer when batches are big) and step s trains on features s mod their number; when
    fewer than 2 fit, features are made per step. Labels are drawn at every step from
    (seed, rank, step): the features repeat, the labels do not, so a model cannot
    memorise the stream and the best it can do is the planted model.

    `stream="eval"` is the held-out stream: its own pools and label draws, the same
    planted model."""

    sequential = False
    steps_per_epoch: int | None = None
    inline = True

    def __init__(self, spec: Any, rank: int = 0, pool_batches: int = _POOL_BATCHES,
                 ring_batches: int = _RING_BATCHES, pin_memory: bool = False, stream: str = "train") -> None:
        if stream not in ("train", "eval"):
            raise ValueError(f"unknown stream {stream!r}")
        self.batch_size = int(spec.batch_size)
        self.seed = int(spec.seed)
        self.rank = rank
        self.keys = feature_names(spec)
        self.planted = PlantedModel(spec)
        alpha = spec.data.zipf_alpha
        alpha = 1.05 if alpha is None else float(alpha)
        self._tag = [_EVAL_TAG] if stream == "eval" else []
        self._label_tag = _EVAL_TAG + 1 if stream == "eval" else _TRAIN_LABEL_TAG
        rng = np.random.default_rng([self.seed, rank, 0x5EED, *self._tag])
        b = self.batch_size
        pool_rows = b * pool_batches
        self._dense = rng.standard_normal((pool_rows, int(spec.dense_features)), dtype=np.float32)
        # Per table: (fixed ids per sample or None, lengths pool or None, ids pool).
        self._tables: list[tuple[int | None, np.ndarray | None, np.ndarray]] = []
        for t in spec.tables:
            if t.multi_hot is not None or float(t.pooling_factor or 1.0) == 1.0:
                fixed = int(t.multi_hot) if t.multi_hot is not None else 1
                lengths = None
                per_batch = b * fixed
            else:
                fixed = None
                lengths = rng.poisson(float(t.pooling_factor), pool_rows).astype(np.int32)
                # A window of b lengths sums to at most this many ids (nearly always).
                per_batch = int(b * float(t.pooling_factor) + 8 * math.sqrt(b * float(t.pooling_factor)) + 16)
            n_ids = per_batch + min(per_batch * (pool_batches - 1), _POOL_EXTRA_IDS)
            ids = zipf_ids(rng, int(t.rows), alpha, n_ids)
            self._tables.append((fixed, lengths, ids))
        # Uniforms the labels are drawn with (pool_rows of them, as many as dense rows).
        self._label_u = np.random.default_rng([self.seed, rank, self._label_tag]).random(pool_rows, dtype=np.float32)
        self._alpha = alpha
        self._rows = [int(t.rows) for t in spec.tables]
        # The training stream keeps one lengths tensor per fixed count; the eval stream,
        # made only while it evaluates, keeps none (made per batch, freed with it), so
        # nothing of it stays allocated between evaluations (estimate/timeline_eval.py).
        self._fixed_lengths = {} if stream == "eval" else {
            k: torch.full((b,), k, dtype=torch.int32) for k in {f for f, _, _ in self._tables if f is not None}
        }
        ids_per_batch = sum(b * t.ids_per_sample for t in spec.tables)
        batch_bytes = int(ids_per_batch * 8 + b * (int(spec.dense_features) + 1) * 4 + b * len(spec.tables) * 4)
        n_ring = min(ring_batches, _RING_MAX_BYTES // max(batch_bytes, 1))
        # Features and planted click probabilities of the batches made up front.
        self.ring: list[tuple[Batch, torch.Tensor]] = []
        if n_ring >= 2:
            self.ring = [self.features(k) for k in range(n_ring)]
            if pin_memory:
                self.ring = [(batch.pin_memory(), p) for batch, p in self.ring]

    @property
    def repeat_every_steps(self) -> int | None:
        """After how many steps the features come round again (None: never)."""
        return len(self.ring) or None

    def batch(self, step: int) -> Batch:
        if self.ring:
            features, probs = self.ring[step % len(self.ring)]
        else:
            features, probs = self.features(step)
        return Batch(dense_features=features.dense_features, sparse_features=features.sparse_features,
                     labels=self.labels(step, probs))

    def labels(self, step: int, probs: torch.Tensor) -> torch.Tensor:
        """Step `step`'s labels: Bernoulli draws of the planted probabilities, u < p with
        u a window of a pool of uniforms at an offset hashed from (seed, rank, step):
        about 8 us for 512 labels (a reseeded torch generator took 30, numpy's seeded
        default_rng 90)."""
        n = len(probs)
        o = _mix64(self.seed, self.rank, step, self._label_tag) % (len(self._label_u) - n + 1)
        return torch.from_numpy(self._label_u[o : o + n] < probs.numpy()).float()

    def make(self, step: int) -> Batch:
        """Batch number `step` (features and labels), made now."""
        features, probs = self.features(step)
        return Batch(dense_features=features.dense_features, sparse_features=features.sparse_features,
                     labels=self.labels(step, probs))

    def features(self, step: int) -> tuple[Batch, torch.Tensor]:
        """The features of batch number `step` (labels all 0) and their planted P(click)."""
        b = self.batch_size
        rng = np.random.default_rng([self.seed, self.rank, step, *self._tag])
        offsets = rng.random(2 * len(self._tables) + 1)
        o = int(offsets[0] * (len(self._dense) - b + 1))
        dense_np = self._dense[o : o + b]
        values: list[np.ndarray] = []
        lengths: list[torch.Tensor] = []
        per_table: list[tuple[np.ndarray, np.ndarray]] = []
        for i, (fixed, lengths_pool, ids) in enumerate(self._tables):
            if fixed is not None:
                fixed_lengths = self._fixed_lengths.get(fixed)
                lengths.append(fixed_lengths if fixed_lengths is not None else
                               torch.full((b,), fixed, dtype=torch.int32))
                window = np.full(b, fixed, dtype=np.int64)
                need = b * fixed
            else:
                assert lengths_pool is not None
                lo = int(offsets[1 + 2 * i] * (len(lengths_pool) - b + 1))
                window = lengths_pool[lo : lo + b]
                lengths.append(torch.from_numpy(window))
                need = int(window.sum())
            if need <= len(ids):
                io = int(offsets[2 + 2 * i] * (len(ids) - need + 1))
                values.append(ids[io : io + need])
            else:  # a rare long window: draw fresh ids rather than grow the pool
                values.append(zipf_ids(rng, self._rows[i], self._alpha, need))
            per_table.append((window, values[-1]))
        kjt = KeyedJaggedTensor(
            keys=self.keys,
            values=torch.from_numpy(np.concatenate(values)),
            lengths=torch.cat(lengths),
        )
        probs = torch.from_numpy(self.planted.probabilities(dense_np, per_table))
        batch = Batch(dense_features=torch.from_numpy(dense_np), sparse_features=kjt,
                      labels=torch.zeros(b, dtype=torch.float32))
        return batch, probs


DEFAULT_HOLDOUT_FRACTION = 0.05


def holdout_split(spec: Any, file_samples: list[int]) -> tuple[int, int]:
    """The first held-out sample of a data set of files with these sample counts, and
    the total: samples [0, first) train, [first, total) are the eval set.

    `eval.holdout`: "last-file" (the last file or day, as MLPerf's DLRM holds out the
    last day), a fraction (the last samples), or "auto" (the last file when there are
    several, else the last 5%). No eval: nothing is held out."""
    total = int(sum(file_samples))
    ev = getattr(spec, "eval", None)
    if ev is None or not ev.enabled:
        return total, total
    holdout = ev.holdout
    if holdout == "auto":
        holdout = "last-file" if len(file_samples) > 1 else DEFAULT_HOLDOUT_FRACTION
    if holdout == "last-file":
        if len(file_samples) < 2:
            raise SpecError("eval.holdout", "last-file needs a data folder of several files; give a fraction")
        return total - int(file_samples[-1]), total
    return total - max(1, int(total * float(holdout))), total


def _part_batch_size(batch_size: int, n_samples: int, world_size: int, part: str) -> int:
    """A held-out set smaller than one batch per rank is evaluated in one smaller batch."""
    if part == "eval" and n_samples < batch_size * world_size:
        return max(1, n_samples // world_size)
    return batch_size


def _one_hot_kjt(keys: list[str], sparse: np.ndarray, rows: np.ndarray) -> KeyedJaggedTensor:
    """Criteo rows (batch x features, raw hashes) -> a one-hot KJT, ids mod table rows."""
    b = sparse.shape[0]
    # Feature-major order: all of feature 0's ids, then feature 1's, ...
    ids = np.mod(sparse[:, : len(keys)].astype(np.int64), rows[None, :]).T.reshape(-1)
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.from_numpy(np.ascontiguousarray(ids)),
        lengths=torch.ones(b * len(keys), dtype=torch.int32),
    )


def _check_criteo_shape(spec: Any, n_dense: int, n_sparse: int, where: str) -> None:
    if int(spec.dense_features) != n_dense:
        raise SpecError("dense_features", f"{where} has {n_dense} dense features, the spec {spec.dense_features}")
    if len(spec.tables) > n_sparse:
        raise SpecError("tables", f"{where} has {n_sparse} categorical features, the spec {len(spec.tables)} tables")


class CriteoNpyBatches:
    """torchrec's preprocessed Criteo files: `<day>_dense.npy` (float32 N x 13, already
    log-transformed), `<day>_sparse.npy` (int N x 26) and `<day>_labels.npy` (N or N x 1).

    `data.path` is a folder (every `*_dense.npy` in name order) or one day's prefix
    (`.../day_0`). Files are memory-mapped; a batch is a slice, so any step is cheap."""

    sequential = False
    inline = False  # page faults on the memory map are disk reads

    def __init__(self, spec: Any, rank: int = 0, world_size: int = 1, part: str = "train") -> None:
        path = Path(spec.data.path)
        if path.is_dir():
            prefixes = sorted(str(p)[: -len("_dense.npy")] for p in path.glob("*_dense.npy"))
        else:
            text = str(path)
            for suffix in ("_dense.npy", "_sparse.npy", "_labels.npy"):
                text = text.removesuffix(suffix)
            prefixes = [text]
        if not prefixes:
            raise SpecError("data.path", f"no *_dense.npy files in {path}")
        self.parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        for prefix in prefixes:
            try:
                dense = np.load(prefix + "_dense.npy", mmap_mode="r")
                sparse = np.load(prefix + "_sparse.npy", mmap_mode="r")
                labels = np.load(prefix + "_labels.npy", mmap_mode="r").reshape(-1)
            except (OSError, ValueError) as exc:
                raise SpecError("data.path", f"cannot read {prefix}_{{dense,sparse,labels}}.npy: {exc}") from None
            if dense.ndim != 2 or sparse.ndim != 2 or not (len(dense) == len(sparse) == len(labels)):
                raise SpecError("data.path", f"{prefix}: dense/sparse/labels disagree on shape")
            _check_criteo_shape(spec, dense.shape[1], sparse.shape[1], prefix)
            self.parts.append((dense, sparse, labels))
        self.starts = np.cumsum([0] + [len(p[0]) for p in self.parts])
        split, total = holdout_split(spec, [len(p[0]) for p in self.parts])
        # part "train": samples before the held-out ones; "eval": the held-out ones.
        self.first_sample = 0 if part == "train" else split
        self.n_samples = split if part == "train" else total - split
        self.batch_size = _part_batch_size(int(spec.batch_size), self.n_samples, world_size, part)
        self.rank, self.world_size = rank, world_size
        self.keys = feature_names(spec)
        self.rows = np.array([t.rows for t in spec.tables], dtype=np.int64)
        self.steps_per_epoch: int | None = self.n_samples // (self.batch_size * world_size)
        if not self.steps_per_epoch:
            raise SpecError("batch_size" if part == "train" else "eval.holdout",
                            f"{self.n_samples} {part} samples in {path} make no batch of {self.batch_size} x {world_size} ranks")

    def _rows(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        pieces: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < stop:
            dense, sparse, labels = self.parts[i]
            lo = start - int(self.starts[i])
            hi = min(stop, int(self.starts[i + 1])) - int(self.starts[i])
            pieces.append((dense[lo:hi], sparse[lo:hi], labels[lo:hi]))
            start += hi - lo
            i += 1
        return tuple(np.concatenate([p[k] for p in pieces]) for k in range(3))  # type: ignore[return-value]

    def batch(self, step: int) -> Batch:
        assert self.steps_per_epoch is not None
        g = (step % self.steps_per_epoch) * self.world_size + self.rank
        first = self.first_sample + g * self.batch_size
        dense, sparse, labels = self._rows(first, first + self.batch_size)
        return Batch(
            dense_features=torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)),
            sparse_features=_one_hot_kjt(self.keys, sparse, self.rows),
            labels=torch.from_numpy(np.ascontiguousarray(labels, dtype=np.float32)),
        )


def parse_criteo_lines(lines: list[str], where: str = "") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Criteo TSV lines (label, 13 integers, 26 hex hashes; empty = missing) ->
    (dense float32 log(1+max(x,0)), sparse int64 raw hashes, labels float32)."""
    n_fields = 1 + CRITEO_DENSE + CRITEO_SPARSE
    rows = [line.rstrip("\r\n").split("\t") for line in lines]
    for i, row in enumerate(rows):
        if len(row) != n_fields:
            raise BadInput(f"{where}line {i + 1} of the batch: {len(row)} tab-separated fields, Criteo has {n_fields}")
    table = np.array(rows, dtype=str)
    table[table == ""] = "0"
    try:
        labels = table[:, 0].astype(np.float32)
        dense_int = table[:, 1 : 1 + CRITEO_DENSE].astype(np.int64)
        sparse = np.array([int(x, 16) for x in table[:, 1 + CRITEO_DENSE :].reshape(-1)], dtype=np.int64)
    except ValueError as exc:
        raise BadInput(f"{where}not Criteo TSV: {exc}") from None
    dense = np.log1p(np.maximum(dense_int, 0)).astype(np.float32)
    return dense, sparse.reshape(len(rows), CRITEO_SPARSE), labels


def _open_text(path: Path) -> IO[str]:
    if path.suffix == ".gz":
        return gzip.open(path, "rt")
    return open(path)  # noqa: SIM115 - closed by the reader


class CriteoTsvBatches:
    """The Criteo Kaggle/Terabyte day files as released (TSV, optionally .gz).

    `data.path` is one file or a folder of them (name order). The lines are counted
    once at start (for epochs and wrap-around); batches are then read in order, and a
    resumed run skips to its step's line. Parsing runs in Python (~10^5 lines/s), so
    for full-size days on a GPU convert them to torchrec's npy files first."""

    sequential = True
    inline = False

    def __init__(self, spec: Any, rank: int = 0, world_size: int = 1, part: str = "train") -> None:
        path = Path(spec.data.path)
        if path.is_dir():
            self.files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
        else:
            self.files = [path]
        if not self.files or not all(p.exists() for p in self.files):
            raise SpecError("data.path", f"no Criteo TSV file at {path}")
        _check_criteo_shape(spec, CRITEO_DENSE, CRITEO_SPARSE, str(path))
        self.batch_size = int(spec.batch_size)
        self.rank, self.world_size = rank, world_size
        self.keys = feature_names(spec)
        self.rows = np.array([t.rows for t in spec.tables], dtype=np.int64)
        split, total = holdout_split(spec, [self._count_lines(p) for p in self.files])
        self.first_sample = 0 if part == "train" else split
        self.n_samples = split if part == "train" else total - split
        self.batch_size = _part_batch_size(self.batch_size, self.n_samples, world_size, part)
        self.steps_per_epoch: int | None = self.n_samples // (self.batch_size * world_size)
        if not self.steps_per_epoch:
            raise SpecError("batch_size" if part == "train" else "eval.holdout",
                            f"{self.n_samples} {part} lines in {path} make no batch of {self.batch_size} x {world_size} ranks")
        self._lines: Iterator[str] | None = None
        self._handle: IO[str] | None = None
        self._cursor = 0  # index of the next line self._lines yields

    @staticmethod
    def _count_lines(path: Path) -> int:
        n = 0
        last = b"\n"
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rb") as fh:
            while chunk := fh.read(1 << 22):
                n += chunk.count(b"\n")
                last = chunk[-1:]
        return n + (last != b"\n")

    def _restart(self) -> None:
        self.close()

        def lines() -> Iterator[str]:
            for p in self.files:
                with _open_text(p) as fh:
                    self._handle = fh
                    for line in fh:
                        if line.strip():
                            yield line

        self._lines = lines()
        self._cursor = 0

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def batch(self, step: int) -> Batch:
        assert self.steps_per_epoch is not None
        g = (step % self.steps_per_epoch) * self.world_size + self.rank
        first = self.first_sample + g * self.batch_size
        if self._lines is None or first < self._cursor:
            self._restart()
        assert self._lines is not None
        for _ in range(first - self._cursor):
            next(self._lines)
        chunk = [next(self._lines) for _ in range(self.batch_size)]
        self._cursor = first + self.batch_size
        dense, sparse, labels = parse_criteo_lines(chunk, f"{self.files[0].parent}: ")
        return Batch(
            dense_features=torch.from_numpy(dense),
            sparse_features=_one_hot_kjt(self.keys, sparse, self.rows),
            labels=torch.from_numpy(labels),
        )


def make_source(spec: Any, rank: int = 0, world_size: int = 1, pin_memory: bool = False) -> BatchSource:
    kind = spec.data.type
    if kind == "synthetic":
        return SyntheticBatches(spec, rank, pin_memory=pin_memory)
    if kind == "criteo-npy":
        return CriteoNpyBatches(spec, rank, world_size)
    if kind == "criteo-tsv":
        return CriteoTsvBatches(spec, rank, world_size)
    raise SpecError("data.type", f"unknown data type {kind!r}")


class Prefetcher:
    """Yields (step, batch) for steps [start, stop), made `depth` steps ahead by
    `workers` threads (numpy and torch release the GIL for the bulk of the work).
    workers=0 or depth=0, or a source whose batches are cheap (`inline`), makes
    batches in the calling thread."""

    def __init__(self, source: BatchSource, start: int, stop: int, workers: int, depth: int,
                 device: torch.device | None = None) -> None:
        self.source = source
        self.start, self.stop = start, stop
        self.device = device if device is not None and device.type == "cuda" else None
        self.depth = depth if workers > 0 and not source.inline else 0
        n_threads = 1 if source.sequential else max(1, workers)
        self._pool = ThreadPoolExecutor(n_threads, thread_name_prefix="batches") if self.depth else None

    def _make(self, step: int) -> Batch:
        batch = self.source.batch(step)
        # Inline sources come pinned already (see make_source); pinning per step costs.
        return batch.pin_memory() if self.device is not None and not self.source.inline else batch

    def __iter__(self) -> Iterator[tuple[int, Batch]]:
        pending: collections.deque[tuple[int, Future[Batch]]] = collections.deque()
        next_step = self.start
        for step in range(self.start, self.stop):
            if self._pool is None:
                batch = self._make(step)
            else:
                while next_step < self.stop and len(pending) <= self.depth:
                    pending.append((next_step, self._pool.submit(self._make, next_step)))
                    next_step += 1
                got, fut = pending.popleft()
                assert got == step
                batch = fut.result()
                del fut
            if self.device is not None:
                batch = batch.to(self.device, non_blocking=True)
            # hand the batch over without keeping a reference in this frame: the runner
            # lets a step's batch go before it evaluates (issue 51)
            handed = [batch]
            del batch
            yield step, handed.pop()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        close = getattr(self.source, "close", None)
        if close is not None:
            close()
