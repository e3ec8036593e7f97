"""`submit --trials N`: a sweep's variants drawn from ranges, not a grid (issue 47 item 2).

The grammar of one `--set KEY=...` with `--trials N`:

  log:LO..HI       a float, log-uniform in [LO, HI] (0 < LO < HI)   optimizer.lr=log:1e-4..1e-1
  uniform:LO..HI   a float, uniform in [LO, HI] (LO < HI)            optimizer.lr=uniform:0.01..0.05
  int:LO..HI       an integer, uniform in LO..HI, both included      embedding_dim=int:8..64
  V1,V2,...        one of the values, each as likely (categorical)    batch_size=256,512,1024

Without --trials, value lists are the grid they always were and a range is refused.

The sampler is seeded random search: trial i's values come from `random.Random(seed)`
drawn in trial order, key after key, so one seed gives the same N variants every time.
Drawing all N at submit is the same as drawing each when a share frees up, since a
random draw does not depend on earlier results. Floats keep 4 significant digits
(names and tables read; a finer step than any lr sweep needs). Pure: no I/O.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from slurm_dlrm.errors import BadInput

SAMPLER = "random"
SIGNIFICANT_DIGITS = 4
RANGE_KINDS = ("log", "uniform", "int")
_RANGE = re.compile(r"(log|uniform|int):(.*)", re.DOTALL)
_NUMBER = r"\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*"
_BOUNDS = re.compile(_NUMBER + r"\.\." + _NUMBER)


@dataclass(frozen=True)
class Range:
    """One sampled field: `kind` one of RANGE_KINDS, inclusive bounds."""

    kind: str
    lo: float
    hi: float
    text: str  # as given (`log:1e-4..1e-1`), for errors and the record

    def draw(self, rng: random.Random) -> float | int:
        if self.kind == "int":
            return rng.randint(int(self.lo), int(self.hi))
        if self.kind == "log":
            x = math.exp(rng.uniform(math.log(self.lo), math.log(self.hi)))
        else:
            x = rng.uniform(self.lo, self.hi)
        return min(max(float(f"{x:.{SIGNIFICANT_DIGITS}g}"), self.lo), self.hi)


def parse_range(item: str, text: str) -> Range | None:
    """`log:1e-4..1e-1` -> Range; None when `text` is no range (a value list). A range
    that cannot be sampled is BadInput naming `item` (the whole --set)."""
    m = _RANGE.fullmatch(text.strip())
    if m is None:
        return None
    kind, bounds = m.group(1), m.group(2)
    b = _BOUNDS.fullmatch(bounds)
    if b is None:
        raise BadInput(f"--set {_cut(item)}: expected {kind}:LO..HI with two numbers (e.g. log:1e-4..1e-1, "
                       "uniform:0.1..0.5, int:8..64)")
    lo_text, hi_text = b.group(1), b.group(2)
    if kind == "int":
        if not re.fullmatch(r"[-+]?\d{1,18}", lo_text) or not re.fullmatch(r"[-+]?\d{1,18}", hi_text):
            raise BadInput(f"--set {_cut(item)}: int:LO..HI takes whole numbers")
        lo_i, hi_i = int(lo_text), int(hi_text)
        if lo_i > hi_i:
            raise BadInput(f"--set {_cut(item)}: the range {lo_i}..{hi_i} is empty (LO > HI)")
        return Range(kind, lo_i, hi_i, text.strip())
    lo, hi = float(lo_text), float(hi_text)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise BadInput(f"--set {_cut(item)}: the bounds must be finite numbers")
    if lo >= hi:
        raise BadInput(f"--set {_cut(item)}: {kind}:{lo_text}..{hi_text} cannot be sampled (LO must be below HI)")
    if kind == "log" and lo <= 0:
        raise BadInput(f"--set {_cut(item)}: log:{lo_text}..{hi_text} cannot be sampled (a log range needs LO > 0)")
    return Range(kind, lo, hi, text.strip())


def sample(space: Sequence[tuple[str, Range | list[Any]]], n: int, seed: int) -> list[list[tuple[str, Any]]]:
    """N trials, each [(key, value)] in `space`'s order: a Range drawn, a list chosen from."""
    rng = random.Random(seed)
    return [[(key, dim.draw(rng) if isinstance(dim, Range) else dim[rng.randrange(len(dim))])
             for key, dim in space] for _ in range(n)]


def draw_record(trial: int, n: int, values: Sequence[tuple[str, Any]],
                space: Sequence[tuple[str, Range | list[Any]]], seed: int) -> dict[str, Any]:
    """What the store keeps of one draw (a `sweep_draw` event's data): enough to say where
    a variant came from and to draw the same sweep again."""
    return {"trial": trial, "trials": n, "values": dict(values), "sampler": SAMPLER, "seed": seed,
            "space": {k: d.text if isinstance(d, Range) else d for k, d in space}}


def draw_reason(draw: dict[str, Any]) -> str:
    """The event's line in `show`: `trial 3 of 0..7: optimizer.lr=0.00231, batch_size=512
    (random sampler, seed 0)`."""
    values = ", ".join(f"{k}={_cut(str(v), 30)}" for k, v in (draw.get("values") or {}).items())
    n = draw.get("trials")
    return (f"trial {draw.get('trial')} of 0..{n - 1 if isinstance(n, int) else '?'}: {values} "
            f"({draw.get('sampler')} sampler, seed {draw.get('seed')})")


def _cut(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
