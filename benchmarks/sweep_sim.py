"""Sweeps with a stopping rule in the simulator (issue 47 target: over >= 20 seeded
sweeps, saved_x median >= 3 and the full sweep's best variant reaching the end in >= 90%).

    .venv/bin/python benchmarks/sweep_sim.py [--sweeps 30] [--variants 27] [--cluster FILE]

What it does, in one run, no training (a few seconds):
1. fits the power-law family (slurm_dlrm/sim/sweep_curves.py) to the learning curves real
   runs of `slurm-dlrm train` recorded (tests/data/sweep_curves.json), and prints the fit's
   error on points held out of it: every other eval (interpolation), and the last third of
   each curve from a fit on its first third (extrapolation);
2. checks the generator on recorded sweeps it did not see (leave one sweep out): how well
   a variant's AUC at the first rung ranks its final AUC (Spearman), recorded vs drawn;
3. replays the recorded sweeps themselves (their measured curves, no fit) through the
   rule in the simulator's packing model;
4. plays `--sweeps` seeded sweeps of `--variants` variants drawn from the family, each
   twice on the same cluster: every variant to the end (the baseline) and with the rule
   (adapt/asha.py: reduction 3, min_steps = steps // 18, the service's defaults; a variant
   within its own eval noise of a cut goes on, the noise from its evals every 20 steps).

saved_x = GPU-hours of every variant to the end / GPU-hours with the rule (allocations,
as Slurm charges them); same_best = the full sweep's best variant (final AUC) reached the
end with the rule. The last line is the issue's:
`sweep_sim: sweeps= variants= saved_x_median= same_best_pct= ...`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from slurm_dlrm.adapt.asha import MARGIN_SDS, StopRule, default_first_rung, rung_steps  # noqa: E402
from slurm_dlrm.sim.files import SimCluster, parse_cluster  # noqa: E402
from slurm_dlrm.sim.sweep_curves import (  # noqa: E402
    CurveFamily,
    RecordedVariant,
    family_metric,
    fit_family,
    held_out_error,
    recorded_variants,
    spearman,
)
from slurm_dlrm.sim.sweep_play import SweepOutcome, play_drawn, play_sweep, summarize  # noqa: E402

CURVES = ROOT / "tests" / "data" / "sweep_curves.json"
HELD_OUT_CURVES = ROOT / "tests" / "data" / "sweep_curves_held_out.json"
SOLO_S = 3600.0  # a variant's run alone on a GPU at its sweep's median batch size (x its batch's ratio)
REDUCTION = 3


def rule_for(steps: int) -> StopRule:
    """The service's default rule (adapt/asha.py default_first_rung: three rungs, the last at half the steps)."""
    return StopRule("auc", default_first_rung(steps, REDUCTION), REDUCTION, steps)


def recorded_metric(v: RecordedVariant):  # type: ignore[no-untyped-def]
    """The measured curve at a step: the eval there, else linear between the nearest two."""
    pts = list(v.curve)

    def at(step: int) -> float:
        for (s0, y0), (s1, y1) in zip(pts, pts[1:], strict=False):
            if s0 <= step <= s1:
                return y0 + (y1 - y0) * (step - s0) / (s1 - s0) if s1 > s0 else y0
        return pts[0][1] if step < pts[0][0] else pts[-1][1]

    return at


def value_at(v: RecordedVariant, step: int) -> float:
    return float(recorded_metric(v)(step))


def rank_check(own: list[RecordedVariant], family: CurveFamily) -> str:
    """Spearman(AUC at the first rung, final AUC) of `own` (one sweep's variants of one
    batch size) recorded, against the same drawn from `family` (median of 50 draws)."""
    name, batch, own_steps = own[0].sweep, own[0].batch_size, own[0].steps
    rung0 = rule_for(own_steps).min_steps
    rec = spearman([value_at(v, rung0) for v in own], [v.curve[-1][1] for v in own])
    drawn = []
    for k in range(50):
        ds = family.draw(len(own), seed=1000 + k)
        ms = [family_metric(family, d, 1000 + k, i) for i, d in enumerate(ds)]
        drawn.append(spearman([m(rung0) for m in ms], [m(own_steps) for m in ms]))
    return (f"  {name} batch {batch:<5} ({len(own)} variants, step {rung0} of {own_steps}) recorded {rec:+.2f}  "
            f"drawn {statistics.median(drawn):+.2f} (10-90%: {sorted(drawn)[5]:+.2f}..{sorted(drawn)[44]:+.2f})")


def replay_line(name: str, own: list[RecordedVariant], cluster: SimCluster) -> str:
    """One recorded sweep replayed with its measured curves (no fit) through the rule."""
    med = statistics.median(v.batch_size for v in own)
    o = play_sweep({i: recorded_metric(v) for i, v in enumerate(own)}, [SOLO_S * v.batch_size / med for v in own],
                   rule_for(own[0].steps), cluster)
    return (f"  {name:<20} variants {o.variants:>2}  gpu_hours full {o.gpu_hours_full:6.2f} stop "
            f"{o.gpu_hours_stop:6.2f}  saved_x {o.saved_x:4.2f}  same_best {o.same_best}  "
            f"best auc {o.best_value_full:.4f} vs {o.best_value_stop:.4f}  reached the end {o.completed_stop}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sweeps", type=int, default=30)
    ap.add_argument("--variants", type=int, default=27)
    ap.add_argument("--cluster", default=str(ROOT / "benchmarks" / "sim" / "cluster_1gpu.yaml"))
    ap.add_argument("--curves", default=str(CURVES))
    ap.add_argument("--held-out-curves", default=str(HELD_OUT_CURVES),
                    help="recorded curves the family is not fitted to, only judged on (skipped if absent)")
    ap.add_argument("--seed", type=int, default=47, help="the development seeds' base (looked at, printed one by one)")
    ap.add_argument("--held-out-seed", type=int, default=5000,
                    help="the held-out seeds' base: never looked at to choose anything; the last line is theirs")
    ap.add_argument("--earlier-held-out-seed", type=int, default=2611,
                    help="the held-out seeds of the rule before (base 2611, used once to measure it): printed too")
    ap.add_argument("--held-out-sweeps", type=int, default=100)
    ap.add_argument("--also", action="append", default=[str(ROOT / "benchmarks" / "sim" / "cluster_4gpu.yaml")],
                    help="also play the same seeds on this cluster (printed before the last line)")
    args = ap.parse_args(argv)
    data = json.loads(Path(args.curves).read_text())
    variants = recorded_variants(data)
    steps = max(v.steps for v in variants)  # the drawn sweeps run the longest recorded
    rule = rule_for(steps)
    cluster = parse_cluster(yaml.safe_load(Path(args.cluster).read_text()))
    sweeps = [str(sw["name"]) for sw in data["sweeps"]]  # recorded order
    print(f"recorded: {len(variants)} variants in {len(sweeps)} sweeps: " + ", ".join(
        f"{sw['name']} ({len(sw['variants'])} variants, {sw['steps']} steps, eval every "
        f"{sw.get('eval_every_steps', 20)})" for sw in data["sweeps"]))
    print(f"rule: reduction {rule.reduction}, min_steps = steps // {2 * rule.reduction ** 2}: rungs at "
          f"{', '.join(str(r) for r in rung_steps(rule))} of {steps} for the drawn sweeps, a variant within "
          f"{MARGIN_SDS:g} x sqrt(2) x its own eval noise of a cut goes on; cluster {cluster.name}")

    # 1. the family and its held-out error
    family = fit_family(variants)
    err = held_out_error(variants)
    spread = max(v.curve[-1][1] for v in variants) - min(v.curve[-1][1] for v in variants)
    print(f"fit: auc(s) = a - b*s^-c per curve; rmse on the fitted points {family.noise_sd:.4f} AUC, of it "
          f"the eval's own noise {family.white_sd:.4f} (from successive differences) and a slow wander "
          f"{family.wander_sd:.4f} (AR(1), per-step correlation {family.wander_phi:.3f})")
    print(f"held out: every other eval rmse {err.interp_rmse:.4f}; last third from a fit on the first third "
          f"rmse {err.extrap_rmse:.4f}, max |err| {err.extrap_max_abs:.4f} (final AUCs span {spread:.4f})")

    # 2. the generator against recorded variants it did not see: one group left out at a
    # time, a group being a recorded sweep's variants of one batch size (their eval set is
    # their own: `batches` x their batch size samples)
    groups = sorted({(v.sweep, v.batch_size) for v in variants})
    print("leave one group (sweep, batch size) out: Spearman(AUC at the first rung, final AUC) of its variants, "
          "recorded vs drawn from the others' family (median of 50 draws):")
    for name, batch in groups if len(groups) > 1 else []:
        own = [v for v in variants if (v.sweep, v.batch_size) == (name, batch)]
        print(rank_check(own, fit_family([v for v in variants if (v.sweep, v.batch_size) != (name, batch)])))

    # 2b. curves recorded after the family was built and never fitted (--held-out-curves)
    held_path = Path(args.held_out_curves)
    if held_path.exists():
        held_vs = recorded_variants(json.loads(held_path.read_text()))
        herr = held_out_error(held_vs)
        print(f"held-out curves ({held_path.name}: {len(held_vs)} variants, not in the family): the family's "
              f"power law on them, last third from the first third rmse {herr.extrap_rmse:.4f} (max |err| "
              f"{herr.extrap_max_abs:.4f}); Spearman recorded vs drawn from the family of the fitted curves:")
        for name, batch in sorted({(v.sweep, v.batch_size) for v in held_vs}):
            print(rank_check([v for v in held_vs if (v.sweep, v.batch_size) == (name, batch)], family))
        for name in dict.fromkeys(v.sweep for v in held_vs):
            print(replay_line(name, [v for v in held_vs if v.sweep == name], cluster))

    # 3. the recorded sweeps replayed (measured curves; small sweeps: keep = reached // 3)
    print("replay of the recorded sweeps (measured curves, no fit):")
    for name in sweeps:
        print(replay_line(name, [v for v in variants if v.sweep == name], cluster))

    # 4. seeded sweeps drawn from the family: the development seeds (the ones looked at
    # while the mechanisms were built), one line each
    outcomes: list[SweepOutcome] = []
    print(f"{args.sweeps} development seeds, sweeps of {args.variants} variants (every variant to the end | "
          f"with the rule):")
    for k in range(args.sweeps):
        seed = args.seed * 1000 + k
        o = play_drawn(family, rule, cluster, args.variants, seed, SOLO_S)
        outcomes.append(o)
        print(f"  seed {seed}: gpu_hours {o.gpu_hours_full:6.2f} | {o.gpu_hours_stop:6.2f}  saved_x {o.saved_x:4.2f}  "
              f"makespan_h {o.makespan_full_s / 3600:5.2f} | {o.makespan_stop_s / 3600:5.2f}  "
              f"same_best {'yes' if o.same_best else 'NO '}  best auc {o.best_value_full:.4f} | "
              f"{o.best_value_stop:.4f}  to the end {o.variants} | {o.completed_stop}  promotions {o.promotions}")
    print(f"development seeds on {cluster.name}: {summarize(outcomes).line()}")
    for other in args.also:  # the same seeds where more of the sweep runs at once
        oc = parse_cluster(yaml.safe_load(Path(other).read_text()))
        so = summarize([play_drawn(family, rule, oc, args.variants, args.seed * 1000 + k, SOLO_S)
                        for k in range(args.sweeps)])
        print(f"development seeds on {oc.name} ({oc.gpu_count} GPUs): {so.line()}")

    # 5. the held-out seeds: the figures of the last line
    print(f"{args.held_out_sweeps} held-out seeds (base {args.held_out_seed}, never looked at to choose anything); "
          f"saved_x against every variant to the end as the service packs such a sweep without the rule; "
          f"saved_x_same_packing against it packed one GPU to a pack as with the rule:")
    held = [play_drawn(family, rule, cluster, args.variants, args.held_out_seed * 1000 + k, SOLO_S)
            for k in range(args.held_out_sweeps)]
    for other in args.also:
        oc = parse_cluster(yaml.safe_load(Path(other).read_text()))
        so = summarize([play_drawn(family, rule, oc, args.variants, args.held_out_seed * 1000 + k, SOLO_S)
                        for k in range(args.held_out_sweeps)])
        print(f"held-out seeds on {oc.name} ({oc.gpu_count} GPUs): {so.line()}")
    if args.earlier_held_out_seed:  # the previous rule's held-out seeds, for comparison (0: skip)
        for c in (cluster, *(parse_cluster(yaml.safe_load(Path(o).read_text())) for o in args.also)):
            so = summarize([play_drawn(family, rule, c, args.variants, args.earlier_held_out_seed * 1000 + k, SOLO_S)
                            for k in range(args.held_out_sweeps)])
            print(f"earlier held-out seeds (base {args.earlier_held_out_seed}) on {c.name}: {so.line()}")
    s = summarize(held)
    full_h = statistics.median(o.gpu_hours_full for o in held)
    stop_h = statistics.median(o.gpu_hours_stop for o in held)
    print(f"held-out seeds on {cluster.name}: median gpu_hours every variant to the end {full_h:.2f}, "
          f"with the rule {stop_h:.2f}")
    print(f"sweep_sim: {s.line()} gpu_hours_full_median={full_h:.2f} gpu_hours_stop_median={stop_h:.2f} "
          f"cluster={cluster.name} seeds=held-out")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
