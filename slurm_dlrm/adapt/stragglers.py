"""Stragglers: members that stay well below their predicted co-located speed.

A single slow sample is noise (a checkpoint, a data-loader hiccup); a member is a
straggler only when every sample over a sustained window is below `ratio` of its
prediction, and the window is fully covered by measurements.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class SpeedSample:
    job_id: int
    t: float  # seconds (unix time)
    samples_per_s: float


@dataclass(frozen=True)
class Straggler:
    job_id: int
    measured_samples_per_s: float  # median over the window
    predicted_samples_per_s: float
    reason: str


def find_stragglers(
    samples: Iterable[SpeedSample],
    predicted_samples_per_s: Mapping[int, float],
    now: float,
    ratio: float = 0.7,
    sustained_s: float = 120.0,
) -> list[Straggler]:
    window_start = now - sustained_s
    by_job: dict[int, list[SpeedSample]] = defaultdict(list)
    first_seen: dict[int, float] = {}
    for s in samples:
        first_seen[s.job_id] = min(first_seen.get(s.job_id, s.t), s.t)
        if s.t >= window_start:
            by_job[s.job_id].append(s)
    out = []
    for job_id in sorted(by_job):
        predicted = predicted_samples_per_s.get(job_id)
        window = by_job[job_id]
        if not predicted or first_seen[job_id] > window_start or len(window) < 2:
            continue
        if all(s.samples_per_s < ratio * predicted for s in window):
            speeds = sorted(s.samples_per_s for s in window)
            median = speeds[len(speeds) // 2]
            out.append(Straggler(
                job_id, median, predicted,
                f"{median:.0f} samples/s for {sustained_s:.0f}s, below {ratio:.0%} of the predicted {predicted:.0f}",
            ))
    return out


def choose_moves(
    stragglers: Iterable[Straggler],
    change_of: Mapping[int, float],
    gpu_of: Mapping[int, Hashable],
    cause_ratio: float = 1.25,
) -> list[tuple[int, str]]:
    """Which members to move for the stragglers found, each with a reason.

    `change_of[job]` is the member's measured use over its planned use (SM or
    bandwidth, whichever departs more); `gpu_of[job]` names its GPU. On a GPU with
    stragglers the member that departs most from its plan, by at least `cause_ratio`,
    is the cause and is moved (even if it is not slow itself: its neighbours are);
    if no member departs that much, the slowness is the device's or the host's and
    the stragglers themselves are moved.
    """
    by_gpu: dict[Hashable, list[Straggler]] = defaultdict(list)
    for s in stragglers:
        by_gpu[gpu_of.get(s.job_id, s.job_id)].append(s)
    out: list[tuple[int, str]] = []
    for gpu, slow in by_gpu.items():
        members = [j for j, g in gpu_of.items() if g == gpu] or [s.job_id for s in slow]
        cause = max(members, key=lambda j: (change_of.get(j, 1.0), -j))
        if change_of.get(cause, 1.0) >= cause_ratio:
            names = ", ".join(str(s.job_id) for s in slow)
            out.append((cause, f"uses {change_of[cause]:.1f}x its planned share; slows job(s) {names}"))
        else:
            out += [(s.job_id, s.reason) for s in slow]
    return out
