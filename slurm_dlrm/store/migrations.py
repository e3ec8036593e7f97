"""Versioned schema migrations, applied in order when a store is opened.

`PRAGMA user_version` holds the version reached; each migration runs in its own
`BEGIN IMMEDIATE` transaction together with the bump of `user_version` and a row in
`migrations`, so a crash mid-migration leaves the previous version intact, and two
processes opening a fresh store at once apply each step exactly once.

To change the schema: append a `Migration` (never edit a released one), and add a
test in tests/test_store_migrations.py that opens a store at the previous version.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass

from slurm_dlrm.store.states import JobState, PackState


@dataclass(frozen=True)
class Migration:
    version: int
    description: str
    statements: tuple[str, ...]
    # Python for what plain SQL cannot say (conditional steps); runs after `statements`.
    apply: Callable[[sqlite3.Connection], None] | None = None


def _in(values: type[JobState] | type[PackState]) -> str:
    return ", ".join(f"'{v.value}'" for v in values)


_V1 = (
    f"""
    CREATE TABLE packs (
        id INTEGER PRIMARY KEY,
        name TEXT NOT NULL UNIQUE,          -- sbatch --job-name; how a crashed service finds it
        user TEXT NOT NULL,
        state TEXT NOT NULL CHECK (state IN ({_in(PackState)})),
        policy TEXT NOT NULL,
        partition TEXT,
        gpu_model TEXT,
        n_nodes INTEGER NOT NULL DEFAULT 1,
        n_gpus INTEGER NOT NULL,
        nodes TEXT,                         -- Slurm hostlist of the allocation, once known
        slurm_job_id TEXT,
        pack_dir TEXT,
        create_time REAL NOT NULL,
        submit_time REAL,                   -- sbatch answered
        start_time REAL,
        end_time REAL,
        reason TEXT,                        -- reason of the last transition
        updated_time REAL NOT NULL
    )
    """,
    "CREATE INDEX packs_state ON packs(state)",
    "CREATE INDEX packs_slurm_job_id ON packs(slurm_job_id)",
    f"""
    CREATE TABLE jobs (
        id INTEGER PRIMARY KEY,
        user TEXT NOT NULL,
        name TEXT NOT NULL,
        state TEXT NOT NULL CHECK (state IN ({_in(JobState)})),
        attempt INTEGER NOT NULL DEFAULT 0, -- times it was requeued after running
        spec_json TEXT NOT NULL,
        spec_fingerprint TEXT NOT NULL,
        gpu_model TEXT,
        est_gpu_peak_bytes INTEGER,
        est_host_peak_bytes INTEGER,
        est_profile_label TEXT,
        est_solo_samples_per_s REAL,
        estimate_json TEXT,                 -- Estimate.to_dict(): breakdowns and profile
        gpu_mem_request_bytes INTEGER,      -- what packing reserves; raised after an OOM
        host_mem_request_bytes INTEGER,
        submit_time REAL NOT NULL,
        start_time REAL,                    -- first start of any attempt
        end_time REAL,                      -- reaching a terminal state
        pack_id INTEGER REFERENCES packs(id),  -- current (or last) pack
        slurm_job_id TEXT,
        slurm_step TEXT,
        exit_code INTEGER,
        exit_reason TEXT,
        updated_time REAL NOT NULL
    )
    """,
    "CREATE INDEX jobs_state ON jobs(state)",
    "CREATE INDEX jobs_fingerprint ON jobs(spec_fingerprint, end_time)",
    "CREATE INDEX jobs_submit_time ON jobs(submit_time)",
    "CREATE INDEX jobs_pack ON jobs(pack_id)",
    """
    CREATE TABLE placements (
        id INTEGER PRIMARY KEY,
        pack_id INTEGER NOT NULL REFERENCES packs(id),
        job_id INTEGER NOT NULL REFERENCES jobs(id),
        attempt INTEGER NOT NULL,
        node_index INTEGER NOT NULL,        -- SLURM_NODEID within the allocation
        node TEXT,                          -- host name, once known
        gpu_index INTEGER NOT NULL,         -- position in CUDA_VISIBLE_DEVICES on that node
        mps_thread_pct INTEGER,
        gpu_mem_limit_bytes INTEGER,
        host_mem_limit_bytes INTEGER,
        cpus INTEGER,
        start_time REAL,                    -- the member ran on this GPU from ...
        end_time REAL,                      -- ... to (NULL while running)
        UNIQUE (pack_id, job_id, node_index, gpu_index)
    )
    """,
    "CREATE INDEX placements_job ON placements(job_id)",
    """
    CREATE TABLE samples (
        t REAL NOT NULL,
        pack_id INTEGER NOT NULL REFERENCES packs(id),
        job_id INTEGER REFERENCES jobs(id), -- NULL: a GPU-level sample
        node TEXT NOT NULL,
        gpu_index INTEGER,
        sm_util_pct REAL,
        mem_util_pct REAL,
        gpu_mem_bytes INTEGER,
        host_cpu_pct REAL,
        rss_bytes INTEGER,
        samples_per_s REAL
    )
    """,
    "CREATE INDEX samples_job_t ON samples(job_id, t)",
    "CREATE INDEX samples_pack_t ON samples(pack_id, t)",
    # Per-job aggregates kept up to date by every sample write, so `acct` never scans
    # the samples table.
    """
    CREATE TABLE job_usage (
        job_id INTEGER PRIMARY KEY REFERENCES jobs(id),
        n_samples INTEGER NOT NULL,
        gpu_mem_peak_bytes INTEGER,
        rss_peak_bytes INTEGER,
        sm_util_sum REAL NOT NULL DEFAULT 0,
        sm_util_n INTEGER NOT NULL DEFAULT 0,
        sm_util_max REAL,
        host_cpu_sum REAL NOT NULL DEFAULT 0,
        host_cpu_n INTEGER NOT NULL DEFAULT 0,
        sps_sum REAL NOT NULL DEFAULT 0,
        sps_n INTEGER NOT NULL DEFAULT 0,
        first_t REAL,
        last_t REAL
    )
    """,
    """
    CREATE TABLE events (
        id INTEGER PRIMARY KEY,
        t REAL NOT NULL,
        kind TEXT NOT NULL,                 -- job_state | pack_state | agent | ingest | note
        job_id INTEGER REFERENCES jobs(id),
        pack_id INTEGER REFERENCES packs(id),
        from_state TEXT,
        to_state TEXT,
        reason TEXT NOT NULL,
        data_json TEXT
    )
    """,
    "CREATE INDEX events_job ON events(job_id)",
    "CREATE INDEX events_pack ON events(pack_id)",
    "CREATE INDEX events_t ON events(t)",
    # How far each agent report file has been ingested; advanced in the transaction
    # that stores what was read, so nothing is read twice or lost across a crash.
    """
    CREATE TABLE ingest_offsets (
        path TEXT PRIMARY KEY,
        inode INTEGER,
        offset_bytes INTEGER NOT NULL,
        lines INTEGER NOT NULL DEFAULT 0,
        bad_lines INTEGER NOT NULL DEFAULT 0,
        updated_time REAL NOT NULL
    )
    """,
)

_V2 = (
    # The documents, apart: a job row stays small, so scanning 10,000 jobs for acct
    # does not read kilobytes of spec per job. sbatch_json: the user's sbatch options
    # for this job (the service merges them into its pack's script).
    """
    CREATE TABLE IF NOT EXISTS job_specs (
        job_id INTEGER PRIMARY KEY REFERENCES jobs(id),
        spec_json TEXT NOT NULL,
        estimate_json TEXT,                 -- Estimate.to_dict(): breakdowns and profile
        sbatch_json TEXT                    -- sbatch options given at submit, or NULL
    )
    """,
    # Covering indexes for acct's per-GPU and per-job groupings (no temp B-trees).
    "DROP INDEX IF EXISTS placements_job",
    "CREATE INDEX placements_job ON placements(job_id, pack_id, start_time, end_time, node)",
    "CREATE INDEX IF NOT EXISTS placements_gpu ON placements(pack_id, node_index, gpu_index, start_time, end_time)",
    # Nothing looks samples up by pack; time windows (report --since, pruning) do.
    "DROP INDEX IF EXISTS samples_pack_t",
    "CREATE INDEX IF NOT EXISTS samples_t ON samples(t)",
)


def _v2_move_documents(conn: sqlite3.Connection) -> None:
    # Two layouts carry version 1: the first one (documents in `jobs`) and one that
    # briefly had `job_specs` without `sbatch_json` (main at bbf9cb2). Bring both here.
    jobs_cols = {r[1] for r in conn.execute("PRAGMA table_info(jobs)")}
    if "spec_json" in jobs_cols:
        conn.execute("INSERT INTO job_specs (job_id, spec_json, estimate_json) "
                     "SELECT id, spec_json, estimate_json FROM jobs")
        conn.execute("ALTER TABLE jobs DROP COLUMN spec_json")  # SQLite >= 3.35
        conn.execute("ALTER TABLE jobs DROP COLUMN estimate_json")
    spec_cols = {r[1] for r in conn.execute("PRAGMA table_info(job_specs)")}
    if "sbatch_json" not in spec_cols:
        conn.execute("ALTER TABLE job_specs ADD COLUMN sbatch_json TEXT")


_V3 = (
    # Samples deleted by `Store.prune_samples`; the aggregates keep counting them.
    "ALTER TABLE job_usage ADD COLUMN n_pruned INTEGER NOT NULL DEFAULT 0",
)

_V4 = (
    # The packing plan's predicted relative speed of the member on that GPU (1.0 = as
    # fast as alone; MemberPlacement.predicted_speed): acct's slowdown correction when no
    # measured solo throughput of the same spec and GPU model exists.
    "ALTER TABLE placements ADD COLUMN predicted_speed REAL",
)

_V5 = (
    # `submit --no-pack` jobs are rows too (issue 23, one job identity): one job, one Slurm
    # job of its own (jobs.slurm_job_id), settled from squeue/sacct, never packed.
    "ALTER TABLE jobs ADD COLUMN mode TEXT NOT NULL DEFAULT 'pack' CHECK (mode IN ('pack', 'no-pack'))",
    # its allocation (hostlist), its GPUs as the node numbers them (Slurm's IDX, "1" or
    # "0-1"), and the GPUs it holds (world_size, or an MPS share like 0.4: acct's charge)
    "ALTER TABLE jobs ADD COLUMN nodes TEXT",
    "ALTER TABLE jobs ADD COLUMN gpu_idx TEXT",
    "ALTER TABLE jobs ADD COLUMN gpu_share REAL",
)

_V6 = (
    # A multi-GPU job has one placement row per rank (issue 18, docs/interfaces.md
    # section 3): its rank and world_size; NULL for a one-rank member (rank 0 of 1).
    "ALTER TABLE placements ADD COLUMN rank INTEGER",
    "ALTER TABLE placements ADD COLUMN world_size INTEGER",
)

_V7 = (
    # issue 31: sbatch --nice (the job's priority among its user's jobs; higher goes
    # later) and --begin (epoch seconds; NULL: at once), as the service plans by them.
    "ALTER TABLE jobs ADD COLUMN nice INTEGER NOT NULL DEFAULT 0",
    "ALTER TABLE jobs ADD COLUMN begin_time REAL",
)

_V8 = (
    # issue 42: an array's tasks (`submit --array 0-3`), as Slurm numbers them: the array
    # job id is the first task's job id, the task id its index; `cancel 12_3` means task 3
    # of array 12. NULL: not a task of an array.
    "ALTER TABLE jobs ADD COLUMN array_job_id INTEGER",
    "ALTER TABLE jobs ADD COLUMN array_task_id INTEGER",
    "CREATE INDEX IF NOT EXISTS jobs_array ON jobs(array_job_id, array_task_id)",
)


def _v8_widen_job_states(conn: sqlite3.Connection) -> None:
    """jobs.state's CHECK to the states of today (TIMEOUT, issue 42). SQLite cannot
    ALTER a CHECK; a wider one holds for every row already there, so the table's text in
    sqlite_schema is rewritten in place, the procedure lang_altertable.html ("Making
    other kinds of table schema changes") gives for changing constraints."""
    sql = conn.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'jobs'").fetchone()[0]
    widened = re.sub(r"CHECK \(state IN \([^)]*\)\)", f"CHECK (state IN ({_in(JobState)}))", sql, count=1)
    if widened == sql:
        return  # created with today's states already
    version = int(conn.execute("PRAGMA schema_version").fetchone()[0])
    conn.execute("PRAGMA writable_schema = ON")
    try:
        conn.execute("UPDATE sqlite_master SET sql = ? WHERE type = 'table' AND name = 'jobs'", (widened,))
        conn.execute(f"PRAGMA schema_version = {version + 1}")
    finally:
        conn.execute("PRAGMA writable_schema = OFF")


_V9 = (
    # issue 39: the runner's held-out evaluations (`"type": "eval"` lines of a job's
    # metrics file), one row per job and step; a step evaluated again after a resume
    # gives the same numbers and replaces its row.
    """
    CREATE TABLE evals (
        job_id INTEGER NOT NULL REFERENCES jobs(id),
        step INTEGER NOT NULL,
        t REAL NOT NULL,
        auc REAL,
        ne REAL,
        log_loss REAL,
        calibration REAL,
        accuracy REAL,
        samples INTEGER,
        planted_auc REAL,                   -- synthetic data: the planted model's AUC (the best)
        PRIMARY KEY (job_id, step)
    )
    """,
)

_V11 = (
    # issue 49: a `--no-pack` job Slurm requeued (--requeue, a node lost) ran more than
    # once under one Slurm id; its charge is the sum of its runs as sacct --duplicates
    # gives them, not start-to-end, which counts the wait between them. NULL: one run
    # (or no accounting to say): start to end.
    "ALTER TABLE jobs ADD COLUMN slurm_run_s REAL",
)


_V10 = (
    # issue 48: every rank's measured peaks (the `rank_peak_*` lists of rank 0's metrics
    # lines in a multi-rank run), the highest seen per job and rank over all attempts
    """
    CREATE TABLE rank_peaks (
        job_id INTEGER NOT NULL REFERENCES jobs(id),
        rank INTEGER NOT NULL,
        gpu_mem_peak_bytes INTEGER,         -- torch.cuda.max_memory_allocated (NULL on the CPU)
        rss_peak_bytes INTEGER,             -- the rank's host RSS high-water mark (VmHWM)
        tensor_peak_bytes INTEGER,          -- live tensor bytes of the training state + activations
        t REAL NOT NULL,                    -- the metrics line it last came from
        PRIMARY KEY (job_id, rank)
    )
    """,
)


MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "jobs, packs, placements, samples, job_usage, events, ingest_offsets",
        tuple(s.strip() for s in _V1),
    ),
    Migration(
        2,
        "job_specs (spec, estimate, sbatch options) apart from jobs; acct and time-window indexes",
        tuple(s.strip() for s in _V2),
        _v2_move_documents,
    ),
    Migration(3, "job_usage.n_pruned (sample retention)", _V3),
    Migration(4, "placements.predicted_speed (acct's slowdown correction)", _V4),
    Migration(5, "jobs.mode, nodes, gpu_idx, gpu_share (submit --no-pack jobs in the store)", _V5),
    Migration(6, "placements.rank, placements.world_size (multi-GPU jobs)", _V6),
    Migration(7, "jobs.nice, jobs.begin_time (submit --nice, --begin)", _V7),
    Migration(8, "jobs.state may be TIMEOUT; jobs.array_job_id, array_task_id (arrays as Slurm numbers them)",
              _V8, _v8_widen_job_states),
    Migration(9, "evals (held-out evaluation per job and step)", tuple(s.strip() for s in _V9)),
    Migration(10, "rank_peaks (every rank's measured peaks, multi-rank jobs)", tuple(s.strip() for s in _V10)),
    Migration(11, "jobs.slurm_run_s (a requeued --no-pack job's runs, summed from sacct)", _V11),
)

LATEST_VERSION = MIGRATIONS[-1].version

MIGRATIONS_TABLE = (
    "CREATE TABLE IF NOT EXISTS migrations ("
    "version INTEGER PRIMARY KEY, description TEXT NOT NULL, applied_time REAL NOT NULL)"
)
