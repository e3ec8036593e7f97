import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_dlrm.cli import cli
from slurm_dlrm.site import REPO_SITE_FILE

BAD = Path(__file__).parent / "data" / "bad_specs"
JSON_EXPECT = {"zero-world.json": "world_size"}


def _expected_field(path: Path) -> str:
    if path.name in JSON_EXPECT:
        return JSON_EXPECT[path.name]
    first = path.read_text().splitlines()[0]
    assert first.startswith("# expect: "), path
    return first.removeprefix("# expect: ")


def _run(*args: str):
    return CliRunner().invoke(cli, ["estimate", "--site", str(REPO_SITE_FILE), *args])


@pytest.fixture()
def good_spec(tmp_path):
    p = tmp_path / "good.yaml"
    p.write_text("name: small\npreset: criteo-kaggle\nscale: {max_rows_per_table: 5000}\nbatch_size: 512\n"
                 "optimizer: {type: adagrad}\n")
    return p


@pytest.mark.parametrize("path", sorted(BAD.iterdir()), ids=lambda p: p.name)
def test_bad_specs_one_line_exit_2(path):
    result = _run(str(path))
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert lines[0].startswith("slurm-dlrm: error: ")
    assert f"{_expected_field(path)}:" in lines[0]
    assert "Traceback" not in result.output


def test_real_entry_point_no_traceback():
    out = subprocess.run([sys.executable, "-m", "slurm_dlrm", "estimate", str(BAD / "zero-rows.yaml")],  # noqa: S603
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stdout == ""
    assert out.stderr.count("\n") == 1 and "tables[0].rows" in out.stderr


def test_nothing_printed_when_one_of_several_specs_is_bad(good_spec):
    result = _run(str(good_spec), str(BAD / "zero-rows.yaml"), "--json")
    assert result.exit_code == 2
    assert not result.output.lstrip().startswith("[")


def test_missing_file_and_unknown_gpu(good_spec, tmp_path):
    assert _run(str(tmp_path / "nope.yaml")).exit_code == 2
    result = _run(str(good_spec), "--gpu", "v100")
    assert result.exit_code == 2 and "unknown GPU model" in result.output


def test_json_output(good_spec):
    result = _run(str(good_spec), "--json", "--no-history")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert len(data) == 1 and set(data[0]["estimates"]) == {"h100", "a100"}
    h = data[0]["estimates"]["h100"]
    assert sum(h["gpu_breakdown"].values()) == h["gpu_peak_bytes"]
    assert h["gpu_breakdown"]["embedding_weights"] == sum(min(r, 5000) for r in _kaggle_rows()) * 16 * 4
    fit = data[0]["fits"]["h100"]
    assert fit["copies"] == fit["gpu_mem_bytes"] // fit["gpu_peak_bytes_with_margin"] and fit["fits"]


def _kaggle_rows():
    from slurm_dlrm.presets import CRITEO_KAGGLE_ROWS

    return CRITEO_KAGGLE_ROWS


def test_human_output_and_gpu_filter(good_spec):
    result = _run(str(good_spec), "--gpu", "a100", "--no-history")
    assert result.exit_code == 0, result.output
    out = result.output
    assert "a100" in out and "h100" not in out
    for word in ("embedding_weights", "cuda_context", "allocator_rounding", "host peak memory", "copies", "GiB"):
        assert word in out


def test_preset_without_scale_does_not_fit_smaller_gpu(tmp_path):
    p = tmp_path / "dcn.yaml"
    p.write_text("name: big\npreset: mlperf-dcnv2\nbatch_size: 8192\n")
    r = _run(str(p), "--json", "--no-history")
    assert r.exit_code == 2  # fits no GPU: bad input, said with what would make it fit
    data = json.loads(r.output[: r.output.rindex("\nslurm-dlrm: error: ")])
    assert not data[0]["fits"]["a100"]["fits"] and not data[0]["fits"]["h100"]["fits"]
    assert any(a.startswith("placement: uvm for tables ") for a in data[0]["advice"])
    # the embedding part is exactly the reference's 204.2 M rows x 128 x 4 B, plus Adagrad state of the same size
    h = data[0]["estimates"]["h100"]["gpu_breakdown"]
    assert h["embedding_weights"] == 204184588 * 128 * 4 == h["embedding_optimizer_state"]


def test_calibration_from_store_history(good_spec, tmp_path):
    from slurm_dlrm.site import load_site
    from slurm_dlrm.spec import load_spec, spec_fingerprint
    from slurm_dlrm.store import Store, store_path_for

    site_text = REPO_SITE_FILE.read_text().replace('store_dir = "~/.local/share/slurm-dlrm"',
                                                   f'store_dir = "{tmp_path}/store"')
    site_file = tmp_path / "site.toml"
    site_file.write_text(site_text)
    site = load_site(site_file)
    spec = load_spec(good_spec)
    fp = spec_fingerprint(spec)
    first = json.loads(CliRunner().invoke(cli, ["estimate", "--site", str(site_file), str(good_spec), "--json",
                                                "--gpu", "h100"]).output)[0]
    est = first["estimates"]["h100"]
    assert est["method"] == "analytic"
    path = store_path_for(site)
    path.parent.mkdir(parents=True, exist_ok=True)
    with Store(path) as store:
        job_id = store.add_job(user="u", name="small", spec=spec.to_dict(), spec_fingerprint=fp, estimate=est)
        _finish_with_peak(store, job_id, int(est["gpu_peak_bytes"] * 1.1))
    second = json.loads(CliRunner().invoke(cli, ["estimate", "--site", str(site_file), str(good_spec), "--json",
                                                 "--gpu", "h100"]).output)[0]["estimates"]["h100"]
    assert second["method"] == "analytic+calibrated"
    assert second["gpu_peak_bytes"] == pytest.approx(est["gpu_peak_bytes"] * 1.1, rel=1e-6)
    assert any("calibrated" in n for n in second["notes"])


def _finish_with_peak(store, job_id, peak):
    """Run a job through the store's public API: a pack, one GPU sample, COMPLETED."""
    from slurm_dlrm.store import JobState, NewPlacement

    pack_id = store.add_pack(name="p1", user="u", policy="exclusive", n_gpus=1,
                             placements=[NewPlacement(job_id=job_id, node_index=0, gpu_index=0)])
    store.transition_job(job_id, JobState.RUNNING, "started")
    store.add_samples([{"t": 1.0, "pack_id": pack_id, "job_id": job_id, "node": "n1", "gpu_index": 0,
                        "gpu_mem_bytes": peak, "rss_bytes": None}])
    store.transition_job(job_id, JobState.COMPLETED, "done", exit_code=0)


def test_estimate_says_what_mps_across_users_means_here(good_spec, tmp_path):
    """MPS runs one user's jobs on a GPU at a time: estimate says what that means on this
    site ([mps] cross_user), in text and JSON."""
    out = _run(str(good_spec), "--no-history")
    assert out.exit_code == 0, out.output
    # issue 42: the note is submit --no-pack's (and in --json here), not at the end of every estimate
    assert "note: a --no-pack job" not in out.output
    res = CliRunner().invoke(cli, ["estimate", str(good_spec), "--no-history", "--json"])
    assert "take turns" in json.loads(res.output)[0]["mps_cross_user"]["note"]
    one_user = tmp_path / "site.toml"
    one_user.write_text(REPO_SITE_FILE.read_text().replace('cross_user = "time-slice"', 'cross_user = "one-user"'))
    res = CliRunner().invoke(cli, ["estimate", "--site", str(one_user), str(good_spec), "--no-history", "--json"])
    assert res.exit_code == 0, res.output
    (r,) = json.loads(res.output)
    assert r["mps_cross_user"]["mode"] == "one-user" and "--exclusive=user" in r["mps_cross_user"]["note"]


def test_a_host_calibration_is_its_own_line_not_a_negative_part(good_spec, tmp_path):
    # issue 42: "calibration -775 MiB" was a part of the host table, under a total the parts
    # did not sum to
    from slurm_dlrm.site import load_site
    from slurm_dlrm.spec import load_spec, spec_fingerprint
    from slurm_dlrm.store import NewPlacement, Store, store_path_for
    from slurm_dlrm.store.states import JobState

    site_file = tmp_path / "site.toml"
    site_file.write_text(REPO_SITE_FILE.read_text().replace('store_dir = "~/.local/share/slurm-dlrm"',
                                                            f'store_dir = "{tmp_path}/store"'))
    spec = load_spec(good_spec)
    est = json.loads(CliRunner().invoke(cli, ["estimate", "--site", str(site_file), str(good_spec), "--json",
                                              "--gpu", "h100"]).output)[0]["estimates"]["h100"]
    path = store_path_for(load_site(site_file))
    path.parent.mkdir(parents=True, exist_ok=True)
    with Store(path) as store:
        for _ in range(3):
            job_id = store.add_job(user="u", name="small", spec=spec.to_dict(), spec_fingerprint=spec_fingerprint(spec),
                                   estimate=est)
            pack_id = store.add_pack(name=f"p{job_id}", user="u", policy="exclusive", n_gpus=1,
                                     placements=[NewPlacement(job_id=job_id, node_index=0, gpu_index=0)])
            store.transition_job(job_id, JobState.RUNNING, "started")
            store.add_samples([{"t": 1.0, "pack_id": pack_id, "job_id": job_id, "node": "n1", "gpu_index": 0,
                                "gpu_mem_bytes": est["gpu_peak_bytes"], "rss_bytes": est["host_peak_bytes"] // 2}])
            store.transition_job(job_id, JobState.COMPLETED, "done", exit_code=0)
    out = CliRunner().invoke(cli, ["estimate", "--site", str(site_file), str(good_spec), "--gpu", "h100"]).output
    assert "calibrated from earlier runs" in out
    assert not any(line.lstrip("│ ").startswith("calibration ") for line in out.splitlines()), out


def test_a_spec_with_no_runs_of_its_own_takes_the_sites_host_calibration(good_spec, tmp_path):
    # issue 43 item 13: the host runtime term depends on the machine; the site's finished
    # runs of other specs correct it, on a line of its own (--no-history: not)
    from slurm_dlrm.site import load_site
    from slurm_dlrm.spec import load_spec
    from slurm_dlrm.store import NewPlacement, Store, store_path_for
    from slurm_dlrm.store.states import JobState

    site_file = tmp_path / "site.toml"
    site_file.write_text(REPO_SITE_FILE.read_text().replace('store_dir = "~/.local/share/slurm-dlrm"',
                                                            f'store_dir = "{tmp_path}/store"'))
    spec = load_spec(good_spec)
    args = ["estimate", "--site", str(site_file), str(good_spec), "--gpu", "h100"]
    est = json.loads(CliRunner().invoke(cli, [*args, "--json"]).output)[0]["estimates"]["h100"]
    path = store_path_for(load_site(site_file))
    path.parent.mkdir(parents=True, exist_ok=True)
    with Store(path) as store:
        for i, below_mib in enumerate((120, 100, 110)):
            job_id = store.add_job(user="u", name=f"other{i}", spec=spec.to_dict(), spec_fingerprint=f"other-{i}",
                                   estimate=est)
            pack_id = store.add_pack(name=f"p{job_id}", user="u", policy="exclusive", n_gpus=1,
                                     placements=[NewPlacement(job_id=job_id, node_index=0, gpu_index=0)])
            store.transition_job(job_id, JobState.RUNNING, "started")
            store.add_samples([{"t": 1.0, "pack_id": pack_id, "job_id": job_id, "node": "n1", "gpu_index": 0,
                                "rss_bytes": est["host_peak_bytes"] - (below_mib << 20)}])
            store.transition_job(job_id, JobState.COMPLETED, "done", exit_code=0)
    site_est = json.loads(CliRunner().invoke(cli, [*args, "--json"]).output)[0]["estimates"]["h100"]
    assert site_est["host_breakdown"]["site_calibration"] == -(100 << 20)
    assert site_est["host_peak_bytes"] == est["host_peak_bytes"] - (100 << 20)
    assert any("from 3 finished cuda run(s)" in n for n in site_est["notes"])
    out = CliRunner().invoke(cli, args).output
    assert "calibrated from the site's runs of any spec (-100.00 MiB)" in out, out
    assert not any(line.lstrip("│ ").startswith("site_calibration") for line in out.splitlines()), out
    plain = json.loads(CliRunner().invoke(cli, [*args, "--json", "--no-history"]).output)[0]["estimates"]["h100"]
    assert plain == est
