"""Wall time of `slurm-dlrm submit SPEC` next to `sbatch --wrap true`, on the local cluster.

Both are run as a user would run them (a new process each time), alternately, with
the user's packing service already running (as it is after the first submit). The
spec's member runs `true` (spec `command`), so the packs the service submits meanwhile
cost Slurm and the agent, not training. Run as root (the local cluster needs it):

    /work/main/.venv/bin/python benchmarks/submit_latency.py [--runs 10] [--compare /work/main]

`--compare CHECKOUT` also times `submit` from another checkout of slurm-dlrm (e.g. the
code before a change), interleaved in the same run. The children get a private bytecode
cache (PYTHONPYCACHEPREFIX in a temporary folder), as an installed package has its .pyc
files; `--no-bytecode` compiles every module from source on every run instead (what a
checkout under PYTHONDONTWRITEBYTECODE=1 does).

Target: median extra < 0.3 s. Last line: `submit: extra_s_vs_sbatch=X`.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from _shared import probe_spec  # noqa: E402 - benchmarks/ is on sys.path (this script's folder)


def timed(argv: list[str], env: dict[str, str], cwd: Path | None = None) -> tuple[float, float, str]:
    """(wall s, CPU s of the child, its stdout). CPU time does not grow with machine load."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    # cwd: `python -m` puts the working folder first on sys.path, before PYTHONPATH, so
    # from inside a checkout that checkout's code would run whatever PYTHONPATH says.
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60, check=True,  # noqa: S603
                         cwd=cwd)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, out.stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--compare", metavar="CHECKOUT", help="also time submit from this checkout (before/after)")
    ap.add_argument("--no-bytecode", action="store_true", help="no .pyc cache: compile from source every run")
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
    spec.write_text(probe_spec("latency-probe"))
    env = {**os.environ, "SLURM_CONF": str(cluster.config.slurm_conf), "SLURM_DLRM_SITE": str(site_path),
           "PYTHONPATH": str(REPO)}
    os.environ.update({k: env[k] for k in ("SLURM_CONF", "SLURM_DLRM_SITE")})
    if args.no_bytecode:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        env.pop("PYTHONPYCACHEPREFIX", None)
    else:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(work / "pycache")
    env_before = None
    paths_before = None
    if args.compare:
        # Its own store and service: the two checkouts may have different schemas.
        (work / "before").mkdir()
        compare = Path(args.compare).resolve()
        site_before = demo_site(work / "before", base=compare / "site-config" / "site.toml")
        env_before = {**env, "PYTHONPATH": str(compare), "SLURM_DLRM_SITE": str(site_before)}
        paths_before = service_paths(load_site(site_before), current_user())
    site = load_site(site_path)
    paths = service_paths(site, current_user())
    spawn_service(paths, ["--round-seconds", "5"], env=env)
    assert wait_until_running(paths, timeout_s=60), f"service did not start: {paths.log}"
    sbatch = ["sbatch", "--parsable", "--wrap", "true", "-o", "/dev/null", "-J", "latency-baseline"]
    submit = [sys.executable, "-m", "slurm_dlrm", "submit", "--parsable", str(spec)]
    which = [sys.executable, "-c", "import slurm_dlrm; print(slurm_dlrm.__file__)"]
    for e, root in ((env, REPO), (env_before, Path(args.compare or ".").resolve())):
        if e is not None:  # each child must run the checkout it is meant to
            got = Path(timed(which, e, work)[2]).resolve()
            assert got.is_relative_to(root), f"children import {got}, not from {root}"
    if env_before is not None:
        timed(submit, env_before, work)  # starts that checkout's own service, as a user's first submit does
    timed(submit, env, work)  # warm the page cache, the bytecode cache and the store (first open migrates it)
    timed(sbatch, env, work)
    rows = []
    before: list[tuple[float, float]] = []
    try:
        for _ in range(args.runs):
            w_sbatch, c_sbatch, _ = timed(sbatch, env, work)
            w_submit, c_submit, _ = timed(submit, env, work)
            rows.append((w_sbatch, w_submit, c_sbatch, c_submit))
            if env_before is not None:
                before.append(timed(submit, env_before, work)[:2])
            time.sleep(0.2)
    finally:
        stop(paths, timeout_s=60)
        if paths_before is not None:
            stop(paths_before, timeout_s=60)
        subprocess.run(["scancel", "-n", "latency-baseline"], env=env, check=False, timeout=30)  # noqa: S603, S607
    print(f"{'run':>3} | {'wall: sbatch --wrap true':>24} {'slurm-dlrm submit':>18} {'extra':>7} |"
          f" {'CPU: sbatch':>11} {'submit':>7} {'extra':>7}  (seconds)")
    for i, (wa, wb, ca, cb) in enumerate(rows, 1):
        print(f"{i:>3} | {wa:>24.3f} {wb:>18.3f} {wb - wa:>7.3f} | {ca:>11.3f} {cb:>7.3f} {cb - ca:>7.3f}")
    med = [statistics.median(r[k] for r in rows) for k in range(4)]
    print(f"med | {med[0]:>24.3f} {med[1]:>18.3f} {med[1] - med[0]:>7.3f} | {med[2]:>11.3f} {med[3]:>7.3f}"
          f" {med[3] - med[2]:>7.3f}")
    if before:
        wb, cb = statistics.median(b[0] for b in before), statistics.median(b[1] for b in before)
        print(f"before ({args.compare}), interleaved: submit wall {wb:.3f} s (extra {wb - med[0]:.3f}),"
              f" CPU {cb:.3f} s (extra {cb - med[2]:.3f}); this checkout: wall {med[1]:.3f} s, CPU {med[3]:.3f} s")
    print("bytecode: " + ("none (compiled from source every run)" if args.no_bytecode else "cached, as installed"))
    print(f"target: extra wall < 0.3 s (median); load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs "
          "(wall time grows with load, CPU time does not)")
    print(f"submit: extra_s_vs_sbatch={med[1] - med[0]:.3f}")


if __name__ == "__main__":
    main()
