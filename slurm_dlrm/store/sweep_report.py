"""`slurm-dlrm acct --sweep NAME`: the variants of one sweep side by side (issue 39).

A sweep is what one `submit --set KEY=V1,V2 ...` or `--array` made: jobs named
`NAME-<label>` (service/sweep.py `expand`), or NAME itself. The table shows what varied
between them (every spec field whose value differs, found by comparing their specs),
their held-out metrics and GPU-hours, sorted by the metric asked for.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Sequence
from typing import Any

from slurm_dlrm.errors import BadInput
from slurm_dlrm.store.acct import AcctFilter, acct_rows
from slurm_dlrm.store.store import Store

# --sort name -> (acct row key, higher is better); calibration: closest to 1 is best.
SORT_KEYS: dict[str, tuple[str, bool]] = {
    "auc": ("final_auc", True),
    "best_auc": ("best_auc", True),
    "ne": ("final_ne", False),
    "best_ne": ("best_ne", False),
    "log_loss": ("final_log_loss", False),
    "accuracy": ("final_accuracy", True),
    "calibration": ("final_calibration", False),
    "gpu_hours": ("gpu_hours", False),
    "job_id": ("job_id", False),
}
# (header, acct row key, format) after the varied fields
METRIC_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("AUC", "final_auc", "{:.4f}"), ("BestAUC", "best_auc", "{:.4f}"), ("BestAUCStep", "best_auc_step", "{}"),
    ("NE", "final_ne", "{:.4f}"), ("LogLoss", "final_log_loss", "{:.4f}"),
    ("Calibration", "final_calibration", "{:.3f}"), ("Accuracy", "final_accuracy", "{:.4f}"),
    ("EvalStep", "final_eval_step", "{}"), ("PlantedAUC", "planted_auc", "{:.4f}"),
    ("GPUHours", "gpu_hours", "{:.3f}"),
)


def parse_sort(text: str) -> str:
    key = text.strip().lower().replace("-", "_")
    if key not in SORT_KEYS:
        raise BadInput(f"--sort {text!r}: unknown metric (one of {', '.join(SORT_KEYS)})")
    return key


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """A spec dict as dotted keys (`optimizer.lr`, `tables.0.rows`) -> scalar values."""
    out: dict[str, Any] = {}
    if isinstance(data, dict):
        for k, v in data.items():
            out.update(flatten(v, f"{prefix}{k}."))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            out.update(flatten(v, f"{prefix}{i}."))
    else:
        out[prefix[:-1]] = data
    return out


def varied_fields(specs: Sequence[dict[str, Any]]) -> list[str]:
    """Dotted spec fields whose values are not the same in every spec (name aside)."""
    flat = [flatten({k: v for k, v in s.items() if k != "name"}) for s in specs]
    keys = sorted(set().union(*flat)) if flat else []
    return [k for k in keys if len({json.dumps(f.get(k), sort_keys=True) for f in flat}) > 1]


def sweep_rows(store: Store, name: str, sort: str = "auc", now: float | None = None,
               user: str | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """The sweep's jobs (acct rows plus a `varied` dict) sorted by `sort`, and the varied fields."""
    with store.read():
        jobs = [j for j in store.jobs(user=user) if j.name == name or j.name.startswith(name + "-")]
    if not jobs:
        raise BadInput(f"--sweep {name!r}: no job is named {name} or {name}-<variant>")
    specs = {j.id: dict(j.spec or {}) for j in jobs}
    fields = varied_fields(list(specs.values()))
    rows = acct_rows(store, AcctFilter(job_ids=tuple(specs)), now)
    with store.read():  # a `--trials` variant's draw (service/trials.py): which trial it is
        trials = {int(e["job_id"]): (e["data"] or {}).get("trial") for e in store.events(kind="sweep_draw")
                  if e["job_id"] in specs}
    for r in rows:
        flat = flatten(specs[int(r["job_id"])])
        r["varied"] = {k: flat.get(k) for k in fields}
        r["trial"] = trials.get(int(r["job_id"]))
    key, higher = SORT_KEYS[sort]

    def order(r: dict[str, Any]) -> tuple[int, float, int]:
        v = r.get(key)
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return (1, 0.0, int(r["job_id"]))  # not evaluated yet: last
        x = abs(float(v) - 1.0) if sort == "calibration" else float(v)
        return (0, -x if higher else x, int(r["job_id"]))

    rows.sort(key=order)
    return rows, fields


def _cell(fmt: str, v: Any) -> str:
    if v is None:
        return "-"
    return fmt.format(v) if isinstance(v, int | float) and not isinstance(v, bool) else str(v)


def render_sweep(rows: Sequence[dict[str, Any]], fields: Sequence[str], fmt: str = "table",
                 header: bool = True) -> str:
    """The sweep table: JobID, Name, State, the varied fields, the metrics, GPU-hours
    (and Trial, the draw's number, after State when `--trials` drew the variants)."""
    drawn = any(r.get("trial") is not None for r in rows)
    trial_head = ["Trial"] if drawn else []
    heads = ["JobID", "Name", "State", *trial_head, *fields, *(h for h, _, _ in METRIC_COLUMNS)]
    if fmt == "json":
        return json.dumps([{"JobID": r["job_id"], "Name": r["name"], "State": r["state"],
                            **({"Trial": r.get("trial")} if drawn else {}), "varied": r["varied"],
                            **{h: r.get(k) for h, k, _ in METRIC_COLUMNS}} for r in rows], indent=1)
    raw = [[r["job_id"], r["name"], r["state"], *([r.get("trial")] if drawn else []),
            *(r["varied"].get(f) for f in fields), *(r.get(k) for _, k, _ in METRIC_COLUMNS)] for r in rows]
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        if header:
            w.writerow(heads)
        w.writerows([["" if v is None else v for v in row] for row in raw])
        return buf.getvalue()
    if fmt != "table":
        raise ValueError(f"unknown format {fmt!r}")
    fmts = ["{}", "{}", "{}", *("{}" for _ in trial_head), *("{}" for _ in fields), *(f for _, _, f in METRIC_COLUMNS)]
    cells = [[_cell(f, v) for f, v in zip(fmts, row, strict=True)] for row in raw]
    table = ([heads] if header else []) + cells
    widths = [max(len(r[i]) for r in table) for i in range(len(heads))]
    return "".join("  ".join(c.rjust(w) if i not in (1, 2) else c.ljust(w)
                             for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip() + "\n"
                   for r in table)
