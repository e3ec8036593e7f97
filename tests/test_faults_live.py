"""Recovery on the local Slurm cluster: the packing service (in this process, rounds every
0.5 s) with stand-in members (slurm_dlrm/emulated/standin/, no torch) under the real agent.

- A member that grows past its host budget is stopped by the agent (OOM_HOST), requeued
  with a raise from its measured peak, resumes from its checkpoint and completes; its
  neighbour in the same pack is untouched.
- A slurmd killed mid-pack together with the pack's processes on its node (a node crash;
  the slurmd is restarted after): the silent agent's heartbeat deadline ends the pack
  LOST, the unfinished members resume from their checkpoints in a new pack and complete;
  the member that had finished is not rerun.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
STANDIN = ["-m", "slurm_dlrm.emulated.standin"]
pytestmark = pytest.mark.slurm
MIB = 1 << 20


@pytest.fixture
def live(slurm_cluster, tmp_path):
    from slurm_dlrm.service.core import PackingService, ServiceSettings
    from slurm_dlrm.site import REPO_SITE_FILE, parse_site
    from slurm_dlrm.store.store import Store, current_user

    data = tomllib.loads(REPO_SITE_FILE.read_text())
    data["site"]["store_dir"] = str(tmp_path / "store-{user}")
    data["site"]["spool_dir"] = str(tmp_path / "spool-{user}")
    # Heartbeats come every 10 s (the agent's max(10, timeout / 4)), the first one after the
    # agent's start-up: a 30 s deadline misses none and still ends a dead pack quickly.
    data["agent"].update(sample_interval_s=0.5, heartbeat_timeout_s=30.0, term_grace_s=10.0)
    site = parse_site(data, "faults-live")
    store = Store(tmp_path / "store.sqlite")
    user = current_user()
    svc = PackingService(store, slurm_cluster.client(), site,
                         ServiceSettings(user=user, python=sys.executable, max_attempts=4))
    yield svc, store, slurm_cluster
    ids = [int(p.slurm_job_id) for p in store.packs(["SUBMITTING", "QUEUED", "RUNNING"]) if p.slurm_job_id]
    if ids:
        slurm_cluster.client().scancel(ids)
    store.close()


def add_standin(store, user: str, name: str, args: list[str], host_mib: int = 64) -> int:
    spec = {"name": name, "tables": [{"name": "t0", "rows": 100, "dim": 8}], "dense_features": 4,
            "bottom_mlp": [8], "top_mlp": [8, 1], "batch_size": 16, "steps": 100,
            "command": [sys.executable, *STANDIN, *args]}
    est = {"gpu_peak_bytes": 1 << 30, "host_peak_bytes": host_mib * MIB,
           "gpu_breakdown": {"embeddings": (1 << 30) - 600 * MIB, "cuda_context": 600 * MIB},
           "host_breakdown": {"python": host_mib * MIB},
           "profile": {"sm_util_pct": 10.0, "membw_util_pct": 10.0, "host_cpu_cores": 1.0,
                       "label": "compute-bound", "solo_samples_per_s": 20000.0}}
    return int(store.add_job(user=user, name=name, spec=spec, spec_fingerprint=f"fp-{name}", estimate=est,
                             gpu_model="h100"))


def run_until(svc, cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        svc.run_round()
        if cond():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def metrics(svc, job_id: int) -> list[tuple[float, int]]:
    path = svc.spool_dir / "jobs" / str(job_id) / "metrics.jsonl"
    if not path.exists():
        return []
    return [(float(r["t"]), int(r["step"])) for r in map(json.loads, path.read_text().splitlines())]


def metrics_steps(svc, job_id: int) -> list[int]:
    return [step for _, step in metrics(svc, job_id)]


def runs(svc, job_id: int, gap_s: float = 2.0) -> list[list[int]]:
    """The job's steps split into runs: a new run starts where the step goes back, where
    the metrics stop for `gap_s`, or at a later placement's start (a member stopped by
    SIGTERM checkpoints its current step, so a quick requeue resumes at the next step)."""
    starts = sorted(p.start_time for p in svc.store.placements(job_id=job_id) if p.start_time)[1:]
    out: list[list[int]] = []
    last_t = last_step = None
    for t, step in metrics(svc, job_id):
        restarted = last_t is not None and any(last_t < s <= t for s in starts)
        if last_t is None or step <= last_step or t - last_t > gap_s or restarted:
            out.append([])
        out[-1].append(step)
        last_t, last_step = t, step
    return out


def assert_resumed(svc, job_id: int, checkpoint_every: int, steps: int) -> None:
    r = runs(svc, job_id)
    assert len(r) >= 2, r
    for before, after in zip(r, r[1:], strict=False):
        # Picked up after a checkpoint, never beyond the step the previous run reached.
        assert checkpoint_every < after[0] <= before[-1] + 1, (before[-3:], after[:3])
    assert r[-1][-1] == steps


def test_member_over_its_memory_is_requeued_and_completes_neighbour_untouched(live):
    svc, store, cluster = live
    user = svc.settings.user
    # ~30 MiB of Python, then 8 MiB per step: passes its 260 MiB (+5% margin, +10% tolerance)
    # around step 30 of 40; a checkpoint every 5 steps.
    hog = add_standin(store, user, "hog", ["--steps", "40", "--step-s", "0.25", "--grow-mib-per-step", "8",
                                           "--checkpoint-every", "5"], host_mib=260)
    calm = add_standin(store, user, "calm", ["--steps", "50", "--step-s", "0.25", "--checkpoint-every", "5"])
    run_until(svc, lambda: all(store.get_job(j).state in ("COMPLETED", "FAILED", "CANCELLED", "OOM")
                               for j in (hog, calm)), 150, "both jobs to end")
    h, c = store.get_job(hog), store.get_job(calm)
    assert (h.state, c.state) == ("COMPLETED", "COMPLETED"), (h.exit_reason, c.exit_reason)
    assert h.attempt >= 1 and c.attempt == 0  # the neighbour ran once, start to end
    first, *later = sorted((p for p in store.placements(job_id=hog)), key=lambda p: p.id)
    assert later and later[-1].host_mem_limit_bytes > first.host_mem_limit_bytes  # raised
    reasons = [e["reason"] for e in store.events(job_id=hog)]
    assert any("out of host memory" in r and "resumes from its checkpoint" in r for r in reasons), reasons
    assert store.events(kind="learned")
    assert [p.pack_id for p in store.placements(job_id=calm)] == [first.pack_id]  # same pack, one run
    assert metrics_steps(svc, calm) == list(range(1, 51))
    assert_resumed(svc, hog, 5, 40)


def _kill_node(cluster, node: str, slurm_job_id: str) -> None:
    """A node crash: its slurmd and every process of the pack's steps on it die at once."""
    import psutil

    from slurm_dlrm.localcluster.processes import is_ours

    pid_file = cluster.config.run_dir / f"slurmd-{node}.pid"
    slurmd = int(pid_file.read_text().split()[0])
    victims = [psutil.Process(slurmd)]
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        # Job ids restart at 1 in every cluster: another instance on this host (another
        # checkout, a chroot) may run a job with the same id. Only this cluster's.
        if cmd.startswith(f"slurmstepd: [{slurm_job_id}.") and is_ours(p.pid, cluster.config.state_dir):
            victims.append(p)
            victims += p.children(recursive=True)
    assert len(victims) > 1, f"no slurmstepd of job {slurm_job_id} found on {node}"
    for p in victims:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


def test_node_crash_mid_pack_members_resume_from_checkpoints(live):
    svc, store, cluster = live
    user = svc.settings.user
    long_args = ["--steps", "300", "--step-s", "0.1", "--checkpoint-every", "20"]
    a = add_standin(store, user, "long-a", long_args)
    b = add_standin(store, user, "long-b", long_args)
    quick = add_standin(store, user, "quick", ["--steps", "5", "--step-s", "0.1"])
    run_until(svc, lambda: store.get_job(quick).state == "COMPLETED"
              and all(len(metrics_steps(svc, j)) >= 60 for j in (a, b)), 90,
              "the quick member to finish and the long ones to pass step 60")
    pack = store.get_pack(store.get_job(a).pack_id)
    assert store.get_job(b).pack_id == pack.id == store.get_job(quick).pack_id
    node = (pack.nodes or "").split(",")[0]
    assert node, pack
    _kill_node(cluster.cluster, node, pack.slurm_job_id)
    try:
        run_until(svc, lambda: store.get_pack(pack.id).state in ("LOST", "FAILED"), 60, "the pack to be declared lost")
    finally:
        cluster.cluster.up(wait_s=60)  # the slurmd back (ReturnToService=2)
    run_until(svc, lambda: all(store.get_job(j).state in ("COMPLETED", "FAILED", "CANCELLED", "OOM") for j in (a, b)),
              120, "the long members to finish")
    for j in (a, b):
        job = store.get_job(j)
        assert job.state == "COMPLETED" and job.attempt == 1, job.exit_reason
        assert job.pack_id != pack.id
        assert_resumed(svc, j, 20, 300)
    q = store.get_job(quick)
    assert q.attempt == 0 and [p.pack_id for p in store.placements(job_id=quick)] == [pack.id]  # not rerun
    why = [e["reason"] for e in store.events(pack_id=pack.id)]
    assert any("no agent heartbeat" in r or "NODE_FAIL" in r for r in why), why
    assert os.path.exists(Path(pack.pack_dir) / "cancel" / str(a))  # the old run was fenced
