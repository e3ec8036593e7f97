"""The learned interference model, leave-jobs-out CV, model files, simulator truths."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_dlrm.cli import cli
from slurm_dlrm.errors import BadInput
from slurm_dlrm.interference_io import load_model, model_file_problem, parse_truth, save_model
from slurm_dlrm.packing.interference import (
    DEFAULT_PARAMS,
    CoLocationSample,
    InterferenceParams,
    SoloProfile,
    predict_speeds_from_fractions,
    util_fraction,
)
from slurm_dlrm.packing.interference_eval import (
    BASELINES,
    LEARNED_JOBS_OUT,
    cross_validate_jobs_out,
    evaluate,
    fold_of_jobs,
    job_key,
    model_predictor,
)
from slurm_dlrm.packing.learned import CORE_FEATURES, LearnedInterference, fit_learned
from slurm_dlrm.truth import NearestTable, SyntheticColocation, synthetic_groups

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def data() -> tuple[list[CoLocationSample], list[tuple[int, ...]]]:
    return synthetic_groups(1500, seed=4, jobs=150)


@pytest.fixture(scope="module")
def model(data) -> LearnedInterference:
    return fit_learned(data[0])


def _fractions(s: CoLocationSample) -> tuple[list[float], list[float]]:
    return [util_fraction(p.sm_util_pct) for p in s.members], [util_fraction(p.membw_util_pct) for p in s.members]


# ---------------------------------------------------------------- the model

def test_order_invariant_bounded_and_lone_member_is_1(data, model):
    rng = random.Random(1)
    for s in data[0][:200]:
        sm, bw = _fractions(s)
        speeds = model.speeds_from_fractions(sm, bw)
        assert all(0.0 < v <= 1.0 for v in speeds)
        order = list(range(len(sm)))
        rng.shuffle(order)
        shuffled = model.speeds_from_fractions([sm[i] for i in order], [bw[i] for i in order])
        assert shuffled == pytest.approx([speeds[i] for i in order])
    assert model.speeds_from_fractions([0.5], [0.5]) == [1.0]


def test_more_co_runner_load_never_speeds_a_member_up(model):
    rng = random.Random(2)
    for _ in range(300):
        n = rng.randint(2, 6)
        sm = [rng.uniform(0.02, 0.9) for _ in range(n)]
        bw = [rng.uniform(0.02, 0.9) for _ in range(n)]
        before = model.speeds_from_fractions(sm, bw)
        j = rng.randrange(1, n)  # raise co-runner j's load; member 0 must not get faster
        sm2, bw2 = list(sm), list(bw)
        sm2[j] = min(1.0, sm[j] + rng.uniform(0, 0.3))
        bw2[j] = min(1.0, bw[j] + rng.uniform(0, 0.3))
        assert model.speeds_from_fractions(sm2, bw2)[0] <= before[0] + 1e-12
        # and a newcomer neither
        grown = model.speeds_from_fractions(sm + [rng.uniform(0, 0.9)], bw + [rng.uniform(0, 0.9)])
        assert grown[0] <= before[0] + 1e-12


def test_learns_a_shape_that_is_not_its_prior(data, model):
    """On groups of jobs it never saw (another pool), far below the analytic model and
    the better naive baseline: the synthetic truth is not the analytic formula."""
    test, _ = synthetic_groups(600, seed=9, jobs=100)
    measured = [v for s in test for v in s.speeds]

    def mae(pred):
        return sum(abs(p - m) for p, m in zip(pred, measured, strict=True)) / len(measured)

    learned = mae([v for s in test for v in model.predict_profiles(s.members)])
    analytic = mae([v for s in test for v in model_predictor(DEFAULT_PARAMS)(s)])
    naive = min(mae([v for s in test for v in b(s)]) for b in BASELINES.values())
    assert learned <= 0.6 * naive
    assert learned < 0.5 * analytic


def test_optional_features_used_only_when_every_sample_has_them(data):
    plain = [CoLocationSample(tuple(SoloProfile(p.sm_util_pct, p.membw_util_pct) for p in s.members), s.speeds)
             for s in data[0][:300]]
    m = fit_learned(plain)
    assert m.full is None and m.optional_features == ()
    with_mem = fit_learned(data[0][:300])
    assert with_mem.optional_features == ("gpu_mem_gib", "others_gpu_mem_gib")
    # The planner's path (SM and bandwidth only) works with either.
    assert len(with_mem.speeds_from_fractions([0.3, 0.4], [0.2, 0.6])) == 2


def test_plugs_into_every_policy_through_interference_params(model):
    p = model.params()
    assert p.model_name == "learned" and p != DEFAULT_PARAMS and p.analytic() == DEFAULT_PARAMS
    assert predict_speeds_from_fractions([0.3, 0.4], [0.2, 0.6], p) == model.speeds_from_fractions([0.3, 0.4], [0.2, 0.6])


def test_exported_trees_round_trip_without_sklearn(tmp_path, model):
    path = tmp_path / "m.json"
    save_model(model, path)
    assert (path.stat().st_mode & 0o777) == 0o600
    code = ("import sys; sys.modules['sklearn'] = None\n"  # importing sklearn would now fail
            "from slurm_dlrm.interference_io import load_model\n"
            f"m = load_model({str(path)!r})\n"
            "print(m.speeds_from_fractions([0.3, 0.5, 0.1], [0.6, 0.1, 0.2]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)  # noqa: S603
    assert json.loads(out.stdout) == pytest.approx(model.speeds_from_fractions([0.3, 0.5, 0.1], [0.6, 0.1, 0.2]))
    loaded = load_model(path)
    assert loaded.info["training_groups"] == model.info["training_groups"]
    assert list(loaded.core.features) == list(CORE_FEATURES)


def test_cli_start_up_imports_no_sklearn():
    code = "import sys, slurm_dlrm.cli, slurm_dlrm.commands.interference; assert 'sklearn' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)  # noqa: S603


# ---------------------------------------------------------------- leave-jobs-out

def test_jobs_out_holds_out_every_group_of_a_held_out_job(data):
    samples = data[0][:400]
    seen: list[set[tuple[float, ...]]] = []

    def fit(train):
        jobs = {job_key(p) for s in train for p in s.members}
        seen.append(jobs)
        return model_predictor(DEFAULT_PARAMS)

    predicted = cross_validate_jobs_out(samples, 5, fit)
    fold = fold_of_jobs(samples, 5)
    for k, jobs in enumerate(seen):
        assert not any(fold[j] == k for j in jobs)  # no held-out job in the fit, in any group
    assert all(v == v for p in predicted for v in p)  # every member scored once (no NaN)
    assert fold == fold_of_jobs(samples, 5)  # deterministic


def test_eval_learned_json_has_both_cross_validations_and_sizes(tmp_path, data):
    path = tmp_path / "m.csv"
    rows = ["group,job,sm_util_pct,membw_util_pct,speed"]
    for g, (s, ids) in enumerate(zip(data[0][:250], data[1][:250], strict=True)):
        rows += [f"g{g},j{j},{p.sm_util_pct},{p.membw_util_pct},{v}" for p, v, j in zip(s.members, s.speeds, ids,
                                                                                         strict=True)]
    path.write_text("\n".join(rows) + "\n")
    r = CliRunner().invoke(cli, ["interference", "eval", "--samples", str(path), "--learned", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    for name in ("model_refit_cv", "model_refit_jobs_out", "learned_cv", "learned_jobs_out"):
        assert name in out["errors"]
        assert all(name in per for per in out["by_group_size"].values())
    assert out["errors"]["learned_jobs_out"]["mae"] < out["errors"]["baseline_inverse_load"]["mae"]
    text = CliRunner().invoke(cli, ["interference", "eval", "--samples", str(path), "--learned", "--folds", "3"])
    assert "learned, 3-fold jobs out" in text.output


def test_evaluate_learned_beats_naive_jobs_out(data):
    ev = evaluate(data[0][:600], folds=5, learned=True)
    naive = min(ev.overall[b].mae for b in BASELINES)
    assert ev.overall[LEARNED_JOBS_OUT].mae <= 0.6 * naive


# ---------------------------------------------------------------- interference fit and model files

def test_fit_writes_a_model_with_schema_features_size_and_cv(tmp_path, data):
    src = tmp_path / "s.jsonl"
    src.write_text("\n".join(json.dumps({"members": [{"sm_util_pct": p.sm_util_pct, "membw_util_pct": p.membw_util_pct}
                                                     for p in s.members], "speeds": list(s.speeds)})
                             for s in data[0][:200]) + "\n")
    out = tmp_path / "model.json"
    r = CliRunner().invoke(cli, ["interference", "fit", "--samples", str(src), "-o", str(out), "--folds", "3", "--json"])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.output)
    assert summary["training_groups"] == 200 and summary["cv"]["folds"] == 3
    doc = json.loads(out.read_text())
    assert doc["schema_version"] == 1 and doc["features"] == list(CORE_FEATURES)
    assert doc["cv"]["learned_jobs_out_mae"] < doc["cv"]["naive_mae"]
    assert not list(tmp_path.glob(".model.json.*"))  # no temporary left behind


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(schema_version=99), "schema version 99"),
    (lambda d: d.update(kind="something-else"), "not a slurm-dlrm interference model"),
    (lambda d: d["core"]["trees"][0][0].__setitem__(2, 10**6), "bad feature index or child link"),
    (lambda d: d["core"].__setitem__("features", ["sm"]), "features"),
])
def test_bad_model_files_exit_2_with_one_line(tmp_path, model, edit, message):
    doc = model.as_dict()
    edit(doc)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    path.chmod(0o600)
    r = CliRunner().invoke(cli, ["simulate", "-w", "benchmarks/sim/dlrm_mix.yaml", "-c",
                                 "benchmarks/sim/cluster_1gpu.yaml", "--plan-model", f"learned:{path}"])
    assert r.exit_code == 2
    assert message in r.output and str(path) in r.output
    assert len(r.output.strip().splitlines()) == 1


def test_corrupt_and_empty_model_files(tmp_path):
    for text, message in (("{not json", "corrupt model file"), ("", "corrupt model file")):
        path = tmp_path / "m.json"
        path.write_text(text)
        path.chmod(0o600)
        with pytest.raises(BadInput, match=message):
            load_model(path)


def test_foreign_owned_or_writable_model_files_are_refused(tmp_path, model):
    path = tmp_path / "m.json"
    save_model(model, path)
    path.chmod(0o620)
    with pytest.raises(BadInput, match="writable by group or others"):
        load_model(path)
    path.chmod(0o600)
    st = path.stat()
    assert model_file_problem(st, st.st_uid) is None
    assert "not by you" in (model_file_problem(st, st.st_uid + 12345) or "") or st.st_uid == 0
    fake = os.stat_result((st.st_mode, 0, 0, 1, 4242, 0, 10, 0, 0, 0))  # owned by uid 4242
    assert "owned by uid 4242" in (model_file_problem(fake, 1000) or "")
    root = os.stat_result((st.st_mode, 0, 0, 1, 0, 0, 10, 0, 0, 0))  # root's, 0600: fine
    assert model_file_problem(root, 1000) is None


def test_fit_bad_input(tmp_path):
    empty = tmp_path / "e.csv"
    empty.write_text("")
    r = CliRunner().invoke(cli, ["interference", "fit", "--samples", str(empty), "-o", str(tmp_path / "m.json")])
    assert r.exit_code == 2 and "no data" in r.output
    assert not (tmp_path / "m.json").exists()


# ---------------------------------------------------------------- simulator truths

def test_synthetic_truth_is_deterministic_order_free_and_not_the_formula():
    truth = SyntheticColocation()
    sm, bw = [0.6, 0.1, 0.3], [0.2, 0.7, 0.3]
    a = truth.speeds_from_fractions(sm, bw)
    b = truth.speeds_from_fractions(sm[::-1], bw[::-1])
    assert a == pytest.approx(b[::-1])
    assert all(0 < v <= 1 for v in a)
    assert truth.speeds_from_fractions([0.4], [0.4]) == [1.0]
    samples, _ = synthetic_groups(300, seed=3)
    refit = [abs(p - m) for s in samples for p, m in zip(model_predictor(DEFAULT_PARAMS)(s), s.speeds, strict=True)]
    assert sum(refit) / len(refit) > 0.05  # the analytic defaults do not describe it


def test_parse_truth_forms(tmp_path, model):
    assert parse_truth("analytic") == DEFAULT_PARAMS
    assert parse_truth("analytic:0.6,1.2,0.04") == InterferenceParams(0.6, 1.2, 0.04)
    assert isinstance(parse_truth("synthetic:3").speed_model, SyntheticColocation)
    table = tmp_path / "t.csv"
    table.write_text("group,sm_util_pct,membw_util_pct,speed\ng1,60,10,0.8\ng1,10,60,0.9\n")
    t = parse_truth(f"table:{table}")
    assert isinstance(t.speed_model, NearestTable)
    assert t.speed_model.speeds_from_fractions([0.12, 0.55], [0.58, 0.12]) == pytest.approx([0.9, 0.8])
    path = tmp_path / "m.json"
    save_model(model, path)
    assert parse_truth(f"learned:{path}").model_name == "learned"
    with pytest.raises(BadInput, match="one of analytic"):
        parse_truth("oracle")


def test_simulate_with_a_mismatched_truth(tmp_path):
    r = CliRunner().invoke(cli, ["simulate", "-w", "benchmarks/sim/dlrm_mix.yaml", "-c", "benchmarks/sim/cluster_1gpu.yaml",
                                 "-p", "complementary", "--truth", "synthetic", "--seed", "2", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["truth"] == "synthetic" and out["plan_model"] == "analytic"
    r2 = CliRunner().invoke(cli, ["simulate", "-w", "benchmarks/sim/dlrm_mix.yaml", "-c",
                                  "benchmarks/sim/cluster_1gpu.yaml", "-p", "complementary", "--seed", "2", "--json"])
    assert json.loads(r2.output)["policies"][0] != out["policies"][0]  # the truth changed the outcome
    r3 = CliRunner().invoke(cli, ["simulate", "-w", "benchmarks/sim/dlrm_mix.yaml", "-c",
                                  "benchmarks/sim/cluster_1gpu.yaml", "--plan-model", "synthetic"])
    assert r3.exit_code == 2 and "--plan-model" in r3.output


def test_predict_with_a_model_file(tmp_path, model):
    path = tmp_path / "m.json"
    save_model(model, path)
    r = CliRunner().invoke(cli, ["interference", "predict", "-m", "sm=70,bw=20", "-m", "sm=55,bw=60",
                                 "--model", str(path), "--json"])
    assert r.exit_code == 0, r.output
    got = [m["predicted_speed"] for m in json.loads(r.output)["groups"][0]["members"]]
    assert got == pytest.approx(model.predict_profiles([SoloProfile(70, 20), SoloProfile(55, 60)]))
    both = CliRunner().invoke(cli, ["interference", "predict", "-m", "sm=70,bw=20", "--model", str(path),
                                    "--params", "0,0,0"])
    assert both.exit_code == 2 and "not both" in both.output
