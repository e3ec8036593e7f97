"""`slurm-dlrm estimate` (and `submit --test-only`) on the largest and the most hostile
inputs the limits of issue 32 allow or refuse, next to another checkout (the code before).

Each case runs as a user would run it, a new process each time, capped at 2 GiB of
address space and `--timeout` seconds; the figures are wall seconds and the child's own
CPU seconds (user + system), which a busy shared machine inflates much less than wall
time. Target: every case under 2 s (docs/interfaces.md section 1, "Limits").

    .venv/bin/python benchmarks/spec_limits.py [--compare CHECKOUT] [--timeout 30]

`--compare CHECKOUT` runs the same cases with that checkout's `slurm_dlrm` (e.g. a copy
of the code before: `git archive 0cdb2fa slurm_dlrm site-config | tar -x -C /tmp/base`),
interleaved in the same run. Last line:
`spec_limits: worst_cpu_s=X worst_wall_s=Y target_s=2 cases=N`.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGET_S = 2.0
MEMORY_CAP_BYTES = 2 << 30
BASE = """dense_features: 13
batch_size: 512
optimizer: {type: adagrad}
steps: 10
"""


def tables(n: int, rows: int = 1_000_000, dim: int = 16) -> str:
    return "tables:\n" + "".join(f"  - {{name: t{i}, rows: {rows + i}, dim: {dim}, pooling_factor: 3.5}}\n"
                                 for i in range(n))


def mlps(layers: int) -> str:
    bottom = ",".join(["1024"] * (layers - 1) + ["16"])
    top = ",".join(["1024"] * (layers - 1) + ["1"])
    return f"bottom_mlp: [{bottom}]\ntop_mlp: [{top}]\n"


def alias_bomb() -> str:
    lines = ["a0: &a0 [" + ",".join(["x"] * 10) + "]"]
    lines += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]
    return "\n".join(lines) + "\nname: *a8\n"


# name -> (spec text, extra argv); the spec is written to spec.yaml
CASES: dict[str, tuple[str, list[str]]] = {
    "1,000 tables": (f"name: t\n{tables(1000, rows=10)}{mlps(2)}{BASE}", []),
    "5,000 tables": (f"name: t\n{tables(5000, rows=10)}{mlps(2)}{BASE}", []),
    "10,000 tables (limit)": (f"name: t\n{tables(10_000, rows=10)}{mlps(2)}{BASE}", []),
    "10,000 tables x 64 ranks x 100 layers + DCN 100": (
        f"name: t\n{tables(10_000)}{mlps(100)}{BASE}world_size: 64\n"
        "interaction: {type: dcn, layers: 100, low_rank: 1024}\n", []),
    "10 tables x 64 ranks x 100 layers + DCN 100": (
        f"name: t\n{tables(10)}{mlps(100)}{BASE}world_size: 64\ninteraction: {{type: dcn, layers: 100, low_rank: 1024}}\n",
        []),
    "20,000-layer bottom_mlp (refused)": (
        f"name: t\n{tables(1)}bottom_mlp: [{','.join(['16'] * 20_000)}]\ntop_mlp: [64, 1]\n{BASE}", []),
    "alias bomb 10^9 (refused)": (alias_bomb() + tables(1) + mlps(2) + BASE, []),
    "5,000 nested [ (refused)": ("name: " + "[" * 5000 + "]" * 5000 + "\n", []),
    "submit --array 0-3000000000 (refused)": ("", ["submit", "--test-only", str(REPO / "examples/sweep/tiny-a.yaml"),
                                                   "--array", "0-3000000000"]),
    "submit 6 x --set of 60 (refused)": ("", ["submit", "--test-only", str(REPO / "examples/sweep/tiny-a.yaml")] + [
        a for k in ("optimizer.lr", "batch_size", "seed", "steps", "dense_features", "metrics_every_steps")
        for a in ("--set", f"{k}=" + ",".join(str(v) for v in range(1, 61)))]),
}


def run_case(code: Path, spec: str, argv: list[str], timeout_s: float, work: Path) -> tuple[str, float, float]:
    """(outcome, wall s, CPU s) of one child running `code`'s slurm_dlrm."""
    path = work / "spec.yaml"
    path.write_text(spec)
    args = argv or ["estimate", "--json", "--no-history", str(path)]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "PYTHONPATH": str(code),
           "SLURM_DLRM_SITE": str(REPO / "site-config" / "site.toml"), "SLURM_DLRM_STORE_DIR": str(work / "store")}

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP_BYTES, MEMORY_CAP_BYTES))

    start = time.monotonic()
    with open(work / "err", "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "slurm_dlrm", *args], stdout=subprocess.DEVNULL,  # noqa: S603
                                stderr=err, env=env, cwd=work, preexec_fn=cap)
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() - start > timeout_s:
                proc.kill()
                _, status, usage = os.wait4(proc.pid, 0)
                return f"killed at {timeout_s:.0f} s", time.monotonic() - start, usage.ru_utime + usage.ru_stime
            time.sleep(0.01)
    wall = time.monotonic() - start
    rc = os.waitstatus_to_exitcode(status)
    text = (work / "err").read_text()
    if "MemoryError" in text:
        outcome = "MemoryError"
    elif "Traceback" in text:
        outcome = "traceback: " + text.strip().splitlines()[-1][:40]
    else:
        outcome = f"exit {rc}" + (f", {len(text.splitlines())} line" if text else "")
    return outcome, wall, usage.ru_utime + usage.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compare", type=Path, help="another checkout of slurm-dlrm (e.g. the code before)")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds per case before the child is killed")
    args = ap.parse_args()
    worst_cpu = worst_wall = 0.0
    print(f"{'case':50} {'this code':>34}" + (f" {'compared checkout':>34}" if args.compare else ""))
    with tempfile.TemporaryDirectory() as tmp:
        for name, (spec, argv) in CASES.items():
            row = f"{name:50}"
            for code in [REPO] + ([args.compare] if args.compare else []):
                outcome, wall, cpu = run_case(code, spec, argv, args.timeout, Path(tmp))
                row += f" {outcome:>16} {wall:6.2f}s {cpu:5.2f}cpu"
                if code == REPO:
                    worst_cpu, worst_wall = max(worst_cpu, cpu), max(worst_wall, wall)
            print(row, flush=True)
    verdict = "met" if worst_cpu < TARGET_S else "NOT met"
    print(f"target: every case under {TARGET_S:g} s of CPU: {verdict} (worst {worst_cpu:.2f} CPU s, "
          f"{worst_wall:.2f} s wall on this machine now)")
    print(f"spec_limits: worst_cpu_s={worst_cpu:.2f} worst_wall_s={worst_wall:.2f} target_s={TARGET_S:g} "
          f"cases={len(CASES)}")


if __name__ == "__main__":
    main()
