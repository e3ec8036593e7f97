"""A 2-rank job end to end on the local Slurm cluster (issue 18): `submit` takes it on the
packing path, the service plans its ranks with two single-GPU jobs into one pack, the
agent runs both ranks as one torch.distributed job (gloo on the CPU, fake GPUs), and
`show` lists each rank on its own GPU of one node."""

from __future__ import annotations

from pathlib import Path

import pytest
from service_harness import cli, show_job, wait_until

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples" / "sweep"
pytestmark = [pytest.mark.slurm, pytest.mark.torch]


def test_two_rank_job_packed_beside_single_gpu_jobs(live_service, tmp_path):
    text = (EXAMPLES / "tiny-a.yaml").read_text().replace("name: tiny-a", "name: multi2")
    spec = tmp_path / "multi2.yaml"
    spec.write_text(text + "world_size: 2\n")
    r = cli("submit", str(spec), str(EXAMPLES / "tiny-b.yaml"), str(EXAMPLES / "tiny-c.yaml"), "--parsable")
    assert r.exit_code == 0, r.output
    multi, *singles = (int(line) for line in r.output.split())

    def all_done():
        """the three jobs ended"""
        jobs = [show_job(j) for j in (multi, *singles)]
        return jobs if all(j["state"] not in ("PENDING", "PLANNED", "RUNNING") for j in jobs) else None

    m, *s = wait_until(all_done)
    assert [j["state"] for j in (m, *s)] == ["COMPLETED"] * 3, [(j["name"], j["state"], j["reason"]) for j in (m, *s)]
    ranks = sorted(m["placements"], key=lambda p: p["rank"])
    assert [(p["rank"], p["world_size"]) for p in ranks] == [(0, 2), (1, 2)]
    assert len({p["node"] for p in ranks}) == 1 and len({p["gpu"] for p in ranks}) == 2
    assert all(p["gpu_mem_limit_mib"] > 0 for p in ranks)  # each rank fenced
    assert {p["pack"] for p in ranks} == {j["pack"] for j in s}  # one pack with the single-GPU jobs
    assert m["last_metrics"]["world_size"] == 2 and m["checkpoint_step"] == m["last_metrics"]["steps_total"]
