"""One dispatch round of the packing service with 1,000 pending jobs (FakeSlurm).

Side by side, in one run: the policy's `plan()` alone (the pure decision, the floor),
then whole rounds (observe + plan + pack folders + placement files + scripts + sbatch
+ store transitions) on the example site (2 nodes x 4 GPUs: most jobs wait for room)
and on a large site (64 nodes x 4 GPUs: every job is placed, ~150 packs written and
submitted), for the `exclusive` baseline policy and for `complementary`.

    /work/main/.venv/bin/python benchmarks/service_round.py

Target: < 2 s for the round. Last line: `round: jobs=1000 seconds=X` (the large site,
complementary: the most work a round does).
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
import time
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from slurm_dlrm.packing.model import PackingRequest, limits_from_site  # noqa: E402
from slurm_dlrm.packing.policies import plan  # noqa: E402
from slurm_dlrm.service.core import PackingService, ServiceSettings  # noqa: E402
from slurm_dlrm.service.spool import write_job_spec  # noqa: E402
from slurm_dlrm.site import REPO_SITE_FILE, parse_site  # noqa: E402
from slurm_dlrm.slurm.fake import FakeSlurm  # noqa: E402
from slurm_dlrm.store.store import Store  # noqa: E402

JOBS = 1000
GIB = 1 << 30
MIB = 1 << 20


def site_for(tmp: Path, nodes: int):
    data = tomllib.loads(REPO_SITE_FILE.read_text())
    data["site"]["store_dir"] = str(tmp / "store-{user}")
    data["site"]["spool_dir"] = str(tmp / "spool-{user}")
    data["nodes"][0]["names"] = f"node[1-{nodes}]"
    data["partitions"][0]["nodes"] = f"node[1-{nodes}]"
    return parse_site(data, "bench")


def estimate(rng: random.Random) -> dict:
    gpu = int(rng.uniform(0.5, 12) * GIB)
    label = rng.choice(["compute-bound", "memory-bound", "host-bound"])
    return {"gpu_peak_bytes": gpu, "host_peak_bytes": int(rng.uniform(0.5, 8) * GIB),
            "gpu_breakdown": {"embeddings": gpu - 520 * MIB, "cuda_context": 520 * MIB}, "host_breakdown": {},
            "profile": {"sm_util_pct": rng.uniform(5, 60), "membw_util_pct": rng.uniform(5, 60),
                        "host_cpu_cores": rng.choice([1, 1, 2, 3]), "label": label, "flops_per_sample": 1e6,
                        "emb_bytes_per_sample": 1e3, "solo_samples_per_s": rng.uniform(1e4, 1e6)}}


def fill(store: Store, n: int, spool: Path, seed: int = 0) -> None:
    """n pending jobs, as `submit` leaves them (store rows and spec files)."""
    rng = random.Random(seed)
    with store.write():
        for i in range(n):
            name = f"job{i}"
            spec = {"name": name, "steps": 1000, "batch_size": 2048}
            job_id = store.add_job(user="bench", name=name, spec=spec, spec_fingerprint=f"fp{i % 37}",
                                   estimate=estimate(rng), gpu_model="h100")
            write_job_spec(spool, job_id, spec)


def timed_round(tmp: Path, nodes: int, policy: str) -> tuple[float, float, int, int, float]:
    site = site_for(tmp, nodes)
    with Store(tmp / "store.sqlite") as store:
        fill(store, JOBS, site.spool_dir_for("bench"))
        slurm = FakeSlurm(nodes=[f"node{i}" for i in range(1, nodes + 1)], user="bench")
        svc = PackingService(store, slurm, site, ServiceSettings(user="bench", python="/venv/bin/python",
                                                                  policy=policy))
        t0, c0 = time.perf_counter(), time.process_time()
        stats = svc.run_round()
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        t1 = time.perf_counter()
        svc.run_round()  # the next round: observes the queued packs, plans what is left
        next_s = time.perf_counter() - t1
    return seconds, cpu, stats.packs_submitted, stats.jobs_planned, next_s


def plan_only(tmp: Path, nodes: int, policy: str) -> float:
    site = site_for(tmp, nodes)
    with Store(tmp / "store.sqlite") as store:
        fill(store, JOBS, site.spool_dir_for("bench"))
        svc = PackingService(store, FakeSlurm(user="bench"), site, ServiceSettings(user="bench", policy=policy))
        demands = tuple(svc.demand_of(j) for j in store.jobs(["PENDING"]))
    request = PackingRequest(jobs=demands, gpu_models=tuple(site.gpu_models.values()), nodes=svc.node_shapes(
        site.default_partition), limits=limits_from_site(site))
    t0 = time.perf_counter()
    plan(request, policy)
    return time.perf_counter() - t0


def main() -> None:
    rows = []
    last = 0.0
    for nodes in (2, 64):
        for policy in ("exclusive", "complementary"):
            with tempfile.TemporaryDirectory() as d:
                p_s = plan_only(Path(d), nodes, policy)
            with tempfile.TemporaryDirectory() as d:
                s, cpu, packs, planned, next_s = timed_round(Path(d), nodes, policy)
            rows.append((nodes * 4, policy, p_s, s, cpu, packs, planned, next_s))
            last = s
    print(f"{'GPUs':>5} {'policy':<14} {'plan() s':>9} {'round s':>8} {'round CPU s':>12} {'packs':>6} "
          f"{'planned':>8} {'next round s':>13}")
    for gpus, policy, p_s, s, cpu, packs, planned, next_s in rows:
        print(f"{gpus:>5} {policy:<14} {p_s:>9.3f} {s:>8.3f} {cpu:>12.3f} {packs:>6} {planned:>8} {next_s:>13.3f}")
    print(f"target: a round with 1,000 pending jobs < 2 s; load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} CPUs (wall time grows with load and disk contention, CPU time less)")
    print(f"round: jobs={JOBS} seconds={last:.3f}")


if __name__ == "__main__":
    main()
