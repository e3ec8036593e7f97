"""`submit --dependency` (issue 23): the service plans a job only once its dependencies
are met, and fails one whose can never be (FakeSlurm rounds, fake clock)."""

from __future__ import annotations

import pytest
from service_harness import add_job, fake_service, write_site_file

from slurm_dlrm.errors import BadInput
from slurm_dlrm.service.depend import parse_dependency
from slurm_dlrm.service.queue import queue_rows
from slurm_dlrm.store.states import JobState

USER = "root"


@pytest.fixture
def world(tmp_path):
    svc, store, _slurm, _clock = fake_service(tmp_path, USER)
    yield svc, store
    store.close()


def _finish(store, job_id, state):
    store.transition_job(job_id, JobState.RUNNING, "started")
    store.transition_job(job_id, state, "ended", exit_code=0 if state == JobState.COMPLETED else 1)


def test_parse_dependency_forms():
    assert parse_dependency("afterok:12:13,afterany:9") == [("afterok", 12), ("afterok", 13), ("afterany", 9)]
    for bad in ("afterok", "afterok:x", "before:3", "afterok:1;afterany:2"):
        with pytest.raises(BadInput):
            parse_dependency(bad)


def test_a_job_waits_for_afterok_and_runs_after_it(world):
    svc, store = world
    first = add_job(store, "first")
    then = add_job(store, "then", sbatch={"dependency": f"afterok:{first}"})
    svc.run_round()
    assert store.get_job(first).state == JobState.PLANNED and store.get_job(then).state == JobState.PENDING
    row = {r["job_id"]: r for r in queue_rows(store, user=USER, service={"running": True})}[then]
    assert row["reason"] == f"Dependency: waiting for afterok:{first}"
    _finish(store, first, JobState.COMPLETED)
    svc.run_round()
    assert store.get_job(then).state == JobState.PLANNED


def test_a_dependency_that_can_never_be_met_fails_the_job_with_why(world):
    svc, store = world
    a = add_job(store, "a")
    ok = add_job(store, "ok", sbatch={"dependency": f"afterok:{a}"})
    notok = add_job(store, "notok", sbatch={"dependency": f"afternotok:{a}"})
    anyway = add_job(store, "anyway", sbatch={"dependency": f"afterany:{a}"})
    svc.run_round()
    _finish(store, a, JobState.FAILED)
    svc.run_round()
    assert store.get_job(ok).state == JobState.FAILED
    assert store.get_job(ok).exit_reason == f"dependency never satisfied: job {a} ended FAILED (afterok)"
    assert store.get_job(notok).state == JobState.PLANNED and store.get_job(anyway).state == JobState.PLANNED


def test_submit_refuses_unknown_dependency_ids_and_records_nothing(tmp_path, monkeypatch):
    from pathlib import Path

    from click.testing import CliRunner

    from slurm_dlrm.cli import cli

    repo = Path(__file__).resolve().parent.parent
    site_file = write_site_file(tmp_path)
    monkeypatch.setenv("SLURM_DLRM_SITE", str(site_file))
    spec = str(repo / "examples" / "sweep" / "tiny-a.yaml")
    run = CliRunner().invoke
    first = int(run(cli, ["submit", "--no-service", "--parsable", spec]).output)
    r = run(cli, ["submit", "--no-service", "-d", "afterok:99", spec])
    # sbatch: "Batch job submission failed: Job dependency problem", exit 1 (issue 42)
    assert (r.exit_code, r.output) == (1, "slurm-dlrm: error: --dependency: job 99: no such job in your store "
                                          "(Job dependency problem); nothing recorded\n")
    r = run(cli, ["submit", "--no-service", "--parsable", "-d", f"afterok:{first}", spec])
    assert r.exit_code == 0 and int(r.output) == first + 1
    r = run(cli, ["submit", "--no-pack", "-d", f"afterok:{first}", spec])
    assert r.exit_code == 2 and "use sbatch's own -d" in r.output
