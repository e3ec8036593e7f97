"""Wait for Slurm jobs to end, through any `SlurmBackend` (one batched query per poll)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from slurm_dlrm.slurm.base import JobInfo, SlurmBackend, SlurmError
from slurm_dlrm.slurm.states import JobState


class JobWaitTimeout(SlurmError):
    """Jobs still not ended when the wait ran out."""

    def __init__(self, job_ids: Sequence[int], timeout_s: float, last: dict[int, JobInfo]) -> None:
        states = ", ".join(f"{j}={last[j].state.value if j in last else '?'}" for j in job_ids)
        super().__init__(["squeue"], None, "", f"jobs not done after {timeout_s:g} s ({states})")
        self.last = last


def wait_for_jobs(backend: SlurmBackend, job_ids: Sequence[int], timeout_s: float = 60.0, *,
                  poll_s: float = 0.5, max_poll_s: float = 5.0,
                  sleep: Callable[[float], None] = time.sleep,
                  clock: Callable[[], float] = time.monotonic) -> dict[int, JobInfo]:
    """Poll until every job is in a terminal state; return the last view of each.

    A job that squeue no longer lists (purged after MinJobAge) is looked up with
    `show_job`; if Slurm has forgotten it entirely it is reported as UNKNOWN. The poll
    interval doubles from `poll_s` up to `max_poll_s`.
    """
    wanted = list(dict.fromkeys(int(j) for j in job_ids))
    deadline = clock() + timeout_s
    last: dict[int, JobInfo] = {}
    interval = poll_s
    while True:
        seen = {j.job_id: j for j in backend.squeue(job_ids=wanted)}
        for jid in wanted:
            if jid in seen:
                last[jid] = seen[jid]
            elif jid not in last or not last[jid].state.is_terminal:
                info = backend.show_job(jid)
                last[jid] = info if info is not None else JobInfo(jid, "", JobState.UNKNOWN, "")
        if all(last[j].state.is_terminal or last[j].state is JobState.UNKNOWN for j in wanted):
            return last
        if clock() >= deadline:
            raise JobWaitTimeout(wanted, timeout_s, last)
        sleep(min(interval, max(0.0, deadline - clock())))
        interval = min(interval * 2, max_poll_s)
