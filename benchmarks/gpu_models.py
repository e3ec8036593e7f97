"""The GPU models against the recorded H100 run, jobs held out (issue 37).

Data: tests/data/gpu/h100-2026-11-27 (one H100 80GB HBM3, driver 580.159.04, CUDA 13.0,
torch 2.11; `scripts/gpu-check.sh`). Nothing here needs a GPU. Three models, each beside
what the planner had before:

- memory: the plain-torch DLRM of each of the 14 memory configs estimated by its own
  rules (`train.plain_trace`: traced under FakeTensorMode, two cuBLAS workspaces,
  the caching allocator's rounding, CUDA transients per id) plus NVML's per-process
  overhead, against NVML's memory of the process. Leave-one-config-out: the held-out
  config's NVML overhead and bytes per id are fitted on the other 13 only. Beside it:
  the run's own estimate (torchrec's rules, the site's CUDA 12 context);
- profiles: the SM and memory-bandwidth busy shares of the 8 job types alone, by the
  profile calibration (`estimate.gpu_calibration`) fitted on the other 7 job types
  (leave-one-job-out), beside the estimator's uncalibrated shares;
- interference: every member's relative speed in the 28 pairs, by the model the planner
  picks (`packing.pairwise.choose_planner_model`, leave-one-job-out: every pair holding
  the held-out job is left out of the fit), beside the naive rule min(1, 1/sum max(s, b)).
  Also the table truth's composition rule (pairs -> larger groups) on the synthetic
  generator's groups of 3-6, where it can be checked (the H100 run measured pairs only).

Run:  .venv/bin/python benchmarks/gpu_models.py [--run DIR] [--learned]
Last line:  gpu_models: mem_median_abs_pct=X mem_worst_under_pct=X profile_sm_mae_pts=X
            profile_bw_mae_pts=X interference_mae=X naive_mae=X planner_predictor=NAME
(targets: memory median <= 3 and worst under >= -3; profile MAE <= 8 points each;
interference_mae <= 0.8 x naive_mae)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from slurm_dlrm.estimate import gpu_calibration as C  # noqa: E402
from slurm_dlrm.interference_io import read_groups  # noqa: E402
from slurm_dlrm.packing.interference import DEFAULT_PARAMS  # noqa: E402
from slurm_dlrm.packing.pairwise import choose_planner_model  # noqa: E402
from slurm_dlrm.selftest.gpu_run import load_run, memory_rows, profile_inputs  # noqa: E402
from slurm_dlrm.site import load_site  # noqa: E402
from slurm_dlrm.train.plain_trace import CUBLAS_THREADS  # noqa: E402
from slurm_dlrm.truth import composition_error, synthetic_groups  # noqa: E402

RUN = ROOT / "tests" / "data" / "gpu" / "h100-2026-11-27"
MIB = 1 << 20


def memory(run_dir: Path) -> tuple[float, float]:
    run = load_run(run_dir)
    gpu = load_site(ROOT / "site-config" / "site.toml").gpu_model("h100")
    t0 = time.perf_counter()
    rows = memory_rows(run)
    print(f"\n== memory: {len(rows)} plain-torch configs, estimate vs NVML's process memory "
          f"(leave-one-config-out; traced in {time.perf_counter() - t0:.0f} s)")
    print(f"{'config':<30} {'NVML MiB':>9} {'estimate':>9} {'err %':>7} {'overhead':>8} {'B/id':>6} "
          f"{'torchrec rules':>14} {'err %':>7}")
    errs, before = [], []
    workspace = gpu.cublas_workspace_bytes * CUBLAS_THREADS
    for i, r in enumerate(rows):
        others = [x for k, x in enumerate(rows) if k != i]
        recs = [m for m in run.memory if m["config"] != r.name]
        overhead = (C.nvml_overhead_mib(recs) or 0.0) * MIB
        per_id = C.fit_per_id([(x.reserved_bytes - x.tensor_peak_bytes - workspace - x.rounding_bytes, x.ids_per_step)
                               for x in others])
        est = r.tensor_peak_bytes + workspace + r.rounding_bytes + per_id * r.ids_per_step + overhead
        err = 100 * (est - r.nvml_bytes) / r.nvml_bytes
        old = 100 * (r.torchrec_rules_estimate_bytes - r.nvml_bytes) / r.nvml_bytes
        errs.append(err)
        before.append(old)
        print(f"{r.name:<30} {r.nvml_bytes / MIB:>9.0f} {est / MIB:>9.0f} {err:>+7.2f} {overhead / MIB:>8.0f} "
              f"{per_id:>6.0f} {r.torchrec_rules_estimate_bytes / MIB:>14.0f} {old:>+7.2f}")
    med, worst = statistics.median(abs(e) for e in errs), min(errs)
    print(f"plain-torch rules, measured overheads: median |err| {med:.2f}%, worst {worst:+.2f}% "
          f"(before: torchrec's rules, site context 520 MiB: median {statistics.median(abs(e) for e in before):.2f}%, "
          f"worst {min(before):+.2f}%)")
    fence = C.fence_overhead_mib(run.selftest)
    print(f"per-process overheads: NVML {C.nvml_overhead_mib(run.memory)} MiB beyond torch's reserved (all "
          f"{len(run.memory)} configs alike), MPS fence {fence} MiB beyond the allocations (selftest "
          f"mps.memory_fence), measured on {C.measured_with(run.selftest)}")
    return med, worst


def profiles(run_dir: Path) -> tuple[float, float]:
    run = load_run(run_dir)
    gpu = load_site(ROOT / "site-config" / "site.toml").gpu_model("h100")
    jobs = profile_inputs(run, gpu)
    held = C.leave_one_job_out(jobs)
    print(f"\n== profiles: {len(jobs)} job types alone, NVML's busy shares (leave-one-job-out)")
    print(f"{'job':<20} {'kernels':>7} {'SM meas':>7} {'calib':>6} {'est':>6} {'BW meas':>7} {'calib':>6} {'est':>6}")
    sm_err, bw_err, sm_before, bw_before = [], [], [], []
    for job, (sm, bw) in held:
        rec = run.alone[job.name]["estimator_profile"]  # what the planner had at the time
        sm_err.append(abs(sm - job.sm_pct))
        bw_err.append(abs(bw - job.membw_pct))
        sm_before.append(abs(rec["sm_util_pct"] - job.sm_pct))
        bw_before.append(abs(rec["membw_util_pct"] - job.membw_pct))
        print(f"{job.name:<20} {job.kernels_per_step:>7} {job.sm_pct:>7.1f} {sm:>6.1f} {rec['sm_util_pct']:>6.1f} "
              f"{job.membw_pct:>7.1f} {bw:>6.1f} {rec['membw_util_pct']:>6.1f}")
    cal = C.fit_profile_calibration(jobs)
    print(f"MAE calibrated: SM {statistics.mean(sm_err):.2f} pts, bandwidth {statistics.mean(bw_err):.2f} pts "
          f"(the run's estimator: SM {statistics.mean(sm_before):.2f}, bandwidth {statistics.mean(bw_before):.2f}); "
          f"fitted on all {len(jobs)}: {cal.as_dict()}")
    return statistics.mean(sm_err), statistics.mean(bw_err)


def interference(run_dir: Path, learned: bool) -> tuple[float, float, str]:
    groups, _ = read_groups(str(run_dir / "colocation.csv"))
    samples = [g.sample() for g in groups if len(g.members) > 1]
    t0 = time.perf_counter()
    choice = choose_planner_model(samples, DEFAULT_PARAMS, learned=learned)
    print(f"\n== interference: {len(samples)} pairs, {choice.how} ({time.perf_counter() - t0:.0f} s)")
    for name, mae in sorted(choice.held_out_mae.items(), key=lambda kv: kv[1]):
        print(f"  {name:<10} MAE {mae:.3f}")
    print(f"  planner: {choice.reason}")
    print(f"  fitted on all pairs: {choice.params.speed_model}")
    synth, _ = synthetic_groups(3000, seed=5)
    comp = composition_error(synth)
    print("  table truth, composing measured pairs into larger groups, on the synthetic generator's groups "
          "(pairs of the same 3000 draws): MAE " + ", ".join(f"size {n} {e:.3f}" for n, e in comp.items()))
    return choice.held_out_mae[choice.name], choice.held_out_mae["naive"], choice.name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", default=str(RUN), help="a gpu-check run folder (default: the recorded H100 run)")
    ap.add_argument("--learned", action="store_true", help="also the learned model as a candidate (slower)")
    args = ap.parse_args()
    run_dir = Path(args.run)
    med, worst = memory(run_dir)
    sm, bw = profiles(run_dir)
    mae, naive, name = interference(run_dir, args.learned)
    print(f"gpu_models: mem_median_abs_pct={med:.2f} mem_worst_under_pct={worst:.2f} profile_sm_mae_pts={sm:.2f} "
          f"profile_bw_mae_pts={bw:.2f} interference_mae={mae:.3f} naive_mae={naive:.3f} planner_predictor={name}")


if __name__ == "__main__":
    main()
