"""Refill of multi-GPU jobs on FakeSlurm with a fake clock (issue 18, docs/interfaces.md
3b): a gang's W ranks join one node of a running pack in one store transaction (all or
none), one join file holds its W entries, a lost file is written again, and a gang that
never started goes back to the queue whole."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from service_harness import (
    FakeClock,
    FakeCluster,
    add_job,
    estimate_dict,
    fake_service,
    make_site,
    spec_dict,
)

import slurm_dlrm.packing.policies as policies
from slurm_dlrm.agent.placement import parse_join
from slurm_dlrm.packing.model import Join, MemberPlacement, PackingPlan
from slurm_dlrm.service.core import PackingService, ServiceSettings
from slurm_dlrm.service.refill import JOINER_NOT_STARTED
from slurm_dlrm.slurm.fake import FakeSlurm
from slurm_dlrm.store import JobState, NewPlacement, PackState, StoreError
from slurm_dlrm.store.store import Store

USER = "root"
MIB = 1 << 20
GIB = 1 << 30


def add_gang(store, name: str, world_size: int = 2, gpu_gib: float = 2.0) -> int:
    """A job of `world_size` ranks: its estimate's `ranks` (the demand's world size)."""
    spec = dict(spec_dict(name), world_size=world_size)
    est = estimate_dict(gpu_gib=gpu_gib)
    est["ranks"] = [{"rank": r, "tables": [r], "gpu_peak_bytes": est["gpu_peak_bytes"],
                     "host_peak_bytes": est["host_peak_bytes"], "gpu_breakdown": est["gpu_breakdown"],
                     "profile": est["profile"]} for r in range(world_size)]
    return int(store.add_job(user=USER, name=name, spec=spec, spec_fingerprint=f"fp-{name}", estimate=est,
                             gpu_model="h100"))


@pytest.fixture
def world(tmp_path, monkeypatch):
    svc, store, slurm, clock = fake_service(tmp_path, USER)
    requests: list = []
    real_plan = policies.plan

    def gang_joining_plan(request, name=None, params=None):
        """The real policy, except that a pending gang joins the first W pack GPUs of
        one node when offered (the policy's own gang joins are tested in
        test_packing_multi.py; here the service's recording is under test)."""
        requests.append(request)
        gangs = [j for j in request.jobs if j.world_size > 1]
        pack_gpus = sorted((g for g in request.open_gpus if g.pack), key=lambda g: g.key)
        if not gangs or not pack_gpus:
            return real_plan(request, name, params)
        assert request.gang_joins  # the service offers gangs to refill
        gang = gangs[0]
        node = pack_gpus[0].key.rsplit(":", 1)[0]
        gpus = [g for g in pack_gpus if g.key.startswith(node + ":")][: gang.world_size]
        joins = tuple(Join(g.key, MemberPlacement(gang.job_id, 0, 0, mps_thread_pct=40 + r,
                                                  gpu_mem_limit_mib=3000 + 1000 * r, host_mem_limit_bytes=GIB,
                                                  cpus=1, predicted_speed=0.9, rank=r,
                                                  world_size=gang.world_size))
                      for r, g in enumerate(gpus))
        return PackingPlan(policy="test-join", packs=(), deferred=(), joins=joins)

    monkeypatch.setattr(policies, "plan", gang_joining_plan)
    yield svc, store, slurm, clock, FakeCluster(slurm, clock), requests
    store.close()


def _running_pack(svc, store, cluster):
    """A RUNNING pack of two jobs that cannot share a GPU (2 GPUs), agents alive."""
    ids = [add_job(store, n, gpu_gib=50) for n in ("a", "b")]
    svc.run_round()
    (pack,) = store.packs()
    assert pack.n_gpus == 2
    svc.slurm.start(int(pack.slurm_job_id))
    p = cluster.placement_of(int(pack.slurm_job_id))
    for m in p["members"]:
        cluster.member(p, m["job_id"], "RUNNING")
    cluster.report(p, [{"type": "heartbeat"}])
    svc.run_round()
    pack = store.get_pack(pack.id)
    assert pack.state == PackState.RUNNING
    return pack, p, ids


def _gang_joined(world):
    svc, store, slurm, clock, cluster, requests = world
    pack, p, (a, b) = _running_pack(svc, store, cluster)
    cluster.member(p, a, "COMPLETED", 0)
    g = add_gang(store, "gang")
    stats = svc.run_round()
    return pack, p, (a, b), g, stats


# ------------------------------------------------------------------ store

def _store_with_running_pack(tmp_path):
    store = Store(tmp_path / "s.sqlite", clock=FakeClock())
    first = add_job(store, "first")
    pack_id = store.add_pack(name="dlrm-x", user=USER, policy="p", n_gpus=4, pack_dir=str(tmp_path),
                             placements=[NewPlacement(first, 0, 0)])
    store.transition_pack(pack_id, PackState.QUEUED, "submitted", slurm_job_id="41")
    store.transition_pack(pack_id, PackState.RUNNING, "started", nodes="node[3-4]")
    return store, pack_id


def _ranks(job_id, gpus, world=None, node=0):
    world = world or len(gpus)
    return [NewPlacement(job_id, node, gpu, mps_thread_pct=40, gpu_mem_limit_bytes=3 * GIB, cpus=1, rank=r,
                         world_size=world) for r, gpu in enumerate(gpus)]


def test_store_records_a_gang_join_as_one_transition_and_w_rows(tmp_path):
    store, pack_id = _store_with_running_pack(tmp_path)
    with store:
        g = add_gang(store, "gang")
        job = store.add_join(pack_id, list(reversed(_ranks(g, [1, 2]))), reason="test")
        assert job.state == JobState.PLANNED and job.pack_id == pack_id and job.attempt == 0
        rows = sorted(store.placements(pack_id=pack_id, job_id=g), key=lambda r: r.rank)
        assert [(r.rank, r.world_size, r.gpu_index, r.node) for r in rows] == [(0, 2, 1, "node3"), (1, 2, 2, "node3")]
        planned = [e for e in store.events(job_id=g) if e["to_state"] == "PLANNED"]
        assert len(planned) == 1 and planned[0]["reason"].startswith(f"joined pack {pack_id}: node 0 GPUs 1,2 of")


def test_store_gang_join_is_all_or_none(tmp_path):
    store, pack_id = _store_with_running_pack(tmp_path)
    with store:
        g = add_gang(store, "gang")
        # rank 1 on a GPU the job held in this pack before: the whole join is refused
        store.add_join(pack_id, _ranks(g, [3, 2]))
        store.transition_job(g, JobState.PENDING, JOINER_NOT_STARTED)
        with pytest.raises(StoreError):
            store.add_join(pack_id, _ranks(g, [1, 2]))
        assert store.get_job(g).state == JobState.PENDING
        assert len(store.placements(job_id=g)) == 2  # only the first join's rows, none of the refused one
        # not the W ranks of one job on distinct GPUs of one node: refused before anything
        other = add_gang(store, "other")
        bad = [_ranks(other, [1], world=2),  # one rank of two
               _ranks(other, [1, 1]),  # two ranks on one GPU
               _ranks(other, [1, 2], world=3),  # two ranks of three
               [NewPlacement(other, 0, 1, rank=0, world_size=2), NewPlacement(other, 1, 2, rank=1, world_size=2)],
               [NewPlacement(other, 0, 1, rank=0, world_size=2), NewPlacement(g, 0, 2, rank=1, world_size=2)]]
        for placements in bad:
            with pytest.raises(StoreError):
                store.add_join(pack_id, placements)
        assert store.get_job(other).state == JobState.PENDING and not store.placements(job_id=other)


# ------------------------------------------------------------------ service

def test_a_gang_joins_a_running_pack_and_its_join_file_holds_every_rank(world):
    svc, store, slurm, clock, cluster, requests = world
    pack, p, (a, b), g, stats = _gang_joined(world)
    job = store.get_job(g)
    assert job.state == JobState.PLANNED and job.pack_id == pack.id and stats.jobs_planned == 1
    assert len(store.packs()) == 1 and len(slurm.submitted) == 1  # no new Slurm job
    rows = sorted(store.placements(job_id=g), key=lambda r: r.rank)
    assert [(r.rank, r.world_size, r.node_index, r.gpu_index) for r in rows] == [(0, 2, 0, 0), (1, 2, 0, 1)]
    path = Path(pack.pack_dir) / "joins" / f"{g}.json"
    data = json.loads(path.read_text())
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert list(data) == ["members"] and len(data["members"]) == 2
    assert set(data["members"][0]) == set(p["members"][0]) | {"rank", "world_size"}  # placement-file entries
    ranks = parse_join(data, "join")  # as the agent reads it
    assert [(r.job_id, r.rank, r.world_size, r.gpu_index, r.gpu_mem_limit_mib) for r in ranks] == [
        (g, 0, 2, 0, 3000), (g, 1, 2, 1, 4000)]
    # both ranks run, then end; the job completes inside the pack without a new attempt
    cluster.member(p, g, "RUNNING")
    svc.run_round()
    assert store.get_job(g).state == JobState.RUNNING
    for j in (b, g):
        cluster.member(p, j, "COMPLETED", 0)
    slurm.finish(int(pack.slurm_job_id))
    svc.run_round()
    assert store.get_job(g).state == JobState.COMPLETED and store.get_job(g).attempt == 0


def test_offer_counts_every_live_rank_of_a_joined_gang(world):
    svc, store, slurm, clock, cluster, requests = world
    pack, p, (a, b), g, _ = _gang_joined(world)
    cluster.member(p, g, "RUNNING")
    add_job(store, "c")  # something to plan, so the round asks the policy
    clock.advance(0.25)
    requests.clear()
    svc.run_round()
    offered = {gpu.key: gpu for gpu in requests[-1].open_gpus if gpu.pack}
    on = {k: sorted((d.job_id, d.rank) for d in gpu.live) for k, gpu in offered.items()}
    assert on[f"{pack.id}:0:0"] == [(g, 0)]
    assert sorted(on[f"{pack.id}:0:1"]) == sorted([(b, 0), (g, 1)])
    b_cpus = next(m["cpus"] for m in p["members"] if m["job_id"] == b)
    # the node's CPUs left: b's and one per rank (the join gave each rank 1 CPU)
    shape = svc.refill.shape(pack)
    assert {gpu.free_cpus for gpu in offered.values()} == {max(0, shape.cpus_per_node - 1 - b_cpus - 2)}


def test_restart_writes_a_missing_gang_join_file_again(world):
    svc, store, slurm, clock, cluster, requests = world
    pack, p, _, g, _ = _gang_joined(world)
    path = Path(pack.pack_dir) / "joins" / f"{g}.json"
    text = path.read_text()
    path.unlink()  # the service died between the store and the file
    restarted = PackingService(store, slurm, svc.site, svc.settings, clock=clock)
    restarted.run_round()
    assert path.read_text() == text and store.get_job(g).state == JobState.PLANNED
    assert len(store.placements(job_id=g)) == 2  # not joined twice


def test_unstarted_gang_of_a_closed_node_goes_back_to_the_queue_whole(world):
    svc, store, slurm, clock, cluster, requests = world
    pack, p, (a, b), g, _ = _gang_joined(world)
    cluster.member(p, b, "COMPLETED", 0)
    (Path(pack.pack_dir) / "closed").mkdir()
    (Path(pack.pack_dir) / "closed" / "0").write_text("x\n")
    svc.run_round()
    job = store.get_job(g)  # back in the queue; the same round may plan it into a new pack
    assert job.state == JobState.PENDING or (job.state == JobState.PLANNED and job.pack_id != pack.id)
    ev = [e for e in store.events(job_id=g) if e["from_state"] == "PLANNED" and e["to_state"] == "PENDING"]
    assert len(ev) == 1 and ev[0]["reason"].startswith(JOINER_NOT_STARTED) and job.attempt == 0


def test_gang_joiner_of_an_ended_pack_goes_back_to_the_queue(world):
    svc, store, slurm, clock, cluster, requests = world
    pack, p, (a, b), g, _ = _gang_joined(world)
    cluster.member(p, b, "COMPLETED", 0)
    slurm.finish(int(pack.slurm_job_id))
    svc.run_round()
    ev = [e for e in store.events(job_id=g) if e["from_state"] == "PLANNED" and e["to_state"] == "PENDING"]
    assert len(ev) == 1 and JOINER_NOT_STARTED in ev[0]["reason"] and store.get_job(g).attempt == 0
    assert store.get_pack(pack.id).state == PackState.COMPLETED


def test_complementary_joins_a_gang_into_a_running_pack(tmp_path):
    """The real policy, unpatched: a 2-rank job takes both GPUs of a running pack (one
    freed, one beside a live member) rather than a new allocation."""
    clock = FakeClock()
    store = Store(tmp_path / "s.sqlite", clock=clock)
    slurm = FakeSlurm(clock=clock, user=USER)
    svc = PackingService(store, slurm, make_site(tmp_path), ServiceSettings(
        user=USER, python="/venv/bin/python", dispatch_window_s=0.0), clock=clock)
    cluster = FakeCluster(slurm, clock)
    with store:
        pack, p, (a, b) = _running_pack(svc, store, cluster)
        cluster.member(p, a, "COMPLETED", 0)
        g = add_gang(store, "gang", gpu_gib=4)
        clock.advance(1)
        cluster.report(p, [{"type": "heartbeat"}])
        svc.run_round()
        job = store.get_job(g)
        assert job.state == JobState.PLANNED and job.pack_id == pack.id and len(slurm.submitted) == 1
        data = json.loads((Path(pack.pack_dir) / "joins" / f"{g}.json").read_text())
        ranks = parse_join(data, "join")
        assert sorted((r.rank, r.gpu_index) for r in ranks) == [(0, 0), (1, 1)]
        assert all(r.world_size == 2 and r.gpu_mem_limit_mib * MIB > 4 * GIB for r in ranks)  # fenced per rank
