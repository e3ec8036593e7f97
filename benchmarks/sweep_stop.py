"""A sweep that stops its losers against the same sweep trained to the end (issue 47).

    .venv/bin/python benchmarks/sweep_stop.py [--variants 27] [--steps 10800] [--min-steps 400]
        [--eval-batches 64] [--round-seconds 1] [--timeout-s 5400]

Live, on this checkout's local Slurm cluster (started if not running, left running),
the members training on the CPU: one sweep of `--variants` variants of a planted-data
spec (tiny-a's model, adagrad, learning rates log-spaced from 1e-4 to 1: variants that
really differ) is submitted twice through `submit --set` -> the packing service ->
Slurm -> the agents: every variant to its end, then the same sweep with `--stop asha`
(rungs min_steps x 3^k). Figures, side by side:

- GPU-hours: acct's GPUHours summed over the sweep's jobs (a member's wall time on its
  GPU share, its start-up included), and the steps the members really trained (from
  their metrics files: steps past a pause count), which CPU contention does not skew;
- the best held-out AUC of each sweep (of the variants trained to their end) and
  whether it is the same variant (same_best; a promoted variant resumes bit for bit,
  so the same variant has the same AUC);
- the overhead of the rule on a variant it never stops: the evaluation seconds of each
  survivor of the stopped sweep minus those of the same variant in the full sweep (its
  rung evaluations), over its run time in the full sweep (target: <= 2%); measured
  inside the members, so CPU contention between the two runs does not enter it.

The last line:

    sweep: variants= best_auc_full= best_auc_stop= same_best= gpu_hours_full= gpu_hours_stop= saved_x=

An interrupted run cancels its jobs and stops its service.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def spec_text(steps: int, eval_batches: int) -> str:
    spec = yaml.safe_load((REPO / "examples" / "sweep" / "tiny-a.yaml").read_text())
    spec.update(name="sw", steps=steps, batch_size=128, optimizer={"type": "adagrad", "lr": 0.01},
                checkpoint_every_steps=steps, metrics_every_steps=20,
                # the spec's own schedule: the end only; eval.samples, so that the sweep without
                # the rule is judged on the held-out set the rule gives the other (one for all)
                eval={"every_steps": steps, "samples": eval_batches * 128})
    return yaml.safe_dump(spec)


def learning_rates(n: int) -> list[float]:
    return [float(f"{10 ** (-4 + 4 * i / max(1, n - 1)):.3g}") for i in range(n)]


class Run:
    """One sweep on a service of its own (store and spool under `workdir`)."""

    def __init__(self, workdir: Path, round_seconds: float) -> None:
        from slurm_dlrm.service.daemon import spawn_service, wait_until_running
        from slurm_dlrm.service.demo import demo_site
        from slurm_dlrm.service.submit import service_paths
        from slurm_dlrm.site import load_site
        from slurm_dlrm.store.store import current_user

        workdir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.workdir = workdir
        site_path = demo_site(workdir)
        os.environ["SLURM_DLRM_SITE"] = str(site_path)
        self.site = load_site(site_path)
        self.user = current_user()
        self.paths = service_paths(self.site, self.user)
        self.ids: list[int] = []
        spawn_service(self.paths, ["--round-seconds", str(round_seconds), "--idle-exit", "900"])
        if wait_until_running(self.paths, timeout_s=60) is None:
            raise RuntimeError(f"the packing service did not start; see {self.paths.log}")

    def sweep(self, steps: int, lrs: list[float], stop: str | None, min_steps: int, timeout_s: float,
              eval_batches: int) -> dict:
        from slurm_dlrm.service.sbatch_options import SbatchOptions
        from slurm_dlrm.service.submit import submit
        from slurm_dlrm.service.sweep_stop import held_job_ids
        from slurm_dlrm.store.acct import AcctFilter, acct_rows
        from slurm_dlrm.store.store import Store

        text = spec_text(steps, eval_batches)
        if stop:
            text += f"sweep: {{stop: asha, min_steps: {min_steps}, reduction: 3}}\n"
        path = self.workdir / "sw.yaml"
        path.write_text(text)
        t0 = time.monotonic()
        self.ids, _ = submit([str(path)], SbatchOptions(), site=self.site, user=self.user, cwd=str(self.workdir),
                             start_service=False, sets=[f"optimizer.lr={','.join(map(str, lrs))}"], stop=stop)
        deadline = time.monotonic() + timeout_s
        with Store.for_user(self.site, self.user, readonly=True) as store:
            while True:
                with store.read():
                    states = {i: str(store.get_job(i).state) for i in self.ids}
                    held = held_job_ids(store, self.ids)
                live = [i for i, s in states.items() if s in ("PLANNED", "RUNNING")
                        or (s == "PENDING" and i not in held)]
                if not live:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the sweep did not end in {timeout_s:.0f} s ({len(live)} variants live)")
                time.sleep(2.0)
        wall_s = time.monotonic() - t0
        from slurm_dlrm.service.demo import wait_packs_final

        wait_packs_final(self.site, self.user, timeout_s=120)
        spool = self.site.spool_dir_for(self.user)
        with Store.for_user(self.site, self.user, readonly=True) as store:
            rows = {int(r["job_id"]): r for r in acct_rows(store, AcctFilter(job_ids=tuple(self.ids)))}
            jobs = {i: store.get_job(i) for i in self.ids}
            held = held_job_ids(store, self.ids)
        variants = []
        for i in self.ids:
            metrics = read_metrics(spool / "jobs" / str(i) / "metrics.jsonl")
            evals = {r["step"]: r for r in metrics if r.get("type") == "eval"}
            final = evals.get(steps)
            variants.append({
                "job_id": i, "lr": jobs[i].spec["optimizer"]["lr"], "state": str(jobs[i].state), "held": i in held,
                "gpu_hours": float(rows[i].get("gpu_hours") or 0.0),
                "steps_trained": trained_steps(metrics),
                "final_auc": final["eval_auc"] if final else None,
                "evals": evals, "run_s": run_seconds(metrics),
            })
        return {"variants": variants, "wall_s": wall_s}

    def cleanup(self) -> None:
        from slurm_dlrm.service.cancel import cancel_job
        from slurm_dlrm.service.daemon import stop
        from slurm_dlrm.slurm.client import SlurmClient
        from slurm_dlrm.store.states import JOB_TERMINAL, PACK_ACTIVE
        from slurm_dlrm.store.store import Store

        with Store.for_user(self.site, self.user) as store:
            for i in self.ids:  # paused variants (held PENDING) and anything still live
                if store.get_job(i).state not in JOB_TERMINAL:
                    cancel_job(store, SlurmClient(timeout_s=15.0), i, user=self.user)
        try:
            stop(self.paths, timeout_s=60)
        finally:
            with Store.for_user(self.site, self.user, readonly=True) as store:
                active = [int(p.slurm_job_id) for p in store.packs(PACK_ACTIVE, user=self.user) if p.slurm_job_id]
            if active:
                SlurmClient().scancel(active)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if isinstance(r, dict):
            out.append(r)
    return out


def trained_steps(metrics: list[dict[str, Any]]) -> int:
    """Steps the member trained: its last step (a pause checkpoints at the step it stops at
    and a promotion resumes there, so no step is trained twice; the few steps after its
    last progress line are not counted)."""
    return max((int(r["step"]) for r in metrics if isinstance(r.get("step"), int)), default=0)


def run_seconds(metrics: list[dict[str, Any]]) -> float:
    ts = [float(r["t"]) for r in metrics if isinstance(r.get("t"), int | float)]
    return max(ts) - min(ts) if len(ts) >= 2 else 0.0


def best(variants: list[dict[str, Any]]) -> dict[str, Any] | None:
    done = [v for v in variants if v["final_auc"] is not None and not math.isnan(v["final_auc"])]
    return max(done, key=lambda v: v["final_auc"]) if done else None


def overhead(full: list[dict[str, Any]], stopped: list[dict[str, Any]]) -> tuple[int, float, float]:
    """(variants, extra eval seconds, their run seconds in the full sweep): for each variant
    the stopped sweep trained to its end, its evaluation seconds there minus those of the
    same variant in the full sweep (the rung evaluations; the first evaluation's one-off
    warm-up is in both), over its run time in the full sweep."""
    extra_s = run_s = 0.0
    n = 0
    for f, s in zip(full, stopped, strict=True):
        if s["final_auc"] is None or f["final_auc"] is None:
            continue
        n += 1
        extra_s += sum(float(r.get("eval_s") or 0.0) for r in s["evals"].values()) \
            - sum(float(r.get("eval_s") or 0.0) for r in f["evals"].values())
        run_s += f["run_s"]
    return n, extra_s, run_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", type=int, default=27)
    ap.add_argument("--steps", type=int, default=10800)  # ~23 min here; 1080 and 40: ~6 min
    ap.add_argument("--min-steps", type=int, default=400)
    ap.add_argument("--eval-batches", type=int, default=64)  # x 128 samples: the held-out set of every eval
    ap.add_argument("--round-seconds", type=float, default=1.0)
    ap.add_argument("--timeout-s", type=float, default=5400.0)
    args = ap.parse_args()
    if args.variants < 2 or args.min_steps < 1 or args.min_steps >= args.steps:
        print("slurm-dlrm: error: --variants >= 2 and 1 <= --min-steps < --steps", file=sys.stderr)
        return 2
    from slurm_dlrm.service.demo import ensure_cluster

    cluster = ensure_cluster(lambda s: print(f"sweep_stop: {s}", file=sys.stderr))
    os.environ["SLURM_CONF"] = str(cluster.config.slurm_conf)
    lrs = learning_rates(args.variants)
    root = Path(tempfile.mkdtemp(prefix="sweep_stop-"))
    results = {}
    for label, stop in (("full", None), ("stop", "asha")):
        run = Run(root / label, args.round_seconds)
        try:
            print(f"sweep_stop: {label}: {args.variants} variants x {args.steps} steps ({run.workdir})",
                  file=sys.stderr)
            results[label] = run.sweep(args.steps, lrs, stop, args.min_steps, args.timeout_s, args.eval_batches)
        finally:
            run.cleanup()
    full, stopped = results["full"]["variants"], results["stop"]["variants"]
    bf, bs = best(full), best(stopped)
    gh_full = sum(v["gpu_hours"] for v in full)
    gh_stop = sum(v["gpu_hours"] for v in stopped)
    st_full = sum(v["steps_trained"] for v in full)
    st_stop = sum(v["steps_trained"] for v in stopped)
    print(f"{'lr':>8} {'full AUC':>9} {'full GPUh':>10} {'stop state':>11} {'stop AUC':>9} {'steps':>6} "
          f"{'stop GPUh':>10}")
    for f, s in zip(full, stopped, strict=True):
        print(f"{f['lr']:>8g} {_f(f['final_auc']):>9} {f['gpu_hours']:>10.4f} "
              f"{'paused' if s['held'] else s['state']:>11} {_f(s['final_auc']):>9} {s['steps_trained']:>6} "
              f"{s['gpu_hours']:>10.4f}")
    print(f"GPU-hours (acct): full {gh_full:.4f}  stop {gh_stop:.4f}  ({gh_full / gh_stop:.2f}x)")
    print(f"steps trained:    full {st_full}  stop {st_stop}  ({st_full / max(1, st_stop):.2f}x)")
    print(f"wall:             full {results['full']['wall_s']:.0f} s  stop {results['stop']['wall_s']:.0f} s")
    n, extra_s, run_s = overhead(full, stopped)
    pct = 100.0 * extra_s / run_s if run_s else float("nan")
    print(f"overhead: the {n} variant(s) trained to the end in both sweeps spent {extra_s:.2f} s more on "
          f"evaluations with the rule, in {run_s:.0f} s of running: overhead_pct={pct:.2f} (target <= 2)")
    same = bf is not None and bs is not None and bf["lr"] == bs["lr"]
    print(f"sweep: variants={args.variants} best_auc_full={_f(bf and bf['final_auc'])} "
          f"best_auc_stop={_f(bs and bs['final_auc'])} same_best={str(same).lower()} "
          f"gpu_hours_full={gh_full:.4f} gpu_hours_stop={gh_stop:.4f} saved_x={gh_full / gh_stop:.2f}")
    return 0


def _f(v: Any) -> str:
    return "-" if v is None else f"{v:.4f}"


if __name__ == "__main__":
    sys.exit(main())
