"""The store folder's filesystem decides the journal (issue 30): never WAL on a network one.

No network mount here: statfs's answer is replaced by NFS's magic number where a test
needs a network filesystem, or the site declares it, as a site may.
"""

from __future__ import annotations

import shutil
import sqlite3
import subprocess

import pytest
from click.testing import CliRunner

from slurm_dlrm.cli import cli
from slurm_dlrm.site import ConfigError
from slurm_dlrm.store import fstype
from slurm_dlrm.store.errors import StoreWalOnNetwork
from slurm_dlrm.store.store import Store
from tests.service_harness import add_job, make_site


def journal(path) -> str:
    conn = sqlite3.connect(path)
    try:
        return str(conn.execute("PRAGMA journal_mode").fetchone()[0])
    finally:
        conn.close()


def test_statfs_magic_matches_stat_f(tmp_path):
    stat = shutil.which("stat")
    if stat is None:
        pytest.skip("no stat(1)")
    out = subprocess.run(  # noqa: S603 - coreutils stat(1), our own arguments
        [stat, "-f", "-c", "%t", str(tmp_path)], capture_output=True, text=True, check=True)
    assert fstype.statfs_magic(tmp_path) == int(out.stdout.strip(), 16)
    assert fstype.statfs_magic("/proc") == 0x9FA0  # PROC_SUPER_MAGIC, as a second known value


def test_statfs_error_names_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing"):
        fstype.statfs_magic(tmp_path / "missing")


@pytest.mark.parametrize(("magic", "name"), [(0x6969, "nfs"), (0x0BD00BD0, "lustre"), (0x47504653, "gpfs"),
                                             (0x19830326, "beegfs"), (0x00C36400, "cephfs"),
                                             (0xFF534D42, "cifs"), (0xFE534D42, "smb2"), (0x01021997, "9p"),
                                             (0x65735546, "fuse"), (0xEF53, None), (0x01021994, None)])
def test_network_magics(monkeypatch, tmp_path, magic, name):
    monkeypatch.setattr(fstype, "statfs_magic", lambda p: magic)
    info = fstype.filesystem_of(tmp_path)
    assert info.network is (name is not None)
    assert info.name == (name or "local")


def test_declared_wins(monkeypatch, tmp_path):
    monkeypatch.setattr(fstype, "statfs_magic", lambda p: 0x6969)
    assert not fstype.filesystem_of(tmp_path, "local").network
    monkeypatch.setattr(fstype, "statfs_magic", lambda p: 0xEF53)
    assert fstype.filesystem_of(tmp_path, "network").network


def test_local_store_is_wal(tmp_path):
    with Store(tmp_path / "s" / "store.sqlite"):
        pass
    assert journal(tmp_path / "s" / "store.sqlite") == "wal"


def test_network_store_never_wal(monkeypatch, tmp_path):
    monkeypatch.setattr(fstype, "statfs_magic", lambda p: 0x6969)
    path = tmp_path / "s" / "store.sqlite"
    with Store(path) as st:
        add_job(st, "a")
        assert st.conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    assert journal(path) == "delete"
    assert not (tmp_path / "s" / "store.sqlite-wal").exists()


def test_site_key_declares_network(tmp_path):
    site = make_site(tmp_path)
    site = site.__class__(**{**site.__dict__, "store_filesystem": "network"})
    with Store.for_user(site, "alice") as st:
        add_job(st, "a", user="alice")
    assert journal(site.store_dir_for("alice") / "store.sqlite") == "delete"


def test_site_key_checked(tmp_path):
    import tomllib

    from slurm_dlrm.site import REPO_SITE_FILE, parse_site

    data = tomllib.loads(REPO_SITE_FILE.read_text())
    data["store"] = {"filesystem": "nfs"}
    with pytest.raises(ConfigError, match="store.filesystem"):
        parse_site(data, "x")


def _wal_store_with_uncheckpointed_jobs(path, n: int) -> None:
    with Store(path) as st:
        st.conn.execute("PRAGMA wal_autocheckpoint = 0")  # the jobs stay in the -wal file
        for i in range(n):
            add_job(st, f"j{i}")
        # Closing the last connection would checkpoint: copy the files as a crash leaves them.
        shutil.copy(path, path.with_name("crashed.sqlite"))
        shutil.copy(path.with_name("store.sqlite-wal"), path.with_name("crashed.sqlite-wal"))
    path.unlink()
    path.with_name("crashed.sqlite").rename(path)
    path.with_name("crashed.sqlite-wal").rename(path.with_name("store.sqlite-wal"))


def test_existing_wal_store_on_network_is_migrated(monkeypatch, tmp_path):
    path = tmp_path / "s" / "store.sqlite"
    _wal_store_with_uncheckpointed_jobs(path, 5)
    assert path.with_name("store.sqlite-wal").stat().st_size > 0
    monkeypatch.setattr(fstype, "statfs_magic", lambda p: 0x6969)
    with Store(path) as st:
        assert len(st.jobs()) == 5  # what was only in the log is in the database now
    assert journal(path) == "delete"
    assert not path.with_name("store.sqlite-wal").exists()


def test_wal_store_in_use_is_left_alone_with_what_to_do(monkeypatch, tmp_path):
    path = tmp_path / "s" / "store.sqlite"
    with Store(path) as st:
        add_job(st, "a")
    other = sqlite3.connect(path)
    other.execute("BEGIN")
    other.execute("SELECT count(*) FROM jobs").fetchone()  # a reader holds a snapshot
    try:
        monkeypatch.setattr(fstype, "statfs_magic", lambda p: 0x6969)
        with pytest.raises(StoreWalOnNetwork, match=r"WAL mode on a network filesystem \(nfs\).*serve stop"):
            Store(path, busy_timeout_s=0.2)
    finally:
        other.rollback()
        other.close()
    assert journal(path) == "wal"  # untouched
    with Store(path) as st:  # and once alone, it switches
        assert [j.name for j in st.jobs()] == ["a"]
    assert journal(path) == "delete"


def test_cli_says_it_in_one_line_exit_1(monkeypatch, tmp_path):
    from slurm_dlrm.site import REPO_SITE_FILE, load_site
    from slurm_dlrm.store.store import current_user, store_path_for

    text = REPO_SITE_FILE.read_text().replace('store_dir = "~/.local/share/slurm-dlrm"',
                                              f'store_dir = "{tmp_path}/store-{{user}}"')
    (tmp_path / "site.toml").write_text(text)
    monkeypatch.setenv("SLURM_DLRM_SITE", str(tmp_path / "site.toml"))
    path = store_path_for(load_site(str(tmp_path / "site.toml")), current_user())
    with Store(path) as st:
        add_job(st, "a")
    other = sqlite3.connect(path)
    other.execute("BEGIN")
    other.execute("SELECT count(*) FROM jobs").fetchone()
    try:
        monkeypatch.setattr(fstype, "statfs_magic", lambda p: 0x6969)
        res = CliRunner().invoke(cli, ["acct"])
    finally:
        other.rollback()
        other.close()
    assert res.exit_code == 1, res.output
    assert "WAL mode on a network filesystem" in res.output
