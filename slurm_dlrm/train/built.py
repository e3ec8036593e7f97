"""What a model backend hands the runner (slurm_dlrm/train/backends.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from slurm_dlrm.estimate.backend import TORCHREC


@dataclass
class Built:
    """What a backend hands the runner: the model (`model(batch) -> (loss, _)`), one
    optimizer object (`zero_grad`, `step`, `state_dict` of live tensors), whether the
    embedding update is fused, the optimizers whose state appears only at their first
    step (`init_state()` before a checkpoint is loaded into them) and notes for the log."""

    model: Any
    optimizer: Any
    fused: bool
    lazy_optimizers: list[Any] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    backend: str = TORCHREC
