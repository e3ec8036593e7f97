"""What every Slurm backend returns and raises, and the interface they share.

`SlurmClient` (the commands) and `FakeSlurm` (unit tests) implement `SlurmBackend`;
a pyslurm backend can implement it later without touching callers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from slurm_dlrm.errors import DlrmError
from slurm_dlrm.slurm.states import JobState


class SlurmError(DlrmError):
    """A Slurm command failed. Carries the argv, its exit code and its stderr."""

    def __init__(self, command: Sequence[str], returncode: int | None, stderr: str,
                 message: str | None = None) -> None:
        self.command = list(command)
        self.returncode = returncode
        self.stderr = stderr
        # The last few stderr lines: sbatch prints a job_submit plugin's reason
        # (slurm.log_user) on a line before the generic "Batch job submission failed".
        lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
        detail = message or (" | ".join(lines[-3:]) if lines else "no message")
        super().__init__(f"{self.command[0] if self.command else 'slurm'} failed "
                         f"(exit {returncode}): {detail}")


class SlurmNotFound(SlurmError):
    """A Slurm binary is not installed or not on PATH."""

    def __init__(self, command: Sequence[str]) -> None:
        super().__init__(command, None, "")
        name = command[0] if command else "?"
        # Replace SlurmError's "X failed (exit None)": nothing ran.
        self.args = (f"{name} not found: install Slurm (apt-get install slurm-wlm, or run "
                     "scripts/setup.sh) or put its bin folder on PATH",)


class SlurmTimeout(SlurmError):
    """A Slurm command did not answer in time (slurmctld down or overloaded)."""

    def __init__(self, command: Sequence[str], timeout_s: float, stderr: str = "") -> None:
        super().__init__(command, None, stderr, f"no answer after {timeout_s:g} s "
                         "(is slurmctld running? see `slurm-dlrm cluster status`)")
        self.timeout_s = timeout_s


class AccountingDisabled(SlurmError):
    """sacct asked on a cluster without slurmdbd."""


@dataclass(frozen=True)
class JobInfo:
    """One Slurm job as squeue / scontrol show job report it."""

    job_id: int
    name: str
    state: JobState
    slurm_state: str  # as Slurm printed it, e.g. "RUNNING" or "CANCELLED"
    user: str = ""
    partition: str = ""
    nodes: str = ""  # hostlist, e.g. "node[1-2]"; empty while pending
    num_nodes: int = 0
    reason: str = ""  # pending/failure reason; "None" becomes ""
    exit_code: int | None = None  # of the batch script, when known
    signal: int | None = None  # that killed the batch script, when known
    tres: str = ""  # allocated TRES if running, else requested, e.g. "cpu=1,mem=2000M,node=1,gres/gpu=1"
    restart_count: int = 0
    submit_time: int | None = None  # unix seconds
    start_time: int | None = None
    end_time: int | None = None
    work_dir: str = ""
    std_out: str = ""
    comment: str = ""
    array_job_id: int | None = None
    array_task_id: int | None = None
    # while running: its GRES as the nodes number them, e.g. "gpu:h100:2(IDX:0-1)" or
    # "mps:40(IDX:0)", one per node, comma-joined (squeue --json gres_detail)
    gres_detail: str = ""

    @property
    def gpu_idx(self) -> str:
        """The GPU indexes of its first node as the node numbers them: "1", "0-1", "0,2";
        "" if unknown. Slurm prints `gpu:h100:2(IDX:0-1)` and, for shared GRES on 22.05,
        `mps:50(IDX:0)`; 24.11+ prints shared GRES per GPU, `mps:50(0/100,50/100)`."""
        import re

        first = re.split(r",(?=[a-z])", self.gres_detail, maxsplit=1)[0]
        m = re.search(r"\(IDX:([^)]*)\)", first)
        if m:
            return m.group(1)
        m = re.search(r"\(((?:\d+/\d+,?)+)\)", first)
        if m:
            return ",".join(str(i) for i, c in enumerate(m.group(1).split(",")) if int(c.split("/")[0]) > 0)
        return ""


@dataclass(frozen=True)
class NodeInfo:
    """One node as `scontrol show nodes` reports it."""

    name: str
    state: str  # base state lower-case: idle, mixed, allocated, down, ...
    flags: tuple[str, ...] = ()  # DRAIN, NOT_RESPONDING, ...
    cpus: int = 0
    cpus_alloc: int = 0
    real_memory_mib: int = 0
    alloc_memory_mib: int = 0
    gres: str = ""  # configured, e.g. "gpu:h100:4,mps:400,shard:32"
    gres_used: str = ""
    partitions: tuple[str, ...] = ()
    address: str = ""
    port: int | None = None
    reason: str = ""

    @property
    def usable(self) -> bool:
        return self.state in ("idle", "mixed", "allocated") and not (
            {"DRAIN", "NOT_RESPONDING", "DOWN", "FAIL", "POWERED_DOWN"} & set(self.flags))


@dataclass(frozen=True)
class PartitionRow:
    """One line of `sinfo`: a partition's nodes in one state."""

    partition: str
    available: str  # up / down
    state: str  # idle, mix, alloc, down*, drain, ...
    nodes: str  # hostlist
    num_nodes: int
    cpus: int
    memory_mib: int
    gres: str
    time_limit: str
    default: bool = False


@dataclass(frozen=True)
class AcctRow:
    """One sacct line: a job (`123`), its batch step (`123.batch`) or a step (`123.0`)."""

    job_id: str  # as sacct prints it: "123", "123.batch", "123.0"
    fields: dict[str, str] = field(default_factory=dict)

    @property
    def base_job_id(self) -> int:
        return int(self.job_id.split(".", 1)[0].split("_", 1)[0].split("+", 1)[0])

    @property
    def step(self) -> str | None:
        """None for the job line, else the step name after the dot."""
        return self.job_id.split(".", 1)[1] if "." in self.job_id else None

    @property
    def state(self) -> JobState:
        from slurm_dlrm.slurm.states import to_job_state
        return to_job_state(self.fields.get("State"))

    def __getitem__(self, key: str) -> str:
        return self.fields[key]

    def get(self, key: str, default: str = "") -> str:
        return self.fields.get(key, default)


@runtime_checkable
class SlurmBackend(Protocol):
    """The calls the rest of slurm-dlrm makes to Slurm."""

    def sbatch(self, script_text: str, args: Sequence[str] = ()) -> int: ...

    def squeue(self, user: str | None = None, job_ids: Sequence[int] | None = None,
               name: str | None = None) -> list[JobInfo]: ...

    def show_job(self, job_id: int) -> JobInfo | None: ...

    def sacct(self, job_ids: Sequence[int], fields: Sequence[str] | None = None) -> list[AcctRow]: ...

    def scancel(self, job_ids: Sequence[int], signal: str | None = None, full: bool = False) -> None: ...

    def requeue(self, job_id: int) -> None: ...

    def show_nodes(self) -> list[NodeInfo]: ...

    def sinfo(self) -> list[PartitionRow]: ...

    def ping(self) -> bool: ...
