"""The held-out set an evaluation reads (slurm_dlrm/train/evaluation.py `Evaluator`), made
batch by batch from the sources of slurm_dlrm/train/data.py."""

from __future__ import annotations

from typing import Any

import torch

from slurm_dlrm.errors import SpecError
from slurm_dlrm.train.batch import Batch
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

    def batch(self, k: int) -> tuple[Batch, torch.Tensor | None]:
        """Held-out batch `k` and, for synthetic data, the planted model's P(click) of its
        samples (None for real data)."""
        if self.synthetic is not None:
            features, probs = self.synthetic.features(k)
            return Batch(dense_features=features.dense_features, sparse_features=features.sparse_features,
                         labels=self.synthetic.labels(k, probs)), probs
        if self.npy is not None:
            return self.npy.batch(k), None
        assert self.kept is not None
        return self.kept[k], None


def eval_batches(spec: Any, rank: int = 0, world_size: int = 1) -> tuple[list[Batch], torch.Tensor | None]:
    """All of this rank's held-out batches at once (`HeldOut`, made up front) and, for
    synthetic data, the planted model's P(click) of each of their samples (None for
    real data)."""
    held = HeldOut(spec, rank, world_size)
    made = [held.batch(k) for k in range(held.count)]
    batches = [b for b, _ in made]
    planted = [p for _, p in made if p is not None]
    return batches, (torch.cat(planted) if planted else None)
