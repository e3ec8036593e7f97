"""Checks and the verdict of `slurm-dlrm selftest`: pure, no I/O.

A check's status is one of

    PASS  measured on this node's hardware and within its bound
    FAIL  measured and out of bounds, or the step broke (the `fix` says what to do)
    SKIP  not measured (no CUDA device, an earlier step failed, ...): the `detail` says why
    DRY   ran against the fake NVML / fake MPS control daemon and behaved: our code
          path works, but nothing about a GPU was measured. Never an acceptance.

Only PASS says something about the hardware; a node is *accepted* when nothing failed
and every hardware check passed. The exit code is 0 when nothing failed (DRY and SKIP
included), so a machine without a GPU can run the command in CI.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

PASS, FAIL, SKIP, DRY = "PASS", "FAIL", "SKIP", "DRY"
STATUSES = (PASS, FAIL, SKIP, DRY)

# Thread-share scaling: the compute kernel is an FP32 8192^2 matmul (4096 output tiles),
# run solo at two shares. Throughput should follow the number of SMs the share gives.
# Deviations that are not a broken fence: MPS turns a share into whole SMs (<= 1 SM, 4 %
# at 25 % of 108 SMs), wave quantisation of 4096 tiles over ~30-60 SMs (< 2 %), and GPU
# Boost clocking a lightly loaded GPU higher (up to ~10 %). 20 % covers these; a share
# that does not throttle at all gives a ratio of 1.0 where 2.0 is expected (-50 %).
SCALING_TOLERANCE = 0.20
# Memory fence: the client allocates in 32 MiB blocks up to its pinned limit. It must
# be refused before it passes the limit by more than one block, and not long before
# the limit (a refusal far below the limit is a full GPU or another fence, not ours):
# allowed shortfall max(256 MiB, 25 % of the limit), which covers the client's own
# context-side allocations that some drivers count against the limit.
FENCE_BLOCK_MIB = 32
FENCE_SHORTFALL_MIB = 256
FENCE_SHORTFALL_FRACTION = 0.25
# Estimator on CUDA: the estimate must cover torch's peak (max_memory_reserved) and not
# overshoot NVML's process memory by more than this (the packing margin would then
# waste a GPU's memory). Under the measured peak at all is a FAIL: that is what OOMs.
ESTIMATE_OVER_TOLERANCE_PCT = 15.0
# A GPU model's memory in the site file vs NVML's total: NVML reports the usable part
# (an "80 GB" H100 gives 79.6 GiB; ECC reservations take a little more on some parts).
MEMORY_MATCH_PCT = 6.0
EXCLUSIVE_PROCESS = 3  # nvmlComputeMode_t


@dataclass
class Check:
    name: str  # e.g. "mps.memory_fence"
    status: str
    figure: str  # what it rests on, with units
    detail: str = ""  # why SKIP/DRY, what was done
    fix: str = ""  # on FAIL: what to do
    values: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r}")
        if self.status == FAIL and not self.fix:
            raise ValueError(f"{self.name}: a FAIL must say what to fix")


def exit_code(checks: list[Check]) -> int:
    return 1 if any(c.status == FAIL for c in checks) else 0


def accepted(checks: list[Check]) -> bool:
    """Nothing failed and every check ran on hardware."""
    return bool(checks) and all(c.status == PASS for c in checks)


def summary(checks: list[Check]) -> dict[str, Any]:
    counts = {s: sum(c.status == s for c in checks) for s in STATUSES}
    if counts[FAIL]:
        text = f"{counts[FAIL]} check(s) FAILED: fix them before trusting packing on this node"
    elif accepted(checks):
        text = "every check passed on this GPU: the node is accepted"
    else:
        text = (f"nothing failed, but the node is NOT accepted: {counts[PASS]} hardware check(s) passed, "
                f"{counts[DRY]} ran only against fakes, {counts[SKIP]} skipped")
    return {"counts": counts, "accepted": accepted(checks), "exit_code": exit_code(checks), "text": text}


def to_json(checks: list[Check], context: dict[str, Any]) -> dict[str, Any]:
    return {"context": context, "checks": [asdict(c) for c in checks], "verdict": summary(checks)}


# ---------------------------------------------------------------- judgements


def judge_fence(event: dict[str, Any] | None, limit_mib: int) -> tuple[str, str, str]:
    """(status, figure, fix) for the client that allocates past its pinned limit."""
    if event is None:
        return FAIL, "the client reported nothing", "see the client's error in the detail; is CUDA usable under MPS?"
    got = int(event.get("allocated_mib", 0))
    if event.get("event") == "no_oom":
        return (FAIL, f"allocated {got} MiB with a limit of {limit_mib} MiB and no out-of-memory error",
                "the MPS memory limit is not enforced: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT needs driver >= 515 on "
                "Volta or newer and clients that reach the daemon (same CUDA_MPS_PIPE_DIRECTORY)")
    if event.get("event") != "oom":
        return FAIL, f"client: {event.get('error', event.get('event'))}", "run the probe by hand (docs/admin.md)"
    shortfall = max(FENCE_SHORTFALL_MIB, FENCE_SHORTFALL_FRACTION * limit_mib)
    figure = f"out of memory after {got} MiB, limit {limit_mib} MiB"
    if got > limit_mib + FENCE_BLOCK_MIB:
        return FAIL, figure, "the fence let the client past its limit: check the driver's MPS memory-limit support"
    if got < limit_mib - shortfall:
        return (FAIL, figure, "refused long before the limit: the GPU is short of free memory (other processes?) "
                "or another limit applies; run on an idle GPU")
    return PASS, figure, ""


def judge_neighbour(progress_after_oom: int | None, exit_status: int | None) -> tuple[str, str, str]:
    if progress_after_oom is None:
        return FAIL, "no progress report from the neighbour", "see the neighbour's error in the detail"
    figure = f"{progress_after_oom} matmuls after the other client's OOM, exit {exit_status}"
    if progress_after_oom <= 0 or exit_status != 0:
        return (FAIL, figure, "one client's OOM stopped its neighbour: the MPS server died or the clients are "
                "not isolated (check the MPS server log in the log folder)")
    return PASS, figure, ""


def expected_ratio(pct_low: float, pct_high: float, sm_count: int | None) -> float:
    """Throughput ratio high/low share, counting MPS's rounding to whole SMs (up)."""
    if not sm_count:
        return pct_high / pct_low
    import math

    return math.ceil(pct_high / 100 * sm_count) / math.ceil(pct_low / 100 * sm_count)


def judge_scaling(tflops_low: float | None, tflops_high: float | None, pct_low: float, pct_high: float,
                  sm_count: int | None) -> tuple[str, str, str]:
    if not tflops_low or not tflops_high:
        return FAIL, "no throughput measured", "see the clients' errors in the detail"
    want = expected_ratio(pct_low, pct_high, sm_count)
    got = tflops_high / tflops_low
    figure = (f"{tflops_low:.2f} TFLOP/s at {pct_low:g}%, {tflops_high:.2f} at {pct_high:g}%: ratio {got:.2f}, "
              f"expected {want:.2f} +/- {SCALING_TOLERANCE:.0%}")
    if abs(got / want - 1) > SCALING_TOLERANCE:
        return (FAIL, figure, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE does not throttle: the GPU must be Volta or newer, "
                "the daemon's default share must not be lower than the client's, and the clients must be MPS "
                "clients (compute mode EXCLUSIVE_PROCESS makes a non-MPS client fail instead)")
    return PASS, figure, ""


def judge_estimate(est_allocator_bytes: int, est_total_bytes: int, reserved_bytes: int,
                   nvml_bytes: int | None) -> tuple[str, float, float | None]:
    """(status, error vs reserved %, error vs NVML %); positive = the estimate is above.

    The estimate without the CUDA context (what PyTorch's caching allocator holds:
    tensors, cuBLAS workspace, rounding) is compared with `max_memory_reserved`; the
    whole estimate with NVML's memory of the process (context included).
    """
    err_reserved = 100.0 * (est_allocator_bytes - reserved_bytes) / reserved_bytes
    err_nvml = 100.0 * (est_total_bytes - nvml_bytes) / nvml_bytes if nvml_bytes else None
    errors = [err_reserved] + ([err_nvml] if err_nvml is not None else [])
    if min(errors) < 0 or max(errors) > ESTIMATE_OVER_TOLERANCE_PCT:
        return FAIL, err_reserved, err_nvml
    return PASS, err_reserved, err_nvml


def memory_matches(model_memory_gib: float, nvml_total_bytes: int) -> bool:
    nvml_gib = nvml_total_bytes / (1 << 30)
    return abs(nvml_gib - model_memory_gib) / model_memory_gib * 100.0 <= MEMORY_MATCH_PCT
