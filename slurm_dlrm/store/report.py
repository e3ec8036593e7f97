"""`slurm-dlrm report`: one self-contained HTML page with matplotlib plots.

matplotlib (Agg backend) is imported inside `write_report` only, so nothing else in
slurm-dlrm pays for it. Each plot is written as a PNG beside the HTML and embedded in
it as base64, so the page works when copied alone.
"""

from __future__ import annotations

import base64
import io
import json
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2

from slurm_dlrm.store.acct import (
    DEFAULT_FORMAT,
    AcctFilter,
    acct_rows,
    acct_table_cells,
    parse_format,
)
from slurm_dlrm.store.store import Store

GIB = float(1 << 30)
STATE_COLOURS = {
    "COMPLETED": "#2e7d32", "RUNNING": "#1565c0", "FAILED": "#c62828", "OOM": "#ef6c00",
    "CANCELLED": "#757575", "PENDING": "#9e9e9e", "PLANNED": "#6a1b9a", "TIMEOUT": "#f9a825",
}


@dataclass
class Written:
    html: Path
    pngs: list[Path] = field(default_factory=list)


_TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>slurm-dlrm report {{ since }} to {{ until }}</title>
<style>
 body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
 table { border-collapse: collapse; font-size: 0.85em; }
 th, td { border: 1px solid #ccc; padding: 2px 6px; text-align: right; }
 th { background: #eee; } td.l, th.l { text-align: left; }
 img { max-width: 100%; border: 1px solid #ddd; margin: 0.5em 0; }
 .note { color: #666; font-size: 0.85em; }
 .empty { color: #444; background: #f6f6f6; border: 1px solid #ddd; padding: 0.6em 1em; }
</style></head><body>
<h1>slurm-dlrm report</h1>
<p>Window: {{ since }} to {{ until }} (local time). Store: <code>{{ store_path }}</code>.
Generated {{ generated }}.</p>
<h2>Summary</h2>
<table>{% for k, v in summary %}<tr><th class="l">{{ k }}</th><td>{{ v }}</td></tr>{% endfor %}</table>
<p class="note">GPU-hours charged split each shared GPU's allocated hours among its members by
their run time on it; "exclusive" is what the same work would take at one job per GPU
(docs/store.md, "GPU-hours").</p>
{% for p in plots %}
<h2>{{ p.title }}</h2>
{% if p.b64 %}<img alt="{{ p.title }}" src="data:image/png;base64,{{ p.b64 }}">
<p class="note">{{ p.note }} (also <a href="{{ p.file }}">{{ p.file }}</a>)</p>
{% else %}<p class="empty">Nothing to plot: {{ p.note }}</p>
{% endif %}{% endfor %}
<h2>Jobs{% if jobs_truncated %} (latest {{ job_rows|length }} of {{ n_jobs }}){% endif %}</h2>
<table><tr>{% for h in job_header %}<th>{{ h }}</th>{% endfor %}</tr>
{% for row in job_rows %}<tr>{% for c in row %}<td>{{ c }}</td>{% endfor %}</tr>{% endfor %}
</table>
</body></html>
"""


def _fmt_time(t: float) -> str:
    return datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def write_report(store: Store, html_path: Path, *, since: float, until: float, max_gpus: int = 16,
                 max_packs: int = 40, max_job_rows: int = 500, now: float | None = None,
                 spool_dir: Path | None = None, sweep: str | None = None) -> Written:
    import matplotlib

    matplotlib.use("Agg")  # no display on login or compute nodes
    import matplotlib.pyplot as plt

    now = store.clock() if now is None else now
    html_path = html_path.resolve()
    html_path.parent.mkdir(parents=True, exist_ok=True)
    stem = html_path.stem
    rows = acct_rows(store, AcctFilter(since=since, until=until), now)
    host_for_run(store, rows)
    written = Written(html_path)
    plots: list[dict[str, str]] = []

    def save(fig: Any, suffix: str, title: str, note: str) -> None:
        if fig is None:  # nothing to draw: say why instead of an empty plot (issue 17)
            plots.append({"title": title, "note": note, "file": "", "b64": ""})
            return
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
        plt.close(fig)
        png = html_path.with_name(f"{stem}-{suffix}.png")
        png.write_bytes(buf.getvalue())
        written.pngs.append(png)
        plots.append({"title": title, "note": note, "file": png.name,
                      "b64": base64.b64encode(buf.getvalue()).decode("ascii")})

    fig, note = _gpu_timelines(plt, store, since, until, max_gpus)
    save(fig, "gpu-util", "SM utilisation per GPU", note)
    fig, note = _gantt(plt, store, since, until, max_packs, now)
    save(fig, "gantt", "Packs and their members", note)
    fig, note = _memory(plt, rows)
    save(fig, "memory", "Estimated vs measured peak memory", note)
    fig, note = _curves(plt, store, rows, spool_dir)
    save(fig, "curves", "Training loss and held-out AUC per job", note)
    fig, note = _sweep_chart(plt, store, rows, sweep)
    save(fig, "sweep", "Sweep: the variants compared", note)

    cols = parse_format(DEFAULT_FORMAT)
    cells = acct_table_cells(store, AcctFilter(since=since, until=until), cols, now)
    shown = [list(r[3:]) for r in cells[-max_job_rows:]]
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    html = env.from_string(_TEMPLATE).render(
        since=_fmt_time(since), until=_fmt_time(until), generated=_fmt_time(now),
        store_path=str(store.path), summary=_summary(store, rows, since, until), plots=plots,
        job_header=[c.name for c, _ in cols], job_rows=shown,
        jobs_truncated=len(rows) > len(shown), n_jobs=len(rows),
    )
    html_path.write_text(html, encoding="utf-8")
    return written


def _summary(store: Store, rows: list[dict[str, Any]], since: float, until: float) -> list[tuple[str, str]]:
    by_state: dict[str, int] = defaultdict(int)
    for r in rows:
        by_state[r["state"]] += 1
    charged = sum(r["gpu_hours"] for r in rows)
    excl = sum(r["excl_gpu_hours"] for r in rows)
    waits = [r["wait_s"] for r in rows if r["start_time"] is not None]
    gpu_err = [r["gpu_mem_peak_bytes"] / r["est_gpu_peak_bytes"] - 1 for r in rows
               if r["gpu_mem_peak_bytes"] and r["est_gpu_peak_bytes"]]
    host_err = [r["rss_peak_bytes"] / r[HOST_EST_KEY] - 1 for r in rows
                if r["rss_peak_bytes"] and r.get(HOST_EST_KEY)]
    on_cpu = sum(1 for r in rows if r["rss_peak_bytes"] and r.get(HOST_EST_KEY) and r.get("ran_on") == "cpu")
    span = store.query("sample_span", {"since": since, "until": until})[0]
    packs = {r["pack_id"] for r in rows if r["pack_id"] is not None}
    out = [
        ("Jobs", f"{len(rows)} (" + ", ".join(f"{k} {v}" for k, v in sorted(by_state.items())) + ")"),
        ("Packs", str(len(packs))),
        ("Monitoring samples", f"{span['n']:,}"),
        ("GPU-hours charged", f"{charged:.3f}"),
        ("GPU-hours at one job per GPU", f"{excl:.3f}"),
        ("GPU-hours saved", f"{excl - charged:.3f}" + (f" ({(excl - charged) / excl:.1%})" if excl > 0 else "")),
        ("Mean wait (started jobs)", f"{statistics.fmean(waits):.0f} s" if waits else "-"),
        ("GPU memory: median (measured/estimated - 1)", f"{statistics.median(gpu_err):+.1%}" if gpu_err else "-"),
        ("Host memory: median (measured/estimated - 1)",
         (f"{statistics.median(host_err):+.1%}" + (f" ({on_cpu} of {len(host_err)} ran on the CPU: against the "
                                                   "estimate for a CPU run)" if on_cpu else ""))
         if host_err else "-"),
        ("OOM jobs", str(by_state.get("OOM", 0))),
    ]
    return out


def _dates(ts: list[float]) -> list[datetime]:
    return [datetime.fromtimestamp(t) for t in ts]


def _gpu_timelines(plt: Any, store: Store, since: float, until: float, max_gpus: int) -> tuple[Any, str]:
    span = store.query("sample_span", {"since": since, "until": until})[0]
    if not span["n"]:
        return None, "no monitoring samples in this window (no pack ran in it, or its agents sent none)."
    bucket_s = max(1.0, (span["t1"] - span["t0"]) / 300.0)
    series: dict[tuple[int, str, int], dict[int | None, tuple[list[float], list[float]]]] = defaultdict(dict)
    for r in store.query("gpu_timeline", {"since": since, "until": until, "bucket_s": bucket_s}):
        gpu = (r["pack_id"], r["node"], r["gpu_index"])
        ts, ys = series[gpu].setdefault(r["job_id"], ([], []))
        if r["sm_util_pct"] is not None:
            ts.append(r["t"])
            ys.append(r["sm_util_pct"])
    drawn = [g for g in series if any(v[0] for v in series[g].values())]
    if not drawn:
        # e.g. the local cluster's fake GPUs: NVML answers no utilisation, only the
        # agents' host figures (CPU, RSS) were sampled. An empty axis would start in 1970.
        return None, (f"{span['n']:,} monitoring samples in this window, but none has an SM utilisation: "
                      "the GPUs' NVML gave none (the local cluster's fake GPUs have no NVML; on real GPUs, "
                      "check that the agent can read NVML).")
    # The busiest GPUs by points, shown in time order.
    gpus = sorted(drawn, key=lambda g: -sum(len(v[0]) for v in series[g].values()))[:max_gpus]
    gpus.sort(key=lambda g: min((v[0][0] for v in series[g].values() if v[0]), default=0.0))
    import matplotlib.dates as mdates

    # Own time axis per GPU: packs are short next to the window.
    fig, axes = plt.subplots(len(gpus), 1, figsize=(11, 1.8 * len(gpus) + 0.6), squeeze=False)
    for ax, gpu in zip(axes[:, 0], gpus, strict=True):
        members = series[gpu]
        for job_id, (ts, ys) in sorted(members.items(), key=lambda kv: -1 if kv[0] is None else kv[0]):
            if not ts:
                continue
            if job_id is None:
                ax.plot(_dates(ts), ys, color="black", linewidth=1.2, label="GPU")
            else:
                ax.plot(_dates(ts), ys, linewidth=0.9, label=f"job {job_id}")
        ax.set_ylim(0, 105)
        ax.set_ylabel("SM %")
        ax.set_title(f"pack {gpu[0]}  {gpu[1]} GPU {gpu[2]}", fontsize=9, loc="left")
        ax.legend(fontsize=7, loc="upper right", ncol=4)
        ax.grid(alpha=0.3)
        locator = mdates.AutoDateLocator()
        ax.xaxis.set_major_locator(locator)
        ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))
    fig.tight_layout()
    note = f"{len(gpus)} of {len(drawn)} GPUs; averages over {bucket_s:.0f} s buckets; black = whole GPU."
    return fig, note


def _gantt(plt: Any, store: Store, since: float, until: float, max_packs: int, now: float) -> tuple[Any, str]:
    import matplotlib.dates as mdates

    rows = store.query("gantt", {"since": since, "until": until, "now": now})
    if not rows:
        return None, "no pack ran in this window."
    pack_ids = list(dict.fromkeys(r["pack_id"] for r in rows))
    keep = set(pack_ids[-max_packs:])
    rows = [r for r in rows if r["pack_id"] in keep]
    fig, ax = plt.subplots(figsize=(11, 0.28 * len(rows) + 1.5))
    labels: list[str] = []
    y = 0
    pack_rows: dict[int, list[int]] = defaultdict(list)
    for r in rows:
        pack_rows[r["pack_id"]].append(y)
        start = mdates.date2num(datetime.fromtimestamp(r["start_time"]))
        end = mdates.date2num(datetime.fromtimestamp(r["end_time"]))
        ax.barh(y, max(end - start, 1e-6), left=start, height=0.7,
                color=STATE_COLOURS.get(r["job_state"], "#888"), edgecolor="none")
        labels.append(f"pack {r['pack_id']} · job {r['job_id']} {r['job_name'][:18]}"
                      + (f" ({r['n_gpus']} GPUs)" if r["n_gpus"] > 1 else ""))
        y += 1
    for r in {r["pack_id"]: r for r in rows}.values():
        ys = pack_rows[r["pack_id"]]
        start = mdates.date2num(datetime.fromtimestamp(r["pack_start"]))
        end = mdates.date2num(datetime.fromtimestamp(r["pack_end"] if r["pack_end"] is not None else now))
        ax.axhspan(min(ys) - 0.45, max(ys) + 0.45, xmin=0, xmax=1, color="#f0f0f0", zorder=0)
        ax.plot([start, end], [min(ys) - 0.45] * 2, color="black", linewidth=2)
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()
    ax.xaxis_date()
    ax.grid(axis="x", alpha=0.3)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in STATE_COLOURS.values()]
    ax.legend(handles, list(STATE_COLOURS), fontsize=7, loc="lower right", ncol=4)
    fig.autofmt_xdate()
    return fig, (f"{len(keep)} of {len(pack_ids)} packs; bars are members coloured by job state, "
                 "the black line above each group is the pack's allocation.")


# The host estimate a run is judged by: the one for the device it ran on (`host_for_run`).
HOST_EST_KEY = "est_host_peak_bytes_for_run"
_METRICS_TAIL_BYTES = 64 << 10


def ran_on(pack_dir: str | None, job_id: int) -> str | None:
    """The device a job's last run trained on ("cuda", "cpu"), from the runner's metrics
    lines (`device`, docs/runner.md) in `<spool>/jobs/<id>/metrics.jsonl`; None if unknown."""
    if not pack_dir:
        return None
    path = Path(pack_dir).parent / "jobs" / str(job_id) / "metrics.jsonl"
    try:
        with path.open("rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - _METRICS_TAIL_BYTES))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            device = json.loads(line).get("device")
        except (ValueError, AttributeError):
            continue
        if isinstance(device, str):
            return device
    return None


def host_for_run(store: Store, rows: list[dict[str, Any]]) -> None:
    """Set each row's `HOST_EST_KEY`: the stored host estimate is for the job's GPU node
    (the CUDA runtime, cuBLAS and fbgemm's GPU kernels mapped into the process, 1.5 GiB);
    a member that trained on the CPU (fake GPUs, as in the demo) is judged against the
    estimate for a CPU run of its spec instead (issue 43: the demo read -70.9%)."""
    from slurm_dlrm.errors import DlrmError
    from slurm_dlrm.estimate import estimate
    from slurm_dlrm.spec import parse_spec

    pack_dirs: dict[int, str | None] = {}
    for r in rows:
        r[HOST_EST_KEY] = r["est_host_peak_bytes"]
        pid = r.get("pack_id")
        if pid is None or not r.get("rss_peak_bytes") or not r.get("est_host_peak_bytes"):
            continue
        if pid not in pack_dirs:
            pack_dirs[pid] = store.get_pack(pid).pack_dir
        r["ran_on"] = ran_on(pack_dirs[pid], r["job_id"])
        if r["ran_on"] != "cpu":
            continue
        job = store.get_job(r["job_id"])
        try:
            r[HOST_EST_KEY] = estimate(parse_spec(job.spec), None).host_peak_bytes
        except (DlrmError, ValueError, TypeError):  # a spec this version no longer reads: keep the stored one
            pass


def _memory(plt: Any, rows: list[dict[str, Any]]) -> tuple[Any, str]:
    if not any(r[m] is not None and r.get(e) is not None for r in rows for e, m in (
            ("est_gpu_peak_bytes", "gpu_mem_peak_bytes"), (HOST_EST_KEY, "rss_peak_bytes"))):
        return None, "no job in this window has both an estimate and a measured peak."
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8))
    n_total = 0
    for ax, est_key, meas_key, title in (
        (axes[0], "est_gpu_peak_bytes", "gpu_mem_peak_bytes", "GPU memory peak (GiB)"),
        (axes[1], HOST_EST_KEY, "rss_peak_bytes", "host memory peak (GiB); estimated for the device it ran on"),
    ):
        pts = [(r[est_key] / GIB, r[meas_key] / GIB, r["state"]) for r in rows
               if r.get(est_key) is not None and r[meas_key] is not None]
        n_total += len(pts)
        for state, colour in STATE_COLOURS.items():
            xs = [p[0] for p in pts if p[2] == state]
            ys = [p[1] for p in pts if p[2] == state]
            if xs:
                ax.scatter(xs, ys, s=12, color=colour, label=state, alpha=0.8)
        if not pts:
            ax.text(0.5, 0.5, "no measured peaks (e.g. fake GPUs: no NVML)", ha="center", va="center",
                    transform=ax.transAxes, fontsize=9)
        hi = max([max(p[0], p[1]) for p in pts], default=1.0) * 1.05
        ax.plot([0, hi], [0, hi], color="black", linewidth=0.8, linestyle="--", label="measured = estimated")
        ax.set_xlim(0, hi)
        ax.set_ylim(0, hi)
        ax.set_xlabel("estimated")
        ax.set_ylabel("measured")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    on_cpu = sum(1 for r in rows if r.get("ran_on") == "cpu" and r["rss_peak_bytes"] is not None)
    return fig, (f"{n_total} points; above the diagonal the estimate was too low."
                 + (f" Host memory of the {on_cpu} job(s) that trained on the CPU (no CUDA, e.g. fake GPUs) "
                    "against the estimate for a CPU run; the others against the estimate for their GPU node."
                    if on_cpu else ""))


MAX_CURVE_JOBS = 12


def _loss_curve(spool_dir: Path, job_id: int) -> list[tuple[int, float]]:
    """(step, loss_avg) of a job's training lines, from its metrics file in the spool."""
    import json

    path = spool_dir / "jobs" / str(job_id) / "metrics.jsonl"
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
                    if isinstance(loss, int | float):
                        out[r["step"]] = float(loss)  # a resumed run's repeat of a step: the same figure
    except OSError:
        return []
    return sorted(out.items())


def _curves(plt: Any, store: Store, rows: list[dict[str, Any]], spool_dir: Path | None) -> tuple[Any, str]:
    from slurm_dlrm.store.evals import eval_curve

    with store.read():
        evals = {int(r["job_id"]): eval_curve(store, int(r["job_id"])) for r in rows}
    losses = {j: _loss_curve(spool_dir, j) for j in evals} if spool_dir is not None else {}
    jobs = [j for j in sorted(evals) if evals[j] or losses.get(j)][-MAX_CURVE_JOBS:]
    if not jobs:
        return None, "no job in this window has held-out evaluations or training metrics."
    names = {int(r["job_id"]): str(r["name"]) for r in rows}
    fig, (ax_loss, ax_auc) = plt.subplots(1, 2, figsize=(12, 4.8))
    for j in jobs:
        label = f"{j} {names.get(j, '')}"[:40]
        if losses.get(j):
            ax_loss.plot([s for s, _ in losses[j]], [v for _, v in losses[j]], linewidth=1, label=label)
        pts = [(e["step"], e["auc"]) for e in evals[j] if e["auc"] is not None]
        if pts:
            line = ax_auc.plot([s for s, _ in pts], [v for _, v in pts], marker="o", markersize=3, linewidth=1,
                               label=label)
            planted = next((e["planted_auc"] for e in evals[j] if e["planted_auc"] is not None), None)
            if planted is not None:
                ax_auc.axhline(planted, color=line[0].get_color(), linewidth=0.7, linestyle=":")
    for ax, title, ylabel in ((ax_loss, "training loss (window mean)", "BCE loss"),
                              (ax_auc, "held-out AUC (dotted: planted model, the best reachable)", "AUC")):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no data" + (" (loss curves read the spool: not with --db)" if ax is ax_loss
                                            and spool_dir is None else ""),
                    ha="center", va="center", transform=ax.transAxes, fontsize=9)
    return fig, f"{len(jobs)} jobs (the latest {MAX_CURVE_JOBS} at most)."


def _sweep_groups(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Jobs named BASE-<label> (a --set/--array sweep, service/sweep.py) grouped by BASE."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        name = str(r["name"])
        if "-" in name:
            groups[name.rsplit("-", 1)[0]].append(r)
    return {k: v for k, v in groups.items() if len(v) >= 2}


def _sweep_chart(plt: Any, store: Store, rows: list[dict[str, Any]], sweep: str | None) -> tuple[Any, str]:
    from slurm_dlrm.store.sweep_report import sweep_rows

    if sweep is None:
        groups = {k: v for k, v in _sweep_groups(rows).items() if any(r["final_auc"] is not None for r in v)}
        if not groups:
            return None, "no sweep (2 or more jobs named NAME-<variant>) with held-out evaluations in this window."
        sweep = max(groups, key=lambda k: max(float(r["submit_time"]) for r in groups[k]))  # the latest
    from slurm_dlrm.errors import BadInput

    try:
        variants, fields = sweep_rows(store, sweep, "auc")
    except BadInput as exc:
        return None, str(exc)
    variants = [v for v in variants if v["final_auc"] is not None][:30]
    if not variants:
        return None, f"sweep {sweep}: no variant has a held-out evaluation yet."
    labels = [", ".join(f"{k.split('.')[-1]}={v['varied'][k]}" for k in fields) or str(v["name"])
              for v in variants]
    fig, (ax_auc, ax_gpu) = plt.subplots(1, 2, figsize=(12, 0.45 * len(variants) + 2.2))
    ys = list(range(len(variants)))[::-1]
    ax_auc.barh(ys, [v["final_auc"] for v in variants], color="#1565c0", label="final AUC")
    ax_auc.scatter([v["best_auc"] for v in variants], ys, color="black", marker="|", s=120, label="best AUC")
    planted = next((v["planted_auc"] for v in variants if v["planted_auc"] is not None), None)
    if planted is not None:
        ax_auc.axvline(planted, color="#2e7d32", linestyle="--", linewidth=1, label="planted model")
    lo = min(min(v["final_auc"] for v in variants), planted or 1.0)
    ax_auc.set_xlim(max(0.0, lo - 0.05), 1.0 if planted is None else min(1.0, planted + 0.02))
    ax_auc.set_yticks(ys, labels, fontsize=8)
    ax_auc.set_xlabel("held-out AUC")
    ax_auc.set_title(f"sweep {sweep}: best first", fontsize=10)
    ax_auc.legend(fontsize=7)
    ax_auc.grid(alpha=0.3, axis="x")
    ax_gpu.barh(ys, [v["gpu_hours"] or 0.0 for v in variants], color="#9e9e9e")
    ax_gpu.set_yticks(ys, [str(v["job_id"]) for v in variants], fontsize=8)
    ax_gpu.set_xlabel("GPU-hours charged")
    ax_gpu.grid(alpha=0.3, axis="x")
    varied = ", ".join(fields) or "nothing but the name"
    return fig, f"{len(variants)} variants of {sweep}; varied: {varied} (slurm-dlrm acct --sweep {sweep})."


__all__ = ["Written", "write_report"]
