"""A user's day on the local Slurm cluster (issue 23): a job whose data file is gone
fails with the runner's own error as its reason and a log `show` names; a cancelled
member stops with a checkpoint (exit 5 in queue, show and acct alike) and `requeue`
resumes it from there."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from service_harness import cli, make_site, show_job, wait_until, write_site_file

pytest.importorskip("slurm_dlrm.estimate")

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples" / "sweep"
# Both submit the demo's tiny DLRMs, whose members really train (slurm-dlrm train): torch.
pytestmark = [pytest.mark.slurm, pytest.mark.torch]


def test_a_failure_you_can_find_and_a_cancel_you_can_resume(live_service, tmp_path):
    site, user = live_service
    long_spec = tmp_path / "long.yaml"
    long_spec.write_text((EXAMPLES / "tiny-a.yaml").read_text().replace("name: tiny-a", "name: long-one")
                         .replace("steps: 60", "steps: 100000"))
    data = tmp_path / "day_0.tsv"
    data.write_text("0\t1\n")
    bad_spec = tmp_path / "criteo.yaml"
    bad_spec.write_text((EXAMPLES / "tiny-b.yaml").read_text().replace("name: tiny-b", "name: lost-data")
                        .replace("data: {type: synthetic, zipf_alpha: 1.05}", "data: {type: criteo-tsv, path: day_0.tsv}"))
    r = cli("submit", "--parsable", str(long_spec), str(bad_spec))
    assert r.exit_code == 0, r.output
    long_id, bad_id = map(int, r.output.split())
    data.unlink()  # gone before the pack runs: only the runner can tell

    # The runner's own words are the reason, short; show names the log with them.
    bad = wait_until(lambda: (j := show_job(bad_id))["state"] in ("FAILED", "COMPLETED", "CANCELLED") and j)
    assert bad["state"] == "FAILED" and bad["exit_code"] == 2
    # one short line (the tmp path is long; the log has it whole)
    assert bad["reason"].startswith("bad spec: data.path: no Criteo TSV file at /"), bad["reason"]
    assert bad["reason"].endswith(" (exit code 2)") and len(bad["reason"]) <= 120
    assert bad["logs"] and any(f"no Criteo TSV file at {data}" in line for line in bad["logs"][0]["tail"])
    rows = json.loads(cli("queue", "--all", "--json").output)["jobs"]
    assert {r["job_id"]: r["reason"] for r in rows}[bad_id] == bad["reason"]
    assert f"no Criteo TSV file at {data}" in cli("log", str(bad_id)).output

    # Cancel a running member after its first checkpoint: exit 5 everywhere.
    wait_until(lambda: (show_job(long_id).get("checkpoint_step") or 0) >= 20)
    # queue's GPU is one Slurm gave the pack on that node (its IDX), not a position.
    row = {r["job_id"]: r for r in json.loads(cli("queue", "--json").output)["jobs"]}[long_id]
    detail = subprocess.run(["scontrol", "show", "job", "-d", str(row["slurm_job_id"])], capture_output=True,  # noqa: S603, S607
                            text=True, timeout=30, check=True).stdout
    idx: set[int] = set()
    for spec in re.findall(r"IDX:([\d,-]+)", detail):
        for part in spec.split(","):
            lo, _, hi = part.partition("-")
            idx.update(range(int(lo), int(hi or lo) + 1))
    assert idx and row["gpu"] in idx, (row, detail)
    r = cli("cancel", str(long_id))
    assert r.exit_code == 0 and "checkpoints and stops" in r.output, r.output
    job = wait_until(lambda: (j := show_job(long_id))["state"] == "CANCELLED" and j)
    assert job["exit_code"] == 5, job
    m = re.fullmatch(rf"cancelled; stopped at step (\d+) with a checkpoint \(exit 5\); "
                     rf"`slurm-dlrm requeue {long_id}` resumes it", job["reason"])
    assert m, job["reason"]
    step = int(m.group(1))
    assert job["checkpoint_step"] == step
    rows = {r["job_id"]: r for r in json.loads(cli("queue", "--all", "--json").output)["jobs"]}
    assert rows[long_id]["reason"] == job["reason"]
    acct = cli("acct", "-j", str(long_id), "-o", "JobID,State,ExitCode", "-P", "-n").output.strip()
    assert acct == f"{long_id}|CANCELLED|5:0", acct

    # requeue: PENDING again, then running from that checkpoint.
    r = cli("requeue", str(long_id))
    assert r.output.strip() == f"job {long_id} requeued; it resumes from its checkpoint at step {step}", r.output
    wait_until(lambda: f"(step {step})" in cli("log", str(long_id)).output)
    assert "resumed from" in cli("log", str(long_id), "-n", "200").output
    cli("cancel", str(long_id))
    wait_until(lambda: show_job(long_id)["state"] == "CANCELLED")


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
    monkeypatch.setenv("SLURM_DLRM_SITE", str(write_site_file(tmp_path)))
    monkeypatch.chdir(tmp_path)
    paths = service_paths(site, current_user())
    spec = str(EXAMPLES / "tiny-a.yaml")

    # No Slurm configuration: submit fails like sbatch, one line, exit 1, nothing recorded.
    monkeypatch.delenv("SLURM_CONF", raising=False)
    r = cli("submit", spec)
    assert r.exit_code == 1 and r.output.count("\n") == 1, r.output
    assert r.output.startswith("slurm-dlrm: error: Slurm cannot be reached: ")
    assert "Could not establish a configuration source" in r.output and "is SLURM_CONF set?" in r.output
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "nope.conf"))
    r = cli("submit", spec)
    assert r.output == (f"slurm-dlrm: error: Slurm cannot be reached: SLURM_CONF={tmp_path / 'nope.conf'}: "
                        "no such file; nothing recorded\n")
    assert not list(tmp_path.glob("store-*/*.db")) and running_pid(paths) is None

    # A service started without it says so in one short line, and show has the rest.
    monkeypatch.delenv("SLURM_CONF")
    r = cli("submit", "--no-service", "--parsable", spec)
    job_id = int(r.output)
    spawn_service(paths, ["--round-seconds", "1"])
    try:
        assert wait_until_running(paths, timeout_s=30) is not None
        st = wait_until(lambda: (s := read_status(paths)).get("slurm_ok") is False and s, timeout_s=60)
        assert st["slurm_conf"] is None
        row = {r["job_id"]: r for r in json.loads(cli("queue", "--json").output)["jobs"]}[job_id]
        assert re.fullmatch(r"(submitting the pack; )?waiting for Slurm: Could not establish a configuration source \(retry in [\d.]+ s\)",
                            row["reason"]), row["reason"]
        shown = cli("show", str(job_id)).output
        assert re.search(r"^  Slurm: \w+ failed \(exit 1\): .*Could not establish a configuration source", shown, re.M)
        assert "runs with SLURM_CONF=(unset)" in shown

        # Exporting SLURM_CONF and submitting again restarts the service with it.
        old_pid = running_pid(paths)
        monkeypatch.setenv("SLURM_CONF", str(slurm_cluster.slurm_conf))
        r = cli("submit", "--parsable", spec)
        assert r.exit_code == 0, r.output
        new_pid = wait_until_running(paths, timeout_s=30)
        assert new_pid not in (None, old_pid)
        wait_until(lambda: read_status(paths).get("slurm_conf") == str(slurm_cluster.slurm_conf), timeout_s=60)
        job = wait_until(lambda: (j := show_job(job_id))["state"] in ("COMPLETED", "FAILED") and j, timeout_s=240)
        assert job["state"] == "COMPLETED", job
    finally:
        wait_until_running(paths, timeout_s=5)  # a service submit just spawned takes its lock first
        stop(paths, timeout_s=30)
