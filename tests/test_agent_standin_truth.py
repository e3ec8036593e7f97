"""Stand-in members that slow each other down as a co-location truth says (issue 29
item 1; slurm_dlrm/emulated/registry.py): each step's time is the solo step over the
member's speed under the truth, with what shares its fake GPU at that moment."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_dlrm.emulated.registry import GpuRegistry, gpu_name
from slurm_dlrm.emulated.standin.__main__ import speeds_under
from slurm_dlrm.interference_io import parse_truth
from slurm_dlrm.packing.interference import predict_speeds_from_fractions

STEP_S = 0.1


def _launch(tmp: Path, job_id: int, gpu: int, sm: float, bw: float, steps: int, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(gpu), SLURMD_NODENAME="nodeT",
               SLURM_DLRM_STANDIN_REGISTRY=str(tmp / "registry"), SLURM_DLRM_JOB_ID=str(job_id),
               SLURM_DLRM_METRICS_FILE=str(tmp / f"m{job_id}.jsonl"))
    env.pop("CUDA_MPS_PIPE_DIRECTORY", None)
    return subprocess.Popen([sys.executable, "-m", "slurm_dlrm.emulated.standin", "--steps", str(steps),  # noqa: S603
                             "--step-s", str(STEP_S), "--truth", "synthetic", "--sm-pct", str(sm),
                             "--bw-pct", str(bw), *extra], env=env)


def _step_times(tmp: Path, job_id: int) -> list[float]:
    return [json.loads(line)["step_time_s"] for line in (tmp / f"m{job_id}.jsonl").read_text().splitlines()]


def test_two_standins_on_one_fake_gpu_slow_each_other_as_the_truth_says(tmp_path):
    truth = parse_truth("synthetic")
    expected = predict_speeds_from_fractions([0.8, 0.3], [0.3, 0.8], truth)
    assert max(expected) < 0.9  # the truth does slow this pair down
    procs = [_launch(tmp_path, 1, 0, 80, 30, 12), _launch(tmp_path, 2, 0, 30, 80, 12),
             _launch(tmp_path, 3, 1, 80, 30, 12)]  # job 3 alone on GPU 1: solo speed
    for p in procs:
        assert p.wait(timeout=60) == 0
    for job_id, speed in ((1, expected[0]), (2, expected[1]), (3, 1.0)):
        median = statistics.median(_step_times(tmp_path, job_id))
        assert median == pytest.approx(STEP_S / speed, rel=0.2), (job_id, median, STEP_S / speed)
    assert not list((tmp_path / "registry").rglob("*.json"))  # each left the registry on exit


def test_a_member_runs_solo_once_its_co_runner_ends(tmp_path):
    truth = parse_truth("synthetic")
    (slow, _) = predict_speeds_from_fractions([0.8, 0.8], [0.3, 0.3], truth)
    short = _launch(tmp_path, 1, 0, 80, 30, 4)
    long = _launch(tmp_path, 2, 0, 80, 30, 30)
    assert short.wait(timeout=60) == 0 and long.wait(timeout=60) == 0
    times = _step_times(tmp_path, 2)
    assert statistics.median(times[:3]) == pytest.approx(STEP_S / slow, rel=0.25)
    assert statistics.median(times[-10:]) == pytest.approx(STEP_S, rel=0.2)  # alone now


def test_a_dead_members_entry_does_not_slow_the_gpu(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    folder = tmp_path / "nodeT" / "gpu0"
    folder.mkdir(parents=True)
    (folder / f"{dead.pid}.json").write_text(json.dumps({"pid": dead.pid, "sm_util_pct": 90, "membw_util_pct": 90}))
    env = {"SLURMD_NODENAME": "nodeT", "CUDA_VISIBLE_DEVICES": "0"}
    with GpuRegistry(tmp_path, gpu_name(env), "5", 80.0, 30.0) as reg:
        assert [int(e["pid"]) for e in reg.live()] == [os.getpid()]
        assert reg.speed(speeds_under("synthetic")) == 1.0


def test_gpu_name_follows_the_fake_mps_daemons_device_list(tmp_path):
    (tmp_path / "fake-mps-state.json").write_text(json.dumps({"running": True, "visible_devices": [2, 3]}))
    env = {"SLURMD_NODENAME": "node2", "CUDA_VISIBLE_DEVICES": "1", "CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}
    assert gpu_name(env) == "node2/gpu3"
    assert gpu_name({"SLURMD_NODENAME": "node2", "CUDA_VISIBLE_DEVICES": "1"}) == "node2/gpu1"


def test_standin_memory_follows_the_true_peak_and_a_bad_truth_is_refused(tmp_path):
    p = _launch(tmp_path, 7, 0, 10, 10, 400, "--peak-mib", "96", "--peak-at-step", "2")
    try:
        deadline = time.monotonic() + 20
        rss_kib = 0
        while time.monotonic() < deadline and rss_kib < 96 * 1024:
            status = Path(f"/proc/{p.pid}/status").read_text()
            rss_kib = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS")))
            time.sleep(0.1)
        assert rss_kib >= 96 * 1024
    finally:
        p.kill()
        p.wait()
    bad = subprocess.run([sys.executable, "-m", "slurm_dlrm.emulated.standin", "--truth", "nope"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--truth" in bad.stderr
