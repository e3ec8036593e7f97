"""How far complementary can get over first-fit when the synthetic generator is the truth
(issue 16, the `robust:` line of policy_compare.py), all in one run, 1 GPU:

1. The learned planner's model error on the co-locations that actually ran (every group
   the simulator's truth was asked about while complementary planned with the learned
   model): the model against the truth, beside the analytic defaults. A large error
   there would mean the samples do not cover what the planner picks.
2. Complementary planning with the truth itself (the generator without its noise): an
   exact model. If that is no better than the learned or the analytic planner, the
   model is not what holds the gain back.
3. A fluid upper bound on throughput under each truth: jobs grouped into types (label x
   GPU-memory tercile, type means of the true profile), every group of types that fits
   one GPU's memory (true peak + CUDA context, no margin) and the node's CPUs, with
   its speeds under the truth; a linear program (scipy's HiGHS) picks how long each
   group runs so that every type's solo work is done in the least time. No arrivals,
   no start-up, no fences' margins, jobs divisible: no OOM-free policy beats it, up to
   the type averaging (9 or 15 types move it by < 1%).

Run:  .venv/bin/python benchmarks/robust_ceiling.py
Last line:  robust_ceiling: ff_syn=X bound_syn=X bound_syn_vs_ff=X compl_analytic=X compl_learned=X
            compl_exact=X learned_mae_ran=X analytic_mae_ran=X need_share_for_1_15=X share_default=X
"""

from __future__ import annotations

import copy
import itertools
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import policy_compare as pc  # noqa: E402

from slurm_dlrm.packing.interference import (  # noqa: E402
    DEFAULT_PARAMS,
    InterferenceParams,
    predict_speeds_from_fractions,
)
from slurm_dlrm.sim import SimCluster, Workload, simulate  # noqa: E402
from slurm_dlrm.truth import SyntheticColocation  # noqa: E402

GIB = 1 << 30


class Recorder:
    """A truth that remembers every group it was asked about (the co-locations that ran)."""

    name = "recorder"

    def __init__(self, inner: SyntheticColocation) -> None:
        self.inner = inner
        self.groups: set[tuple[tuple[float, ...], tuple[float, ...]]] = set()

    def speeds_from_fractions(self, sm: Sequence[float], bw: Sequence[float]) -> list[float]:
        self.groups.add((tuple(sm), tuple(bw)))
        return self.inner.speeds_from_fractions(sm, bw)


def fluid_bound_jobs_per_h(workload: Workload, cluster: SimCluster, truth: InterferenceParams,
                           terciles: int = 3) -> float:
    """The LP bound of the module docstring (one node, one GPU)."""
    import numpy as np
    from scipy.optimize import linprog

    node = cluster.nodes[0]
    gpu = cluster.gpu_model(node.gpu_model)
    ctx = gpu.cuda_context_bytes + gpu.cublas_workspace_bytes
    cap = gpu.memory_bytes - gpu.cuda_context_bytes
    jobs = list(workload.jobs)
    types = []
    for label in sorted({j.label for j in jobs}):
        js = sorted((j for j in jobs if j.label == label), key=lambda j: j.true_gpu_mem_bytes)
        for b in range(terciles):
            part = js[b * len(js) // terciles:(b + 1) * len(js) // terciles]
            if part:
                types.append((sum(j.solo_duration_s for j in part),
                              statistics.mean(j.true_sm_util_pct for j in part) / 100,
                              statistics.mean(j.true_membw_util_pct for j in part) / 100,
                              statistics.mean(j.true_gpu_mem_bytes for j in part) + ctx,
                              statistics.mean(j.host_cpu_cores for j in part)))
    k_types = len(types)
    cols = []
    for n in range(1, cluster.limits.members_per_gpu + 1):
        for combo in itertools.combinations_with_replacement(range(k_types), n):
            if sum(types[k][3] for k in combo) > cap or sum(types[k][4] for k in combo) > node.cpus:
                continue
            speeds = (predict_speeds_from_fractions([types[k][1] for k in combo], [types[k][2] for k in combo], truth)
                      if n > 1 else [1.0])
            col = [0.0] * k_types
            for k, x in zip(combo, speeds, strict=True):
                col[k] += x
            cols.append(col)
    a = np.array(cols).T  # types x groups: solo work per second of running the group
    res = linprog(np.ones(a.shape[1]), A_ub=-a, b_ub=-np.array([t[0] for t in types]), bounds=(0, None),
                  method="highs")
    if res.status != 0:
        raise RuntimeError(f"fluid bound: {res.message}")
    return len(jobs) / (float(res.fun) / 3600)


def main() -> None:
    cluster = pc.parse_cluster(yaml.safe_load((pc.SIM / "cluster_1gpu.yaml").read_text()))
    data = copy.deepcopy(yaml.safe_load((pc.SIM / "dlrm_mix.yaml").read_text()))
    workload = pc.parse_workload(data, {g.name: g for g in cluster.gpu_models})
    synthetic = SyntheticColocation()
    syn = InterferenceParams(speed_model=synthetic)
    exact = InterferenceParams(speed_model=SyntheticColocation(noise_pct=0.0))
    learned = pc.agent_sample_model(workload, syn)

    def tput(policy: str, truth: InterferenceParams | None, plan: InterferenceParams | None) -> float:
        return simulate(workload, cluster, policy, true_params=truth, plan_params=plan).throughput_jobs_per_h

    ff_syn = tput("first-fit", syn, None)
    ff_default = tput("first-fit", None, None)
    compl_default = tput("complementary", None, None)
    compl_analytic = tput("complementary", syn, None)
    compl_exact = tput("complementary", syn, exact)
    rec = Recorder(synthetic)
    compl_learned = simulate(workload, cluster, "complementary", true_params=InterferenceParams(speed_model=rec),
                             plan_params=learned).throughput_jobs_per_h

    # 1. Error on the co-locations that ran: the planner sees the estimates, the truth
    # runs on the true profiles.
    by_true = {(min(1.0, j.true_sm_util_pct / 100), min(1.0, j.true_membw_util_pct / 100)): j for j in workload.jobs}
    err_l: list[float] = []
    err_a: list[float] = []
    sizes: dict[int, int] = {}
    for sm, bw in rec.groups:
        js = [by_true[(s, b)] for s, b in zip(sm, bw, strict=True)]
        est_sm, est_bw = [j.sm_util_pct / 100 for j in js], [j.membw_util_pct / 100 for j in js]
        true_speeds = synthetic.speeds_from_fractions(list(sm), list(bw))
        err_l += [p - t for p, t in zip(predict_speeds_from_fractions(est_sm, est_bw, learned), true_speeds, strict=True)]
        err_a += [p - t for p, t in zip(predict_speeds_from_fractions(est_sm, est_bw, DEFAULT_PARAMS), true_speeds,
                                        strict=True)]
        sizes[len(sm)] = sizes.get(len(sm), 0) + 1
    mae_l = statistics.mean(abs(e) for e in err_l)
    mae_a = statistics.mean(abs(e) for e in err_a)
    print("== 1. the learned planner's co-locations that ran (synthetic truth): "
          f"{len(rec.groups)} groups, sizes " + ", ".join(f"{n}: {c}" for n, c in sorted(sizes.items())))
    print(f"   learned model    MAE {mae_l:.4f}  bias {statistics.mean(err_l):+.4f}")
    print(f"   analytic default MAE {mae_a:.4f}  bias {statistics.mean(err_a):+.4f} (it predicts too little slowdown)")

    print("\n== 2. complementary on the synthetic truth, by planner model (jobs/h; x first-fit)")
    for name, v in (("analytic defaults", compl_analytic), ("learned from agent samples", compl_learned),
                    ("exact (the truth, no noise)", compl_exact)):
        print(f"   {name:<28} {v:.2f}  {v / ff_syn:.3f}x")
    print(f"   first-fit                    {ff_syn:.2f}")

    t0 = time.perf_counter()
    bound_syn = fluid_bound_jobs_per_h(workload, cluster, syn)
    bound_default = fluid_bound_jobs_per_h(workload, cluster, DEFAULT_PARAMS)
    print(f"\n== 3. fluid upper bound (no arrivals, start-up or margins; {time.perf_counter() - t0:.1f} s)")
    print(f"   {'truth':<18} {'bound':>6} {'first-fit':>9} {'bound/ff':>8} {'compl.':>6} {'compl./bound':>12}")
    print(f"   {'analytic defaults':<18} {bound_default:>6.2f} {ff_default:>9.2f} {bound_default / ff_default:>8.3f} "
          f"{compl_default:>6.2f} {compl_default / bound_default:>12.3f}")
    print(f"   {'synthetic':<18} {bound_syn:>6.2f} {ff_syn:>9.2f} {bound_syn / ff_syn:>8.3f} "
          f"{compl_analytic:>6.2f} {compl_analytic / bound_syn:>12.3f}")
    need = 1.15 * ff_syn / bound_syn
    print(f"   1.15x first-fit on the synthetic truth = {1.15 * ff_syn:.2f} jobs/h = {need:.3f} of its bound; "
          f"complementary reaches {compl_default / bound_default:.3f} of the bound on the truth it was built on")
    print(f"robust_ceiling: ff_syn={ff_syn:.2f} bound_syn={bound_syn:.2f} bound_syn_vs_ff={bound_syn / ff_syn:.3f} "
          f"compl_analytic={compl_analytic:.2f} compl_learned={compl_learned:.2f} compl_exact={compl_exact:.2f} "
          f"learned_mae_ran={mae_l:.4f} analytic_mae_ran={mae_a:.4f} need_share_for_1_15={need:.3f} "
          f"share_default={compl_default / bound_default:.3f}")


if __name__ == "__main__":
    main()
