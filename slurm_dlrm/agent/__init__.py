"""The per-node agent: MPS, member launch, sampling and enforcement inside a pack allocation.

Seams: `nvml` (the only importer of pynvml; `$SLURM_DLRM_FAKE_NVML` selects the fake,
`slurm_dlrm.emulated.nvml`), `mps` (the MPS control daemon, whichever
`nvidia-cuda-mps-control` is on PATH: the fake one is `slurm_dlrm.emulated.mps_control`).
The loop lives in `loop`; how a member is launched (`launch`), stopped (`stopping`),
sampled and held to its budgets (`sampling`), and how its end is classified (`reaping`)
live beside it. Everything that stands in for GPU hardware lives in
`slurm_dlrm/emulated/`, not here.
"""
