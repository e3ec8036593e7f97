"""`slurm-dlrm acct`: per-job accounting rows, columns and output formats (sacct-like).

Library side only; the click glue is in `slurm_dlrm/commands/store.py`. GPU-hours are
defined in docs/store.md ("GPU-hours"); the SQL is `queries.ACCT`.
"""

from __future__ import annotations

import csv
import glob
import io
import json
import logging
import os
import pwd
import re
import sqlite3
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from slurm_dlrm.errors import BadInput
from slurm_dlrm.site import SiteConfig
from slurm_dlrm.store import queries
from slurm_dlrm.store.db import DB_FILENAME
from slurm_dlrm.store.errors import StoreError
from slurm_dlrm.store.jobids import JobRef, parse_job_refs, resolve_job_refs
from slurm_dlrm.store.states import JobState, parse_job_state
from slurm_dlrm.store.store import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AcctFilter:
    job_ids: tuple[int, ...] | None = None
    # -j as typed (`12`, `12_3`, `12_[0-2]`): resolved in each store (issue 42)
    job_refs: tuple[JobRef, ...] | None = None
    users: tuple[str, ...] | None = None
    states: tuple[JobState, ...] | None = None
    pack: str | None = None  # pack id or name
    since: float | None = None  # jobs not finished before this (epoch s)
    until: float | None = None  # jobs submitted up to this
    names: tuple[str, ...] | None = None  # sacct --name
    default_partition: str | None = None  # the Partition of a job given no -p that never ran


@dataclass(frozen=True)
class Column:
    name: str
    key: str
    kind: str  # str | int | bytes | bytes_list | pct | dur | time | hours | rate | metric
    help: str


COLUMNS: tuple[Column, ...] = (
    Column("JobID", "job_id", "int", "job id in the store"),
    Column("Name", "name", "str", "job name from the spec"),
    Column("JobName", "name", "str", "the same as Name (sacct's name for it)"),
    Column("JobIDRaw", "job_id", "int", "the same as JobID"),
    Column("ArrayJobID", "array_id", "str", "the id as Slurm prints an array task (12_3), else the job id"),
    Column("Partition", "partition_or_default", "str", "partition (-p, else its pack's, else the site's default)"),
    Column("Account", "account", "str", "account (-A), empty if none was given"),
    Column("User", "user", "str", "owner"),
    Column("State", "state", "str", "PENDING PLANNED RUNNING COMPLETED FAILED OOM CANCELLED TIMEOUT"),
    Column("Attempt", "attempt", "int", "times requeued after running"),
    # one pack label everywhere: the name queue, show and cancel --pack use (its Slurm job name)
    Column("Pack", "pack_name", "str", "current or last pack, by the name queue and show print"),
    Column("PackID", "pack_id", "int", "that pack's number in the store"),
    Column("PackName", "pack_name", "str", "the same as Pack (kept for old -o lists)"),
    Column("SlurmJobID", "slurm_job_id", "str", "Slurm job id (and step) of the member"),
    Column("NodeList", "nodes", "str", "nodes of the last attempt"),
    Column("GPUs", "n_gpus", "int", "GPUs of the last attempt (shared or not)"),
    Column("GPUModel", "gpu_model", "str", "GPU model estimated for"),
    Column("Submit", "submit_time", "time", "submit time"),
    Column("Start", "start_time", "time", "first start"),
    Column("End", "end_time", "time", "end (terminal state)"),
    Column("Wait", "wait_s", "dur", "submit to first start (to now if not started)"),
    Column("Elapsed", "run_s", "dur", "time running, summed over attempts"),
    Column("EstGPUMem", "est_gpu_peak_bytes", "bytes", "estimated peak GPU memory"),
    Column("MaxGPUMem", "gpu_mem_peak_bytes", "bytes", "measured peak GPU memory"),
    Column("EstHostMem", "est_host_peak_bytes", "bytes", "estimated peak host memory"),
    Column("MaxRSS", "rss_peak_bytes", "bytes", "measured peak host RSS"),
    # a multi-rank run's ranks (issue 48): the runner gathers them at every metrics line
    Column("RankMaxGPUMem", "rank_gpu_mem_peaks", "bytes_list", "measured peak GPU memory of every rank, in rank order"),
    Column("RankMaxRSS", "rank_rss_peaks", "bytes_list", "measured peak host RSS of every rank, in rank order"),
    Column("RankMaxTensor", "rank_tensor_peaks", "bytes_list",
           "measured peak of live tensor bytes of every rank (what `estimate` predicts per rank)"),
    Column("MeanSM", "sm_util_mean", "pct", "mean SM utilisation, %"),
    Column("MaxSM", "sm_util_max", "pct", "max SM utilisation, %"),
    Column("MeanCPU", "host_cpu_mean", "pct", "mean host CPU, % of one core"),
    Column("SamplesPerSec", "samples_per_s_mean", "rate", "mean training throughput, samples/s"),
    Column("NSamples", "n_samples", "int", "monitoring samples recorded (pruned ones included)"),
    Column("GPUHours", "gpu_hours", "hours", "GPU-hours charged (shared GPUs split)"),
    Column("ExclGPUHours", "excl_gpu_hours", "hours", "GPU-hours it would take on its own GPUs"),
    Column("GPUHoursSaved", "gpu_hours_saved", "hours", "ExclGPUHours - GPUHours"),
    Column("SpeedBasis", "speed_basis", "str",
           "ExclGPUHours' slowdown: solo | measured (vs solo runs) | predicted (plan) | none"),
    Column("ExitCode", "exit_code", "exit", "member exit code as code:signal, like sacct (143 is 0:15)"),
    Column("Reason", "exit_reason", "str", "reason of the terminal state"),
    Column("Fingerprint", "spec_fingerprint", "str", "spec fingerprint"),
    # held-out evaluation (issue 39; docs/runner.md "Evaluation")
    Column("AUC", "final_auc", "metric", "held-out AUC at the last evaluation"),
    Column("NE", "final_ne", "metric", "normalized entropy at the last evaluation (< 1 beats the base rate)"),
    Column("LogLoss", "final_log_loss", "metric", "held-out log-loss (nats) at the last evaluation"),
    Column("Calibration", "final_calibration", "metric", "sum of predictions / sum of labels, last evaluation"),
    Column("Accuracy", "final_accuracy", "metric", "held-out accuracy at the last evaluation"),
    Column("EvalStep", "final_eval_step", "int", "step of the last evaluation"),
    Column("BestAUC", "best_auc", "metric", "highest held-out AUC of any evaluation"),
    Column("BestAUCStep", "best_auc_step", "int", "step it came at"),
    Column("BestNE", "best_ne", "metric", "lowest NE of any evaluation"),
    Column("BestNEStep", "best_ne_step", "int", "step it came at"),
    Column("PlantedAUC", "planted_auc", "metric", "synthetic data: the planted model's AUC (the best reachable)"),
    Column("Profile", "est_profile_label", "str", "compute-bound | memory-bound | host-bound"),
)
COLUMNS_BY_NAME = {c.name.lower(): c for c in COLUMNS}
DEFAULT_FORMAT = (
    "JobID,Name,State,Pack,GPUs,Wait,Elapsed,EstGPUMem,MaxGPUMem,EstHostMem,MaxRSS,"
    "MeanSM,MaxSM,SamplesPerSec,GPUHours,GPUHoursSaved,AUC"
)


# ---------------------------------------------------------------- parsing options

_REL = re.compile(r"^(?:now)?-?(\d+(?:\.\d+)?)([smhdw])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
# Slurm's own relative form (sacct -S now-1hours): now[+-]COUNT[seconds|minutes|hours|days|weeks]
_SLURM_REL = re.compile(r"^now([+-])(\d+)(seconds|minutes|hours|days|weeks)?$")
_SLURM_UNIT_S = {"seconds": 1, "minutes": 60, "hours": 3600, "days": 86400, "weeks": 604800}
_CLOCK = re.compile(r"^(\d{1,2}):(\d{2})(?::(\d{2}))?$")
_MMDDYY = re.compile(r"^(\d{2})/?(\d{2})(?:/?(\d{2}))?$")


def parse_time(text: str, option: str, now: float | None = None) -> float:
    """Epoch seconds from ``now``, ``2h``/``now-2h`` (ago), ISO date/time, or ``@<epoch>``."""
    now = time.time() if now is None else now
    s = text.strip().lower()
    if s == "now":
        return now
    m = _REL.match(s)
    if m:
        return now - float(m.group(1)) * _UNIT_S[m.group(2)]
    slurm_time = _slurm_time(s, now)
    if slurm_time is not None:
        return slurm_time
    if s.startswith("@"):
        try:
            return float(s[1:])
        except ValueError:
            pass
    try:
        return datetime.fromisoformat(text.strip()).timestamp()
    except ValueError:
        raise BadInput(
            f"{option}: cannot read {text!r} as a time (use 2026-11-21, 2026-11-21T14:00, 14:00, 3h, now-1hours, "
            f"today, midnight or @EPOCH)"
        ) from None


def _slurm_time(s: str, now: float) -> float | None:
    """sacct's other time forms: now-1hours, today/midnight/noon, HH:MM[:SS] (today),
    MMDD[YY] and MM/DD[/YY] (local midnight)."""
    m = _SLURM_REL.match(s)
    if m:
        delta = int(m.group(2)) * _SLURM_UNIT_S[m.group(3) or "seconds"]
        return now - delta if m.group(1) == "-" else now + delta
    day = datetime.fromtimestamp(now).replace(hour=0, minute=0, second=0, microsecond=0)
    if s in ("today", "midnight"):
        return day.timestamp()
    if s == "noon":
        return day.replace(hour=12).timestamp()
    m = _CLOCK.match(s)
    if m and int(m.group(1)) < 24 and int(m.group(2)) < 60:
        return day.replace(hour=int(m.group(1)), minute=int(m.group(2)), second=int(m.group(3) or 0)).timestamp()
    m = _MMDDYY.match(s)
    if m:
        try:
            year = 2000 + int(m.group(3)) if m.group(3) else day.year
            return day.replace(year=year, month=int(m.group(1)), day=int(m.group(2))).timestamp()
        except ValueError:
            return None
    return None


def parse_format(text: str) -> list[tuple[Column, int | None]]:
    """``JobID,State,MaxGPUMem%12`` -> columns with optional widths."""
    out: list[tuple[Column, int | None]] = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        name, _, width = item.partition("%")
        col = COLUMNS_BY_NAME.get(name.lower())
        if col is None:
            raise BadInput(f"--format: unknown column {name!r} (see --helpformat)")
        if width and not width.isdigit():
            raise BadInput(f"--format: bad width in {item!r}")
        out.append((col, int(width) if width else None))
    if not out:
        raise BadInput("--format: no columns given")
    return out


# sacct's state abbreviations (sacct -s CD,F); PL is ours (PLANNED, no Slurm twin).
STATE_ABBREVIATIONS = {"PD": "PENDING", "PL": "PLANNED", "R": "RUNNING", "CD": "COMPLETED", "F": "FAILED",
                       "OOM": "OOM", "CA": "CANCELLED", "TO": "TIMEOUT"}


def parse_states(text: str) -> tuple[JobState, ...]:
    try:
        return tuple(parse_job_state(STATE_ABBREVIATIONS.get(s.strip().upper(), s)) for s in text.split(",")
                     if s.strip())
    except ValueError as exc:
        raise BadInput(f"--state: {exc}") from None


def parse_job_ids(text: str) -> tuple[JobRef, ...]:
    """-j/--jobs: Slurm's job id forms (store/jobids.py), never int(): `2_0` is task 0
    of array 2, not job 20."""
    return parse_job_refs([text], "-j/--jobs: job id")


# ---------------------------------------------------------------- rows

def _params(store: Store, f: AcctFilter, now: float) -> dict[str, Any] | None:
    """Named-query parameters for `f`; None if nothing can match (unknown pack name)."""
    pack_id: int | None = None
    if f.pack is not None:
        if f.pack.isdigit():
            pack_id = int(f.pack)
        else:
            p = store.find_pack_by_name(f.pack)
            if p is None:
                return None
            pack_id = p.id
    users = f.users
    if store.owner_user is not None and users is not None:
        # the rows' own user column is not trusted: the store's owner is who they are
        if store.owner_user not in users:
            return None
        users = None
    job_ids = f.job_ids
    if f.job_refs is not None:
        job_ids = (*(job_ids or ()), *resolve_job_refs(store, f.job_refs, missing_ok=True))
    return {
        "now": now,
        "job_ids": None if job_ids is None else json.dumps(list(job_ids)),
        "states": None if f.states is None else json.dumps([s.value for s in f.states]),
        "users": None if users is None else json.dumps(list(users)),
        "names": None if f.names is None else json.dumps(list(f.names)),
        "default_partition": f.default_partition,
        "pack_id": pack_id, "since": f.since, "until": f.until,
    }


def acct_rows(store: Store, f: AcctFilter, now: float | None = None) -> list[dict[str, Any]]:
    """One dict per job (keys: `Column.key`); the derived columns come from the SQL."""
    now = store.clock() if now is None else now
    with store.read():
        params = _params(store, f, now)
        rows = [] if params is None else store.query("acct_filtered", params)
    if store.owner_user is not None:
        for r in rows:
            r["user"] = store.owner_user
    return rows


def _sql_dur(s: str) -> str:
    # the whole-second expression is repeated rather than put in a subquery: a scalar
    # subquery per cell costs more than the arithmetic
    return (f"CASE WHEN {s} < 86400 THEN printf('%02d:%02d:%02d', {s} / 3600, {s} % 3600 / 60, {s} % 60) "
            f"ELSE printf('%d-%02d:%02d:%02d', {s} / 86400, {s} % 86400 / 3600, {s} % 3600 / 60, {s} % 60) END")


# Table cells are formatted by SQLite (printf/strftime in C): for 10,000 jobs this
# halves the CPU time of `acct` compared with formatting 160,000 cells in Python.
_SQL_HUMAN: dict[str, Callable[[str], str]] = {
    "str": lambda x: f"CAST({x} AS TEXT)",
    "int": lambda x: f"CAST({x} AS TEXT)",
    # code:signal like sacct; the agent records a death by signal N as 128+N; none yet: 0:0, as sacct
    "exit": lambda x: f"CASE WHEN {x} IS NULL THEN '0:0' WHEN {x} > 128 THEN '0:' || ({x} - 128) ELSE {x} || ':0' END",
    "bytes": lambda x: (
        f"CASE WHEN abs({x}) >= 1099511627776 THEN printf('%.1fT', {x} / 1099511627776.0) "
        f"WHEN abs({x}) >= 1073741824 THEN printf('%.1fG', {x} / 1073741824.0) "
        f"WHEN abs({x}) >= 1048576 THEN printf('%.1fM', {x} / 1048576.0) "
        f"WHEN abs({x}) >= 1024 THEN printf('%.1fK', {x} / 1024.0) ELSE CAST(CAST({x} AS INTEGER) AS TEXT) END"
    ),
    # a JSON array of byte counts (one per rank): each as "bytes", '-' where not measured
    "bytes_list": lambda x: (f"(SELECT group_concat(CASE WHEN value IS NULL THEN '-' ELSE "
                             f"{_SQL_HUMAN['bytes']('value')} END, ',') FROM json_each({x}))"),
    "pct": lambda x: f"printf('%.1f', {x})",
    "rate": lambda x: f"printf('%.0f', {x})",
    "hours": lambda x: f"printf('%.3f', {x})",
    "metric": lambda x: f"printf('%.4f', {x})",
    # [D-]HH:MM:SS like sacct; never negative (clock skew between hosts)
    "dur": lambda x: _sql_dur(f"max(0, CAST({x} + 0.5 AS INTEGER))"),
    "time": lambda x: f"strftime('%Y-%m-%dT%H:%M:%S', {x}, 'unixepoch', 'localtime')",
}


def acct_table_cells(store: Store, f: AcctFilter, cols: Sequence[tuple[Column, int | None]],
                     now: float | None = None) -> list[tuple[Any, ...]]:
    """Rows of formatted cells (strings), each prefixed with (submit_time, user, job_id)."""
    now = store.clock() if now is None else now
    # Column keys and kinds come from COLUMNS, never from the user: safe to splice.
    cells = ", ".join(f"coalesce({_SQL_HUMAN[c.kind](c.key)}, '')" for c, _ in cols)
    sql = f"SELECT submit_time, user, job_id, {cells} FROM ({queries.ACCT_FILTERED})"
    with store.read():
        params = _params(store, f, now)
        if params is None:
            return []
        rows: list[tuple[Any, ...]] = store.conn.execute(sql, params).fetchall()
    owner = store.owner_user
    if owner is None:
        return rows
    at = [3 + i for i, (c, _) in enumerate(cols) if c.key == "user"]
    return [tuple(owner if i == 1 or i in at else v for i, v in enumerate(r)) for r in rows]


def acct_table(store: Store, f: AcctFilter, cols: Sequence[tuple[Column, int | None]],
               now: float | None = None, header: bool = True) -> str:
    """`slurm-dlrm acct` as a table, for one store."""
    return render_table([r[3:] for r in acct_table_cells(store, f, cols, now)], cols, header)


def render_table(cell_rows: Sequence[Sequence[str]], cols: Sequence[tuple[Column, int | None]],
                 header: bool = True) -> str:
    """Right-aligned columns (sacct style); a given width truncates with '+'."""
    padded: list[list[str]] = []
    heads: list[str] = []
    for i, (c, width) in enumerate(cols):
        cells = [r[i] for r in cell_rows]
        w = width if width is not None else max([len(c.name), *map(len, cells)])
        if width is not None:
            cells = [s if len(s) <= w else s[: w - 1] + "+" for s in cells]
        padded.append([s.rjust(w) for s in cells])
        heads.append(c.name[:w].rjust(w))
    lines = [" ".join(heads), " ".join("-" * len(h) for h in heads)] if header else []
    lines += map(" ".join, zip(*padded, strict=True))
    return "\n".join(lines) + ("\n" if lines else "")


# ---------------------------------------------------------------- all users

def discover_user_stores(site: SiteConfig) -> list[tuple[str, Path]]:
    """Every user's store under the site's store folder: (user, path) pairs that exist.

    ``store_dir`` with ``{user}``: glob that component. Starting with ``~``: each
    account's home. Otherwise it is one shared folder.
    """
    template = site.store_dir
    found: dict[str, tuple[str, Path]] = {}
    if "{user}" in template:
        head, tail = template.split("{user}", 1)
        head = os.path.expanduser(head)
        pattern = glob.escape(head) + "*" + glob.escape(tail)
        for d in sorted(glob.glob(pattern)):
            user = d[len(head): len(d) - len(tail) if tail else None]
            p = Path(d) / DB_FILENAME
            if p.exists():
                found.setdefault(os.path.realpath(p), (user, p))
    elif template.startswith("~/") or template == "~":
        rest = template[1:]
        for pw in pwd.getpwall():
            p = Path(pw.pw_dir + rest) / DB_FILENAME
            try:
                if p.exists():
                    found.setdefault(os.path.realpath(p), (pw.pw_name, p))
            except OSError:
                continue
    else:
        p = Path(os.path.expanduser(template)) / DB_FILENAME
        if p.exists():
            found[os.path.realpath(p)] = ("*", p)
    return sorted(found.values())


def acct_all_users(site: SiteConfig, fetch: Callable[[Store], list[Any]]) -> tuple[list[Any], list[str]]:
    """`fetch(store)` over every readable store (opened read-only), and one warning per
    store skipped. `fetch` is `acct_rows` or `acct_table_cells` with its arguments bound."""
    rows: list[Any] = []
    warnings: list[str] = []
    from slurm_dlrm.store.others import open_other_store

    for user, path in discover_user_stores(site):
        if not os.access(path, os.R_OK):
            warnings.append(f"{user}: cannot read {path} (permission denied); skipped")
            continue
        try:
            # someone else's file: owner checked, schema checked, every read bounded
            with open_other_store(path, user) as st:
                rows.extend(fetch(st))
        except (StoreError, sqlite3.Error, OSError) as exc:
            first = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
            warnings.append(f"{user}: {path}: {first}; skipped")
    return rows, warnings


# ---------------------------------------------------------------- totals per user and partition

@dataclass(frozen=True)
class TotalColumn:
    name: str
    key: str
    kind: str  # int | hours


TOTAL_COLUMNS: tuple[TotalColumn, ...] = (
    TotalColumn("Jobs", "jobs", "int"), TotalColumn("Pending", "pending", "int"),
    TotalColumn("Running", "running", "int"), TotalColumn("Completed", "completed", "int"),
    TotalColumn("Failed", "failed", "int"), TotalColumn("OOM", "oom", "int"),
    TotalColumn("Cancelled", "cancelled", "int"), TotalColumn("GPUHours", "gpu_hours", "hours"),
    TotalColumn("ExclGPUHours", "excl_gpu_hours", "hours"), TotalColumn("GPUHoursSaved", "gpu_hours_saved", "hours"),
)


@dataclass
class Totals:
    """acct's figures summed per user and per partition, over one or many stores."""

    by_user: dict[str, dict[str, float]]
    by_partition: dict[str, dict[str, float]]
    skipped: list[str]  # one line per store that could not be read

    def add(self, rows: Sequence[dict[str, Any]], default_partition: str = "") -> None:
        for r in rows:
            for table, name in ((self.by_user, str(r["user"])),
                                (self.by_partition, str(r["partition"] or default_partition or "-"))):
                acc = table.setdefault(name, {c.key: 0.0 for c in TOTAL_COLUMNS})
                for c in TOTAL_COLUMNS:
                    acc[c.key] += float(r[c.key] or 0.0)

    def as_dict(self) -> dict[str, Any]:
        def rows(table: dict[str, dict[str, float]], label: str) -> list[dict[str, Any]]:
            return [{label: k, **{c.name: (int(v[c.key]) if c.kind == "int" else round(v[c.key], 4))
                                  for c in TOTAL_COLUMNS}} for k, v in sorted(table.items())]

        return {"users": rows(self.by_user, "User"), "partitions": rows(self.by_partition, "Partition"),
                "skipped": list(self.skipped)}


def acct_totals(store: Store, f: AcctFilter, now: float | None = None) -> list[dict[str, Any]]:
    """ACCT's rows of `store` (filtered by `f`) summed per (user, partition)."""
    now = store.clock() if now is None else now
    with store.read():
        params = _params(store, f, now)
        rows = [] if params is None else store.query("acct_totals", params)
    if store.owner_user is not None:
        for r in rows:
            r["user"] = store.owner_user  # summed again per user by Totals.add
    return rows


def render_totals(totals: Totals, fmt: str, header: bool = True) -> str:
    """Per-user and per-partition totals: two tables (table), or rows with a `Group` column."""
    if fmt == "json":
        return json.dumps(totals.as_dict(), indent=1)
    d = totals.as_dict()
    rows = [("user", r["User"], r) for r in d["users"]] + [("partition", r["Partition"], r) for r in d["partitions"]]
    names = [c.name for c in TOTAL_COLUMNS]
    if fmt in ("csv", "parsable"):
        buf = io.StringIO()
        if fmt == "csv":
            w = csv.writer(buf, lineterminator="\n")
            if header:
                w.writerow(["Group", "Name", *names])
            for g, n, r in rows:
                w.writerow([g, n, *(r[k] for k in names)])
        else:
            if header:
                buf.write("|".join(["Group", "Name", *names]) + "\n")
            for g, n, r in rows:
                buf.write("|".join([g, n, *(str(r[k]) for k in names)]) + "\n")
        return buf.getvalue()
    out: list[str] = []
    for title, label, items in (("Per user", "User", d["users"]), ("Per partition", "Partition", d["partitions"])):
        cells = [[str(r[label]), *(str(r[c.name]) if c.kind == "int" else f"{r[c.name]:.3f}" for c in TOTAL_COLUMNS)]
                 for r in items]
        heads = [label, *names]
        widths = [max([len(h), *(len(row[i]) for row in cells)]) for i, h in enumerate(heads)]
        out.append(f"{title}:")
        if header:
            out.append(" ".join(h.rjust(w) for h, w in zip(heads, widths, strict=True)))
            out.append(" ".join("-" * w for w in widths))
        out += [" ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
        out.append("")
    if totals.skipped:
        out.append("Stores not read:")
        out += [f"  {s}" for s in totals.skipped]
        out.append("")
    return "\n".join(out)


# ---------------------------------------------------------------- rendering

def raw_value(col: Column, v: Any) -> Any:
    """Machine-readable value: bytes and counts as ints, seconds and % as numbers, times ISO 8601."""
    if v is None:
        return None
    if col.kind == "time":
        return datetime.fromtimestamp(v).astimezone().isoformat(timespec="seconds")
    if col.kind == "bytes":
        return int(v)
    if col.kind == "bytes_list":
        return json.loads(v)
    if col.kind in ("dur", "pct", "rate"):
        return round(float(v), 1)
    if col.kind == "hours":
        return round(float(v), 4)
    if col.kind == "metric":
        return round(float(v), 6)
    return v


def render_parsable(cell_rows: Sequence[Sequence[str]], cols: Sequence[tuple[Column, int | None]],
                    header: bool = True) -> str:
    """`acct -P`: the table's formatted cells, '|'-separated, like sacct -P (--raw: `render`)."""
    lines = ["|".join(c.name for c, _ in cols)] if header else []
    lines += ["|".join(r) for r in cell_rows]
    return "\n".join(lines) + ("\n" if lines else "")


def render(rows: Sequence[dict[str, Any]], cols: Sequence[tuple[Column, int | None]], fmt: str,
           header: bool = True) -> str:
    """Raw values as fmt: json | csv | parsable (``|``-separated, like sacct -P).

    The human table is `render_table` over `acct_table_cells`.
    """
    if fmt == "json":
        return json.dumps([{c.name: raw_value(c, r.get(c.key)) for c, _ in cols} for r in rows], indent=1)
    buf = io.StringIO()
    if fmt == "csv":
        writer = csv.writer(buf, lineterminator="\n")
        if header:
            writer.writerow([c.name for c, _ in cols])
        for r in rows:
            writer.writerow(["" if (v := raw_value(c, r.get(c.key))) is None else v for c, _ in cols])
        return buf.getvalue()
    if fmt != "parsable":
        raise ValueError(f"unknown format {fmt!r}")
    if header:
        buf.write("|".join(c.name for c, _ in cols) + "\n")
    for r in rows:
        buf.write("|".join("" if (v := raw_value(c, r.get(c.key))) is None else str(v) for c, _ in cols) + "\n")
    return buf.getvalue()


def columns_help() -> str:
    return "\n".join(f"{c.name:<15} {c.help}" for c in COLUMNS)
