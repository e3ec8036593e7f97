"""How long one `complementary` plan takes, from 100 to 100,000 pending jobs.

Jobs are drawn from the classes of benchmarks/sim/dlrm_mix.yaml; the cluster has one
GPU per 10 jobs, on 4-GPU nodes (104 cores, 800 GiB). Each size is planned 3 times and
the best time is reported (the machine is shared). The baselines' times are printed
beside for 10,000 jobs.

Run:  /work/main/.venv/bin/python benchmarks/plan_scale.py
Last line:  plan: jobs=10000 gpus=1000 seconds=X   (target < 1 s)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from slurm_dlrm.packing import NodeShape, PackingRequest, plan  # noqa: E402
from slurm_dlrm.sim import parse_cluster, parse_workload  # noqa: E402
from slurm_dlrm.sim.engine import _demand  # noqa: E402
from slurm_dlrm.site import GIB  # noqa: E402

SIM = ROOT / "benchmarks" / "sim"


def request(n_jobs: int, cluster_models: tuple) -> PackingRequest:  # type: ignore[type-arg]
    data = yaml.safe_load((SIM / "dlrm_mix.yaml").read_text())
    data["generate"]["jobs"] = n_jobs
    workload = parse_workload(data, {g.name: g for g in cluster_models})
    jobs = tuple(_demand(j, j.gpu_mem_bytes, j.est_duration_s) for j in workload.jobs)
    gpus = max(1, n_jobs // 10)
    nodes = (NodeShape("h100", 4, 104, 800 * GIB, count=max(1, gpus // 4), name="n"),)
    return PackingRequest(jobs=jobs, gpu_models=cluster_models, nodes=nodes)


def best_of(req: PackingRequest, policy: str, repeat: int) -> tuple[float, int]:
    best = float("inf")
    placed = 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        p = plan(req, policy)
        best = min(best, time.perf_counter() - t0)
        placed = len(p.placed_job_ids)
    return best, placed


def main() -> None:
    models = parse_cluster(yaml.safe_load((SIM / "cluster_4gpu.yaml").read_text())).gpu_models
    print(f"{'jobs':>8} {'gpus':>6} {'placed':>7} {'seconds':>8} {'us/job':>7}")
    t10k = None
    for n in (100, 1000, 10000, 100000):
        req = request(n, models)
        secs, placed = best_of(req, "complementary", 3 if n <= 10000 else 1)
        print(f"{n:>8} {n // 10:>6} {placed:>7} {secs:>8.3f} {1e6 * secs / n:>7.1f}")
        if n == 10000:
            t10k = secs
            base = {p: best_of(req, p, 1)[0] for p in ("exclusive", "first-fit", "mem-best-fit")}
    print("baselines at 10,000 jobs: " + ", ".join(f"{p} {s:.3f} s" for p, s in base.items()))
    print(f"plan: jobs=10000 gpus=1000 seconds={t10k:.3f}")


if __name__ == "__main__":
    main()
