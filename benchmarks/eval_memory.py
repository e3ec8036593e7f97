"""What the runner's evaluation costs and saves (issue 51): held-out batches made one at a
time (`HeldOut`, now) against the held-out set made up front and kept for the whole run
(the baseline: issue 39's runner), same model, same Evaluator, same metrics.

For each config: the runner's torchrec model on the CPU, one training step, then 3
evaluations each way; printed side by side: wall seconds per evaluation (median, timed
without the tracker; on a loaded machine the figures move by tens of %), the
live tensor bytes the held-out set holds between evaluations, the peak of live tensor
bytes during an evaluation (a dispatch mode following every storage, as
benchmarks/_measure.py), and whether the metrics are identical.

Run:  /work/main/.venv/bin/python benchmarks/eval_memory.py
Last line:  eval_memory: configs=N time_cost_pct_median=X held_saved_mib_max=X peak_saved_pct_max=X identical=1
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _measure import LiveTensorBytes  # noqa: E402

from slurm_dlrm.spec import parse_spec  # noqa: E402

MIB = 1 << 20
CONFIGS: list[dict[str, Any]] = [
    {"name": "b16k-pooling2", "tables": [{"rows": 500, "dim": 16, "pooling_factor": 2.0}] * 8,
     "bottom_mlp": [256, 16], "top_mlp": [256, 128, 1], "batch_size": 16384},
    {"name": "b2k-pooling20", "tables": [{"rows": 20000, "dim": 16, "pooling_factor": 20.0}] * 6,
     "bottom_mlp": [128, 16], "top_mlp": [128, 1], "batch_size": 2048},
    {"name": "b512-default", "tables": [{"rows": 20000, "dim": 16}, {"rows": 80000, "dim": 16}],
     "bottom_mlp": [128, 64, 16], "top_mlp": [128, 64, 1], "batch_size": 512},
]


class UpFront:
    """The baseline: every held-out batch made at start and kept (issue 39's runner)."""

    def __init__(self, held: Any) -> None:
        self.count = held.count
        self.made = [held.batch(k) for k in range(held.count)]

    def batch(self, k: int) -> Any:
        return self.made[k]


def run(d: dict[str, Any]) -> dict[str, Any]:
    from slurm_dlrm.train.backends import build
    from slurm_dlrm.train.data import make_source
    from slurm_dlrm.train.evaluation import Evaluator
    from slurm_dlrm.train.heldout import HeldOut
    from slurm_dlrm.train.runner import predict_clicks

    spec = parse_spec({"dense_features": 13, "optimizer": {"type": "sgd"}, "loader_workers": 0, **d})
    cpu = torch.device("cpu")
    torch.manual_seed(0)
    built = build("torchrec", spec, cpu, 1, 1)
    batch = make_source(spec).batch(0)
    loss, _ = built.model(batch)
    loss.backward()
    built.optimizer.step()
    built.optimizer.zero_grad()
    del batch, loss, _

    def predict(b: Any) -> Any:
        return predict_clicks(built, cpu, lambda: torch.autocast("cpu", enabled=False), b)

    out: dict[str, Any] = {}
    for way in ("up front", "one at a time"):
        # time: without the tracker (a dispatch mode slows every op); the baseline's set is
        # made before the clock starts, as the old runner made it at start
        held: Any = HeldOut(spec)
        if way == "up front":
            held = UpFront(held)
        ev = Evaluator(held, 0, 1)
        times, records = [], []
        for i in range(3):
            t0 = time.perf_counter()
            records.append(ev.run(predict, i + 1, 0.0))
            times.append(time.perf_counter() - t0)
        del held, ev
        tracker = LiveTensorBytes()
        with tracker:
            base = tracker.live
            held = HeldOut(spec)
            if way == "up front":
                held = UpFront(held)
                for b, p in held.made:  # host memory from the start (counted as the process holds it)
                    for t in (b.dense_features, b.labels, b.sparse_features.values(), b.sparse_features.lengths(), p):
                        tracker._track(t)
            kept = tracker.live - base
            ev = Evaluator(held, 0, 1)
            tracker.peak = tracker.live
            ev.run(predict, 1, 0.0)
            out[way] = {"s": statistics.median(times), "kept": kept, "peak": tracker.peak - base,
                        "metrics": [(r or {}).get("eval_auc") for r in records] + [(records[0] or {}).get("eval_ne")]}
            del held, ev
    return out


def main() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    print(f"{'config':<16} {'s/eval up front':>15} {'one at a time':>13} {'cost%':>6} | {'held MiB':>8} "
          f"{'now':>5} | {'eval peak MiB':>13} {'now':>7} {'saved%':>6} | same metrics")
    costs, saved, peaks, same = [], [], [], True
    for d in CONFIGS:
        r = run(d)
        a, b = r["up front"], r["one at a time"]
        cost = 100 * (b["s"] - a["s"]) / a["s"]
        peak_saved = 100 * (a["peak"] - b["peak"]) / a["peak"]
        ident = a["metrics"] == b["metrics"]
        same = same and ident
        costs.append(cost)
        saved.append((a["kept"] - b["kept"]) / MIB)
        peaks.append(peak_saved)
        print(f"{d['name']:<16} {a['s']:>15.3f} {b['s']:>13.3f} {cost:>+6.1f} | {a['kept'] / MIB:>8.1f} "
              f"{b['kept'] / MIB:>5.1f} | {a['peak'] / MIB:>13.1f} {b['peak'] / MIB:>7.1f} {peak_saved:>6.1f} | "
              f"{'yes' if ident else 'NO'}", flush=True)
    dist.destroy_process_group()
    print(f"eval_memory: configs={len(costs)} time_cost_pct_median={statistics.median(costs):.1f} "
          f"held_saved_mib_max={max(saved):.1f} peak_saved_pct_max={max(peaks):.1f} identical={int(same)}")


if __name__ == "__main__":
    main()
