"""Memory and compute estimates of DLRM jobs (contract: docs/interfaces.md §2).

Pure: no torch, no I/O. `estimate(spec, gpu)` is the analytic model;
`slurm_dlrm.estimate.traced` (imports torch) covers specs with a custom module;
`calibrate(estimate, history)` corrects an estimate from measured peaks of earlier
jobs with the same fingerprint.
"""

from slurm_dlrm.estimate.analytic import ComputeProfile, Estimate, RankEstimate, estimate
from slurm_dlrm.estimate.calibrate import HistoryRecord, calibrate
from slurm_dlrm.estimate.fit import Fit, check_tables_fit, copies_per_gpu

__all__ = ["ComputeProfile", "Estimate", "Fit", "RankEstimate", "HistoryRecord", "calibrate", "check_tables_fit", "copies_per_gpu",
           "estimate"]
