"""Failures a user can find (issue 23): `show` points at the job's log and progress,
`log` prints it, `requeue` runs a cancelled job again from its checkpoint, and a
missing data file is refused at submit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from service_harness import write_site_file

from slurm_dlrm.cli import cli

pytest.importorskip("slurm_dlrm.estimate")

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples" / "sweep"


@pytest.fixture
def env(tmp_path, monkeypatch):
    site_file = write_site_file(tmp_path)
    monkeypatch.setenv("SLURM_DLRM_SITE", str(site_file))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def run(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def _user_spool(tmp: Path) -> Path:
    (spool,) = tmp.glob("spool-*")
    return spool


def test_a_missing_data_file_is_refused_at_submit(env):
    spec = env / "criteo.yaml"
    text = (EXAMPLES / "tiny-a.yaml").read_text()
    spec.write_text(text.replace("data: {type: synthetic, zipf_alpha: 1.05}", "data: {type: criteo-tsv, path: day_0.tsv}"))
    r = run("submit", "--no-service", str(spec))
    assert r.exit_code == 2
    assert r.output.strip() == f"slurm-dlrm: error: {spec}: data.path: no such file or folder: {env / 'day_0.tsv'}"
    assert not list(env.glob("store-*/*.db"))  # nothing recorded
    (env / "day_0.tsv").write_text("0\t1\n")
    r = run("submit", "--no-service", "--parsable", str(spec))
    assert r.exit_code == 0, r.output


def test_show_prints_log_progress_and_checkpoint_and_log_prints_the_log(env):
    r = run("submit", "--no-service", "--parsable", str(EXAMPLES / "tiny-a.yaml"))
    assert r.exit_code == 0, r.output
    job_id = int(r.output)
    r = run("show", str(job_id))
    assert "log: none yet" in r.output
    job_dir = _user_spool(env) / "jobs" / str(job_id)
    lines = [f"line {i}" for i in range(30)]
    (job_dir / "output-node1.log").write_text("\n".join(lines) + "\n")
    with open(job_dir / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"t": 1.0, "step": 20, "loss": 0.5, "samples_per_s": 100.0}) + "\n")
        f.write(json.dumps({"t": 2.0, "step": 40, "loss": 0.4567, "samples_per_s": 12345.6}) + "\n")
    (job_dir / "ckpt" / "step-000000040").mkdir(parents=True)
    (job_dir / "ckpt" / "step-000000040" / "manifest.json").write_text("{}")
    (job_dir / "ckpt" / "step-000000060").mkdir()  # no manifest: not a checkpoint
    r = run("show", str(job_id), "-n", "3")
    assert r.exit_code == 0, r.output
    out = r.output.splitlines()
    assert "  progress: step 40, loss 0.4567, 12,346 samples/s" in "\n".join(out)
    assert "  checkpoint: step 40" in out
    at = out.index(f"  log: {job_dir / 'output-node1.log'}   (slurm-dlrm log {job_id} [-f])")
    assert out[at + 1:] == ["    | line 27", "    | line 28", "    | line 29"]
    d = json.loads(run("show", str(job_id), "--json").output)
    assert d["last_metrics"]["step"] == 40 and d["logs"][0]["tail"][-1] == "line 29"
    assert run("log", str(job_id)).output == "\n".join(lines) + "\n"
    assert run("log", str(job_id), "-n", "2").output == "line 28\nline 29\n"
    r = run("log", "99")
    assert r.exit_code == 2 and r.output.strip() == "slurm-dlrm: error: job 99: no such job in your store"


def test_requeue_runs_a_cancelled_job_again_from_its_checkpoint(env):
    job_id = int(run("submit", "--no-service", "--parsable", str(EXAMPLES / "tiny-a.yaml")).output)
    r = run("requeue", "--no-service", str(job_id))
    assert r.exit_code == 2
    assert r.output.strip() == f"slurm-dlrm: error: job {job_id}: is PENDING; only CANCELLED, FAILED or TIMEOUT jobs can be requeued"
    before = json.loads(run("show", str(job_id), "--json").output)["attempt"]
    assert run("cancel", str(job_id)).exit_code == 0
    ckpt = _user_spool(env) / "jobs" / str(job_id) / "ckpt" / "step-000000030"
    ckpt.mkdir(parents=True)
    (ckpt / "manifest.json").write_text("{}")
    r = run("requeue", "--no-service", str(job_id))
    assert r.exit_code == 0, r.output
    assert r.output.strip() == f"job {job_id} requeued; it resumes from its checkpoint at step 30"
    d = json.loads(run("show", str(job_id), "--json").output)
    assert d["state"] == "PENDING" and d["attempt"] == before + 1
    assert d["events"][-1]["reason"] == "requeued by the user; resumes from its checkpoint at step 30"


def test_log_follow_prints_what_comes_until_the_job_ends(env):
    import os
    import subprocess
    import sys
    import time

    job_id = int(run("submit", "--no-service", "--parsable", str(EXAMPLES / "tiny-a.yaml")).output)
    log = _user_spool(env) / "jobs" / str(job_id) / "output-node1.log"
    log.write_text("first\n")
    proc = subprocess.Popen([sys.executable, "-m", "slurm_dlrm", "log", "-f", str(job_id)],  # noqa: S603
                            stdout=subprocess.PIPE, text=True, env=dict(os.environ))
    assert proc.stdout is not None
    assert proc.stdout.readline() == "first\n"
    with open(log, "a") as f:
        f.write("second\n")
    assert proc.stdout.readline() == "second\n"  # followed, not read once
    time.sleep(0.2)
    assert proc.poll() is None  # still pending: it keeps following
    with open(log, "a") as f:
        f.write("last words\n")
    assert run("cancel", str(job_id)).exit_code == 0
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and out == "last words\n"
