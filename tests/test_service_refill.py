"""Refill on FakeSlurm with a fake clock (docs/interfaces.md 3b): the store's join edge,
the service's offer of running packs' GPUs, joins recorded then written, restart safety,
and joiners that never started going back to the queue without an attempt counted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from service_harness import FakeClock, FakeCluster, add_job, fake_service

import slurm_dlrm.packing.policies as policies
from slurm_dlrm.agent.placement import parse_member
from slurm_dlrm.packing.model import Join, MemberPlacement, PackingPlan
from slurm_dlrm.service.core import PackingService
from slurm_dlrm.service.refill import JOINER_NOT_STARTED, pack_allocation
from slurm_dlrm.store import JobState, NewPlacement, PackState, StaleState, Store

USER = "root"
REAL_PLAN = policies.plan  # the fixture below replaces policies.plan
MIB = 1 << 20
GIB = 1 << 30


@pytest.fixture
def world(tmp_path, monkeypatch):
    svc, store, slurm, clock = fake_service(tmp_path, USER)
    requests: list = []
    real_plan = policies.plan

    def joining_plan(request, name=None, params=None):
        """The real policy, except that jobs go onto pack GPUs when some are offered
        (refill-sim teaches `complementary` this; here the mechanism is under test)."""
        requests.append(request)
        pack_gpus = sorted((g for g in request.open_gpus if g.pack), key=lambda g: (g.members, g.key))
        if not pack_gpus:
            return real_plan(request, name, params)
        joins = []
        for job, gpu in zip(request.jobs, pack_gpus, strict=False):
            joins.append(Join(gpu.key, MemberPlacement(job.job_id, 0, 0, mps_thread_pct=40, gpu_mem_limit_mib=3000,
                                                       host_mem_limit_bytes=GIB, cpus=1, predicted_speed=0.9)))
        return PackingPlan(policy="test-join", packs=(), deferred=(), joins=tuple(joins))

    monkeypatch.setattr(policies, "plan", joining_plan)
    yield svc, store, slurm, clock, FakeCluster(slurm, clock), requests
    store.close()


def _running_pack(svc, store, cluster, names=("a", "b"), **est):
    """A pack of `names` that is RUNNING with live agents; returns (pack, placement dict, ids)."""
    ids = [add_job(store, n, **est) for n in names]
    svc.run_round()
    (pack,) = store.packs()
    slurm_job = svc.slurm.job(int(pack.slurm_job_id))
    svc.slurm.start(slurm_job.job_id)
    p = cluster.placement_of(slurm_job.job_id)
    for m in p["members"]:
        cluster.member(p, m["job_id"], "RUNNING")
    cluster.report(p, [{"type": "heartbeat"}])
    svc.run_round()
    pack = store.get_pack(pack.id)
    assert pack.state == PackState.RUNNING and all(store.get_job(i).state == JobState.RUNNING for i in ids)
    return pack, p, ids


# ------------------------------------------------------------------ store

def test_store_join_edge_is_checked_and_counts_no_attempt(tmp_path):
    clock = FakeClock()
    with Store(tmp_path / "s.sqlite", clock=clock) as store:
        first, joiner = add_job(store, "first"), add_job(store, "joiner")
        pack_id = store.add_pack(name="dlrm-x", user=USER, policy="p", n_gpus=2, pack_dir=str(tmp_path),
                                 placements=[NewPlacement(first, 0, 0)])
        place = NewPlacement(joiner, 0, 1, mps_thread_pct=40, gpu_mem_limit_bytes=3 * GIB, cpus=1)
        with pytest.raises(StaleState):  # not running yet: nothing to join
            store.add_join(pack_id, place)
        store.transition_pack(pack_id, PackState.QUEUED, "submitted", slurm_job_id="41")
        store.transition_pack(pack_id, PackState.RUNNING, "started", nodes="node[3-4]")
        job = store.add_join(pack_id, place, reason="test")
        assert job.state == JobState.PLANNED and job.pack_id == pack_id and job.slurm_job_id == "41"
        (row,) = store.placements(pack_id=pack_id, job_id=joiner)
        assert (row.node, row.gpu_index, row.gpu_mem_limit_bytes, row.attempt) == ("node3", 1, 3 * GIB, 0)
        ev = [e for e in store.events(job_id=joiner) if e["to_state"] == "PLANNED"][-1]
        assert ev["reason"].startswith(f"joined pack {pack_id}: node 0 GPU 1 of dlrm-x")
        with pytest.raises(StaleState):  # recorded once only
            store.add_join(pack_id, place)
        store.transition_job(joiner, JobState.PENDING, JOINER_NOT_STARTED)
        assert store.get_job(joiner).attempt == 0


# ------------------------------------------------------------------ service

def test_running_pack_gpus_offered_with_live_members_and_room(world):
    svc, store, slurm, clock, cluster, requests = world
    pack, p, (a, b) = _running_pack(svc, store, cluster, sps=100.0)  # 100 steps x 64 samples: 64 s solo
    cluster.member(p, a, "COMPLETED", 0)
    add_job(store, "c")
    clock.advance(0.25)
    requests.clear()
    svc.run_round()
    offered = [g for g in requests[-1].open_gpus if g.pack]
    assert len(offered) == pack.n_gpus
    cpus_per_node, mem_mib = pack_allocation(p["members"], pack.n_nodes, *svc.node_limits(), 512,
                                             p.get("reserve_cpus", 0), p.get("reserve_host_mem_bytes", 0))
    assert p["reserve_cpus"] > 0 and p["reserve_host_mem_bytes"] > 0  # complementary's refill headroom
    # the plan's refill headroom and the node it chose (the script's --nodelist, issue 43)
    assert store.pack_plan_data(pack.id) == {**{k: p[k] for k in ("reserve_cpus", "reserve_host_mem_bytes")},
                                             "node": slurm.job(int(pack.slurm_job_id)).nodelist}
    script = slurm.job(int(pack.slurm_job_id)).script
    assert f"--cpus-per-task={cpus_per_node}" in script and f"--mem={mem_mib}M" in script
    live = {d.job_id for g in offered for d in g.live}
    assert live == {b}  # a ended: its GPU share is free again
    (live_b,) = [d for g in offered for d in g.live]
    full = svc.demand_of(store.get_job(b)).est_duration_s
    ran = clock() - store.placements(job_id=b)[0].start_time
    assert full == pytest.approx(64.0) and 0 < ran < full
    assert live_b.est_duration_s == pytest.approx(full - ran)  # what is left of its run
    # Once the runner reports its step (the metrics file counts the runs before a
    # resume, and a slowed member's steps), what is left comes from it instead.
    metrics = svc.site.spool_dir_for(svc.settings.user) / "jobs" / str(b) / "metrics.jsonl"
    metrics.parent.mkdir(parents=True, exist_ok=True)
    metrics.write_text(json.dumps({"step": 75, "samples_per_s": 80.0}) + "\n")
    add_job(store, "d")  # something to plan, so the round asks the policy
    clock.advance(0.25)
    requests.clear()
    svc.run_round()
    (live_b,) = [d for g in requests[-1].open_gpus if g.pack for d in g.live if d.job_id == b]
    assert live_b.est_duration_s == pytest.approx(full * 25 / 100)
    gpu_b = next(m for m in p["members"] if m["job_id"] == b)
    for g in offered:
        assert g.key.startswith(f"{pack.id}:0:") and g.node_name == "node1" and g.gpu_model == pack.gpu_model
        assert g.members == len(g.live)
        assert g.free_cpus == cpus_per_node - 1 - gpu_b["cpus"]
        assert g.free_host_mem_bytes == min(mem_mib, 10**9) * MIB - 512 * MIB - gpu_b["host_mem_limit_bytes"]


def test_a_new_packs_offer_holds_the_whole_refill_reserve_its_plan_made(world):
    # The plan's reserve (refill headroom) in bytes, the allocation in Slurm's whole MiB:
    # rounded down, it was up to a MiB short, and the joiner the reserve was made for (one
    # as large as the member, refill_headroom_pct 100) did not fit where the simulator,
    # counting bytes, joined it (sim_vs_live's GPU-hours -12..-15 % after wave 5).
    svc, store, slurm, clock, cluster, requests = world
    pack, p, (a,) = _running_pack(svc, store, cluster, names=("a",), host_gib=1.37)
    (member,) = p["members"]
    reserve = p["reserve_host_mem_bytes"]
    assert reserve > 0 and (member["host_mem_limit_bytes"] + reserve) % MIB  # not a whole MiB
    add_job(store, "b")
    requests.clear()
    svc.run_round()
    offered = [g for g in requests[-1].open_gpus if g.pack]
    assert offered and all(g.free_host_mem_bytes >= reserve for g in offered)
    _, mem_mib = pack_allocation(p["members"], pack.n_nodes, *svc.node_limits(), 512, p["reserve_cpus"], reserve)
    assert f"--mem={mem_mib}M" in slurm.job(int(pack.slurm_job_id)).script


def test_join_recorded_then_written_and_runs_in_the_same_allocation(world):
    svc, store, slurm, clock, cluster, requests = world
    pack, p, (a, b) = _running_pack(svc, store, cluster)
    cluster.member(p, a, "COMPLETED", 0)
    c = add_job(store, "c")
    stats = svc.run_round()
    job = store.get_job(c)
    assert job.state == JobState.PLANNED and job.pack_id == pack.id and stats.jobs_planned == 1
    assert len(store.packs()) == 1 and len(slurm.submitted) == 1  # no new Slurm job
    path = Path(pack.pack_dir) / "joins" / f"{c}.json"
    entry = json.loads(path.read_text())
    assert set(entry) == set(p["members"][0])  # exactly a placement-file member
    parsed = parse_member(entry, "join")
    assert parsed.job_id == c and parsed.gpu_mem_limit_mib == 3000 and parsed.node_index == 0
    assert entry["command"][:4] == ["/venv/bin/python", "-m", "slurm_dlrm", "train"]
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    from slurm_dlrm.service.queue import queue_rows

    row = next(r for r in queue_rows(store, user=USER, service={}) if r["job_id"] == c)
    assert (row["pack"], row["slurm_job_id"], row["state"]) == (pack.name, pack.slurm_job_id, "PLANNED")
    assert row["reason"] == "pack running; waiting for its agent to start it"
    # the agent starts it and it finishes inside the pack
    cluster.member(p, c, "RUNNING")
    svc.run_round()
    assert store.get_job(c).state == JobState.RUNNING and store.get_job(c).slurm_job_id == pack.slurm_job_id
    cluster.member(p, b, "COMPLETED", 0)
    cluster.member(p, c, "COMPLETED", 0)
    slurm.finish(int(pack.slurm_job_id))
    svc.run_round()
    assert store.get_job(c).state == JobState.COMPLETED and store.get_pack(pack.id).state == PackState.COMPLETED
    assert store.get_job(c).attempt == 0
    (row,) = store.placements(job_id=c)
    assert row.pack_id == pack.id and row.start_time is not None and row.end_time is not None


def test_restart_writes_a_missing_join_file_again(world):
    svc, store, slurm, clock, cluster, requests = world
    pack, p, (a, b) = _running_pack(svc, store, cluster)
    cluster.member(p, a, "COMPLETED", 0)
    c = add_job(store, "c")
    svc.run_round()
    path = Path(pack.pack_dir) / "joins" / f"{c}.json"
    text = path.read_text()
    path.unlink()  # the service died between the store and the file
    restarted = PackingService(store, slurm, svc.site, svc.settings, clock=clock)
    restarted.run_round()
    assert path.read_text() == text and store.get_job(c).state == JobState.PLANNED
    assert len(store.placements(job_id=c)) == 1  # not joined twice


def test_closed_node_is_not_offered_and_its_unstarted_joiner_is_requeued(world):
    svc, store, slurm, clock, cluster, requests = world
    pack, p, (a, b) = _running_pack(svc, store, cluster)
    cluster.member(p, a, "COMPLETED", 0)
    c = add_job(store, "c")
    svc.run_round()
    assert store.get_job(c).state == JobState.PLANNED
    # the agent closed before it saw the join file (it reports its last records first)
    cluster.member(p, b, "COMPLETED", 0)
    (Path(pack.pack_dir) / "closed").mkdir()
    (Path(pack.pack_dir) / "closed" / "0").write_text("x\n")
    requests.clear()
    svc.run_round()
    job = store.get_job(c)  # back in the queue; the same round may plan it into a new pack
    assert job.state == JobState.PENDING or (job.state == JobState.PLANNED and job.pack_id != pack.id)
    ev = [e for e in store.events(job_id=c) if e["to_state"] == "PENDING"]
    assert ev and ev[-1]["reason"].startswith(JOINER_NOT_STARTED) and store.get_job(c).attempt == 0
    assert not any(g.pack for r in requests for g in r.open_gpus)  # the closed node is not offered


def test_joiner_that_started_is_not_requeued_when_its_node_closes(world):
    svc, store, slurm, clock, cluster, requests = world
    pack, p, (a, b) = _running_pack(svc, store, cluster)
    cluster.member(p, a, "COMPLETED", 0)
    c = add_job(store, "c")
    svc.run_round()
    # RUNNING and the end are reported, then the marker: all after the service's ingest
    cluster.member(p, c, "RUNNING")
    cluster.member(p, c, "COMPLETED", 0)
    (Path(pack.pack_dir) / "closed").mkdir()
    (Path(pack.pack_dir) / "closed" / "0").write_text("x\n")
    svc.refill.check_joiners(type("S", (), {"transitions": 0})())
    assert store.get_job(c).state == JobState.COMPLETED


def test_pack_ending_before_the_joiner_started_requeues_it_without_an_attempt(world):
    svc, store, slurm, clock, cluster, requests = world
    pack, p, (a, b) = _running_pack(svc, store, cluster)
    cluster.member(p, a, "COMPLETED", 0)
    c = add_job(store, "c")
    svc.run_round()
    cluster.member(p, b, "COMPLETED", 0)
    slurm.finish(int(pack.slurm_job_id))
    svc.run_round()
    job = store.get_job(c)
    ev = [e for e in store.events(job_id=c) if e["from_state"] == "PLANNED" and e["to_state"] == "PENDING"]
    assert ev and JOINER_NOT_STARTED in ev[-1]["reason"] and job.attempt == 0
    assert store.get_pack(pack.id).state == PackState.COMPLETED


def test_no_offer_without_a_fresh_heartbeat_or_for_a_non_joining_policy(world):
    svc, store, slurm, clock, cluster, requests = world
    pack, p, (a, b) = _running_pack(svc, store, cluster)
    cluster.member(p, a, "COMPLETED", 0)
    clock.advance(svc.site.agent.heartbeat_timeout_s - 1)
    add_job(store, "c")
    svc.policy = "exclusive"
    requests.clear()
    svc.run_round()
    assert requests and not any(g.pack for r in requests for g in r.open_gpus)
    svc.policy = "complementary"
    clock.advance(5)  # the last heartbeat is now older than agent.heartbeat_timeout_s
    cluster.report(p, [{"type": "sample", "job_id": b, "gpu_index": 0, "samples_per_s": 1.0}])
    requests.clear()
    svc.last_dispatch_t = None
    svc.run_round()
    assert not any(g.pack for r in requests for g in r.open_gpus)


def test_join_grace_site_key_default_and_validation(world, tmp_path):
    from slurm_dlrm.errors import ConfigError
    from slurm_dlrm.site import REPO_SITE_FILE, parse_site

    svc, store, slurm, clock, cluster, requests = world
    assert svc.site.agent.join_grace_s is None  # unset in site-config/site.toml
    svc.settings = svc.settings.__class__(user=USER, dispatch_window_s=3.0)
    assert svc.join_grace_s == 6.0  # two dispatch rounds
    pack, p, ids = _running_pack(svc, store, cluster)
    assert p["join_grace_s"] == 6.0  # what the agent reads
    import tomllib

    data = tomllib.loads(REPO_SITE_FILE.read_text())
    data["agent"]["join_grace_s"] = 45
    assert parse_site(data, "x").agent.join_grace_s == 45.0
    data["agent"]["join_grace_s"] = -1
    with pytest.raises(ConfigError, match="agent.join_grace_s"):
        parse_site(data, "x")


def test_a_job_is_not_offered_a_pack_it_left(world):
    svc, store, slurm, clock, cluster, requests = world
    pack, p, (a, b) = _running_pack(svc, store, cluster)
    cluster.member(p, a, "PREEMPTED", 5)  # a left the pack (requeued); b still runs there
    requests.clear()
    svc.run_round()
    assert store.get_job(a).attempt == 1
    assert not any(g.pack for r in requests for g in r.open_gpus)  # a is planned elsewhere
    assert store.get_job(a).pack_id != pack.id
    # the store refuses a second placement on the same GPU of the same pack
    (old,) = [pl for pl in store.placements(job_id=a) if pl.pack_id == pack.id]
    c = add_job(store, "c")
    store.add_join(pack.id, NewPlacement(c, old.node_index, old.gpu_index))
    from slurm_dlrm.store import StoreError

    store.transition_job(c, JobState.PENDING, "test")
    with pytest.raises(StoreError, match="already had GPU"):
        store.add_join(pack.id, NewPlacement(c, old.node_index, old.gpu_index))
    assert store.get_job(c).state == JobState.PENDING  # nothing half-done


def test_time_left_of_the_allocation_is_offered(world):
    svc, store, slurm, clock, cluster, requests = world
    pack, p, (a, b) = _running_pack(svc, store, cluster, sbatch={"time_minutes": 30})
    cluster.member(p, a, "COMPLETED", 0)
    add_job(store, "c", sbatch={"time_minutes": 10})
    clock.advance(100.0)
    cluster.report(p, [{"type": "heartbeat"}])
    requests.clear()
    svc.run_round()
    (request,) = requests
    offered = [g for g in request.open_gpus if g.pack]
    assert offered and all(g.remaining_s == pytest.approx(1800.0 - 100.0) for g in offered)
    (c,) = request.jobs
    assert c.time_limit_s == 600.0  # its own -t, which must fit


def test_a_forged_pack_marker_of_another_user_changes_nothing_here(world):
    # docs/admin.md "What a forged marker gains": the service lists only its own user's
    # jobs and knows its packs by the Slurm job id it recorded, so another user's
    # hand-typed `--comment=slurm-dlrm:mode=pack,pack_id=<ours>` with our pack's name is
    # neither adopted nor joined nor cancelled.
    svc, store, slurm, clock, cluster, requests = world
    pack, p, (a, b) = _running_pack(svc, store, cluster)
    before = ([(j.id, j.state, j.pack_id) for j in store.jobs()], store.get_pack(pack.id))
    slurm.user = "mallory"
    forged = slurm.sbatch("#!/bin/bash\nsleep 600\n", [f"--comment=slurm-dlrm:mode=pack,pack_id={pack.id}",
                                                      f"--job-name={pack.name}", "--gres=gpu:1", "--mem=1G"])
    slurm.user = USER
    slurm.start(forged)
    clock.advance(1.0)
    cluster.report(p, [{"type": "heartbeat"}])
    svc.run_round()
    after = ([(j.id, j.state, j.pack_id) for j in store.jobs()], store.get_pack(pack.id))
    assert after[0] == before[0] and after[1].slurm_job_id == before[1].slurm_job_id == pack.slurm_job_id
    assert after[1].state == PackState.RUNNING
    assert slurm.job(forged).state.name == "RUNNING"  # not ours to touch
    assert not any(method == "scancel" and forged in args[0] for method, args in slurm.calls)


def test_refill_never_places_a_joiner_beyond_the_allocations_host_memory(world):
    # The pack's --mem is its members plus the bounded refill headroom (issue 24), so
    # the offer must be what that allocation has left, and the real policy must keep a
    # joiner that does not fit out of it.
    from slurm_dlrm.packing.model import JobDemand, PackingRequest

    svc, store, slurm, clock, cluster, requests = world
    pack, p, (a, b) = _running_pack(svc, store, cluster, host_gib=1.0)
    limits = {m["job_id"]: m["host_mem_limit_bytes"] for m in p["members"]}
    pct = svc.site.packing.refill_headroom_pct
    assert pct == 100.0  # the documented default
    assert p["reserve_host_mem_bytes"] <= sum(limits.values()) * pct / 100 + 1  # bounded, not the node's share
    cluster.member(p, a, "COMPLETED", 0)
    add_job(store, "c")
    clock.advance(0.25)
    requests.clear()
    svc.run_round()
    offered = [g for g in requests[-1].open_gpus if g.pack]
    _, mem_mib = pack_allocation(p["members"], pack.n_nodes, *svc.node_limits(), 512,
                                 p.get("reserve_cpus", 0), p.get("reserve_host_mem_bytes", 0))
    free = mem_mib * MIB - 512 * MIB - limits[b]  # the allocation minus the agent and the live member
    assert offered and all(g.free_host_mem_bytes == free for g in offered)

    def joiner(job_id: int, host_bytes: int) -> JobDemand:
        return JobDemand(job_id=job_id, user=USER, submit_time_s=0.0, priority=0.0, gpu_mem_bytes=1 * GIB,
                         host_mem_bytes=host_bytes, sm_util_pct=5, membw_util_pct=5, host_cpu_cores=1,
                         est_duration_s=10.0)

    too_big, fits = joiner(900, free), joiner(901, GIB // 4)  # `free` plus its margin is over the room
    for policy in ("complementary", "mem-best-fit"):
        req = PackingRequest(jobs=(too_big, fits), gpu_models=requests[-1].gpu_models, nodes=(),
                             open_gpus=tuple(offered), limits=requests[-1].limits)
        joined = {j.member.job_id: j.member for j in REAL_PLAN(req, policy).joins}
        assert set(joined) == {901}, policy
        assert sum(m.host_mem_limit_bytes for m in joined.values()) <= free
