"""torchrun-style local launch: `world_size` copies of the runner on this node.

Used when a spec asks for world_size > 1 and the process was not started by torchrun
(no RANK/WORLD_SIZE in the environment). Each child gets RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE and a file:// rendezvous in a private temp folder (no TCP port to
collide with another job on the node). The parent forwards SIGTERM/SIGUSR1/SIGINT to
every child, and when one child fails it stops the others (they would wait forever in
a collective) and returns that child's exit code.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

from slurm_dlrm.errors import TRAIN_EXIT_FAILED, TRAIN_EXIT_OK, TRAIN_EXIT_PREEMPTED

log = logging.getLogger(__name__)

# A file:// rendezvous for the ranks, so two jobs on one node never race for a TCP port.
ENV_RDZV_FILE = "SLURM_DLRM_RDZV_FILE"
_FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# Ranks left blocked in a collective by a dead peer never reach a step boundary.
_KILL_GRACE_S = 5.0


def launch_local(world_size: int, child_args: list[str], poll_s: float = 0.2) -> int:
    """Run `python -m slurm_dlrm.train <child_args>` as `world_size` ranks; return the
    job's exit code (0 if all succeed, the first failure's code otherwise)."""
    rdzv_dir = Path(tempfile.mkdtemp(prefix="slurm-dlrm-rdzv-"))
    children: list[subprocess.Popen[bytes]] = []
    received: list[int] = []

    def forward(signum: int, _frame: FrameType | None) -> None:
        received.append(signum)
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in _FORWARDED}
    try:
        for rank in range(world_size):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                       LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                       **{ENV_RDZV_FILE: str(rdzv_dir / "store")})
            argv = [sys.executable, "-m", "slurm_dlrm.train", *child_args]
            children.append(subprocess.Popen(argv, env=env))  # noqa: S603 - argv list, our own module
        log.info("launched %d ranks: pids %s", world_size, [c.pid for c in children])
        first_failure: int | None = None
        while True:
            codes = [c.poll() for c in children]
            if all(code is not None for code in codes):
                break
            failed = [code for code in codes if code not in (None, TRAIN_EXIT_OK, TRAIN_EXIT_PREEMPTED)]
            if failed and first_failure is None:
                first_failure = failed[0]
                log.error("a rank exited with %s; stopping the others", first_failure)
                _stop_all(children)
                break
            time.sleep(poll_s)
        final = [child.wait() for child in children]
        if first_failure is None:
            if all(code == TRAIN_EXIT_OK for code in final):
                return TRAIN_EXIT_OK
            if all(code in (TRAIN_EXIT_OK, TRAIN_EXIT_PREEMPTED) for code in final):
                return TRAIN_EXIT_PREEMPTED
            first_failure = next(c for c in final if c not in (TRAIN_EXIT_OK, TRAIN_EXIT_PREEMPTED))
        # A rank killed by a signal (negative code) is a plain failure to the agent.
        return first_failure if first_failure > 0 else TRAIN_EXIT_FAILED
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
        shutil.rmtree(rdzv_dir, ignore_errors=True)


def _stop_all(children: list[subprocess.Popen[bytes]]) -> None:
    for child in children:
        if child.poll() is None:
            child.terminate()
    deadline = time.monotonic() + _KILL_GRACE_S
    for child in children:
        try:
            child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
