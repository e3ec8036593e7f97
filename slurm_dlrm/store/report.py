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
    AcctFilter,
    acct_rows,
    acct_table_cells,
    parse_format,
)
from slurm_dlrm.store.report_curves import curves_figure, sweep_figure
from slurm_dlrm.store.store import Store

GIB = float(1 << 30)
# The jobs table's columns: acct's default less the ones a page can spare (MaxSM,
# SamplesPerSec), so that it fits a laptop's window; `slurm-dlrm acct` has them all.
REPORT_FORMAT = ("JobID,Name,State,Pack,GPUs,Wait,Elapsed,EstGPUMem,MaxGPUMem,EstHostMem,MaxRSS,"
                 "MeanSM,GPUHours,GPUHoursSaved,AUC")
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
 .wide { max-width: 100%; overflow-x: auto; }
 .wide table { font-size: 0.78em; }
 .wide th, .wide td { padding: 2px 4px; overflow-wrap: anywhere; }
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
{% if p.table_head %}<div class="wide"><table><tr>{% for h in p.table_head %}<th>{{ h }}</th>{% endfor %}</tr>
{% for row in p.table_rows %}<tr>{% for c in row %}<td>{{ c }}</td>{% endfor %}</tr>{% endfor %}
</table></div>{% endif %}
{% else %}<p class="empty">Nothing to plot: {{ p.note }}</p>
{% endif %}{% endfor %}
<h2>Jobs{% if jobs_truncated %} (latest {{ job_rows|length }} of {{ n_jobs }}){% endif %}</h2>
<div class="wide"><table id="jobs"><tr>{% for h in job_header %}<th>{{ h }}</th>{% endfor %}</tr>
{% for row in job_rows %}<tr>{% for c in row %}<td>{{ c }}</td>{% endfor %}</tr>{% endfor %}
</table></div>
<p class="note">Every column of a job: <code>slurm-dlrm acct -j ID --format ...</code> (docs/store.md).</p>
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
    plots: list[dict[str, Any]] = []

    def save(fig: Any, suffix: str, title: str, note: str) -> None:
        if fig is None:  # nothing to draw: say why instead of an empty plot (issue 17)
            plots.append({"title": title, "note": note, "file": "", "b64": "", "table_head": [], "table_rows": []})
            return
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
        plt.close(fig)
        png = html_path.with_name(f"{stem}-{suffix}.png")
        png.write_bytes(buf.getvalue())
        written.pngs.append(png)
        plots.append({"title": title, "note": note, "file": png.name,
                      "b64": base64.b64encode(buf.getvalue()).decode("ascii"), "table_head": [], "table_rows": []})

    fig, note = _gpu_timelines(plt, store, since, until, max_gpus)
    save(fig, "gpu-util", "SM utilisation per GPU", note)
    fig, note = _gantt(plt, store, since, until, max_packs, now)
    save(fig, "gantt", "Packs and their members", note)
    fig, note = _memory(plt, rows)
    save(fig, "memory", "Estimated vs measured peak memory", note)
    fig, note = curves_figure(plt, store, rows, spool_dir, sweep)
    save(fig, "curves", "Training loss and held-out AUC per job", note)
    fig, note, head, table = sweep_figure(plt, store, rows, sweep)
    save(fig, "sweep", "Sweep: the variants compared", note)
    if head:
        plots[-1]["table_head"], plots[-1]["table_rows"] = head, table

    cols = parse_format(REPORT_FORMAT)
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


__all__ = ["Written", "write_report"]
