"""Opening a store: migrations, pragmas, file modes, read-only access."""

from __future__ import annotations

import os
import sqlite3
import stat

import pytest
from service_harness import old_store

from slurm_dlrm.site import REPO_SITE_FILE, load_site
from slurm_dlrm.store import NewPlacement, SchemaTooNew, Store, StoreError, store_path_for
from slurm_dlrm.store.errors import UnknownEntity
from slurm_dlrm.store.migrations import LATEST_VERSION, MIGRATIONS
from slurm_dlrm.store.states import JobState


def mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def test_fresh_store_is_migrated_wal_and_private(tmp_path):
    path = tmp_path / "a b'c;\n" / "store.sqlite"  # quotes, ; and a newline in the folder name
    with Store(path) as s:
        assert s.schema_version == LATEST_VERSION
        assert s.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert s.conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1
        assert s.conn.execute("PRAGMA busy_timeout").fetchone()[0] > 0
        tables = set(s.db.table_names())
        assert {"jobs", "packs", "placements", "samples", "events", "job_usage", "ingest_offsets",
                "migrations"} <= tables
        assert [r[0] for r in s.conn.execute("SELECT version FROM migrations")] == [m.version for m in MIGRATIONS]
        s.add_job(user="u", name="n", spec={}, spec_fingerprint="f")  # creates -wal/-shm
        assert mode(path.parent) == 0o700
        for suffix in ("", "-wal", "-shm"):
            assert mode(str(path) + suffix) == 0o600, suffix


@pytest.mark.parametrize("shared_mode", [0o1777, 0o777, 0o1700])
def test_a_shared_folder_is_refused_and_left_alone(tmp_path, shared_mode):
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, shared_mode)  # like /tmp: tightening it would lock out its other users
    with pytest.raises(StoreError, match="shared"):
        Store(d / "store.sqlite")
    assert mode(d) == shared_mode
    assert not (d / "store.sqlite").exists()


def test_open_tightens_loose_folder_and_file(tmp_path):
    d = tmp_path / "loose"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    (d / "store.sqlite").touch()
    os.chmod(d / "store.sqlite", 0o644)
    Store(d / "store.sqlite").close()
    assert mode(d) == 0o700 and mode(d / "store.sqlite") == 0o600


def test_reopen_does_not_reapply_and_data_survives(tmp_path):
    p = tmp_path / "s" / "store.sqlite"
    with Store(p) as s:
        j = s.add_job(user="u", name="n", spec={"x": 1}, spec_fingerprint="f")
    with Store(p) as s:
        assert s.get_job(j).spec == {"x": 1}
        assert s.conn.execute("SELECT count(*) FROM migrations").fetchone()[0] == len(MIGRATIONS)


def test_migrates_an_old_empty_database(tmp_path):
    p = tmp_path / "s" / "store.sqlite"
    p.parent.mkdir(mode=0o700)
    conn = sqlite3.connect(p)
    conn.execute("CREATE TABLE unrelated (x)")  # version 0, with a table of its own
    conn.commit()
    conn.close()
    with Store(p) as s:
        assert s.schema_version == LATEST_VERSION
        assert "unrelated" in s.db.table_names()


def test_newer_schema_is_refused(tmp_path):
    p = tmp_path / "s" / "store.sqlite"
    Store(p).close()
    conn = sqlite3.connect(p)
    conn.execute(f"PRAGMA user_version = {LATEST_VERSION + 1}")
    conn.close()
    with pytest.raises(SchemaTooNew):
        Store(p)
    with pytest.raises(SchemaTooNew):
        Store(p, readonly=True)


def test_readonly_reads_but_never_writes(tmp_path):
    p = tmp_path / "s" / "store.sqlite"
    with Store(p) as s:
        j = s.add_job(user="u", name="n", spec={}, spec_fingerprint="f")
    with Store(p, readonly=True) as ro:
        assert ro.get_job(j).name == "n"
        with pytest.raises(StoreError):
            ro.add_job(user="u", name="m", spec={}, spec_fingerprint="f")
    with pytest.raises(StoreError):
        Store(tmp_path / "missing" / "store.sqlite", readonly=True)


def test_two_processes_opening_a_fresh_store_migrate_once(tmp_path):
    import multiprocessing as mp

    p = str(tmp_path / "s" / "store.sqlite")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_open_close, args=(p,)) for _ in range(3)]
    for pr in procs:
        pr.start()
    for pr in procs:
        pr.join(60)
    assert [pr.exitcode for pr in procs] == [0, 0, 0]
    with Store(p) as s:
        assert s.conn.execute("SELECT count(*) FROM migrations").fetchone()[0] == len(MIGRATIONS)


def _open_close(p: str) -> None:
    Store(p).close()


def test_store_path_follows_the_site(tmp_path):
    site = load_site(REPO_SITE_FILE)
    assert store_path_for(site, "bob").name == "store.sqlite"
    assert store_path_for(site, "bob").parent == site.store_dir_for("bob")


def test_v1_store_is_migrated_keeping_its_jobs(tmp_path):
    p = tmp_path / "s" / "store.sqlite"
    p.parent.mkdir(mode=0o700)
    conn = sqlite3.connect(p)
    for stmt in MIGRATIONS[0].statements:
        conn.execute(stmt)
    conn.execute(
        "INSERT INTO jobs (user, name, state, spec_json, spec_fingerprint, estimate_json, submit_time, updated_time) "
        "VALUES ('u', 'old', 'PENDING', '{\"name\": \"old\"}', 'fp', '{\"gpu_peak_bytes\": 5}', 1.0, 1.0)")
    conn.execute("INSERT INTO packs (name, user, state, policy, n_gpus, create_time, updated_time) "
                 "VALUES ('pk', 'u', 'SUBMITTING', 'exclusive', 1, 1.0, 1.0)")
    conn.execute("PRAGMA user_version = 1")
    conn.commit()
    conn.close()
    with Store(p) as s:
        assert s.schema_version == LATEST_VERSION >= 2
        job = s.get_job(1)
        assert (job.spec, job.estimate, job.sbatch) == ({"name": "old"}, {"gpu_peak_bytes": 5}, None)
        assert "spec_json" not in s.db["jobs"].columns_dict
        assert {"samples_t", "placements_gpu"} <= {i.name for t in ("samples", "placements") for i in s.db[t].indexes}
        j2 = s.add_job(user="u", name="new", spec={}, spec_fingerprint="f", sbatch={"partition": "dlrm"})
        assert s.get_job(j2).sbatch == {"partition": "dlrm"}
        assert s.check() == []


def test_the_interim_v1_layout_is_migrated_too(tmp_path):
    # main at bbf9cb2 had version 1 with job_specs (no sbatch_json) and the new indexes.
    p = tmp_path / "s" / "store.sqlite"
    p.parent.mkdir(mode=0o700)
    conn = sqlite3.connect(p)
    for stmt in MIGRATIONS[0].statements:
        conn.execute(stmt)
    conn.executescript("""
        CREATE TABLE job_specs (job_id INTEGER PRIMARY KEY REFERENCES jobs(id), spec_json TEXT NOT NULL,
                                estimate_json TEXT);
        ALTER TABLE jobs DROP COLUMN spec_json; ALTER TABLE jobs DROP COLUMN estimate_json;
        DROP INDEX samples_pack_t; CREATE INDEX samples_t ON samples(t);
        CREATE INDEX placements_gpu ON placements(pack_id, node_index, gpu_index, start_time, end_time);
        INSERT INTO jobs (user, name, state, spec_fingerprint, submit_time, updated_time)
            VALUES ('u', 'mid', 'PENDING', 'fp', 1.0, 1.0);
        INSERT INTO job_specs VALUES (1, '{"name": "mid"}', NULL);
        PRAGMA user_version = 1;
    """)
    conn.close()
    with Store(p) as s:
        assert s.schema_version == LATEST_VERSION
        assert s.get_job(1).spec == {"name": "mid"}
        j2 = s.add_job(user="u", name="new", spec={}, spec_fingerprint="f", sbatch={"time": 10})
        assert s.get_job(j2).sbatch == {"time": 10}
        assert s.check() == []


def test_v3_store_gets_predicted_speed_and_old_placements_stay_uncorrected(tmp_path):
    p = tmp_path / "s" / "store.sqlite"
    conn = old_store(p, 3)
    conn.executescript("""
        INSERT INTO jobs (user, name, state, spec_fingerprint, submit_time, start_time, end_time, pack_id,
                          updated_time) VALUES ('u', 'a', 'COMPLETED', 'fp', 1.0, 10.0, 110.0, 1, 1.0);
        INSERT INTO jobs (user, name, state, spec_fingerprint, submit_time, start_time, end_time, pack_id,
                          updated_time) VALUES ('u', 'b', 'COMPLETED', 'fp', 1.0, 10.0, 110.0, 1, 1.0);
        INSERT INTO job_specs VALUES (1, '{}', NULL, NULL), (2, '{}', NULL, NULL);
        INSERT INTO packs (name, user, state, policy, n_gpus, create_time, start_time, end_time, updated_time)
            VALUES ('pk', 'u', 'COMPLETED', 'complementary', 1, 1.0, 10.0, 110.0, 1.0);
        INSERT INTO placements (pack_id, job_id, attempt, node_index, gpu_index, start_time, end_time)
            VALUES (1, 1, 0, 0, 0, 10.0, 110.0), (1, 2, 0, 0, 0, 10.0, 110.0);
        PRAGMA user_version = 3;
    """)
    conn.close()
    with Store(p) as s:
        assert s.schema_version == LATEST_VERSION >= 4
        assert [pl.predicted_speed for pl in s.placements()] == [None, None]
        rows = s.query("acct", {"now": 200.0, "job_ids": None, "states": None, "users": None, "pack_id": None,
                                "since": None, "until": None})
        # shared, but no prediction and no measurement: no correction (100 s each, 50 s charged)
        assert [(r["speed_basis"], round(r["excl_gpu_hours"] * 3600), round(r["gpu_hours"] * 3600))
                for r in rows] == [("none", 100, 50), ("none", 100, 50)]
        j = s.add_job(user="u", name="c", spec={}, spec_fingerprint="f")
        pk = s.add_pack(name="pk2", user="u", policy="complementary", n_gpus=1,
                        placements=[NewPlacement(j, 0, 0, predicted_speed=0.75)])
        assert s.placements(pack_id=pk)[0].predicted_speed == 0.75
        assert s.check() == []


def test_v4_store_gets_job_modes_and_its_jobs_stay_packed(tmp_path):
    p = tmp_path / "s" / "store.sqlite"
    conn = old_store(p, 4)
    conn.executescript("""
        INSERT INTO jobs (user, name, state, spec_fingerprint, submit_time, updated_time)
            VALUES ('u', 'a', 'PENDING', 'fp', 1.0, 1.0);
        INSERT INTO job_specs VALUES (1, '{}', NULL, NULL);
        PRAGMA user_version = 4;
    """)
    conn.close()
    with Store(p) as s:
        assert s.schema_version == LATEST_VERSION >= 5
        old = s.get_job(1)
        assert (old.mode, old.no_pack, old.nodes, old.gpu_idx, old.gpu_share) == ("pack", False, None, None, None)
        j = s.add_job(user="u", name="n", spec={}, spec_fingerprint="f", mode="no-pack", gpu_share=0.4)
        assert s.get_job(j).no_pack and s.get_job(j).gpu_share == 0.4
        with pytest.raises(sqlite3.IntegrityError):  # only the two modes
            s.add_job(user="u", name="x", spec={}, spec_fingerprint="f", mode="other")
        # a no-pack job is PLANNED with its Slurm id, not a pack
        with pytest.raises(ValueError, match="Slurm job id"):
            s.transition_job(j, "PLANNED", "submitted")
        assert s.transition_job(j, "PLANNED", "submitted", slurm_job_id="7").pack_id is None
        s.set_job_allocation(j, nodes="node1", gpu_idx="0-1")
        assert (s.get_job(j).nodes, s.get_job(j).gpu_idx) == ("node1", "0-1")
        assert s.check() == []


def test_a_store_of_version_7_is_migrated_to_take_timeout_and_array_tasks(tmp_path):
    # issue 42: TIMEOUT is a job state; jobs.state's CHECK of an older store refused it
    p = tmp_path / "s" / "store.sqlite"
    conn = old_store(p, 7, lambda stmt: stmt.replace(", 'TIMEOUT'", ""))  # the states a version-7 store had
    conn.execute("INSERT INTO jobs (user, name, state, spec_fingerprint, submit_time, updated_time) "
                 "VALUES ('u', 'old', 'RUNNING', 'fp', 1.0, 1.0)")
    conn.execute("INSERT INTO job_specs VALUES (1, '{}', NULL, NULL)")
    conn.execute("PRAGMA user_version = 7")
    conn.commit()
    with pytest.raises(sqlite3.IntegrityError):
        conn.execute("UPDATE jobs SET state = 'TIMEOUT' WHERE id = 1")
    conn.close()
    with Store(p) as s:
        assert s.schema_version == LATEST_VERSION
        s.transition_job(1, JobState.TIMEOUT, "reached its time limit")
        assert s.get_job(1).state == JobState.TIMEOUT and s.get_job(1).array_job_id is None
        assert s.check() == []
        with pytest.raises(sqlite3.IntegrityError):
            s.conn.execute("UPDATE jobs SET state = 'BOGUS' WHERE id = 1")


def test_site_host_runs_are_completed_measured_runs_of_one_device_kind_newest_first(tmp_path):
    """The site-wide host calibration's input (issue 43 item 13): any fingerprint, only
    COMPLETED jobs with a measured peak RSS, CPU-run and GPU-run estimates apart."""
    cpu = {"host_peak_bytes": 500, "host_breakdown": {"runtime": 400, "tensors": 100}}
    cuda = {"host_peak_bytes": 2000, "host_breakdown": {"runtime": 1500, "pinned_staging": 500}}
    clock = [100.0]
    with Store(tmp_path / "s.sqlite", clock=lambda: clock[0]) as s:
        def run(est, rss, end_state=JobState.COMPLETED):
            j = s.add_job(user="u", name="n", spec={}, spec_fingerprint=f"fp{clock[0]}", estimate=est)
            p = s.add_pack(name=f"p{j}", user="u", policy="exclusive", n_gpus=1,
                           placements=[NewPlacement(job_id=j, node_index=0, gpu_index=0)])
            s.transition_job(j, JobState.RUNNING, "started")
            s.add_samples([{"t": clock[0], "pack_id": p, "job_id": j, "node": "n1", "gpu_index": 0, "rss_bytes": rss}])
            s.transition_job(j, end_state, "done", exit_code=0 if end_state == JobState.COMPLETED else 1)
            clock[0] += 10
            return j

        a, b = run(cpu, 450), run(cuda, 1800)
        run(cpu, 9999, JobState.FAILED)  # ended early or not: not a finished run's peak
        run(cpu, None)  # no RSS measured
        c = run(cpu, 480)
        s.add_job(user="u", name="pending", spec={}, spec_fingerprint="x", estimate=cpu)
        assert [(r.job_id, r.meas_host_peak_bytes) for r in s.site_host_runs("cpu")] == [(c, 480), (a, 450)]
        assert s.site_host_runs("cpu")[0].estimate == cpu
        assert [r.job_id for r in s.site_host_runs("cuda")] == [b]
        assert [r.job_id for r in s.site_host_runs("cpu", limit=1)] == [c]


def test_a_store_of_version_9_is_migrated_to_keep_a_requeued_no_pack_jobs_runs(tmp_path):
    # issue 49: jobs.slurm_run_s (a requeued --no-pack job's runs from sacct); old rows NULL
    p = tmp_path / "s" / "store.sqlite"
    conn = old_store(p, 9)
    conn.execute("INSERT INTO jobs (user, name, state, spec_fingerprint, submit_time, updated_time) "
                 "VALUES ('u', 'old', 'RUNNING', 'fp', 1.0, 1.0)")
    conn.execute("INSERT INTO job_specs VALUES (1, '{}', NULL, NULL)")
    conn.execute("PRAGMA user_version = 9")
    conn.commit()
    conn.close()
    with Store(p) as s:
        assert s.schema_version == LATEST_VERSION >= 11
        assert s.conn.execute("SELECT slurm_run_s FROM jobs WHERE id = 1").fetchone()[0] is None
        s.set_job_slurm_run_s(1, 65.0)
        assert s.conn.execute("SELECT slurm_run_s FROM jobs WHERE id = 1").fetchone()[0] == 65.0
        with pytest.raises(UnknownEntity):
            s.set_job_slurm_run_s(99, 1.0)
        assert s.check() == []
