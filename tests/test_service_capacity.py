"""A dispatch round plans new packs on what Slurm has free node by node (issue 29: the
live run's longest waits were packs planned on whole nodes, queued in Slurm behind
packs refill kept alive; the simulator never plans a pack it cannot start)."""

from __future__ import annotations

from pathlib import Path

import pytest
from service_harness import FakeClock, add_job, make_site

from slurm_dlrm.service.capacity import free_capacity
from slurm_dlrm.service.core import PackingService, ServiceSettings
from slurm_dlrm.slurm.fake import FakeSlurm
from slurm_dlrm.slurm.parse import busy_gpu_count, parse_scontrol_nodes
from slurm_dlrm.store import Store

DATA = Path(__file__).parent / "data" / "slurm"
RELEASES = sorted(p.name for p in DATA.iterdir() if (p / "scontrol_show_node.txt").exists())
MIB = 1 << 20


def _nodes(release: str):
    return parse_scontrol_nodes((DATA / release / "scontrol_show_node.txt").read_text())


@pytest.mark.parametrize("release", RELEASES)
def test_busy_gpus_from_each_releases_gres_used(release):
    # Recorded with 3 whole GPUs (IDX 0-2) plus an MPS share on GPU 0 and a shard on
    # GPU 3 of node1, 2 whole GPUs of node2 (scripts/slurm-capture.py).
    node1, node2 = _nodes(release)
    assert busy_gpu_count(node1.gres_used) == 4
    assert busy_gpu_count(node2.gres_used) == 2


def test_busy_gpus_in_each_gres_used_form():
    assert busy_gpu_count("") == 0
    assert busy_gpu_count("gpu:h100:0(IDX:N/A),mps:h100:0(IDX:N/A)") == 0
    assert busy_gpu_count("gpu:2(IDX:0,3)") == 2
    assert busy_gpu_count("gpu:h100:1(IDX:N/A)") == 1  # held, on a device Slurm did not name
    assert busy_gpu_count("shard:h100:3(0/8,3/8,0/8,0/8)") == 1
    assert busy_gpu_count("gpu:h100:1(IDX:2),shard:h100:2(-/8,-/8,-/8,2/8)") == 2


@pytest.mark.parametrize("release", RELEASES)
def test_free_capacity_per_node_less_the_agent_and_the_users_queued_packs(tmp_path, release):
    site = make_site(tmp_path)
    node1, node2 = _nodes(release)
    free = free_capacity(site, [node1, node2], None, waiting_gpus=1)
    by_name = {n.name: n for n in free.nodes}
    assert by_name["node1"].gpus == 0 and by_name["node2"].gpus == 2
    assert by_name["node2"].cpus == node2.cpus - node2.cpus_alloc - 1  # one CPU for a new pack's agent
    assert by_name["node2"].memory_bytes == (256000 - node2.alloc_memory_mib - 512) * MIB
    assert free.free_gpus == 1  # 2 free, 1 already asked for by a pack Slurm has not started
    drained = parse_scontrol_nodes((DATA / release / "scontrol_show_node_drain.txt").read_text())
    assert [n.name for n in free_capacity(site, drained, None, 0).nodes] == ["node1"]


def test_a_round_plans_only_the_packs_slurm_can_start(tmp_path, monkeypatch):
    clock = FakeClock()
    site = make_site(tmp_path)
    store = Store(tmp_path / "store.sqlite", clock=clock)
    slurm = FakeSlurm(clock=clock, user="root")
    # Other users' jobs hold node1's 4 GPUs and 2 of node2's (the recorded 24.11 nodes).
    monkeypatch.setattr(slurm, "show_nodes", lambda: _nodes("24.11.5"))
    svc = PackingService(store, slurm, site, ServiceSettings(user="root", python="/venv/bin/python",
                                                             dispatch_window_s=0.0, policy="exclusive"), clock=clock)
    ids = [add_job(store, f"j{i}") for i in range(4)]
    svc.run_round()
    packs = store.packs()
    assert sum(p.n_gpus for p in packs) == 2  # whole nodes would have planned all four
    assert sum(1 for i in ids if str(store.get_job(i).state) == "PENDING") == 2
    store.close()


def test_a_slurm_that_names_none_of_the_sites_nodes_leaves_the_old_view(tmp_path, monkeypatch):
    from dataclasses import replace

    clock = FakeClock()
    site = make_site(tmp_path)
    store = Store(tmp_path / "store.sqlite", clock=clock)
    slurm = FakeSlurm(clock=clock, user="root")
    monkeypatch.setattr(slurm, "show_nodes", lambda: [replace(n, name=f"other{i}")
                                                      for i, n in enumerate(_nodes("24.11.5"))])
    svc = PackingService(store, slurm, site, ServiceSettings(user="root", python="/venv/bin/python",
                                                             dispatch_window_s=0.0, policy="exclusive"), clock=clock)
    ids = [add_job(store, f"j{i}") for i in range(3)]
    svc.run_round()
    assert sum(p.n_gpus for p in store.packs()) == 3  # planned as before, not stalled
    assert all(str(store.get_job(i).state) != "PENDING" for i in ids)
    store.close()


# ------------------------------------------------------------------ issue 43 items 2 and 3

def _service(tmp_path, slurm=None, policy="exclusive", **settings):
    clock = FakeClock()
    site = make_site(tmp_path)
    store = Store(tmp_path / "store.sqlite", clock=clock)
    slurm = slurm or FakeSlurm(clock=clock, user="root")
    slurm.clock = clock
    svc = PackingService(store, slurm, site, ServiceSettings(user="root", python="/venv/bin/python",
                                                             dispatch_window_s=0.0, policy=policy, **settings),
                         clock=clock)
    return svc, store, slurm, clock


def test_a_round_reads_the_nodes_once_whatever_its_pack_keys(tmp_path):
    svc, store, slurm, _ = _service(tmp_path)
    for account in ("a1", "a2", "a3"):  # three pack keys: three groups planned in one round
        add_job(store, f"j-{account}", sbatch={"account": account})
    svc.run_round()
    assert len({p.id for p in store.packs()}) == 3
    assert [c[0] for c in slurm.calls].count("show_nodes") == 1
    svc.run_round()  # nothing left to plan: no read at all
    assert [c[0] for c in slurm.calls].count("show_nodes") == 1
    store.close()


def test_a_pack_is_pinned_to_the_node_its_plan_chose(tmp_path, monkeypatch):
    svc, store, slurm, _ = _service(tmp_path)
    # node1's GPUs are all taken (the recorded 24.11 nodes): the plan puts the pack on node2
    monkeypatch.setattr(slurm, "show_nodes", lambda: _nodes("24.11.5"))
    job = add_job(store, "j")
    svc.run_round()
    (pack,) = store.packs()
    fake_job = slurm.job(int(pack.slurm_job_id))
    assert "#SBATCH --nodelist=node2\n" in fake_job.script
    slurm.start(fake_job.job_id)  # Slurm's choice: unpinned, the first node that fits
    svc.run_round()
    assert store.get_pack(pack.id).nodes == "node2" and str(store.get_job(job).state) == "PLANNED"
    store.close()


def test_a_pinned_pack_slurm_has_not_started_holds_its_node_for_the_next_plan(tmp_path):
    site = make_site(tmp_path)
    node1, node2 = _nodes("24.11.5")  # node2: 2 GPUs free
    from slurm_dlrm.service.capacity import Held

    free = free_capacity(site, [node1, node2], None, 0, {"node2": Held(1, 3, 1024 * MIB)})
    n2 = {n.name: n for n in free.nodes}["node2"]
    assert n2.gpus == 1 and n2.cpus == node2.cpus - node2.cpus_alloc - 3 - 1
    assert n2.memory_bytes == (256000 - node2.alloc_memory_mib - 1024 - 512) * MIB
    assert free.free_gpus == 1


def test_a_pinned_pack_whose_node_goes_away_is_withdrawn_and_planned_elsewhere(tmp_path):
    svc, store, slurm, clock = _service(tmp_path)
    job = add_job(store, "j")
    svc.run_round()
    (first,) = store.packs()
    node = slurm.job(int(first.slurm_job_id)).nodelist
    assert node in ("node1", "node2")
    slurm.drain(node)
    slurm.set_state(int(first.slurm_job_id), "PENDING", reason=f"ReqNodeNotAvail, UnavailableNodes:{node}")
    clock.advance(1.0)
    svc.run_round()
    assert str(store.get_pack(first.id).state) == "CANCELLED"
    assert "withdrawn: pinned to" in (store.get_pack(first.id).reason or "")
    assert slurm.job(int(first.slurm_job_id)).slurm_state == "CANCELLED"  # scancel'ed
    j = store.get_job(job)
    assert j.attempt == 0  # it never ran
    clock.advance(1.0)
    svc.run_round()  # planned again, on the node Slurm can give
    second = store.get_pack(store.get_job(job).pack_id)
    assert second.id != first.id
    assert slurm.job(int(second.slurm_job_id)).nodelist == ({"node1", "node2"} - {node}).pop()
    store.close()


def test_a_pinned_pack_waits_for_resources_only_so_long_and_never_for_priority(tmp_path):
    svc, store, slurm, clock = _service(tmp_path, pin_wait_s=30.0)
    a, b = add_job(store, "a", sbatch={"account": "x"}), add_job(store, "b", sbatch={"account": "y"})
    svc.run_round()
    pack_a, pack_b = (store.get_pack(store.get_job(i).pack_id) for i in (a, b))
    slurm.set_state(int(pack_a.slurm_job_id), "PENDING", reason="Resources")  # someone took its node
    slurm.set_state(int(pack_b.slurm_job_id), "PENDING", reason="Priority")  # not the pin's doing
    clock.advance(20.0)
    svc.run_round()
    assert str(store.get_pack(pack_a.id).state) == "QUEUED"  # not yet
    clock.advance(15.0)
    svc.run_round()
    assert str(store.get_pack(pack_a.id).state) == "CANCELLED"
    assert "not started after 35 s (Resources)" in (store.get_pack(pack_a.id).reason or "")
    clock.advance(3600.0)
    svc.run_round()
    assert str(store.get_pack(pack_b.id).state) == "QUEUED"
    store.close()


def test_no_pin_without_a_free_view_or_with_node_features(tmp_path, monkeypatch):
    from slurm_dlrm.slurm import SlurmError

    svc, store, slurm, _ = _service(tmp_path)
    add_job(store, "feat", sbatch={"constraint": "bigmem"})
    svc.run_round()
    slurm.fail_next["show_nodes"] = SlurmError(["scontrol"], 1, "boom")
    add_job(store, "blind")
    svc.run_round()
    assert [p.state for p in store.packs()] and all("--nodelist" not in j.script for j in slurm.submitted)
    store.close()
