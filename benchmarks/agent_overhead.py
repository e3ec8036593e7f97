"""Overhead of the per-node agent: its own CPU and memory while it watches 16 members.

Runs `slurm-dlrm agent` (child-process launch, fake NVML with 4 GPUs, fake MPS control
daemon) over 16 cheap stand-in members that sleep and append a metrics line twice a
second, sampling every second. Beside it, over the same members and the same window, a
bare baseline: a minimal psutil loop reading each member's CPU times and RSS once a
second, and an idle Python process. Only each watcher's own process is measured (the
members and the MPS daemon are separate processes).

    /work/main/.venv/bin/python benchmarks/agent_overhead.py [--seconds 30] [--members 16]

Target (issue 8): < 1% of one core and < 80 MB RSS. Last line:
    agent: members=16 cpu_pct=X rss_mb=X
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from slurm_dlrm.emulated import mps_control as fake_mps_control  # noqa: E402
from slurm_dlrm.emulated.standin import member_entry, placement_dict  # noqa: E402

BASELINE = """
import sys, time, psutil
procs = [psutil.Process(int(p)) for p in sys.argv[1:]]
while True:
    for p in procs:
        try:
            with p.oneshot():
                p.cpu_times(); p.memory_info()
        except psutil.Error:
            pass
    time.sleep(1.0)
"""


def _measure(procs: dict[str, psutil.Process], seconds: float) -> dict[str, tuple[float, float]]:
    """cpu % of one core over the window and peak RSS (MB), per watcher."""
    start = {name: p.cpu_times() for name, p in procs.items()}
    peak = {name: 0.0 for name in procs}
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        for name, p in procs.items():
            peak[name] = max(peak[name], p.memory_info().rss / 1e6)
        time.sleep(1.0)
    wall = time.monotonic() - t0
    out = {}
    for name, p in procs.items():
        end = p.cpu_times()
        cpu_s = (end.user + end.system) - (start[name].user + start[name].system)
        out[name] = (100.0 * cpu_s / wall, peak[name])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0, help="measurement window")
    ap.add_argument("--members", type=int, default=16)
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds ignored after the start")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="agent-bench-"))
    fake_mps_control.install_launcher(work / "bin")
    (work / "nvml.json").write_text(json.dumps({"gpu_count": 4}))
    (work / "tmp").mkdir()
    pack = work / "pack"
    steps = str(int((args.seconds + args.warmup + 60) / 0.5))
    members = [member_entry(pack, i, i % 4, args=["--steps", steps, "--step-s", "0.5",
                                                  "--env-out", str(work / f"env-{i}.json")])
               for i in range(args.members)]
    (work / "placement.json").write_text(json.dumps(placement_dict(pack, members, sample_interval_s=1.0,
                                                                   term_grace_s=20)))
    env = dict(os.environ, PATH=f"{work / 'bin'}:{os.environ['PATH']}", TMPDIR=str(work / "tmp"),
               SLURM_DLRM_FAKE_NVML=str(work / "nvml.json"), PYTHONPATH=str(ROOT))
    env.pop("SLURM_JOB_ID", None)
    agent = subprocess.Popen(  # noqa: S603
        [sys.executable, "-m", "slurm_dlrm", "agent", "--pack-file", str(work / "placement.json"),
         "--launch", "process", "--gpus", "0,1,2,3", "--node-name", "bench", "--sample-interval", "1"],
        env=env, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watchers: list[subprocess.Popen[str]] = []
    try:
        deadline = time.monotonic() + 60
        while len(list(work.glob("env-*.json"))) < args.members and time.monotonic() < deadline:
            time.sleep(0.2)
        pids = [str(json.loads(p.read_text())["pid"]) for p in sorted(work.glob("env-*.json"))]
        if len(pids) < args.members:
            print(f"only {len(pids)} of {args.members} members started", file=sys.stderr)
            return 1
        watchers.append(subprocess.Popen([sys.executable, "-c", BASELINE, *pids], env=env))  # noqa: S603
        watchers.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1e6)"]))  # noqa: S603
        time.sleep(args.warmup)
        procs = {"agent": psutil.Process(agent.pid), "psutil loop": psutil.Process(watchers[0].pid),
                 "idle python": psutil.Process(watchers[1].pid)}
        result = _measure(procs, args.seconds)
    finally:
        for w in watchers:
            w.kill()
            w.wait()
        agent.send_signal(signal.SIGTERM)
        try:
            out, err = agent.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            agent.kill()
            out, err = agent.communicate()
    report = pack / "reports" / "bench.jsonl"
    lines = report.read_text().splitlines() if report.exists() else []
    samples = sum('"type":"sample"' in line for line in lines)
    print(f"{args.members} members sampled every 1 s for {args.seconds:g} s (after {args.warmup:g} s warm-up); "
          f"fake NVML with 4 GPUs, fake MPS daemon; {samples} sample records written")
    print(f"{'watcher':<14}{'cpu % of one core':>20}{'peak RSS MB':>14}")
    for name, (cpu, rss) in result.items():
        print(f"{name:<14}{cpu:>20.3f}{rss:>14.1f}")
    print(f"agent exit: {out.strip()[:200]}")
    shutil.rmtree(work, ignore_errors=True)
    cpu, rss = result["agent"]
    print(f"agent: members={args.members} cpu_pct={cpu:.3f} rss_mb={rss:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
