"""Digest of the plans every policy (and refill) makes for a few thousand seeded random
requests, so that a change meant to move code only (issue 15: policies.py split into one
module per policy) can be shown to keep every plan.

Each request is drawn from a seeded `random.Random` (job mixes like
tests/test_packing_props.py's strategies: sizes from 0 to 90 GiB, any utilisation, with
and without durations and time limits; 1-3 node shapes of two GPU models; random limits
and GPU budgets). A third of them also carry running pack GPUs (refill) and a sixth
carry busy shard GPUs (first-fit's open GPUs). Every policy plans every request; the
plan (or the BadInput it raises) is serialised canonically (repr of the frozen
dataclasses) and fed into one sha256.

Run:  .venv/bin/python benchmarks/plan_equivalence.py [--requests 5000] [--seed 15]
Last line:  plan_equivalence: requests=N plans=M digest=SHA256
Compare the digest before and after a refactor: equal digests mean identical plans.

Recorded (defaults): after issue 15's split (main 1cb80fd)
ed091a08a63cd1e7a8236366cea5c4e402a3d589a108e02845ed0fd5de9aca5c; issue 19 changes
complementary's plans on purpose (priced joins, drain-tail order and reservations,
docs/packing.md "Closer to the bound"):
48bb1a75b6fabdc44da3882fee01ecc90970367ef06ef3cac7675fd19b3e76b1, with exclusive's,
first-fit's and mem-best-fit's per-policy digests unchanged.
After main's issue 16 (interference defaults 0, which change every model-driven plan)
was merged in: f98c4da6864385360a3883690b20075249d98f118c7a9c8d2e1089c6456bb330.
Issue 24's bounded refill headroom (`refill_headroom_pct`, then default 25) changes the
reserves of mem-best-fit's and complementary's packs on purpose:
b18e73b50bbfee8a5c42fa7a31559fb573ffda49c8037e99ac1dc2504cabf7b5, with exclusive's and
first-fit's per-policy digests unchanged (same joins: 8374). With the default at 100 and
a pack whose allocation never holds a waiting job taking no joins (drain):
8b11f7a4fcb534a0a7e16e042f4dbd82654abac4b953f3df753aeaf40d9cc0b6 (joins: 8047).
`--headroom share` (the whole share, no drain) gives main's digest before issue 24:
fef096b6b805b3bde2c409defb2cb4e4b85fcbb10930d1e9f4331ce91f66ee49 (joins: 8383).
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from slurm_dlrm.errors import BadInput  # noqa: E402
from slurm_dlrm.packing import (  # noqa: E402
    POLICY_NAMES,
    JobDemand,
    NodeShape,
    PackingLimits,
    PackingRequest,
    plan,
)
from slurm_dlrm.packing.model import OpenGpu  # noqa: E402
from slurm_dlrm.site import GIB, GpuModel  # noqa: E402

H100 = GpuModel("h100", 80, 132, 3350, 67, 494, 520, 32)
A100 = GpuModel("a100", 40, 108, 1555, 19.5, 156, 450, 8)
MODELS = (H100, A100)


def job(rng: random.Random, job_id: int) -> JobDemand:
    return JobDemand(
        job_id=job_id, user=rng.choice(["u", "v"]), submit_time_s=rng.uniform(0, 1000),
        priority=rng.choice([0.0, 1.0, 2.0, 1e9]) if rng.random() < 0.1 else rng.choice([0.0, 1.0, 2.0]),
        gpu_mem_bytes=rng.randint(0, 90 * GIB), host_mem_bytes=rng.randint(0, 64 * GIB),
        sm_util_pct=rng.uniform(0, 100), membw_util_pct=rng.uniform(0, 100),
        host_cpu_cores=rng.uniform(0.1, 12),
        est_duration_s=None if rng.random() < 0.2 else rng.uniform(60, 86400),
        time_limit_s=None if rng.random() < 0.5 else rng.uniform(600, 172800))


def request(rng: random.Random) -> PackingRequest:
    n = rng.randint(1, 40)
    jobs = [job(rng, i) for i in range(n)]
    shapes = []
    for k in range(rng.randint(1, 3)):
        shapes.append(NodeShape(rng.choice(["h100", "a100"]), rng.randint(0, 8), rng.randint(4, 128),
                                rng.randint(16, 1024) * GIB, count=rng.randint(1, 3), name=f"s{k}"))
    limits = PackingLimits(max_members_per_gpu=rng.randint(1, 12), mps_client_limit=rng.randint(1, 48),
                           memory_margin_pct=rng.uniform(0, 30), max_gpus_per_pack=rng.randint(1, 8),
                           shards_per_gpu=rng.randint(1, 12))
    max_gpus = None if rng.random() < 0.5 else rng.randint(0, 20)
    open_gpus: list[OpenGpu] = []
    kind = rng.random()
    if kind < 1 / 3:  # running packs: refill
        next_id = 10_000
        for p in range(rng.randint(1, 4)):
            model = rng.choice(MODELS)
            for node in range(rng.randint(1, 2)):
                free_cpus = rng.randint(0, 40) if rng.random() < 0.9 else None
                free_mem = rng.randint(0, 200) * GIB
                remaining = None if rng.random() < 0.5 else rng.uniform(600, 86400)
                for g in range(rng.randint(1, 4)):
                    live = []
                    for _ in range(rng.randint(0, 3)):
                        live.append(job(rng, next_id))
                        next_id += 1
                    open_gpus.append(OpenGpu(f"{p}:{node}:{g}", f"pack{p}n{node}", len(live), pack=True,
                                             gpu_model=model.name, live=tuple(live), free_cpus=free_cpus,
                                             free_host_mem_bytes=free_mem, remaining_s=remaining))
    elif kind < 0.5:  # busy shard GPUs on the request's nodes: first-fit's open GPUs
        for i in range(rng.randint(1, 4)):
            s = rng.choice(shapes)
            name = s.name if s.count == 1 else f"{s.name}#{rng.randrange(s.count)}"  # as plan() expands shapes
            open_gpus.append(OpenGpu(f"shard{i}", name, rng.randint(0, 6)))
    return PackingRequest(jobs=tuple(jobs), gpu_models=MODELS, nodes=tuple(shapes), limits=limits,
                          max_gpus=max_gpus, open_gpus=tuple(open_gpus))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=15)
    ap.add_argument("--headroom", default=None, metavar="PCT|share",
                    help="refill_headroom_pct of every request (default: PackingLimits' own); "
                         "'share' is the whole share, main's behaviour before issue 24")
    args = ap.parse_args()
    headroom = None if args.headroom == "share" else float(args.headroom) if args.headroom else ...
    rng = random.Random(args.seed)
    digest = hashlib.sha256()
    per_policy = {p: hashlib.sha256() for p in POLICY_NAMES}
    plans = errors = joins = 0
    t0 = time.perf_counter()
    for i in range(args.requests):
        req = request(rng)
        if headroom is not ...:
            req = replace(req, limits=replace(req.limits, refill_headroom_pct=headroom))
        for policy in POLICY_NAMES:
            try:
                text = repr(plan(req, policy))
                joins += text.count("Join(")
            except BadInput as e:
                text = f"BadInput({e})"
                errors += 1
            line = f"{i} {policy} {text}\n".encode()
            digest.update(line)
            per_policy[policy].update(line)
            plans += 1
    secs = time.perf_counter() - t0
    for p in POLICY_NAMES:
        print(f"{p:>14}: {per_policy[p].hexdigest()}")
    print(f"bad-input answers: {errors}, joins: {joins}, seconds: {secs:.1f}")
    print(f"plan_equivalence: requests={args.requests} plans={plans} digest={digest.hexdigest()}")


if __name__ == "__main__":
    main()
