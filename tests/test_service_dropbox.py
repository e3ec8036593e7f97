"""Requests from a login node without the lease (issue 30c): dropped as files, applied by
the service once, refused (and recorded) when truncated, foreign or replayed."""

from __future__ import annotations

import errno
import os
import shutil
import sqlite3
import time

import pytest
from click.testing import CliRunner

from slurm_dlrm.cli import cli
from slurm_dlrm.service import dropbox
from slurm_dlrm.service.daemon import ServicePaths, this_host
from slurm_dlrm.service.dropbox import encode, ingest_requests, requests_dir, write_request
from slurm_dlrm.service.hosts import write_lease_file
from slurm_dlrm.service.remote import appliers
from slurm_dlrm.service.snapshot import SnapshotPublisher, snapshot_path
from slurm_dlrm.slurm.fake import FakeSlurm
from slurm_dlrm.store.lease import Lease
from slurm_dlrm.store.states import JobState
from slurm_dlrm.store.store import Store, current_user
from tests.service_harness import (
    add_job,
    ingest_dropped,
    request_row,
    write_site_file,
)

USER = current_user()


def reasons(store):
    return [e["reason"] for e in store.events(kind="request")]


def test_submit_request_applied_once(dropbox_env):
    site, store_dir, store = dropbox_env
    name = write_request(store_dir, "submit", {"rows": [request_row("a"), request_row("b")]}, user=USER, host="login2")
    assert (requests_dir(store_dir) / name).is_file()
    assert not [n for n in os.listdir(requests_dir(store_dir)) if n.startswith(".")]  # no temporary left
    st = ingest_dropped(site, store_dir, store)
    assert st.applied == 1 and st.results[0]["job_ids"] == [1, 2]
    assert [j.name for j in store.jobs()] == ["a", "b"]
    assert (site.spool_dir_for(USER) / "jobs" / "1").is_dir()  # the runner's spec file, as submit writes it
    assert not (requests_dir(store_dir) / name).exists()
    assert ingest_dropped(site, store_dir, store).applied == 0
    assert len(store.jobs()) == 2


def test_crash_after_commit_before_delete_is_not_applied_again(dropbox_env, monkeypatch):
    site, store_dir, store = dropbox_env
    name = write_request(store_dir, "submit", {"rows": [request_row("a")]}, user=USER, host="login2")
    keep = (requests_dir(store_dir) / name).read_bytes()
    ingest_dropped(site, store_dir, store)
    (requests_dir(store_dir) / name).write_bytes(keep)  # as if the unlink never happened
    st = ingest_dropped(site, store_dir, store)
    assert (st.applied, st.leftovers, st.refused) == (0, 1, 0)
    assert len(store.jobs()) == 1 and reasons(store) == []
    assert not (requests_dir(store_dir) / name).exists()


def test_crash_before_commit_applies_it_at_the_next_round(dropbox_env):
    site, store_dir, store = dropbox_env
    write_request(store_dir, "submit", {"rows": [request_row("a")]}, user=USER, host="login2")

    def boom(store_, payload):
        appliers(site, USER, FakeSlurm())["submit"](store_, payload)
        raise KeyboardInterrupt  # killed inside the transaction (not a refusal)

    with pytest.raises(KeyboardInterrupt):
        ingest_requests(store, store_dir, USER, {"submit": boom})
    assert store.jobs() == []  # rolled back with its record
    assert ingest_dropped(site, store_dir, store).applied == 1
    assert len(store.jobs()) == 1


def test_replayed_copy_is_refused_and_recorded_once(dropbox_env):
    site, store_dir, store = dropbox_env
    name = write_request(store_dir, "submit", {"rows": [request_row("a")]}, user=USER, host="login2")
    raw = (requests_dir(store_dir) / name).read_bytes()
    ingest_dropped(site, store_dir, store)
    (requests_dir(store_dir) / "99999999999999999999-submit-evil.req").write_bytes(raw)
    st = ingest_dropped(site, store_dir, store)
    assert st.refused == 1 and len(store.jobs()) == 1
    assert len(reasons(store)) == 1 and "replayed" in reasons(store)[0]
    assert (requests_dir(store_dir) / "refused" / "99999999999999999999-submit-evil.req").exists()
    ingest_dropped(site, store_dir, store)
    assert len(reasons(store)) == 1


def test_truncated_file_is_refused(dropbox_env):
    site, store_dir, store = dropbox_env
    name = write_request(store_dir, "submit", {"rows": [request_row("a")]}, user=USER, host="login2")
    path = requests_dir(store_dir) / name
    path.write_bytes(path.read_bytes()[:-20])
    other = requests_dir(store_dir) / "00000000000000000001-x.req"
    raw = encode({"version": 1}).replace(b'"version":1', b'"version":2')  # altered after the checksum
    other.write_bytes(raw)
    st = ingest_dropped(site, store_dir, store)
    assert st.refused == 2 and store.jobs() == []
    rs = reasons(store)
    assert any("truncated" in r and name in r for r in rs) and any("checksum" in r for r in rs)


def test_foreign_requests_are_refused(dropbox_env):
    site, store_dir, store = dropbox_env
    body = {"version": 1, "kind": "submit", "request_id": "r1", "user": "mallory", "uid": os.getuid() + 1,
            "host": "login2", "created_t": 0, "payload": {"rows": [request_row("a")]}}
    (requests_dir(store_dir)).mkdir(parents=True, exist_ok=True)
    (requests_dir(store_dir) / "1-submit.req").write_bytes(encode(body))
    name = write_request(store_dir, "submit", {"rows": [request_row("b")]}, user=USER, host="login2")
    if os.getuid() == 0:
        os.chown(requests_dir(store_dir) / name, 65534, 65534)  # a file someone else owns
    st = ingest_dropped(site, store_dir, store)
    assert st.applied == 0 and store.jobs() == []
    rs = reasons(store)
    assert any("foreign" in r and "mallory" in r for r in rs)
    if os.getuid() == 0:
        assert any("foreign: the file belongs to uid 65534" in r for r in rs)


def test_symlink_is_refused(dropbox_env, tmp_path):
    site, store_dir, store = dropbox_env
    name = write_request(store_dir, "submit", {"rows": [request_row("a")]}, user=USER, host="login2")
    shutil.move(requests_dir(store_dir) / name, tmp_path / "elsewhere.req")
    os.symlink(tmp_path / "elsewhere.req", requests_dir(store_dir) / name)
    assert ingest_dropped(site, store_dir, store).refused == 1 and store.jobs() == []


def test_bad_ids_refused_whole_and_recorded(dropbox_env):
    site, store_dir, store = dropbox_env
    a = add_job(store, "a", user=USER)
    write_request(store_dir, "cancel", {"job_ids": [a, 999]}, user=USER, host="login2")
    write_request(store_dir, "cancel", {"job_ids": "all"}, user=USER, host="login2")
    write_request(store_dir, "submit", {"rows": [{"name": "x"}]}, user=USER, host="login2")
    st = ingest_dropped(site, store_dir, store)
    assert st.refused == 3 and st.applied == 0
    assert store.get_job(a).state == JobState.PENDING  # nothing half-done
    rs = reasons(store)
    assert any("job 999: no such job" in r for r in rs) and any("job_ids" in r for r in rs)
    assert any("malformed" in r for r in rs)
    assert len(store.jobs()) == 1


def test_cancel_and_requeue_requests(dropbox_env):
    site, store_dir, store = dropbox_env
    a = add_job(store, "a", user=USER)
    write_request(store_dir, "cancel", {"job_ids": [a]}, user=USER, host="login2")
    ingest_dropped(site, store_dir, store)
    assert store.get_job(a).state == JobState.CANCELLED
    write_request(store_dir, "requeue", {"job_ids": [a]}, user=USER, host="login2")
    ingest_dropped(site, store_dir, store)
    assert store.get_job(a).state == JobState.PENDING


def test_snapshot_published_when_changed_and_readable_immutable(dropbox_env):
    site, store_dir, store = dropbox_env
    add_job(store, "a", user=USER)
    now = [0.0]
    pub = SnapshotPublisher(store_dir, clock=lambda: now[0])  # copies take no time on this clock
    assert pub.publish_if_changed(store)
    assert not pub.publish_if_changed(store)
    with Store(snapshot_path(store_dir), readonly=True, immutable=True) as snap:
        assert [j.name for j in snap.jobs()] == ["a"]
    assert oct(snapshot_path(store_dir).stat().st_mode & 0o777) == "0o600"
    conn = sqlite3.connect(snapshot_path(store_dir))
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    conn.close()
    other = Store.for_user(site, USER)  # a command on this host writes too
    add_job(other, "b", user=USER)
    other.close()
    assert pub.publish_if_changed(store)


def test_a_slow_copy_is_made_less_often(dropbox_env):
    site, store_dir, store = dropbox_env
    now = [0.0]

    def clock():
        return now[0]

    pub = SnapshotPublisher(store_dir, clock=clock)
    real_publish = __import__("slurm_dlrm.service.snapshot", fromlist=["publish"]).publish

    def slow_publish(st, d):
        now[0] += 2.0  # a copy that takes 2 s: at most one per 40 s
        return real_publish(st, d)

    import slurm_dlrm.service.snapshot as snapshot_mod

    snapshot_mod.publish, orig = slow_publish, snapshot_mod.publish
    try:
        add_job(store, "a", user=USER)
        assert pub.publish_if_changed(store)
        add_job(store, "b", user=USER)
        now[0] += 10.0
        assert not pub.publish_if_changed(store)  # changed, but 12 s after a 2 s copy
        now[0] += 30.0
        assert pub.publish_if_changed(store)
        with Store(snapshot_path(store_dir), readonly=True, immutable=True) as snap:
            assert [j.name for j in snap.jobs()] == ["a", "b"]
    finally:
        snapshot_mod.publish = orig


# ---------------------------------------------------------------- the commands elsewhere

@pytest.fixture
def other_host(tmp_path, monkeypatch):
    """The service holds the store from login9 (its lease file says so); we are not login9."""
    from slurm_dlrm.site import load_site

    monkeypatch.setenv("SLURM_DLRM_SITE", str(write_site_file(tmp_path)))
    site = load_site(str(tmp_path / "site.toml"))
    store_dir = site.store_dir_for(USER)
    with Store.for_user(site, USER) as st:
        a = add_job(st, "a", user=USER)
        SnapshotPublisher(store_dir).publish_if_changed(st)
        add_job(st, "later", user=USER)  # not in the copy yet
    now = time.time()
    write_lease_file(ServicePaths(store_dir), Lease("login9", 77, "T", now, now, now + 600))
    assert this_host() != "login9"
    opened = []

    def audit(event, args):
        if event == "sqlite3.connect" and "snapshot" not in str(args[0]) and args[0] != ":memory:":
            opened.append(args[0])

    import sys

    sys.addaudithook(audit)
    yield site, store_dir, a, opened
    opened.append("end")  # the hook stays for the process: mark this test's end


def test_submit_elsewhere_drops_a_request(other_host, monkeypatch):
    import slurm_dlrm.service.request_wait as request_wait

    site, store_dir, _a, opened = other_host
    monkeypatch.setattr(request_wait, "MIN_WAIT_S", 0.0)
    spec = os.path.join(os.path.dirname(__file__), "..", "examples", "sweep")
    files = sorted(os.path.join(spec, f) for f in os.listdir(spec) if f.endswith(".yaml"))[:2]
    from slurm_dlrm.service.daemon import write_status

    write_status(ServicePaths(store_dir), {"round_period_s": 0.2})  # login9's service, which never answers here
    opened.clear()
    t0 = time.perf_counter()
    res = CliRunner().invoke(cli, ["submit", *files])
    # it waits 3 rounds for the job ids (issue 43 item 11; tests/test_service_request_wait.py)
    assert res.exit_code == 1 and "packing service on host login9 did not record request" in res.output
    assert time.perf_counter() - t0 < 5.0
    assert opened == []  # the live store was never opened from here
    names = [n for n in os.listdir(requests_dir(store_dir)) if n.endswith(".req")]
    assert len(names) == 1
    res = CliRunner().invoke(cli, ["submit", "--no-pack", files[0]])
    assert res.exit_code == 1 and "runs on host login9" in res.output


def test_queue_and_cancel_elsewhere_use_the_copy(other_host):
    site, store_dir, a, opened = other_host
    opened.clear()
    res = CliRunner().invoke(cli, ["queue", "--json"])
    assert res.exit_code == 0, res.output
    assert "later" not in res.output and '"a"' in res.output
    res = CliRunner().invoke(cli, ["queue"])
    assert res.exit_code == 0 and "not running" not in res.output  # its lease says it runs, on login9
    res = CliRunner().invoke(cli, ["acct", "--json"])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(cli, ["cancel", "999"])  # as scancel: an error line, exit 0 (issue 42)
    assert res.exit_code == 0 and "slurm-dlrm: error: job 999: no such job" in res.output
    res = CliRunner().invoke(cli, ["cancel", str(a)])
    assert res.exit_code == 0 and "requested" in res.output and "login9" in res.output
    assert opened == []
    with Store.for_user(site, USER) as st:  # the service's next round
        assert ingest_dropped(site, store_dir, st).applied == 1
        assert st.get_job(a).state == JobState.CANCELLED


def test_estimate_elsewhere_reads_history_from_the_copy(other_host):
    _site, _store_dir, _a, opened = other_host
    spec = os.path.join(os.path.dirname(__file__), "..", "examples", "sweep", "tiny-a.yaml")
    opened.clear()
    res = CliRunner().invoke(cli, ["estimate", spec])
    assert res.exit_code == 0, res.output
    assert opened == []


def test_serve_status_elsewhere_names_the_lease_holder(other_host):
    res = CliRunner().invoke(cli, ["serve", "status"])
    assert res.exit_code == 0 and "running on host login9" in res.output and "pid 77" in res.output, res.output


def test_no_copy_yet_says_so(other_host):
    site, store_dir, _a, _opened = other_host
    snapshot_path(store_dir).unlink()
    res = CliRunner().invoke(cli, ["queue"])
    assert res.exit_code == 1 and "has not published a copy" in res.output


def test_dropbox_module_has_no_store_import():
    assert "slurm_dlrm.store.store" not in open(dropbox.__file__).read()


def test_a_submit_from_another_host_keeps_nice_and_begin(dropbox_env):
    """--nice/--begin (issue 31) travel in the request's rows; a bad one refuses the request."""
    site, store_dir, store = dropbox_env
    write_request(store_dir, "submit", {"rows": [dict(request_row("a"), nice=50, begin_time=2.0e9)]}, user=USER,
                  host="login2")
    assert ingest_dropped(site, store_dir, store).applied == 1
    job = store.jobs()[0]
    assert (job.nice, job.begin_time) == (50, 2.0e9)
    write_request(store_dir, "submit", {"rows": [dict(request_row("b"), nice="-5")]}, user=USER, host="login2")
    assert ingest_dropped(site, store_dir, store).applied == 0
    assert len(store.jobs()) == 1 and any("nice must be a number" in r for r in reasons(store))


@pytest.mark.parametrize("short", [False, True])
def test_a_full_file_system_is_one_line_and_hands_nothing_over(dropbox_env, monkeypatch, short):
    """Issue 49 (chaos_live seed 2: the store's file system full while `submit` on a login
    node without the service dropped its request): OSError's traceback. Now StoreFull (one
    line, exit 1) and no file, partial or whole, left in the drop folder."""
    from slurm_dlrm.store.errors import StoreFull

    _, store_dir, _ = dropbox_env
    real_write = os.write

    def full(fd, data):
        if short:  # a short write: the room ran out part way
            return real_write(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(StoreFull, match="its file system is full; nothing was handed over"):
        write_request(store_dir, "submit", {"rows": [request_row("a")]}, user=USER, host="login2")
    monkeypatch.undo()
    assert list(requests_dir(store_dir).iterdir()) == []
