"""How well the interference models predict co-located speeds on the synthetic generator.

The truth is `slurm_dlrm.truth.SyntheticColocation` (a roofline with queuing, L2
thrash and launch queuing: not the analytic formula's shape, so neither model is judged
on its own prior). Groups of 2-6 jobs drawn from a pool of jobs that recur across
groups, as on a cluster. Printed side by side, MAE of each member's relative speed:

- the analytic model with the default constants (no fit);
- the analytic model refit (5-fold, leave-jobs-out);
- the learned model (5-fold, leave-groups-out and leave-jobs-out: every group holding a
  held-out job is left out of the fit, the error for a job never seen);
- the naive baselines (speed 1; min(1, 1/sum max(sm, bw))), the better one is the bar;

then per group size, and the time of one fit on 100,000 groups (the model `interference
fit` writes, both tree sets: the data carry GPU memory).

Run:  /work/main/.venv/bin/python benchmarks/interference_accuracy.py [--groups N]
Last line:  interference: groups=N mae_analytic=X mae_learned_jobs_out=X mae_naive=X fit_s=X
            (targets: mae_learned_jobs_out <= 0.6 x mae_naive; fit_s < 30)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from slurm_dlrm.packing.interference import DEFAULT_PARAMS  # noqa: E402
from slurm_dlrm.packing.interference_eval import (  # noqa: E402
    BASELINES,
    LEARNED_JOBS_OUT,
    MODEL,
    evaluate,
)
from slurm_dlrm.packing.learned import fit_learned  # noqa: E402
from slurm_dlrm.truth import synthetic_groups  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=3000)
    ap.add_argument("--jobs", type=int, default=300, help="distinct jobs the groups are drawn from")
    ap.add_argument("--fit-groups", type=int, default=100_000)
    args = ap.parse_args()

    t0 = time.perf_counter()
    samples, _ = synthetic_groups(args.groups, seed=1, jobs=args.jobs)
    print(f"{args.groups} synthetic groups of {args.jobs} jobs in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    t0 = time.perf_counter()
    ev = evaluate(samples, DEFAULT_PARAMS, folds=5, learned=True)
    print(f"5-fold evaluation (refits and learned fits) in {time.perf_counter() - t0:.1f} s", file=sys.stderr)

    names = list(ev.order)
    print(f"synthetic truth: {ev.groups} groups, {ev.members} members; MAE of the relative speed (bias)")
    for name in names:
        st = ev.overall[name]
        print(f"  {name:<24} {st.mae:.4f}  ({st.bias:+.4f})")
    print("MAE by group size:")
    print(f"{'size':>6} " + " ".join(f"{n[:14]:>14}" for n in names))
    for size, per in sorted(ev.by_size.items()):
        print(f"{size:>6} " + " ".join(f"{per[n].mae:>14.4f}" for n in names))
    naive = min(ev.overall[b].mae for b in BASELINES)

    t0 = time.perf_counter()
    big, _ = synthetic_groups(args.fit_groups, seed=2, jobs=max(args.jobs, 2000))
    print(f"{args.fit_groups} groups generated in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    t0 = time.perf_counter()
    model = fit_learned(big, DEFAULT_PARAMS)
    fit_s = time.perf_counter() - t0
    print(f"one fit on {args.fit_groups} groups ({model.info['training_members']} members, features "
          f"{', '.join(model.as_dict()['features'])}): {fit_s:.1f} s")
    learned = ev.overall[LEARNED_JOBS_OUT].mae
    print(f"learned jobs out / better naive = {learned / naive:.2f} (target <= 0.6)")
    print(f"interference: groups={ev.groups} mae_analytic={ev.overall[MODEL].mae:.4f} "
          f"mae_learned_jobs_out={learned:.4f} mae_naive={naive:.4f} fit_s={fit_s:.1f}")


if __name__ == "__main__":
    main()
