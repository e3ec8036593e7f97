"""Slurm job states -> our job states, through one table.

Slurm prints a state long (``RUNNING``) in squeue/scontrol/sacct and short (``R``)
in ``squeue -o %t``; sacct may add a suffix (``CANCELLED by 0``) and squeue --json
may give several flags (``["RUNNING", "COMPLETING"]``). Anything this table does not
know becomes ``UNKNOWN`` with a warning, never an exception: a Slurm upgrade that
adds a state must not crash the service.
"""

from __future__ import annotations

import enum
import logging

log = logging.getLogger(__name__)


class JobState(enum.StrEnum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUSPENDED = "SUSPENDED"
    COMPLETING = "COMPLETING"  # ended, Slurm still cleaning up on the nodes
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TIMEOUT = "TIMEOUT"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    NODE_FAIL = "NODE_FAIL"
    PREEMPTED = "PREEMPTED"
    REQUEUED = "REQUEUED"  # back to pending after a requeue; will run again
    UNKNOWN = "UNKNOWN"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL

    @property
    def is_active(self) -> bool:
        """Holds (or may soon hold) resources."""
        return self in (JobState.PENDING, JobState.RUNNING, JobState.SUSPENDED,
                        JobState.COMPLETING, JobState.REQUEUED)


TERMINAL = frozenset({JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED, JobState.TIMEOUT,
                      JobState.OUT_OF_MEMORY, JobState.NODE_FAIL, JobState.PREEMPTED})

# Slurm 22.05 slurm.h job_state_string() / job_state_string_compact(), both forms.
SLURM_STATES: dict[str, JobState] = {
    "PENDING": JobState.PENDING, "PD": JobState.PENDING,
    "CONFIGURING": JobState.PENDING, "CF": JobState.PENDING,  # nodes booting
    "RUNNING": JobState.RUNNING, "R": JobState.RUNNING,
    "RESIZING": JobState.RUNNING, "RS": JobState.RUNNING,
    "SIGNALING": JobState.RUNNING, "SI": JobState.RUNNING,
    "STAGE_OUT": JobState.RUNNING, "SO": JobState.RUNNING,
    "SUSPENDED": JobState.SUSPENDED, "S": JobState.SUSPENDED,
    "STOPPED": JobState.SUSPENDED, "ST": JobState.SUSPENDED,
    "COMPLETING": JobState.COMPLETING, "CG": JobState.COMPLETING,
    "COMPLETED": JobState.COMPLETED, "CD": JobState.COMPLETED,
    "FAILED": JobState.FAILED, "F": JobState.FAILED,
    "BOOT_FAIL": JobState.FAILED, "BF": JobState.FAILED,
    "DEADLINE": JobState.TIMEOUT, "DL": JobState.TIMEOUT,
    "CANCELLED": JobState.CANCELLED, "CA": JobState.CANCELLED,
    "REVOKED": JobState.CANCELLED, "RV": JobState.CANCELLED,  # federation sibling revoked
    "TIMEOUT": JobState.TIMEOUT, "TO": JobState.TIMEOUT,
    "OUT_OF_MEMORY": JobState.OUT_OF_MEMORY, "OOM": JobState.OUT_OF_MEMORY,
    "NODE_FAIL": JobState.NODE_FAIL, "NF": JobState.NODE_FAIL,
    "PREEMPTED": JobState.PREEMPTED, "PR": JobState.PREEMPTED,
    "REQUEUED": JobState.REQUEUED, "RQ": JobState.REQUEUED,
    "REQUEUE_HOLD": JobState.REQUEUED, "RH": JobState.REQUEUED,
    "REQUEUE_FED": JobState.REQUEUED, "RF": JobState.REQUEUED,
    "SPECIAL_EXIT": JobState.FAILED, "SE": JobState.FAILED,
    "RESV_DEL_HOLD": JobState.PENDING, "RD": JobState.PENDING,
}

# When squeue --json lists several flags, the first of these that is present wins
# (COMPLETING is a flag on top of the base state in Slurm's job_state bits).
_PRECEDENCE = ("COMPLETING", "CONFIGURING", "REQUEUED", "RESIZING", "SIGNALING", "STAGE_OUT")


def to_job_state(slurm_state: str | list[str] | None) -> JobState:
    """Map one Slurm state (long, short, ``CANCELLED by 123`` or a flag list)."""
    if slurm_state is None:
        return JobState.UNKNOWN
    if isinstance(slurm_state, list):
        if not slurm_state:
            return JobState.UNKNOWN
        for flag in _PRECEDENCE:
            if flag in slurm_state:
                return to_job_state(flag)
        return to_job_state(slurm_state[0])
    word = slurm_state.strip().split(" ", 1)[0].rstrip("+").upper()
    state = SLURM_STATES.get(word)
    if state is None:
        log.warning("unknown Slurm job state %r, treated as UNKNOWN", slurm_state)
        return JobState.UNKNOWN
    return state
