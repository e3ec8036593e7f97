"""The slowdown rule on the local Slurm cluster (issue 31, docs/packing.md "Every job
gets its turn"): a 2-rank job submitted behind a steady stream of one-GPU jobs, each too
big to share a GPU, starts within its bound. The service runs in this process (rounds
0.5 s apart) with the site's `fairness = "slowdown"` and a small bound and wait
(`[packing] overdue_slowdown`, `overdue_min_wait_s`, `gang_reserve_slowdown`), so the
test takes about 30 s; the members are stand-ins (slurm_dlrm/emulated/standin/).

It checks the rule's promise live; it does not tell the rules apart: with jobs of one
length, the gang waits about 10 s under the default "rounds" too (refill places gangs
first and reserves their GPUs under either rule). The simulator's multi run is where
gangs starved before the bound (docs/packing.md).
"""

from __future__ import annotations

import sys
import time
import tomllib

import pytest
from test_faults_live import STANDIN, run_until

pytestmark = pytest.mark.slurm
MIB = 1 << 20
GIB = 1 << 30
RUN_S = 15.0  # every job's run: 60 steps of 0.25 s, and its estimate says so
OVERDUE = 2.0
MIN_WAIT_S = 5.0
STARTUP_S = 30.0
WAITING = ("PENDING", "PLANNED")  # the service's and the agent's start-up for a join or a new pack


@pytest.fixture
def fair_live(slurm_cluster, tmp_path):
    from slurm_dlrm.service.core import PackingService, ServiceSettings
    from slurm_dlrm.site import REPO_SITE_FILE, parse_site
    from slurm_dlrm.store.store import Store, current_user

    data = tomllib.loads(REPO_SITE_FILE.read_text())
    data["site"]["store_dir"] = str(tmp_path / "store-{user}")
    data["site"]["spool_dir"] = str(tmp_path / "spool-{user}")
    data["agent"].update(sample_interval_s=0.5, heartbeat_timeout_s=30.0, term_grace_s=10.0)
    data["packing"].update(fairness="slowdown", overdue_slowdown=OVERDUE, overdue_min_wait_s=MIN_WAIT_S,
                           gang_reserve_slowdown=1.5)
    store = Store(tmp_path / "store.sqlite")
    svc = PackingService(store, slurm_cluster.client(), parse_site(data, "fair-live"),
                         ServiceSettings(user=current_user(), python=sys.executable, max_attempts=4))
    yield svc, store
    ids = [int(p.slurm_job_id) for p in store.packs(["SUBMITTING", "QUEUED", "RUNNING"]) if p.slurm_job_id]
    if ids:
        slurm_cluster.client().scancel(ids)
    store.close()


def add_job(store, user: str, name: str, world_size: int = 1) -> int:
    """A stand-in of RUN_S seconds whose estimate expects RUN_S (100 steps x 16 samples at
    1600 / RUN_S samples/s) and 50 GiB per rank: no two share a GPU."""
    gpu = 50 * GIB
    profile = {"sm_util_pct": 10.0, "membw_util_pct": 10.0, "host_cpu_cores": 1.0, "label": "compute-bound",
               "solo_samples_per_s": 1600 / RUN_S}
    est = {"gpu_peak_bytes": gpu, "host_peak_bytes": 64 * MIB,
           "gpu_breakdown": {"embeddings": gpu - 600 * MIB, "cuda_context": 600 * MIB},
           "host_breakdown": {"python": 64 * MIB}, "profile": profile}
    spec = {"name": name, "tables": [{"name": f"t{r}", "rows": 100, "dim": 8} for r in range(world_size)],
            "dense_features": 4, "bottom_mlp": [8], "top_mlp": [8, 1], "batch_size": 16, "steps": 100,
            "command": [sys.executable, *STANDIN, "--steps", str(int(RUN_S / 0.25)), "--step-s", "0.25"]}
    if world_size > 1:
        spec["world_size"] = world_size
        est["ranks"] = [{"rank": r, "tables": [r], "gpu_peak_bytes": gpu, "host_peak_bytes": 64 * MIB,
                         "gpu_breakdown": est["gpu_breakdown"], "profile": profile} for r in range(world_size)]
    return int(store.add_job(user=user, name=name, spec=spec, spec_fingerprint=f"fp-{name}", estimate=est,
                             gpu_model="h100"))


def test_a_gang_behind_a_stream_of_one_gpu_jobs_starts_within_its_bound(fair_live):
    svc, store = fair_live
    user = svc.settings.user
    singles: list[int] = []

    def stream() -> int:
        """Keep 6 one-GPU jobs waiting (every GPU stays busy); the running count."""
        waiting = [j for j in singles if store.get_job(j).state in WAITING]
        for _ in range(6 - len(waiting)):
            singles.append(add_job(store, user, f"s{len(singles)}"))
        return sum(1 for j in singles if store.get_job(j).state == "RUNNING")

    gpus = sum(n.gpus * len(n.hostnames) for n in svc.site.nodes)
    run_until(svc, lambda: stream() >= gpus, 120, "the stream of one-GPU jobs to fill every GPU")
    gang = add_job(store, user, "gang", world_size=2)
    submitted = time.monotonic()
    run_until(svc, lambda: stream() >= 0 and store.get_job(gang).state not in WAITING, 120,
              "the 2-rank job to start behind the stream")
    waited_s = time.monotonic() - submitted
    behind = sum(1 for j in singles if store.get_job(j).state in WAITING)
    # Its bound: overdue once (wait + run) / run reaches OVERDUE (and MIN_WAIT_S), then
    # a reservation that waits at most for the jobs on its GPUs to end (one run).
    bound_s = max(MIN_WAIT_S, (OVERDUE - 1) * RUN_S) + RUN_S + STARTUP_S
    job = store.get_job(gang)
    assert job.state in ("RUNNING", "COMPLETED"), (job.state, job.exit_reason, store.events(job_id=gang))
    assert waited_s <= bound_s, (waited_s, bound_s, store.events(job_id=gang))
    assert behind > 0  # the stream went on: one-GPU jobs were still waiting when it started
