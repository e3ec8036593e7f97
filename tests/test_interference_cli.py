"""The interference model's validation tools: memory keys, sample files, `slurm-dlrm interference`."""

from __future__ import annotations

import json
import random
import runpy
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner
from service_harness import estimate_dict, spec_dict

from slurm_dlrm.cli import cli
from slurm_dlrm.packing import (
    CoLocationSample,
    InterferenceParams,
    SoloProfile,
    interference_model,
    predict_colocated_speeds,
    prediction_error,
)
from slurm_dlrm.packing.interference import _profile_of
from slurm_dlrm.packing.interference_eval import cross_validate, fold_of_groups, inverse_load

GIB = 1 << 30
MIB = 1 << 20


# ---------------------------------------------------------------- memory in any unit

@pytest.mark.parametrize("mem", [{"gpu_mem_bytes": 8 * GIB}, {"gpu_mem_mib": 8192}, {"gpu_mem_gib": 8},
                                 {"gpu_mem_gib": "8"}, {"gpu_mem_bytes": 8.0 * GIB}])
def test_profile_memory_from_any_unit_as_key(mem):
    assert _profile_of({"sm_util_pct": 30, "membw_util_pct": 10, **mem}) == SoloProfile(30, 10, 8 * GIB)


def test_profile_memory_from_any_unit_as_attribute():
    @dataclass
    class InMib:
        sm_util_pct: float
        membw_util_pct: float
        gpu_mem_mib: float

    @dataclass
    class InGib:
        sm_util_pct: float
        membw_util_pct: float
        gpu_mem_gib: float

    assert _profile_of(InMib(30, 10, 1536)).gpu_mem_bytes == 1536 * MIB
    assert _profile_of(InGib(30, 10, 1.5)).gpu_mem_bytes == 1536 * MIB
    # bytes win over the other units; no memory at all is 0
    assert _profile_of({"sm_util_pct": 1, "membw_util_pct": 1, "gpu_mem_bytes": 5, "gpu_mem_gib": 9}).gpu_mem_bytes == 5
    assert _profile_of({"sm_util_pct": 1, "membw_util_pct": 1, "gpu_mem_bytes": None, "gpu_mem_gib": 1}).gpu_mem_bytes == GIB
    assert _profile_of({"sm_util_pct": 1, "membw_util_pct": 1}).gpu_mem_bytes == 0


def test_memory_in_gib_decides_the_fit_like_bytes():
    members = [{"sm_util_pct": 60, "membw_util_pct": 30, "gpu_mem_gib": 50},
               {"sm_util_pct": 50, "membw_util_pct": 10, "gpu_mem_mib": 40 * 1024}]  # SMs over-subscribed
    assert interference_model(members, gpu_memory_bytes=80 * GIB) == [0.0, 0.0]
    fits = predict_colocated_speeds(members, gpu_memory_bytes=96 * GIB)
    assert fits == predict_colocated_speeds([SoloProfile(60, 30), SoloProfile(50, 10)])
    assert 0 < min(fits) < 1


# ---------------------------------------------------------------- sample files and the CLI

TRUTH = InterferenceParams(0.9, 0.25, 0.06)  # far from the defaults (0, 0, 0)
ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "docs" / "examples"


def synthetic(n_groups: int, seed: int, noise: float = 0.02) -> list[tuple[list[SoloProfile], list[float]]]:
    """Co-location groups whose speeds come from TRUTH times Gaussian noise."""
    rng = random.Random(seed)
    out = []
    for _ in range(n_groups):
        members = [SoloProfile(rng.uniform(5, 70), rng.uniform(5, 70), rng.choice((2, 6, 10)) << 30)
                   for _ in range(rng.choice((2, 2, 3, 4)))]
        speeds = [s * (1 + rng.gauss(0, noise)) for s in predict_colocated_speeds(members, TRUTH)]
        out.append((members, speeds))
    return out


def write_csv(path: Path, groups, rates_every: int = 0) -> Path:
    """One row per member; every `rates_every`-th row gives solo and co-located rates instead of speed."""
    lines = ["group,job,sm_util_pct,membw_util_pct,gpu_mem_gib,speed,solo_rate,colocated_rate"]
    row = 0
    for g, (members, speeds) in enumerate(groups):
        for i, (m, s) in enumerate(zip(members, speeds, strict=True)):
            row += 1
            mem = m.gpu_mem_bytes / GIB
            if rates_every and row % rates_every == 0:
                lines.append(f"g{g},j{i},{m.sm_util_pct!r},{m.membw_util_pct!r},{mem},,250,{250 * s!r}")
            else:
                lines.append(f"g{g},j{i},{m.sm_util_pct!r},{m.membw_util_pct!r},{mem},{s!r},,")
    path.write_text("\n".join(lines) + "\n")
    return path


def run(*args: str):
    result = CliRunner().invoke(cli, ["interference", *args])
    return result


def eval_json(*args: str) -> dict:
    result = run("eval", *args, "--json")
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def test_refit_recovers_known_constants_and_beats_the_baselines(tmp_path):
    path = write_csv(tmp_path / "m.csv", synthetic(60, seed=3), rates_every=4)
    out = eval_json("--samples", str(path), "--refit")
    fitted = out["refit"]["fitted_on_all"]
    assert fitted["alpha"] == pytest.approx(TRUTH.sm_contention, abs=0.15)
    assert fitted["beta"] == pytest.approx(TRUTH.membw_contention, abs=0.1)
    assert fitted["gamma"] == pytest.approx(TRUTH.per_client_overhead, abs=0.03)
    err = {name: e["mae"] for name, e in out["errors"].items()}
    # held-out error near the noise (2% of speeds < 1), well below the baselines and the
    # default constants, which were not the ones that made the data
    assert err["model_refit_cv"] < 0.02
    assert err["model_refit_cv"] < err["model"] / 2
    assert err["model_refit_cv"] < min(err["baseline_speed_1"], err["baseline_inverse_load"]) / 3
    assert out["refit"]["folds"] == 5 and len(out["refit"]["fold_params"]) == 5
    assert out["groups"] == 60


def test_eval_json_shape_and_figures_match_the_library(tmp_path):
    groups = synthetic(12, seed=8)
    path = write_csv(tmp_path / "m.csv", groups)
    out = eval_json("--samples", str(path), "--params", "0.9,0.25,0.06")
    assert set(out) == {"groups", "members", "params", "errors", "throughput_errors", "by_group_size", "source",
                        "default_params", "planner"}
    assert out["planner"]["model"] in out["planner"]["held_out_mae"] and out["planner"]["reason"]
    assert out["params"] == {"alpha": 0.9, "beta": 0.25, "gamma": 0.06} and out["default_params"] is False
    assert list(out["errors"]) == ["model", "baseline_speed_1", "baseline_inverse_load"]
    stats_keys = {"count", "mae", "median_abs", "p90_abs", "bias", "max_abs"}
    assert all(set(e) == stats_keys for e in out["errors"].values())
    assert all(set(e) == stats_keys and e["count"] == 12 for e in out["throughput_errors"].values())
    # the figures are the library's, on the same samples
    samples = [CoLocationSample(tuple(m), tuple(s)) for m, s in groups]
    assert out["errors"]["model"]["mae"] == pytest.approx(prediction_error(samples, TRUTH))
    signed = [p - m for s in samples for p, m in zip(predict_colocated_speeds(s.members, TRUTH), s.speeds, strict=True)]
    assert out["errors"]["model"]["bias"] == pytest.approx(sum(signed) / len(signed))
    assert out["errors"]["model"]["max_abs"] == pytest.approx(max(abs(e) for e in signed))
    ones = [1.0 - m for s in samples for m in s.speeds]
    assert out["errors"]["baseline_speed_1"]["bias"] == pytest.approx(sum(ones) / len(ones))
    per_gpu = sorted(abs(sum(predict_colocated_speeds(s.members, TRUTH)) - sum(s.speeds)) for s in samples)
    assert out["throughput_errors"]["model"]["mae"] == pytest.approx(sum(per_gpu) / 12)
    assert out["throughput_errors"]["model"]["median_abs"] == pytest.approx((per_gpu[5] + per_gpu[6]) / 2)
    sizes = {str(len(m)) for m, _ in groups}
    assert set(out["by_group_size"]) == sizes
    assert sum(v["model"]["count"] for v in out["by_group_size"].values()) == out["members"] == sum(
        len(m) for m, _ in groups)


def test_inverse_load_baseline():
    s = CoLocationSample((SoloProfile(60, 20), SoloProfile(30, 70)), (0.5, 0.5))
    assert inverse_load(s) == pytest.approx([1 / 1.3, 1 / 1.3])
    light = CoLocationSample((SoloProfile(20, 10), SoloProfile(10, 30)), (1.0, 1.0))
    assert inverse_load(light) == [1.0, 1.0]


def test_folds_hold_out_whole_groups_deterministically():
    samples = [CoLocationSample(tuple(m), tuple(s)) for m, s in synthetic(23, seed=1)]
    fold = fold_of_groups(samples, 5)
    assert fold == fold_of_groups(samples, 5)
    counts = [fold.count(k) for k in range(5)]
    assert max(counts) - min(counts) <= 1  # dealt round-robin
    predicted, params = cross_validate(samples, 5)
    assert len(params) == 5 and len(set(params)) == 5  # a different training set per fold
    for k in range(5):  # each held-out group is predicted by the fold that did not see it
        for s, p, f in zip(samples, predicted, fold, strict=True):
            if f == k:
                assert p == predict_colocated_speeds(s.members, params[k])
    with pytest.raises(ValueError):
        cross_validate(samples[:3], 5)


def test_jsonl_and_csv_examples_agree_and_are_reproducible(tmp_path):
    gen = runpy.run_path(str(EXAMPLES / "make_colocation_samples.py"))
    data = gen["groups"]()
    assert (EXAMPLES / "colocation_samples.csv").read_text() == gen["as_csv"](data), \
        "regenerate: python docs/examples/make_colocation_samples.py"
    assert (EXAMPLES / "colocation_samples.jsonl").read_text() == gen["as_jsonl"](data)
    a = eval_json("--samples", str(EXAMPLES / "colocation_samples.csv"), "--refit")
    b = eval_json("--samples", str(EXAMPLES / "colocation_samples.jsonl"), "--refit")
    a.pop("source"), b.pop("source")
    assert a == b
    assert a["errors"]["model_refit_cv"]["mae"] < a["errors"]["model"]["mae"]


def test_eval_table_names_every_predictor(tmp_path):
    result = run("eval", "--samples", str(EXAMPLES / "colocation_samples.csv"), "--refit", "--folds", "4")
    assert result.exit_code == 0, result.stderr
    for label in ("model ", "model refit, 4-fold groups out", "model refit, 4-fold jobs out", "baseline speed=1", "baseline 1/sum(max(sm,bw))",
                  "MAE of the relative speed by group size", "summed speed", "refit on all 16 groups: alpha=", "fold 4 of 4 held out"):
        assert label in result.stdout


def test_aliases_memory_units_json_array_and_single_member_groups(tmp_path):
    csv_path = tmp_path / "a.csv"
    csv_path.write_text("# measured on node7\ngroup,sm_pct,bw_pct,gpu_mem_mib,speed,notes\n"
                        "x,30,10,2048,0.9,first\nx,20,50,1024,0.8,\nlone,40,40,512,1.0,alone\n")
    json_path = tmp_path / "a.json"
    json_path.write_text(json.dumps([{"group": "x", "members": [
        {"sm_util_pct": 30, "membw_util_pct": 10, "gpu_mem_bytes": 2 * GIB, "speed": 0.9},
        {"sm_util_pct": 20, "membw_util_pct": 50, "gpu_mem_gib": 1, "solo_rate": 10, "colocated_rate": 8}]}]))
    r = run("eval", "--samples", str(csv_path), "--json")
    assert r.exit_code == 0, r.stderr
    assert "ignored field(s) not in the format: notes" in r.stderr
    assert "1 single-member group(s) skipped" in r.stderr
    a = json.loads(r.stdout)
    b = eval_json("--samples", str(json_path))
    a.pop("source"), b.pop("source")
    assert a == b and a["groups"] == 1


BAD = [
    ("a.csv", "group,sm_util_pct,membw_util_pct,speed\na,30,10,0.9\na,abc,10,0.8\n", "line 3: sm_util_pct: not a number"),
    ("a.csv", "group,sm_util_pct,membw_util_pct,speed\na,30,10,0.9\n\n# c\na,130,10,0.8\n",
     "line 5: sm_util_pct: must be <= 100"),
    ("a.csv", "group,sm_util_pct,membw_util_pct,speed\na,30,10,0.9\na,20,,0.8\n", "line 3: membw_util_pct: missing"),
    ("a.csv", "group,sm_util_pct,membw_util_pct,speed\na,30,10,0.9\na,20,10\n", "line 3: 3 fields, the header has 4"),
    ("a.csv", "group,sm_util_pct,membw_util_pct\na,30,10\n", "line 1: no 'speed' column"),
    ("a.csv", "group,sm_util_pct,speed\na,30,1\n", "line 1: no 'membw_util_pct' column"),
    ("a.csv", "group,sm_util_pct,sm_pct,membw_util_pct,speed\na,30,30,10,1\n", "line 2: sm_pct: give sm_util_pct"),
    ("a.csv", "group,sm_util_pct,membw_util_pct,speed,solo_rate,colocated_rate\na,30,10,0.9,,\na,20,10,,0,5\n",
     "line 3: solo_rate: must be > 0"),
    ("a.csv", "group,sm_util_pct,membw_util_pct,speed\na,30,10,nan\n", "line 2: speed: must be finite"),
    ("a.csv", "group,sm_util_pct,membw_util_pct,speed,gpu_mem_gib\na,30,10,1,-2\n", "line 2: gpu_mem_gib: must be >= 0"),
    ("a.csv", "group;sm_util_pct;membw_util_pct;speed\na;30;10;1\n", "line 1: the header has one column"),
    ("a.csv", "group,job,sm_util_pct,membw_util_pct,speed\na,j,30,10,1\nb,j,3,1,1\na,j,30,10,1\n",
     "line 4: job: 'j' appears twice in group 'a'"),
    ("a.csv", "group,sm_util_pct,membw_util_pct,speed,solo_rate,colocated_rate\na,30,10,1,,\na,20,10,0.9,10,9\n",
     "line 3: speed: give speed or solo_rate and colocated_rate, not both"),
    ("a.jsonl", '{"members": [{"sm_util_pct": 1, "membw_util_pct": 2}], "speeds": [1]}\n{"members": [\n',
     "line 2: not valid JSON"),
    ("a.jsonl", '{"members": [{"sm_util_pct": 1, "membw_util_pct": 2}, {"sm_util_pct": 1}], "speeds": [1, 1]}\n',
     "line 1: members[1]: membw_util_pct: missing"),
    ("a.jsonl", '\n{"members": [{"sm_util_pct": 1, "membw_util_pct": 2}], "speeds": [1, 2]}\n',
     "line 2: speeds: a list of one number per member"),
    ("a.jsonl", '{"members": [{"sm_util_pct": 1, "membw_util_pct": 2}, {"sm_util_pct": 1, "membw_util_pct": 2}]}\n',
     "line 1: members[0]: speed: missing"),
    ("a.jsonl", '{"members": [{"sm_util_pct": 1, "membw_util_pct": 2}], "speeds": [true]}\n',
     "line 1: speeds[0]: not a number"),
    ("a.csv", "", "no data"),
]


@pytest.mark.parametrize("name, text, message", BAD)
def test_bad_files_name_the_line_and_exit_2(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    result = run("eval", "--samples", str(path), "--json")
    assert result.exit_code == 2
    assert result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert f"{path}: {message}" in result.stderr
    assert result.stderr.startswith(f"slurm-dlrm: error: {path}")


@pytest.mark.parametrize("args, message", [
    ((), "give --samples FILE or --store DB"),
    (("--samples", "x.csv", "--folds", "3"), "--folds: only with --refit"),
    (("--samples", "x.csv", "--params", "1,2"), "--params: three numbers"),
    (("--samples", "x.csv", "--params", "1,-2,0"), "--params: beta: must be >= 0"),
    (("--samples", "/no/such.csv",), "cannot read"),
    (("--store", "/no/such.db",), "--store: no such file"),
])
def test_bad_eval_options(args, message):
    result = run("eval", *args)
    assert result.exit_code == 2 and result.stdout == ""
    assert message in result.stderr


def test_too_many_folds_is_refused(tmp_path):
    path = write_csv(tmp_path / "m.csv", synthetic(3, seed=2))
    result = run("eval", "--samples", str(path), "--refit", "--folds", "4")
    assert result.exit_code == 2 and "between 2 and the number of groups, 3" in result.stderr
    assert eval_json("--samples", str(path), "--refit")["refit"]["folds"] == 3  # the default shrinks to fit


def test_high_speeds_and_fractions_are_flagged(tmp_path):
    path = tmp_path / "f.csv"
    path.write_text("group,sm_util_pct,membw_util_pct,speed\na,0.3,0.1,2.5\na,0.2,0.5,0.9\n")
    result = run("eval", "--samples", str(path))
    assert result.exit_code == 0
    assert "1 member(s) measured above 1.5x" in result.stderr
    assert "fractions instead of percent" in result.stderr


# ---------------------------------------------------------------- predict

def test_predict_members_from_arguments():
    result = run("predict", "-m", "sm=70,bw=20,mem_gib=8", "-m", "sm_util_pct=15,bw=60,mem_mib=20480,job=emb",
                 "--json")
    assert result.exit_code == 0, result.stderr
    out = json.loads(result.stdout)
    (group,) = out["groups"]
    want = predict_colocated_speeds([SoloProfile(70, 20), SoloProfile(15, 60)])
    assert [m["predicted_speed"] for m in group["members"]] == pytest.approx(want)
    assert [m["job"] for m in group["members"]] == ["1", "emb"]
    assert [m["gpu_mem_bytes"] for m in group["members"]] == [8 * GIB, 20 * GIB]
    d = InterferenceParams()
    assert out["params"] == {"alpha": d.sm_contention, "beta": d.membw_contention, "gamma": d.per_client_overhead}
    # memory decides the fit
    over = json.loads(run("predict", "-m", "sm=70,bw=20,mem_gib=50", "-m", "sm=15,bw=60,mem_gib=40",
                          "--gpu-mem-gib", "80", "--json").stdout)
    assert [m["predicted_speed"] for m in over["groups"][0]["members"]] == [0.0, 0.0]


def test_predict_from_a_file_with_given_constants(tmp_path):
    groups = synthetic(4, seed=5)
    path = write_csv(tmp_path / "m.csv", groups)
    out = json.loads(run("predict", "-f", str(path), "--params", "0.9,0.25,0.06", "--json").stdout)
    assert len(out["groups"]) == 4
    for (members, speeds), g in zip(groups, out["groups"], strict=True):
        assert [m["predicted_speed"] for m in g["members"]] == pytest.approx(predict_colocated_speeds(members, TRUTH))
        assert [m["measured_speed"] for m in g["members"]] == pytest.approx(speeds)
    table = run("predict", "-f", str(path)).stdout
    assert table.splitlines()[0].split() == ["group", "job", "sm%", "bw%", "mem", "GiB", "predicted", "measured"]
    # profiles alone (no speed column) are enough to predict
    bare = tmp_path / "bare.csv"
    bare.write_text("group,sm_util_pct,membw_util_pct\na,30,10\na,20,50\n")
    assert run("predict", "-f", str(bare)).exit_code == 0


@pytest.mark.parametrize("args, message", [
    (("-m", "sm=30"), "bw= is required"),
    (("-m", "sm=30,bw=10,foo=1"), "unknown key 'foo'"),
    (("-m", "sm=30,bw=10,sm=4"), "sm given twice"),
    (("-m", "sm=30,bw"), "'bw' is not KEY=VALUE"),
    (("-m", "sm=300,bw=10"), "sm_util_pct: must be <= 100"),
    ((), "give the members with --member"),
    (("-m", "sm=3,bw=1", "--gpu-mem-gib", "0"), "--gpu-mem-gib: must be > 0"),
])
def test_predict_bad_members(args, message):
    result = run("predict", *args)
    assert result.exit_code == 2 and result.stdout == ""
    assert message in result.stderr


# ---------------------------------------------------------------- the store's own measurements

def test_eval_store_reads_the_agents_samples_like_the_service_refit(tmp_path):
    from slurm_dlrm.packing.interference import predict_speeds_from_fractions
    from slurm_dlrm.store import JobState, NewPlacement, PackState, Store
    from slurm_dlrm.store.colocations import store_colocation_samples

    profiles = {"fp-c": (70.0, 20.0), "fp-m": (20.0, 70.0), "fp-x": (50.0, 50.0), "fp-y": (35.0, 10.0)}
    solo_sps = {"fp-c": 2000.0, "fp-m": 800.0, "fp-x": 1200.0, "fp-y": 3000.0}
    db = tmp_path / "store.db"
    with Store(db) as store:
        def run_pack(n: int, fps: list[str]) -> None:
            ids = [int(store.add_job(user="u", name=f"j{n}-{i}", spec=spec_dict(f"j{n}-{i}"), spec_fingerprint=fp,
                                     estimate=estimate_dict(sm=profiles[fp][0], bw=profiles[fp][1]),
                                     gpu_model="h100")) for i, fp in enumerate(fps)]
            pid = store.add_pack(name=f"h{n}", user="u", policy="complementary", n_gpus=1,
                                 placements=[NewPlacement(job_id=j, node_index=0, gpu_index=0, cpus=2,
                                                          mps_thread_pct=100) for j in ids])
            store.transition_pack(pid, PackState.CANCELLED, "test history")
            for j in ids:
                store.transition_job(j, JobState.CANCELLED, "test history")
            rel = predict_speeds_from_fractions([profiles[fp][0] / 100 for fp in fps],
                                                [profiles[fp][1] / 100 for fp in fps], TRUTH) if len(fps) > 1 else [1.0]
            store.add_samples([{"t": 1000.0 * n + k, "pack_id": pid, "job_id": j, "node": "n1", "gpu_index": 0,
                                "samples_per_s": solo_sps[fp] * r} for k in range(3)
                               for j, fp, r in zip(ids, fps, rel, strict=True)])

        for n, fp in enumerate(profiles):
            run_pack(n, [fp])
        pairs = [("fp-c", "fp-m"), ("fp-c", "fp-x"), ("fp-m", "fp-x"), ("fp-x", "fp-x"), ("fp-c", "fp-c"),
                 ("fp-y", "fp-m"), ("fp-y", "fp-c", "fp-x")]
        for n, fps in enumerate(pairs, start=10):
            run_pack(n, list(fps))
        found = store_colocation_samples(store)
    assert len(found) == len(pairs)
    exact = eval_json("--store", str(db), "--params", "0.9,0.25,0.06")
    assert exact["groups"] == 7 and exact["members"] == 15
    assert exact["errors"]["model"]["max_abs"] < 1e-9  # the speeds were made by these constants
    assert exact["source"] == f"store {db}"
    fitted = eval_json("--store", str(db), "--refit", "--folds", "3")["refit"]["fitted_on_all"]
    assert fitted == pytest.approx({"alpha": 0.9, "beta": 0.25, "gamma": 0.06}, abs=0.02)
    table = run("eval", "--store", str(db))
    assert table.exit_code == 0 and "samples: 7 co-location groups, 15 members" in table.stdout


def test_eval_store_refuses_a_file_that_is_not_a_store(tmp_path):
    junk = tmp_path / "junk.db"
    junk.write_text("not sqlite at all " * 100)
    result = run("eval", "--store", str(junk))
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.startswith("slurm-dlrm: error: --store: ")


def test_eval_store_takes_the_store_folder(tmp_path):
    from slurm_dlrm.store import Store

    with Store(tmp_path / "store.sqlite"):
        pass
    result = run("eval", "--store", str(tmp_path))
    assert result.exit_code == 2  # an empty store: found, read, nothing to score
    assert "no co-location group with two or more members" in result.stderr
