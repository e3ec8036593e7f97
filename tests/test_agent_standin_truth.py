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


def _lines(tmp: Path, job_id: int) -> list[dict]:
    path = tmp / f"m{job_id}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_two_standins_on_one_fake_gpu_slow_each_other_as_the_truth_says(tmp_path):
    truth = parse_truth("synthetic")
    expected = predict_speeds_from_fractions([0.8, 0.3], [0.3, 0.8], truth)
    assert max(expected) < 0.9  # the truth does slow this pair down
    procs = [_launch(tmp_path, 1, 0, 80, 30, 20), _launch(tmp_path, 2, 0, 30, 80, 20),
             _launch(tmp_path, 3, 1, 80, 30, 12)]  # job 3 alone on GPU 1: solo speed
    for p in procs:
        assert p.wait(timeout=60) == 0
    # Only the steps both ran together count: on a busy machine one process may start
    # a second after the other (Slurm 26.05 leg, load ~10: a median of 0.17 s, not 0.13).
    one, two = _lines(tmp_path, 1), _lines(tmp_path, 2)
    together_from = max(one[0]["t"], two[0]["t"]) + STEP_S / min(expected)  # its first may have begun alone
    together_to = min(one[-1]["t"], two[-1]["t"])
    for job_id, speed in ((1, expected[0]), (2, expected[1]), (3, 1.0)):
        lines = _lines(tmp_path, job_id)
        times = [r["step_time_s"] for r in lines if job_id == 3 or together_from < r["t"] <= together_to]
        assert len(times) >= 3, (job_id, len(times))
        median = statistics.median(times)
        assert median == pytest.approx(STEP_S / speed, rel=0.2), (job_id, median, STEP_S / speed)
    assert not list((tmp_path / "registry").rglob("*.json"))  # each left the registry on exit


def test_a_member_runs_solo_once_its_co_runner_ends(tmp_path):
    """The steps are told apart by when they ran, not by their order: on a busy machine
    one process may start a second after the other (then "its first 3 steps" were solo)."""
    truth = parse_truth("synthetic")
    (slow, _) = predict_speeds_from_fractions([0.8, 0.8], [0.3, 0.3], truth)
    long = _launch(tmp_path, 2, 0, 80, 30, 40)
    deadline = time.monotonic() + 60
    while not _lines(tmp_path, 2) and time.monotonic() < deadline and long.poll() is None:
        time.sleep(0.05)
    assert _lines(tmp_path, 2), "the long member never stepped"
    short = _launch(tmp_path, 1, 0, 80, 30, 6)
    assert short.wait(timeout=60) == 0 and long.wait(timeout=60) == 0
    short_lines = _lines(tmp_path, 1)
    together_from, together_to = short_lines[0]["t"], short_lines[-1]["t"]
    long_lines = _lines(tmp_path, 2)
    # a step of the long member that ended while the short one was stepping ran beside it
    # (its start is one step earlier: skip the first, which may have begun alone)
    together = [r["step_time_s"] for r in long_lines if together_from + STEP_S / slow < r["t"] <= together_to]
    alone = [r["step_time_s"] for r in long_lines if r["t"] > together_to + 0.5]
    assert len(together) >= 2 and len(alone) >= 5, (len(together), len(alone))
    assert statistics.median(together) == pytest.approx(STEP_S / slow, rel=0.25)
    assert statistics.median(alone[-10:]) == pytest.approx(STEP_S, rel=0.2)  # alone now


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


def test_a_standins_device_memory_is_what_the_fake_nvml_reports_not_its_rss(tmp_path, monkeypatch):
    # 40 GiB of device memory on a 24 GiB machine: only the registry can hold it.
    from slurm_dlrm.agent.nvml import Nvml
    from slurm_dlrm.emulated import nvml as fake_nvml

    scenario = tmp_path / "nvml.json"
    scenario.write_text(json.dumps({"gpu_count": 2}))
    monkeypatch.setenv(fake_nvml.ENV_FAKE_NVML, str(scenario))
    monkeypatch.setenv("SLURMD_NODENAME", "nodeT")
    p = _launch(tmp_path, 8, 1, 10, 10, 400, "--gpu-peak-mib", "40960", "--peak-at-step", "2")
    try:
        nv = Nvml()
        assert nv.init()
        deadline = time.monotonic() + 20
        seen = 0
        while time.monotonic() < deadline and seen < 40 << 30:
            seen = nv.sample([0, 1]).by_pid().get(p.pid, None)
            seen = (seen.gpu_mem_bytes or 0) if seen is not None else 0
            time.sleep(0.1)
        assert seen == 40 << 30
        status = Path(f"/proc/{p.pid}/status").read_text()
        assert int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS"))) < 1 << 20
    finally:
        p.kill()
        p.wait()


def test_a_standin_past_its_mps_memory_limit_exits_as_a_cuda_oom(tmp_path):
    from slurm_dlrm.errors import TRAIN_EXIT_OOM_GPU

    env_limit = ["--set-env", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=3000M"]
    over = _launch(tmp_path, 9, 0, 10, 10, 20, "--gpu-peak-mib", "3100", "--peak-at-step", "4", *env_limit)
    under = _launch(tmp_path, 10, 1, 10, 10, 20, "--gpu-peak-mib", "2900", "--peak-at-step", "4", *env_limit)
    assert over.wait(timeout=60) == TRAIN_EXIT_OOM_GPU
    assert under.wait(timeout=60) == 0
    # it reached past 3000 MiB at its 4th step: three steps were done before it died
    assert [json.loads(x)["step"] for x in (tmp_path / "m9.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_metrics_every_k_steps_keeps_the_step_count_and_time(tmp_path):
    t0 = time.monotonic()
    p = _launch(tmp_path, 11, 2, 10, 10, 45, "--metrics-every", "10")
    assert p.wait(timeout=60) == 0
    lines = [json.loads(x) for x in (tmp_path / "m11.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [10, 20, 30, 40, 45]
    assert lines[0]["step_time_s"] == pytest.approx(STEP_S, rel=0.3)  # per step, not per line
    assert time.monotonic() - t0 >= 45 * STEP_S
    bad = subprocess.run([sys.executable, "-m", "slurm_dlrm.emulated.standin", "--gpu-peak-mib", "5"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--gpu-peak-mib" in bad.stderr


def test_a_standins_checkpoint_is_never_ahead_of_its_metrics(tmp_path, monkeypatch):
    # The agent SIGKILLs a member over its host budget at any instant: a checkpoint
    # written before its step's metrics line left the next run resuming past a step the
    # metrics never showed (issue 43 item 14). Each checkpoint must find its step's line.
    import slurm_dlrm.emulated.standin as standin

    metrics = tmp_path / "m.jsonl"
    monkeypatch.setenv("SLURM_DLRM_METRICS_FILE", str(metrics))
    monkeypatch.setenv("SLURM_DLRM_CHECKPOINT_DIR", str(tmp_path / "ckpt"))
    monkeypatch.delenv("RANK", raising=False)
    seen: list[tuple[int, int]] = []
    real = standin._checkpoint

    def checkpoint(ckpt_dir, step):
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        seen.append((step, json.loads(lines[-1])["step"] if lines else 0))
        real(ckpt_dir, step)

    monkeypatch.setattr(standin, "_checkpoint", checkpoint)
    assert standin.main(["--steps", "7", "--step-s", "0", "--checkpoint-every", "2"]) == 0
    assert seen == [(2, 2), (4, 4), (6, 6), (7, 7)]
