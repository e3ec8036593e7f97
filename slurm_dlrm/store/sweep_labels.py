"""Labels for a sweep's variants where people read them (issue 47 item 3, the report's
sweep chart): a variant's label names the few fields that tell the sweep's variants
apart most; every field that differs goes in a table beside it. A spec is compared as
its digest: its scalars by dotted key, its tables summed up (before, every field of
every table was a label part: the demo's labels were 25 fields, wider than the chart).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from slurm_dlrm.store.sweep_report import flatten

LABEL_FIELDS = 3
LABEL_CHARS = 34


def spec_digest(spec: dict[str, Any]) -> dict[str, Any]:
    """A spec as the fields a person compares: its scalars by dotted key, its tables
    summed up (how many, their dims, their rows in all, each other table field's values),
    not one field per table (tables.2.name, tables.2.dtype, ... made labels wider than the chart)."""
    tables = spec.get("tables") if isinstance(spec.get("tables"), list) else []
    out = flatten({k: v for k, v in spec.items() if k not in ("name", "tables")})
    if tables:
        dicts = [t for t in tables if isinstance(t, dict)]
        out["tables"] = len(tables)
        out["dim"] = "/".join(str(d) for d in sorted({int(t["dim"]) for t in dicts if isinstance(t.get("dim"), int)}))
        out["rows"] = sum(int(t["rows"]) for t in dicts if isinstance(t.get("rows"), int))
        for key in sorted({k for t in dicts for k in t} - {"name", "dim", "rows"}):
            vals = {json.dumps(flatten(t.get(key)) if isinstance(t.get(key), dict | list) else t.get(key),
                               sort_keys=True) for t in dicts}
            out[f"tables.{key}"] = "/".join(sorted(v.strip('"') for v in vals))
    return out


def short_key(key: str) -> str:
    """`optimizer.lr` -> lr, `optimizer.type` -> optimizer, `tables.pooling_factor` -> pooling_factor."""
    parts = key.split(".")
    if parts[-1].isdigit():
        return key
    if len(parts) > 1 and parts[-1] == "type":
        return parts[-2]
    return parts[-1]


def short_value(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, int):
        return f"{v / 1000:.3g}k" if abs(v) >= 10_000 else str(v)
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def label_fields(digests: Sequence[dict[str, Any]], most: int = LABEL_FIELDS) -> list[str]:
    """The fields that differ most between `digests`: most distinct values first (on a tie
    a named field before a list item, then the shorter), a field that splits the variants
    as a chosen one does left out."""
    keys = sorted({k for d in digests for k in d})
    varying = []
    for k in keys:
        vals = [json.dumps(d.get(k), sort_keys=True, default=str) for d in digests]
        if len(set(vals)) > 1:
            first: dict[str, int] = {}
            split = tuple(first.setdefault(v, len(first)) for v in vals)
            indexed = any(part.isdigit() for part in k.split("."))  # bottom_mlp.1: after a named field
            varying.append((-len(set(vals)), indexed, max(len(short_value(d.get(k))) for d in digests), k, split))
    varying.sort()
    chosen: list[str] = []
    splits: set[tuple[int, ...]] = set()
    for *_, k, split in varying:
        if split in splits:
            continue
        chosen.append(k)
        splits.add(split)
        if len(chosen) == most:
            break
    return chosen


def digest_table(sweep: str, variants: Sequence[tuple[int, str, dict[str, Any]]]
                 ) -> tuple[list[str], list[list[str]], dict[int, str]]:
    """(header, rows, label per job id) for (job id, name, spec) variants: the table has
    every field that differs, the label the few that differ most, after the variant's name."""
    digests = [spec_digest(spec) for _, _, spec in variants]
    keys = sorted({k for d in digests for k in d})
    varying = [k for k in keys if len({json.dumps(d.get(k), sort_keys=True, default=str) for d in digests}) > 1]
    chosen = label_fields(digests)
    ordered = chosen + [k for k in varying if k not in chosen]
    labels = {}
    rows = []
    for (job_id, name, _), d in zip(variants, digests, strict=True):
        short = name[len(sweep) + 1:] if name.startswith(sweep + "-") else name
        text = f"{short}: " + " ".join(f"{short_key(k)}={short_value(d.get(k))}" for k in chosen)
        labels[job_id] = text if len(text) <= LABEL_CHARS else text[:LABEL_CHARS - 1] + "…"
        rows.append([short, str(job_id), *(short_value(d.get(k)) for k in ordered)])
    return ["Variant", "JobID", *ordered], rows, labels
