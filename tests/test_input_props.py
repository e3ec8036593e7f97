"""Issue 32: a standing adversarial suite for what users write into specs, sweeps and
site files. Hypothesis generates hostile values (huge and negative numbers, inf/nan,
long and deep lists, alias bombs, long strings, raw YAML punctuation) and puts them
through `estimate` and `submit --test-only` (click's CliRunner, in-process). Every
answer is the documented one: exit 0, or exit 2 with one line `slurm-dlrm: error: ...`
on stderr, never a traceback; and each takes under 2 CPU seconds (CPU time of this
process, so a busy shared machine does not make it flaky), or 5 for specs at the size
limits, whose figure against the 2 s target is benchmarks/spec_limits.py's (1.9 CPU s
at worst, on a loaded machine). Example counts are small so the suite runs in seconds;
the reproductions of each item are tests/test_input_limits.py.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurm_dlrm.cli import cli

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "examples" / "sweep" / "tiny-a.yaml"
SITE = REPO / "site-config" / "site.toml"
CPU_LIMIT_S = 2.0
AT_LIMITS_CPU_S = 5.0  # a 2.5x margin over the benchmark's worst case

PROPS = settings(max_examples=int(__import__("os").environ.get("PROPS_EXAMPLES", "25")), deadline=None, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

# ---------------------------------------------------------------- hostile values

huge_ints = st.one_of(st.integers(), st.integers(min_value=2**40, max_value=2**70),
                      st.sampled_from([10**400, -(10**300), 2**53 + 1, 2**63, 0, -1]))
odd_floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1e300, -0.0, 5e-324]))
long_text = st.one_of(st.text(max_size=40), st.integers(1_000, 200_000).map(lambda n: "x" * n),
                      st.sampled_from(["a\0b", "\u202e", "$(id)", "'; rm -rf ~", "%j%N", "{user}"]))


class DeepList:
    """`[[[...1...]]]` nested `depth` deep, written into the YAML text as is (PyYAML's
    dumper itself recurses, so it cannot write one)."""

    def __init__(self, depth: int) -> None:
        self.depth = depth

    def __repr__(self) -> str:
        return f"DeepList({self.depth})"


def dump(data: dict[str, Any]) -> str:
    deep: list[DeepList] = []

    def mark(value: Any) -> Any:
        if isinstance(value, DeepList):
            deep.append(value)
            return f"__deep_{len(deep) - 1}__"
        if isinstance(value, dict):
            return {k: mark(v) for k, v in value.items()}
        if isinstance(value, list):
            return [mark(v) for v in value]
        return value

    text = yaml.safe_dump(mark(data), width=1 << 30)
    for i, d in enumerate(deep):
        text = text.replace(f"__deep_{i}__", "[" * d.depth + "1" + "]" * d.depth)
    return text


scalars = st.one_of(st.none(), st.booleans(), huge_ints, odd_floats, long_text)
hostile = st.one_of(
    scalars,
    st.lists(scalars, max_size=5),
    st.integers(1, 30_000).map(lambda n: [16] * n),  # a long MLP / list
    st.integers(1, 3_000).map(DeepList),  # deep nesting
    st.dictionaries(st.text(max_size=8), scalars, max_size=4),
)

BASE: dict[str, Any] = yaml.safe_load(TINY.read_text())
FIELDS = [k for k in BASE if k not in ("command", "custom_module")] + [
    "interaction", "loader_workers", "prefetch_batches", "world_size", "epochs", "scale", "preset", "data",
    "tables.0.rows", "tables.0.dim", "tables.0.pooling_factor", "tables.0.multi_hot", "tables.0.placement",
    "interaction.layers", "interaction.low_rank", "data.path", "command"]


def with_value(base: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    import copy

    data = copy.deepcopy(base)
    if dotted == "interaction.layers" or dotted == "interaction.low_rank":
        data["interaction"] = {"type": "dcn", dotted.split(".")[1]: value}
        return data
    if dotted == "data.path":
        data["data"] = {"type": "criteo-tsv", "path": value}
        return data
    cur: Any = data
    parts = dotted.split(".")
    for p in parts[:-1]:
        cur = cur[int(p)] if isinstance(cur, list) else cur[p]
    cur[parts[-1]] = value
    return data


def alias_bomb(levels: int, width: int) -> str:
    lines = [f"a0: &a0 [{', '.join(['x'] * width)}]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, levels)]
    return "\n".join(lines) + f"\nname: *a{levels - 1}\n"


# ---------------------------------------------------------------- the property

def invoke(args: list[str], tmp_path: Path, cpu_limit_s: float = CPU_LIMIT_S) -> Any:
    """Run the CLI in-process; assert the answer is 0, or 2 with one line; return it."""
    runner = CliRunner(env={"SLURM_DLRM_SITE": str(SITE), "SLURM_DLRM_STORE_DIR": str(tmp_path / "store"),
                            "HOME": str(tmp_path)})
    cpu0 = time.process_time()
    result = runner.invoke(cli, args, catch_exceptions=True)
    cpu_s = time.process_time() - cpu0
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        f"{type(result.exception).__name__}: {str(result.exception)[:300]}"
    assert result.exit_code in (0, 2), (result.exit_code, result.stderr[-1000:])
    if result.exit_code == 2:
        assert result.stderr.count("\n") == 1 and result.stderr.startswith("slurm-dlrm: error: "), \
            result.stderr[-1000:]
        # short: the path, the field, the reason and a value cut to about 60 characters
        assert len(result.stderr) < 600, result.stderr[:600]
    assert "Traceback" not in result.stderr
    assert cpu_s < cpu_limit_s, f"{cpu_s:.2f} CPU s for {' '.join(a[:40] for a in args)}"
    return result


@PROPS
@given(field=st.sampled_from(FIELDS), value=hostile)
def test_hostile_spec_fields_are_estimated_or_refused_in_one_line(tmp_path, field, value):
    path = tmp_path / "spec.yaml"
    path.write_text(dump(with_value(BASE, field, value)))
    invoke(["estimate", "--no-history", str(path)], tmp_path)


@PROPS
@given(text=st.lists(st.sampled_from(list("[]{}&*!|>:,-#'\"\\ \n\tabx019.e+") + ["<<: ", "*a", "&a ", "? "]),
                    max_size=300).map("".join))
def test_raw_yaml_punctuation_never_tracebacks(tmp_path, text):
    path = tmp_path / "spec.yaml"
    path.write_text("name: x\n" + text)
    invoke(["estimate", "--no-history", str(path)], tmp_path)


@PROPS
@given(levels=st.integers(2, 12), width=st.integers(2, 12))
def test_alias_fanout_is_counted_not_built(tmp_path, levels, width):
    path = tmp_path / "spec.yaml"
    path.write_text(alias_bomb(levels, width))
    result = invoke(["estimate", "--no-history", str(path)], tmp_path)
    assert result.exit_code == 2
    if width ** levels > 1_000_000:
        assert "once aliases are expanded" in result.stderr


@settings(PROPS, max_examples=8)
@given(tables=st.integers(1, 10_000), layers=st.integers(1, 100), world_size=st.sampled_from([1, 2, 8, 64]),
       dcn=st.booleans())
def test_specs_within_every_limit_estimate_under_the_budget(tmp_path, tables, layers, world_size, dcn):
    data = dict(BASE, tables=[{"name": f"t{i}", "rows": 1000 + i, "dim": 16} for i in range(tables)],
                bottom_mlp=[64] * (layers - 1) + [16], top_mlp=[64] * max(layers - 1, 1) + [1], world_size=world_size)
    if dcn:
        data["interaction"] = {"type": "dcn", "layers": layers, "low_rank": 64}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data, width=1 << 30))
    invoke(["estimate", "--no-history", str(path)], tmp_path, AT_LIMITS_CPU_S)


set_keys = st.one_of(st.sampled_from(["optimizer.lr", "batch_size", "seed", "tables.0.rows", "bottom_mlp", "name",
                                      "interaction", "tables.99.rows", "a.b.c", "steps"]),
                     st.text(alphabet="abc.0129_", min_size=1, max_size=30))
set_values = st.one_of(st.lists(st.one_of(st.integers(-5, 10**6).map(str), st.sampled_from(
    ["1e400", ".nan", "[1,[2,[3]]]", "{a: 1, a: 2}", "&a [*a]", "'x", "[" * 200, "9" * 5000, "null"])),
    min_size=1, max_size=40).map(",".join), long_text.filter(lambda s: "\0" not in s))


@PROPS
@given(sets=st.lists(st.tuples(set_keys, set_values), max_size=6),
       array=st.one_of(st.none(), st.text(alphabet="0123456789-:,%", max_size=25),
                       st.sampled_from(["0-3000000000", "9" * 5000, "0-999,0-999", "0-15:4", "1-0"])))
def test_hostile_sweeps_are_checked_before_they_are_built(tmp_path, sets, array):
    args = ["submit", "--test-only", str(TINY)]
    for key, values in sets:
        args += ["--set", f"{key}={values}"]
    if array is not None:
        args += ["--array", array]
    invoke(args, tmp_path)


SITE_KEYS = ["memory_margin_pct = 5.0", "round_batch_size = 16", "max_members_per_gpu = 8", "sample_interval_s = 2.0"]


@PROPS
@given(key=st.sampled_from(SITE_KEYS + ["names"]),
       value=st.one_of(st.sampled_from(["nan", "inf", "-inf", "1e308", "9" * 30, "9" * 5000, '"x"', "[" * 2000,
                                        "true", "-1", "0"]),
                       st.integers().map(str), st.floats(allow_nan=False, allow_infinity=False).map(repr)),
       hosts=st.one_of(st.integers(0, 10**12).map(lambda n: f"node[0-{n}]"),
                       st.text(alphabet="node[]0123456789,-", max_size=40)))
def test_hostile_site_values_are_one_line(tmp_path, key, value, hosts):
    text = SITE.read_text()
    if key == "names":
        start = text.index('names = "')
        end = text.index('"', start + len('names = "'))
        text = text[:start] + f'names = "{hosts}"' + text[end + 1:]
    else:
        text = text.replace(key, key.split(" = ")[0] + " = " + value, 1)
    site = tmp_path / "site.toml"
    site.write_text(text)
    invoke(["estimate", "--no-history", "--site", str(site), str(TINY)], tmp_path)
