"""Recovery decisions: out-of-memory retries and members of a lost pack.

An OOM means the job needed more than the fence it hit. How much more is told by
how wrong the estimate already was: a job that blew through a 5% margin on a 2 GiB
estimate needs a small raise; one that hit a host limit at twice its estimate needs
a large one. So the next figure is the larger of the fence and the measured peak,
grown by the relative error observed so far (at least `min_raise_frac`), not a
blind doubling. The raise is what the service learns for the spec's fingerprint.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

MIB = 1 << 20

# Pack endings after which unfinished members are rerun from their checkpoints.
# NODE_FAIL / TIMEOUT / PREEMPTED are Slurm's; LOST is ours (heartbeat deadline).
RECOVERABLE_PACK_ENDINGS = frozenset({"NODE_FAIL", "TIMEOUT", "PREEMPTED", "LOST", "BOOT_FAIL"})
# Member states that must not be rerun: done, or the user said stop.
FINAL_MEMBER_STATES = frozenset({"COMPLETED", "CANCELLED"})


@dataclass(frozen=True)
class OomDecision:
    action: Literal["requeue", "fail"]
    gpu_mem_bytes: int  # estimate for the next attempt
    host_mem_bytes: int
    reason: str


def _round_up(n: float, unit: int = 2 * MIB) -> int:
    # CUDA's caching allocator hands out 2 MiB segments; fences below that are noise.
    return int(-(-int(n) // unit) * unit)


def decide_after_oom(
    kind: Literal["gpu", "host"],
    gpu_est_bytes: int,
    host_est_bytes: int,
    limit_bytes: int,
    measured_peak_bytes: int | None,
    attempt: int,
    max_attempts: int,
    capacity_bytes: int,
    min_raise_frac: float = 0.10,
) -> OomDecision:
    """Raise the estimate of the resource that ran out, or give up with a reason.

    `attempt` counts attempts already made (1 after the first failure);
    `capacity_bytes` is the most any placement could give (largest GPU's memory
    for `gpu`, a node's memory for `host`).
    """
    est = gpu_est_bytes if kind == "gpu" else host_est_bytes
    hit = max(limit_bytes, measured_peak_bytes or 0)
    observed_error = hit / est - 1.0 if est > 0 else 1.0
    new = _round_up(hit * (1.0 + max(observed_error, min_raise_frac)))
    # A limit below the estimate (the site's host calibration lowered it) proved too low:
    # the retry asks at least the estimate, and says so (the demand never went below it).
    new = max(new, _round_up(est))
    what = "GPU" if kind == "gpu" else "host"
    if attempt >= max_attempts:
        return OomDecision(
            "fail", gpu_est_bytes, host_est_bytes,
            f"out of {what} memory {attempt} times (limit {max_attempts}); last fence {limit_bytes // MIB} MiB",
        )
    if new > capacity_bytes:
        if hit >= capacity_bytes:
            return OomDecision(
                "fail", gpu_est_bytes, host_est_bytes,
                f"needs more {what} memory than any placement has ({capacity_bytes // MIB} MiB)",
            )
        new = capacity_bytes
    reason = (
        f"out of {what} memory at {limit_bytes // MIB} MiB (estimate {est // MIB} MiB, "
        f"measured peak {(measured_peak_bytes or 0) // MIB} MiB): retry {attempt + 1} with {new // MIB} MiB"
    )
    if kind == "gpu":
        return OomDecision("requeue", new, host_est_bytes, reason)
    return OomDecision("requeue", gpu_est_bytes, new, reason)


@dataclass(frozen=True)
class MemberOutcome:
    job_id: int
    state: str  # the member's state in the store when its pack ended


def members_to_requeue(pack_ending: str, members: Iterable[MemberOutcome]) -> list[tuple[int, str]]:
    """Members of a pack that ended with `pack_ending` to rerun, each with a reason.

    Finished and cancelled members are never rerun; members that failed on their
    own (a bug, an OOM handled by `decide_after_oom`) are not rerun here either.
    """
    if pack_ending not in RECOVERABLE_PACK_ENDINGS:
        return []
    out = []
    for m in members:
        if m.state in FINAL_MEMBER_STATES or m.state in {"FAILED", "OOM"}:
            continue
        out.append((m.job_id, f"pack ended {pack_ending}; resume from checkpoint"))
    return out
