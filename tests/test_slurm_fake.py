"""FakeSlurm follows the real commands' behaviour that callers rely on."""

import pytest

from slurm_dlrm.slurm import JobState, SlurmBackend, SlurmError, SlurmTimeout
from slurm_dlrm.slurm.base import AccountingDisabled
from slurm_dlrm.slurm.fake import FakeSlurm

SCRIPT = "#!/bin/bash\n#SBATCH --job-name=pack-7\n#SBATCH --nodes=2\nsrun hostname\n"


def test_is_a_backend_and_hands_out_increasing_ids():
    fake = FakeSlurm(first_job_id=10)
    assert isinstance(fake, SlurmBackend)
    a = fake.sbatch(SCRIPT)
    b = fake.sbatch(SCRIPT, ["--job-name=other", "--gres=gpu:2"])
    assert (a, b) == (10, 11)
    assert fake.submitted[1].name == "other" and fake.submitted[1].gres == "gpu:2"
    assert fake.submitted[0].name == "pack-7" and fake.submitted[0].num_nodes == 2
    assert fake.submitted[0].script == SCRIPT


def test_lifecycle_pending_running_completed_then_purged():
    fake = FakeSlurm()
    jid = fake.sbatch(SCRIPT)
    assert fake.show_job(jid).state is JobState.PENDING
    fake.start(jid)
    info = fake.show_job(jid)
    assert info.state is JobState.RUNNING and info.nodes == "node[1-2]"
    assert {n.state for n in fake.show_nodes()} == {"mixed"}
    fake.add_step(jid, "member-a")
    fake.finish(jid, exit_code=0)
    assert fake.squeue(job_ids=[jid])[0].state is JobState.COMPLETED
    fake.purge(jid)
    assert fake.squeue(job_ids=[jid]) == [] and fake.show_job(jid) is None
    rows = fake.sacct([jid])
    assert [r.job_id for r in rows] == [f"{jid}", f"{jid}.batch", f"{jid}.0"]
    assert rows[2]["JobName"] == "member-a" and all(r.state is JobState.COMPLETED for r in rows)


def test_failure_cancel_and_signal():
    fake = FakeSlurm()
    a, b, c = (fake.sbatch(SCRIPT) for _ in range(3))
    fake.start(a)
    fake.finish(a, exit_code=3)
    assert fake.show_job(a).state is JobState.FAILED and fake.show_job(a).exit_code == 3
    fake.start(b)
    fake.scancel([b], signal="USR1")
    assert fake.show_job(b).state is JobState.RUNNING and fake.job(b).signals_sent == ["USR1"]
    fake.scancel([b, c])
    assert fake.show_job(b).state is JobState.CANCELLED and fake.show_job(b).signal == 15
    assert fake.show_job(c).state is JobState.CANCELLED
    assert fake.sacct([b])[0]["State"] == "CANCELLED by 0"
    fake.scancel([a])  # already ended: silent, like scancel 22.05.8
    fake.scancel([999])  # unknown: silent too (exit 0), as observed on the local cluster
    assert fake.show_job(a).state is JobState.FAILED


def test_requeue_and_other_terminal_states():
    fake = FakeSlurm()
    jid = fake.sbatch(SCRIPT)
    with pytest.raises(SlurmError, match="pending"):
        fake.requeue(jid)
    fake.start(jid)
    fake.set_state(jid, "NODE_FAIL", reason="NodeDown")
    assert fake.show_job(jid).state is JobState.NODE_FAIL
    fake.requeue(jid)
    info = fake.show_job(jid)
    assert info.state is JobState.PENDING and info.restart_count == 1 and info.nodes == ""
    fake.start(jid)
    fake.set_state(jid, "TIMEOUT")
    assert fake.show_job(jid).state is JobState.TIMEOUT
    with pytest.raises(ValueError):
        fake.finish(jid)


def test_rejections_like_sbatch():
    fake = FakeSlurm()
    with pytest.raises(SlurmError, match="#!"):
        fake.sbatch("echo no shebang\n")
    with pytest.raises(SlurmError, match="partition"):
        fake.sbatch(SCRIPT, ["--partition=gpu"])
    with pytest.raises(SlurmError, match="Requested node configuration is not available"):
        fake.sbatch(SCRIPT, ["--gres=gpu:8"])
    assert fake.jobs == {}
    too_big = fake.sbatch(SCRIPT, ["-N", "3"])  # accepted; it can only pend
    with pytest.raises(ValueError, match="3 nodes"):
        fake.start(too_big)


def test_injected_failures_accounting_off_and_controller_down():
    fake = FakeSlurm(accounting=False)
    fake.fail_next["sbatch"] = SlurmError(["sbatch"], 1, "sbatch: error: Batch job submission failed")
    with pytest.raises(SlurmError):
        fake.sbatch(SCRIPT)
    assert fake.sbatch(SCRIPT) == 1000  # only the next call fails
    with pytest.raises(AccountingDisabled):
        fake.sacct([1000])
    fake.controller_down = True
    assert fake.ping() is False
    with pytest.raises(SlurmTimeout):
        fake.squeue()
    assert [c[0] for c in fake.calls][-3:] == ["sacct", "ping", "squeue"]


def test_drain_and_sinfo():
    fake = FakeSlurm()
    fake.drain("node2", "bad gpu")
    nodes = {n.name: n for n in fake.show_nodes()}
    assert not nodes["node2"].usable and nodes["node1"].usable
    assert nodes["node2"].reason == "bad gpu"
    assert sum(r.num_nodes for r in fake.sinfo()) == 2


def test_wait_for_jobs_polls_until_terminal_with_backoff():
    from slurm_dlrm.slurm.wait import JobWaitTimeout, wait_for_jobs

    fake = FakeSlurm()
    a, b = fake.sbatch(SCRIPT), fake.sbatch(SCRIPT)
    now = [0.0]
    sleeps = []

    def sleep(s):
        sleeps.append(s)
        now[0] += s
        if len(sleeps) == 1:
            fake.start(a)
            fake.start(b)
        elif len(sleeps) == 3:
            fake.finish(a)
            fake.set_state(b, "TIMEOUT")
            fake.purge(b)  # Slurm forgot it before we saw it end: UNKNOWN, not a hang

    done = wait_for_jobs(fake, [a, b, a], timeout_s=30, poll_s=0.5, sleep=sleep, clock=lambda: now[0])
    assert done[a].state is JobState.COMPLETED
    assert done[b].state is JobState.UNKNOWN
    assert sleeps == [0.5, 1.0, 2.0]

    c = fake.sbatch(SCRIPT)
    with pytest.raises(JobWaitTimeout, match="PENDING"):
        wait_for_jobs(fake, [c], timeout_s=3, sleep=sleep, clock=lambda: now[0])
