"""`slurm-dlrm exporter`: metrics from the stores, read-only, bad stores skipped and counted.

The exposition is parsed back with prometheus_client's own text parser, as Prometheus
would read it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pwd
import re
import socket
import sqlite3
import threading
import zlib
from pathlib import Path

import pytest
from click.testing import CliRunner
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from slurm_dlrm import exporter as E
from slurm_dlrm.cli import cli
from slurm_dlrm.service.daemon import ServicePaths, write_status
from slurm_dlrm.site import load_site
from slurm_dlrm.store import JobState, NewPlacement, PackState, Store
from slurm_dlrm.store.acct import AcctFilter, acct_rows

REPO = Path(__file__).resolve().parent.parent
NOW = 1_700_000_000.0
GIB = 1 << 30


def site_for(tmp_path: Path):
    return dataclasses.replace(load_site(str(REPO / "site-config" / "site.toml")), store_dir=str(tmp_path / "{user}"))


def site_file(tmp_path: Path) -> Path:
    text = (REPO / "site-config" / "site.toml").read_text().replace(
        'store_dir = "~/.local/share/slurm-dlrm"', f'store_dir = "{tmp_path}/{{user}}"')
    p = tmp_path / "site.toml"
    p.write_text(text)
    return p


def make_store(path: Path, user: str = "alice") -> dict[str, int]:
    """A RUNNING 2-GPU pack (3 members: 2 on GPU 0, 1 on GPU 1) with GPU samples, an OOM
    that was retried, a finished job with a measured peak, a move, and a pending job."""
    s = Store(path, clock=lambda: NOW)
    est = {"gpu_peak_bytes": 4 * GIB, "host_peak_bytes": 8 * GIB}
    ids = {n: s.add_job(user=user, name=n, spec={"name": n}, spec_fingerprint="fp", estimate=est,
                        gpu_model="h100", submit_time=NOW - 1000) for n in ("a", "b", "c", "done", "oom", "wait")}
    old = s.add_pack(name=f"old-{user}", user=user, policy="complementary", n_gpus=1, partition="dlrm",
                     gpu_model="h100", t=NOW - 900,
                     placements=[NewPlacement(ids["done"], 0, 0, gpu_mem_limit_bytes=5 * GIB),
                                 NewPlacement(ids["oom"], 0, 0, gpu_mem_limit_bytes=5 * GIB)])
    s.transition_pack(old, PackState.QUEUED, "sub", slurm_job_id="700", t=NOW - 890)
    s.transition_pack(old, PackState.RUNNING, "run", nodes="node1", t=NOW - 880)  # waited 120 s
    s.transition_job(ids["done"], JobState.RUNNING, "started", t=NOW - 880)
    s.transition_job(ids["oom"], JobState.RUNNING, "started", t=NOW - 880)
    s.add_samples([{"t": NOW - 870, "pack_id": old, "job_id": ids["done"], "node": "node1", "gpu_index": 0,
                    "gpu_mem_bytes": 6 * GIB, "samples_per_s": 100.0}])  # measured 6 GiB vs 4 estimated
    s.transition_job(ids["done"], JobState.COMPLETED, "exit 0", exit_code=0, t=NOW - 700)
    s.transition_job(ids["oom"], JobState.OOM, "out of GPU memory", exit_code=3, t=NOW - 800)
    s.transition_job(ids["oom"], JobState.PENDING, "retry with more memory", t=NOW - 790)
    s.transition_pack(old, PackState.COMPLETED, "end", t=NOW - 600)
    pk = s.add_pack(name=f"run-{user}", user=user, policy="complementary", n_gpus=2, partition="dlrm",
                    gpu_model="h100", t=NOW - 500,
                    placements=[NewPlacement(ids["a"], 0, 0, gpu_mem_limit_bytes=10 * GIB),
                                NewPlacement(ids["b"], 0, 0, gpu_mem_limit_bytes=20 * GIB),
                                NewPlacement(ids["c"], 0, 1, gpu_mem_limit_bytes=30 * GIB),
                                NewPlacement(ids["oom"], 0, 1, gpu_mem_limit_bytes=7 * GIB)])
    s.transition_pack(pk, PackState.QUEUED, "sub", slurm_job_id="701", t=NOW - 490)
    s.transition_pack(pk, PackState.RUNNING, "run", nodes="node2", t=NOW - 400)
    for n in ("a", "b", "c", "oom"):
        s.transition_job(ids[n], JobState.RUNNING, "started", t=NOW - 400)
    # a move: RUNNING -> PENDING with the recovery's "moved:" reason (and out of GPU 1)
    s.transition_job(ids["oom"], JobState.PENDING, "moved: re-pack ...; resumes from its checkpoint", t=NOW - 100)
    rows = []
    for i in range(10):
        t = NOW - 50 + i * 5
        rows.append({"t": t, "pack_id": pk, "job_id": None, "node": "node2", "gpu_index": 0,
                     "sm_util_pct": 40.0 + i, "mem_util_pct": 20.0, "gpu_mem_bytes": (25 + i) * GIB})
        rows.append({"t": t, "pack_id": pk, "job_id": None, "node": "node2", "gpu_index": 1,
                     "sm_util_pct": 70.0, "mem_util_pct": 35.0, "gpu_mem_bytes": 12 * GIB})
    rows.append({"t": NOW - 3600, "pack_id": pk, "job_id": None, "node": "node2", "gpu_index": 1,
                 "sm_util_pct": 1.0, "gpu_mem_bytes": 1})  # old: not the latest
    s.add_samples(rows)
    # held-out evaluations (issue 39): of running "a" (the last one is served) and of "done"
    with s.write():
        s.conn.executemany("INSERT INTO evals (job_id, step, t, auc, ne, log_loss) VALUES (?, ?, ?, ?, ?, ?)",
                           [(ids["a"], 100, NOW - 60, 0.70, 0.95, 0.6), (ids["a"], 200, NOW - 30, 0.75, 0.9, None),
                            (ids["done"], 100, NOW - 700, 0.8, 0.8, 0.5)])
    s.close()
    return ids


def scrape(collector: E.StoreCollector) -> dict[str, list]:
    text = generate_latest(E.make_registry(collector)).decode()
    fams = {f.name: f.samples for f in text_string_to_metric_families(text)}
    return fams


def value(fams, name: str, **labels) -> float:
    family = re.sub(r"_(total|bucket|count|sum)$", "", name)
    hits = [s.value for s in fams[family] if s.name == name
            and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, (name, labels, fams[family])
    return hits[0]


@pytest.fixture
def alice(tmp_path):
    ids = make_store(tmp_path / "alice" / "store.sqlite")
    col = E.StoreCollector(site_for(tmp_path), all_users=True, clock=lambda: NOW)
    return tmp_path, ids, col


def test_metrics_of_one_store(alice):
    tmp_path, ids, col = alice
    f = scrape(col)
    u = {"user": "alice", "partition": "dlrm", "gpu_model": "h100"}
    assert value(f, "slurm_dlrm_jobs", state="RUNNING", **u) == 3
    # the moved one, and "wait" (never packed: the partition its options name, else the default)
    assert value(f, "slurm_dlrm_jobs", state="PENDING", **u) == 2
    assert value(f, "slurm_dlrm_jobs", state="CANCELLED", **u) == 0  # every state, 0 when empty
    assert value(f, "slurm_dlrm_packs", state="RUNNING", **u) == 1
    assert value(f, "slurm_dlrm_packs", state="COMPLETED", **u) == 1
    g0 = {**u, "node": "node2", "gpu": "0", "slurm_job_id": "701"}
    g1 = {**g0, "gpu": "1"}
    assert value(f, "slurm_dlrm_gpu_members", **g0) == 2
    assert value(f, "slurm_dlrm_gpu_members", **g1) == 1  # the moved member left GPU 1
    assert value(f, "slurm_dlrm_gpu_memory_fenced_bytes", **g0) == 30 * GIB
    assert value(f, "slurm_dlrm_gpu_memory_fenced_bytes", **g1) == 30 * GIB
    assert value(f, "slurm_dlrm_gpu_memory_used_bytes", **g0) == 34 * GIB  # the latest sample
    assert value(f, "slurm_dlrm_gpu_sm_utilization_ratio", **g0) == pytest.approx(0.49)
    assert value(f, "slurm_dlrm_gpu_memory_bandwidth_utilization_ratio", **g1) == pytest.approx(0.35)
    assert value(f, "slurm_dlrm_gpu_memory_total_bytes", **g0) == load_site(None).gpu_models["h100"].memory_bytes
    assert not [s for s in f["slurm_dlrm_gpu_members"] if s.labels["slurm_job_id"] == "700"]  # ended pack
    # counters
    assert value(f, "slurm_dlrm_ooms_total", **u) == 1
    assert value(f, "slurm_dlrm_requeues_total", **u) == 2
    assert value(f, "slurm_dlrm_recoveries_total", kind="oom", **u) == 1
    assert value(f, "slurm_dlrm_recoveries_total", kind="pack", **u) == 0
    assert value(f, "slurm_dlrm_repacks_total", **u) == 1
    with Store(tmp_path / "alice" / "store.sqlite", readonly=True) as st:
        rows = acct_rows(st, AcctFilter(), NOW)
    assert value(f, "slurm_dlrm_gpu_charged_seconds_total", **u) == pytest.approx(
        3600 * sum(r["gpu_hours"] for r in rows))
    assert value(f, "slurm_dlrm_gpu_exclusive_seconds_total", **u) == pytest.approx(
        3600 * sum(r["excl_gpu_hours"] for r in rows))
    # histograms: one finished job with a measured peak (6 / 4 GiB); waits of 5 started jobs
    assert value(f, "slurm_dlrm_estimate_error_ratio_count", **u) == 1
    assert value(f, "slurm_dlrm_estimate_error_ratio_sum", **u) == pytest.approx(1.5)
    assert value(f, "slurm_dlrm_estimate_error_ratio_bucket", le="1.25", **u) == 0
    assert value(f, "slurm_dlrm_estimate_error_ratio_bucket", le="1.5", **u) == 1
    assert value(f, "slurm_dlrm_queue_wait_seconds_count", **u) == 5
    assert value(f, "slurm_dlrm_queue_wait_seconds_bucket", le="120.0", **u) == 2  # done, oom: 120 s
    assert value(f, "slurm_dlrm_exporter_stores") == 1
    assert sum(s.value for s in f["slurm_dlrm_store_errors"]) == 0
    # the last evaluation of each running job; none of ended ones
    job_a = {**u, "job_id": str(ids["a"])}
    assert value(f, "slurm_dlrm_job_eval", metric="auc", **job_a) == 0.75
    assert value(f, "slurm_dlrm_job_eval", metric="ne", **job_a) == 0.9
    assert value(f, "slurm_dlrm_job_eval_step", **job_a) == 200
    assert {s.labels["metric"] for s in f["slurm_dlrm_job_eval"]} == {"auc", "ne"}  # log_loss not recorded at 200
    assert {s.labels["job_id"] for s in f["slurm_dlrm_job_eval"]} == {str(ids["a"])}


def test_scrape_never_writes(alice):
    tmp_path, _, col = alice
    db = tmp_path / "alice" / "store.sqlite"
    before = (hashlib.sha256(db.read_bytes()).hexdigest(), db.stat().st_mtime_ns)
    for _ in range(3):
        scrape(col)
    assert (hashlib.sha256(db.read_bytes()).hexdigest(), db.stat().st_mtime_ns) == before
    # a WAL reader may create the WAL index (-shm) and an empty -wal: never a page of data
    wal = db.with_name("store.sqlite-wal")
    assert not wal.exists() or wal.stat().st_size == 0
    col.close()


def test_counters_follow_new_events_incrementally_and_never_go_back(alice):
    tmp_path, ids, col = alice
    f = scrape(col)
    u = {"user": "alice", "partition": "dlrm", "gpu_model": "h100"}
    assert value(f, "slurm_dlrm_ooms_total", **u) == 1
    with Store(tmp_path / "alice" / "store.sqlite", clock=lambda: NOW) as s:
        s.transition_job(ids["a"], JobState.OOM, "out of GPU memory", t=NOW + 1)
        s.transition_job(ids["a"], JobState.PENDING, "retry", t=NOW + 2)
    last_id = col.cursors[str(tmp_path / "alice" / "store.sqlite")].last_event_id
    f = scrape(col)
    assert value(f, "slurm_dlrm_ooms_total", **u) == 2
    assert value(f, "slurm_dlrm_recoveries_total", kind="oom", **u) == 2
    assert col.cursors[str(tmp_path / "alice" / "store.sqlite")].last_event_id == last_id + 2
    # a derived total that moves backwards is held at what was reported
    assert col._counter("x", ("a",), 5.0) == 5.0
    assert col._counter("x", ("a",), 4.0) == 5.0
    assert col._counter("x", ("a",), 6.0) == 6.0


def test_service_status_becomes_round_age_duration_and_slurm_reachability(alice):
    tmp_path, _, col = alice
    write_status(ServicePaths(tmp_path / "alice"), {"user": "alice", "last_round_t": NOW - 7, "slurm_ok": False,
                                                    "round_seconds": 0.25})
    f = scrape(col)
    assert value(f, "slurm_dlrm_service_last_round_age_seconds", user="alice") == pytest.approx(7)
    assert value(f, "slurm_dlrm_service_round_duration_seconds", user="alice") == 0.25
    assert value(f, "slurm_dlrm_service_slurm_reachable", user="alice") == 0
    assert ServicePaths(tmp_path).status.name == E.SERVICE_STATUS_FILE  # the file the service writes


def test_bad_stores_are_skipped_counted_and_logged_once(alice, caplog):
    tmp_path, _, col = alice
    # corrupt
    (tmp_path / "carol").mkdir(mode=0o700)
    (tmp_path / "carol" / "store.sqlite").write_bytes(b"this is not a database" * 100)
    # older schema (a store its owner has not opened since an upgrade, or mid-migration)
    make_store(tmp_path / "dave" / "store.sqlite", user="dave")
    with sqlite3.connect(tmp_path / "dave" / "store.sqlite") as c:
        c.execute("PRAGMA user_version = 3")
    # locked: a writer holding an exclusive lock (locking_mode EXCLUSIVE: readers too)
    make_store(tmp_path / "erin" / "store.sqlite", user="erin")
    locker = sqlite3.connect(tmp_path / "erin" / "store.sqlite", isolation_level=None)
    locker.execute("PRAGMA locking_mode = EXCLUSIVE")
    locker.execute("BEGIN EXCLUSIVE")
    locker.execute("DELETE FROM events WHERE id < 0")
    # someone else's file in a real account's store folder
    other = next((p for p in pwd.getpwall() if p.pw_uid not in (0, os.geteuid())), None)
    if other is not None:
        make_store(tmp_path / other.pw_name / "store.sqlite", user=other.pw_name)  # owned by us, not them
    caplog.set_level(logging.WARNING, logger="slurm_dlrm.exporter")
    try:
        f = scrape(col)
        f2 = scrape(col)
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    assert value(f, "slurm_dlrm_store_errors_total", reason="corrupt") == 1
    assert value(f, "slurm_dlrm_store_errors_total", reason="schema") == 1
    assert value(f, "slurm_dlrm_store_errors_total", reason="locked") == 1
    if other is not None:
        assert value(f, "slurm_dlrm_store_errors_total", reason="owner") == 1
    assert value(f2, "slurm_dlrm_store_errors_total", reason="corrupt") == 2
    assert value(f, "slurm_dlrm_exporter_stores") == 1  # alice's, read as usual
    assert value(f, "slurm_dlrm_jobs", state="RUNNING", user="alice", partition="dlrm", gpu_model="h100") == 3
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 3 + (other is not None), skipped  # one line per store, not per scrape
    assert any("carol" in m and "corrupt" in m for m in skipped)


def test_dashboard_references_only_served_metrics(alice):
    tmp_path, _, col = alice
    write_status(ServicePaths(tmp_path / "alice"), {"user": "alice", "last_round_t": NOW - 1, "round_seconds": 0.1})
    served: dict[str, set[str]] = {}  # sample name (and family name) -> its label names
    for name, samples in scrape(col).items():
        served.setdefault(name, set())
        for s in samples:
            served.setdefault(s.name, set()).update(s.labels)
            served[name].update(s.labels)
    dashboards = sorted((REPO / "site-config" / "grafana").glob("*.json"))
    assert dashboards
    for path in dashboards:
        dash = json.loads(path.read_text())
        targets = [t for p in dash["panels"] for t in p.get("targets", [])]
        assert targets, path
        # every metric named anywhere in the file (panels, variables), not only in targets
        used = set(re.findall(r"\bslurm_dlrm_[a-z_]+", path.read_text()))
        assert used and used <= set(served), (path.name, sorted(used - set(served)))
        for t in targets:  # a legend names only labels its metrics carry
            metrics = set(re.findall(r"\bslurm_dlrm_[a-z_]+", t["expr"]))
            labels = set().union(*(served[m] for m in metrics)) | {"le"}
            assert set(re.findall(r"{{(\w+)}}", t["legendFormat"])) <= labels, (path.name, t)


def test_cli_once_json_and_port_in_use(tmp_path):
    make_store(tmp_path / "alice" / "store.sqlite")
    site = site_file(tmp_path)
    res = CliRunner().invoke(cli, ["exporter", "--all-users", "--site", str(site), "--once", "--json"])
    assert res.exit_code == 0, res.output
    samples = json.loads(res.stdout)
    assert any(s["name"] == "slurm_dlrm_gpu_members" and s["labels"]["user"] == "alice" for s in samples)
    res = CliRunner().invoke(cli, ["exporter", "--all-users", "--site", str(site), "--once"])
    assert res.exit_code == 0 and "# TYPE slurm_dlrm_jobs gauge" in res.stdout
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        res = CliRunner().invoke(cli, ["exporter", "--site", str(site), "--addr", "127.0.0.1", "--port", str(port)])
    assert res.exit_code == 1
    assert res.stderr.strip() == f"slurm-dlrm: error: exporter: cannot listen on 127.0.0.1:{port}: port in use"
    for args, what in ((["--json"], "--json:"), (["--addr", "no.such.host.invalid"], "--addr:")):
        res = CliRunner().invoke(cli, ["exporter", "--site", str(site), *args])
        assert res.exit_code == 2 and res.stderr.startswith(f"slurm-dlrm: error: {what}"), res.output
        assert len(res.stderr.strip().splitlines()) == 1
    assert E.DEFAULT_PORT == 9867 and "9867" in CliRunner().invoke(cli, ["exporter", "--help"]).output


def test_history_figures_refresh_at_most_every_slow_every_s_active_ones_every_scrape(tmp_path):
    ids = make_store(tmp_path / "alice" / "store.sqlite")
    mono = [1000.0]
    col = E.StoreCollector(site_for(tmp_path), all_users=True, clock=lambda: NOW, slow_every_s=60.0,
                           monotonic=lambda: mono[0])
    u = {"user": "alice", "partition": "dlrm", "gpu_model": "h100"}
    f = scrape(col)
    assert value(f, "slurm_dlrm_jobs", state="COMPLETED", **u) == 1
    with Store(tmp_path / "alice" / "store.sqlite", clock=lambda: NOW) as s:
        s.transition_job(ids["a"], JobState.COMPLETED, "exit 0", exit_code=0, t=NOW + 1)
    stagger = 60.0 * (zlib.crc32(str(tmp_path / "alice" / "store.sqlite").encode()) % 1000) / 1000
    due = 1000.0 + 60.0 - stagger  # the first refresh was moved back by the store's stagger
    mono[0] = due - 1
    f = scrape(col)
    assert value(f, "slurm_dlrm_jobs", state="RUNNING", **u) == 2  # at once
    assert value(f, "slurm_dlrm_jobs", state="COMPLETED", **u) == 1  # not yet
    assert value(f, "slurm_dlrm_queue_wait_seconds_count", **u) == 5
    mono[0] = due + 1e-6  # (1060 - s) - (1000 - s) can round to just under 60 for some paths' s
    f = scrape(col)
    assert value(f, "slurm_dlrm_jobs", state="COMPLETED", **u) == 2


def test_warm_reads_history_before_serving_and_counts_nothing_twice(tmp_path):
    # `slurm-dlrm exporter` warms before it opens its port: the first scrape finds the
    # history figures already summed (they refresh only slow_every_s later) and its
    # counters equal an unwarmed collector's first scrape.
    ids = make_store(tmp_path / "alice" / "store.sqlite")
    mono = [1000.0]
    col = E.StoreCollector(site_for(tmp_path), all_users=True, clock=lambda: NOW, slow_every_s=60.0,
                           monotonic=lambda: mono[0])
    assert col.warm() > 0 and col.last_stores_read == 1
    fresh = scrape(E.StoreCollector(site_for(tmp_path), all_users=True, clock=lambda: NOW, slow_every_s=60.0,
                                    monotonic=lambda: mono[0]))
    with Store(tmp_path / "alice" / "store.sqlite", clock=lambda: NOW) as s:
        s.transition_job(ids["a"], JobState.COMPLETED, "exit 0", exit_code=0, t=NOW + 1)
    f = scrape(col)
    u = {"user": "alice", "partition": "dlrm", "gpu_model": "h100"}
    assert value(f, "slurm_dlrm_jobs", state="COMPLETED", **u) == 1  # the warm-up's history
    assert value(f, "slurm_dlrm_jobs", state="RUNNING", **u) == 2  # active figures: this scrape's
    counters = [(x.name, x.labels, x.value) for samples in fresh.values() for x in samples
                if x.name.endswith("_total") and x.name != "slurm_dlrm_store_errors_total"]
    assert counters and all(value(f, name, **labels) == v for name, labels, v in counters)


def test_scrapes_on_other_threads_reuse_the_open_connections(tmp_path):
    # prometheus_client's server answers each scrape on a new thread; the connections
    # the collector keeps open (warm-up included) must serve them all.
    make_store(tmp_path / "alice" / "store.sqlite")
    col = E.StoreCollector(site_for(tmp_path), all_users=True, clock=lambda: NOW, slow_every_s=0.0)
    col.warm()
    out: list[dict[str, list]] = []
    for _ in range(2):
        t = threading.Thread(target=lambda: out.append(scrape(col)))
        t.start()
        t.join()
    u = {"user": "alice", "partition": "dlrm", "gpu_model": "h100"}
    for f in out:
        assert value(f, "slurm_dlrm_jobs", state="RUNNING", **u) == 3
        assert not any(s.value for s in f.get("slurm_dlrm_store_errors", []))
