"""Issue 39 on the local Slurm cluster: packing never changes a result. The same spec
and seed give the same held-out metrics, bit for bit on the CPU, packed with a
neighbour and alone after a cancel + requeue from its checkpoint; the service reads the
evaluations into the store, where acct and queue show them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from service_harness import cli, show_job, wait_until

pytest.importorskip("slurm_dlrm.estimate")

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples" / "sweep"
# The jobs really train (slurm-dlrm train in the batch script): torch.
pytestmark = [pytest.mark.slurm, pytest.mark.torch]
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "OOM")


def _evals(spool: Path, job_id: int) -> dict[int, dict]:
    """The job's evaluations by step, without their time stamp and duration."""
    out = {}
    for line in (spool / "jobs" / str(job_id) / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("type") == "eval":
            out[r["step"]] = {k: v for k, v in r.items() if k not in ("t", "eval_s")}
    return out


def test_eval_metrics_are_the_same_packed_and_alone_after_cancel_and_requeue(live_service, tmp_path):
    """One spec packed with a neighbour, then alone in a pack of its own, cancelled once it
    has a checkpoint and requeued (it resumes there): every evaluation agrees bit for bit."""
    site, user = live_service
    spool = site.spool_dir_for(user)
    spec = yaml.safe_load((EXAMPLES / "tiny-a.yaml").read_text())
    # long enough to cancel mid-run, a checkpoint every 40 steps (240 steps, ~1 s left after
    # the first checkpoint, once completed before the cancel landed: a finished runner
    # leaves at once since it skips the interpreter's teardown)
    spec.update(name="same", steps=1200, batch_size=1024, seed=3, checkpoint_every_steps=40,
                metrics_every_steps=20, eval={"every_steps": 400, "batches": 2})
    (tmp_path / "same.yaml").write_text(yaml.safe_dump(spec))
    (tmp_path / "nb.yaml").write_text(yaml.safe_dump({**spec, "name": "nb", "seed": 9,
                                                      "optimizer": {"type": "sgd", "lr": 0.05}}))
    r = cli("submit", "--parsable", str(tmp_path / "same.yaml"), str(tmp_path / "nb.yaml"))
    assert r.exit_code == 0, r.output
    packed, neighbour = (int(x.split(";")[0]) for x in r.output.split())
    jobs = wait_until(lambda: all(show_job(i)["state"] in TERMINAL for i in (packed, neighbour))
                      and [show_job(packed), show_job(neighbour)])
    assert [j["state"] for j in jobs] == ["COMPLETED", "COMPLETED"], [(j["state"], j["reason"]) for j in jobs]
    assert jobs[0]["pack"] == jobs[1]["pack"]  # packed together

    r = cli("submit", "--parsable", str(tmp_path / "same.yaml"))
    assert r.exit_code == 0, r.output
    alone = int(r.output.split(";")[0])
    wait_until(lambda: (j := show_job(alone))["state"] == "RUNNING" and (j.get("checkpoint_step") or 0) >= 40, 180)
    assert cli("cancel", str(alone)).exit_code == 0
    first = wait_until(lambda: (j := show_job(alone))["state"] in TERMINAL and j)
    assert first["state"] == "CANCELLED", first["state"]
    assert cli("requeue", str(alone)).exit_code == 0
    done = wait_until(lambda: (j := show_job(alone))["state"] in TERMINAL and j)
    assert done["state"] == "COMPLETED" and done["pack"] != jobs[0]["pack"], (done["state"], done["reason"])
    assert any("resumed from" in line for log in done["logs"] for line in Path(log["path"]).read_text().splitlines())

    a, b = _evals(spool, packed), _evals(spool, alone)
    assert sorted(a) == [400, 800, 1200] and a == {s: b[s] for s in a}  # bit for bit, every evaluation
    assert a[1200] != _evals(spool, neighbour)[1200]  # the neighbour is another model
    # the service read them into the store: acct shows the last AUC and its step
    got = wait_until(lambda: (rows := json.loads(cli("acct", "--json", "-o", "JobID,AUC,EvalStep").output))
                     and all(r["AUC"] is not None for r in rows) and rows, 30)
    by_id = {r["JobID"]: r for r in got}
    assert by_id[packed]["AUC"] == by_id[alone]["AUC"] == round(a[1200]["eval_auc"], 6)
    assert by_id[alone]["EvalStep"] == by_id[packed]["EvalStep"] == 1200
