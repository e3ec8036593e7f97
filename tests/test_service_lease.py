"""The service's lease on the store (issue 30b): one host writes, another takes over only
after the lease ran out, never while it is held."""

from __future__ import annotations

import sqlite3
import sys
import time

import pytest

from slurm_dlrm.service import hosts
from slurm_dlrm.service.daemon import ServicePaths
from slurm_dlrm.service.hosts import (
    LeaseHolder,
    read_lease_file,
    write_lease_file,
    writer_elsewhere,
)
from slurm_dlrm.service.loop import LoopControl
from slurm_dlrm.store.lease import Lease, acquire, read_lease, release
from slurm_dlrm.store.store import Store
from tests.service_harness import FakeClock, make_site


@pytest.fixture
def store(tmp_path):
    clock = FakeClock()
    with Store(tmp_path / "store.sqlite", clock=clock) as st:
        yield st


def test_taken_only_when_free_expired_or_ours(store):
    a, prev = acquire(store, host="login1", pid=10, token="A", ttl_s=30)
    assert a is not None and prev is None and a.expires_t == store.clock() + 30
    b, prev = acquire(store, host="login2", pid=20, token="B", ttl_s=30)
    assert b is None and prev == a  # held: never taken
    store.clock.advance(29.9)
    assert acquire(store, host="login2", pid=20, token="B", ttl_s=30)[0] is None
    renewed, _ = acquire(store, host="login1", pid=10, token="A", ttl_s=30)  # the holder renews
    assert renewed is not None and renewed.acquired_t == a.acquired_t and renewed.expires_t > a.expires_t
    store.clock.advance(30.0)  # expired now
    b, prev = acquire(store, host="login2", pid=20, token="B", ttl_s=30)
    assert b is not None and b.host == "login2" and prev is not None and prev.token == "A"
    assert acquire(store, host="login1", pid=10, token="A", ttl_s=30)[0] is None  # the old holder lost it
    ev = [e for e in store.events(kind="lease")]
    assert len(ev) == 2 and "taken over from host login1 (pid 10)" in ev[-1]["reason"]


def test_same_host_lock_holder_supersedes_a_dead_predecessor(store):
    acquire(store, host="login1", pid=10, token="A", ttl_s=30)
    assert acquire(store, host="login2", pid=11, token="B", ttl_s=30, holds_host_lock=True)[0] is None
    lease, _ = acquire(store, host="login1", pid=11, token="C", ttl_s=30, holds_host_lock=True)
    assert lease is not None and lease.token == "C"


def test_release_frees_at_once(store):
    acquire(store, host="login1", pid=10, token="A", ttl_s=30)
    release(store, "B")  # not ours: nothing
    assert read_lease(store).token == "A" and read_lease(store).live(store.clock())
    release(store, "A")
    assert acquire(store, host="login2", pid=20, token="B", ttl_s=30)[0] is not None


def _paths(tmp_path):
    p = ServicePaths(tmp_path / "store-root")
    p.store_dir.mkdir(parents=True, exist_ok=True)
    return p


def test_standby_never_opens_a_store_another_host_holds(tmp_path, monkeypatch):
    site = make_site(tmp_path)
    paths = _paths(tmp_path)
    with Store.for_user(site, "root"):  # a store the other host's service writes
        pass
    write_lease_file(paths, Lease("login9", 5, "X", time.time(), time.time(), time.time() + 3600))
    opened = []

    def audit(event, args):
        if event == "sqlite3.connect":
            opened.append(args)

    sys.addaudithook(audit)
    holder = LeaseHolder(site, "root", paths, ttl_s=5)
    opened.clear()
    assert holder.wait(LoopControl(), 0.05, idle_exit_s=0.3) is None
    assert opened == []  # not even read: the lease file answered
    assert read_lease_file(paths).host == "login9"


def test_takeover_within_a_round_of_expiry(tmp_path):
    site = make_site(tmp_path)
    paths = _paths(tmp_path)
    period = 0.5
    expires = time.time() + 1.0
    with Store.for_user(site, "root") as st:  # the row a killed holder on login9 left
        acquire(st, host="login9", pid=5, token="X", ttl_s=1.0)
    write_lease_file(paths, Lease("login9", 5, "X", expires - 1, expires - 1, expires))
    holder = LeaseHolder(site, "root", paths, ttl_s=5)
    store = holder.wait(LoopControl(), period)
    try:
        assert store is not None
        lease = read_lease(store)
        # taken (the compare-and-set's own time) after the end, within 2 rounds of it
        assert expires <= lease.acquired_t < expires + 2 * period
        assert lease.host == hosts.this_host() and lease.token == holder.token
        assert read_lease_file(paths).token == holder.token
        assert holder.renew(store)
        holder.release(store)
        assert not read_lease_file(paths).live(time.time())
    finally:
        store.close()


def test_renew_fails_after_a_takeover(tmp_path):
    site = make_site(tmp_path)
    paths = _paths(tmp_path)
    holder = LeaseHolder(site, "root", paths, ttl_s=0.2)
    store = holder.wait(LoopControl(), 0.05)
    try:
        time.sleep(0.3)  # paused past its lease ...
        other, _ = acquire(store, host="login2", pid=7, token="B", ttl_s=30)  # ... another host took it
        assert other is not None
        write_lease_file(paths, other)
        assert not holder.renew(store)
        assert read_lease(store).token == "B"
        holder.release(store)  # ours no more: nothing is given back
        assert read_lease(store).live(time.time())
    finally:
        store.close()


def test_writer_elsewhere(tmp_path):
    paths = _paths(tmp_path)
    now = time.time()
    assert writer_elsewhere(paths) is None
    write_lease_file(paths, Lease("login9", 5, "X", now, now, now + 60))
    assert writer_elsewhere(paths).host == "login9"
    assert writer_elsewhere(paths, now_t=now + 61) is None
    write_lease_file(paths, Lease(hosts.this_host(), 5, "X", now, now, now + 60))
    assert writer_elsewhere(paths) is None
    hosts.lease_path(paths).write_text('{"host": "login9"')  # torn: read as no lease
    assert read_lease_file(paths) is None


def test_lease_ttl(tmp_path):
    from dataclasses import replace

    site = make_site(tmp_path)
    assert hosts.lease_ttl_s(site, 10.0) == 30.0 and hosts.lease_ttl_s(site, 20.0) == 60.0
    assert hosts.lease_ttl_s(replace(site, service_lease_s=4.0), 10.0) == 4.0


def test_sqlite_connect_is_audited():
    seen = []
    sys.addaudithook(lambda e, a: seen.append(e) if e == "sqlite3.connect" else None)
    sqlite3.connect(":memory:").close()
    assert "sqlite3.connect" in seen
