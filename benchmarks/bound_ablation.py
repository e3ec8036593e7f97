"""What each of issue 19's mechanisms contributes to complementary (docs/packing.md
"Closer to the bound"): complementary in the simulator with all of them, and with each
one switched off in turn, on the workload and clusters of policy_compare.py, over
several workload seeds (one seed's figures move by +-0.05 with any change of the plan:
a pack's members and so its end change, and with them every later round).

Mechanisms (the switch each row turns off):
- observed: refill counts a live member past its warm-up at its measured peak + 2%
  instead of its fence (`model.OBSERVED_MARGIN_PCT`);
- priced: a joiner is chosen by its priced gain (predicted speeds weighted by the
  GPU memory, CPUs, SMs and bandwidth each member takes, priced by the backlog's
  demand), not by summed speed with the `min_gain` floor (`refill._PRICED`);
- tail: drain-tail jobs (expected run >= 0.25 of the time the backlog needs) go first,
  longest first (`refill._TAIL_FACTOR`, `complementary._TAIL_FACTOR`);
- reserve: the first drain-tail job that fits no pack GPU gets an EASY-backfill
  reservation on the one that frees its room soonest (`refill._RESERVE`);
- margin: each round's memory margin follows the estimate's error observed at members'
  peaks (`simulate(margin_from_errors=)`); matters in the +-20% scenario.

Run:  .venv/bin/python benchmarks/bound_ablation.py [--seeds 7,1,2,3,4]
Last line:  ablation: full_1gpu=X full_4gpu=X full_noisy=X (mean share of the ideal bound)
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from slurm_dlrm.packing import complementary, model, refill  # noqa: E402
from slurm_dlrm.sim import ideal_throughput_jobs_per_h, parse_cluster, parse_workload, simulate  # noqa: E402

SIM = ROOT / "benchmarks" / "sim"
SCENARIOS = (("1gpu", "cluster_1gpu.yaml", 1, None), ("4gpu", "cluster_4gpu.yaml", 4, None),
             ("noisy", "cluster_1gpu.yaml", 1, 20.0))


@contextmanager
def switched_off(name: str) -> Iterator[bool]:
    """Turn one mechanism off for the duration; yields whether the simulator's learned
    margin stays on."""
    saved = (model.OBSERVED_MARGIN_PCT, refill._PRICED, refill._TAIL_FACTOR, complementary._TAIL_FACTOR,
             refill._RESERVE)
    try:
        if name == "observed":
            model.OBSERVED_MARGIN_PCT = 1e9  # the fence is always smaller
        elif name == "priced":
            refill._PRICED = False
        elif name == "tail":
            refill._TAIL_FACTOR = complementary._TAIL_FACTOR = math.inf
        elif name == "reserve":
            refill._RESERVE = False
        elif name == "all":
            model.OBSERVED_MARGIN_PCT = 1e9
            refill._PRICED = False
            refill._TAIL_FACTOR = complementary._TAIL_FACTOR = math.inf
        yield name not in ("margin", "all")
    finally:
        (model.OBSERVED_MARGIN_PCT, refill._PRICED, refill._TAIL_FACTOR, complementary._TAIL_FACTOR,
         refill._RESERVE) = saved


def share(cluster_file: str, scale: int, noise: float | None, seed: int, learn: bool) -> tuple[float, int]:
    cluster = parse_cluster(yaml.safe_load((SIM / cluster_file).read_text()))
    data = copy.deepcopy(yaml.safe_load((SIM / "dlrm_mix.yaml").read_text()))
    data["seed"] = seed
    data["generate"]["jobs"] *= scale
    data["generate"]["arrival_rate_per_h"] *= scale
    if noise is not None:
        data["generate"]["mem_noise_pct"] = noise
    workload = parse_workload(data, {g.name: g for g in cluster.gpu_models})
    r = simulate(workload, cluster, "complementary", margin_from_errors=learn)
    return r.throughput_jobs_per_h / ideal_throughput_jobs_per_h(workload, cluster), r.ooms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="7,1,2,3,4", help="workload seeds (comma-separated); 7 is policy_compare's")
    ap.add_argument("--seeds-4gpu", default="7,1", help="seeds for the 4-GPU cluster (4x the jobs, slower)")
    args = ap.parse_args()
    seeds = [int(x) for x in args.seeds.split(",")]
    seeds4 = [int(x) for x in args.seeds_4gpu.split(",")]
    print(f"share of the ideal bound (mean over seeds; seed 7 in brackets), OOMs summed; seeds {seeds}, 4 GPUs {seeds4}")
    print(f"{'variant':<14}" + "".join(f"{n:>24}" for n, *_ in SCENARIOS))
    full: dict[str, float] = {}
    for variant in ("full", "observed", "priced", "tail", "reserve", "margin", "all"):
        cells = []
        for name, f, scale, noise in SCENARIOS:
            runs = []
            for seed in (seeds4 if name == "4gpu" else seeds):
                with switched_off(variant) as learn:
                    runs.append((seed, *share(f, scale, noise, seed, learn)))
            mean = statistics.mean(s for _, s, _ in runs)
            s7 = next((s for seed, s, _ in runs if seed == 7), math.nan)
            cells.append(f"{mean:.3f} [{s7:.3f}] oom {sum(o for *_, o in runs):>3}")
            if variant == "full":
                full[name] = mean
        label = "all on" if variant == "full" else ("all off" if variant == "all" else f"no {variant}")
        print(f"{label:<14}" + "".join(f"{c:>24}" for c in cells), flush=True)
    print(f"ablation: full_1gpu={full['1gpu']:.3f} full_4gpu={full['4gpu']:.3f} full_noisy={full['noisy']:.3f}")


if __name__ == "__main__":
    main()
