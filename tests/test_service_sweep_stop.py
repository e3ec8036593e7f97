"""A sweep's stopping rule in the service (issue 47), on FakeSlurm with a fake clock: rung
evaluations judged once each, a loser paused through the agent's stop path and held
PENDING (not dispatched, its reason readable), promoted when later variants lower the
cut, promoted by hand with `requeue`, never promoted once cancelled; queue shows rungs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from service_harness import FakeCluster, estimate_dict, fake_service, spec_dict

from slurm_dlrm.service.cancel import cancel_job, requeue_job
from slurm_dlrm.service.queue import queue_rows
from slurm_dlrm.service.sweep_stop import GO_ON, PAUSE, PROMOTE, is_paused, sweep_marks
from slurm_dlrm.store import JobState

USER = "root"
RULE = {"stop": "asha", "metric": "auc", "min_steps": 10, "reduction": 3, "id": "lr.abc"}  # rungs 10, 30


@pytest.fixture
def world(tmp_path):
    svc, store, slurm, clock = fake_service(tmp_path, USER)
    yield svc, store, slurm, clock, FakeCluster(slurm, clock)
    store.close()


def add_variant(store, name, rule=RULE):
    spec = {**spec_dict(name, steps=100), "sweep": dict(rule)}
    return int(store.add_job(user=USER, name=name, spec=spec, spec_fingerprint="fp", estimate=estimate_dict(),
                             gpu_model="h100"))


def write_eval(svc, clock, job_id, step, auc):
    d = Path(svc.spool_dir) / "jobs" / str(job_id)
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"type": "eval", "step": step, "t": clock(), "eval_auc": auc}) + "\n")
    clock.advance(1.0)


def start_all(svc, slurm, cluster):
    """A round plans the pending variants; Slurm starts every pack; members report RUNNING."""
    svc.run_round()
    for j in list(slurm.jobs.values()):
        if j.state.name == "PENDING":
            slurm.start(j.job_id)
            p = cluster.placement_of(j.job_id)
            for m in p["members"]:
                cluster.member(p, m["job_id"], "RUNNING")
    svc.run_round()


def kinds(store, job_id):
    return [e["kind"] for e in store.events(job_id=job_id) if e["kind"].startswith("sweep_")]


def test_a_variant_the_rule_may_pause_asks_for_a_pack_of_its_own_gpu(world):
    # docs/packing.md "Sweeps that stop their losers": the policy packs it one GPU wide
    svc, store, *_ = world
    a = add_variant(store, "lr-a")
    plain = int(store.add_job(user=USER, name="plain", spec=spec_dict("plain", steps=100), spec_fingerprint="fp",
                              estimate=estimate_dict(), gpu_model="h100"))
    assert svc.demand_of(store.get_job(a)).may_pause and not svc.demand_of(store.get_job(plain)).may_pause


def stop_reported(svc, store, cluster, job_id, by="sweep-pause"):
    """The agent saw the cancel file: the member checkpointed and stopped."""
    job = store.get_job(job_id)
    pack = store.get_pack(job.pack_id)
    assert (Path(pack.pack_dir) / "cancel" / str(job_id)).read_text().split()[1:2] == ([by] if by else [])
    p = cluster.placement_of(int(pack.slurm_job_id))
    cluster.member(p, job_id, "CANCELLED", reason="cancelled by the service")
    svc.run_round()


def test_a_loser_pauses_at_its_checkpoint_is_held_and_a_later_arrival_promotes_it(world):
    svc, store, slurm, clock, cluster = world
    a, b = add_variant(store, "lr-a"), add_variant(store, "lr-b")
    start_all(svc, slurm, cluster)
    assert store.get_job(a).state == JobState.RUNNING == store.get_job(b).state
    write_eval(svc, clock, a, 10, 0.70)
    write_eval(svc, clock, b, 10, 0.65)
    write_eval(svc, clock, a, 20, 0.71)  # not a rung: judged by nobody
    svc.run_round()
    assert kinds(store, a) == [GO_ON] and kinds(store, b) == [PAUSE]
    (pause,) = store.events(job_id=b, kind=PAUSE)
    assert pause["reason"] == "paused: auc 0.6500 at step 10 is below rung 0's cut 0.7000 (1 of 2 go on)"
    assert pause["data"] == {"rung": 0, "step": 10, "metric": "auc", "value": 0.65, "cut": 0.70, "keep": 1,
                             "reached": 2, "rank": 2, "margin": 0.0}  # b has one eval: no noise of its own measured
    svc.run_round()
    assert kinds(store, b) == [PAUSE]  # one event per decision, not one per round

    stop_reported(svc, store, cluster, b)
    job = store.get_job(b)
    assert job.state == JobState.PENDING and is_paused(store, job)
    assert store.get_job(a).state == JobState.RUNNING  # its neighbour is not disturbed
    for _ in range(2):
        svc.run_round()
    assert store.get_job(b).state == JobState.PENDING and store.get_job(b).pack_id == job.pack_id  # held: not planned
    (row,) = [r for r in queue_rows(store, user=USER, service={}) if r["job_id"] == b]
    assert row["reason"].startswith("SweepPaused: auc 0.6500 at step 10 is below rung 0's cut 0.7000")
    assert row["rung"] == "0 paused"

    # four more variants arrive below both: keep = 6 // 3 = 2, so b (second best) is promoted
    more = [add_variant(store, f"lr-{c}") for c in "cdef"]
    start_all(svc, slurm, cluster)
    for i, j in enumerate(more):
        write_eval(svc, clock, j, 10, 0.50 + i / 100)
    svc.run_round()
    assert kinds(store, b) == [PAUSE, PROMOTE]
    assert all(kinds(store, j) == [PAUSE] for j in more)
    assert not is_paused(store, store.get_job(b))
    svc.run_round()
    assert store.get_job(b).state in (JobState.PLANNED, JobState.RUNNING)  # dispatched again, resumes
    assert sweep_marks(store, [a, b]) == {a: ("0 on", store.events(job_id=a, kind=GO_ON)[0]["reason"]),
                                           b: ("0 promoted", store.events(job_id=b, kind=PROMOTE)[0]["reason"])}


def test_a_variant_within_its_own_eval_noise_of_the_cut_goes_on(world):
    # adapt/asha.py: outside the top, but less than 2 x sqrt(2) x its eval noise (measured
    # from its own successive evals up to the rung) below the cut: it goes on
    svc, store, slurm, clock, cluster = world
    a, b, c = (add_variant(store, f"lr-{x}") for x in "abc")
    start_all(svc, slurm, cluster)
    for j, base in ((a, 0.70), (b, 0.69), (c, 0.69)):
        for step in (2, 4, 6, 8, 10):
            write_eval(svc, clock, j, step, base if step == 10 or j != b else base + (0.004 if step % 4 else -0.004))
        if j == a:
            svc.run_round()  # a first: it goes on alone
    svc.run_round()
    # b's evals wander 0.004 about a line: a margin of 0.0171, so 0.69 against the cut 0.70 goes on;
    # c's evals lie on a line: no noise, no margin, paused
    assert kinds(store, a) == [GO_ON] and kinds(store, b) == [GO_ON] and kinds(store, c) == [PAUSE]
    (on,) = store.events(job_id=b, kind=GO_ON)
    assert on["reason"].startswith("goes on at rung 0: auc 0.6900 ranks 2 of 3 (1 go on), within its eval noise "
                                "0.0171 of the cut 0.7000")
    assert on["data"]["margin"] == pytest.approx(0.0171, abs=1e-4) and store.events(job_id=c, kind=PAUSE)[0]["data"]["margin"] == 0.0


def test_steps_run_past_a_pause_judge_nothing_until_it_is_promoted(world):
    svc, store, slurm, clock, cluster = world
    a, b = add_variant(store, "lr-a"), add_variant(store, "lr-b")
    start_all(svc, slurm, cluster)
    write_eval(svc, clock, a, 10, 0.70)
    write_eval(svc, clock, b, 10, 0.60)
    svc.run_round()
    write_eval(svc, clock, b, 30, 0.90)  # the pause had not landed yet: b ran on to rung 1
    svc.run_round()
    assert kinds(store, b) == [PAUSE]
    write_eval(svc, clock, a, 30, 0.80)
    svc.run_round()
    (ev,) = store.events(job_id=a, kind=GO_ON)[1:]
    assert ev["data"]["rung"] == 1 and ev["data"]["reached"] == 1  # b's 0.90 at rung 1 did not count


def test_cancelling_the_sweep_by_name_stops_paused_ones_for_good(world):
    from slurm_dlrm.commands.queue import _sweep_name, name_matches

    svc, store, slurm, clock, cluster = world
    a, b = add_variant(store, "lr-a"), add_variant(store, "lr-b")
    start_all(svc, slurm, cluster)
    write_eval(svc, clock, a, 10, 0.70)
    write_eval(svc, clock, b, 10, 0.60)
    svc.run_round()
    stop_reported(svc, store, cluster, b)
    job = store.get_job(b)
    assert name_matches({"name": job.name, "sweep": _sweep_name(job)}, {"lr"})
    assert not name_matches({"name": job.name, "sweep": _sweep_name(job)}, {"l"})
    assert "cancelled" in cancel_job(store, slurm, b, user=USER)
    more = [add_variant(store, f"lr-{c}") for c in "cdef"]
    start_all(svc, slurm, cluster)
    for j in more:
        write_eval(svc, clock, j, 10, 0.1)
    svc.run_round()
    assert store.get_job(b).state == JobState.CANCELLED and kinds(store, b) == [PAUSE]  # never promoted


def test_requeue_promotes_a_paused_variant_by_hand(world, tmp_path):
    svc, store, slurm, clock, cluster = world
    a, b = add_variant(store, "lr-a"), add_variant(store, "lr-b")
    start_all(svc, slurm, cluster)
    write_eval(svc, clock, a, 10, 0.70)
    write_eval(svc, clock, b, 10, 0.60)
    svc.run_round()
    stop_reported(svc, store, cluster, b)
    assert "promoted by hand" in requeue_job(store, tmp_path, b, user=USER)
    assert kinds(store, b) == [PAUSE, PROMOTE]
    assert store.events(job_id=b, kind=PROMOTE)[0]["data"]["by"] == "user"
    svc.run_round()
    assert store.get_job(b).state in (JobState.PLANNED, JobState.RUNNING)


def test_a_sweep_without_a_rule_is_left_alone(world):
    svc, store, slurm, clock, cluster = world
    plain = [int(store.add_job(user=USER, name=f"p{i}", spec=spec_dict(f"p{i}"), spec_fingerprint="fp",
                               estimate=estimate_dict(), gpu_model="h100")) for i in range(2)]
    start_all(svc, slurm, cluster)
    write_eval(svc, clock, plain[0], 10, 0.7)
    write_eval(svc, clock, plain[1], 10, 0.5)
    svc.run_round()
    assert all(kinds(store, j) == [] for j in plain)


def test_acct_sweep_shows_each_variants_rung_its_metric_there_and_the_saving(world):
    from slurm_dlrm.store.sweep_report import render_sweep, sweep_rows, sweep_saving

    svc, store, slurm, clock, cluster = world
    a, b = add_variant(store, "lr-a"), add_variant(store, "lr-b")
    start_all(svc, slurm, cluster)
    write_eval(svc, clock, a, 10, 0.70)
    write_eval(svc, clock, b, 10, 0.60)
    svc.run_round()
    stop_reported(svc, store, cluster, b)
    clock.advance(60.0)
    write_eval(svc, clock, a, 30, 0.75)
    write_eval(svc, clock, a, 100, 0.80)
    svc.run_round()
    rows, _fields = sweep_rows(store, "lr", now=clock())
    by_id = {r["job_id"]: r for r in rows}
    assert by_id[a]["rung"] == "1 on" and by_id[a]["at_rungs"] == [0.70, 0.75, None]  # rungs 10, 30, 90
    assert by_id[b]["rung"] == "0 paused" and by_id[b]["at_rungs"] == [0.60, None, None]
    # b stopped at step 10 of 100: trained to its end it would have cost what a did (start-up and
    # stop are the same for a short and a long run, so not 10x its own)
    used_a, used_b = by_id[a]["gpu_hours"], by_id[b]["gpu_hours"]
    assert used_b > 0 and used_a > used_b
    assert by_id[b]["gpu_hours_full"] == pytest.approx(used_a) and by_id[a]["gpu_hours_full"] == used_a
    saving = sweep_saving(rows)
    assert saving is not None and saving["gpu_hours_saved"] == pytest.approx(used_a - used_b)
    text = render_sweep(rows, _fields)
    assert text.splitlines()[0].split()[:5] == ["JobID", "Name", "State", "Rung", "AtRungs"]
    assert "0.6000/-/-" in text and text.splitlines()[-1].startswith("sweep: 2 variants used ")
    assert json.loads(render_sweep(rows, _fields, "json"))[0]["AtRungs"] is not None


def test_a_restarted_service_still_holds_a_pause_that_lands_in_its_first_round(world):
    from slurm_dlrm.service.core import PackingService

    svc, store, slurm, clock, cluster = world
    a, b = add_variant(store, "lr-a"), add_variant(store, "lr-b")
    start_all(svc, slurm, cluster)
    write_eval(svc, clock, a, 10, 0.70)
    write_eval(svc, clock, b, 10, 0.60)
    svc.run_round()
    fresh = PackingService(store, slurm, svc.site, svc.settings, clock=clock)  # knows no sweep yet
    stop_reported(fresh, store, cluster, b)
    assert store.get_job(b).state == JobState.PENDING and is_paused(store, store.get_job(b))
    fresh.run_round()
    assert store.get_job(b).state == JobState.PENDING  # held


def test_the_users_cancel_while_a_pause_is_on_its_way_cancels(world):
    svc, store, slurm, clock, cluster = world
    a, b = add_variant(store, "lr-a"), add_variant(store, "lr-b")
    start_all(svc, slurm, cluster)
    write_eval(svc, clock, a, 10, 0.70)
    write_eval(svc, clock, b, 10, 0.60)
    svc.run_round()
    cancel_job(store, slurm, b, user=USER)
    stop_reported(svc, store, cluster, b, by=None)  # the user's cancel wrote the file last
    assert store.get_job(b).state == JobState.CANCELLED
