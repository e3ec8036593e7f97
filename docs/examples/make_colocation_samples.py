"""Write the example co-location data (synthetic: NOT measurements).

Relative speeds come from the interference model itself with known constants
(alpha=0.5, beta=1.0, gamma=0.05, not the defaults) times 3% Gaussian noise, so
`slurm-dlrm interference eval --refit` on them should find roughly those constants.
Regenerate (tests/test_interference_cli.py checks the files match):

    /work/main/.venv/bin/python docs/examples/make_colocation_samples.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from slurm_dlrm.packing import InterferenceParams, SoloProfile, predict_colocated_speeds

TRUTH = InterferenceParams(0.5, 1.0, 0.05)
HERE = Path(__file__).resolve().parent


def groups(n_groups: int = 16, seed: int = 11, noise: float = 0.03) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for g in range(n_groups):
        size = rng.choice((2, 2, 2, 3, 3, 4))
        members = [SoloProfile(round(rng.uniform(5, 75), 1), round(rng.uniform(5, 75), 1),
                               rng.choice((4, 8, 12, 16, 24)) << 30) for _ in range(size)]
        speeds = predict_colocated_speeds(members, TRUTH)
        out.append({"group": f"g{g + 1:02d}", "jobs": [f"j{g + 1:02d}{chr(97 + i)}" for i in range(size)],
                    "members": members,
                    "speeds": [round(min(1.0, s * (1 + rng.gauss(0, noise))), 4) for s in speeds]})
    return out


def as_csv(data: list[dict]) -> str:
    lines = ["group,job,sm_util_pct,membw_util_pct,gpu_mem_gib,speed"]
    for g in data:
        for job, m, s in zip(g["jobs"], g["members"], g["speeds"], strict=True):
            lines.append(f"{g['group']},{job},{m.sm_util_pct},{m.membw_util_pct},{m.gpu_mem_bytes >> 30},{s}")
    return "\n".join(lines) + "\n"


def as_jsonl(data: list[dict]) -> str:
    return "".join(json.dumps({"group": g["group"], "members": [
        {"job": job, "sm_util_pct": m.sm_util_pct, "membw_util_pct": m.membw_util_pct,
         "gpu_mem_gib": m.gpu_mem_bytes >> 30} for job, m in zip(g["jobs"], g["members"], strict=True)],
        "speeds": g["speeds"]}) + "\n" for g in data)


if __name__ == "__main__":
    data = groups()
    (HERE / "colocation_samples.csv").write_text(as_csv(data))
    (HERE / "colocation_samples.jsonl").write_text(as_jsonl(data))
