"""An example `custom_module` for a spec: a small DLRM written with plain nn.EmbeddingBag.

Use it as ``custom_module: "slurm_dlrm.estimate.example_custom:build"``. The traced
estimator (slurm_dlrm.estimate.traced) builds it on `meta` and follows its storage; a
custom module's `forward(batch)` takes a torchrec `Batch` and returns the loss (or a
tuple starting with it: torchrec's DLRMTrain's `(loss, (loss, logits, labels))` gives the
held-out evaluation its predictions). Imports torch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class TinyDLRM(nn.Module):
    def __init__(self, spec: Any) -> None:
        super().__init__()
        self.keys = [t.name for t in spec.tables]
        self.tables = nn.ModuleList(nn.EmbeddingBag(t.rows, t.dim, mode="sum") for t in spec.tables)
        layers: list[nn.Module] = []
        width = spec.dense_features
        for w in spec.bottom_mlp:
            layers += [nn.Linear(width, w), nn.ReLU()]
            width = w
        self.bottom = nn.Sequential(*layers)
        width = spec.bottom_mlp[-1] + sum(t.dim for t in spec.tables)  # concatenation, no pairwise dots
        layers = []
        for w in spec.top_mlp[:-1]:
            layers += [nn.Linear(width, w), nn.ReLU()]
            width = w
        layers.append(nn.Linear(width, spec.top_mlp[-1]))
        self.top = nn.Sequential(*layers)
        self.loss = nn.BCEWithLogitsLoss()

    def forward(self, batch: Any) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        kjt = batch.sparse_features
        values, lengths = kjt.values(), kjt.lengths()
        B = batch.dense_features.shape[0]
        pooled = []
        start = 0
        for i, (emb, n) in enumerate(zip(self.tables, kjt.length_per_key(), strict=True)):
            lens = lengths[i * B:(i + 1) * B]
            offsets = torch.cumsum(lens, 0) - lens
            pooled.append(emb(values[start:start + n], offsets.to(torch.int64)))
            start += n
        x = torch.cat([self.bottom(batch.dense_features), *pooled], dim=1)
        logits = self.top(x).squeeze(1)
        loss = self.loss(logits, batch.labels)
        # torchrec's DLRMTrain's shape: the logits give the held-out evaluation its predictions
        return loss, (loss.detach(), logits.detach(), batch.labels)


def build(spec: Any) -> nn.Module:
    return TinyDLRM(spec)
