"""Concurrent writers and readers on one store: no lock error escapes, nothing is lost.

Two writer processes write samples for a while: one through `add_samples` (a direct
writer), one by appending agent-report lines to a spool file and ingesting them
(agent + ingestion), each also logging events and moving a job's state. A third
process runs `acct` in a loop. At the end every committed sample must be in the
database exactly once, the per-job aggregates must match the samples, and no child
may have seen an error.

    /work/main/.venv/bin/python benchmarks/store_stress.py --seconds 60
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sqlite3
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from slurm_dlrm.store import JobState, NewPlacement, PackState, Store, ingest_spool_file  # noqa: E402
from slurm_dlrm.store.acct import DEFAULT_FORMAT, AcctFilter, acct_table, parse_format  # noqa: E402
from slurm_dlrm.store.synthetic import sample_line_dicts  # noqa: E402


def _direct_writer(db: str, pack_id: int, job_id: int, seconds: float, batch: int, out: Any) -> None:
    res: dict[str, Any] = {"role": "direct", "committed": 0, "error": None}
    try:
        store = Store(db)
        deadline = time.monotonic() + seconds
        i = 0
        while time.monotonic() < deadline:
            rows = list(sample_line_dicts(pack_id, job_id, batch, t0=1e9 + i * batch, seed=i))
            res["committed"] += store.add_samples(rows, batch_size=batch)
            store.add_event("note", f"batch {i}", job_id=job_id)
            i += 1
    except BaseException as exc:  # report everything, including lock errors
        res["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    out.put(res)


def _spool_writer(db: str, spool: str, pack_id: int, job_id: int, seconds: float, batch: int, out: Any) -> None:
    res: dict[str, Any] = {"role": "spool", "committed": 0, "written": 0, "error": None}
    try:
        store = Store(db)
        deadline = time.monotonic() + seconds
        i = 0
        def on_record(st: Store, rec: dict[str, Any]) -> None:
            st.event_in_tx("agent", str(rec.get("event")), pack_id=rec.get("pack_id"), data=rec)

        with open(spool, "ab") as f:
            while time.monotonic() < deadline:
                lines = [json.dumps(r) for r in sample_line_dicts(pack_id, job_id, batch, t0=2e9 + i * batch, seed=i)]
                lines.append(json.dumps({"type": "agent", "t": time.time(), "pack_id": pack_id,
                                         "node": "node1", "event": "exit", "detail": f"batch {i}"}))
                # Write the batch in two pieces so the reader sometimes sees a partial line.
                blob = ("\n".join(lines) + "\n").encode()
                cut = len(blob) // 2
                f.write(blob[:cut])
                f.flush()
                r1 = ingest_spool_file(store, spool, on_record)
                f.write(blob[cut:])
                f.flush()
                r2 = ingest_spool_file(store, spool, on_record)
                res["committed"] += r1.samples + r2.samples
                res["written"] += batch
                i += 1
    except BaseException as exc:
        res["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    out.put(res)


def _acct_reader(db: str, seconds: float, out: Any) -> None:
    res: dict[str, Any] = {"role": "acct", "runs": 0, "max_ms": 0.0, "error": None}
    try:
        store = Store(db, readonly=True)
        cols = parse_format(DEFAULT_FORMAT)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            t = time.perf_counter()
            acct_table(store, AcctFilter(), cols)
            res["max_ms"] = max(res["max_ms"], (time.perf_counter() - t) * 1000)
            res["runs"] += 1
            time.sleep(0.01)
    except BaseException as exc:
        res["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    out.put(res)


def run(seconds: float, db: str, batch: int = 500) -> dict[str, Any]:
    spool = str(Path(db).with_name("node1.jsonl"))
    with Store(db) as store:
        a = store.add_job(user="u", name="direct", spec={}, spec_fingerprint="x")
        b = store.add_job(user="u", name="spool", spec={}, spec_fingerprint="x")
        pack = store.add_pack(name=f"stress-{time.time_ns()}", user="u", policy="complementary", n_gpus=1,
                              placements=[NewPlacement(a, 0, 0), NewPlacement(b, 0, 0)])
        store.transition_pack(pack, PackState.QUEUED, "submitted", slurm_job_id="1")
        store.transition_pack(pack, PackState.RUNNING, "started", nodes="node1")
        for j in (a, b):
            store.transition_job(j, JobState.RUNNING, "started")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_direct_writer, args=(db, pack, a, seconds, batch, q)),
        ctx.Process(target=_spool_writer, args=(db, spool, pack, b, seconds, batch, q)),
        ctx.Process(target=_acct_reader, args=(db, seconds, q)),
    ]
    for p in procs:
        p.start()
    results = [q.get(timeout=seconds + 120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    by_role = {r["role"]: r for r in results}
    with Store(db) as store:
        stored = {row[0]: row[1] for row in store.conn.execute(
            "SELECT job_id, count(*) FROM samples GROUP BY job_id")}
        problems = store.check()
        # Whatever the spool writer wrote but had not ingested yet (none: it ingests last).
        ingest_spool_file(store, spool)
        stored_after = store.conn.execute("SELECT count(*) FROM samples WHERE job_id = ?", (b,)).fetchone()[0]
    errors = [f"{r['role']}: {r['error']}" for r in results if r["error"]]
    ok = (not errors and not problems and stored.get(a, 0) == by_role["direct"]["committed"]
          and stored.get(b, 0) == by_role["spool"]["committed"] == by_role["spool"]["written"] == stored_after)
    return {
        "ok": ok, "errors": errors, "problems": problems,
        "direct_committed": by_role["direct"]["committed"], "direct_stored": stored.get(a, 0),
        "spool_written": by_role["spool"]["written"], "spool_stored": stored.get(b, 0),
        "acct_runs": by_role["acct"]["runs"], "acct_max_ms": round(by_role["acct"]["max_ms"], 1),
        "exit_codes": [p.exitcode for p in procs],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--batch", type=int, default=500)
    ap.add_argument("--db", help="store file (default: a temporary one)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        db = args.db or str(Path(tmp) / "store" / "store.sqlite")
        res = run(args.seconds, db, args.batch)
    for e in res["errors"]:
        print(e, file=sys.stderr)
    for p in res["problems"]:
        print(p, file=sys.stderr)
    print(f"direct writer: {res['direct_committed']} committed, {res['direct_stored']} stored")
    print(f"spool writer:  {res['spool_written']} written, {res['spool_stored']} stored")
    print(f"acct reader:   {res['acct_runs']} runs, max {res['acct_max_ms']} ms")
    print(f"store_stress: seconds={args.seconds:g} samples={res['direct_stored'] + res['spool_stored']} "
          f"acct_runs={res['acct_runs']} lock_errors={sum('locked' in e for e in res['errors'])} ok={str(res['ok']).lower()}")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except sqlite3.Error as exc:
        print(f"store_stress: sqlite error escaped: {exc}", file=sys.stderr)
        sys.exit(1)
