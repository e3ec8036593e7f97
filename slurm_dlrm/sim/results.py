"""What one simulator run measured: each job's outcome (`JobOutcome`) and the run's
figures (`SimResult`: throughput, JCT, GPU-hours, utilisation, OOMs) with the metrics
that `slurm-dlrm simulate` and the benchmarks print.

Apart from the event loop (sim/engine.py) because these are what readers of a run use
(sim/report.py, the CLI, benchmarks/) without needing how the run was made.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from slurm_dlrm.sim.snapshot import Snapshot


@dataclass(frozen=True)
class JobOutcome:
    job_id: int
    arrival_s: float
    solo_duration_s: float
    end_s: float | None  # None: never completed
    state: str  # COMPLETED | FAILED | UNPLACEABLE | PENDING | STOPPED (a sweep's paused variant)
    ooms: int
    start_s: float | None = None  # when a plan first placed it (it left the queue)


@dataclass(frozen=True)
class SimResult:
    policy: str
    workload: str
    cluster: str
    gpus: int
    jobs: tuple[JobOutcome, ...]
    first_arrival_s: float
    end_s: float
    alloc_gpu_s: float
    busy_gpu_s: float  # integral of min(1, sum of members' SM use x speed) over allocated GPUs
    ooms: int
    rounds: int
    packs: int
    member_s: float = 0.0  # integral of running (started, not ended) members over time
    backlog_s: float = 0.0  # time during which jobs were waiting
    backlog_work_s: float = 0.0  # solo-seconds of training done during that time
    evictions: int = 0  # dmem: members evicted under GPU memory pressure (counted in ooms too)
    resubmits: int = 0  # failed jobs submitted again by their users (retry.user_resubmits)
    # Integrals over the packs' lives of the CPUs / host memory they asked Slurm for at
    # their start: what our packs held of the nodes, i.e. not left to other users.
    held_cpu_s: float = 0.0
    held_mem_byte_s: float = 0.0
    snapshots: tuple[Snapshot, ...] = ()  # simulate(snapshot_at_s=...)

    @property
    def backlog_throughput_jobs_per_h(self) -> float:
        """Solo-equivalent jobs per hour while jobs were waiting: the packing's capacity,
        free of the start (queue filling) and the drain (too few jobs left to pack)."""
        mean_solo = sum(j.solo_duration_s for j in self.jobs) / max(1, len(self.jobs))
        return (self.backlog_work_s / mean_solo) / (self.backlog_s / 3600.0) if self.backlog_s > 0 and mean_solo > 0 else 0.0

    @property
    def mean_members_per_gpu(self) -> float:
        return self.member_s / self.alloc_gpu_s if self.alloc_gpu_s > 0 else 0.0

    @property
    def completed(self) -> list[JobOutcome]:
        return [j for j in self.jobs if j.state == "COMPLETED"]

    @property
    def makespan_s(self) -> float:
        ends = [j.end_s for j in self.completed if j.end_s is not None]
        return (max(ends) - self.first_arrival_s) if ends else 0.0

    @property
    def throughput_jobs_per_h(self) -> float:
        """Solo-equivalent jobs per hour: completed solo work, counted in mean-sized jobs."""
        mean_solo = sum(j.solo_duration_s for j in self.jobs) / max(1, len(self.jobs))
        done = sum(j.solo_duration_s for j in self.completed)
        return (done / mean_solo) / (self.makespan_s / 3600.0) if self.makespan_s > 0 and mean_solo > 0 else 0.0

    @property
    def jct_s(self) -> list[float]:
        return sorted(j.end_s - j.arrival_s for j in self.completed if j.end_s is not None)

    @property
    def avg_jct_s(self) -> float:
        v = self.jct_s
        return sum(v) / len(v) if v else 0.0

    @property
    def p95_jct_s(self) -> float:
        v = self.jct_s
        return v[min(len(v) - 1, math.ceil(0.95 * len(v)) - 1)] if v else 0.0

    @property
    def gpu_hours(self) -> float:
        return self.alloc_gpu_s / 3600.0

    @property
    def mean_gpu_util_pct(self) -> float:
        return 100.0 * self.busy_gpu_s / self.alloc_gpu_s if self.alloc_gpu_s > 0 else 0.0

    @property
    def completion_rate(self) -> float:
        return len(self.completed) / len(self.jobs) if self.jobs else 0.0

    def metrics(self) -> dict[str, float | int | str]:
        return {"policy": self.policy, "workload": self.workload, "cluster": self.cluster, "gpus": self.gpus,
                "jobs": len(self.jobs), "completed": len(self.completed),
                "throughput_jobs_per_h": round(self.throughput_jobs_per_h, 4),
                "backlog_throughput_jobs_per_h": round(self.backlog_throughput_jobs_per_h, 4),
                "avg_jct_s": round(self.avg_jct_s, 1), "p95_jct_s": round(self.p95_jct_s, 1),
                "makespan_s": round(self.makespan_s, 1), "gpu_hours": round(self.gpu_hours, 3),
                "mean_gpu_util_pct": round(self.mean_gpu_util_pct, 2), "ooms": self.ooms,
                "completion_rate": round(self.completion_rate, 4), "rounds": self.rounds, "packs": self.packs,
                "mean_members_per_gpu": round(self.mean_members_per_gpu, 2), "resubmits": self.resubmits}
