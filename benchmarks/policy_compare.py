"""Compare the packing policies in the simulator, all in one run.

Workload: benchmarks/sim/dlrm_mix.yaml (jobs use ~1/6 of a GPU's compute alone, with
varied memory and host demand; estimates within the estimator's error: true GPU
memory = estimate +-5%, utilisation +-10%, duration +-20%). Clusters:
benchmarks/sim/cluster_1gpu.yaml and cluster_4gpu.yaml (the 4-GPU run has 4x the jobs
and 4x the arrival rate). Every policy runs on the same jobs; the ideal bound (perfect
packing, no interference, no start-up) is printed beside them.

Robustness (docs/simulate.md "When the truth is not the planner's model"): the four
policies on 1 GPU when what really happens differs from what the planner predicts:
the synthetic roofline/queuing generator as the truth with the planner on the analytic
defaults; the analytic model with constants (0.60, 1.20, 0.04), twice the former priors,
as the truth (the defaults are 0, so "2x the defaults" would be no change); and the
synthetic truth with the planner on a learned model fit on simulated agent samples
(groups of the workload's jobs as the agents would measure them: the estimates'
profiles, the truth's speeds). Line: `robust: min_tput_vs_firstfit=X ooms=N` (the worst
of complementary's gains over first-fit, and complementary's OOMs over the three).

Multi-GPU (issue 18): the 4-GPU run again with 25% of the jobs drawn with world_size 2
or 4 (rank 0 the fullest, the others 0.5-1.0 of it), placed as rank members all or
none; line `multi: tput_vs_exclusive=X tput_vs_firstfit=X ooms=N done_pct=X`
(complementary's), printed before the last line.

Fairness (issues 31, 40): on the multi run, complementary under the default rule (the
slowdown bound, `fairness="slowdown"`, since issue 40) and under the rule before it
(round-based aging, "rounds", a site choice now), and `queue --start`'s expected starts
(sim/start_estimate.py: the simulator resumed from the state when asked, estimates as
the truth) against the actual ones, and against the same run with the jobs submitted
after the question left out (the start given the queue then, what squeue --start
claims); one line per rule, the default's first,
`fair: rule=R slowdown_p50_single=X slowdown_p50_multi=X slowdown_p99_all=X max_wait_h=X
tput_vs_rounds=X start_estimate_within_25pct=X start_estimate_within_25pct_given_queue=X`.
How the start figures count: the question is asked at 2, 6, 10 and 20 h after the first
arrival, for every job waiting then (a job waiting at two moments counts twice); an
expected start is right when |expected - actual| <= 25% of the wait *left when asked*
(actual start - moment asked), `within_share`. Not of the wait since submission (a job
asked about after waiting 9 h of a 10 h wait would pass with any answer within 2.5 h,
and the estimator knows the 9 h already), nor of the time since the trace began. A job
the forward run cannot place counts as a miss. benchmarks/start_estimate_bound.py
splits the misses (estimates vs later arrivals) and gives the ceiling.
`--fair-only` runs just that (complementary on the multi run under both rules, a few minutes);
`--seed N` with it draws the workload with another seed (default: the file's, 7).

--truth SPEC (issue 37; e.g. table:tests/data/gpu/h100-2026-11-27/colocation.csv, the
recorded H100 pairs, larger groups composed from them): the 1- and 4-GPU runs again with
that truth (exclusive, first-fit, complementary), the planner on the model it would pick
from the table's groups (`packing.pairwise.choose_planner_model`); line
`policy[truth=SPEC]: ...` (the planner's pick) beside the usual `policy:` line (today's
truth, the analytic defaults). `--truth-only` runs just those and today's two runs.

Exact (issue 50, benchmarks/exact_ceiling.py): every round of complementary's 1- and
4-GPU runs (a stride of them) solved by CP-SAT on the heuristic's own objective, with its
proven bound, and the `exact` policy over whole runs beside complementary; line
`exact: share_of_bound_1gpu=X share_of_bound_4gpu=X heuristic_share_of_round_optimum=X
plan_p95_ms=X` above the last line. `--exact-only` runs just that; `--no-exact` skips it
(it is the slowest part: a solver per round).

Multi-node (issue 48, benchmarks/multinode_sim.py): the mix on four 4-GPU nodes alone
and with a few whole-node 2-node jobs, side by side per policy (what they cost the
packs); line `multinode_sim: ...` above the last line; `--no-multinode` skips it.

Run:  /work/main/.venv/bin/python benchmarks/policy_compare.py [--dmem] [--fair-only [--seed N]] [--truth SPEC [--truth-only]] [--exact-only | --no-exact] [--no-multinode]
Last line:  policy: tput_vs_exclusive_1gpu=X tput_vs_exclusive_4gpu=X share_of_bound_1gpu=X
            share_of_bound_4gpu=X tput_vs_firstfit=X jct_cut_vs_firstfit_pct=X ooms=N
(share_of_bound: complementary's throughput over the ideal bound, the lowest of the
per-resource bounds printed under each table; tput_vs_firstfit and
jct_cut_vs_firstfit_pct: mean over the two clusters; ooms: complementary's OOMs over
both clusters. The line above it gives the +-20% scenario: share, OOMs, recovered.)

A job that fails (OOM-killed past `retry.max_retries`) is submitted again by its user at
once (`retry.user_resubmits: 10`, `user_resubmit_delay_s: 0`, the cluster files), so
every policy does the same work and a failed attempt costs its JCT; first-fit is also
shown as it was measured before (failed jobs dropped, JCT over its survivors only).

--dmem (issue 22): the fenced policies run again with cgroup dmem fences (simulate(...,
dmem=True)): they pack on the estimates (margin 0), each member keeps its usual fence
(estimate + margin) as its hard limit (dmem.max) and its estimate as its soft limit
(dmem.min); under GPU memory pressure the member furthest above its soft limit is
evicted. The figures print side by side with the fence-only runs, above the last line.
"""

from __future__ import annotations

import argparse
import copy
import math
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from slurm_dlrm.packing import POLICY_NAMES  # noqa: E402
from slurm_dlrm.packing.interference import (  # noqa: E402
    DEFAULT_PARAMS,
    CoLocationSample,
    InterferenceParams,
    SoloProfile,
    predict_speeds_from_fractions,
)
from slurm_dlrm.packing.learned import fit_learned  # noqa: E402
from slurm_dlrm.sim import (  # noqa: E402
    SimResult,
    Workload,
    comparison_table,
    ideal_throughput_bounds_jobs_per_h,
    ideal_throughput_jobs_per_h,
    parse_cluster,
    parse_workload,
    simulate,
    workload_summary,
)
from slurm_dlrm.sim.start_estimate import expected_starts, within_share  # noqa: E402
from slurm_dlrm.truth import SyntheticColocation  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from exact_ceiling import exact_line  # noqa: E402 - benchmarks/ is on sys.path
from multinode_sim import compare as multinode_compare  # noqa: E402 - issue 48: what multi-node jobs cost the packs

SIM = ROOT / "benchmarks" / "sim"


def agent_sample_model(workload: Workload, truth: InterferenceParams, groups: int = 3000,
                       seed: int = 11) -> InterferenceParams:
    """A learned model fit on what the agents would report: random groups of 2-8 of the
    workload's jobs, their estimated profiles (what the store holds) and their speeds
    under the truth (computed on their true profiles)."""
    rng = random.Random(seed)
    jobs = list(workload.jobs)
    samples = []
    for _ in range(groups):
        members = rng.sample(jobs, rng.randint(2, 8))
        speeds = predict_speeds_from_fractions([min(1.0, j.true_sm_util_pct / 100) for j in members],
                                               [min(1.0, j.true_membw_util_pct / 100) for j in members], truth)
        samples.append(CoLocationSample(tuple(SoloProfile(j.sm_util_pct, j.membw_util_pct) for j in members),
                                        tuple(speeds)))
    t0 = time.perf_counter()
    model = fit_learned(samples, DEFAULT_PARAMS)
    print(f"  learned model fit on {groups} simulated agent groups in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr)
    return model.params()


def robustness() -> tuple[float, int]:
    """The four policies on 1 GPU with truth and planner disagreeing; prints each case."""
    synthetic = InterferenceParams(speed_model=SyntheticColocation())
    # The defaults are 0 (docs/packing.md): "2x off" is taken from the former priors
    # (0.30, 0.60, 0.02), doubled: a GPU with far more contention than the planner expects.
    off = InterferenceParams(0.60, 1.20, 0.04)
    cases = (("truth synthetic, planner analytic defaults", synthetic, None, False),
             ("truth analytic (0.60, 1.20, 0.04): 2x the former priors, planner defaults (0, 0, 0)", off, None, False),
             ("truth synthetic, planner learned from simulated agent samples", synthetic, None, True))
    gains, ooms = [], 0
    print("\n== robustness: truth and planner disagree (1 GPU, the four policies)")
    for title, truth, plan_params, fit in cases:
        r = run("cluster_1gpu.yaml", 1, truth=truth, plan_params=plan_params, plan_fit=fit)
        res = r["results"]
        comp, ff = res["complementary"], res["first-fit"]  # type: ignore[index]
        gain = comp.throughput_jobs_per_h / ff.throughput_jobs_per_h
        gains.append(gain)
        ooms += comp.ooms
        print(f"-- {title}: complementary {gain:.2f}x first-fit throughput "
              f"(exclusive {res['exclusive'].throughput_jobs_per_h:.2f}, first-fit {ff.throughput_jobs_per_h:.2f}, "  # type: ignore[index]
              f"mem-best-fit {res['mem-best-fit'].throughput_jobs_per_h:.2f}, "  # type: ignore[index]
              f"complementary {comp.throughput_jobs_per_h:.2f} jobs/h; complementary OOMs {comp.ooms}, "
              f"avg JCT {comp.avg_jct_s / 3600:.1f} h vs first-fit {ff.avg_jct_s / 3600:.1f} h)")
    return min(gains), ooms


def run(cluster_file: str, scale: int, mem_noise_pct: float | None = None,
        policies: tuple[str, ...] = POLICY_NAMES, user_resubmits: int | None = None,
        truth: InterferenceParams | None = None, plan_params: InterferenceParams | None = None,
        plan_fit: bool = False, dmem: bool = False, multi_gpu_share: float = 0.0,
        snapshot_at_s: tuple[float, ...] = (), seed: int | None = None) -> dict[str, object]:
    cluster_data = yaml.safe_load((SIM / cluster_file).read_text())
    if user_resubmits is not None:
        cluster_data["retry"]["user_resubmits"] = user_resubmits
    cluster = parse_cluster(cluster_data)
    data = copy.deepcopy(yaml.safe_load((SIM / "dlrm_mix.yaml").read_text()))
    data["generate"]["jobs"] *= scale
    data["generate"]["arrival_rate_per_h"] *= scale
    if mem_noise_pct is not None:
        data["generate"]["mem_noise_pct"] = mem_noise_pct
    if multi_gpu_share > 0:
        data["generate"]["multi_gpu_share"] = multi_gpu_share  # world_size 2 or 4 (multi_gpu_ranks default)
    workload = parse_workload(data, {g.name: g for g in cluster.gpu_models}, seed=seed)
    if plan_fit:
        assert truth is not None
        plan_params = agent_sample_model(workload, truth)
    results = {}
    for policy in policies:
        t0 = time.perf_counter()
        results[policy] = simulate(workload, cluster, policy, true_params=truth, plan_params=plan_params,
                                   dmem=dmem, snapshot_at_s=snapshot_at_s)
        print(f"  simulated {policy} on {cluster.name} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return {"cluster": cluster, "workload": workload, "results": results,
            "ideal": ideal_throughput_jobs_per_h(workload, cluster)}


def show(title: str, r: dict[str, object]) -> None:
    w = r["workload"]
    s = workload_summary(w)  # type: ignore[arg-type]
    print(f"\n== {title}: {s['jobs']} jobs (mean solo SM {s['mean_sm_util_pct']:.1f}%, bandwidth "
          f"{s['mean_membw_util_pct']:.1f}%, GPU mem {s['mean_gpu_mem_gib']:.1f} GiB, "
          f"{s['mean_host_cpu_cores']:.1f} cores, solo {s['mean_solo_duration_s'] / 3600:.2f} h)")
    res = list(r["results"].values())  # type: ignore[attr-defined]
    print(comparison_table(res, r["ideal"]))  # type: ignore[arg-type]
    excl = r["results"]["exclusive"].throughput_jobs_per_h  # type: ignore[index]
    bounds = ideal_throughput_bounds_jobs_per_h(w, r["cluster"])  # type: ignore[arg-type]
    print("ideal bound per resource (x exclusive; the lowest binds): "
          + ", ".join(f"{k} {v / excl:.2f}x" for k, v in sorted(bounds.items(), key=lambda kv: kv[1])))
    print("backlog throughput (jobs/h while jobs wait): "
          + ", ".join(f"{x.policy} {x.backlog_throughput_jobs_per_h:.2f}" for x in res)
          + "; mean members per GPU: " + ", ".join(f"{x.policy} {x.mean_members_per_gpu:.2f}" for x in res))


DMEM_POLICIES = ("mem-best-fit", "complementary")


def show_dmem(cases: list[tuple[str, dict[str, object], dict[str, object]]]) -> None:
    """Fence-only vs dmem runs of the fenced policies, side by side."""
    print("\n== dmem fences (pack on estimates; hard limit = fence, soft limit = estimate) vs fences alone")
    print(f"{'case':<34} {'policy':<14} {'tput fence':>10} {'tput dmem':>10} {'x':>6} {'JCT fence h':>11} "
          f"{'JCT dmem h':>10} {'mem/GPU f':>9} {'mem/GPU d':>9} {'OOMs f':>6} {'OOMs d':>6} {'evict':>5}")
    for name, base, dm in cases:
        for p in DMEM_POLICIES:
            a, b = base["results"][p], dm["results"][p]  # type: ignore[index]
            print(f"{name:<34} {p:<14} {a.throughput_jobs_per_h:>10.2f} {b.throughput_jobs_per_h:>10.2f} "
                  f"{b.throughput_jobs_per_h / a.throughput_jobs_per_h:>6.3f} {a.avg_jct_s / 3600:>11.2f} "
                  f"{b.avg_jct_s / 3600:>10.2f} {a.mean_members_per_gpu:>9.2f} {b.mean_members_per_gpu:>9.2f} "
                  f"{a.ooms:>6d} {b.ooms:>6d} {b.evictions:>5d}")


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))] if v else 0.0


# Moments (h after the first arrival) at which `queue --start` is asked in the multi run.
START_ASKED_H = (2.0, 6.0, 10.0, 20.0)


def fairness(multi: dict[str, object]) -> None:
    """Issues 31 and 40: complementary on the multi run under the default rule (the
    cluster's, "slowdown" since issue 40) and under the other one, per-job slowdown (JCT /
    solo run), waits, and queue --start's accuracy; one `fair:` line per rule, the
    default's first."""
    w, cluster = multi["workload"], multi["cluster"]
    default = cluster.dispatch.fairness  # type: ignore[attr-defined]
    other = "rounds" if default != "rounds" else "slowdown"
    t0 = time.perf_counter()
    runs = {default: multi["results"]["complementary"],  # type: ignore[index]
            other: simulate(w, cluster, "complementary", fairness=other,  # type: ignore[arg-type]
                            snapshot_at_s=tuple(h * 3600 for h in START_ASKED_H))}
    print(f"  simulated complementary under {other!r} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    world = {j.job_id: j.world_size for j in w.jobs}  # type: ignore[attr-defined]

    def figures(r: SimResult) -> dict[str, float]:
        sd = {o.job_id: (o.end_s - o.arrival_s) / o.solo_duration_s for o in r.completed if o.end_s is not None}
        waits = [(o.start_s - o.arrival_s) / 3600 for o in r.jobs if o.start_s is not None]
        return {"tput": r.throughput_jobs_per_h,
                "p50_single": pct([v for k, v in sd.items() if world[k] == 1], 0.5),
                "p50_multi": pct([v for k, v in sd.items() if world[k] > 1], 0.5),
                "p99_all": pct(list(sd.values()), 0.99), "max_wait_h": max(waits, default=0.0)}

    fig = {rule: figures(r) for rule, r in runs.items()}
    print("\n== fairness (issues 31, 40): complementary on the multi run, per-job slowdown = JCT / solo run")
    print(f"{'rule':<34} {'tput/h':>7} {'p50 1-GPU':>9} {'p50 multi':>9} {'p99 all':>8} {'max wait h':>10}")
    for rule, f in fig.items():
        name = f"{rule} ({'the default' if rule == default else 'a site choice'})"
        print(f"{name:<34} {f['tput']:>7.2f} {f['p50_single']:>9.2f} {f['p50_multi']:>9.2f} {f['p99_all']:>8.2f} "
              f"{f['max_wait_h']:>10.1f}")
    jobs = {j.job_id: j for j in w.jobs}  # type: ignore[attr-defined]
    shares = {}
    queued = {}  # against the run with no later arrivals: what squeue --start promises
    for rule, r in runs.items():
        actual = {o.job_id: o.start_s for o in r.jobs if o.start_s is not None}
        ok = n = ok_q = n_q = 0
        for snap in r.snapshots:
            t0 = time.perf_counter()
            pred = expected_starts(snap, jobs, cluster, "complementary", fairness=rule)  # type: ignore[arg-type]
            got = {jid: actual[jid] for jid, _, _ in snap.pending if jid in actual}
            k, m = within_share(pred, got, snap.now_s)
            ok, n = ok + k, n + m
            # The same run with the jobs submitted after the question left out (true run
            # times and interference, as the run has them): the start given the queue at
            # that moment, which is all squeue --start claims to know. The run is the
            # same up to that moment (the simulator is causal).
            before = replace(w, jobs=tuple(j for j in w.jobs if j.arrival_s <= snap.now_s))  # type: ignore[attr-defined]
            alone = simulate(before, cluster, "complementary", fairness=rule)  # type: ignore[arg-type]
            got_q = {o.job_id: o.start_s for o in alone.jobs if o.job_id in got and o.start_s is not None}
            kq, mq = within_share(pred, got_q, snap.now_s)
            ok_q, n_q = ok_q + kq, n_q + mq
            print(f"queue --start ({rule}) at {(snap.now_s - r.first_arrival_s) / 3600:.0f} h: {len(snap.pending)} "
                  f"waiting, {k} of {m} expected starts within 25% of the actual wait, {kq} of {mq} of the wait "
                  f"with no later arrivals ({time.perf_counter() - t0:.1f} s)")
        shares[rule] = 100 * ok / max(1, n)
        queued[rule] = 100 * ok_q / max(1, n_q)
    print(f"queue --start within 25%: {shares[default]:.1f}% under the default rule ({default}), {shares[other]:.1f}% "
          f"under {other}; given the queue when asked (no later arrivals): {queued[default]:.1f}% and "
          f"{queued[other]:.1f}%")
    rounds_tput = fig["rounds"]["tput"]
    for rule, f in fig.items():
        print(f"fair: rule={rule} slowdown_p50_single={f['p50_single']:.2f} slowdown_p50_multi={f['p50_multi']:.2f} "
              f"slowdown_p99_all={f['p99_all']:.2f} max_wait_h={f['max_wait_h']:.1f} "
              f"tput_vs_rounds={f['tput'] / rounds_tput:.3f} start_estimate_within_25pct={shares[rule]:.1f} "
              f"start_estimate_within_25pct_given_queue={queued[rule]:.1f}")


def policy_figures(one: dict[str, object], four: dict[str, object]) -> str:
    """The `policy:` line's figures for a 1-GPU and a 4-GPU run."""
    def tput(r: dict[str, object], p: str) -> float:
        return r["results"][p].throughput_jobs_per_h  # type: ignore[index, no-any-return]

    def jct(r: dict[str, object], p: str) -> float:
        return r["results"][p].avg_jct_s  # type: ignore[index, no-any-return]

    vs_ff = sum(tput(r, "complementary") / tput(r, "first-fit") for r in (one, four)) / 2
    cut = 100 * sum(1 - jct(r, "complementary") / jct(r, "first-fit") for r in (one, four)) / 2
    ooms = sum(r["results"]["complementary"].ooms for r in (one, four))  # type: ignore[index]
    return (f"tput_vs_exclusive_1gpu={tput(one, 'complementary') / tput(one, 'exclusive'):.2f} "
            f"tput_vs_exclusive_4gpu={tput(four, 'complementary') / tput(four, 'exclusive'):.2f} "
            f"share_of_bound_1gpu={tput(one, 'complementary') / one['ideal']:.3f} "  # type: ignore[operator]
            f"share_of_bound_4gpu={tput(four, 'complementary') / four['ideal']:.3f} "  # type: ignore[operator]
            f"tput_vs_firstfit={vs_ff:.2f} jct_cut_vs_firstfit_pct={cut:.1f} ooms={ooms}")


TRUTH_POLICIES = ("exclusive", "first-fit", "complementary")  # what the policy: line's figures need


def measured_truth(spec: str, with_defaults: bool = False) -> list[str]:
    """Issue 37: the 1- and 4-GPU runs under `spec` (e.g. the recorded H100 pairs), the
    planner on its pick from the table (and, `with_defaults`, on today's defaults);
    exclusive, first-fit and complementary only. Returns the lines."""
    from slurm_dlrm.interference_io import parse_truth, read_groups
    from slurm_dlrm.packing.pairwise import choose_planner_model

    truth = parse_truth(spec)
    lines = []
    kind, _, path = spec.partition(":")
    pick = None
    if kind == "table":
        groups, _ = read_groups(path)
        pick = choose_planner_model([g.sample() for g in groups if len(g.members) > 1], DEFAULT_PARAMS)
        print(f"\n== truth {spec}: planner pick: {pick.reason}")
    for plan_name, plan in (("planner's pick " + (pick.name if pick else "-"), pick.params if pick else None),
                            ("planner on today's defaults", None))[: 2 if with_defaults else 1]:
        if plan_name.endswith("-"):
            continue
        one = run("cluster_1gpu.yaml", 1, truth=truth, plan_params=plan, policies=TRUTH_POLICIES)
        four = run("cluster_4gpu.yaml", 4, truth=truth, plan_params=plan, policies=TRUTH_POLICIES)
        show(f"1 GPU, truth {spec}, {plan_name}", one)
        show(f"4 GPUs, truth {spec}, {plan_name}", four)
        tag = f"truth={spec}" + ("" if plan is not None and pick is not None else ",planner=defaults")
        lines.append(f"policy[{tag}]: {policy_figures(one, four)}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dmem", action="store_true", help="also run the fenced policies with cgroup dmem fences")
    ap.add_argument("--fair-only", action="store_true",
                    help="only the multi run and its fair: lines (issues 31, 40; a few minutes instead of the whole run)")
    ap.add_argument("--seed", type=int, default=None,
                    help="with --fair-only: draw the workload with this seed (default: the file's, 7)")
    ap.add_argument("--truth", default=None, metavar="SPEC",
                    help="also the 1- and 4-GPU runs under this truth (e.g. table:FILE), issue 37")
    ap.add_argument("--truth-only", action="store_true",
                    help="with --truth: only today's two runs and the runs under --truth")
    ap.add_argument("--exact-only", action="store_true", help="only the exact: line (issue 50)")
    ap.add_argument("--no-exact", action="store_true", help="skip the exact: line (issue 50; the slowest part)")
    ap.add_argument("--no-multinode", action="store_true",
                    help="skip the multinode_sim: table and line (issue 48, benchmarks/multinode_sim.py)")
    args = ap.parse_args()
    if args.exact_only:
        print(exact_line())
        return
    if args.seed is not None and not args.fair_only:
        ap.error("--seed goes with --fair-only")
    if args.truth_only and not args.truth:
        ap.error("--truth-only goes with --truth")
    if args.truth_only:
        one = run("cluster_1gpu.yaml", 1, policies=TRUTH_POLICIES)
        four = run("cluster_4gpu.yaml", 4, policies=TRUTH_POLICIES)
        show("1 GPU", one)
        show("4 GPUs", four)
        for line in measured_truth(args.truth):
            print(line)
        print(f"policy: {policy_figures(one, four)}")
        return
    if args.fair_only:
        multi = run("cluster_4gpu.yaml", 4, multi_gpu_share=0.25, policies=("complementary",),
                    snapshot_at_s=tuple(h * 3600 for h in START_ASKED_H), seed=args.seed)
        fairness(multi)
        return
    one = run("cluster_1gpu.yaml", 1)
    four = run("cluster_4gpu.yaml", 4)
    show("1 GPU", one)
    show("4 GPUs", four)
    # Beyond the estimator's error: true GPU memory up to +-20% off the estimate (margin 5%).
    noisy = run("cluster_1gpu.yaml", 1, mem_noise_pct=20.0)
    show("1 GPU, memory estimates +-20% off (beyond the estimator's error; OOM retries)", noisy)

    def tput(r: dict[str, object], p: str) -> float:
        return r["results"][p].throughput_jobs_per_h  # type: ignore[index, no-any-return]

    def jct(r: dict[str, object], p: str) -> float:
        return r["results"][p].avg_jct_s  # type: ignore[index, no-any-return]

    # First-fit as measured before: a job failed past its retries is dropped, and the
    # JCT averages only the jobs that completed.
    dropped = {name: run(f, scale, policies=("first-fit",), user_resubmits=0)
               for name, f, scale in (("1 GPU", "cluster_1gpu.yaml", 1), ("4 GPUs", "cluster_4gpu.yaml", 4))}
    for name, d in dropped.items():
        ff = d["results"]["first-fit"]  # type: ignore[index]
        main_run = one if name == "1 GPU" else four
        print(f"first-fit on {name} with failed jobs dropped (not resubmitted): {ff.throughput_jobs_per_h:.2f} jobs/h, "
              f"avg JCT {ff.avg_jct_s / 3600:.2f} h over its {100 * ff.completion_rate:.1f}% completed; complementary "
              f"{tput(main_run, 'complementary') / ff.throughput_jobs_per_h:.2f}x its throughput, JCT "
              f"{100 * (1 - jct(main_run, 'complementary') / ff.avg_jct_s):.1f}% below")

    vs_excl_1 = tput(one, "complementary") / tput(one, "exclusive")
    vs_excl_4 = tput(four, "complementary") / tput(four, "exclusive")
    vs_ff = (tput(one, "complementary") / tput(one, "first-fit") + tput(four, "complementary") / tput(four, "first-fit")) / 2
    cut = 100 * ((1 - jct(one, "complementary") / jct(one, "first-fit")) + (1 - jct(four, "complementary") / jct(four, "first-fit"))) / 2
    ideal_1 = one["ideal"] / tput(one, "exclusive")  # type: ignore[operator]
    ideal_4 = four["ideal"] / tput(four, "exclusive")  # type: ignore[operator]
    share_1 = tput(one, "complementary") / one["ideal"]  # type: ignore[operator]
    share_4 = tput(four, "complementary") / four["ideal"]  # type: ignore[operator]
    ooms = one["results"]["complementary"].ooms + four["results"]["complementary"].ooms  # type: ignore[index]
    if args.dmem:
        show_dmem([
            ("1 GPU", one, run("cluster_1gpu.yaml", 1, policies=DMEM_POLICIES, dmem=True)),
            ("4 GPUs", four, run("cluster_4gpu.yaml", 4, policies=DMEM_POLICIES, dmem=True)),
            ("1 GPU, estimates +-20% off", noisy,
             run("cluster_1gpu.yaml", 1, mem_noise_pct=20.0, policies=DMEM_POLICIES, dmem=True)),
        ])
    robust_min, robust_ooms = robustness()
    print(f"robust: min_tput_vs_firstfit={robust_min:.2f} ooms={robust_ooms}")
    # Issue 18: the 4-GPU mix with 25% of the jobs on 2 or 4 GPUs (ranks fenced one per GPU).
    multi = run("cluster_4gpu.yaml", 4, multi_gpu_share=0.25, snapshot_at_s=tuple(h * 3600 for h in START_ASKED_H))
    show("4 GPUs, 25% of jobs with 2 or 4 ranks (multi-GPU, issue 18)", multi)
    mc = multi["results"]["complementary"]  # type: ignore[index]
    gangs = sum(1 for j in multi["workload"].jobs if j.world_size > 1)  # type: ignore[attr-defined]
    print(f"multi-GPU jobs: {gangs} of {len(mc.jobs)} (targets: >= 1.25x first-fit, 0 OOMs, 100% done)")
    # Issue 24: the cluster files' node runs nothing but packs (refill_headroom_pct: share);
    # on a node shared with other jobs a site keeps the default bounded headroom, which
    # costs gangs most (they join only a pack whose allocation holds all their ranks).
    bounded_data = yaml.safe_load((SIM / "cluster_4gpu.yaml").read_text())
    bounded_data["packing"]["refill_headroom_pct"] = 100
    mb = simulate(multi["workload"], parse_cluster(bounded_data), "complementary")  # type: ignore[arg-type]
    print(f"multi with the site default refill_headroom_pct=100 (a node shared with other jobs): complementary "
          f"{mb.throughput_jobs_per_h:.2f} jobs/h = {mb.throughput_jobs_per_h / tput(multi, 'first-fit'):.2f}x "
          f"first-fit, OOMs {mb.ooms} (benchmarks/refill_headroom.py)")
    print(f"multi: tput_vs_exclusive={tput(multi, 'complementary') / tput(multi, 'exclusive'):.2f} "
          f"tput_vs_firstfit={tput(multi, 'complementary') / tput(multi, 'first-fit'):.2f} "
          f"ooms={mc.ooms} done_pct={100 * mc.completion_rate:.1f}")
    fairness(multi)
    done = min(one["results"]["complementary"].completion_rate, four["results"]["complementary"].completion_rate)  # type: ignore[index]
    nz = noisy["results"]["complementary"]  # type: ignore[index]
    nz_share = nz.throughput_jobs_per_h / noisy["ideal"]  # type: ignore[operator]
    nz_hit = [j for j in nz.jobs if j.ooms > 0]
    nz_recovered = sum(1 for j in nz_hit if j.state == "COMPLETED")
    print(f"\nideal bound vs exclusive: 1 GPU {ideal_1:.2f}x, 4 GPUs {ideal_4:.2f}x; complementary reaches "
          f"{share_1:.3f} and {share_4:.3f} of it, completion {100 * done:.1f}% "
          f"(targets: >= 0.80 of the bound on both, 4 GPUs >= 1 GPU x exclusive, >= 1.25x first-fit, "
          f"JCT >= 30% below first-fit, 0 OOMs, 100% completion)")
    print(f"memory estimates +-20% off: complementary share_of_bound={nz_share:.3f} ooms={nz.ooms} "
          f"({100 * nz.ooms / len(nz.jobs):.1f}% of {len(nz.jobs)} jobs; {nz_recovered} of {len(nz_hit)} jobs hit recovered), "
          f"completion {100 * nz.completion_rate:.1f}% (targets: share >= 0.70, OOMs <= 1% of jobs, all recovered)")
    for line in measured_truth(args.truth) if args.truth else []:
        print(line)
    if not args.no_exact:
        print(exact_line())
    if not args.no_multinode:
        mn_lines, mn_last = multinode_compare()
        print("\n".join(mn_lines))
        print(mn_last)
    print(f"policy: tput_vs_exclusive_1gpu={vs_excl_1:.2f} tput_vs_exclusive_4gpu={vs_excl_4:.2f} "
          f"share_of_bound_1gpu={share_1:.3f} share_of_bound_4gpu={share_4:.3f} "
          f"tput_vs_firstfit={vs_ff:.2f} jct_cut_vs_firstfit_pct={cut:.1f} ooms={ooms}")

if __name__ == "__main__":
    main()
