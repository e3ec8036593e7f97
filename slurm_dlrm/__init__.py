"""slurm-dlrm: pack many DLRM training jobs onto shared GPUs under Slurm."""

__version__ = "0.1.0"
