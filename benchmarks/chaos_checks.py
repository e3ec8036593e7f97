"""The invariants benchmarks/chaos_live.py checks over a run's whole history (issue 49).

- every job in a terminal state that `acct` explains (its rows, the store's state):
  COMPLETED for all but those the user cancelled (and did not requeue);
- no job lost (a submission with fewer jobs than it asked for, or one not ended),
  none duplicated (more);
- no two runs of one job alive at once: from the runners' own metrics lines (each line
  carries its process id; a run is one process), no two runs' [first step start, last
  step] intervals overlap;
- every resumed run starts at a checkpoint its predecessors completed: the last step
  any earlier run reported (a stop's checkpoint), or the periodic checkpoint at or just
  below it (a run SIGKILLed between a step's metrics line and its checkpoint);
- `PRAGMA integrity_check` ok; every job's and pack's state events chain (each event's
  from-state is the last one's to-state, each edge legal, times not going back, the
  last one the row's state);
- GPU-hours charged <= sacct's allocations (ElapsedRaw x gres/gpu of the packs and the
  --no-pack jobs) and >= the members' measured run time (per pack, the union of its
  members' runs: a pack holds at least one GPU meanwhile);
- during the run (a monitor sampling the store every 2 s): no job leaves COMPLETED.
"""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

CHECKPOINT_EVERY = 10  # the workload's (chaos_live.spec_text)


class Monitor:
    """Samples the user's store during the run: each job's states in the order seen."""

    def __init__(self, site: Any, user: str, stop: threading.Event) -> None:
        self.site, self.user, self.stop = site, user, stop
        self.seen: dict[int, list[str]] = defaultdict(list)
        self.samples = 0
        self.read_errors = 0
        self.violations: list[str] = []

    def run(self) -> None:
        from slurm_dlrm.store.store import Store

        while not self.stop.wait(2.0):
            try:
                with Store.for_user(self.site, self.user, readonly=True) as store:
                    jobs = store.jobs(user=self.user)
            except Exception:  # noqa: BLE001 - a store being written to a full disk, a restart
                self.read_errors += 1
                continue
            self.samples += 1
            for j in jobs:
                states = self.seen[j.id]
                if not states or states[-1] != str(j.state):
                    if states and states[-1] == "COMPLETED":
                        self.violations.append(f"job {j.id} left COMPLETED for {j.state}")
                    states.append(str(j.state))


def runs_of(metrics: Path) -> list[dict[str, Any]]:
    """The runs in a job's metrics file, in order: pid, first/last step, start/end time."""
    runs: list[dict[str, Any]] = []
    try:
        text = metrics.read_text()
    except FileNotFoundError:
        return runs
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        pid = rec.get("pid")
        if not runs or runs[-1]["pid"] != pid:
            runs.append({"pid": pid, "first": rec["step"], "last": rec["step"],
                         "t0": rec["t"] - rec.get("step_time_s", 0.0), "t1": rec["t"], "gaps": 0})
        else:
            r = runs[-1]
            if rec["step"] != r["last"] + 1:
                r["gaps"] += 1
            r["last"], r["t1"] = rec["step"], rec["t"]
    return runs


def check_runs(job_id: int, runs: list[dict[str, Any]], steps: int, completed: bool) -> tuple[list[str], list[str]]:
    """(overlaps, bad resumes) of one job's runs."""
    overlaps, bad = [], []
    pids = [r["pid"] for r in runs]
    if len(set(pids)) != len(pids):
        overlaps.append(f"job {job_id}: one process's lines interleave with another's ({pids})")
    for a in range(len(runs)):
        for b in range(a + 1, len(runs)):
            ra, rb = runs[a], runs[b]
            if ra["pid"] != rb["pid"] and ra["t0"] < rb["t1"] and rb["t0"] < ra["t1"]:
                overlaps.append(f"job {job_id}: runs {ra['pid']} (steps {ra['first']}-{ra['last']}) and "
                                f"{rb['pid']} (steps {rb['first']}-{rb['last']}) alive at once")
    reached = 0
    for i, r in enumerate(runs):
        resumed_at = r["first"] - 1
        allowed = {reached, reached // CHECKPOINT_EVERY * CHECKPOINT_EVERY}
        if reached and reached % CHECKPOINT_EVERY == 0:
            allowed.add(reached - CHECKPOINT_EVERY)
        if i == 0:
            allowed = {0}
        if resumed_at not in allowed:
            bad.append(f"job {job_id}: run {i} ({r['pid']}) starts after step {resumed_at}; its predecessors "
                       f"reached {reached} (checkpoints there: {sorted(allowed)})")
        if r["gaps"]:
            bad.append(f"job {job_id}: run {r['pid']} skipped steps {r['gaps']} time(s)")
        reached = max(reached, r["last"])
    if completed and reached != steps:
        bad.append(f"job {job_id}: COMPLETED at step {reached} of {steps}")
    return overlaps, bad


def chain_violations(events: list[dict[str, Any]], current: dict[int, str], key: str,
                     legal: dict[tuple[Any, Any], str]) -> list[str]:
    out = []
    by: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        by[e[key]].append(e)
    legal_s = {(str(a), str(b)) for a, b in legal}
    for ident, evs in by.items():
        evs.sort(key=lambda e: e["id"])
        last_to, last_t = None, 0.0
        for e in evs:
            if e["from_state"] is not None and last_to is not None and e["from_state"] != last_to:
                out.append(f"{key} {ident}: event {e['id']} from {e['from_state']}, but the last went to {last_to}")
            if e["from_state"] is not None and (e["from_state"], e["to_state"]) not in legal_s:
                out.append(f"{key} {ident}: event {e['id']} {e['from_state']} -> {e['to_state']} is not an edge")
            if e["t"] < last_t - 1e-6:
                out.append(f"{key} {ident}: event {e['id']} at {e['t']:.3f} before the one before it ({last_t:.3f})")
            last_to, last_t = e["to_state"], max(last_t, e["t"])
        if ident in current and last_to is not None and last_to != current[ident]:
            out.append(f"{key} {ident}: last event to {last_to}, the row says {current[ident]}")
    return out


def sacct_gpu_hours(slurm_ids: list[str], mps_per_gpu: int) -> tuple[float, list[str]]:
    if not slurm_ids:
        return 0.0, []
    # -D: every run of a job Slurm requeued (a --no-pack job after NODE_FAIL) is an allocation
    r = subprocess.run(["sacct", "-X", "-D", "-n", "-P", "-j", ",".join(slurm_ids), "-o",  # noqa: S603, S607
                        "JobID,ElapsedRaw,AllocTRES"],
                       capture_output=True, text=True, timeout=60, check=False)
    total, seen = 0.0, []
    for line in r.stdout.splitlines():
        parts = line.split("|")
        if len(parts) < 3:
            continue
        m = re.search(r"gres/gpu=(\d+)", parts[2])
        mps = re.search(r"gres/mps=(\d+)", parts[2])  # a --no-pack job's MPS share of a GPU
        gpus = int(m.group(1)) if m else (int(mps.group(1)) / mps_per_gpu if mps and mps_per_gpu else 0)
        total += int(parts[1] or 0) * gpus / 3600
        if parts[0] not in seen:
            seen.append(parts[0])
    return total, seen


def union_s(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def check_history(site: Any, user: str, cluster: Any, subs: list[Any], cancelled: set[int], requeued: set[int],
                  monitor: Monitor) -> dict[str, Any]:
    from slurm_dlrm.store.acct import AcctFilter, acct_rows
    from slurm_dlrm.store.states import JOB_TRANSITIONS, PACK_TRANSITIONS
    from slurm_dlrm.store.store import Store, store_path_for

    report: list[str] = []
    with Store.for_user(site, user, readonly=True) as store:
        jobs = store.jobs(user=user)
        packs = store.packs(user=user)
        placements = [p for j in jobs for p in store.placements(job_id=j.id)]
        events = store.events()
        rows = acct_rows(store, AcctFilter(job_ids=tuple(j.id for j in jobs)))
    # lost / duplicated, by submission (its name, or its name and a suffix: array, sweep)
    lost = duplicated = 0
    for s in subs:
        found = [j for j in jobs if j.name == s.name or re.fullmatch(re.escape(s.name) + r"[-_\[].*", j.name)]
        if len(found) != s.expect_jobs:
            report.append(f"submission {s.name}: {len(found)} jobs, asked for {s.expect_jobs} (ids {s.ids})")
        lost += max(0, s.expect_jobs - len(found))
        duplicated += max(0, len(found) - s.expect_jobs)
    open_jobs = [j for j in jobs if str(j.state) in ("PENDING", "PLANNED", "RUNNING")]
    lost += len(open_jobs)
    for j in open_jobs:
        report.append(f"job {j.id} ({j.name}) never ended: {j.state}")
    # terminal states, as acct explains them
    by_row = {int(r["job_id"]): r for r in rows}
    user_cancelled = {j.id for j in jobs if j.id in cancelled - requeued and str(j.state) == "CANCELLED"}
    completed = 0
    for j in jobs:
        row = by_row.get(j.id)
        if row is None or str(row["state"]) != str(j.state):
            report.append(f"job {j.id}: acct says {row and row['state']}, the store {j.state}")
        if str(j.state) == "COMPLETED":
            completed += 1
        elif j.id not in user_cancelled and j not in open_jobs:
            report.append(f"job {j.id} ({j.name}) ended {j.state}: {j.exit_reason}")
    counted = len(jobs) - len(user_cancelled)
    completed_pct = round(100.0 * completed / counted, 1) if counted else 0.0
    # runs: overlaps and resumes, from the runners' own lines
    spool = site.spool_dir_for(user)
    steps_of = {s.name: s.steps for s in subs}
    overlaps: list[str] = []
    bad: list[str] = []
    runs_by_job: dict[int, list[dict[str, Any]]] = {}
    for j in jobs:
        base = next((n for n in steps_of if j.name == n or j.name.startswith(n)), None)
        runs = runs_of(spool / "jobs" / str(j.id) / "metrics.jsonl")
        runs_by_job[j.id] = runs
        o, b = check_runs(j.id, runs, steps_of.get(base or "", -1), str(j.state) == "COMPLETED")
        overlaps += o
        bad += b
    # the store: integrity and events in order
    db = store_path_for(site, user)
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    integrity = conn.execute("PRAGMA integrity_check").fetchone()[0]
    conn.close()
    ev = [dict(e) for e in events]
    order = chain_violations([e for e in ev if e["kind"] == "job_state" and e.get("job_id")],
                             {j.id: str(j.state) for j in jobs}, "job_id", JOB_TRANSITIONS)
    order += chain_violations([e for e in ev if e["kind"] == "pack_state" and e.get("pack_id")],
                              {p.id: str(p.state) for p in packs}, "pack_id", PACK_TRANSITIONS)
    integrity_ok = integrity == "ok" and not order
    # GPU-hours: charged vs sacct's allocations vs the members' measured runs
    charged_h = sum(float(r["gpu_hours"] or 0) for r in rows)
    slurm_ids = sorted({p.slurm_job_id for p in packs if p.slurm_job_id}
                       | {j.slurm_job_id for j in jobs if j.mode != "pack" and j.slurm_job_id})
    alloc_h, sacct_seen = 0.0, []
    deadline = time.monotonic() + 60  # slurmctld sends records to slurmdbd asynchronously
    while time.monotonic() < deadline:
        alloc_h, sacct_seen = sacct_gpu_hours(slurm_ids, int(cluster.config.mps_per_gpu or 0))
        if len(sacct_seen) >= len(slurm_ids):
            break
        time.sleep(3)
    per_pack: dict[Any, list[tuple[float, float]]] = defaultdict(list)
    for pl in placements:
        t_end = pl.end_time or time.time()
        for r in runs_by_job.get(pl.job_id, []):
            if pl.start_time is not None and pl.start_time - 5 <= r["t0"] <= t_end + 5:
                per_pack[pl.pack_id].append((r["t0"], r["t1"]))
    for j in jobs:  # --no-pack jobs: their runs are their allocation's
        if j.mode != "pack":
            per_pack[("nopack", j.id)] += [(r["t0"], r["t1"]) for r in runs_by_job.get(j.id, [])]
    measured_h = sum(union_s(iv) for iv in per_pack.values()) / 3600
    hours_ok = measured_h <= charged_h * 1.01 + 1e-4 and charged_h <= alloc_h * 1.01 + 1e-4
    report.append(f"GPU-hours: members' measured runs {measured_h:.4f} <= charged {charged_h:.4f} <= sacct "
                  f"allocations {alloc_h:.4f} ({len(sacct_seen)} of {len(slurm_ids)} Slurm jobs in sacct): "
                  f"{'ok' if hours_ok else 'VIOLATED'}")
    report.append(f"runs: {sum(len(r) for r in runs_by_job.values())} over {len(jobs)} jobs "
                  f"({sum(1 for r in runs_by_job.values() if len(r) > 1)} jobs resumed); packs {len(packs)} "
                  f"({sum(1 for p in packs if str(p.state) == 'LOST')} lost); user-cancelled {len(user_cancelled)}, "
                  f"requeued {len(requeued)}")
    report.append(f"monitor: {monitor.samples} samples, {monitor.read_errors} unreadable; "
                  f"store integrity_check {integrity}, {len(order)} events out of order")
    report += [f"VIOLATION {v}" for v in overlaps + bad + order + monitor.violations]
    ok = (not lost and not duplicated and not overlaps and not bad and integrity_ok and hours_ok
          and completed_pct == 100.0 and not monitor.violations)
    return {"jobs": len(jobs), "completed_pct": completed_pct, "lost": lost, "duplicated": duplicated,
            "overlapping_attempts": len(overlaps), "bad_resumes": len(bad),
            "integrity": "ok" if integrity_ok else ("events_out_of_order" if integrity == "ok" else "bad"),
            "report": report, "ok": ok}
