"""`python -m slurm_dlrm.emulated.standin`: the stand-in member as a program. An entry point,
so it may hand the program what the emulated node's floor may not import: the truth reader
(interference_io) and the simulator's speed rule (packing.interference); and, as one rank
of a multi-node job started by srun, its rank from Slurm's task variables (train/slurm_ranks.py)."""

import os
import sys
from collections.abc import Sequence

from slurm_dlrm.emulated.standin import main
from slurm_dlrm.interference_io import parse_truth
from slurm_dlrm.packing.interference import predict_speeds_from_fractions
from slurm_dlrm.train.slurm_ranks import dist_env_from_slurm


def speeds_under(text: str):  # type: ignore[no-untyped-def]
    """--truth TEXT -> speeds_of(sm, bw) for GpuRegistry.speed."""
    truth = parse_truth(text)

    def speeds_of(sm: Sequence[float], bw: Sequence[float]) -> Sequence[float]:
        return predict_speeds_from_fractions(list(sm), list(bw), truth)

    return speeds_of


if __name__ == "__main__":
    os.environ.update(dist_env_from_slurm(os.environ))  # one rank per srun task (a multi-node job)
    sys.exit(main(parse_truth=speeds_under))
