"""The emulated GPU node: what stands in for GPU hardware on machines without one (tests,
the local Slurm cluster, `demo --standin`, benchmarks/sim_vs_live.py). Everything else in
slurm_dlrm is the real code path; it meets these files only through its seams.

| file | stands in for | selected by |
| --- | --- | --- |
| `nvml.py` | NVML (the `pynvml` module of nvidia-ml-py) | `$SLURM_DLRM_FAKE_NVML`, read by `agent/nvml.py` |
| `mps_control.py` | `nvidia-cuda-mps-control` (the MPS control daemon and its servers) | its launcher first on PATH (`install_launcher`) |
| `standin/` | a member process on a GPU (what `slurm-dlrm train` is to the agent), no torch | the member's command: `python -m slurm_dlrm.emulated.standin` |
| `registry.py` | the GPU's sharing itself: which stand-ins run on each fake GPU now, so each slows down by what really shares it | a stand-in run with `--truth` |

The co-location truth that decides how much a stand-in slows down is not here: it is
`slurm_dlrm/truth.py`, shared with the simulator (`simulate --truth` takes the same
strings), and it imports the planner's types, while this package sits below the agent
(floor 1, docs/architecture.md). The stand-in's entry point (`standin/__main__.py`)
hands the truth in; these modules import neither `sim/` nor the truth.
"""
