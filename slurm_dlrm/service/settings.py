"""The service's settings (`ServiceSettings`: what `serve` and the tests choose) and what
one round reports (`RoundStats`).

Apart from the round (service/core.py) so that a newcomer looking for a knob or for the
figures a round returns finds them without reading the round; `PackingService` and its
parts (pack_end.py) take them from here.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

MAX_ATTEMPTS = 3  # runs of one job ended by its own memory (OOM retries) before it fails
# Runs of one job ended by a fault not its own (a lost node or pack, a killed agent or
# member, preemption) before it fails: the same default as Slurm's MaxBatchRequeue. Apart
# from MAX_ATTEMPTS so that faults that come together (issue 49: a gang hit by a killed
# member, a killed agent and a killed member in one run) do not fail a sound job, while a
# job that brings its pack down every time still ends.
MAX_FAULT_RUNS = 5


@dataclass(frozen=True)
class ServiceSettings:
    user: str
    python: str = sys.executable
    sbatch_timeout_s: float = 30.0  # the Slurm client's command timeout
    backoff_min_s: float = 2.0
    backoff_max_s: float = 60.0
    max_attempts: int = MAX_ATTEMPTS
    max_fault_runs: int = MAX_FAULT_RUNS
    policy: str | None = None  # None: the site's packing.policy
    # Batched dispatch (RMixer): plan when this long passed since the last plan, or when
    # packing.round_batch_size jobs arrived since. None: the site's packing.round_seconds.
    dispatch_window_s: float | None = None
    # A pack pinned to its planned node (--nodelist) that Slurm holds back for want of
    # resources there this long after sbatch is withdrawn and its members planned again
    # on a fresh view of the nodes; None: max(PIN_WAIT_MIN_S, PIN_WAIT_ROUNDS windows).
    pin_wait_s: float | None = None


@dataclass
class RoundStats:
    ingested_lines: int = 0
    transitions: int = 0
    packs_submitted: int = 0
    jobs_planned: int = 0
    slurm_ok: bool = True
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
