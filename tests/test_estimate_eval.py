"""Issue 51: the estimate counts the held-out evaluation the runner does (on by default),
and `eval: false` estimates the training step exactly as before."""

from __future__ import annotations

import copy

import pytest
from click.testing import CliRunner

from slurm_dlrm.cli import cli
from slurm_dlrm.estimate import estimate
from slurm_dlrm.estimate.analytic import EVAL_LIBRARY_BYTES, device_tables, synthetic_pool_bytes
from slurm_dlrm.estimate.timeline import simulate_step
from slurm_dlrm.estimate.timeline_eval import (
    EVAL_OUTPUTS,
    METRICS_F64_PER_SAMPLE,
    eval_host_parts,
    simulate_eval,
)
from slurm_dlrm.estimate.timeline_torch import simulate_step as simulate_torch_step
from slurm_dlrm.presets import PRESET_NAMES
from slurm_dlrm.site import REPO_SITE_FILE, load_site
from slurm_dlrm.spec import parse_spec

H100 = load_site(REPO_SITE_FILE).gpu_models["h100"]

SMALL = {
    "name": "s",
    "tables": [{"rows": 1000, "dim": 16}, {"rows": 2000, "dim": 16}, {"rows": 500, "dim": 16}],
    "dense_features": 13,
    "bottom_mlp": [64, 16],
    "top_mlp": [32, 1],
    "batch_size": 256,
    "optimizer": {"type": "sgd"},
    "prefetch_batches": 0,
}


def small(**over):
    d = copy.deepcopy(SMALL)
    d.update(over)
    return parse_spec(d)


# Peaks of live tensor bytes of the runner's run WITH its evaluation (the spec's default:
# at the last step here), measured with benchmarks/_measure.py (3 steps; the runner's
# HeldOut, Evaluator and predict_clicks; torch 2.13 CPU, torchrec 1.8, fbgemm-gpu-cpu
# 1.8). Each is a spec whose evaluation is its peak: the old estimate (the training step
# alone) was 55% and 4% under them. (Before the harness made the source's batches
# outside its tracker, these read 3 x batch x 4 bytes higher: 13599369, 13391320, 400876;
# before one rank's DDP dropped find_unused_parameters, the first read 64 bytes higher,
# its Reducer's int32 local-used map and device copy for 8 dense parameters: 13550217.)
MEASURED_EVAL = [
    ({"batch_size": 4096, "eval": {"batches": 32}}, 13550153),
    ({"batch_size": 4096, "eval": {"batches": 32}, "backend": "torch"}, 13342168),
    ({"tables": [{"rows": 1000, "dim": 16, "dtype": "fp16", "pooling_factor": 3.0}, {"rows": 2000, "dim": 16}],
      "optimizer": {"type": "rowwise_adagrad"}, "mixed_precision": "fp16", "backend": "torch"}, 397804),
]


@pytest.mark.parametrize("over, measured", MEASURED_EVAL)
def test_matches_measured_peaks_with_evaluation(over, measured):
    est = estimate(small(**over), None)
    # never under where the evaluation is the peak (issue 51), and within 0.01%
    assert 0 <= est.tensor_peak_bytes - measured < 1e-4 * measured, (est.tensor_peak_bytes, measured)
    assert est.peak_phase.startswith("evaluation"), est.peak_phase
    # the training step alone is well under what the job allocates
    assert estimate(small(**{**over, "eval": False}), None).tensor_peak_bytes < 0.97 * measured


@pytest.mark.torch
def test_never_under_where_the_evaluation_is_the_peak_measured_now():
    """The benchmark's child (benchmarks/_measure.py) on a spec whose evaluation is its
    peak, with the current runner code: the estimate is not under it by a byte, and the
    model's state after the build is counted to the byte (but the 12 bytes the first step
    adds: the runner's running loss, torchrec's output dist). Failed before: the harness
    counted each step's ring entry's planted P(click) as live (4 x 4096 x 4 bytes here)
    and the fused kernels' small buffers were an allowance 100-1,300 bytes short."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("torchrec")
    from slurm_dlrm.estimate.timeline import static_parts

    d = copy.deepcopy(SMALL)
    d.update(batch_size=4096, eval={"batches": 32}, optimizer={"type": "adagrad"},
             tables=[{"rows": 1000, "dim": 16}, {"rows": 2000, "dim": 16}, {"rows": 500, "dim": 16},
                     {"rows": 700, "dim": 16}])
    child = Path(__file__).resolve().parent.parent / "benchmarks" / "_measure.py"

    def measure() -> dict:
        out = subprocess.run([sys.executable, str(child), json.dumps(d), "4"], capture_output=True,  # noqa: S603
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    m = measure()
    assert m["peak_phase"] == "eval"
    spec = parse_spec(d)
    est = estimate(spec, None).tensor_peak_bytes
    assert 0 <= est - m["peak_tensor_bytes"] < 1e-4 * m["peak_tensor_bytes"], (est, m["peak_tensor_bytes"])
    st = static_parts(spec, list(range(len(spec.tables))), "cpu")
    counted = sum(getattr(st, f) for f in st.__dataclass_fields__)
    # Once in ~10 runs at load 10-40 the harness's read after the build differed (cause not
    # found: another thread's allocation under the tracker?): a second measurement decides.
    statics = [m["static_tensor_bytes"]]
    if counted - statics[0] != 12:
        statics.append(measure()["static_tensor_bytes"])
    assert counted - statics[-1] == 12, (counted, statics)


@pytest.mark.parametrize("backend", ["torchrec", "torch"])
@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_eval_false_estimates_the_training_step_alone(preset, backend):
    """`eval: false` is today's estimate: the larger of the first and the steady step,
    nothing of an evaluation on the device or the host."""
    spec = parse_spec({"name": "p", "preset": preset, "scale": {"max_rows_per_table": 20000}, "eval": False,
                       "backend": backend})
    replay = simulate_torch_step if backend == "torch" else simulate_step
    for gpu, device in ((None, "cpu"), (H100, "cuda")):
        tables = device_tables(spec, all_placements=gpu is None)
        step = max(replay(spec, device, tables).peak, replay(spec, device, tables, first_step=True).peak)
        est = estimate(spec, gpu)
        assert est.tensor_peak_bytes == step
        assert est.host_breakdown["evaluation"] == 0
        assert not est.peak_phase.startswith("evaluation")
        assert EVAL_OUTPUTS not in est.gpu_breakdown


@pytest.mark.parametrize("backend", ["torchrec", "torch"])
def test_peak_is_the_larger_of_the_step_and_the_evaluation(backend):
    for batches in (1, 8, 64, 512):
        spec = small(backend=backend, eval={"batches": batches})
        est = estimate(spec, None)
        step = estimate(small(backend=backend, eval=False), None).tensor_peak_bytes
        ev = simulate_eval(spec, "cpu").peak
        assert est.tensor_peak_bytes == max(step, ev)
        assert est.peak_phase.startswith("evaluation") == (ev > step)
    # the metrics' float64 temporaries grow with the held-out samples
    assert simulate_eval(small(eval={"batches": 512}), "cpu").at_peak[EVAL_OUTPUTS] >= \
        METRICS_F64_PER_SAMPLE * 8 * 512 * 256


def test_on_a_gpu_the_buffers_and_metrics_are_host_memory():
    """The device holds the held-out batch's copy and the forward; the predictions
    buffer and the metrics are computed on the host (EvalAccumulator's `.cpu()`)."""
    spec = small(eval={"batches": 512})
    est = estimate(spec, H100)
    cpu_eval = simulate_eval(spec, "cpu").peak
    gpu_eval = simulate_eval(spec, "cuda").peak
    assert gpu_eval < cpu_eval - METRICS_F64_PER_SAMPLE * 8 * 512 * 256 // 2
    host = eval_host_parts(spec)
    assert est.host_breakdown["evaluation"] == EVAL_LIBRARY_BYTES + synthetic_pool_bytes(spec) + sum(host.values())
    assert host["metrics"] == METRICS_F64_PER_SAMPLE * 8 * 512 * 256
    # a CPU run counts them in its tensors, not twice
    assert estimate(spec, None).host_breakdown["evaluation"] == EVAL_LIBRARY_BYTES + synthetic_pool_bytes(spec)
    # backend torch evaluates with the plain-torch reference metrics: torchrec.metrics is
    # never imported (estimator_accuracy --backend torch: eval on read +46 MiB RSS over)
    plain = small(eval={"batches": 512}, backend="torch")
    assert estimate(plain, None).host_breakdown["evaluation"] == synthetic_pool_bytes(plain)


def test_several_ranks_rank0_receives_every_ranks_predictions():
    one = simulate_eval(small(eval={"batches": 64}), "cpu").peak
    two = small(eval={"batches": 64}, world_size=2)
    est = estimate(two, None)
    assert est.peak_phase.startswith("evaluation")
    # rank 0 holds both ranks' buffers and computes the metrics over both ranks' samples
    assert simulate_eval(two, "cpu").peak > one + METRICS_F64_PER_SAMPLE * 8 * 64 * 256 // 2


def test_cli_counts_the_evaluation_on_the_host_of_a_gpu_run(tmp_path):
    """On a GPU the device's share of an evaluation (one batch, a forward without
    autograd) stays under the training step; its host side is the `evaluation` line."""
    import json

    p = tmp_path / "s.yaml"
    p.write_text("name: s\ntables: [{rows: 1000, dim: 16}, {rows: 2000, dim: 16}]\ndense_features: 13\n"
                 "bottom_mlp: [64, 16]\ntop_mlp: [32, 1]\nbatch_size: 4096\neval: {batches: 2000}\n")
    off = tmp_path / "off.yaml"
    off.write_text(p.read_text().replace("eval: {batches: 2000}", "eval: false"))
    out = {}
    for name, path in (("on", p), ("off", off)):
        res = CliRunner().invoke(cli, ["estimate", "--site", str(REPO_SITE_FILE), str(path), "--gpu", "h100",
                                       "--no-history", "--json"])
        assert res.exit_code == 0, res.output
        out[name] = json.loads(res.output)[0]["estimates"]["h100"]
    assert out["on"]["gpu_peak_bytes"] == out["off"]["gpu_peak_bytes"]
    assert out["off"]["host_breakdown"]["evaluation"] == 0
    assert out["on"]["host_breakdown"]["evaluation"] > METRICS_F64_PER_SAMPLE * 8 * 2000 * 4096
    assert out["on"]["host_peak_bytes"] - out["off"]["host_peak_bytes"] == out["on"]["host_breakdown"]["evaluation"]
