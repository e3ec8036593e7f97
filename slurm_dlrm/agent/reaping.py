"""How a member's end is told: its exit classified (COMPLETED, OOM_GPU, OOM_HOST,
PREEMPTED, TIMEOUT, CANCELLED, FAILED; a SIGKILL from the kernel OOM killer told apart
from others by the job cgroup's oom_kill counter), explained in the runner's own words
where it left some, and the one end of a multi-rank job chosen from its ranks' ends.

Apart from the agent loop (loop.py) because this is where "why did my job end as it
did" is answered (docs/agent.md "Enforcement and end states"); `classify_exit` and
`job_outcome` are pure, `explain` and `reap_ended` read the member's log, its
checkpoints and the cgroup counter.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from pathlib import Path

from slurm_dlrm.agent import fences
from slurm_dlrm.agent.launch import resolve_pid
from slurm_dlrm.agent.member import Member
from slurm_dlrm.agent.outlog import (
    REASON_MAX_CHARS,
    error_line,
    newest_checkpoint_step,
    short_reason,
    tail_lines,
)
from slurm_dlrm.errors import (
    TRAIN_EXIT_BAD_SPEC,
    TRAIN_EXIT_OK,
    TRAIN_EXIT_OOM_GPU,
    TRAIN_EXIT_OOM_HOST,
    TRAIN_EXIT_PREEMPTED,
)

log = logging.getLogger(__name__)

# The order in which a multi-rank job's end state is chosen from its ranks' (the worst wins).
GANG_STATE_ORDER = ("FAILED", "OOM_GPU", "OOM_HOST", "CANCELLED", "TIMEOUT", "PREEMPTED", "COMPLETED")


def classify_exit(returncode: int, stop_reason: str | None, via_srun: bool,
                  oom_kills: int | None = None) -> tuple[str, int, str]:
    """(state, exit code in shell convention, reason) for a member that ended.

    `oom_kills`: how much the job cgroup's memory.events oom_kill rose while it ran
    (None: unknown). Every kill the agent sends has a `stop_reason`, so a SIGKILL
    without one came from outside: the counter tells the OOM killer from the rest."""
    signum = -returncode if returncode < 0 else None
    if via_srun and returncode > 128:
        signum = returncode - 128
    code = 128 + signum if signum else returncode
    sig_name = signal_name(signum) if signum else ""
    if stop_reason in ("OOM_HOST", "OOM_GPU"):
        return stop_reason, code, ""
    if stop_reason == "CANCEL":
        return "CANCELLED", code, "cancelled by the service"
    if returncode == TRAIN_EXIT_OK:
        return "COMPLETED", code, ""
    if stop_reason == "TIMEOUT":
        if returncode == TRAIN_EXIT_PREEMPTED:
            return "TIMEOUT", code, "reached its time limit; stopped with a checkpoint (exit 5)"
        return "TIMEOUT", code, (f"reached its time limit; ended by {sig_name or f'exit code {returncode}'} "
                                 "without a checkpoint exit")
    if stop_reason == "GANG":
        return "CANCELLED", code, "stopped because another rank of its job ended"
    if returncode == TRAIN_EXIT_OOM_GPU:
        return "OOM_GPU", code, "CUDA out of memory (runner exit code 3)"
    if returncode == TRAIN_EXIT_OOM_HOST:
        return "OOM_HOST", code, "host MemoryError (runner exit code 4)"
    if returncode == TRAIN_EXIT_PREEMPTED:
        return "PREEMPTED", code, "checkpointed and stopped after a signal"
    if stop_reason == "KILLED":
        return "CANCELLED", code, "did not exit within term_grace_s after SIGTERM; killed"
    if stop_reason == "TERM":
        return "CANCELLED", code, f"stopped by {sig_name or f'exit code {returncode}'} without a checkpoint exit"
    if signum == signal.SIGKILL:
        if oom_kills:
            # host memory ran out under the job's cgroup limit (Slurm's --mem): retried
            # with more host memory like the agent's own budget stop (issue 43)
            return "OOM_HOST", code, f"killed by SIGKILL: the kernel OOM killer (cgroup oom_kill +{oom_kills} while it ran)"
        if oom_kills == 0:
            return "FAILED", code, "killed by SIGKILL from outside the agent, not the OOM killer (Slurm, scancel, a user)"
        return "FAILED", code, "killed by SIGKILL from outside the agent (OOM killer, Slurm or a user: no cgroup to tell)"
    if signum:
        return "FAILED", code, f"killed by {sig_name}"
    if returncode == TRAIN_EXIT_BAD_SPEC:
        return "FAILED", code, "the spec did not validate (runner exit code 2)"
    return "FAILED", code, f"exit code {returncode}"


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def explain(m: Member, state: str, code: int, reason: str) -> str:
    """The runner's own words where ours are generic: its one-line error for a
    failure, the step it checkpointed at for a cancel (docs/agent.md)."""
    # Not for a death by signal (code 128 + signum): the process wrote no cause, and
    # the log a job's ranks share may end with a sibling's error (gloo's lost peer).
    if state == "FAILED" and m.output_path is not None and code <= 128:
        cause = error_line(tail_lines(m.output_path, 40))
        if cause:
            return f"{short_reason(cause, REASON_MAX_CHARS - 20)} (exit code {code})"
    if state in ("CANCELLED", "TIMEOUT") and code == TRAIN_EXIT_PREEMPTED:
        # the checkpoint it stopped with (a metrics line may be a few steps older)
        step = newest_checkpoint_step(Path(m.placement.checkpoint_dir))
        if step is None and m.metrics is not None:
            m.metrics.poll()
            step = m.metrics.last.get("step") if m.metrics.last else None
        at = f" at step {step}" if isinstance(step, int) else ""
        why = "reached its time limit" if state == "TIMEOUT" else "cancelled"
        return f"{why}; stopped{at} with a checkpoint (exit 5); `slurm-dlrm requeue {m.placement.job_id}` resumes it"
    return reason


def reap_ended(members: list[Member], launch: str, oom_cgroup: Path | None) -> list[Member]:
    """The running members whose process has exited, each given its state, exit code and
    reason, in the order they are to be reported (`launch`: the agent's launch mode;
    `oom_cgroup`: the job cgroup whose oom_kill counter tells the OOM killer apart)."""
    ended: list[Member] = []
    for m in members:
        if m.done or m.popen is None:
            continue
        resolve_pid(m)
        rc = m.popen.poll()
        if rc is None:
            continue
        if m.pid is not None and launch == "process":
            # The leader is gone; leftovers of its group (loader workers) go with it.
            with contextlib.suppress(OSError):
                os.killpg(m.pid, signal.SIGKILL)
        now_kills = fences.oom_kill_count(oom_cgroup)
        rose = None if now_kills is None or m.oom_kills_at_launch is None else now_kills - m.oom_kills_at_launch
        state, code, reason = classify_exit(rc, m.stop_reason, via_srun=launch == "step",
                                            oom_kills=rose)
        if state == m.stop_reason and m.stop_detail:
            reason = m.stop_detail
        reason = explain(m, state, code, reason)
        m.state, m.exit_code, m.reason = state, code, reason
        log.info("%s (job %d) ended: %s %s", m.placement.name, m.placement.job_id, state, reason)
        ended.append(m)
    # A rank killed outright is the cause, not the sibling that then lost its peer in
    # the same turn (gloo fails it with exit 1): report signal deaths first.
    ended.sort(key=lambda m: (m.stop_reason not in ("OOM_HOST", "OOM_GPU"), not (m.exit_code or 0) > 128))
    return ended


def killed_from_outside(m: Member) -> bool:
    """A one-rank member SIGKILLed by no one the agent knows of (not its own stop; not the
    OOM killer as far as the job cgroup tells, which OOM_HOST covers): it did not fail on
    its own, so its job goes back to the queue and resumes from its checkpoint, as a
    multi-rank job's killed rank does (issue 49: chaos_live's killed member ended FAILED)."""
    return m.state == "FAILED" and m.stop_reason is None and m.exit_code == 128 + signal.SIGKILL


def job_outcome(ranks: list[Member], cause: Member | None) -> tuple[Member, str, bool]:
    """The one end of a multi-rank job (docs/agent.md "Multi-rank jobs"): the rank whose
    record it is, the reason, and whether the job goes back to the queue as a whole.
    `cause`: the first rank that ended badly and stopped its siblings, if any."""
    world = ranks[0].placement.world_size
    if cause is not None:
        rep = cause
        others = world - 1
        reason = f"rank {cause.placement.rank}: {cause.reason or cause.state.lower()}; " \
                 f"its {others} other rank{'s' if others != 1 else ''} stopped"
    else:
        states = {r.state for r in ranks}
        state = next(s for s in GANG_STATE_ORDER if s in states)
        rep = min((r for r in ranks if r.state == state), key=lambda r: r.placement.rank)
        reason = rep.reason
    # A rank that crashed or was killed is requeued with its job as a whole (all ranks
    # resume from the shared checkpoint); a bad spec or a rank that never started is not.
    requeue = (rep.state == "FAILED" and cause is not None and rep.exit_code is not None
               and rep.exit_code != TRAIN_EXIT_BAD_SPEC)
    return rep, reason, requeue
