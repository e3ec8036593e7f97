"""Refill on the local Slurm cluster (docs/interfaces.md 3b): a pending job joins a
running pack after one of its members ended, trains to completion inside that same
allocation (one Slurm job id), and `acct`/`queue` show it in that pack.

The service runs in this process (rounds driven here, 0.5 s apart) with the site's
policy (`complementary`), which decides the join; the mechanism alone, with a test
policy, is in tests/test_service_refill.py.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from service_harness import make_site

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples" / "sweep"
pytestmark = pytest.mark.slurm


@pytest.mark.torch  # its members really train (tiny-a/tiny-b specs)
def test_pending_job_joins_a_running_pack_and_completes_in_its_allocation(slurm_cluster, tmp_path, monkeypatch):
    from slurm_dlrm.service.core import PackingService, ServiceSettings
    from slurm_dlrm.service.queue import queue_rows
    from slurm_dlrm.service.sbatch_options import SbatchOptions
    from slurm_dlrm.service.submit import submit
    from slurm_dlrm.store.acct import AcctFilter, acct_rows
    from slurm_dlrm.store.store import Store, current_user

    monkeypatch.setenv("PYTHONPATH", str(REPO))  # sbatch exports it: the agents run this checkout
    site = make_site(tmp_path)
    user = current_user()
    long_spec = tmp_path / "long.yaml"
    long_spec.write_text((EXAMPLES / "tiny-a.yaml").read_text().replace("name: tiny-a", "name: long-one")
                         .replace("steps: 60", "steps: 100000"))
    first, _ = submit([str(EXAMPLES / "tiny-a.yaml"), str(long_spec)], SbatchOptions(), site=site, user=user,
                      cwd=str(tmp_path), start_service=False)
    short_id, long_id = first
    slurm = slurm_cluster.client()
    store = Store.for_user(site, user)
    svc = PackingService(store, slurm, site, ServiceSettings(user=user, dispatch_window_s=0.0))
    assert svc.policy == "complementary"
    joiner_id = None
    pack = None
    try:
        deadline = time.monotonic() + 80
        while time.monotonic() < deadline:
            svc.run_round()
            if joiner_id is None and store.get_job(short_id).state == "COMPLETED":
                assert store.get_job(long_id).state == "RUNNING"
                (joiner_id,), _ = submit([str(EXAMPLES / "tiny-b.yaml")], SbatchOptions(), site=site, user=user,
                                         cwd=str(tmp_path), start_service=False)
            if joiner_id is not None and store.get_job(joiner_id).state in ("COMPLETED", "FAILED", "CANCELLED"):
                break
            time.sleep(0.5)
        assert joiner_id is not None, [str(j.state) for j in store.jobs()]
        joiner = store.get_job(joiner_id)
        assert joiner.state == "COMPLETED", (joiner.state, joiner.exit_reason, store.events(job_id=joiner_id))
        packs = store.packs()
        assert len(packs) == 1, packs  # no second allocation: it ran in the pack it joined
        pack = packs[0]
        assert joiner.pack_id == pack.id and joiner.slurm_job_id == pack.slurm_job_id and joiner.attempt == 0
        assert any(e["reason"].startswith(f"joined pack {pack.id}:") for e in store.events(job_id=joiner_id))
        (place,) = store.placements(job_id=joiner_id)
        assert place.pack_id == pack.id and place.start_time is not None and place.end_time is not None
        assert (Path(pack.pack_dir) / "joins" / f"{joiner_id}.json").exists()
        # acct and queue show it in that pack
        rows = {r["job_id"]: r for r in acct_rows(store, AcctFilter(job_ids=(short_id, joiner_id)))}
        assert (rows[joiner_id]["pack_id"], rows[joiner_id]["pack_name"]) == (pack.id, pack.name)
        assert str(rows[joiner_id]["slurm_job_id"]).split(".")[0] == pack.slurm_job_id
        assert rows[joiner_id]["n_samples"] > 0  # the agent sampled it like an initial member
        q = {r["job_id"]: r for r in queue_rows(store, user=user, service={}, include_ended=True)}
        assert (q[joiner_id]["pack"], q[joiner_id]["slurm_job_id"]) == (pack.name, pack.slurm_job_id)
        assert q[joiner_id]["node"] == q[long_id]["node"]
        # Slurm knows one job: the joiner's metrics were written by a member of that allocation
        out = subprocess.run(["squeue", "-h", "-j", pack.slurm_job_id, "-o", "%T"], capture_output=True,  # noqa: S603
                             text=True, timeout=30, check=False).stdout.strip()
        assert out in ("RUNNING", "COMPLETING"), out  # the long member still holds it
    finally:
        from slurm_dlrm.service.cancel import cancel_job

        if store.get_job(long_id).state in ("PENDING", "PLANNED", "RUNNING"):
            cancel_job(store, slurm, long_id, user=user)
        for p in store.packs(["SUBMITTING", "QUEUED", "RUNNING"]):
            if p.slurm_job_id:
                subprocess.run(["scancel", p.slurm_job_id], check=False, timeout=30)  # noqa: S603
        store.close()
