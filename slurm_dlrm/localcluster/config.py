"""The settings of one local cluster instance (`ClusterConfig`): its shape, its state
folder and the paths in it, its port layout, and how it is saved to `cluster.json`
so that `status`, `down` and a later `up` find it.

Apart because every other module of the local cluster reads these settings and none
of them is needed to know what the settings are: this one does no I/O beyond
reading and naming files of the state folder.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from slurm_dlrm.errors import BadInput, DlrmError

# The checkout (or site-packages) folder: slurm_dlrm/localcluster/config.py is three levels down.
REPO_DIR = Path(__file__).resolve().parent.parent.parent

ENV_DIR = "SLURM_DLRM_CLUSTER_DIR"
ENV_PORT = "SLURM_DLRM_CLUSTER_PORT"

# Port layout relative to the base port. Nodes take base+10 .. base+10+N-1.
PORT_SLURMCTLD = 0
PORT_SLURMDBD = 1
PORT_MYSQL = 2
PORT_FIRST_SLURMD = 10
PORTS_PER_INSTANCE = 100
MAX_NODES = PORTS_PER_INSTANCE - PORT_FIRST_SLURMD

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


# ---------------------------------------------------------------- state on disk

def checkout_hash(path: Path = REPO_DIR) -> str:
    return hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:8]


def default_state_dir() -> Path:
    """$SLURM_DLRM_CLUSTER_DIR, else /tmp/slurm-dlrm-<hash of this checkout> (of the
    site-packages folder, for a wheel install)."""
    env = os.environ.get(ENV_DIR)
    if env:
        return Path(env).resolve()
    return Path("/tmp") / f"slurm-dlrm-{checkout_hash()}"


def saved_config_path(state_dir: Path) -> Path:
    return state_dir / "cluster.json"


def load_saved_config(state_dir: Path) -> ClusterConfig | None:
    p = saved_config_path(state_dir)
    try:
        return ClusterConfig.from_json(json.loads(p.read_text()))
    except (OSError, ValueError, TypeError):
        return None

