"""A SIGKILL the agent did not send is not called an OOM kill unless the job cgroup's
memory.events says so (issue 32, also noticed): budget stops, cancels and the end of the
allocation have their own reasons; the rest is told apart by oom_kill."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from agent_harness import agent_options

from slurm_dlrm.agent import fences
from slurm_dlrm.agent.loop import Agent
from slurm_dlrm.agent.placement import parse_placement
from slurm_dlrm.agent.reaping import classify_exit
from slurm_dlrm.agent.reports import read_reports
from slurm_dlrm.emulated.standin import member_entry, placement_dict


def test_classify_a_sigkill_by_who_sent_it():
    assert classify_exit(-9, "OOM_HOST", False)[0] == "OOM_HOST"  # our budget stop
    assert classify_exit(-9, "CANCEL", False)[:2] == ("CANCELLED", 137)
    assert classify_exit(-9, "KILLED", False)[0] == "CANCELLED"  # our SIGKILL after term_grace_s
    state, _, oom = classify_exit(-9, None, False, oom_kills=1)
    assert state == "OOM_HOST"  # issue 43: retried with more host memory, not FAILED
    assert "OOM killer" in oom and "+1" in oom
    assert classify_exit(137, None, True, oom_kills=2)[0] == "OOM_HOST"  # srun's 128+9
    assert classify_exit(-9, None, False, oom_kills=0)[0] == "FAILED"
    assert classify_exit(-9, None, False)[0] == "FAILED"
    outside = classify_exit(137, None, True, oom_kills=0)[2]  # srun's 128+9
    assert "not the OOM killer" in outside
    unknown = classify_exit(-9, None, False)[2]
    assert "OOM killer sends" not in unknown and "no cgroup to tell" in unknown
    assert classify_exit(-15, None, False)[2] == "killed by SIGTERM"
    for r in (oom, outside, unknown):
        assert len(r) <= 120 and r.startswith("killed by SIGKILL")


def test_oom_cgroup_is_the_slurm_jobs_and_its_counter_is_read(tmp_path):
    job = tmp_path / "system.slice" / "slurmstepd.scope" / "job_77"
    (job / "step_0" / "user").mkdir(parents=True)
    (job / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 2\noom_kill 2\noom_group_kill 0\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/system.slice/slurmstepd.scope/job_77/step_0/user\n")
    assert fences.oom_cgroup(tmp_path, "77", str(proc)) == job
    assert fences.oom_cgroup(tmp_path, "78", str(proc)) == job / "step_0" / "user"  # not under a job: own
    assert fences.oom_kill_count(job) == 2
    assert fences.oom_kill_count(job / "step_0") is None  # no memory controller file
    proc.write_text("1:memory:/x\n")  # cgroup v1 only, and no such folder
    assert fences.oom_cgroup(tmp_path, "77", str(proc)) is None


def test_oom_cgroup_v1_sums_the_jobs_folders(tmp_path):
    # cgroup v1 (Slurm's cgroup/v1 layout): a kill counts only where the limit was hit
    job = tmp_path / "memory" / "slurm" / "uid_0" / "job_77"
    step = job / "step_batch"
    (step / "task_0").mkdir(parents=True)
    for folder, n in ((job, 0), (step, 1), (step / "task_0", 2)):
        (folder / "memory.oom_control").write_text(f"oom_kill_disable 0\nunder_oom 0\noom_kill {n}\n")
    proc = tmp_path / "cgroup"
    proc.write_text("12:pids:/x\n4:memory:/slurm/uid_0/job_77/step_batch/task_0\n0::/\n")  # hybrid: v2 has no memory
    assert fences.oom_cgroup(tmp_path, "77", str(proc)) == job
    assert fences.oom_kill_count(job) == 3
    assert fences.oom_cgroup(tmp_path, None, str(proc)) == step / "task_0"


@pytest.mark.parametrize("oom_killed", [True, False])
def test_an_outside_sigkill_is_reported_by_its_sender(agent_world, monkeypatch, oom_killed):
    own = Path(Path("/proc/self/cgroup").read_text().split("0::", 1)[1].splitlines()[0].strip().lstrip("/"))
    root = agent_world / "cgroup"
    events = root / own / "memory.events"
    events.parent.mkdir(parents=True, exist_ok=True)
    events.write_text("oom 0\noom_kill 3\n")
    monkeypatch.setenv(fences.ENV_CGROUP_ROOT, str(root))
    pack = agent_world / "pack"
    env_out = agent_world / "env-6"
    pd = placement_dict(pack, [member_entry(pack, 6, 0, args=["--steps", "2000", "--step-s", "0.05",
                                                                   "--env-out", str(env_out)])],
                        sample_interval_s=0.1)
    agent = Agent(parse_placement(pd), agent_options(agent_world, gpus=["0"]))

    def killer() -> None:
        deadline = time.monotonic() + 20
        while not env_out.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        if oom_killed:
            events.write_text("oom 1\noom_kill 4\n")  # the kernel's count, then its SIGKILL
        os.kill(json.loads(env_out.read_text())["pid"], signal.SIGKILL)

    t = threading.Thread(target=killer)
    t.start()
    agent.run()
    t.join()
    state = "OOM_HOST" if oom_killed else "FAILED"
    assert agent.job_states == {6: state}
    end = [r for r in read_reports(pack / "reports" / "n1.jsonl") if r["type"] == "member" and r["state"] == state]
    assert len(end) == 1
    if oom_killed:
        assert "the kernel OOM killer (cgroup oom_kill +1" in end[0]["reason"]
        assert "requeue" not in end[0]  # the OOM recovery raises its request instead
    else:
        assert "not the OOM killer" in end[0]["reason"]
        # it did not fail on its own: the service requeues it from its checkpoint (issue 49)
        assert end[0]["requeue"] is True
