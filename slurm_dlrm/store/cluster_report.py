"""`slurm-dlrm report --all-users`: one HTML page across every user's store (admins).

Every store under the site's store folder is read read-only (as `acct --all-users`);
the page gives the cluster's totals, the totals per user and per partition (acct's
figures, `acct.acct_totals`), a chart of GPU-hours charged and saved per user, the
stores that could not be read and why, and the jobs table across users. The per-store
plots of `slurm-dlrm report` (timelines, Gantt) stay per user: across hundreds of
users they would not be readable.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2

from slurm_dlrm.site import SiteConfig
from slurm_dlrm.store.acct import (
    DEFAULT_FORMAT,
    TOTAL_COLUMNS,
    AcctFilter,
    Totals,
    acct_all_users,
    acct_table_cells,
    acct_totals,
    parse_format,
)
from slurm_dlrm.store.store import Store


@dataclass
class ClusterWritten:
    html: Path
    pngs: list[Path] = field(default_factory=list)
    stores_read: int = 0
    skipped: list[str] = field(default_factory=list)


_TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>slurm-dlrm cluster report {{ since }} to {{ until }}</title>
<style>
 body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
 table { border-collapse: collapse; font-size: 0.85em; margin-bottom: 1em; }
 th, td { border: 1px solid #ccc; padding: 2px 6px; text-align: right; }
 th { background: #eee; } td.l, th.l { text-align: left; }
 img { max-width: 100%; border: 1px solid #ddd; margin: 0.5em 0; }
 .note { color: #666; font-size: 0.85em; } .warn { color: #b71c1c; }
</style></head><body>
<h1>slurm-dlrm cluster report</h1>
<p>Window: {{ since }} to {{ until }} (local time). Site: <code>{{ site_name }}</code>;
{{ stores_read }} store(s) read under <code>{{ store_dir }}</code>. Generated {{ generated }}.</p>
{% if skipped %}<h2 class="warn">Stores not read ({{ skipped|length }})</h2>
<ul>{% for s in skipped %}<li class="warn">{{ s }}</li>{% endfor %}</ul>
<p class="note">Their jobs are missing from every figure below.</p>{% endif %}
<h2>Cluster</h2>
<table>{% for k, v in summary %}<tr><th class="l">{{ k }}</th><td>{{ v }}</td></tr>{% endfor %}</table>
{% for t in tables %}
<h2>{{ t.title }}</h2>
<table><tr>{% for h in t.header %}<th{% if loop.first %} class="l"{% endif %}>{{ h }}</th>{% endfor %}</tr>
{% for row in t.rows %}<tr>{% for c in row %}<td{% if loop.first %} class="l"{% endif %}>{{ c }}</td>{% endfor %}</tr>{% endfor %}
</table>{% endfor %}
<p class="note">GPU-hours as in <code>slurm-dlrm acct</code> (docs/store.md, "GPU-hours"): charged splits each
shared GPU's allocated hours among its members; "Excl" is the same work at one job per GPU.</p>
{% for p in plots %}
<h2>{{ p.title }}</h2>
<img alt="{{ p.title }}" src="data:image/png;base64,{{ p.b64 }}">
<p class="note">{{ p.note }} (also <a href="{{ p.file }}">{{ p.file }}</a>)</p>
{% endfor %}
<h2>Jobs{% if jobs_truncated %} (latest {{ job_rows|length }} of {{ n_jobs }}){% endif %}</h2>
<table><tr>{% for h in job_header %}<th>{{ h }}</th>{% endfor %}</tr>
{% for row in job_rows %}<tr>{% for c in row %}<td>{{ c }}</td>{% endfor %}</tr>{% endfor %}
</table>
</body></html>
"""


def _fmt_time(t: float) -> str:
    return datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def write_cluster_report(site: SiteConfig, html_path: Path, *, since: float, until: float,
                         max_job_rows: int = 1000, now: float) -> ClusterWritten:
    html_path = html_path.resolve()
    html_path.parent.mkdir(parents=True, exist_ok=True)
    f = AcctFilter(since=since, until=until)
    cols = parse_format("User," + DEFAULT_FORMAT)
    default_partition = site.default_partition.name if site.partitions else ""
    totals = Totals({}, {}, [])
    n_read = 0

    def fetch(st: Store) -> list[Any]:
        nonlocal n_read
        totals.add(acct_totals(st, f, now), default_partition)
        n_read += 1
        return acct_table_cells(st, f, cols, now)

    cells, skipped = acct_all_users(site, fetch)
    totals.skipped.extend(skipped)
    cells.sort(key=lambda r: tuple(r[:3]))
    written = ClusterWritten(html_path, stores_read=n_read, skipped=list(skipped))

    d = totals.as_dict()
    names = [c.name for c in TOTAL_COLUMNS]

    def table(title: str, label: str, items: list[dict[str, Any]]) -> dict[str, Any]:
        rows = [[r[label], *(r[n] if c.kind == "int" else f"{r[n]:.3f}" for n, c in zip(names, TOTAL_COLUMNS,
                                                                                        strict=True))]
                for r in items]
        return {"title": title, "header": [label, *names], "rows": rows}

    all_jobs = {n: sum(r[n] for r in d["users"]) for n in names}
    excl, charged = all_jobs["ExclGPUHours"], all_jobs["GPUHours"]
    summary = [
        ("Users", str(len(d["users"]))),
        ("Jobs", f"{int(all_jobs['Jobs'])} (pending {int(all_jobs['Pending'])}, running {int(all_jobs['Running'])}, "
                 f"completed {int(all_jobs['Completed'])}, failed {int(all_jobs['Failed'])}, "
                 f"OOM {int(all_jobs['OOM'])}, cancelled {int(all_jobs['Cancelled'])})"),
        ("GPU-hours charged", f"{charged:.3f}"),
        ("GPU-hours at one job per GPU", f"{excl:.3f}"),
        ("GPU-hours saved", f"{excl - charged:.3f}" + (f" ({(excl - charged) / excl:.1%})" if excl > 0 else "")),
    ]
    plots = []
    if d["users"]:
        plots.append(_per_user_chart(d["users"], html_path, written))
    shown = [list(r[3:]) for r in cells[-max_job_rows:]]
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    html = env.from_string(_TEMPLATE).render(
        since=_fmt_time(since), until=_fmt_time(until), generated=_fmt_time(now), site_name=site.name,
        store_dir=site.store_dir, stores_read=n_read, skipped=skipped, summary=summary,
        tables=[table("Per user", "User", d["users"]), table("Per partition", "Partition", d["partitions"])],
        plots=plots, job_header=[c.name for c, _ in cols], job_rows=shown,
        jobs_truncated=len(cells) > len(shown), n_jobs=len(cells),
    )
    html_path.write_text(html, encoding="utf-8")
    return written


def _per_user_chart(users: list[dict[str, Any]], html_path: Path, written: ClusterWritten) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    top = sorted(users, key=lambda r: -r["GPUHours"])[:30]
    fig, ax = plt.subplots(figsize=(11, 0.35 * len(top) + 1.5))
    ys = list(range(len(top)))
    ax.barh([y - 0.2 for y in ys], [r["GPUHours"] for r in top], height=0.4, color="#1565c0", label="charged")
    ax.barh([y + 0.2 for y in ys], [r["GPUHoursSaved"] for r in top], height=0.4, color="#2e7d32", label="saved")
    ax.set_yticks(ys)
    ax.set_yticklabels([str(r["User"]) for r in top], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("GPU-hours")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    png = html_path.with_name(f"{html_path.stem}-users.png")
    png.write_bytes(buf.getvalue())
    written.pngs.append(png)
    return {"title": "GPU-hours charged and saved per user", "file": png.name,
            "note": f"{len(top)} of {len(users)} users, by GPU-hours charged.",
            "b64": base64.b64encode(buf.getvalue()).decode("ascii")}
