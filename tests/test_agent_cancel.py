"""The agent's cancel channel (docs/interfaces.md 3a): one member stops, neighbours go on."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from slurm_dlrm.agent import fake_mps_control, fake_nvml
from slurm_dlrm.agent.loop import Agent, AgentOptions, classify_exit
from slurm_dlrm.agent.placement import parse_placement
from slurm_dlrm.agent.reports import read_reports
from slurm_dlrm.agent.standin import member_entry, placement_dict

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def world(tmp_path, monkeypatch):
    fake_mps_control.install_launcher(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    scenario = tmp_path / "nvml.json"
    scenario.write_text(json.dumps({"gpu_count": 2}))
    monkeypatch.setenv(fake_nvml.ENV_FAKE_NVML, str(scenario))
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    (tmp_path / "tmp").mkdir()
    return tmp_path


def test_cancel_file_stops_one_member_only(world):
    pack = world / "pack"
    members = [
        member_entry(pack, 1, 0, args=["--steps", "20", "--step-s", "0.1"]),
        member_entry(pack, 2, 0, args=["--steps", "600", "--step-s", "0.05"]),  # would run 30 s
        member_entry(pack, 3, 1, args=["--steps", "20", "--step-s", "0.1"]),
        member_entry(pack, 4, 1, args=["--steps", "600", "--step-s", "0.05"]),  # cancelled before start
    ]
    (pack / "cancel").mkdir(parents=True)
    (pack / "cancel" / "4").touch()
    placement = parse_placement(placement_dict(pack, members, sample_interval_s=0.1, term_grace_s=5))
    agent = Agent(placement, AgentOptions(node_index=0, node_name="n1", gpus=["0", "1"], launch="process",
                                          tmp_root=str(world / "tmp"), heartbeat_every_s=0.5))

    def cancel_two_once_running() -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                recs = read_reports(agent.reports.path)
            except OSError:
                recs = []
            if any(r["type"] == "member" and r["job_id"] == 2 and r["state"] == "RUNNING" for r in recs):
                time.sleep(0.3)
                (pack / "cancel" / "2").touch()
                return
            time.sleep(0.05)

    threading.Thread(target=cancel_two_once_running, daemon=True).start()
    t0 = time.monotonic()
    assert agent.run() == 0
    assert time.monotonic() - t0 < 25  # not the 30 s member 2 would run
    assert {m.placement.job_id: m.state for m in agent.members} == {
        1: "COMPLETED", 2: "CANCELLED", 3: "COMPLETED", 4: "CANCELLED"}
    finals = {r["job_id"]: r for r in read_reports(agent.reports.path)
              if r["type"] == "member" and r["state"] != "RUNNING"}
    assert "before it started" in finals[4]["reason"] and finals[2]["reason"] == "cancelled by the user"
    assert not any(r["type"] == "member" and r["job_id"] == 4 and r["state"] == "RUNNING"
                   for r in read_reports(agent.reports.path))


def test_cancel_wins_over_a_checkpoint_exit_but_not_over_completion():
    assert classify_exit(5, "CANCEL", via_srun=False)[0] == "CANCELLED"
    assert classify_exit(0, "CANCEL", via_srun=False)[0] == "COMPLETED"
