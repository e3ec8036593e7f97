"""`slurm-dlrm selftest`: the acceptance test a site runs on a GPU node (docs/admin.md).

`verdict` (pure: checks, bounds, the verdict), `run` (the steps, through the agent's MPS
and NVML seams), `probe` (the CUDA child processes; the only module importing torch),
`sitefile` (writing measured figures into a site file), `submit` (running it as a
Slurm job through the Slurm seam).
"""
