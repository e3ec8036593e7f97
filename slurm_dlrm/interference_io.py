"""Reading co-location data for `slurm-dlrm interference` (the model stays pure in packing/).

Two file forms, documented in docs/packing.md ("Validating the model on your
measurements"):

- CSV, one row per member: ``group,job,sm_util_pct,membw_util_pct,gpu_mem_gib,speed``
  (or ``solo_rate`` and ``colocated_rate`` instead of ``speed``);
- JSON lines, one co-location group per line:
  ``{"members": [{"sm_util_pct": .., "membw_util_pct": .., "gpu_mem_gib": ..}], "speeds": [..]}``
  (a JSON array of such objects, or of members for one group, is read too).

Every problem is a `BadInput` naming the file, the line and the field.
"""

from __future__ import annotations

import csv
import json
import math
import sqlite3
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_dlrm.errors import BadInput
from slurm_dlrm.packing.interference import (
    DEFAULT_PARAMS,
    CoLocationSample,
    InterferenceParams,
    SoloProfile,
)

# Model files are read and written with the store (the service loads its own from there).
from slurm_dlrm.store.model_file import load_model, model_file_problem, save_model

SM = "sm_util_pct"
BW = "membw_util_pct"
# Aliases a measurement script plausibly writes; a file giving both an alias and its
# canonical name is refused (which one is meant?).
ALIASES = {"sm_pct": SM, "bw_pct": BW}
MEM_SCALE = {"gpu_mem_bytes": 1, "gpu_mem_mib": 1 << 20, "gpu_mem_gib": 1 << 30}  # first present wins
SPEED, SOLO, COLOCATED = "speed", "solo_rate", "colocated_rate"
CORES, MPS = "host_cpu_cores", "mps_thread_pct"  # optional: the learned model uses them when all rows have them
KNOWN = {"group", "job", SM, BW, SPEED, SOLO, COLOCATED, CORES, MPS, *MEM_SCALE, *ALIASES}


@dataclass(frozen=True)
class MeasuredGroup:
    """The members that shared one GPU, their solo profiles and (if measured) speeds."""

    name: str
    jobs: tuple[str, ...]
    members: tuple[SoloProfile, ...]
    speeds: tuple[float, ...] | None  # co-located rate / solo rate, per member

    def sample(self) -> CoLocationSample:
        assert self.speeds is not None
        return CoLocationSample(self.members, self.speeds)


@dataclass
class ReadNotes:
    """What a reader noticed that is not an error (printed on stderr by the CLI)."""

    ignored_fields: set[str]
    high_speeds: int = 0  # members measured faster than 1.5x solo
    max_util_pct: float = 0.0

    def warnings(self) -> list[str]:
        out = []
        if self.ignored_fields:
            out.append(f"ignored field(s) not in the format: {', '.join(sorted(self.ignored_fields))}")
        if self.high_speeds:
            out.append(f"{self.high_speeds} member(s) measured above 1.5x their solo speed (the model never "
                       "predicts above 1; are solo and co-located rates swapped?)")
        if 0.0 < self.max_util_pct <= 1.0:
            out.append("every utilisation is <= 1%: fractions instead of percent? (multiply by 100)")
        return out


def _number(raw: Any, where: str, field: str, lo: float | None = None, hi: float | None = None,
            positive: bool = False) -> float:
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        raise BadInput(f"{where}: {field}: missing")
    if isinstance(raw, bool):
        raise BadInput(f"{where}: {field}: not a number (got {raw!r})")
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise BadInput(f"{where}: {field}: not a number (got {raw!r})") from None
    if not math.isfinite(value):
        raise BadInput(f"{where}: {field}: must be finite (got {raw!r})")
    if positive and value <= 0:
        raise BadInput(f"{where}: {field}: must be > 0 (got {raw!r})")
    if lo is not None and value < lo:
        raise BadInput(f"{where}: {field}: must be >= {lo:g} (got {raw!r})")
    if hi is not None and value > hi:
        raise BadInput(f"{where}: {field}: must be <= {hi:g} (got {raw!r})")
    return value


def _present(record: Mapping[str, Any], key: str) -> bool:
    value = record.get(key)
    return value is not None and not (isinstance(value, str) and not value.strip())


def parse_member(record: Mapping[str, Any], where: str, notes: ReadNotes,
                 need_speed: bool) -> tuple[SoloProfile, float | None]:
    """One member's profile (and speed, if the record has one) from a flat mapping."""
    rec = {str(k).strip().lower(): v for k, v in record.items()}
    for alias, canonical in ALIASES.items():
        if alias in rec:
            if canonical in rec:
                raise BadInput(f"{where}: {alias}: give {canonical} or {alias}, not both")
            rec[canonical] = rec.pop(alias)
    notes.ignored_fields.update(k for k in rec if k not in KNOWN)
    sm = _number(rec.get(SM), where, SM, 0.0, 100.0)
    bw = _number(rec.get(BW), where, BW, 0.0, 100.0)
    notes.max_util_pct = max(notes.max_util_pct, sm, bw)
    mem_bytes = 0
    for key, scale in MEM_SCALE.items():
        if _present(rec, key):
            value = _number(rec[key], where, key, 0.0) * scale
            if not math.isfinite(value):
                raise BadInput(f"{where}: {key}: {rec[key]!r} is too large")
            mem_bytes = int(round(value))
            break
    cores = _number(rec[CORES], where, CORES, 0.0) if _present(rec, CORES) else 0.0
    mps = _number(rec[MPS], where, MPS, 0.0, 100.0) if _present(rec, MPS) else 0.0
    speed: float | None = None
    has_rates = _present(rec, SOLO) or _present(rec, COLOCATED)
    if _present(rec, SPEED):
        if has_rates:
            raise BadInput(f"{where}: {SPEED}: give {SPEED} or {SOLO} and {COLOCATED}, not both")
        speed = _number(rec[SPEED], where, SPEED, 0.0)
    elif has_rates:
        solo = _number(rec.get(SOLO), where, SOLO, positive=True)
        speed = _number(rec.get(COLOCATED), where, COLOCATED, 0.0) / solo
    elif need_speed:
        raise BadInput(f"{where}: {SPEED}: missing (give {SPEED}, or {SOLO} and {COLOCATED})")
    if speed is not None and speed > 1.5:
        notes.high_speeds += 1
    return SoloProfile(sm, bw, mem_bytes, cores, mps), speed


def _group(name: str, rows: Sequence[tuple[str, SoloProfile, float | None]], where: str) -> MeasuredGroup:
    jobs = tuple(j for j, _, _ in rows)
    seen: set[str] = set()
    for j in jobs:
        if j in seen:
            raise BadInput(f"{where}: job: {j!r} appears twice in group {name!r}")
        seen.add(j)
    speeds = [s for _, _, s in rows]
    known = [s for s in speeds if s is not None]
    if known and len(known) != len(speeds):
        raise BadInput(f"{where}: {SPEED}: group {name!r} has a speed for some members only")
    return MeasuredGroup(name, jobs, tuple(p for _, p, _ in rows),
                         tuple(s for s in known) if known else None)


def _read_csv(path: str, lines: list[tuple[int, str]], notes: ReadNotes, need_speed: bool) -> list[MeasuredGroup]:
    (header_no, header_line), body = lines[0], lines[1:]
    header = [h.strip().lower() for h in next(csv.reader([header_line]))]
    if len(header) == 1 and any(sep in header_line for sep in ";\t"):
        raise BadInput(f"{path}: line {header_no}: the header has one column: use commas between fields")
    dupes = sorted({h for h in header if header.count(h) > 1})
    if dupes:
        raise BadInput(f"{path}: line {header_no}: column {dupes[0]!r} appears twice")
    for need in ("group", SM, BW):
        if need not in header and not any(a in header for a, c in ALIASES.items() if c == need):
            raise BadInput(f"{path}: line {header_no}: no {need!r} column (header: {','.join(header)})")
    if need_speed and SPEED not in header and not (SOLO in header and COLOCATED in header):
        raise BadInput(f"{path}: line {header_no}: no {SPEED!r} column (nor {SOLO!r} and {COLOCATED!r})")
    groups: dict[str, list[tuple[str, SoloProfile, float | None]]] = {}
    first_line: dict[str, int] = {}
    for no, line in body:
        cells = next(csv.reader([line]))
        where = f"{path}: line {no}"
        if len(cells) != len(header):
            raise BadInput(f"{where}: {len(cells)} fields, the header has {len(header)}")
        rec = dict(zip(header, cells, strict=True))
        name = rec["group"].strip()
        if not name:
            raise BadInput(f"{where}: group: empty")
        profile, speed = parse_member(rec, where, notes, need_speed)
        rows = groups.setdefault(name, [])
        first_line.setdefault(name, no)
        job = (rec.get("job") or "").strip() or str(len(rows) + 1)
        if any(job == j for j, _, _ in rows):
            raise BadInput(f"{where}: job: {job!r} appears twice in group {name!r}")
        rows.append((job, profile, speed))
    return [_group(name, rows, f"{path}: line {first_line[name]}") for name, rows in groups.items()]


def _json_group(obj: Any, name: str, where: str, notes: ReadNotes, need_speed: bool) -> MeasuredGroup:
    if not isinstance(obj, Mapping):
        raise BadInput(f"{where}: a group must be an object with \"members\" (got {type(obj).__name__})")
    members = obj.get("members")
    if not isinstance(members, list) or not members:
        raise BadInput(f"{where}: members: a non-empty list of member objects is required")
    speeds = obj.get("speeds")
    if speeds is not None and (not isinstance(speeds, list) or len(speeds) != len(members)):
        raise BadInput(f"{where}: speeds: a list of one number per member is required "
                       f"({len(members)} members)")
    rows: list[tuple[str, SoloProfile, float | None]] = []
    for i, m in enumerate(members):
        at = f"{where}: members[{i}]"
        if not isinstance(m, Mapping):
            raise BadInput(f"{at}: a member must be an object (got {type(m).__name__})")
        own = dict(m)
        if speeds is not None:
            if any(_present(own, k) for k in (SPEED, SOLO, COLOCATED)):
                raise BadInput(f"{at}: give speeds for the group or per member, not both")
            if isinstance(speeds[i], bool) or not isinstance(speeds[i], int | float | str):
                raise BadInput(f"{where}: speeds[{i}]: not a number (got {speeds[i]!r})")
            own[SPEED] = speeds[i]
        profile, speed = parse_member(own, at, notes, need_speed)
        rows.append((str(m.get("job", i + 1)), profile, speed))
    notes.ignored_fields.update(k for k in obj if k not in {"group", "members", "speeds"})
    return _group(str(obj.get("group", name)), rows, where)


def _read_json(path: str, text: str, lines: list[tuple[int, str]], notes: ReadNotes,
               need_speed: bool) -> list[MeasuredGroup]:
    from slurm_dlrm.strict_load import DuplicateKeyError, load_json

    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        whole = None  # JSON lines: one group per line
    if whole is not None:
        try:
            load_json(text)  # again, refusing a key given twice
        except DuplicateKeyError as exc:
            raise BadInput(f"{path}: {exc}") from None
    if isinstance(whole, list):
        if whole and all(isinstance(x, Mapping) and "members" not in x for x in whole):
            return [_json_group({"members": whole}, "1", path, notes, need_speed)]  # one group's members
        return [_json_group(x, str(i + 1), f"{path}: item {i}", notes, need_speed) for i, x in enumerate(whole)]
    if isinstance(whole, Mapping) and len(lines) > 1:  # one group, pretty-printed
        return [_json_group(whole, "1", path, notes, need_speed)]
    out = []
    for no, line in lines:
        where = f"{path}: line {no}"
        try:
            obj = load_json(line, line=no)
        except DuplicateKeyError as exc:
            raise BadInput(f"{path}: {exc}") from None
        except json.JSONDecodeError as exc:
            raise BadInput(f"{where}: not valid JSON: {exc.msg} (column {exc.colno})") from None
        out.append(_json_group(obj, f"line {no}", where, notes, need_speed))
    return out


def read_groups(path: str, need_speed: bool = True) -> tuple[list[MeasuredGroup], ReadNotes]:
    """Co-location groups from a CSV or JSON(-lines) file, by extension (.csv, .json,
    .jsonl, .ndjson), else by the first character (``{``/``[``: JSON)."""
    try:
        text = Path(path).read_text(encoding="utf-8-sig")  # utf-8-sig: spreadsheets write a BOM
    except OSError as exc:
        raise BadInput(f"{path}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise BadInput(f"{path}: not UTF-8 text ({exc.reason})") from None
    lines = [(no, line) for no, line in enumerate(text.splitlines(), 1)
             if line.strip() and not line.lstrip().startswith("#")]
    if not lines:
        raise BadInput(f"{path}: no data")
    notes = ReadNotes(set())
    suffix = Path(path).suffix.lower()
    is_json = suffix in (".json", ".jsonl", ".ndjson") or (suffix != ".csv" and lines[0][1].lstrip()[:1] in "{[")
    groups = _read_json(path, text, lines, notes, need_speed) if is_json else _read_csv(path, lines, notes, need_speed)
    if not groups:
        raise BadInput(f"{path}: no co-location group")
    return groups, notes


# ---------------------------------------------------------------- command-line values

MEMBER_KEYS: dict[str, str] = {"sm": SM, SM: SM, "bw": BW, BW: BW, **ALIASES, "mem_bytes": "gpu_mem_bytes",
                               "mem_mib": "gpu_mem_mib", "mem_gib": "gpu_mem_gib",
                               **{k: k for k in MEM_SCALE}, "job": "job"}


def parse_member_arg(text: str, index: int) -> tuple[str, SoloProfile]:
    """``sm=30,bw=10,mem_gib=8`` (optionally ``job=NAME``) -> (job, profile)."""
    where = f"--member {text!r}"
    rec: dict[str, str] = {}
    for part in text.split(","):
        key, eq, value = part.partition("=")
        key = key.strip().lower()
        if not eq or not key:
            raise BadInput(f"{where}: {part.strip()!r} is not KEY=VALUE (keys: sm, bw, mem_gib, mem_mib, mem_bytes, job)")
        if key not in MEMBER_KEYS:
            raise BadInput(f"{where}: unknown key {key!r} (keys: sm, bw, mem_gib, mem_mib, mem_bytes, job)")
        if MEMBER_KEYS[key] in rec:
            raise BadInput(f"{where}: {key} given twice")
        rec[MEMBER_KEYS[key]] = value.strip()
    for need, short in ((SM, "sm"), (BW, "bw")):
        if need not in rec:
            raise BadInput(f"{where}: {short}= is required")
    profile, _ = parse_member(rec, where, ReadNotes(set()), need_speed=False)
    return rec.get("job") or str(index + 1), profile


def parse_params(text: str) -> InterferenceParams:
    """``alpha,beta,gamma`` -> InterferenceParams (each a finite number >= 0)."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 3:
        raise BadInput(f"--params: three numbers alpha,beta,gamma are required (got {text!r})")
    a, b, g = (_number(p, "--params", name, 0.0) for p, name in zip(parts, ("alpha", "beta", "gamma"), strict=True))
    return InterferenceParams(a, b, g)


# ---------------------------------------------------------------- the store

def read_store_groups(db_path: str) -> list[MeasuredGroup]:
    """The co-locations the agents measured in a store (its file, or the folder holding
    store.sqlite), read-only, through the same code the service's live refit uses
    (`slurm_dlrm.store.colocations`)."""
    from slurm_dlrm.store import Store, StoreError
    from slurm_dlrm.store.colocations import store_colocation_samples
    from slurm_dlrm.store.db import DB_FILENAME

    path = Path(db_path).expanduser()
    if path.is_dir():  # the store folder of a site config
        path = path / DB_FILENAME
    if not path.is_file():
        raise BadInput(f"--store: no such file: {path}")
    try:
        with Store(path, readonly=True) as store:
            return [MeasuredGroup(f"pack {key[0]} node {key[1]} gpu {key[2]}", tuple(str(j) for j in ids),
                                  s.members, s.speeds) for key, ids, s in store_colocation_samples(store)]
    except (StoreError, sqlite3.Error) as exc:
        raise BadInput(f"--store: {exc}") from None


# ---------------------------------------------------------------- learned model files

__all__ = ["load_model", "model_file_problem", "parse_truth", "read_groups", "read_store_groups", "save_model"]


def parse_truth(text: str, what: str = "--truth") -> InterferenceParams:
    """``analytic[:A,B,G]`` | ``learned:FILE`` | ``table:FILE`` | ``synthetic[:SEED]`` ->
    the InterferenceParams the simulator uses (the speed model attached)."""
    from slurm_dlrm.truth import NearestTable, SyntheticColocation

    kind, _, arg = text.partition(":")
    kind = kind.strip().lower()
    if kind == "analytic":
        return parse_params(arg) if arg else DEFAULT_PARAMS
    if kind == "learned" and arg:
        return load_model(arg).params()
    if kind == "table" and arg:
        groups, _ = read_groups(arg)
        try:
            table = NearestTable(tuple(g.sample() for g in groups if len(g.members) > 1))
        except ValueError as exc:
            raise BadInput(f"{what} {text}: {exc}") from None
        return InterferenceParams(speed_model=table)
    if kind == "synthetic":
        seed = int(_number(arg, what, "seed", 0.0)) if arg else 0
        return InterferenceParams(speed_model=SyntheticColocation(seed=seed))
    raise BadInput(f"{what}: {text!r}: one of analytic[:A,B,G], learned:FILE, table:FILE, synthetic[:SEED]")
