"""A member the kernel's OOM killer kills is OOM_HOST and retried with more host memory
(issue 43 item 1), end to end with the real agent and the real OOM killer.

The local Slurm cluster does not constrain RAM (templates/localcluster/slurm.conf.j2:
TaskPlugin=task/none, ProctrackType=proctrack/linuxproc; this host's memory controller
is on a cgroup v1 hierarchy), so Slurm never OOM-kills there. This test plays Slurm's
task/cgroup `ConstrainRAMSpace` itself: each pack's agent runs in a memory cgroup the
test makes (v2 where the root enables the memory controller, else v1), limited to the
pack script's `--mem`, the way slurmstepd puts a job's steps in its job cgroup; the
kernel does the killing and counts it (memory.events on v2, memory.oom_control on v1). The service runs on FakeSlurm.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from service_harness import FakeClock, estimate_dict, make_site, spec_dict

from slurm_dlrm.agent import fences
from slurm_dlrm.emulated import nvml as fake_nvml
from slurm_dlrm.packing.model import AGENT_MEM_MIB
from slurm_dlrm.service.core import PackingService, ServiceSettings
from slurm_dlrm.service.queue import job_details
from slurm_dlrm.slurm.fake import FakeSlurm
from slurm_dlrm.store.states import JobState
from slurm_dlrm.store.store import Store

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
USER = "root"
HOST_EST_GIB = 1.5  # the retry's 10% raise (decide_after_oom) must cover the overshoot below


def _memory_parent() -> tuple[str, Path] | None:
    """Where this test can make a memory-limited cgroup: under the cgroup v2 root where
    its memory controller is enabled for children (a systemd host, as root), else under
    this process's cgroup v1 memory folder (hybrid hosts such as this project's)."""
    v2 = Path("/sys/fs/cgroup")
    with contextlib.suppress(OSError):
        if "memory" in (v2 / "cgroup.subtree_control").read_text().split() and os.access(v2, os.W_OK):
            return "v2", v2
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if "memory" in controllers.split(","):
            folder = Path("/sys/fs/cgroup/memory") / path.strip().lstrip("/")
            if (folder / "memory.limit_in_bytes").exists() and os.access(folder, os.W_OK):
                return "v1", folder
    return None


@contextlib.contextmanager
def memory_cgroup(limit_mib: int):
    found = _memory_parent()
    assert found is not None
    version, parent = found
    folder = parent / f"slurm-dlrm-test-{os.getpid()}-{time.monotonic_ns()}"
    folder.mkdir()
    try:
        limits = (("memory.max", "memory.swap.max") if version == "v2"
                  else ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"))
        (folder / limits[0]).write_text(str(limit_mib * MIB))
        swap = folder / limits[1]
        if swap.exists():  # no swapping out of the limit where swap exists
            swap.write_text("0" if version == "v2" else str(limit_mib * MIB))
        yield folder
    finally:
        for _ in range(50):  # empty once its last process is reaped
            try:
                folder.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def run_agent_in(cgroup: Path, placement: Path, env: dict[str, str]) -> None:
    """The pack's agent as slurmstepd would start it, inside the job's memory cgroup."""
    argv = [sys.executable, "-m", "slurm_dlrm", "agent", "--pack-file", str(placement), "--launch", "process",
            "--mps", "off", "--gpus", "0", "--node-index", "0", "--node-name", "node1"]
    proc = subprocess.Popen(  # noqa: S603 - fixed argv
        ["/bin/sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(cgroup), *argv], env=env)
    assert proc.wait(timeout=120) == 0


needs_cgroup = pytest.mark.skipif(
    _memory_parent() is None, reason="needs root and a cgroup memory controller (v2 root or v1) to make a limited cgroup")


@needs_cgroup
def test_a_member_the_kernel_oom_kills_is_retried_with_more_memory_and_completes(tmp_path):
    clock = FakeClock()
    site = make_site(tmp_path, refill_headroom_pct=0)  # --mem: the member's limit + the agent's share
    # a site whose agent lets a member run 60% over its share before stopping it itself:
    # the job cgroup's limit (Slurm's --mem) is what stops this one
    site = replace(site, agent=replace(site.agent, host_mem_tolerance_pct=60.0, sample_interval_s=0.2))
    store = Store(tmp_path / "store.sqlite", clock=clock)
    slurm = FakeSlurm(clock=clock, user=USER)
    svc = PackingService(store, slurm, site, ServiceSettings(user=USER, python=sys.executable, dispatch_window_s=0.0),
                         clock=clock)
    scenario = tmp_path / "nvml.json"
    scenario.write_text(json.dumps({"gpu_count": 1}))
    env = {**os.environ, "PYTHONPATH": str(ROOT), fake_nvml.ENV_FAKE_NVML: str(scenario), "TMPDIR": str(tmp_path)}
    env.pop("SLURM_JOB_ID", None)

    def pack_mem_mib() -> int:
        packs = [p for p in store.packs() if p.state.name in ("QUEUED", "SUBMITTING")]
        assert len(packs) == 1, packs
        m = re.search(r"^#SBATCH --mem=(\d+)M$", slurm.job(int(packs[0].slurm_job_id)).script, re.M)
        assert m
        return int(m.group(1))

    # --mem of the first pack: the member's host share (estimate + 5% margin, in whole MiB
    # rounded up as Slurm is asked for it) + the agent's
    share = math.ceil(HOST_EST_GIB * (1 << 30) * (1 + site.packing.memory_margin_pct / 100))
    mem1 = -(-share // MIB) + AGENT_MEM_MIB
    # The member's peak: about 80 MiB past that together with the agent (~60 MiB) and its
    # own interpreter (~20 MiB); the retry's raise is >= 10% of its 1.5 GiB share
    # (decide_after_oom, ~160 MiB), so it fits the second --mem.
    spec = dict(spec_dict("hungry", steps=12), command=[
        sys.executable, "-m", "slurm_dlrm.emulated.standin", "--steps", "12", "--step-s", "0.05",
        "--peak-mib", str(mem1), "--peak-at-step", "6", "--checkpoint-every", "2"])
    jid = store.add_job(user=USER, name="hungry", spec=spec, spec_fingerprint="fp-hungry",
                        estimate=estimate_dict(host_gib=HOST_EST_GIB), gpu_model="h100")
    svc.run_round()
    assert pack_mem_mib() == mem1

    kills = []
    for attempt in range(2):
        (pack,) = [p for p in store.packs() if p.state.name == "QUEUED"]
        sid = int(pack.slurm_job_id)
        slurm.start(sid)
        with memory_cgroup(pack_mem_mib()) as cg:
            run_agent_in(cg, Path(pack.pack_dir) / "placement.json", env)
            kills.append(fences.oom_kill_count(cg))  # the agent's own reading
        slurm.finish(sid)
        clock.advance(5.0)
        svc.run_round()
        job = store.get_job(jid)
        if attempt == 0:
            assert kills[0] == 1, kills  # the kernel killed it, not the agent
            # before: FAILED "killed by SIGKILL: the kernel OOM killer ...", never retried
            assert job.attempt == 1 and job.state == JobState.PLANNED, (job.state, job.reason)
            assert job.host_mem_request_bytes > job.est_host_peak_bytes
            assert pack_mem_mib() > mem1  # the retry's pack asks Slurm for more
    assert job.state == JobState.COMPLETED, (job.state, job.reason)
    assert kills[1] == 0, kills
    d = job_details(store, jid, user=USER, service={})
    events = " | ".join(e["reason"] for e in d["events"])
    assert "the kernel OOM killer" in events and "out of host memory" in events, events
    first, second = sorted(d["placements"], key=lambda p: p["attempt"])
    assert second["host_mem_limit_mib"] > first["host_mem_limit_mib"]
    assert d["host_mem_request_mib"] * MIB == job.host_mem_request_bytes // MIB * MIB > HOST_EST_GIB * (1 << 30)
