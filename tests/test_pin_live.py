"""A pack starts on the node its plan chose (issue 43 item 2), on the local Slurm cluster.

The service's view of the nodes says node1's GPUs and CPUs are taken (as when another
user's job held them a moment ago); both nodes are in fact idle. Unpinned, Slurm put the
pack on node1 (the first node that fits), and the next round planned on a view that
differed from what the plan assumed; pinned (`--nodelist`), the pack runs on node2.
"""

from __future__ import annotations

import sys
import tomllib
from dataclasses import replace
from typing import Any

import pytest
from test_faults_live import add_standin, run_until

pytestmark = pytest.mark.slurm


class _ViewWithNode1Taken:
    """The cluster's client, but `scontrol show nodes` reports node1 full."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def show_nodes(self) -> list[Any]:
        return [replace(n, gres_used="gpu:h100:4(IDX:0-3)", cpus_alloc=n.cpus) if n.name == "node1" else n
                for n in self._client.show_nodes()]


def test_a_pack_starts_on_the_node_its_plan_chose(slurm_cluster, tmp_path):
    from slurm_dlrm.service.core import PackingService, ServiceSettings
    from slurm_dlrm.site import REPO_SITE_FILE, parse_site
    from slurm_dlrm.store.store import Store, current_user

    data = tomllib.loads(REPO_SITE_FILE.read_text())
    data["site"]["store_dir"] = str(tmp_path / "store-{user}")
    data["site"]["spool_dir"] = str(tmp_path / "spool-{user}")
    site = parse_site(data, "pin-live")
    store = Store(tmp_path / "store.sqlite")
    user = current_user()
    client = slurm_cluster.client()
    svc = PackingService(store, _ViewWithNode1Taken(client), site,
                         ServiceSettings(user=user, python=sys.executable, dispatch_window_s=0.0))
    try:
        job = add_standin(store, user, "pinned", ["--steps", "4", "--step-s", "0.25"])
        run_until(svc, lambda: store.get_job(job).pack_id is not None
                  and store.get_pack(store.get_job(job).pack_id).state != "QUEUED", 60, "the pack to start")
        pack = store.get_pack(store.get_job(job).pack_id)
        assert (pack.state, pack.nodes) == ("RUNNING", "node2"), (pack.state, pack.nodes, pack.reason)
        assert store.pack_plan_data(pack.id)["node"] == "node2"
        run_until(svc, lambda: store.get_job(job).state == "COMPLETED", 60, "the member to complete")
    finally:
        ids = [int(p.slurm_job_id) for p in store.packs(["SUBMITTING", "QUEUED", "RUNNING"]) if p.slurm_job_id]
        if ids:
            client.scancel(ids)
        store.close()
