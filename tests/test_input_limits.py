"""Issue 32 items 6-8: no spec, sweep or site file a user writes exhausts memory, hangs
`estimate`/`submit`, or ends in a traceback. Each reproduction runs the CLI in a child
process with a memory cap and a wall-clock guard, so the old code's slow or hungry path
fails the test (MemoryError, timeout) instead of hanging or swapping the machine; on
the current code each is refused (one line, exit 2) or estimated within seconds.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from slurm_dlrm.errors import BadInput, ConfigError, SpecError
from slurm_dlrm.site import expand_hostlist, load_site
from slurm_dlrm.spec import MAX_TABLES, load_spec
from slurm_dlrm.strict_load import InputLimitError, load_json, load_yaml

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "examples" / "sweep" / "tiny-a.yaml"
SITE = REPO / "site-config" / "site.toml"
CHILD_MEMORY_BYTES = 2 << 30  # the alias bomb took 3.6 GB before


@dataclass
class Run:
    rc: int
    stdout: str
    stderr: str
    cpu_s: float  # the child's own CPU seconds (user + system): robust on a busy machine
    wall_s: float


def run_cli(tmp_path: Path, *args: str, wall_limit_s: float = 60.0) -> Run:
    """`slurm-dlrm ARGS` in a child capped at CHILD_MEMORY_BYTES; fails the test past
    `wall_limit_s` (killing the child)."""
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "SLURM_DLRM_SITE": str(SITE),
           "SLURM_DLRM_STORE_DIR": str(tmp_path / "store")}

    def cap_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY_BYTES, CHILD_MEMORY_BYTES))

    start = time.monotonic()
    with out.open("wb") as fo, err.open("wb") as fe:
        proc = subprocess.Popen([sys.executable, "-m", "slurm_dlrm", *args], stdout=fo, stderr=fe,  # noqa: S603
                                env=env, cwd=tmp_path, preexec_fn=cap_memory)
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() - start > wall_limit_s:
                proc.kill()
                os.wait4(proc.pid, 0)
                pytest.fail(f"slurm-dlrm {' '.join(a[:40] for a in args)}: still running after {wall_limit_s:.0f} s")
            time.sleep(0.02)
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
    return Run(proc.returncode, out.read_text(), err.read_text(), usage.ru_utime + usage.ru_stime,
               time.monotonic() - start)


def assert_refused(run: Run, *needles: str) -> None:
    """One line on stderr, exit 2, no traceback, nothing on stdout."""
    assert run.rc == 2, (run.rc, run.stderr[-2000:])
    assert run.stderr.count("\n") == 1 and run.stderr.startswith("slurm-dlrm: error: "), run.stderr[-2000:]
    assert "Traceback" not in run.stderr and run.stdout == ""
    assert len(run.stderr) < 400, run.stderr[:400]
    for needle in needles:
        assert needle in run.stderr, run.stderr


def spec_text(tables: int = 1, *, bottom_mlp: str = "[64, 16]", extra: str = "", rows: int = 10,
              dim: int = 16) -> str:
    rows_text = "".join(f"  - {{name: t{i}, rows: {rows}, dim: {dim}}}\n" for i in range(tables))
    return (f"name: big\ntables:\n{rows_text}dense_features: 13\nbottom_mlp: {bottom_mlp}\ntop_mlp: [64, 1]\n"
            f"batch_size: 512\noptimizer: {{type: adagrad}}\nsteps: 10\n{extra}")


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# ---------------------------------------------------------------- item 6: YAML aliases

def alias_bomb(levels: int = 9) -> str:
    """`name: *a8` where each anchor is ten of the one before: 10^9 leaves in 500 bytes."""
    lines = ["a0: &a0 [" + ",".join(["x"] * 10) + "]"]
    lines += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, levels)]
    return "\n".join(lines) + f"\nname: *a{levels - 1}\n"


def test_alias_bomb_spec_is_refused_in_one_line_without_building_it(tmp_path):
    path = write(tmp_path, "bomb.yaml", alias_bomb())
    run = run_cli(tmp_path, "estimate", path, wall_limit_s=30)
    assert_refused(run, "bomb.yaml: spec: more than 1,000,000 values once aliases are expanded")
    with pytest.raises(InputLimitError):
        load_yaml(alias_bomb())


def test_aliases_within_the_budget_still_load():
    # a spec may share one table's settings: anchors and merge keys stay usable
    text = "common: &c {rows: 1000, dim: 16}\ntables: [{<<: *c, name: a}, {<<: *c, name: b}, *c]\n"
    assert load_yaml(text)["tables"][2] == {"rows": 1000, "dim": 16}
    with pytest.raises(InputLimitError, match="alias \\*a inside its own anchor"):
        load_yaml("a: &a [1, *a]\n")


def test_an_error_never_prints_a_whole_value(tmp_path):
    # under the alias budget, but a value far longer than a line: the error cuts it
    big = "[" + ",".join(["1234567890"] * 50_000) + "]"
    path = write(tmp_path, "long.yaml", spec_text(extra=f"seed: {big}\n"))
    with pytest.raises(SpecError) as exc:
        load_spec(path)
    assert "seed: must be an integer, got list [" in str(exc.value) and len(str(exc.value)) < 300
    assert_refused(run_cli(tmp_path, "estimate", path), "seed: must be an integer")


@pytest.mark.parametrize(("suffix", "text", "needle"), [
    (".yaml", "name: " + "[" * 5000 + "]" * 5000 + "\n", "nest"),  # was a RecursionError traceback
    (".yaml", "name: x\nseed: " + "[" * 100 + "]" * 100 + "\n", "nested deeper than 64 levels"),
    (".json", '{"name": ' + "[" * 5000 + "]" * 5000 + "}", "nested deeper than 64 levels"),
    (".yaml", "name: x\nseed: " + "9" * 5000 + "\n", "a value cannot be read"),  # int() past 4,300 digits
    (".json", '{"name": "x", "seed": ' + "9" * 5000 + "}", "a value cannot be read"),
    (".yaml", "name: x\nseed: 2024-13-45\n", "a value cannot be read"),  # a timestamp that is no date
])
def test_deep_nesting_and_unreadable_values_are_one_line(tmp_path, suffix, text, needle):
    path = write(tmp_path, f"s{suffix}", text)
    with pytest.raises(SpecError, match=needle):
        load_spec(path)
    assert_refused(run_cli(tmp_path, "estimate", path), needle)


def test_a_long_unknown_key_is_cut_in_the_error(tmp_path):
    # an explicit key (`? KEY`): YAML's implicit keys stop at 1,024 characters
    path = write(tmp_path, "s.yaml", spec_text(extra="? " + "x" * 100_000 + "\n: 1\n"))
    assert_refused(run_cli(tmp_path, "estimate", path), ": " + "x" * 60 + "...: unknown field")
    site = write(tmp_path, "site.toml", SITE.read_text().replace("[packing]", "[packing]\n" + "k" * 100_000 + " = 1", 1))
    assert_refused(run_cli(tmp_path, "estimate", "--site", site, str(TINY)), "packing." + "k" * 60 + "...: unknown key")


def test_an_error_quoting_user_text_stays_one_line(tmp_path):
    # a --set value and a file name with a newline (or a right-to-left override) in them
    assert_refused(run_cli(tmp_path, "submit", "--test-only", str(TINY), "--set", "optimizer.lr=0\x1f\n0"),
                   "optimizer.lr=0\\x1f\\n0")
    odd = write(tmp_path, "a\nb\u202e.yaml", "name: [1]\n")
    assert_refused(run_cli(tmp_path, "estimate", odd), "a\\nb\\u202e.yaml: name: must be a string")


def test_json_nesting_limit_matches_yaml():
    assert load_json("[" * 64 + "]" * 64) is not None
    with pytest.raises(InputLimitError, match="nested deeper than 64"):
        load_json("[" * 65 + "]" * 65)


def test_a_spec_file_past_the_size_limit_is_refused_unread(tmp_path):
    path = tmp_path / "huge.yaml"
    with path.open("w") as f:
        f.write(spec_text())
        f.write("#" * (5 << 20) + "\n")
    with pytest.raises(SpecError, match="larger than 4 MiB"):
        load_spec(path)
    # both commands read at most the limit (submit read it whole); /dev/zero, which never
    # ends, is refused before any read (issue 43 item 4: a regular file only)
    for argv in (["estimate", str(path)], ["submit", "--test-only", str(path)]):
        assert_refused(run_cli(tmp_path, *argv, wall_limit_s=30), "larger than 4 MiB")
    for argv in (["estimate", "/dev/zero"], ["submit", "--test-only", "/dev/zero"]):
        assert_refused(run_cli(tmp_path, *argv, wall_limit_s=30), "a character device, not a regular file")


def test_a_spec_that_is_a_fifo_is_refused_without_blocking(tmp_path):
    # issue 43 item 4: open() of a FIFO with no writer blocked submit and estimate for ever
    fifo = tmp_path / "spec.yaml"
    os.mkfifo(fifo)
    for argv in (["estimate", str(fifo)], ["submit", "--test-only", str(fifo)], ["submit", "--test-only", "./spec.yaml"]):
        assert_refused(run_cli(tmp_path, *argv, wall_limit_s=30), "spec.yaml: it is a FIFO, not a regular file")
    with pytest.raises(SpecError, match="a directory, not a regular file"):
        load_spec(tmp_path)


# ---------------------------------------------------------------- item 7: sweeps

@pytest.mark.parametrize(("args", "needle"), [
    (["--array", "0-3000000000"], "at most 4,000,000"),
    (["--array", "9" * 5000], "at most 4,000,000"),  # int() of 5,000 digits was a traceback
    (["--array", "0-2000000"], "tasks or more; at most 1000"),
    (["--array", "0-999,0-999"], "tasks or more; at most 1000"),
    ([arg for k in ("optimizer.lr", "batch_size", "seed", "steps", "dense_features", "metrics_every_steps")
      for arg in ("--set", f"{k}=" + ",".join(str(v) for v in range(1, 61)))],
     "60 x 60 x 60 x 60 x 60 x 60 = 46,656,000,000 variants of one spec; at most 1000"),
    (["--set", "seed=" + ",".join(map(str, range(200))), "--array", "0-9"], "200 x 10 = 2,000 variants"),
    (["--set", "seed=[" + ", ".join(["&a0 [1,1,1,1,1,1,1,1,1,1]"] + [f"&a{i} [" + ",".join([f"*a{i - 1}"] * 10) + "]"
                                      for i in range(1, 9)]) + "]"], "more than 10,000 values"),
])
def test_sweep_sizes_are_checked_before_anything_is_built(tmp_path, args, needle):
    run = run_cli(tmp_path, "submit", "--test-only", str(TINY), *args, wall_limit_s=30)
    assert_refused(run, needle)


def test_a_set_value_alias_bomb_is_refused():
    from slurm_dlrm.service.sweep import parse_sets

    anchors = ["&a0 [1,1,1,1,1,1,1,1,1,1]"] + [f"&a{i} [" + ",".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]
    with pytest.raises(BadInput, match="more than 10,000 values") as exc:
        parse_sets(["seed=[" + ", ".join(anchors) + "]"])
    assert len(str(exc.value)) < 300
    assert parse_sets(["bottom_mlp=[64,16],[128,16]"]) == [("bottom_mlp", [[64, 16], [128, 16]])]


def test_array_counts_match_sbatch_forms():
    from slurm_dlrm.service.sweep import parse_array

    assert parse_array("0-15:4") == [0, 4, 8, 12]
    assert parse_array("1,3,5%2") == [1, 3, 5]
    assert parse_array("0-999") == list(range(1000))
    assert parse_array("3,3") == [3]


# ---------------------------------------------------------------- item 8: spec sizes

@pytest.mark.parametrize(("extra", "bottom_mlp", "needle"), [
    ("interaction: {type: dcn, layers: 100000000}\n", "[16]", "interaction.layers: must be <= 100"),
    ("interaction: {type: dcn, layers: 1.0e+8}\n", "[16]", "interaction.layers: must be <= 100"),
    ("loader_workers: 100000\n", "[16]", "loader_workers: must be <= 1,024"),
    ("prefetch_batches: 100000\n", "[16]", "prefetch_batches: must be <= 1,024"),
    ("world_size: 100000\n", "[16]", "world_size: must be <= 64"),
    ("batch_size: 1.0e+300\n", "[16]", "batch_size: must be <= 16,777,216"),
    ("", "[" + ",".join(["16"] * 20_000) + "]", "bottom_mlp: at most 100 layers, got 20,000"),
    ("", "[1048577, 16]", "bottom_mlp[0]: must be <= 1,048,576"),
    ("seed: 9007199254740993\n", "[16]", "seed: must be <= 9,007,199,254,740,992"),
    ("command: [" + ",".join(["x"] * 5000) + "]\n", "[16]", "command: at most 4,096 arguments"),
    ('command: ["a\\0b"]\n', "[16]", "command[0]: must not contain a NUL"),
    ("data: {type: criteo-tsv, path: '" + "p" * 5000 + "'}\n", "[16]", "data.path: must be at most 4,096"),
])
def test_every_spec_size_has_a_limit(tmp_path, extra, bottom_mlp, needle):
    text = spec_text(bottom_mlp=bottom_mlp, extra=extra).replace("batch_size: 512\n", "") \
        if "batch_size" in extra else spec_text(bottom_mlp=bottom_mlp, extra=extra)
    path = write(tmp_path, "s.yaml", text)
    with pytest.raises(SpecError, match=needle.replace("[", "\\[")):
        load_spec(path)
    assert_refused(run_cli(tmp_path, "estimate", path, wall_limit_s=30), needle)


@pytest.mark.parametrize(("field", "value"), [("rows", 10**400), ("dim", 70_000)])
def test_table_sizes_have_limits(tmp_path, field, value):
    # rows of 10^400 reached float() in the UVM cache figure: OverflowError traceback
    text = spec_text(**{field: value}).replace("dim: 16}", "dim: 16, placement: uvm}")
    path = write(tmp_path, "s.yaml", text)
    assert_refused(run_cli(tmp_path, "estimate", path), f"tables[0].{field}: must be <=")


def test_more_tables_than_the_limit_are_refused(tmp_path):
    path = write(tmp_path, "s.yaml", spec_text(MAX_TABLES + 1))
    assert_refused(run_cli(tmp_path, "estimate", path), f"tables: at most 10,000 tables, got {MAX_TABLES + 1:,}")


def test_estimate_of_the_most_tables_allowed_is_linear(tmp_path):
    """10,000 tables of 10 rows ran past 2 minutes (a quadratic membership test per
    table, and fit advice estimating once per table). The bound is the child's own CPU
    seconds, with a wide margin: a shared busy machine slows wall time, not CPU time
    much; benchmarks/spec_limits.py prints the figures against the 2 s target."""
    path = write(tmp_path, "s.yaml", spec_text(MAX_TABLES))
    run = run_cli(tmp_path, "estimate", "--json", "--no-history", path, wall_limit_s=90)
    # 10,000 one-hot tables make the dot interaction's top MLP input 50 M wide: it fits
    # no GPU, so fit advice runs too (the path that estimated once per table); the
    # estimate itself is printed first, as for any spec that fits no GPU
    assert run.rc == 2 and "fits no GPU" in run.stderr and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert run.cpu_s < 8, f"{run.cpu_s:.1f} CPU s"


def test_dcn_and_deep_mlps_at_their_limits_estimate_quickly(tmp_path):
    mlp = "[" + ",".join(["256"] * 99 + ["16"]) + "]"
    text = spec_text(8, bottom_mlp=mlp, extra="interaction: {type: dcn, layers: 100, low_rank: 64}\nworld_size: 8\n")
    text = text.replace("top_mlp: [64, 1]", "top_mlp: [" + ",".join(["256"] * 99 + ["1"]) + "]")
    path = write(tmp_path, "s.yaml", text)
    run = run_cli(tmp_path, "estimate", "--json", "--no-history", path, wall_limit_s=90)
    assert run.rc == 0, run.stderr[-2000:]
    assert run.cpu_s < 8, f"{run.cpu_s:.1f} CPU s"


def test_fit_advice_names_tables_to_move_with_few_estimates(monkeypatch):
    """The UVM advice is a binary search over how many of the largest tables move: the
    old loop estimated once per table moved (here about a thousand estimates of 2,000
    tables, with a quadratic pass in each). Still the fewest that fit."""
    import dataclasses

    from slurm_dlrm.estimate import analytic, copies_per_gpu, fit
    from slurm_dlrm.spec import parse_spec

    site = load_site(SITE)
    gpu = max(site.gpu_models.values(), key=lambda g: g.memory_bytes)
    n = 2000
    rows = int(gpu.memory_bytes * 2 / n / (16 * 8))  # weights + Adagrad state of all: about 2 GPUs
    spec = parse_spec({"name": "x", "tables": [{"name": f"t{i}", "rows": rows + i, "dim": 16} for i in range(n)],
                       "dense_features": 13, "bottom_mlp": [16], "top_mlp": [16, 1], "batch_size": 64,
                       "interaction": {"type": "dcn", "layers": 2, "low_rank": 16}, "optimizer": {"type": "adagrad"}})

    def fits_with_largest_moved(k: int) -> bool:
        moved = [dataclasses.replace(t, placement="uvm") if i >= n - k else t for i, t in enumerate(spec.tables)]
        return copies_per_gpu(real(dataclasses.replace(spec, tables=tuple(moved)), gpu), gpu, 5.0).fits

    calls = []
    real = analytic.estimate
    monkeypatch.setattr(analytic, "estimate", lambda *a, **k: calls.append(1) or real(*a, **k))
    advice = fit.fit_advice(spec, gpu, 5.0, max_gpus=1)
    assert len(calls) < 80, len(calls)
    uvm = [a for a in advice if a.startswith("placement: uvm for tables t1999, t1998, ")]
    assert len(uvm) == 1, advice
    fewest = 10 + int(uvm[0].split(" and ")[1].split(" more")[0])
    assert 100 < fewest < n and fits_with_largest_moved(fewest) and not fits_with_largest_moved(fewest - 1)


# ---------------------------------------------------------------- site files

@pytest.mark.parametrize(("patch", "needle"), [
    (("names = \"", "names = \"node[0-999999999],"), "names more than 100,000 hosts"),
    (("names = \"", "names = \"node[" + "9" * 5000 + "],"), "bad hostlist range"),
    (("memory_margin_pct = 5.0", "memory_margin_pct = nan"), "must be a finite number"),
    (("round_batch_size = 16", "round_batch_size = " + "9" * 30), "must be at most 9,007,199,254,740,992"),
    (("round_batch_size = 16", "round_batch_size = " + "9" * 5000), "not valid TOML"),
    (("[packing]", "[packing]\nx = " + "[" * 3000 + "]" * 3000), "nested too deep"),
])
def test_site_file_sizes_have_limits(tmp_path, patch, needle):
    text = SITE.read_text()
    assert patch[0] in text
    site = write(tmp_path, "site.toml", text.replace(patch[0], patch[1], 1))
    with pytest.raises(ConfigError, match=needle.replace("[", "\\[")):
        load_site(site)
    run = run_cli(tmp_path, "estimate", "--site", site, str(TINY), wall_limit_s=30)
    assert_refused(run, needle)


def test_hostlists_expand_as_before():
    assert expand_hostlist("node[1-3,7],gpu01") == ["node1", "node2", "node3", "node7", "gpu01"]
    assert expand_hostlist("n[01-02]x") == ["n01x", "n02x"]
    assert len(expand_hostlist("n[0-99999]")) == 100_000
    with pytest.raises(ValueError, match="more than 100,000"):
        expand_hostlist("n[0-99999],m")


def test_rank_tables_heap_places_tables_as_the_scan_of_every_rank_did():
    """rank_tables keeps the ranks' costs in a heap (64 ranks x 10,000 tables scanned
    every rank per table); the placement is the old scan's, ties to the lowest rank."""
    import random

    from slurm_dlrm.estimate.analytic import _table_total_bytes, rank_tables
    from slurm_dlrm.spec import parse_spec

    rng = random.Random(32)
    for world_size in (2, 3, 8, 64):
        spec = parse_spec({"name": "x", "dense_features": 13, "bottom_mlp": [16], "top_mlp": [16, 1],
                           "batch_size": 64, "optimizer": {"type": "adagrad"}, "world_size": world_size,
                           "tables": [{"rows": rng.choice([10, 1000, 10**6]), "dim": 16,
                                       "pooling_factor": rng.choice([1.0, 1.0, 2.5, 20.0])} for _ in range(500)]})
        cost = [0.0] * world_size
        owned: list[list[int]] = [[] for _ in range(world_size)]
        for i in sorted(range(len(spec.tables)), key=lambda i: -_table_total_bytes(spec, i)):
            r = cost.index(min(cost))
            cost[r] += spec.tables[i].dim * 4 * (1 + 0.5 * spec.tables[i].ids_per_sample)
            owned[r].append(i)
        assert rank_tables(spec) == [sorted(o) for o in owned]


def test_the_pure_python_loader_keeps_the_same_limits(monkeypatch):
    """Where PyYAML has no libyaml, the pure-Python parser and composer run: the limits
    are checked on its events the same way (its composer recurses, so depth matters)."""
    from slurm_dlrm import strict_load

    monkeypatch.setattr(strict_load, "_CLoader", None)
    monkeypatch.setattr(strict_load, "_STRICT_C", None)
    with pytest.raises(InputLimitError, match="once aliases are expanded"):
        load_yaml(alias_bomb())
    with pytest.raises(InputLimitError, match="nested deeper than 64"):
        load_yaml("name: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(InputLimitError, match="a value cannot be read"):
        load_yaml("seed: " + "9" * 5000 + "\n")
    assert load_yaml(TINY.read_text()) == strict_load.yaml.safe_load(TINY.read_text())
