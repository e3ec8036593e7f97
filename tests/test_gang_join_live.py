"""A 2-rank job joins a running pack on the local Slurm cluster (issue 18, docs/interfaces.md
3b): the packing service (in this process, rounds 0.5 s apart, the site's `complementary`)
records the gang's join, writes one join file of two entries, and the pack's real agent
launches both ranks (stand-ins, slurm_dlrm/emulated/standin/, no torch) in the same Slurm
allocation, each on its own GPU; the job completes there.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from test_faults_live import STANDIN, live, run_until  # noqa: F401  (live: the fixture)

pytestmark = pytest.mark.slurm
MIB = 1 << 20
GIB = 1 << 30


def add_member(store, user: str, name: str, args: list[str], gpu_gib: float, world_size: int = 1) -> int:
    """A stand-in job; `world_size` > 1 gives its estimate a rank each (a gang)."""
    gpu = int(gpu_gib * GIB)
    est = {"gpu_peak_bytes": gpu, "host_peak_bytes": 64 * MIB,
           "gpu_breakdown": {"embeddings": gpu - 600 * MIB, "cuda_context": 600 * MIB},
           "host_breakdown": {"python": 64 * MIB},
           "profile": {"sm_util_pct": 10.0, "membw_util_pct": 10.0, "host_cpu_cores": 1.0,
                       "label": "compute-bound", "solo_samples_per_s": 20000.0}}
    spec = {"name": name, "tables": [{"name": f"t{r}", "rows": 100, "dim": 8} for r in range(world_size)],
            "dense_features": 4, "bottom_mlp": [8], "top_mlp": [8, 1], "batch_size": 16, "steps": 100,
            "command": [sys.executable, *STANDIN, *args]}
    if world_size > 1:
        spec["world_size"] = world_size
        est["ranks"] = [{"rank": r, "tables": [r], "gpu_peak_bytes": gpu, "host_peak_bytes": 64 * MIB,
                         "gpu_breakdown": est["gpu_breakdown"], "profile": est["profile"]}
                        for r in range(world_size)]
    return int(store.add_job(user=user, name=name, spec=spec, spec_fingerprint=f"fp-{name}", estimate=est,
                             gpu_model="h100"))


def test_two_rank_job_joins_a_running_pack_and_completes_in_its_allocation(live, tmp_path):  # noqa: F811
    svc, store, _cluster = live
    user = svc.settings.user
    # two members too big to share a GPU: a 2-GPU pack; the short one leaves room
    short = add_member(store, user, "short", ["--steps", "8", "--step-s", "0.25"], gpu_gib=50)
    long = add_member(store, user, "long", ["--steps", "2000", "--step-s", "0.25"], gpu_gib=50)
    run_until(svc, lambda: store.get_job(short).state == "COMPLETED" and store.get_job(long).state == "RUNNING",
              120, "the short member to end beside the running long one")
    (pack,) = store.packs()
    assert pack.n_gpus == 2
    env_out = tmp_path / "gang-env"
    gang = add_member(store, user, "gang", ["--steps", "12", "--step-s", "0.25", "--env-out", str(env_out)],
                      gpu_gib=2, world_size=2)
    run_until(svc, lambda: store.get_job(gang).state in ("COMPLETED", "FAILED", "OOM", "CANCELLED"), 120,
              "the 2-rank joiner to end")
    job = store.get_job(gang)
    assert job.state == "COMPLETED", (job.state, job.exit_reason, store.events(job_id=gang))
    assert [p.id for p in store.packs()] == [pack.id]  # no second allocation
    assert job.pack_id == pack.id and job.slurm_job_id == pack.slurm_job_id and job.attempt == 0
    assert any(e["reason"].startswith(f"joined pack {pack.id}: node 0 GPUs ") for e in store.events(job_id=gang))
    rows = sorted(store.placements(job_id=gang), key=lambda p: p.rank)
    assert [(p.rank, p.world_size) for p in rows] == [(0, 2), (1, 2)] and len({p.gpu_index for p in rows}) == 2
    assert all(p.start_time is not None and p.end_time is not None for p in rows)
    data = json.loads((Path(pack.pack_dir) / "joins" / f"{gang}.json").read_text())
    assert [m["rank"] for m in data["members"]] == [0, 1]
    # the agent ran both ranks as one job, each on its own GPU
    envs = [json.loads(Path(f"{env_out}.rank{r}").read_text())["env"] for r in range(2)]
    assert [(e["RANK"], e["WORLD_SIZE"]) for e in envs] == [("0", "2"), ("1", "2")]
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"]
    assert envs[0]["CUDA_VISIBLE_DEVICES"] != envs[1]["CUDA_VISIBLE_DEVICES"]
    assert store.get_job(long).state == "RUNNING"  # its neighbour kept running
