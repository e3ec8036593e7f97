"""Model quality of the demo-sized spec (`slurm-dlrm spec --example`) on synthetic data
with a planted model (issue 39), the cost of evaluating, and whether packing changes
a result.

Runs (`slurm-dlrm train` processes on the CPU, one torch thread each, so that a run
is bitwise reproducible):

  alone     the example spec, evaluated every 20 steps (the AUC curve)
  packed    the same spec at the same time as two neighbours (other seeds and learning
            rates) on the same cores, as members of a pack share a node
  default   the example spec as printed (the default eval interval)
  baseline  the same with `eval: false`

Figures: planted_auc (the planted model's AUC on the held-out set: the best any model
can reach), reached_auc (the last evaluation of `alone`), steps_to_within_2pct (first
evaluation within 2% of the planted AUC), eval_overhead_pct (seconds spent evaluating
/ seconds training, both measured inside `default`; the wall-clock difference against
`baseline` is printed beside it, noisier on a shared machine), packed_equals_alone (1
when every evaluation of `packed` equals `alone`'s bit for bit).

Run: .venv/bin/python benchmarks/eval_quality.py
Last line: `eval_quality: planted_auc= reached_auc= steps_to_within_2pct= eval_overhead_pct= packed_equals_alone=`
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from slurm_dlrm.commands.spec import EXAMPLE  # noqa: E402

CURVE_EVERY_STEPS = 20
# what an evaluation record must repeat exactly (its time stamp and duration aside)
VOLATILE = ("t", "eval_s")


def start(spec: dict[str, Any], workdir: Path) -> subprocess.Popen[str]:
    workdir.mkdir(parents=True)
    spec_file = workdir / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # bitwise: same thread count
    argv = [sys.executable, "-m", "slurm_dlrm.train", str(spec_file), "--device", "cpu",
            "--metrics-file", str(workdir / "metrics.jsonl"), "--checkpoint-dir", str(workdir / "ckpt")]
    return subprocess.Popen(argv, cwd=workdir, env=env, stdout=subprocess.DEVNULL,  # noqa: S603
                            stderr=(workdir / "stderr.log").open("w"), text=True)


def finish(proc: subprocess.Popen[str], workdir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]], float]:
    t0 = time.perf_counter()
    code = proc.wait(timeout=1800)
    if code != 0:
        sys.exit(f"eval_quality: {workdir.name} exited {code}: {(workdir / 'stderr.log').read_text()[-2000:]}")
    recs = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    return ([r for r in recs if r.get("type") != "eval"], [r for r in recs if r.get("type") == "eval"],
            time.perf_counter() - t0)


def run(spec: dict[str, Any], workdir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]], float, float]:
    """(progress lines, eval lines, wall seconds, start-up seconds: process start to the first step)"""
    t0, epoch0 = time.perf_counter(), time.time()
    train, evals, _ = finish(start(spec, workdir), workdir)
    first = train[0]
    startup_s = first["t"] - first["step_time_s"] * first["step"] - epoch0
    return train, evals, time.perf_counter() - t0, startup_s


def training_s(train: list[dict[str, Any]]) -> float:
    """Seconds of training: each progress window's step time x its steps (evaluations excluded)."""
    total, prev = 0.0, 0
    for r in train:
        total += r["step_time_s"] * (r["step"] - prev)
        prev = r["step"]
    return total


def stable(evals: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in e.items() if k not in VOLATILE} for e in evals]


def main() -> None:
    base = yaml.safe_load(EXAMPLE)
    base["checkpoint_every_steps"] = 0  # not what is measured here
    curve = {**copy.deepcopy(base), "eval": {"every_steps": CURVE_EVERY_STEPS}}
    neighbours = [{**copy.deepcopy(curve), "name": f"neighbour-{i}", "seed": 10 + i,
                   "optimizer": {"type": "adagrad", "lr": lr}} for i, lr in enumerate((0.05, 0.003))]
    with tempfile.TemporaryDirectory(prefix="eval-quality-") as tmp:
        root = Path(tmp)
        _, alone, _, _ = run(curve, root / "alone")
        procs = [(start(s, root / f"packed-{i}"), root / f"packed-{i}") for i, s in enumerate([curve, *neighbours])]
        packed = [finish(p, d)[1] for p, d in procs]
        default_train, default_evals, default_wall, default_start = run(base, root / "default")
        base_train, base_evals, base_wall, base_start = run({**base, "eval": False}, root / "baseline")

    planted = float(alone[-1]["planted_auc"])
    reached = float(alone[-1]["eval_auc"])
    within = next((e["step"] for e in alone if e["eval_auc"] >= 0.98 * planted), None)
    eval_s = sum(e["eval_s"] for e in default_evals)
    overhead_pct = 100.0 * eval_s / training_s(default_train)
    equal = int(stable(packed[0]) == stable(alone) and len(alone) > 0)
    assert not base_evals

    print(f"spec: slurm-dlrm spec --example ({base['steps']} steps, batch {base['batch_size']}, "
          f"{len(base['tables'])} tables), synthetic data with a planted model; CPU, 1 torch thread per job")
    print(f"{'step':>6} {'auc':>8} {'ne':>8} {'log_loss':>9}   (alone, eval every {CURVE_EVERY_STEPS} steps)")
    for e in alone:
        print(f"{e['step']:>6} {e['eval_auc']:>8.4f} {e['eval_ne']:>8.4f} {e['eval_log_loss']:>9.4f}")
    print(f"planted model AUC {planted:.4f} (the best reachable); reached {reached:.4f} "
          f"({100 * (planted - reached) / planted:.2f}% below); within 2% from step {within}")
    print("neighbours' last AUC: " + ", ".join(f"{p[-1]['eval_auc']:.4f}" for p in packed[1:]))
    print(f"default interval ({len(default_evals)} evaluation(s) of {default_evals[0]['eval_samples']:,} samples): "
          f"{eval_s:.3f} s evaluating, {training_s(default_train):.2f} s training -> {overhead_pct:.2f}%")
    print(f"  wall clock of the whole run: {default_wall:.1f} s with eval, {base_wall:.1f} s baseline (eval: false), "
          f"{100 * (default_wall / base_wall - 1):+.1f}% (start-up and noise included)")
    print(f"  start-up to the first step: {default_start:.1f} s with eval, {base_start:.1f} s baseline "
          "(evaluation imports torchrec.metrics, which imports torchmetrics: 2-4 s, in a thread during the build)")
    print(f"  training samples/s: {statistics.median(r['samples_per_s'] for r in default_train):,.0f} with eval, "
          f"{statistics.median(r['samples_per_s'] for r in base_train):,.0f} baseline (median of the windows)")
    print(f"packed with 2 neighbours vs alone: {len(packed[0])} evaluations, "
          f"{'identical bit for bit' if equal else 'DIFFERENT'}")
    print(f"eval_quality: planted_auc={planted:.4f} reached_auc={reached:.4f} steps_to_within_2pct={within} "
          f"eval_overhead_pct={overhead_pct:.2f} packed_equals_alone={equal}")


if __name__ == "__main__":
    main()
