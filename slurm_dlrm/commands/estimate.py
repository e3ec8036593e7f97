"""`slurm-dlrm estimate SPEC...`: click glue over slurm_dlrm.estimate."""

from __future__ import annotations

import json
import logging
from typing import Any

import click

from slurm_dlrm.errors import BadInput, DlrmError, one_line

log = logging.getLogger(__name__)

HELP = """Estimate a DLRM job's peak GPU and host memory and its compute profile, before it runs.

\b
Example:
  slurm-dlrm estimate spec.yaml
  slurm-dlrm estimate spec.yaml other.yaml --gpu a100
  slurm-dlrm estimate spec.yaml --json | jq '.[0].estimates.h100.gpu_peak_bytes'

Prints, per spec, the breakdown of the GPU peak (embedding weights, optimizer state,
dense parameters, gradients, activations, inputs, CUDA context, allocator rounding) and
of the host peak, the compute profile (FLOPs and embedding bytes per sample, predicted
solo SM and memory-bandwidth utilisation, label), and how many copies of the job fit
one GPU of each model of the site (with the site's packing margin). When the store holds
measured peaks of earlier jobs with the same spec fingerprint, the estimate is
calibrated from them and says so; where it holds none, the host peak is calibrated from
the site's finished runs of any spec (at least 3, same device kind: the host runtime
term depends on the machine) and says so on its own line (--no-history to skip both).

With world_size > 1 (or nodes: and gpus_per_node:) it prints every rank's own peak under
the sharding plan the runner will use (torchrec's table-wise greedy placement): the
largest rank decides the request. `--planner` adds torchrec's own planner estimate per
rank beside it, for the same topology (imports torch and torchrec).

Exit codes: 0 ok, 2 bad spec or site config (one line naming the field).
"""


@click.command("estimate", help=HELP, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("spec_paths", metavar="SPEC...", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--gpu", "gpu_name", metavar="MODEL", default=None,
              help="Estimate for this GPU model of the site only (default: every model).")
@click.option("--site", "site_path", type=click.Path(dir_okay=False), default=None,
              help="Site config (default: $SLURM_DLRM_SITE, /etc/slurm-dlrm/site.toml, the repository's).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (a list, one object per spec).")
@click.option("--no-history", is_flag=True, help="Do not calibrate from measured peaks in the store.")
@click.option("--planner", is_flag=True, help="Also ask torchrec's planner for each rank's bytes (needs torchrec).")
def estimate_cmd(spec_paths: tuple[str, ...], gpu_name: str | None, site_path: str | None, as_json: bool,
                 no_history: bool, planner: bool) -> None:
    from slurm_dlrm.estimate import check_tables_fit
    from slurm_dlrm.site import load_site
    from slurm_dlrm.spec import load_spec

    site = load_site(site_path)
    models = [site.gpu_model(gpu_name)] if gpu_name else list(site.gpu_models.values())
    # Validate every spec before printing anything: nothing half-done on bad input.
    specs = []
    for path in spec_paths:
        spec = load_spec(path)
        check_tables_fit(spec, site)
        specs.append(spec)
    results = [_estimate_one(spec, models, site, use_history=not no_history) for spec in specs]
    if planner:
        for r, spec in zip(results, specs, strict=True):
            if spec.world_size > 1:
                r["planner_rank_bytes"] = {g.name: _planner(spec, g, site) for g in models}
    misfits = _advise(results, specs, models, site)
    if site.mps.enabled:
        # What `submit --no-pack` on an MPS share means here when other users share the GPU.
        for r in results:
            r["mps_cross_user"] = {"mode": site.mps.cross_user, "note": site.mps.cross_user_note()}
    if as_json:
        click.echo(json.dumps(results, indent=2))
    else:
        _print_human(results)  # the --no-pack MPS note is submit --no-pack's (and in --json), not every estimate's
    if misfits:
        # as submit would: a job no GPU holds is bad input (exit 2), said with what would fix it
        for line in misfits[1:]:
            click.echo(f"slurm-dlrm: error: {one_line(line)}", err=True)
        raise BadInput(misfits[0])


def _advise(results: list[dict[str, Any]], specs: list[Any], models: list[Any], site: Any) -> list[str]:
    """One line per spec that fits none of `models`, with what would make it fit the
    largest of them (also under `advice` in its result)."""
    from slurm_dlrm.estimate.fit import fit_advice

    lines = []
    for r, spec in zip(results, specs, strict=True):
        if any(f["fits"] for f in r["fits"].values()):
            continue
        gpu = max(models, key=lambda g: g.memory_bytes)
        need = r["fits"][gpu.name]["gpu_peak_bytes_with_margin"]
        r["advice"] = fit_advice(spec, gpu, site.packing.memory_margin_pct,
                                 max_gpus=max((g.gpus for g in site.nodes if g.gpu_model == gpu.name), default=8))
        fix = "; ".join(r["advice"]) or "nothing short of a smaller model"
        lines.append(f"{spec.source}: fits no GPU: needs {human_bytes(need)} with the packing margin, "
                     f"a {gpu.name} has {human_bytes(gpu.memory_bytes)}; it would fit with {fix}")
    return lines


def ranks_per_node(spec: Any, site: Any, gpu: Any) -> int:
    """The ranks a node holds: the spec's gpus_per_node, else the largest node's GPUs."""
    if spec.gpus_per_node is not None:
        return int(spec.gpus_per_node)
    node_gpus = max((g.gpus for g in site.nodes if g.gpu_model == gpu.name), default=spec.world_size)
    return max(1, min(spec.world_size, node_gpus))


def _planner(spec: Any, gpu: Any, site: Any) -> list[int]:
    """torchrec's planner estimate per rank on `gpu` (train/planner_estimate.py)."""
    try:
        from slurm_dlrm.train.planner_estimate import planner_rank_bytes
    except ImportError as exc:
        raise DlrmError(f"--planner needs torch and torchrec ({exc})") from None
    import warnings

    for name in ("torchrec", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)  # its enumerator warns per table
    warnings.filterwarnings("ignore", category=FutureWarning)  # HeuristicalStorageReservation's own
    return planner_rank_bytes(spec, spec.world_size, ranks_per_node(spec, site, gpu), device="cuda",
                              hbm_cap_bytes=gpu.memory_bytes)


def _estimate_one(spec: Any, models: list[Any], site: Any, use_history: bool) -> dict[str, Any]:
    from slurm_dlrm.estimate import calibrate, copies_per_gpu, estimate
    from slurm_dlrm.estimate.calibrate import site_calibrate
    from slurm_dlrm.spec import spec_fingerprint

    fp = spec_fingerprint(spec)
    history, site_runs = _history(site, fp) if use_history else ([], [])
    out: dict[str, Any] = {"spec": spec.source, "name": spec.name, "fingerprint": fp, "estimates": {}, "fits": {}}
    if spec.world_size > 1:
        out["ranks_per_node"] = ranks_per_node(spec, site, models[0])
    for gpu in models:
        if spec.custom_module:
            from slurm_dlrm.service.custom_trace import check_custom_module

            # The same one line as `submit` for a factory that cannot be found, and no
            # torch import (or traceback where torch is missing) before that.
            check_custom_module(spec, spec.source)
            try:
                from slurm_dlrm.estimate.traced import estimate_traced
            except ImportError as exc:
                raise DlrmError(f"{spec.source}: custom_module: tracing it needs torch ({exc})") from None
            est = estimate_traced(spec, gpu)
        else:
            est = estimate(spec, gpu)
        est = calibrate(est, history, fingerprint=fp)
        est = site_calibrate(est, site_runs)  # unchanged where the fingerprint's own runs corrected the host peak
        fit = copies_per_gpu(est, gpu, site.packing.memory_margin_pct)
        out["estimates"][gpu.name] = est.to_dict()
        out["fits"][gpu.name] = {"gpu_mem_bytes": fit.gpu_mem_bytes, "gpu_peak_bytes_with_margin": fit.gpu_peak_bytes,
                                 "copies": fit.copies, "fits": fit.fits}
    return out


def _history(site: Any, fingerprint: str) -> tuple[list[Any], list[Any]]:
    """Measured peaks of earlier jobs with this fingerprint, and the site's recent finished
    runs of any spec (`SiteRun`s, both device kinds), from the user's store (if any)."""
    from slurm_dlrm.estimate import HistoryRecord
    from slurm_dlrm.estimate.calibrate import SITE_MAX_RUNS
    from slurm_dlrm.service.warm_start import site_runs

    try:
        from slurm_dlrm.service.remote import lease_elsewhere, open_snapshot
        from slurm_dlrm.store import Store, store_path_for
        from slurm_dlrm.store.store import current_user

        user = current_user()
        lease = lease_elsewhere(site, user)
        path = store_path_for(site, user)
        if lease is None and not path.exists():
            return [], []
        # on a login node whose service does not hold the store: the copy it publishes
        with (open_snapshot(site, user, lease) if lease is not None else Store(path, readonly=True)) as store:
            rows = store.calibration(fingerprint, limit=20)
            # both device kinds; a run trained on another device than its estimate's is left out
            measured = [r for kind in ("cpu", "cuda")
                    for r in site_runs(store.site_host_runs(kind, limit=SITE_MAX_RUNS), kind)]
    except (DlrmError, OSError, ImportError) as exc:  # no history is not an error
        log.warning("no calibration history: %s", exc)
        return [], []
    return [HistoryRecord(fingerprint, r.est_gpu_peak_bytes, r.meas_gpu_peak_bytes, r.est_host_peak_bytes,
                          r.meas_host_peak_bytes, t=r.end_time or 0.0) for r in rows], measured


def human_bytes(n: float) -> str:
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{int(n)} B"


def _print_human(results: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=110, soft_wrap=True, highlight=False)
    for r in results:
        models = list(r["estimates"])
        first = r["estimates"][models[0]]
        console.print(f"[bold]{r['name']}[/bold]  ({r['spec']})  fingerprint {r['fingerprint']}  "
                      f"method {first['method']}")
        gpu = Table(title="GPU peak memory", title_justify="left")
        gpu.add_column("part")
        for m in models:
            gpu.add_column(m, justify="right")
        keys: list[str] = []
        for m in models:
            keys += [k for k in r["estimates"][m]["gpu_breakdown"] if k not in keys]
        for k in keys:
            vals = [r["estimates"][m]["gpu_breakdown"].get(k, 0) for m in models]
            if any(vals):
                gpu.add_row(k, *(human_bytes(v) for v in vals))
        gpu.add_row("[bold]total (as NVML counts it: the planner's room)[/bold]",
                    *(f"[bold]{human_bytes(r['estimates'][m]['gpu_peak_bytes'])}[/bold]" for m in models))
        gpu.add_row("as the MPS memory limit counts it (the fence)",
                    *(human_bytes(r["estimates"][m].get("gpu_fence_bytes", 0)) for m in models))
        console.print(gpu)
        _print_ranks(console, r)
        host = Table(title="host peak memory", title_justify="left")
        host.add_column("part")
        host.add_column("bytes", justify="right")
        # The parts, then the analytic total they sum to; a calibration from measured runs
        # is its own line (issue 42: a "calibration -775 MiB" part under a total that
        # was not what the parts said)
        calibration = first["host_breakdown"].get("calibration") or 0
        site_calibration = first["host_breakdown"].get("site_calibration") or 0
        for k, v in first["host_breakdown"].items():
            if v and k not in ("calibration", "site_calibration"):
                host.add_row(k, human_bytes(v))
        analytic = first["host_peak_bytes"] - calibration - site_calibration
        host.add_row("[bold]total[/bold]", f"[bold]{human_bytes(analytic)}[/bold]")
        if calibration:
            host.add_row("calibrated from earlier runs", human_bytes(first["host_peak_bytes"]))
        if site_calibration:
            host.add_row(f"calibrated from the site's runs of any spec ({human_bytes(site_calibration)})",
                         human_bytes(first["host_peak_bytes"]))
        console.print(host)
        prof = Table(title="compute profile (solo)", title_justify="left")
        for col in ("GPU", "label", "SM %", "mem BW %", "host cores", "samples/s", "GFLOP/sample",
                    "emb KiB/sample"):
            prof.add_column(col, justify="right")
        for m in models:
            p = r["estimates"][m]["profile"]
            prof.add_row(m, p["label"], f"{p['sm_util_pct']:.1f}", f"{p['membw_util_pct']:.1f}",
                         f"{p['host_cpu_cores']:.2f}", f"{p['solo_samples_per_s']:,.0f}",
                         f"{p['flops_per_sample'] / 1e9:.4f}", f"{p['emb_bytes_per_sample'] / 1024:.1f}")
        console.print(prof)
        fits = Table(title="copies per GPU (by memory, with the packing margin)", title_justify="left")
        for col in ("GPU", "memory", "one copy", "copies"):
            fits.add_column(col, justify="right")
        for m in models:
            f = r["fits"][m]
            fits.add_row(m, human_bytes(f["gpu_mem_bytes"]), human_bytes(f["gpu_peak_bytes_with_margin"]),
                         str(f["copies"]) if f["fits"] else "[red]0 (does not fit)[/red]")
        console.print(fits)
        console.print(f"peak at: {first['peak_phase']}")
        for note in first["notes"]:
            console.print(f"note: {note}")
        console.print()


def _print_ranks(console: Any, r: dict[str, Any]) -> None:
    """Every rank's peak under the runner's sharding plan (world_size > 1), beside
    torchrec's planner estimate where --planner asked for it."""
    from rich.table import Table

    models = list(r["estimates"])
    ranks = {m: r["estimates"][m].get("ranks") or [] for m in models}
    if not ranks[models[0]]:
        return
    planner = r.get("planner_rank_bytes") or {}
    per_node = r.get("ranks_per_node") or 0
    t = Table(title="per rank (the runner's sharding plan; the largest rank decides the request)",
              title_justify="left")
    for col in ("rank", *(["node"] if per_node else []), "tables"):
        t.add_column(col, justify="right")
    for m in models:
        t.add_column(f"{m} GPU peak", justify="right")
        if m in planner:
            t.add_column(f"{m} torchrec planner", justify="right")
    t.add_column("host peak", justify="right")
    largest = {m: max(x["gpu_peak_bytes"] for x in ranks[m]) for m in models}
    for i, first in enumerate(ranks[models[0]]):
        cells = [str(first["rank"]), *([str(first["rank"] // per_node)] if per_node else []),
                 ",".join(str(x) for x in first["tables"]) or "-"]
        for m in models:
            b = ranks[m][i]["gpu_peak_bytes"]
            cells.append(f"[bold]{human_bytes(b)}[/bold]" if b == largest[m] else human_bytes(b))
            if m in planner:
                cells.append(human_bytes(planner[m][i]))
        cells.append(human_bytes(first["host_peak_bytes"]))
        t.add_row(*cells)
    console.print(t)


estimate = estimate_cmd
