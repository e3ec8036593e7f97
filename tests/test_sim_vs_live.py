"""benchmarks/sim_vs_live.py (issue 29 items 2 and 5, reduced): bad input is refused
before anything is submitted; the small workload runs live (marked slurm) with every
job done and the simulator's figures beside the live ones."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "sim_vs_live.py"


@pytest.fixture
def bench(monkeypatch):
    spec = importlib.util.spec_from_file_location("sim_vs_live", BENCH)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "sim_vs_live", mod)
    spec.loader.exec_module(mod)
    return mod


def _small(tmp_path: Path, n: int, **changes) -> Path:
    data = yaml.safe_load((BENCH.parent / "sim" / "live_small.yaml").read_text())
    data["jobs"] = data["jobs"][:n]
    for i, change in changes.items():
        data["jobs"][int(i[1:])].update(change)
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(("args", "says"), [
    (["--truth", "nope"], "--truth"),
    (["--workload", "MISSING"], "--workload"),
    (["--policies", "complementary"], "must include exclusive"),
    (["--workload", str(BENCH.parent / "sim" / "dlrm_mix.yaml")], "generated jobs have no spec"),
])
def test_bad_input_is_one_line_exit_2_before_anything_runs(bench, monkeypatch, capsys, args, says):
    monkeypatch.setattr(bench, "run_live", lambda *a, **k: pytest.fail("submitted despite bad input"))
    assert bench.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err


def test_a_profile_only_job_or_one_larger_than_a_node_is_named(bench, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(bench, "run_live", lambda *a, **k: pytest.fail("submitted despite bad input"))
    prof = tmp_path / "p.yaml"
    prof.write_text(yaml.safe_dump({"name": "p", "jobs": [
        {"name": "a", "arrival_s": 0, "solo_duration_s": 30,
         "profile": {"sm_util_pct": 10, "membw_util_pct": 10, "gpu_mem_gib": 2}}]}))
    assert bench.main(["--workload", str(prof)]) == 2
    assert "workload.jobs[0] (a): a profile-only job" in capsys.readouterr().err
    big = _small(tmp_path, 2, j1={"true": {"gpu_mem_gib": 100}})
    assert bench.main(["--workload", str(big)]) == 2
    assert "workload.jobs[1] (tiny-b): larger than a node" in capsys.readouterr().err
    wide = _small(tmp_path, 2, j0={"world_size": 9})
    assert bench.main(["--workload", str(wide)]) == 2
    assert "workload.jobs[0] (tiny-a): larger than a node" in capsys.readouterr().err


def test_the_simulated_side_runs_the_same_jobs_with_the_services_estimates(bench, tmp_path):
    import argparse

    args = argparse.Namespace(workload=str(_small(tmp_path, 4)), cluster=str(bench.DEFAULT_CLUSTER),
                              truth="synthetic", seed=29)
    workload, cluster, truth, raw = bench._load(args)
    specs = bench.check_live(raw, workload, cluster)
    told = bench.service_estimates(workload, specs, cluster)
    assert [j.solo_duration_s for j in told.jobs] == [j.solo_duration_s for j in workload.jobs]
    assert all(j.est_duration_s is not None and j.est_duration_s < j.solo_duration_s for j in told.jobs)
    row = bench.sim_row(told, cluster, truth, "exclusive")
    assert row.done_pct == 100.0 and row.gpu_h > 0
    argv = bench._standin_spec(specs[0], workload.jobs[0], "synthetic", "py", 552 << 20)["command"]
    assert float(argv[argv.index("--step-s") + 1]) == pytest.approx(
        workload.jobs[0].solo_duration_s / specs[0]["steps"], rel=1e-6)
    assert argv[argv.index("--truth") + 1] == "synthetic"
    # the true peak plus the context, as NVML counts a process's device memory
    assert float(argv[argv.index("--gpu-peak-mib") + 1]) == pytest.approx(
        workload.jobs[0].true_gpu_mem_bytes / (1 << 20) + 552, abs=1e-3)


@pytest.mark.slurm
def test_small_workload_live_and_simulated_under_three_minutes(bench, slurm_cluster, tmp_path, capsys):
    # The 12 jobs at half their solo times, one arriving every 2 s: both live runs and
    # the simulation well inside 3 minutes on this machine.
    data = yaml.safe_load((BENCH.parent / "sim" / "live_small.yaml").read_text())
    for i, job in enumerate(data["jobs"]):
        job["solo_duration_s"] = job["solo_duration_s"] / 2
        job["arrival_s"] = 2.0 * i
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump(data))
    t0 = time.monotonic()
    assert bench.main(["--workload", str(path), "--timeout-s", "120"]) == 0
    assert time.monotonic() - t0 < 180
    out = capsys.readouterr().out
    line = out.strip().splitlines()[-1]
    m = dict(re.findall(r"(\w+)=(\S+)", line))
    assert line.startswith("sim_vs_live: ") and int(m["jobs"]) == 12
    assert float(m["live_done_pct"]) == 100.0 and int(m["live_ooms"]) == 0
    for key in ("live_tput_vs_exclusive", "sim_tput_vs_exclusive", "tput_err_pct", "jct_err_pct", "gpuh_err_pct"):
        assert m[key] not in ("nan", "inf", "-inf"), line
    assert "complementary" in out and "exclusive" in out
    # The agreement itself, so it cannot rot: the targets (10 / 15 / 10 %) with
    # half again for a CI machine running two Slurm legs side by side (measured here,
    # 2026-11-27: -1.4 / 5.3 / -1.6; before the constants were fitted GPU-hours was -14).
    assert abs(float(m["tput_err_pct"])) <= 15, line
    assert abs(float(m["jct_err_pct"])) <= 22, line
    # GPU-hours: wave 5 read -12.5 / -14.1 in the legs (bound 15 for a while): the service
    # asked Slurm for a pack's host memory rounded DOWN to MiB, so a joiner the plan had
    # reserved room for (job 2 here, a few KB under the reserve) did not fit live and the
    # simulator joined it (now both round up: service/refill.pack_allocation, sim's packs).
    assert abs(float(m["gpuh_err_pct"])) <= 12, line


def _holding(root: str) -> list[int]:
    """Pids whose command line or environment names `root` (the run's service, agents,
    stand-ins, fake MPS daemons: all run with the run's folders)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            blob = (d / "cmdline").read_bytes() + (d / "environ").read_bytes()
        except OSError:
            continue
        if root.encode() in blob:
            out.append(int(d.name))
    return out


def _live_packs(client):
    return [j for j in client.squeue() if j.name.startswith("dlrm-") and not j.state.is_terminal]


@pytest.mark.slurm
def test_an_interrupted_run_leaves_no_pack_service_or_daemon(slurm_cluster, tmp_path):
    env = dict(os.environ, SLURM_CONF=str(slurm_cluster.slurm_conf))
    proc = subprocess.Popen([sys.executable, str(BENCH)], env=env, stderr=subprocess.PIPE, text=True)  # noqa: S603
    client = slurm_cluster.client()
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not _live_packs(client):
            time.sleep(1.0)
        assert _live_packs(client), "no pack started"
        time.sleep(3.0)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "interrupted" in err.strip().splitlines()[-1]
    root = re.search(r"\((/\S+sim-vs-live-\w+)\)$", err.strip()).group(1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (_live_packs(client) or _holding(root)):
        time.sleep(1.0)
    assert not _live_packs(client)
    assert not _holding(root)


def test_live_timing_reads_the_constants_from_the_stores_records(bench):
    from types import SimpleNamespace as NS

    packs = [NS(id=1, end_time=130.0), NS(id=2, end_time=None)]
    placements = [NS(pack_id=1, job_id=1, start_time=11.0, end_time=63.0, attempt=0),
                  NS(pack_id=1, job_id=2, start_time=40.0, end_time=126.0, attempt=0),
                  NS(pack_id=2, job_id=3, start_time=50.0, end_time=None, attempt=0)]
    events = {1: [{"to_state": "PENDING", "t": 0.0}, {"to_state": "PLANNED", "t": 10.0},
                  {"to_state": "RUNNING", "t": 11.0}],
              2: [{"to_state": "PLANNED", "t": 38.5, "data": {"join": True}}, {"to_state": "RUNNING", "t": 40.0}],
              3: [{"to_state": "PLANNED", "t": 49.0}]}
    t = bench.live_timing(packs, placements, events, {1: 50.0, 2: 85.0})
    assert t == {"submit_to_start_s": 1.0, "join_start_s": 1.5, "pack_release_s": 4.0, "member_startup_s": 1.5}
