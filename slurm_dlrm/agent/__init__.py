"""The per-node agent: MPS, member launch, sampling and enforcement inside a pack allocation.

Seams: `nvml` (the only importer of pynvml, with `fake_nvml`), `mps` (the MPS control
daemon, with the `fake_mps_control` executable). The loop lives in `loop`.
"""
