"""A sweep over one spec at submit: `--set KEY=V1,V2` (the product over every --set) and
`--array 0-3` (copies with seeds), as one sbatch array or a submitit sweep would give."""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from typing import Any

from slurm_dlrm.errors import BadInput

MAX_VARIANTS = 1000
_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def split_values(text: str) -> list[str]:
    """`0.01,0.1` -> two values; commas inside [] or {} stay (`[64,16],[128,16]`)."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    out.append(cur)
    return [v.strip() for v in out]


def parse_sets(sets: Sequence[str]) -> list[tuple[str, list[Any]]]:
    """`optimizer.lr=0.01,0.1` -> ("optimizer.lr", [0.01, 0.1]); values read as YAML."""
    import yaml

    out = []
    for item in sets:
        key, eq, values = item.partition("=")
        if not eq or not key.strip() or not values.strip():
            raise BadInput(f"--set {item}: expected KEY=VALUE[,VALUE...] (a dotted spec field, e.g. optimizer.lr=0.01,0.1)")
        try:
            parsed = [yaml.safe_load(v) for v in split_values(values)]
        except yaml.YAMLError:
            raise BadInput(f"--set {item}: a value is not valid YAML") from None
        out.append((key.strip(), parsed))
    return out


def parse_array(text: str) -> list[int]:
    """sbatch's --array forms: `0-3`, `1,3,5`, `0-15:4` (a `%N` limit is accepted, unused)."""
    idx: list[int] = []
    for part in text.split("%", 1)[0].split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+)(?::(\d+))?)?", part.strip())
        if not m:
            raise BadInput(f"--array {text}: expected N, N-M, N-M:STEP or a comma list of them")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) else lo
        step = int(m.group(3)) if m.group(3) else 1
        if hi < lo or step < 1:
            raise BadInput(f"--array {text}: {part} is an empty range")
        idx.extend(range(lo, hi + 1, step))
    if len(idx) > MAX_VARIANTS:
        raise BadInput(f"--array {text}: {len(idx)} tasks; at most {MAX_VARIANTS}")
    return sorted(set(idx))


def _assign(data: Any, key: str, value: Any, raw_key: str) -> None:
    parts = key.split(".")
    cur = data
    for i, p in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(cur, list):
            if not p.isdigit() or int(p) >= len(cur):
                raise BadInput(f"--set {raw_key}: {'.'.join(parts[:i + 1])}: no such list item")
            if last:
                cur[int(p)] = value
            else:
                cur = cur[int(p)]
        elif isinstance(cur, dict):
            if last:
                cur[p] = value
            else:
                if not isinstance(cur.get(p), (dict, list)):
                    cur[p] = {}
                cur = cur[p]
        else:
            raise BadInput(f"--set {raw_key}: {'.'.join(parts[:i])} is not a mapping or list")


def _label(key: str, value: Any) -> str:
    return _SAFE.sub("_", f"{key.split('.')[-1]}{value}")


def expand(spec: Any, sets: Sequence[tuple[str, list[Any]]], array: Sequence[int] | None) -> list[Any]:
    """The spec's variants, validated (each a JobSpec named `<name>-<label>`), or [spec]."""
    import copy

    from slurm_dlrm.spec import parse_spec

    if not sets and not array:
        return [spec]
    axes: list[list[tuple[str, Any]]] = [[(k, v) for v in values] for k, values in sets]
    if array:
        axes.append([("__array__", i) for i in array])
    combos = list(itertools.product(*axes))
    if len(combos) > MAX_VARIANTS:
        raise BadInput(f"--set/--array: {len(combos)} variants of {spec.name}; at most {MAX_VARIANTS}")
    base = spec.to_dict()
    out = []
    for combo in combos:
        data = copy.deepcopy(base)
        labels = []
        for key, value in combo:
            if key == "__array__":
                # like SLURM_ARRAY_TASK_ID: the task index, and a seed of its own
                data["seed"] = int(base.get("seed") or 0) + int(value)
                labels.append(f"{value}")
            else:
                _assign(data, key, value, key)
                labels.append(_label(key, value))
        data["name"] = f"{spec.name}-{'-'.join(labels)}"[:64]
        src = f"{spec.source} [{', '.join(f'{k}={v}' if k != '__array__' else f'array={v}' for k, v in combo)}]"
        out.append(parse_spec(data, src))
    return out
