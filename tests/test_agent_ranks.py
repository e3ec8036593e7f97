"""Multi-rank jobs in the agent (issue 18): W ranks of one job launched as one
torch.distributed job, each on its own GPU with its own fence; one rank failing stops
its siblings and only them; the job is reported once; cancel and SIGTERM reach every rank.
Stand-in members (no torch), the fake NVML and the fake MPS control daemon."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from agent_harness import agent_options

from slurm_dlrm.agent.launch import free_port, member_env
from slurm_dlrm.agent.loop import Agent
from slurm_dlrm.agent.mps import MpsSetup
from slurm_dlrm.agent.placement import parse_join, parse_placement
from slurm_dlrm.agent.reports import read_reports
from slurm_dlrm.emulated.standin import member_entry, placement_dict, rank_entries
from slurm_dlrm.errors import BadInput

LONG = ["--steps", "10000", "--step-s", "0.05"]


def _pack(agent_world, args, single_args=None, **kw):
    """Job 5 with 2 ranks on GPUs 0 and 1 (rank fences differ) and single job 6 on GPU 1."""
    pack = agent_world / "pack"
    env_out = ["--env-out", str(agent_world / "env-5")]
    ranks = rank_entries(member_entry(pack, 5, 0, args=[*args, *env_out]), [0, 1],
                         gpu_mem_limit_mib=[1000, 2000], mps_thread_pct=[30, 40])
    single = member_entry(pack, 6, 1, args=single_args or ["--steps", "40", "--step-s", "0.05"])
    return pack, placement_dict(pack, [*ranks, single], sample_interval_s=0.1, **kw)


def _rank_env(agent_world, rank, timeout_s=20.0):
    path = agent_world / f"env-5.rank{rank}"
    deadline = time.monotonic() + timeout_s
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.1)  # the stand-in writes it before it starts stepping
    return json.loads(path.read_text())


def _in_thread(fn):
    t = threading.Thread(target=fn)
    t.start()
    return t


# ------------------------------------------------------------------ placement and environment

def test_placement_ranks_are_checked(tmp_path):
    ranks = rank_entries(member_entry(tmp_path, 5, 0), [0, 1])
    p = parse_placement(placement_dict(tmp_path, ranks))
    assert [(m.rank, m.world_size, m.key) for m in p.members] == [(0, 2, "5-r0"), (1, 2, "5-r1")]
    single = parse_placement(placement_dict(tmp_path, [member_entry(tmp_path, 6, 0)])).members[0]
    assert (single.rank, single.world_size, single.key) == (0, 1, "6")  # absent = rank 0 of 1
    for mutate, message in [
        (lambda r: r[1].update(gpu_index=0), "two ranks on one GPU"),
        (lambda r: r[1].update(node_index=1), "differ in node_index"),
        (lambda r: r[1].update(command=["x"]), "differ in command"),
        (lambda r: r[1].update(checkpoint_dir="/elsewhere"), "differ in checkpoint_dir"),
        (lambda r: r[1].update(rank=0), "5 rank 0 appears twice"),
        (lambda r: r[1].update(rank=2), "rank: must be < world_size 2"),
        (lambda r: r.pop(), r"ranks \[0\], expected 0..1"),
        (lambda r: r[1].update(world_size=3), "disagree on world_size"),
        (lambda r: [(e.pop("rank"), e.pop("world_size")) for e in r], "5 appears twice"),
    ]:
        bad = rank_entries(member_entry(tmp_path, 5, 0), [0, 1])
        mutate(bad)
        with pytest.raises(BadInput, match=message):
            parse_placement(placement_dict(tmp_path, bad))
    # a join file holds one member entry, or all W ranks of one job
    assert [m.rank for m in parse_join({"members": ranks}, "joins/5.json")] == [0, 1]
    assert parse_join(member_entry(tmp_path, 6, 0), "joins/6.json")[0].world_size == 1
    with pytest.raises(BadInput, match="expected 0..1"):
        parse_join({"members": ranks[:1]}, "joins/5.json")
    with pytest.raises(BadInput, match="the ranks of one job"):
        parse_join({"members": [*ranks, member_entry(tmp_path, 6, 0)]}, "joins/5.json")


def test_rank_environment(tmp_path):
    ranks = parse_placement(placement_dict(tmp_path, rank_entries(
        member_entry(tmp_path, 5, 0), [1, 0], gpu_mem_limit_mib=[1000, 2000]))).members
    base = {"PATH": "/bin", "RANK": "7", "MASTER_PORT": "1", "SLURM_DLRM_RDZV_FILE": "/x"}
    daemon = type("D", (), {"env": lambda self: {"CUDA_MPS_PIPE_DIRECTORY": "/p", "CUDA_MPS_LOG_DIRECTORY": "/l"}})()
    mps = MpsSetup("own", daemon, "")  # type: ignore[arg-type]
    env1 = member_env(base, ranks[1], ["3", "4"], mps, master_port=29123)
    assert {k: env1[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                 "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")} == {
        "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29123", "CUDA_VISIBLE_DEVICES": "0", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2000M"}
    assert "SLURM_DLRM_RDZV_FILE" not in env1  # the runner's own launcher's rendezvous must not apply
    single = parse_placement(placement_dict(tmp_path, [member_entry(tmp_path, 6, 0)])).members[0]
    env = member_env(base, single, ["3"], MpsSetup("off", None, ""))
    assert "RANK" not in env and "MASTER_PORT" not in env  # a single member is not a rank of anything
    with pytest.raises(ValueError, match="without a MASTER_PORT"):
        member_env(base, ranks[0], ["3", "4"], mps)


def test_free_port_is_free_and_not_taken():
    port = free_port(set())
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # nobody holds it
    again = free_port({port})
    assert again != port


# ------------------------------------------------------------------ the loop

def test_ranks_get_their_gpu_fence_and_one_port_and_the_job_reports_once(agent_world):
    pack, pd = _pack(agent_world, ["--steps", "30", "--step-s", "0.05"])
    agent = Agent(parse_placement(pd), agent_options(agent_world))
    agent.run()
    assert agent.job_states == {5: "COMPLETED", 6: "COMPLETED"}
    envs = [_rank_env(agent_world, r)["env"] for r in (0, 1)]
    assert [e["RANK"] for e in envs] == ["0", "1"] and {e["WORLD_SIZE"] for e in envs} == {"2"}
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0", "1"]  # each rank its own GPU
    assert [e["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] for e in envs] == ["0=1000M", "0=2000M"]  # and its own fence
    assert [e["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] for e in envs] == ["30", "40"]
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"] and envs[0]["MASTER_ADDR"] == "127.0.0.1"
    recs = read_reports(pack / "reports" / "n1.jsonl")
    running = [r for r in recs if r["type"] == "member" and r["job_id"] == 5 and r["state"] == "RUNNING"]
    assert sorted(r["rank"] for r in running) == [0, 1]
    ends = [r for r in recs if r["type"] == "member" and r["job_id"] == 5 and r["state"] != "RUNNING"]
    assert len(ends) == 1 and ends[0]["state"] == "COMPLETED" and ends[0]["world_size"] == 2  # once, as a job
    assert [x["state"] for x in ends[0]["ranks"]] == ["COMPLETED", "COMPLETED"]
    assert sorted(r["rank"] for r in recs if r["type"] == "rank") == [0, 1]
    samples = [r for r in recs if r["type"] == "sample" and r["job_id"] == 5]
    assert {(r["rank"], r["gpu_index"]) for r in samples} == {(0, 0), (1, 1)}
    assert not any(r["samples_per_s"] for r in samples if r["rank"] == 1)  # rank 0's metrics are counted once


def test_ranks_that_end_in_the_same_turn_report_the_job_once(agent_world):
    # On a busy machine both ranks can end between two turns of the loop (issue 28): the
    # agent then reaps them together, and the job must still get exactly one end record.
    pack = agent_world / "pack"
    ranks = rank_entries(member_entry(pack, 5, 0, args=["--steps", "5", "--step-s", "0.05"]), [0, 1])
    agent = Agent(parse_placement(placement_dict(pack, ranks, sample_interval_s=0.1)), agent_options(agent_world))
    reap = agent._reap

    def reap_once_both_ended():
        if any(m.popen is None or m.popen.poll() is None for m in agent.members):
            return
        reap()

    agent._reap = reap_once_both_ended  # type: ignore[method-assign]
    agent.run()
    ends = [r for r in read_reports(pack / "reports" / "n1.jsonl")
            if r["type"] == "member" and r["state"] != "RUNNING"]
    assert [(e["job_id"], e["state"]) for e in ends] == [(5, "COMPLETED")]
    assert agent.job_states == {5: "COMPLETED"}


def test_a_killed_rank_stops_its_sibling_not_the_neighbour(agent_world):
    pack, pd = _pack(agent_world, LONG, single_args=["--steps", "10000", "--step-s", "0.05"], term_grace_s=3)
    agent = Agent(parse_placement(pd), agent_options(agent_world))
    seen: dict[str, float] = {}

    def kill_rank_1():
        victim = _rank_env(agent_world, 1)["pid"]
        _rank_env(agent_world, 0)
        seen["t"] = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while agent.job_states.get(5) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        seen["neighbour"] = float(agent.members[2].state == "RUNNING")
        (pack / "cancel").mkdir(exist_ok=True)
        (pack / "cancel" / "6").touch()  # end the test

    t = _in_thread(kill_rank_1)
    agent.run()
    t.join()
    assert seen["neighbour"] == 1.0  # the single member on rank 1's GPU kept running
    r0, r1, single = agent.members
    assert (r1.state, r1.exit_code) == ("FAILED", 137)
    assert r0.state == "CANCELLED" and r0.stop_reason == "GANG" and r0.exit_code == 5  # SIGTERM: it checkpointed
    assert single.state == "CANCELLED" and single.stop_reason == "CANCEL"
    recs = read_reports(pack / "reports" / "n1.jsonl")
    ends = [r for r in recs if r["type"] == "member" and r["job_id"] == 5 and r["state"] != "RUNNING"]
    assert len(ends) == 1
    end = ends[0]
    assert (end["state"], end["rank"], end["exit_code"], end["requeue"]) == ("FAILED", 1, 137, True)
    assert end["reason"].startswith("rank 1: killed by SIGKILL") and "other rank stopped" in end["reason"]
    assert agent.job_states[5] == "FAILED"


def test_a_rank_over_its_host_budget_stops_the_job_as_oom(agent_world):
    pack = agent_world / "pack"
    args = ["--steps", "10000", "--step-s", "0.05", "--grow-mib-per-step", "4"]
    ranks = rank_entries(member_entry(pack, 5, 0, args=args), [0, 1],
                         host_mem_limit_bytes=[4 << 30, 60 << 20])  # rank 1's own fence is the small one
    pd = placement_dict(pack, ranks, sample_interval_s=0.1, term_grace_s=3)
    agent = Agent(parse_placement(pd), agent_options(agent_world))
    agent.run()
    r0, r1 = agent.members
    assert r1.state == "OOM_HOST" and r0.state == "CANCELLED" and r0.stop_reason == "GANG"
    end = [r for r in read_reports(pack / "reports" / "n1.jsonl")
           if r["type"] == "member" and r["state"] not in ("RUNNING",)]
    assert [(e["state"], e["rank"], e.get("requeue")) for e in end] == [("OOM_HOST", 1, None)]


def test_cancel_reaches_every_rank(agent_world):
    pack, pd = _pack(agent_world, LONG, term_grace_s=5)
    agent = Agent(parse_placement(pd), agent_options(agent_world))

    def cancel():
        _rank_env(agent_world, 0)
        _rank_env(agent_world, 1)
        (pack / "cancel").mkdir(exist_ok=True)
        (pack / "cancel" / "5").touch()

    t = _in_thread(cancel)
    agent.run()
    t.join()
    assert [m.state for m in agent.members] == ["CANCELLED", "CANCELLED", "COMPLETED"]
    assert [m.exit_code for m in agent.members[:2]] == [5, 5]  # both got the SIGTERM and stopped cleanly
    assert agent.job_states == {5: "CANCELLED", 6: "COMPLETED"}
    assert json.loads((pack / "job-5" / "ckpt" / "checkpoint.json").read_text())["step"] > 0


def test_a_cancelled_job_starts_none_of_its_ranks(agent_world):
    pack, pd = _pack(agent_world, LONG)
    (pack / "cancel").mkdir(parents=True)
    (pack / "cancel" / "5").touch()
    agent = Agent(parse_placement(pd), agent_options(agent_world))
    agent.run()
    assert [m.state for m in agent.members] == ["CANCELLED", "CANCELLED", "COMPLETED"]
    assert all(m.popen is None for m in agent.members[:2])


def test_a_refused_rank_keeps_the_whole_job_from_starting(agent_world):
    pack, pd = _pack(agent_world, LONG)
    pd["members"][1]["gpu_index"] = 5  # no such GPU: rank 1 cannot launch
    agent = Agent(parse_placement(pd), agent_options(agent_world))
    agent.run()
    r0, r1, single = agent.members
    assert r0.state == r1.state == "FAILED" and single.state == "COMPLETED"
    assert r0.popen is None or r0.popen.returncode is not None
    end = [r for r in read_reports(pack / "reports" / "n1.jsonl") if r["type"] == "member" and r["job_id"] == 5]
    assert [e["state"] for e in end if e["state"] != "RUNNING"] == ["FAILED"]
    assert "requeue" not in end[-1]  # it never ran: a requeue would fail the same way


def test_sigterm_reaches_every_rank(agent_world):
    pack, pd = _pack(agent_world, LONG, term_grace_s=10)
    (agent_world / "placement.json").write_text(json.dumps(pd))
    proc = subprocess.Popen([sys.executable, "-m", "slurm_dlrm", "agent", "--pack-file",  # noqa: S603
                             str(agent_world / "placement.json"),
                             "--node-name", "n1", "--gpus", "0,1", "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, TMPDIR=str(agent_world / "tmp")))
    _rank_env(agent_world, 0)
    _rank_env(agent_world, 1)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert json.loads(out)["members"] == {"5": "PREEMPTED", "6": "PREEMPTED"}, err
    ranks = [r for r in read_reports(pack / "reports" / "n1.jsonl") if r["type"] == "rank"]
    assert sorted((r["rank"], r["state"]) for r in ranks) == [(0, "PREEMPTED"), (1, "PREEMPTED")]


def test_a_join_of_two_ranks_starts_both(agent_world):
    pack = agent_world / "pack"
    first = member_entry(pack, 6, 0, args=["--steps", "20", "--step-s", "0.05"])
    pd = placement_dict(pack, [first], sample_interval_s=0.1)
    pd["join_grace_s"] = 3.0
    ranks = rank_entries(member_entry(pack, 5, 0, args=["--steps", "10", "--step-s", "0.05",
                                                       "--env-out", str(agent_world / "env-5")]), [0, 1])
    agent = Agent(parse_placement(pd), agent_options(agent_world))

    def join():
        time.sleep(0.3)
        (pack / "joins").mkdir(exist_ok=True)
        (pack / "joins" / ".5.json.tmp").write_text(json.dumps({"members": ranks}))
        os.replace(pack / "joins" / ".5.json.tmp", pack / "joins" / "5.json")

    t = _in_thread(join)
    agent.run()
    t.join()
    assert agent.job_states == {6: "COMPLETED", 5: "COMPLETED"}
    assert [(m.placement.rank, m.placement.gpu_index) for m in agent.members[1:]] == [(0, 0), (1, 1)]
    assert _rank_env(agent_world, 1)["env"]["CUDA_VISIBLE_DEVICES"] == "1"


def test_a_rank_as_a_job_step_gets_its_rank_variables_again(tmp_path):
    from slurm_dlrm.agent.launch import step_argv

    rank = parse_placement(placement_dict(tmp_path, rank_entries(member_entry(tmp_path, 5, 0), [0, 1]))).members[1]
    env = member_env({"PATH": "/bin"}, rank, ["0", "1"], MpsSetup("off", None, ""), master_port=29500)
    argv = step_argv(rank, env, "node1", tmp_path / "member-5-r1.pid", sys.executable)
    sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--setenv"]
    assert {"RANK=1", "LOCAL_RANK=1", "WORLD_SIZE=2", "MASTER_ADDR=127.0.0.1", "MASTER_PORT=29500",
            "CUDA_VISIBLE_DEVICES=1"} <= set(sets)
