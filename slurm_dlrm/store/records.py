"""The store's row types: what `Store` reads back (`Job`, `Pack`, `Placement`,
`CalibrationRow`, `JobUsage`) and what a caller hands it to place a job (`NewPlacement`).
Plain frozen dataclasses, no SQL: `slurm_dlrm.store.store` fills them."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from slurm_dlrm.store.states import JobState, PackState

MODE_PACK = "pack"
MODE_NO_PACK = "no-pack"  # `submit --no-pack`: a job of its own in Slurm


def _row_fields(cls: type, row: Mapping[str, Any]) -> dict[str, Any]:
    return {f.name: row.get(f.name) for f in fields(cls)}


@dataclass(frozen=True)
class Job:
    id: int
    user: str
    name: str
    state: JobState
    attempt: int
    spec_fingerprint: str
    spec_json: str
    estimate_json: str | None
    sbatch_json: str | None
    gpu_model: str | None
    est_gpu_peak_bytes: int | None
    est_host_peak_bytes: int | None
    est_profile_label: str | None
    est_solo_samples_per_s: float | None
    gpu_mem_request_bytes: int | None
    host_mem_request_bytes: int | None
    submit_time: float
    start_time: float | None
    end_time: float | None
    pack_id: int | None
    slurm_job_id: str | None
    slurm_step: str | None
    exit_code: int | None
    exit_reason: str | None
    updated_time: float
    # `submit --no-pack` (issue 23): "no-pack" = one job as its own Slurm job (slurm_job_id),
    # never packed; nodes/gpu_idx/gpu_share are that job's allocation (None for packed jobs,
    # whose placements say where they ran).
    mode: str = "pack"
    nodes: str | None = None
    gpu_idx: str | None = None
    gpu_share: float | None = None
    nice: int = 0  # submit --nice (issue 31): higher goes later among the user's jobs
    begin_time: float | None = None  # submit --begin: not planned before this (epoch seconds)
    # a task of `submit --array` (issue 42): the array's id (its first task's job id) and
    # this task's index, as Slurm numbers them (`12_3`); None: not an array task
    array_job_id: int | None = None
    array_task_id: int | None = None

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Job:
        d = _row_fields(cls, row)
        d["state"] = JobState(d["state"])
        d["mode"] = d["mode"] or "pack"
        d["nice"] = d.get("nice") or 0
        return cls(**d)

    @property
    def no_pack(self) -> bool:
        return self.mode == MODE_NO_PACK

    @property
    def spec(self) -> dict[str, Any]:
        return dict(json.loads(self.spec_json))

    @property
    def estimate(self) -> dict[str, Any] | None:
        return None if self.estimate_json is None else dict(json.loads(self.estimate_json))

    @property
    def sbatch(self) -> dict[str, Any] | None:
        return None if self.sbatch_json is None else dict(json.loads(self.sbatch_json))


@dataclass(frozen=True)
class Pack:
    id: int
    name: str
    user: str
    state: PackState
    policy: str
    partition: str | None
    gpu_model: str | None
    n_nodes: int
    n_gpus: int
    nodes: str | None
    slurm_job_id: str | None
    pack_dir: str | None
    create_time: float
    submit_time: float | None
    start_time: float | None
    end_time: float | None
    reason: str | None
    updated_time: float

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Pack:
        d = _row_fields(cls, row)
        d["state"] = PackState(d["state"])
        return cls(**d)


@dataclass(frozen=True)
class Placement:
    id: int
    pack_id: int
    job_id: int
    attempt: int
    node_index: int
    node: str | None
    gpu_index: int
    mps_thread_pct: int | None
    gpu_mem_limit_bytes: int | None
    host_mem_limit_bytes: int | None
    cpus: int | None
    start_time: float | None
    end_time: float | None
    predicted_speed: float | None = None  # relative to solo, from the packing plan
    rank: int | None = None  # a multi-GPU job's rank (None: a one-rank member)
    world_size: int | None = None

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Placement:
        return cls(**_row_fields(cls, row))


@dataclass(frozen=True)
class NewPlacement:
    """One member on one GPU, as the policy planned it (a job with world_size > 1 has several)."""

    job_id: int
    node_index: int
    gpu_index: int
    mps_thread_pct: int | None = None
    gpu_mem_limit_bytes: int | None = None
    host_mem_limit_bytes: int | None = None
    cpus: int | None = None
    node: str | None = None
    # MemberPlacement.predicted_speed: the member's speed on this GPU relative to running
    # alone, from the interference model (acct's GPU-hours saved, docs/store.md)
    predicted_speed: float | None = None
    rank: int | None = None  # MemberPlacement.rank/world_size for a multi-GPU job's rank
    world_size: int | None = None


@dataclass(frozen=True)
class CalibrationRow:
    """A finished job's estimated vs measured peaks, for the estimator's calibration."""

    job_id: int
    state: JobState
    end_time: float | None
    est_gpu_peak_bytes: int | None
    meas_gpu_peak_bytes: int | None
    est_host_peak_bytes: int | None
    meas_host_peak_bytes: int | None
    n_samples: int


@dataclass(frozen=True)
class SiteHostRun:
    """A COMPLETED job of any fingerprint: the estimate it was submitted with
    (`Estimate.to_dict()`) and its measured peak RSS, for the site-wide host calibration."""

    job_id: int
    end_time: float | None
    estimate: dict[str, Any]
    meas_host_peak_bytes: int
    pack_dir: str | None = None  # its last pack's folder (store/report.py `ran_on` reads its device there)


@dataclass(frozen=True)
class JobUsage:
    """What the samples of one job measured so far (all attempts), from `job_usage`."""

    job_id: int
    n_samples: int
    gpu_mem_peak_bytes: int | None
    rss_peak_bytes: int | None
    sm_util_mean: float | None
    sm_util_max: float | None
    host_cpu_mean: float | None
    samples_per_s_mean: float | None
    first_t: float | None
    last_t: float | None
