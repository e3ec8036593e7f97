"""The agent inside a real (local) Slurm allocation, with the fake NVML and fake MPS control.

A pack of 4 members on 2 GPUs of one node: each member runs as its own job step with
its own environment, the MPS daemon is started and quit, samples arrive, a member that
outgrows its host memory is stopped while the others finish, and `scancel --signal=TERM`
of the allocation leaves checkpoints.
"""

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_dlrm.agent.reports import read_reports
from slurm_dlrm.emulated import mps_control as fake_mps_control
from slurm_dlrm.emulated import nvml as fake_nvml
from slurm_dlrm.emulated.standin import member_entry, placement_dict

pytestmark = pytest.mark.slurm
ROOT = Path(__file__).resolve().parents[1]


def _pack(tmp_path: Path, members: list[dict], agent_args: tuple[str, ...] = (), nodes: int = 1,
          **kw) -> tuple[Path, str]:
    """Write placement + scenario; return (pack_dir, batch script)."""
    pack = tmp_path / "pack"
    pack.mkdir()
    fake_mps_control.install_launcher(tmp_path / "bin")
    scenario = tmp_path / "nvml.json"
    scenario.write_text(json.dumps({"gpu_count": 4}))
    placement = tmp_path / "placement.json"
    placement.write_text(json.dumps(placement_dict(pack, members, **kw)))
    q = shlex.quote
    script = "\n".join([
        "#!/bin/bash",
        f"#SBATCH --output={q(str(tmp_path / 'slurm-%j.out'))}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --gres=gpu:2",
        "#SBATCH --time=5",
        f"export PATH={q(str(tmp_path / 'bin'))}:\"$PATH\"",
        f"export {fake_nvml.ENV_FAKE_NVML}={q(str(scenario))}",
        f"export PYTHONPATH={q(str(ROOT))}",
        f"export TMPDIR={q(str(tmp_path))}",
        "unset CUDA_MPS_PIPE_DIRECTORY",
        f"srun --ntasks-per-node=1 {q(sys.executable)} -m slurm_dlrm -v agent --pack-file {q(str(placement))} --json "
        + " ".join(q(a) for a in agent_args),
        "",
    ])
    return pack, script


def _members(pack: Path, tmp_path: Path, steps: int, step_s: float, grow_job: int | None) -> list[dict]:
    out = []
    for job in (1, 2, 3, 4):
        args = ["--steps", str(steps), "--step-s", str(step_s), "--env-out", str(tmp_path / f"env-{job}.json")]
        limit = 512
        if job == grow_job:
            args += ["--grow-mib-per-step", "16"]
            limit = 100
        out.append(member_entry(pack, job, (job - 1) // 2, host_mem_limit_mib=limit, gpu_mem_limit_mib=1000 * job,
                                mps_thread_pct=20 * job, args=args))
    return out


def _dead(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"


def _slurm_out(tmp_path: Path) -> str:
    return "\n".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))


@pytest.mark.torch  # one member (tiny-a) is a real `slurm-dlrm train`
def test_pack_of_four_on_two_gpus(slurm_cluster, tmp_path):
    pack_members = _members(tmp_path / "pack", tmp_path, steps=30, step_s=0.1, grow_job=3)
    # Member 4 is the real runner: `slurm-dlrm train` on a tiny spec (CPU torch here). It
    # trains long enough (seconds) for the 0.5 s sampler to catch its throughput: since a
    # finished runner leaves without the interpreter's teardown, 20 steps (~0.1 s) ended
    # before any sample saw a fresh metrics line.
    pack_members[3].update(name="tiny-a", host_mem_limit_bytes=3 << 30, command=[
        sys.executable, "-m", "slurm_dlrm", "train", str(ROOT / "examples" / "sweep" / "tiny-a.yaml"),
        "--steps", "1500"])
    pack, script = _pack(tmp_path, pack_members, ("--launch", "step"), sample_interval_s=0.5)
    client = slurm_cluster.client()
    job_id = client.sbatch(script)
    info = slurm_cluster.wait([job_id], timeout_s=240)[job_id]
    out = _slurm_out(tmp_path)
    assert info.slurm_state == "COMPLETED", out
    summary = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    assert summary["members"] == {"1": "COMPLETED", "2": "COMPLETED", "3": "OOM_HOST", "4": "COMPLETED"}, out
    assert summary["mps"] == "own"

    envs = {job: json.loads((tmp_path / f"env-{job}.json").read_text())["env"] for job in (1, 2, 3)}
    for job, env in envs.items():
        assert env["CUDA_VISIBLE_DEVICES"] == str((job - 1) // 2)  # position in the daemon's GPU list
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == str(20 * job)
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={1000 * job}M"
        assert env["SLURM_DLRM_JOB_ID"] == str(job)
        assert env["SLURM_DLRM_CHECKPOINT_DIR"] == pack_members[job - 1]["checkpoint_dir"]
        assert env["SLURM_JOB_ID"] == str(job_id)
    steps = {env["SLURM_STEP_ID"] for env in envs.values()}
    assert len(steps) == 3 and "0" not in steps  # each member is its own step; step 0 is the agent
    assert list((pack / "job-4" / "ckpt").iterdir())  # the runner checkpointed where the agent said

    (report,) = (pack / "reports").glob("*.jsonl")
    recs = read_reports(report)
    events = [r for r in recs if r["type"] == "agent"]
    # fence_env_only: MPS v2 (the fake's default driver), the fence is the members' environment
    assert [e["event"] for e in events] == ["start", "mps_started", "fence_env_only", "closed", "mps_stopped", "exit"]
    assert recs[-1]["event"] == "exit"
    daemon_pid = events[1]["daemon_pid"]
    assert daemon_pid and _dead(daemon_pid)  # the daemon was quit
    assert not list(tmp_path.glob("mps-*"))  # and its folders removed
    samples = [r for r in recs if r["type"] == "sample"]
    assert {r["gpu_index"] for r in samples if r["job_id"] is None} == {0, 1}
    for job in (1, 2, 4):
        mine = [r for r in samples if r["job_id"] == job]
        assert mine and any(r["rss_bytes"] for r in mine) and any(r["samples_per_s"] for r in mine)
        assert any(r["gpu_mem_bytes"] for r in mine)  # the fake NVML saw the step's process on its GPU
    oom = [r for r in recs if r["type"] == "member" and r["job_id"] == 3 and r["state"] == "OOM_HOST"]
    assert oom and "host RSS" in oom[0]["reason"]

    if slurm_cluster.accounting:
        names = set()
        deadline = time.monotonic() + 20
        while not {"standin-1", "tiny-a"} <= names and time.monotonic() < deadline:
            rows = subprocess.run(["sacct", "-j", str(job_id), "-n", "-P", "-o", "JobID,JobName,State"],  # noqa: S603
                                  capture_output=True, text=True, timeout=30, check=False).stdout
            names = {line.split("|")[1] for line in rows.splitlines() if "|" in line}
            time.sleep(1)
        assert {"standin-1", "standin-2", "standin-3", "tiny-a"} <= names


@pytest.mark.parametrize("launch,signal,final", [
    ("auto", "TERM", "PREEMPTED"),  # members are child processes: each gets the SIGTERM
    ("step", "USR1", "PREEMPTED"),  # members are steps: srun forwards SIGUSR1 (SIGTERM it turns into SIGKILL)
])
def test_scancel_signal_leaves_checkpoints(slurm_cluster, tmp_path, launch, signal, final):
    pack_members = _members(tmp_path / "pack", tmp_path, steps=100000, step_s=0.1, grow_job=None)
    pack, script = _pack(tmp_path, pack_members, ("--launch", launch), sample_interval_s=0.5, term_grace_s=20)
    client = slurm_cluster.client()
    job_id = client.sbatch(script)
    metrics = [Path(m["metrics_path"]) for m in pack_members]
    deadline = time.monotonic() + 90
    while not all(p.exists() and p.stat().st_size > 0 for p in metrics):
        assert time.monotonic() < deadline, _slurm_out(tmp_path)
        time.sleep(0.5)
    client.scancel([job_id], signal=signal)
    slurm_cluster.wait([job_id], timeout_s=90)
    out = _slurm_out(tmp_path)
    for m in pack_members:
        ckpt = json.loads((Path(m["checkpoint_dir"]) / "checkpoint.json").read_text())
        assert ckpt["step"] > 0, out
    (report,) = (pack / "reports").glob("*.jsonl")
    recs = read_reports(report)
    finals = {r["job_id"]: r["state"] for r in recs if r["type"] == "member" and r["state"] != "RUNNING"}
    assert finals == {1: final, 2: final, 3: final, 4: final}, out
    assert recs[-1]["type"] == "agent" and recs[-1]["event"] == "exit"
    summary = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    assert summary["launch"] == ("process" if launch == "auto" else launch)


def test_two_nodes_one_agent_each(slurm_cluster, tmp_path):
    pack = tmp_path / "pack"
    members = [member_entry(pack, job, 0, node_index=job % 2, args=[
        "--steps", "15", "--step-s", "0.1", "--env-out", str(tmp_path / f"env-{job}.json")]) for job in (1, 2, 3, 4)]
    pack, script = _pack(tmp_path, members, ("--launch", "step"), nodes=2, sample_interval_s=0.5)
    job_id = slurm_cluster.client().sbatch(script.replace("#SBATCH --gres=gpu:2", "#SBATCH --gres=gpu:1"))
    info = slurm_cluster.wait([job_id], timeout_s=120)[job_id]
    out = _slurm_out(tmp_path)
    assert info.slurm_state == "COMPLETED", out
    reports = {p.stem: read_reports(p) for p in (pack / "reports").glob("*.jsonl")}
    assert len(reports) == 2, out  # one report file per node
    by_node = {}
    for node, recs in reports.items():
        finals = {r["job_id"]: r["state"] for r in recs if r["type"] == "member" and r["state"] != "RUNNING"}
        by_node[node] = finals
        assert set(finals.values()) == {"COMPLETED"} and recs[-1]["event"] == "exit"
    assert sorted(sorted(f) for f in by_node.values()) == [[1, 3], [2, 4]]  # node index 1 ran 1 and 3
    for job in (1, 2, 3, 4):
        env = json.loads((tmp_path / f"env-{job}.json").read_text())["env"]
        assert env["SLURM_DLRM_JOB_ID"] == str(job) and env["CUDA_VISIBLE_DEVICES"] == "0"
