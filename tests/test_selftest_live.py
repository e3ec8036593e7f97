"""`slurm-dlrm selftest --submit` on the real local Slurm cluster (fake GPUs, fake NVML and MPS).

The job goes through sbatch with --gres=gpu:1, runs the selftest on the node Slurm
picked (CUDA_VISIBLE_DEVICES set by Slurm), and the submitting command prints its
verdict: DRY for what ran against the fakes, SKIP for the hardware figures, exit 0.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slurm


def _selftest(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "slurm_dlrm", "selftest", *args],  # noqa: S603
                          capture_output=True, text=True, timeout=timeout, check=False)


def test_submit_runs_the_selftest_as_a_job(slurm_cluster):
    part = slurm_cluster.config.partition
    out = _selftest("--submit", "-p", part, "--fake", "--json")
    assert out.returncode == 0, out.stderr + out.stdout
    data = json.loads(out.stdout)
    ctx = data["context"]
    assert ctx["slurm_job_id"] > 0 and ctx["nvml"] == "fake"
    assert ctx["node"] in slurm_cluster.config.node_names
    status = {c["name"]: c["status"] for c in data["checks"]}
    assert "PASS" not in status.values() and "FAIL" not in status.values()
    assert status["mps.daemon_start"] == status["mps.daemon_shutdown"] == status["mps.nvml_sees_clients"] == "DRY"
    assert status["mps.memory_fence"] == status["calibration.compute"] == "SKIP"
    assert not data["verdict"]["accepted"]
    # Slurm gave the job one GPU: the selftest tested that one, by the name Slurm used.
    assert ctx["gpu_name"].isdigit()
    done = slurm_cluster.wait([ctx["slurm_job_id"]])
    assert done[ctx["slurm_job_id"]].state.value == "COMPLETED"


def test_submit_bad_input_is_one_line(slurm_cluster):
    out = _selftest("--submit", "-p", "nosuch", "--fake")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"slurm-dlrm: error: -p nosuch: no such partition (Slurm has: {slurm_cluster.config.partition})"]
    out = _selftest("--submit", "--fake")
    assert out.returncode == 2 and "-p PARTITION is required" in out.stderr


def test_submit_to_a_chosen_node_whole(slurm_cluster):
    node = slurm_cluster.config.node_names[-1]
    out = _selftest("--submit", "-p", slurm_cluster.config.partition, "-w", node, "--exclusive", "--gres", "gpu:2",
                    "--gpu", "1", "--fake", "--json")
    assert out.returncode == 0, out.stderr + out.stdout
    ctx = json.loads(out.stdout)["context"]
    assert ctx["node"] == node and ctx["nvml_index"] == int(ctx["gpu_name"])
