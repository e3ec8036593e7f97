"""`submit` on a login node whose service runs on another host prints the job ids, as on
the service's host (issue 43 item 11): it waits a few of the service's rounds for the
published copy of the store to show its request's outcome; past that, one line, exit 1,
and the request is still applied once."""

from __future__ import annotations

import os
import sqlite3
import threading

import pytest
from click.testing import CliRunner

from slurm_dlrm.cli import cli
from slurm_dlrm.errors import DlrmError
from slurm_dlrm.service.daemon import ServicePaths, write_status
from slurm_dlrm.service.dropbox import ingest_requests, requests_dir
from slurm_dlrm.service.remote import appliers
from slurm_dlrm.service.request_wait import read_outcome, service_round_s, wait_bound_s
from slurm_dlrm.service.snapshot import publish, snapshot_path
from slurm_dlrm.slurm.fake import FakeSlurm
from slurm_dlrm.store.store import Store
from tests.test_service_dropbox import USER, other_host  # noqa: F401 - the fixture

SWEEP = os.path.join(os.path.dirname(__file__), "..", "examples", "sweep")


def _specs(n: int) -> list[str]:
    return sorted(os.path.join(SWEEP, f) for f in os.listdir(SWEEP) if f.endswith(".yaml"))[:n]


class _ServiceElsewhere(threading.Thread):
    """login9's service rounds: apply the dropped requests, publish the copy."""

    def __init__(self, site, store_dir) -> None:
        super().__init__(daemon=True)
        self.site, self.store_dir = site, store_dir
        self.ready, self.stop = threading.Event(), threading.Event()

    def run(self) -> None:
        with Store.for_user(self.site, USER) as store:  # its own connection, opened before the audit counts
            self.ready.set()
            while not self.stop.wait(0.05):
                if ingest_requests(store, self.store_dir, USER, appliers(self.site, USER, FakeSlurm())).applied:
                    publish(store, self.store_dir)


def test_submit_elsewhere_prints_the_ids_the_service_gave(other_host):  # noqa: F811
    site, store_dir, _a, opened = other_host
    write_status(ServicePaths(store_dir), {"round_period_s": 1.0})
    service = _ServiceElsewhere(site, store_dir)
    service.start()
    service.ready.wait(10)
    opened.clear()
    try:
        res = CliRunner().invoke(cli, ["submit", "--parsable", *_specs(2)])
        assert res.exit_code == 0, res.output
        with Store(snapshot_path(store_dir), readonly=True, immutable=True) as copy:
            new = [j.id for j in copy.jobs() if j.name not in ("a", "later")]
        assert res.output.split() == [str(i) for i in new] and len(new) == 2  # what `afterok:$(...)` needs
        res = CliRunner().invoke(cli, ["submit", _specs(1)[0]])
        assert res.exit_code == 0 and res.output.startswith(f"Submitted job {max(new) + 1} ("), res.output
    finally:
        service.stop.set()
        service.join(10)
    assert opened == []  # the live store was never opened from this host


def test_submit_elsewhere_without_an_answer_says_so_and_the_request_applies_once(other_host, monkeypatch):  # noqa: F811
    import slurm_dlrm.service.request_wait as request_wait

    site, store_dir, _a, _opened = other_host
    monkeypatch.setattr(request_wait, "MIN_WAIT_S", 0.0)
    write_status(ServicePaths(store_dir), {"round_period_s": 0.1})  # 3 rounds: 0.3 s
    res = CliRunner().invoke(cli, ["submit", "--parsable", *_specs(2)])
    assert res.exit_code == 1
    assert res.output.count("\n") == 1 and res.output.startswith("slurm-dlrm: error: submit: your packing service "
                                                                 "on host login9 did not record request ")
    (name,) = [n for n in os.listdir(requests_dir(store_dir)) if n.endswith(".req")]
    assert name in res.output
    with Store.for_user(site, USER) as store:  # the service's next rounds, later
        n = len(store.jobs())
        assert ingest_requests(store, store_dir, USER, appliers(site, USER, FakeSlurm())).applied == 1
        assert ingest_requests(store, store_dir, USER, appliers(site, USER, FakeSlurm())).applied == 0
        assert len(store.jobs()) == n + 2  # once


def test_a_refused_request_and_the_wait_bound(tmp_path):
    from slurm_dlrm.commands.submit import ids_from_elsewhere
    from slurm_dlrm.service.dropbox import REQUESTS_TABLE

    assert read_outcome(tmp_path, "x.req") is None  # no copy yet
    conn = sqlite3.connect(snapshot_path(tmp_path))
    conn.execute("CREATE TABLE other (a)")
    conn.commit()
    assert read_outcome(tmp_path, "x.req") is None  # a copy from before the first request
    conn.execute(REQUESTS_TABLE)
    conn.execute("INSERT INTO requests VALUES ('r1', 'x.req', 'submit', 'h', 'refused: rows: a list of jobs', 1, NULL)")
    conn.execute("INSERT INTO requests VALUES ('r2', 'y.req', 'submit', 'h', 'applied', 1, '{\"job_ids\": [7, 8]}')")
    conn.commit()
    conn.close()
    refused = read_outcome(tmp_path, "x.req")
    assert refused is not None and not refused.applied and refused.outcome.startswith("refused: rows")
    assert read_outcome(tmp_path, "y.req").result == {"job_ids": [7, 8]}

    class Site:
        class packing:  # noqa: N801
            round_seconds = 2.0

        def store_dir_for(self, user):
            return tmp_path

    assert ids_from_elsewhere(Site(), USER, "login9", "y.req", 2) == [7, 8]
    with pytest.raises(DlrmError, match="did not record request x.req: refused: rows: a list of jobs"):
        ids_from_elsewhere(Site(), USER, "login9", "x.req", 1)
    assert wait_bound_s(10.0) == 30.0 and wait_bound_s(0.5) == 5.0  # 3 rounds, at least 5 s
    assert service_round_s(tmp_path, 10.0) == 10.0
    write_status(ServicePaths(tmp_path), {"round_period_s": 0.5})
    assert service_round_s(tmp_path, 10.0) == 0.5
