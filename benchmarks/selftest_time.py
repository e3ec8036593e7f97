"""Wall time of `slurm-dlrm selftest`, per step, against the issue's target (< 5 minutes on a GPU node).

Runs the selftest once (`--json`) and reads its checks. On a machine without a GPU pass
`--fake`: only the fake path runs (NVML and the MPS daemon's start, two stand-in clients,
quit), the hardware steps are SKIP, and the time says nothing about the target;
`hardware=false` in the last line says so.

    .venv/bin/python benchmarks/selftest_time.py            # on a GPU node, inside an allocation
    .venv/bin/python benchmarks/selftest_time.py --fake     # anywhere

Last line:
    selftest: seconds=X target_s=300 hardware=true|false pass=N fail=N skip=N dry=N
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 300.0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fake", action="store_true", help="no GPU here: the fake NVML and MPS daemon")
    p.add_argument("--gpu", type=int, default=0)
    args = p.parse_args()
    argv = [sys.executable, "-m", "slurm_dlrm", "selftest", "--json", "--gpu", str(args.gpu)]
    if args.fake:
        argv.append("--fake")
    t0 = time.perf_counter()
    out = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, check=False)  # noqa: S603
    seconds = time.perf_counter() - t0
    try:
        data = json.loads(out.stdout)
    except ValueError:
        print(out.stderr.strip() or out.stdout.strip(), file=sys.stderr)
        return 1
    counts = data["verdict"]["counts"]
    hardware = bool(data["context"].get("hardware"))
    print(f"{'check':34s} {'status':6s} figure")
    for c in data["checks"]:
        print(f"{c['name']:34s} {c['status']:6s} {c['figure'][:90]}")
    print(f"\nwall time {seconds:.1f} s, target < {TARGET_S:.0f} s on a GPU node"
          + ("" if hardware else " (no GPU here: the hardware steps did not run, this is not the target's figure)"))
    print(f"selftest: seconds={seconds:.1f} target_s={TARGET_S:.0f} hardware={str(hardware).lower()} "
          f"pass={counts['PASS']} fail={counts['FAIL']} skip={counts['SKIP']} dry={counts['DRY']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
