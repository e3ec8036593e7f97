"""`slurm-dlrm simulate`: table, --json, plots, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from slurm_dlrm.cli import cli

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = ROOT / "benchmarks" / "sim" / "cluster_1gpu.yaml"


def _small_workload(tmp_path: Path) -> Path:
    data = yaml.safe_load((ROOT / "benchmarks" / "sim" / "dlrm_mix.yaml").read_text())
    data["generate"]["jobs"] = 30
    path = tmp_path / "w.json"
    path.write_text(json.dumps(data))
    return path


def test_simulate_json_compares_the_policies(tmp_path):
    w = _small_workload(tmp_path)
    r = CliRunner().invoke(cli, ["simulate", "-w", str(w), "-c", str(CLUSTER), "-p", "exclusive",
                                 "-p", "complementary", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert [p["policy"] for p in out["policies"]] == ["exclusive", "complementary"]
    excl, comp = out["policies"]
    assert comp["throughput_jobs_per_h"] > excl["throughput_jobs_per_h"]
    assert out["ideal_throughput_jobs_per_h"] >= comp["throughput_jobs_per_h"]
    bounds = out["ideal_bounds_jobs_per_h"]
    assert {"sm", "membw", "gpu_mem", "cpus", "slots", "arrivals"} <= set(bounds)
    assert min(bounds.values()) == pytest.approx(out["ideal_throughput_jobs_per_h"], rel=1e-3)
    assert comp["completed"] == 30 and comp["ooms"] == 0


def test_simulate_table_and_plots(tmp_path):
    w = _small_workload(tmp_path)
    r = CliRunner().invoke(cli, ["simulate", "-w", str(w), "-c", str(CLUSTER), "--plots", str(tmp_path / "plots")])
    assert r.exit_code == 0, r.output
    for policy in ("exclusive", "first-fit", "mem-best-fit", "complementary", "ideal bound"):
        assert policy in r.output
    assert (tmp_path / "plots" / "policies.png").stat().st_size > 1000
    assert (tmp_path / "plots" / "jct_cdf.png").stat().st_size > 1000


def test_simulate_bad_input_is_one_line_exit_2(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text("name: x\nnodes: []\n")
    w = _small_workload(tmp_path)
    r = CliRunner().invoke(cli, ["simulate", "-w", str(w), "-c", str(bad)])
    assert r.exit_code == 2
    assert "cluster.nodes" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(cli, ["simulate", "-w", str(tmp_path / "missing.yaml"), "-c", str(CLUSTER)])
    assert r.exit_code == 2 and "cannot read" in r.output
