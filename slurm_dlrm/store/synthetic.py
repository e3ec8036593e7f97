"""Synthetic history for tests, benchmarks and report previews (not used in production).

Packs of 1-2 GPUs with 1-4 members per GPU run one after another; each member gets an
estimate, a measured peak near it, and monitoring samples through `add_samples`, so
every aggregate goes through the real write path.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from slurm_dlrm.store.records import NewPlacement
from slurm_dlrm.store.states import JobState, PackState
from slurm_dlrm.store.store import Store

GIB = 1 << 30


@dataclass
class SyntheticHistory:
    job_ids: list[int]
    pack_ids: list[int]
    n_samples: int


def populate(store: Store, *, n_jobs: int, samples_per_job: int, t0: float, seed: int = 0,
             user: str = "alice", interval_s: float = 2.0, gpu_samples: bool = True,
             final_running: int = 0) -> SyntheticHistory:
    """Write `n_jobs` finished jobs (the last `final_running` still RUNNING) with samples."""
    rng = random.Random(seed)
    job_ids: list[int] = []
    pack_ids: list[int] = []
    n_samples = 0
    t = t0
    remaining = n_jobs
    with store.write():
        while remaining > 0:
            n_gpus = rng.choice((1, 1, 2))
            per_gpu = [rng.randint(1, 4) for _ in range(n_gpus)]
            members = min(sum(per_gpu), remaining)
            remaining -= members
            ids = []
            for i in range(members):
                est_gpu = rng.randint(1, 18) * GIB
                est_host = rng.randint(2, 30) * GIB
                fp = f"fp{rng.randint(0, 49):02d}"
                ids.append(store.add_job(
                    user=user, name=f"syn-{len(job_ids) + i}", spec={"name": f"syn-{len(job_ids) + i}"},
                    spec_fingerprint=fp, gpu_model="h100", submit_time=t - rng.uniform(5, 600),
                    estimate={"gpu_peak_bytes": est_gpu, "host_peak_bytes": est_host,
                              "profile": {"label": rng.choice(("compute-bound", "memory-bound")),
                                          "solo_samples_per_s": rng.uniform(20_000, 40_000)}},
                ))
            placements = []
            slot = 0
            for g, k in enumerate(per_gpu):
                for _ in range(k):
                    if slot < len(ids):
                        # the plan's predicted speed: a fixed guess (no rng draw, so the
                        # rest of the synthetic history stays as it was)
                        placements.append(NewPlacement(ids[slot], 0, g, mps_thread_pct=100 // k,
                                                       predicted_speed=1.0 if k == 1 else round(k ** -0.5, 3)))
                        slot += 1
            pid = store.add_pack(name=f"dlrm-{user}-{len(pack_ids)}", user=user, policy="complementary",
                                 n_gpus=n_gpus, placements=placements, t=t)
            store.transition_pack(pid, PackState.QUEUED, "submitted", slurm_job_id=str(1000 + pid), t=t + 1)
            store.transition_pack(pid, PackState.RUNNING, "started", nodes="node1", t=t + 5)
            duration = samples_per_job * interval_s
            running_tail = remaining == 0 and final_running > 0
            ends = []
            for jid in ids:
                store.transition_job(jid, JobState.RUNNING, "member started", t=t + 6)
            for idx, p in enumerate(placements):
                end = t + 6 + duration * rng.uniform(0.9, 1.0)
                ends.append(end)
                n_samples += store.insert_samples_in_tx(list(_samples(rng, pid, p, t + 6, samples_per_job, interval_s)))
                if running_tail and idx >= len(placements) - final_running:
                    continue
                state = rng.choices((JobState.COMPLETED, JobState.FAILED, JobState.OOM), (0.9, 0.05, 0.05))[0]
                store.transition_job(p.job_id, state, "exit 0" if state == JobState.COMPLETED else state.value.lower(),
                                     exit_code=0 if state == JobState.COMPLETED else 3, t=end)
            if gpu_samples:
                for g in range(n_gpus):
                    rows = [{"t": t + 6 + i * interval_s, "pack_id": pid, "job_id": None, "node": "node1",
                             "gpu_index": g, "sm_util_pct": float(rng.randint(40, 95)), "gpu_mem_bytes": 0}
                            for i in range(0, samples_per_job, 4)]
                    n_samples += store.insert_samples_in_tx(rows)
            if not running_tail:
                store.transition_pack(pid, PackState.COMPLETED, "allocation ended", t=max(ends) + 2)
            job_ids += ids
            pack_ids.append(pid)
            t = max(ends) + rng.uniform(1, 30)
    return SyntheticHistory(job_ids, pack_ids, n_samples)


def _samples(rng: random.Random, pack_id: int, p: NewPlacement, start: float, n: int,
             interval_s: float) -> Iterator[dict[str, Any]]:
    peak = rng.randint(1, 20) * GIB
    sm = rng.uniform(10, 60)
    for i in range(n):
        yield {"t": start + i * interval_s, "pack_id": pack_id, "job_id": p.job_id, "node": "node1",
               # NVML reports whole percents; psutil one decimal.
               "gpu_index": p.gpu_index, "sm_util_pct": float(round(min(100.0, max(0.0, rng.gauss(sm, 5))))),
               "mem_util_pct": float(rng.randint(5, 50)), "gpu_mem_bytes": int(peak * min(1.0, (i + 1) / 5)),
               "host_cpu_pct": round(rng.uniform(50, 200), 1), "rss_bytes": rng.randint(1, 8) * GIB,
               "samples_per_s": round(rng.uniform(5_000, 30_000), 1)}


def sample_line_dicts(pack_id: int, job_id: int, n: int, t0: float, seed: int = 0) -> Iterator[dict[str, Any]]:
    """Contract-4 "sample" records for one member (for spool files in tests/benchmarks)."""
    rng = random.Random(seed)
    for i in range(n):
        yield {"type": "sample", "t": t0 + i * 0.5, "pack_id": pack_id, "job_id": job_id, "node": "node1",
               "gpu_index": 0, "sm_util_pct": float(rng.randint(0, 100)), "mem_util_pct": 20.0,
               "gpu_mem_bytes": rng.randint(1, 1 << 34), "host_cpu_pct": 150.0,
               "rss_bytes": rng.randint(1, 1 << 33), "samples_per_s": round(rng.uniform(1000, 9000), 1)}
