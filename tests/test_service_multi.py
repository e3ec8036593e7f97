"""Multi-GPU jobs through the packing service (issue 18): one placement-file entry and
one store row per rank, queue and show list the ranks (FakeSlurm, fake clock)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from service_harness import GIB, MIB, estimate_dict, fake_service, spec_dict

from slurm_dlrm.service.queue import queue_rows

USER = "root"


@pytest.fixture
def world(tmp_path):
    svc, store, _slurm, _clock = fake_service(tmp_path, USER)
    yield svc, store
    store.close()


def _rank(gpu_gib: float, sm: float) -> dict:
    d = estimate_dict(gpu_gib=gpu_gib, sm=sm, bw=sm)
    return {"rank": 0, "tables": [0], "gpu_peak_bytes": d["gpu_peak_bytes"], "host_peak_bytes": d["host_peak_bytes"],
            "gpu_breakdown": d["gpu_breakdown"], "profile": d["profile"]}


def test_a_two_rank_job_gets_an_entry_and_a_row_per_rank(world):
    svc, store = world
    est = estimate_dict(gpu_gib=12, sm=30, bw=30)
    est["ranks"] = [dict(_rank(12, 30), rank=0), dict(_rank(3, 10), rank=1, tables=[1])]
    spec = dict(spec_dict("gang"), world_size=2)
    gang = int(store.add_job(user=USER, name="gang", spec=spec, spec_fingerprint="fp-gang", estimate=est,
                             gpu_model="h100"))
    singles = [int(store.add_job(user=USER, name=f"s{i}", spec=spec_dict(f"s{i}"), spec_fingerprint=f"fp-s{i}",
                                 estimate=estimate_dict(gpu_gib=2, sm=15, bw=15), gpu_model="h100"))
               for i in range(3)]
    stats = svc.run_round()
    assert stats.jobs_planned == 4  # jobs, not rank entries
    pack = store.get_pack(store.get_job(gang).pack_id)
    placement = json.loads((Path(pack.pack_dir) / "placement.json").read_text())
    ranks = sorted((m for m in placement["members"] if m["job_id"] == gang), key=lambda m: m["rank"])
    assert [(m["rank"], m["world_size"]) for m in ranks] == [(0, 2), (1, 2)]
    assert len({(m["node_index"], m["gpu_index"]) for m in ranks}) == 2
    assert ranks[0]["node_index"] == ranks[1]["node_index"]
    for key in ("command", "checkpoint_dir", "metrics_path"):
        assert ranks[0][key] == ranks[1][key]
    assert ranks[0]["gpu_mem_limit_mib"] > 3 * ranks[1]["gpu_mem_limit_mib"]  # each rank its own fence
    others = [m for m in placement["members"] if m["job_id"] != gang]
    assert others and all("rank" not in m and "world_size" not in m for m in others)
    rows = [p for p in store.placements(job_id=gang)]
    assert sorted((p.rank, p.world_size) for p in rows) == [(0, 2), (1, 2)]
    (row,) = [r for r in queue_rows(store, user=USER, service={}, job_ids=[gang])]
    assert [r["rank"] for r in row["ranks"]] == [0, 1]
    assert row["ranks"][0]["gpu_mem_mib"] * MIB > 12 * GIB
    single_rows = queue_rows(store, user=USER, service={}, job_ids=singles)
    assert all("ranks" not in r for r in single_rows)
