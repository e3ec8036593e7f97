"""The batch types the data sources make: torchrec's `Batch` and `KeyedJaggedTensor`
where torchrec imports, else two small stand-ins with the few methods the runner and
the torch backend use (a GPU machine with plain PyTorch has no torchrec: the torch
backend must train there).

The stand-ins keep torchrec's layout: one `values` tensor of every feature's ids,
feature-major, and `lengths` (features x batch, int32). `length_per_key()` is computed
once on the host and carried over by `to()`/`pin_memory()`, as torchrec's KJT does, so
the torch backend splits a device batch by feature without a device-to-host sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch


class PlainKJT:
    def __init__(self, keys: list[str], values: torch.Tensor, lengths: torch.Tensor,
                 length_per_key: list[int] | None = None) -> None:
        self._keys = list(keys)
        self._values = values
        self._lengths = lengths
        self._length_per_key = length_per_key

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def lengths(self) -> torch.Tensor:
        return self._lengths

    def length_per_key(self) -> list[int]:
        if self._length_per_key is None:
            per_key = self._lengths.view(len(self._keys), -1).sum(dim=1, dtype=torch.int64)
            self._length_per_key = [int(x) for x in per_key.tolist()]
        return self._length_per_key

    def to(self, device: torch.device, non_blocking: bool = False) -> PlainKJT:
        return PlainKJT(self._keys, self._values.to(device, non_blocking=non_blocking),
                        self._lengths.to(device, non_blocking=non_blocking), self._length_per_key)

    def pin_memory(self) -> PlainKJT:
        return PlainKJT(self._keys, self._values.pin_memory(), self._lengths.pin_memory(), self._length_per_key)


@dataclass
class PlainBatch:
    dense_features: torch.Tensor
    sparse_features: PlainKJT
    labels: torch.Tensor

    def to(self, device: torch.device, non_blocking: bool = False) -> PlainBatch:
        return PlainBatch(self.dense_features.to(device, non_blocking=non_blocking),
                          self.sparse_features.to(device, non_blocking=non_blocking),
                          self.labels.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> PlainBatch:
        return PlainBatch(self.dense_features.pin_memory(), self.sparse_features.pin_memory(),
                          self.labels.pin_memory())


def _classes() -> tuple[Any, Any]:
    try:
        from torchrec.datasets.utils import Batch as TorchrecBatch
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor as TorchrecKJT
    except Exception:  # noqa: BLE001 - not installed, or a crossed torch/fbgemm pair
        return PlainBatch, PlainKJT
    return TorchrecBatch, TorchrecKJT


if TYPE_CHECKING:
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
else:
    Batch, KeyedJaggedTensor = _classes()
