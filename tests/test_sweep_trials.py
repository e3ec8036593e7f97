"""Issue 47 item 2: `submit --trials N` draws N variants from ranges (service/trials.py),
records each draw, and refuses what cannot be sampled. No torch, no cluster."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from click.testing import CliRunner
from service_harness import make_site, write_site_file

from slurm_dlrm.cli import cli
from slurm_dlrm.errors import BadInput
from slurm_dlrm.service.sweep import parse_sets
from slurm_dlrm.service.trials import Range, parse_range, sample

pytest.importorskip("slurm_dlrm.estimate")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "sweep"


def test_ranges_parse_and_draw_inside_their_bounds():
    log = parse_range("lr=log:1e-4..1e-1", "log:1e-4..1e-1")
    uni = parse_range("x=uniform:-1..1", "uniform:-1..1")
    ints = parse_range("d=int:8..64", "int:8..64")
    assert parse_range("bs=256,512", "256,512") is None  # a value list, not a range
    assert (log, ints) == (Range("log", 1e-4, 0.1, "log:1e-4..1e-1"), Range("int", 8, 64, "int:8..64"))
    rng = random.Random(3)
    lrs = [log.draw(rng) for _ in range(2000)]
    assert all(1e-4 <= x <= 0.1 and float(f"{x:.4g}") == x for x in lrs)
    # log-uniform: about a third of the draws in each decade
    decades = [sum(1 for x in lrs if 10 ** -k <= x < 10 ** (-k + 1)) for k in (4, 3, 2)]
    assert all(560 < n < 780 for n in decades), decades
    dims = [ints.draw(rng) for _ in range(2000)]
    assert all(isinstance(d, int) for d in dims) and min(dims) == 8 and max(dims) == 64
    assert all(-1 <= uni.draw(rng) <= 1 for _ in range(100))


def test_the_same_seed_draws_the_same_trials_and_another_seed_others():
    space = parse_sets(["optimizer.lr=log:1e-4..1e-1", "batch_size=256,512,1024"], trials=8)
    assert space[1] == ("batch_size", [256, 512, 1024])
    a, b, c = sample(space, 8, 7), sample(space, 8, 7), sample(space, 8, 8)
    assert a == b and a != c and len(a) == 8
    assert all(k == ["optimizer.lr", "batch_size"] for k in ([key for key, _ in t] for t in a))
    assert {v for t in sample(space, 60, 1) for k, v in t if k == "batch_size"} == {256, 512, 1024}


@pytest.mark.parametrize(("sets", "trials", "what"), [
    (["optimizer.lr=log:0..1e-1"], 4, "LO > 0"),
    (["optimizer.lr=log:-1..1e-1"], 4, "LO > 0"),
    (["optimizer.lr=uniform:0.5..0.5"], 4, "below HI"),
    (["embedding_dim=int:64..8"], 4, "empty"),
    (["embedding_dim=int:8.5..64"], 4, "whole numbers"),
    (["optimizer.lr=log:1e-4"], 4, "two numbers"),
    (["optimizer.lr=uniform:nan..1"], 4, "two numbers"),
    (["batch_size=256,512"], 4, "no range"),
    ([], 4, "no range"),
    (["optimizer.lr=log:1e-4..1e-1"], 0, "1 to 1000"),
    (["optimizer.lr=log:1e-4..1e-1"], 1001, "1 to 1000"),
    (["optimizer.lr=log:1e-4..1e-1"], None, "add --trials"),
])
def test_what_cannot_be_sampled_is_bad_input(sets, trials, what):
    with pytest.raises(BadInput, match=what):
        parse_sets(sets, trials)


def test_a_grid_without_trials_is_what_it_was():
    assert parse_sets(["optimizer.lr=0.01,0.1", "bottom_mlp=[64,16],[128,16]"]) == [
        ("optimizer.lr", [0.01, 0.1]), ("bottom_mlp", [[64, 16], [128, 16]])]


@pytest.fixture
def env(tmp_path, monkeypatch):
    make_site(tmp_path)
    monkeypatch.setenv("SLURM_DLRM_SITE", str(write_site_file(tmp_path)))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


def test_submit_trials_records_each_draw_and_show_and_acct_say_where_a_variant_came_from(env):
    spec = str(EXAMPLES / "tiny-b.yaml")
    args = ["--trials", "6", "--trial-seed", "11", "--set", "optimizer.lr=log:1e-4..1e-1",
            "--set", "batch_size=256,512,1024"]
    r = run("submit", "--no-service", "--json", spec, *args)
    assert r.exit_code == 0, r.output
    jobs = json.loads(r.output)
    assert [j["name"].split("-")[2] for j in jobs] == [f"t{i}" for i in range(6)]
    lrs = [j["name"].split("-lr")[1].split("-")[0] for j in jobs]
    assert len(set(lrs)) == 6 and all(1e-4 <= float(x) <= 0.1 for x in lrs)
    again = json.loads(run("submit", "--test-only", "--json", spec, *args).output)
    assert [j["name"] for j in again] == [j["name"] for j in jobs]  # the seed draws the same variants
    d = json.loads(run("show", str(jobs[3]["job_id"]), "--json").output)
    assert d["draw"]["trial"] == 3 and d["draw"]["trials"] == 6 and d["draw"]["seed"] == 11
    assert d["draw"]["sampler"] == "random" and d["draw"]["space"]["optimizer.lr"] == "log:1e-4..1e-1"
    assert math.isclose(d["spec"]["optimizer"]["lr"], d["draw"]["values"]["optimizer.lr"])
    assert d["spec"]["batch_size"] == d["draw"]["values"]["batch_size"]
    text = run("show", str(jobs[3]["job_id"])).output
    assert "sweep_draw" in text and "trial 3 of 0..5: optimizer.lr=" in text and "seed 11" in text
    rows = json.loads(run("acct", "--sweep", "tiny-b", "--json").output)
    assert sorted(row["Trial"] for row in rows) == list(range(6)) and "optimizer.lr" in rows[0]["varied"]


@pytest.mark.parametrize("args", [
    ["--trials", "4", "--set", "optimizer.lr=log:0..1"],
    ["--trials", "0", "--set", "optimizer.lr=log:1e-4..1"],
    ["--set", "optimizer.lr=uniform:1e-4..1"],
    ["--trials", "4", "--set", "optimizer.lr=0.1,0.2"],
])
def test_submit_of_a_range_that_cannot_be_sampled_is_one_line_exit_2_and_records_nothing(env, args):
    r = run("submit", "--no-service", str(EXAMPLES / "tiny-b.yaml"), *args)
    assert r.exit_code == 2 and r.output.startswith("slurm-dlrm: error: --") and r.output.count("\n") == 1
    assert json.loads(run("queue", "--json", "--no-slurm", "--all").output)["jobs"] == []
