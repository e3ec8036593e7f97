"""What one user writes must not break, forge or hang what an admin reads across users
(issue 32 items 3, 4, 5, 9): the exporter, `acct --all-users`, `report --all-users`.

A hanging reader is run in a subprocess with a timeout, so today's code fails the test
instead of hanging it.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import sqlite3
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from slurm_dlrm import exporter as E
from slurm_dlrm.cli import cli
from slurm_dlrm.service.daemon import ServicePaths, write_status
from slurm_dlrm.store import Store
from slurm_dlrm.store import service_status as S
from slurm_dlrm.store.db import ensure_private_dir, ensure_private_file
from slurm_dlrm.store.errors import StoreNotOwned, StoreTimeout, StoreUntrusted
from slurm_dlrm.store.others import open_other_store, store_user
from tests.test_exporter import NOW, make_store, scrape, site_file, site_for, value

REPO = Path(__file__).resolve().parent.parent
HANG_GUARD_S = 60  # today's code is still reading after this: the test fails, it does not hang

# A view that never ends: an unbounded recursive CTE, in place of the `jobs` table.
ENDLESS_VIEW = ("CREATE VIEW jobs AS WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) "
                "SELECT i AS id, 'alice' AS user, 'x' AS name, 'RUNNING' AS state FROM n")


def other_account() -> pwd.struct_passwd | None:
    """A real account other than ours and root's, to own files (needs root to chown)."""
    if os.geteuid() != 0:
        return None
    return next((p for p in pwd.getpwall() if p.pw_uid not in (0, os.geteuid())), None)


def crafted_store(path: Path) -> None:
    """mallory's store: a real one, then `jobs` replaced by the endless view."""
    make_store(path, user="mallory")
    with sqlite3.connect(path) as c:
        c.execute("PRAGMA foreign_keys = OFF")
        c.execute("DROP TABLE jobs")
        c.execute(ENDLESS_VIEW)


def run_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "slurm_dlrm", *args], capture_output=True, text=True,  # noqa: S603 - our module
                          timeout=HANG_GUARD_S, cwd=cwd, env=env, check=False)


# ---------------------------------------------------------------- item 3: status files


def test_a_broken_status_file_is_counted_not_raised_out_of_the_scrape(tmp_path):
    make_store(tmp_path / "alice" / "store.sqlite")
    make_store(tmp_path / "mallory" / "store.sqlite", user="mallory")
    (tmp_path / "mallory" / E.SERVICE_STATUS_FILE).write_text(json.dumps({"last_round_t": "abc"}))
    write_status(ServicePaths(tmp_path / "alice"), {"last_round_t": NOW - 3, "round_seconds": 0.5, "host": "login1"})
    col = E.StoreCollector(site_for(tmp_path), all_users=True, clock=lambda: NOW)
    f = scrape(col)  # today: ValueError out of collect(), every user's metrics lost
    assert value(f, "slurm_dlrm_store_errors_total", reason="status") == 1
    assert value(f, "slurm_dlrm_service_last_round_age_seconds", user="alice", host="login1") == pytest.approx(3)
    assert value(f, "slurm_dlrm_jobs", state="RUNNING", user="mallory", partition="dlrm", gpu_model="h100") == 3
    assert value(f, "slurm_dlrm_exporter_stores") == 2


def test_a_status_file_naming_another_user_labels_nothing_as_that_user(tmp_path):
    """mallory's status says user=alice and her rows say alice: every series is mallory's."""
    make_store(tmp_path / "mallory" / "store.sqlite", user="alice")  # her rows name alice
    write_status(ServicePaths(tmp_path / "mallory"), {"user": "alice", "last_round_t": NOW - 1})
    f = scrape(E.StoreCollector(site_for(tmp_path), all_users=True, clock=lambda: NOW))
    users = {s.labels["user"] for fam in f.values() for s in fam if "user" in s.labels}
    assert users == {"mallory"}
    assert value(f, "slurm_dlrm_service_last_round_age_seconds", user="mallory") == pytest.approx(1)


@pytest.mark.skipif(other_account() is None, reason="needs root and a second account to own a file")
def test_the_label_is_the_store_files_owner_not_the_folder_name(tmp_path):
    acc = other_account()
    assert acc is not None
    path = tmp_path / "not-an-account-x9" / "store.sqlite"
    make_store(path, user="alice")
    for p in (path.parent, *path.parent.iterdir()):
        os.chown(p, acc.pw_uid, acc.pw_gid)
    write_status(ServicePaths(path.parent), {"user": "alice", "last_round_t": NOW - 1})
    f = scrape(E.StoreCollector(site_for(tmp_path), all_users=True, clock=lambda: NOW))
    # the status file is ours (root's), not the store owner's: not that user's status
    assert value(f, "slurm_dlrm_store_errors_total", reason="status") == 1
    users = {s.labels["user"] for fam in f.values() for s in fam if "user" in s.labels}
    assert users == {acc.pw_name}


def test_store_user_takes_the_owner_over_the_folder_name():
    accounts = {"alice": 1001, "mallory": 1002}
    names = {v: k for k, v in accounts.items()}
    kw = {"reader_uid": 0, "uid_of": accounts.get, "name_of": lambda uid: names.get(uid, f"uid:{uid}")}
    assert store_user("alice", 1001, **kw) == "alice"
    with pytest.raises(StoreNotOwned, match="mallory"):  # mallory made /shared/alice first
        store_user("alice", 1002, **kw)
    assert store_user("payroll", 1002, **kw) == "mallory"  # a folder named as no account
    assert store_user("payroll", 4242, **kw) == "uid:4242"
    assert store_user("payroll", 0, **kw) == "payroll"  # the reader's own file: as named
    assert store_user("*", 1002, **kw) == "*"  # one shared store: its rows name their users


status_values = hs.recursive(
    hs.none() | hs.booleans() | hs.integers() | hs.floats(allow_nan=True, allow_infinity=True) | hs.text(max_size=20),
    lambda inner: hs.lists(inner, max_size=3) | hs.dictionaries(hs.text(max_size=8), inner, max_size=3),
    max_leaves=8)
status_docs = hs.one_of(
    status_values,
    hs.fixed_dictionaries({}, optional={
        "last_round_t": status_values, "round_seconds": status_values, "slurm_ok": status_values,
        "host": status_values, "user": status_values}))


@settings(max_examples=300, deadline=None)
@given(status_docs)
def test_any_status_json_is_parsed_or_refused_in_one_line(doc):
    try:
        st = S.parse_service_status(doc)
    except S.BadStatus as exc:
        assert "\n" not in str(exc) and len(str(exc)) < 200
        return
    if st is None:
        return
    for v in (st.last_round_t, *(() if st.round_s is None else (st.round_s,))):
        assert isinstance(v, float) and v >= 0 and v == v and v != float("inf")
    assert isinstance(st.slurm_ok, bool)
    assert st.host == "" or S._HOST.fullmatch(st.host)
    assert st.user is None or S._USER.fullmatch(st.user)


def test_a_label_field_that_is_no_name_is_dropped_not_the_figures():
    st = S.parse_service_status({"last_round_t": 5, "host": "login1\nfake 1", "user": 'a"b'})
    assert st is not None and st.last_round_t == 5.0 and st.host == "" and st.user is None
    with pytest.raises(S.BadStatus, match="round_seconds"):
        S.parse_service_status({"last_round_t": 5, "round_seconds": float("nan")})
    with pytest.raises(S.BadStatus, match="slurm_ok"):
        S.parse_service_status({"last_round_t": 5, "slurm_ok": "yes"})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(hs.binary(max_size=300) | status_docs.map(lambda d: json.dumps(d, allow_nan=True).encode()))
def test_any_status_file_never_fails_a_scrape(tmp_path, raw):
    (tmp_path / "alice").mkdir(exist_ok=True)
    if not (tmp_path / "alice" / "store.sqlite").exists():
        make_store(tmp_path / "alice" / "store.sqlite")
    (tmp_path / "alice" / E.SERVICE_STATUS_FILE).write_bytes(raw)
    f = scrape(E.StoreCollector(site_for(tmp_path), all_users=True, clock=lambda: NOW))
    assert value(f, "slurm_dlrm_exporter_stores") == 1
    for s in f["slurm_dlrm_service_last_round_age_seconds"]:
        assert s.labels["user"] == "alice" and s.value >= 0


def test_a_fifo_or_huge_status_file_does_not_block_or_load(tmp_path):
    make_store(tmp_path / "alice" / "store.sqlite")
    os.mkfifo(tmp_path / "alice" / E.SERVICE_STATUS_FILE)  # today: open() blocks for ever
    res = run_cli(["exporter", "--all-users", "--once", "--site", str(site_file(tmp_path))], tmp_path)
    assert res.returncode == 0, res.stderr
    assert 'slurm_dlrm_store_errors_total{host="' in res.stdout
    assert any(line.startswith('slurm_dlrm_store_errors_total{') and 'reason="status"' in line
               and line.endswith(" 1.0") for line in res.stdout.splitlines())
    os.unlink(tmp_path / "alice" / E.SERVICE_STATUS_FILE)
    (tmp_path / "alice" / E.SERVICE_STATUS_FILE).write_text(json.dumps({"last_round_t": 1.0, "pad": "x" * 70000}))
    with pytest.raises(S.BadStatus, match="larger than"):
        S.read_service_status(tmp_path / "alice")


# ---------------------------------------------------------------- item 4: crafted stores


def test_exporter_all_users_does_not_hang_on_a_view_over_an_endless_cte(tmp_path):
    make_store(tmp_path / "alice" / "store.sqlite")
    crafted_store(tmp_path / "mallory" / "store.sqlite")
    res = run_cli(["exporter", "--all-users", "--once", "--json", "--site", str(site_file(tmp_path))], tmp_path)
    assert res.returncode == 0, res.stderr
    samples = json.loads(res.stdout)
    err = {s["labels"]["reason"]: s["value"] for s in samples if s["name"] == "slurm_dlrm_store_errors_total"}
    assert err["untrusted"] == 1
    assert {s["labels"]["user"] for s in samples if s["name"] == "slurm_dlrm_jobs"} == {"alice"}
    assert "mallory" in res.stderr and "'jobs' is a view" in res.stderr


@pytest.mark.parametrize("command", [["acct", "--all-users", "--json"], ["acct", "--all-users"],
                                     ["report", "--all-users", "-S", "30000d", "-o", "r.html"]])
def test_acct_and_report_all_users_skip_a_crafted_store(tmp_path, command):
    make_store(tmp_path / "alice" / "store.sqlite")
    crafted_store(tmp_path / "mallory" / "store.sqlite")
    res = run_cli([*command, "--site", str(site_file(tmp_path))], tmp_path)
    assert res.returncode == 0, res.stderr
    warned = [line for line in res.stderr.splitlines() if "mallory" in line]
    assert len(warned) == 1 and "not read" in warned[0] and "skipped" in warned[0], res.stderr
    if "--json" in command:
        assert {r["User"] for r in json.loads(res.stdout)} == {"alice"}


def test_a_schema_swapped_after_the_first_scrape_is_caught(tmp_path):
    """The exporter keeps connections open: a table replaced in place (same file) after
    the first scrape must be seen at the next one, not read through."""
    make_store(tmp_path / "mallory" / "store.sqlite", user="mallory")
    col = E.StoreCollector(site_for(tmp_path), all_users=True, clock=lambda: NOW)
    assert value(scrape(col), "slurm_dlrm_exporter_stores") == 1
    ino = os.stat(tmp_path / "mallory" / "store.sqlite").st_ino
    with sqlite3.connect(tmp_path / "mallory" / "store.sqlite") as c:
        c.execute("PRAGMA foreign_keys = OFF")
        c.execute("DROP TABLE jobs")
        c.execute(ENDLESS_VIEW)
    assert os.stat(tmp_path / "mallory" / "store.sqlite").st_ino == ino
    f = scrape(col)
    assert value(f, "slurm_dlrm_exporter_stores") == 0
    assert value(f, "slurm_dlrm_store_errors_total", reason="untrusted") == 1


@pytest.mark.parametrize("change, why", [
    ("ALTER TABLE jobs ADD COLUMN extra TEXT", r"column\(s\) extra"),
    ("ALTER TABLE packs ADD COLUMN g INTEGER GENERATED ALWAYS AS (id * 2) VIRTUAL", r"column\(s\) g"),
    ("CREATE TRIGGER t AFTER INSERT ON jobs BEGIN SELECT 1; END", "trigger 't'"),
    ("CREATE VIEW v AS SELECT 1", "view 'v'"),
])
def test_other_schema_changes_are_refused(tmp_path, change, why):
    path = tmp_path / "mallory" / "store.sqlite"
    make_store(path, user="mallory")
    with sqlite3.connect(path) as c:
        c.execute(change)
    with pytest.raises(StoreUntrusted, match=why):
        open_other_store(path, "mallory")
    Store(path, readonly=True).close()  # the owner's own reads do not check (their file)


def test_every_read_of_another_users_store_is_bounded(tmp_path):
    path = tmp_path / "alice" / "store.sqlite"
    make_store(path)
    with open_other_store(path, "alice", read_budget_s=0.2) as st:
        with pytest.raises(StoreTimeout, match="0.2 s"), st.read():
            st.conn.execute("WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) "
                            "SELECT count(*) FROM n").fetchone()
        assert not st.conn.in_transaction  # the snapshot ended: the next read sees new data
        assert len(st.query("jobs_by_state", {"states": '["PENDING"]', "user": None})) == 2
    with open_other_store(path, "alice", read_budget_s=5) as st:
        assert len(st.query("jobs_by_state", {"states": '["RUNNING"]', "user": None})) == 3  # a normal read passes
        assert st.conn.execute("PRAGMA trusted_schema").fetchone()[0] == 0


# ---------------------------------------------------------------- item 9: foreign folders


@pytest.mark.skipif(other_account() is None, reason="needs root and a second account to own a folder")
def test_a_store_folder_or_file_made_first_by_another_user_is_refused(tmp_path):
    acc = other_account()
    assert acc is not None
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    folder = shared / "me"
    folder.mkdir(mode=0o755)
    os.chown(folder, acc.pw_uid, acc.pw_gid)  # mallory made /shared/me before me
    with pytest.raises(StoreNotOwned, match=f"belongs to {acc.pw_name}"):
        ensure_private_dir(folder)
    with pytest.raises(StoreNotOwned):
        Store(folder / "store.sqlite")
    assert not (folder / "store.sqlite").exists()  # nothing half-done
    # a file planted in a folder of ours (0666, theirs)
    mine = shared / "mine"
    ensure_private_dir(mine)
    planted = mine / "store.sqlite"
    planted.touch(mode=0o666)
    os.chown(planted, acc.pw_uid, acc.pw_gid)
    with pytest.raises(StoreNotOwned, match="store file"):
        ensure_private_file(planted)
    planted.unlink()
    (mine / "store.sqlite-wal").touch()
    os.chown(mine / "store.sqlite-wal", acc.pw_uid, acc.pw_gid)
    with pytest.raises(StoreNotOwned, match="-wal"):
        Store(planted)
    # the CLI: one line, exit 2 (bad input: the site's store_dir)
    site = site_file(tmp_path)
    site.write_text(site.read_text().replace(f"{tmp_path}/{{user}}", str(folder)))
    res = CliRunner().invoke(cli, ["acct", "--site", str(site)])
    assert res.exit_code == 2, res.output
    assert len(res.stderr.strip().splitlines()) == 1 and "belongs to" in res.stderr


def test_an_own_store_folder_is_made_private(tmp_path):
    folder = tmp_path / "me"
    folder.mkdir(mode=0o755)
    (folder / "store.sqlite").touch(mode=0o644)
    os.chmod(folder / "store.sqlite", 0o666)
    Store(folder / "store.sqlite").close()
    assert folder.stat().st_mode & 0o777 == 0o700
    assert (folder / "store.sqlite").stat().st_mode & 0o777 == 0o600


# ---------------------------------------------------------------- item 5: where it listens


def test_exporter_listens_on_loopback_unless_told(tmp_path, monkeypatch):
    import inspect

    assert inspect.signature(E.serve).parameters["addr"].default == "127.0.0.1" == E.DEFAULT_ADDRESS
    make_store(tmp_path / "alice" / "store.sqlite")
    site = site_file(tmp_path)
    bound: list[str] = []

    def fake_serve(registry, port, addr="?", tls=None):
        bound.append(addr)
        raise OSError(98, "Address already in use")  # stop before serving for ever

    monkeypatch.setattr(E, "serve", fake_serve)
    for extra, want in (([], "127.0.0.1"), (["--address", "0.0.0.0"], "0.0.0.0"), (["--addr", "::1"], "::1")):
        res = CliRunner().invoke(cli, ["exporter", "--site", str(site), "--port", "1", *extra])
        assert res.exit_code == 1 and bound[-1] == want, res.output
    site.write_text(site.read_text().replace("sample_retention_days = 30",
                                             'sample_retention_days = 30\nexporter_address = "10.1.2.3"'))
    CliRunner().invoke(cli, ["exporter", "--site", str(site), "--port", "1"])
    assert bound[-1] == "10.1.2.3"


def test_the_exporter_names_its_host(tmp_path):
    make_store(tmp_path / "alice" / "store.sqlite")
    write_status(ServicePaths(tmp_path / "alice"), {"last_round_t": NOW - 2, "host": "login2"})
    f = scrape(E.StoreCollector(site_for(tmp_path), all_users=True, clock=lambda: NOW, host="login9"))
    assert value(f, "slurm_dlrm_exporter_info", host="login9") == 1
    assert value(f, "slurm_dlrm_exporter_stores", host="login9") == 1
    assert value(f, "slurm_dlrm_service_last_round_age_seconds", user="alice", host="login2") == pytest.approx(2)
    assert E.StoreCollector(site_for(tmp_path)).host == socket.gethostname()


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)  # noqa: S603,S607 - fixed argv


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make certificates")
def test_tls_and_client_certificates_through_prometheus_clients_server(tmp_path):
    """--tls-cert/--tls-key/--tls-client-ca reach start_http_server: plain HTTP and a
    client without a certificate are refused, a client with one is served."""
    make_store(tmp_path / "alice" / "store.sqlite")
    d = tmp_path / "pki"
    d.mkdir()
    # The extensions a real CA sets: Python 3.13+ verifies with VERIFY_X509_STRICT, which
    # refuses a CA without keyUsage and a leaf without authorityKeyIdentifier.
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             "-addext", "subjectKeyIdentifier=hash", "-keyout", "ca.key", "-out", "ca.pem", cwd=d)
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
                 "-out", f"{name}.csr", cwd=d)
        (d / f"{name}.ext").write_text(
            "subjectAltName=IP:127.0.0.1\nbasicConstraints=critical,CA:FALSE\n"
            "keyUsage=critical,digitalSignature,keyEncipherment\n"
            f"extendedKeyUsage={name}Auth\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-days", "1", "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=d)
    col = E.StoreCollector(site_for(tmp_path), all_users=True, clock=lambda: NOW)
    server, thread = E.serve(E.make_registry(col), 0, "127.0.0.1",
                             E.Tls(str(d / "server.pem"), str(d / "server.key"), str(d / "ca.pem")))
    try:
        url = f"https://127.0.0.1:{server.server_port}/metrics"
        with pytest.raises(OSError):  # plain HTTP to a TLS port
            urllib.request.urlopen(url.replace("https", "http"), timeout=10)
        anonymous = ssl.create_default_context(cafile=str(d / "ca.pem"))
        with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(url, timeout=10, context=anonymous).read()
        known = ssl.create_default_context(cafile=str(d / "ca.pem"))
        known.load_cert_chain(str(d / "client.pem"), str(d / "client.key"))
        body = urllib.request.urlopen(url, timeout=10, context=known).read().decode()
        assert 'slurm_dlrm_jobs{' in body and 'user="alice"' in body
    finally:
        server.shutdown()
        server.server_close()
    site = site_file(tmp_path)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = str(probe.getsockname()[1])
    for args, what in ((["--tls-cert", str(d / "server.pem")], "--tls-cert and --tls-key"),
                       (["--tls-client-ca", str(d / "ca.pem")], "--tls-client-ca"),
                       (["--tls-cert", str(d / "ca.key"), "--tls-key", str(d / "server.key")], "--tls-cert/--tls-key")):
        res = CliRunner().invoke(cli, ["exporter", "--site", str(site), "--port", free, *args])
        assert res.exit_code == 2 and res.stderr.startswith(f"slurm-dlrm: error: {what}"), res.output
        assert len(res.stderr.strip().splitlines()) == 1

