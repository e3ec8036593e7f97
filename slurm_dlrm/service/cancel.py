"""`slurm-dlrm cancel`'s service side: cancel one job without disturbing the other
members of its pack."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from slurm_dlrm.service.common import pack_member_ids, write_atomic
from slurm_dlrm.service.daemon import ensure_private_dir

log = logging.getLogger(__name__)


def cancel_job(store: Any, slurm: Any, job_id: int, *, user: str) -> str:
    """Cancel one job without disturbing the other members of its pack. Returns what was done.

    PENDING: cancelled in the store. PLANNED or RUNNING: the agent is told through
    `<pack_dir>/cancel/<job_id>` (docs/interfaces.md 3a) and reports the member
    CANCELLED; a member not yet started is cancelled in the store at once. A running
    member is left to its agent (it checkpoints and exits 5; its pack's Slurm job then
    ends when the agent does): an `scancel` would signal its srun step as well, which
    then reports 143 for a runner that exited 5. Only a pack none of whose members ever
    started is scancel'ed when its last member goes.
    """
    from slurm_dlrm.slurm import SlurmError
    from slurm_dlrm.store.errors import StaleState
    from slurm_dlrm.store.jobids import own_job
    from slurm_dlrm.store.states import JOB_TERMINAL, JobState

    job = own_job(store, job_id, user)
    if job.state in JOB_TERMINAL:
        return f"job {job_id} already ended ({job.state})"
    if job.no_pack:  # its own Slurm job: scancel it (the service records how it ended)
        from slurm_dlrm.service.native import cancel_native

        return cancel_native(store, slurm, job)
    if job.state == JobState.PENDING:
        try:
            store.transition_job(job_id, JobState.CANCELLED, "cancelled by the user", expect=JobState.PENDING)
            return f"job {job_id} cancelled (was pending)"
        except StaleState:
            job = store.get_job(job_id)  # a round just planned it: cancel it in its pack
    pack = store.get_pack(job.pack_id)
    if pack.pack_dir:
        cancel_dir = Path(pack.pack_dir) / "cancel"
        ensure_private_dir(cancel_dir)
        write_atomic(cancel_dir / str(job_id), f"{time.time()}\n")
    if job.state == JobState.PLANNED:
        store.transition_job(job_id, JobState.CANCELLED, "cancelled by the user before it started",
                             expect=JobState.PLANNED)
    else:
        store.add_event("note", "cancel requested; waiting for the agent", job_id=job_id, pack_id=pack.id)
    live = [i for i in pack_member_ids(store, pack.id, ("PLANNED", "RUNNING")) if i != job_id]
    if job.state == JobState.RUNNING:
        return (f"job {job_id} cancel sent to its pack {pack.name}; it checkpoints and stops; "
                f"{len(live)} other member(s) keep running")
    if not live and pack.slurm_job_id and str(pack.state) != "RUNNING":
        try:
            slurm.scancel([int(pack.slurm_job_id)])
        except SlurmError as exc:
            log.warning("scancel of pack %s: %s", pack.name, exc)
        return f"job {job_id} cancelled; its pack {pack.name} (Slurm job {pack.slurm_job_id}) had no other member"
    return f"job {job_id} cancel sent to its pack {pack.name}; {len(live)} other member(s) keep running"


def not_requeuable(job_id: int, state: str) -> str:
    return f"job {job_id}: is {state}; only CANCELLED, FAILED or TIMEOUT jobs can be requeued"


def cancel_in_flight(store: Any, job: Any) -> bool:
    """A cancel was sent to the job's agent and has not landed yet (the member is
    checkpointing): `requeue` waits for it (issue 42: `cancel 39 && requeue 39`)."""
    from slurm_dlrm.store.states import JobState

    if job.state not in (JobState.PLANNED, JobState.RUNNING) or job.pack_id is None or job.no_pack:
        return False
    pack = store.get_pack(job.pack_id)
    return bool(pack.pack_dir) and (Path(pack.pack_dir) / "cancel" / str(job.id)).exists()


def requeue_job(store: Any, spool_dir: Path, job_id: int, *, user: str) -> str:
    """Put an ended job (CANCELLED, FAILED or TIMEOUT) back in the queue, like `scontrol requeue`;
    a sweep variant paused at a rung is promoted by hand (it resumes from its checkpoint).

    Its next run resumes from the checkpoint its last run left in `<spool>/jobs/<id>/ckpt`
    (per job, not per pack). Returns what was done."""
    from slurm_dlrm.errors import BadInput
    from slurm_dlrm.service.joblog import last_checkpoint_step
    from slurm_dlrm.store.errors import StaleState
    from slurm_dlrm.store.jobids import own_job
    from slurm_dlrm.store.states import JOB_REQUEUABLE, JobState

    job = own_job(store, job_id, user)
    if job.state == JobState.PENDING and not job.no_pack:
        from slurm_dlrm.service.sweep_stop import promote_by_hand

        promoted = promote_by_hand(store, job)  # a sweep variant paused at a rung (issue 47)
        if promoted is not None:
            return promoted
    if job.state not in JOB_REQUEUABLE:
        raise BadInput(not_requeuable(job_id, str(job.state)))
    if job.no_pack:
        raise BadInput(f"job {job_id}: a --no-pack job (Slurm job {job.slurm_job_id or '-'}) is not requeued "
                       f"by the packing service; submit its spec again")
    step = last_checkpoint_step(spool_dir, job_id)
    how = f"resumes from its checkpoint at step {step}" if step is not None else "starts from step 0 (no checkpoint)"
    try:
        store.transition_job(job_id, JobState.PENDING, f"requeued by the user; {how}", expect=job.state)
    except StaleState:
        raise BadInput(f"job {job_id}: changed state meanwhile; try again") from None
    return f"job {job_id} requeued; it {how}"
