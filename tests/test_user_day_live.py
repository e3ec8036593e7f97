"""A user's day on the local Slurm cluster (issue 23): a job whose data file is gone
fails with the runner's own error as its reason and a log `show` names; a cancelled
member stops with a checkpoint (exit 5 in queue, show and acct alike) and `requeue`
resumes it from there."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from service_harness import make_site

pytest.importorskip("slurm_dlrm.estimate")

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples" / "sweep"
# Both submit the demo's tiny DLRMs, whose members really train (slurm-dlrm train): torch.
pytestmark = [pytest.mark.slurm, pytest.mark.torch]


@pytest.fixture
def live(slurm_cluster, tmp_path, monkeypatch):
    from slurm_dlrm.service.daemon import spawn_service, stop, wait_until_running
    from slurm_dlrm.service.submit import service_paths
    from slurm_dlrm.store.store import Store, current_user

    site = make_site(tmp_path)
    site_file = tmp_path / "site.toml"
    text = (REPO / "site-config" / "site.toml").read_text()
    text = text.replace('store_dir = "~/.local/share/slurm-dlrm"', f'store_dir = "{tmp_path}/store-{{user}}"')
    text = text.replace('spool_dir = "~/.local/share/slurm-dlrm/spool"', f'spool_dir = "{tmp_path}/spool-{{user}}"')
    site_file.write_text(text)
    monkeypatch.setenv("SLURM_DLRM_SITE", str(site_file))
    monkeypatch.setenv("SLURM_CONF", str(slurm_cluster.slurm_conf))
    monkeypatch.chdir(tmp_path)
    user = current_user()
    paths = service_paths(site, user)
    spawn_service(paths, ["--round-seconds", "1"])
    assert wait_until_running(paths, timeout_s=30) is not None, paths.log.read_text()[-2000:]
    yield site, user
    try:
        stop(paths, timeout_s=30)
    finally:
        with Store.for_user(site, user) as store:  # leave no pack of this test in Slurm
            ids = [int(p.slurm_job_id) for p in store.packs(["SUBMITTING", "QUEUED", "RUNNING"]) if p.slurm_job_id]
        if ids:
            subprocess.run(["scancel", *map(str, ids)], check=False, timeout=30)  # noqa: S603


def run(*args: str):
    from slurm_dlrm.cli import cli

    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def _job(job_id: int) -> dict:
    r = run("show", str(job_id), "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def _until(what, timeout_s: float = 180.0, every_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while True:
        got = what()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what.__doc__ or what}"
        time.sleep(every_s)


def test_a_failure_you_can_find_and_a_cancel_you_can_resume(live, tmp_path):
    site, user = live
    long_spec = tmp_path / "long.yaml"
    long_spec.write_text((EXAMPLES / "tiny-a.yaml").read_text().replace("name: tiny-a", "name: long-one")
                         .replace("steps: 60", "steps: 100000"))
    data = tmp_path / "day_0.tsv"
    data.write_text("0\t1\n")
    bad_spec = tmp_path / "criteo.yaml"
    bad_spec.write_text((EXAMPLES / "tiny-b.yaml").read_text().replace("name: tiny-b", "name: lost-data")
                        .replace("data: {type: synthetic, zipf_alpha: 1.05}", "data: {type: criteo-tsv, path: day_0.tsv}"))
    r = run("submit", "--parsable", str(long_spec), str(bad_spec))
    assert r.exit_code == 0, r.output
    long_id, bad_id = map(int, r.output.split())
    data.unlink()  # gone before the pack runs: only the runner can tell

    # The runner's own words are the reason, short; show names the log with them.
    bad = _until(lambda: (j := _job(bad_id))["state"] in ("FAILED", "COMPLETED", "CANCELLED") and j)
    assert bad["state"] == "FAILED" and bad["exit_code"] == 2
    # one short line (the tmp path is long; the log has it whole)
    assert bad["reason"].startswith("bad spec: data.path: no Criteo TSV file at /"), bad["reason"]
    assert bad["reason"].endswith(" (exit code 2)") and len(bad["reason"]) <= 120
    assert bad["logs"] and any(f"no Criteo TSV file at {data}" in line for line in bad["logs"][0]["tail"])
    rows = json.loads(run("queue", "--all", "--json").output)["jobs"]
    assert {r["job_id"]: r["reason"] for r in rows}[bad_id] == bad["reason"]
    assert f"no Criteo TSV file at {data}" in run("log", str(bad_id)).output

    # Cancel a running member after its first checkpoint: exit 5 everywhere.
    _until(lambda: (_job(long_id).get("checkpoint_step") or 0) >= 20)
    # queue's GPU is one Slurm gave the pack on that node (its IDX), not a position.
    row = {r["job_id"]: r for r in json.loads(run("queue", "--json").output)["jobs"]}[long_id]
    detail = subprocess.run(["scontrol", "show", "job", "-d", str(row["slurm_job_id"])], capture_output=True,  # noqa: S603, S607
                            text=True, timeout=30, check=True).stdout
    idx: set[int] = set()
    for spec in re.findall(r"IDX:([\d,-]+)", detail):
        for part in spec.split(","):
            lo, _, hi = part.partition("-")
            idx.update(range(int(lo), int(hi or lo) + 1))
    assert idx and row["gpu"] in idx, (row, detail)
    r = run("cancel", str(long_id))
    assert r.exit_code == 0 and "checkpoints and stops" in r.output, r.output
    job = _until(lambda: (j := _job(long_id))["state"] == "CANCELLED" and j)
    assert job["exit_code"] == 5, job
    m = re.fullmatch(rf"cancelled; stopped at step (\d+) with a checkpoint \(exit 5\); "
                     rf"`slurm-dlrm requeue {long_id}` resumes it", job["reason"])
    assert m, job["reason"]
    step = int(m.group(1))
    assert job["checkpoint_step"] == step
    rows = {r["job_id"]: r for r in json.loads(run("queue", "--all", "--json").output)["jobs"]}
    assert rows[long_id]["reason"] == job["reason"]
    acct = run("acct", "-j", str(long_id), "-o", "JobID,State,ExitCode", "-P", "-n").output.strip()
    assert acct == f"{long_id}|CANCELLED|5:0", acct

    # requeue: PENDING again, then running from that checkpoint.
    r = run("requeue", str(long_id))
    assert r.output.strip() == f"job {long_id} requeued; it resumes from its checkpoint at step {step}", r.output
    _until(lambda: f"(step {step})" in run("log", str(long_id)).output)
    assert "resumed from" in run("log", str(long_id), "-n", "200").output
    run("cancel", str(long_id))
    _until(lambda: _job(long_id)["state"] == "CANCELLED")


def test_an_unreachable_slurm_is_said_at_once_and_the_service_follows_slurm_conf(slurm_cluster, tmp_path,
                                                                                  monkeypatch):
    from slurm_dlrm.service.daemon import (
        read_status,
        running_pid,
        spawn_service,
        stop,
        wait_until_running,
    )
    from slurm_dlrm.service.submit import service_paths
    from slurm_dlrm.store.store import current_user

    site = make_site(tmp_path)
    site_file = tmp_path / "site.toml"
    text = (REPO / "site-config" / "site.toml").read_text()
    text = text.replace('store_dir = "~/.local/share/slurm-dlrm"', f'store_dir = "{tmp_path}/store-{{user}}"')
    text = text.replace('spool_dir = "~/.local/share/slurm-dlrm/spool"', f'spool_dir = "{tmp_path}/spool-{{user}}"')
    site_file.write_text(text)
    monkeypatch.setenv("SLURM_DLRM_SITE", str(site_file))
    monkeypatch.chdir(tmp_path)
    paths = service_paths(site, current_user())
    spec = str(EXAMPLES / "tiny-a.yaml")

    # No Slurm configuration: submit fails like sbatch, one line, exit 1, nothing recorded.
    monkeypatch.delenv("SLURM_CONF", raising=False)
    r = run("submit", spec)
    assert r.exit_code == 1 and r.output.count("\n") == 1, r.output
    assert r.output.startswith("slurm-dlrm: error: Slurm cannot be reached: ")
    assert "Could not establish a configuration source" in r.output and "is SLURM_CONF set?" in r.output
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "nope.conf"))
    r = run("submit", spec)
    assert r.output == (f"slurm-dlrm: error: Slurm cannot be reached: SLURM_CONF={tmp_path / 'nope.conf'}: "
                        "no such file; nothing recorded\n")
    assert not list(tmp_path.glob("store-*/*.db")) and running_pid(paths) is None

    # A service started without it says so in one short line, and show has the rest.
    monkeypatch.delenv("SLURM_CONF")
    r = run("submit", "--no-service", "--parsable", spec)
    job_id = int(r.output)
    spawn_service(paths, ["--round-seconds", "1"])
    try:
        assert wait_until_running(paths, timeout_s=30) is not None
        st = _until(lambda: (s := read_status(paths)).get("slurm_ok") is False and s, timeout_s=60)
        assert st["slurm_conf"] is None
        row = {r["job_id"]: r for r in json.loads(run("queue", "--json").output)["jobs"]}[job_id]
        assert re.fullmatch(r"(submitting the pack; )?waiting for Slurm: Could not establish a configuration source \(retry in [\d.]+ s\)",
                            row["reason"]), row["reason"]
        shown = run("show", str(job_id)).output
        assert re.search(r"^  Slurm: \w+ failed \(exit 1\): .*Could not establish a configuration source", shown, re.M)
        assert "runs with SLURM_CONF=(unset)" in shown

        # Exporting SLURM_CONF and submitting again restarts the service with it.
        old_pid = running_pid(paths)
        monkeypatch.setenv("SLURM_CONF", str(slurm_cluster.slurm_conf))
        r = run("submit", "--parsable", spec)
        assert r.exit_code == 0, r.output
        new_pid = wait_until_running(paths, timeout_s=30)
        assert new_pid not in (None, old_pid)
        _until(lambda: read_status(paths).get("slurm_conf") == str(slurm_cluster.slurm_conf), timeout_s=60)
        job = _until(lambda: (j := _job(job_id))["state"] in ("COMPLETED", "FAILED") and j, timeout_s=240)
        assert job["state"] == "COMPLETED", job
    finally:
        wait_until_running(paths, timeout_s=5)  # a service submit just spawned takes its lock first
        stop(paths, timeout_s=30)
