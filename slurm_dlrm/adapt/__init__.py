"""DLRover-RM's adaptive half, as pure decisions the service and simulator share.

- `perf_model`: a per-job resource-performance model, samples/s as a function of the
  MPS SM share and host CPU cores, fitted by non-negative least squares.
- `recovery`: what to do when a member runs out of memory or its pack is lost.
- `stragglers`: members whose measured speed stays well below their prediction.
- `stages`: warm start from similar jobs, warm-up update, run-time re-pack decision.
- `asha`: a sweep's stopping rule (asynchronous successive halving): who goes on at a rung.

No I/O here: callers pass in what the store measured and act on what comes back.
"""

from slurm_dlrm.adapt.perf_model import PerfModel, allocate_shares, fit_perf_model
from slurm_dlrm.adapt.recovery import (
    MemberOutcome,
    OomDecision,
    decide_after_oom,
    members_to_requeue,
)
from slurm_dlrm.adapt.stages import (
    Profile,
    RepackDecision,
    WarmStart,
    decide_repack,
    update_after_warmup,
    warm_start,
)
from slurm_dlrm.adapt.stragglers import SpeedSample, Straggler, choose_moves, find_stragglers

__all__ = [
    "MemberOutcome",
    "OomDecision",
    "PerfModel",
    "Profile",
    "RepackDecision",
    "SpeedSample",
    "Straggler",
    "WarmStart",
    "allocate_shares",
    "choose_moves",
    "decide_after_oom",
    "decide_repack",
    "find_stragglers",
    "fit_perf_model",
    "members_to_requeue",
    "update_after_warmup",
    "warm_start",
]
