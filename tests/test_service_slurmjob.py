"""`[service] run_as = "slurm-job"` (issue 30f): the service as a small batch job that
keeps one successor waiting (singleton) and cancels it when idle."""

from __future__ import annotations

import shlex
import tomllib
from dataclasses import replace

import pytest

from slurm_dlrm.service import slurmjob
from slurm_dlrm.service.loop import LoopControl
from slurm_dlrm.service.run import serve_forever
from slurm_dlrm.service.submit import ensure_service, ensure_service_job
from slurm_dlrm.site import REPO_SITE_FILE, ConfigError, parse_site
from slurm_dlrm.slurm.fake import FakeSlurm
from slurm_dlrm.slurm.states import JobState
from slurm_dlrm.store.store import current_user
from tests.service_harness import make_site

USER = current_user()


def job_site(tmp_path):
    return replace(make_site(tmp_path, round_seconds=0.1), service_run_as="slurm-job", service_partition="cpu",
                   service_job_minutes=30, path=str(tmp_path / "we'ird site.toml"))


def test_site_keys():
    data = tomllib.loads(REPO_SITE_FILE.read_text())
    data["service"] = {"run_as": "slurm-job"}
    with pytest.raises(ConfigError, match="service.partition"):
        parse_site(data, "x")
    data["service"] = {"run_as": "slurm-job", "partition": "cpu; rm -rf ~"}
    with pytest.raises(ConfigError, match="service.partition"):
        parse_site(data, "x")
    data["service"] = {"run_as": "cron"}
    with pytest.raises(ConfigError, match="service.run_as"):
        parse_site(data, "x")
    data["service"] = {"run_as": "slurm-job", "partition": "cpu", "job_minutes": 90}
    site = parse_site(data, "x")
    assert (site.service_run_as, site.service_partition, site.service_job_minutes) == ("slurm-job", "cpu", 90)


def test_script_and_flags_are_quoted(tmp_path):
    site = job_site(tmp_path)
    python = str(tmp_path / "my env" / "bin" / "py'thon")
    script = slurmjob.service_script(site, USER, python)
    exec_line = [ln for ln in script.splitlines() if ln.startswith("exec ")][0]
    argv = shlex.split(exec_line)[1:]
    assert argv[0] == python and "--slurm-job" in argv and argv[argv.index("--site") + 1] == site.path
    flags = slurmjob.sbatch_flags(site, USER)
    assert flags == sorted(flags)
    assert "--dependency=singleton" in flags and "--partition=cpu" in flags and "--time=30" in flags
    assert f"--job-name=slurm-dlrm-service-{USER}" in flags


def test_submit_queues_one_service_job(tmp_path):
    site = job_site(tmp_path)
    fake = FakeSlurm(partition="cpu", user=USER)
    assert ensure_service_job(site, USER, fake).startswith("queued as Slurm job 1000")
    assert "already queued" in ensure_service_job(site, USER, fake)  # a second submit queues nothing
    fake.start(1000)
    assert "already queued or running as Slurm job 1000" in ensure_service_job(site, USER, fake)
    assert len(fake.submitted) == 1
    assert fake.submitted[0].script.startswith("#!/bin/bash")


def test_ensure_service_takes_the_slurm_job_path(tmp_path, monkeypatch):
    site = job_site(tmp_path)
    seen = []
    monkeypatch.setattr("slurm_dlrm.service.submit.ensure_service_job", lambda s, u: seen.append(u) or "queued")
    monkeypatch.setattr("slurm_dlrm.service.submit.spawn_service", lambda *a, **k: pytest.fail("spawned"))
    assert ensure_service(site, USER) == "queued" and seen == [USER]


def test_the_service_job_queues_its_successor_and_cancels_it_when_idle(tmp_path, monkeypatch):
    site = job_site(tmp_path)
    fake = FakeSlurm(partition="cpu", user=USER)
    own = fake.sbatch(slurmjob.service_script(site, USER), slurmjob.sbatch_flags(site, USER))
    fake.start(own)
    monkeypatch.setenv("SLURM_JOB_ID", str(own))
    rounds = serve_forever(site, USER, slurm=fake, round_seconds=0.1, idle_exit_s=0.3, control=LoopControl(),
                           slurm_job=True)
    assert rounds >= 1
    successors = [j for j in fake.submitted if j.job_id != own]
    assert len(successors) == 1 and "--dependency=singleton" in successors[0].args
    assert fake.job(successors[0].job_id).state == JobState.CANCELLED  # idle: nothing waits to follow
    assert fake.job(own).state == JobState.RUNNING  # its own job ends when the script does
