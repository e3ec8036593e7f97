"""Issue 42 item 2: a job's own time limit. The pack carried `--signal=TERM@120` for any
limit, so `-t 1`/`-t 2` jobs were stopped at once and recorded CANCELLED; now the agent
keeps each member's limit less the lead the limit affords, the member checkpoints and
ends TIMEOUT, and `requeue` resumes it."""

from __future__ import annotations

import re
import time

import pytest
from agent_harness import agent_options

from slurm_dlrm.agent.loop import Agent
from slurm_dlrm.agent.placement import parse_placement
from slurm_dlrm.emulated.standin import member_entry, placement_dict
from slurm_dlrm.service.sbatch_options import (
    PackScript,
    SbatchOptions,
    pack_sbatch_flags,
    stop_lead_s,
)


@pytest.mark.parametrize("minutes, lead", [(1, 10.0), (2, 18.0), (3, 27.0), (10, 90.0), (14, 120.0), (600, 120.0)])
def test_the_lead_fits_the_limit(minutes, lead):
    assert stop_lead_s(60.0 * minutes, 120.0) == pytest.approx(lead)


def _flags(time_minutes):
    p = PackScript(pack_name="dlrm-x", comment="c", nodes=1, gpus_per_node=1, cpus_per_node=1, mem_per_node_mib=100,
                   python="/usr/bin/python3", placement_path="/p/placement.json", pack_dir="/p",
                   signal_before_end_s=120, options=SbatchOptions(time_minutes=time_minutes))
    return pack_sbatch_flags(p)


def test_a_pack_with_its_own_limit_is_not_signalled_two_minutes_early_by_slurm():
    assert not any(f.startswith("--signal") for f in _flags(2))  # before: --signal=TERM@120 with --time=00:02:00
    assert "--time=00:02:00" in _flags(2)
    assert "--signal=TERM@120" in _flags(None)  # the partition's limit: Slurm's signal, as before


def test_a_member_at_its_limit_checkpoints_and_ends_timeout(agent_world):
    # one agent run, three members: one stops with a checkpoint at its limit less the lead,
    # one ignores SIGTERM and is killed before its limit (not after term_grace_s), one has
    # no limit and completes. The limit counts from the agent's start (the pack's).
    pack = agent_world / "pack"
    short = dict(member_entry(pack, 1, 0, args=["--steps", "100000", "--step-s", "0.05"]),
                 time_limit_s=5.0, stop_lead_s=1.0)
    # a shell ignores SIGTERM from its first millisecond (the stand-in's Python takes a while
    # to get there on a loaded machine)
    stubborn = dict(member_entry(pack, 2, 1), command=["bash", "-c", "trap '' TERM; while :; do sleep 0.1; done"],
                    time_limit_s=5.0, stop_lead_s=2.0)
    # and its -o (#SBATCH --output) is a link to its own log (issue 43 item 8)
    plain = dict(member_entry(pack, 3, 1), command=["bash", "-c", "echo hello; sleep 0.5"],
                 output_links=[str(agent_world / "out-3.txt")])
    placement = parse_placement(placement_dict(pack, [short, stubborn, plain], sample_interval_s=0.1,
                                               term_grace_s=30.0))
    agent = Agent(placement, agent_options(agent_world))
    t0 = time.monotonic()
    agent.run()
    took_s = time.monotonic() - t0
    assert [m.state for m in agent.members] == ["TIMEOUT", "TIMEOUT", "COMPLETED"]
    assert [m.exit_code for m in agent.members[:2]] == [5, 137]  # it checkpointed; it was killed
    assert re.fullmatch(r"reached its time limit; stopped at step \d+ with a checkpoint \(exit 5\); "
                        r"`slurm-dlrm requeue 1` resumes it", agent.members[0].reason), agent.members[0].reason
    assert "without a checkpoint exit" in agent.members[1].reason
    assert (agent_world / "out-3.txt").resolve() == agent.members[2].output_path.resolve()
    assert "hello" in (agent_world / "out-3.txt").read_text()
    assert 3.9 <= took_s < 8.0  # to its limit less the lead, not at once (and the agent's own teardown)


def test_the_service_gives_the_agent_the_limit_records_timeout_and_requeue_resumes_it(tmp_path):
    from service_harness import FakeClock, FakeCluster, add_job, make_site, start_pack

    from slurm_dlrm.service.cancel import requeue_job
    from slurm_dlrm.service.core import PackingService, ServiceSettings
    from slurm_dlrm.slurm.fake import FakeSlurm
    from slurm_dlrm.store import Store
    from slurm_dlrm.store.states import JobState

    clock = FakeClock()
    site = make_site(tmp_path)
    with Store(tmp_path / "store.sqlite", clock=clock) as store:
        slurm = FakeSlurm(clock=clock, user="root")
        svc = PackingService(store, slurm, site, ServiceSettings(user="root", python="/venv/bin/python",
                                                                 dispatch_window_s=0.0), clock=clock)
        j = add_job(store, "short", sbatch={"time_minutes": 2})
        _pack, sid, placement = start_pack(svc, slurm, FakeCluster(slurm, clock))
        (entry,) = placement["members"]
        assert (entry["time_limit_s"], entry["stop_lead_s"]) == (120.0, 18.0)
        assert "#SBATCH --signal" not in slurm.job(sid).script
        FakeCluster(slurm, clock).member(placement, j, "TIMEOUT", 5, "reached its time limit; stopped at step 7")
        svc.run_round()
        assert store.get_job(j).state == JobState.TIMEOUT
        res = svc.spool_dir / "jobs" / str(j) / "ckpt"
        res.mkdir(parents=True, exist_ok=True)
        assert requeue_job(store, svc.spool_dir, j, user="root").startswith(f"job {j} requeued")
        assert (store.get_job(j).state, store.get_job(j).attempt) == (JobState.PENDING, 1)


def test_a_users_scancel_of_the_pack_cancels_its_members_not_repacks_them(tmp_path):
    # issue 42 item 7: the members checkpointed on the SIGTERM and were requeued as
    # "preempted", so a user's scancel was undone; a signal while Slurm still runs the
    # pack (preemption, a partition's limit ahead) still requeues them
    from service_harness import FakeClock, FakeCluster, add_job, make_site, start_pack

    from slurm_dlrm.service.core import PackingService, ServiceSettings
    from slurm_dlrm.slurm.fake import FakeSlurm
    from slurm_dlrm.store import Store
    from slurm_dlrm.store.states import JobState

    clock = FakeClock()
    with Store(tmp_path / "store.sqlite", clock=clock) as store:
        slurm = FakeSlurm(clock=clock, user="root")
        svc = PackingService(store, slurm, make_site(tmp_path), ServiceSettings(
            user="root", python="/venv/bin/python", dispatch_window_s=0.0), clock=clock)
        cluster = FakeCluster(slurm, clock)
        a = add_job(store, "a")
        _pack, sid, placement = start_pack(svc, slurm, cluster)
        cluster.member(placement, a, "PREEMPTED", 5, "checkpointed and stopped after a signal")
        svc.run_round()
        assert store.get_job(a).state in (JobState.PENDING, JobState.PLANNED)  # preempted: runs again
        b = add_job(store, "b")
        clock.advance(60)
        svc.run_round()
        pack_b = store.get_job(b).pack_id
        sid_b = int(store.get_pack(pack_b).slurm_job_id)
        slurm.start(sid_b)
        placement_b = cluster.placement_of(sid_b)
        slurm.scancel([sid_b])  # the user's scancel
        cluster.member(placement_b, b, "PREEMPTED", 5, "checkpointed and stopped after a signal")
        svc.run_round()
        job = store.get_job(b)
        assert job.state == JobState.CANCELLED and "scancel" in job.exit_reason


def test_the_service_hurries_while_a_pack_starts_and_queue_says_slurm_started_it(tmp_path):
    # issue 42 item 8: queue said "pack queued in Slurm" 8-15 s after squeue showed R
    from service_harness import FakeClock, FakeCluster, add_job, make_site

    from slurm_dlrm.service.core import STARTING_ROUND_S, PackingService, ServiceSettings
    from slurm_dlrm.service.queue import STARTED_IN_SLURM, queue_rows, slurm_pending_reasons
    from slurm_dlrm.slurm.fake import FakeSlurm
    from slurm_dlrm.store import Store

    clock = FakeClock()
    with Store(tmp_path / "store.sqlite", clock=clock) as store:
        slurm = FakeSlurm(clock=clock, user="root")
        svc = PackingService(store, slurm, make_site(tmp_path), ServiceSettings(
            user="root", python="/venv/bin/python", dispatch_window_s=0.0), clock=clock)
        j = add_job(store, "a")
        svc.run_round()
        assert svc.next_delay_s() is None  # queued in Slurm: no hurry (it may wait for hours)
        sid = int(store.get_pack(store.get_job(j).pack_id).slurm_job_id)
        slurm.start(sid)
        reasons = slurm_pending_reasons(slurm, "root")
        assert reasons[str(sid)] == STARTED_IN_SLURM
        (row,) = queue_rows(store, user="root", service={"running": True}, slurm_reasons=reasons)
        assert row["reason"] == f"pack {STARTED_IN_SLURM}"
        svc.run_round()  # sees the allocation: the agent is starting the member
        assert svc.next_delay_s() == STARTING_ROUND_S
        placement = FakeCluster(slurm, clock).placement_of(sid)
        FakeCluster(slurm, clock).member(placement, j, "RUNNING")
        svc.run_round()
        assert svc.next_delay_s() is None
