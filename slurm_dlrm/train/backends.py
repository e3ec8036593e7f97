"""The runner's two model backends behind one seam: `torchrec` (torchrec DLRM sharded by
DistributedModelParallel, fbgemm's fused kernels; slurm_dlrm/train/model.py) and
`torch` (the plain-PyTorch DLRM of slurm_dlrm/train/plain_dlrm.py: nn.EmbeddingBag
tables and MLPs, DDP over several ranks; slurm_dlrm/train/backend_torch.py).

A spec's `backend: auto` (the default) is torchrec where fbgemm-gpu imports, else torch.
The runner resolves it by importing fbgemm_gpu (`resolve`); the estimator, which must
not import torch, looks for the module without importing it (`estimate.backend`):
the login node and the compute nodes are assumed to share one software environment.

Importing this module imports no torch; `build` imports the chosen backend.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from slurm_dlrm.estimate.backend import TORCH, TORCHREC, backend_for_estimate
from slurm_dlrm.train.built import Built

__all__ = ["TORCH", "TORCHREC", "Built", "backend_for_estimate", "build", "plan_text", "resolve"]


@lru_cache(maxsize=1)
def fbgemm_import_error() -> str | None:
    """None when fbgemm_gpu (and with it torchrec's kernels) imports here, else why not.
    A crossed torch/fbgemm pair fails with an OSError ("undefined symbol"), not an
    ImportError: any exception counts."""
    try:
        import fbgemm_gpu  # noqa: F401
        import torchrec  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - whatever fails, the torch backend runs instead
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
    return None


def resolve(spec_backend: str) -> tuple[str, str]:
    """(backend, why) for the runner. `auto`: torchrec where fbgemm-gpu imports."""
    if spec_backend != "auto":
        return spec_backend, f"backend {spec_backend} (spec)"
    err = fbgemm_import_error()
    if err is None:
        return TORCHREC, "backend torchrec (auto: fbgemm-gpu imports)"
    return TORCH, f"backend torch (auto: fbgemm-gpu does not import: {err})"


def build(backend: str, spec: Any, device: Any, world_size: int, local_world_size: int) -> Built:
    """Build the model and optimizers of `backend` (after init_process_group and seeding)."""
    if backend == TORCH:
        from slurm_dlrm.train import backend_torch

        return backend_torch.build(spec, device, world_size, local_world_size)
    from slurm_dlrm.train import model

    return model.build(spec, device, world_size, local_world_size)


def plan_text(built: Built) -> str:
    """A stable description of how the state is laid out (checkpoints load only into the same)."""
    if built.backend == TORCH:
        from slurm_dlrm.train import backend_torch

        return backend_torch.plan_text(built)
    from slurm_dlrm.train import model

    return model.plan_text(built.model)
