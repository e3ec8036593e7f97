"""Issue 39 on the local Slurm cluster: packing never changes a result. The same spec
and seed give the same held-out metrics, bit for bit on the CPU, packed with a
neighbour and alone after a cancel + requeue from its checkpoint; the service reads the
evaluations into the store, where acct and queue show them."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from service_harness import make_site

pytest.importorskip("slurm_dlrm.estimate")

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples" / "sweep"
# The jobs really train (slurm-dlrm train in the batch script): torch.
pytestmark = [pytest.mark.slurm, pytest.mark.torch]
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "OOM")


@pytest.fixture
def live(slurm_cluster, tmp_path, monkeypatch):
    from slurm_dlrm.service.daemon import spawn_service, stop, wait_until_running
    from slurm_dlrm.service.submit import service_paths
    from slurm_dlrm.store.store import Store, current_user

    make_site(tmp_path)
    site_file = tmp_path / "site.toml"
    text = (REPO / "site-config" / "site.toml").read_text()
    text = text.replace('store_dir = "~/.local/share/slurm-dlrm"', f'store_dir = "{tmp_path}/store-{{user}}"')
    text = text.replace('spool_dir = "~/.local/share/slurm-dlrm/spool"', f'spool_dir = "{tmp_path}/spool-{{user}}"')
    site_file.write_text(text)
    monkeypatch.setenv("SLURM_DLRM_SITE", str(site_file))
    monkeypatch.setenv("SLURM_CONF", str(slurm_cluster.slurm_conf))
    monkeypatch.chdir(tmp_path)
    from slurm_dlrm.site import load_site

    site = load_site(str(site_file))
    user = current_user()
    paths = service_paths(site, user)
    spawn_service(paths, ["--round-seconds", "1"])
    assert wait_until_running(paths, timeout_s=30) is not None, paths.log.read_text()[-2000:]
    yield site, user
    try:
        stop(paths, timeout_s=30)
    finally:
        with Store.for_user(site, user) as store:  # leave nothing of this test in Slurm
            ids = {p.slurm_job_id for p in store.packs(["SUBMITTING", "QUEUED", "RUNNING"]) if p.slurm_job_id}
        if ids:
            subprocess.run(["scancel", *sorted(ids)], check=False, timeout=30)  # noqa: S603, S607


def run(*args: str):
    from slurm_dlrm.cli import cli

    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def _job(job_id: int) -> dict:
    r = run("show", str(job_id), "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def _until(what, timeout_s: float = 240.0, every_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while True:
        got = what()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what.__doc__ or what}"
        time.sleep(every_s)


def _evals(spool: Path, job_id: int) -> dict[int, dict]:
    """The job's evaluations by step, without their time stamp and duration."""
    out = {}
    for line in (spool / "jobs" / str(job_id) / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("type") == "eval":
            out[r["step"]] = {k: v for k, v in r.items() if k not in ("t", "eval_s")}
    return out


def test_eval_metrics_are_the_same_packed_and_alone_after_cancel_and_requeue(live, tmp_path):
    """One spec packed with a neighbour, then alone in a pack of its own, cancelled once it
    has a checkpoint and requeued (it resumes there): every evaluation agrees bit for bit."""
    site, user = live
    spool = site.spool_dir_for(user)
    spec = yaml.safe_load((EXAMPLES / "tiny-a.yaml").read_text())
    # long enough to cancel mid-run (a few seconds of training), a checkpoint every 40 steps
    spec.update(name="same", steps=240, batch_size=1024, seed=3, checkpoint_every_steps=40,
                metrics_every_steps=20, eval={"every_steps": 80, "batches": 2})
    (tmp_path / "same.yaml").write_text(yaml.safe_dump(spec))
    (tmp_path / "nb.yaml").write_text(yaml.safe_dump({**spec, "name": "nb", "seed": 9,
                                                      "optimizer": {"type": "sgd", "lr": 0.05}}))
    r = run("submit", "--parsable", str(tmp_path / "same.yaml"), str(tmp_path / "nb.yaml"))
    assert r.exit_code == 0, r.output
    packed, neighbour = (int(x.split(";")[0]) for x in r.output.split())
    jobs = _until(lambda: all(_job(i)["state"] in TERMINAL for i in (packed, neighbour))
                  and [_job(packed), _job(neighbour)])
    assert [j["state"] for j in jobs] == ["COMPLETED", "COMPLETED"], [(j["state"], j["reason"]) for j in jobs]
    assert jobs[0]["pack"] == jobs[1]["pack"]  # packed together

    r = run("submit", "--parsable", str(tmp_path / "same.yaml"))
    assert r.exit_code == 0, r.output
    alone = int(r.output.split(";")[0])
    _until(lambda: (j := _job(alone))["state"] == "RUNNING" and (j.get("checkpoint_step") or 0) >= 40, 180)
    assert run("cancel", str(alone)).exit_code == 0
    first = _until(lambda: (j := _job(alone))["state"] in TERMINAL and j)
    assert first["state"] == "CANCELLED", first["state"]
    assert run("requeue", str(alone)).exit_code == 0
    done = _until(lambda: (j := _job(alone))["state"] in TERMINAL and j)
    assert done["state"] == "COMPLETED" and done["pack"] != jobs[0]["pack"], (done["state"], done["reason"])
    assert any("resumed from" in line for log in done["logs"] for line in Path(log["path"]).read_text().splitlines())

    a, b = _evals(spool, packed), _evals(spool, alone)
    assert sorted(a) == [80, 160, 240] and a == {s: b[s] for s in a}  # bit for bit, every evaluation
    assert a[240] != _evals(spool, neighbour)[240]  # the neighbour is another model
    # the service read them into the store: acct shows the last AUC and its step
    got = _until(lambda: (rows := json.loads(run("acct", "--json", "-o", "JobID,AUC,EvalStep").output))
                 and all(r["AUC"] is not None for r in rows) and rows, 30)
    by_id = {r["JobID"]: r for r in got}
    assert by_id[packed]["AUC"] == by_id[alone]["AUC"] == round(a[240]["eval_auc"], 6)
    assert by_id[alone]["EvalStep"] == by_id[packed]["EvalStep"] == 240
