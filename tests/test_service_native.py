"""`submit --no-pack` jobs are store rows (issue 23, one job identity): recorded before
sbatch, followed and settled by the service's rounds from squeue/sacct, shown by
queue/show/acct with their Slurm id, cancelled by scancel. FakeSlurm, fake clock."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from service_harness import FakeClock, make_site, write_site_file

from slurm_dlrm.admin.marker import parse_marker
from slurm_dlrm.errors import BadInput
from slurm_dlrm.service.cancel import cancel_job, requeue_job
from slurm_dlrm.service.core import PackingService, RoundStats, ServiceSettings
from slurm_dlrm.service.native import native_ending, observe_native, record_and_submit
from slurm_dlrm.service.queue import job_details, queue_rows
from slurm_dlrm.service.sbatch_options import SbatchOptions
from slurm_dlrm.service.submit import native_request, prepare
from slurm_dlrm.slurm import SlurmError
from slurm_dlrm.slurm.fake import FakeSlurm
from slurm_dlrm.store.acct import AcctFilter, acct_rows
from slurm_dlrm.store.states import JobState
from slurm_dlrm.store.store import Store

REPO = Path(__file__).resolve().parent.parent
SPEC = REPO / "examples" / "sweep" / "tiny-a.yaml"
USER = "root"
SERVICE = {"running": True, "slurm_ok": True}


@pytest.fixture
def world(tmp_path):
    clock = FakeClock()
    site = make_site(tmp_path)
    store = Store(tmp_path / "store.sqlite", clock=clock)
    slurm = FakeSlurm(clock=clock, user=USER)
    svc = PackingService(store, slurm, site, ServiceSettings(user=USER, python="/py", dispatch_window_s=0.0),
                         clock=clock, spool_dir=tmp_path / "spool")
    yield svc, store, slurm, clock, site, tmp_path
    store.close()


def submit(svc, site, tmp_path, n=1, partition="dlrm"):
    subs = prepare([str(SPEC)] * n, SbatchOptions(partition=partition), site, str(tmp_path))
    items = [(s, native_request(s, site)) for s in subs]
    return record_and_submit(svc.store, svc.slurm, items, user=USER, site=site, spool_dir=svc.spool_dir,
                             python="/py")


def test_a_no_pack_job_is_a_row_followed_to_its_end_and_shown_with_its_slurm_id(world):
    svc, store, slurm, clock, site, tmp = world
    (res,) = submit(svc, site, tmp)
    job = store.get_job(res.job_id)
    assert job.no_pack and job.state == JobState.PLANNED and job.slurm_job_id == str(res.slurm_job_id)
    fake = slurm.job(res.slurm_job_id)
    marker = parse_marker(fake.comment)
    assert marker is not None and marker.mode == "no-pack" and marker.job_id == res.job_id
    assert f"--output={tmp / 'spool' / 'jobs' / str(res.job_id)}/output-%N.log" in fake.args
    assert "SLURM_DLRM_METRICS_FILE=" in fake.script  # progress where show/log read it
    # a round never packs it; while Slurm has it pending, queue says so with Slurm's reason
    stats = svc.run_round()
    assert stats.packs_submitted == 0 and store.packs() == []
    (row,) = queue_rows(store, user=USER, service=SERVICE, slurm_reasons={str(res.slurm_job_id): "Resources"})
    assert (row["pack"], row["slurm_job_id"], row["state"], row["reason"]) == \
        ("no-pack", str(res.slurm_job_id), "PLANNED", "queued in Slurm (Resources)")
    # Slurm starts it on GPU 2 of node1: RUNNING, with the node's own GPU index
    clock.advance(5)
    slurm.start(res.slurm_job_id, gpu_idx="2")
    svc.run_round()
    job = store.get_job(res.job_id)
    assert job.state == JobState.RUNNING and job.nodes == "node1" and job.gpu_idx == "2"
    (row,) = queue_rows(store, user=USER, service=SERVICE)
    assert (row["node"], row["gpu"], row["gpu_mem_mib"]) == ("node1", 2, res.req.gpu_mem_mib)
    clock.advance(60)
    slurm.finish(res.slurm_job_id, 0)
    svc.run_round()
    job = store.get_job(res.job_id)
    assert (job.state, job.exit_code, job.exit_reason) == (JobState.COMPLETED, 0, "exited 0")
    d = job_details(store, res.job_id, user=USER, service=SERVICE)
    assert d["mode"] == "no-pack" and d["no_pack"]["gres"] == res.req.gres and d["gpu"] == 2
    (a,) = acct_rows(store, AcctFilter())
    assert (a["pack_name"], a["slurm_job_id"], a["state"], a["exit_code"], a["nodes"]) == \
        ("no-pack", str(res.slurm_job_id), "COMPLETED", 0, "node1")
    assert a["n_gpus"] == 1 and a["run_s"] == pytest.approx(60.0)
    share = job.gpu_share
    assert share is not None and a["gpu_hours"] == pytest.approx(60.0 * share / 3600)


def test_sbatch_refused_leaves_a_failed_row_with_slurms_words(world):
    svc, store, slurm, clock, site, tmp = world
    (res,) = submit(svc, site, tmp, partition="nope")
    assert res.slurm_job_id is None and "invalid partition" in res.error
    job = store.get_job(res.job_id)
    assert job.state == JobState.FAILED and "sbatch refused: invalid partition specified: nope" in job.exit_reason
    assert slurm.submitted == []


def test_an_sbatch_that_timed_out_stays_pending_until_the_service_looked(world):
    from slurm_dlrm.slurm import SlurmTimeout

    svc, store, slurm, clock, site, tmp = world
    slurm.fail_next["sbatch"] = SlurmTimeout(["sbatch"], 30.0)
    (res,) = submit(svc, site, tmp)
    assert res.unanswered and res.slurm_job_id is None  # Slurm may have it: not FAILED yet
    assert store.get_job(res.job_id).state == JobState.PENDING
    (row,) = queue_rows(store, user=USER, service=SERVICE)
    assert row["reason"] == "submitting to Slurm"
    clock.advance(svc.settings.sbatch_timeout_s + 6)
    svc.run_round()  # no Slurm job carries its marker: it never got there
    job = store.get_job(res.job_id)
    assert job.state == JobState.FAILED and "before Slurm answered" in job.exit_reason


def test_a_failed_store_write_after_sbatch_cancels_the_slurm_job(world, monkeypatch):
    svc, store, slurm, clock, site, tmp = world
    real = store.transition_job

    def broken(job_id, to, *a, **kw):
        if to == JobState.PLANNED:
            raise OSError("disk full")
        return real(job_id, to, *a, **kw)

    monkeypatch.setattr(store, "transition_job", broken)
    with pytest.raises(OSError, match="disk full"):
        submit(svc, site, tmp)
    (fake,) = slurm.submitted
    assert fake.slurm_state == "CANCELLED"  # no Slurm job the store does not know


def test_a_row_whose_submit_died_before_sbatch_answered_is_found_or_failed(world):
    svc, store, slurm, clock, site, tmp = world
    a, b = submit(svc, site, tmp, n=2)
    # as if each submit had died after its sbatch: the rows have no Slurm id
    store.conn.execute("UPDATE jobs SET state = 'PENDING', slurm_job_id = NULL")
    slurm.scancel([b.slurm_job_id])
    slurm.purge(b.slurm_job_id)  # b's never reached Slurm (as far as squeue knows)
    svc.run_round()
    assert [store.get_job(i).state for i in (a.job_id, b.job_id)] == [JobState.PENDING] * 2  # sbatch may still run
    clock.advance(svc.settings.sbatch_timeout_s + 6)
    svc.run_round()
    ja, jb = store.get_job(a.job_id), store.get_job(b.job_id)
    assert ja.state == JobState.PLANNED and ja.slurm_job_id == str(a.slurm_job_id)  # by the marker's job_id
    assert jb.state == JobState.FAILED and "before Slurm answered" in jb.exit_reason
    assert store.packs() == []


def test_cancel_scancels_a_no_pack_job_of_ones_own_only(world):
    svc, store, slurm, clock, site, tmp = world
    queued, running = submit(svc, site, tmp, n=2)
    slurm.start(running.slurm_job_id)
    svc.run_round()
    with pytest.raises(BadInput, match="belongs to root, not alice"):
        cancel_job(store, slurm, queued.job_id, user="alice")
    assert slurm.job(queued.slurm_job_id).slurm_state == "PENDING"
    assert "was queued" in cancel_job(store, slurm, queued.job_id, user=USER)
    assert store.get_job(queued.job_id).state == JobState.CANCELLED
    assert slurm.job(queued.slurm_job_id).slurm_state == "CANCELLED"
    assert "cancel sent to Slurm job" in cancel_job(store, slurm, running.job_id, user=USER)
    clock.advance(3)
    svc.run_round()  # Slurm's end (SIGTERM: 0:15) recorded by the round
    job = store.get_job(running.job_id)
    assert job.state == JobState.CANCELLED and job.exit_code == 128 + 15
    with pytest.raises(BadInput, match="submit its spec again"):
        requeue_job(store, tmp / "spool", running.job_id, user=USER)


def test_an_end_squeue_forgot_comes_from_sacct(world):
    svc, store, slurm, clock, site, tmp = world
    (res,) = submit(svc, site, tmp)
    slurm.start(res.slurm_job_id)
    clock.advance(30)
    slurm.finish(res.slurm_job_id, 3)  # the runner's CUDA OOM exit code
    slurm.purge(res.slurm_job_id)
    svc.run_round()  # PLANNED -> RUNNING (from sacct's Start) -> OOM
    job = store.get_job(res.job_id)
    assert job.state == JobState.OOM and job.exit_code == 3 and "GPU memory" in job.exit_reason
    assert [e["to"] for e in job_details(store, res.job_id, user=USER, service=SERVICE)["events"]
            if e["kind"] == "job_state"] == ["PENDING", "PLANNED", "RUNNING", "OOM"]


def test_a_node_failure_is_not_the_end_slurm_reruns_it(world):
    """Issue 49 (chaos_live, a node lost): squeue's NODE_FAIL was recorded as the job's end
    (FAILED) while Slurm requeued it and ran it again unseen. A no-pack job carries
    --requeue; while squeue still has it, NODE_FAIL is not its end: the rerun's is.
    Gone from squeue with NODE_FAIL in sacct (not requeued), it is FAILED as before."""
    svc, store, slurm, clock, site, tmp = world
    (res,) = submit(svc, site, tmp)
    assert "#SBATCH --requeue" in slurm.job(res.slurm_job_id).script
    slurm.start(res.slurm_job_id)
    svc.run_round()
    clock.advance(30)
    slurm.set_state(res.slurm_job_id, "NODE_FAIL")
    svc.run_round()
    assert store.get_job(res.job_id).state == JobState.RUNNING
    fake = slurm.job(res.slurm_job_id)  # Slurm's requeue: pending, then running again
    fake.slurm_state, fake.end_time = "PENDING", None
    svc.run_round()
    slurm.start(res.slurm_job_id)
    clock.advance(30)
    slurm.finish(res.slurm_job_id, 0)
    svc.run_round()
    assert store.get_job(res.job_id).state == JobState.COMPLETED
    (other,) = submit(svc, site, tmp)
    slurm.start(other.slurm_job_id)
    svc.run_round()
    slurm.set_state(other.slurm_job_id, "NODE_FAIL")
    slurm.purge(other.slurm_job_id)
    svc.run_round()
    assert store.get_job(other.job_id).state == JobState.FAILED


@pytest.mark.parametrize("gone_from_squeue", [False, True])
def test_a_job_slurm_requeued_is_charged_its_runs_not_the_wait_between(world, gone_from_squeue):
    """Issue 49 (chaos_live): a --no-pack job Slurm requeued at NODE_FAIL was charged from
    its first start to its last end, the wait between its runs included (~0.004 h a job
    there). Its runs come from Slurm's accounting (sacct --duplicates: a row per run), also
    once squeue forgot it, when the last row, not the first (the NODE_FAIL), is its end."""
    svc, store, slurm, clock, site, tmp = world
    (res,) = submit(svc, site, tmp)
    slurm.start(res.slurm_job_id)
    svc.run_round()
    clock.advance(40)
    slurm.requeue_by_slurm(res.slurm_job_id, "NODE_FAIL")  # ran 40 s, then its node was lost
    svc.run_round()
    clock.advance(300)  # pending 300 s: the node comes back
    svc.run_round()
    slurm.start(res.slurm_job_id)
    svc.run_round()
    clock.advance(25)
    slurm.finish(res.slurm_job_id, 0)  # the second run: 25 s
    if gone_from_squeue:  # the service was down until squeue forgot it (MinJobAge)
        slurm.purge(res.slurm_job_id)
    svc.run_round()
    job = store.get_job(res.job_id)
    assert (job.state, job.exit_code) == (JobState.COMPLETED, 0)
    (a,) = acct_rows(store, AcctFilter())
    assert a["run_s"] == pytest.approx(65.0)  # not 365
    assert job.gpu_share is not None and a["gpu_hours"] == pytest.approx(65.0 * job.gpu_share / 3600)


def test_an_unreachable_slurm_leaves_no_pack_jobs_as_they_are(world):
    svc, store, slurm, clock, site, tmp = world
    (res,) = submit(svc, site, tmp)
    slurm.controller_down = True
    stats = RoundStats()
    svc.observe(stats)
    assert store.get_job(res.job_id).state == JobState.PLANNED and svc.slurm_error


@pytest.mark.parametrize("state,code,sig,want", [
    ("COMPLETED", 0, None, ("COMPLETED", 0)),
    ("FAILED", 1, None, ("FAILED", 1)),
    ("FAILED", 2, None, ("FAILED", 2)),
    ("FAILED", 3, None, ("OOM", 3)),
    ("FAILED", 4, None, ("OOM", 4)),
    ("OUT_OF_MEMORY", 0, 9, ("OOM", 137)),
    ("CANCELLED by 0", None, 15, ("CANCELLED", 143)),
    ("CANCELLED", 5, None, ("CANCELLED", 5)),
    ("TIMEOUT", None, 15, ("TIMEOUT", 143)),
    ("NODE_FAIL", None, None, ("FAILED", None)),
])
def test_native_ending_maps_slurms_end_to_our_state(state, code, sig, want):
    end = native_ending(state, code, sig)
    assert (end.state, end.exit_code) == want and end.reason


def test_observe_native_with_no_jobs_does_nothing(world):
    svc, store, slurm, clock, site, tmp = world
    observe_native(svc, [], [], RoundStats())
    assert slurm.calls == []


def test_cli_prints_our_id_with_the_slurm_id(tmp_path, monkeypatch):
    site_file = write_site_file(tmp_path)
    monkeypatch.setenv("SLURM_DLRM_SITE", str(site_file))
    monkeypatch.chdir(tmp_path)
    fake = FakeSlurm(user=USER, first_job_id=4)
    import slurm_dlrm.slurm as seam

    monkeypatch.setattr(seam, "SlurmClient", lambda *a, **kw: fake)
    import slurm_dlrm.service.submit as svc

    monkeypatch.setattr(svc, "check_slurm_reachable", lambda *a: None)  # FakeSlurm has no `scontrol ping`
    from slurm_dlrm.cli import cli

    r = CliRunner().invoke(cli, ["submit", "--no-pack", "--no-service", str(SPEC)])
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("Submitted job 1 (Slurm 4; tiny-a: --mem=")
    r = CliRunner().invoke(cli, ["submit", "--no-pack", "--no-service", "--parsable", str(SPEC)])
    assert r.exit_code == 0 and r.stdout == "2\n"  # sbatch's one-cluster form: the id -d afterok takes
    r = CliRunner().invoke(cli, ["queue", "--json", "--no-slurm"])
    rows = json.loads(r.output)["jobs"]
    assert [(j["job_id"], j["pack"], j["slurm_job_id"]) for j in rows] == [(1, "no-pack", "4"), (2, "no-pack", "5")]
    # sbatch refused: one line, exit 1, the row FAILED with the reason
    r = CliRunner().invoke(cli, ["submit", "--no-pack", "--no-service", "-p", "nope", str(SPEC)])
    assert r.exit_code == 1 and r.output.count("\n") == 1
    assert "job 3 (tiny-a): sbatch refused: invalid partition specified: nope" in r.output
    r = CliRunner().invoke(cli, ["queue", "--json", "--no-slurm", "-t", "F"])
    assert [(j["job_id"], j["state"]) for j in json.loads(r.output)["jobs"]] == [(3, "FAILED")]
    with pytest.raises(SlurmError):  # the fake still refuses what Slurm would
        fake.sbatch("#!/bin/bash\n", ["--partition=nope"])


def test_a_job_that_moved_meanwhile_does_not_stop_the_round(world, caplog):
    svc, store, slurm, clock, site, tmp = world
    a, b = submit(svc, site, tmp, n=2)
    stale = store.get_job(a.job_id)  # as the round read it
    cancel_job(store, slurm, a.job_id, user=USER)  # ... then `cancel` moved it (another process)
    slurm.start(b.slurm_job_id)
    observe_native(svc, [stale, store.get_job(b.job_id)], slurm.squeue(), RoundStats())
    assert store.get_job(a.job_id).state == JobState.CANCELLED
    assert store.get_job(b.job_id).state == JobState.RUNNING  # the next job was still followed
    assert f"no-pack job {a.job_id}" in caplog.text
