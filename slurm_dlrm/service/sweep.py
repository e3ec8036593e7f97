"""A sweep over one spec at submit: `--set KEY=V1,V2` (the product over every --set) and
`--array 0-3` (copies with seeds), as one sbatch array or a submitit sweep would give.

`--trials N` with ranges (`--set optimizer.lr=log:1e-4..1e-1`) draws N variants instead
of a grid (service/trials.py holds the grammar and the sampler).

Every count is checked before anything is built (issue 32: `--array 0-3000000000`
and six `--set` lists of 60 values were built in full, to a MemoryError): an array's
size from its ranges' bounds, a sweep's from the product of its list sizes.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Sequence
from typing import Any

from slurm_dlrm.errors import BadInput

MAX_VARIANTS = 1000  # jobs one submit makes from one spec (Slurm's default MaxArraySize is 1001)
# Slurm's largest MaxArraySize is 4,000,001, so no array index is above 4,000,000.
MAX_ARRAY_INDEX = 4_000_000
# One --set value is a YAML scalar or a small list/mapping (an MLP, a table).
MAX_SET_VALUE_NODES = 10_000
_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def _cut(text: str, limit: int = 60) -> str:
    """What an error quotes of an option's text: never all of it."""
    return text if len(text) <= limit else text[:limit] + "..."


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


def parse_sets(sets: Sequence[str], trials: int | None = None) -> list[tuple[str, Any]]:
    """`optimizer.lr=0.01,0.1` -> ("optimizer.lr", [0.01, 0.1]); values read as YAML
    (with the spec's duplicate-key and size checks). The sweep's size (the product of
    the lists) is checked before any value is read. With `trials` (--trials N), a range
    (`log:1e-4..1e-1`, service/trials.py) comes back as a trials.Range in place of the
    list; a range without --trials, or --trials without a range, is BadInput."""
    import yaml

    from slurm_dlrm.service.trials import Range, parse_range
    from slurm_dlrm.strict_load import DuplicateKeyError, InputLimitError, load_yaml

    split: list[tuple[str, str, list[str] | Range]] = []
    for item in sets:
        key, eq, values = item.partition("=")
        if not eq or not key.strip() or not values.strip():
            raise BadInput(f"--set {_cut(item)}: expected KEY=VALUE[,VALUE...] (a dotted spec field, e.g. "
                           "optimizer.lr=0.01,0.1)")
        found = parse_range(item, values)
        split.append((item, key.strip(), found if found is not None else split_values(values)))
    ranged = [item for item, _, v in split if isinstance(v, Range)]
    if trials is None:
        if ranged:
            raise BadInput(f"--set {_cut(ranged[0])}: a range is sampled: add --trials N (how many variants to "
                           "draw); without it --set takes a list of values (KEY=V1,V2)")
        check_variant_count([len(v) for _, _, v in split if not isinstance(v, Range)], 1)
    else:
        check_trials(trials, bool(ranged))
        for item, _, v in split:  # a categorical list is read whole: bounded as a grid's are
            if not isinstance(v, Range) and len(v) > MAX_VARIANTS:
                raise BadInput(f"--set {_cut(item)}: {len(v):,} values; at most {MAX_VARIANTS}")
    out: list[tuple[str, Any]] = []
    for item, key, texts in split:
        if isinstance(texts, Range):
            out.append((key, texts))
            continue
        try:
            parsed = [load_yaml(v, max_nodes=MAX_SET_VALUE_NODES) for v in texts]
        except (DuplicateKeyError, InputLimitError) as exc:
            raise BadInput(f"--set {_cut(item)}: {_cut(str(exc), 120)}") from None
        except yaml.YAMLError as exc:
            why = " ".join(str(exc).split())
            raise BadInput(f"--set {_cut(item)}: a value is not valid YAML ({_cut(why, 120)})") from None
        out.append((key, parsed))
    return out


def check_trials(trials: int, has_range: bool) -> None:
    """--trials N: 1..MAX_VARIANTS, and something to sample."""
    if not 1 <= trials <= MAX_VARIANTS:
        raise BadInput(f"--trials {trials}: how many variants to draw, 1 to {MAX_VARIANTS}")
    if not has_range:
        raise BadInput(f"--trials {trials}: no range to sample: give one --set KEY=log:LO..HI, uniform:LO..HI or "
                       "int:LO..HI (value lists alone are a grid: drop --trials)")


def check_variant_count(list_sizes: Sequence[int], array_size: int) -> None:
    """Refuse a sweep of more than MAX_VARIANTS jobs, from the sizes alone."""
    n = math.prod(list_sizes) * max(array_size, 1)
    if n > MAX_VARIANTS:
        what = " x ".join(str(k) for k in [*list_sizes, *([array_size] if array_size > 1 else [])])
        raise BadInput(f"--set/--array: {what} = {n:,} variants of one spec; at most {MAX_VARIANTS}")


def parse_array(text: str) -> list[int]:
    """sbatch's --array forms: `0-3`, `1,3,5`, `0-15:4` (its `%N` limit: `array_throttle`).
    The task count is summed from each range's bounds before any index is listed."""
    ranges: list[range] = []
    count = 0
    for part in text.split("%", 1)[0].split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+)(?::(\d+))?)?", part.strip())
        if not m:
            raise BadInput(f"--array {_cut(text)}: expected N, N-M, N-M:STEP or a comma list of them")
        numbers = [g for g in m.groups() if g is not None]
        if any(len(g) > 7 or int(g) > MAX_ARRAY_INDEX for g in numbers):  # len first: int() of 5,000 digits fails
            raise BadInput(f"--array {_cut(text)}: {_cut(part)}: indexes and steps are at most {MAX_ARRAY_INDEX:,} "
                           "(Slurm's largest MaxArraySize)")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) else lo
        step = int(m.group(3)) if m.group(3) else 1
        if hi < lo or step < 1:
            raise BadInput(f"--array {_cut(text)}: {_cut(part)} is an empty range")
        ranges.append(range(lo, hi + 1, step))
        count += len(ranges[-1])
        if count > MAX_VARIANTS:
            raise BadInput(f"--array {_cut(text)}: {count:,} tasks or more; at most {MAX_VARIANTS}")
    return sorted(set(itertools.chain.from_iterable(ranges)))


def array_throttle(text: str) -> int | None:
    """sbatch --array's `%N`: at most N tasks of the array run at once (None: no limit)."""
    _, pct, limit = text.partition("%")
    if not pct:
        return None
    if not re.fullmatch(r"\d{1,7}", limit.strip()) or int(limit) < 1:
        raise BadInput(f"--array {_cut(text)}: %{_cut(limit)}: the limit of tasks at once is a number >= 1")
    return int(limit)


def _assign(data: Any, key: str, value: Any, raw_key: str) -> None:
    parts = key.split(".")
    cur = data
    for i, p in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(cur, list):
            if not p.isdigit() or int(p) >= len(cur):
                raise BadInput(f"--set {_cut(raw_key)}: {_cut('.'.join(parts[:i + 1]))}: no such list item")
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
            raise BadInput(f"--set {_cut(raw_key)}: {_cut('.'.join(parts[:i]))} is not a mapping or list")


def _label(key: str, value: Any) -> str:
    return _SAFE.sub("_", f"{key.split('.')[-1]}{value}")


def expand(spec: Any, sets: Sequence[tuple[str, Any]], array: Sequence[int] | None,
           name: str | None = None) -> list[Any]:
    """The spec's variants, validated (each a JobSpec named `<name>-<label>`), or [spec]."""
    return [v for v, _task, _group in expand_tasks(spec, sets, array, name)]


def expand_tasks(spec: Any, sets: Sequence[tuple[str, Any]], array: Sequence[int] | None,
                 name: str | None = None, trials: int | None = None,
                 trial_seed: int | None = None) -> list[tuple[Any, int | None, int]]:
    """(variant, array task id or None, which array it belongs to) for each variant: with
    `--set` and `--array`, each combination of the set values is one array of tasks, as
    one sbatch --array per combination would give. `name` (-J) replaces the spec's name
    in the variants' names, which keep their label (issue 42: all were named alike).
    With `trials`, `sets` (parse_sets(..., trials)) is sampled instead (variants_with_draws)."""
    return [(v, task, group) for v, task, group, _draw in
            variants_with_draws(spec, sets, array, name, trials, trial_seed)]


def variants_with_draws(spec: Any, sets: Sequence[tuple[str, Any]], array: Sequence[int] | None,
                        name: str | None = None, trials: int | None = None, trial_seed: int | None = None,
                        ) -> list[tuple[Any, int | None, int, dict[str, Any] | None]]:
    """expand_tasks' tuples plus each variant's draw (service/trials.py draw_record; None
    in a grid): with `trials`, N draws from `sets` seeded by `trial_seed` (default: the
    spec's seed), each drawn variant named `<name>-t<trial>-<values>`."""
    import copy

    from slurm_dlrm.service.trials import Range, draw_record, sample
    from slurm_dlrm.spec import parse_spec

    if not sets and not array:
        return [(spec, None, 0, None)]
    draws: dict[int, dict[str, Any]] = {}
    axes: list[list[tuple[str, Any]]]
    if trials is not None:
        check_trials(trials, any(isinstance(d, Range) for _, d in sets))
        check_variant_count([trials], len(array or ()))
        seed = int(trial_seed if trial_seed is not None else spec.seed or 0)
        drawn = sample(sets, trials, seed)
        draws = {i: draw_record(i, trials, values, sets, seed) for i, values in enumerate(drawn)}
        axes = [[("__trial__", i) for i in range(trials)]]
    else:
        check_variant_count([len(values) for _, values in sets], len(array or ()))
        axes = [[(k, v) for v in values] for k, values in sets]
    if array:
        axes.append([("__array__", i) for i in array])
    combos = [tuple(c for pair in combo for c in (_trial_pairs(pair, draws) if pair[0] == "__trial__" else [pair]))
              for combo in itertools.product(*axes)]
    base = spec.to_dict()
    out = []
    groups: dict[tuple[Any, ...], int] = {}
    for combo in combos:
        task = next((int(v) for k, v in combo if k == "__array__"), None)
        trial = next((int(v) for k, v in combo if k == "__trial__"), None)
        group = groups.setdefault(tuple(repr(v) for k, v in combo if k != "__array__"), len(groups))
        data = copy.deepcopy(base)
        labels = []
        for key, value in combo:
            if key == "__array__":
                # like SLURM_ARRAY_TASK_ID: the task index, and a seed of its own
                data["seed"] = int(base.get("seed") or 0) + int(value)
                labels.append(f"{value}")
            elif key == "__trial__":
                labels.append(f"t{value}")  # first: the name stays unique when cut to 64
            else:
                _assign(data, key, value, key)
                labels.append(_label(key, value))
        data["name"] = f"{name or spec.name}-{'-'.join(labels)}"[:64]
        # names the variant in its errors: each value cut short, as every error does
        src = f"{spec.source} [{', '.join(_where(k, v) for k, v in combo)}]"
        out.append((parse_spec(data, src), task, group, None if trial is None else draws[trial]))
    return out


# ---------------------------------------------------------------- a stopping rule (issue 47)



def parse_stop(text: str) -> tuple[str, str | None]:
    """`--stop asha[:METRIC]` -> ("asha", METRIC or None)."""
    from slurm_dlrm.adapt.asha import METRICS
    from slurm_dlrm.spec import SWEEP_STOPS

    rule, _, metric = text.strip().partition(":")
    if rule not in SWEEP_STOPS:
        raise BadInput(f"--stop {_cut(text)}: unknown stopping rule (one of {', '.join(SWEEP_STOPS)}, "
                       "e.g. asha or asha:ne)")
    if metric and metric not in METRICS:
        raise BadInput(f"--stop {_cut(text)}: unknown metric {_cut(metric)!r} (one of {', '.join(sorted(METRICS))})")
    return rule, metric or None


def default_min_steps(steps: int, reduction: int, eval_every_steps: int) -> int:
    """The first rung (adapt/asha.py's default_first_rung: three rungs, the last at half the
    steps), on the eval schedule where it is that long."""
    from slurm_dlrm.adapt.asha import default_first_rung

    raw = default_first_rung(steps, reduction)
    if eval_every_steps and raw >= eval_every_steps:
        raw -= raw % eval_every_steps
    return raw


def apply_stop_rule(variants: Sequence[Any], stop: str | None, sweep_id: str, where: str) -> list[Any]:
    """The variants (JobSpecs) with their sweep's stopping rule resolved: `--stop` over
    the spec's `sweep:` (its min_steps and reduction kept), defaults filled in, checked
    (BadInput naming what is wrong), and the sweep's id written into each."""
    import dataclasses

    from slurm_dlrm.adapt.asha import StopRule, rule_problem
    from slurm_dlrm.spec import SweepSpec

    given = [v.sweep for v in variants if v.sweep is not None]
    if not variants or (stop is None and not given):
        return list(variants)
    base = given[0] if given else SweepSpec()
    if stop is not None:
        rule_name, metric = parse_stop(stop)
        base = dataclasses.replace(base, stop=rule_name, metric=metric or base.metric)
    what = f"--stop {_cut(stop)}" if stop is not None else f"{where}: sweep"
    if len(variants) < 2:
        raise BadInput(f"{what}: a stopping rule needs a sweep of at least 2 variants (--set KEY=V1,V2 or --array); "
                       "this is one job")
    samples = held_out_samples(variants, what)
    out = []
    for v in variants:
        if v.steps is None:
            raise BadInput(f"{what}: {v.name}: needs steps (an epochs spec's length is known only once its data "
                           "is read)")
        if not v.eval.enabled:
            raise BadInput(f"{what}: {v.name}: the rule judges held-out evaluations; this spec has eval: false")
        own = v.sweep or base
        min_steps = own.min_steps or default_min_steps(int(v.steps), own.reduction, int(v.eval.every_steps))
        rule = StopRule(base.metric, min_steps, own.reduction, int(v.steps))
        problem = rule_problem(rule)
        if problem is not None:
            raise BadInput(f"{what}: {v.name}: {problem}")
        out.append(dataclasses.replace(v, eval=dataclasses.replace(v.eval, samples=samples),
                                       sweep=SweepSpec(base.stop, base.metric, min_steps, own.reduction, id=sweep_id)))
    return out


def held_out_samples(variants: Sequence[Any], what: str) -> int:
    """The one held-out set a sweep's variants are judged on, in samples per rank: the
    spec's `eval.samples`, else the largest variant's `eval.batches` x `batch_size` (no
    variant judged on fewer samples than it would have been alone). The same count for
    all makes the same examples (train/heldout.py), whatever each variant's batch size:
    with `eval.batches` each was judged on its own batches (tiny-a, 16 batches: planted
    AUC 0.7971 at batch 128 against 0.8023 at 512; 0.7948 for both with 8192 samples)."""
    given = sorted({int(v.eval.samples) for v in variants if v.eval.enabled and v.eval.samples is not None})
    if len(given) > 1:
        raise BadInput(f"{what}: eval.samples differs between variants ({', '.join(map(str, given))}); a sweep's "
                       "variants are judged on one held-out set")
    if given:
        return given[0]
    return max(int(v.eval.batches) * int(v.batch_size) for v in variants if v.eval.enabled) \
        if any(v.eval.enabled for v in variants) else 0


def new_sweep_id(name: str) -> str:
    """A sweep's id: its name and a random tag (two submits of one name are two sweeps)."""
    import secrets

    return f"{_SAFE.sub('_', name)[:48]}.{secrets.token_hex(4)}"
def _trial_pairs(pair: tuple[str, Any], draws: dict[int, dict[str, Any]]) -> list[tuple[str, Any]]:
    """A trial's axis entry as the (key, value) pairs it sets, behind its own marker."""
    trial = int(pair[1])
    return [pair, *draws[trial]["values"].items()]


def _where(key: str, value: Any) -> str:
    if key == "__array__":
        return f"array={value}"
    if key == "__trial__":
        return f"trial={value}"
    return f"{key}={_cut(str(value))}"


def record_draw(store: Any, job_id: int, draw: Any) -> None:
    """A `--trials` variant's draw as its `sweep_draw` event, in the caller's transaction
    (submit's record_rows, --no-pack's record_and_submit)."""
    if draw is None:
        return
    if not isinstance(draw, dict):
        raise BadInput(f"job row: draw must be a mapping, not {type(draw).__name__}")
    from slurm_dlrm.service.trials import draw_reason

    store.event_in_tx("sweep_draw", draw_reason(draw), job_id=job_id, data=draw)
