"""Write benchmarks/sim/live_mix.yaml: dlrm_mix.yaml's job mix as jobs the live service
can run (issue 29 item 2).

    .venv/bin/python benchmarks/sim/make_live_mix.py [--jobs 60] [--seed 29] [--time-scale 45]

The live service plans from a job's *spec* (slurm_dlrm.estimate), never from a profile
written beside it, so every drawn dlrm_mix job gets the spec, from a grid of DLRM shapes,
whose estimate on an H100 is nearest to its profile (GPU memory per rank first, then SM,
bandwidth and host cores); its "true" figures keep the mix's noise around that estimate
(mem +-5 %, SM/bandwidth +-10 %, the told duration +-20 %). A share of the jobs are 2-rank
gangs (`world_size: 2`, ranks alike). Times are compressed by --time-scale (arrivals, run
times); the spec's steps are set so the estimate's run time is the told duration.

The estimator's physics bounds what a spec can be: an estimate's SM share always exceeds
its bandwidth share (embedding gathers are counted in both), so dlrm_mix's memory-bound
class (bandwidth 20-40 %, SM 8-20 %) maps to specs with SM >= bandwidth. The script
prints the mix it reached beside the target's class ranges.
"""

from __future__ import annotations

import argparse
import copy
import math
import random
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
GIB = 1 << 30
DATA_PATH = "data/live-mix.tsv"  # relative to the live run's work folder; never read by a stand-in


def _spec(rng: random.Random, world: int) -> dict[str, Any]:
    dim = rng.choice([32, 64, 128])
    # synthetic batches are made inline (1 core); file data takes loader workers
    data = rng.choice(["synthetic", "criteo-npy", "criteo-tsv"])
    workers = {"synthetic": 0, "criteo-npy": rng.choice([1, 2, 3]), "criteo-tsv": rng.choice([3, 4, 5, 6, 7])}[data]
    ntab = rng.choice([2, 4, 8, 16, 26])
    spec: dict[str, Any] = {
        "tables": [{"name": f"t{i}", "rows": int(10 ** rng.uniform(5, 7.6)), "dim": dim,
                    "pooling_factor": float(rng.choice([1, 2, 4, 8, 16, 32, 64]))} for i in range(ntab)],
        "dense_features": 13,
        "bottom_mlp": [*rng.choice([[256], [512, 256], [1024, 512], [2048, 1024]]), dim],
        "top_mlp": [*rng.choice([[256], [512, 256], [1024, 1024, 512], [2048, 2048, 1024]]), 1],
        "interaction": {"type": rng.choice(["dot", "dot", "dcn"])},
        "batch_size": rng.choice([256, 512, 1024, 2048, 4096, 8192]),
        "optimizer": {"type": rng.choice(["sgd", "adagrad"]), "lr": 0.01},
        "loader_workers": workers,
        "prefetch_batches": 2,
        "data": {"type": "synthetic", "zipf_alpha": 1.05} if data == "synthetic" else {"type": data, "path": DATA_PATH},
        "seed": 0,
    }
    if world > 1:
        spec["world_size"] = world
    return spec


def _distance(p: dict[str, Any], job: Any) -> float:
    def lg(a: float, b: float, floor: float) -> float:
        return math.log((a + floor) / (b + floor))

    return (3.0 * lg(p["gpu_mem_bytes"] / GIB, job.gpu_mem_bytes / GIB, 0.25) ** 2
            + lg(p["sm_util_pct"], job.sm_util_pct, 2.0) ** 2 + lg(p["membw_util_pct"], job.membw_util_pct, 2.0) ** 2
            + lg(p["host_cpu_cores"], job.host_cpu_cores, 0.5) ** 2)


def main(argv: list[str] | None = None) -> int:
    from slurm_dlrm.sim.files import _profile_from_spec, generate_jobs, parse_cluster

    ap = argparse.ArgumentParser(prog="make_live_mix", description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=60)
    ap.add_argument("--seed", type=int, default=29)
    ap.add_argument("--time-scale", type=float, default=45.0, help="divide arrivals and run times by this")
    ap.add_argument("--gang-share", type=float, default=0.2)
    ap.add_argument("--candidates", type=int, default=6000, help="spec shapes tried per world size")
    ap.add_argument("--out", default=str(HERE / "live_mix.yaml"))
    args = ap.parse_args(argv)
    mix = yaml.safe_load((HERE / "dlrm_mix.yaml").read_text())
    cluster = parse_cluster(yaml.safe_load((HERE / "cluster_local.yaml").read_text()))
    gpu = cluster.gpu_model("h100")
    gen = dict(mix["generate"], jobs=args.jobs, multi_gpu_share=args.gang_share, multi_gpu_ranks=[2],
               multi_gpu_rank_scale=[1.0, 1.0],
               # a few minutes each once compressed: the live run must end in minutes
               duration=dict(mix["generate"]["duration"], max_s=7200))
    jobs = generate_jobs(gen, {"h100": gpu}, args.seed)
    rng = random.Random(args.seed)
    pools: dict[int, list[tuple[dict[str, Any], dict[str, Any]]]] = {}
    for world in sorted({j.world_size for j in jobs}):
        pool = []
        for _ in range(args.candidates):
            s = _spec(rng, world)
            s_named = dict(s, name="x", steps=1)
            try:
                p = _profile_from_spec(s_named, gpu, "candidate")
            except Exception:  # noqa: BLE001 - a shape the spec limits refuse is just not a candidate
                continue
            if p["gpu_mem_bytes"] + (1 << 30) < gpu.memory_bytes // 2:
                pool.append((s, p))
        pools[world] = pool
    out_jobs = []
    noise = random.Random(args.seed + 1)
    for j in jobs:
        spec, p = min(pools[j.world_size], key=lambda sp: _distance(sp[1], j))
        told_s = (j.est_duration_s or j.solo_duration_s) / args.time_scale
        steps = max(20, round(told_s * p["solo_samples_per_s"] / spec["batch_size"]))
        name = j.name
        spec = copy.deepcopy(spec)
        spec.update(name=name, steps=steps, checkpoint_every_steps=max(1, steps // 10),
                    metrics_every_steps=max(1, steps // 100))
        entry = {"name": name, "arrival_s": round(j.arrival_s / args.time_scale, 2),
                 "solo_duration_s": round(j.solo_duration_s / args.time_scale, 2),
                 "world_size": j.world_size, "peak_at_frac": j.peak_at_frac,
                 # the mix's noise around the estimate this spec gets
                 "true": {"gpu_mem_gib": round(p["gpu_mem_bytes"] / GIB * (1 + noise.uniform(-0.05, 0.05)), 4),
                          "sm_util_pct": round(min(100.0, p["sm_util_pct"] * (1 + noise.uniform(-0.1, 0.1))), 2),
                          "membw_util_pct": round(min(100.0, p["membw_util_pct"] * (1 + noise.uniform(-0.1, 0.1))), 2)},
                 "spec": spec}
        out_jobs.append((j, p, entry))
    header = (f"# Generated by benchmarks/sim/make_live_mix.py --jobs {args.jobs} --seed {args.seed} "
              f"--time-scale {args.time_scale:g} --gang-share {args.gang_share:g}: dlrm_mix.yaml's classes as specs\n"
              "# the live service can run (see the script's docstring); times compressed. Do not edit by hand.\n")
    body = {"name": "live-mix", "jobs": [e for _, _, e in out_jobs]}
    Path(args.out).write_text(header + yaml.safe_dump(body, sort_keys=False, width=120))
    print(f"{'class':<14} {'n':>3} {'gangs':>5} {'sm% target':>11} {'sm% got':>8} {'bw% target':>11} {'bw% got':>8} "
          f"{'GiB target':>10} {'GiB got':>8} {'cpus target':>11} {'cpus got':>8}")
    for cls in sorted({j.name.rsplit("-", 1)[0] for j in jobs}):
        rows = [(j, p) for j, p, _ in out_jobs if j.name.rsplit("-", 1)[0] == cls]

        def mean(xs: list[float]) -> float:
            return sum(xs) / len(xs)

        print(f"{cls:<14} {len(rows):>3} {sum(j.world_size > 1 for j, _ in rows):>5} "
              f"{mean([j.sm_util_pct for j, _ in rows]):>11.1f} {mean([p['sm_util_pct'] for _, p in rows]):>8.1f} "
              f"{mean([j.membw_util_pct for j, _ in rows]):>11.1f} {mean([p['membw_util_pct'] for _, p in rows]):>8.1f} "
              f"{mean([j.gpu_mem_bytes / GIB for j, _ in rows]):>10.1f} "
              f"{mean([p['gpu_mem_bytes'] / GIB for _, p in rows]):>8.1f} "
              f"{mean([j.host_cpu_cores for j, _ in rows]):>11.1f} {mean([p['host_cpu_cores'] for _, p in rows]):>8.1f}")
    solo = [e["solo_duration_s"] for _, _, e in out_jobs]
    print(f"make_live_mix: jobs={len(out_jobs)} gangs={sum(e['world_size'] > 1 for _, _, e in out_jobs)} "
          f"last_arrival_s={max(e['arrival_s'] for _, _, e in out_jobs):.0f} "
          f"solo_s_sum={sum(s * e['world_size'] for s, (_, _, e) in zip(solo, out_jobs, strict=True)):.0f} "
          f"solo_s_max={max(solo):.0f} out={args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
