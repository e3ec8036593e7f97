"""Which of the runner's model backends a spec's estimate follows (docs/runner.md):
`backend: torchrec` or `torch` as written; `auto` as the runner will resolve it, torchrec
where fbgemm-gpu is installed, else torch. Looked up here without importing either
(the submit path imports no torch): the login node and the compute nodes are taken to
share one software environment, as a site's shared venv does. A host with no torch at
all (a login node with the project alone) says nothing about the compute nodes: `auto`
is then estimated as torchrec, the runner's usual backend, and the job's log says which
one ran."""

from __future__ import annotations

import importlib.util
from functools import lru_cache

TORCHREC = "torchrec"
TORCH = "torch"


@lru_cache(maxsize=1)
def torch_installed() -> bool:
    return importlib.util.find_spec("torch") is not None


@lru_cache(maxsize=1)
def fbgemm_installed() -> bool:
    return importlib.util.find_spec("fbgemm_gpu") is not None and importlib.util.find_spec("torchrec") is not None


def backend_for_estimate(spec_backend: str) -> str:
    if spec_backend != "auto":
        return spec_backend
    return TORCHREC if fbgemm_installed() or not torch_installed() else TORCH
