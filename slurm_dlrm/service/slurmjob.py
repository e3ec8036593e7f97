"""`[service] run_as = "slurm-job"`: the packing service as a small Slurm job (issue 30f).

Where login nodes end long-running user processes, the service runs in a CPU partition
the site names, as one ordinary batch job of the user (`slurm-dlrm-service-<user>`,
1 CPU, 1 GiB, `[service] job_minutes`). It keeps itself alive with Slurm's own
`--dependency=singleton` (one running job of that name and user at a time): once it
holds the store's lease it queues its successor, which Slurm starts only after this one
ended, at its time limit (Slurm's SIGTERM: the service stops after its round and gives
the lease back) or earlier. So there is always one service or one waiting to start, and
the lease (service/hosts.py) keeps two from writing at once. A service idle for its
`--idle-exit` cancels its waiting successor and ends; the next `submit` queues it again.

It runs on a compute node, which holds the lease: every login node is then "another
host" (docs/service.md): `submit` drops a request file, `queue` reads the copy.
"""

from __future__ import annotations

import logging
import shlex
import sys
from typing import Any

from slurm_dlrm.site import SiteConfig

log = logging.getLogger(__name__)

JOB_MEM_MIB = 1024
IDLE_EXIT_S = 600.0


def job_name(user: str) -> str:
    return f"slurm-dlrm-service-{user}"


def service_script(site: SiteConfig, user: str, python: str = sys.executable) -> str:
    """The batch script: the service in the foreground, its log in the store folder."""
    log_file = site.store_dir_for(user) / "service.log"
    argv = [python, "-m", "slurm_dlrm", "-v", "serve", "--slurm-job", "--idle-exit", f"{IDLE_EXIT_S:g}",
            "--log-file", str(log_file)]
    if site.path:
        argv += ["--site", site.path]
    return ("#!/bin/bash\n"
            "# slurm-dlrm packing service as a Slurm job ([service] run_as = \"slurm-job\"; docs/service.md)\n"
            f"exec {' '.join(shlex.quote(a) for a in argv)}\n")


def sbatch_flags(site: SiteConfig, user: str) -> list[str]:
    out = site.store_dir_for(user) / "service-job-%j.out"
    return sorted([f"--job-name={job_name(user)}", f"--partition={site.service_partition}",
                   f"--time={site.service_job_minutes}", "--cpus-per-task=1", f"--mem={JOB_MEM_MIB}M",
                   "--dependency=singleton", f"--output={out}", "--ntasks=1"])


def service_jobs(slurm: Any, user: str) -> list[Any]:
    """The user's service jobs Slurm still has (pending or running)."""
    return [i for i in slurm.squeue(user=user) if i.name == job_name(user) and not i.state.is_terminal]


def queue_service_job(site: SiteConfig, user: str, slurm: Any, *, running_id: int | None = None,
                      python: str = sys.executable) -> tuple[int, bool]:
    """One waiting service job: (its id, whether it was submitted now). A running one
    (other than `running_id`, the caller's own) counts as waiting for a `submit`."""
    from slurm_dlrm.slurm.states import JobState

    for info in service_jobs(slurm, user):
        if info.job_id == running_id:
            continue
        if running_id is None or info.state == JobState.PENDING:
            return info.job_id, False
    job_id = slurm.sbatch(service_script(site, user, python), sbatch_flags(site, user))
    log.info("queued the packing service as Slurm job %d (%s)", job_id, job_name(user))
    return job_id, True


def cancel_successors(slurm: Any, user: str, own_id: int | None) -> list[int]:
    """On an idle exit: no service job waits to start after this one."""
    from slurm_dlrm.slurm.states import JobState

    ids = [i.job_id for i in service_jobs(slurm, user) if i.job_id != own_id and i.state == JobState.PENDING]
    if ids:
        slurm.scancel(ids)
        log.info("idle: cancelled the waiting service job(s) %s", ids)
    return ids
