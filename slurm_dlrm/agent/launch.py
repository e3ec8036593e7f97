"""How a member is launched: its environment (GPU, MPS, rank and runner variables), the
`srun --overlap` argv of a member that is its own job step, the MASTER_PORT of a
multi-rank job, the process itself (its log, its -o/-e links, its dmem cgroup) and,
for a step, its pid read from `member_exec`'s pid file.

Apart from the agent loop (loop.py), which decides *whether* and *when* a member starts
(cancels, fences, gangs, joins); this module is *how* one starts (docs/agent.md "The
member environment" and "Launch").
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from slurm_dlrm.agent import fences
from slurm_dlrm.agent.member import Member
from slurm_dlrm.agent.mps import MpsSetup
from slurm_dlrm.agent.placement import MemberPlacement
from slurm_dlrm.errors import ENV_CHECKPOINT_DIR, ENV_JOB_ID, ENV_METRICS_FILE

log = logging.getLogger(__name__)

PID_FILE_TIMEOUT_S = 120.0
# Variables Slurm or a site may have set for the whole job that must not leak into a member.
_MPS_CLIENT_VARS = ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
# torch.distributed's launch variables: set for the ranks of a multi-rank job, removed
# otherwise (an agent started by torchrun or a wrapper must not make members ranks of it);
# SLURM_DLRM_RDZV_FILE is the runner's own local launcher's rendezvous (train/launch.py).
DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "GROUP_RANK", "SLURM_DLRM_RDZV_FILE")
MASTER_ADDR = "127.0.0.1"  # a job's ranks share one node (gang placement, docs/interfaces.md section 3)
# The ranks' rendezvous: a torch.distributed FileStore in a 0700 folder of the agent's
# run folder, which our runner prefers to env:// (train/runner.py). A TCPStore on
# 127.0.0.1:MASTER_PORT authenticates nothing: any process on the node could join or
# feed it. MASTER_ADDR/MASTER_PORT stay set for a `command` of the user's own.
ENV_RDZV_FILE = "SLURM_DLRM_RDZV_FILE"


def member_env(base: dict[str, str], m: MemberPlacement, gpus: list[str], mps: MpsSetup,
               pipe_dir: str | None = None, master_port: int | None = None,
               rdzv_file: str | None = None) -> dict[str, str]:
    """The environment of one member (docs/agent.md lists every variable). pipe_dir: the
    member's MPS v3 namespace folder (its socket picks the namespace); master_port: its
    job's rendezvous port when it is one rank of several."""
    if m.gpu_index >= len(gpus):
        raise ValueError(f"member {m.name}: gpu_index {m.gpu_index} but the node has {len(gpus)} GPUs")
    env = dict(base)
    for var in (*_MPS_CLIENT_VARS, *DIST_VARS):
        env.pop(var, None)
    if m.world_size > 1:
        if master_port is None:
            raise ValueError(f"member {m.name}: rank {m.rank} of {m.world_size} without a MASTER_PORT")
        # One torch.distributed job on one node: env:// rendezvous at rank 0's TCP store.
        env.update(RANK=str(m.rank), LOCAL_RANK=str(m.rank), WORLD_SIZE=str(m.world_size),
                   LOCAL_WORLD_SIZE=str(m.world_size), MASTER_ADDR=MASTER_ADDR, MASTER_PORT=str(master_port))
        if rdzv_file is not None:
            env[ENV_RDZV_FILE] = rdzv_file
    if mps.daemon is not None and mps.mode == "own":
        # Our daemon sees only the allocation's GPUs and renumbers them 0..n-1 for clients.
        env["CUDA_VISIBLE_DEVICES"] = str(m.gpu_index)
    else:
        env["CUDA_VISIBLE_DEVICES"] = gpus[m.gpu_index]
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # CUDA numbers GPUs as NVML does
    if mps.daemon is not None:
        env.update(mps.daemon.env())
        if pipe_dir is not None:
            env["CUDA_MPS_PIPE_DIRECTORY"] = pipe_dir
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(m.mps_thread_pct)
        # The member sees one GPU, its device 0; this is the fence gres/mps never sets.
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={m.gpu_mem_limit_mib}M"
    env[ENV_METRICS_FILE] = m.metrics_path
    env[ENV_CHECKPOINT_DIR] = m.checkpoint_dir
    env[ENV_JOB_ID] = str(m.job_id)
    env["OMP_NUM_THREADS"] = str(m.cpus)
    return env


# Variables applied again inside a Slurm step, after slurmstepd sets its own.
STEP_OVERRIDES = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
                  "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY",
                  "OMP_NUM_THREADS", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                  "MASTER_PORT", ENV_RDZV_FILE)


def free_port(taken: set[int], host: str = MASTER_ADDR) -> int:
    """A TCP port no one listens on now, not in `taken` (the ports this agent gave its
    running jobs): the kernel picks it (bind to port 0). Between this probe and rank 0's
    bind another process could take it; the job then fails at rendezvous and is requeued."""
    for _ in range(64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in taken:
            return port
    raise OSError("no free TCP port for MASTER_PORT")


def step_argv(m: MemberPlacement, env: dict[str, str], node_name: str, pid_file: Path, python: str) -> list[str]:
    """`srun --overlap` argv that runs one member as its own job step on this node."""
    # --mem=0: the step shares the job's memory (the agent enforces each member's budget);
    # without it srun takes $SLURM_MEM_PER_CPU from the batch job and, in Slurm 22.05,
    # refuses the step because the agent's step holds that memory, --overlap or not.
    argv = ["srun", "--overlap", "--mem=0", "--nodes=1", "--ntasks=1", f"--nodelist={node_name}",
            f"--job-name={m.name}", "--export=ALL", "--input=none",
            python, "-m", "slurm_dlrm.agent.member_exec", "--pid-file", str(pid_file)]
    for var in STEP_OVERRIDES:
        if var in env:
            argv += ["--setenv", f"{var}={env[var]}"]
    return [*argv, "--", *m.command]


def start_process(m: Member, *, base_env: dict[str, str], gpus: list[str], mps: MpsSetup, launch: str,
                  node_name: str, run_dir: Path, python: str) -> list[str]:
    """Start one member's process (`launch` "process": its command; "step": its srun) with
    its environment, its output in `output-<node>.log` beside its metrics file; the argv
    it ran. OSError or ValueError when it cannot start."""
    p = m.placement
    pipe_dir = None
    if m.fence.get("kind") == "v3" and mps.daemon is not None:
        pipe_dir = str(mps.daemon.pipe_dir / m.fence["server"] / m.fence["namespace"])
    m.env = member_env(base_env, p, gpus, mps, pipe_dir=pipe_dir,
                       master_port=m.master_port, rdzv_file=m.rdzv_file)
    for d in (Path(p.checkpoint_dir), Path(p.metrics_path).parent):
        d.mkdir(parents=True, exist_ok=True)
    m.output_path = Path(p.metrics_path).parent / f"output-{node_name}.log"
    out = open(m.output_path, "ab")  # noqa: SIM115
    link_output(m)
    if launch == "step":
        m.pid_file = run_dir / f"member-{p.key}.pid"
        m.pid_file.unlink(missing_ok=True)
        argv = step_argv(p, m.env, node_name, m.pid_file, python)
    else:
        argv = list(p.command)
    cgroup = m.cgroup
    agent_pid = os.getpid()

    def preexec() -> None:
        # dmem: the member joins its cgroup before exec, so its first allocation is charged there.
        if cgroup is not None:
            fences.join_cgroup(cgroup)
        die_with_parent(agent_pid)

    with out:
        m.popen = subprocess.Popen(  # noqa: S603 - argv list from the placement, no shell
            argv, env=m.env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=preexec)  # noqa: PLW1509 - the agent has no threads
    return argv


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent_pid: int) -> None:
    """In a member before exec: SIGTERM when the agent dies, so it checkpoints and stops.
    Killed agents left their members running as orphans that Slurm's proctrack/linuxproc
    (and pgid) no longer tracks, until they finished; the service had meanwhile rerun them
    from their checkpoint elsewhere: two runs of one job at once (issue 49, chaos_live).
    Linux only; elsewhere nothing."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the agent died before the prctl
        os.kill(os.getpid(), signal.SIGTERM)


def link_output(m: Member) -> None:
    """The job's -o/-e paths as links to its log (issue 43 item 8), made by the agent as
    the user; a path that is a file of its own is left alone (said in the agent log)."""
    for link in m.placement.output_links:
        path = Path(link)
        try:
            if path.is_symlink():
                path.unlink()
            elif path.exists():
                log.warning("job %d: -o/-e %s exists and is not a link; not replaced", m.placement.job_id, path)
                continue
            path.symlink_to(m.output_path)  # type: ignore[arg-type]
        except OSError as exc:
            log.warning("job %d: cannot link -o/-e %s to its log: %s", m.placement.job_id, path, exc)


def resolve_pid(m: Member) -> None:
    """A step member's pid, from the file `member_exec` writes once its step runs; a step
    that has not written it within PID_FILE_TIMEOUT_S is stopped (its srun killed)."""
    if m.pid is not None or m.pid_file is None:
        return
    try:
        m.pid = int(m.pid_file.read_text().strip())
    except (OSError, ValueError):
        if time.monotonic() - m.launched_at > PID_FILE_TIMEOUT_S and m.popen is not None:
            log.error("%s: step did not start within %.0fs; stopping srun", m.placement.name, PID_FILE_TIMEOUT_S)
            m.stop_reason = m.stop_reason or "KILLED"
            with contextlib.suppress(OSError):
                m.popen.kill()
