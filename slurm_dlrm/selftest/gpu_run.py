"""A recorded `scripts/gpu-check.sh` run read back, and the site figures fitted on it (issue 37).

`load_run(folder)` reads selftest.json, memory.jsonl and colocation.jsonl (a DRY run is
refused: nothing in it was measured on a GPU). `memory_rows` traces the plain-torch
model of every memory config (`train.plain_trace`, imports torch); `profile_inputs`
gives each job type's estimator figures beside what NVML saw alone. `site_figures`
fits what `selftest --write-site` keeps: the two per-process overheads and the
profile calibration.

    python -m slurm_dlrm.selftest.gpu_run RUN_DIR [--model h100] [--site FILE] [--write-site FILE]

prints the figures (JSON) and, with --write-site, writes them into the model's entry.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_dlrm.errors import BadInput
from slurm_dlrm.estimate import gpu_calibration as C
from slurm_dlrm.site import GpuModel


@dataclass(frozen=True)
class GpuRun:
    folder: Path
    selftest: dict[str, Any]
    memory: list[dict[str, Any]]  # memory.jsonl, configs that were measured
    alone: dict[str, dict[str, Any]]  # job type -> its alone record (colocation.jsonl)
    pairs: list[dict[str, Any]] = field(default_factory=list)


def _jsonl(path: Path) -> list[dict[str, Any]]:
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except ValueError as exc:
                raise BadInput(f"{path}:{n}: not JSON: {exc}") from None
    return out


def load_run(folder: str | Path) -> GpuRun:
    folder = Path(folder)
    need = ("selftest.json", "memory.jsonl", "colocation.jsonl")
    missing = [n for n in need if not (folder / n).is_file()]
    if missing:
        raise BadInput(f"{folder}: not a gpu-check run folder (no {', '.join(missing)})")
    try:
        selftest = json.loads((folder / "selftest.json").read_text())
    except ValueError as exc:
        raise BadInput(f"{folder / 'selftest.json'}: not JSON: {exc}") from None
    memory = _jsonl(folder / "memory.jsonl")
    coloc = _jsonl(folder / "colocation.jsonl")
    if selftest.get("dry") or any(r.get("dry") for r in memory + coloc):
        raise BadInput(f"{folder}: a DRY run (fakes, the CPU): nothing in it was measured on a GPU")
    return GpuRun(folder, selftest, [r for r in memory if r.get("status") == "MEASURED"],
                  {r["job"]: r for r in coloc if r.get("kind") == "alone"},
                  [r for r in coloc if r.get("kind") == "pair"])


def calibrated_model(run: GpuRun, gpu: GpuModel) -> GpuModel:
    """`gpu` with the selftest's measured compute figures (calibration.compute)."""
    for c in run.selftest.get("checks", []):
        if c.get("name") == "calibration.compute" and c.get("status") == "PASS":
            keys = ("gemm_efficiency", "bf16_gemm_efficiency", "stream_bandwidth_gbps", "gather_bandwidth_gbps",
                    "kernel_launch_us")
            values: dict[str, Any] = {k: float(c["values"][k]) for k in keys if k in c.get("values", {})}
            return dataclasses.replace(gpu, **values)
    return gpu


@dataclass(frozen=True)
class MemoryRow:
    """One memory config: the plain-torch trace's parts and what the GPU measured."""

    name: str
    tensor_peak_bytes: int
    rounding_bytes: int
    ids_per_step: int
    allocated_bytes: int
    reserved_bytes: int
    nvml_bytes: int
    torchrec_rules_estimate_bytes: int  # what the run's estimate (torchrec's rules) said
    trace: Any = None  # the PlainTrace


def memory_rows(run: GpuRun, names: tuple[str, ...] | None = None) -> list[MemoryRow]:
    from slurm_dlrm.estimate.analytic import allocator_rounding_bytes
    from slurm_dlrm.spec import parse_spec
    from slurm_dlrm.train.plain_trace import ids_per_step, trace_plain_step

    rows = []
    for r in run.memory:
        if names is not None and r["config"] not in names:
            continue
        spec = parse_spec(r["spec"], r["config"])
        tr = trace_plain_step(spec)
        m = r["measured"]
        rows.append(MemoryRow(r["config"], tr.peak_bytes, allocator_rounding_bytes(tr.peak_sizes), ids_per_step(spec),
                              int(m["max_memory_allocated_bytes"]), int(m["max_memory_reserved_bytes"]),
                              int(m["nvml_process_bytes"]), int(r["estimate_bytes"]), tr))
    return rows


def profile_inputs(run: GpuRun, gpu: GpuModel) -> list[C.ProfileInputs]:
    """Each job type measured alone: the estimator's GPU times on the calibrated model,
    the plain-torch step's kernel count (traced), the estimator's shares, NVML's."""
    from slurm_dlrm.estimate.analytic import compute_profile, gpu_step_times
    from slurm_dlrm.selftest.gpu_configs import JOB_TYPES, spec_data
    from slurm_dlrm.spec import parse_spec
    from slurm_dlrm.train.plain_trace import trace_plain_step

    model = calibrated_model(run, gpu)
    # The estimator's own shares on the same model, as compute_profile computes them
    # before it applies a calibration (so the fit maps what it will be given).
    plain = dataclasses.replace(model, gpu_us_per_kernel=None, host_us_per_kernel=None, sm_busy_ceiling=None,
                                membw_intercept_pct=None, membw_per_est_membw=None, membw_per_est_sm=None)
    out = []
    for name, overrides in JOB_TYPES:
        rec = run.alone.get(name)
        if rec is None:
            continue
        spec = parse_spec(spec_data(name, overrides, False), name)
        t_compute, t_memory, _, _ = gpu_step_times(spec, model)
        prof = compute_profile(spec, plain)
        out.append(C.ProfileInputs(name, t_compute + t_memory, trace_plain_step(spec).ops_per_step,
                                   prof.sm_util_pct, prof.membw_util_pct, float(rec["nvml"]["sm_util_pct"]),
                                   float(rec["nvml"]["membw_util_pct"])))
    return out


def site_figures(run: GpuRun, gpu: GpuModel, with_profiles: bool = True) -> dict[str, Any]:
    """What `--write-site` keeps for this GPU model, each from its own measurement."""
    out: dict[str, Any] = {}
    nvml = C.nvml_overhead_mib(run.memory)
    if nvml is not None:
        out["nvml_overhead_mib"] = nvml
    fence = C.fence_overhead_mib(run.selftest)
    if fence is not None:
        out["fence_overhead_mib"] = fence
    with_ = C.measured_with(run.selftest)
    if with_ is not None:
        out["measured_with"] = with_
    if with_profiles and len(run.alone) >= 3:
        # the compute figures the calibration was fitted on go with it
        model = calibrated_model(run, gpu)
        for key in ("gemm_efficiency", "bf16_gemm_efficiency", "stream_bandwidth_gbps", "gather_bandwidth_gbps",
                    "kernel_launch_us"):
            value = getattr(model, key)
            if value is not None:
                out[key] = round(float(value), 4)
        out.update(C.fit_profile_calibration(profile_inputs(run, gpu)).as_dict())
    return out


def main(argv: list[str] | None = None) -> int:
    from slurm_dlrm.selftest.gpu_check import DEFAULT_SITE
    from slurm_dlrm.site import load_site

    p = argparse.ArgumentParser(prog="python -m slurm_dlrm.selftest.gpu_run", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir")
    p.add_argument("--site", default=str(DEFAULT_SITE))
    p.add_argument("--model", default="h100")
    p.add_argument("--write-site", default=None, metavar="FILE")
    args = p.parse_args(argv)
    gpu = load_site(args.site).gpu_model(args.model)
    figures = site_figures(load_run(args.run_dir), gpu)
    print(json.dumps(figures, indent=2))
    if args.write_site:
        from slurm_dlrm.selftest.sitefile import check_writable, write_gpu_model

        check_writable(args.write_site)
        write_gpu_model(args.write_site, args.model, figures)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BadInput as exc:
        print(f"slurm-dlrm: error: {exc}", file=sys.stderr)
        sys.exit(2)
