"""The accounting side of a local cluster (`up --accounting`): a private MariaDB
(its own datadir, port and socket on 127.0.0.1) with the database and user for Slurm,
then slurmdbd, and the cluster, account and user registered with `sacctmgr`, so that
`sacct` works.

Apart because it is the one optional part of `up`, with its own programs (mariadb,
sacctmgr) and their quirks across releases (`sacctmgr_already_there`).
"""

from __future__ import annotations

import secrets
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from slurm_dlrm.localcluster.config import (
    ACCOUNT,
    MYSQL_DB,
    MYSQL_USER,
    PORT_MYSQL,
    PORT_SLURMDBD,
    ClusterConfig,
    ClusterError,
)
from slurm_dlrm.localcluster.daemons import log_tail, spawn
from slurm_dlrm.slurm.client import SlurmClient


def start_mariadb(c: ClusterConfig) -> None:
    datadir = c.state_dir / "mysql"
    if not (datadir / "mysql").is_dir():
        datadir.mkdir(parents=True, exist_ok=True)
        _run(["mariadb-install-db", "--no-defaults", f"--datadir={datadir}", "--user=root",
              "--auth-root-authentication-method=socket", "--skip-test-db"], timeout_s=120,
             what="mariadb-install-db")
    spawn(c, "mariadbd", [
        "mariadbd", "--no-defaults", f"--datadir={datadir}", f"--port={c.port(PORT_MYSQL)}",
        "--bind-address=127.0.0.1", f"--socket={c.mysql_socket}", "--user=root",
        f"--pid-file={c.run_dir / 'mariadbd.pid.own'}", f"--log-error={c.log_dir / 'mariadb.log'}",
        "--skip-name-resolve", "--innodb-buffer-pool-size=32M", "--innodb-log-file-size=16M",
        "--performance-schema=OFF", "--skip-log-bin",
        # Slurm's advice: slurmdbd 26.05 warns that MariaDB 11.8's (trixie, sid) default
        # snapshot isolation makes it die on a write conflict. `loose-`: MariaDB 10.11
        # (bookworm) has no such option and would otherwise refuse to start.
        "--loose-innodb-snapshot-isolation=OFF", "--innodb-lock-wait-timeout=900"],
        daemonizes=False, wait_s=5)
    _wait_for(lambda: c.mysql_socket.exists() and _can_connect(c.port(PORT_MYSQL)), 60,
              "mariadbd to accept connections", c.log_dir / "mariadb.log")
    pw_file = c.etc_dir / "mysql.password"
    if not pw_file.exists():
        pw_file.write_text(secrets.token_hex(16))
        pw_file.chmod(0o600)
    pw = pw_file.read_text().strip()
    sql = (f"CREATE DATABASE IF NOT EXISTS {MYSQL_DB}; "
           f"CREATE USER IF NOT EXISTS '{MYSQL_USER}'@'127.0.0.1' IDENTIFIED BY '{pw}'; "
           f"GRANT ALL ON {MYSQL_DB}.* TO '{MYSQL_USER}'@'127.0.0.1'; FLUSH PRIVILEGES;")
    _run(["mariadb", "--no-defaults", f"--socket={c.mysql_socket}", "-u", "root", "-e", sql],
         timeout_s=30, what="mariadb (create database)")


def start_slurmdbd(c: ClusterConfig) -> None:
    spawn(c, "slurmdbd", ["slurmdbd"], daemonizes=True, wait_s=60)
    _wait_for(lambda: _can_connect(c.port(PORT_SLURMDBD)), 60, "slurmdbd to listen",
              c.log_dir / "slurmdbd.log")
    cl = SlurmClient(c.slurm_conf, timeout_s=30)
    for argv in (["sacctmgr", "-i", "add", "cluster", c.cluster_name],
                 ["sacctmgr", "-i", "add", "account", ACCOUNT, f"Cluster={c.cluster_name}",
                  "Description=slurm-dlrm", "Organization=local"],
                 ["sacctmgr", "-i", "add", "user", "root", f"Account={ACCOUNT}",
                  f"Cluster={c.cluster_name}"]):
        proc = cl.run(argv, check=False)
        if proc.returncode != 0 and not sacctmgr_already_there(proc.stdout + proc.stderr):
            raise ClusterError(f"{' '.join(argv)} failed: {(proc.stderr or proc.stdout).strip()}")


# What `sacctmgr -i add` prints (exit 1) when the cluster/account/user is there already,
# e.g. on a second `up` with the same database (tests/data/slurm/*/sacctmgr_add_*_again.txt):
# 22.05 "This cluster X already exists.  Not adding." / " Nothing new added.";
# 24.11 and 26.05 "Already existing account ..." / "Nothing added.".
_SACCTMGR_ALREADY = ("already exists", "already existing", "nothing new added", "nothing added")


def sacctmgr_already_there(output: str) -> bool:
    text = output.lower()
    return any(s in text for s in _SACCTMGR_ALREADY)


def _can_connect(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _wait_for(cond: Any, timeout_s: float, what: str, log_file: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.2)
    raise ClusterError(f"timed out after {timeout_s:g} s waiting for {what}: {log_tail(log_file)}")


def _run(argv: list[str], *, timeout_s: float, what: str) -> None:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)  # noqa: S603
    except FileNotFoundError:
        raise ClusterError(f"{argv[0]} not found: run scripts/setup.sh") from None
    except subprocess.TimeoutExpired:
        raise ClusterError(f"{what} timed out after {timeout_s:g} s") from None
    if proc.returncode != 0:
        raise ClusterError(f"{what} failed (exit {proc.returncode}): {_tail_text(proc.stderr or proc.stdout)}")


def _tail_text(text: str) -> str:
    return " | ".join(text.strip().splitlines()[-3:])

