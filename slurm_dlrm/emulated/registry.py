"""What a stand-in member "feels" of its fake GPU: which stand-ins share it right now,
and how fast that lets each run under a co-location truth (issue 29 item 1).

The fake NVML and fake MPS daemon know a GPU's clients but not their solo profiles, so
each stand-in that runs with `--truth` announces itself in a small per-GPU registry:
`<root>/<node>/gpu<index>/<pid>.json` = `{"pid", "job_id", "sm_util_pct",
"membw_util_pct", "gpu_mem_bytes"}` (root: `$SLURM_DLRM_STANDIN_REGISTRY`). `gpu_mem_bytes`
is the device memory the stand-in holds (`--gpu-peak-mib`): the fake NVML reports it as
the process's GPU memory in place of its RSS, so a job of tens of GiB is emulated
without the host memory. A stand-in reads its GPU's
folder at every slice of a step; entries of dead processes are ignored (a killed member
leaves its file behind). The GPU is named as the fake NVML names it: the node
(`$SLURMD_NODENAME`, several slurmd share one host here) and the first
`CUDA_VISIBLE_DEVICES` index, remapped through the fake MPS daemon's device list when
the member is an MPS client (the real MPS server remaps the same way).

Speeds are the simulator's: `predict_speeds_from_fractions` on the members' solo
fractions with the truth `simulate --truth` takes (`parse_truth`), a lone member at 1;
the stand-in's entry point (standin/__main__.py) hands that function in, since the
emulated node's floor (below the agent's) may not import packing or the truth reader.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from slurm_dlrm.emulated.mps_control import STATE_FILE as MPS_STATE_FILE
from slurm_dlrm.osutil import pid_alive

SpeedsOf = Callable[[Sequence[float], Sequence[float]], Sequence[float]]

ENV_STANDIN_REGISTRY = "SLURM_DLRM_STANDIN_REGISTRY"


def gpu_name(env: dict[str, str] | None = None) -> str:
    """`<node>/gpu<index>`: the physical fake GPU this process runs on."""
    env = dict(os.environ) if env is None else env
    node = env.get("SLURMD_NODENAME") or socket.gethostname()
    token = (env.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip()
    pipe = env.get("CUDA_MPS_PIPE_DIRECTORY")
    if pipe:
        try:
            state = json.loads((Path(pipe) / MPS_STATE_FILE).read_text())
        except (OSError, ValueError):
            state = None
        running = isinstance(state, dict) and state.get("running")
        visible = (state.get("visible_devices") or []) if running and isinstance(state, dict) else []
        if token.isdigit() and int(token) < len(visible):
            token = str(visible[int(token)])
    return f"{node}/gpu{token}"


class GpuRegistry:
    """This stand-in's entry in its GPU's folder, and the live co-runners it sees."""

    def __init__(self, root: str | os.PathLike[str], gpu: str, job_id: str | None,
                 sm_util_pct: float, membw_util_pct: float) -> None:
        self.folder = Path(root) / gpu
        self.pid = os.getpid()
        self.entry: dict[str, Any] = {"pid": self.pid, "job_id": job_id, "sm_util_pct": float(sm_util_pct),
                                      "membw_util_pct": float(membw_util_pct)}
        self.path = self.folder / f"{self.pid}.json"

    def __enter__(self) -> GpuRegistry:
        self.folder.mkdir(parents=True, exist_ok=True)
        self._write()
        return self

    def _write(self) -> None:
        tmp = self.folder / f".{self.pid}.tmp"
        tmp.write_text(json.dumps(self.entry))
        os.replace(tmp, self.path)  # readers never see a half-written entry

    def set_gpu_mem(self, nbytes: int) -> None:
        """The device memory this stand-in now holds (what the fake NVML reports)."""
        self.entry["gpu_mem_bytes"] = int(nbytes)
        self._write()

    def __exit__(self, *exc: Any) -> None:
        with contextlib.suppress(OSError):
            self.path.unlink()

    def live(self) -> list[dict[str, Any]]:
        """The live stand-ins on this GPU, this one included, in pid order."""
        out = []
        for f in sorted(self.folder.glob("*.json")):
            try:
                e = json.loads(f.read_text())
                pid = int(e["pid"])
            except (OSError, ValueError, KeyError, TypeError):
                continue  # being replaced, or not ours
            if pid == self.pid or pid_alive(pid):
                out.append(e)
        return out

    def speed(self, speeds_of: SpeedsOf) -> float:
        """This stand-in's speed (relative to solo) with what runs now; `speeds_of(sm, bw)`
        gives every member's speed from their solo SM and bandwidth fractions."""
        live = self.live()
        if len(live) <= 1:
            return 1.0
        sm = [min(1.0, float(e["sm_util_pct"]) / 100.0) for e in live]
        bw = [min(1.0, float(e["membw_util_pct"]) / 100.0) for e in live]
        speeds = speeds_of(sm, bw)
        mine = next((i for i, e in enumerate(live) if int(e["pid"]) == self.pid), None)
        return 1.0 if mine is None else max(1e-3, float(speeds[mine]))


def registered_gpu_mem_bytes(env: dict[str, str], pid: int, node: str, gpu_index: int) -> int | None:
    """The device memory stand-in `pid` declared on `node`'s GPU `gpu_index`, or None when
    it declared none (then the fake NVML falls back to its RSS)."""
    root = env.get(ENV_STANDIN_REGISTRY)
    if not root:
        return None
    try:
        entry = json.loads((Path(root) / node / f"gpu{gpu_index}" / f"{pid}.json").read_text())
        value = entry.get("gpu_mem_bytes")
    except (OSError, ValueError, AttributeError):
        return None
    return int(value) if isinstance(value, int) and value >= 0 else None
