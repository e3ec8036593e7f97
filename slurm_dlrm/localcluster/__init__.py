"""A real Slurm cluster on localhost with fake GPUs, for development, tests and the demo
(docs/cluster.md). Everything is private to one state folder and one range of ports,
so several instances run side by side (one per git worktree).

Where to look: `cluster.py` (`LocalCluster`: up, down, status), `config.py` (the
settings and the state folder), `ports.py` (the base port, the settings from the site
file), `rendering.py` (slurm.conf, gres.conf, the admin files), `daemons.py` and
`accounting.py` (starting munged, MariaDB, slurmdbd), `processes.py` (which processes
are ours; nothing is signalled otherwise). This face hands on the names the CLI,
tests/conftest.py, scripts and benchmarks use.
"""

from slurm_dlrm.localcluster.cluster import ClusterStatus, LocalCluster, instance_lock
from slurm_dlrm.localcluster.config import (
    ENV_DIR,
    ENV_PORT,
    PORTS_PER_INSTANCE,
    ClusterConfig,
    ClusterError,
    default_state_dir,
)
from slurm_dlrm.localcluster.daemons import which_missing
from slurm_dlrm.localcluster.ports import config_from_site

__all__ = [
    "ENV_DIR", "ENV_PORT", "PORTS_PER_INSTANCE", "ClusterConfig", "ClusterError", "ClusterStatus",
    "LocalCluster", "config_from_site", "default_state_dir", "instance_lock", "which_missing",
]
