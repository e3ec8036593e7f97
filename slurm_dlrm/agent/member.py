"""What the agent keeps of one member (or one rank of a multi-rank job) while it runs:
its placement, process, pid, state, why the agent stopped it, its samplers and fence.

Apart from the loop (loop.py) so that the modules that launch, stop, sample and reap
members (launch.py, stopping.py, sampling.py, reaping.py) share this one type without
importing the loop that drives them.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_dlrm.agent.placement import MemberPlacement
from slurm_dlrm.agent.procstat import MetricsTail, TreeSample, TreeSampler


@dataclass
class Member:
    placement: MemberPlacement
    env: dict[str, str] = field(default_factory=dict)
    popen: subprocess.Popen[bytes] | None = None
    pid: int | None = None  # the member's own pid, leader of its process group
    pid_file: Path | None = None
    launched_at: float = 0.0
    state: str = "PENDING"
    exit_code: int | None = None
    reason: str = ""
    stop_reason: str | None = None  # why we stopped it: OOM_HOST | OOM_GPU | CANCEL | TERM | KILLED | TIMEOUT
    stop_detail: str = ""
    cancel_since: float | None = None  # monotonic time of the SIGTERM for a cancel request
    cancel_killed: bool = False
    tree: TreeSampler = field(default_factory=TreeSampler)
    metrics: MetricsTail | None = None
    last_tree: TreeSample | None = None
    output_path: Path | None = None  # the runner's stdout+stderr on this node
    fence: dict[str, Any] = field(default_factory=dict)  # what holds it to its memory limit
    cgroup: Path | None = None  # its dmem cgroup, joined before exec
    master_port: int | None = None  # a rank of a multi-rank job: its job's MASTER_PORT
    rdzv_file: str | None = None  # and its job's private FileStore
    oom_kills_at_launch: int | None = None  # the job cgroup's oom_kill count when it started
    deadline: float | None = None  # monotonic time it is told to stop: its time limit minus the lead
    timeout_kill_at: float | None = None  # and SIGKILL'ed if it has not stopped by then

    @property
    def done(self) -> bool:
        return self.state not in ("PENDING", "RUNNING")

