"""The training runner end to end on the CPU: metrics, checkpoints, signals, exact
resume, exit codes."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

pytest.importorskip("torchrec")
spec_mod = pytest.importorskip("slurm_dlrm.spec")

import torch  # noqa: E402

from slurm_dlrm.cli import cli  # noqa: E402
from slurm_dlrm.errors import (  # noqa: E402
    ENV_CHECKPOINT_DIR,
    ENV_METRICS_FILE,
    TRAIN_EXIT_BAD_SPEC,
    TRAIN_EXIT_FAILED,
    TRAIN_EXIT_OK,
    TRAIN_EXIT_OOM_GPU,
    TRAIN_EXIT_OOM_HOST,
    TRAIN_EXIT_PREEMPTED,
    SpecError,
)
from slurm_dlrm.train import checkpoint as ckpt  # noqa: E402
from slurm_dlrm.train.runner import RunOptions, exit_code_for, run  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# The runner's model backends (docs/runner.md). Every test here passed on both; CI runs
# the cheap ones on both (in-process runs, one signal test) and the torch backend's own
# multi-rank and no-torchrec tests below, to stay inside its time budget.
BACKENDS = ["torchrec", "torch"]
CONTRACT_FIELDS = {"t", "step", "samples_per_s", "step_time_s", "loss", "peak_gpu_bytes", "peak_tensor_bytes", "rss_bytes"}


def tiny(**over) -> dict:
    d = {
        "name": "tiny",
        "tables": [
            {"rows": 400, "dim": 8, "pooling_factor": 2.0},
            {"rows": 300, "dim": 8, "multi_hot": 3},
            {"rows": 50, "dim": 8},
        ],
        "dense_features": 13,
        "bottom_mlp": [16, 8],
        "top_mlp": [16, 1],
        "batch_size": 32,
        "optimizer": {"type": "adagrad", "lr": 0.05},
        "steps": 24,
        "seed": 1,
        "loader_workers": 0,
        "checkpoint_every_steps": 5,
        "metrics_every_steps": 4,
        "eval": {"every_steps": 12, "batches": 2},
    }
    d.update(over)
    return d


def lines(path: Path) -> list[dict]:
    """The training progress lines (held-out evaluations apart: `evals`)."""
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("type") != "eval"]


def evals(path: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines()) if r.get("type") == "eval"}


def _run(tmp: Path, spec: dict, **opts) -> int:
    return run(spec_mod.parse_spec(spec), RunOptions(metrics_file=tmp / "metrics.jsonl",
                                                       checkpoint_dir=tmp / "ckpt", tty=False, **opts))


@pytest.mark.parametrize("backend", BACKENDS)
def test_trains_on_cpu_and_writes_metrics(tmp_path: Path, backend: str, caplog):
    caplog.set_level(logging.INFO, logger="slurm_dlrm.train")
    assert _run(tmp_path, tiny(backend=backend)) == TRAIN_EXIT_OK
    assert caplog.text.count(f"backend {backend} (spec)") == 1  # said once in the job's log
    recs = lines(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in recs] == [4, 8, 12, 16, 20, 24]
    for r in recs:
        assert CONTRACT_FIELDS <= set(r)
        assert r["samples_per_s"] > 0 and r["step_time_s"] > 0
        assert r["peak_gpu_bytes"] is None  # CPU
        # tables + Adagrad state alone are (400+300+50)*8*4*2 bytes
        assert r["peak_tensor_bytes"] >= 750 * 8 * 4 * 2
        assert r["rss_bytes"] > 10 * 2**20
    assert recs[-1]["loss_avg"] < recs[0]["loss_avg"]  # it learns
    # Held-out evaluations every 12 steps and at the end, on 2 batches of 32.
    ev = evals(tmp_path / "metrics.jsonl")
    assert sorted(ev) == [12, 24]
    for r in ev.values():
        assert r["eval_samples"] == 64 and 0.0 <= r["eval_auc"] <= 1.0 and r["eval_ne"] > 0
        assert 0.5 < r["planted_auc"] <= 1.0  # synthetic data: the planted model's AUC
    # every 5 steps plus the final one, newest 2 kept
    assert [s for s, _ in ckpt.list_steps(tmp_path / "ckpt")] == [24, 20]
    # Rerun: already done. --no-resume: starts over and drops the old checkpoints.
    assert _run(tmp_path, tiny(backend=backend)) == TRAIN_EXIT_OK
    assert len(lines(tmp_path / "metrics.jsonl")) == 6
    assert _run(tmp_path, tiny(steps=7, backend=backend), resume=False) == TRAIN_EXIT_OK
    assert [s for s, _ in ckpt.list_steps(tmp_path / "ckpt")] == [7, 5]
    assert [r["step"] for r in lines(tmp_path / "metrics.jsonl")][6:] == [4, 7]


@pytest.mark.parametrize("backend, optimizer", [
    ("torchrec", {"type": "adagrad", "lr": 0.05}),  # fused TBE kernels, optimizer in backward
    ("torchrec", {"type": "adam", "lr": 0.01}),  # no fused Adam on the CPU: DENSE kernel + torch.optim.Adam
    ("torch", {"type": "adagrad", "lr": 0.05}),  # sparse table gradients + torch Adagrad
    ("torch", {"type": "adam", "lr": 0.01}),  # SparseAdam: its int step counts travel in the checkpoint
    ("torch", {"type": "rowwise_adagrad", "lr": 0.05, "fused": False}),  # dense table gradients
])
def test_interrupted_and_resumed_run_is_exact(tmp_path: Path, backend: str, optimizer: dict):
    spec = tiny(optimizer=optimizer, backend=backend)
    assert _run(tmp_path / "a", spec) == TRAIN_EXIT_OK
    # Stop after step 13 (as SIGTERM would): checkpoint at 13, exit 5; then resume.
    assert _run(tmp_path / "b", spec, stop_after_step=13) == TRAIN_EXIT_PREEMPTED
    assert [s for s, _ in ckpt.list_steps(tmp_path / "b" / "ckpt")] == [13, 10]
    assert _run(tmp_path / "b", spec) == TRAIN_EXIT_OK
    full = {r["step"]: r["loss"] for r in lines(tmp_path / "a" / "metrics.jsonl")}
    resumed = {r["step"]: r["loss"] for r in lines(tmp_path / "b" / "metrics.jsonl")}
    assert set(resumed) == {4, 8, 12, 16, 20, 24}
    for step in (16, 20, 24):
        assert resumed[step] == full[step], step
    # Held-out metrics too, bit for bit: at 12 (before the stop) and 24 (after the resume).
    strip = ("t", "eval_s")
    full_ev, resumed_ev = evals(tmp_path / "a" / "metrics.jsonl"), evals(tmp_path / "b" / "metrics.jsonl")
    assert sorted(resumed_ev) == [12, 24]
    for step in (12, 24):
        assert {k: v for k, v in resumed_ev[step].items() if k not in strip} == \
            {k: v for k, v in full_ev[step].items() if k not in strip}, step


def test_corrupt_newest_checkpoint_is_skipped_on_resume(tmp_path: Path, caplog):
    caplog.set_level(logging.INFO, logger="slurm_dlrm.train")
    spec = tiny()
    assert _run(tmp_path / "a", spec) == TRAIN_EXIT_OK
    assert _run(tmp_path / "b", spec, stop_after_step=13, keep_checkpoints=3) == TRAIN_EXIT_PREEMPTED
    newest = tmp_path / "b" / "ckpt" / "step-000000013" / "rank0.bin"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x55
    newest.write_bytes(bytes(data))
    (tmp_path / "b" / "metrics.jsonl").unlink()
    assert _run(tmp_path / "b", spec) == TRAIN_EXIT_OK
    assert "step-000000013 skipped" in caplog.text
    assert "resumed from" in caplog.text and "step 10" in caplog.text
    full = {r["step"]: r["loss"] for r in lines(tmp_path / "a" / "metrics.jsonl")}
    resumed = {r["step"]: r["loss"] for r in lines(tmp_path / "b" / "metrics.jsonl")}
    assert min(resumed) == 12  # restarted from 10, first report at 12
    assert resumed[24] == full[24]


def test_criteo_npy_epochs_and_synchronous_checkpoints(tmp_path: Path):
    import numpy as np

    n = 100
    rng = np.random.default_rng(0)
    np.save(tmp_path / "day_0_dense.npy", rng.standard_normal((n, 13)).astype(np.float32))
    np.save(tmp_path / "day_0_sparse.npy", rng.integers(0, 2**31, (n, 26)))
    np.save(tmp_path / "day_0_labels.npy", rng.integers(0, 2, (n, 1)).astype(np.int32))
    spec = tiny(tables=[{"rows": 100, "dim": 8}] * 26, steps=None, epochs=2, batch_size=16,
                data={"type": "criteo-npy", "path": str(tmp_path)}, checkpoint_every_steps=4,
                metrics_every_steps=3, loader_workers=2, eval={"holdout": 0.2, "every_steps": 0})
    assert _run(tmp_path, spec, async_checkpoint_max_bytes=0) == TRAIN_EXIT_OK
    # The last 20 samples are held out: 80 make 5 batches of 16 per epoch, 10 steps for 2.
    assert [r["step"] for r in lines(tmp_path / "metrics.jsonl")] == [3, 6, 9, 10]
    assert [s for s, _ in ckpt.list_steps(tmp_path / "ckpt")] == [10, 8]
    (ev,) = evals(tmp_path / "metrics.jsonl").values()
    assert ev["step"] == 10 and ev["eval_samples"] == 16 and "planted_auc" not in ev


def test_bad_spec_exits_2_before_importing_torch(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(tiny(batch_size=0)))
    result = CliRunner().invoke(cli, ["train", str(bad)])
    assert result.exit_code == TRAIN_EXIT_BAD_SPEC
    assert "batch_size" in result.output
    argv = [sys.executable, "-m", "slurm_dlrm.train", str(tmp_path / "nope.yaml")]
    missing = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=REPO)  # noqa: S603
    assert missing.returncode == TRAIN_EXIT_BAD_SPEC
    assert "nope.yaml" in missing.stderr


def test_data_that_does_not_fit_the_spec_is_a_bad_spec(tmp_path: Path):
    tsv = tmp_path / "day_0"
    tsv.write_text("1\t" + "\t".join(["1"] * 13 + ["a"] * 26) + "\n")
    spec = tiny(dense_features=5, data={"type": "criteo-tsv", "path": str(tsv)}, bottom_mlp=[8])
    assert _run(tmp_path, spec) == TRAIN_EXIT_BAD_SPEC


def test_exit_codes_for_failures():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert exit_code_for(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"), cuda) == TRAIN_EXIT_OOM_GPU
    assert exit_code_for(torch.OutOfMemoryError("DefaultCPUAllocator: can't allocate memory"), cuda) == TRAIN_EXIT_OOM_HOST
    assert exit_code_for(MemoryError(), cpu) == TRAIN_EXIT_OOM_HOST
    assert exit_code_for(SpecError("tables", "x"), cpu) == TRAIN_EXIT_BAD_SPEC
    assert exit_code_for(RuntimeError("boom"), cpu) == TRAIN_EXIT_FAILED


def _wait_for_metrics(path: Path, proc: subprocess.Popen, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return
        if proc.poll() is not None:
            raise AssertionError(f"runner exited early with {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}")
        time.sleep(0.1)
    raise AssertionError("no metrics line in time")


@pytest.mark.parametrize("backend", BACKENDS)
def test_sigterm_mid_run_checkpoints_exits_5_and_restart_resumes(tmp_path: Path, backend: str):
    spec_path = tmp_path / "s.yaml"
    spec_path.write_text(yaml.safe_dump(tiny(steps=1_000_000, checkpoint_every_steps=0, metrics_every_steps=2,
                                             backend=backend)))
    env = dict(os.environ, **{ENV_METRICS_FILE: str(tmp_path / "m.jsonl"), ENV_CHECKPOINT_DIR: str(tmp_path / "ck")})
    env["PYTHONPATH"] = str(REPO)
    argv = [sys.executable, "-m", "slurm_dlrm", "train", str(spec_path)]
    proc = subprocess.Popen(argv, env=env, cwd=tmp_path,  # noqa: S603
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_metrics(tmp_path / "m.jsonl", proc)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == TRAIN_EXIT_PREEMPTED, err
    steps = ckpt.list_steps(tmp_path / "ck")
    assert len(steps) == 1
    stopped_at = steps[0][0]
    assert f"checkpoint at step {stopped_at}" in out
    assert ckpt.verify(steps[0][1], {"world_size": 1}).step == stopped_at
    # Restart with a run length just past the checkpoint: it resumes, does not restart.
    again = subprocess.run([*argv,  # noqa: S603
                            "--steps", str(stopped_at + 2)], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == TRAIN_EXIT_OK, again.stderr
    assert f"resumed from {steps[0][1]} (step {stopped_at})" in again.stderr
    assert lines(tmp_path / "m.jsonl")[-1]["step"] == stopped_at + 2


def test_one_rank_skips_ddps_unused_parameter_walk(tmp_path: Path):
    # issue 47: find_unused_parameters walks the autograd graph every step (3-6 % of a
    # small model's step, benchmarks/runner_overhead.py); it keeps several ranks' bucket
    # order for a bit-exact resume (issue 48), which one rank has no use for.
    from slurm_dlrm.train.runner import StopFlag, setup, teardown

    opts = RunOptions(metrics_file=tmp_path / "m.jsonl", checkpoint_dir=tmp_path / "ckpt", resume=False, tty=False)
    trainer = setup(spec_mod.parse_spec(tiny()), opts, StopFlag())
    try:
        ddp = [m for m in trainer.built.model.modules() if isinstance(m, torch.nn.parallel.DistributedDataParallel)]
        assert ddp and not any(m.find_unused_parameters for m in ddp)
    finally:
        teardown(trainer)


def test_world_size_2_launches_two_ranks_and_checkpoints_both(tmp_path: Path):
    spec_path = tmp_path / "s.yaml"
    spec_path.write_text(yaml.safe_dump(tiny(world_size=2, steps=6, checkpoint_every_steps=3, metrics_every_steps=3)))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", ENV_METRICS_FILE, ENV_CHECKPOINT_DIR):
        env.pop(var, None)
    done = subprocess.run([sys.executable,  # noqa: S603
                           "-m", "slurm_dlrm.train", str(spec_path), "--metrics-file",
                           str(tmp_path / "m.jsonl")], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert done.returncode == TRAIN_EXIT_OK, done.stderr[-3000:]
    recs = lines(tmp_path / "m.jsonl")  # rank 0 reports for the job
    assert [r["step"] for r in recs] == [3, 6] and recs[0]["world_size"] == 2
    # every rank's peaks, gathered into rank 0's lines (acct's RankMaxRSS..., issue 48)
    assert all(len(r["rank_peak_rss_bytes"]) == 2 and min(r["rank_peak_rss_bytes"]) > 0 for r in recs), recs
    assert recs[-1]["rank_peak_rss_bytes"][0] == recs[-1]["peak_rss_bytes"] and min(recs[-1]["rank_peak_tensor_bytes"]) > 0
    assert recs[-1]["rank_peak_gpu_bytes"] == [None, None]  # the CPU
    found = ckpt.newest_valid(tmp_path / "ckpt", {"world_size": 2})
    assert found is not None and found.step == 6
    assert {"rank0.bin", "rank1.bin", "rank0.json", "rank1.json"} <= set(found.manifest["files"])


def test_a_rank_that_sees_one_gpu_gets_its_shards_on_cuda_0(monkeypatch):
    """A pack's agent gives each rank its own GPU (CUDA_VISIBLE_DEVICES=<one>): torchrec must
    then place every rank's shards on cuda:0, not cuda:<rank> (issue 18)."""
    from torchrec.distributed.sharding_plan import placement

    from slurm_dlrm.errors import BadInput
    from slurm_dlrm.train.runner import pick_device, sharding_local_size

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    local = sharding_local_size(torch.device("cuda", 0), local_world_size=2)
    assert local == 1 and placement("cuda", 1, local) == "rank:1/cuda:0"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)  # torchrun: every rank sees the node's GPUs
    local = sharding_local_size(torch.device("cuda", 1), local_world_size=2)
    assert local == 2 and placement("cuda", 1, local) == "rank:1/cuda:1"
    assert sharding_local_size(torch.device("cpu"), 2) == 2
    if not torch.cuda.is_available():  # fake GPUs: CUDA_VISIBLE_DEVICES set, no device
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
        assert pick_device("auto", 1) == torch.device("cpu")  # the CPU, with gloo
        with pytest.raises(BadInput, match="no CUDA device is visible"):
            pick_device("cuda", 0)  # a bad-spec exit 2 from the runner


def test_eval_stop_when_ends_the_run_completed_and_a_restart_trains_no_further(tmp_path: Path, caplog):
    """Issue 39: eval.stop_when (here a target any model reaches at the first evaluation)
    ends the run with exit 0, a checkpoint and a `"type": "stop"` line saying why; a
    restart (requeue) does not train on."""
    spec = tiny(eval={"every_steps": 8, "batches": 1, "stop_when": {"metric": "auc", "target": 0.01}})
    assert _run(tmp_path, spec) == TRAIN_EXIT_OK
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    stop = [r for r in recs if r.get("type") == "stop"]
    assert len(stop) == 1 and stop[0]["step"] == 8 and "reached the target 0.01" in stop[0]["reason"]
    assert max(r["step"] for r in recs) == 8  # no step after it
    assert [s for s, _ in ckpt.list_steps(tmp_path / "ckpt")][0] == 8
    n_lines = len(recs)
    with caplog.at_level(logging.INFO):
        assert _run(tmp_path, spec) == TRAIN_EXIT_OK
    assert "eval.stop_when stopped it at step 8" in caplog.text
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == n_lines


def test_torch_backend_ranks_keep_one_model_and_resume_exactly(tmp_path: Path):
    """backend torch over 2 ranks (DDP over gloo, sparse table gradients): a run stopped
    at step 4 and resumed reports the losses of an uninterrupted run, and both ranks'
    checkpoints hold the same tables (DDP keeps the replicas equal)."""
    spec_path = tmp_path / "s.yaml"
    spec_path.write_text(yaml.safe_dump(tiny(world_size=2, steps=8, checkpoint_every_steps=4, metrics_every_steps=2,
                                             backend="torch")))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", ENV_METRICS_FILE, ENV_CHECKPOINT_DIR):
        env.pop(var, None)

    def train(run: str, *extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "slurm_dlrm.train", str(spec_path),  # noqa: S603
                               "--metrics-file", str(tmp_path / run / "m.jsonl"), *extra],
                              env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180)

    full = train("a")
    assert full.returncode == TRAIN_EXIT_OK, full.stderr[-3000:]
    first = train("b", "--steps", "4")
    assert first.returncode == TRAIN_EXIT_OK, first.stderr[-3000:]
    again = train("b")
    assert again.returncode == TRAIN_EXIT_OK, again.stderr[-3000:]
    assert "resumed from" in again.stderr
    want = {r["step"]: r["loss"] for r in lines(tmp_path / "a" / "m.jsonl")}
    got = {r["step"]: r["loss"] for r in lines(tmp_path / "b" / "m.jsonl")}
    assert got[6] == want[6] and got[8] == want[8]
    found = ckpt.newest_valid(tmp_path / "a" / "ckpt", {"world_size": 2})
    assert found is not None
    r0, r1 = ckpt.read_rank(found, 0), ckpt.read_rank(found, 1)
    tables = [k for k in r0 if ".tables." in k and k.startswith("model/")]
    assert tables and all(torch.equal(r0[k], r1[k]) for k in tables)


def test_torch_backend_trains_where_torchrec_does_not_import(tmp_path: Path):
    """A GPU machine with plain PyTorch (no torchrec, no fbgemm-gpu): `backend: auto`
    resolves to torch, says why once, and the runner trains and checkpoints."""
    hider = tmp_path / "hide"
    hider.mkdir()
    (hider / "sitecustomize.py").write_text(
        "import sys\nfor name in ('torchrec', 'fbgemm_gpu'):\n    sys.modules[name] = None\n")
    spec_path = tmp_path / "s.yaml"
    spec_path.write_text(yaml.safe_dump(tiny(steps=6, checkpoint_every_steps=3, metrics_every_steps=3)))
    env = dict(os.environ, PYTHONPATH=f"{hider}:{REPO}")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", ENV_METRICS_FILE, ENV_CHECKPOINT_DIR):
        env.pop(var, None)
    done = subprocess.run([sys.executable, "-m", "slurm_dlrm.train", str(spec_path),  # noqa: S603
                           "--metrics-file", str(tmp_path / "m.jsonl")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == TRAIN_EXIT_OK, done.stderr[-3000:]
    assert done.stderr.count("backend torch (auto: fbgemm-gpu does not import") == 1
    assert [r["step"] for r in lines(tmp_path / "m.jsonl")] == [3, 6]


def test_a_checkpoint_of_another_world_size_is_one_clear_line_not_a_silent_restart(tmp_path: Path, caplog):
    """Issue 48: checkpoints are not resharded; a run on another world size says so and
    exits 2 instead of starting over at step 0 (which would drop the training done)."""
    assert _run(tmp_path, tiny(steps=5, checkpoint_every_steps=5)) == TRAIN_EXIT_OK
    (newest,) = [p for _, p in ckpt.list_steps(tmp_path / "ckpt")][:1]
    manifest = json.loads((newest / "manifest.json").read_text())
    (newest / "manifest.json").write_text(json.dumps(dict(manifest, world_size=4)))  # as 4 ranks wrote it
    with caplog.at_level(logging.ERROR, logger="slurm_dlrm.train"):
        assert _run(tmp_path, tiny(steps=10, checkpoint_every_steps=5)) == TRAIN_EXIT_BAD_SPEC
    assert "checkpoint at step 5" in caplog.text and "world_size is 4, this run has 1" in caplog.text
    assert _run(tmp_path, tiny(steps=10, checkpoint_every_steps=5), resume=False) == TRAIN_EXIT_OK


def test_teardown_frees_the_model_before_the_process_group(tmp_path: Path, monkeypatch):
    """In-process runs (tests, the selftest probe, benchmarks) tear down: DDP's Reducer must
    be gone before the group is destroyed, or ~ProcessGroupGloo runs inside the Reducer's
    dealloc with the GIL held and can deadlock a gloo worker (tests/test_train_teardown.py)."""
    import gc
    import weakref

    from slurm_dlrm.train import runner as runner_mod
    from slurm_dlrm.train.runner import StopFlag, setup, teardown

    if runner_mod.dist.is_initialized():  # an earlier test's group: setup must make (and own) its own
        runner_mod.dist.destroy_process_group()
    opts = RunOptions(metrics_file=tmp_path / "m.jsonl", checkpoint_dir=tmp_path / "ckpt", resume=False, tty=False)
    trainer = setup(spec_mod.parse_spec(tiny()), opts, StopFlag())
    assert trainer.dist_info.owns_group
    ddp = [weakref.ref(m) for m in trainer.built.model.modules() if isinstance(m, torch.nn.parallel.DistributedDataParallel)]
    assert ddp
    seen: list[bool] = []
    real = runner_mod.dist.destroy_process_group

    def destroy(*args, **kwargs):
        gc.collect()
        seen.append(all(r() is None for r in ddp))
        return real(*args, **kwargs)

    monkeypatch.setattr(runner_mod.dist, "destroy_process_group", destroy)
    teardown(trainer)
    assert seen == [True]
