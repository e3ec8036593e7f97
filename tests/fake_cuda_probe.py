"""A stand-in for `python -m slurm_dlrm.selftest.probe` on a machine without CUDA (tests only).

It speaks the probe's protocol (same roles, options and JSON events) and behaves the way
a CUDA client under MPS does, from the variables the agent's `member_env` set:
`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` scales the matmul throughput, and
`CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` ("0=<MiB>M") ends the allocation loop with an
out-of-memory event. `FAKE_CUDA_BROKEN` names what a broken node would do instead:
"share" (no throttling), "fence" (no memory limit), "neighbour" (the steady client dies),
"estimate" (the run peaks far above any estimate), "cuda" (no CUDA client starts),
"torchrec" (torch without torchrec: the estimate role says it cannot run).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

PEAK_TFLOPS = 40.0
BROKEN = set(os.environ.get("FAKE_CUDA_BROKEN", "").split(","))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("role")
    for opt in ("--status", "--stop", "--spec", "--workdir"):
        p.add_argument(opt)
    for opt in ("--timeout", "--seconds"):
        p.add_argument(opt, type=float, default=60.0)
    for opt in ("--chunk-mib", "--max-mib", "--steps", "--nvml-index"):
        p.add_argument(opt, type=int, default=0)
    a = p.parse_args()
    out = open(a.status, "a", buffering=1)  # noqa: SIM115

    def emit(event: str, **kw: object) -> None:
        out.write(json.dumps({"event": event, "pid": os.getpid(), "t": time.time(), **kw}) + "\n")

    def wait_stop() -> None:
        deadline = time.monotonic() + a.timeout
        while a.stop and not Path(a.stop).exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    pct = float(os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "100"))
    if "cuda" in BROKEN and a.role != "idle":
        emit("error", error="RuntimeError: CUDA error: all CUDA-capable devices are busy or unavailable")
        return 1
    emit("ready", cuda=True)
    if a.role == "bench":
        emit("bench", tflops=PEAK_TFLOPS * (1.0 if "share" in BROKEN else pct / 100), iterations=10)
    elif a.role == "steady":
        n = 0
        while not (a.stop and Path(a.stop).exists()):
            n += 1
            if n % 5 == 0:
                emit("progress", iterations=n)
            if "neighbour" in BROKEN and n > 10:
                emit("error", error="CUDA error: an illegal memory access (MPS server died)")
                return 1
            time.sleep(0.02)
        emit("done", iterations=n)
    elif a.role == "greedy":
        limit = os.environ["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]
        limit_mib = int(limit.split("=")[1].rstrip("M"))
        got = 0
        while got + a.chunk_mib <= (a.max_mib if "fence" in BROKEN else limit_mib):
            got += a.chunk_mib
        emit("no_oom" if "fence" in BROKEN else "oom", allocated_mib=got)
        wait_stop()
        return 0 if "fence" in BROKEN else 3
    elif a.role == "estimate":
        if "torchrec" in BROKEN:  # the probe's answer on a machine with torch alone
            emit("unavailable", reason="torchrec is not installed: the runner trains torchrec's model")
            return 0
        from slurm_dlrm.estimate import estimate
        from slurm_dlrm.site import load_site
        from slurm_dlrm.spec import parse_spec

        spec = parse_spec(json.loads(Path(a.spec).read_text()))
        est = estimate(spec, load_site().gpu_model(os.environ["FAKE_CUDA_MODEL"]))
        context = est.gpu_breakdown["cuda_context"]
        # A run that peaks a little under the estimate; "estimate": twice above it.
        scale = 2.0 if "estimate" in BROKEN else 0.95
        reserved = int((est.gpu_peak_bytes - context) * scale)
        emit("estimate", exit_code=0, spec=spec.name, max_memory_allocated_bytes=int(reserved * 0.9),
             max_memory_reserved_bytes=reserved, nvml_process_bytes=reserved + int(context * 0.9))
    elif a.role == "calibrate":
        emit("calibrate", cuda_context_bytes=480 << 20, cublas_workspace_bytes=8 << 20, device_name="fake",
             sm_count=132, gemm_tflops=30.0, bf16_gemm_tflops=400.0, stream_bandwidth_gbps=2900.0,
             gather_bandwidth_gbps=1100.0, kernel_launch_us=5.5)
    elif a.role == "idle":
        wait_stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
