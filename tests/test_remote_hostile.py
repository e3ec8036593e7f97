"""The multi-login-node path against a hostile neighbour and a fault (issue 41).

Another user is a real account other than ours (files chowned to it, as
tests/test_exporter_security.py does); another login node is a lease naming a host that
is not this one (tests/test_service_dropbox.py's `other_host`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import sqlite3
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_dlrm.cli import cli
from slurm_dlrm.errors import BadInput
from slurm_dlrm.service import dropbox
from slurm_dlrm.service.daemon import ServicePaths, this_host
from slurm_dlrm.service.dropbox import requests_dir, write_request
from slurm_dlrm.service.hosts import lease_path, read_lease_file, write_lease_file
from slurm_dlrm.service.remote import open_snapshot
from slurm_dlrm.service.snapshot import SnapshotPublisher, snapshot_path
from slurm_dlrm.slurm.fake import FakeSlurm
from slurm_dlrm.store.errors import StoreNotOwned, StoreUntrusted
from slurm_dlrm.store.lease import Lease
from slurm_dlrm.store.store import Store, current_user
from tests.service_harness import (
    add_job,
    estimate_dict,
    ingest_dropped,
    make_site,
    request_row,
    write_site_file,
)
from tests.test_exporter_security import ENDLESS_VIEW, other_account

USER = current_user()
SPEC = str(Path(__file__).resolve().parent.parent / "examples" / "sweep" / "tiny-a.yaml")
THIRTY_YEARS_S = 30 * 365 * 86400.0


def _site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple:
    from slurm_dlrm.site import load_site

    shared = tmp_path / "shared"  # /shared/{user}: the layout refuse_foreign anticipates
    shared.mkdir(mode=0o755)
    site_file = write_site_file(tmp_path, store_dir=shared / "{user}")
    monkeypatch.setenv("SLURM_DLRM_SITE", str(site_file))
    site = load_site(str(site_file))
    return site, site.store_dir_for(USER)


def _plant(store_dir: Path, *, endless: bool = False) -> None:
    """What another host's service leaves (or a neighbour forges): a lease of login9's
    that runs for 30 years, and a copy of a store with one job, "forged"."""
    store_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    with Store(store_dir / "forge.sqlite") as st:
        add_job(st, "forged", user=USER)
        SnapshotPublisher(store_dir).publish_if_changed(st)
    for f in store_dir.glob("forge.sqlite*"):
        f.unlink()
    if endless:
        with sqlite3.connect(snapshot_path(store_dir)) as c:
            c.execute("PRAGMA foreign_keys = OFF")
            c.execute("DROP TABLE jobs")
            c.execute(ENDLESS_VIEW)
    now = time.time()
    write_lease_file(ServicePaths(store_dir), Lease("login9", 77, "T", now, now, now + THIRTY_YEARS_S))
    assert this_host() != "login9"


def _chown_all(store_dir: Path, uid: int, gid: int, *, folder: bool = True) -> None:
    for f in store_dir.iterdir():
        os.chown(f, uid, gid)
    if folder:
        os.chown(store_dir, uid, gid)


def test_a_store_folder_made_first_by_another_user_fools_no_remote_command(tmp_path, monkeypatch):
    """Item 1: mallory made /shared/<me>/ first, with a lease naming login9 for 30 years
    and a copy of her own; queue, submit, cancel and serve status refuse it (exit 2, one
    line) instead of listing her jobs or reporting a request handed to no one."""
    acc = other_account()
    assert acc is not None, "needs root and another account"
    _site_, store_dir = _site(tmp_path, monkeypatch)
    _plant(store_dir)
    _chown_all(store_dir, acc.pw_uid, acc.pw_gid)
    os.chmod(store_dir, 0o755)
    for args in (["queue"], ["submit", SPEC], ["cancel", "1"], ["serve", "status"]):
        res = CliRunner().invoke(cli, args)
        assert res.exit_code == 2, (args, res.output)
        assert res.stderr.startswith("slurm-dlrm: error: ") and "belongs to " + acc.pw_name in res.stderr, args
        assert len(res.stderr.strip().splitlines()) == 1 and "forged" not in res.output
    assert not requests_dir(store_dir).exists()  # nothing dropped where she reads it
    # The folder is ours, but she put the lease and the copy in while it was open to her.
    os.chown(store_dir, os.geteuid(), os.getegid())
    os.chmod(store_dir, 0o700)
    with pytest.raises(StoreNotOwned, match="service lease file"):
        read_lease_file(ServicePaths(store_dir))
    os.chown(lease_path(ServicePaths(store_dir)), os.geteuid(), os.getegid())
    res = CliRunner().invoke(cli, ["queue"])
    assert res.exit_code == 2 and "store copy" in res.stderr and "forged" not in res.output, res.output
    os.chown(snapshot_path(store_dir), os.geteuid(), os.getegid())
    assert "forged" in CliRunner().invoke(cli, ["queue"]).output  # all ours now: read as before
    # ours, but open to everyone: anyone could have swapped the files
    os.chmod(store_dir, 0o777)
    res = CliRunner().invoke(cli, ["queue"])
    assert res.exit_code == 1 and "can be written by others" in res.stderr, res.output
    os.chmod(store_dir, 0o770)  # the group could swap the copy between its check and SQLite's open
    res = CliRunner().invoke(cli, ["queue"])
    assert res.exit_code == 1 and "can be written by others" in res.stderr, res.output
    assert read_lease_file(ServicePaths(store_dir)) is not None  # read through its checked descriptor
    os.chmod(store_dir, 0o700)
    os.chmod(snapshot_path(store_dir), 0o666)
    res = CliRunner().invoke(cli, ["queue"])
    assert res.exit_code == 1 and "can be written by others" in res.stderr, res.output


def test_a_copy_with_an_endless_view_is_refused_not_spun_on(tmp_path, monkeypatch):
    """Item 1: a copy whose `jobs` is a recursive view; today's `queue` runs it for ever."""
    site, store_dir = _site(tmp_path, monkeypatch)
    _plant(store_dir, endless=True)
    lease = read_lease_file(ServicePaths(store_dir))
    assert lease is not None
    t0 = time.monotonic()
    with pytest.raises(StoreUntrusted, match="'jobs' is a view"):
        open_snapshot(site, USER, lease).close()
    res = CliRunner().invoke(cli, ["queue"])
    assert res.exit_code == 1 and "'jobs' is a view" in res.stderr, res.output
    assert time.monotonic() - t0 < 10.0
    with Store(store_dir / "real.sqlite") as st:  # a copy the service really made stays readable
        add_job(st, "mine", user=USER)
        SnapshotPublisher(store_dir).publish_if_changed(st)
    with open_snapshot(site, USER, lease) as snap:
        assert snap.untrusted and snap.read_budget_s and [j.name for j in snap.jobs()] == ["mine"]


# ---------------------------------------------------------------- items 3 and 5: one request's fault


def _drop_raw(store_dir: Path, line: bytes, name: str) -> str:
    folder = requests_dir(store_dir)
    folder.mkdir(mode=0o700, exist_ok=True)
    raw = line + b"\nsha256 " + hashlib.sha256(line).hexdigest().encode() + b"\n"
    fd = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, raw)
    os.close(fd)
    return name


def _head(payload: bytes, rid: str) -> bytes:
    return (b'{"version":1,"kind":"submit","request_id":"' + rid.encode() + b'","user":' + json.dumps(USER).encode()
            + b',"uid":' + str(os.getuid()).encode() + b',"host":"login2","created_t":1,"payload":' + payload + b"}")


def test_one_malformed_request_is_refused_and_the_next_applied(dropbox_env):
    """Item 3: a row whose estimate has the wrong shape (AttributeError), a NULL name
    (IntegrityError), a 100,000-deep JSON (RecursionError): each refused, moved to
    refused/, one event each; the good request after them is applied in the same round."""
    site, store_dir, store = dropbox_env
    bad = [write_request(store_dir, "submit", {"rows": [request_row("a", estimate=dict(estimate_dict(), profile=[1]))]},
                         user=USER, host="login2"),
           write_request(store_dir, "submit", {"rows": [request_row(None)]}, user=USER, host="login2"),
           _drop_raw(store_dir, _head(b'{"rows":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "deep"),
                     f"{time.time_ns():020d}-submit-login2-1-deep.req")]
    good = write_request(store_dir, "submit", {"rows": [request_row("good")]}, user=USER, host="login2")
    st = ingest_dropped(site, store_dir, store)
    assert (st.applied, st.refused) == (1, 3)
    assert [j.name for j in store.jobs()] == ["good"]
    assert sorted(os.listdir(requests_dir(store_dir) / "refused")) == sorted(bad)
    assert not (requests_dir(store_dir) / good).exists()
    events = [e["reason"] for e in store.events(kind="request")]
    assert len(events) == 3 and all(any(n in e for e in events) for n in bad), events
    again = ingest_dropped(site, store_dir, store)  # nothing left in the way, nothing recorded twice
    assert (again.applied, again.refused) == (0, 0) and len(store.events(kind="request")) == 3


def test_a_huge_row_count_is_refused_before_it_is_parsed(dropbox_env, monkeypatch):
    """Item 5: `[{},{},...]` well inside the 64 MiB cap (9 MiB here, 250 MB once decoded;
    64 MiB of it, 1.8 GB) and one nested past the depth cap are refused from their bytes:
    json.loads never sees them."""
    site, store_dir, store = dropbox_env
    n = 3_000_000
    wide = _drop_raw(store_dir, _head(b'{"rows":[' + b"{}," * (n - 1) + b"{}]}", "wide"), "1-wide.req")
    _drop_raw(store_dir, _head(b'{"rows":[' + b"[" * 40 + b"]" * 40 + b"]}", "deep"), "2-deep.req")
    assert (requests_dir(store_dir) / wide).stat().st_size <= dropbox.MAX_REQUEST_BYTES
    parsed: list[int] = []
    real_loads = json.loads
    monkeypatch.setattr(dropbox.json, "loads", lambda b, *a, **k: parsed.append(len(b)) or real_loads(b, *a, **k))
    st = ingest_dropped(site, store_dir, store)
    assert st.refused == 2 and parsed == []
    events = " ".join(e["reason"] for e in store.events(kind="request"))
    assert "too large" in events and "nested deeper than" in events
    monkeypatch.undo()
    # at the caps' edge, and JSON text that only looks deep or wide, is applied
    deep_ok = {"rows": [request_row("x" + "[{" * 50 + '\\"' + ",:" * 100)], "dependency": None}
    write_request(store_dir, "submit", deep_ok, user=USER, host="login2")
    assert ingest_dropped(site, store_dir, store).applied == 1
    dropbox.check_shape(b"[" * dropbox.MAX_REQUEST_DEPTH + b"]" * dropbox.MAX_REQUEST_DEPTH)
    with pytest.raises(dropbox.Refused):
        dropbox.check_shape(b"[" * (dropbox.MAX_REQUEST_DEPTH + 1) + b"]" * (dropbox.MAX_REQUEST_DEPTH + 1))
    with pytest.raises(BadInput, match="too many jobs"):  # the writer refuses it first, nothing dropped
        write_request(store_dir, "submit", {"rows": [{}] * (dropbox.MAX_REQUEST_ROWS + 1)}, user=USER, host="h")
    assert not [n for n in os.listdir(requests_dir(store_dir)) if n.endswith(".req") or n.endswith(".tmp")]
    with pytest.raises(dropbox.Refused, match="too many jobs"):
        dropbox.decode(dropbox.encode({"version": 1, "kind": "submit", "request_id": "r", "user": USER,
                                       "uid": os.getuid(), "payload": {"rows": [{}] * (dropbox.MAX_REQUEST_ROWS + 1)}}),
                       user=USER, uid=os.getuid())


# ---------------------------------------------------------------- item 2: the exporter's connections


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_idle_connections_do_not_hold_a_scrape(tmp_path):
    """Item 2: a scrape is answered within 1 s while 10 TCP connections that send
    nothing are open, over HTTPS (today's server does every TLS handshake in its one
    accept loop, with no timeout) and HTTP; an idle connection is closed after the
    connection timeout, not held for ever."""
    from slurm_dlrm import exporter as E
    from tests.test_exporter import NOW, make_store, site_for

    make_store(tmp_path / "alice" / "store.sqlite")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",  # noqa: S603,S607
                    "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", "key.pem", "-out", "cert.pem"], cwd=tmp_path, check=True, capture_output=True)
    col = E.StoreCollector(site_for(tmp_path), all_users=True, clock=lambda: NOW)
    client = ssl.create_default_context(cafile=str(tmp_path / "cert.pem"))
    for tls in (E.Tls(str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")), None):
        server, _thread = E.serve(E.make_registry(col), 0, "127.0.0.1", tls, connection_timeout_s=1.0)
        scheme = "https" if tls else "http"
        url = f"{scheme}://127.0.0.1:{server.server_port}/metrics"
        opened_t = time.monotonic()
        idle = [socket.create_connection(("127.0.0.1", server.server_port), timeout=5) for _ in range(10)]
        try:
            time.sleep(0.2)  # the server has accepted them
            t0 = time.monotonic()
            body = urllib.request.urlopen(url, timeout=5, context=client if tls else None).read().decode()
            took_s = time.monotonic() - t0
            assert took_s < 1.0 and 'user="alice"' in body, (scheme, took_s)
            idle[0].settimeout(6.0)
            assert idle[0].recv(1) == b""  # closed by the server after its timeout
            assert 0.9 < time.monotonic() - opened_t < 6.0
        finally:
            for s in idle:
                s.close()
            server.shutdown()
            server.server_close()


# ---------------------------------------------------------------- item 4: the lease, mid-round


def test_a_holder_that_lost_the_lease_mid_round_writes_and_sends_nothing(tmp_path):
    """Item 4: login-a's round is slow (a 30 s sbatch, or a clock a lease length behind),
    login-b takes the store over meanwhile; what login-a does after that is refused in the
    same transaction (writes) or before the command (Slurm): one host's writes only."""
    from slurm_dlrm.service.core import PackingService, ServiceSettings
    from slurm_dlrm.service.hosts import LeaseHolder
    from slurm_dlrm.store.errors import LeaseLost
    from slurm_dlrm.store.states import JobState
    from tests.service_harness import FakeClock

    clock = FakeClock()
    site = make_site(tmp_path)
    paths = ServicePaths(site.store_dir_for(USER))
    store_a, store_b = Store.for_user(site, USER, clock=clock), Store.for_user(site, USER, clock=clock)
    a, b = LeaseHolder(site, USER, paths, 30.0), LeaseHolder(site, USER, paths, 30.0)
    a.host, b.host = "login-a", "login-b"
    slurm = FakeSlurm(clock=clock, user=USER)
    assert a.take(store_a) is not None and b.take(store_b) is None
    svc_a = PackingService(store_a, a.guard(store_a, slurm), site,
                           ServiceSettings(user=USER, python="/venv/bin/python", dispatch_window_s=0.0), clock=clock)
    # A Slurm command renews the lease first: a takeover cannot happen during the command.
    clock.advance(25.0)
    real_sbatch = slurm.sbatch

    def slow_sbatch(script, args=()):
        clock.advance(20.0)  # past where the lease taken at the round's start ended
        assert b.take(store_b) is None
        return real_sbatch(script, args)

    slurm.sbatch = slow_sbatch
    first = add_job(store_a, "first", user=USER)
    svc_a.run_round()
    assert len(slurm.jobs) == 1 and store_a.get_job(first).state == JobState.PLANNED
    slurm.sbatch = real_sbatch
    # Now login-a pauses past its lease (or its clock lags); login-b takes over.
    clock.advance(60.0)
    assert b.take(store_b) is not None
    events = len(store_b.events())
    with pytest.raises(LeaseLost):
        add_job(store_a, "second", user=USER)
    assert a.lost and [j.name for j in store_b.jobs()] == ["first"]
    with pytest.raises(LeaseLost):
        svc_a.slurm.sbatch("#!/bin/sh\n")
    with pytest.raises(LeaseLost):
        svc_a.slurm.scancel([1])
    assert len(slurm.jobs) == 1 and slurm.jobs[min(slurm.jobs)].state != "CANCELLED"
    add_job(store_b, "by-b", user=USER)  # the new holder writes as before
    with pytest.raises(LeaseLost):  # the old holder's next round: its first write is refused
        svc_a.run_round()
    assert len(slurm.jobs) == 1 and len(store_b.events()) == events + 1
    # A Slurm client's own timeout is cut to what the lease has left once renewed (less 1 s).
    seen: list[float] = []

    class Client:
        timeout_s = 30.0

        def scancel(self, ids):
            seen.append(self.timeout_s)

    fenced_b = b.guard(store_b, Client())
    b.ttl_s = 10.0
    clock.advance(28.0)  # 2 s left of login-b's 30 s lease: renewed for 10
    fenced_b.scancel([1])
    assert seen == [9.0] and fenced_b.timeout_s == 30.0
    a.release(store_a)  # a clean stop of the old holder leaves the new holder's lease file
    lease = read_lease_file(paths)
    assert lease is not None and lease.host == "login-b" and lease.live(clock())
    store_a.close()
    store_b.close()


# ---------------------------------------------------------------- item 6: crash leftovers


def test_a_killed_writers_temporaries_are_removed_at_start_a_live_ones_kept(tmp_path):
    """Item 6: what a kill between write and rename leaves (a store-sized snapshot
    temporary, a request's) goes when the service starts; a file a live writer may still
    be filling stays (its pid alive here, or another host's and recent)."""
    import subprocess as sp

    from slurm_dlrm.service.loop import LoopControl
    from slurm_dlrm.service.run import serve_forever

    site = make_site(tmp_path)
    store_dir = site.store_dir_for(USER)
    Store.for_user(site, USER).close()
    proc = sp.Popen(["true"])  # noqa: S603,S607 - a pid that is gone
    proc.wait()
    dead, alive = proc.pid, 1
    req = requests_dir(store_dir)
    req.mkdir(mode=0o700)
    here = "".join(c if c.isalnum() or c in "-_" else "_" for c in this_host())[:40]
    hour_ago = time.time() - 3600
    files = {  # name -> (age, removed at start?)
        store_dir / f".store.snapshot.sqlite.{dead}.tmp": (hour_ago, True),
        store_dir / f".service.lease.json.{dead}.tmp": (hour_ago, True),
        store_dir / f".store.snapshot.sqlite.{alive}.tmp": (hour_ago, False),  # alive: may be filling it
        store_dir / f".store.snapshot.sqlite.{dead + 1}.tmp": (time.time(), False),  # recent: maybe another host's
        req / f".{time.time_ns():020d}-submit-{here}-{dead}-0a1b.req.tmp": (time.time(), True),
        req / f".{time.time_ns():020d}-submit-login2-{dead}-0a1c.req.tmp": (time.time(), False),
        req / f".{time.time_ns():020d}-cancel-login2-{dead}-0a1d.req.tmp": (hour_ago, True),
    }
    for path, (mtime, _gone) in files.items():
        path.write_bytes(b"x" * 4096)
        os.utime(path, (mtime, mtime))
    serve_forever(site, USER, slurm=FakeSlurm(user=USER), round_seconds=0.1, idle_exit_s=0.2, control=LoopControl())
    left = {p: p.exists() for p in files}
    assert left == {p: not gone for p, (_t, gone) in files.items()}
