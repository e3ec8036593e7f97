"""Stragglers: members that stay well below their predicted co-located speed.

A single slow sample is noise (a checkpoint, a data-loader hiccup); a member is a
straggler only when every sample over a sustained window is below `ratio` of its
prediction, and the window is fully covered by measurements.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
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
