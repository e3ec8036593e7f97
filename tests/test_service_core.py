"""The packing service's rounds on FakeSlurm with a fake clock (no cluster needed)."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
from service_harness import FakeClock, FakeCluster, add_job, fake_service, make_site

from slurm_dlrm.admin.marker import parse_marker
from slurm_dlrm.service.cancel import cancel_job
from slurm_dlrm.service.core import (
    PRUNE_EVERY_S,
    PackingService,
    RoundStats,
    ServiceSettings,
    is_unreachable,
)

# Modules of other areas, skipped until they are on main.
_slurm = pytest.importorskip("slurm_dlrm.slurm")
FakeSlurm = pytest.importorskip("slurm_dlrm.slurm.fake").FakeSlurm
_states_mod = pytest.importorskip("slurm_dlrm.store.states")
Store = pytest.importorskip("slurm_dlrm.store.store").Store
pytest.importorskip("slurm_dlrm.packing.policies")
SlurmError, SlurmTimeout = _slurm.SlurmError, _slurm.SlurmTimeout
JobState, PackState = _states_mod.JobState, _states_mod.PackState

USER = "root"


@pytest.fixture
def world(tmp_path):
    svc, store, slurm, clock = fake_service(tmp_path, USER)
    yield svc, store, slurm, clock, FakeCluster(slurm, clock)
    store.close()


def _states(store, ids):
    return [store.get_job(i).state for i in ids]


def test_round_packs_jobs_into_fewer_gpus_and_writes_the_contract(world):
    svc, store, slurm, clock, cluster = world
    ids = [add_job(store, f"j{i}", gpu_gib=2 + i, sm=15 + 5 * i) for i in range(6)]
    stats = svc.run_round()
    assert stats.packs_submitted >= 1 and stats.jobs_planned == 6
    assert all(s == JobState.PLANNED for s in _states(store, ids))
    packs = store.packs()
    assert sum(p.n_gpus for p in packs) < len(ids)
    assert all(p.state == PackState.QUEUED and p.slurm_job_id for p in packs)
    for p in packs:
        fake = slurm.job(int(p.slurm_job_id))
        assert fake.name == p.name  # the name a restarted service finds it by
        marker = parse_marker(fake.comment)  # what job_submit.lua checks (interfaces section 6)
        assert marker is not None and marker.mode == "pack" and marker.pack_id == p.id
        placement = json.loads((Path(p.pack_dir) / "placement.json").read_text())
        assert placement["pack_id"] == p.id and placement["pack_dir"] == p.pack_dir
        for m in placement["members"]:
            assert m["command"][:4] == ["/venv/bin/python", "-m", "slurm_dlrm", "train"]
            spec = json.loads(Path(m["command"][4]).read_text())
            assert spec["name"] == store.get_job(m["job_id"]).name
            assert m["gpu_mem_limit_mib"] >= 2 * 1024  # the estimate plus margin and context
            # the dmem soft limit: the fence without its margin (docs/agent.md "Fences")
            assert 0 < m["gpu_mem_limit_mib"] - m["gpu_mem_estimate_mib"] <= m["gpu_mem_limit_mib"] * 0.05 + 1
        assert oct(Path(p.pack_dir).stat().st_mode & 0o777) == "0o700"
    # A second round has nothing to do: no duplicate packs.
    svc.run_round()
    assert len(store.packs()) == len(packs) and len(slurm.submitted) == len(packs)


def test_placement_file_parses_with_the_agent_reader(world):
    agent_placement = pytest.importorskip("slurm_dlrm.agent.placement")
    svc, store, slurm, clock, cluster = world
    ids = {add_job(store, "a"), add_job(store, "b")}
    svc.run_round()
    seen = set()
    for p in store.packs():
        parsed = agent_placement.load_placement(Path(p.pack_dir) / "placement.json")
        assert parsed.pack_id == p.id
        seen |= {m.job_id for m in parsed.members}
    assert seen == ids


def test_reports_drive_members_to_completion_exactly_once(world):
    svc, store, slurm, clock, cluster = world
    ids = [add_job(store, f"j{i}") for i in range(3)]
    svc.run_round()
    cluster.tick()  # start + RUNNING reports + one sample each
    svc.run_round()
    assert all(s == JobState.RUNNING for s in _states(store, ids))
    assert {p.state for p in store.packs()} == {PackState.RUNNING}
    n_samples = store.conn.execute("SELECT count(*) FROM samples").fetchone()[0]
    assert n_samples == 3
    svc.run_round()  # nothing new: nothing ingested twice
    assert store.conn.execute("SELECT count(*) FROM samples").fetchone()[0] == 3
    cluster.tick()  # COMPLETED reports, batch script ends
    svc.run_round()
    assert all(s == JobState.COMPLETED for s in _states(store, ids))
    assert {p.state for p in store.packs()} == {PackState.COMPLETED}


def _two_members_running(world):
    """Jobs a and b planned into one pack that Slurm started; both report RUNNING."""
    svc, store, slurm, clock, cluster = world
    a, b = add_job(store, "a"), add_job(store, "b")
    svc.run_round()
    (pack,) = store.packs()
    sid = int(pack.slurm_job_id)
    slurm.start(sid)
    p = cluster.placement_of(sid)
    cluster.member(p, a, "RUNNING")
    cluster.member(p, b, "RUNNING")
    return a, b, pack, sid, p


def test_member_without_an_end_report_fails_with_the_pack_reason(world):
    """The pack's agent reported its orderly exit, yet a member reported no end: the pack
    failed for a reason of its own, and the member fails with it."""
    svc, store, slurm, clock, cluster = world
    a, b, pack, sid, p = _two_members_running(world)
    cluster.member(p, a, "COMPLETED", 0)
    cluster.report(p, [{"type": "agent", "event": "exit", "detail": "members: done"}])
    slurm.finish(sid, exit_code=1)
    svc.run_round()
    assert store.get_job(a).state == JobState.COMPLETED
    jb = store.get_job(b)
    assert jb.state == JobState.FAILED and "before the member reported an end" in jb.exit_reason
    assert store.get_pack(pack.id).state == PackState.FAILED


def test_a_killed_agent_s_members_resume_from_checkpoints_within_max_fault_runs(world):
    """Issue 49 (chaos_live): an agent SIGKILLed ends its pack FAILED (srun's step dies)
    with no exit report; its unfinished member did not fail on its own, so it reruns from
    its checkpoint (fenced first), and fails only once max_fault_runs runs ended so. Before,
    it ended FAILED at the first killed agent; then after max_attempts (3) runs, which
    failed a gang that three faults of a chaos run hit in turn (seed 2)."""
    svc, store, slurm, clock, cluster = world
    a, b, pack, sid, p = _two_members_running(world)
    cluster.member(p, a, "COMPLETED", 0)
    slurm.finish(sid, exit_code=9)
    svc.run_round()
    assert store.get_pack(pack.id).state == PackState.FAILED
    assert store.get_job(a).state == JobState.COMPLETED and store.get_job(a).attempt == 0
    jb = store.get_job(b)
    assert jb.attempt == 1 and jb.state in (JobState.PENDING, JobState.PLANNED), jb
    assert (Path(pack.pack_dir) / "cancel" / str(b)).exists()  # the old run is fenced
    assert svc.settings.max_fault_runs > svc.settings.max_attempts
    for _ in range(svc.settings.max_fault_runs - 1):  # each later run's agent killed too
        svc.run_round()
        (q,) = [x for x in store.packs() if x.id == store.get_job(b).pack_id]
        slurm.start(int(q.slurm_job_id))
        cluster.member(cluster.placement_of(int(q.slurm_job_id)), b, "RUNNING")
        svc.run_round()
        slurm.finish(int(q.slurm_job_id), exit_code=9)
        svc.run_round()
    jb = store.get_job(b)
    assert jb.state == JobState.FAILED, jb
    assert f"gave up after {svc.settings.max_fault_runs} runs ended by faults" in jb.exit_reason, jb.exit_reason


def test_members_of_a_pack_that_failed_before_they_started_go_back_to_the_queue(world):
    """A pack whose agent step srun could not create (Slurm 22.05 after a slurmctld restart:
    "Invalid generic resource (gres) specification"): its members never ran, so they are
    planned again without an attempt counted; a pack that keeps failing so fails them
    after max_attempts such packs (no endless resubmission)."""
    svc, store, slurm, clock, cluster = world
    a = add_job(store, "a")
    for n in range(svc.settings.max_attempts):
        svc.run_round()
        (pack,) = [x for x in store.packs() if x.id == store.get_job(a).pack_id]
        assert store.get_job(a).state == JobState.PLANNED
        slurm.start(int(pack.slurm_job_id))
        slurm.finish(int(pack.slurm_job_id), exit_code=1)
        svc.run_round()
        job = store.get_job(a)
        if n < svc.settings.max_attempts - 1:
            assert job.state in (JobState.PENDING, JobState.PLANNED) and job.attempt == 0, job
    job = store.get_job(a)
    assert job.state == JobState.FAILED and "before the member reported an end" in job.exit_reason
    assert len(store.packs()) == svc.settings.max_attempts


def test_a_pack_whose_agent_handled_a_host_oom_is_not_a_failed_allocation(world):
    """Under task/cgroup srun fails the agent's step (batch exit 1) for an OOM kill in the
    job cgroup the agent handled: the member is OOM_HOST and retried, its neighbour completed,
    the agent exited in order, so the pack completed (Slurm's word kept in its reason).
    Without the agent's exit report the same ending is a failed pack."""
    svc, store, slurm, clock, cluster = world
    a, b, pack, sid, p = _two_members_running(world)
    cluster.member(p, a, "OOM_HOST", 137, "killed by the kernel's OOM killer in the job's memory cgroup")
    cluster.member(p, b, "COMPLETED", 0)
    cluster.report(p, [{"type": "agent", "event": "exit", "detail": "members: done"}])
    slurm.finish(sid, exit_code=1)
    svc.run_round()
    done = store.get_pack(pack.id)
    assert done.state == PackState.COMPLETED and "Slurm: FAILED" in (done.reason or "")
    assert store.get_job(b).state == JobState.COMPLETED
    assert store.get_job(a).attempt == 1  # retried with more host memory

    c = add_job(store, "c")
    svc.run_round()
    (other,) = [q for q in store.packs() if store.get_job(c).pack_id == q.id]
    sid = int(other.slurm_job_id)
    slurm.start(sid)
    q = cluster.placement_of(sid)
    cluster.member(q, c, "RUNNING")
    cluster.member(q, c, "COMPLETED", 0)
    slurm.finish(sid, exit_code=1)  # no agent exit: the agent died after its member ended
    svc.run_round()
    assert store.get_pack(other.id).state == PackState.FAILED


def test_node_fail_requeues_members_and_they_run_again(world):
    svc, store, slurm, clock, cluster = world
    a = add_job(store, "a")
    svc.run_round()
    (pack,) = store.packs()
    sid = int(pack.slurm_job_id)
    slurm.start(sid)
    cluster.member(cluster.placement_of(sid), a, "RUNNING")
    svc.run_round()
    slurm.set_state(sid, "NODE_FAIL")
    svc.run_round()  # observes the loss, requeues, and plans a new pack in the same round
    job = store.get_job(a)
    assert job.attempt == 1 and job.state == JobState.PLANNED and job.pack_id != pack.id
    assert store.get_pack(pack.id).state == PackState.FAILED


def test_slurm_refusing_the_pack_fails_members_with_slurms_message(world):
    svc, store, slurm, clock, cluster = world
    ids = [add_job(store, f"j{i}", sbatch={"partition": "nosuch"}) for i in range(2)]
    svc.run_round()
    for i in ids:
        job = store.get_job(i)
        assert job.state == JobState.FAILED
        assert "invalid partition specified: nosuch" in job.exit_reason
    assert [p.state for p in store.packs()] == [PackState.FAILED]


def test_controller_down_keeps_jobs_and_backs_off(world):
    svc, store, slurm, clock, cluster = world
    ids = [add_job(store, f"j{i}") for i in range(2)]
    slurm.controller_down = True
    svc.run_round()
    st = svc.status()
    assert st["slurm_ok"] is False and "no answer" in st["slurm_error"]
    assert svc.next_delay_s() == pytest.approx(2.0)
    # The pack in flight stays SUBMITTING; nothing is failed or lost.
    assert [p.state for p in store.packs()] == [PackState.SUBMITTING]
    assert all(s == JobState.PLANNED for s in _states(store, ids))
    calls = len(slurm.calls)
    svc.run_round()  # inside the back-off window: Slurm is not called at all
    assert len(slurm.calls) == calls
    clock.advance(2.5)
    svc.run_round()  # retry: still down, back-off doubles
    assert svc.next_delay_s() == pytest.approx(4.0)
    slurm.controller_down = False
    clock.advance(40)  # past the sbatch marker's in-flight window
    svc.run_round()
    assert svc.status()["slurm_ok"] is True
    (pack,) = store.packs()
    assert pack.state == PackState.QUEUED and len(slurm.submitted) == 1


def test_unreachable_classification():
    assert is_unreachable(SlurmTimeout(["sbatch"], 30))
    assert is_unreachable(SlurmError(["sbatch"], 1, "sbatch: error: Batch job submission failed: "
                                     "Unable to contact slurm controller (connect failure)"))
    assert not is_unreachable(SlurmError(["sbatch"], 1, "sbatch: error: invalid partition specified: x"))


def test_cancel_one_member_leaves_neighbours(world):
    svc, store, slurm, clock, cluster = world
    ids = [add_job(store, f"j{i}") for i in range(3)]
    pending = add_job(store, "later")
    svc.run_round()
    (pack,) = [p for p in store.packs() if store.get_job(ids[0]).pack_id == p.id]
    cluster.tick()
    svc.run_round()
    msg = cancel_job(store, slurm, ids[1], user=USER)
    assert "other member(s) keep running" in msg
    assert (Path(pack.pack_dir) / "cancel" / str(ids[1])).exists()
    assert slurm.job(int(pack.slurm_job_id)).state.name == "RUNNING"
    cluster.tick()  # the agent stops the cancelled one, the others finish
    svc.run_round()
    assert _states(store, ids) == [JobState.COMPLETED, JobState.CANCELLED, JobState.COMPLETED]
    with pytest.raises(Exception, match="belongs to"):
        cancel_job(store, slurm, pending, user="mallory")


def test_cancel_pending_and_last_member(world):
    svc, store, slurm, clock, cluster = world
    a = add_job(store, "a")
    assert "was pending" in cancel_job(store, slurm, a, user=USER)
    assert store.get_job(a).state == JobState.CANCELLED
    b = add_job(store, "b")
    svc.run_round()
    (pack,) = store.packs()
    assert "had no other member" in cancel_job(store, slurm, b, user=USER)
    assert store.get_job(b).state == JobState.CANCELLED
    assert slurm.job(int(pack.slurm_job_id)).state.name == "CANCELLED"
    svc.run_round()
    assert store.get_pack(pack.id).state == PackState.CANCELLED


def _runs_out_of_gpu_memory(world, a):
    """Plan job `a`, run it in its pack and end it OOM_GPU; returns its request before."""
    svc, store, slurm, clock, cluster = world
    svc.run_round()
    (pack,) = [x for x in store.packs() if x.id == store.get_job(a).pack_id]
    sid = int(pack.slurm_job_id)
    slurm.start(sid)
    p = cluster.placement_of(sid)
    cluster.member(p, a, "RUNNING")
    cluster.member(p, a, "OOM_GPU", 3, "CUDA out of memory")
    slurm.finish(sid)
    before = store.get_job(a).gpu_mem_request_bytes
    svc.run_round()
    return before


def test_oom_is_requeued_with_more_memory(world):
    svc, store, slurm, clock, cluster = world
    a = add_job(store, "a", gpu_gib=4)
    before = _runs_out_of_gpu_memory(world, a)
    job = store.get_job(a)
    assert job.attempt == 1 and job.gpu_mem_request_bytes > before
    assert job.state == JobState.PLANNED  # planned again in the same round, with the raise


def test_runs_lost_to_faults_do_not_spend_the_oom_retries(world):
    """Issue 49: the OOM retry bound (max_attempts) counts the runs the job's own memory
    ended, not those a fault ended: after two killed agents, an OOM is still retried with
    more memory (before, attempt 3 of 3 failed it)."""
    svc, store, slurm, clock, cluster = world
    a = add_job(store, "a", gpu_gib=4)
    for _ in range(2):  # two runs, each ended by its agent's SIGKILL
        svc.run_round()
        (q,) = [x for x in store.packs() if x.id == store.get_job(a).pack_id]
        slurm.start(int(q.slurm_job_id))
        cluster.member(cluster.placement_of(int(q.slurm_job_id)), a, "RUNNING")
        svc.run_round()
        slurm.finish(int(q.slurm_job_id), exit_code=9)
    before = _runs_out_of_gpu_memory(world, a)
    job = store.get_job(a)
    assert job.attempt == 3 and job.gpu_mem_request_bytes > before, job
    assert job.state in (JobState.PENDING, JobState.PLANNED), job


# ---------------------------------------------------------------- crash safety

class Crash(BaseException):
    """kill -9: nothing catches it, nothing after it runs."""


class Crashy:
    """Forwards to `target`; raises Crash at the chosen call, before or after it runs.

    `plan` is shared by the store and Slurm proxies: [method name or None, countdown].
    With a name, the countdown runs over that method's calls; with None, over all.
    """

    def __init__(self, target, plan, rng, names):
        self._target, self._plan, self._rng, self._names = target, plan, rng, names

    def __getattr__(self, name):
        attr = getattr(self._target, name)
        if name not in self._names or self._plan[0] not in (None, name) or not callable(attr):
            return attr

        def call(*a, **kw):
            self._plan[1] -= 1
            hit = self._plan[1] == 0
            after = self._rng.random() < 0.5
            if hit and not after:
                raise Crash(name)
            out = attr(*a, **kw)
            if hit and after:
                raise Crash(name)
            return out
        return call


STORE_CALLS = {"add_pack", "transition_job", "transition_pack", "jobs", "packs", "get_pack", "get_job",
               "placements"}
SLURM_CALLS = {"sbatch", "squeue", "sacct", "scancel"}


def test_crash_right_after_sbatch_then_restart_finds_the_pack_by_name(tmp_path):
    clock = FakeClock()
    site = make_site(tmp_path)
    slurm = FakeSlurm(clock=clock, user=USER)
    path = tmp_path / "store.sqlite"
    with Store(path, clock=clock) as store:
        add_job(store, "a")
        rng = random.Random(0)
        rng.random = lambda: 0.1  # crash after the call
        svc = PackingService(store, Crashy(slurm, ["sbatch", 1], rng, SLURM_CALLS), site,
                             ServiceSettings(user=USER), clock=clock)
        with pytest.raises(Crash):
            svc.run_round()
        assert len(slurm.submitted) == 1
        assert [p.state for p in store.packs()] == [PackState.SUBMITTING]
    with Store(path, clock=clock) as store:
        PackingService(store, slurm, site, ServiceSettings(user=USER), clock=clock).run_round()
        (pack,) = store.packs()
        assert pack.state == PackState.QUEUED and pack.slurm_job_id == str(slurm.submitted[0].job_id)
    assert len(slurm.submitted) == 1


def test_crash_before_sbatch_then_restart_submits_once(tmp_path):
    clock = FakeClock()
    site = make_site(tmp_path)
    slurm = FakeSlurm(clock=clock, user=USER)
    path = tmp_path / "store.sqlite"
    with Store(path, clock=clock) as store:
        add_job(store, "a")
        rng = random.Random(0)
        rng.random = lambda: 0.9  # crash before the call
        svc = PackingService(store, Crashy(slurm, ["sbatch", 1], rng, SLURM_CALLS), site,
                             ServiceSettings(user=USER), clock=clock)
        with pytest.raises(Crash):
            svc.run_round()
        assert slurm.submitted == []
    with Store(path, clock=clock) as store:
        svc = PackingService(store, slurm, site, ServiceSettings(user=USER), clock=clock)
        svc.run_round()
        # sbatch may still be in flight in the killed process: wait out its timeout first
        assert slurm.submitted == [] and [p.state for p in store.packs()] == [PackState.SUBMITTING]
        clock.advance(36)
        svc.run_round()
        (pack,) = store.packs()
        assert pack.state == PackState.QUEUED and len(slurm.submitted) == 1


@pytest.mark.parametrize("seed", range(6))
def test_kill_at_random_moments_no_duplicate_no_lost_job(tmp_path, seed):
    rng = random.Random(seed)
    clock = FakeClock()
    site = make_site(tmp_path)
    slurm = FakeSlurm(clock=clock, user=USER)
    cluster = FakeCluster(slurm, clock)
    path = tmp_path / "store.sqlite"
    with Store(path, clock=clock) as s0:
        ids = [add_job(s0, f"j{i}", gpu_gib=1 + (i % 5), sm=10 + 7 * (i % 6)) for i in range(12)]
    crashes = 0
    for _round in range(80):
        store = Store(path, clock=clock)
        if _round % 5 == 4 and _round < 30:
            ids.append(add_job(store, f"late{_round}", gpu_gib=3))  # submits go on meanwhile
        if rng.random() < 0.5:
            plan = [rng.choice(sorted(STORE_CALLS | SLURM_CALLS)), rng.randint(1, 3)]
        else:
            plan = [None, rng.randint(1, 12)]
        svc = PackingService(Crashy(store, plan, rng, STORE_CALLS), Crashy(slurm, plan, rng, SLURM_CALLS),
                             site, ServiceSettings(user=USER, python="/py", dispatch_window_s=0.0), clock=clock)
        try:
            svc.run_round()
        except Crash:
            crashes += 1
        finally:
            store.close()
        if rng.random() < 0.2:
            clock.advance(40)  # a long outage: in-flight sbatch windows expire
        if rng.random() < 0.7:
            cluster.tick()
    # Let it settle without crashes.
    with Store(path, clock=clock) as store:
        svc = PackingService(store, slurm, site, ServiceSettings(user=USER, python="/py", dispatch_window_s=0.0), clock=clock)
        for _ in range(20):
            clock.advance(40)
            svc.run_round()
            cluster.tick()
        states = _states(store, ids)
        names = [j.name for j in slurm.submitted]
        packs = store.packs()
    assert crashes >= 10, crashes
    assert len(names) == len(set(names)), "a pack was submitted twice"
    assert {p.name for p in packs} >= set(names), "Slurm runs a pack the store does not know"
    assert states == [JobState.COMPLETED] * len(ids), "a job was lost"
    # Each job completed in exactly one pack.
    with Store(path, clock=clock) as store:
        done = store.conn.execute(
            "SELECT job_id, count(*) FROM events WHERE kind = 'job_state' AND to_state = 'COMPLETED' GROUP BY job_id"
        ).fetchall()
    assert all(n == 1 for _, n in done) and len(done) == len(ids)


def test_batched_dispatch_waits_for_the_window_or_a_batch(tmp_path):
    clock = FakeClock()
    site = make_site(tmp_path, round_batch_size=4)
    with Store(tmp_path / "store.sqlite", clock=clock) as store:
        slurm = FakeSlurm(clock=clock, user=USER)
        svc = PackingService(store, slurm, site, ServiceSettings(user=USER, dispatch_window_s=10.0), clock=clock)
        add_job(store, "first")
        svc.run_round()  # a fresh service plans at once
        assert len(slurm.submitted) == 1
        for name in ("a", "b"):  # submitted one by one, a second apart
            clock.advance(1)
            add_job(store, name)
            svc.run_round()
        assert len(slurm.submitted) == 1 and svc.status()["next_dispatch_in_s"] == pytest.approx(8.0)
        clock.advance(8.5)
        svc.run_round()  # the window closed: a and b share one pack
        assert len(slurm.submitted) == 2
        assert {j.pack_id for j in store.jobs(["PLANNED"]) if j.name in ("a", "b")} == {store.packs()[-1].id}
        for i in range(4):  # a full batch does not wait for the window
            add_job(store, f"batch{i}")
        svc.run_round()
        assert len(slurm.submitted) == 3


def test_round_prunes_old_samples_hourly_keeping_acct_figures(world):
    svc, store, slurm, clock, cluster = world
    days = svc.site.sample_retention_days
    assert days == 30.0  # the site default
    ids = [add_job(store, f"j{i}") for i in range(2)]
    svc.run_round()
    cluster.tick()
    svc.run_round()  # the first round already pruned (nothing old yet); RUNNING, one sample each
    pack_id = store.packs()[0].id
    day = 86400.0
    old = [{"t": clock() - (days + 1) * day, "pack_id": pack_id, "job_id": ids[0], "node": "node1",
            "gpu_index": 0, "samples_per_s": 10.0}]
    recent = [{"t": clock() - (days - 1) * day, "pack_id": pack_id, "job_id": ids[0], "node": "node1",
               "gpu_index": 0, "samples_per_s": 30.0}]
    store.add_samples(old + recent)
    n_before = store.usage(ids[0]).n_samples

    def count() -> int:
        return int(store.conn.execute("SELECT count(*) FROM samples WHERE job_id = ?", (ids[0],)).fetchone()[0])

    total = count()
    assert svc.last_prune_t is not None
    clock.now = svc.last_prune_t + PRUNE_EVERY_S - 1
    svc.run_round()
    assert count() == total  # not due yet
    clock.advance(2)
    stats = svc.run_round()
    assert count() == total - 1 and any("pruned 1 samples" in n for n in stats.notes)
    assert store.conn.execute("SELECT min(t) FROM samples").fetchone()[0] >= clock() - days * day
    usage = store.usage(ids[0])
    assert usage.n_samples == n_before  # acct's aggregates keep the pruned sample
    assert store.check() == []


def test_sample_retention_zero_keeps_everything(tmp_path):
    clock = FakeClock()
    site = replace(make_site(tmp_path), sample_retention_days=0.0)
    store = Store(tmp_path / "store.sqlite", clock=clock)
    svc = PackingService(store, FakeSlurm(clock=clock, user=USER), site, ServiceSettings(user=USER), clock=clock)
    job = add_job(store, "j0")
    pack_id = store.add_pack(name="pk", user=USER, policy="exclusive", n_gpus=1)
    store.add_samples([{"t": clock() - 1e9, "pack_id": pack_id, "job_id": job, "node": "n", "gpu_index": 0}])
    stats = RoundStats()
    assert svc.prune_samples(stats) == 0 and not stats.notes
    assert store.conn.execute("SELECT count(*) FROM samples").fetchone()[0] == 1
    store.close()


def test_sample_retention_days_is_validated(tmp_path):
    import tomllib

    from slurm_dlrm.errors import ConfigError
    from slurm_dlrm.site import REPO_SITE_FILE, parse_site

    data = tomllib.loads(REPO_SITE_FILE.read_text())
    data["site"]["sample_retention_days"] = 7
    assert parse_site(data).sample_retention_days == 7.0
    data["site"]["sample_retention_days"] = -1
    with pytest.raises(ConfigError, match="sample_retention_days"):
        parse_site(data)


def _rank_report(cluster, p, job, state, exit_code, requeue):
    """What the agent writes once all ranks of a 2-rank job ended (docs/agent.md "Multi-rank jobs")."""
    rec = {"type": "member", "job_id": job, "state": state, "exit_code": exit_code, "rank": 1, "world_size": 2,
           "reason": "rank 1: killed by SIGKILL; its 1 other rank stopped",
           "ranks": [{"rank": 0, "state": "CANCELLED"}, {"rank": 1, "state": state}]}
    cluster.report(p, [{**rec, "requeue": True} if requeue else rec])


def test_a_member_killed_from_outside_resumes_from_its_checkpoint(world):
    """Issue 49 (chaos_live): a one-rank member SIGKILLed by no one the agent knows of (its
    report says `requeue`) goes back to the queue and resumes, as a killed rank's job does;
    before, it ended FAILED. Killed by a user's scancel of the pack, it is CANCELLED."""
    svc, store, slurm, clock, cluster = world
    a, b, pack, sid, p = _two_members_running(world)
    svc.run_round()
    why = "killed by SIGKILL from outside the agent, not the OOM killer (Slurm, scancel, a user)"
    cluster.report(p, [{"type": "member", "job_id": a, "state": "FAILED", "exit_code": 137, "reason": why,
                        "requeue": True}])
    svc.run_round()
    job = store.get_job(a)
    assert job.attempt == 1 and job.state in (JobState.PENDING, JobState.PLANNED), job
    reasons = [str(e.get("reason")) for e in store.events(job_id=a)]
    assert any(r.startswith("killed from outside (killed by SIGKILL") and "resumes from its checkpoint" in r
               for r in reasons), reasons
    slurm.set_state(sid, "CANCELLED")  # the user's scancel: its SIGKILL after KillWait
    cluster.report(p, [{"type": "member", "job_id": b, "state": "FAILED", "exit_code": 137, "reason": why,
                        "requeue": True}])
    svc.run_round()
    assert store.get_job(b).state == JobState.CANCELLED and "scancel" in store.get_job(b).exit_reason


def test_a_pack_slurm_forgot_while_its_agent_runs_ends_when_the_agent_falls_silent(world):
    """Issue 49 (chaos_live): slurmctld SIGKILLed before it saved a job forgets it (gone
    from squeue, no end in sacct) while its steps still run on the node. The pack is not
    declared LOST while its agent still samples (it was, and charged only up to then,
    less than its members ran); once the agent is silent, it is LOST, charged up to the
    agent's last sample, and its members resume."""
    svc, store, slurm, clock, cluster = world
    a, b, pack, sid, p = _two_members_running(world)
    sample = {"type": "sample", "job_id": a, "gpu_index": 0, "sm_util_pct": 20.0, "gpu_mem_bytes": 1 << 30,
              "rss_bytes": 1 << 30, "samples_per_s": 1000.0}
    cluster.report(p, [sample])
    svc.run_round()
    slurm.purge(sid)  # squeue no longer lists it; sacct still says RUNNING
    for _ in range(3):
        clock.advance(4.0)
        cluster.report(p, [sample])
        last = clock.now
        svc.run_round()
        assert store.get_pack(pack.id).state == PackState.RUNNING
    clock.advance(30.0)
    svc.run_round()
    lost = store.get_pack(pack.id)
    assert lost.state == PackState.LOST and lost.end_time == pytest.approx(last)
    assert store.get_job(a).attempt == 1 and store.get_job(b).attempt == 1


def test_a_failed_rank_requeues_its_job_as_a_whole(world):
    svc, store, slurm, clock, cluster = world
    a, b = add_job(store, "a"), add_job(store, "b")
    svc.run_round()
    (pack,) = store.packs()
    sid = int(pack.slurm_job_id)
    slurm.start(sid)
    p = cluster.placement_of(sid)
    for rank in (0, 1):  # one RUNNING record per rank: the first starts the job, the second changes nothing
        cluster.report(p, [{"type": "member", "job_id": a, "state": "RUNNING", "rank": rank, "world_size": 2}])
    cluster.member(p, b, "RUNNING")
    svc.run_round()
    assert store.get_job(a).state == JobState.RUNNING
    _rank_report(cluster, p, a, "FAILED", 137, requeue=True)
    _rank_report(cluster, p, b, "FAILED", 2, requeue=False)  # a bad spec is not retried
    svc.run_round()
    job = store.get_job(a)
    assert job.attempt == 1 and job.state in (JobState.PENDING, JobState.PLANNED), job
    assert store.get_job(b).state == JobState.FAILED
    events = [str(e.get("reason")) for e in store.events(job_id=a)]
    assert any("a rank failed (rank 1: killed by SIGKILL" in r and "resume from its checkpoint" in r for r in events)
