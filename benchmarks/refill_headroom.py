"""What the refill headroom buys (issue 24): `[packing] refill_headroom_pct` swept on
benchmarks/sim/cluster_4gpu.yaml with dlrm_mix.yaml (seeds 1-5, means), for the two
refilling policies. The baseline is `share`: every pack asks for its GPUs' whole share of
the node, as before the key (`--mem=63G -c 9` for a 1.5 GiB pack), and as the simulator's
cluster files still do, since their node runs nothing but packs.

The simulated node runs nothing but our packs, so what a smaller allocation gives other
users back is shown as what the packs held: `cpus_held%` / `mem_held%`, the CPUs and host
memory the packs asked Slurm for, time-averaged over the run, as a share of the
cluster's (the rest is left to other users' jobs), beside what it costs or gains our
own jobs (throughput, JCT). A pack whose allocation never holds a waiting job drains
(docs/packing.md), so a small headroom costs refills, not a stuck pack.

Run:  .venv/bin/python benchmarks/refill_headroom.py [--seeds 5]
Last line:  refill_headroom: pct=100 tput_per_h=... mem_held_pct=... baseline_... (complementary)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from slurm_dlrm.sim import parse_cluster, parse_workload, simulate  # noqa: E402

PCTS: tuple[float | str, ...] = (0, 25, 100, 400, 1000, "share")
MULTI_PCTS: tuple[float | str, ...] = (100, 1000, "share")
POLICIES = ("complementary", "mem-best-fit")
DEFAULT_PCT, BASELINE_PCT = 100, "share"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=5)
    args = ap.parse_args()
    cluster_data = yaml.safe_load((ROOT / "benchmarks/sim/cluster_4gpu.yaml").read_text())
    workload_data = yaml.safe_load((ROOT / "benchmarks/sim/dlrm_mix.yaml").read_text())
    table: dict[tuple[str, float | str], tuple[float, ...]] = {}
    for pct in PCTS:
        data = dict(cluster_data, packing=dict(cluster_data["packing"], refill_headroom_pct=pct))
        cluster = parse_cluster(data)
        node_cpus = sum(n.cpus for n in cluster.nodes)
        node_mem = sum(n.memory_bytes for n in cluster.nodes)
        for policy in POLICIES:
            runs = []
            for seed in range(1, args.seeds + 1):
                w = parse_workload(workload_data, {g.name: g for g in cluster.gpu_models}, seed=seed)
                r = simulate(w, cluster, policy)
                span_s = max(1.0, r.end_s - r.first_arrival_s)
                runs.append((r.throughput_jobs_per_h, r.avg_jct_s / 3600, r.p95_jct_s / 3600,
                             100 * r.held_cpu_s / span_s / node_cpus, 100 * r.held_mem_byte_s / span_s / node_mem))
            table[policy, pct] = tuple(statistics.mean(x[i] for x in runs) for i in range(5))
    print(f"{'refill_headroom_pct':>19}"
          + "".join(f"   {p:>13} tput/h avgJCT_h p95JCT_h cpus_held% mem_held%" for p in POLICIES))
    for pct in PCTS:
        label = f"{pct}" + (" (default)" if pct == DEFAULT_PCT else " (baseline)" if pct == BASELINE_PCT else "")
        print(f"{label:>19}" + "".join(f"   {'':>13} {t:6.2f} {a:8.2f} {q:8.2f} {c:10.1f} {m:9.1f}"
                                       for t, a, q, c, m in (table[p, pct] for p in POLICIES)))
    # The same with 25% of the jobs on 2 or 4 GPUs (policy_compare's multi mix): a
    # gang joins only a pack whose allocation holds all its ranks' CPUs and memory.
    multi_data = dict(workload_data, generate=dict(workload_data["generate"], multi_gpu_share=0.25))
    multi: dict[float | str, tuple[float, ...]] = {}
    for pct in MULTI_PCTS:
        cluster = parse_cluster(dict(cluster_data, packing=dict(cluster_data["packing"], refill_headroom_pct=pct)))
        runs = []
        for seed in range(1, args.seeds + 1):
            w = parse_workload(multi_data, {g.name: g for g in cluster.gpu_models}, seed=seed)
            r = simulate(w, cluster, "complementary")
            runs.append((r.throughput_jobs_per_h, r.avg_jct_s / 3600))
        multi[pct] = tuple(statistics.mean(x[i] for x in runs) for i in range(2))
    print("multi-GPU mix (25% of jobs with 2 or 4 ranks), complementary: "
          + ", ".join(f"{p}: {t:.2f} jobs/h, avg JCT {a:.2f} h" for p, (t, a) in multi.items()))
    t, a, q, c, m = table["complementary", DEFAULT_PCT]
    bt, ba, bq, bc, bm = table["complementary", BASELINE_PCT]
    print(f"refill_headroom: pct={DEFAULT_PCT} tput_per_h={t:.2f} avg_jct_h={a:.2f} p95_jct_h={q:.2f} "
          f"cpus_held_pct={c:.1f} mem_held_pct={m:.1f} baseline_pct={BASELINE_PCT} baseline_tput_per_h={bt:.2f} "
          f"baseline_avg_jct_h={ba:.2f} baseline_p95_jct_h={bq:.2f} baseline_cpus_held_pct={bc:.1f} "
          f"baseline_mem_held_pct={bm:.1f} multi_tput_per_h={multi[DEFAULT_PCT][0]:.2f} "
          f"baseline_multi_tput_per_h={multi[BASELINE_PCT][0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
