"""The report's learning-curve panels (store/report.py): training loss and held-out AUC
per job, and a sweep's variants compared, with the stopping rule's pauses and promotions
(issue 47: events `sweep_pause` / `sweep_promote`) marked on the curves.

Apart from report.py because these read what the runner wrote (its metrics files, found
through the pack folder the store records, so `report --db` draws them too) and what
the sweep's rule decided, and label variants for people (store/sweep_labels.py
`label_fields`: the few fields that tell the variants apart, the rest in a table).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from slurm_dlrm.store.store import Store

MAX_CURVE_JOBS = 12
MAX_SWEEP_BARS = 30
# The kinds of the sweep rule's decisions (SWEEP_CONTRACT.md), drawn on the curves.
PAUSE_EVENT = "sweep_pause"
PROMOTE_EVENT = "sweep_promote"


def metrics_paths(job_id: int, pack_dir: str | None, spool_dir: Path | None) -> list[Path]:
    """Where a job's metrics file may be: `<spool>/jobs/<id>/metrics.jsonl`, the spool
    being the parent of the job's pack folder (recorded in the store: read with --db
    too) or the one given."""
    out = []
    if pack_dir:
        out.append(Path(pack_dir).parent / "jobs" / str(job_id) / "metrics.jsonl")
    if spool_dir is not None:
        out.append(spool_dir / "jobs" / str(job_id) / "metrics.jsonl")
    return list(dict.fromkeys(out))


def loss_curve(paths: list[Path]) -> list[tuple[int, float]]:
    """(step, loss_avg) of a job's training lines, from the first of `paths` that reads."""
    for path in paths:
        out: dict[int, float] = {}
        try:
            with path.open("rb") as f:
                for line in f:
                    try:
                        r = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(r, dict) and r.get("type") is None and isinstance(r.get("step"), int):
                        loss = r.get("loss_avg", r.get("loss"))
                        if isinstance(loss, int | float) and not isinstance(loss, bool):
                            out[r["step"]] = float(loss)  # a resumed run's repeat of a step: the same figure
        except OSError:
            continue
        return sorted(out.items())
    return []


def _pack_dirs(store: Store, rows: list[dict[str, Any]]) -> dict[int, str | None]:
    dirs: dict[int, str | None] = {}
    for r in rows:
        pid = r.get("pack_id")
        if pid is not None and pid not in dirs:
            dirs[pid] = store.get_pack(pid).pack_dir
    return {int(r["job_id"]): dirs.get(r["pack_id"]) if r.get("pack_id") is not None else None for r in rows}


def sweep_jobs(rows: list[dict[str, Any]], sweep: str) -> list[dict[str, Any]]:
    return [r for r in rows if str(r["name"]) == sweep or str(r["name"]).startswith(sweep + "-")]


def sweep_stops(store: Store, job_ids: list[int]) -> dict[int, list[dict[str, Any]]]:
    """Per job: its pause and promote decisions in time order ({kind, step, value, rung, ...})."""
    out: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for jid in job_ids:
        for kind in (PAUSE_EVENT, PROMOTE_EVENT):
            for e in store.events(job_id=jid, kind=kind):
                raw = e.get("data")
                data: dict[str, Any] = raw if isinstance(raw, dict) else {}
                step = data.get("step")
                if isinstance(step, int | float) and not isinstance(step, bool):
                    out[jid].append({"kind": kind, "t": e["t"], **data})
        out[jid].sort(key=lambda d: d["t"])
    return dict(out)


def _short(name: str, sweep: str | None) -> str:
    return name[len(sweep) + 1:] if sweep and name.startswith(sweep + "-") else name


def curves_figure(plt: Any, store: Store, rows: list[dict[str, Any]], spool_dir: Path | None,
                  sweep: str | None = None) -> tuple[Any, str]:
    """Loss and AUC per job (the sweep's with `sweep`, else the window's latest), pauses
    and promotions of the sweep's rule marked on both."""
    from slurm_dlrm.store.evals import eval_curve

    if sweep is not None and sweep_jobs(rows, sweep):
        rows = sweep_jobs(rows, sweep)
    elif sweep is not None:  # none of its jobs in the window: the window's latest, as without --sweep
        sweep = None
    with store.read():
        evals = {int(r["job_id"]): eval_curve(store, int(r["job_id"])) for r in rows}
        pack_dirs = _pack_dirs(store, rows)
        stops = sweep_stops(store, list(evals))
    losses = {j: loss_curve(metrics_paths(j, pack_dirs.get(j), spool_dir)) for j in evals}
    most = MAX_SWEEP_BARS if sweep is not None else MAX_CURVE_JOBS  # a sweep's: every variant, stopped or not
    jobs = [j for j in sorted(evals) if evals[j] or losses.get(j)][-most:]
    if not jobs:
        return None, "no job in this window has held-out evaluations or training metrics."
    names = {int(r["job_id"]): str(r["name"]) for r in rows}
    fig, (ax_loss, ax_auc) = plt.subplots(1, 2, figsize=(12, 4.8))
    marked = 0
    for j in jobs:
        label = f"{j} {_short(names.get(j, ''), sweep)}"[:28]
        colour = None
        if losses.get(j):
            colour = ax_loss.plot([s for s, _ in losses[j]], [v for _, v in losses[j]], linewidth=1,
                                  label=label)[0].get_color()
        pts = [(e["step"], e["auc"]) for e in evals[j] if e["auc"] is not None]
        if pts:
            colour = ax_auc.plot([s for s, _ in pts], [v for _, v in pts], marker="o", markersize=3, linewidth=1,
                                 label=label if not losses.get(j) else None, color=colour)[0].get_color()
            planted = next((e["planted_auc"] for e in evals[j] if e["planted_auc"] is not None), None)
            if planted is not None:
                ax_auc.axhline(planted, color=colour, linewidth=0.7, linestyle=":")
        for d in stops.get(j, []):
            paused = d["kind"] == PAUSE_EVENT
            value = d.get("value")
            y = float(value) if isinstance(value, int | float) and not isinstance(value, bool) else (
                next((v for s, v in pts if s == d["step"]), None))
            if y is not None:
                ax_auc.scatter([d["step"]], [y], marker="x" if paused else "^", s=70 if paused else 45,
                               color="#c62828" if paused else "#2e7d32", zorder=5, linewidths=2)
            ax_loss.axvline(d["step"], color="#c62828" if paused else "#2e7d32", linewidth=0.8,
                            linestyle="--", alpha=0.6)
            marked += 1
    for ax, title, ylabel in ((ax_loss, "training loss (window mean)", "BCE loss"),
                              (ax_auc, "held-out AUC (dotted: planted model, the best reachable)", "AUC")):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if not ax.has_data():
            why = ("no data (the jobs' metrics files are gone from their pack folders)" if ax is ax_loss
                   else "no held-out evaluations")
            ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes, fontsize=9)
    if marked:
        ax_auc.scatter([], [], marker="x", color="#c62828", label="paused at a rung")
        ax_auc.scatter([], [], marker="^", color="#2e7d32", label="promoted")
    handles, labels = [], []
    for ax in (ax_loss, ax_auc):
        h, lab = ax.get_legend_handles_labels()
        handles += h
        labels += lab
    if handles:  # one legend under both panels: the curves' labels never cover them
        fig.legend(handles, labels, loc="lower center", ncol=min(6, len(labels)), fontsize=7, frameon=False)
        fig.tight_layout(rect=(0, 0.06 + 0.035 * ((len(labels) - 1) // 6), 1, 1))
    n_loss = sum(1 for j in jobs if losses.get(j))
    note = (f"{len(jobs)} jobs (the latest {most} at most)" + (f" of sweep {sweep}" if sweep else "")
            + f"; training loss of {n_loss} of them, from their metrics files.")
    if marked:
        note += (f" {marked} decisions of the sweep's stopping rule: x paused at a rung (below the rung's cut), "
                 "triangle promoted (resumed from its checkpoint); dashed lines on the loss panel at the same steps.")
    return fig, note


def sweep_groups(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Jobs named BASE-<label> (a --set/--array sweep, service/sweep.py) grouped by BASE."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        name = str(r["name"])
        if "-" in name:
            groups[name.rsplit("-", 1)[0]].append(r)
    return {k: v for k, v in groups.items() if len(v) >= 2}


def sweep_figure(plt: Any, store: Store, rows: list[dict[str, Any]],
                 sweep: str | None) -> tuple[Any, str, list[str], list[list[str]]]:
    """The sweep's bars (final AUC, GPU-hours), each variant labelled by the few fields
    that tell them apart; the table of every field that differs comes back beside it."""
    from slurm_dlrm.errors import BadInput
    from slurm_dlrm.store.sweep_labels import digest_table
    from slurm_dlrm.store.sweep_report import sweep_rows

    if sweep is None:
        groups = {k: v for k, v in sweep_groups(rows).items() if any(r["final_auc"] is not None for r in v)}
        if not groups:
            return (None, "no sweep (2 or more jobs named NAME-<variant>) with held-out evaluations in this window.",
                    [], [])
        sweep = max(groups, key=lambda k: max(float(r["submit_time"]) for r in groups[k]))  # the latest
    try:
        variants, fields = sweep_rows(store, sweep, "auc")
    except BadInput as exc:
        return None, str(exc), [], []
    variants = [v for v in variants if v["final_auc"] is not None][:MAX_SWEEP_BARS]
    if not variants:
        return None, f"sweep {sweep}: no variant has a held-out evaluation yet.", [], []
    with store.read():
        specs = {int(v["job_id"]): dict(store.get_job(int(v["job_id"])).spec or {}) for v in variants}
        stops = sweep_stops(store, list(specs))
    head, table, labels_of = digest_table(sweep, [(int(v["job_id"]), str(v["name"]), specs[int(v["job_id"])])
                                                  for v in variants])
    paused = {j for j, ds in stops.items() if ds and ds[-1]["kind"] == PAUSE_EVENT}
    labels = [labels_of[int(v["job_id"])] for v in variants]
    fig, (ax_auc, ax_gpu) = plt.subplots(1, 2, figsize=(12, 0.32 * len(variants) + 2.2),
                                         gridspec_kw={"width_ratios": (2, 1)})
    ys = list(range(len(variants)))[::-1]
    colours = ["#ef6c00" if int(v["job_id"]) in paused else "#1565c0" for v in variants]
    ax_auc.barh(ys, [v["final_auc"] for v in variants], color=colours, label="final AUC")
    ax_auc.scatter([v["best_auc"] for v in variants], ys, color="black", marker="|", s=120, label="best AUC")
    planted = next((v["planted_auc"] for v in variants if v["planted_auc"] is not None), None)
    if planted is not None:
        ax_auc.axvline(planted, color="#2e7d32", linestyle="--", linewidth=1, label="planted model")
    lo = min(min(v["final_auc"] for v in variants), planted or 1.0)
    ax_auc.set_xlim(max(0.0, lo - 0.05), 1.0 if planted is None else min(1.0, planted + 0.02))
    ax_auc.set_yticks(ys, labels, fontsize=8)
    ax_auc.set_xlabel("held-out AUC")
    ax_auc.set_title(f"sweep {sweep}: best first", fontsize=10)
    handles, names = ax_auc.get_legend_handles_labels()
    if paused:  # an empty barh has no colour of its own: a patch says which bars paused
        from matplotlib.patches import Patch

        handles.append(Patch(color="#ef6c00"))
        names.append("paused by the rule (AUC at its pause)")
    ax_auc.legend(handles, names, fontsize=7, loc="lower right")
    ax_auc.grid(alpha=0.3, axis="x")
    ax_gpu.barh(ys, [v["gpu_hours"] or 0.0 for v in variants], color="#9e9e9e")
    ax_gpu.set_yticks(ys, [str(v["job_id"]) for v in variants], fontsize=8)
    ax_gpu.set_xlabel("GPU-hours charged")
    ax_gpu.set_title("job id", fontsize=9, loc="left")
    ax_gpu.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    varied = ", ".join(fields) or "nothing but the name"
    if len(varied) > 160:
        varied = f"{len(fields)} spec fields"
    note = (f"{len(variants)} variants of {sweep}; varied: {varied} (slurm-dlrm acct --sweep {sweep}). "
            "Each bar is labelled by the fields that tell the variants apart most; the table below has them all.")
    return fig, note, head, table


__all__ = ["MAX_CURVE_JOBS", "PAUSE_EVENT", "PROMOTE_EVENT", "curves_figure", "loss_curve", "metrics_paths",
           "sweep_figure", "sweep_groups", "sweep_jobs", "sweep_stops"]
