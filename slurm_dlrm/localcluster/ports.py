"""The base port of an instance and the settings of a new one. The base port is
derived from the state folder's path, kept from the folder's last run, and moved on
by whole slots while any port of it is busy; `config_from_site` takes the cluster's
shape from the site file's first node group.

Apart from `config.py` because choosing a port looks at the machine (which ports are
bound, whether the folder's last cluster still runs), and `config_from_site` sits
here because the port is the one setting it cannot read from a file.
"""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path
from typing import Any

from slurm_dlrm.errors import BadInput
from slurm_dlrm.localcluster.cluster import LocalCluster
from slurm_dlrm.localcluster.config import (
    ENV_PORT,
    PORT_FIRST_SLURMD,
    PORT_MYSQL,
    PORT_SLURMCTLD,
    PORT_SLURMDBD,
    PORTS_PER_INSTANCE,
    ClusterConfig,
    ClusterError,
    default_state_dir,
    load_saved_config,
)
from slurm_dlrm.site import SiteConfig, load_site

# Derived base ports stay below Linux's ephemeral range (32768+), so an outgoing
# connection never holds one of our listening ports.
DERIVED_PORT_LOW = 10000
DERIVED_PORT_SLOTS = 220


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

