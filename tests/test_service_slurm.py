"""The live path on the local Slurm cluster: submit -> service -> packs -> agents -> store.

One sweep exercises everything at once to stay inside the time budget: the service is
killed with SIGKILL at random moments while it plans and submits, one member of a
running pack is cancelled, and every other member must train to completion, with no
pack submitted twice and no job lost.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
from service_harness import make_site, write_site_file

pytest.importorskip("slurm_dlrm.estimate")

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples" / "sweep"
pytestmark = pytest.mark.slurm


@pytest.fixture
def live(slurm_cluster, tmp_path, monkeypatch):
    from slurm_dlrm.service.daemon import stop
    from slurm_dlrm.service.submit import service_paths
    from slurm_dlrm.store.store import current_user

    site = make_site(tmp_path)
    site_file = write_site_file(tmp_path)
    monkeypatch.setenv("SLURM_DLRM_SITE", str(site_file))
    user = current_user()
    paths = service_paths(site, user)
    yield site, user, paths, slurm_cluster
    try:
        stop(paths, timeout_s=30)
    finally:
        from slurm_dlrm.store.store import Store

        with Store.for_user(site, user) as store:  # leave no pack of this test in Slurm
            ids = [int(p.slurm_job_id) for p in store.packs(["SUBMITTING", "QUEUED", "RUNNING"]) if p.slurm_job_id]
        if ids:
            subprocess.run(["scancel", *map(str, ids)], check=False, timeout=30)  # noqa: S603


def _start(paths) -> int:
    from slurm_dlrm.service.daemon import spawn_service, wait_until_running

    spawn_service(paths, ["--round-seconds", "1"])
    pid = wait_until_running(paths, timeout_s=30)
    assert pid is not None, paths.log.read_text()[-2000:]
    return pid


def _long_spec(tmp_path: Path) -> Path:
    text = (EXAMPLES / "tiny-a.yaml").read_text().replace("name: tiny-a", "name: long-one")
    text = text.replace("steps: 60", "steps: 100000")
    p = tmp_path / "long.yaml"
    p.write_text(text)
    return p


def _sacct_names(since: str) -> list[str]:
    out = subprocess.run(["sacct", "-X", "-n", "-P", "-a", "-S", since, "-o", "JobName"], capture_output=True,  # noqa: S603
                         text=True, timeout=30, check=True).stdout
    return [n for n in out.splitlines() if n.startswith("dlrm-")]


@pytest.mark.torch  # its members really train (tiny-a specs)
def test_sweep_survives_kill_9_and_a_cancel(live, tmp_path):
    from slurm_dlrm.service.cancel import cancel_job
    from slurm_dlrm.service.daemon import running_pid
    from slurm_dlrm.service.sbatch_options import SbatchOptions
    from slurm_dlrm.service.submit import submit, wait_for_jobs
    from slurm_dlrm.store.acct import AcctFilter, acct_rows
    from slurm_dlrm.store.store import Store

    site, user, paths, cluster = live
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - 5))
    rng = random.Random(7)
    specs = [str(p) for p in sorted(EXAMPLES.glob("*.yaml"))[:8]] + [str(_long_spec(tmp_path))]
    pid = _start(paths)

    def kill_and_restart(pid: int) -> int:
        assert pid > 1
        os.kill(pid, signal.SIGKILL)
        gone = time.monotonic() + 10
        while running_pid(paths) is not None and time.monotonic() < gone:
            time.sleep(0.02)  # the kernel drops the lock with the process (a zombie holds none)
        return _start(paths)

    # Submit in three batches, each followed by a kill -9 while the service plans,
    # writes pack folders and runs sbatch; then more kills while it ingests reports.
    ids: list[int] = []
    kills = 0
    for batch in (specs[-1:] + specs[:2], specs[2:5], specs[5:8]):
        new, _ = submit(batch, SbatchOptions(), site=site, user=user, cwd=str(tmp_path))
        ids += new
        time.sleep(rng.uniform(0.05, 0.6))
        pid = kill_and_restart(pid)
        kills += 1
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline:
        time.sleep(rng.uniform(0.2, 1.5))
        pid = kill_and_restart(pid)
        kills += 1
    long_id = ids[0]
    with Store.for_user(site, user) as store:
        t_end = time.monotonic() + 120
        while store.get_job(long_id).state != "RUNNING" and time.monotonic() < t_end:
            time.sleep(0.5)
        assert store.get_job(long_id).state == "RUNNING"
        neighbours = [j.id for j in store.jobs(["PLANNED", "RUNNING"]) if j.pack_id == store.get_job(long_id).pack_id
                      and j.id != long_id]
        print(cancel_job(store, cluster.client(), long_id, user=user))
    jobs = wait_for_jobs(site, user, ids, poll_s=1.0, timeout_s=240)
    states = {j.id: str(j.state) for j in jobs}
    assert states == {**{i: "COMPLETED" for i in ids[1:]}, long_id: "CANCELLED"}, states
    with Store.for_user(site, user) as store:
        packs = store.packs()
        rows = {r["job_id"]: r for r in acct_rows(store, AcctFilter(job_ids=tuple(ids)))}
        done_events = store.conn.execute(
            "SELECT job_id, count(*) FROM events WHERE kind = 'job_state' AND to_state = 'COMPLETED' GROUP BY job_id"
        ).fetchall()
    # Packed: fewer GPUs than jobs.
    assert sum(p.n_gpus for p in packs if p.slurm_job_id) < len(ids)
    # No pack twice in Slurm, no Slurm job the store does not know, each job completed once.
    ours = {p.name for p in packs}
    names = [n for n in _sacct_names(since) if n in ours]
    assert len(names) == len(set(names)), names
    assert all(n == 1 for _, n in done_events) and len(done_events) == len(ids) - 1
    # The agents' samples reached the store; acct charges GPU-hours.
    assert all(rows[i]["n_samples"] > 0 for i in ids[1:])
    assert sum(r["gpu_hours"] for r in rows.values()) > 0
    print(f"kills={kills} packs={len(packs)} neighbours of the cancelled job={neighbours}")


def test_bad_partition_fails_members_with_slurms_message(live, tmp_path):
    from slurm_dlrm.service.sbatch_options import SbatchOptions
    from slurm_dlrm.service.submit import submit, wait_for_jobs

    site, user, paths, cluster = live
    _start(paths)
    ids, _ = submit([str(EXAMPLES / "tiny-a.yaml")], SbatchOptions(partition="nosuch"), site=site, user=user,
                    cwd=str(tmp_path))
    (job,) = wait_for_jobs(site, user, ids, poll_s=0.5, timeout_s=60)
    assert job.state == "FAILED"
    assert "invalid partition" in job.exit_reason.lower(), job.exit_reason
