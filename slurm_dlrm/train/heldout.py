"""The held-out set an evaluation reads (slurm_dlrm/train/evaluation.py `Evaluator`), made
batch by batch from the sources of slurm_dlrm/train/data.py."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from slurm_dlrm.errors import SpecError
from slurm_dlrm.spec import EVAL_SAMPLE_CHUNK as SAMPLE_CHUNK
from slurm_dlrm.train.batch import Batch, KeyedJaggedTensor
from slurm_dlrm.train.data import CriteoNpyBatches, CriteoTsvBatches, SyntheticBatches


class HeldOut:
    """This rank's held-out set (`eval.batches` batches, fewer when the held-out data is
    smaller), made batch by batch when an evaluation asks for it (`batch(k)`), so an
    evaluation holds one held-out batch at a time, not all of them for the whole run.
    Batch k is a function of (seed, rank, k) (synthetic) or a slice of the memory-mapped
    files (criteo-npy): made again, it is the same batch. Criteo TSV is parsed once at
    start and kept (parsing is ~10^5 lines/s, too slow to repeat at every evaluation)."""

    def __init__(self, spec: Any, rank: int = 0, world_size: int = 1) -> None:
        n = int(spec.eval.batches)
        self.synthetic: SyntheticBatches | None = None
        self.npy: CriteoNpyBatches | None = None
        self.kept: list[Batch] | None = None
        # `eval.samples`: that many samples, in batches of the training batch size (the
        # last one shorter); None: `count` whole batches
        self.samples: int | None = None
        self.batch_size = int(spec.batch_size)
        self._chunk: tuple[int, tuple[Batch, torch.Tensor]] | None = None  # the last chunk made
        if spec.eval.samples is not None:
            self.samples = int(spec.eval.samples)
            n = math.ceil(self.samples / self.batch_size)
            if spec.data.type == "synthetic":
                self.synthetic = SyntheticBatches(dataclasses.replace(spec, batch_size=SAMPLE_CHUNK), rank,
                                                  ring_batches=0, stream="eval")
                self.count = n
                return
        if spec.data.type == "synthetic":
            self.synthetic = SyntheticBatches(spec, rank, ring_batches=0, stream="eval")
            self.count = n
        elif spec.data.type == "criteo-npy":
            self.npy = CriteoNpyBatches(spec, rank, world_size, part="eval")
            assert self.npy.steps_per_epoch is not None
            self.count = min(n, self.npy.steps_per_epoch)
        elif spec.data.type == "criteo-tsv":
            held = CriteoTsvBatches(spec, rank, world_size, part="eval")
            assert held.steps_per_epoch is not None
            try:
                self.kept = [held.batch(k) for k in range(min(n, held.steps_per_epoch))]
            finally:
                held.close()
            self.count = len(self.kept)
        else:
            raise SpecError("data.type", f"unknown data type {spec.data.type!r}")
        if self.samples is not None:  # Criteo: the first samples of this rank's held-out batches
            self.samples = min(self.samples, self.count * self.batch_size)

    def batch(self, k: int) -> tuple[Batch, torch.Tensor | None]:
        """Held-out batch `k` and, for synthetic data, the planted model's P(click) of its
        samples (None for real data)."""
        if self.samples is not None:
            return self._sample_batch(k)
        return self._whole_batch(k)

    def _sample_batch(self, k: int) -> tuple[Batch, torch.Tensor | None]:
        """With `eval.samples`: samples [k * batch, min((k + 1) * batch, samples))."""
        assert self.samples is not None
        lo, hi = k * self.batch_size, min((k + 1) * self.batch_size, self.samples)
        if self.synthetic is None:  # Criteo: batch k of the source, the last one cut short
            batch, planted = self._whole_batch(k)
            return (batch, planted) if hi - lo == self.batch_size else (take_samples(batch, 0, hi - lo), planted)
        parts, probs = [], []
        for c in range(lo // SAMPLE_CHUNK, (hi - 1) // SAMPLE_CHUNK + 1):
            chunk, p = self._made_chunk(c)
            a, e = max(lo, c * SAMPLE_CHUNK) - c * SAMPLE_CHUNK, min(hi, (c + 1) * SAMPLE_CHUNK) - c * SAMPLE_CHUNK
            parts.append(take_samples(chunk, a, e))
            probs.append(p[a:e])
        return concat_samples(parts), torch.cat(probs)

    def _made_chunk(self, c: int) -> tuple[Batch, torch.Tensor]:
        """Chunk c of SAMPLE_CHUNK held-out samples with labels (kept until the next one:
        consecutive batches share a chunk when the batch size is no multiple of it)."""
        if self._chunk is None or self._chunk[0] != c:
            assert self.synthetic is not None
            self._chunk = (c, self._synthetic_batch(c))
        return self._chunk[1]

    def _synthetic_batch(self, k: int) -> tuple[Batch, torch.Tensor]:
        assert self.synthetic is not None
        features, probs = self.synthetic.features(k)
        return Batch(dense_features=features.dense_features, sparse_features=features.sparse_features,
                     labels=self.synthetic.labels(k, probs)), probs

    def _whole_batch(self, k: int) -> tuple[Batch, torch.Tensor | None]:
        if self.synthetic is not None:
            return self._synthetic_batch(k)
        if self.npy is not None:
            return self.npy.batch(k), None
        assert self.kept is not None
        return self.kept[k], None


def take_samples(batch: Batch, a: int, e: int) -> Batch:
    """Samples [a, e) of `batch` (features key-major, as torchrec's KJT lays them out)."""
    kjt = batch.sparse_features
    keys = list(kjt.keys())
    n = int(batch.labels.shape[0])
    lengths = kjt.lengths().view(len(keys), n)
    ends = torch.cumsum(kjt.lengths().reshape(-1).to(torch.int64), 0).tolist()
    starts = [0, *ends]
    values = [kjt.values()[starts[i * n + a] : starts[i * n + e]] for i in range(len(keys))]
    return Batch(dense_features=batch.dense_features[a:e],
                 sparse_features=KeyedJaggedTensor(keys=keys, values=torch.cat(values),
                                                   lengths=lengths[:, a:e].reshape(-1).contiguous()),
                 labels=batch.labels[a:e])


def concat_samples(parts: list[Batch]) -> Batch:
    """The samples of `parts`, one after the other, as one batch."""
    if len(parts) == 1:
        return parts[0]
    keys = list(parts[0].sparse_features.keys())
    ns = [int(p.labels.shape[0]) for p in parts]
    lengths, values = [], []
    for i in range(len(keys)):
        for p, n in zip(parts, ns, strict=True):
            kl = p.sparse_features.lengths().view(len(keys), n)
            starts = [0, *torch.cumsum(kl.sum(dim=1, dtype=torch.int64), 0).tolist()]
            lengths.append(kl[i])
            values.append(p.sparse_features.values()[starts[i] : starts[i + 1]])
    return Batch(dense_features=torch.cat([p.dense_features for p in parts]),
                 sparse_features=KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths)),
                 labels=torch.cat([p.labels for p in parts]))


def eval_batches(spec: Any, rank: int = 0, world_size: int = 1) -> tuple[list[Batch], torch.Tensor | None]:
    """All of this rank's held-out batches at once (`HeldOut`, made up front) and, for
    synthetic data, the planted model's P(click) of each of their samples (None for
    real data)."""
    held = HeldOut(spec, rank, world_size)
    made = [held.batch(k) for k in range(held.count)]
    batches = [b for b, _ in made]
    planted = [p for _, p in made if p is not None]
    return batches, (torch.cat(planted) if planted else None)
