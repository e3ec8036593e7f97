"""The service's main loop: rounds on a timer, on a wake-up signal, until SIGTERM.

The round itself (observe, then act) lives in `slurm_dlrm.service.core`; this module
only decides *when* to run one, so it is tested with a fake clock and no Slurm.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType

log = logging.getLogger(__name__)


@dataclass
class LoopControl:
    """Flags set by signal handlers (or tests) and read by the loop."""

    stop: bool = False
    wake: bool = False

    def install_signal_handlers(self) -> None:
        def on_term(signum: int, frame: FrameType | None) -> None:
            self.stop = True

        def on_usr1(signum: int, frame: FrameType | None) -> None:
            self.wake = True

        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_term)
        signal.signal(signal.SIGUSR1, on_usr1)


def run_loop(
    round_fn: Callable[[], float | None],
    control: LoopControl,
    round_seconds: float,
    *,
    min_gap_s: float = 0.5,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    tick_s: float = 0.1,
    max_rounds: int | None = None,
) -> int:
    """Run rounds until `control.stop`; returns how many ran.

    A round runs when `round_seconds` passed since the last one, or on a wake-up (but
    not sooner than `min_gap_s` after the last, so a burst of submits makes one
    round). `round_fn` may return a delay to the next round (a Slurm back-off).
    An exception in a round is logged and the loop goes on: the next round starts
    from what the store says, so a failed round loses nothing.
    """
    rounds = 0
    last_start = -float("inf")
    next_due = clock()
    while not control.stop:
        now = clock()
        if now >= next_due or (control.wake and now - last_start >= min_gap_s):
            control.wake = False
            last_start = now
            delay: float | None = None
            try:
                delay = round_fn()
            except Exception:
                log.exception("round failed; retrying after %.1f s", round_seconds)
            rounds += 1
            next_due = last_start + (round_seconds if delay is None else min(delay, round_seconds))
            if max_rounds is not None and rounds >= max_rounds:
                break
            continue
        sleep(min(tick_s, max(next_due - now, 0.0)))
    return rounds
