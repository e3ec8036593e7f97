"""A stand-in pack member for tests and benchmarks (no torch): it behaves like
`slurm-dlrm train` towards the agent and does nothing else.

    python -m slurm_dlrm.emulated.standin --steps 50 --step-s 0.1 [--grow-mib-per-step 8]
        [--exit-code 3] [--env-out PATH] [--busy] [--checkpoint-every 10]
        [--set-env CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=99999M] [--mps-client]

It appends a metrics line per step to $SLURM_DLRM_METRICS_FILE, resumes from and writes
checkpoints in $SLURM_DLRM_CHECKPOINT_DIR, on SIGTERM/SIGUSR1 writes a checkpoint and exits
with TRAIN_EXIT_PREEMPTED, can grow its host memory every step (to trip the agent's host
budget), and ends with the exit code asked for (3 = TRAIN_EXIT_OOM_GPU, ...).
With `--truth T --sm-pct S --bw-pct B` (T as `simulate --truth` takes it) each step
takes `--step-s` over its speed under that truth with the stand-ins that share its fake
GPU at that moment (emulated/registry.py); `--peak-mib M --peak-at-step K` grows its RSS,
which the fake NVML reports as its GPU memory, to the job's true peak M by step K;
`--gpu-peak-mib M` instead declares M MiB of *device* memory in the registry (the fake
NVML reports that, so tens of GiB cost no host memory) and, like a CUDA allocation past
the MPS client's `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`, exits 3 (TRAIN_EXIT_OOM_GPU) when
the next allocation would pass it. `--metrics-every K` writes one metrics line (and
looks at the stop signal) every K steps, as the runner's `metrics_every_steps`: a job of
thousands of short steps then costs a few hundred wake-ups, not thousands.
`--set-env` changes its own environment first (what a member that lifts its own fence
does: one line of Python before CUDA starts); `--mps-client` then "starts CUDA" against
the fake MPS daemon (`emulated/mps_control.py`, `connect_client`), which records the limit it holds
the member to.

Launched as one rank of a multi-rank job (`RANK` in its environment, docs/agent.md
"Multi-rank jobs") it behaves like the runner's ranks: rank 0 alone writes metrics and
checkpoints, every rank resumes from the shared checkpoint, and `--env-out PATH` writes
`PATH.rank<R>` (the ranks share one command).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slurm_dlrm.errors import ENV_CHECKPOINT_DIR, ENV_JOB_ID, ENV_METRICS_FILE, TRAIN_EXIT_PREEMPTED

_stop: list[int] = []
_SLICE_S = 0.05  # how often a stand-in with --truth looks at what shares its GPU


def _on_signal(signum: int, frame: Any) -> None:
    # Ignore repeats: Slurm and the agent both deliver it, and a repeat during interpreter
    # shutdown (Python handlers already removed) would kill the process with the signal.
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    _stop.append(signum)


def _checkpoint(ckpt_dir: Path | None, step: int) -> None:
    if ckpt_dir is None:
        return
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    tmp = ckpt_dir / "checkpoint.json.tmp"
    tmp.write_text(json.dumps({"step": step, "t": time.time()}))
    os.replace(tmp, ckpt_dir / "checkpoint.json")


def main(argv: list[str] | None = None, parse_truth: Callable[[str], Any] | None = None) -> int:
    """The program; `parse_truth` (passed by __main__.py, which stands above the emulated node's
    floor) turns --truth into the speeds function GpuRegistry.speed takes."""
    ap = argparse.ArgumentParser(prog="standin")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--step-s", type=float, default=0.1)
    ap.add_argument("--samples-per-step", type=int, default=2048)
    ap.add_argument("--grow-mib-per-step", type=float, default=0.0)
    ap.add_argument("--exit-code", type=int, default=0)
    ap.add_argument("--env-out", default=None)
    ap.add_argument("--busy", action="store_true", help="spin instead of sleeping")
    ap.add_argument("--ignore-term", action="store_true", help="ignore SIGTERM (a hung member)")
    ap.add_argument("--checkpoint-every", type=int, default=0, help="also checkpoint every N steps (0: only on stop)")
    ap.add_argument("--set-env", action="append", default=[], metavar="K=V", help="set in its own environment first")
    ap.add_argument("--mps-client", action="store_true", help="connect to the (fake) MPS daemon as a CUDA client")
    # A GPU that slows down like one (emulated/registry.py): --step-s is the solo step
    # time, each step's time follows the truth for what shares the fake GPU meanwhile.
    ap.add_argument("--truth", default=None, help="co-location truth as `simulate --truth` takes it")
    ap.add_argument("--sm-pct", type=float, default=0.0, help="solo SM use, %% (with --truth)")
    ap.add_argument("--bw-pct", type=float, default=0.0, help="solo memory-bandwidth use, %% (with --truth)")
    ap.add_argument("--peak-mib", type=float, default=0.0,
                    help="true peak memory: RSS (the fake NVML's GPU memory) grows to it by --peak-at-step")
    ap.add_argument("--peak-at-step", type=int, default=1)
    ap.add_argument("--gpu-peak-mib", type=float, default=0.0,
                    help="true peak device memory, declared in the registry (needs --truth), by --peak-at-step")
    ap.add_argument("--metrics-every", type=int, default=1, help="steps per metrics line (and per wake-up)")
    ap.add_argument("--registry", default=None,
                    help="the stand-ins' per-GPU registry folder (default $SLURM_DLRM_STANDIN_REGISTRY, else in $TMPDIR)")
    args = ap.parse_args(argv)
    truth = None
    if args.truth is not None:
        from slurm_dlrm.errors import BadInput

        if parse_truth is None:
            print("standin: --truth needs the program's entry point (python -m slurm_dlrm.emulated.standin)",
                  file=sys.stderr)
            return 2
        try:
            truth = parse_truth(args.truth)
        except BadInput as exc:
            print(f"standin: {exc}", file=sys.stderr)
            return 2
    if args.gpu_peak_mib and truth is None:
        print("standin: --gpu-peak-mib needs --truth (device memory lives in the stand-ins' registry)",
              file=sys.stderr)
        return 2
    if args.metrics_every < 1:
        print("standin: --metrics-every must be >= 1", file=sys.stderr)
        return 2
    for item in args.set_env:
        key, _, value = item.partition("=")
        os.environ[key] = value
    if args.mps_client and os.environ.get("CUDA_MPS_PIPE_DIRECTORY"):
        from slurm_dlrm.emulated.mps_control import connect_client

        connect_client()
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN if args.ignore_term else _on_signal)
    metrics = os.environ.get(ENV_METRICS_FILE)
    ckpt_env = os.environ.get(ENV_CHECKPOINT_DIR)
    ckpt_dir = Path(ckpt_env) if ckpt_env else None
    rank = os.environ.get("RANK")
    if rank is not None and rank != "0":
        metrics = None  # rank 0 alone writes the job's metrics and checkpoints, as the runner does
    if args.env_out:
        keep = {k: v for k, v in os.environ.items()
                if k.startswith(("CUDA_", "SLURM_DLRM_", "OMP_", "SLURM_STEP_ID", "SLURM_JOB_ID"))
                or k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
        out_path = f"{args.env_out}.rank{rank}" if rank is not None else args.env_out
        Path(out_path).write_text(json.dumps({"pid": os.getpid(), "pgid": os.getpgid(0), "env": keep}))
    step = 0
    if ckpt_dir is not None and (ckpt_dir / "checkpoint.json").exists():
        step = int(json.loads((ckpt_dir / "checkpoint.json").read_text())["step"])
    hog: list[bytearray] = []
    out = open(metrics, "a", buffering=1) if metrics else None  # noqa: SIM115
    writes_ckpt = ckpt_dir if rank in (None, "0") else None
    registry = None
    if truth is not None:
        from slurm_dlrm.emulated.registry import ENV_STANDIN_REGISTRY, GpuRegistry, gpu_name

        root = (args.registry or os.environ.get(ENV_STANDIN_REGISTRY)
                or str(Path(tempfile.gettempdir()) / f"slurm-dlrm-standins-{os.getuid()}"))
        registry = GpuRegistry(root, gpu_name(), os.environ.get(ENV_JOB_ID), args.sm_pct, args.bw_pct)
    with registry or contextlib.nullcontext():
        return _run(args, step, hog, out, writes_ckpt, registry, truth)


def _pinned_limit_bytes() -> int | None:
    """The device memory the MPS server lets this client allocate (its own environment's
    CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, as the agent sets it), or None without a limit."""
    from slurm_dlrm.emulated.mps_control import client_limit_mib

    mib = client_limit_mib(os.environ.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", ""))
    return None if mib is None else mib << 20


def _run(args: Any, step: int, hog: list[bytearray], out: Any, writes_ckpt: Path | None,
         registry: Any, truth: Any) -> int:
    from slurm_dlrm.errors import TRAIN_EXIT_OOM_GPU

    peak_bytes = int(args.peak_mib * (1 << 20))
    gpu_peak_bytes = int(args.gpu_peak_mib * (1 << 20))
    gpu_limit = _pinned_limit_bytes() if gpu_peak_bytes else None
    while step < args.steps:
        if _stop:
            _checkpoint(writes_ckpt, step)
            return TRAIN_EXIT_PREEMPTED
        t0 = time.monotonic()
        chunk = min(args.metrics_every, args.steps - step)
        step_s = args.step_s * chunk
        if gpu_peak_bytes:
            want_gpu = int(gpu_peak_bytes * min(1.0, (step + chunk) / max(1, args.peak_at_step)))
            if gpu_limit is not None and want_gpu > gpu_limit:
                print(f"standin: CUDA out of memory: {want_gpu >> 20} MiB over the MPS limit {gpu_limit >> 20} MiB",
                      file=sys.stderr)
                return TRAIN_EXIT_OOM_GPU  # as the runner exits on torch.cuda.OutOfMemoryError
            if want_gpu > int(registry.entry.get("gpu_mem_bytes", 0)):
                registry.set_gpu_mem(want_gpu)
        if registry is not None:
            # Progress at the speed of each short slice: co-runners come and go mid-step.
            done = 0.0
            while done < step_s and not _stop:
                speed = registry.speed(truth)
                dt_s = min(_SLICE_S, (step_s - done) / speed)
                time.sleep(dt_s)
                done += dt_s * speed
        elif args.busy:
            while time.monotonic() - t0 < step_s:
                pass
        else:
            time.sleep(step_s)
        if peak_bytes:
            want = peak_bytes * min(1.0, (step + chunk) / max(1, args.peak_at_step))
            have = sum(len(b) for b in hog)
            if want > have:
                block = bytearray(int(want - have))
                block[::4096] = b"x" * len(block[::4096])  # touch every page so it counts in RSS
                hog.append(block)
        if args.grow_mib_per_step:
            block = bytearray(int(args.grow_mib_per_step * (1 << 20)))
            block[::4096] = b"x" * len(block[::4096])  # touch every page so it counts in RSS
            hog.append(block)
        before = step
        step += chunk
        dt = time.monotonic() - t0
        if out is not None:
            out.write(json.dumps({"t": time.time(), "step": step, "samples_per_s": args.samples_per_step * chunk / dt,
                                  "step_time_s": dt / chunk, "loss": 1.0 / step,
                                  "job_id": os.environ.get(ENV_JOB_ID),
                                  "pid": os.getpid()}) + "\n")  # one run's lines (chaos_live: overlaps)
        # The step's metrics line first, then its checkpoint, as the runner writes them: a
        # member SIGKILLed between the two (the agent's OOM stop) must not leave a
        # checkpoint ahead of its metrics, or its next run resumes past a step nobody saw
        # (issue 43 item 14: runs [32, 33, 34], [36, ...] on Slurm 26.05).
        if args.checkpoint_every and step // args.checkpoint_every > before // args.checkpoint_every:
            _checkpoint(writes_ckpt, step)  # what a killed run resumes from (as the runner's periodic ones)
    _checkpoint(writes_ckpt, step)
    if out is not None:
        out.close()
    return args.exit_code


def member_entry(pack_dir: str | os.PathLike[str], job_id: int, gpu_index: int, *, node_index: int = 0,
                 host_mem_limit_mib: int = 512, gpu_mem_limit_mib: int = 3000, mps_thread_pct: int = 50,
                 args: list[str] | None = None, python: str | None = None) -> dict[str, Any]:
    """A placement member (docs/interfaces.md section 3) that runs this stand-in."""
    job_dir = Path(pack_dir) / f"job-{job_id}"
    return {
        "job_id": job_id, "name": f"standin-{job_id}", "node_index": node_index, "gpu_index": gpu_index,
        "mps_thread_pct": mps_thread_pct, "gpu_mem_limit_mib": gpu_mem_limit_mib,
        "host_mem_limit_bytes": host_mem_limit_mib << 20, "cpus": 1,
        "command": [python or sys.executable, "-m", "slurm_dlrm.emulated.standin", *(args or [])],
        "checkpoint_dir": str(job_dir / "ckpt"), "metrics_path": str(job_dir / "metrics.jsonl"),
    }


def placement_dict(pack_dir: str | os.PathLike[str], members: list[dict[str, Any]], *, pack_id: int = 7,
                   sample_interval_s: float = 0.2, term_grace_s: float = 5.0, mps: bool = True,
                   host_mem_tolerance_pct: float = 10.0) -> dict[str, Any]:
    return {"pack_id": pack_id, "user": os.environ.get("USER", "root"), "mps": mps,
            "sample_interval_s": sample_interval_s, "host_mem_tolerance_pct": host_mem_tolerance_pct,
            "term_grace_s": term_grace_s, "pack_dir": str(pack_dir), "members": members}


def rank_entries(entry: dict[str, Any], gpu_indexes: list[int], **per_rank: list[Any]) -> list[dict[str, Any]]:
    """The W placement entries of one multi-rank job (docs/interfaces.md section 3) from one
    member entry: rank r on gpu_indexes[r]; `per_rank` gives a field's value per rank
    (e.g. host_mem_limit_bytes=[...])."""
    out = []
    for r, gpu in enumerate(gpu_indexes):
        e = dict(entry, rank=r, world_size=len(gpu_indexes), gpu_index=gpu)
        for key, values in per_rank.items():
            e[key] = values[r]
        out.append(e)
    return out
