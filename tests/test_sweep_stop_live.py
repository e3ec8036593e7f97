"""Issue 47 on the local Slurm cluster: a sweep with a stopping rule pauses its loser at
its first rung through the agent's stop path (its neighbour goes on in the same pack),
`queue`/`show` say why, a job submitted then takes the freed share, and `requeue`
resumes the paused variant from its checkpoint bit for bit: its evaluations are those
of the same spec trained straight through."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from service_harness import cli, show_job, wait_until

pytest.importorskip("slurm_dlrm.estimate")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "sweep"
pytestmark = [pytest.mark.slurm, pytest.mark.torch]
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "OOM", "TIMEOUT")


LOSER_STEPS = 4000


def _evals(spool: Path, job_id: int) -> dict[int, dict]:
    out = {}
    for line in (spool / "jobs" / str(job_id) / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("type") == "eval":
            out[r["step"]] = {k: v for k, v in r.items() if k not in ("t", "eval_s")}
    return out


def test_a_loser_pauses_at_its_rung_its_share_is_refilled_and_requeue_resumes_it_bit_for_bit(live_service, tmp_path):
    site, user = live_service
    spool = site.spool_dir_for(user)
    base = yaml.safe_load((EXAMPLES / "tiny-a.yaml").read_text())
    # eval.samples given: the job submitted later without the rule is judged on the same set
    base.update(metrics_every_steps=10, checkpoint_every_steps=1000, eval={"every_steps": 20, "samples": 256},
                sweep={"min_steps": 20})
    # ASHA lets the first variant at a rung go on (no rivals yet), so the loser must reach
    # step 20 second: a race of two start-ups when both run at once (the loser won it on a
    # loaded host and went on), so it starts after the winner's end (`singleton`: both are
    # named "pair") in the share the winner freed; a third variant, judged first at step
    # 50000 (never here), holds their pack open
    good = {**base, "name": "pair", "steps": 60, "optimizer": {"type": "adagrad", "lr": 0.05}}
    # one rung (20) and 4000 steps: on a quiet host it reached its end within the round
    # that judged it at 60 steps, and once at 1000 (3.3 ms a step: done 1.4 s after its
    # pause was decided, so it completed; nothing to save then)
    loser = {**base, "name": "pair", "steps": LOSER_STEPS, "optimizer": {"type": "sgd", "lr": 1e-6}}  # learns nothing
    anchor = {**base, "name": "anchor", "steps": 100_000, "sweep": {"min_steps": 50_000}}
    (tmp_path / "good.yaml").write_text(yaml.safe_dump(good))
    (tmp_path / "loser.yaml").write_text("#SBATCH --dependency=singleton\n" + yaml.safe_dump(loser))
    (tmp_path / "anchor.yaml").write_text(yaml.safe_dump(anchor))
    r = cli("submit", "--parsable", *(str(tmp_path / f"{n}.yaml") for n in ("good", "loser", "anchor")))
    assert r.exit_code == 0, r.output
    g, lo, a = (int(x) for x in r.output.split())

    paused = wait_until(lambda: (j := show_job(lo))["state"] == "PENDING" and j["attempt"] >= 1 and j, 180)
    assert show_job(g)["state"] == "COMPLETED" and show_job(a)["state"] == "RUNNING"  # neighbour undisturbed
    ev = [(e["kind"], e["reason"]) for e in show_job(g)["events"] if e["kind"].startswith("sweep_")]
    assert len(ev) == 1 and ev[0][0] == "sweep_go_on" and "ranks 1 of 1" in ev[0][1], ev  # first at rung 0
    (row,) = [x for x in json.loads(cli("queue", "--json", "--no-slurm").output)["jobs"] if x["job_id"] == lo]
    assert row["reason"].startswith("SweepPaused: auc ") and "at step 20 is below rung 0's cut" in row["reason"]
    assert "(1 of 2 go on)" in row["reason"] and row["rung"] == "0 paused"
    step = paused.get("checkpoint_step")
    assert step is not None and step >= 20  # stopped with a checkpoint at or just past its rung

    # the freed share: a job submitted now joins the pack
    (tmp_path / "ref.yaml").write_text(yaml.safe_dump({**{k: v for k, v in loser.items() if k != "sweep"},
                                                       "name": "ref"}))
    r = cli("submit", "--parsable", str(tmp_path / "ref.yaml"))
    assert r.exit_code == 0, r.output
    ref = int(r.output.split()[0])
    joined = wait_until(lambda: (j := show_job(ref))["state"] in ("RUNNING", *TERMINAL) and j, 120)
    pack = paused["placements"][-1]["pack"]
    assert joined["pack"] == pack == show_job(a)["pack"], (joined["pack"], pack, show_job(a)["pack"])
    assert show_job(lo)["state"] == "PENDING"  # held: not dispatched with it

    r = cli("requeue", str(lo))
    assert r.exit_code == 0 and "promoted by hand" in r.output, r.output
    done = wait_until(lambda: (j := show_job(lo))["state"] in TERMINAL and j, 180)
    assert done["state"] == "COMPLETED", (done["state"], done["reason"])
    wait_until(lambda: show_job(ref)["state"] in TERMINAL, 120)
    got, straight = _evals(spool, lo), _evals(spool, ref)
    assert sorted(got) == list(range(20, LOSER_STEPS + 1, 20)) and got == straight  # paused + resumed = straight, bit for bit
    assert cli("cancel", "-n", "pair").exit_code == 0  # the sweep's name: its variants (the anchor)
    wait_until(lambda: show_job(a)["state"] in TERMINAL, 60)
