"""A real Slurm cluster on localhost with fake GPUs, for development, tests and the demo.

`up()` writes slurm.conf and gres.conf into a state folder, creates fake GPU device
files (character devices c 1 3), starts its own munged, slurmctld and one slurmd per
node (each on its own port on 127.0.0.1), and with accounting also MariaDB and
slurmdbd. Everything is private to the state folder and the base port, so several
instances run side by side (one per git worktree). `down()` stops only processes this
instance started: it finds them through pid files and checks that each carries the
instance's marker in its environment (a slurmstepd, which from Slurm 23.x no longer
inherits it: its working folder or open log file in the state folder) and runs in the
same root before signalling it; nothing is killed by name.

Over 600 lines: one class, `LocalCluster`, owns one instance's whole lifecycle (config,
daemons, pid files, the marker check); the helpers beside it serve only it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import jinja2

from slurm_dlrm import localcgroup
from slurm_dlrm.errors import BadInput, DlrmError
from slurm_dlrm.package_data import data_dir
from slurm_dlrm.site import SiteConfig, load_site
from slurm_dlrm.slurm.base import SlurmError
from slurm_dlrm.slurm.client import SlurmClient

log = logging.getLogger(__name__)

TEMPLATE_DIR = data_dir("templates") / "localcluster"
REPO_DIR = Path(__file__).resolve().parent.parent

ENV_DIR = "SLURM_DLRM_CLUSTER_DIR"
ENV_PORT = "SLURM_DLRM_CLUSTER_PORT"
# Set in the environment of every daemon we start: `down` signals a pid only if its
# /proc/PID/environ carries this marker with our state folder (pid files can be stale
# and pids are reused).
MARKER = "SLURM_DLRM_CLUSTER_INSTANCE"

# Port layout relative to the base port. Nodes take base+10 .. base+10+N-1.
PORT_SLURMCTLD = 0
PORT_SLURMDBD = 1
PORT_MYSQL = 2
PORT_FIRST_SLURMD = 10
PORTS_PER_INSTANCE = 100
MAX_NODES = PORTS_PER_INSTANCE - PORT_FIRST_SLURMD
# Derived base ports stay below Linux's ephemeral range (32768+), so an outgoing
# connection never holds one of our listening ports.
DERIVED_PORT_LOW = 10000
DERIVED_PORT_SLOTS = 220

MYSQL_DB = "slurm_acct_db"
MYSQL_USER = "slurm"
ACCOUNT = "dlrm"


class ClusterError(DlrmError):
    """The local cluster could not be brought up or down."""


@dataclass(frozen=True)
class ClusterConfig:
    state_dir: Path
    base_port: int
    nodes: int = 2
    gpus_per_node: int = 4
    gpu_type: str = "h100"
    cpus_per_node: int = 32
    memory_mib: int = 256000
    mps_per_gpu: int = 100
    shards_per_gpu: int = 8
    partition: str = "dlrm"
    max_time_minutes: int = 1440
    accounting: bool = False
    cluster_name: str = "local"
    slurm_conf_extra: Path | None = None
    gres_conf: Path | None = None
    job_submit_lua: Path | None = None
    # The site file the cluster was made from, and whether `up` renders and installs the
    # admin files for it (slurm-dlrm.conf, gres.conf, job_submit.lua, the MPS scripts): on
    # unless `--no-admin`, or the three files above are given by hand.
    site_path: Path | None = None
    admin: bool = True
    min_job_age_s: int = 300
    def_mem_per_cpu_mib: int = 2000

    # ---------------------------------------------------------- derived paths

    @property
    def admin_files(self) -> bool:
        return self.admin and not (self.slurm_conf_extra or self.gres_conf or self.job_submit_lua)

    @property
    def site_file(self) -> Path:
        """The local cluster's own site file (`admin check --site`), written by `up`."""
        return self.state_dir / "site.toml"

    @property
    def slurm_conf(self) -> Path:
        return self.state_dir / "etc" / "slurm.conf"

    @property
    def etc_dir(self) -> Path:
        return self.state_dir / "etc"

    @property
    def run_dir(self) -> Path:
        return self.state_dir / "run"

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "log"

    @property
    def munge_socket(self) -> Path:
        return self.run_dir / "munge.sock"

    @property
    def mysql_socket(self) -> Path:
        return self.run_dir / "mysql.sock"

    @property
    def node_names(self) -> list[str]:
        return [f"node{i}" for i in range(1, self.nodes + 1)]

    @property
    def node_hostlist(self) -> str:
        return f"node[1-{self.nodes}]" if self.nodes > 1 else "node1"

    def port(self, offset: int) -> int:
        return self.base_port + offset

    def slurmd_port(self, index: int) -> int:
        return self.base_port + PORT_FIRST_SLURMD + index

    def validate(self) -> None:
        if not 1 <= self.nodes <= MAX_NODES:
            raise BadInput(f"--nodes: must be 1..{MAX_NODES}, got {self.nodes}")
        if not 0 <= self.gpus_per_node <= 64:
            raise BadInput(f"--gpus-per-node: must be 0..64, got {self.gpus_per_node}")
        if not 1024 <= self.base_port <= 65535 - PORTS_PER_INSTANCE:
            raise BadInput(f"--base-port: must be 1024..{65535 - PORTS_PER_INSTANCE}, got {self.base_port}")
        for flag, path in (("--slurm-conf-extra", self.slurm_conf_extra), ("--gres-conf", self.gres_conf),
                           ("--job-submit-lua", self.job_submit_lua)):
            if path is not None and not Path(path).is_file():
                raise BadInput(f"{flag}: no such file: {path}")
        # munged and mariadbd listen on unix sockets in the state folder (108 bytes max).
        if len(str(self.mysql_socket)) > 100:
            raise BadInput(f"--state-dir: path too long for a unix socket ({self.state_dir})")

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in d.items()}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ClusterConfig:
        paths = {"state_dir", "slurm_conf_extra", "gres_conf", "job_submit_lua", "site_path"}
        known = {f for f in cls.__dataclass_fields__}
        kw: dict[str, Any] = {k: (Path(v) if k in paths and v is not None else v)
                              for k, v in d.items() if k in known}
        # A cluster.json from before `up` installed the admin files: that cluster has none.
        kw.setdefault("admin", False)
        return cls(**kw)


# ---------------------------------------------------------------- defaults

def checkout_hash(path: Path = REPO_DIR) -> str:
    return hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:8]


def default_state_dir() -> Path:
    """$SLURM_DLRM_CLUSTER_DIR, else /tmp/slurm-dlrm-<hash of this checkout> (of the
    site-packages folder, for a wheel install)."""
    env = os.environ.get(ENV_DIR)
    if env:
        return Path(env).resolve()
    return Path("/tmp") / f"slurm-dlrm-{checkout_hash()}"


def derived_base_port(state_dir: Path) -> int:
    h = int(hashlib.sha256(str(state_dir).encode()).hexdigest(), 16)
    return DERIVED_PORT_LOW + (h % DERIVED_PORT_SLOTS) * PORTS_PER_INSTANCE


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def pick_base_port(state_dir: Path, nodes: int) -> int:
    """$SLURM_DLRM_CLUSTER_PORT, else the port this state folder used last time, else
    one derived from its path, moved on by whole slots while any port of it is busy."""
    env = os.environ.get(ENV_PORT)
    if env:
        try:
            return int(env)
        except ValueError:
            raise BadInput(f"${ENV_PORT}: not a port number: {env!r}") from None
    offsets = [PORT_SLURMCTLD, PORT_SLURMDBD, PORT_MYSQL, *range(PORT_FIRST_SLURMD, PORT_FIRST_SLURMD + nodes)]
    saved = load_saved_config(state_dir)
    if saved is not None:
        # Keep the ports of the last run (a running cluster holds them itself).
        if any(d.running for d in LocalCluster(saved).daemons()) or \
                all(_port_free(saved.base_port + o) for o in offsets):
            return saved.base_port
    start = derived_base_port(state_dir)
    for slot in range(DERIVED_PORT_SLOTS):
        base = DERIVED_PORT_LOW + ((start - DERIVED_PORT_LOW) // PORTS_PER_INSTANCE + slot) \
            % DERIVED_PORT_SLOTS * PORTS_PER_INSTANCE
        if all(_port_free(base + o) for o in offsets):
            return base
    raise ClusterError("no free port range for the local cluster; pass --base-port")


def config_from_site(site: SiteConfig | None = None, **overrides: Any) -> ClusterConfig:
    """Cluster shape from the site config's first node group; overrides win (None = unset)."""
    site = site or load_site()
    group = site.nodes[0]
    part = site.default_partition
    base: dict[str, Any] = dict(
        nodes=len(group.hostnames), gpus_per_node=group.gpus, gpu_type=group.gpu_model,
        cpus_per_node=group.cpus, memory_mib=group.memory_mib,
        mps_per_gpu=site.mps.mps_per_gpu if site.mps.enabled else 0,
        shards_per_gpu=site.mps.shards_per_gpu, partition=part.name,
        max_time_minutes=part.max_time_minutes, site_path=Path(site.path) if site.path else None)
    base.update({k: v for k, v in overrides.items() if v is not None})
    state_dir = Path(base.pop("state_dir", None) or default_state_dir()).resolve()
    base_port = base.pop("base_port", None) or pick_base_port(state_dir, int(base["nodes"]))
    name = base.pop("cluster_name", None) or f"{site.name}{base_port}"
    cfg = ClusterConfig(state_dir=state_dir, base_port=int(base_port), cluster_name=name.lower(), **base)
    cfg.validate()
    return cfg


# ---------------------------------------------------------------- state on disk

def saved_config_path(state_dir: Path) -> Path:
    return state_dir / "cluster.json"


def load_saved_config(state_dir: Path) -> ClusterConfig | None:
    p = saved_config_path(state_dir)
    try:
        return ClusterConfig.from_json(json.loads(p.read_text()))
    except (OSError, ValueError, TypeError):
        return None


@dataclass
class Daemon:
    """One process of the cluster: its name, pid file and whether it runs."""

    name: str
    pid_file: Path
    pid: int | None = None
    running: bool = False


@dataclass
class ClusterStatus:
    config: ClusterConfig
    daemons: list[Daemon] = field(default_factory=list)
    nodes: list[dict[str, Any]] = field(default_factory=list)

    @property
    def up(self) -> bool:
        return bool(self.daemons) and all(d.running for d in self.daemons)

    def to_json(self) -> dict[str, Any]:
        c = self.config
        return {
            "up": self.up,
            "state_dir": str(c.state_dir),
            "slurm_conf": str(c.slurm_conf),
            "cluster_name": c.cluster_name,
            "accounting": c.accounting,
            "site_file": str(c.site_file) if c.admin_files else None,
            "ports": {"slurmctld": c.port(PORT_SLURMCTLD),
                      **({"slurmdbd": c.port(PORT_SLURMDBD), "mysql": c.port(PORT_MYSQL)} if c.accounting else {}),
                      **{n: c.slurmd_port(i) for i, n in enumerate(c.node_names)}},
            "logs": str(c.log_dir),
            "munge_socket": str(c.munge_socket),
            "daemons": [{"name": d.name, "pid": d.pid, "running": d.running, "pid_file": str(d.pid_file)}
                        for d in self.daemons],
            "nodes": self.nodes,
        }


def _read_pid(pid_file: Path) -> int | None:
    try:
        return int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _same_root(pid: int) -> bool:
    """The process sees the same / as we do: not one of another chroot (a Slurm
    release root of scripts/slurm-matrix.sh) that happens to use the same state path."""
    try:
        theirs, ours = os.stat(f"/proc/{pid}/root"), os.stat("/")
    except OSError:
        return False
    return (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino)


def _inode(path: str | Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _stepd_is_ours(pid: int, state_dir: Path) -> bool:
    """A slurmstepd of one of our slurmd: its working folder or an open file (slurmd's
    log, which slurmstepd writes to) is in our state folder. Compared by inode, so a
    look-alike path in another root does not match. Needed from Slurm 23.x: slurmstepd
    no longer inherits slurmd's environment (24.11: no marker in its environ), and it
    is double-forked (parent pid 1), so neither environ nor parentage names it."""
    ours = {i for i in (_inode(state_dir), _inode(state_dir / "log"), _inode(state_dir / "spool")) if i}
    spool = state_dir / "spool"
    with contextlib.suppress(OSError):
        ours |= {i for i in (_inode(d) for d in spool.iterdir()) if i}
    if _inode(f"/proc/{pid}/cwd") in ours:
        return True
    log_files = set()
    with contextlib.suppress(OSError):
        log_files = {i for i in (_inode(f) for f in (state_dir / "log").iterdir()) if i}
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    return any(_inode(f"/proc/{pid}/fd/{fd}") in log_files for fd in fds)


def _is_ours(pid: int, state_dir: Path) -> bool:
    """The process exists, is not a zombie, runs in our root, and is ours: a daemon
    carrying our marker, a slurmstepd of our slurmd (see `_stepd_is_ours`), or a task
    of a job of this cluster (slurmstepd gives every task SLURM_CONF and SLURM_JOB_ID,
    even with --export=NONE)."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes()
        st = Path(f"/proc/{pid}/stat").read_text()
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return False
    if st.rsplit(")", 1)[-1].split()[0] == "Z" or not _same_root(pid):
        return False
    entries = env.split(b"\0")
    if f"{MARKER}={state_dir}".encode() in entries:
        return True
    if comm == "slurmstepd":
        return _stepd_is_ours(pid, state_dir)
    conf = f"SLURM_CONF={state_dir / 'etc' / 'slurm.conf'}".encode()
    return conf in entries and any(e.startswith(b"SLURM_JOB_ID=") for e in entries)


def _ours_by_environ(state_dir: Path) -> Iterator[int]:
    """Every live process carrying our marker (daemons and the slurmstepd they spawn)."""
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != me and _is_ours(int(entry.name), state_dir):
            yield int(entry.name)


# ---------------------------------------------------------------- locking

_held_locks: dict[str, tuple[int, int]] = {}  # path -> (fd, depth): re-entrant within a process


@contextlib.contextmanager
def instance_lock(state_dir: Path) -> Iterator[None]:
    """Serialise `up`/`down` on one state folder across processes (two pytest runs in
    one checkout, or `cluster up` typed twice). Re-entrant within a process."""
    state_dir.mkdir(parents=True, exist_ok=True)
    key = str(state_dir / ".lock")
    if key in _held_locks:
        fd, depth = _held_locks[key]
        _held_locks[key] = (fd, depth + 1)
        try:
            yield
        finally:
            fd, depth = _held_locks[key]
            _held_locks[key] = (fd, depth - 1)
        return
    fd = os.open(key, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        _held_locks[key] = (fd, 1)
        try:
            yield
        finally:
            del _held_locks[key]
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- the cluster

class LocalCluster:
    def __init__(self, config: ClusterConfig) -> None:
        self.memory_cgroup: localcgroup.MemoryCgroup | None = None  # set by render()
        self.config = config

    @classmethod
    def at(cls, state_dir: Path | None = None) -> LocalCluster | None:
        """The cluster recorded in a state folder (running or not), if any."""
        cfg = load_saved_config((state_dir or default_state_dir()).resolve())
        return cls(cfg) if cfg is not None else None

    def client(self, timeout_s: float = 30.0) -> SlurmClient:
        return SlurmClient(self.config.slurm_conf, timeout_s=timeout_s)

    # ------------------------------------------------------------ daemons

    def daemons(self) -> list[Daemon]:
        c = self.config
        names = ["munged"]
        if c.accounting:
            names += ["mariadbd", "slurmdbd"]
        names.append("slurmctld")
        names += [f"slurmd-{n}" for n in c.node_names]
        out = []
        for name in names:
            pid_file = c.run_dir / f"{name}.pid"
            pid = _read_pid(pid_file)
            out.append(Daemon(name, pid_file, pid, pid is not None and _is_ours(pid, c.state_dir)))
        return out

    def status(self, query_nodes: bool = True) -> ClusterStatus:
        st = ClusterStatus(self.config, self.daemons())
        if query_nodes and st.up:
            try:
                st.nodes = [{"name": n.name, "state": n.state, "flags": list(n.flags), "gres": n.gres,
                             "gres_used": n.gres_used, "cpus": n.cpus, "port": n.port}
                            for n in self.client(timeout_s=10).show_nodes()]
            except SlurmError as exc:
                log.warning("cluster is up but scontrol failed: %s", exc)
        return st

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.config.slurm_conf)
        env[MARKER] = str(self.config.state_dir)
        return env

    def _spawn(self, name: str, argv: list[str], *, daemonizes: bool, wait_s: float = 20.0) -> int:
        """Start one daemon; return its pid once its pid file names a live process of ours."""
        c = self.config
        pid_file = c.run_dir / f"{name}.pid"
        with contextlib.suppress(FileNotFoundError):
            pid_file.unlink()
        out = open(c.log_dir / f"{name}.out", "ab")  # noqa: SIM115 - handed to the child
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,  # noqa: S603
                                    stderr=subprocess.STDOUT, env=self._env(), start_new_session=True,
                                    cwd=c.state_dir)
        except FileNotFoundError:
            raise ClusterError(f"{argv[0]} not found: run scripts/setup.sh (apt-get install "
                               "slurm-wlm munge mariadb-server slurmdbd)") from None
        finally:
            out.close()
        if not daemonizes:
            pid_file.write_text(f"{proc.pid}\n")
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if daemonizes and proc.poll() not in (None, 0):
                break
            pid = _read_pid(pid_file)
            if pid is not None and _is_ours(pid, c.state_dir):
                if daemonizes:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=5)  # reap the parent that forked the daemon
                return pid
            if not daemonizes and proc.poll() is not None:
                break
            time.sleep(0.1)
        logs = [c.log_dir / f"{name}.out", c.log_dir / f"{name}.log"]
        tail = _fatal_line(logs) or _tail(logs[0]) or _tail(logs[1])
        raise ClusterError(f"{name} did not start (see {c.log_dir}): {tail}")

    def _start_munged(self) -> None:
        c = self.config
        key = c.etc_dir / "munge.key"
        if not key.exists():
            key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        self._spawn("munged", ["munged", "--force", f"--socket={c.munge_socket}",
                               f"--pid-file={c.run_dir / 'munged.pid'}", f"--key-file={key}",
                               f"--log-file={c.log_dir / 'munged.log'}",
                               f"--seed-file={c.state_dir / 'munged.seed'}"], daemonizes=True)

    def _start_mariadb(self) -> None:
        c = self.config
        datadir = c.state_dir / "mysql"
        if not (datadir / "mysql").is_dir():
            datadir.mkdir(parents=True, exist_ok=True)
            _run(["mariadb-install-db", "--no-defaults", f"--datadir={datadir}", "--user=root",
                  "--auth-root-authentication-method=socket", "--skip-test-db"], timeout_s=120,
                 what="mariadb-install-db")
        self._spawn("mariadbd", [
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

    def _start_slurmdbd(self) -> None:
        c = self.config
        self._spawn("slurmdbd", ["slurmdbd"], daemonizes=True, wait_s=60)
        _wait_for(lambda: _can_connect(c.port(PORT_SLURMDBD)), 60, "slurmdbd to listen",
                  c.log_dir / "slurmdbd.log")
        cl = self.client(timeout_s=30)
        for argv in (["sacctmgr", "-i", "add", "cluster", c.cluster_name],
                     ["sacctmgr", "-i", "add", "account", ACCOUNT, f"Cluster={c.cluster_name}",
                      "Description=slurm-dlrm", "Organization=local"],
                     ["sacctmgr", "-i", "add", "user", "root", f"Account={ACCOUNT}",
                      f"Cluster={c.cluster_name}"]):
            proc = cl.run(argv, check=False)
            if proc.returncode != 0 and not sacctmgr_already_there(proc.stdout + proc.stderr):
                raise ClusterError(f"{' '.join(argv)} failed: {(proc.stderr or proc.stdout).strip()}")

    # ------------------------------------------------------------ files

    def render(self) -> None:
        """Write slurm.conf, gres.conf (and slurmdbd.conf) and the fake GPU devices."""
        c = self.config
        self.memory_cgroup = localcgroup.detect()  # first: a bad $SLURM_DLRM_CLUSTER_CGROUP writes nothing
        # slurmd's spool folder (SlurmdSpoolDir=<state>/spool/slurmd-%n) holds its domain
        # sockets; 24.11+ log an error at start when it does not exist yet.
        for d in (c.etc_dir, c.run_dir, c.log_dir, c.state_dir / "ctld", c.state_dir / "spool",
                  c.state_dir / "dev", *(c.state_dir / "spool" / f"slurmd-{n}" for n in c.node_names)):
            d.mkdir(parents=True, exist_ok=True)
        c.state_dir.chmod(0o755)  # munged refuses group/other-writable socket folders
        c.run_dir.chmod(0o755)
        nodes = []
        for i, name in enumerate(c.node_names):
            devices = []
            for g in range(c.gpus_per_node):
                dev = c.state_dir / "dev" / name / f"nvidia{g}"
                _mknod_null(dev)
                devices.append(str(dev))
            gres = [f"gpu:{c.gpu_type}:{c.gpus_per_node}"] if c.gpus_per_node else []
            if c.gpus_per_node and c.mps_per_gpu:
                gres.append(f"mps:{c.mps_per_gpu * c.gpus_per_node}")
            if c.gpus_per_node and c.shards_per_gpu:
                gres.append(f"shard:{c.shards_per_gpu * c.gpus_per_node}")
            nodes.append({"name": name, "port": c.slurmd_port(i), "cpus": c.cpus_per_node,
                          "memory_mib": c.memory_mib, "gres": ",".join(gres) or "(null)",
                          "devices": devices})
        extra = c.slurm_conf_extra.read_text().rstrip() if c.slurm_conf_extra else ""
        gres_text = Path(c.gres_conf).read_text() if c.gres_conf else None
        lua_text = Path(c.job_submit_lua).read_text() if c.job_submit_lua else None
        extra_source = str(c.slurm_conf_extra or "")
        if c.admin_files:
            admin = self._render_admin()
            extra, gres_text, lua_text = admin["slurm-dlrm.conf"].rstrip(), admin["gres.conf"], admin["job_submit.lua"]
            extra_source = f"{c.state_dir / 'admin' / 'rendered' / 'slurm-dlrm.conf'} (slurm-dlrm admin render)"
        # Slurm refuses a node defined twice: a fragment with its own NodeName/PartitionName
        # lines (e.g. `slurm-dlrm admin render`'s) replaces ours.
        extra_keys = {line.split("=", 1)[0].strip() for line in extra.splitlines() if "=" in line}
        values = dict(
            cluster_name=c.cluster_name, hostname=socket.gethostname().split(".")[0],
            slurmctld_port=c.port(PORT_SLURMCTLD), slurmdbd_port=c.port(PORT_SLURMDBD),
            mysql_port=c.port(PORT_MYSQL), munge_socket=str(c.munge_socket), state_dir=str(c.state_dir),
            accounting=c.accounting, job_submit_lua=lua_text is not None, nodes=nodes,
            own_nodes="NodeName" not in extra_keys, own_partition="PartitionName" not in extra_keys,
            node_list=c.node_hostlist, partition=c.partition,
            max_time=c.max_time_minutes, min_job_age_s=c.min_job_age_s,
            def_mem_per_cpu_mib=c.def_mem_per_cpu_mib, gpu_type=c.gpu_type,
            mps_per_gpu=c.mps_per_gpu, shards_per_gpu=c.shards_per_gpu, extra=extra,
            extra_source=extra_source, mysql_user=MYSQL_USER, mysql_db=MYSQL_DB,
            mysql_password="", **self._memory_cgroup_values())
        env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATE_DIR), undefined=jinja2.StrictUndefined,
                                 trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
        _write(c.slurm_conf, one_source_per_key(env.get_template("slurm.conf.j2").render(values), extra))
        gres_path = c.etc_dir / "gres.conf"
        if gres_text is not None:
            _write(gres_path, gres_text)
        else:
            _write(gres_path, env.get_template("gres.conf.j2").render(values))
        cgroup_conf = c.etc_dir / "cgroup.conf"
        if values["task_plugin"] == "task/cgroup":
            _write(cgroup_conf, env.get_template("cgroup.conf.j2").render(values))
        else:
            cgroup_conf.unlink(missing_ok=True)
        lua = c.etc_dir / "job_submit.lua"
        if lua_text is not None:
            _write(lua, lua_text)
        elif lua.exists():
            lua.unlink()
        if c.accounting:
            pw_file = c.etc_dir / "mysql.password"
            if not pw_file.exists():
                pw_file.write_text(secrets.token_hex(16))
            pw_file.chmod(0o600)
            values["mysql_password"] = pw_file.read_text().strip()
            dbd = c.etc_dir / "slurmdbd.conf"
            _write(dbd, env.get_template("slurmdbd.conf.j2").render(values))
            dbd.chmod(0o600)  # slurmdbd refuses a world-readable file (it holds a password)
        saved_config_path(c.state_dir).write_text(json.dumps(c.to_json(), indent=1) + "\n")

    def _memory_cgroup_values(self) -> dict[str, Any]:
        """Slurm constrains each job's memory where the host allows (localcgroup.py); the
        decision is kept for `_up` (how slurmd starts) and `cluster status` (one line)."""
        mc = self.memory_cgroup or localcgroup.detect()
        (self.config.state_dir / localcgroup.DECISION_FILE).write_text(mc.status_line() + "\n")
        return {"task_plugin": "task/cgroup" if mc.usable else "task/none",
                "constrain_swap": "yes" if mc.swap else "no"}

    def _slurmd_argv(self, name: str) -> list[str]:
        argv = ["slurmd", "-f", str(self.config.slurm_conf), "-N", name]
        mc = self.memory_cgroup
        if mc is None or not mc.usable or mc.mount is None:
            return argv
        cgroup = localcgroup.cluster_cgroup(mc.mount, self.config.state_dir)
        cgroup.mkdir(exist_ok=True)
        return localcgroup.wrap_argv(argv, cgroup, mc.mount)

    def _render_admin(self) -> dict[str, str]:
        """`slurm-dlrm admin render` for this cluster: write its site file, render, install
        the MPS scripts and the fake MPS control command; return the rendered texts by name
        (the caller puts slurm-dlrm.conf, gres.conf and job_submit.lua in place)."""
        import tomllib

        from slurm_dlrm.admin.localsite import dump_toml, local_site_raw
        from slurm_dlrm.admin.render import MODULE_NAME, render_site, write_rendered
        from slurm_dlrm.emulated.mps_control import install_launcher
        from slurm_dlrm.site import REPO_SITE_FILE

        c = self.config
        admin_dir = c.state_dir / "admin"
        fake = install_launcher(admin_dir / "bin")
        try:
            raw = tomllib.loads(Path(c.site_path or REPO_SITE_FILE).read_text())
        except (OSError, ValueError) as exc:
            raise BadInput(f"--site: cannot read {c.site_path or REPO_SITE_FILE}: {exc}") from None
        local = local_site_raw(
            raw, state_dir=str(c.state_dir), hostlist=c.node_hostlist, gpu_model=c.gpu_type,
            gpus=c.gpus_per_node, cpus=c.cpus_per_node, memory_mib=c.memory_mib,
            first_slurmd_port=c.slurmd_port(0), partition=c.partition, max_time_minutes=c.max_time_minutes,
            mps_per_gpu=c.mps_per_gpu, shards_per_gpu=c.shards_per_gpu, accounting=c.accounting,
            fake_mps_control=str(fake))
        _write(c.site_file, "# The local cluster's site file, written by `slurm-dlrm cluster up` from "
               f"{c.site_path or REPO_SITE_FILE}.\n# Check the cluster against it: "
               f"SLURM_CONF={c.slurm_conf} slurm-dlrm admin check --site {c.site_file}\n" + dump_toml(local))
        from slurm_dlrm.site import load_site

        files = render_site(load_site(c.site_file))
        write_rendered(files, admin_dir / "rendered")
        for f in files:
            if f.name.startswith("scripts/") or f.name == MODULE_NAME:
                dest = Path(f.install_path)
                dest.parent.mkdir(parents=True, exist_ok=True)
                _write(dest, f.text)
                dest.chmod(f.mode)
        (c.state_dir / "shm").mkdir(exist_ok=True)
        return {f.name: f.text for f in files}

    # ------------------------------------------------------------ up / down

    def up(self, wait_s: float = 90.0) -> ClusterStatus:
        """Start what is not running yet; safe to call when the cluster is up."""
        with instance_lock(self.config.state_dir):
            return self._up(wait_s)

    def _up(self, wait_s: float) -> ClusterStatus:
        c = self.config
        c.validate()
        running = LocalCluster.at(c.state_dir)
        if running is not None and any(d.running for d in running.daemons()):
            if running.config != c:
                raise ClusterError(
                    f"a cluster with other settings runs in {c.state_dir} (base port "
                    f"{running.config.base_port}, {running.config.nodes} nodes, accounting "
                    f"{'on' if running.config.accounting else 'off'}); run `slurm-dlrm cluster down "
                    f"--state-dir {c.state_dir}` first")
            if running.status(query_nodes=False).up:
                self.wait_idle(wait_s)
                return self.status()
        c.state_dir.mkdir(parents=True, exist_ok=True)
        # Started anew: whoever starts it owns it (tests/conftest.py's marker is stale).
        (c.state_dir / "fixture-started").unlink(missing_ok=True)
        t0 = time.monotonic()
        self.render()
        by_name = {d.name: d for d in self.daemons()}
        try:
            if not by_name["munged"].running:
                self._start_munged()
            if c.accounting:
                if not by_name["mariadbd"].running:
                    self._start_mariadb()
                if not by_name["slurmdbd"].running:
                    self._start_slurmdbd()
            if not by_name["slurmctld"].running:
                self._spawn("slurmctld", ["slurmctld", "-f", str(c.slurm_conf), *self._ctld_recovery_flags()],
                            daemonizes=True)
            for name in c.node_names:
                if not by_name[f"slurmd-{name}"].running:
                    self._spawn(f"slurmd-{name}", self._slurmd_argv(name), daemonizes=True)
            self.wait_idle(wait_s)
        except BaseException:
            # Nothing half-up: stop what this call started (newest first), keep what ran before.
            started = [d for d in self.daemons() if d.running and not by_name[d.name].running]
            for d in reversed(started):
                if d.pid is not None:
                    _terminate(d.pid, c.state_dir, 10.0)
                d.pid_file.unlink(missing_ok=True)
            raise
        log.info("local cluster up in %.1f s", time.monotonic() - t0)
        return self.status()

    def _ctld_recovery_flags(self) -> list[str]:
        """`-i` when the last slurmctld died before its first state save (killed, crashed,
        the machine stopped): its state folder then has `clustername` but no
        `assoc_usage`, which Slurm 26.05 refuses with accounting on ("fatal: No Assoc usage
        file ... to recover"; 22.05 and 24.11 only log it). `-i` ignores the missing file
        and keeps whatever job and node state is there (issue 28)."""
        ctld = self.config.state_dir / "ctld"
        if (ctld / "clustername").exists() and not (ctld / "assoc_usage").exists():
            log.warning("%s: no assoc_usage beside clustername (a slurmctld ended before saving its "
                        "state): starting slurmctld with -i", ctld)
            return ["-i"]
        return []

    def wait_idle(self, wait_s: float) -> None:
        """Wait until every node answers and is not down/drained (idle, or busy with jobs)."""
        cl = self.client(timeout_s=10)
        deadline = time.monotonic() + wait_s
        last = "no answer"
        while time.monotonic() < deadline:
            dead = [d for d in self.daemons() if not d.running]
            if dead:
                name = dead[0].name
                tail = _tail(self.config.log_dir / f"{name}.log") or _tail(self.config.log_dir / f"{name}.out")
                raise ClusterError(f"{name} stopped while starting (see {self.config.log_dir}): {tail}")
            try:
                nodes = cl.show_nodes()
            except SlurmError as exc:
                last = str(exc)
            else:
                if len(nodes) == self.config.nodes and all(n.usable for n in nodes):
                    return
                last = ", ".join(f"{n.name}={n.state}{'+' + '+'.join(n.flags) if n.flags else ''}"
                                 for n in nodes)
            time.sleep(0.5)
        raise ClusterError(f"nodes not idle after {wait_s:g} s ({last}); logs in {self.config.log_dir}")

    def down(self, timeout_s: float = 20.0) -> list[str]:
        """Cancel all jobs, stop our daemons (pid files + marker check), sweep strays."""
        with instance_lock(self.config.state_dir):
            return self._down(timeout_s)

    def _down(self, timeout_s: float) -> list[str]:
        c = self.config
        daemons = self.daemons()
        stopped: list[str] = []
        by_name = {d.name: d for d in daemons}
        if by_name.get("slurmctld") and by_name["slurmctld"].running:
            self._cancel_all_jobs()
        # Reverse start order: slurmd first, munged last (the others need it to talk).
        order = [d for d in daemons if d.name.startswith("slurmd-")] + \
            [by_name[n] for n in ("slurmctld", "slurmdbd", "mariadbd", "munged") if n in by_name]
        for d in order:
            if d.running and d.pid is not None:
                _terminate(d.pid, c.state_dir, timeout_s)
                stopped.append(d.name)
            with contextlib.suppress(FileNotFoundError):
                d.pid_file.unlink()
        # slurmstepd of jobs that outlived the cancel inherit the marker from slurmd;
        # their tasks are recognised by SLURM_CONF + SLURM_JOB_ID (see _is_ours).
        stopped += self._stop_fake_mps_daemons()
        strays = list(_ours_by_environ(c.state_dir))
        for pid in strays:
            _terminate(pid, c.state_dir, 5.0)
        if strays:
            stopped.append(f"{len(strays)} stray process(es)")
        mc = localcgroup.detect()
        if mc.usable and mc.mount is not None:  # Slurm's slurm_<node> folders below ours
            localcgroup.remove_tree(localcgroup.cluster_cgroup(mc.mount, c.state_dir))
        return stopped

    def _stop_fake_mps_daemons(self) -> list[str]:
        """The fake MPS control daemons the rendered prolog started and no epilog stopped
        (slurmd gone first): `quit` through their pipe, then SIGKILL the pid their pid
        file names, only if that process runs the fake in our root."""
        from slurm_dlrm.emulated.mps_control import LAUNCHER_MODULES

        c = self.config
        fake = c.state_dir / "admin" / "bin" / "nvidia-cuda-mps-control"
        stopped = []
        for pid_file in sorted((c.state_dir / "mps").glob("gpu*/pipe/nvidia-cuda-mps-control.pid")):
            pid = _read_pid(pid_file)
            if pid is None or pid <= 1:
                continue
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if not any(m.encode() in cmdline for m in LAUNCHER_MODULES) or not _same_root(pid):
                continue
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                subprocess.run([str(fake)], input="quit\n", text=True, timeout=10, capture_output=True,  # noqa: S603
                               env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pid_file.parent)})
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
                time.sleep(0.1)
            if Path(f"/proc/{pid}").exists():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            stopped.append(f"fake MPS daemon {pid_file.parent.parent.name}")
        return stopped

    def _cancel_all_jobs(self) -> None:
        cl = self.client(timeout_s=10)
        try:
            jobs = [j for j in cl.squeue() if not j.state.is_terminal]
            if not jobs:
                return
            cl.scancel([j.job_id for j in jobs])
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                if all(j.state.is_terminal for j in cl.squeue()):
                    return
                time.sleep(0.5)
        except SlurmError as exc:
            log.warning("could not cancel jobs before stopping: %s", exc)


# ---------------------------------------------------------------- helpers

# Records, not settings: one line per node/partition, several lines by design.
_RECORD_KEYS = frozenset({"nodename", "partitionname", "nodeset", "downnodes", "frontendname", "include"})
_EXTRA_MARK = "# ---- from --slurm-conf-extra"


def _conf_key(line: str) -> str | None:
    text = line.strip()
    if not text or text.startswith("#") or "=" not in text:
        return None
    return text.split("=", 1)[0].strip().lower()  # slurm.conf keys are case-insensitive


def one_source_per_key(conf: str, extra: str) -> str:
    """slurm.conf with each setting the appended fragment (`admin render`'s, or
    --slurm-conf-extra) also sets left to the fragment: slurmctld logs "KEY specified
    more than once, latest value used" for every key set twice (SelectTypeParameters,
    JobSubmitPlugins, AccountingStorageTRES, GresTypes, SelectType on the local
    cluster), and one source is what an admin reads. Pure."""
    overridden = {k for k in map(_conf_key, extra.splitlines()) if k and k not in _RECORD_KEYS}
    head, mark, tail = conf.partition(_EXTRA_MARK)
    out = []
    for line in head.splitlines(keepends=True):
        key = _conf_key(line)
        if key in overridden:
            out.append(f"# {line.split('=', 1)[0].strip()}: set by the fragment below\n")
        else:
            out.append(line)
    return "".join(out) + mark + tail


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _mknod_null(path: Path) -> None:
    """A character device c 1 3 (what /dev/null is): Slurm accepts it as a GPU file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        st = path.stat()
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3):
            return
        path.unlink()
    except FileNotFoundError:
        pass
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except PermissionError:
        raise ClusterError(f"cannot create device file {path}: `cluster up` must run as root "
                           "(mknod)") from None


def _terminate(pid: int, state_dir: Path, timeout_s: float) -> None:
    if not _is_ours(pid, state_dir):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _is_ours(pid, state_dir):
            return
        time.sleep(0.1)
    log.warning("pid %d did not stop after SIGTERM within %g s; sending SIGKILL", pid, timeout_s)
    with contextlib.suppress(ProcessLookupError):
        if _is_ours(pid, state_dir):
            os.kill(pid, signal.SIGKILL)


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
    raise ClusterError(f"timed out after {timeout_s:g} s waiting for {what}: {_tail(log_file)}")


def _fatal_line(paths: list[Path]) -> str:
    """The last `fatal:` line of a daemon's logs: why it stopped, which its last lines
    (config warnings printed after it) may not say."""
    found = ""
    for path in paths:
        with contextlib.suppress(OSError):
            for line in path.read_text(errors="replace").splitlines():
                if "fatal:" in line:
                    found = line.strip()
    return found


def _tail(path: Path, lines: int = 3) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


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


def which_missing() -> list[str]:
    """Binaries `up` needs that are not on PATH."""
    return [b for b in ("munged", "slurmctld", "slurmd", "sbatch", "scontrol") if shutil.which(b) is None]
