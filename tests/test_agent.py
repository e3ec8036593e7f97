"""The agent loop with stand-in members, the fake NVML and the fake MPS control daemon."""

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from agent_harness import agent_options
from click.testing import CliRunner

from slurm_dlrm.agent.launch import member_env, step_argv
from slurm_dlrm.agent.loop import Agent
from slurm_dlrm.agent.mps import MpsDaemon, MpsSetup
from slurm_dlrm.agent.placement import parse_placement
from slurm_dlrm.agent.procstat import MetricsTail, TreeSampler
from slurm_dlrm.agent.reaping import classify_exit
from slurm_dlrm.agent.reports import ReportWriter, read_reports
from slurm_dlrm.cli import cli
from slurm_dlrm.emulated.standin import member_entry, placement_dict
from slurm_dlrm.errors import BadInput

SAMPLE_KEYS = {"type", "t", "pack_id", "job_id", "node", "gpu_index", "sm_util_pct", "mem_util_pct",
               "gpu_mem_bytes", "host_cpu_pct", "rss_bytes", "samples_per_s"}


# ------------------------------------------------------------------ pure parts

def test_placement_validation_names_the_field(tmp_path):
    good = placement_dict(tmp_path, [member_entry(tmp_path, 1, 0)])
    p = parse_placement(good)
    assert p.members[0].command[1:3] == ("-m", "slurm_dlrm.emulated.standin")
    for mutate, field in [
        (lambda d: d["members"][0].pop("gpu_mem_limit_mib"), "members[0].gpu_mem_limit_mib: missing"),
        (lambda d: d["members"][0].update(mps_thread_pct=150), "members[0].mps_thread_pct"),
        (lambda d: d["members"][0].update(command=[]), "members[0].command"),
        (lambda d: d.update(sample_interval_s="2"), "sample_interval_s"),
        (lambda d: d["members"].append(dict(d["members"][0])), "appears twice"),
    ]:
        d = json.loads(json.dumps(good))
        mutate(d)
        with pytest.raises(BadInput, match=field.replace("[", r"\[").replace("]", r"\]")):
            parse_placement(d)


def test_member_env_per_mps_mode(tmp_path):
    m = parse_placement(placement_dict(tmp_path, [member_entry(tmp_path, 12, 1, gpu_mem_limit_mib=3000,
                                                               mps_thread_pct=40)])).members[0]
    base = {"PATH": "/bin", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"}
    daemon = MpsDaemon(tmp_path / "pipe", tmp_path / "log", "x", owned=True)
    own = member_env(base, m, ["5", "7"], MpsSetup("own", daemon, ""))
    assert own["CUDA_VISIBLE_DEVICES"] == "1"  # renumbered by our daemon, which sees 5,7 only
    assert own["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
    assert own["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=3000M"
    assert own["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "pipe")
    assert own["SLURM_DLRM_JOB_ID"] == "12" and own["SLURM_DLRM_METRICS_FILE"].endswith("job-12/metrics.jsonl")
    assert own["SLURM_DLRM_CHECKPOINT_DIR"].endswith("job-12/ckpt") and own["PATH"] == "/bin"
    site = member_env(base, m, ["5", "7"], MpsSetup("site", MpsDaemon(tmp_path, tmp_path, "x", False), ""))
    assert site["CUDA_VISIBLE_DEVICES"] == "7" and site["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
    off = member_env(base, m, ["5", "7"], MpsSetup("off", None, ""))
    assert off["CUDA_VISIBLE_DEVICES"] == "7"
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in off and "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in off
    with pytest.raises(ValueError, match="gpu_index 1"):
        member_env(base, m, ["5"], MpsSetup("off", None, ""))


def test_step_argv_runs_the_member_as_an_overlapping_step(tmp_path):
    m = parse_placement(placement_dict(tmp_path, [member_entry(tmp_path, 3, 0)])).members[0]
    env = {"CUDA_VISIBLE_DEVICES": "0", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=3000M", "HOME": "/x"}
    argv = step_argv(m, env, "node2", tmp_path / "p.pid", "/py")
    assert argv[:2] == ["srun", "--overlap"]
    assert "--ntasks=1" in argv and "--nodelist=node2" in argv and "--job-name=standin-3" in argv
    cut = argv.index("--")
    assert argv[cut + 1:] == list(m.command)
    assert "--setenv" in argv and "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=3000M" in argv and "HOME=/x" not in argv


@pytest.mark.parametrize("rc,stop,srun,state,code", [
    (0, None, False, "COMPLETED", 0),
    (3, None, False, "OOM_GPU", 3),
    (4, None, False, "OOM_HOST", 4),
    (5, "TERM", False, "PREEMPTED", 5),
    (-9, "OOM_HOST", False, "OOM_HOST", 137),
    (137, "OOM_HOST", True, "OOM_HOST", 137),
    (-9, "KILLED", False, "CANCELLED", 137),
    (-15, "TERM", False, "CANCELLED", 143),
    (-9, None, False, "FAILED", 137),
    (2, None, False, "FAILED", 2),
    (1, None, True, "FAILED", 1),
])
def test_classify_exit(rc, stop, srun, state, code):
    assert classify_exit(rc, stop, srun)[:2] == (state, code)


def test_metrics_tail_reads_only_what_is_new(tmp_path):
    path = tmp_path / "m.jsonl"
    tail = MetricsTail(path, max_back_bytes=4096)
    assert tail.poll() is None  # no file yet
    with open(path, "w") as f:
        for i in range(20000):  # ~1 MB written before the first look
            f.write(json.dumps({"step": i, "samples_per_s": float(i)}) + "\n")
    assert tail.poll()["step"] == 19999
    assert tail.bytes_read <= 4096  # the tail, never the whole file
    with open(path, "a") as f:
        f.write(json.dumps({"step": 20000, "samples_per_s": 5.0}) + "\n" + '{"step": 20001, "sam')
    assert tail.poll()["step"] == 20000  # the half-written line waits
    with open(path, "a") as f:
        f.write('ples_per_s": 6.5}\n')
    assert tail.samples_per_s(stale_after_s=60) == 6.5
    path.write_text(json.dumps({"step": 1, "samples_per_s": 1.0}) + "\n")  # truncated and rewritten
    assert tail.poll()["step"] == 1
    time.sleep(0.01)
    assert tail.samples_per_s(stale_after_s=0.005) is None  # too old to stand for the present


def test_report_batches_are_complete_lines(tmp_path):
    w = ReportWriter(tmp_path / "pack", "node/1", 7, clock=lambda: 1.5)
    w.sample(None, 0, sm_util_pct=1.0)
    w.member(3, "RUNNING")
    assert w.path.name == "node_1.jsonl" and w.path.read_bytes() == b""  # nothing until the batch ends
    w.flush()
    w.heartbeat()
    w.close()
    assert oct(w.path.parent.stat().st_mode & 0o777) == "0o700"
    recs = read_reports(w.path)
    assert [r["type"] for r in recs] == ["sample", "member", "heartbeat"]
    assert set(recs[0]) == SAMPLE_KEYS and recs[0]["job_id"] is None and recs[0]["rss_bytes"] is None
    with open(w.path, "ab") as f:
        f.write(b'{"type": "sample", "t"')  # a writer mid-line: not a record yet
    assert len(read_reports(w.path)) == 3


def test_a_failed_batch_is_kept_and_written_later(tmp_path, monkeypatch):
    w = ReportWriter(tmp_path / "pack", "n1", 7)
    w.heartbeat()
    real_write = os.write
    calls = []

    def full_disk(fd, data):
        calls.append(len(data))
        if len(calls) == 1:
            raise OSError(28, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full_disk)
    assert w.flush() is False and w.pending == 1
    w.member(3, "COMPLETED", 0)
    assert w.flush() is True and w.pending == 0
    w.close()
    assert [r["type"] for r in read_reports(w.path)] == ["heartbeat", "member"]


def test_a_zombie_member_is_not_sampled():
    # Exited but not yet reaped, a process shows RSS 0 in /proc: a sample of it would
    # report a member with no memory. The sampler treats it as gone.
    import psutil

    sampler = TreeSampler()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    try:
        deadline = time.monotonic() + 10
        live = sampler.sample(child.pid)
        while live is None or live.rss_bytes <= 1 << 20:  # until the interpreter is up
            assert time.monotonic() < deadline
            time.sleep(0.02)
            live = sampler.sample(child.pid)
        while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert sampler.sample(child.pid) is None
    finally:
        child.wait()


def test_a_member_that_exits_between_its_status_and_memory_reads_is_not_sampled(monkeypatch):
    # The race under load (full suite beside two Slurm legs): the status read says running,
    # the process exits, its memory reads 0 pages; a sample said "rss_bytes 0".
    import psutil

    sampler = TreeSampler()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        assert sampler.sample(child.pid) is not None
        gone = psutil.Process(child.pid).memory_info()._replace(rss=0)
        real = psutil.Process.memory_info

        def memory_info(self):
            return gone

        # psutil's oneshot() turns the method's cache on and off through these
        memory_info.cache_activate = real.cache_activate  # type: ignore[attr-defined]
        memory_info.cache_deactivate = real.cache_deactivate  # type: ignore[attr-defined]
        monkeypatch.setattr(psutil.Process, "memory_info", memory_info)
        assert sampler.sample(child.pid) is None
    finally:
        child.kill()
        child.wait()


# ------------------------------------------------------------------ the loop

def test_pack_runs_members_enforces_and_reports(agent_world):
    pack = agent_world / "pack"
    members = [
        member_entry(pack, 1, 0, args=["--steps", "25", "--step-s", "0.08", "--env-out", str(agent_world / "env1.json")]),
        member_entry(pack, 2, 1, host_mem_limit_mib=120, args=["--steps", "200", "--step-s", "0.08",
                                                                 "--grow-mib-per-step", "16"]),
        member_entry(pack, 3, 0, args=["--steps", "3", "--step-s", "0.05", "--exit-code", "3"]),
        member_entry(pack, 4, 1, args=["--steps", "25", "--step-s", "0.08", "--busy",
                                       "--env-out", str(agent_world / "env4.json")]),
        member_entry(pack, 5, 5, args=["--steps", "1"]),  # names a GPU the node does not have
    ]
    placement = parse_placement(placement_dict(pack, members, sample_interval_s=0.15))
    agent = Agent(placement, agent_options(agent_world))
    t0 = time.monotonic()
    assert agent.run() == 0
    assert time.monotonic() - t0 < 20
    states = {m.placement.job_id: m.state for m in agent.members}
    assert states == {1: "COMPLETED", 2: "OOM_HOST", 3: "OOM_GPU", 4: "COMPLETED", 5: "FAILED"}
    assert (pack / "job-1" / "ckpt" / "checkpoint.json").exists()

    env1 = json.loads((agent_world / "env1.json").read_text())["env"]
    env4 = json.loads((agent_world / "env4.json").read_text())["env"]
    assert env1["CUDA_VISIBLE_DEVICES"] == "0" and env4["CUDA_VISIBLE_DEVICES"] == "1"
    assert env1["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=3000M" and env1["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    assert env1["SLURM_DLRM_JOB_ID"] == "1" and env4["SLURM_DLRM_METRICS_FILE"] == members[3]["metrics_path"]
    assert env1["CUDA_MPS_PIPE_DIRECTORY"] == env4["CUDA_MPS_PIPE_DIRECTORY"]
    assert not Path(env1["CUDA_MPS_PIPE_DIRECTORY"]).exists()  # daemon quit, folders removed

    recs = read_reports(agent.reports.path)
    assert recs[0]["type"] == "agent" and recs[0]["event"] == "start"
    assert recs[-1]["type"] == "agent" and recs[-1]["event"] == "exit"
    events = [r["event"] for r in recs if r["type"] == "agent"]
    # fence_env_only: on an MPS v2 node the fence is the members' own environment (issue 22)
    assert events == ["start", "mps_started", "fence_env_only", "closed", "mps_stopped", "exit"]
    assert any(r["type"] == "heartbeat" for r in recs)
    finals = {r["job_id"]: r for r in recs if r["type"] == "member" and r["state"] != "RUNNING"}
    assert finals[2]["state"] == "OOM_HOST" and "host RSS" in finals[2]["reason"] and finals[2]["exit_code"] == 137
    assert finals[3]["exit_code"] == 3 and "gpu_index 5" in finals[5]["reason"]
    samples = [r for r in recs if r["type"] == "sample"]
    assert all(SAMPLE_KEYS <= set(r) for r in samples)
    gpu_rows = [r for r in samples if r["job_id"] is None]
    assert {r["gpu_index"] for r in gpu_rows} == {0, 1} and all(r["gpu_mem_bytes"] for r in gpu_rows)
    # A spinning member shows up as CPU, a sleeping one hardly. The first sample of each
    # is dropped (interpreter start-up is CPU for both); medians, not means, so one
    # descheduled interval on a loaded box does not decide; bounds an idle process
    # (sleeping 0.08 s per step) cannot reach, while a spinner gets them even at a
    # small share of a busy CPU.
    busy = [r["host_cpu_pct"] for r in samples if r["job_id"] == 4 and r["host_cpu_pct"] is not None][1:]
    idle = [r["host_cpu_pct"] for r in samples if r["job_id"] == 1 and r["host_cpu_pct"] is not None][1:]
    assert busy and idle, (busy, idle)
    assert max(busy) > 15 and statistics.median(busy) > max(5.0, 2 * statistics.median(idle)), (busy, idle)
    m1 = [r for r in samples if r["job_id"] == 1]
    # (the first sample may catch the member at its exec, before the interpreter is mapped)
    assert any(r["samples_per_s"] for r in m1) and all(r["rss_bytes"] > 1 << 20 for r in m1[1:]), \
        [r["rss_bytes"] for r in m1]
    # The fake NVML saw member 1 as a GPU client (its RSS as GPU memory).
    assert any(r["gpu_mem_bytes"] and r["gpu_mem_bytes"] > 1 << 20 for r in m1)


def test_without_mps_gpu_memory_is_fenced_by_the_agent(agent_world):
    pack = agent_world / "pack"
    members = [member_entry(pack, 1, 0, gpu_mem_limit_mib=40, args=["--steps", "200", "--step-s", "0.05",
                                                                    "--grow-mib-per-step", "8"]),
               member_entry(pack, 2, 0, args=["--steps", "10", "--step-s", "0.05"])]
    placement = parse_placement(placement_dict(pack, members, sample_interval_s=0.1, mps=False))
    agent = Agent(placement, agent_options(agent_world))
    agent.run()
    assert [m.state for m in agent.members] == ["OOM_GPU", "COMPLETED"]
    recs = read_reports(agent.reports.path)
    assert [r["event"] for r in recs if r["type"] == "agent"] == ["start", "mps_unavailable", "closed", "exit"]
    assert "no MPS fence" in agent.members[0].reason


def test_a_lost_gpu_is_reported_and_members_go_on(agent_world):
    (agent_world / "nvml.json").write_text(json.dumps({"gpus": [{}, {"lost_after_calls": 10}]}))
    pack = agent_world / "pack"
    members = [member_entry(pack, 1, 1, args=["--steps", "12", "--step-s", "0.05"])]
    agent = Agent(parse_placement(placement_dict(pack, members, sample_interval_s=0.1)), agent_options(agent_world))
    agent.run()
    assert agent.members[0].state == "COMPLETED"
    gpu1 = [r for r in read_reports(agent.reports.path) if r["type"] == "sample" and r["job_id"] is None
            and r["gpu_index"] == 1]
    assert gpu1[-1]["gpu_lost"] is True and gpu1[-1]["gpu_mem_bytes"] is None and not gpu1[0]["gpu_lost"]


def test_cancel_files_stop_one_member(agent_world):
    pack = agent_world / "pack"
    members = [member_entry(pack, 1, 0, args=["--steps", "10000", "--step-s", "0.05"]),
               member_entry(pack, 2, 0, args=["--steps", "10000", "--step-s", "0.05", "--ignore-term"]),
               member_entry(pack, 3, 1, args=["--steps", "30", "--step-s", "0.05"]),
               member_entry(pack, 4, 1, args=["--steps", "30", "--step-s", "0.05"])]
    (pack / "cancel").mkdir(parents=True)
    (pack / "cancel" / "4").touch()  # cancelled before it started: never launched
    (pack / "cancel" / ".9.tmp").touch()  # a half-made request is not a request
    placement = parse_placement(placement_dict(pack, members, sample_interval_s=0.1, term_grace_s=0.5))
    agent = Agent(placement, agent_options(agent_world))

    def cancel_soon():
        deadline = time.monotonic() + 10
        # both running (a metrics line means the stand-in's SIGTERM handler is set: on a
        # loaded machine the first one may still be starting when the second writes)
        while (not all(Path(members[i]["metrics_path"]).exists() for i in (0, 1))
               and time.monotonic() < deadline):
            time.sleep(0.05)
        for job in ("1", "2"):
            (pack / "cancel" / f".{job}.tmp").touch()
            os.replace(pack / "cancel" / f".{job}.tmp", pack / "cancel" / job)

    t = threading.Thread(target=cancel_soon)
    t.start()
    agent.run()
    t.join()
    assert [m.state for m in agent.members] == ["CANCELLED", "CANCELLED", "COMPLETED", "CANCELLED"]
    assert agent.members[1].exit_code == 137  # ignored SIGTERM: killed after term_grace_s
    assert agent.members[0].exit_code == 5  # checkpointed on SIGTERM, still reported CANCELLED
    # The reason says what the runner did (it kept a checkpoint) and how to go on.
    assert re.fullmatch(r"cancelled; stopped at step \d+ with a checkpoint \(exit 5\); "
                        r"`slurm-dlrm requeue 1` resumes it", agent.members[0].reason), agent.members[0].reason
    assert "checkpoint" not in agent.members[1].reason
    assert not Path(members[3]["metrics_path"]).exists()


def test_a_failed_member_reports_the_runners_own_error(agent_world):
    # The runner logs its cause (`ERROR slurm_dlrm.train.runner: bad spec: ...`) into the
    # member's output file; the agent reports that line, not "the spec did not validate".
    pack = agent_world / "pack"
    fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    say = (f"import logging, sys; logging.basicConfig(format={fmt!r}); print('loading', flush=True); "
           "logging.getLogger('slurm_dlrm.train.runner').error('bad spec: data.path: no Criteo TSV file at /d/x.tsv'); "
           "sys.exit(2)")
    crash = "print('step 1'); raise RuntimeError('CUDA error: an illegal memory access')"
    members = [{**member_entry(pack, 1, 0), "command": [sys.executable, "-c", say]},
               {**member_entry(pack, 2, 1), "command": [sys.executable, "-c", crash]},
               {**member_entry(pack, 3, 1), "command": [sys.executable, "-c", "import sys; sys.exit(1)"]}]
    agent = Agent(parse_placement(placement_dict(pack, members, sample_interval_s=0.1, mps=False)), agent_options(agent_world))
    agent.run()
    reasons = [m.reason for m in agent.members]
    assert reasons == ["bad spec: data.path: no Criteo TSV file at /d/x.tsv (exit code 2)",
                       "RuntimeError: CUDA error: an illegal memory access (exit code 1)",
                       "exit code 1"]
    assert (pack / "job-1" / "output-n1.log").read_text().startswith("loading")


def test_the_agent_writes_the_nodes_real_gpu_indexes(agent_world):
    # Device cgroups renumber CUDA_VISIBLE_DEVICES to 0..n-1; SLURM_JOB_GPUS keeps the
    # node's own indexes (Slurm's IDX), which is what `queue` shows.
    pack = agent_world / "pack"
    members = [member_entry(pack, 1, 1, args=["--steps", "1"])]
    env = {**os.environ, "SLURM_JOB_GPUS": "1,3", "CUDA_VISIBLE_DEVICES": "0,1"}
    Agent(parse_placement(placement_dict(pack, members, mps=False)), agent_options(agent_world), env=env).run()
    assert json.loads((pack / "nodes" / "0.json").read_text()) == {
        "node": "n1", "gpus": ["1", "3"], "cuda_visible_devices": ["0", "1"]}
    env = {k: v for k, v in os.environ.items() if k not in ("SLURM_JOB_GPUS", "SLURM_STEP_GPUS")}
    Agent(parse_placement(placement_dict(pack, members, mps=False)), agent_options(agent_world, gpus=["2", "5"]), env=env).run()
    assert json.loads((pack / "nodes" / "0.json").read_text())["gpus"] == ["2", "5"]


def test_pack_id_finds_the_placement(tmp_path):
    from slurm_dlrm.commands.agent import find_pack_file

    for name, pid in (("dlrm-aa-1", 1), ("dlrm-aa-2", 2)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "placement.json").write_text(json.dumps({"pack_id": pid}))
    assert find_pack_file(tmp_path, 2, "placement.json") == tmp_path / "dlrm-aa-2" / "placement.json"
    with pytest.raises(BadInput, match="--pack 3"):
        find_pack_file(tmp_path, 3, "placement.json")


def _agent_cli(agent_world, placement, *extra):
    path = agent_world / "placement.json"
    path.write_text(json.dumps(placement))
    return subprocess.Popen([sys.executable, "-m", "slurm_dlrm", "agent", "--pack-file", str(path),  # noqa: S603
                             "--launch", "process", "--gpus", "0,1", "--node-name", "n1", "--json", *extra],
                            cwd=agent_world, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, TMPDIR=str(agent_world / "tmp")))


def test_sigterm_is_forwarded_and_members_checkpoint(agent_world):
    pack = agent_world / "pack"
    members = [member_entry(pack, i, i % 2, args=["--steps", "10000", "--step-s", "0.05"]) for i in (1, 2, 3)]
    proc = _agent_cli(agent_world, placement_dict(pack, members, sample_interval_s=0.2, term_grace_s=10))
    metrics = [Path(m["metrics_path"]) for m in members]
    deadline = time.monotonic() + 20
    while not all(p.exists() and p.stat().st_size for p in metrics) and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    summary = json.loads(out)
    assert summary["members"] == {"1": "PREEMPTED", "2": "PREEMPTED", "3": "PREEMPTED"} and summary["mps"] == "own"
    for m in members:
        assert json.loads((Path(m["checkpoint_dir"]) / "checkpoint.json").read_text())["step"] > 0
    recs = read_reports(pack / "reports" / "n1.jsonl")
    assert recs[-1]["event"] == "exit" and "SIGTERM" in recs[-1]["detail"]
    assert [r["event"] for r in recs if r["type"] == "agent"][-2] == "mps_stopped"


def test_a_killed_agent_s_members_stop_with_a_checkpoint(agent_world):
    """Issue 49 (chaos_live): an agent SIGKILLed left its members running as orphans
    (Slurm's proctrack/linuxproc no longer tracks them), while the service reran them
    elsewhere from their checkpoint: two runs of one job at once. They get SIGTERM when
    the agent dies (PR_SET_PDEATHSIG), checkpoint and stop."""
    import psutil

    pack = agent_world / "pack"
    members = [member_entry(pack, i, i % 2, args=["--steps", "10000", "--step-s", "0.05",
                                                  "--env-out", str(agent_world / f"env-{i}")]) for i in (1, 2)]
    proc = _agent_cli(agent_world, placement_dict(pack, members, sample_interval_s=0.2, term_grace_s=10), "--mps", "off")
    outs = [agent_world / f"env-{i}" for i in (1, 2)]
    deadline = time.monotonic() + 20
    while not all(p.exists() for p in outs) and time.monotonic() < deadline:
        time.sleep(0.1)
    pids = [json.loads(p.read_text())["pid"] for p in outs]
    proc.kill()
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        assert time.monotonic() < deadline, "members outlived their agent"
        time.sleep(0.1)
    for m in members:
        assert json.loads((Path(m["checkpoint_dir"]) / "checkpoint.json").read_text())["step"] > 0


def test_a_member_ignoring_sigterm_is_killed_after_the_grace(agent_world):
    pack = agent_world / "pack"
    members = [member_entry(pack, 1, 0, args=["--steps", "10000", "--step-s", "0.05", "--ignore-term"]),
               member_entry(pack, 2, 1, args=["--steps", "10000", "--step-s", "0.05"])]
    proc = _agent_cli(agent_world, placement_dict(pack, members, sample_interval_s=0.2, term_grace_s=1.0), "--mps", "off")
    deadline = time.monotonic() + 20
    while not Path(members[0]["metrics_path"]).exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.3)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert 0.9 < time.monotonic() - t0 < 10
    assert json.loads(out)["members"] == {"1": "CANCELLED", "2": "PREEMPTED"}, err


def test_cli_refuses_bad_input(tmp_path):
    runner = CliRunner()
    r = runner.invoke(cli, ["agent", "--pack-file", str(tmp_path / "missing.json")])
    assert r.exit_code == 2 and "cannot read" in r.output
    (tmp_path / "p.json").write_text(json.dumps({"pack_id": 1, "members": []}))
    r = runner.invoke(cli, ["agent", "--pack-file", str(tmp_path / "p.json")])
    assert r.exit_code == 2 and "pack_dir: missing" in r.output
    r = runner.invoke(cli, ["agent"])
    assert r.exit_code == 2 and "exactly one of --pack-file or --pack" in r.output
