"""What the runner's evaluation costs and saves (issue 51): held-out batches made one at a
time (`HeldOut`, now) against the held-out set made up front and kept for the whole run
(the baseline: issue 39's runner), same model, same Evaluator, same metrics.

For each config: the runner's torchrec model on the CPU, one training step, then
evaluations each way, taking turns (8 timed each); printed side by side: wall seconds per
evaluation (median, timed without the tracker; on a loaded machine the figures move by
tens of %), what that difference costs a run evaluating at the default interval (against
200 training steps of the same model), the live tensor bytes the held-out set holds
between evaluations, the peak of live tensor bytes during an evaluation (a dispatch mode
following every storage, as benchmarks/_measure.py), and whether the metrics are identical.

Run:  /work/main/.venv/bin/python benchmarks/eval_memory.py
Last line:  eval_memory: configs=N time_cost_pct_median=X held_saved_mib_max=X peak_saved_pct_max=X identical=1
            run_cost_pct_max=X
(time_cost_pct: one evaluation's wall time, one at a time against up front; run_cost_pct:
that difference against the 200 training steps between two evaluations at the default
`eval.every_steps`, a training step timed on the same model.)
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

from slurm_dlrm.spec import EVAL_DEFAULT_EVERY_STEPS, parse_spec  # noqa: E402

MIB = 1 << 20
WAYS = ("up front", "one at a time")
REPEATS = 8
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
    # time: without the tracker (a dispatch mode slows every op), the two ways taking turns
    # (a first untimed round each, then REPEATS rounds in alternating order) so that a
    # load change on the shared machine falls on both alike; the baseline's set is made
    # before the clock starts, as the old runner made it at start
    evaluators: dict[str, Any] = {}
    for way in WAYS:
        held: Any = HeldOut(spec)
        evaluators[way] = Evaluator(UpFront(held) if way == "up front" else held, 0, 1)
        evaluators[way].run(predict, 0, 0.0)  # warm: torchrec.metrics' first call, the allocator
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    records: dict[str, list[Any]] = {way: [] for way in WAYS}
    for i in range(REPEATS):
        for way in (WAYS if i % 2 == 0 else WAYS[::-1]):
            t0 = time.perf_counter()
            records[way].append(evaluators[way].run(predict, i + 1, 0.0))
            times[way].append(time.perf_counter() - t0)
    del evaluators
    # a training step's time, to say what one evaluation's difference costs a run that
    # evaluates every `EVAL_DEFAULT_EVERY_STEPS` steps (the spec's default)
    source = make_source(spec)
    step_s = []
    for k in range(1, 6):
        b = source.batch(k)
        t0 = time.perf_counter()
        loss, _ = built.model(b)
        loss.backward()
        built.optimizer.step()
        built.optimizer.zero_grad()
        step_s.append(time.perf_counter() - t0)
        del b, loss, _
    out["step_s"] = statistics.median(step_s[1:])
    for way in WAYS:
        held = HeldOut(spec)
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
            recs = records[way]
            out[way] = {"s": statistics.median(times[way]), "kept": kept, "peak": tracker.peak - base,
                        "metrics": [(r or {}).get("eval_auc") for r in recs] + [(recs[0] or {}).get("eval_ne")]}
            del held, ev
    return out


def main() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    print(f"{'config':<16} {'s/eval up front':>15} {'one at a time':>13} {'cost%':>6} {'run%':>6} | {'held MiB':>8} "
          f"{'now':>5} | {'eval peak MiB':>13} {'now':>7} {'saved%':>6} | same metrics")
    costs, run_costs, saved, peaks, same = [], [], [], [], True
    for d in CONFIGS:
        r = run(d)
        a, b = r["up front"], r["one at a time"]
        cost = 100 * (b["s"] - a["s"]) / a["s"]
        # what the difference costs a run evaluating every EVAL_DEFAULT_EVERY_STEPS steps
        run_cost = 100 * (b["s"] - a["s"]) / (EVAL_DEFAULT_EVERY_STEPS * r["step_s"])
        peak_saved = 100 * (a["peak"] - b["peak"]) / a["peak"]
        ident = a["metrics"] == b["metrics"]
        same = same and ident
        costs.append(cost)
        run_costs.append(run_cost)
        saved.append((a["kept"] - b["kept"]) / MIB)
        peaks.append(peak_saved)
        print(f"{d['name']:<16} {a['s']:>15.3f} {b['s']:>13.3f} {cost:>+6.1f} {run_cost:>+6.2f} | "
              f"{a['kept'] / MIB:>8.1f} {b['kept'] / MIB:>5.1f} | {a['peak'] / MIB:>13.1f} {b['peak'] / MIB:>7.1f} "
              f"{peak_saved:>6.1f} | {'yes' if ident else 'NO'}  (a step {r['step_s'] * 1000:.0f} ms)", flush=True)
    load = os.getloadavg()[0]
    dist.destroy_process_group()
    print(f"(run%: the difference against a run's {EVAL_DEFAULT_EVERY_STEPS} training steps between two "
          f"evaluations; load {load:.1f} on {os.cpu_count()} cores)")
    print(f"eval_memory: configs={len(costs)} time_cost_pct_median={statistics.median(costs):.1f} "
          f"held_saved_mib_max={max(saved):.1f} peak_saved_pct_max={max(peaks):.1f} identical={int(same)} "
          f"run_cost_pct_max={max(run_costs):.2f}")


if __name__ == "__main__":
    main()
