"""`slurm-dlrm selftest --submit`: run the selftest as a Slurm job through the Slurm seam.

The batch script runs `python -m slurm_dlrm selftest --json ...` on the allocated node
and writes the JSON verdict to a file in the user's spool folder (a filesystem the
login node and the compute nodes share, site key `site.spool_dir`); the submitting
process waits for the job and reads it back.
"""

from __future__ import annotations

import getpass
import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

from slurm_dlrm.errors import BadInput, DlrmError
from slurm_dlrm.slurm import SlurmBackend
from slurm_dlrm.slurm.wait import wait_for_jobs

JOB_NAME = "slurm-dlrm-selftest"
JOB_TIME_MINUTES = 15  # the verdict takes < 5 minutes on a GPU node; room for the CUDA import


def partition_gpu_gres(backend: SlurmBackend, partition: str) -> str:
    """The partition's gres string; BadInput when it does not exist or has no GPU."""
    rows = [r for r in backend.sinfo() if r.partition == partition]
    if not rows:
        names = sorted({r.partition for r in backend.sinfo()})
        raise BadInput(f"-p {partition}: no such partition (Slurm has: {', '.join(names) or 'none'})")
    gres = ",".join(sorted({r.gres for r in rows if r.gres and r.gres != "(null)"}))
    if not re.search(r"(^|,)gpu[:(]", gres + "("):
        raise BadInput(f"-p {partition}: the partition has no GPUs (gres: {gres or 'none'}); "
                       "selftest needs a GPU node")
    return gres


def gpus_requested(gres: str | None) -> int:
    """GPUs per node a --gres value asks for ("gpu:1", "gpu:h100:2", "gpu:h100:2,mps:50"); 1 by default."""
    for part in (gres or "gpu:1").split(","):
        fields = part.strip().split(":")
        if fields[0] == "gpu":
            return int(fields[-1]) if len(fields) > 1 and fields[-1].isdigit() else 1
    raise BadInput(f"--gres {gres}: asks for no GPU (selftest needs gpu:N)")


def batch_script(inner_args: list[str], stem: Path, python: str | None = None) -> str:
    """The job script: `<stem><jobid>.json` gets the verdict (--output is an sbatch argument)."""
    q = shlex.quote
    argv = [python or sys.executable, "-m", "slurm_dlrm", "selftest", "--json", *inner_args]
    return "\n".join([
        "#!/bin/bash",
        f"#SBATCH --job-name={JOB_NAME}",
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks=1",
        f"#SBATCH --time={JOB_TIME_MINUTES}",
        # The JSON verdict goes to a file; the selftest's exit code is the job's.
        " ".join(q(a) for a in argv) + f' > {q(str(stem))}"$SLURM_JOB_ID".json',
        "",
    ])


def submit_and_wait(backend: SlurmBackend, partition: str, gres: str | None, inner_args: list[str],
                    out_dir: Path, extra_sbatch: list[str], timeout_s: float) -> tuple[int, dict[str, Any]]:
    """Submit, wait, read the verdict: (job id, the JSON the job wrote)."""
    partition_gpu_gres(backend, partition)
    out_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    stem = out_dir / f"selftest-{getpass.getuser()}-"
    args = ["-p", partition, f"--gres={gres or 'gpu:1'}", f"--output={stem}%j.log", *extra_sbatch]
    job_id = backend.sbatch(batch_script(inner_args, stem), args)
    done = wait_for_jobs(backend, [job_id], timeout_s=timeout_s, max_poll_s=5.0)
    info = done.get(job_id)
    result_path = Path(f"{stem}{job_id}.json")
    log_path = Path(f"{stem}{job_id}.log")
    try:
        data = json.loads(result_path.read_text())
    except (OSError, ValueError):
        tail = ""
        try:
            tail = log_path.read_text().strip().splitlines()[-1]
        except (OSError, IndexError):
            pass
        state = info.state.value if info is not None else "unknown"
        raise DlrmError(f"selftest job {job_id}: no verdict (job {state}; {tail or 'no output'}; log {log_path})") \
            from None
    return job_id, data
