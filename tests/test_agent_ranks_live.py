"""A 2-rank DLRM job packed beside two single-GPU members on the local Slurm cluster
(issue 18): the real agent in a real allocation of 2 (fake) GPUs, the ranks are real
`slurm-dlrm train` processes (gloo on the CPU), the neighbours stand-ins.

Run 1: every rank sees its own GPU and fence and the job's one MASTER_PORT; SIGKILL to
rank 1 -> the agent stops rank 0, the neighbours keep running; the job is reported once,
FAILED with `requeue`. Run 2 (the placement the service writes for the requeued job, same
checkpoint folder): both ranks resume from the checkpoint; a cancel reaches both ranks,
which checkpoint together and stop.
"""

import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path

import pytest
import yaml

from slurm_dlrm.agent.reports import read_reports
from slurm_dlrm.emulated import mps_control as fake_mps_control
from slurm_dlrm.emulated import nvml as fake_nvml
from slurm_dlrm.emulated.standin import member_entry, placement_dict, rank_entries

pytestmark = [pytest.mark.slurm, pytest.mark.torch]
ROOT = Path(__file__).resolve().parents[1]
JOB = 5  # the 2-rank job; 6 and 7 are the single-GPU neighbours


def _spec(tmp_path: Path) -> Path:
    spec = yaml.safe_load((ROOT / "examples" / "sweep" / "tiny-a.yaml").read_text())
    spec.update(name="tiny-ranks", world_size=2, steps=100000, checkpoint_every_steps=5, metrics_every_steps=5)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _placement(tmp_path: Path, run: int, spec: Path) -> tuple[Path, Path, list[dict]]:
    pack = tmp_path / f"pack-{run}"
    pack.mkdir()
    job_dir = tmp_path / "job-5"  # per job, not per pack: a requeued job resumes from it
    ranks = rank_entries(member_entry(pack, JOB, 0, host_mem_limit_mib=3072, args=[]), [0, 1],
                         gpu_mem_limit_mib=[3000, 4000], mps_thread_pct=[40, 60])
    for r in ranks:
        r.update(name="tiny-ranks", command=[sys.executable, "-m", "slurm_dlrm", "train", str(spec)],
                 checkpoint_dir=str(job_dir / "ckpt"), metrics_path=str(job_dir / "metrics.jsonl"))
    singles = [member_entry(pack, job, job - 6, gpu_mem_limit_mib=1000, mps_thread_pct=30,
                            args=["--steps", "100000", "--step-s", "0.1"]) for job in (6, 7)]
    members = [*ranks, *singles] if run == 1 else ranks
    placement = tmp_path / f"placement-{run}.json"
    placement.write_text(json.dumps(placement_dict(pack, members, sample_interval_s=0.5, term_grace_s=30)))
    return pack, placement, members


def _script(tmp_path: Path, placement: Path) -> str:
    q = shlex.quote
    return "\n".join([
        "#!/bin/bash",
        f"#SBATCH --output={q(str(tmp_path / 'slurm-%j.out'))}",
        "#SBATCH --nodes=1",
        "#SBATCH --gres=gpu:2",
        "#SBATCH --time=10",
        f"export PATH={q(str(tmp_path / 'bin'))}:\"$PATH\"",
        f"export {fake_nvml.ENV_FAKE_NVML}={q(str(tmp_path / 'nvml.json'))}",
        f"export PYTHONPATH={q(str(ROOT))}",
        f"export TMPDIR={q(str(tmp_path))}",
        "unset CUDA_MPS_PIPE_DIRECTORY",
        f"srun --ntasks-per-node=1 {q(sys.executable)} -m slurm_dlrm -v agent --pack-file {q(str(placement))} --json",
        "",
    ])


def _job_procs(job: int, tmp: Path) -> dict[int, dict[str, str]]:
    """pid -> environment of the live processes the agent launched for `job` (read from
    /proc, not from the agent's own reports; the runner's children are left out). Only
    this test's (TMPDIR = its tmp_path, from the batch script): another run on the machine
    may have a job of the same number."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            raw = (d / "environ").read_bytes()
            stat = (d / "stat").read_text()
        except OSError:
            continue
        env = dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)
        if env.get("SLURM_DLRM_JOB_ID") == str(job) and env.get("TMPDIR") == str(tmp) \
                and stat.rpartition(")")[2].split()[0] != "Z":
            if int(stat.rpartition(")")[2].split()[3]) == int(d.name):  # a process group leader
                out[int(d.name)] = env
    return out


def _wait(what, cond, timeout_s: float, out) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{out()}"
        time.sleep(0.5)


def _records(pack: Path) -> list[dict]:
    files = list((pack / "reports").glob("*.jsonl")) if (pack / "reports").exists() else []
    return read_reports(files[0]) if files else []


def _ckpt_steps(tmp_path: Path) -> list[int]:
    d = tmp_path / "job-5" / "ckpt"
    return sorted(int(p.name.split("-")[1]) for p in d.glob("step-*")) if d.exists() else []


def test_two_rank_job_beside_two_single_members(slurm_cluster, tmp_path):
    fake_mps_control.install_launcher(tmp_path / "bin")
    (tmp_path / "nvml.json").write_text(json.dumps({"gpu_count": 4}))
    spec = _spec(tmp_path)
    client = slurm_cluster.client()

    def out() -> str:
        text = "\n".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))
        logs = "\n".join(p.read_text()[-3000:] for p in (tmp_path / "job-5").glob("output-*.log"))
        return text + "\n--- job 5 output ---\n" + logs

    # ---- run 1: placement, fences, a rank killed
    pack, placement, members = _placement(tmp_path, 1, spec)
    sid = client.sbatch(_script(tmp_path, placement))
    _wait("job 5's first checkpoint", lambda: _ckpt_steps(tmp_path), 300, out)
    ranks = _job_procs(JOB, tmp_path)
    assert len(ranks) == 2, ranks
    by_rank = {env["RANK"]: (pid, env) for pid, env in ranks.items()}
    envs = {r: by_rank[r][1] for r in ("0", "1")}
    assert [envs[r]["CUDA_VISIBLE_DEVICES"] for r in ("0", "1")] == ["0", "1"]  # its own GPU
    assert [envs[r]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] for r in ("0", "1")] == ["0=3000M", "0=4000M"]  # own fence
    assert [envs[r]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] for r in ("0", "1")] == ["40", "60"]
    assert {envs[r]["WORLD_SIZE"] for r in envs} == {"2"} and {envs[r]["MASTER_ADDR"] for r in envs} == {"127.0.0.1"}
    assert envs["0"]["MASTER_PORT"] == envs["1"]["MASTER_PORT"]
    neighbours = {job: _job_procs(job, tmp_path) for job in (6, 7)}
    assert [next(iter(n.values()))["CUDA_VISIBLE_DEVICES"] for n in neighbours.values()] == ["0", "1"]
    metrics = [r for r in map(json.loads, (tmp_path / "job-5" / "metrics.jsonl").read_text().splitlines())
               if "type" not in r][-1]  # the last progress line (an evaluation has its own)
    assert metrics["world_size"] == 2 and metrics["device"] == "cpu"  # gloo on the CPU, fake GPUs

    os.kill(by_rank["1"][0], signal.SIGKILL)
    _wait("job 5's end record", lambda: any(r["type"] == "member" and r["job_id"] == JOB and r["state"] != "RUNNING"
                                            for r in _records(pack)), 120, out)
    assert not _job_procs(JOB, tmp_path)  # rank 0 was stopped too
    assert {job: len(_job_procs(job, tmp_path)) for job in (6, 7)} == {6: 1, 7: 1}  # the neighbours run on
    sizes = {job: Path(members[job - 4]["metrics_path"]).stat().st_size for job in (6, 7)}
    time.sleep(2)
    assert all(Path(members[job - 4]["metrics_path"]).stat().st_size > sizes[job] for job in (6, 7))
    for job in (6, 7):
        (pack / "cancel").mkdir(exist_ok=True)
        (pack / "cancel" / str(job)).touch()
    info = slurm_cluster.wait([sid], timeout_s=120)[sid]
    assert info.slurm_state == "COMPLETED", out()
    recs = _records(pack)
    (end,) = [r for r in recs if r["type"] == "member" and r["job_id"] == JOB and r["state"] != "RUNNING"]
    assert (end["state"], end["rank"], end["exit_code"], end["requeue"]) == ("FAILED", 1, 137, True), end
    assert "rank 1: killed by SIGKILL" in end["reason"]
    rank_ends = {r["rank"]: r for r in recs if r["type"] == "rank"}
    # rank 0 got the agent's SIGTERM; gloo may fail its pending collective first (exit 1)
    assert rank_ends[1]["state"] == "FAILED" and rank_ends[0]["state"] in ("CANCELLED", "FAILED")
    assert rank_ends[0]["t"] >= rank_ends[1]["t"]
    summary = json.loads([line for line in out().splitlines() if line.startswith("{")][-1])
    assert summary["members"] == {"5": "FAILED", "6": "CANCELLED", "7": "CANCELLED"}
    stopped_at = _ckpt_steps(tmp_path)[-1]

    # ---- run 2: the requeued job resumes from its checkpoint; a cancel reaches both ranks
    pack2, placement2, _ = _placement(tmp_path, 2, spec)
    sid2 = client.sbatch(_script(tmp_path, placement2))
    _wait("a checkpoint after the resume", lambda: _ckpt_steps(tmp_path)[-1] > stopped_at, 300, out)
    assert len(_job_procs(JOB, tmp_path)) == 2
    (pack2 / "cancel").mkdir()
    (pack2 / "cancel" / str(JOB)).touch()
    slurm_cluster.wait([sid2], timeout_s=120)
    log = "\n".join(p.read_text() for p in (tmp_path / "job-5").glob("output-*.log"))
    assert f"(step {stopped_at})" in log.split("resumed from", 1)[1].splitlines()[0], out()
    recs = _records(pack2)
    rank_ends = sorted((r["rank"], r["state"], r["exit_code"]) for r in recs if r["type"] == "rank")
    assert rank_ends == [(0, "CANCELLED", 5), (1, "CANCELLED", 5)], out()  # both checkpointed and stopped
    (end,) = [r for r in recs if r["type"] == "member" and r["job_id"] == JOB and r["state"] != "RUNNING"]
    assert end["state"] == "CANCELLED" and "requeue" not in end
