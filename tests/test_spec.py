import copy
import json

import pytest

from slurm_dlrm.errors import SpecError
from slurm_dlrm.presets import (
    CRITEO_KAGGLE_ROWS,
    CRITEO_TB10M_ROWS,
    CRITEO_TB40M_ROWS,
    MLPERF_DCNV2_ROWS,
    PRESET_NAMES,
)
from slurm_dlrm.spec import load_spec, parse_spec, spec_fingerprint

GOOD = {
    "name": "tiny-a",
    "tables": [{"rows": 1000, "dim": 16}, {"name": "u", "rows": 50, "dim": 16, "multi_hot": 3, "dtype": "fp16"}],
    "dense_features": 13,
    "bottom_mlp": [64, 16],
    "top_mlp": [32, 1],
    "interaction": {"type": "dot"},
    "batch_size": 256,
    "optimizer": {"type": "rowwise_adagrad", "lr": 0.01},
}


def good():
    return copy.deepcopy(GOOD)


def test_good_spec_parses_with_defaults():
    s = parse_spec(good())
    assert s.tables[0].name == "t0" and s.tables[0].pooling_factor == 1.0 and s.tables[0].placement == "hbm"
    assert s.tables[1].multi_hot == 3 and s.tables[1].pooling_factor is None and s.tables[1].dtype_bytes == 2
    assert s.optimizer.fused is True and s.steps == 1000 and s.world_size == 1
    assert parse_spec(s.to_dict()) == s


@pytest.mark.parametrize(
    "preset, rows, dim, gib",
    [
        ("criteo-kaggle", CRITEO_KAGGLE_ROWS, 16, 2.0),
        ("criteo-terabyte-10m", CRITEO_TB10M_ROWS, 64, 11.7),
        ("criteo-terabyte-40m", CRITEO_TB40M_ROWS, 128, 89.5),
        ("mlperf-dcnv2", MLPERF_DCNV2_ROWS, 128, 97.4),
    ],
)
def test_presets_match_reference(preset, rows, dim, gib):
    s = parse_spec({"name": "p", "preset": preset})
    assert len(s.tables) == 26
    assert tuple(t.rows for t in s.tables) == rows
    assert {t.dim for t in s.tables} == {dim}
    assert s.bottom_mlp[-1] == dim
    weight_gib = sum(t.weight_bytes for t in s.tables) / 2**30
    assert abs(weight_gib - gib) < 0.05
    assert parse_spec(s.to_dict()) == s


def test_reference_row_totals():
    assert round(sum(CRITEO_KAGGLE_ROWS) / 1e6, 2) == 33.76
    assert round(sum(CRITEO_TB10M_ROWS) / 1e6, 1) == 49.1
    assert round(sum(CRITEO_TB40M_ROWS) / 1e6, 1) == 187.8
    assert round(sum(MLPERF_DCNV2_ROWS) / 1e6, 1) == 204.2


def test_scale_shrinks_a_preset_and_spec_fields_win():
    s = parse_spec({"name": "p", "preset": "mlperf-dcnv2", "scale": {"max_rows_per_table": 1000, "dim": 8},
                    "batch_size": 64})
    assert max(t.rows for t in s.tables) == 1000 and min(t.rows for t in s.tables) == 3
    assert {t.dim for t in s.tables} == {8} and s.bottom_mlp == (512, 256, 8)
    assert s.batch_size == 64 and s.interaction.type == "dcn" and s.tables[20].multi_hot == 100
    assert parse_spec(s.to_dict()) == s


def test_fingerprint_ignores_names_seed_steps_paths():
    a = parse_spec(good())
    d = good()
    d.update(name="other", seed=7, steps=5, command=["x"], optimizer={"type": "rowwise_adagrad", "lr": 0.5})
    d["tables"][0]["name"] = "renamed"
    assert spec_fingerprint(parse_spec(d)) == spec_fingerprint(a)
    d["batch_size"] = 512
    assert spec_fingerprint(parse_spec(d)) != spec_fingerprint(a)
    # a preset with scale and the same tables written out are the same structure
    p = parse_spec({"name": "p", "preset": "criteo-kaggle", "scale": {"max_rows_per_table": 100}})
    spelled = p.to_dict()
    del spelled["preset"], spelled["scale"]
    assert spec_fingerprint(parse_spec(spelled)) == spec_fingerprint(p)


def _set(path, value):
    def mutate(d):
        keys = path.split(".")
        cur = d
        for k in keys[:-1]:
            cur = cur[int(k)] if isinstance(cur, list) else cur[k]
        last = keys[-1]
        if isinstance(cur, list):
            cur[int(last)] = value
        else:
            cur[last] = value
    return mutate


def _del(key):
    return lambda d: d.pop(key)


BAD = [
    (_set("colour", "red"), "colour"),
    (_set("tables.0.colour", "red"), "tables[0].colour"),
    (_set("tables.0.rows", 0), "tables[0].rows"),
    (_set("tables.0.rows", -5), "tables[0].rows"),
    (_set("tables.0.rows", "many"), "tables[0].rows"),
    (_set("tables.0.rows", 1.5), "tables[0].rows"),
    (_set("tables.0.rows", True), "tables[0].rows"),
    (_set("tables.1.dim", 8), "tables[1].dim"),
    (_set("tables.0.dtype", "int8"), "tables[0].dtype"),
    (_set("tables.0.placement", "ssd"), "tables[0].placement"),
    (_set("tables.0.pooling_factor", 0), "tables[0].pooling_factor"),
    (_set("tables.1.pooling_factor", 2.0), "tables[1].multi_hot"),
    (_set("tables.1.name", "t0"), "tables[1].name"),
    (_set("tables", []), "tables"),
    (_set("tables", {"rows": 1}), "tables"),
    (_set("tables.0", 5), "tables[0]"),
    (_del("tables"), "tables"),
    (_del("name"), "name"),
    (_set("name", "has space"), "name"),
    (_set("dense_features", 0), "dense_features"),
    (_set("bottom_mlp", [64, 8]), "bottom_mlp"),
    (_set("bottom_mlp", []), "bottom_mlp"),
    (_set("bottom_mlp", [64, -16]), "bottom_mlp[1]"),
    (_set("top_mlp", [32, 2]), "top_mlp"),
    (_set("top_mlp", "32-1"), "top_mlp"),
    (_set("top_mlp", [1]), "top_mlp"),
    (_set("interaction", {"type": "cat"}), "interaction.type"),
    (_set("interaction", {"type": "dot", "layers": 3}), "interaction.layers"),
    (_set("interaction", {"type": "dcn", "layers": 0}), "interaction.layers"),
    (_set("batch_size", -1), "batch_size"),
    (_set("batch_size", None), "batch_size"),
    (_set("optimizer", {"type": "lamb"}), "optimizer.type"),
    (_set("optimizer", {"type": "adam", "fused": "yes"}), "optimizer.fused"),
    (_set("optimizer", {"type": "adam", "lr": -1}), "optimizer.lr"),
    (_set("mixed_precision", "fp8"), "mixed_precision"),
    (_set("loader_workers", -1), "loader_workers"),
    (_set("steps", 0), "steps"),
    (_set("epochs", 1), "epochs"),
    (_set("world_size", 0), "world_size"),
    (_set("data", {"type": "criteo-tsv"}), "data.path"),
    (_set("data", {"type": "parquet"}), "data.type"),
    (_set("command", "python train.py"), "command"),
    (_set("command", ["python", 3]), "command[1]"),
    (_set("preset", "criteo-huge"), "preset"),
    (_set("scale", {"max_rows_per_table": 0}), "scale.max_rows_per_table"),
    (_set("scale", {"rows": 10}), "scale.rows"),
    (_set("custom_module", "not a module"), "custom_module"),
]


@pytest.mark.parametrize("mutate, field", BAD, ids=[f for _, f in BAD])
def test_bad_specs_name_the_field(mutate, field):
    d = good()
    mutate(d)
    with pytest.raises(SpecError) as err:
        parse_spec(d, "x.yaml")
    assert err.value.field == field, str(err.value)
    assert "\n" not in str(err.value) and str(err.value).startswith("x.yaml: ")


def test_not_a_mapping():
    with pytest.raises(SpecError):
        parse_spec([1, 2])


def test_load_yaml_and_json(tmp_path):
    y = tmp_path / "a.yaml"
    y.write_text("name: a\npreset: criteo-kaggle\nscale: {max_rows_per_table: 100}\nbatch_size: 32\n")
    j = tmp_path / "a.json"
    j.write_text(json.dumps({"name": "a", "preset": "criteo-kaggle", "scale": {"max_rows_per_table": 100},
                             "batch_size": 32}))
    assert load_spec(y) == load_spec(j)
    assert load_spec(y).source == str(y)


@pytest.mark.parametrize("text", ["", "name: [unclosed", "- 1\n- 2\n", "\x00\x01"])
def test_load_bad_files(tmp_path, text):
    p = tmp_path / "b.yaml"
    p.write_text(text)
    with pytest.raises(SpecError) as err:
        load_spec(p)
    assert "\n" not in str(err.value)


def test_missing_file(tmp_path):
    with pytest.raises(SpecError, match="cannot read"):
        load_spec(tmp_path / "nope.yaml")


def test_every_preset_name_parses():
    for name in PRESET_NAMES:
        assert parse_spec({"name": "n", "preset": name}).preset == name


def test_spec_path_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, slurm_dlrm.spec; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)  # noqa: S603
