"""Following jobs until they end: a rich live table on a terminal, plain lines otherwise.

Diagnostics go to stderr, so `submit --parsable --wait` keeps stdout to the ids.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

from slurm_dlrm.service.submit import job_progress, wait_for_jobs
from slurm_dlrm.site import SiteConfig

STATE_STYLE = {"PENDING": "yellow", "PLANNED": "cyan", "RUNNING": "green", "COMPLETED": "bold green",
               "FAILED": "bold red", "OOM": "bold red", "CANCELLED": "magenta", "TIMEOUT": "yellow"}


def _steps(job: Any) -> int | None:
    try:
        steps = job.spec.get("steps")
    except (ValueError, AttributeError):
        return None
    return steps if isinstance(steps, int) and steps > 0 else None


def progress_rows(site: SiteConfig, user: str, jobs: Sequence[Any]) -> list[dict[str, Any]]:
    rows = []
    for j in jobs:
        total = _steps(j)
        done = job_progress(site, user, j.id) if j.state in ("RUNNING", "COMPLETED") else None
        if j.state == "COMPLETED" and total:
            done = total
        rows.append({"id": j.id, "name": j.name, "state": str(j.state), "done": done, "total": total,
                     "attempt": j.attempt, "reason": j.exit_reason or ""})
    return rows


def render_table(rows: list[dict[str, Any]], elapsed_s: float) -> Any:
    from rich.progress_bar import ProgressBar
    from rich.table import Table

    counts: dict[str, int] = {}
    for r in rows:
        counts[r["state"]] = counts.get(r["state"], 0) + 1
    summary = ", ".join(f"{n} {s.lower()}" for s, n in sorted(counts.items()))
    table = Table(title=f"{len(rows)} jobs: {summary}  ({elapsed_s:.0f} s)", title_justify="left")
    for col in ("JOBID", "NAME", "STATE", "PROGRESS", "STEP", "REASON"):
        table.add_column(col, no_wrap=col != "REASON")
    for r in rows:
        total, done = r["total"], r["done"]
        bar = ProgressBar(total=float(total or 1), completed=float(done or 0), width=20)
        step = f"{done}/{total}" if done is not None and total else ("-" if total is None else f"0/{total}")
        table.add_row(str(r["id"]), r["name"], f"[{STATE_STYLE.get(r['state'], '')}]{r['state']}", bar, step,
                      r["reason"][:60])
    return table


def follow_jobs(site: SiteConfig, user: str, ids: Sequence[int], *, poll_s: float = 1.0,
                live: bool | None = None, timeout_s: float | None = None) -> list[Any]:
    """Block until all jobs end; returns the final job rows."""
    start = time.monotonic()
    live = sys.stderr.isatty() if live is None else live
    if live:
        from rich.console import Console
        from rich.live import Live

        console = Console(stderr=True)
        with Live(console=console, refresh_per_second=2, transient=False) as view:
            def update(jobs: list[Any]) -> None:
                view.update(render_table(progress_rows(site, user, jobs), time.monotonic() - start))

            return wait_for_jobs(site, user, ids, poll_s=poll_s, on_update=update, timeout_s=timeout_s)
    last: dict[int, str] = {}

    def lines(jobs: list[Any]) -> None:
        for j in jobs:
            if last.get(j.id) != j.state:
                last[j.id] = str(j.state)
                why = f": {j.exit_reason}" if j.exit_reason and j.state != "COMPLETED" else ""
                print(f"[{time.monotonic() - start:6.1f} s] job {j.id} ({j.name}) {j.state}{why}",
                      file=sys.stderr, flush=True)

    return wait_for_jobs(site, user, ids, poll_s=poll_s, on_update=lines, timeout_s=timeout_s)
