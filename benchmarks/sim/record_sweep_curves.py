"""Record learning curves of real sweeps for the simulator (issue 47 item 5).

    .venv/bin/python benchmarks/sim/record_sweep_curves.py [--out tests/data/sweep_curves.json]
                                                            [--only NAME] [--steps 540]

Trains every variant of a few sweeps with the project's own runner (`slurm-dlrm train`,
CPU, planted synthetic data, held-out eval every `EVAL_EVERY` steps) and keeps each
variant's eval curve (step, auc, ne) and its median step time, nothing else, as one small
JSON file, with the planted model's AUC on its eval set (the eval set is `EVAL_BATCHES`
batches of the variant's own batch size: variants of other batch sizes are judged on
other samples). slurm_dlrm/sim/sweep_curves.py fits a parametric family to these curves; the
sweeps differ in optimizer, learning rates, batch sizes, embedding dims and planted model
(seed) so that the fit is not one sweep's.

Minutes on an idle laptop core (about 15 s a 540-step variant; 15-20 min on the shared machine); nothing here is read by a test run, the
file it writes is.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
EVAL_EVERY = 20
EVAL_BATCHES = 16

BASE: dict[str, Any] = {
    "tables": [{"name": "t0", "rows": 20000, "dim": 16, "pooling_factor": 1.0},
               {"name": "t1", "rows": 5000, "dim": 16, "pooling_factor": 2.0},
               {"name": "t2", "rows": 1000, "dim": 16, "pooling_factor": 3.0}],
    "dense_features": 13, "bottom_mlp": [64, 16], "top_mlp": [64, 1], "interaction": {"type": "dot"},
    "batch_size": 256, "optimizer": {"type": "adagrad", "lr": 0.01}, "loader_workers": 0,
    "prefetch_batches": 1, "data": {"type": "synthetic", "zipf_alpha": 1.05}, "seed": 0,
    "checkpoint_every_steps": 100000, "metrics_every_steps": EVAL_EVERY,
    "eval": {"every_steps": EVAL_EVERY, "batches": EVAL_BATCHES},
}

# name -> (changes to BASE, the grid: field -> values, steps, eval every). The second and
# third sweeps are shorter: on the shared 2-core machine (load 17) a 540-step run took
# 15-20 minutes, so they ran half the steps with evals twice as often.
SWEEPS: dict[str, tuple[dict[str, Any], dict[str, list[Any]], int, int]] = {
    "adagrad-lr-batch": ({}, {"optimizer.lr": [0.001, 0.003, 0.01, 0.03, 0.1, 0.3], "batch_size": [128, 512]}, 540, 20),
    "sgd-lr": ({"optimizer": {"type": "sgd", "lr": 0.1}, "seed": 1}, {"optimizer.lr": [0.01, 0.1, 0.3, 1.0]}, 270, 10),
    "rowwise-lr-dim8": ({"optimizer": {"type": "rowwise_adagrad", "lr": 0.01}, "seed": 2},
                        {"optimizer.lr": [0.003, 0.01, 0.03, 0.1], "dim": [8]}, 270, 10),
}


def variant_spec(name: str, changes: dict[str, Any], values: dict[str, Any], every: int = EVAL_EVERY) -> dict[str, Any]:
    spec = copy.deepcopy(BASE)
    spec.update(copy.deepcopy(changes))
    spec["name"] = name
    spec["metrics_every_steps"] = every
    spec["eval"] = {**spec["eval"], "every_steps": every}
    for key, value in values.items():
        if key == "dim":  # every table's dim and the bottom MLP's last layer (the dot needs them equal)
            for t in spec["tables"]:
                t["dim"] = value
            spec["bottom_mlp"] = [*spec["bottom_mlp"][:-1], value]
        elif "." in key:
            head, leaf = key.split(".", 1)
            spec[head][leaf] = value
        else:
            spec[key] = value
    return spec


def _finished(metrics: Path, steps: int) -> bool:
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return False
    return any(json.loads(x).get("type") == "eval" and json.loads(x).get("step") == steps for x in lines[-3:])


def train_curve(spec: dict[str, Any], steps: int, work: Path, reuse: list[Path]) -> dict[str, Any]:
    path = work / f"{spec['name']}.yaml"
    spec = {**spec, "steps": steps}
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    metrics = work / f"{spec['name']}.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = [r / metrics.name for r in reuse if _finished(r / metrics.name, steps)]
    if done:  # an interrupted recording's finished run
        metrics = done[0]
    else:
        _train(path, metrics, work, spec["name"], env)
    curve, step_s, planted = [], [], None
    for line in metrics.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("type") == "eval":
            curve.append([int(rec["step"]), round(float(rec["eval_auc"]), 5), round(float(rec["eval_ne"]), 5)])
            planted = rec.get("planted_auc", planted)
        elif "step_time_s" in rec:
            step_s.append(float(rec["step_time_s"]))
    return {"curve": curve, "step_s": round(statistics.median(step_s), 5),
            "planted_auc": None if planted is None else round(float(planted), 5)}


def _train(path: Path, metrics: Path, work: Path, name: str, env: dict[str, str]) -> None:
    subprocess.run([sys.executable, "-m", "slurm_dlrm", "train", str(path), "--device", "cpu", "--no-resume",  # noqa: S603
                    "--metrics-file", str(metrics), "--checkpoint-dir", str(work / "ckpt" / name)],
                   check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "tests" / "data" / "sweep_curves.json"))
    ap.add_argument("--only", action="append", default=None, help="record only this sweep (repeat)")
    ap.add_argument("--steps", type=int, default=None, help="train this many steps (default: the sweep's)")
    ap.add_argument("--reuse", action="append", default=[],
                    help="a folder of an interrupted recording: its finished runs are read (repeat)")
    ap.add_argument("--reuse-only", action="store_true",
                    help="train nothing: keep the variants whose runs in --reuse folders finished")
    ap.add_argument("--part", default="0/1", help="K/N: record only variants i with i %% N == K (merge the parts' "
                                                  "files with --merge)")
    ap.add_argument("--merge", nargs="*", default=None, help="merge these parts' files into --out and stop")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.merge is not None:
        merged: dict[str, Any] = {}
        for part in args.merge:
            doc = json.loads(Path(part).read_text())
            for sw in doc["sweeps"]:
                into = merged.setdefault(sw["name"], {**sw, "variants": []})
                into["variants"] += sw["variants"]
        for sw in merged.values():
            sw["variants"].sort(key=lambda v: v["index"])
        out.write_text(json.dumps({"eval": doc["eval"], "sweeps": [merged[k] for k in SWEEPS if k in merged]},
                                  separators=(",", ":")) + "\n")
        return 0
    part, parts = (int(x) for x in args.part.split("/"))
    data: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {"sweeps": []}
    data["eval"] = {"batches": EVAL_BATCHES, "note": "held-out eval (auc, ne) on the CPU; every_steps per sweep"}
    done = {s["name"] for s in data["sweeps"]}
    with tempfile.TemporaryDirectory(prefix="sweep-curves-") as tmp:
        for sweep, (changes, grid, sweep_steps, every) in SWEEPS.items():
            steps = args.steps or sweep_steps
            if (args.only and sweep not in args.only) or sweep in done:
                continue
            variants = []
            keys = list(grid)
            for i, combo in enumerate(itertools.product(*(grid[k] for k in keys))):
                if i % parts != part:
                    continue
                values = dict(zip(keys, combo, strict=True))
                if args.reuse_only and not any(_finished(Path(r) / f"{sweep}-{i}.jsonl", steps) for r in args.reuse):
                    continue
                rec = train_curve(variant_spec(f"{sweep}-{i}", changes, values, every), steps, Path(tmp),
                                  [Path(r) for r in args.reuse])
                variants.append({"index": i, "set": values, **rec})
                last = rec["curve"][-1]
                print(f"{sweep} {values}: auc {last[1]:.4f} at step {last[0]} ({rec['step_s'] * 1000:.1f} ms/step)",
                      flush=True)
            if not variants:
                continue
            data["sweeps"].append({"name": sweep, "steps": steps, "eval_every_steps": every,
                                   "base": {**BASE, **changes}, "grid": grid, "variants": variants})
            out.write_text(json.dumps(data, separators=(",", ":")) + "\n")  # after each sweep: resumable
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
