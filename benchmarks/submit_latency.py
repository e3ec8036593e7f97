"""Wall time of `slurm-dlrm submit SPEC` next to `sbatch --wrap true`, on the local cluster.

Both are run as a user would run them (a new process each time), alternately, with
the user's packing service already running (as it is after the first submit). The
spec's member runs `true` (spec `command`), so the packs the service submits meanwhile
cost Slurm and the agent, not training. Run as root (the local cluster needs it):

    /work/main/.venv/bin/python benchmarks/submit_latency.py [--runs 10]

Target: median extra < 0.3 s. Last line: `submit: extra_s_vs_sbatch=X`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SPEC = """\
name: latency-probe
tables:
  - {name: t0, rows: 1000, dim: 8}
dense_features: 13
bottom_mlp: [16, 8]
top_mlp: [16, 1]
batch_size: 64
steps: 1
command: ["true"]
"""


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60, check=True)  # noqa: S603
    return time.perf_counter() - t0, out.stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    args = ap.parse_args()

    from slurm_dlrm.service.daemon import spawn_service, stop, wait_until_running
    from slurm_dlrm.service.demo import demo_site, ensure_cluster
    from slurm_dlrm.service.submit import service_paths
    from slurm_dlrm.site import load_site
    from slurm_dlrm.store.store import current_user

    cluster = ensure_cluster(lambda s: print(s, file=sys.stderr))
    work = Path(tempfile.mkdtemp(prefix="slurm-dlrm-latency-"))
    site_path = demo_site(work)
    spec = work / "probe.yaml"
    spec.write_text(SPEC)
    env = {**os.environ, "SLURM_CONF": str(cluster.config.slurm_conf), "SLURM_DLRM_SITE": str(site_path),
           "PYTHONPATH": str(REPO)}
    os.environ.update({k: env[k] for k in ("SLURM_CONF", "SLURM_DLRM_SITE")})
    site = load_site(site_path)
    paths = service_paths(site, current_user())
    spawn_service(paths, ["--round-seconds", "5"], env=env)
    assert wait_until_running(paths, timeout_s=60), f"service did not start: {paths.log}"
    sbatch = ["sbatch", "--parsable", "--wrap", "true", "-o", "/dev/null", "-J", "latency-baseline"]
    submit = [sys.executable, "-m", "slurm_dlrm", "submit", "--parsable", str(spec)]
    timed(submit, env)  # warm the page cache and the store (first open migrates it)
    timed(sbatch, env)
    rows = []
    slurm_ids = []
    try:
        for _ in range(args.runs):
            s_sbatch, sid = timed(sbatch, env)
            s_submit, _ = timed(submit, env)
            slurm_ids.append(sid)
            rows.append((s_sbatch, s_submit))
            time.sleep(0.2)
    finally:
        stop(paths, timeout_s=60)
        subprocess.run(["scancel", "-n", "latency-baseline"], env=env, check=False, timeout=30)  # noqa: S603, S607
    print(f"{'run':>3} {'sbatch --wrap true (s)':>24} {'slurm-dlrm submit (s)':>22} {'extra (s)':>10}")
    for i, (a, b) in enumerate(rows, 1):
        print(f"{i:>3} {a:>24.3f} {b:>22.3f} {b - a:>10.3f}")
    med_a = statistics.median(r[0] for r in rows)
    med_b = statistics.median(r[1] for r in rows)
    print(f"med {med_a:>24.3f} {med_b:>22.3f} {med_b - med_a:>10.3f}")
    print("target: extra < 0.3 s (median); machine load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"submit: extra_s_vs_sbatch={med_b - med_a:.3f}")


if __name__ == "__main__":
    main()
