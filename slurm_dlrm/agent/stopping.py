"""How members are stopped: a signal to a member's process group (or to its srun), the
agent's own SIGTERM/SIGINT/SIGUSR1 caught and forwarded to every member, cancels asked
through `<pack_dir>/cancel/`, time limits, a budget stop, and the SIGKILL after
`term_grace_s`.

Apart from the agent loop (loop.py), which calls these each turn; every way a member is
told to stop, and the `stop_reason` each leaves for reaping.py to classify, is here
(docs/agent.md "Enforcement and end states").
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slurm_dlrm.agent.launch import resolve_pid
from slurm_dlrm.agent.member import Member
from slurm_dlrm.agent.reaping import signal_name

log = logging.getLogger(__name__)

# A signal to the allocation reaches members directly too (same step, or their own step);
# forwarding it at once doubles it, and a duplicate that lands while a member's
# interpreter shuts down (handlers reset) kills it. So the agent forwards a little later,
# to members still running: it still matters when only the agent was signalled.
FORWARD_DELAY_S = 1.0  # a step that has not started its member by then is stopped


def install_signal_handlers(wsock: socket.socket, on_term: Callable[[int, Any], None]) -> dict[int, Any]:
    """`on_term` for SIGTERM, SIGINT and SIGUSR1; SIGCHLD and every signal write to
    `wsock`, so the loop's `select` wakes at once. The old handlers, for
    `restore_signal_handlers`."""
    old: dict[int, Any] = {}
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        old[sig] = signal.signal(sig, on_term)
    old[signal.SIGCHLD] = signal.signal(signal.SIGCHLD, lambda s, f: None)  # wakes select
    old[-1] = signal.set_wakeup_fd(wsock.fileno(), warn_on_full_buffer=False)
    return old


def restore_signal_handlers(old: dict[int, Any]) -> None:
    signal.set_wakeup_fd(old.pop(-1))
    for sig, handler in old.items():
        signal.signal(sig, handler)


def signal_member(m: Member, sig: int) -> None:
    resolve_pid(m)
    if m.pid is not None:
        try:
            os.killpg(m.pid, sig)
            return
        except ProcessLookupError:
            pass
        except PermissionError as exc:
            log.warning("cannot signal %s: %s", m.placement.name, exc)
    if m.popen is not None and m.popen.poll() is None:
        with contextlib.suppress(OSError):
            m.popen.send_signal(sig)  # srun forwards it to the step


def stop_member(m: Member, reason: str, detail: str) -> None:
    """Stop one member for exceeding a budget; its neighbours are not touched."""
    if m.done or m.stop_reason in ("OOM_HOST", "OOM_GPU"):
        return
    m.stop_reason, m.stop_detail = reason, detail
    log.warning("stopping %s (job %d): %s", m.placement.name, m.placement.job_id, detail)
    signal_member(m, signal.SIGKILL)


def begin_termination(members: list[Member], term_signal: int, term_grace_s: float) -> None:
    """The agent was signalled: every running member is to stop (forwarded after
    FORWARD_DELAY_S, killed after `term_grace_s`)."""
    log.warning("%s received: forwarding to %d members in %.1fs, grace %.0fs", signal_name(term_signal),
                sum(not m.done for m in members), FORWARD_DELAY_S, term_grace_s)
    for m in members:
        if not m.done:
            m.stop_reason = m.stop_reason or "TERM"


def forward(members: list[Member], term_signal: int) -> None:
    for m in members:
        if not m.done:
            signal_member(m, term_signal)


def check_time_limits(members: list[Member]) -> None:
    """A member at its time limit minus its lead is told to stop (SIGTERM: it
    checkpoints and exits 5) and ends TIMEOUT; one still there just before the limit
    itself is killed (issue 42)."""
    now = time.monotonic()
    for m in members:
        if m.done or m.deadline is None:
            continue
        if m.timeout_kill_at is None and now >= m.deadline and m.stop_reason is None:
            lead = m.placement.stop_lead_s
            m.stop_reason = "TIMEOUT"
            m.timeout_kill_at = now + max(1.0, lead - max(2.0, 0.2 * lead))
            log.warning("%s (job %d): time limit %.0fs reached less its %.0fs lead; stopping it", m.placement.name,
                        m.placement.job_id, m.placement.time_limit_s or 0, lead)
            signal_member(m, signal.SIGTERM)
        elif m.timeout_kill_at is not None and now >= m.timeout_kill_at and not m.cancel_killed:
            m.cancel_killed = True
            signal_member(m, signal.SIGKILL)


def cancel_requested(cancel_dir: Path) -> set[int]:
    """Job ids named in <pack_dir>/cancel/ (docs/interfaces.md section 3a)."""
    try:
        names = os.listdir(cancel_dir)
    except OSError:
        return set()
    return {int(n) for n in names if n.isdigit()}


def cancel_members(members: list[Member], wanted: set[int]) -> None:
    """SIGTERM to the running members whose job is in `wanted` (once each)."""
    if not wanted:
        return
    for m in members:
        if m.placement.job_id in wanted and not m.done and m.cancel_since is None:
            log.warning("cancel requested for %s (job %d)", m.placement.name, m.placement.job_id)
            m.stop_reason, m.cancel_since = "CANCEL", time.monotonic()
            signal_member(m, signal.SIGTERM)


def kill_after_grace(members: list[Member], term_grace_s: float, terminating_since: float | None) -> None:
    """SIGKILL to a member `term_grace_s` after its cancel's SIGTERM, and to every member
    still running `term_grace_s` after the agent was signalled."""
    now = time.monotonic()
    for m in members:
        if (not m.done and m.cancel_since is not None and not m.cancel_killed
                and now - m.cancel_since >= term_grace_s):
            m.cancel_killed = True
            signal_member(m, signal.SIGKILL)
    if terminating_since is None:
        return
    if time.monotonic() - terminating_since < term_grace_s:
        return
    for m in members:
        if not m.done and m.stop_reason != "KILLED":
            m.stop_reason = "KILLED" if m.stop_reason in ("TERM", None) else m.stop_reason
            signal_member(m, signal.SIGKILL)
