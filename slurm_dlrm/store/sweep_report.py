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
    add_rungs(store, rows, specs)
    return rows, fields


def add_rungs(store: Store, rows: list[dict[str, Any]], specs: dict[int, dict[str, Any]]) -> None:
    """Variants of a sweep with a stopping rule (issue 47): each row's last rung decision
    (`rung`: "1 on", "0 paused", ...), its metric at each rung (`at_rungs`), and the
    GPU-hours it would have used trained to its end (`gpu_hours_full`: its own if it got
    there, else the mean of those that did, else its GPU-hours x steps / steps evaluated)."""
    from slurm_dlrm.adapt.asha import StopRule, rung_steps

    ruled = {j: s["sweep"] for j, s in specs.items() if isinstance(s.get("sweep"), dict)}
    if not ruled:
        return
    ids = sorted(ruled)
    marks = ",".join("?" * len(ids))
    words = {"sweep_go_on": "on", "sweep_pause": "paused", "sweep_promote": "promoted"}
    last: dict[int, str] = {}
    with store.read():
        for job_id, kind, data_json in store.conn.execute(
                f"SELECT job_id, kind, data_json FROM events WHERE job_id IN ({marks}) AND kind IN "
                "('sweep_go_on', 'sweep_pause', 'sweep_promote') ORDER BY id", ids):
            last[int(job_id)] = f"{(json.loads(data_json) if data_json else {}).get('rung', 0)} {words[kind]}"
        evals: dict[int, dict[int, dict[str, Any]]] = {}
        for job_id, step, auc, ne, log_loss in store.conn.execute(
                f"SELECT job_id, step, auc, ne, log_loss FROM evals WHERE job_id IN ({marks})", ids):
            evals.setdefault(int(job_id), {})[int(step)] = {"auc": auc, "ne": ne, "loss": log_loss}
    for r in rows:
        job_id = int(r["job_id"])
        sw = ruled.get(job_id)
        if sw is None:
            continue
        steps = int(specs[job_id].get("steps") or 0)
        rule = StopRule(str(sw.get("metric") or "auc"), int(sw.get("min_steps") or 0),
                        int(sw.get("reduction") or 3), steps)
        mine = evals.get(job_id, {})
        r["rung"] = last.get(job_id)
        r["at_rungs"] = [mine.get(step, {}).get(rule.metric) for step in rung_steps(rule)]
        r["steps_evaluated"] = max(mine, default=0)
        r["steps"] = steps
    # A variant's start-up and its stop cost the same whether it trains 40 steps or 4,000,
    # so a stopped one trained to its end would cost what the sweep's finished ones cost
    # (their mean); with none finished, its GPU-hours scaled by steps (an overstatement).
    finished = [float(r["gpu_hours"]) for r in rows if "steps" in r and r.get("gpu_hours") is not None
                and r["steps"] and r["steps_evaluated"] >= r["steps"]]
    mean = sum(finished) / len(finished) if finished else None
    for r in rows:
        if "steps" not in r:
            continue
        used, done, steps = r.get("gpu_hours"), r.pop("steps_evaluated"), r.pop("steps")
        if used is None or not steps:
            r["gpu_hours_full"] = None
        elif done >= steps:
            r["gpu_hours_full"] = float(used)
        elif mean is not None:
            r["gpu_hours_full"] = max(float(used), mean)
        else:
            r["gpu_hours_full"] = float(used) * steps / max(1, done)


def sweep_saving(rows: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The sweep's GPU-hours against training every variant to its end (None: no rule)."""
    ruled = [r for r in rows if "gpu_hours_full" in r]
    if not ruled:
        return None
    used = sum(float(r.get("gpu_hours") or 0.0) for r in ruled)
    full = sum(float(r.get("gpu_hours_full") or r.get("gpu_hours") or 0.0) for r in ruled)
    return {"variants": len(ruled), "gpu_hours": used, "gpu_hours_full": full, "gpu_hours_saved": full - used,
            "saved_x": full / used if used > 0 else None}


def saving_line(saving: dict[str, Any]) -> str:
    x = saving["saved_x"]
    return (f"sweep: {saving['variants']} variants used {saving['gpu_hours']:.3f} GPU-hours; every variant to "
            f"its end: ~{saving['gpu_hours_full']:.3f}; saved ~{saving['gpu_hours_saved']:.3f}"
            + (f" ({x:.1f}x)" if x is not None else ""))


def _cell(fmt: str, v: Any) -> str:
    if v is None:
        return "-"
    return fmt.format(v) if isinstance(v, int | float) and not isinstance(v, bool) else str(v)


def render_sweep(rows: Sequence[dict[str, Any]], fields: Sequence[str], fmt: str = "table",
                 header: bool = True) -> str:
    """The sweep table: JobID, Name, State, the varied fields, the metrics, GPU-hours
    (and Trial, the draw's number, after State when `--trials` drew the variants); with a
    stopping rule, each variant's last rung and its metric at every rung, and (table) a
    last line with the GPU-hours saved against training every variant to its end."""
    drawn = any(r.get("trial") is not None for r in rows)
    trial_head = ["Trial"] if drawn else []
    ruled = any("gpu_hours_full" in r for r in rows)
    rung_heads = ["Rung", "AtRungs"] if ruled else []
    heads = ["JobID", "Name", "State", *trial_head, *rung_heads, *fields, *(h for h, _, _ in METRIC_COLUMNS)]
    if fmt == "json":
        return json.dumps([{"JobID": r["job_id"], "Name": r["name"], "State": r["state"],
                            **({"Trial": r.get("trial")} if drawn else {}), "varied": r["varied"],
                            **({"Rung": r.get("rung"), "AtRungs": r.get("at_rungs"),
                                "GPUHoursFull": r.get("gpu_hours_full")} if ruled else {}),
                            **{h: r.get(k) for h, k, _ in METRIC_COLUMNS}} for r in rows], indent=1)

    def at_rungs(r: dict[str, Any]) -> str:
        return "/".join("-" if v is None else f"{v:.4f}" for v in r.get("at_rungs") or []) or "-"

    raw = [[r["job_id"], r["name"], r["state"], *([r.get("trial")] if drawn else []),
            *([r.get("rung"), at_rungs(r)] if ruled else []),
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
    fmts = ["{}", "{}", "{}", *("{}" for _ in trial_head), *("{}" for _ in rung_heads), *("{}" for _ in fields),
            *(f for _, _, f in METRIC_COLUMNS)]
    cells = [[_cell(f, v) for f, v in zip(fmts, row, strict=True)] for row in raw]
    table = ([heads] if header else []) + cells
    widths = [max(len(r[i]) for r in table) for i in range(len(heads))]
    # Name, State and Rung read left to right
    left = (1, 2, 3 + len(trial_head)) if ruled else (1, 2)
    out = "".join("  ".join(c.rjust(w) if i not in left else c.ljust(w)
                            for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip() + "\n"
                  for r in table)
    saving = sweep_saving(rows)
    return out + (saving_line(saving) + "\n" if saving is not None and header else "")
