"""How close is the estimator to measured memory? And torchrec's own planner?

For each of the configs below (varied over table count and size, dim, pooling,
batch, optimizer, MLP widths and interaction), a child process
(benchmarks/_measure.py) trains a few real steps with torchrec's sharded model and
fused embedding kernels on the CPU (one process, gloo) and measures the peak of live
tensor bytes and the peak RSS. Printed side by side with:
  - the estimator's device-independent part (`Estimate.tensor_peak_bytes` for a CPU
    run, i.e. everything but the CUDA context, cuBLAS workspace and allocator rounding),
  - the estimator's host peak for a CPU run, against peak RSS,
  - torchrec's planner estimate for the same config and device.

Adam: fbgemm's CPU kernels have no fused Adam, so Adam configs run (and are
estimated) on the non-fused path; see benchmarks/_measure.py.

`--backend torch`: every config with `backend: torch` (the runner's plain-PyTorch
backend, estimated by slurm_dlrm/estimate/timeline_torch.py); torchrec's planner does
not apply there (its column reads 0).

Run:  /work/main/.venv/bin/python benchmarks/estimator_accuracy.py [--only NAME] [--steps N]
      [--spec FILE ...] [--specs-only] [--backend torchrec|torch] [--drawn N --draw-seed S]
      [--no-traced] [--save FILE] [--load FILE [--saved-only]]
Last line:  estimator: configs=N median_err_pct=X p95_err_pct=X max_under_pct=X
            rss_median_err_pct=X rss_max_under_pct=X planner_median_err_pct=X
            rss_anon_median_err_pct=X rss_anon_max_under_pct=X rss_file_median_mib=X
            rss_site_median_err_pct=X rss_site_max_under_pct=X
            eval_median_err_pct=X eval_max_under_pct=X eval_configs=N eval_peak_configs=N
            eval_peak_max_under_pct=X [meta_configs=N meta_median_err_pct=X meta_max_under_pct=X
            meta_eval_peak_configs=N]
Every config runs twice (issue 51): with `eval: false` (the training step alone: the keys
before eval_*) and as users run it, with the default evaluation on (every 200 steps and
at the last step, so once here, at --steps): eval_* compare the peak of live tensor
bytes of that run, evaluation included, with the estimate (which takes the larger of the
training step and the evaluation). EVAL_EXTRA adds configs that are not among the 38
(a held-out check) and the parts no other config runs (an evaluation every few steps,
eval.stop_when, a Criteo folder's `holdout: last-file`, several ranks); printed apart,
not in the last line (`--no-eval-extra` leaves them out).
(rss_site_*: the host peak with the site-wide calibration from measured runs
(`slurm_dlrm.estimate.calibrate.site_calibrate`), held out: each config's correction is
learned from the OTHER configs' measurements only, so it is judged on a run it never saw.
rss_anon_*: peak RSS less the mapped libraries' resident pages, which the page cache
decides, against the estimate less its `HOST_RUNTIME_CPU_MAPPED_FILES_BYTES`.)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from slurm_dlrm.estimate import estimate  # noqa: E402
from slurm_dlrm.estimate.analytic import HOST_RUNTIME_CPU_MAPPED_FILES_BYTES  # noqa: E402
from slurm_dlrm.estimate.calibrate import SITE_MAX_RUNS, SiteRun, site_calibrate  # noqa: E402
from slurm_dlrm.spec import load_spec, parse_spec  # noqa: E402

MIB = 1 << 20


def _t(rows: list[int], dim: int, **kw: Any) -> list[dict[str, Any]]:
    return [{"rows": r, "dim": dim, **kw} for r in rows]


BASE: dict[str, Any] = {
    "tables": _t([20000, 5000, 80000, 1000], 16),
    "dense_features": 13,
    "bottom_mlp": [128, 64, 16],
    "top_mlp": [128, 64, 1],
    "interaction": {"type": "dot"},
    "batch_size": 512,
    "optimizer": {"type": "sgd", "lr": 0.05},
    "prefetch_batches": 1,
    "loader_workers": 0,
    "checkpoint_every_steps": 0,  # the child does not checkpoint (the runner's host snapshot)
}


def cfg(name: str, **over: Any) -> dict[str, Any]:
    d = copy.deepcopy(BASE)
    d.update(copy.deepcopy(over))
    d["name"] = name
    return d


CONFIGS: list[dict[str, Any]] = [
    cfg("base-sgd"),
    cfg("adagrad", optimizer={"type": "adagrad"}),
    cfg("rowwise", optimizer={"type": "rowwise_adagrad"}),
    cfg("adam-nonfused", optimizer={"type": "adam"}),
    cfg("adagrad-nonfused", optimizer={"type": "adagrad", "fused": False}),
    cfg("2-tables-big", tables=_t([400000, 150000], 16), optimizer={"type": "rowwise_adagrad"}),
    cfg("26-tables", tables=_t([3000 + 1000 * i for i in range(26)], 16), batch_size=256),
    cfg("26-tables-b2k", tables=_t([500 + 97 * i for i in range(26)], 16), batch_size=2048),
    cfg("dim8", tables=_t([20000, 5000, 80000, 1000], 8), bottom_mlp=[64, 8]),
    cfg("dim64", tables=_t([20000, 5000, 80000, 1000], 64), bottom_mlp=[256, 64], top_mlp=[256, 1]),
    cfg("dim128-adagrad", tables=_t([10000, 30000, 2000], 128), bottom_mlp=[256, 128], top_mlp=[512, 256, 1],
        optimizer={"type": "adagrad"}),
    cfg("pooling-4", tables=_t([20000, 5000, 80000, 1000], 16, pooling_factor=4.0)),
    cfg("pooling-mixed", tables=[{"rows": 20000, "dim": 16, "pooling_factor": 2.5},
                                 {"rows": 5000, "dim": 16, "multi_hot": 7},
                                 {"rows": 80000, "dim": 16, "multi_hot": 20},
                                 {"rows": 1000, "dim": 16}], batch_size=1024),
    cfg("batch-64", batch_size=64),
    cfg("batch-4096", batch_size=4096, prefetch_batches=2),
    cfg("batch-4096-tiny-tables", tables=_t([100, 200, 300, 400, 500, 600], 16), batch_size=4096),
    cfg("wide-top", top_mlp=[1024, 1024, 512, 256, 1], batch_size=1024),
    cfg("deep-bottom", bottom_mlp=[512, 256, 128, 64, 16], batch_size=1024),
    cfg("narrow-mlps", bottom_mlp=[16], top_mlp=[8, 1], batch_size=2048),
    cfg("dcn-small", interaction={"type": "dcn", "layers": 2, "low_rank": 32}),
    cfg("dcn-3x512", interaction={"type": "dcn", "layers": 3, "low_rank": 512}, top_mlp=[512, 256, 1],
        optimizer={"type": "adagrad"}),
    cfg("dcn-b2k-rowwise", interaction={"type": "dcn", "layers": 3, "low_rank": 64}, batch_size=2048,
        optimizer={"type": "rowwise_adagrad"}),
    cfg("dcn-adam", interaction={"type": "dcn", "layers": 2, "low_rank": 16}, optimizer={"type": "adam"}),
    cfg("dcn-multihot-26", tables=[{"rows": 2000 + 300 * i, "dim": 16, "multi_hot": 1 + (i * 7) % 12}
                                   for i in range(26)], interaction={"type": "dcn", "layers": 3, "low_rank": 128},
        top_mlp=[1024, 512, 256, 1], batch_size=512, optimizer={"type": "adagrad"}),
    cfg("no-prefetch", prefetch_batches=0, batch_size=2048),
    cfg("prefetch-3", prefetch_batches=3, batch_size=2048, tables=_t([20000, 5000, 80000, 1000], 16, multi_hot=8)),
    cfg("bf16-autocast", mixed_precision="bf16", batch_size=2048, optimizer={"type": "adagrad"}),
    cfg("dcn-fp16-autocast", mixed_precision="fp16", interaction={"type": "dcn", "layers": 2, "low_rank": 64},
        batch_size=1024),
    cfg("fp16-tables", tables=_t([20000, 5000, 80000, 1000], 16, dtype="fp16"), optimizer={"type": "adagrad"}),
    cfg("bf16-tables-rowwise", tables=_t([20000, 5000, 80000, 1000], 16, dtype="bf16"),
        optimizer={"type": "rowwise_adagrad"}, mixed_precision="bf16"),
    cfg("criteo-npy-prefetch", tables=_t([3000 + 500 * i for i in range(26)], 16), batch_size=1024,
        data={"type": "criteo-npy", "path": "@NPY@"}, loader_workers=2, prefetch_batches=2),
    # several ranks (one process each, gloo): the fullest rank is measured and estimated
    cfg("ws2-adagrad", tables=_t([40000, 20000, 15000, 5000], 16), bottom_mlp=[64, 16], top_mlp=[32, 1],
        optimizer={"type": "adagrad"}, world_size=2),
    cfg("ws2-dcn-pooling", tables=[{"rows": 40000, "dim": 16, "multi_hot": 3}, {"rows": 20000, "dim": 16},
                                   {"rows": 15000, "dim": 16, "pooling_factor": 2.5}, {"rows": 5000, "dim": 16},
                                   {"rows": 70000, "dim": 16}], bottom_mlp=[64, 16], top_mlp=[64, 1],
        batch_size=1024, optimizer={"type": "rowwise_adagrad"}, world_size=2,
        interaction={"type": "dcn", "layers": 2, "low_rank": 32}),
    cfg("ws3-sgd", tables=_t([100000, 1000, 3000, 60000, 500, 8000], 32), bottom_mlp=[128, 32], top_mlp=[128, 1],
        batch_size=256, world_size=3),
    # large batches (issue 17): a step frees tens of MiB of activations per layer, which
    # glibc's dynamic mmap threshold used to keep in the heap (slurm_dlrm/train/hostmem.py)
    cfg("big-batch-16k", tables=_t([500] * 8, 16, pooling_factor=2.0), bottom_mlp=[256, 16], top_mlp=[256, 128, 1],
        batch_size=16384, prefetch_batches=1),
    cfg("big-batch-8k-dcn-adagrad", tables=_t([2000] * 12, 32), bottom_mlp=[512, 256, 32], top_mlp=[512, 256, 1],
        interaction={"type": "dcn", "layers": 2, "low_rank": 64}, batch_size=8192, optimizer={"type": "adagrad"}),
    {"name": "kaggle-scaled", "preset": "criteo-kaggle", "scale": {"max_rows_per_table": 20000}, "batch_size": 1024,
     "prefetch_batches": 1, "loader_workers": 0, "optimizer": {"type": "adagrad"}, "checkpoint_every_steps": 0},
    {"name": "dcnv2-scaled", "preset": "mlperf-dcnv2", "scale": {"max_rows_per_table": 5000, "dim": 16},
     "batch_size": 256, "prefetch_batches": 1, "loader_workers": 0,
     "interaction": {"type": "dcn", "layers": 3, "low_rank": 64}, "checkpoint_every_steps": 0},
]


# Configs none of the 38 above is, run with evaluation on only: a held-out check of the
# evaluation's estimate (written after the estimate; nothing was fitted to them), and
# the parts no other config runs (issue 51): an evaluation every few steps, eval.stop_when,
# a Criteo folder's `holdout: last-file`, several ranks, a large held-out set.
EVAL_EXTRA: list[dict[str, Any]] = [
    cfg("x-eval-every-2", eval={"every_steps": 2, "batches": 8}, batch_size=2048),
    cfg("x-stop-when", eval={"every_steps": 2, "batches": 4, "stop_when": {"metric": "auc", "patience": 1}}),
    cfg("x-npy-last-file", tables=_t([3000 + 500 * i for i in range(26)], 16), batch_size=512,
        data={"type": "criteo-npy", "path": "@NPY_DIR@"}, eval={"every_steps": 3, "batches": 8, "holdout": "last-file"}),
    cfg("x-ws2-eval-every-2", tables=_t([40000, 20000, 15000, 5000], 16), bottom_mlp=[64, 16], top_mlp=[32, 1],
        world_size=2, eval={"every_steps": 2, "batches": 16}),
    cfg("x-many-eval-batches", tables=_t([3000, 500, 700], 8), bottom_mlp=[32, 8], top_mlp=[16, 1], batch_size=1024,
        eval={"batches": 96}, optimizer={"type": "rowwise_adagrad"}),
    cfg("x-multihot-dcn-adam", tables=[{"rows": 30000, "dim": 32, "multi_hot": 5}, {"rows": 900, "dim": 32},
                                       {"rows": 12000, "dim": 32, "pooling_factor": 6.0}],
        bottom_mlp=[256, 32], top_mlp=[256, 64, 1], interaction={"type": "dcn", "layers": 3, "low_rank": 48},
        batch_size=3072, optimizer={"type": "adam"}),
    cfg("x-bf16-onehot-b8k", tables=_t([700, 1100, 90, 5000, 250], 16), bottom_mlp=[128, 16], top_mlp=[64, 1],
        batch_size=8192, mixed_precision="bf16", optimizer={"type": "adagrad"}, eval={"batches": 24}),
    cfg("x-ws2-big-eval", tables=_t([6000, 800, 2500], 16), bottom_mlp=[64, 16], top_mlp=[32, 1], batch_size=2048,
        world_size=2, eval={"batches": 40}, interaction={"type": "dcn", "layers": 1, "low_rank": 16}),
]


def drawn_configs(n: int, seed: int) -> list[dict[str, Any]]:
    """`n` DLRM specs drawn at random (seed `seed`), written as a user writes one: only
    the model, the batch and the optimizer; everything else (loader workers, prefetch,
    checkpoints, evaluation every 200 steps and at the end) the spec's defaults. A hold-out
    no one tuned the estimate on: a fresh seed draws configs no one has seen."""
    import random

    rng = random.Random(seed)
    out = []
    for i in range(n):
        dim = rng.choice([8, 16, 16, 32, 64, 128])
        tables = []
        for _ in range(rng.choice([1, 2, 3, 4, 6, 8, 13, 26])):
            t: dict[str, Any] = {"rows": int(10 ** rng.uniform(2.5, 5.3)), "dim": dim}
            kind = rng.random()
            if kind < 0.25:
                t["multi_hot"] = rng.randint(2, 24)
            elif kind < 0.45:
                t["pooling_factor"] = round(rng.uniform(1.5, 12.0), 1)
            tables.append(t)
        while sum(t["rows"] for t in tables) * dim * 4 > 256 * MIB:  # a CPU child measures it in minutes
            for t in tables:
                t["rows"] = max(100, t["rows"] // 2)
        batch = rng.choice([256, 512, 1024, 2048, 4096, 8192, 16384])
        bottom = sorted((rng.choice([32, 64, 128, 256, 512]) for _ in range(rng.randint(1, 3))), reverse=True)
        top = sorted((rng.choice([16, 64, 128, 256, 512, 1024]) for _ in range(rng.randint(1, 3))), reverse=True)
        d: dict[str, Any] = {
            "name": f"drawn-{seed}-{i}", "tables": tables, "dense_features": rng.choice([13, 13, 8, 32]),
            "bottom_mlp": [*bottom, dim], "top_mlp": [*top, 1], "batch_size": batch,
            "optimizer": {"type": rng.choice(["sgd", "adagrad", "rowwise_adagrad"])},
        }
        if rng.random() < 0.4:
            d["interaction"] = {"type": "dcn", "layers": rng.randint(1, 3), "low_rank": rng.choice([16, 32, 64, 128])}
        out.append(d)
    return out


# The traced estimator (slurm_dlrm/estimate/traced.py, for `custom_module` specs: built and
# traced on the meta device): each config above that a custom module can take (one rank,
# synthetic data, a torch optimizer) as the example module (plain nn.EmbeddingBag tables,
# concatenation), trained on the CPU with torch's optimizer and evaluated by the runner's
# Evaluator (benchmarks/_measure.py `run_custom`), both with evaluation on and `eval: false`.
EXAMPLE_MODULE = "slurm_dlrm.estimate.example_custom:build"


def custom_configs(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for c in configs:
        s = parse_spec(c)
        if s.world_size == 1 and s.data.type == "synthetic" and s.optimizer.type in ("sgd", "adagrad", "adam"):
            out.append(dict(c, custom_module=EXAMPLE_MODULE))
    return out


def write_criteo_npy(prefix: str, rows: int) -> str:
    """A small day of torchrec's preprocessed Criteo layout (13 dense, 26 sparse)."""
    import numpy as np

    rng = np.random.default_rng(0)
    np.save(f"{prefix}_dense.npy", rng.random((rows, 13), dtype=np.float32))
    np.save(f"{prefix}_sparse.npy", rng.integers(0, 2**31, (rows, 26), dtype=np.int64))
    np.save(f"{prefix}_labels.npy", rng.integers(0, 2, rows, dtype=np.int32))
    return prefix


_SAVED: dict[str, dict[str, Any]] = {}  # --load: measurements of an earlier run, by key
_SAVE_TO: str | None = None  # --save: every measurement appended here (JSON lines)
_SAVE_LOCK = threading.Lock()
_SAVED_ONLY: list[bool] = []  # --saved-only: a config --load has no measurement of is left out
_TMP_DIR: list[str] = []  # this run's folder of npy files: named alike in every run's keys


def _key(d: dict[str, Any], steps: int) -> str:
    key = json.dumps({"spec": d, "steps": steps}, sort_keys=True, default=str)
    return key.replace(_TMP_DIR[0], "@TMP@") if _TMP_DIR else key


def measure(d: dict[str, Any], steps: int) -> dict[str, Any] | None:
    """The child's measurement of spec `d` (or the one --load read for the same spec and
    steps; None with --saved-only when it has none)."""
    key = _key(d, steps)
    if key in _SAVED:
        return _SAVED[key]
    if _SAVED_ONLY:
        return None
    result = _measure_child(d, steps)
    if _SAVE_TO is not None:
        with _SAVE_LOCK, open(_SAVE_TO, "a") as f:
            f.write(json.dumps({"key": key, "result": result}) + "\n")
    return result


def _measure_child(d: dict[str, Any], steps: int) -> dict[str, Any]:
    out = subprocess.run(  # noqa: S603 - fixed argv, our own child script
        [sys.executable, os.path.join(HERE, "_measure.py"), json.dumps(d), str(steps)],
        capture_output=True, text=True, timeout=900,
    )
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        tail = " | ".join(out.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"{d['name']}: child failed ({out.returncode}): {tail}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def worst_under(errs: list[float]) -> float:
    """The largest under-estimate in %, 0.0 where none is under (never -0.0)."""
    return max([0.0, *(-x for x in errs)]) + 0.0


def pct(est: float, meas: float) -> float:
    return 100.0 * (est - meas) / meas


def p95(xs: list[float]) -> float:
    s = sorted(xs)
    k = max(0, min(len(s) - 1, int(round(0.95 * (len(s) - 1)))))
    return s[k]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", help="run only the config(s) with this name")
    ap.add_argument("--steps", type=int, default=5,
                    help="steps per config (host memory settles after the first 2-3)")
    ap.add_argument("--spec", action="append", default=[], metavar="FILE",
                    help="also run this spec file (YAML/JSON); repeatable")
    ap.add_argument("--specs-only", action="store_true", help="run only the --spec files")
    ap.add_argument("--backend", choices=("torchrec", "torch"), default="torchrec",
                    help="the runner's model backend every config trains on")
    ap.add_argument("--no-eval-extra", action="store_true",
                    help="leave out the extra evaluation configs (EVAL_EXTRA)")
    ap.add_argument("--drawn", type=int, default=0, metavar="N",
                    help="instead of the fixed configs: N specs drawn at random with the spec's defaults "
                         "(a hold-out; see --draw-seed)")
    ap.add_argument("--draw-seed", type=int, default=0, help="the seed of --drawn's draw (use a fresh one)")
    ap.add_argument("--no-traced", action="store_true",
                    help="leave out the traced estimator's configs (custom_module, traced on meta)")
    ap.add_argument("--jobs", type=int, default=2,
                    help="children measured at once (memory is per process, so this does not change figures)")
    ap.add_argument("--save", metavar="FILE", help="append every measurement to FILE (JSON lines)")
    ap.add_argument("--load", metavar="FILE", action="append", default=[],
                    help="take the measurements FILE holds (from --save) instead of measuring again: "
                         "the estimate's side of a run without its hour of children; repeatable")
    ap.add_argument("--saved-only", action="store_true",
                    help="with --load: measure nothing, leave out what the files do not hold (a run in parts)")
    args = ap.parse_args()
    global _SAVE_TO
    _SAVE_TO = args.save
    if args.saved_only:
        _SAVED_ONLY.append(True)
    for path in args.load:
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                _SAVED[row["key"]] = row["result"]
    fixed = drawn_configs(args.drawn, args.draw_seed) if args.drawn else CONFIGS
    configs = [] if args.specs_only else [c for c in fixed if not args.only or c["name"] in args.only]
    extra = [] if args.specs_only or args.no_eval_extra or args.drawn else \
        [c for c in EVAL_EXTRA if not args.only or c["name"] in args.only]
    tmp = tempfile.TemporaryDirectory(prefix="estimator-accuracy-")
    _TMP_DIR.append(tmp.name)
    npy = write_criteo_npy(os.path.join(tmp.name, "day_0"), rows=1024 * 8)
    days = os.path.join(tmp.name, "days")
    os.mkdir(days)
    for day in range(2):
        write_criteo_npy(os.path.join(days, f"day_{day}"), rows=512 * 12)
    for c in configs + extra:
        if c.get("data", {}).get("path") == "@NPY@":
            c["data"] = {"type": "criteo-npy", "path": npy}
        elif c.get("data", {}).get("path") == "@NPY_DIR@":
            c["data"] = dict(c["data"], path=days)
    for path in args.spec:
        configs.append(load_spec(path).to_dict())
    if args.backend != "torchrec":
        configs = [dict(c, backend=args.backend) for c in configs]
        extra = [dict(c, backend=args.backend) for c in extra]
    # What users run (evaluation on, the default) and the training step alone (eval: false),
    # every config both ways; the columns before "| eval on" are the eval: false run's.
    eval_on = [c for c in configs if parse_spec(c).eval.enabled]
    on_by_name = {c["name"]: c for c in eval_on}
    off = [dict(c, eval=False) for c in configs]
    print("eval: false (the training step alone) | eval on (the spec's default: every 200 steps and at the end)")
    print(f"{'config':<24} {'measured':>9} {'estimate':>9} {'err%':>6} | {'planner':>9} {'err%':>7} | "
          f"{'RSS':>8} {'est RSS':>8} {'err%':>6} {'files':>6} {'anon%':>6} | {'ms':>5} phase"
          f" | {'eval on':>9} {'estimate':>9} {'err%':>6} {'RSS':>7} {'est':>7} {'err%':>6} phase")
    errs: list[float] = []
    rss_errs: list[float] = []
    anon_errs: list[float] = []  # without the mapped libraries' resident pages (page cache)
    file_mibs: list[float] = []
    planner_errs: list[float] = []
    measured: list[tuple[str, Any, int]] = []  # (name, estimate, peak RSS) for the held-out site calibration
    t0 = time.time()
    eval_errs: list[float] = []
    eval_rss_errs: list[float] = []
    eval_peak_errs: list[float] = []  # configs whose estimate names the evaluation as the peak
    traced = [] if args.no_traced or args.backend != "torchrec" else custom_configs(configs + extra)
    pool = ThreadPoolExecutor(max(1, args.jobs))
    # with the evaluation on first: what users run (a run cut short has those)
    on_futures = {d["name"]: pool.submit(measure, d, args.steps) for d in eval_on + extra}
    futures = [pool.submit(measure, d, args.steps) for d in off]
    for d, fut in zip(off, futures, strict=True):
        m = fut.result()  # in config order, as each is done
        if m is None:  # --saved-only and not measured: the evaluation's columns alone, if measured
            line = f"{d['name']:<24} {'(eval: false not measured)':<97}"
        else:
            spec = parse_spec(d)
            t = time.perf_counter()
            est = estimate(spec, None)
            est_ms = (time.perf_counter() - t) * 1000
            meas = m["peak_tensor_bytes"]
            e = pct(est.tensor_peak_bytes, meas)
            pe = pct(m["planner_bytes"], meas) if m["planner_bytes"] else float("nan")
            re = pct(est.host_peak_bytes, m["peak_rss_bytes"])
            files = int(m.get("rss_file_bytes") or 0)
            ae = pct(est.host_peak_bytes - HOST_RUNTIME_CPU_MAPPED_FILES_BYTES, m["peak_rss_bytes"] - files)
            errs.append(e)
            planner_errs.append(pe)
            rss_errs.append(re)
            anon_errs.append(ae)
            file_mibs.append(files / MIB)
            measured.append((d["name"], est, int(m["peak_rss_bytes"])))
            line = (f"{d['name']:<24} {meas / MIB:>8.2f}M {est.tensor_peak_bytes / MIB:>8.2f}M {e:>+6.2f} | "
                    f"{m['planner_bytes'] / MIB:>8.2f}M {pe:>+7.1f} | {m['peak_rss_bytes'] / MIB:>7.0f}M "
                    f"{est.host_peak_bytes / MIB:>7.0f}M {re:>+6.1f} {files / MIB:>5.0f}M {ae:>+6.1f} | "
                    f"{est_ms:>5.1f} {est.peak_phase}")
        on = on_futures[d["name"]].result() if d["name"] in on_futures else None
        if on is not None:
            err, rss_err, phase, text = eval_row(on_by_name[d["name"]], on)
            eval_errs.append(err)
            eval_rss_errs.append(rss_err)
            if phase.startswith("evaluation"):
                eval_peak_errs.append(err)
            line += " | " + text
        if m is not None or on is not None:
            print(line, flush=True)
    extra_errs = []
    if extra:
        print()
        print("evaluation on, configs not among the above (written after the estimate, a held-out check) and the "
              "parts no other config runs: eval every few steps, eval.stop_when, holdout last-file, several ranks")
        for d in extra:
            got = on_futures[d["name"]].result()
            if got is None:
                continue
            err, _rss_err, phase, text = eval_row(d, got)
            extra_errs.append(err)
            print(f"{d['name']:<24} {text}", flush=True)
    # queued after the others: what users run first
    traced_futures = [(d, pool.submit(measure, d, args.steps), pool.submit(measure, dict(d, eval=False), args.steps))
                      for d in traced]
    meta_errs, meta_peak_errs = traced_rows(traced_futures)
    pool.shutdown()
    tmp.cleanup()
    site_errs = site_held_out(measured)
    if not errs:  # --saved-only, no eval: false run among the files
        errs, rss_errs, anon_errs, file_mibs, planner_errs = ([float("nan")] for _ in range(5))
    abs_errs = [abs(x) for x in errs]
    unders = [-x for x in errs if x < 0]
    print()
    print(f"configs: {len(errs)}  wall: {time.time() - t0:.0f} s")
    print(f"estimator, live tensor bytes: median |err| {statistics.median(abs_errs):.2f}%  p95 {p95(abs_errs):.2f}%  "
          f"max {max(abs_errs):.2f}%  under-estimates {len(unders)}, of which {sum(u > 0.5 for u in unders)} by more "
          f"than 0.5% (worst {max(unders, default=0.0):.2f}%)")
    planner_errs = [x for x in planner_errs if x == x] or [float("nan")]  # backend torch: no planner
    print(f"torchrec planner, same configs: median |err| {statistics.median(abs(x) for x in planner_errs):.1f}%  "
          f"under-estimates {sum(x < 0 for x in planner_errs)} (worst {max((-x for x in planner_errs), default=0):.1f}%)")
    print(f"estimator, host peak RSS: median |err| {statistics.median(abs(x) for x in rss_errs):.1f}%  "
          f"max {max(abs(x) for x in rss_errs):.1f}%  worst under-estimate {max((-x for x in rss_errs), default=0):.1f}% "
          "(beyond 3% is a defect: --mem is sized from it)")
    print(f"estimator, host peak RSS without the mapped libraries' resident pages (the page cache's share: "
          f"{min(file_mibs):.0f}-{max(file_mibs):.0f} MiB here, {HOST_RUNTIME_CPU_MAPPED_FILES_BYTES / MIB:.0f} MiB "
          f"in the estimate): median |err| {statistics.median(abs(x) for x in anon_errs):.1f}%  "
          f"worst under-estimate {max((-x for x in anon_errs), default=0):.1f}%")
    eval_abs = [abs(x) for x in eval_errs] or [0.0]
    print(f"estimator with evaluation on (what users run): configs {len(eval_errs)}  median |err| "
          f"{statistics.median(eval_abs):.2f}%  max {max(eval_abs):.2f}%  worst under-estimate "
          f"{max((-x for x in eval_errs), default=0.0):.2f}%  evaluation the estimated peak: {len(eval_peak_errs)} "
          f"(worst under {max((-x for x in eval_peak_errs), default=0.0):.2f}%)  host peak RSS: median |err| "
          f"{statistics.median(abs(x) for x in eval_rss_errs or [0.0]):.1f}%  worst under "
          f"{max((-x for x in eval_rss_errs), default=0.0):.1f}%")
    if extra_errs:
        print(f"evaluation on, the {len(extra_errs)} extra configs: median |err| "
              f"{statistics.median(abs(x) for x in extra_errs):.2f}%  worst under-estimate "
              f"{max((-x for x in extra_errs), default=0.0):.2f}%")
    print(f"estimator: configs={len(errs)} median_err_pct={statistics.median(abs_errs):.2f} "
          f"p95_err_pct={p95(abs_errs):.2f} max_under_pct={max(unders, default=0.0):.2f} "
          f"rss_median_err_pct={statistics.median(abs(x) for x in rss_errs):.2f} "
          f"rss_max_under_pct={worst_under(rss_errs):.2f} "
          f"planner_median_err_pct={statistics.median(abs(x) for x in planner_errs):.2f} "
          f"rss_anon_median_err_pct={statistics.median(abs(x) for x in anon_errs):.2f} "
          f"rss_anon_max_under_pct={worst_under(anon_errs):.2f} "
          f"rss_file_median_mib={statistics.median(file_mibs):.0f} "
          f"rss_site_median_err_pct={statistics.median(abs(x) for x in site_errs):.2f} "
          f"rss_site_max_under_pct={worst_under(site_errs):.2f} "
          f"eval_median_err_pct={statistics.median(eval_abs):.2f} "
          f"eval_max_under_pct={worst_under(eval_errs):.2f} "
          f"eval_configs={len(eval_errs)} eval_peak_configs={len(eval_peak_errs)} "
          f"eval_peak_max_under_pct={worst_under(eval_peak_errs):.4f}"
          + (f" meta_configs={len(meta_errs)} meta_median_err_pct={statistics.median(abs(x) for x in meta_errs):.2f} "
             f"meta_max_under_pct={worst_under(meta_errs):.4f} "
             f"meta_eval_peak_configs={len(meta_peak_errs)}" if meta_errs else "")
          + ("" if args.backend == "torchrec" else f" backend={args.backend}"))


def traced_rows(futures: list[tuple[dict[str, Any], Any, Any]]) -> tuple[list[float], list[float]]:
    """The traced estimator (on meta) against the custom module's CPU run, evaluation on
    and off: every error (both runs), and those where the estimate names the evaluation."""
    if not futures:
        return [], []
    from slurm_dlrm.estimate.traced import estimate_traced

    print()
    print("custom_module (the traced estimator: built and traced on meta) against the same module run on the CPU "
          "with the runner's Evaluator: eval on | eval: false")
    print(f"{'config':<24} {'eval on':>9} {'estimate':>9} {'err%':>7} phase                | "
          f"{'eval off':>9} {'estimate':>9} {'err%':>7}")
    errs, peak_errs = [], []
    for d, on_fut, off_fut in futures:
        row = f"{d['name']:<24}"
        for i, (dd, fut) in enumerate(((d, on_fut), (dict(d, eval=False), off_fut))):
            m = fut.result()
            if m is None:
                row += f" {'(not measured)':<50}"
                continue
            est = estimate_traced(parse_spec(dd), None)
            err = pct(est.tensor_peak_bytes, m["peak_tensor_bytes"])
            errs.append(err)
            if est.peak_phase == "evaluation":
                peak_errs.append(err)
            row += (f" {m['peak_tensor_bytes'] / MIB:>8.2f}M {est.tensor_peak_bytes / MIB:>8.2f}M {err:>+7.3f}"
                    + (f" {est.peak_phase:<20} |" if i == 0 else ""))
        print(row, flush=True)
    unders = [-x for x in errs if x < 0]
    print(f"traced estimator (meta): {len(errs)} runs, median |err| {statistics.median(abs(x) for x in errs):.2f}%  "
          f"worst under {max(unders, default=0.0):.4f}%  evaluation the estimated peak: {len(peak_errs)} "
          f"(worst under {max((-x for x in peak_errs), default=0.0):.4f}%)")
    return errs, peak_errs


def eval_row(d: dict[str, Any], m: dict[str, Any]) -> tuple[float, float, str, str]:
    """A config run with evaluation on: (tensor peak error %, host peak RSS error %, the
    estimate's peak phase, the printed columns)."""
    est = estimate(parse_spec(d), None)
    meas = m["peak_tensor_bytes"]
    err = pct(est.tensor_peak_bytes, meas)
    rss_err = pct(est.host_peak_bytes, m["peak_rss_bytes"])
    measured_at = "eval" if m.get("peak_phase") == "eval" else "step"
    text = (f"{meas / MIB:>8.2f}M {est.tensor_peak_bytes / MIB:>8.2f}M {err:>+6.2f} "
            f"{m['peak_rss_bytes'] / MIB:>6.0f}M {est.host_peak_bytes / MIB:>6.0f}M {rss_err:>+6.1f} "
            f"{est.peak_phase} (measured at: {measured_at})")
    return err, rss_err, est.peak_phase, text


def site_held_out(measured: list[tuple[str, Any, int]]) -> list[float]:
    """Per config, the error of the host peak calibrated from the other configs' measured
    runs only (leave-one-out: `site_calibrate` never saw the run it is judged on); prints
    a table, and the cost of one `site_calibrate` call over `SITE_MAX_RUNS` runs."""
    print()
    print(f"host peak with the site calibration, held out (learned from the other {len(measured) - 1} configs' "
          f"measured RSS; the most recent {SITE_MAX_RUNS} of them)")
    print(f"{'config':<24} {'RSS':>8} {'est RSS':>8} {'err%':>6} | {'site':>8} {'corr':>6} {'err%':>6}")
    errs = []
    for i, (name, est, rss) in enumerate(measured):
        # in config order, as a site would have met them; the held-out one left out
        runs = [SiteRun("cpu", e.host_peak_bytes, r, t=float(j)) for j, (_, e, r) in enumerate(measured) if j != i]
        site = site_calibrate(est, runs)
        err = pct(site.host_peak_bytes, rss)
        errs.append(err)
        print(f"{name:<24} {rss / MIB:>7.0f}M {est.host_peak_bytes / MIB:>7.0f}M "
              f"{pct(est.host_peak_bytes, rss):>+6.1f} | {site.host_peak_bytes / MIB:>7.0f}M "
              f"{site.host_breakdown.get('site_calibration', 0) / MIB:>+5.0f}M {err:>+6.2f}")
    if measured:
        est = measured[0][1]
        runs = [SiteRun("cpu", e.host_peak_bytes, r, t=float(j)) for j, (_, e, r) in enumerate(measured)]
        runs = (runs * SITE_MAX_RUNS)[:SITE_MAX_RUNS]
        n = 2000
        t = time.perf_counter()
        for _ in range(n):
            site_calibrate(est, runs)
        print(f"site_calibrate over {len(runs)} runs: {(time.perf_counter() - t) / n * 1e6:.1f} us per call")
    print(f"estimator, host peak RSS with the site calibration (held out): median |err| "
          f"{statistics.median(abs(x) for x in errs or [0.0]):.2f}%  worst under-estimate "
          f"{max((-x for x in errs), default=0.0):.2f}%")
    return errs or [0.0]


if __name__ == "__main__":
    main()
