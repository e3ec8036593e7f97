"""The packing policy engine (pure: no Slurm, no I/O).

`plan(request, policy)` decides which pending jobs share which GPUs; the interference
model `predict_colocated_speeds(profiles)` predicts each co-located member's speed
relative to running alone; `slurm_dlrm.packing.dispatch` decides when to run a round
and ages waiting jobs. See docs/packing.md.
"""

from slurm_dlrm.packing.common import POLICY_NAMES, URGENT_PRIORITY
from slurm_dlrm.packing.dispatch import (
    DispatchConfig,
    after_round,
    aged,
    effective_priority,
    should_run_round,
)
from slurm_dlrm.packing.interference import (
    DEFAULT_PARAMS,
    CoLocationSample,
    InterferenceParams,
    SoloProfile,
    build_samples,
    predict_colocated_speeds,
    prediction_error,
    refit_interference,
)
from slurm_dlrm.packing.model import (
    Deferred,
    JobDemand,
    MemberPlacement,
    NodeShape,
    Pack,
    PackingLimits,
    PackingPlan,
    PackingRequest,
    demand_from_estimate,
    limits_from_site,
    member_fence_bytes,
    nodes_from_site,
)
from slurm_dlrm.packing.policies import plan

# The interference model under the name the issue gives it.
interference_model = predict_colocated_speeds

__all__ = [
    "DEFAULT_PARAMS", "POLICY_NAMES", "URGENT_PRIORITY", "CoLocationSample", "Deferred", "DispatchConfig",
    "InterferenceParams", "JobDemand", "MemberPlacement", "NodeShape", "Pack", "PackingLimits", "PackingPlan",
    "PackingRequest", "SoloProfile", "aged", "after_round", "build_samples", "demand_from_estimate",
    "effective_priority", "interference_model", "limits_from_site", "member_fence_bytes", "nodes_from_site",
    "plan", "predict_colocated_speeds", "prediction_error", "refit_interference", "should_run_round",
]
