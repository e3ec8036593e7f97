"""Issue 17 item 1: a pack left open in the store by a service that is gone (stopped,
killed) is settled by the commands that read the store, with Slurm's end time, so
`acct` an hour later charges what it charged when the pack ended."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from service_harness import FakeClock, FakeCluster, add_job, make_site

from slurm_dlrm.service.core import PackingService, ServiceSettings
from slurm_dlrm.service.reconcile import reconcile_orphan_packs
from slurm_dlrm.slurm.fake import FakeSlurm
from slurm_dlrm.store.acct import AcctFilter, acct_rows
from slurm_dlrm.store.states import JobState, PackState
from slurm_dlrm.store.store import Store, store_path_for

USER = "root"
HOUR = 3600.0


def _gpu_hours(store, ids, now):
    return sum(r["gpu_hours"] for r in acct_rows(store, AcctFilter(job_ids=tuple(ids)), now=now))


def _run_until_slurm_ends(tmp_path, accounting=True, end=True):
    """A service packs 3 jobs, the members run and report their ends, then the service
    stops (its last round saw the members end, not the pack); then Slurm ends the job."""
    clock = FakeClock()
    site = make_site(tmp_path)
    store = Store(store_path_for(site, USER), clock=clock)
    slurm = FakeSlurm(clock=clock, user=USER, accounting=accounting)
    svc = PackingService(store, slurm, site, ServiceSettings(user=USER, python="/venv/bin/python",
                                                            dispatch_window_s=0.0), clock=clock)
    cluster = FakeCluster(slurm, clock)
    ids = [add_job(store, f"j{i}") for i in range(3)]
    svc.run_round()
    cluster.tick()  # Slurm starts the pack, members RUNNING
    svc.run_round()
    clock.advance(50.0)
    (pack,) = store.packs()
    p = cluster.placement_of(int(pack.slurm_job_id))
    for m in p["members"]:
        cluster.member(p, m["job_id"], "COMPLETED", 0)
    svc.run_round()  # members COMPLETED; the pack still runs in Slurm (its agent is exiting)
    assert {store.get_job(i).state for i in ids} == {JobState.COMPLETED}
    assert store.get_pack(pack.id).state == PackState.RUNNING
    if end:
        clock.advance(2.0)
        slurm.finish(int(pack.slurm_job_id))  # ... and ends: no service round sees it
    return site, store, slurm, clock, ids, pack


def test_acct_an_hour_later_charges_up_to_slurms_end(tmp_path):
    site, store, slurm, clock, ids, pack = _run_until_slurm_ends(tmp_path)
    end = clock.now
    at_end = _gpu_hours(store, ids, end)
    assert at_end > 0
    clock.advance(HOUR)  # an hour later, the service long gone
    slurm.calls.clear()
    assert reconcile_orphan_packs(site, USER, slurm=slurm) == 1
    assert _gpu_hours(store, ids, clock.now) == pytest.approx(at_end, rel=1e-9)
    done = store.get_pack(pack.id)
    assert done.state == PackState.COMPLETED and done.end_time == pytest.approx(end)
    assert [c[0] for c in slurm.calls] == ["squeue"]  # one call for all packs
    assert reconcile_orphan_packs(site, USER, slurm=slurm) == 0  # nothing left to do, no Slurm call
    assert [c[0] for c in slurm.calls] == ["squeue"]


def test_a_purged_job_is_ended_by_sacct_or_else_at_the_last_sign_of_life(tmp_path):
    site, store, slurm, clock, ids, pack = _run_until_slurm_ends(tmp_path)
    end = clock.now
    slurm.purge(int(pack.slurm_job_id))  # gone from squeue (MinJobAge): sacct has its End
    clock.advance(HOUR)
    reconcile_orphan_packs(site, USER, slurm=slurm)
    assert store.get_pack(pack.id).end_time == pytest.approx(end, abs=1.0)  # sacct prints whole seconds

    site, store, slurm, clock, ids, pack = _run_until_slurm_ends(tmp_path / "noacct", accounting=False)
    at_end = _gpu_hours(store, ids, clock.now)
    slurm.purge(int(pack.slurm_job_id))
    clock.advance(HOUR)
    reconcile_orphan_packs(site, USER, slurm=slurm)
    done = store.get_pack(pack.id)
    assert done.state == PackState.COMPLETED and done.end_time <= clock.now - HOUR
    assert _gpu_hours(store, ids, clock.now) <= at_end


def test_a_running_pack_or_a_live_service_is_left_alone(tmp_path):
    site, store, slurm, clock, ids, pack = _run_until_slurm_ends(tmp_path)
    from slurm_dlrm.service.daemon import ServiceLock
    from slurm_dlrm.service.submit import service_paths

    with ServiceLock.acquire(service_paths(site, USER)):  # a service runs: it does this itself
        assert reconcile_orphan_packs(site, USER, slurm=slurm) == 0
    assert store.get_pack(pack.id).state == PackState.RUNNING


def test_a_pack_still_running_in_slurm_stays_running(tmp_path):
    site, store, slurm, clock, ids, pack = _run_until_slurm_ends(tmp_path)
    slurm.job(int(pack.slurm_job_id)).slurm_state = "RUNNING"  # not over yet after all
    slurm.job(int(pack.slurm_job_id)).end_time = None
    assert reconcile_orphan_packs(site, USER, slurm=slurm) == 0
    assert store.get_pack(pack.id).state == PackState.RUNNING


def test_an_idle_service_does_not_exit_while_its_pack_runs_in_slurm(tmp_path):
    """Every member ended, nothing pending: idle, but the pack's Slurm job still runs.
    The idle exit waits until a round saw it end."""
    import threading

    from slurm_dlrm.service.loop import LoopControl
    from slurm_dlrm.service.run import serve_forever

    site, store, slurm, clock, ids, pack = _run_until_slurm_ends(tmp_path, end=False)
    control = LoopControl()
    t = threading.Thread(target=serve_forever, args=(site, USER),
                         kwargs={"round_seconds": 0.1, "idle_exit_s": 0.2, "slurm": slurm, "control": control},
                         daemon=True)
    t.start()
    try:
        time.sleep(1.5)
        assert t.is_alive(), "the service exited with a pack still running in Slurm"
        slurm.finish(int(pack.slurm_job_id))
        t.join(timeout=10)
        assert not t.is_alive()
    finally:
        control.stop = True
        t.join(timeout=10)
    assert store.get_pack(pack.id).state == PackState.COMPLETED


# ---------------------------------------------------------------- on the local cluster


def _cli(env, *argv, timeout=120):
    return subprocess.run([sys.executable, "-m", "slurm_dlrm", *argv], capture_output=True, text=True,  # noqa: S603
                          env=env, timeout=timeout)


@pytest.mark.slurm
def test_killed_service_then_acct_an_hour_later_on_slurm(slurm_cluster, tmp_path):
    """The service is killed (-9) while its pack runs; the members finish, Slurm ends the
    job. `acct` (the command) settles the pack; an hour later the charge is the same."""
    from slurm_dlrm.service.daemon import running_pid
    from slurm_dlrm.service.demo import default_specs, demo_site, standin_specs
    from slurm_dlrm.service.submit import service_paths
    from slurm_dlrm.site import load_site
    from slurm_dlrm.slurm import SlurmClient
    from slurm_dlrm.store.store import current_user

    work = tmp_path / "run"
    work.mkdir(mode=0o700)
    site_path = demo_site(work)
    specs = standin_specs(default_specs(2), work, sys.executable, step_s=0.05)
    env = {**os.environ, "SLURM_DLRM_SITE": str(site_path), "SLURM_CONF": str(slurm_cluster.config.slurm_conf)}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)
    sub = _cli(env, "submit", "--parsable", *map(str, specs))
    assert sub.returncode == 0, sub.stderr
    ids = [int(x) for x in sub.stdout.split()]
    site, user = load_site(site_path), current_user()
    paths = service_paths(site, user)
    deadline = time.monotonic() + 180
    with Store.for_user(site, user, readonly=True) as store:
        while not store.packs([PackState.RUNNING], user=user):
            assert time.monotonic() < deadline, "the pack did not start"
            time.sleep(0.5)
        (pack,) = store.packs([PackState.RUNNING], user=user)
    pid = running_pid(paths)
    assert pid and pid > 0
    os.kill(pid, signal.SIGKILL)
    slurm = SlurmClient(slurm_cluster.config.slurm_conf)
    while any(i.name == pack.name and not i.state.is_terminal for i in slurm.squeue(user=user)):
        assert time.monotonic() < deadline, "the pack did not end"
        time.sleep(0.5)
    while running_pid(paths) is not None:
        time.sleep(0.1)
    acct = _cli(env, "acct", "--json", "-j", ",".join(map(str, ids)))
    assert acct.returncode == 0, acct.stderr
    with Store.for_user(site, user, readonly=True) as store:
        done = store.get_pack(pack.id)
        assert done.state == PackState.COMPLETED, done
        assert {store.get_job(i).state for i in ids} == {JobState.COMPLETED}
        now = time.time()
        assert done.end_time <= now
        assert _gpu_hours(store, ids, now + HOUR) == pytest.approx(_gpu_hours(store, ids, now), rel=1e-9)
        assert _gpu_hours(store, ids, now) < (done.end_time - done.start_time) * done.n_gpus / HOUR + 1e-9


@pytest.mark.slurm
def test_demo_then_acct_an_hour_later_prints_the_same_gpu_hours(slurm_cluster, tmp_path):
    """Issue 17 target: the demo (stand-in members, 3 specs) ends with its packs final
    in the store, says the cluster is still running and how to stop it (item 6), and
    acct an hour later charges what the demo printed."""
    import re

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    env.pop("SLURM_DLRM_SITE", None)
    proc = _cli(env, "demo", "--standin", "-n", "3", "--no-report", "--round-seconds", "1",
                "--workdir", str(tmp_path / "demo"), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert "still running" in lines[-1] and "slurm-dlrm cluster down" in lines[-1]
    printed = float(re.search(r"GPU-hours used: ([0-9.]+)", proc.stdout).group(1))
    site_file = re.search(r"SLURM_DLRM_SITE=(\S+)\)", proc.stdout).group(1)
    from slurm_dlrm.site import load_site
    from slurm_dlrm.store.store import current_user

    site, user = load_site(site_file), current_user()
    with Store.for_user(site, user, readonly=True) as store:
        assert {p.state for p in store.packs(user=user)} == {PackState.COMPLETED}
        ids = [j.id for j in store.jobs(user=user)]
        later = _gpu_hours(store, ids, time.time() + HOUR)
    assert later == pytest.approx(printed, abs=5e-5)  # the demo prints 4 decimals
    env["SLURM_DLRM_SITE"] = site_file
    acct = _cli(env, "acct", "--json", "-o", "JobID,GPUHours")
    assert acct.returncode == 0, acct.stderr
    import json

    rows = json.loads(acct.stdout)  # each row's GPUHours is rounded to 4 decimals
    assert sum(r["GPUHours"] for r in rows) == pytest.approx(printed, abs=5e-5 * (1 + len(rows)))


def test_a_no_pack_job_of_a_service_that_is_gone_is_settled_by_the_readers(tmp_path):
    from slurm_dlrm.service.native import record_and_submit
    from slurm_dlrm.service.sbatch_options import SbatchOptions
    from slurm_dlrm.service.submit import native_request, prepare

    site = make_site(tmp_path)
    store = Store(store_path_for(site, USER))
    slurm = FakeSlurm(user=USER)
    (sub,) = prepare([str(Path(__file__).resolve().parent.parent / "examples" / "sweep" / "tiny-a.yaml")],
                     SbatchOptions(partition="dlrm"), site, str(tmp_path))
    (res,) = record_and_submit(store, slurm, [(sub, native_request(sub, site))], user=USER, site=site,
                               spool_dir=site.spool_dir_for(USER), python="/py")
    slurm.start(res.slurm_job_id, gpu_idx="3")
    slurm.finish(res.slurm_job_id, 1)  # no service round saw it
    reconcile_orphan_packs(site, USER, slurm=slurm)
    job = store.get_job(res.job_id)
    assert job.state == JobState.FAILED and job.exit_code == 1 and job.start_time is not None
    assert "Slurm: FAILED, exit code 1" in job.exit_reason
    store.close()
