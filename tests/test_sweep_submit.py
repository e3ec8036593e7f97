"""`submit --stop asha[:METRIC]` and the spec's `sweep:` (issue 47): the rule resolved into
every variant's spec (defaults that suit the spec), the runner's eval schedule follows
the rungs, and bad input is one line, exit 2, nothing recorded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from service_harness import make_site, write_site_file

from slurm_dlrm.cli import cli

pytest.importorskip("slurm_dlrm.estimate")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "sweep"


@pytest.fixture
def env(tmp_path, monkeypatch):
    make_site(tmp_path)
    monkeypatch.setenv("SLURM_DLRM_SITE", str(write_site_file(tmp_path)))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def spec_file(tmp: Path, extra: str = "", steps: int = 600) -> Path:
    src = (EXAMPLES / "tiny-b.yaml").read_text().replace("name: tiny-b", "name: sw")
    src = "\n".join(line for line in src.splitlines() if not line.startswith("steps:"))
    p = tmp / "sw.yaml"
    p.write_text(f"{src}\nsteps: {steps}\neval: {{every_steps: 20, batches: 1}}\n{extra}")
    return p


def recorded() -> list[dict]:
    return json.loads(CliRunner().invoke(cli, ["queue", "--json", "--no-slurm", "--all"]).output)["jobs"]


def specs_of(r) -> list[dict]:
    from slurm_dlrm.site import load_site
    from slurm_dlrm.store.store import Store, current_user

    ids = [int(x) for x in r.output.split()]
    with Store.for_user(load_site(None), current_user(), readonly=True) as store:
        return [dict(store.get_job(i).spec) for i in ids]


def test_stop_option_resolves_the_rule_into_every_variant(env):
    r = CliRunner().invoke(cli, ["submit", "--no-service", "--parsable", str(spec_file(env)),
                                 "--set", "optimizer.lr=0.01,0.1,0.3", "--stop", "asha:ne"])
    assert r.exit_code == 0, r.output
    specs = specs_of(r)
    rules = [s["sweep"] for s in specs]
    assert len({r["id"] for r in rules}) == 1 and rules[0]["id"].startswith("sw.")  # one sweep
    # 600 // 18 = 33, on the eval schedule (every 20): 20; rungs 20, 60, 180
    assert rules[0] == {"stop": "asha", "metric": "ne", "min_steps": 20, "reduction": 3, "id": rules[0]["id"]}
    # the last of three rungs at half the steps (adapt/asha.py: curves cross late)
    from slurm_dlrm.adapt.asha import StopRule, rung_steps
    from slurm_dlrm.service.sweep import default_min_steps

    assert default_min_steps(5400, 3, 10) == 300 and rung_steps(StopRule("auc", 300, 3, 5400)) == (300, 900, 2700)
    assert default_min_steps(800, 2, 0) == 100  # reduction 2: 800 // 8, as before


def test_the_spec_sweep_section_is_the_rule_and_the_option_overrides_its_metric(env):
    spec = spec_file(env, "sweep: {stop: asha, min_steps: 50, reduction: 2}\n")
    r = CliRunner().invoke(cli, ["submit", "--no-service", "--parsable", str(spec), "--set", "seed=1,2"])
    assert r.exit_code == 0, r.output
    assert [(s["sweep"]["metric"], s["sweep"]["min_steps"], s["sweep"]["reduction"]) for s in specs_of(r)] == \
        [("auc", 50, 2)] * 2
    r = CliRunner().invoke(cli, ["submit", "--no-service", "--parsable", str(spec), "--set", "seed=1,2",
                                 "--stop", "asha:loss"])
    assert [s["sweep"]["metric"] for s in specs_of(r)] == ["loss"] * 2


@pytest.mark.parametrize(("extra", "args", "needle"), [
    ("sweep: {reduction: 1}\n", ["--set", "seed=1,2"], "sweep.reduction: must be >= 2, got 1"),
    ("sweep: {min_steps: 700}\n", ["--set", "seed=1,2"], "sweep.min_steps: must be below the spec's steps (600)"),
    ("sweep: {metric: acc}\n", ["--set", "seed=1,2"], "sweep.metric"),
    ("", ["--set", "seed=1,2", "--stop", "asha:acc"], "--stop asha:acc: unknown metric 'acc'"),
    ("", ["--set", "seed=1,2", "--stop", "hyperband"], "--stop hyperband: unknown stopping rule"),
    ("", ["--stop", "asha"], "--stop asha: a stopping rule needs a sweep of at least 2 variants"),
    ("sweep: {stop: asha}\n", [], "sweep: a stopping rule needs a sweep of at least 2 variants"),
    ("", ["--set", "seed=1,2", "--stop", "asha", "--no-pack"], "--stop: a stopping rule pauses members of packs"),
    ("", ["--set", "eval.samples=1000,2000", "--stop", "asha"],
     "--stop asha: eval.samples differs between variants (1000, 2000)"),
])
def test_bad_rules_exit_2_in_one_line_and_record_nothing(env, extra, args, needle):
    r = CliRunner().invoke(cli, ["submit", "--no-service", str(spec_file(env, extra)), *args])
    assert r.exit_code == 2 and needle in r.output and r.output.count("\n") == 1, r.output
    assert r.output.startswith("slurm-dlrm: error: ")
    assert recorded() == []


def test_the_variants_of_a_sweep_are_judged_on_one_held_out_set(env):
    """Issue 47: `eval.batches` batches of each variant's own batch size were different
    sets; the rule gives every variant one `eval.samples`: the spec's, else the largest
    variant's batches x batch size. Without a rule nothing changes."""
    r = CliRunner().invoke(cli, ["submit", "--no-service", "--parsable", str(spec_file(env)),
                                 "--set", "batch_size=128,512", "--stop", "asha"])
    assert r.exit_code == 0, r.output
    assert [(s["batch_size"], s["eval"]["samples"], s["eval"]["batches"]) for s in specs_of(r)] == \
        [(128, 512, 1), (512, 512, 1)]
    r = CliRunner().invoke(cli, ["submit", "--no-service", "--parsable", str(spec_file(env)),
                                 "--set", "batch_size=128,512", "--set", "eval.samples=1000", "--stop", "asha"])
    assert [s["eval"]["samples"] for s in specs_of(r)] == [1000, 1000]
    r = CliRunner().invoke(cli, ["submit", "--no-service", "--parsable", str(spec_file(env)),
                                 "--set", "batch_size=128,512"])
    assert ["samples" in s["eval"] for s in specs_of(r)] == [False, False]


def test_eval_disabled_or_no_steps_refuses_the_rule(env):
    spec = spec_file(env).read_text().replace("eval: {every_steps: 20, batches: 1}", "eval: false")
    (env / "noeval.yaml").write_text(spec)
    r = CliRunner().invoke(cli, ["submit", "--no-service", str(env / "noeval.yaml"), "--set", "seed=1,2",
                                 "--stop", "asha"])
    assert r.exit_code == 2 and "eval: false" in r.output, r.output
    assert recorded() == []


def test_the_runner_evaluates_at_every_rung():
    pytest.importorskip("torch")
    import yaml

    from slurm_dlrm.spec import parse_spec
    from slurm_dlrm.train.evaluation import Evaluator
    from slurm_dlrm.train.runner import sweep_rung_steps

    data = yaml.safe_load((EXAMPLES / "tiny-b.yaml").read_text())
    data.update(steps=1000, eval={"every_steps": 200}, sweep={"min_steps": 40, "reduction": 3, "id": "x.1"})
    spec = parse_spec(data)
    rungs = sweep_rung_steps(spec, 1000)
    assert rungs == {40, 120, 360}  # 1080 is past the end
    ev = Evaluator([], 200, 1000, extra_steps=rungs)
    assert [s for s in range(1, 1001) if ev.due(s)] == [40, 120, 200, 360, 400, 600, 800, 1000]
    assert sweep_rung_steps(parse_spec({**data, "sweep": None}), 1000) == frozenset()
