"""Fences from the estimate's observed error (docs/packing.md "Closer to the bound", 5).

The simulator (`sim/planner_view.py`, `round_limits`) and the live service
(`service/measured.py`, `learned_limits`) both take each round's GPU memory margin
from here, so the margin the simulator credits is the one the service runs. Pure.
"""

from __future__ import annotations

from collections.abc import Sequence

# A member killed at its fence shows only that its error passed the fence: count it
# just past it (the smallest error that explains the kill).
PAST_FENCE = 0.01


def peak_error(peak_bytes: float, estimate_bytes: float, fence_bytes: float | None = None) -> float | None:
    """|peak / estimate - 1| of one member at its peak (both without the CUDA context),
    capped just past the fence's margin when a fence held it (`fence_bytes`, also
    without the context). None: no estimate to compare with."""
    if estimate_bytes <= 0:
        return None
    err = peak_bytes / estimate_bytes - 1.0
    if fence_bytes is not None:
        err = min(err, fence_bytes / estimate_bytes - 1.0 + PAST_FENCE)
    return abs(err)


def learned_margin_pct(errors: Sequence[float], configured_pct: float) -> float:
    """The round's memory margin: the configured one or, once errors were observed, the
    largest seen scaled by (n+1)/n (the unbiased bound of a uniform error), whichever
    is larger. With the estimator's +-5% it stays at the configured 5%; with estimates
    +-20% off it reaches ~20% after the first peaks."""
    if not errors:
        return configured_pct
    n = len(errors)
    return max(configured_pct, 100.0 * max(errors) * (n + 1) / n)
