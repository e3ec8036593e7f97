"""`slurm-dlrm exporter`: Prometheus metrics read from the stores at scrape time.

A custom `prometheus_client` collector: every scrape opens each store read-only
(`Store(path, readonly=True)`, SQLite `mode=ro`: a scrape never writes), reads it with
`slurm_dlrm.store.metrics.read_store`, and yields metric families; prometheus_client
writes the exposition format. One module over 600 lines: the collector and the
HTTP(S) server that bounds each connection (issue 41) share the scrape state; the server
part is the first to move out when it grows. Metric names, units and labels: docs/admin.md
("Prometheus and Grafana").

A store that cannot be read (corrupt, locked, being migrated, owned by someone else,
unreadable, a schema that is not ours, a read past its time budget) is skipped:
`slurm_dlrm_store_errors_total{reason}` counts it and one log line says why (again only
after it was readable in between), never a failed scrape. With --all-users every store
is someone else's file: its series are labelled with its file's owner, never with the
user its rows or its service status name (store/others.py), its schema is checked and
each read is bounded in time; a service status file that is not what the service
writes is skipped and counted as reason="status".

Counters are derived from the stores (totals, not increments the exporter saw), so a
figure that moves backwards (a pack's end time corrected by sacct, a solo run changing
acct's measured slowdown basis) would look like a counter reset to Prometheus. The
collector therefore never reports less than it reported before for the same series.
"""

from __future__ import annotations

import bisect
import logging
import os
import pwd
import socket
import sqlite3
import ssl
import stat
import threading
import time
import zlib
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import CollectorRegistry

from slurm_dlrm.site import SiteConfig
from slurm_dlrm.store.acct import discover_user_stores
from slurm_dlrm.store.errors import (
    SchemaTooNew,
    StoreBusy,
    StoreError,
    StoreNotOwned,
    StoreTimeout,
    StoreUntrusted,
)
from slurm_dlrm.store.metrics import StoreCursor, StoreMetrics, read_store
from slurm_dlrm.store.migrations import LATEST_VERSION
from slurm_dlrm.store.others import UNTRUSTED_READ_BUDGET_S, store_user
from slurm_dlrm.store.service_status import SERVICE_STATUS_FILE, BadStatus, read_service_status
from slurm_dlrm.store.states import JobState, PackState
from slurm_dlrm.store.store import Store, current_user, store_path_for

log = logging.getLogger(__name__)

DEFAULT_PORT = 9867
# Loopback only unless the site says otherwise: /metrics names users and their GPU use,
# and prometheus_client serves it to anyone who connects (docs/admin.md, "Exporter security").
DEFAULT_ADDRESS = "127.0.0.1"
# measured / estimated peak GPU memory: < 1 over-estimated, > 1 under-estimated
EST_ERROR_BUCKETS = (0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)
WAIT_BUCKETS_S = (10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, 21600.0, 86400.0)
STORE_ERROR_REASONS = ("permission", "owner", "corrupt", "locked", "schema", "missing", "untrusted",
                       "timeout", "status", "other")
# One store's reads per scrape stop after this (a crafted or huge store cannot hold the
# scrape, and the collector's lock, for long).
READ_BUDGET_S = UNTRUSTED_READ_BUDGET_S

# Connections kept open between scrapes (file descriptors: 3 each with -wal and -shm),
# and the page cache each may hold.
MAX_OPEN = 256
DISCOVER_EVERY_S = 60.0  # a new user's store is scraped within this
CACHE_KIB_PER_STORE = 512

USER_LABELS = ("user", "partition", "gpu_model")
GPU_LABELS = ("user", "partition", "gpu_model", "node", "gpu", "slurm_job_id")


@dataclass(frozen=True)
class StoreRef:
    user: str  # from the folder's name (discovery); the label comes from the file's owner
    path: Path


class StoreCollector:
    """Reads the stores on every `collect()` (one scrape at a time)."""

    def __init__(self, site: SiteConfig, *, all_users: bool = False, user: str | None = None,
                 slow_every_s: float = 60.0, sample_window_s: float | None = None,
                 busy_timeout_s: float = 0.25, read_budget_s: float = READ_BUDGET_S,
                 clock: Any = time.time, monotonic: Any = time.monotonic, host: str | None = None) -> None:
        self.site = site
        self.all_users = all_users
        self.user = user or current_user()
        self.slow_every_s = slow_every_s
        # A GPU's utilisation is shown while its latest sample is this recent: a few
        # agent intervals, and at least a minute (clock skew between hosts, slow ingest).
        self.sample_window_s = (sample_window_s if sample_window_s is not None
                                else max(60.0, 5 * site.agent.sample_interval_s))
        self.busy_timeout_s = busy_timeout_s
        self.read_budget_s = read_budget_s
        self.host = host or socket.gethostname()
        self.clock = clock
        self.monotonic = monotonic
        self.cursors: dict[str, StoreCursor] = {}
        self.store_errors: dict[str, int] = {r: 0 for r in STORE_ERROR_REASONS}
        self._failing: dict[str, str] = {}  # path -> reason, to log once per failure spell
        self._floor: dict[tuple[str, tuple[str, ...]], float] = {}
        self._open: dict[str, tuple[Store, tuple[int, int]]] = {}
        self._uids: dict[str, tuple[int | None, float]] = {}
        self._names: dict[int, tuple[str, float]] = {}
        self._labels: dict[str, tuple[str, int]] = {}  # path -> (user label, owner uid), per scrape
        self._found: tuple[list[StoreRef], float] | None = None
        self._lock = threading.Lock()
        self.last_stores_read = 0
        self.last_scrape_s = 0.0

    # ------------------------------------------------------------ which stores

    def stores(self) -> list[StoreRef]:
        if not self.all_users:
            return [StoreRef(self.user, store_path_for(self.site, self.user))]
        # Found again at most every DISCOVER_EVERY_S: with a store_dir under `~`, finding
        # them walks every account (getpwall), which on a large site is not per-scrape work.
        now = self.monotonic()
        if self._found is None or now - self._found[1] >= DISCOVER_EVERY_S:
            self._found = ([StoreRef(u, p) for u, p in discover_user_stores(self.site)], now)
        return self._found[0]

    def describe(self) -> Iterable[Metric]:
        return []  # no collect() at registration: it would read every store

    # ------------------------------------------------------------ one scrape

    def warm(self) -> float:
        """One scrape's reading, its metrics dropped: run before the port opens, so the
        first scrape Prometheus makes finds every store's history already summed (it is
        the slow one: GPU-seconds and histograms over all events). Seconds taken."""
        t0 = time.perf_counter()
        for _ in self.collect():
            pass
        return time.perf_counter() - t0

    def collect(self) -> Iterator[Metric]:
        # whole, under the lock: two scrapes at once would share the cursors and connections
        with self._lock:
            families = list(self._collect())
        return iter(families)

    def _collect(self) -> Iterator[Metric]:
        t0 = time.perf_counter()
        now = self.clock()
        default_partition = self.site.default_partition.name if self.site.partitions else ""
        read: list[tuple[StoreRef, StoreMetrics, StoreCursor]] = []
        seen: set[str] = set()
        self._labels = {}
        for ref in self.stores():
            key = str(ref.path)
            seen.add(key)
            m = self._read_one(ref, now, default_partition)
            if m is not None:
                read.append((ref, m, self.cursors[key]))
        for gone in set(self.cursors) - seen:
            del self.cursors[gone]  # its user left: its series go stale
        for gone in set(self._open) - seen:
            self._drop(gone, self._open[gone][0])
        self.last_stores_read = len(read)

        yield from self._gauges(read)
        yield from self._counters(read)
        yield from self._histograms(read)
        yield from self._services(read, now)
        # host: which exporter (one per login node) saw these, whatever Prometheus relabels
        errors = CounterMetricFamily("slurm_dlrm_store_errors", "Stores skipped by a scrape, by reason.",
                                     labels=("reason", "host"))
        for reason, n in self.store_errors.items():
            errors.add_metric((reason, self.host), n)
        yield errors
        self.last_scrape_s = time.perf_counter() - t0
        info = GaugeMetricFamily("slurm_dlrm_exporter_info", "1, labelled with the host the exporter runs on.",
                                 labels=("host",))
        info.add_metric((self.host,), 1)
        yield info
        stores = GaugeMetricFamily("slurm_dlrm_exporter_stores", "Stores read by this scrape.", labels=("host",))
        stores.add_metric((self.host,), len(read))
        yield stores
        dur = GaugeMetricFamily("slurm_dlrm_exporter_scrape_duration_seconds",
                                "Time this scrape took to read the stores.", labels=("host",))
        dur.add_metric((self.host,), self.last_scrape_s)
        yield dur

    def _read_one(self, ref: StoreRef, now: float, default_partition: str) -> StoreMetrics | None:
        key = str(ref.path)
        reason, detail, ident = self._refuse(ref)
        if reason is None:
            try:
                label = self._labels[key][0]
                st = self._store(key, ref.path, ident)
                st.owner_user = label if self.all_users and label != "*" else None
                try:
                    cursor = self.cursors.setdefault(key, StoreCursor())
                    m = read_store(st, cursor, user=label, default_partition=default_partition,
                                   now=now, sample_window_s=self.sample_window_s,
                                   slow_every_s=self.slow_every_s,
                                   stagger_s=self.slow_every_s * (zlib.crc32(key.encode()) % 1000) / 1000,
                                   monotonic=self.monotonic())
                except BaseException:
                    self._drop(key, st)
                    raise
                if key not in self._open:
                    st.close()
            except (StoreError, sqlite3.Error, OSError) as exc:
                reason, detail = _classify(exc), str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            else:
                if key in self._failing:
                    log.info("store %s (%s) readable again", ref.path, ref.user)
                    del self._failing[key]
                return m
        assert reason is not None
        self.store_errors[reason] += 1
        if self._failing.get(key) != reason:
            log.warning("store %s (%s) skipped: %s: %s", ref.path, ref.user, reason, detail)
            self._failing[key] = reason
        return None

    def _store(self, key: str, path: Path, ident: tuple[int, int]) -> Store:
        """The store's read-only connection, kept open between scrapes (up to MAX_OPEN).

        A fresh connection parses the schema and starts with a cold page cache: with 50
        stores that was most of a scrape's cost. Reopened when the file was replaced
        (another inode) or migrated (another schema version, checked again on open).
        """
        held = self._open.get(key)
        if held is not None:
            st, held_ident = held
            if held_ident == ident and st.schema_version == LATEST_VERSION:
                return st
            self._drop(key, st)
        # all users: someone else's file (schema checked on open and whenever it changes)
        st = Store(path, readonly=True, busy_timeout_s=self.busy_timeout_s, retry_s=self.busy_timeout_s,
                   read_budget_s=self.read_budget_s, untrusted=self.all_users)
        st.conn.execute(f"PRAGMA cache_size = -{CACHE_KIB_PER_STORE}")
        if len(self._open) < MAX_OPEN:
            self._open[key] = (st, ident)
        return st

    def _drop(self, key: str, st: Store) -> None:
        self._open.pop(key, None)
        try:
            st.close()
        except sqlite3.Error:
            pass

    def close(self) -> None:
        for key, (st, _) in list(self._open.items()):
            self._drop(key, st)

    def _uid(self, user: str) -> int | None:
        """The account's uid (None: no such account, e.g. a folder named by hand), looked
        up at most every 5 minutes (a miss reads the whole passwd database)."""
        now = self.monotonic()
        hit = self._uids.get(user)
        if hit is None or now - hit[1] > 300:
            try:
                hit = (pwd.getpwnam(user).pw_uid, now)
            except KeyError:
                hit = (None, now)
            self._uids[user] = hit
        return hit[0]

    def _name(self, uid: int) -> str:
        now = self.monotonic()
        hit = self._names.get(uid)
        if hit is None or now - hit[1] > 300:
            try:
                hit = (pwd.getpwuid(uid).pw_name, now)
            except KeyError:
                hit = (f"uid:{uid}", now)
            self._names[uid] = hit
        return hit[0]

    def _refuse(self, ref: StoreRef) -> tuple[str | None, str, tuple[int, int]]:
        """Checks before opening: the file exists, we may read it, and whose it is (the
        label of its series: its owner, store/others.py's `store_user`)."""
        try:
            st = os.stat(ref.path)
        except FileNotFoundError:
            return "missing", "no store file", (0, 0)
        except OSError as exc:
            return "permission", str(exc), (0, 0)
        ident = (st.st_dev, st.st_ino)
        if not os.access(ref.path, os.R_OK):
            return "permission", "not readable by the exporter", ident
        if not stat.S_ISREG(st.st_mode):
            return "corrupt", "not a regular file", ident
        label = ref.user
        if self.all_users:
            try:
                label = store_user(ref.user, st.st_uid, uid_of=self._uid, name_of=self._name)
            except StoreNotOwned as exc:
                # someone else's file in a user's store folder: not that user's figures
                return "owner", str(exc), ident
        self._labels[str(ref.path)] = (label, st.st_uid)
        return None, "", ident

    # ------------------------------------------------------------ families

    def _gauges(self, read: Sequence[tuple[StoreRef, StoreMetrics, StoreCursor]]) -> Iterator[Metric]:
        jobs = GaugeMetricFamily("slurm_dlrm_jobs", "Jobs in the stores, by state.", labels=(*USER_LABELS, "state"))
        packs = GaugeMetricFamily("slurm_dlrm_packs", "Packs (Slurm jobs of packed members), by state.",
                                  labels=(*USER_LABELS, "state"))
        job_n: dict[tuple[str, ...], int] = defaultdict(int)
        pack_n: dict[tuple[str, ...], int] = defaultdict(int)
        for _, m, _ in read:
            for k, n in m.jobs.items():
                job_n[k] += n
            for k, n in m.packs.items():
                pack_n[k] += n
        # every state of every label set seen, so a state that empties reads 0, not absent
        for fam, counts, states in ((jobs, job_n, [s.value for s in JobState]),
                                    (packs, pack_n, [s.value for s in PackState])):
            for base in sorted({k[:3] for k in counts}):
                for s in states:
                    fam.add_metric((*base, s), counts.get((*base, s), 0))
        yield jobs
        yield packs

        members = GaugeMetricFamily("slurm_dlrm_gpu_members", "Members running on each GPU of a running pack.",
                                    labels=GPU_LABELS)
        fenced = GaugeMetricFamily("slurm_dlrm_gpu_memory_fenced_bytes",
                                   "Sum of the running members' GPU memory limits (MPS pinned limit).",
                                   labels=GPU_LABELS)
        used = GaugeMetricFamily("slurm_dlrm_gpu_memory_used_bytes",
                                 "GPU memory in use (NVML), latest sample.", labels=GPU_LABELS)
        total = GaugeMetricFamily("slurm_dlrm_gpu_memory_total_bytes",
                                  "GPU memory of the GPU model (site config).", labels=GPU_LABELS)
        # the latest GPU sample, while it is recent (sample_window_s); none: no series
        sm = GaugeMetricFamily("slurm_dlrm_gpu_sm_utilization_ratio",
                               "SM utilisation (0-1), latest sample.", labels=GPU_LABELS)
        bw = GaugeMetricFamily("slurm_dlrm_gpu_memory_bandwidth_utilization_ratio",
                               "Memory-controller (bandwidth) utilisation (0-1), latest sample.", labels=GPU_LABELS)
        seen: set[tuple[str, ...]] = set()
        for _, m, _ in read:
            for g in m.gpus:
                labels = (g.user, g.partition, g.gpu_model, g.node, str(g.gpu), g.slurm_job_id)
                if labels in seen:
                    continue  # one series per GPU, whatever a store holds twice
                seen.add(labels)
                members.add_metric(labels, g.members)
                if g.fenced_bytes is not None:
                    fenced.add_metric(labels, g.fenced_bytes)
                model = self.site.gpu_models.get(g.gpu_model)
                if model is not None:
                    total.add_metric(labels, model.memory_bytes)
                if g.sample_t is None:
                    continue
                if g.used_bytes is not None:
                    used.add_metric(labels, g.used_bytes)
                if g.sm_util_pct is not None:
                    sm.add_metric(labels, g.sm_util_pct / 100.0)
                if g.mem_util_pct is not None:
                    bw.add_metric(labels, g.mem_util_pct / 100.0)
        yield from (members, fenced, used, total, sm, bw)

        # issue 39: the last held-out evaluation of each running job
        ev = GaugeMetricFamily("slurm_dlrm_job_eval", "Last held-out evaluation of a running job, by metric "
                               "(auc, ne, log_loss, calibration, accuracy).",
                               labels=(*USER_LABELS, "job_id", "metric"))
        ev_step = GaugeMetricFamily("slurm_dlrm_job_eval_step", "Training step of that evaluation.",
                                    labels=(*USER_LABELS, "job_id"))
        for _, m, _ in read:
            for e in m.evals:
                base = (e.user, e.partition, e.gpu_model, str(e.job_id))
                ev_step.add_metric(base, e.step)
                for name, value in sorted(e.values.items()):
                    ev.add_metric((*base, name), value)
        yield from (ev, ev_step)

    def _counter(self, name: str, labels: tuple[str, ...], value: float) -> float:
        """Never less than reported before for the same series (see the module doc)."""
        k = (name, labels)
        v = max(value, self._floor.get(k, 0.0))
        self._floor[k] = v
        return v

    def _counters(self, read: Sequence[tuple[StoreRef, StoreMetrics, StoreCursor]]) -> Iterator[Metric]:
        charged = CounterMetricFamily(
            "slurm_dlrm_gpu_charged_seconds",
            "GPU-seconds charged to jobs (acct's GPUHours x 3600: a shared GPU's allocated time split by run time).",
            labels=USER_LABELS)
        exclusive = CounterMetricFamily(
            "slurm_dlrm_gpu_exclusive_seconds",
            "GPU-seconds the same work would take at one job per GPU (acct's ExclGPUHours x 3600).",
            labels=USER_LABELS)
        ooms = CounterMetricFamily("slurm_dlrm_ooms", "Members that ended out of GPU or host memory.",
                                   labels=USER_LABELS)
        requeues = CounterMetricFamily("slurm_dlrm_requeues",
                                       "Jobs put back to PENDING after running or an OOM (an attempt more).",
                                       labels=USER_LABELS)
        recoveries = CounterMetricFamily(
            "slurm_dlrm_recoveries",
            "Requeues that recovered from a fault: kind=oom (retried with more memory), pack (node failure, lost or failed pack).",
            labels=(*USER_LABELS, "kind"))
        repacks = CounterMetricFamily("slurm_dlrm_repacks",
                                      "Members moved to another placement (straggler or run-time re-pack).",
                                      labels=USER_LABELS)
        gpu_s: dict[tuple[str, ...], list[float]] = defaultdict(lambda: [0.0, 0.0])
        ev: dict[tuple[str, ...], list[float]] = defaultdict(lambda: [0.0] * 5)
        for _, _, c in read:
            for gk, (ch, ex) in c.gpu_seconds.items():
                gpu_s[gk][0] += ch
                gpu_s[gk][1] += ex
            for ek, e in c.events.items():
                acc = ev[ek]
                for i, v in enumerate((e.ooms, e.requeues, e.recovered_oom, e.recovered_pack, e.repacks)):
                    acc[i] += v
        for lk in sorted(gpu_s):
            charged.add_metric(lk, self._counter("charged", lk, gpu_s[lk][0]))
            exclusive.add_metric(lk, self._counter("exclusive", lk, gpu_s[lk][1]))
        for k in sorted(ev):
            o, r, ro, rp, mv = ev[k]
            ooms.add_metric(k, self._counter("ooms", k, o))
            requeues.add_metric(k, self._counter("requeues", k, r))
            recoveries.add_metric((*k, "oom"), self._counter("rec", (*k, "oom"), ro))
            recoveries.add_metric((*k, "pack"), self._counter("rec", (*k, "pack"), rp))
            repacks.add_metric(k, self._counter("repacks", k, mv))
        yield from (charged, exclusive, ooms, requeues, recoveries, repacks)

    def _histograms(self, read: Sequence[tuple[StoreRef, StoreMetrics, StoreCursor]]) -> Iterator[Metric]:
        est = HistogramMetricFamily(
            "slurm_dlrm_estimate_error_ratio",
            "Finished jobs' measured / estimated peak GPU memory (> 1: under-estimated).", labels=USER_LABELS)
        wait = HistogramMetricFamily("slurm_dlrm_queue_wait_seconds",
                                     "Jobs' wait from submit to first start.", labels=USER_LABELS)
        for fam, attr, bounds in ((est, "est_error_ratios", EST_ERROR_BUCKETS), (wait, "wait_s", WAIT_BUCKETS_S)):
            merged: dict[tuple[str, ...], list[float]] = defaultdict(list)
            for _, _, c in read:
                for k, vals in getattr(c, attr).items():
                    merged[k].extend(vals)
            for k in sorted(merged):
                counts, total = _buckets(merged[k], bounds)
                fam.add_metric(k, [(_le(b), float(n)) for b, n in zip(bounds, counts, strict=False)]
                               + [("+Inf", float(len(merged[k])))], sum_value=total)
        yield est
        yield wait

    def _services(self, read: Sequence[tuple[StoreRef, StoreMetrics, StoreCursor]], now: float) -> Iterator[Metric]:
        age = GaugeMetricFamily("slurm_dlrm_service_last_round_age_seconds",
                                "Time since the user's packing service finished a dispatch round.",
                                labels=("user", "host"))
        dur = GaugeMetricFamily("slurm_dlrm_service_round_duration_seconds",
                                "How long the service's last dispatch round took.", labels=("user", "host"))
        ok = GaugeMetricFamily("slurm_dlrm_service_slurm_reachable",
                               "1 if the service's last round reached Slurm, 0 if Slurm was unreachable.",
                               labels=("user", "host"))
        for ref, _, _ in read:
            label, owner_uid = self._labels[str(ref.path)]
            path = ref.path.parent / SERVICE_STATUS_FILE
            try:
                status = read_service_status(ref.path.parent, owner_uid=owner_uid if self.all_users else None)
            except BadStatus as exc:
                self.store_errors["status"] += 1
                if self._failing.get(str(path)) != "status":
                    log.warning("service status %s (%s) skipped: %s", path, label, exc)
                    self._failing[str(path)] = "status"
                continue
            self._failing.pop(str(path), None)
            if status is None:
                continue  # this user never ran a service
            # the store's user, never the file's "user" field: a file names whom it likes
            u = ((status.user or label) if label == "*" else label, status.host)
            age.add_metric(u, max(0.0, now - status.last_round_t))
            if status.round_s is not None:
                dur.add_metric(u, status.round_s)
            ok.add_metric(u, 1.0 if status.slurm_ok else 0.0)
        yield from (age, dur, ok)


def _le(b: float) -> str:
    return repr(float(b))


def _buckets(values: list[float], bounds: Sequence[float]) -> tuple[list[int], float]:
    """Cumulative counts per upper bound (le), and the sum."""
    vs = sorted(values)
    return [bisect.bisect_right(vs, b) for b in bounds], float(sum(vs))


def _classify(exc: BaseException) -> str:
    if isinstance(exc, StoreNotOwned):
        return "owner"
    if isinstance(exc, StoreUntrusted):
        return "untrusted"
    if isinstance(exc, StoreTimeout):
        return "timeout"
    if isinstance(exc, StoreBusy):
        return "locked"
    if isinstance(exc, SchemaTooNew):
        return "schema"
    if isinstance(exc, PermissionError):
        return "permission"
    msg = str(exc).lower()
    if "schema version" in msg or "no such table" in msg or "no such column" in msg:
        return "schema"  # older, newer, or caught mid-creation
    if "locked" in msg or "busy" in msg:
        return "locked"
    if "not a database" in msg or "malformed" in msg or "disk image" in msg:
        return "corrupt"
    if "unable to open" in msg or "readonly" in msg or "permission" in msg:
        return "permission"
    if "no store at" in msg:
        return "missing"
    return "other"


def make_registry(collector: StoreCollector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


@dataclass(frozen=True)
class Tls:
    """HTTPS for /metrics: the certificate (chain) and key; with `client_cafile`,
    clients must present a certificate it signed (mutual TLS)."""

    certfile: str
    keyfile: str
    client_cafile: str | None = None  # set: clients must present a certificate it signed

    def context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        if self.client_cafile is not None:
            ctx.load_verify_locations(self.client_cafile)
            ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_cert_chain(certfile=self.certfile, keyfile=self.keyfile)
        return ctx


# A connection that has not finished its TLS handshake, or its request, by then is
# closed: each waits in its own thread, so it holds no other scrape meanwhile.
CONNECTION_TIMEOUT_S = 10.0


class _SilentHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        """No access log (as prometheus_client's own handler)."""


class MetricsServer(ThreadingWSGIServer):
    """prometheus_client's threading WSGI server, with TLS done per connection.

    prometheus_client 0.26's start_http_server wraps the listening socket, so every
    TLS handshake runs in its single accept loop with no timeout: one TCP connection
    that sends nothing blocks every scrape until it closes (issue 41 item 2). Here the
    accept loop only accepts; the handshake and the request run in the connection's
    own thread, bounded by `connection_timeout_s`."""

    ssl_context: ssl.SSLContext | None = None
    connection_timeout_s: float = CONNECTION_TIMEOUT_S

    def finish_request(self, request: Any, client_address: Any) -> None:
        request.settimeout(self.connection_timeout_s)
        if self.ssl_context is None:
            super().finish_request(request, client_address)
            return
        conn = self.ssl_context.wrap_socket(request, server_side=True)  # the handshake, here and bounded
        try:
            super().finish_request(conn, client_address)
        finally:
            conn.close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A peer that times out or fails the handshake: logged, not a traceback on stderr."""
        import sys

        log.debug("exporter: connection from %s dropped: %s", client_address, sys.exc_info()[1])


def serve(registry: CollectorRegistry, port: int, addr: str = DEFAULT_ADDRESS, tls: Tls | None = None, *,
          connection_timeout_s: float = CONNECTION_TIMEOUT_S) -> tuple[MetricsServer, threading.Thread]:
    """Start the HTTP(S) server (a thread); raises OSError when the port is taken,
    ssl.SSLError when the certificate or key cannot be loaded."""
    from prometheus_client import make_wsgi_app

    context = tls.context() if tls is not None else None
    family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]

    class Server(MetricsServer):
        address_family = family

    Server.ssl_context = context
    Server.connection_timeout_s = connection_timeout_s
    httpd = make_server(str(sockaddr[0]), port, make_wsgi_app(registry), Server, handler_class=_SilentHandler)
    thread = threading.Thread(target=httpd.serve_forever, name="exporter-http", daemon=True)
    thread.start()
    return httpd, thread
