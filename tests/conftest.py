"""Shared fixtures. `slurm_cluster`: the real local Slurm cluster, once per session.

Tests that need it are marked `@pytest.mark.slurm` and take the fixture:

    @pytest.mark.slurm
    def test_x(slurm_cluster):
        client = slurm_cluster.client()          # a SlurmClient bound to the cluster
        job_id = client.sbatch(script, ["--gres=gpu:1"])
        done = slurm_cluster.wait([job_id])      # {job_id: JobInfo}, terminal states

The cluster's state folder and ports are derived from this checkout's path (so git
worktrees do not collide); $SLURM_DLRM_CLUSTER_DIR / $SLURM_DLRM_CLUSTER_PORT override
them. A cluster already running there is reused and left running; one a fixture
started is stopped at the end by the last pytest session using it. Accounting (MariaDB + slurmdbd, ~4 s more) is on, so
`sacct` works. With CI=true a cluster that does not come up fails the tests instead
of skipping them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from slurm_dlrm.localcluster import (
    ClusterConfig,
    LocalCluster,
    config_from_site,
    default_state_dir,
    which_missing,
)
from slurm_dlrm.slurm.base import JobInfo
from slurm_dlrm.slurm.client import SlurmClient
from slurm_dlrm.slurm.wait import wait_for_jobs


@dataclass
class SlurmTestCluster:
    cluster: LocalCluster
    started_here: bool

    @property
    def config(self) -> ClusterConfig:
        return self.cluster.config

    @property
    def slurm_conf(self) -> Path:
        return self.config.slurm_conf

    @property
    def accounting(self) -> bool:
        return self.config.accounting

    def client(self, timeout_s: float = 30.0) -> SlurmClient:
        return SlurmClient(self.slurm_conf, timeout_s=timeout_s)

    def wait(self, job_ids: Sequence[int], timeout_s: float = 60.0) -> dict[int, JobInfo]:
        return wait_for_jobs(self.client(), job_ids, timeout_s=timeout_s, poll_s=0.2, max_poll_s=1.0)


def _unavailable(reason: str) -> None:
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"local Slurm cluster unavailable in CI: {reason}", pytrace=False)
    pytest.skip(f"local Slurm cluster unavailable: {reason}")


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmTestCluster]:
    from slurm_dlrm.errors import DlrmError
    from slurm_dlrm.localcluster import instance_lock
    from slurm_dlrm.site import REPO_SITE_FILE, load_site

    if os.geteuid() != 0:
        _unavailable("must run as root (slurmd, mknod)")
    missing = which_missing()
    if missing:
        _unavailable(f"not installed: {', '.join(missing)} (run scripts/setup.sh)")
    state_dir = default_state_dir()
    # Several pytest sessions of one checkout may share the cluster: each registers
    # itself in users/; the last one out stops it if a fixture (not a person) started it.
    users = state_dir / "fixture-users"
    started_flag = state_dir / "fixture-started"
    with instance_lock(state_dir):
        existing = LocalCluster.at(state_dir)
        if existing is not None and existing.status(query_nodes=False).up:
            cluster = existing
        else:
            if existing is not None:
                existing.down()  # a half-running leftover of this checkout: start clean
            cluster = LocalCluster(config_from_site(load_site(REPO_SITE_FILE), state_dir=state_dir,
                                                    accounting=True))
            try:
                cluster.up(wait_s=60)
            except DlrmError as exc:
                cluster.down()  # whatever did start
                _unavailable(str(exc))
            started_flag.touch()
        users.mkdir(exist_ok=True)
        (users / str(os.getpid())).touch()
    old_conf = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.config.slurm_conf)
    try:
        yield SlurmTestCluster(cluster, started_flag.exists())
    finally:
        if old_conf is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old_conf
        with instance_lock(state_dir):
            (users / str(os.getpid())).unlink(missing_ok=True)
            others = [p for p in users.iterdir() if p.name.isdigit() and Path(f"/proc/{p.name}").exists()]
            if started_flag.exists() and not others:
                cluster.down()
                started_flag.unlink(missing_ok=True)
