"""`FakeSlurm`: a stateful stand-in for `SlurmClient` in unit tests.

It follows what the real Slurm 22.05 commands do, as far as callers can see: job ids
count up, jobs start PENDING, `scancel` of an unknown or ended job is a silent no-op,
`requeue` of a pending job fails, more GPUs per node than a node has is refused, `sacct` without accounting raises `AccountingDisabled`, jobs vanish from
`squeue` once "purged" (MinJobAge) but stay in `sacct`. Tests move jobs through states
with `start`, `finish`, `set_state`, `add_step` and `purge`, and read back what was
submitted from `submitted`. `fail_next` injects an error into the next call of a method;
`controller_down = True` makes every call time out, like a dead slurmctld.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from slurm_dlrm.site import expand_hostlist
from slurm_dlrm.slurm.base import (
    AccountingDisabled,
    AcctRow,
    JobInfo,
    NodeInfo,
    PartitionRow,
    SlurmError,
    SlurmTimeout,
)
from slurm_dlrm.slurm.client import DEFAULT_SACCT_FIELDS
from slurm_dlrm.slurm.parse import compress_hostlist
from slurm_dlrm.slurm.states import JobState, to_job_state


@dataclass
class FakeStep:
    step_id: str  # "batch", "0", "1", ...
    name: str
    state: str = "COMPLETED"
    exit_code: int = 0
    signal: int = 0
    nodes: str = ""


@dataclass
class FakeJob:
    job_id: int
    name: str
    script: str
    args: list[str]
    user: str
    partition: str
    num_nodes: int = 1
    gres: str = ""  # as asked: "gpu:2"
    comment: str = ""
    work_dir: str = ""
    slurm_state: str = "PENDING"
    reason: str = "None"
    nodes: str = ""
    exit_code: int = 0
    signal: int = 0
    restart_count: int = 0
    submit_time: int = 0
    start_time: int | None = None
    end_time: int | None = None
    signals_sent: list[str] = field(default_factory=list)
    steps: list[FakeStep] = field(default_factory=list)
    purged: bool = False
    gpu_idx: str = ""  # while running: the node's GPUs it got (squeue's gres_detail IDX)
    nodelist: str = ""  # sbatch -w/--nodelist: Slurm starts it there or not at all
    # runs before a requeue (start, end, state, nodes), oldest first: sacct --duplicates
    # lists each as a row of its own before the current run's
    earlier_runs: list[tuple[int | None, int | None, str, str]] = field(default_factory=list)

    @property
    def state(self) -> JobState:
        return to_job_state(self.slurm_state)

    def alloc_tres(self) -> str:
        """Its TRES as Slurm prints them (squeue tres_alloc_str, scontrol TRES, sacct
        AllocTRES): totals over its nodes, `--gres` per node, untyped: "cpu=2,node=2,gres/gpu=4"
        (tests/data/slurm/*: gpu:h100 nodes, all three releases). --exclusive adds no GPU:
        the local cluster's Slurm gives a 2 nodes x gpu:2 --exclusive job on 4-GPU nodes
        gres/gpu=4."""
        tres = f"cpu={self.num_nodes},node={self.num_nodes}"
        kind, _, rest = self.gres.partition(":")
        count = rest.rpartition(":")[2]
        if kind and count.isdigit():
            tres += f",gres/{kind}={int(count) * max(1, self.num_nodes)}"
        return tres

    def info(self) -> JobInfo:
        st = self.state
        return JobInfo(
            job_id=self.job_id, name=self.name, state=st, slurm_state=self.slurm_state, user=self.user,
            partition=self.partition, nodes=self.nodes, num_nodes=self.num_nodes,
            reason="" if self.reason == "None" else self.reason,
            exit_code=None if self.signal else self.exit_code, signal=self.signal or None,
            tres=self.alloc_tres(),
            restart_count=self.restart_count, submit_time=self.submit_time, start_time=self.start_time,
            end_time=self.end_time if st.is_terminal else None, work_dir=self.work_dir, comment=self.comment,
            gres_detail=f"{self.gres}(IDX:{self.gpu_idx})" if self.gres and self.gpu_idx and st.is_active else "")


def _sbatch_options(script_text: str, args: Sequence[str]) -> dict[str, str]:
    """The few sbatch options the fake honours, from #SBATCH lines then args (args win)."""
    tokens: list[str] = []
    for line in script_text.splitlines():
        if line.startswith("#SBATCH"):
            tokens += shlex.split(line[len("#SBATCH"):])
        elif line.strip() and not line.startswith("#"):
            break  # sbatch stops reading #SBATCH at the first command
    tokens += list(args)
    short = {"-J": "job-name", "-N": "nodes", "-p": "partition", "-D": "chdir", "-w": "nodelist"}
    opts: dict[str, str] = {}
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok.startswith("--") and "=" in tok:
            key, _, val = tok[2:].partition("=")
            opts[key] = val
        elif tok in short and i + 1 < len(tokens):
            opts[short[tok]] = tokens[i + 1]
            i += 1
        elif tok.startswith("--") and i + 1 < len(tokens) and not tokens[i + 1].startswith("-"):
            opts[tok[2:]] = tokens[i + 1]
            i += 1
        i += 1
    return opts


class FakeSlurm:
    """In-memory Slurm with the `SlurmBackend` interface."""

    def __init__(self, nodes: Sequence[str] = ("node1", "node2"), *, gpus_per_node: int = 4,
                 gpu_type: str = "h100", partition: str = "dlrm", user: str = "root",
                 accounting: bool = True, first_job_id: int = 1000,
                 clock: Callable[[], float] = time.time) -> None:
        self.node_names = list(nodes)
        self.gpus_per_node = gpus_per_node
        self.gpu_type = gpu_type
        self.partition = partition
        self.user = user
        self.accounting = accounting
        self.clock = clock
        self.jobs: dict[int, FakeJob] = {}
        self.submitted: list[FakeJob] = []
        self.calls: list[tuple[str, tuple[object, ...]]] = []
        self.fail_next: dict[str, SlurmError] = {}
        self.controller_down = False
        self.drained: dict[str, str] = {}
        self._next_id = first_job_id

    # ------------------------------------------------------------ plumbing

    def _enter(self, method: str, *args: object) -> None:
        self.calls.append((method, args))
        if self.controller_down:
            raise SlurmTimeout([method], 30.0)
        err = self.fail_next.pop(method, None)
        if err is not None:
            raise err

    def _now(self) -> int:
        return int(self.clock())

    def job(self, job_id: int) -> FakeJob:
        try:
            return self.jobs[job_id]
        except KeyError:
            raise KeyError(f"FakeSlurm: no job {job_id}") from None

    # ------------------------------------------------------------ test controls

    def start(self, job_id: int, nodes: str | None = None, gpu_idx: str = "0") -> None:
        """The scheduler starts a pending job (on its --nodelist, else on the first nodes by
        default; a GRES job on the node's GPUs `gpu_idx`, as squeue's gres_detail shows
        them). Slurm never starts a job off its --nodelist: neither does `start`."""
        j = self.job(job_id)
        if j.state is not JobState.PENDING:
            raise ValueError(f"job {job_id} is {j.slurm_state}, not PENDING")
        if j.num_nodes > len(self.node_names):
            raise ValueError(f"job {job_id} wants {j.num_nodes} nodes; the fake has {len(self.node_names)}")
        if nodes is None and j.nodelist:
            nodes = j.nodelist
        if nodes is not None and j.nodelist and set(expand_hostlist(nodes)) != set(expand_hostlist(j.nodelist)):
            raise ValueError(f"job {job_id} asked for --nodelist={j.nodelist}; Slurm would not start it on {nodes}")
        j.slurm_state, j.reason, j.start_time, j.gpu_idx = "RUNNING", "None", self._now(), gpu_idx
        names = self.node_names[:j.num_nodes] if nodes is None else expand_hostlist(nodes)
        j.nodes = compress_hostlist(names)  # "node[1-2]", as Slurm prints it
        j.steps.append(FakeStep("batch", "batch", "RUNNING", nodes=names[0]))

    def finish(self, job_id: int, exit_code: int = 0) -> None:
        """The batch script exits: COMPLETED on 0, else FAILED."""
        self._end(job_id, "COMPLETED" if exit_code == 0 else "FAILED", exit_code=exit_code,
                  reason="None" if exit_code == 0 else "NonZeroExitCode")

    def set_state(self, job_id: int, slurm_state: str, reason: str = "None", exit_code: int = 0,
                  signal: int = 0) -> None:
        """Put a job in any Slurm state (e.g. TIMEOUT, NODE_FAIL, OUT_OF_MEMORY)."""
        if to_job_state(slurm_state).is_terminal:
            self._end(job_id, slurm_state, exit_code=exit_code, signal=signal, reason=reason)
            return
        j = self.job(job_id)
        j.slurm_state, j.reason = slurm_state, reason

    def requeue_by_slurm(self, job_id: int, slurm_state: str = "NODE_FAIL") -> None:
        """Slurm's own requeue of a --requeue job (a node lost): the run ends in
        `slurm_state` (kept for sacct), the job is PENDING again under the same id."""
        j = self.job(job_id)
        j.earlier_runs.append((j.start_time, self._now(), slurm_state, j.nodes))
        j.slurm_state, j.reason, j.nodes = "PENDING", "BeginTime", ""
        j.restart_count += 1
        j.start_time = j.end_time = None
        j.exit_code = j.signal = 0

    def add_step(self, job_id: int, name: str, state: str = "COMPLETED", exit_code: int = 0,
                 nodes: str | None = None) -> str:
        """A job step (an srun inside the job); returns its id like "1000.0"."""
        j = self.job(job_id)
        n = sum(1 for s in j.steps if s.step_id.isdigit())
        j.steps.append(FakeStep(str(n), name, state, exit_code, nodes=nodes or j.nodes))
        return f"{job_id}.{n}"

    def purge(self, job_id: int) -> None:
        """MinJobAge passed: squeue and scontrol no longer know the job; sacct does."""
        self.job(job_id).purged = True

    def drain(self, node: str, reason: str = "test") -> None:
        self.drained[node] = reason

    def _end(self, job_id: int, slurm_state: str, *, exit_code: int = 0, signal: int = 0,
             reason: str = "None") -> None:
        j = self.job(job_id)
        if j.state.is_terminal:
            raise ValueError(f"job {job_id} already ended ({j.slurm_state})")
        j.slurm_state, j.exit_code, j.signal, j.reason = slurm_state, exit_code, signal, reason
        j.end_time = self._now()
        if j.start_time is None:
            j.start_time = j.end_time
        for s in j.steps:
            if not to_job_state(s.state).is_terminal:
                base = slurm_state.split(" ", 1)[0]
                s.state, s.exit_code, s.signal = base, exit_code, signal

    # ------------------------------------------------------------ SlurmBackend

    def sbatch(self, script_text: str, args: Sequence[str] = ()) -> int:
        self._enter("sbatch", script_text, tuple(args))
        if not script_text.startswith("#!"):
            raise SlurmError(["sbatch", "--parsable", *args], 1,
                             "sbatch: error: This does not look like a batch script.  The first\n"
                             "sbatch: error: line must start with #! followed by the path to an interpreter.")
        opts = _sbatch_options(script_text, args)
        partition = opts.get("partition", self.partition)
        if partition != self.partition:
            raise SlurmError(["sbatch", "--parsable", *args], 1,
                             "sbatch: error: invalid partition specified: " + partition)
        num_nodes = int(opts.get("nodes", "1").split("-", 1)[0])
        # 22.05.8 with default EnforcePartLimits accepts more nodes than the partition
        # has (the job just pends), but refuses more GPUs per node than a node has.
        gres = opts.get("gres", "")
        if gres.startswith("gpu:") and gres.rsplit(":", 1)[-1].isdigit() \
                and int(gres.rsplit(":", 1)[-1]) > self.gpus_per_node:
            raise SlurmError(["sbatch", "--parsable", *args], 1, "sbatch: error: Batch job submission failed: "
                             "Requested node configuration is not available")
        nodelist = opts.get("nodelist", "")
        if nodelist and not set(expand_hostlist(nodelist)) <= set(self.node_names):
            raise SlurmError(["sbatch", "--parsable", *args], 1, "sbatch: error: Batch job submission failed: "
                             "Invalid node name specified")
        job_id = self._next_id
        self._next_id += 1
        j = FakeJob(job_id=job_id, name=opts.get("job-name", "sbatch"), script=script_text, args=list(args),
                    user=self.user, partition=partition, num_nodes=num_nodes,
                    gres=opts.get("gres", ""), comment=opts.get("comment", ""), work_dir=opts.get("chdir", ""),
                    submit_time=self._now(), nodelist=nodelist)
        self.jobs[job_id] = j
        self.submitted.append(j)
        return job_id

    def squeue(self, user: str | None = None, job_ids: Sequence[int] | None = None,
               name: str | None = None) -> list[JobInfo]:
        self._enter("squeue", user, tuple(job_ids) if job_ids is not None else None, name)
        wanted = set(job_ids) if job_ids is not None else None
        return [j.info() for j in self.jobs.values()
                if not j.purged and (wanted is None or j.job_id in wanted)
                and (user is None or j.user == user) and (name is None or j.name == name)]

    def show_job(self, job_id: int) -> JobInfo | None:
        self._enter("show_job", job_id)
        j = self.jobs.get(job_id)
        return None if j is None or j.purged else j.info()

    def sacct(self, job_ids: Sequence[int], fields: Sequence[str] | None = None) -> list[AcctRow]:
        self._enter("sacct", tuple(job_ids), tuple(fields or ()))
        if not self.accounting:
            raise AccountingDisabled(["sacct"], 1, "Slurm accounting storage is disabled")
        cols = list(fields or DEFAULT_SACCT_FIELDS)
        rows = []
        for jid in job_ids:
            j = self.jobs.get(jid)
            if j is None:
                continue
            for start, end, state, nodes in j.earlier_runs:
                rows.append(self._acct_row(str(j.job_id), j.name, state, 0, 0, replace(j, start_time=start,
                                                                                   end_time=end), nodes, cols))
            rows.append(self._acct_row(str(j.job_id), j.name, j.slurm_state if j.slurm_state != "CANCELLED"
                                       else "CANCELLED by 0", j.exit_code, j.signal, j, j.nodes, cols))
            for s in j.steps:
                rows.append(self._acct_row(f"{j.job_id}.{s.step_id}", s.name, s.state, s.exit_code, s.signal,
                                           j, s.nodes, cols))
        return rows

    def _acct_row(self, job_id: str, name: str, state: str, exit_code: int, sig: int, j: FakeJob,
                  nodes: str, cols: list[str]) -> AcctRow:
        def ts(t: int | None) -> str:
            return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t)) if t else "Unknown"

        values = {
            "JobID": job_id, "JobName": name, "State": state, "ExitCode": f"{exit_code}:{sig}",
            "Start": ts(j.start_time), "End": ts(j.end_time) if to_job_state(state).is_terminal else "Unknown",
            "Elapsed": "00:00:00", "NodeList": nodes or "None assigned",
            "AllocTRES": j.alloc_tres(),
            "User": j.user, "Partition": j.partition, "Comment": j.comment,
        }
        return AcctRow(job_id=job_id, fields={c: values.get(c, "") for c in cols})

    def scancel(self, job_ids: Sequence[int], signal: str | None = None, full: bool = False) -> None:
        self._enter("scancel", tuple(job_ids), signal, full)
        for jid in job_ids:
            j = self.jobs.get(jid)
            # scancel 22.05.8 exits 0 silently for unknown ids and for jobs that ended.
            if j is None or j.purged or j.state.is_terminal:
                continue
            if signal is not None:
                j.signals_sent.append(signal)
                continue
            self._end(jid, "CANCELLED", signal=15 if j.state is JobState.RUNNING else 0, reason=j.reason)

    def requeue(self, job_id: int) -> None:
        self._enter("requeue", job_id)
        j = self.jobs.get(job_id)
        # Messages as scontrol 22.05.8 prints them (exit 1).
        if j is None or j.purged:
            raise SlurmError(["scontrol", "requeue", str(job_id)], 1,
                             f"Invalid job id specified for job {job_id}")
        if j.state is JobState.PENDING:
            raise SlurmError(["scontrol", "requeue", str(job_id)], 1,
                             f"Job is pending execution for job {job_id}")
        j.earlier_runs.append((j.start_time, self._now(), "REQUEUED", j.nodes))
        j.slurm_state, j.reason, j.nodes = "PENDING", "BeginTime", ""
        j.restart_count += 1
        j.start_time = j.end_time = None
        j.exit_code = j.signal = 0

    def show_nodes(self) -> list[NodeInfo]:
        self._enter("show_nodes")
        busy: dict[str, int] = {}
        for j in self.jobs.values():
            if j.state is JobState.RUNNING:
                for n in expand_hostlist(j.nodes):
                    busy[n] = busy.get(n, 0) + 1
        gres = f"gpu:{self.gpu_type}:{self.gpus_per_node}" if self.gpus_per_node else ""
        return [NodeInfo(name=n, state="mixed" if busy.get(n) else "idle",
                         flags=("DRAIN",) if n in self.drained else (), cpus=32, cpus_alloc=busy.get(n, 0),
                         real_memory_mib=256000, gres=gres, partitions=(self.partition,), address="127.0.0.1",
                         reason=self.drained.get(n, ""))
                for n in self.node_names]

    def sinfo(self) -> list[PartitionRow]:
        self._enter("sinfo")
        nodes = self.show_nodes()
        rows = []
        for state in sorted({n.state for n in nodes}):
            names = [n.name for n in nodes if n.state == state]
            rows.append(PartitionRow(partition=self.partition, available="up", state=state,
                                     nodes=compress_hostlist(names), num_nodes=len(names), cpus=32, memory_mib=256000,
                                     gres=nodes[0].gres, time_limit="1-00:00:00", default=True))
        return rows

    def ping(self) -> bool:
        self.calls.append(("ping", ()))
        return not self.controller_down

    # convenience for tests
    def info(self, job_id: int) -> JobInfo:
        return replace(self.job(job_id).info())
