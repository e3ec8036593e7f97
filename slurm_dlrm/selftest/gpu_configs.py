"""What `scripts/gpu-check.sh` runs (slurm_dlrm.selftest.gpu_check): the memory configs,
the co-location job types, their dry (CPU-test) sizes, and the run's shared state.

Pure data and small dataclasses; no torch, nothing started.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MIB = 1 << 20
GIB = 1 << 30
MEMORY_STEPS = 5

# ---------------------------------------------------------------- the configs

_BASE: dict[str, Any] = {
    "tables": [{"rows": 2_000_000, "dim": 64}, {"rows": 1_000_000, "dim": 64},
               {"rows": 500_000, "dim": 64, "pooling_factor": 8.0}, {"rows": 100_000, "dim": 64}],
    "dense_features": 13, "bottom_mlp": [512, 256, 64], "top_mlp": [512, 256, 1], "batch_size": 2048,
    "steps": MEMORY_STEPS, "checkpoint_every_steps": 0, "metrics_every_steps": 1, "loader_workers": 0,
}
_DCN = {"type": "dcn", "layers": 2, "low_rank": 64}

# sgd / adagrad / adam / row-wise, fused (sparse table gradients) and not, fp32 and bf16,
# dot and DCN, batch 512 .. 16384.
MEMORY_CONFIGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("mem-sgd-dot-b2048", {"optimizer": {"type": "sgd"}}),
    ("mem-adagrad-dot-b2048", {"optimizer": {"type": "adagrad"}}),
    ("mem-adam-dot-b2048", {"optimizer": {"type": "adam"}}),
    ("mem-rowwise-dot-b2048", {"optimizer": {"type": "rowwise_adagrad"}}),
    ("mem-sgd-nonfused-b2048", {"optimizer": {"type": "sgd", "fused": False}}),
    ("mem-adagrad-nonfused-b2048", {"optimizer": {"type": "adagrad", "fused": False}}),
    ("mem-adam-nonfused-b2048", {"optimizer": {"type": "adam", "fused": False}}),
    ("mem-sgd-dot-b512", {"optimizer": {"type": "sgd"}, "batch_size": 512}),
    ("mem-sgd-dot-b16384", {"optimizer": {"type": "sgd"}, "batch_size": 16384}),
    ("mem-adam-dot-bf16-b4096", {"optimizer": {"type": "adam"}, "mixed_precision": "bf16", "batch_size": 4096}),
    ("mem-rowwise-dcn-b2048", {"optimizer": {"type": "rowwise_adagrad"}, "interaction": _DCN}),
    ("mem-adagrad-dcn-bf16-b8192", {"optimizer": {"type": "adagrad"}, "interaction": _DCN,
                                    "mixed_precision": "bf16", "batch_size": 8192}),
    ("mem-adam-nonfused-dcn-b16384", {"optimizer": {"type": "adam", "fused": False}, "interaction": _DCN,
                                      "batch_size": 16384}),
    ("mem-rowwise-dot-bf16-b16384", {"optimizer": {"type": "rowwise_adagrad"}, "mixed_precision": "bf16",
                                     "batch_size": 16384}),
)


def _tables(n: int, rows: int, dim: int, pooling: float) -> list[dict[str, Any]]:
    return [{"rows": rows, "dim": dim, "pooling_factor": pooling} for _ in range(n)]


# From memory-bound (many random row gathers, tiny MLPs) to compute-bound (wide MLPs,
# one id per table). ~1-3 GiB each on a GPU, so eight sit on one GPU together.
JOB_TYPES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("emb-gather-sgd", {"tables": _tables(4, 1_000_000, 128, 64.0), "bottom_mlp": [64, 128], "top_mlp": [64, 1],
                        "batch_size": 4096, "optimizer": {"type": "sgd"}}),
    ("emb-gather-adagrad", {"tables": _tables(4, 500_000, 128, 32.0), "bottom_mlp": [64, 128], "top_mlp": [64, 1],
                            "batch_size": 4096, "optimizer": {"type": "adagrad"}}),
    ("emb-rowwise-dcn", {"tables": _tables(8, 250_000, 64, 16.0), "bottom_mlp": [128, 64], "top_mlp": [256, 1],
                         "batch_size": 4096, "optimizer": {"type": "rowwise_adagrad"}, "interaction": _DCN}),
    ("balanced-dot", {"tables": _tables(8, 200_000, 64, 4.0), "bottom_mlp": [512, 256, 64],
                      "top_mlp": [1024, 512, 1], "batch_size": 4096, "optimizer": {"type": "adam"}}),
    ("balanced-dcn-bf16", {"tables": _tables(8, 200_000, 64, 4.0), "bottom_mlp": [512, 256, 64],
                           "top_mlp": [1024, 512, 1], "batch_size": 8192, "optimizer": {"type": "adam"},
                           "interaction": {"type": "dcn", "layers": 3, "low_rank": 256}, "mixed_precision": "bf16"}),
    ("mlp-wide-fp32", {"tables": _tables(4, 50_000, 128, 1.0), "bottom_mlp": [1024, 1024, 128],
                       "top_mlp": [2048, 2048, 1024, 1], "batch_size": 8192, "optimizer": {"type": "sgd"}}),
    ("mlp-wide-bf16", {"tables": _tables(4, 50_000, 128, 1.0), "bottom_mlp": [2048, 2048, 128],
                       "top_mlp": [4096, 4096, 2048, 1], "batch_size": 16384, "optimizer": {"type": "sgd"},
                       "mixed_precision": "bf16"}),
    ("dcn-deep-bf16", {"tables": _tables(26, 20_000, 128, 1.0), "bottom_mlp": [512, 256, 128],
                       "top_mlp": [1024, 1024, 512, 1], "batch_size": 8192, "optimizer": {"type": "adagrad"},
                       "interaction": {"type": "dcn", "layers": 3, "low_rank": 512}, "mixed_precision": "bf16"}),
)


def spec_data(name: str, overrides: dict[str, Any], dry: bool) -> dict[str, Any]:
    """The spec of one config; `dry`: the same shape at CPU-test size (rows / 1000,
    widths / 16, batch 32), so the plumbing runs in seconds."""
    data = {**_BASE, **overrides, "name": name}
    if dry:
        data["tables"] = [{**t, "rows": max(64, t["rows"] // 1000), "dim": 8} for t in data["tables"]]
        data["bottom_mlp"] = [max(8, w // 16) for w in data["bottom_mlp"][:-1]] + [8]
        data["top_mlp"] = [max(4, w // 16) for w in data["top_mlp"][:-1]] + [1]
        data["batch_size"] = 32
        if data.get("interaction", {}).get("type") == "dcn":
            data["interaction"] = {**data["interaction"], "low_rank": 4}
    return data


# ---------------------------------------------------------------- output


@dataclass
class Out:
    folder: Path
    dry: bool
    log_lines: list[str] = field(default_factory=list)

    def jsonl(self, name: str, record: dict[str, Any]) -> None:
        with open(self.folder / name, "a") as f:
            f.write(json.dumps({"dry": self.dry, **record}) + "\n")

    def log(self, text: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {text}"
        self.log_lines.append(line)
        print(line, file=sys.stderr, flush=True)
        with open(self.folder / "log.txt", "a") as f:
            f.write(line + "\n")


@dataclass
class Env:
    """Where the check runs: the environment its children get, NVML, the GPU model."""

    env: dict[str, str]
    device: str  # "cuda" | "cpu"
    nvml_index: int | None
    gpu_name: str
    model_name: str
    model_note: str
    work: Path
    site_path: Path
