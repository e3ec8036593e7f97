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
