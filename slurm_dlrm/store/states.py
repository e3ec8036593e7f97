"""The job and pack lifecycles: states and the legal transitions between them.

Pure (no I/O): the store checks every move against these tables inside the
transaction that makes it, and writes an event row with the reason. Each edge has a
comment saying who takes it and why, so the service and the fault handling can be
written against this file alone.
"""

from __future__ import annotations

from enum import StrEnum


class JobState(StrEnum):
    PENDING = "PENDING"  # waiting for a dispatch round
    PLANNED = "PLANNED"  # member of a pack that is being submitted / queued in Slurm
    RUNNING = "RUNNING"  # the agent started the member
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    OOM = "OOM"  # ran out of GPU or host memory; the service may requeue it once more
    CANCELLED = "CANCELLED"
    # reached its own time limit (sbatch -t); stopped with a checkpoint where it could
    # write one in the lead the limit affords (issue 42); `requeue` resumes it
    TIMEOUT = "TIMEOUT"


class PackState(StrEnum):
    SUBMITTING = "SUBMITTING"  # row written, sbatch not yet answered (crash window)
    QUEUED = "QUEUED"  # sbatch gave a Slurm job id; Slurm has it pending
    RUNNING = "RUNNING"  # Slurm started the allocation (or an agent reported)
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    LOST = "LOST"  # neither Slurm nor the agents know the pack any more


J = JobState
P = PackState

# (from, to) -> why this edge exists. Anything not listed is refused.
JOB_TRANSITIONS: dict[tuple[JobState, JobState], str] = {
    # dispatch: a round put the job into a pack that is about to be sbatch'ed, or
    # into a GPU of a RUNNING pack whose members ended (a join, docs/interfaces.md 3b)
    (J.PENDING, J.PLANNED): "planned into a pack",
    # the user cancelled before any round picked the job
    (J.PENDING, J.CANCELLED): "cancelled while pending",
    # the job can never run here (e.g. its estimate exceeds every GPU of the site)
    (J.PENDING, J.FAILED): "rejected as infeasible",
    # the agent launched the member
    (J.PLANNED, J.RUNNING): "member started",
    # sbatch refused the pack, or the pack was lost/cancelled before the member started,
    # or a joiner's pack (or its node's agent) closed before the joiner started;
    # the job never ran, so its attempt counter does not move
    (J.PLANNED, J.PENDING): "pack did not start; back to the queue",
    (J.PLANNED, J.CANCELLED): "cancelled while its pack was queued",
    # the member died at launch (bad command, CUDA init failure) or hit OOM at once
    (J.PLANNED, J.FAILED): "failed at launch",
    (J.PLANNED, J.OOM): "out of memory at launch",
    (J.RUNNING, J.COMPLETED): "member exited 0",
    (J.RUNNING, J.FAILED): "member failed",
    # the agent saw TRAIN_EXIT_OOM_GPU / TRAIN_EXIT_OOM_HOST or stopped it over budget
    (J.RUNNING, J.OOM): "member ran out of memory",
    (J.RUNNING, J.CANCELLED): "cancelled while running",
    # the agent stopped it at its time limit minus the signal lead (issue 42)
    (J.RUNNING, J.TIMEOUT): "reached its time limit",
    # requeue without a failure of the job itself: preempted, node failure, pack lost,
    # or a straggler moved to another pack; attempt += 1, resumes from its checkpoint
    (J.RUNNING, J.PENDING): "requeued",
    # the service retries an OOM with a larger memory request; attempt += 1.
    # An OOM job that is not requeued stays OOM (terminal).
    (J.OOM, J.PENDING): "requeued after OOM",
    # the user asked for another run (`slurm-dlrm requeue`, like `scontrol requeue`):
    # it resumes from the checkpoint its last run left; attempt += 1
    (J.CANCELLED, J.PENDING): "requeued by the user",
    (J.FAILED, J.PENDING): "requeued by the user",
    (J.TIMEOUT, J.PENDING): "requeued by the user",
}

JOB_TERMINAL = frozenset({J.COMPLETED, J.FAILED, J.OOM, J.CANCELLED, J.TIMEOUT})
# What `slurm-dlrm requeue` takes (scontrol requeue takes any ended job but a completed one).
JOB_REQUEUABLE = frozenset({J.CANCELLED, J.FAILED, J.TIMEOUT})
# Leaving these states for PENDING counts as a new attempt (the job had run).
JOB_ATTEMPT_FROM = frozenset({J.RUNNING, J.OOM, J.CANCELLED, J.FAILED, J.TIMEOUT})

PACK_TRANSITIONS: dict[tuple[PackState, PackState], str] = {
    # sbatch answered with a Slurm job id (or reconciliation found it by name)
    (P.SUBMITTING, P.QUEUED): "submitted",
    # reconciliation after a crash found the pack already running
    (P.SUBMITTING, P.RUNNING): "found running during reconciliation",
    # sbatch refused the script (bad request, QOS limit, ...)
    (P.SUBMITTING, P.FAILED): "sbatch refused",
    # reconciliation after a crash found no Slurm job with the pack's name
    (P.SUBMITTING, P.LOST): "not found in Slurm after a crash",
    (P.SUBMITTING, P.CANCELLED): "cancelled before sbatch answered",
    (P.QUEUED, P.RUNNING): "allocation started",
    (P.QUEUED, P.CANCELLED): "cancelled while queued",
    # Slurm failed it before start (e.g. NODE_FAIL at launch, time limit 0)
    (P.QUEUED, P.FAILED): "failed before start",
    # the whole pack ran between two polls; start time comes from sacct
    (P.QUEUED, P.COMPLETED): "ran to completion between polls",
    (P.QUEUED, P.LOST): "Slurm no longer knows the job",
    (P.RUNNING, P.COMPLETED): "allocation ended normally",
    (P.RUNNING, P.FAILED): "allocation failed (NODE_FAIL, TIMEOUT, agent error)",
    (P.RUNNING, P.CANCELLED): "cancelled while running",
    # heartbeats stopped and Slurm does not know the job any more
    (P.RUNNING, P.LOST): "heartbeats stopped",
}

PACK_TERMINAL = frozenset({P.COMPLETED, P.FAILED, P.CANCELLED, P.LOST})
# Packs that hold (or may hold) a Slurm allocation: what the service polls.
PACK_ACTIVE = frozenset({P.SUBMITTING, P.QUEUED, P.RUNNING})


def job_transition_allowed(src: JobState, dst: JobState) -> bool:
    return (src, dst) in JOB_TRANSITIONS


def pack_transition_allowed(src: PackState, dst: PackState) -> bool:
    return (src, dst) in PACK_TRANSITIONS


def parse_job_state(name: str) -> JobState:
    """`JobState` from a user-typed name (case-insensitive); ValueError if unknown."""
    try:
        return JobState(name.strip().upper())
    except ValueError:
        raise ValueError(f"unknown job state {name!r} (one of {', '.join(JobState)})") from None
