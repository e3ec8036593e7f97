"""Two login nodes on one network home: takeover and the other host's commands (issue 30e).

Each run is tests/two_hosts_harness.py's: two UTS + network namespaces (`unshare`, so
run as root) named login-a and login-b share one home folder with the store on a
declared network filesystem (rollback journal); Slurm is a stateful fake both hosts'
services share. 200 submissions, half from each host at once; login-a's service is
SIGKILLed mid-way and login-b's takes over when its lease ends. Per run it counts jobs
lost and duplicated, and times:

- takeover_s: from the SIGKILL to login-b's service holding the lease (the lease's
  remaining life plus the wait after it ends; `after_expiry` is the second part, the
  target being under 2 rounds);
- submit and `queue --all` as whole commands (a new interpreter each) on login-a once
  it is the other host, beside the same commands on login-a while it held the service
  (the baseline, same run) and the interpreter's bare start (`python -c pass`). A submit
  on the other host waits for the service to record its jobs and prints their ids, as on
  the service's host (issue 43 item 11): its time includes up to a round of waiting.

    python benchmarks/two_hosts.py [--runs 5] [--seed 1] [--round-seconds 0.5] [--lease-seconds 4]

Last line: `two_hosts: submits=200 lost= duplicated= takeover_s= submit_p50_ms_other_host=
queue_p50_ms_other_host=` (lost and duplicated summed over the runs; the others the
median over the runs' medians).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1, help="first seed; run i uses seed + i")
    ap.add_argument("--submits", type=int, default=200)
    ap.add_argument("--round-seconds", type=float, default=0.5)
    ap.add_argument("--lease-seconds", type=float, default=4.0)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("two_hosts: needs root (unshare --uts --net)", file=sys.stderr)
        return 2
    from tests.two_hosts_harness import run_two_hosts

    rows = []
    print(f"{'seed':>4} {'lost':>4} {'dup':>3} {'slurm':>5} {'viol':>4} {'takeover_s':>10} {'after_exp_s':>11} "
          f"{'submit_other':>12} {'submit_svc':>10} {'queue_other':>11} {'queue_svc':>9} {'py_start':>8}  (ms)")
    for i in range(args.runs):
        seed = args.seed + i
        with tempfile.TemporaryDirectory(prefix="two-hosts-") as tmp:
            t0 = time.monotonic()
            r = run_two_hosts(Path(tmp) / "run", seed=seed, submits=args.submits, round_s=args.round_seconds,
                              lease_s=args.lease_seconds)
            r["wall_s"] = time.monotonic() - t0
        bad_slurm = len(r["slurm_jobs_unaccounted"]) + r["slurm_jobs_duplicated"] + len(r["packs_mismatched"])
        r["bad_slurm"] = bad_slurm
        rows.append(r)
        print(f"{seed:>4} {r['lost']:>4} {r['duplicated']:>3} {bad_slurm:>5} {len(r['violations'].splitlines()):>4} "
              f"{r['takeover_s']!s:>10} {r['takeover_after_expiry_s']!s:>11} {r['submit_p50_ms_other_host']!s:>12} "
              f"{r['submit_p50_ms_service_host']!s:>10} {r['queue_p50_ms_other_host']!s:>11} "
              f"{r['queue_p50_ms_service_host']!s:>9} {r['python_start_ms']!s:>8}  ({r['wall_s']:.0f} s, "
              f"{r['slurm_jobs']} Slurm jobs, {r['drop_path_submits']} submits through the drop folder)")
        if r["failed_submits"] or r["queue_errors"] or r["refused_requests"] or r["non_id_outputs"]:
            print(f"     failed submits {r['failed_submits']}; queue errors {r['queue_errors']}; "
                  f"refused {r['refused_requests']}; --parsable printed no id: {r['non_id_outputs']}")
        if r["unanswered_submits"]:  # issue 43 item 11: ids not there within 3 rounds (around the takeover)
            print(f"     {r['unanswered_submits']} submits on the other host got no job id within 3 rounds "
                  f"(applied later, once: see lost/dup)")

    def med(key: str) -> float:
        vals = [r[key] for r in rows if r[key] is not None]
        return round(statistics.median(vals), 3) if vals else float("nan")

    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    print(f"targets: lost 0, duplicated 0, takeover within 2 rounds ({2 * args.round_seconds:g} s) of the lease's "
          f"end: worst {max((r['takeover_after_expiry_s'] or 0) for r in rows):.3f} s; submit from the other host "
          f"< 500 ms, queue < 1000 ms (whole commands; load average {load:.1f} on {os.cpu_count()} CPUs, "
          f"bare interpreter start {med('python_start_ms'):.0f} ms)")
    print(f"baseline (the service's own host, same runs): submit p50 {med('submit_p50_ms_service_host'):.0f} ms, "
          f"queue p50 {med('queue_p50_ms_service_host'):.0f} ms")
    print(f"CPU time (user + system of the command's process), other host vs the service's: submit "
          f"{med('submit_cpu_p50_ms_other_host'):.0f} vs {med('submit_cpu_p50_ms_service_host'):.0f} ms, queue "
          f"{med('queue_cpu_p50_ms_other_host'):.0f} vs {med('queue_cpu_p50_ms_service_host'):.0f} ms")
    lost = sum(r["lost"] for r in rows)
    dup = sum(r["duplicated"] for r in rows)
    print(f"two_hosts: submits={args.submits} lost={lost} duplicated={dup} takeover_s={med('takeover_s')} "
          f"submit_p50_ms_other_host={med('submit_p50_ms_other_host'):.0f} "
          f"queue_p50_ms_other_host={med('queue_p50_ms_other_host'):.0f}")
    return 0 if lost == 0 and dup == 0 and all(r["bad_slurm"] == 0 and not r["violations"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
