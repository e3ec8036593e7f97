"""Exporter benchmark: one Prometheus scrape over 50 stores, 1,000 active jobs, 1M samples.

Builds 50 user stores (``<dir>/<user>/store.sqlite``, the layout ``store_dir =
".../{user}"`` gives): each holds 20 active jobs (16 running as members of 4 RUNNING
2-GPU packs with GPU samples up to now, 4 pending) and a finished history of 80 jobs;
1,000,000 samples in all. Then, in a fresh child process (so that its peak RSS is the
exporter's, not the builder's), scrapes it through the real collector and
`prometheus_client.generate_latest`, and parses the text back:

- warm-up: what `slurm-dlrm exporter` reads before it opens its port
  (`StoreCollector.warm()`: every store's acct GPU-seconds and histograms computed, the
  lifecycle counters counted from the first event), so no scrape pays for it;
- steady: the first scrape right after, then --scrapes scrapes 15 s apart (a fake monotonic clock), as Prometheus would
  make them: each store's slow figures are refreshed once a minute, staggered; the
  summary's scrape_ms is the slowest of these;
- baseline: what an admin has without the exporter, `acct --all-users` over the same
  stores (acct_rows per store, read-only), and the exporter with every figure
  recomputed on every scrape (--slow-every 0).

    .venv/bin/python benchmarks/exporter_scrape.py [--keep-db DIR]

Targets: scrape < 200 ms, < 100 MB. Last line: ``exporter: stores=50 scrape_ms=X rss_mb=X``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from slurm_dlrm.site import load_site  # noqa: E402
from slurm_dlrm.store import JobState, NewPlacement, PackState, Store  # noqa: E402
from slurm_dlrm.store.synthetic import populate  # noqa: E402

N_STORES = 50
ACTIVE_PER_STORE = 20
RUNNING_PER_STORE = 16
HISTORY_PER_STORE = 80
TOTAL_SAMPLES = 1_000_000
GIB = 1 << 30


def build_store(path: Path, user: str, seed: int, now: float, samples_budget: int) -> int:
    """One user's store; returns the samples written."""
    rng = random.Random(seed)
    store = Store(path)
    n = 0
    try:
        # the history: finished jobs, their member and GPU samples, a day ago
        hist_samples_per_job = max(1, (samples_budget - 3360) // (HISTORY_PER_STORE + HISTORY_PER_STORE // 10))
        h = populate(store, n_jobs=HISTORY_PER_STORE, samples_per_job=hist_samples_per_job,
                     t0=now - 86400, seed=seed, user=user)
        n += h.n_samples
        with store.write():
            ids = [store.add_job(user=user, name=f"act-{i}", spec={"name": f"act-{i}"},
                                 spec_fingerprint=f"fp{rng.randint(0, 9)}", gpu_model="h100",
                                 submit_time=now - rng.uniform(600, 3600),
                                 estimate={"gpu_peak_bytes": rng.randint(2, 16) * GIB,
                                           "host_peak_bytes": 4 * GIB})
                   for i in range(ACTIVE_PER_STORE)]
            running = ids[:RUNNING_PER_STORE]
            start = now - 600
            for p in range(RUNNING_PER_STORE // 4):
                members = running[p * 4:(p + 1) * 4]
                pid = store.add_pack(
                    name=f"dlrm-{user}-act{p}", user=user, policy="complementary", n_gpus=2,
                    placements=[NewPlacement(j, 0, k % 2, mps_thread_pct=50, gpu_mem_limit_bytes=8 * GIB,
                                             predicted_speed=0.7) for k, j in enumerate(members)],
                    t=start)
                store.transition_pack(pid, PackState.QUEUED, "submitted", slurm_job_id=str(50000 + seed * 10 + p),
                                      t=start + 1)
                store.transition_pack(pid, PackState.RUNNING, "started", nodes=f"node{p + 1}", t=start + 5)
                for j in members:
                    store.transition_job(j, JobState.RUNNING, "member started", t=start + 6)
                rows = []
                for k, j in enumerate(members):
                    for i in range(60):  # the last 10 minutes, every 10 s
                        rows.append({"t": start + 6 + i * 10, "pack_id": pid, "job_id": j, "node": f"node{p + 1}",
                                     "gpu_index": k % 2, "sm_util_pct": float(rng.randint(10, 60)),
                                     "mem_util_pct": float(rng.randint(5, 40)),
                                     "gpu_mem_bytes": rng.randint(1, 8) * GIB, "host_cpu_pct": 100.0,
                                     "rss_bytes": 2 * GIB, "samples_per_s": rng.uniform(5000, 20000)})
                for g in range(2):
                    for i in range(300):  # the GPU's own samples, every 2 s
                        rows.append({"t": start + 6 + i * 2, "pack_id": pid, "job_id": None, "node": f"node{p + 1}",
                                     "gpu_index": g, "sm_util_pct": float(rng.randint(40, 95)),
                                     "mem_util_pct": float(rng.randint(10, 60)),
                                     "gpu_mem_bytes": rng.randint(8, 60) * GIB})
                n += store.insert_samples_in_tx(rows)
    finally:
        store.close()
    return n


def build(root: Path) -> int:
    marker = root / "built.json"
    if marker.exists():
        return int(json.loads(marker.read_text())["samples"])
    now = time.time()
    total = 0
    per_store = TOTAL_SAMPLES // N_STORES
    for i in range(N_STORES):
        budget = per_store + (TOTAL_SAMPLES - total - per_store * (N_STORES - i) if i == N_STORES - 1 else 0)
        total += build_store(root / f"user{i:02d}" / "store.sqlite", f"user{i:02d}", i, now, budget)
    marker.write_text(json.dumps({"samples": total, "built": now}))
    return total


def measure(root: Path, scrapes: int) -> dict[str, float]:
    """In a fresh process: scrape the stores as the exporter does."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from slurm_dlrm.exporter import StoreCollector, make_registry
    from slurm_dlrm.store.acct import AcctFilter, acct_all_users, acct_rows

    site = dataclasses.replace(load_site(str(REPO / "site-config" / "site.toml")), store_dir=str(root / "{user}"))
    fake_mono = [1000.0]
    # The stores' active samples run up to the moment they were built: the scrapes see
    # them as if made right then (the default GPU sample window, 60 s at 2 s sampling)
    built = float(json.loads((root / "built.json").read_text())["built"])
    col = StoreCollector(site, all_users=True, slow_every_s=60.0, clock=lambda: built + 2.0,
                         monotonic=lambda: fake_mono[0])
    reg = make_registry(col)

    cpu: list[float] = []

    def scrape() -> tuple[float, str]:
        t, c = time.perf_counter(), time.process_time()
        text = generate_latest(reg).decode()
        cpu.append((time.process_time() - c) * 1000)
        return (time.perf_counter() - t) * 1000, text

    c = time.process_time()
    cold_ms = 1000 * col.warm()
    cpu.append((time.process_time() - c) * 1000)
    first_ms, text = scrape()
    fams = list(text_string_to_metric_families(text))
    n_series = sum(len(f.samples) for f in fams)
    steady = [first_ms]
    for _ in range(scrapes):
        fake_mono[0] += 15.0
        ms, text = scrape()
        steady.append(ms)
    list(text_string_to_metric_families(text))  # it parses
    stores = col.last_stores_read
    members = sum(s.value for f in fams if f.name == "slurm_dlrm_gpu_members" for s in f.samples)
    running = sum(s.value for f in fams if f.name == "slurm_dlrm_jobs" for s in f.samples
                  if s.labels["state"] == "RUNNING")
    active = sum(s.value for f in fams if f.name == "slurm_dlrm_jobs" for s in f.samples
                 if s.labels["state"] in ("RUNNING", "PENDING"))
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    # baselines: every figure recomputed each scrape; acct --all-users
    full = StoreCollector(site, all_users=True, slow_every_s=0.0, clock=lambda: built + 2.0)
    freg = make_registry(full)
    generate_latest(freg)
    full_ms = []
    for _ in range(3):
        t = time.perf_counter()
        generate_latest(freg)
        full_ms.append((time.perf_counter() - t) * 1000)
    acct_ms = []
    for _ in range(3):
        t = time.perf_counter()
        rows, _w = acct_all_users(site, lambda st: acct_rows(st, AcctFilter(), built + 2.0))
        acct_ms.append((time.perf_counter() - t) * 1000)
    return {"stores": stores, "cold_ms": cold_ms, "steady_max_ms": max(steady),
            "steady_median_ms": statistics.median(steady), "cold_cpu_ms": cpu[0],
            "steady_cpu_max_ms": max(cpu[1:]), "steady_cpu_median_ms": statistics.median(cpu[1:]), "series": n_series, "members": members,
            "running": running, "active": active, "rss_mb": rss_mb, "full_ms": min(full_ms),
            "acct_all_users_ms": min(acct_ms), "acct_rows": len(rows), "cpu_s": time.process_time()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keep-db", metavar="DIR", help="Build the stores here once and reuse them.")
    ap.add_argument("--scrapes", type=int, default=8, help="Steady-state scrapes, 15 s apart (fake clock).")
    ap.add_argument("--measure", metavar="DIR", help=argparse.SUPPRESS)  # the child process
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(Path(args.measure), args.scrapes)))
        return
    tmp = None
    if args.keep_db:
        root = Path(args.keep_db)
        root.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="exporter-bench-")
        root = Path(tmp.name)
    os.chmod(root, 0o700)
    t = time.perf_counter()
    samples = build(root)
    print(f"stores: {N_STORES} under {root}, {samples:,} samples (built/reused in {time.perf_counter() - t:.1f} s)")
    out = subprocess.run(  # noqa: S603 - fixed argv, this script as the child
        [sys.executable, __file__, "--measure", str(root), "--scrapes", str(args.scrapes)],
        check=True, capture_output=True, text=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"active jobs: {r['active']:.0f} ({r['running']:.0f} running as {r['members']:.0f} GPU members), "
          f"{r['series']} series per scrape")
    print(f"{'':34} {'wall ms':>8} {'CPU ms':>8}")
    print(f"{'exporter, warm-up before serving':34} {r['cold_ms']:8.1f} {r['cold_cpu_ms']:8.1f}"
          "   (at start, before the port opens)")
    print(f"{'exporter, steady, median':34} {r['steady_median_ms']:8.1f} {r['steady_cpu_median_ms']:8.1f}")
    print(f"{'exporter, steady, slowest':34} {r['steady_max_ms']:8.1f} {r['steady_cpu_max_ms']:8.1f}"
          "   (target < 200)")
    print(f"{'baseline: every figure each scrape':34} {r['full_ms']:8.1f}")
    print(f"{'baseline: acct --all-users':34} {r['acct_all_users_ms']:8.1f}   ({r['acct_rows']} rows)")
    print(f"peak RSS of the scraping process: {r['rss_mb']:.1f} MB (target < 100); "
          f"its CPU time {r['cpu_s']:.2f} s; load average {os.getloadavg()[0]:.1f}")
    if tmp is not None:
        tmp.cleanup()
    print(f"exporter: stores={r['stores']} scrape_ms={r['steady_max_ms']:.0f} rss_mb={r['rss_mb']:.0f}")


if __name__ == "__main__":
    main()
