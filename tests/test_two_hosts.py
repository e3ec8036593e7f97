"""Two login nodes, one network home, the service killed on one and taken over by the
other (issue 30d): no job lost or duplicated, every Slurm job accounted for, the store
never opened from a host without the lease. Harness: tests/two_hosts_harness.py (UTS +
network namespaces; Slurm is a stateful fake shared by both hosts, see there why)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.two_hosts_harness import run_two_hosts


def _can_unshare() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "--uts", "--net", "true"], capture_output=True).returncode == 0  # noqa: S607


@pytest.mark.skipif(not _can_unshare(), reason="needs root and unshare(1) for UTS + network namespaces")
def test_two_hosts_takeover_loses_nothing(tmp_path):
    r = run_two_hosts(tmp_path / "run", seed=1, submits=200, round_s=0.5, lease_s=2.0)
    assert r["failed_submits"] == []
    assert r["submits"] == 200 and r["lost"] == 0 and r["duplicated"] == 0 and r["unknown_jobs"] == []
    assert r["drop_path_submits"] > 0  # some did go through the drop folder
    assert r["slurm_jobs"] > 0 and r["slurm_jobs_unaccounted"] == [] and r["slurm_jobs_duplicated"] == 0
    assert r["packs_mismatched"] == []
    assert r["violations"] == ""
    assert r["refused_requests"] == []
    assert r["journal_mode"] == "delete"  # a network filesystem: never WAL
    assert r["final_lease_host"] == "login-b" and r["takeovers"] == 1
    assert 0 <= r["takeover_after_expiry_s"] <= 2 * 0.5 + 0.2  # within 2 rounds of the lease's end
    assert r["queue_errors"] == [] and r["queue_p50_ms_other_host"] is not None
