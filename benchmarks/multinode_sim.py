"""What whole-node multi-node jobs cost the packs, in the simulator (issue 48 item 8).

The policies' mix (benchmarks/sim/dlrm_mix.yaml, 4x its jobs and arrival rate) on four
4-GPU nodes (cluster_4gpu.yaml's node, four times), run twice per policy on the same
packed jobs: alone, and with a few 2-node x 4-GPU jobs (sim/multinode.py: not packed,
first come first served; each reserves the nodes that drain first, which then take no
new pack or joiner, and holds them whole for its run) arriving evenly over the mix.
Side by side per policy, for the packed jobs only: their work rate (solo hours done
per hour of their makespan), mean JCT, p95 wait; and the multi-node jobs' waits.
`cost_x` = the packs' lost work rate over the share of GPU time the multi-node jobs
held: 1.0 means they cost the packs exactly the GPUs they took; above 1, the drain
(reserved nodes emptying while packs may not refill them) costs on top.

Run:  /work/main/.venv/bin/python benchmarks/multinode_sim.py   (also inside policy_compare.py)
Last line:  multinode_sim: policy=complementary multinode_jobs=N gpu_share_pct=X packed_rate_drop_pct=X
            cost_x=X packed_jct_rise_pct=X multinode_wait_p50_h=X
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from slurm_dlrm.sim import SimResult, Workload, parse_cluster, parse_workload, simulate  # noqa: E402
from slurm_dlrm.sim.files import SimCluster  # noqa: E402
from slurm_dlrm.sim.multinode import with_whole_node_jobs  # noqa: E402

SIM = Path(__file__).resolve().parent / "sim"
POLICIES = ("exclusive", "mem-best-fit", "complementary")
SCALE = 4  # the mix's jobs and arrival rate, x
MULTINODE_JOBS = 3
MULTINODE_NODES, GPUS_PER_NODE = 2, 4
MULTINODE_HOURS = 2.0


def cluster_and_mix() -> tuple[SimCluster, Workload]:
    data = yaml.safe_load((SIM / "cluster_4gpu.yaml").read_text())
    node = data["nodes"][0]
    data["nodes"] = [dict(node, name=f"gpu4{c}") for c in "abcd"]
    data["name"] = "4x4gpu"
    cluster = parse_cluster(data)
    mix = copy.deepcopy(yaml.safe_load((SIM / "dlrm_mix.yaml").read_text()))
    mix["generate"]["jobs"] *= SCALE
    mix["generate"]["arrival_rate_per_h"] *= SCALE
    return cluster, parse_workload(mix, {g.name: g for g in cluster.gpu_models})


def _pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))] if v else 0.0


def packed_figures(r: SimResult, multinode_ids: set[int]) -> dict[str, float]:
    packed = [o for o in r.jobs if o.job_id not in multinode_ids]
    done = [o for o in packed if o.state == "COMPLETED" and o.end_s is not None]
    span_h = (max(o.end_s for o in done) - r.first_arrival_s) / 3600.0 if done else 0.0  # type: ignore[type-var]
    return {
        "rate": sum(o.solo_duration_s for o in done) / 3600.0 / span_h if span_h > 0 else 0.0,
        "jct_h": sum(o.end_s - o.arrival_s for o in done) / len(done) / 3600.0 if done else 0.0,  # type: ignore[operator]
        "wait_p95_h": _pct([(o.start_s or o.arrival_s) - o.arrival_s for o in done], 0.95) / 3600.0,
        "done_pct": 100.0 * len(done) / len(packed) if packed else 0.0,
        "span_h": span_h,
    }


def compare() -> tuple[list[str], str]:
    """The side-by-side table's lines and the last line (complementary's figures)."""
    cluster, mix = cluster_and_mix()
    with_mn = with_whole_node_jobs(mix, MULTINODE_JOBS, MULTINODE_NODES, GPUS_PER_NODE, MULTINODE_HOURS * 3600)
    mn_ids = {j.job_id for j in with_mn.jobs if j.nodes > 1}
    lines = [f"Multi-node jobs (issue 48): {len(mix.jobs)} packed jobs on {cluster.name} ({cluster.gpu_count} GPUs), "
             f"alone and with {MULTINODE_JOBS} jobs of {MULTINODE_NODES} whole nodes x {GPUS_PER_NODE} GPUs, "
             f"{MULTINODE_HOURS:g} h each",
             f"{'policy':<14} {'packed rate alone':>17} {'with':>7} {'drop%':>6} {'GPU share%':>10} {'cost_x':>6} "
             f"{'JCT h alone':>11} {'with':>6} {'wait p95 h':>10} {'with':>6} {'mn wait h (each)':>20}"]
    last = ""
    for policy in POLICIES:
        t0 = time.perf_counter()
        alone = simulate(mix, cluster, policy)
        both = simulate(with_mn, cluster, policy)
        print(f"  simulated {policy} with and without multi-node jobs in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr)
        a, b = packed_figures(alone, set()), packed_figures(both, mn_ids)
        mn = [o for o in both.jobs if o.job_id in mn_ids]
        waits_h = [((o.start_s if o.start_s is not None else both.end_s) - o.arrival_s) / 3600.0 for o in mn]
        # the share of the GPU time over the packed jobs' makespan the multi-node jobs held
        held_gpu_h = sum(MULTINODE_NODES * GPUS_PER_NODE * ((o.end_s or both.end_s) - (o.start_s or both.end_s))
                         for o in mn) / 3600.0
        share = 100.0 * held_gpu_h / (cluster.gpu_count * b["span_h"]) if b["span_h"] > 0 else 0.0
        drop = 100.0 * (1.0 - b["rate"] / a["rate"]) if a["rate"] > 0 else 0.0
        cost_x = drop / share if share > 0 else 0.0
        jct_rise = 100.0 * (b["jct_h"] / a["jct_h"] - 1.0) if a["jct_h"] > 0 else 0.0
        lines.append(f"{policy:<14} {a['rate']:>17.2f} {b['rate']:>7.2f} {drop:>6.1f} {share:>10.1f} {cost_x:>6.2f} "
                     f"{a['jct_h']:>11.2f} {b['jct_h']:>6.2f} {a['wait_p95_h']:>10.2f} {b['wait_p95_h']:>6.2f} "
                     f"{','.join(f'{w:.2f}' for w in waits_h):>20}")
        if b["done_pct"] < 100.0 or any(o.state != "COMPLETED" for o in mn):
            lines.append(f"  {policy}: not all done: packed {b['done_pct']:.1f}%, multi-node "
                         f"{[o.state for o in mn]}")
        if policy == "complementary":
            last = (f"multinode_sim: policy=complementary multinode_jobs={len(mn)} gpu_share_pct={share:.1f} "
                    f"packed_rate_drop_pct={drop:.1f} cost_x={cost_x:.2f} packed_jct_rise_pct={jct_rise:.1f} "
                    f"multinode_wait_p50_h={_pct(waits_h, 0.5):.2f}")
    lines.append("packed rate: solo hours of the packed jobs done per hour of their makespan; drop% over GPU share% "
                 "= cost_x (1.0: they cost the packs the GPUs they held, no more)")
    return lines, last


def main() -> None:
    lines, last = compare()
    print("\n".join(lines))
    print(last)


if __name__ == "__main__":
    main()
