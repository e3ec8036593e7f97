"""`slurm-dlrm simulate`: replay a workload on a cluster through packing policies."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import click

from slurm_dlrm.errors import BadInput

log = logging.getLogger(__name__)

POLICIES = ("exclusive", "first-fit", "mem-best-fit", "complementary", "exact")


def read_data_file(path: str, what: str) -> Any:
    """A YAML or JSON file (YAML is a superset of JSON) as plain data."""
    import yaml

    from slurm_dlrm.strict_load import DuplicateKeyError, load_yaml

    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise BadInput(f"{what}: cannot read {path}: {exc.strerror}") from None
    try:
        return load_yaml(text)
    except DuplicateKeyError as exc:
        raise BadInput(f"{what}: {path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise BadInput(f"{what}: {path} is not valid YAML/JSON: {str(exc).splitlines()[0]}") from None


def _site_gpu_models(site_path: str | None) -> dict[str, Any]:
    from slurm_dlrm.site import load_site

    try:
        return dict(load_site(site_path).gpu_models)
    except BadInput:
        if site_path is not None:
            raise
        return {}


def write_plots(results: list[Any], out_dir: Path) -> list[Path]:
    """Bar charts of the per-policy figures and a JCT distribution (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    names = [r.policy for r in results]
    panels = [("throughput_jobs_per_h", "throughput (solo-equiv. jobs/h)"), ("avg_jct_s", "average JCT (s)"),
              ("p95_jct_s", "p95 JCT (s)"), ("gpu_hours", "GPU-hours"), ("mean_gpu_util_pct", "mean GPU util (%)"),
              ("ooms", "OOMs")]
    fig, axes = plt.subplots(2, 3, figsize=(12, 6.5))
    for ax, (key, title) in zip(axes.flat, panels, strict=True):
        ax.bar(names, [r.metrics()[key] for r in results], color="#4c72b0")
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.suptitle(f"{results[0].workload} on {results[0].cluster}")
    fig.tight_layout()
    summary = out_dir / "policies.png"
    fig.savefig(summary, dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        jct = [v / 3600.0 for v in r.jct_s]
        if jct:
            ax.plot(jct, [(i + 1) / len(jct) for i in range(len(jct))], label=r.policy)
    ax.set_xlabel("job completion time (h)")
    ax.set_ylabel("fraction of jobs")
    ax.legend()
    fig.tight_layout()
    cdf = out_dir / "jct_cdf.png"
    fig.savefig(cdf, dpi=110)
    plt.close(fig)
    return [summary, cdf]


@click.command("simulate", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--workload", "-w", "workload_path", default=None, metavar="FILE",
              help="Workload file (YAML/JSON; format in docs/simulate.md). Required unless --sweep.")
@click.option("--cluster", "-c", "cluster_path", required=True, metavar="FILE",
              help="Cluster file (YAML/JSON): nodes, packing limits, Slurm timings.")
@click.option("--policy", "-p", "policies", multiple=True, type=click.Choice(POLICIES), metavar="POLICY",
              help=f"Policy to replay ({', '.join(POLICIES)}); repeat to compare. Default: all four.")
@click.option("--seed", type=int, default=None, help="Override the workload file's generator seed.")
@click.option("--site", "site_path", default=None, metavar="FILE",
              help="Site config giving GPU models the cluster file does not define.")
@click.option("--plots", "plot_dir", default=None, metavar="DIR", help="Write comparison plots (PNG) here.")
@click.option("--truth", "truth_text", default="analytic", show_default=True, metavar="MODEL",
              help="What really happens on a shared GPU: analytic[:A,B,G], learned:FILE, table:FILE "
                   "(measured groups, nearest), synthetic[:SEED] (a roofline/queuing generator).")
@click.option("--plan-model", "plan_text", default="analytic", show_default=True, metavar="MODEL",
              help="The model the policies plan with: analytic[:A,B,G] or learned:FILE.")
@click.option("--json", "as_json", is_flag=True, help="Print the per-policy figures as JSON.")
@click.option("--sweep", "sweep_path", default=None, metavar="CURVES",
              help="Play seeded sweeps instead of a workload (issue 47): CURVES is a file of recorded learning "
                   "curves (tests/data/sweep_curves.json's format); each sweep runs every variant to the end, "
                   "then with the ASHA stopping rule.")
@click.option("--sweeps", "n_sweeps", type=click.IntRange(1, 10_000), default=20, show_default=True,
              help="With --sweep: how many seeded sweeps.")
@click.option("--variants", "n_variants", type=click.IntRange(2, 10_000), default=27, show_default=True,
              help="With --sweep: variants per sweep.")
@click.option("--reduction", type=click.IntRange(2, 100), default=3, show_default=True,
              help="With --sweep: the rule's reduction factor (rungs at steps // (2 x reduction**2) x reduction**k).")
def simulate_cmd(workload_path: str | None, cluster_path: str, policies: tuple[str, ...], seed: int | None,
                 site_path: str | None, plot_dir: str | None, truth_text: str, plan_text: str,
                 as_json: bool, sweep_path: str | None, n_sweeps: int, n_variants: int, reduction: int) -> None:
    """Replay a workload on a simulated cluster through packing policies and compare
    throughput (solo-equivalent jobs/h), average and p95 job completion time, makespan,
    GPU-hours, mean GPU utilisation, OOMs and completion rate, beside the ideal bound.

    \b
    Example:
      slurm-dlrm simulate -w benchmarks/sim/dlrm_mix.yaml -c benchmarks/sim/cluster_1gpu.yaml
      slurm-dlrm simulate -w W.yaml -c C.yaml -p first-fit -p complementary --json
      slurm-dlrm simulate -w W.yaml -c C.yaml --plots out/
      slurm-dlrm simulate -w W.yaml -c C.yaml --truth synthetic --plan-model learned:model.json
      slurm-dlrm simulate --sweep tests/data/sweep_curves.json -c benchmarks/sim/cluster_1gpu.yaml
    """
    if sweep_path is not None:
        if workload_path is not None:
            raise BadInput("--sweep: plays sweeps drawn from recorded curves; do not combine it with -w/--workload")
        _simulate_sweeps(sweep_path, cluster_path, policies, seed, site_path, as_json, n_sweeps, n_variants,
                         reduction)
        return
    if workload_path is None:
        raise BadInput("-w/--workload: give a workload file (or --sweep CURVES)")
    from slurm_dlrm.interference_io import parse_truth
    from slurm_dlrm.sim import (
        comparison_table,
        ideal_throughput_bounds_jobs_per_h,
        ideal_throughput_jobs_per_h,
        parse_cluster,
        parse_workload,
        simulate,
        workload_summary,
    )

    truth = parse_truth(truth_text, "--truth")
    plan_params = parse_truth(plan_text, "--plan-model")
    if plan_text.split(":")[0].strip().lower() not in ("analytic", "learned"):
        raise BadInput(f"--plan-model: {plan_text!r}: analytic[:A,B,G] or learned:FILE (the others are truths only)")
    cluster_data = read_data_file(cluster_path, "cluster")
    workload_data = read_data_file(workload_path, "workload")
    cluster = parse_cluster(cluster_data, _site_gpu_models(site_path))
    workload = parse_workload(workload_data, {g.name: g for g in cluster.gpu_models}, seed=seed)
    chosen = list(policies) or list(POLICIES[:4])  # exact only when asked (its rounds cost a solver each)
    results = []
    for policy in chosen:
        log.info("simulating %s", policy)
        results.append(simulate(workload, cluster, policy, true_params=truth, plan_params=plan_params))
    ideal = ideal_throughput_jobs_per_h(workload, cluster)
    bounds = ideal_throughput_bounds_jobs_per_h(workload, cluster)
    paths = write_plots(results, Path(plot_dir)) if plot_dir else []
    if as_json:
        click.echo(json.dumps({"workload": workload_summary(workload), "cluster": cluster.name,
                               "gpus": cluster.gpu_count, "ideal_throughput_jobs_per_h": round(ideal, 4),
                               "ideal_bounds_jobs_per_h": {k: round(v, 4) for k, v in bounds.items()},
                               "policies": [r.metrics() for r in results],
                               "truth": truth_text, "plan_model": plan_text,
                               "plots": [str(p) for p in paths]}, indent=2))
        return
    s = workload_summary(workload)
    click.echo(f"workload {workload.name}: {s['jobs']} jobs, mean solo SM {s['mean_sm_util_pct']:.1f}%, "
               f"bandwidth {s['mean_membw_util_pct']:.1f}%, GPU memory {s['mean_gpu_mem_gib']:.1f} GiB, "
               f"{s['mean_host_cpu_cores']:.1f} cores, solo {s['mean_solo_duration_s'] / 3600:.2f} h")
    click.echo(f"cluster {cluster.name}: {cluster.gpu_count} GPUs on {len(cluster.nodes)} node(s)")
    click.echo(f"truth {truth_text}, planner's model {plan_text}")
    click.echo(comparison_table(results, ideal, baseline=chosen[0] if "exclusive" not in chosen else "exclusive"))
    click.echo("ideal bound per resource (jobs/h; the lowest binds): "
               + ", ".join(f"{k} {v:.2f}" for k, v in sorted(bounds.items(), key=lambda kv: kv[1])))
    for p in paths:
        click.echo(f"plot: {p}", err=True)
    sys.stdout.flush()


def _simulate_sweeps(curves_path: str, cluster_path: str, policies: tuple[str, ...], seed: int | None,
                     site_path: str | None, as_json: bool, n_sweeps: int, n_variants: int, reduction: int) -> None:
    """`simulate --sweep CURVES`: seeded sweeps drawn from recorded curves, each played to
    the end and with the stopping rule (slurm_dlrm/sim/sweep_play.py)."""
    from slurm_dlrm.adapt.asha import StopRule, default_first_rung
    from slurm_dlrm.sim import parse_cluster
    from slurm_dlrm.sim.sweep_curves import fit_family, recorded_variants
    from slurm_dlrm.sim.sweep_play import play_drawn, summarize

    if len(policies) > 1:
        raise BadInput("--sweep: one policy at a time (-p POLICY)")
    policy = policies[0] if policies else "complementary"
    data = read_data_file(curves_path, "--sweep")
    try:
        variants = recorded_variants(data)
        steps = max(int(sw["steps"]) for sw in data["sweeps"])  # the drawn sweeps run the longest recorded
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise BadInput(f"--sweep: {curves_path} is not a file of recorded curves (sweeps[].variants[].curve): "
                       f"{exc!r}") from None
    if len(variants) < 2 or any(len(v.curve) < 3 for v in variants):
        raise BadInput(f"--sweep: {curves_path}: needs 2 or more variants of 3 or more evaluations each")
    rule = StopRule("auc", default_first_rung(steps, reduction), reduction, steps)
    if rule.min_steps >= steps:
        raise BadInput(f"--reduction {reduction}: no rung below the curves' {steps} steps")
    cluster = parse_cluster(read_data_file(cluster_path, "cluster"), _site_gpu_models(site_path))
    family = fit_family(variants)
    first = 47_000 if seed is None else seed
    outcomes = [play_drawn(family, rule, cluster, n_variants, first + k, policy=policy) for k in range(n_sweeps)]
    s = summarize(outcomes)
    if as_json:
        click.echo(json.dumps({"summary": vars(s), "rule": vars(rule), "policy": policy, "cluster": cluster.name,
                               "sweeps": [{**vars(o), "seed": first + k, "saved_x": round(o.saved_x, 4),
                                           "same_best": o.same_best} for k, o in enumerate(outcomes)]}, indent=2))
        return
    click.echo(f"{n_sweeps} sweeps of {n_variants} variants drawn from {len(variants)} recorded curves, "
               f"{policy} on {cluster.name}; rule: reduction {reduction}, first rung at step {rule.min_steps} "
               f"of {steps}")
    click.echo(f"{'seed':>7} {'gpu_h_full':>10} {'gpu_h_stop':>10} {'saved_x':>7} {'same_best':>9} {'to_end':>6}")
    for k, o in enumerate(outcomes):
        click.echo(f"{first + k:>7} {o.gpu_hours_full:>10.2f} {o.gpu_hours_stop:>10.2f} {o.saved_x:>7.2f} "
                   f"{'yes' if o.same_best else 'NO':>9} {o.completed_stop:>6}")
    click.echo(f"sweep_sim: {s.line()}")
