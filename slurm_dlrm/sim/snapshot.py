"""The queue and the running packs at one moment, as the service sees them (estimates
only): `Snapshot` with its `RunningPack`s and their `RunningMember`s. A run records one
at `simulate(snapshot_at_s=...)` and starts from one at `simulate(resume=...)`
(sim/engine.py), which is what `queue --start` does (sim/start_estimate.py).

Apart from the simulator's state because the service builds these from its store
(service/start_times.py) without the simulator's internals.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunningMember:
    """One member of a running pack as the service sees it (issue 31, `queue --start`)."""

    job_id: int
    gpu_index: int
    rank: int
    fence_bytes: int | None  # None: no fence
    cpus: int
    host_mem_bytes: int
    ready_in_s: float  # seconds until it trains (pack start + start-up); 0: training now
    peak_bytes: int | None = None  # its measured peak (agents' samples) once past it; None: not yet
    peak_in_s: float = 0.0  # not past its peak: solo-seconds of training until it reaches it


@dataclass(frozen=True)
class RunningPack:
    """A pack holding GPUs now: where it is and what it holds (its allocation never shrinks)."""

    node_name: str
    gpu_count: int
    cpus: int
    host_mem_bytes: int
    mps: bool
    start_in_s: float  # > 0: submitted, Slurm starts it then; 0: started
    members: tuple[RunningMember, ...]
    pack_id: int = -1  # >= 0: kept in the forward run (the policy orders pack GPUs by key)
    idle_for_s: float | None = None  # no member left for this long (slurm.pack_release_s not yet up)


@dataclass(frozen=True)
class Snapshot:
    """The queue and the running jobs at one moment, as the service sees them (estimates
    only): what `queue --start` simulates forward from (sim/start_estimate.py)."""

    now_s: float
    pending: tuple[tuple[int, float, int], ...]  # (job id, expected run left s, estimated GPU bytes)
    running: tuple[tuple[int, float, int], ...]  # likewise, for jobs on GPUs now
    memory_margin_pct: float | None = None  # the fences' margin then (None: the cluster's)
    # Where the running jobs are (simulate(resume=...) keeps them there), and the
    # dispatcher's own state: rounds each waiting job was passed over, the last round.
    packs: tuple[RunningPack, ...] = ()
    waited_rounds: tuple[tuple[int, int], ...] = ()
    last_round_s: float | None = None
    arrived_since_round: int = 0
    # running job id -> the run left that the planner weighs it by (the estimate times
    # the share of steps left), where it differs from the measured one in `running`
    planned_left_s: tuple[tuple[int, float], ...] = ()
    round_due: bool = True  # something changed since the last round (else the next waits for a change)

