"""The store: one SQLite file per user holding jobs, packs, placements, samples, events.

Every state change goes through `transition_job` / `transition_pack`, which check the
lifecycle tables in `states.py` and write an event row in the same transaction.
Writes nest: calling a store method inside `with store.write():` joins the outer
transaction, so a caller can make several changes atomically.

Over 600 lines: one class, the transactional API every read and write goes through
(nested `write()`, the state machines, an event in the same transaction); the row types
are in records.py, the SQL text in queries.py, the schema in migrations.py, ingestion
in ingest.py.
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from slurm_dlrm.site import SiteConfig, expand_hostlist
from slurm_dlrm.store import queries
from slurm_dlrm.store.db import DB_FILENAME, connect, is_busy, retry_busy
from slurm_dlrm.store.errors import (
    IllegalTransition,
    SchemaTooNew,
    StaleState,
    StoreBusy,
    StoreError,
    StoreFull,
    StoreTimeout,
    UnknownEntity,
)
from slurm_dlrm.store.migrations import LATEST_VERSION, MIGRATIONS, MIGRATIONS_TABLE
from slurm_dlrm.store.records import (
    MODE_NO_PACK,
    CalibrationRow,
    Job,
    JobUsage,
    NewPlacement,
    Pack,
    Placement,
    SiteHostRun,
)
from slurm_dlrm.store.states import (
    JOB_ATTEMPT_FROM,
    JOB_TERMINAL,
    PACK_TERMINAL,
    JobState,
    PackState,
    job_transition_allowed,
    pack_transition_allowed,
)

if TYPE_CHECKING:
    import sqlite_utils

log = logging.getLogger(__name__)

Clock = Callable[[], float]
StateT = TypeVar("StateT", JobState, PackState)

SAMPLE_FIELDS = (
    "t", "pack_id", "job_id", "node", "gpu_index", "sm_util_pct", "mem_util_pct",
    "gpu_mem_bytes", "host_cpu_pct", "rss_bytes", "samples_per_s",
)
_INSERT_SAMPLE = f"INSERT INTO samples ({', '.join(SAMPLE_FIELDS)}) VALUES ({', '.join('?' * len(SAMPLE_FIELDS))})"


def current_user() -> str:
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return os.environ.get("USER", str(os.getuid()))


def store_path_for(site: SiteConfig, user: str | None = None) -> Path:
    """Where `user`'s store lives: ``<site.store_dir_for(user)>/store.sqlite``."""
    return site.store_dir_for(user or current_user()) / DB_FILENAME


# ---------------------------------------------------------------- the store

class Store:
    """A user's store. Not thread-safe: one `Store` per thread or process."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        readonly: bool = False,
        clock: Clock = time.time,
        busy_timeout_s: float = 10.0,
        retry_s: float = 300.0,
        read_budget_s: float | None = None,
        untrusted: bool = False,
        filesystem: str = "auto",
        immutable: bool = False,
    ) -> None:
        """`untrusted` (read-only only): another user's file, so its schema is checked
        on open and again whenever it changes (store/guard.py). `read_budget_s`: each
        read transaction or query is interrupted past this (StoreTimeout)."""
        self.path = Path(path)
        self.readonly = readonly
        self.clock = clock
        self.retry_s = retry_s
        self.read_budget_s = read_budget_s
        self.untrusted = untrusted
        # The user every row is labelled with when this store is read on an admin's
        # behalf: its file's owner, not what its rows say (exporter, acct --all-users).
        self.owner_user: str | None = None
        self._deadline: float | None = None
        self._checked_cookie: int | None = None
        self.write_fence: Callable[[Store], None] | None = None
        try:
            self.conn: sqlite3.Connection = connect(self.path, readonly=readonly, busy_timeout_s=busy_timeout_s,
                                                        filesystem=filesystem, immutable=immutable)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open store {self.path}: {exc}") from exc
        self._db: Any = None
        self._depth = 0
        self._known_jobs: set[int] = set()
        self._known_packs: set[int] = set()
        self._warned_unknown: set[tuple[str, int]] = set()
        if read_budget_s is not None:
            # every 1000 VM steps: a few microseconds each, and a crafted query still ends
            self.conn.set_progress_handler(self._past_deadline, 1000)
        try:
            if readonly:
                with self._budget():
                    self._check_version()
                    if untrusted:
                        self._check_schema()
            else:
                self._migrate()
        except sqlite3.DatabaseError as exc:  # e.g. "file is not a database"
            self.conn.close()
            raise StoreError(f"cannot open store {self.path}: {exc}") from exc
        except BaseException:
            self.conn.close()
            raise

    @property
    def db(self) -> sqlite_utils.Database:
        """sqlite-utils over the same connection (introspection, ad-hoc queries, tests).

        Built on first use: importing sqlite_utils also imports numpy (~0.1 s), which
        `slurm-dlrm acct` and the submit path need not pay.
        """
        if self._db is None:
            import sqlite_utils

            self._db = sqlite_utils.Database(self.conn, recursive_triggers=False, execute_plugins=False)
        return self._db

    @classmethod
    def for_user(cls, site: SiteConfig, user: str | None = None, **kw: Any) -> Store:
        kw.setdefault("filesystem", site.store_filesystem)
        return cls(store_path_for(site, user), **kw)

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ transactions

    @property
    def schema_version(self) -> int:
        return int(self.conn.execute("PRAGMA user_version").fetchone()[0])

    def _check_version(self) -> None:
        v = self.schema_version
        if v > LATEST_VERSION:
            raise SchemaTooNew(f"{self.path}: schema version {v} is newer than this slurm-dlrm ({LATEST_VERSION})")
        if v < LATEST_VERSION:
            raise StoreError(f"{self.path}: schema version {v} is older than {LATEST_VERSION}; open it read-write once to migrate")

    def _past_deadline(self) -> int:
        return 1 if self._deadline is not None and time.monotonic() > self._deadline else 0

    def _check_schema(self) -> None:
        """The schema check of an untrusted store, again only when its schema cookie moved
        (any CREATE/DROP/ALTER bumps it), so a checked-then-swapped table is caught."""
        from slurm_dlrm.store.guard import check_schema

        cookie = int(self.conn.execute("PRAGMA schema_version").fetchone()[0])
        if cookie != self._checked_cookie:
            check_schema(self.conn, str(self.path))
            self._checked_cookie = cookie

    @contextmanager
    def _budget(self) -> Iterator[None]:
        """Bound what runs inside to read_budget_s (outermost call only)."""
        if self.read_budget_s is None or self._deadline is not None:
            yield
            return
        self._deadline = time.monotonic() + self.read_budget_s
        try:
            yield
        except sqlite3.OperationalError as exc:
            if "interrupted" in str(exc):
                raise StoreTimeout(f"{self.path}: a read took over {self.read_budget_s:g} s; "
                                   f"interrupted") from None
            raise
        finally:
            self._deadline = None

    def _migrate(self) -> None:
        if self.schema_version > LATEST_VERSION:
            raise SchemaTooNew(f"{self.path}: schema version {self.schema_version} is newer than this slurm-dlrm ({LATEST_VERSION})")
        for m in MIGRATIONS:
            if self.schema_version >= m.version:
                continue
            with self.write():
                # Re-read under the write lock: another process may have migrated.
                if self.schema_version >= m.version:
                    continue
                self.conn.execute(MIGRATIONS_TABLE)
                for stmt in m.statements:
                    self.conn.execute(stmt)
                if m.apply is not None:
                    m.apply(self.conn)
                self.conn.execute(
                    "INSERT INTO migrations (version, description, applied_time) VALUES (?, ?, ?)",
                    (m.version, m.description, self.clock()),
                )
                self.conn.execute(f"PRAGMA user_version = {int(m.version)}")
                log.info("store %s: migrated to version %d (%s)", self.path, m.version, m.description)

    @contextmanager
    def write(self, *, fenced: bool = True) -> Iterator[Store]:
        """One write transaction (`BEGIN IMMEDIATE`, retried while busy); nests.

        `write_fence(store)`, when set (the service's lease check, service/hosts.py), runs
        first inside every outermost transaction: what it raises undoes the transaction.
        `fenced=False`: the lease's own compare-and-set."""
        if self.readonly:
            raise StoreError(f"{self.path} is open read-only")
        if self._depth:
            self._depth += 1
            try:
                yield self
            finally:
                self._depth -= 1
            return
        retry_busy(lambda: self.conn.execute("BEGIN IMMEDIATE"), self.retry_s)
        self._depth = 1
        try:
            if fenced and self.write_fence is not None:
                self.write_fence(self)
            yield self
        except BaseException as exc:
            self._depth = 0
            if self.conn.in_transaction:
                self.conn.execute("ROLLBACK")
            # Ids learnt inside the rolled-back transaction may not exist any more.
            self._known_jobs.clear()
            self._known_packs.clear()
            self._raise_if_full(exc)
            raise
        try:
            retry_busy(lambda: self.conn.execute("COMMIT"), self.retry_s)
        except BaseException as exc:
            if self.conn.in_transaction:
                self.conn.execute("ROLLBACK")
            self._known_jobs.clear()
            self._known_packs.clear()
            self._raise_if_full(exc)
            raise
        finally:
            self._depth = 0

    def _raise_if_full(self, exc: BaseException) -> None:
        """A full file system is one line for the user, not sqlite3's traceback (issue 49:
        `submit` while the store's disk was full printed one; the service logs it and
        retries at its next round)."""
        if isinstance(exc, sqlite3.OperationalError) and (
                getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL or "disk is full" in str(exc)):
            raise StoreFull(f"store {self.path}: its file system is full; nothing was written "
                            f"(free space there and run the command again)") from exc

    @contextmanager
    def savepoint(self, name: str = "sp") -> Iterator[None]:
        """Inside `write()`: undo only this block's changes if it raises."""
        assert self._depth, "savepoint() needs an open write()"
        self.conn.execute(f"SAVEPOINT {name}")
        try:
            yield
        except BaseException:
            self.conn.execute(f"ROLLBACK TO {name}")
            self.conn.execute(f"RELEASE {name}")
            raise
        self.conn.execute(f"RELEASE {name}")

    @contextmanager
    def read(self) -> Iterator[Store]:
        """A consistent snapshot across several queries (a deferred read transaction)."""
        if self._depth or self.conn.in_transaction:
            yield self
            return
        with self._budget():
            retry_busy(lambda: self.conn.execute("BEGIN"), self.retry_s)
            try:
                if self.untrusted:
                    self._check_schema()  # inside the snapshot every read below sees
                yield self
            finally:
                self._deadline = None  # ending the snapshot is never interrupted
                if self.conn.in_transaction:
                    self.conn.execute("COMMIT")

    def query(self, name: str, params: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
        """Run a named query from `queries.QUERIES`; rows as dicts."""
        sql = queries.QUERIES[name]

        def run() -> list[dict[str, Any]]:
            cur = self.conn.execute(sql, dict(params or {}))
            cols = [d[0] for d in cur.description]
            return [dict(zip(cols, row, strict=True)) for row in cur.fetchall()]

        with self._budget():
            if self.untrusted and not self.conn.in_transaction:
                self._check_schema()
            return retry_busy(run, self.retry_s)

    # ------------------------------------------------------------ events

    def event_in_tx(
        self, kind: str, reason: str, *, job_id: int | None = None, pack_id: int | None = None,
        src: str | None = None, dst: str | None = None, data: Mapping[str, Any] | None = None,
        t: float | None = None,
    ) -> None:
        self.conn.execute(
            "INSERT INTO events (t, kind, job_id, pack_id, from_state, to_state, reason, data_json) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (self.clock() if t is None else t, kind, job_id, pack_id, src, dst, reason,
             None if data is None else json.dumps(data, sort_keys=True, default=str)),
        )

    def add_event(
        self, kind: str, reason: str, *, job_id: int | None = None, pack_id: int | None = None,
        data: Mapping[str, Any] | None = None, t: float | None = None,
    ) -> None:
        """An audit row that is not a state change (agent events, notes, warnings)."""
        with self.write():
            self.event_in_tx(kind, reason, job_id=job_id, pack_id=pack_id, data=data, t=t)

    def events(
        self, *, job_id: int | None = None, pack_id: int | None = None, kind: str | None = None,
        since: float | None = None,
    ) -> list[dict[str, Any]]:
        rows = self.query("events", {"job_id": job_id, "pack_id": pack_id, "kind": kind, "since": since})
        for r in rows:
            raw = r.pop("data_json")
            r["data"] = None if raw is None else json.loads(raw)
        return rows

    # ------------------------------------------------------------ jobs

    def add_job(
        self, *, user: str, name: str, spec: Mapping[str, Any], spec_fingerprint: str,
        estimate: Mapping[str, Any] | None = None, gpu_model: str | None = None,
        gpu_mem_request_bytes: int | None = None, host_mem_request_bytes: int | None = None,
        submit_time: float | None = None, reason: str = "submitted",
        sbatch: Mapping[str, Any] | None = None, mode: str = "pack", gpu_share: float | None = None,
        nice: int = 0, begin_time: float | None = None,
        array_job_id: int | None = None, array_task_id: int | None = None,
    ) -> int:
        """A new PENDING job. `estimate` is `Estimate.to_dict()` (docs/interfaces.md section 2).

        `sbatch`: the sbatch options the user gave for this job (JSON-able), kept for the
        service; read back as `Job.sbatch`. `mode="no-pack"`: a `submit --no-pack` job,
        PENDING only until its own sbatch answers (never planned into a pack);
        `gpu_share` the GPUs it asks for. `array_task_id` (issue 42): a task of an
        array whose id is `array_job_id`, or this job's own id when None (its first task).
        """
        now = self.clock() if submit_time is None else submit_time
        est = dict(estimate or {})
        profile = est.get("profile") or {}
        est_gpu = _int_or_none(est.get("gpu_peak_bytes"))
        est_host = _int_or_none(est.get("host_peak_bytes"))
        row = {
            "user": user, "name": name, "state": JobState.PENDING.value, "attempt": 0,
            "spec_fingerprint": spec_fingerprint, "gpu_model": gpu_model,
            "est_gpu_peak_bytes": est_gpu, "est_host_peak_bytes": est_host,
            "est_profile_label": profile.get("label"),
            "est_solo_samples_per_s": _float_or_none(profile.get("solo_samples_per_s")),
            "gpu_mem_request_bytes": est_gpu if gpu_mem_request_bytes is None else gpu_mem_request_bytes,
            "host_mem_request_bytes": est_host if host_mem_request_bytes is None else host_mem_request_bytes,
            "submit_time": now, "updated_time": now, "mode": mode, "gpu_share": gpu_share,
            "nice": nice, "begin_time": begin_time,
        }
        with self.write():
            cols = ", ".join(row)
            cur = self.conn.execute(f"INSERT INTO jobs ({cols}) VALUES ({', '.join('?' * len(row))})", tuple(row.values()))
            job_id = int(cur.lastrowid or 0)
            if array_task_id is not None:
                self.conn.execute("UPDATE jobs SET array_job_id = ?, array_task_id = ? WHERE id = ?",
                                  (job_id if array_job_id is None else array_job_id, array_task_id, job_id))
            self.conn.execute(
                "INSERT INTO job_specs (job_id, spec_json, estimate_json, sbatch_json) VALUES (?, ?, ?, ?)",
                (job_id, json.dumps(dict(spec), sort_keys=True, default=str),
                 json.dumps(est, sort_keys=True, default=str) if estimate is not None else None,
                 json.dumps(dict(sbatch), sort_keys=True, default=str) if sbatch is not None else None),
            )
            self.event_in_tx("job_state", reason, job_id=job_id, dst=JobState.PENDING.value, t=now)
        return job_id

    def set_job_estimate(self, job_id: int, estimate: Mapping[str, Any], reason: str) -> None:
        """Replace a PENDING job's estimate (and the memory requests made from it), e.g.
        the traced estimate of a custom module that `submit` could only mark (issue 17)."""
        est = dict(estimate)
        profile = est.get("profile") or {}
        gpu, host = _int_or_none(est.get("gpu_peak_bytes")), _int_or_none(est.get("host_peak_bytes"))
        with self.write():
            now = self.clock()
            cur = self.conn.execute(
                "UPDATE jobs SET est_gpu_peak_bytes = ?, est_host_peak_bytes = ?, est_profile_label = ?, "
                "est_solo_samples_per_s = ?, gpu_mem_request_bytes = ?, host_mem_request_bytes = ?, "
                "updated_time = ? WHERE id = ? AND state = ?",
                (gpu, host, profile.get("label"), _float_or_none(profile.get("solo_samples_per_s")), gpu, host, now,
                 job_id, JobState.PENDING.value))
            if cur.rowcount != 1:
                raise StaleState("job", job_id, JobState.PENDING.value, self.get_job(job_id).state.value)
            self.conn.execute("UPDATE job_specs SET estimate_json = ? WHERE job_id = ?",
                              (json.dumps(est, sort_keys=True, default=str), job_id))
            self.event_in_tx("estimate", reason, job_id=job_id, t=now)

    def get_job(self, job_id: int) -> Job:
        rows = self.query("job_by_id", {"id": job_id})
        if not rows:
            raise UnknownEntity("job", job_id)
        return Job.from_row(rows[0])

    def jobs(self, states: Iterable[JobState | str] | None = None, *, user: str | None = None) -> list[Job]:
        """Jobs in any of `states` (all if None), oldest first."""
        st = None if states is None else json.dumps([JobState(s).value for s in states])
        return [Job.from_row(r) for r in self.query("jobs_by_state", {"states": st, "user": user})]

    def _checked_move(
        self, kind: str, query: str, entity_id: int, states: type[StateT],
        allowed: Callable[[StateT, StateT], bool], to: str, expect: str | None,
    ) -> tuple[Any, StateT, StateT]:
        """The row and (from, to) of a legal move, or the typed refusal; inside `write()`."""
        dst = states(to)
        rows = self.query(query, {"id": entity_id})
        if not rows:
            raise UnknownEntity(kind, entity_id)
        row = rows[0]
        src = states(row["state"])
        if expect is not None and src != states(expect):
            raise StaleState(kind, entity_id, states(expect).value, src.value)
        if not allowed(src, dst):
            raise IllegalTransition(kind, entity_id, src.value, dst.value)
        return row, src, dst

    def transition_job(
        self, job_id: int, to: JobState | str, reason: str, *, expect: JobState | str | None = None,
        pack_id: int | None = None, exit_code: int | None = None, slurm_job_id: str | None = None,
        slurm_step: str | None = None, gpu_mem_request_bytes: int | None = None,
        host_mem_request_bytes: int | None = None, data: Mapping[str, Any] | None = None,
        t: float | None = None,
    ) -> Job:
        """Move a job along its lifecycle (see `states.JOB_TRANSITIONS`) and log the event.

        Side effects by edge: -> PLANNED needs `pack_id`; -> RUNNING sets the first
        start time and starts the job's placements in its pack; leaving RUNNING ends
        them; a terminal state sets end time, exit code and reason; -> PENDING from
        RUNNING or OOM counts a new attempt and clears end time and exit code.
        `expect` makes it a compare-and-set: `StaleState` if the job moved meanwhile.
        """
        with self.write():
            row, src, dst = self._checked_move("job", "job_by_id", job_id, JobState, job_transition_allowed,
                                               to, expect)
            now = self.clock() if t is None else self._not_before_last("job_id", job_id, t)
            sets: dict[str, Any] = {"state": dst.value, "updated_time": now}
            cur_pack = row["pack_id"]
            if dst == JobState.PLANNED:
                if row.get("mode") == MODE_NO_PACK:  # its own Slurm job, no pack
                    if slurm_job_id is None and row["slurm_job_id"] is None:
                        raise ValueError("a no-pack job is PLANNED with its Slurm job id")
                elif pack_id is None:
                    raise ValueError("transition to PLANNED needs pack_id")
                else:
                    sets["pack_id"] = cur_pack = pack_id
            if dst == JobState.RUNNING:
                if row["start_time"] is None:
                    sets["start_time"] = now
                self.conn.execute(
                    "UPDATE placements SET start_time = ? WHERE job_id = ? AND pack_id = ? AND start_time IS NULL",
                    (now, job_id, cur_pack),
                )
            if src == JobState.RUNNING:
                self.conn.execute(
                    "UPDATE placements SET end_time = ? WHERE job_id = ? AND pack_id = ? "
                    "AND start_time IS NOT NULL AND end_time IS NULL",
                    (now, job_id, cur_pack),
                )
            if dst in JOB_TERMINAL:
                sets.update(end_time=now, exit_reason=reason)
                if exit_code is not None:
                    sets["exit_code"] = exit_code
            if dst == JobState.PENDING:
                sets.update(end_time=None, exit_code=None, exit_reason=None)
                if src in JOB_ATTEMPT_FROM:
                    sets["attempt"] = int(row["attempt"]) + 1
            for key, value in (("slurm_job_id", slurm_job_id), ("slurm_step", slurm_step),
                               ("gpu_mem_request_bytes", gpu_mem_request_bytes),
                               ("host_mem_request_bytes", host_mem_request_bytes)):
                if value is not None:
                    sets[key] = value
            assign = ", ".join(f"{k} = ?" for k in sets)
            self.conn.execute(f"UPDATE jobs SET {assign} WHERE id = ?", (*sets.values(), job_id))
            ev = dict(data or {})
            if exit_code is not None:
                ev.setdefault("exit_code", exit_code)
            self.event_in_tx("job_state", reason, job_id=job_id, pack_id=cur_pack, src=src.value,
                        dst=dst.value, data=ev or None, t=now)
            return Job.from_row({**row, **sets})

    def _not_before_last(self, column: str, ident: int, t: float) -> float:
        """A transition dated by Slurm is not dated before the one before it: Slurm's times
        are whole seconds, cut down, so a --no-pack job's start read from Slurm came out
        before its PLANNED event of the same second, and the events ran backwards (issue
        49). The state's own event kind only; `column` is job_id or pack_id."""
        kind = "job_state" if column == "job_id" else "pack_state"
        row = self.conn.execute(f"SELECT max(t) FROM events WHERE {column} = ? AND kind = ?",  # noqa: S608
                                (ident, kind)).fetchone()
        return t if row is None or row[0] is None else max(t, float(row[0]))

    def set_job_allocation(self, job_id: int, *, nodes: str | None = None, gpu_idx: str | None = None,
                           gpu_share: float | None = None) -> None:
        """Where a no-pack job runs, as Slurm says: its hostlist, the node's GPU indexes and
        (a multi-node job) the GPUs Slurm allocated it over all its nodes, which acct charges."""
        with self.write():
            sets = {k: v for k, v in (("nodes", nodes), ("gpu_idx", gpu_idx), ("gpu_share", gpu_share))
                    if v is not None}
            if not sets:
                return
            assign = ", ".join(f"{k} = ?" for k in sets)
            cur = self.conn.execute(f"UPDATE jobs SET {assign}, updated_time = ? WHERE id = ?",
                                    (*sets.values(), self.clock(), job_id))
            if cur.rowcount != 1:
                raise UnknownEntity("job", job_id)

    def set_job_slurm_run_s(self, job_id: int, run_s: float) -> None:
        """A no-pack job's seconds running in Slurm, summed over its runs (acct charges
        this instead of start to end, which counts a requeued job's wait between runs)."""
        with self.write():
            cur = self.conn.execute("UPDATE jobs SET slurm_run_s = ? WHERE id = ?", (max(0.0, float(run_s)), job_id))
            if cur.rowcount != 1:
                raise UnknownEntity("job", job_id)

    # ------------------------------------------------------------ packs

    def add_pack(
        self, *, name: str, user: str, policy: str, n_gpus: int, n_nodes: int = 1,
        partition: str | None = None, gpu_model: str | None = None, pack_dir: str | None = None,
        placements: Sequence[NewPlacement] = (), reason: str = "planned", t: float | None = None,
        data: Mapping[str, Any] | None = None,
    ) -> int:
        """A SUBMITTING pack with its placements; its member jobs move PENDING -> PLANNED.

        `data` goes with the pack's first event (the service keeps the plan's refill
        headroom there: `pack_plan_data`), in the same transaction.

        All in one transaction: either the pack and all members are planned or nothing.
        Write this row *before* calling sbatch with `--job-name=name`, so a service
        that crashes in between finds the pack by name (`find_pack_by_name`).
        """
        now = self.clock() if t is None else t
        with self.write():
            try:
                cur = self.conn.execute(
                    "INSERT INTO packs (name, user, state, policy, partition, gpu_model, n_nodes, n_gpus, "
                    "pack_dir, create_time, reason, updated_time) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (name, user, PackState.SUBMITTING.value, policy, partition, gpu_model, n_nodes, n_gpus,
                     pack_dir, now, reason, now),
                )
            except sqlite3.IntegrityError as exc:
                raise StoreError(f"pack name {name!r} already exists") from exc
            pack_id = int(cur.lastrowid or 0)
            self.event_in_tx("pack_state", reason, pack_id=pack_id, dst=PackState.SUBMITTING.value,
                             data=dict(data) if data else None, t=now)
            seen: set[int] = set()
            for p in placements:
                if p.job_id not in seen:
                    seen.add(p.job_id)
                    self.transition_job(p.job_id, JobState.PLANNED, f"planned into pack {name}",
                                        pack_id=pack_id, t=now)
                attempt = self.conn.execute("SELECT attempt FROM jobs WHERE id = ?", (p.job_id,)).fetchone()[0]
                self.conn.execute(
                    "INSERT INTO placements (pack_id, job_id, attempt, node_index, node, gpu_index, "
                    "mps_thread_pct, gpu_mem_limit_bytes, host_mem_limit_bytes, cpus, predicted_speed, rank, "
                    "world_size) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (pack_id, p.job_id, attempt, p.node_index, p.node, p.gpu_index, p.mps_thread_pct,
                     p.gpu_mem_limit_bytes, p.host_mem_limit_bytes, p.cpus, p.predicted_speed, p.rank,
                     p.world_size),
                )
        return pack_id

    def pack_plan_data(self, pack_id: int) -> dict[str, Any]:
        """The `data` given to `add_pack` (empty if none)."""
        row = self.conn.execute(
            "SELECT data_json FROM events WHERE pack_id = ? AND kind = 'pack_state' AND from_state IS NULL "
            "AND to_state = ? ORDER BY id LIMIT 1", (pack_id, PackState.SUBMITTING.value)).fetchone()
        return dict(json.loads(row[0])) if row and row[0] else {}

    def add_join(self, pack_id: int, placement: NewPlacement | Sequence[NewPlacement], *, reason: str = "",
                 t: float | None = None) -> Job:
        """A PENDING job joins a GPU of a RUNNING pack (docs/interfaces.md section 3b), or
        for a multi-GPU job (a sequence: one placement per rank) W GPUs of one node of it.

        One transaction, all or none: the job moves PENDING -> PLANNED in that pack, its
        placement row(s) are written (node name from the pack's allocation) and the event
        reads "joined pack N: ...". Refused (`StaleState`) unless the pack is RUNNING and
        the job PENDING, so a join is recorded at most once and never into an ended pack;
        `StoreError` if the job was placed on one of those GPUs of the pack before (the
        service never offers a job a pack it left), or if a gang's placements are not its
        W ranks (one job, one node, distinct GPUs, ranks 0..W-1).
        The service writes the join file only after this returns.
        """
        ranks = [placement] if isinstance(placement, NewPlacement) else sorted(placement, key=lambda p: p.rank or 0)
        _check_gang_join(ranks)
        first = ranks[0]
        now = self.clock() if t is None else t
        with self.write():
            rows = self.query("pack_by_id", {"id": pack_id})
            if not rows:
                raise UnknownEntity("pack", pack_id)
            pack = Pack.from_row(rows[0])
            if pack.state != PackState.RUNNING:
                raise StaleState("pack", pack_id, PackState.RUNNING.value, pack.state.value)
            gpus = ",".join(str(p.gpu_index) for p in ranks)
            where = f"node {first.node_index} GPU{'s' if len(ranks) > 1 else ''} {gpus}"
            why = f"joined pack {pack_id}: {where} of {pack.name}" + (f", {reason}" if reason else "")
            job = self.transition_job(first.job_id, JobState.PLANNED, why, expect=JobState.PENDING,
                                      pack_id=pack_id, slurm_job_id=pack.slurm_job_id, data={"join": True}, t=now)
            hosts = expand_hostlist(pack.nodes) if pack.nodes else []
            for p in ranks:
                node = p.node or (hosts[p.node_index] if p.node_index < len(hosts) else None)
                if self.conn.execute("SELECT 1 FROM placements WHERE pack_id = ? AND job_id = ? AND node_index = ? "
                                     "AND gpu_index = ?", (pack_id, job.id, p.node_index, p.gpu_index)).fetchone():
                    # raised inside the transaction: the state change and earlier rows roll back
                    raise StoreError(f"job {job.id} already had GPU {p.gpu_index} of node "
                                     f"{p.node_index} in pack {pack_id}")
                self.conn.execute(
                    "INSERT INTO placements (pack_id, job_id, attempt, node_index, node, gpu_index, "
                    "mps_thread_pct, gpu_mem_limit_bytes, host_mem_limit_bytes, cpus, predicted_speed, rank, "
                    "world_size) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (pack_id, job.id, job.attempt, p.node_index, node, p.gpu_index,
                     p.mps_thread_pct, p.gpu_mem_limit_bytes, p.host_mem_limit_bytes,
                     p.cpus, p.predicted_speed, p.rank, p.world_size),
                )
            return job

    def get_pack(self, pack_id: int) -> Pack:
        rows = self.query("pack_by_id", {"id": pack_id})
        if not rows:
            raise UnknownEntity("pack", pack_id)
        return Pack.from_row(rows[0])

    def find_pack_by_name(self, name: str) -> Pack | None:
        """The pack submitted as `sbatch --job-name=name` (for crash reconciliation)."""
        rows = self.query("pack_by_name", {"name": name})
        return Pack.from_row(rows[0]) if rows else None

    def packs(self, states: Iterable[PackState | str] | None = None, *, user: str | None = None) -> list[Pack]:
        st = None if states is None else json.dumps([PackState(s).value for s in states])
        return [Pack.from_row(r) for r in self.query("packs_by_state", {"states": st, "user": user})]

    def placements(self, *, pack_id: int | None = None, job_id: int | None = None) -> list[Placement]:
        rows = self.query("placements", {"pack_id": pack_id, "job_id": job_id})
        return [Placement.from_row(r) for r in rows]

    def transition_pack(
        self, pack_id: int, to: PackState | str, reason: str, *, expect: PackState | str | None = None,
        slurm_job_id: str | None = None, nodes: str | None = None, start_time: float | None = None,
        data: Mapping[str, Any] | None = None, t: float | None = None,
    ) -> Pack:
        """Move a pack along its lifecycle (see `states.PACK_TRANSITIONS`) and log the event.

        -> QUEUED sets the submit time; -> RUNNING the start time (`start_time` if Slurm
        reported an earlier one); a terminal state the end time. `slurm_job_id` and
        `nodes` (a Slurm hostlist; fills each placement's node name) are recorded when
        given. Member jobs are not moved: the caller decides what happens to them.
        """
        with self.write():
            row, src, dst = self._checked_move("pack", "pack_by_id", pack_id, PackState, pack_transition_allowed,
                                               to, expect)
            now = self.clock() if t is None else self._not_before_last("pack_id", pack_id, t)
            sets: dict[str, Any] = {"state": dst.value, "reason": reason, "updated_time": now}
            if dst in (PackState.QUEUED, PackState.RUNNING) and row["submit_time"] is None:
                sets["submit_time"] = now
            if dst in (PackState.RUNNING, PackState.COMPLETED) and row["start_time"] is None:
                sets["start_time"] = now if start_time is None else start_time
            if dst in PACK_TERMINAL:
                sets["end_time"] = now
            if slurm_job_id is not None:
                sets["slurm_job_id"] = slurm_job_id
            assign = ", ".join(f"{k} = ?" for k in sets)
            self.conn.execute(f"UPDATE packs SET {assign} WHERE id = ?", (*sets.values(), pack_id))
            if nodes is not None:
                self._set_nodes(pack_id, nodes)
            self.event_in_tx("pack_state", reason, pack_id=pack_id, src=src.value, dst=dst.value,
                        data={**(data or {}), **({"slurm_job_id": slurm_job_id} if slurm_job_id else {})} or None,
                        t=now)
            return Pack.from_row({**row, **sets, **({"nodes": nodes} if nodes is not None else {})})

    def set_pack_slurm_job(self, pack_id: int, *, slurm_job_id: str | None = None, nodes: str | None = None) -> None:
        """Record the Slurm job id and/or allocated nodes as soon as they are known."""
        with self.write():
            if not self.conn.execute("SELECT 1 FROM packs WHERE id = ?", (pack_id,)).fetchone():
                raise UnknownEntity("pack", pack_id)
            if slurm_job_id is not None:
                self.conn.execute("UPDATE packs SET slurm_job_id = ?, updated_time = ? WHERE id = ?",
                                  (slurm_job_id, self.clock(), pack_id))
                self.event_in_tx("note", f"slurm job id {slurm_job_id}", pack_id=pack_id)
            if nodes is not None:
                self._set_nodes(pack_id, nodes)

    def _set_nodes(self, pack_id: int, nodes: str) -> None:
        self.conn.execute("UPDATE packs SET nodes = ? WHERE id = ?", (nodes, pack_id))
        hosts = expand_hostlist(nodes)
        for i, host in enumerate(hosts):
            self.conn.execute("UPDATE placements SET node = ? WHERE pack_id = ? AND node_index = ?",
                              (host, pack_id, i))

    # ------------------------------------------------------------ samples

    def add_samples(self, samples: Iterable[Mapping[str, Any]], *, batch_size: int = 10_000) -> int:
        """Insert samples (dicts shaped like contract 4's "sample" records) in batches.

        Each batch is one transaction, so a crash loses at most the batch in flight.
        Samples naming an unknown job or pack are dropped (logged once per id).
        Returns how many were stored.
        """
        stored = 0
        batch: list[Mapping[str, Any]] = []
        for s in samples:
            batch.append(s)
            if len(batch) >= batch_size:
                with self.write():
                    stored += self.insert_samples_in_tx(batch)
                batch = []
        if batch:
            with self.write():
                stored += self.insert_samples_in_tx(batch)
        return stored

    def _known(self, table: str, ids: set[int], cache: set[int]) -> set[int]:
        missing = ids - cache
        if missing:
            rows = self.conn.execute(
                f"SELECT id FROM {table} WHERE id IN (SELECT value FROM json_each(?))",
                (json.dumps(sorted(missing)),),
            ).fetchall()
            cache.update(r[0] for r in rows)
        return ids & cache

    def insert_samples_in_tx(self, samples: Sequence[Mapping[str, Any]]) -> int:
        """Insert samples and update `job_usage`; the caller holds `write()`."""
        assert self._depth, "insert_samples_in_tx() needs an open write()"
        rows: list[tuple[Any, ...]] = []
        for s in samples:
            # Coerce here: SQLite would store a stray string in a REAL column as TEXT.
            # Inlined (no helper calls): this loop is most of the ingest cost.
            g = s.get
            try:
                rows.append((
                    float(s["t"]), int(s["pack_id"]),
                    None if (v := g("job_id")) is None else int(v), str(s["node"]),
                    None if (v := g("gpu_index")) is None else int(v),
                    None if (v := g("sm_util_pct")) is None else float(v),
                    None if (v := g("mem_util_pct")) is None else float(v),
                    None if (v := g("gpu_mem_bytes")) is None else int(v),
                    None if (v := g("host_cpu_pct")) is None else float(v),
                    None if (v := g("rss_bytes")) is None else int(v),
                    None if (v := g("samples_per_s")) is None else float(v),
                ))
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("dropping malformed sample %r: %s", s, exc)
        if not rows:
            return 0
        packs = self._known("packs", {r[1] for r in rows}, self._known_packs)
        jobs = self._known("jobs", {r[2] for r in rows if r[2] is not None}, self._known_jobs)
        good = [r for r in rows if r[1] in packs and (r[2] is None or r[2] in jobs)]
        if len(good) != len(rows):
            for r in rows:
                for kind, key, ok in (("pack", r[1], r[1] in packs), ("job", r[2], r[2] is None or r[2] in jobs)):
                    if not ok and (kind, key) not in self._warned_unknown:
                        self._warned_unknown.add((kind, key))
                        log.warning("dropping samples of unknown %s %s", kind, key)
        self.conn.executemany(_INSERT_SAMPLE, good)
        self.conn.executemany(queries.UPSERT_JOB_USAGE, _usage_rows(good))
        return len(good)

    def prune_samples(self, before: float, *, batch: int = 50_000) -> int:
        """Delete samples older than `before` (epoch s), in short transactions.

        The per-job aggregates (`job_usage`, so `acct` and the calibration query) keep
        what they learnt; only timelines before `before` are lost. Returns how many
        samples were deleted.
        """
        deleted = 0
        while True:
            with self.write():
                rows = self.conn.execute(
                    "SELECT rowid, job_id FROM samples WHERE t < ? LIMIT ?", (before, batch)
                ).fetchall()
                if not rows:
                    break
                per_job: dict[int, int] = {}
                for _, job in rows:
                    if job is not None:
                        per_job[job] = per_job.get(job, 0) + 1
                self.conn.executemany("UPDATE job_usage SET n_pruned = n_pruned + ? WHERE job_id = ?",
                                      [(n, job) for job, n in per_job.items()])
                self.conn.execute("DELETE FROM samples WHERE rowid IN (SELECT value FROM json_each(?))",
                                  (json.dumps([r[0] for r in rows]),))
                deleted += len(rows)
        if deleted:
            self.add_event("store", f"pruned {deleted} samples older than {before:.0f}",
                           data={"before": before, "deleted": deleted})
        return deleted

    def calibration(self, spec_fingerprint: str, *, limit: int = 100) -> list[CalibrationRow]:
        """Finished jobs with this fingerprint: estimated vs measured GPU and host peaks, newest first."""
        rows = self.query("calibration", {"fingerprint": spec_fingerprint, "limit": limit,
                                          "terminal": json.dumps(sorted(s.value for s in JOB_TERMINAL))})
        return [CalibrationRow(**{**r, "state": JobState(r["state"])}) for r in rows]

    def site_host_runs(self, device_kind: str, *, limit: int = 20) -> list[SiteHostRun]:
        """The most recent COMPLETED jobs of any fingerprint whose estimate took the
        `device_kind` ("cpu" | "cuda") runtime term and whose peak RSS was measured:
        the site-wide host calibration's input, newest first."""
        rows = self.query("site_host_runs", {"completed": JobState.COMPLETED.value, "device_kind": device_kind,
                                             "limit": limit})
        return [SiteHostRun(job_id=int(r["job_id"]), end_time=r["end_time"], estimate=json.loads(r["estimate_json"]),
                            meas_host_peak_bytes=int(r["meas_host_peak_bytes"]), pack_dir=r["pack_dir"]) for r in rows]

    def usage(self, job_id: int) -> JobUsage | None:
        """Measured peaks and means of a job (None before its first sample)."""
        rows = self.query("job_usage", {"job_id": job_id})
        return JobUsage(**rows[0]) if rows else None

    def check(self) -> list[str]:
        """Consistency problems (empty if none): integrity, foreign keys, job_usage vs samples."""
        problems: list[str] = []
        res = self.conn.execute("PRAGMA integrity_check").fetchall()
        if res != [("ok",)]:
            problems += [f"integrity: {r[0]}" for r in res]
        for r in self.conn.execute("PRAGMA foreign_key_check").fetchall():
            problems.append(f"foreign key: table {r[0]} rowid {r[1]} -> {r[2]}")
        for r in self.query("usage_mismatch"):
            problems.append(f"job_usage of job {r['job_id']}: {r['n_usage']} samples counted, {r['n_samples']} stored")
        return problems


def _int_or_none(v: Any) -> int | None:
    return None if v is None else int(v)


def _float_or_none(v: Any) -> float | None:
    return None if v is None else float(v)


def _max(a: Any, b: Any) -> Any:
    if a is None:
        return b
    if b is None:
        return a
    return a if a >= b else b


def _usage_rows(rows: Sequence[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Per-job aggregates of one batch, for `UPSERT_JOB_USAGE`."""
    acc: dict[int, list[Any]] = {}
    for (t, _pack, job, _node, _gpu, sm, _mu, gmem, cpu, rss, sps) in rows:
        if job is None:
            continue
        a = acc.get(job)
        if a is None:
            # n, gmem_peak, rss_peak, sm_sum, sm_n, sm_max, cpu_sum, cpu_n, sps_sum, sps_n, first_t, last_t
            a = acc[job] = [0, None, None, 0.0, 0, None, 0.0, 0, 0.0, 0, t, t]
        a[0] += 1
        a[1] = _max(a[1], gmem)
        a[2] = _max(a[2], rss)
        if sm is not None:
            a[3] += sm
            a[4] += 1
            a[5] = _max(a[5], sm)
        if cpu is not None:
            a[6] += cpu
            a[7] += 1
        if sps is not None:
            a[8] += sps
            a[9] += 1
        if t < a[10]:
            a[10] = t
        if t > a[11]:
            a[11] = t
    return [(job, *a) for job, a in acc.items()]


__all__ = [
    "CalibrationRow", "Job", "SiteHostRun", "JobUsage", "NewPlacement", "Pack", "Placement", "Store", "StoreBusy",
    "current_user", "is_busy", "store_path_for",
]


def _check_gang_join(ranks: list[NewPlacement]) -> None:
    """A join's placements: one, or the W ranks of one job on W distinct GPUs of one node."""
    if not ranks:
        raise StoreError("a join needs at least one placement")
    first = ranks[0]
    if len(ranks) == 1 and (first.world_size or 1) <= 1:
        return
    world = first.world_size or 1
    if any(p.job_id != first.job_id for p in ranks):
        raise StoreError("a join holds the ranks of one job")
    if any(p.node_index != first.node_index for p in ranks):
        raise StoreError(f"job {first.job_id}: a gang joins one node")
    if len({p.gpu_index for p in ranks}) != len(ranks):
        raise StoreError(f"job {first.job_id}: two ranks on one GPU")
    if [p.rank for p in ranks] != list(range(world)) or any((p.world_size or 1) != world for p in ranks):
        raise StoreError(f"job {first.job_id}: a gang joins with all its {world} ranks (got ranks "
                         f"{[p.rank for p in ranks]})")
