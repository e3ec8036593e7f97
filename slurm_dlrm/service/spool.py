"""Files of a user's spool a job needs before any pack exists (kept apart from
slurm_dlrm.service.core so that `submit` does not import the service)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from slurm_dlrm.service.common import write_atomic
from slurm_dlrm.service.daemon import ensure_private_dir

SPEC_FILE = "spec.json"  # <spool_dir>/jobs/<job_id>/spec.json: what the member's `train` reads


def write_job_spec(spool_dir: Path, job_id: int, spec: dict[str, Any]) -> Path:
    """`<spool_dir>/jobs/<job_id>/spec.json` (folders 0700, file 0600); returns its path."""
    job_dir = spool_dir / "jobs" / str(job_id)
    if not job_dir.is_dir():
        ensure_private_dir(job_dir)
    path = job_dir / SPEC_FILE
    write_private(path, json.dumps(spec, sort_keys=True) + "\n")
    return path


def write_private(path: Path, text: str) -> None:
    """0600, replaced atomically: an agent or runner reading placement.json or spec.json
    while the service rewrites it (a resubmission) sees the whole old file or the new."""
    write_atomic(path, text)
