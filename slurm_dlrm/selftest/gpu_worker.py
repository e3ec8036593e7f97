"""The child processes of `scripts/gpu-check.sh`, one JSON line per event on stdout.

    python -m slurm_dlrm.selftest.gpu_worker memory SPEC.json... --device cuda --steps 5 [--nvml-index 0]
        trains the plain-torch DLRM of each SPEC (slurm_dlrm.selftest.plain_dlrm) and prints
        torch's peaks, the allocator's statistics, the optimizer state it holds and NVML's
        memory of this process: one "memory" event per spec (on a GPU the parent gives
        one spec per process: peaks and NVML's figure are per process).
    python -m slurm_dlrm.selftest.gpu_worker colocate SPEC.json --device cuda
        builds the model, warms up, prints "ready", then reads commands on stdin:
        `run SECONDS` trains for that long and prints a "window" event (steps, seconds,
        steps/s), `quit` ends. The parent starts one per job type and runs their windows
        alone and in pairs, so a process starts once, not once per measurement.

Each process has its own CUDA context (and MPS client, NVML process entry). Imports
torch; the parent (slurm_dlrm.selftest.gpu_check) never does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

MIB = 1 << 20


def emit(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, "pid": os.getpid(), **fields}) + "\n")
    sys.stdout.flush()


def nvml_process_bytes(nvml_index: int | None) -> int | None:
    """NVML's memory of this process (the agent's seam; the fake NVML when it is set)."""
    if nvml_index is None:
        return None
    from slurm_dlrm.agent.nvml import Nvml

    nv = Nvml()
    if not nv.init():
        return None
    try:
        mine = nv.sample([nvml_index]).by_pid().get(os.getpid())
    finally:
        nv.shutdown()
    return mine.gpu_mem_bytes if mine is not None else None


def _load(path: str) -> Any:
    from slurm_dlrm.spec import parse_spec

    return parse_spec(json.loads(Path(path).read_text()), path)


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def role_memory(args: argparse.Namespace) -> int:
    import torch

    from slurm_dlrm.selftest.plain_dlrm import build_trainer

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.init()
    for path in args.spec:  # one spec per process on a GPU (its own context and NVML entry)
        spec = _load(path)
        try:
            trainer = build_trainer(spec, device, batches=1)  # the estimator counts the batch in use only
            for _ in range(args.steps):  # Adam's state appears at the first step; the peak is in the first two
                trainer.step()
            _sync(device)
        except Exception as exc:  # noqa: BLE001 - reported per spec, the next one runs
            emit("error", spec=spec.name, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
            continue
        stats: dict[str, Any] = torch.cuda.memory_stats() if cuda else {}
        emit("memory", spec=spec.name, device=device.type, steps=args.steps, notes=trainer.notes,
             max_memory_allocated_bytes=int(torch.cuda.max_memory_allocated()) if cuda else None,
             max_memory_reserved_bytes=int(torch.cuda.max_memory_reserved()) if cuda else None,
             memory_reserved_now_bytes=int(torch.cuda.memory_reserved()) if cuda else None,
             segments_peak=stats.get("segment.all.peak"),
             inactive_split_bytes_peak=stats.get("inactive_split_bytes.all.peak"),
             optimizer_state_bytes=trainer.optimizer_state_bytes(),
             table_bytes=sum(p.numel() * p.element_size() for p in trainer.model.tables.parameters()),
             batches_on_device=len(trainer.batches),
             nvml_process_bytes=nvml_process_bytes(args.nvml_index))
        del trainer
    return 0


def role_colocate(args: argparse.Namespace) -> int:
    import torch

    from slurm_dlrm.selftest.plain_dlrm import build_trainer

    spec = _load(args.spec[0])
    device = torch.device(args.device)
    trainer = build_trainer(spec, device, batches=4)
    for _ in range(3):  # warm-up: cuBLAS picks its kernels, the allocator fills its cache
        trainer.step()
    _sync(device)
    emit("ready", spec=spec.name, device=device.type,
         max_memory_reserved_bytes=int(torch.cuda.max_memory_reserved()) if device.type == "cuda" else None,
         nvml_process_bytes=nvml_process_bytes(args.nvml_index))
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "quit":
            break
        if words[0] != "run" or len(words) != 2:
            emit("error", error=f"unknown command {line.strip()!r}")
            continue
        seconds = float(words[1])
        steps = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            trainer.step()  # float(loss) synchronises: every step is finished when counted
            steps += 1
        dt = time.perf_counter() - t0
        emit("window", spec=spec.name, steps=steps, seconds=dt, steps_per_s=steps / dt,
             samples_per_s=steps * spec.batch_size / dt)
    emit("done")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m slurm_dlrm.selftest.gpu_worker")
    p.add_argument("role", choices=("memory", "colocate"))
    p.add_argument("spec", nargs="+", help="job spec(s) (JSON); colocate takes one")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--nvml-index", type=int, default=None)
    args = p.parse_args(argv)
    if args.role == "colocate" and len(args.spec) != 1:
        p.error("colocate takes one spec")
    try:
        return role_memory(args) if args.role == "memory" else role_colocate(args)
    except Exception as exc:  # noqa: BLE001 - the parent reads the reason from the event
        emit("error", error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
