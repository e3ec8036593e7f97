"""The agent's side of refill (docs/interfaces.md 3b): joins launched, grace, closed marker."""

import json
import os
import threading
import time

from agent_harness import agent_options

from slurm_dlrm.agent.loop import Agent
from slurm_dlrm.agent.placement import parse_placement
from slurm_dlrm.agent.reports import read_reports
from slurm_dlrm.emulated.standin import member_entry, placement_dict


def _agent(agent_world, pack, members, join_grace_s):
    data = placement_dict(pack, members, sample_interval_s=0.1)
    data["join_grace_s"] = join_grace_s
    return Agent(parse_placement(data), agent_options(agent_world))


def _write_join(pack, entry, name=None):
    joins = pack / "joins"
    joins.mkdir(exist_ok=True)
    final = name or f"{entry['job_id']}.json"
    tmp = joins / f".{final}.tmp"
    tmp.write_text(json.dumps(entry) if isinstance(entry, dict) else entry)
    os.replace(tmp, joins / final)


def test_joiner_launched_on_its_node_with_its_fence_then_grace_and_closed_marker(agent_world):
    pack = agent_world / "pack"
    first = member_entry(pack, 1, 0, args=["--steps", "4", "--step-s", "0.05"])
    joiner = member_entry(pack, 2, 1, gpu_mem_limit_mib=1234, mps_thread_pct=30,
                          args=["--steps", "4", "--step-s", "0.05", "--env-out", str(agent_world / "env2.json")])
    other_node = member_entry(pack, 3, 0, node_index=1, args=["--steps", "1"])
    agent = _agent(agent_world, pack, [first], join_grace_s=1.5)
    ended_at: dict[str, float] = {}

    def service() -> None:
        # after the first member ended, while the agent waits for joins
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            recs = read_reports(agent.reports.path) if agent.reports.path.exists() else []
            if any(r["type"] == "member" and r["job_id"] == 1 and r["state"] == "COMPLETED" for r in recs):
                break
            time.sleep(0.05)
        time.sleep(0.3)
        _write_join(pack, other_node)
        _write_join(pack, "{not json", name="9.json")
        _write_join(pack, joiner)

    t = threading.Thread(target=service)
    t.start()
    t0 = time.monotonic()
    assert agent.run() == 0
    t.join()
    ended_at["agent"] = time.monotonic()
    assert {m.placement.job_id: m.state for m in agent.members} == {1: "COMPLETED", 2: "COMPLETED"}
    env2 = json.loads((agent_world / "env2.json").read_text())["env"]
    assert env2["CUDA_VISIBLE_DEVICES"] == "1"  # its gpu_index under the agent's own daemon
    assert env2["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=1234M"
    assert env2["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30" and env2["SLURM_DLRM_JOB_ID"] == "2"
    recs = read_reports(agent.reports.path)
    members = [r for r in recs if r["type"] == "member"]
    assert [(r["job_id"], r["state"]) for r in members] == [(1, "RUNNING"), (1, "COMPLETED"),
                                                           (2, "RUNNING"), (2, "COMPLETED")]
    assert members[2].get("joined") is True and "joined" not in members[0]
    assert not any(r.get("job_id") == 3 for r in members)  # node 1's joiner is not ours
    events = [r["event"] for r in recs if r["type"] == "agent"]
    assert "join_refused" in events and events[-2:] == ["mps_stopped", "exit"]
    assert events.index("closed") < events.index("exit")
    refused = next(r for r in recs if r.get("event") == "join_refused")
    assert refused["detail"].startswith("9.json")
    assert (pack / "closed" / "0").exists() and not (pack / "closed" / "1").exists()
    # it waited join_grace_s after its last member ended
    end2 = next(r["t"] for r in members if r["job_id"] == 2 and r["state"] == "COMPLETED")
    exit_t = next(r["t"] for r in recs if r.get("event") == "exit")
    assert exit_t - end2 >= 1.4
    assert ended_at["agent"] - t0 < 20


def test_no_join_within_grace_exits_and_closes(agent_world):
    pack = agent_world / "pack"
    agent = _agent(agent_world, pack, [member_entry(pack, 1, 0, args=["--steps", "2", "--step-s", "0.05"])],
                   join_grace_s=0.8)
    t0 = time.monotonic()
    assert agent.run() == 0
    took = time.monotonic() - t0
    assert 0.8 <= took < 10
    assert (pack / "closed" / "0").exists()
    # a join written once the node is closed is never launched: the agent is gone, and the
    # service requeues it (tests/test_service_refill.py)


def test_sigterm_while_waiting_for_joins_exits_at_once(agent_world):
    import signal

    pack = agent_world / "pack"
    agent = _agent(agent_world, pack, [member_entry(pack, 1, 0, args=["--steps", "1", "--step-s", "0.01"])],
                   join_grace_s=60.0)
    timer = threading.Timer(1.5, lambda: os.kill(os.getpid(), signal.SIGTERM))
    timer.start()
    t0 = time.monotonic()
    try:
        assert agent.run() == 0
    finally:
        timer.cancel()
    assert time.monotonic() - t0 < 10
    assert (pack / "closed" / "0").exists()
