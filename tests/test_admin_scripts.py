"""The rendered MPS prolog, epilog and task prolog, run by bash against a fake
`nvidia-cuda-mps-control` (daemon with -d, client otherwise, commands through the control
FIFO in CUDA_MPS_PIPE_DIRECTORY, PID file there, like the real one) and stub squeue/scontrol (tests/slurm_records.py).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest

from slurm_dlrm.admin.marker import format_marker
from slurm_dlrm.admin.render import render_site, write_rendered
from slurm_dlrm.agent import fences
from slurm_dlrm.emulated import mps_control as fake_mps_control
from slurm_dlrm.site import REPO_SITE_FILE, parse_site
from tests.slurm_records import write_stub

FAKE_MPS_CONTROL = r'''#!/usr/bin/env python3
"""Fake nvidia-cuda-mps-control for tests (slurm-dlrm). `-d`: fork a daemon that serves the
control FIFO in $CUDA_MPS_PIPE_DIRECTORY and writes nvidia-cuda-mps-control.pid there;
no argument: a client sending stdin's commands through that FIFO.
FAKE_MPS_FAIL_START / FAKE_MPS_START_DELAY_S / FAKE_MPS_IGNORE_QUIT make it misbehave;
FAKE_MPS_NO_PID_FILE acts like a driver that writes no PID file."""
import os, signal, sys, time

PIPE = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
LOGS = os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps")
PID_FILE = os.path.join(PIPE, "nvidia-cuda-mps-control.pid")
FIFO = os.path.join(PIPE, "control")
SHM = os.environ.get("FAKE_MPS_SHM_DIR", "/dev/shm")


def log(msg):
    os.makedirs(LOGS, exist_ok=True)
    with open(os.path.join(LOGS, "control.log"), "a") as f:
        f.write("%.3f %d %s\n" % (time.time(), os.getpid(), msg))


def cleanup():
    for p in (PID_FILE, PID_FILE + ".fake", FIFO, os.path.join(SHM, "cuda.shm.0.%d.1" % os.getpid())):
        try:
            os.unlink(p)
        except OSError:
            pass
    log("exit")


def serve():
    if os.environ.get("FAKE_MPS_FAIL_START"):
        log("failed to start")
        return
    time.sleep(float(os.environ.get("FAKE_MPS_START_DELAY_S", "0")))
    os.makedirs(PIPE, exist_ok=True)
    if not os.path.exists(FIFO):
        os.mkfifo(FIFO, 0o622)
    # Drivers without the PID file: keep it where only this fake looks.
    pid_file = PID_FILE + ".fake" if os.environ.get("FAKE_MPS_NO_PID_FILE") else PID_FILE
    with open(pid_file + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(pid_file + ".tmp", pid_file)
    if os.path.isdir(SHM):
        open(os.path.join(SHM, "cuda.shm.0.%d.1" % os.getpid()), "w").close()
    log("start CUDA_VISIBLE_DEVICES=%s" % os.environ.get("CUDA_VISIBLE_DEVICES", ""))

    def on_term(*_):
        log("SIGTERM")
        cleanup()
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    fd = os.open(FIFO, os.O_RDWR)  # read-write: no EOF when a client closes
    buf = b""
    while True:
        buf += os.read(fd, 4096)
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            cmd = line.decode().strip()
            log("command " + cmd)
            if cmd == "quit" and not os.environ.get("FAKE_MPS_IGNORE_QUIT"):
                cleanup()
                return


def alive():
    for pid_file in (PID_FILE, PID_FILE + ".fake"):
        try:
            pid = int(open(pid_file).read())
            os.kill(pid, 0)
            return True
        except (OSError, ValueError):
            continue
    return False


def client():
    if not alive() or not os.path.exists(FIFO):
        print("Cannot find MPS control daemon process", file=sys.stderr)
        return 1
    for line in sys.stdin:
        cmd = line.strip()
        if not cmd:
            continue
        w = os.open(FIFO, os.O_WRONLY | os.O_NONBLOCK)
        os.write(w, (cmd + "\n").encode())
        os.close(w)
        if cmd.startswith("set_default_active_thread_percentage"):
            print(cmd.split()[-1])
    return 0


if sys.argv[1:] == ["-d"]:
    if os.fork():
        sys.exit(0)  # like the real one: returns at once, the daemon comes up later
    os.setsid()
    if os.fork():
        os._exit(0)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    try:
        serve()
    finally:
        os._exit(0)
sys.exit(client())
'''

# scontrol stub: answers come from files in $STUB_DIR.
STUB_SCONTROL = r'''#!/bin/bash
# scontrol show job -o ID -> $STUB_DIR/job_ID, else "Invalid job id"
id=${!#}
if [[ -f $STUB_DIR/job_$id ]]; then cat "$STUB_DIR/job_$id"; exit 0; fi
echo "slurm_load_jobs error: Invalid job id specified" >&2
exit 1
'''


def write_fake_mps(bin_dir: Path, shm_dir: Path | None = None) -> Path:
    """Install the fake; `shm_dir` replaces /dev/shm as its default (slurmd passes no FAKE_* env)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    path = bin_dir / "nvidia-cuda-mps-control"
    text = FAKE_MPS_CONTROL
    if shm_dir is not None:
        text = text.replace('os.environ.get("FAKE_MPS_SHM_DIR", "/dev/shm")', f"os.environ.get(\"FAKE_MPS_SHM_DIR\", {str(shm_dir)!r})")
        assert str(shm_dir) in text
    path.write_text(text)
    path.chmod(0o755)
    return path


class Node:
    """One fake compute node: rendered scripts, fake MPS, stub Slurm commands."""

    def __init__(self, root: Path, shards: bool = True, fake: str = "fifo", mps: dict[str, Any] | None = None,
                 slurm: dict[str, Any] | None = None) -> None:
        self.root = root
        self.bin = root / "bin"
        self.stub = root / "stub"
        self.shm = root / "shm"
        for d in (self.stub, self.shm):
            d.mkdir(parents=True)
        if fake == "fifo":
            write_fake_mps(self.bin)
        else:  # the package's fake daemon: "v2" (driver before r615) or "v3"
            fake_mps_control.install_launcher(self.bin, v3=fake == "v3")
        for name, text in (("scontrol", STUB_SCONTROL),):
            (self.bin / name).write_text(text)
            (self.bin / name).chmod(0o755)
        raw = tomllib.loads(REPO_SITE_FILE.read_text())
        raw["mps"]["shards_per_gpu"] = 8 if shards else 0
        raw["slurm"].update(mps_control_command=str(self.bin / "nvidia-cuda-mps-control"),
                            mps_pipe_root=str(root / "p"), mps_log_root=str(root / "l"), shm_dir=str(self.shm),
                            script_dir=str(root / "s"), mps_start_timeout_s=1.5, mps_stop_timeout_s=1.0,
                            **(slurm or {}))
        raw["mps"].update(mps or {})
        self.site = parse_site(raw)
        write_rendered(render_site(self.site), root / "out")
        self.scripts = root / "out" / "scripts"
        self.pipe_root = root / "p"
        self.log_root = root / "l"

    def run(self, script: str, job: int, gpus: str | None = "1", pct: str | None = "40",
            **extra: str) -> subprocess.CompletedProcess[str]:
        env = {"PATH": f"{self.bin}:/usr/bin:/bin", "SLURM_JOB_ID": str(job), "STUB_DIR": str(self.stub),
               "FAKE_MPS_SHM_DIR": str(self.shm), **extra}
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus
        if pct is not None:
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = pct
        return subprocess.run(["bash", str(self.scripts / script)], env=env, capture_output=True,  # noqa: S603
                              text=True, timeout=30)

    def daemon_pid(self, gpu: int) -> int | None:
        try:
            pid = int((self.pipe_root / f"gpu{gpu}" / "pipe" / "nvidia-cuda-mps-control.pid").read_text())
        except (OSError, ValueError):
            return None
        return pid if alive(pid) else None

    def control_log(self, gpu: int) -> str:
        p = self.log_root / f"gpu{gpu}" / "control.log"
        return p.read_text() if p.exists() else ""

    def events(self) -> str:
        p = self.log_root / "events.log"
        return p.read_text() if p.exists() else ""

    def job_running(self, job: int, comment: str = "", mps: int | None = 40, *, release: str = "22.05.8",
                    name: str = "x", work_dir: str = "/home/u", tres_per_node: str | None = None,
                    submit_line: str = "sbatch x.sh", state: str = "RUNNING") -> None:
        """Job `job` as Slurm `release` shows it to squeue (and scontrol), fields as given."""
        if tres_per_node is None:
            sep = ":" if release.startswith("22.") else "/"
            tres_per_node = f"gres{sep}mps:{mps}" if mps is not None else ""
        write_stub(self.bin, self.stub, release, job, name=name, work_dir=work_dir, comment=comment,
                   tres_per_node=tres_per_node, submit_line=submit_line, state=state)

    def slurm_unreachable(self, message: str = "") -> None:
        """squeue and scontrol fail as with the controller down."""
        for name in ("squeue", "scontrol"):
            (self.bin / name).write_text(f"#!/bin/bash\necho {shlex.quote(message)} >&2\nexit 1\n")

    def kill_daemons(self) -> None:
        for f in self.pipe_root.glob("gpu*/pipe/nvidia-cuda-mps-control.pid*"):
            try:
                pid = int(f.read_text())
            except (OSError, ValueError):
                continue
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def node():
    # Short paths: MPS pipe directories must stay under 87 characters.
    root = Path(tempfile.mkdtemp(prefix="sdm", dir="/tmp"))
    n = Node(root)
    yield n
    n.kill_daemons()
    shutil.rmtree(root, ignore_errors=True)


def alive(pid: int) -> bool:
    """Exists and is not a zombie (the daemons are orphans; PID 1 may reap them late)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_gone(pid: int, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_prolog_ignores_jobs_without_mps(node):
    result = node.run("prolog.sh", 5, gpus="0", pct=None)
    assert result.returncode == 0
    assert not node.pipe_root.exists()


def test_daemon_lives_from_first_prolog_to_last_epilog(node):
    (node.shm / "cuda.shm.0.999.1").write_text("stale")  # left by a crashed daemon
    node.job_running(11, mps=40)
    assert node.run("prolog.sh", 11, pct="500").returncode == 0  # 22.05 + shards: bogus percentage
    pid = node.daemon_pid(1)
    assert pid is not None
    assert "start CUDA_VISIBLE_DEVICES=1" in node.control_log(1)
    # The prolog recomputed the percentage from gres:mps:40 (mps_per_gpu = 100).
    assert "set_default_active_thread_percentage 40" in node.control_log(1)
    assert (node.pipe_root / "jobs" / "11").read_text() == "1 40 0 2\n"  # no marker: no fence; protocol 2
    assert not (node.shm / "cuda.shm.0.999.1").exists()  # no daemon ran: stale segments went

    node.job_running(12, mps=30)
    assert node.run("prolog.sh", 12, pct="375").returncode == 0
    assert node.daemon_pid(1) == pid  # one daemon per GPU, shared
    assert node.control_log(1).count("start ") == 1

    assert node.run("epilog.sh", 11).returncode == 0
    assert node.daemon_pid(1) == pid  # job 12 still holds the GPU
    assert not (node.pipe_root / "jobs" / "11").exists()

    assert node.run("epilog.sh", 12).returncode == 0
    assert wait_gone(pid)
    assert "command quit" in node.control_log(1)
    assert not (node.pipe_root / "gpu1" / "pipe").exists()
    assert not list(node.shm.glob("cuda.shm.*"))
    assert "stopped" in node.events()


def test_daemons_per_gpu_are_independent(node):
    node.job_running(21)
    node.job_running(22)
    assert node.run("prolog.sh", 21, gpus="0").returncode == 0
    assert node.run("prolog.sh", 22, gpus="3").returncode == 0
    pid0, pid3 = node.daemon_pid(0), node.daemon_pid(3)
    assert pid0 and pid3 and pid0 != pid3
    assert node.run("epilog.sh", 21).returncode == 0
    assert wait_gone(pid0)
    assert node.daemon_pid(3) == pid3
    # GPU 3's daemon still runs, so the node's shared memory stays.
    assert list(node.shm.glob("cuda.shm.*"))


def test_epilog_escalates_when_quit_is_ignored(node):
    node.job_running(31)
    assert node.run("prolog.sh", 31, FAKE_MPS_IGNORE_QUIT="1").returncode == 0
    pid = node.daemon_pid(1)
    assert pid
    started = time.monotonic()
    result = node.run("epilog.sh", 31)
    assert result.returncode == 0
    assert wait_gone(pid, 1.0)
    assert "SIGTERM" in node.control_log(1) and "sending SIGTERM" in node.events()
    assert time.monotonic() - started < 5  # bounded by mps_stop_timeout_s per step


def test_prolog_fails_when_the_daemon_never_answers(node):
    started = time.monotonic()
    result = node.run("prolog.sh", 41, FAKE_MPS_FAIL_START="1")
    assert result.returncode == 1  # slurmd drains the node and requeues the job
    assert 1.4 < time.monotonic() - started < 8  # waited mps_start_timeout_s (1.5 s), no longer
    assert not (node.pipe_root / "gpu1" / "jobs" / "41").exists()
    assert not (node.pipe_root / "jobs" / "41").exists()
    assert "did not answer" in node.events()


def test_prolog_waits_for_a_slow_daemon(node):
    node.job_running(45)
    assert node.run("prolog.sh", 45, FAKE_MPS_START_DELAY_S="0.6").returncode == 0
    assert node.daemon_pid(1)


def test_daemon_without_a_pid_file(node):
    """Older drivers write no PID file: readiness and stop go by get_server_list alone."""
    node.job_running(55)
    node.job_running(56)
    assert node.run("prolog.sh", 55, FAKE_MPS_NO_PID_FILE="1").returncode == 0
    fake_pid_file = node.pipe_root / "gpu1" / "pipe" / "nvidia-cuda-mps-control.pid.fake"
    pid = int(fake_pid_file.read_text())
    assert node.daemon_pid(1) is None and alive(pid)
    assert node.run("prolog.sh", 56).returncode == 0  # finds the running daemon by its pipe
    assert node.control_log(1).count("start ") == 1
    assert node.run("epilog.sh", 55).returncode == 0
    assert alive(pid)
    assert node.run("epilog.sh", 56).returncode == 0
    assert wait_gone(pid)
    assert "command quit" in node.control_log(1)
    assert not (node.pipe_root / "gpu1" / "pipe").exists()


def test_prolog_replaces_a_dead_daemon(node):
    node.job_running(51)
    assert node.run("prolog.sh", 51).returncode == 0
    old = node.daemon_pid(1)
    assert old
    os.kill(old, signal.SIGKILL)  # pid file, FIFO and job record stay behind
    assert wait_gone(old)
    node.job_running(52)
    assert node.run("prolog.sh", 52).returncode == 0
    new = node.daemon_pid(1)
    assert new and new != old


def test_epilog_drops_jobs_slurm_no_longer_knows(node):
    node.job_running(61)
    assert node.run("prolog.sh", 61).returncode == 0
    pid = node.daemon_pid(1)
    # Job 60's epilog never ran (slurmd restarted); Slurm has forgotten it.
    (node.pipe_root / "gpu1" / "jobs" / "60").write_text("")
    assert node.run("epilog.sh", 61).returncode == 0
    assert pid is not None and wait_gone(pid)
    assert "dropping job 60" in node.events()


def test_epilog_keeps_the_daemon_while_the_controller_is_unreachable(node):
    node.job_running(71)
    assert node.run("prolog.sh", 71).returncode == 0
    pid = node.daemon_pid(1)
    (node.pipe_root / "gpu1" / "jobs" / "70").write_text("")
    node.slurm_unreachable("Unable to contact slurm controller")
    assert node.run("epilog.sh", 71).returncode == 0
    assert node.daemon_pid(1) == pid


def test_epilog_ignores_jobs_the_prolog_did_not_record(node):
    assert node.run("epilog.sh", 81, pct=None).returncode == 0
    assert not node.pipe_root.exists()


def task_env(output: str) -> dict[str, Any]:
    env: dict[str, Any] = {}
    for line in output.splitlines():
        if line.startswith("export "):
            name, _, value = line[len("export "):].partition("=")
            env[name] = value
        elif line.startswith("unset "):
            env[line[len("unset "):]] = None
    return env


def test_task_prolog_points_a_no_pack_job_at_its_daemon_and_fences_memory(node):
    node.job_running(91, comment=format_marker("no-pack", gpu_mem_mib=3000, job_id=4))
    assert node.run("prolog.sh", 91, gpus="2").returncode == 0
    node.slurm_unreachable()  # tasks must not ask Slurm
    result = node.run("task_prolog.sh", 91, gpus="0", pct="500")
    assert result.returncode == 0
    env = task_env(result.stdout)
    assert env == {
        "CUDA_MPS_PIPE_DIRECTORY": f"{node.pipe_root}/gpu2/pipe",
        "CUDA_MPS_LOG_DIRECTORY": f"{node.log_root}/gpu2",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "40",
        "CUDA_VISIBLE_DEVICES": None,
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=3000M",
    }


def test_task_prolog_sets_no_fence_for_packs_or_foreign_comments(node):
    comments = [format_marker("pack", pack_id=3), "slurm-dlrm:mode=no-pack,gpu_mem_mib=$(id)", "hello",
                "slurm-dlrm:mode=no-pack,gpu_mem_mib=0"]
    for job, comment in enumerate(comments, start=200):
        node.job_running(job, comment=comment)
        assert node.run("prolog.sh", job).returncode == 0
        env = task_env(node.run("task_prolog.sh", job).stdout)
        assert "CUDA_MPS_PIPE_DIRECTORY" in env
        assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in env, comment


def test_task_prolog_is_silent_for_other_jobs(node):
    assert node.run("task_prolog.sh", 93, pct=None).stdout == ""
    assert node.run("task_prolog.sh", 94).stdout == ""  # mps job, but no daemon recorded


def test_without_shards_the_slurm_percentage_is_used(tmp_path):
    root = Path(tempfile.mkdtemp(prefix="sdm", dir="/tmp"))
    n = Node(root, shards=False)
    try:
        n.job_running(101, comment=format_marker("no-pack", gpu_mem_mib=1234), mps=30)
        assert n.run("prolog.sh", 101, pct="25").returncode == 0
        # Slurm's own 25 stands (no shards: its percentage is right); the fence is read.
        assert (n.pipe_root / "jobs" / "101").read_text() == "1 25 1234 2\n"
        # The controller unreachable: the job still runs, with Slurm's percentage, unfenced.
        n.slurm_unreachable()
        assert n.run("prolog.sh", 102, pct="25").returncode == 0
        assert (n.pipe_root / "jobs" / "102").read_text() == "1 25 0 2\n"
        assert "squeue failed" in n.events()
    finally:
        n.kill_daemons()
        shutil.rmtree(root, ignore_errors=True)


# ------------------------------------------------------------------ fences (issue 22)

NOBODY = 65534


@pytest.fixture
def short_root():
    root = Path(tempfile.mkdtemp(prefix="sdf", dir="/tmp"))
    root.chmod(0o755)  # clients of another user reach the pipes below
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _client_as(uid: int, pipe: Path, limit: str | None) -> dict[str, Any]:
    """A CUDA client of user `uid` connecting to the fake daemon (what libcuda does at start):
    a forked child that drops to `uid` and reports the daemon's record on a pipe."""
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(pipe), **({"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": limit} if limit else {})}
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.close(rfd)
            os.setgid(uid)
            os.setuid(uid)
            try:
                record = fake_mps_control.connect_client(env)
            except PermissionError as exc:  # the daemon refused this client
                record = {"refused": str(exc)}
            os.write(wfd, json.dumps(record).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(wfd)
    with os.fdopen(rfd) as r:
        text = r.read()
    _, status = os.waitpid(pid, 0)
    assert status == 0 and text, f"client as uid {uid} failed"
    return json.loads(text)  # type: ignore[no-any-return]


def _fake_state(node: Node, gpu: int) -> dict[str, Any]:
    return json.loads((node.pipe_root / f"gpu{gpu}" / "pipe" / fake_mps_control.STATE_FILE).read_text())


@pytest.mark.skipif(os.getuid() != 0, reason="clients of another user need root to start")
def test_v3_no_pack_job_is_held_by_its_users_server(short_root):
    node = Node(short_root, fake="v3")
    try:
        node.job_running(301, comment=format_marker("no-pack", gpu_mem_mib=3000, job_id=4))
        result = node.run("prolog.sh", 301, SLURM_JOB_UID=str(NOBODY))
        assert result.returncode == 0, node.events()
        state = _fake_state(node, 1)
        assert state["protocol"] == 3
        assert state["v3_servers"][f"uid{NOBODY}"] == {"uid": NOBODY, "pinned_memory_limit_mib": 3000,
                                                       "active_thread_percentage": 40.0, "namespaces": {},
                                                       "sm_partitions": {}}
        env = task_env(node.run("task_prolog.sh", 301).stdout)
        assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in env  # the daemon holds it, not the task
        # the job's task raises its own limit: the daemon routes it by uid to its server
        client = _client_as(NOBODY, Path(env["CUDA_MPS_PIPE_DIRECTORY"]), "0=99999M")
        assert client["server"] == f"uid{NOBODY}" and client["effective_limit_mib"] == 3000
        assert node.run("epilog.sh", 301).returncode == 0
        assert node.daemon_pid(1) is None
    finally:
        node.kill_daemons()


@pytest.mark.skipif(os.getuid() != 0, reason="servers of another user need root to start")
def test_v2_no_pack_job_gets_a_server_limit_and_keeps_the_env_fallback(short_root):
    node = Node(short_root, fake="v2")
    try:
        node.job_running(302, comment=format_marker("no-pack", gpu_mem_mib=3000, job_id=5))
        assert node.run("prolog.sh", 302, SLURM_JOB_UID=str(NOBODY)).returncode == 0, node.events()
        (server,) = _fake_state(node, 1)["servers"].values()
        assert server["uid"] == NOBODY and server["device_pinned_mem_limit_mib"] == {"0": 3000}
        env = task_env(node.run("task_prolog.sh", 302).stdout)
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=3000M"  # v2: the task's variable stays
        pipe = Path(env["CUDA_MPS_PIPE_DIRECTORY"])
        assert _client_as(NOBODY, pipe, None)["effective_limit_mib"] == 3000  # the server's limit
        assert _client_as(NOBODY, pipe, "0=99999M")["effective_limit_mib"] == 99999  # v2's hole
        assert "a task can still set a higher limit itself" in node.events()
    finally:
        node.kill_daemons()


def test_dmem_limits_go_on_the_jobs_cgroup(short_root):
    cg = short_root / "cg"
    regions = {"nvidia/0000:3b:00.0/vidmem": 80 << 30, "nvidia/0000:5e:00.0/vidmem": 80 << 30}
    fences.make_fake_cgroup_tree(cg, regions)
    job_cg = cg / "system.slice" / "slurmstepd.scope" / "job_303"
    job_cg.mkdir(parents=True)
    node = Node(short_root / "n", slurm={"cgroup_root": str(cg)})
    try:
        node.job_running(303, comment=format_marker("no-pack", gpu_mem_mib=3000, job_id=6))
        assert node.run("prolog.sh", 303).returncode == 0, node.events()
        assert (job_cg / "dmem.max").read_text() == f"nvidia/0000:5e:00.0/vidmem {3000 << 20}\n"
        assert (job_cg / "dmem.min").read_text() == f"nvidia/0000:5e:00.0/vidmem {3000 << 20}\n"
        assert (cg / "system.slice" / "slurmstepd.scope" / "cgroup.subtree_control").read_text() == "+dmem\n"
    finally:
        node.kill_daemons()


def test_dmem_on_without_the_controller_refuses_the_job_in_one_line(short_root):
    cg = short_root / "cg"
    fences.make_fake_cgroup_tree(cg, {}, dmem=False)
    node = Node(short_root / "n", mps={"dmem": "on"}, slurm={"cgroup_root": str(cg)})
    try:
        node.job_running(304, comment=format_marker("no-pack", gpu_mem_mib=3000, job_id=7))
        assert node.run("prolog.sh", 304).returncode == 1
        lines = [ln for ln in node.events().splitlines() if "dmem" in ln]
        assert len(lines) == 1 and "no nvidia region for GPU 1" in lines[0]
        assert not (node.pipe_root / "gpu1" / "jobs" / "304").exists()
        # a job without a fence to set is not affected
        node.job_running(305)
        assert node.run("prolog.sh", 305).returncode == 0
    finally:
        node.kill_daemons()


def write_site_script(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/bash\n" + text)
    path.chmod(0o755)
    return path


def test_the_sites_own_scripts_run_from_ours():
    """[slurm] site_prolog/site_epilog/site_task_prolog: ours runs the site's (with the job's
    environment); a failing site prolog fails ours before any MPS daemon starts; the site
    task prolog's lines pass on, ours after them win."""
    root = Path(tempfile.mkdtemp(prefix="sdc", dir="/tmp"))
    site = root / "site"
    trace = root / "trace"
    for name in ("10-a.sh", "20-b.sh"):  # a glob of two, run in name order
        write_site_script(site / "prolog.d" / name,
                          f'echo "{name} job=$SLURM_JOB_ID" >>{trace}\nexit "${{SITE_PROLOG_RC:-0}}"\n')
    write_site_script(site / "epilog.sh", f'echo "epilog job=$SLURM_JOB_ID" >>{trace}\nexit "${{SITE_EPILOG_RC:-0}}"\n')
    write_site_script(site / "task_prolog.sh", 'echo "export SITE_VAR=1"\necho "export CUDA_MPS_PIPE_DIRECTORY=/x"\n')
    node = Node(root / "n", slurm={"site_prolog": f"{site}/prolog.d/*", "site_epilog": f"{site}/epilog.sh",
                                   "site_task_prolog": f"{site}/task_prolog.sh"})
    try:
        node.job_running(31)
        assert node.run("prolog.sh", 31).returncode == 0
        assert trace.read_text() == "10-a.sh job=31\n20-b.sh job=31\n"
        assert node.daemon_pid(1) is not None
        out = node.run("task_prolog.sh", 31)
        assert out.returncode == 0
        lines = out.stdout.splitlines()
        assert lines[0] == "export SITE_VAR=1"
        # Ours comes later, so slurmstepd keeps our value of the same variable.
        assert lines.index("export CUDA_MPS_PIPE_DIRECTORY=/x") < \
            lines.index(f"export CUDA_MPS_PIPE_DIRECTORY={node.pipe_root}/gpu1/pipe")
        pid = node.daemon_pid(1)
        assert node.run("epilog.sh", 31).returncode == 0
        assert trace.read_text().endswith("epilog job=31\n")
        assert pid is not None and wait_gone(pid)  # ours ran too

        # The site's prolog fails: ours fails with its status and starts nothing.
        trace.unlink()
        node.job_running(32)
        failed = node.run("prolog.sh", 32, gpus="2", SITE_PROLOG_RC="3")
        assert failed.returncode == 3
        assert trace.read_text() == "10-a.sh job=32\n"  # stopped at the first failure
        assert node.daemon_pid(2) is None and not (node.pipe_root / "jobs" / "32").exists()
        assert "the site's prolog" in node.events()
        # The site's epilog fails: ours still ran, the epilog fails (Slurm drains the node).
        assert node.run("prolog.sh", 33, gpus="2").returncode == 0
        node.job_running(33)
        pid2 = node.daemon_pid(2)
        failed = node.run("epilog.sh", 33, gpus="2", SITE_EPILOG_RC="4")
        assert failed.returncode == 4
        assert pid2 is not None and wait_gone(pid2)
    finally:
        node.kill_daemons()
        shutil.rmtree(root, ignore_errors=True)


def test_a_missing_site_script_fails_like_slurmd_would():
    root = Path(tempfile.mkdtemp(prefix="sdc", dir="/tmp"))
    node = Node(root / "n", slurm={"site_prolog": f"{root}/nope.sh", "site_epilog": f"{root}/none.d/*"})
    try:
        node.job_running(41)
        result = node.run("prolog.sh", 41)
        assert result.returncode == 1 and "missing or not executable" in result.stderr
        assert node.run("epilog.sh", 41).returncode == 0  # a glob that matches nothing runs nothing
    finally:
        node.kill_daemons()
        shutil.rmtree(root, ignore_errors=True)


def test_prolog_says_when_users_share_a_gpu(node):
    """MPS runs one user's jobs on a GPU at a time: events.log names the GPU and the users
    whose jobs now take turns on it; one user's second job on it is no news."""
    for job in (51, 52, 53):
        node.job_running(job)
    assert node.run("prolog.sh", 51, SLURM_JOB_UID="1000").returncode == 0
    assert node.run("prolog.sh", 52, SLURM_JOB_UID="1000").returncode == 0
    assert "shares it" not in node.events()
    assert node.run("prolog.sh", 53, SLURM_JOB_UID="1001").returncode == 0
    assert ("job 53: GPU 1: uid 1001 shares it with uid 1000: MPS runs one user's jobs at a time, so they take "
            "turns ([mps] cross_user = time-slice)") in node.events()
    for job in (51, 52, 53):
        assert node.run("epilog.sh", job).returncode == 0


# ------------------------------------------------------------------ user text (issue 32)

FORGED_NAME = "x TresPerNode=mps:100 Comment=slurm-dlrm:mode=no-pack,gpu_mem_mib=99999"


@pytest.mark.parametrize("release", ["22.05.8", "24.11.5", "26.05.5"])
def test_prolog_takes_no_job_field_from_the_users_text(node, release):
    """Issue 32 item 1, its reproductions: a job name and a work dir that read like later
    fields of `scontrol show job -o` gave thread share 100 and fence 99999 MiB (100000 %
    from the work dir). The prolog reads TresPerNode and Comment alone (squeue)."""
    real = format_marker("no-pack", gpu_mem_mib=3000, job_id=4)
    node.job_running(401, comment=real, mps=10, release=release, name=FORGED_NAME,
                     submit_line=f"sbatch --job-name='{FORGED_NAME}' x.sh")
    assert node.run("prolog.sh", 401, gpus="2", pct="10").returncode == 0, node.events()
    assert (node.pipe_root / "jobs" / "401").read_text() == "2 10 3000 2\n"
    node.job_running(402, comment=real, mps=10, release=release, work_dir="/home/u/TresPerNode=mps:100000")
    assert node.run("prolog.sh", 402, gpus="2", pct="10").returncode == 0, node.events()
    assert (node.pipe_root / "jobs" / "402").read_text() == "2 10 3000 2\n"
    # A job with no marker of its own gets no fence from one its name carries.
    node.job_running(403, comment="", mps=10, release=release, name=FORGED_NAME)
    assert node.run("prolog.sh", 403, gpus="2", pct="10").returncode == 0
    assert (node.pipe_root / "jobs" / "403").read_text() == "2 10 0 2\n"


def test_prolog_caps_every_value(node):
    """Thread share within 1..100 whatever the count or Slurm's variable say; a fence at most
    the site's largest GPU (80 GiB in site-config/site.toml)."""
    cases = [  # tres_per_node, Slurm's percentage, comment -> record
        ("gres:mps:a:500,gres:mps:b:50", "10", "", "1 100 0 2\n"),  # summed, then capped
        ("gres:mps:a:30,gres:mps:b:20", "10", "", "1 50 0 2\n"),  # typed entries add up
        ("gres:mps:0", "10", "", "1 1 0 2\n"),
        ("gres:gpu:1", "99999999999999999999", "", "1 100 0 2\n"),  # no mps count: env, capped
        ("gres:mps:10", "10", format_marker("no-pack", gpu_mem_mib=999999999), "1 10 81920 2\n"),
        ("gres:mps:10", "10", "slurm-dlrm:mode=no-pack,gpu_mem_mib=3000\nComment=x", "1 10 0 2\n"),
        ("gres:mps:10", "10", "slurm-dlrm:mode=no-pack,gpu_mem_mib=3000 TresPerNode=gres:mps:100", "1 10 0 2\n"),
        # What job_submit.lua admits gets its fence, never none: empty items, leading zeros.
        ("gres:mps:10", "10", "slurm-dlrm:mode=no-pack,,gpu_mem_mib=03000,", "1 10 3000 2\n"),
        ("gres:mps:10", "10", "slurm-dlrm:mode=no-pack,gpu_mem_mib=0000000000003000", "1 10 3000 2\n"),
    ]
    for job, (tres, pct, comment, record) in enumerate(cases, start=410):
        node.job_running(job, comment=comment, tres_per_node=tres)
        assert node.run("prolog.sh", job, pct=pct).returncode == 0, node.events()
        assert (node.pipe_root / "jobs" / str(job)).read_text() == record, (tres, pct, comment)
    assert "held to 81920 MiB" in node.events()


def test_epilog_takes_no_job_state_from_the_users_text(node):
    """A running job named like a finished one keeps its record and its daemon."""
    node.job_running(421)
    assert node.run("prolog.sh", 421).returncode == 0
    pid = node.daemon_pid(1)
    node.job_running(422, name="x JobState=COMPLETED Reason=None")
    assert node.run("prolog.sh", 422).returncode == 0
    assert node.run("epilog.sh", 421).returncode == 0
    assert "dropping job 422" not in node.events()
    assert (node.pipe_root / "gpu1" / "jobs" / "422").exists()
    assert node.daemon_pid(1) == pid


def _reach(uid: int, pipe: Path) -> bool:
    """Whether a process of `uid` can reach the daemon's socket in `pipe`."""
    probe = "import os, sys; sys.exit(0 if os.access(sys.argv[1] + '/control', os.F_OK) else 3)"
    return subprocess.run(["setpriv", f"--reuid={uid}", "--regid=65534", "--clear-groups",  # noqa: S603,S607
                           sys.executable, "-c", probe, str(pipe)], timeout=30).returncode == 0


@pytest.mark.skipif(os.getuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_pipe_folders_reach_only_the_gpus_users(short_root):
    """Issue 32 item 10: a GPU's pipe folder stays root's (1700: users cannot replace the
    daemon's socket or PID file) with an ACL entry for each user with a job on that GPU,
    dropped when their last job there ends; nobody else reaches the daemon."""
    if shutil.which("setfacl") is None:
        pytest.skip("setfacl (acl) not installed: scripts/setup.sh installs it")
    node = Node(short_root / "n")
    try:
        node.job_running(431)
        assert node.run("prolog.sh", 431, gpus="1", SLURM_JOB_UID=str(NOBODY)).returncode == 0, node.events()
        pipe = node.pipe_root / "gpu1" / "pipe"
        st = pipe.stat()
        assert st.st_uid == 0 and st.st_mode & 0o1000 and not st.st_mode & 0o007
        assert _reach(NOBODY, pipe) and not _reach(1000, pipe)
        node.job_running(432)
        assert node.run("prolog.sh", 432, gpus="1", SLURM_JOB_UID="1000").returncode == 0, node.events()
        assert _reach(1000, pipe) and not _reach(1001, pipe)
        assert node.run("epilog.sh", 432).returncode == 0
        assert not _reach(1000, pipe) and _reach(NOBODY, pipe)
    finally:
        node.kill_daemons()


@pytest.mark.skipif(os.getuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_without_acls_the_gpus_first_user_owns_its_pipe_folder(short_root):
    """No ACLs on the node: the folder is 0700 and owned by the first user with a job on
    the GPU; a second user cannot reach it (events.log says so), and a PID file that user
    writes there is not taken for the daemon's."""
    node = Node(short_root / "n")
    # setfacl there but refused (a filesystem without ACLs) reads as no setfacl.
    (node.bin / "setfacl").write_text('#!/bin/bash\n[[ $1 == --version ]] && exit 0\necho "Operation not supported" >&2\nexit 1\n')
    (node.bin / "setfacl").chmod(0o755)
    try:
        node.job_running(441)
        assert node.run("prolog.sh", 441, gpus="1", SLURM_JOB_UID=str(NOBODY)).returncode == 0, node.events()
        pipe = node.pipe_root / "gpu1" / "pipe"
        assert (pipe.stat().st_mode & 0o7777, pipe.stat().st_uid) == (0o700, NOBODY)
        assert _reach(NOBODY, pipe) and not _reach(1000, pipe)
        node.job_running(442)
        assert node.run("prolog.sh", 442, gpus="1", SLURM_JOB_UID="1000").returncode == 0, node.events()
        assert not _reach(1000, pipe)
        assert "uid 1000 cannot reach the MPS daemon without ACLs" in node.events()
        # The owner swaps the PID file for one naming GPU 2's daemon (another user's job):
        # the epilog must not signal it.
        node.job_running(443)
        assert node.run("prolog.sh", 443, gpus="2", SLURM_JOB_UID="1001").returncode == 0, node.events()
        other = node.daemon_pid(2)
        pid_file = pipe / "nvidia-cuda-mps-control.pid"
        real = node.daemon_pid(1)
        pid_file.unlink()
        pid_file.write_text(f"{other}\n")
        os.chown(pid_file, NOBODY, NOBODY)
        assert node.run("epilog.sh", 442).returncode == 0
        assert node.run("epilog.sh", 441).returncode == 0
        assert real is not None and wait_gone(real)  # stopped by quit on its socket, not by that PID
        assert other is not None and alive(other) and node.daemon_pid(2) == other
    finally:
        node.kill_daemons()


@pytest.mark.skipif(os.getuid() != 0, reason="clients of another user need root to start")
def test_v3_daemon_serves_no_client_from_a_server_of_another_uid(short_root):
    """Issue 32 item 11, the fake as the real daemon: a client reaches only a server of its
    own uid (nvidia-cuda-mps-control(1)). Pointing CUDA_MPS_PIPE_DIRECTORY at another user's
    server socket is refused; a same-uid client may pick a sibling socket (NVIDIA's
    "Namespace Routing": the socket selects), which is why a user's own jobs are not fenced
    from each other (docs/admin.md "Threat model")."""
    node = Node(short_root, fake="v3")
    try:
        node.job_running(311, comment=format_marker("no-pack", gpu_mem_mib=3000, job_id=4))
        assert node.run("prolog.sh", 311, SLURM_JOB_UID=str(NOBODY)).returncode == 0, node.events()
        pipe = node.pipe_root / "gpu1" / "pipe"
        server_socket_dir = pipe / f"uid{NOBODY}"
        refused = _client_as(0, server_socket_dir, None)  # root passes the folder, not the daemon
        assert "not the uid 65534" in refused["refused"]
        own = _client_as(NOBODY, server_socket_dir, "0=99999M")
        assert own["server"] == f"uid{NOBODY}" and own["effective_limit_mib"] == 3000
        assert [c["uid"] for c in _fake_state(node, 1)["clients"].values()] == [NOBODY]  # root's not recorded
        if shutil.which("setfacl") is not None:  # a second user's job on the GPU reaches the folder
            node.job_running(312, comment=format_marker("no-pack", gpu_mem_mib=2000, job_id=5))
            assert node.run("prolog.sh", 312, SLURM_JOB_UID="1000").returncode == 0, node.events()
            assert "refused" in _client_as(1000, server_socket_dir, None)
            assert _client_as(1000, pipe, None)["server"] == "uid1000"  # its own server, by uid
    finally:
        node.kill_daemons()
