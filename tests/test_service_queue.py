"""`queue` rows and reasons, and `submit --wait`'s follow loop, on a store in tmp."""

from __future__ import annotations

import threading
import time

import pytest
from service_harness import FakeClock, FakeCluster, add_job, make_site

from slurm_dlrm.service.core import PackingService, ServiceSettings
from slurm_dlrm.service.queue import format_table, queue_rows
from slurm_dlrm.service.submit import wait_for_jobs
from slurm_dlrm.slurm.fake import FakeSlurm
from slurm_dlrm.store.store import Store


@pytest.fixture
def world(tmp_path):
    clock = FakeClock()
    site = make_site(tmp_path)
    store = Store.for_user(site, "root", clock=clock)
    slurm = FakeSlurm(clock=clock, user="root")
    svc = PackingService(store, slurm, site, ServiceSettings(user="root", python="/py"), clock=clock)
    yield site, store, slurm, svc, FakeCluster(slurm, clock)
    store.close()


def test_reasons_follow_the_service_and_slurm(world):
    site, store, slurm, svc, cluster = world
    a = add_job(store, "a")
    down = {"running": True, "slurm_ok": False, "slurm_error": "squeue failed: no answer after 30 s",
            "slurm_retry_in_s": 8}
    (row,) = queue_rows(store, user="root", service=down)
    assert row["state"] == "PENDING" and row["reason"].startswith("waiting for Slurm: squeue failed")
    assert "retry in 8 s" in row["reason"]
    (row,) = queue_rows(store, user="root", service={"running": False})
    assert "not running" in row["reason"]
    svc.run_round()
    pack = store.packs()[0]
    (row,) = queue_rows(store, user="root", service={"running": True, "slurm_ok": True},
                        slurm_reasons={pack.slurm_job_id: "Resources"})
    assert row["state"] == "PLANNED" and row["reason"] == "pack queued in Slurm (Resources)"
    assert row["pack"] == pack.name and row["gpu"] == 0 and row["mps_pct"] and row["gpu_mem_mib"] > 0
    cluster.tick()
    svc.run_round()
    (row,) = queue_rows(store, user="root", service={"running": True})
    assert row["state"] == "RUNNING" and row["node"] == "node1" and row["slurm_job_id"] == pack.slurm_job_id
    text = format_table(queue_rows(store, user="root", service={"running": True}))
    assert text.splitlines()[0].split()[:3] == ["JOBID", "NAME", "STATE"] and f"{a}  " in text.splitlines()[1]
    cluster.tick()
    svc.run_round()
    assert queue_rows(store, user="root", service={}) == []
    (ended,) = queue_rows(store, user="root", service={}, include_ended=True)
    assert ended["state"] == "COMPLETED"


def test_wait_returns_when_every_job_ended(world):
    site, store, slurm, svc, cluster = world
    ids = [add_job(store, "a"), add_job(store, "b")]
    updates = []

    def world_runs():
        for _ in range(3):
            time.sleep(0.2)
            svc_thread_store = Store.for_user(site, "root")
            try:
                PackingService(svc_thread_store, slurm, site, ServiceSettings(user="root", python="/py"),
                               clock=cluster.clock).run_round()
                cluster.tick()
            finally:
                svc_thread_store.close()

    t = threading.Thread(target=world_runs)
    t.start()
    jobs = wait_for_jobs(site, "root", ids, poll_s=0.05, on_update=updates.append, timeout_s=30)
    t.join()
    assert [str(j.state) for j in jobs] == ["COMPLETED", "COMPLETED"]
    assert len(updates) >= 2 and str(updates[0][0].state) in ("PENDING", "PLANNED", "RUNNING")
