"""Opening a store made by an earlier schema version migrates it and keeps its data."""

from __future__ import annotations

import json
import sqlite3

from slurm_dlrm.store import Store
from slurm_dlrm.store.migrations import MIGRATIONS


def _store_at_version(path, version):
    path.parent.mkdir(mode=0o700)
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE migrations (version INTEGER PRIMARY KEY, description TEXT NOT NULL, "
                 "applied_time REAL NOT NULL)")
    for m in MIGRATIONS:
        if m.version > version:
            break
        for stmt in m.statements:
            conn.execute(stmt)
        conn.execute("INSERT INTO migrations VALUES (?, ?, 0)", (m.version, m.description))
    conn.execute(f"PRAGMA user_version = {version}")
    conn.commit()
    conn.close()


def test_v1_store_gains_sbatch_json_and_keeps_its_jobs(tmp_path):
    p = tmp_path / "s" / "store.sqlite"
    _store_at_version(p, 1)
    conn = sqlite3.connect(p)
    conn.execute("INSERT INTO jobs (user, name, state, spec_fingerprint, submit_time, updated_time) "
                 "VALUES ('u', 'old', 'PENDING', 'f', 1, 1)")
    conn.execute("INSERT INTO job_specs (job_id, spec_json) VALUES (1, '{}')")
    conn.commit()
    conn.close()
    with Store(p) as s:
        assert s.schema_version == 2
        old = s.get_job(1)
        assert old.name == "old" and old.sbatch_json is None
        new = s.add_job(user="u", name="n", spec={}, spec_fingerprint="f", sbatch={"partition": "dlrm"})
        assert json.loads(s.get_job(new).sbatch_json) == {"partition": "dlrm"}
