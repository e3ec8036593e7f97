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
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


@pytest.fixture
def live_service(slurm_cluster: SlurmTestCluster, tmp_path: Path,
                 monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, str]]:
    """The packing service of this user on the local Slurm cluster, with its site (store
    and spool) in tmp_path, as `slurm-dlrm` commands of the test find it; yields (site,
    user). At the end it stops the service and scancels whatever of the test is still in
    Slurm (packs, and --no-pack jobs)."""
    from service_harness import make_site, write_site_file

    from slurm_dlrm.service.daemon import spawn_service, stop, wait_until_running
    from slurm_dlrm.service.submit import service_paths
    from slurm_dlrm.store.store import Store, current_user

    site = make_site(tmp_path)
    monkeypatch.setenv("SLURM_DLRM_SITE", str(write_site_file(tmp_path)))
    monkeypatch.setenv("SLURM_CONF", str(slurm_cluster.slurm_conf))
    monkeypatch.chdir(tmp_path)
    user = current_user()
    paths = service_paths(site, user)
    spawn_service(paths, ["--round-seconds", "1"])
    assert wait_until_running(paths, timeout_s=30) is not None, paths.log.read_text()[-2000:]
    yield site, user
    try:
        stop(paths, timeout_s=30)
    finally:
        with Store.for_user(site, user) as store:
            ids = {p.slurm_job_id for p in store.packs(["SUBMITTING", "QUEUED", "RUNNING"]) if p.slurm_job_id}
            ids |= {j.slurm_job_id for j in store.jobs(["PENDING", "PLANNED", "RUNNING"]) if j.slurm_job_id}
        if ids:
            subprocess.run(["scancel", *sorted(map(str, ids))], check=False, timeout=30)  # noqa: S603, S607


@pytest.fixture
def dropbox_env(tmp_path: Path) -> Iterator[tuple[Any, Path, Any]]:
    """This user's store, held open as the service holds it, in a site under tmp_path:
    yields (site, store folder, store) for tests of requests dropped there by another
    login node (service_harness.ingest_dropped reads them in)."""
    from service_harness import make_site

    from slurm_dlrm.store.store import Store, current_user

    site = make_site(tmp_path)
    user = current_user()
    store = Store.for_user(site, user)
    try:
        yield site, site.store_dir_for(user), store
    finally:
        store.close()


@pytest.fixture
def agent_world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder for an agent on no GPU: the fake MPS control daemon first on PATH, fake
    NVML with 2 GPUs, no MPS pipe folder or Slurm node name from outside, the checkout on
    PYTHONPATH (members import slurm_dlrm), and tmp/ for the agent's temporaries."""
    import json

    from slurm_dlrm.emulated import mps_control as fake_mps_control
    from slurm_dlrm.emulated import nvml as fake_nvml

    fake_mps_control.install_launcher(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.delenv("SLURMD_NODENAME", raising=False)
    scenario = tmp_path / "nvml.json"
    scenario.write_text(json.dumps({"gpu_count": 2}))
    monkeypatch.setenv(fake_nvml.ENV_FAKE_NVML, str(scenario))
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[1]))
    (tmp_path / "tmp").mkdir()
    return tmp_path
