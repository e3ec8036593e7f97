"""Faults in the simulator: recovery on vs off vs no faults, on the same work, in one run.

Workload: benchmarks/sim/dlrm_mix.yaml at twice its size and rate (400 jobs, 40/h) as
repeated submissions of 60 specs (sweeps), on 4 nodes x 4 H100 (the 4-GPU shape of
benchmarks/sim/cluster_4gpu.yaml, four times), policy `complementary`.
Injected faults (slurm_dlrm/sim/faults.py):
- OOMs: 20% of the specs are under-estimated by 10-40% (beyond the 5% fence margin);
- host OOMs (issue 43): 10% of the specs use 20-60% more host memory than estimated
  (beyond the 5% margin and the agent's 10% tolerance: stopped, or killed by the
  kernel's OOM killer under the pack's --mem; OOM_HOST either way);
- node failures: every node fails after Exp(mean 48 h), back 30 min later;
- interference beyond the model: 10% of the specs use 3-5x the SM/bandwidth estimated.
Recovery on: decide_after_oom raise (GPU or host) + resume from the last checkpoint (every 300 s of
training) + per-spec learned correction; NODE_FAIL -> unfinished members requeued from
checkpoints; stragglers (find_stragglers) checkpointed and moved with their measured
profile. Recovery off: an OOM or a node failure ends the job as FAILED.
No faults: the same true work with estimates that cover it and no node failure.
Five fault seeds; figures are means over them (per-seed rows printed).

Run:  /work/main/.venv/bin/python benchmarks/faults_sim.py
Last line:  faults: completion_pct=X completion_pct_no_recovery=X jct_penalty_pct=X
(completion_pct: recovery on; jct_penalty_pct: mean JCT with faults and recovery over
the fault-free mean JCT, minus 1, in percent, averaged over the seeds.)
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from slurm_dlrm.sim import parse_cluster, parse_workload, simulate  # noqa: E402
from slurm_dlrm.sim.faults import (  # noqa: E402
    FaultConfig,
    FaultRuntime,
    RecoveryConfig,
    as_spec_families,
    inject_faults,
    with_right_estimates,
)

SIM = ROOT / "benchmarks" / "sim"
SEEDS = (0, 1, 2, 3, 4)
POLICY = "complementary"


def main() -> None:
    raw = yaml.safe_load((SIM / "cluster_4gpu.yaml").read_text())
    node = raw["nodes"][0]
    raw["name"] = "4x4gpu"
    raw["nodes"] = [dict(node, name=f"gpu{i}") for i in range(4)]
    cluster = parse_cluster(raw)
    data = copy.deepcopy(yaml.safe_load((SIM / "dlrm_mix.yaml").read_text()))
    data["generate"]["jobs"] *= 2
    data["generate"]["arrival_rate_per_h"] *= 2
    workload, fam_of = as_spec_families(parse_workload(data, {g.name: g for g in cluster.gpu_models}), 60, seed=3)
    recovery = RecoveryConfig(checkpoint_every_s=300.0)
    rows = []
    t0 = time.perf_counter()
    print(f"{len(workload.jobs)} jobs, {cluster.gpu_count} GPUs on {len(cluster.nodes)} nodes, policy {POLICY}")
    print(f"{'seed':>4} {'ooms':>5} {'host':>4} {'node_fail':>9} {'requeued':>8} {'moved':>5} {'lost_h':>6} "
          f"{'done_on%':>8} {'done_off%':>9} {'jct_free_s':>10} {'jct_on_s':>8} {'jct_off_s':>9} {'penalty%':>8}")
    for seed in SEEDS:
        cfg = FaultConfig(seed=seed, oom_family_frac=0.2, host_oom_family_frac=0.1, node_mtbf_h=48.0,
                          node_repair_s=1800.0, straggler_family_frac=0.1)
        faulted = inject_faults(workload, fam_of, cfg)
        free = simulate(with_right_estimates(faulted), cluster, POLICY,
                        faults=FaultRuntime(fam_of, FaultConfig(seed=seed), recovery))
        on_rt = FaultRuntime(fam_of, cfg, recovery)
        on = simulate(faulted, cluster, POLICY, faults=on_rt)
        off_rt = FaultRuntime(fam_of, cfg, RecoveryConfig(enabled=False))
        off = simulate(faulted, cluster, POLICY, faults=off_rt)
        assert free.completion_rate == 1.0, "the fault-free run must complete every job"
        penalty = (on.avg_jct_s / free.avg_jct_s - 1.0) * 100.0
        s = on_rt.stats
        rows.append((on.completion_rate, off.completion_rate, penalty))
        print(f"{seed:>4} {s.ooms:>5} {s.host_ooms:>4} {s.node_failures:>9} {s.oom_requeues + s.node_requeues:>8} "
              f"{s.straggler_moves:>5} {s.lost_work_s / 3600:>6.2f} {100 * on.completion_rate:>8.1f} "
              f"{100 * off.completion_rate:>9.1f} {free.avg_jct_s:>10.0f} {on.avg_jct_s:>8.0f} "
              f"{off.avg_jct_s:>9.0f} {penalty:>8.1f}")
    n = len(rows)
    done_on = 100.0 * sum(r[0] for r in rows) / n
    done_off = 100.0 * sum(r[1] for r in rows) / n
    penalty = sum(r[2] for r in rows) / n
    print(f"(jct_off_s counts only the jobs that completed; simulated in {time.perf_counter() - t0:.1f} s)")
    print(f"targets: completion >= 99% with recovery ({done_on:.1f}%, {done_off:.1f}% without); "
          f"JCT penalty <= 10% ({penalty:.1f}%)")
    print(f"faults: completion_pct={done_on:.1f} completion_pct_no_recovery={done_off:.1f} jct_penalty_pct={penalty:.1f}")


if __name__ == "__main__":
    main()
