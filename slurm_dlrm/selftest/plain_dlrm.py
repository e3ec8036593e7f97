"""The plain-torch DLRM, moved to slurm_dlrm/train/plain_dlrm.py (issue 38): the runner's
`backend: torch` and scripts/gpu-check.sh train one model, built once. Importable here
under the same names for the check's workers and the models that read it."""

from __future__ import annotations

from slurm_dlrm.train.plain_dlrm import (  # noqa: F401 - re-exported
    TORCH_DTYPES,
    LowRankCrossNet,
    PlainDLRM,
    RowwiseAdagrad,
    Trainer,
    build_trainer,
    make_batches,
    mlp,
    optimizers_for,
)

_TORCH_DTYPES = TORCH_DTYPES
_mlp = mlp
_optimizers = optimizers_for

__all__ = ["LowRankCrossNet", "PlainDLRM", "RowwiseAdagrad", "Trainer", "build_trainer", "make_batches"]
