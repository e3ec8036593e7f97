"""Service rounds while ~1,000 members run past their warm-up (FakeSlurm, fake clock).

What the run-time adaptation (docs/recovery.md) adds to a round: the warm-up update,
the straggler check and the re-pack judgement of every running member (at most 64 per
round, each once per `adapt.repack_interval_s`; a fresh plan with up to 32 pending jobs
where a move could pay). Side by side in one run, on the same store: rounds with the
re-pack judgement switched off (the baseline: warm-up and stragglers only) and on.
64 nodes x 4 H100, 1,000 jobs placed and running with random measured SM use (so many
warm-ups ask for a re-plan), 1,000 more pending.

    /work/main/.venv/bin/python benchmarks/service_adapt_round.py

Last line: `adapt_round: members=N seconds_off=X seconds_on=Y` (the slowest of four
rounds after the warm-up, each mode).
"""

from __future__ import annotations

import json
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from service_round import fill, site_for  # noqa: E402

from slurm_dlrm.service.core import PackingService, ServiceSettings  # noqa: E402
from slurm_dlrm.slurm.fake import FakeSlurm  # noqa: E402
from slurm_dlrm.store.store import Store  # noqa: E402

NODES = 64
USER = "bench"


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def placement_file(slurm: FakeSlurm, slurm_job_id: int) -> dict:
    script = slurm.job(slurm_job_id).script
    line = next(x for x in script.splitlines() if "--pack-file" in x)
    return dict(json.loads(Path(shlex.split(line.split("--pack-file", 1)[1])[0]).read_text()))


def run(tmp: Path, repack: bool) -> tuple[int, list[float], int]:
    site = site_for(tmp, NODES)
    clock = Clock()
    with Store(tmp / "store.sqlite", clock=clock) as store:
        slurm = FakeSlurm(clock=clock, nodes=[f"node{i}" for i in range(1, NODES + 1)], user=USER)
        svc = PackingService(store, slurm, site, ServiceSettings(user=USER, python="/venv/bin/python"), clock=clock)
        if not repack:
            svc.recovery._check_repack = lambda *a, **k: None  # type: ignore[method-assign]
        fill(store, 1000, site.spool_dir_for(USER))
        svc.run_round()
        rng = random.Random(0)
        t0 = clock()
        members = 0
        for j in list(slurm.jobs.values()):
            slurm.start(j.job_id)
            p = placement_file(slurm, j.job_id)
            recs = []
            for m in p["members"]:
                members += 1
                recs.append({"type": "member", "job_id": m["job_id"], "state": "RUNNING", "t": t0})
                sps = rng.uniform(500, 2000)
                for k in range(0, 140, 10):
                    recs.append({"type": "sample", "job_id": m["job_id"], "gpu_index": m["gpu_index"],
                                 "sm_util_pct": rng.uniform(10, 90), "samples_per_s": sps * rng.uniform(0.9, 1.1),
                                 "t": t0 + k})
            recs.append({"type": "heartbeat", "t": t0 + 130})
            reports = Path(p["pack_dir"]) / "reports"
            reports.mkdir(exist_ok=True)
            with open(reports / "node1.jsonl", "a") as f:
                for r in recs:
                    f.write(json.dumps({"pack_id": p["pack_id"], "node": "node1", **r}) + "\n")
        fill(store, 1000, site.spool_dir_for(USER), seed=1)  # a queue for the fresh plans
        clock.now += 140
        svc.run_round()  # ingests the reports; warm-ups end (and scipy is imported once)
        seconds = []
        for _ in range(4):
            clock.now += 10
            t = time.perf_counter()
            svc.run_round()
            seconds.append(time.perf_counter() - t)
        judged = len(store.events(kind="move")) + sum(
            "kept in place" in e["reason"] for e in store.events(kind="adapt"))
    return members, seconds, judged


def main() -> None:
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        members, off, _ = run(Path(a), repack=False)
        _, on, judged = run(Path(b), repack=True)
    print(f"{'round':>5} {'re-pack off s':>14} {'re-pack on s':>13}")
    for i, (x, y) in enumerate(zip(off, on, strict=True)):
        print(f"{i + 1:>5} {x:>14.3f} {y:>13.3f}")
    print(f"running members: {members}; warm-up re-plans judged (moved or kept): {judged}")
    print(f"adapt_round: members={members} seconds_off={max(off):.3f} seconds_on={max(on):.3f}")


if __name__ == "__main__":
    main()
