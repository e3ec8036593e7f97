"""The GPU side of `slurm-dlrm selftest`: child processes that measure, one JSON line per event.

`python -m slurm_dlrm.selftest.probe ROLE ...`, each run in its own process so that its
CUDA context, MPS client variables and NVML process entry are its own:

    idle      no CUDA at all: waits for --stop (a stand-in MPS client when there is no GPU,
              so NVML's process list can be checked against the fake)
    bench     FP32 8192^2 matmuls for --seconds; prints TFLOP/s (the thread-share check)
    steady    like bench, then keeps computing until --stop appears, printing progress
    greedy    allocates --chunk-mib blocks until CUDA says out of memory; holds them until --stop
    estimate  trains SPEC (JSON file) for --steps with the runner on CUDA; prints torch's peaks
              and NVML's memory of this process ("unavailable" when torchrec/fbgemm-gpu
              are not installed)
    calibrate CUDA context and cuBLAS workspace, GEMM efficiency, copy and gather bandwidth,
              kernel launch overhead

Events go to stdout (or --status FILE, flushed per line). Torch is imported only here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

MIB = 1 << 20
BENCH_N = 8192  # 8192^2 FP32: 4096 tiles of 128x128, so wave quantisation stays under 2 %


def _emitter(path: str | None) -> TextIO:
    return open(path, "a", buffering=1) if path else sys.stdout  # noqa: SIM115 - lives as long as the process


def emit(out: TextIO, event: str, **fields: Any) -> None:
    out.write(json.dumps({"event": event, "pid": os.getpid(), "t": time.time(), **fields}) + "\n")
    out.flush()


def _wait_stop(stop: str | None, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while stop and not Path(stop).exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _nvml_process_bytes(nvml_index: int | None) -> int | None:
    """NVML's memory figure of this process on its GPU (the seam the agent samples with)."""
    if nvml_index is None:
        return None
    from slurm_dlrm.agent.nvml import Nvml

    nv = Nvml()
    try:
        snap = nv.sample([nvml_index])
    finally:
        nv.shutdown()
    mine = snap.by_pid().get(os.getpid())
    return mine.gpu_mem_bytes if mine is not None else None


# ---------------------------------------------------------------- roles


def role_idle(args: argparse.Namespace, out: TextIO) -> int:
    emit(out, "ready", cuda=False)
    _wait_stop(args.stop, args.timeout)
    emit(out, "done")
    return 0


def _matmul_tflops(seconds: float) -> tuple[float, int]:
    import torch

    a = torch.randn(BENCH_N, BENCH_N, device="cuda")
    b = torch.randn(BENCH_N, BENCH_N, device="cuda")
    torch.matmul(a, b)  # warm-up: cuBLAS picks its kernel, clocks ramp
    torch.cuda.synchronize()
    n = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        torch.matmul(a, b)
        torch.cuda.synchronize()
        n += 1
    dt = time.perf_counter() - t0
    return 2 * BENCH_N**3 * n / dt / 1e12, n


def role_bench(args: argparse.Namespace, out: TextIO) -> int:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False  # FP32 FMA: throughput follows the SMs given
    emit(out, "ready", cuda=True)
    tflops, n = _matmul_tflops(args.seconds)
    emit(out, "bench", tflops=tflops, iterations=n,
         thread_pct=os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"))
    return 0


def role_steady(args: argparse.Namespace, out: TextIO) -> int:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    a = torch.randn(2048, 2048, device="cuda")
    torch.cuda.synchronize()
    emit(out, "ready", cuda=True)
    n = 0
    last = time.monotonic()
    deadline = time.monotonic() + args.timeout
    while not (args.stop and Path(args.stop).exists()) and time.monotonic() < deadline:
        torch.matmul(a, a)
        torch.cuda.synchronize()
        n += 1
        if time.monotonic() - last > 0.25:
            emit(out, "progress", iterations=n)
            last = time.monotonic()
    emit(out, "done", iterations=n)
    return 0


def role_greedy(args: argparse.Namespace, out: TextIO) -> int:
    import torch

    torch.zeros(1, device="cuda")
    emit(out, "ready", cuda=True)
    blocks = []
    chunk = args.chunk_mib * MIB
    allocated = 0
    code = 0
    try:
        while allocated < args.max_mib * MIB:
            blocks.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
            allocated += chunk
        emit(out, "no_oom", allocated_mib=allocated // MIB)
    except torch.OutOfMemoryError as exc:
        emit(out, "oom", allocated_mib=allocated // MIB, error=str(exc).splitlines()[0][:200])
        code = 3  # TRAIN_EXIT_OOM_GPU, what a member that hits its fence exits with
    _wait_stop(args.stop, args.timeout)  # hold the memory: NVML must see this client
    emit(out, "done")
    return code


# What the runner's model needs beyond torch; missing, the estimate role says so.
RUNNER_LIBRARIES = ("torchrec", "fbgemm_gpu")


def role_estimate(args: argparse.Namespace, out: TextIO) -> int:
    import torch

    from slurm_dlrm.spec import parse_spec

    try:
        # The selftest's estimator specs check the runner's torchrec backend (the runner
        # itself imports torchrec only for that backend since issue 38).
        import fbgemm_gpu  # noqa: F401
        import torchrec  # noqa: F401

        from slurm_dlrm.train.runner import (
            RunOptions,
            StopFlag,
            quiet_library_logs,
            setup,
            teardown,
        )
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").split(".")[0]
        if missing not in RUNNER_LIBRARIES:
            raise
        # A GPU machine with torch alone (scripts/gpu-check.sh's): not a broken node.
        emit(out, "unavailable", reason=f"{missing} is not installed: these specs check the runner's torchrec "
             "backend (scripts/gpu-check.sh runs its backend torch instead)")
        return 0

    quiet_library_logs()
    spec = parse_spec(json.loads(Path(args.spec).read_text()), args.spec)
    work = Path(args.workdir)
    opts = RunOptions(metrics_file=work / "metrics.jsonl", checkpoint_dir=work / "ckpt", steps=args.steps,
                      device=args.device, resume=False, tty=False, final_checkpoint=False)
    trainer = setup(spec, opts, StopFlag())
    cuda = trainer.device.type == "cuda"  # --device cpu: the plumbing only (tests without a GPU)
    try:
        code = trainer.run()
        if cuda:
            torch.cuda.synchronize()
        emit(out, "estimate", exit_code=code, spec=spec.name, steps=trainer.total_steps,
             max_memory_allocated_bytes=int(torch.cuda.max_memory_allocated()) if cuda else None,
             max_memory_reserved_bytes=int(torch.cuda.max_memory_reserved()) if cuda else None,
             nvml_process_bytes=_nvml_process_bytes(args.nvml_index) if cuda else None)
    finally:
        teardown(trainer)
    return 0 if code == 0 else 1


def _time_cuda(fn: Any, reps: int) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


# MLP-sized GEMMs (batch x in x out) as DLRM's bottom/top MLPs run them.
GEMM_SHAPES = ((4096, 512, 512), (4096, 1024, 1024), (8192, 1024, 512), (2048, 2048, 1024))


def _copy_gbps() -> float:
    import torch

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / _time_cuda(lambda: dst.copy_(src), 10) / 1e9  # read + write


def _gather_gbps() -> float:
    """Random rows of a 512 MiB table, dim 64, a batch's worth of ids: what embedding lookups do."""
    import torch

    rows, dim, ids = 2_000_000, 64, 1 << 20
    table = torch.randn(rows, dim, device="cuda")
    idx = torch.randint(0, rows, (ids,), device="cuda")
    return 2 * ids * dim * 4 / _time_cuda(lambda: table.index_select(0, idx), 20) / 1e9


# A small plain-torch DLRM (slurm_dlrm/selftest/plain_dlrm.py): a few steps load the
# kernels a training process loads, then NVML minus torch's reserved is what a member
# takes outside the allocator (issue 37: 742 MiB on H100, driver 580, CUDA 13, torch 2.11).
NVML_OVERHEAD_SPEC = {"name": "nvml-overhead", "tables": [{"rows": 100_000, "dim": 64}, {"rows": 50_000, "dim": 64}],
                      "dense_features": 13, "bottom_mlp": [256, 64], "top_mlp": [256, 1], "batch_size": 2048,
                      "optimizer": {"type": "adagrad"}}


def _nvml_overhead_after_training(nvml_index: int | None) -> int | None:
    import torch

    from slurm_dlrm.selftest import plain_dlrm
    from slurm_dlrm.spec import parse_spec

    try:
        trainer = plain_dlrm.build_trainer(parse_spec(NVML_OVERHEAD_SPEC, "nvml-overhead"), torch.device("cuda"))
        for _ in range(3):
            trainer.step()
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - the figure is optional; the calibration stands without it
        return None
    now = _nvml_process_bytes(nvml_index)
    return None if now is None else now - torch.cuda.memory_reserved()


def role_calibrate(args: argparse.Namespace, out: TextIO) -> int:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    context_bytes = None
    nvml_now = _nvml_process_bytes(args.nvml_index)
    if nvml_now is not None:
        context_bytes = nvml_now - torch.cuda.memory_reserved()
    # cuBLAS workspace: what the first matmul adds beyond its operands (torch keeps it in
    # the caching allocator, one per handle and stream).
    a = torch.randn(256, 256, device="cuda")
    before = torch.cuda.memory_allocated()
    c = a @ a
    torch.cuda.synchronize()
    workspace = torch.cuda.memory_allocated() - before - c.numel() * c.element_size()
    del a, c
    figures: dict[str, float] = {}
    for dtype, key in ((torch.float32, "gemm_tflops"), (torch.bfloat16, "bf16_gemm_tflops")):
        flops = secs = 0.0
        for m, k, n in GEMM_SHAPES:
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            w = torch.randn(k, n, device="cuda", dtype=dtype)
            secs += _time_cuda(lambda x=x, w=w: x @ w, 50)
            flops += 2.0 * m * k * n
        figures[key] = flops / secs / 1e12
    figures["stream_bandwidth_gbps"] = _copy_gbps()
    figures["gather_bandwidth_gbps"] = _gather_gbps()
    one = torch.zeros(1, device="cuda")
    figures["kernel_launch_us"] = _time_cuda(lambda: one.add_(1.0), 2000) * 1e6
    emit(out, "calibrate", cuda_context_bytes=context_bytes, cublas_workspace_bytes=int(workspace),
         nvml_overhead_bytes=_nvml_overhead_after_training(args.nvml_index),
         device_name=torch.cuda.get_device_name(), sm_count=torch.cuda.get_device_properties(0).multi_processor_count,
         **figures)
    return 0


ROLES = {"idle": role_idle, "bench": role_bench, "steady": role_steady, "greedy": role_greedy,
         "estimate": role_estimate, "calibrate": role_calibrate}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m slurm_dlrm.selftest.probe")
    p.add_argument("role", choices=sorted(ROLES))
    p.add_argument("--status", help="append events here instead of stdout")
    p.add_argument("--stop", help="steady/greedy/idle end when this file exists")
    p.add_argument("--timeout", type=float, default=120.0, help="longest wait for --stop")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--chunk-mib", type=int, default=32)
    p.add_argument("--max-mib", type=int, default=4096)
    p.add_argument("--spec")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--workdir", default=".")
    p.add_argument("--nvml-index", type=int, default=None)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="estimate: cpu runs the plumbing only")
    args = p.parse_args(argv)
    out = _emitter(args.status)
    try:
        return ROLES[args.role](args, out)
    except Exception as exc:  # noqa: BLE001 - the parent reads the reason from the event
        emit(out, "error", error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
