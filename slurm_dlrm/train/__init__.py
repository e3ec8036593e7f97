"""The DLRM training runner (`slurm-dlrm train SPEC`, `python -m slurm_dlrm.train SPEC`).

Modules: `data` (synthetic and Criteo batches), `model` (torchrec DLRM + DMP +
optimizers), `checkpoint` (atomic, verified checkpoints), `metrics` (JSON lines and
progress), `runner` (the loop, signals, exit codes), `launch` (local multi-process).
Importing this package imports no torch; its modules do.
"""
