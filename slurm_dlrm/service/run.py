"""Running one user's service: the lock, the store, the Slurm client, the loop."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from slurm_dlrm.service.daemon import ServiceLock, elsewhere, read_pid, this_host, write_status
from slurm_dlrm.service.dropbox import ingest_requests
from slurm_dlrm.service.hosts import LeaseHolder, lease_ttl_s
from slurm_dlrm.service.leftovers import remove_stale_temporaries
from slurm_dlrm.service.loop import LoopControl, run_loop
from slurm_dlrm.service.remote import appliers
from slurm_dlrm.service.snapshot import SnapshotPublisher
from slurm_dlrm.service.submit import service_paths
from slurm_dlrm.site import SiteConfig
from slurm_dlrm.store.errors import LeaseLost

log = logging.getLogger(__name__)


def serve_forever(site: SiteConfig, user: str, *, round_seconds: float | None = None,
                  idle_exit_s: float = 0.0, slurm: Any = None, control: LoopControl | None = None,
                  policy: str | None = None, log_file: Path | None = None, slurm_job: bool = False) -> int:
    """Run the service until SIGTERM (or `idle_exit_s` with nothing to do). Returns rounds run.

    If another service of this user holds the lock, returns 0 at once: two `submit`s
    racing to start the service end with exactly one running.

    `log_file`: log there, rotated by size, with stdout/stderr following the current
    file (service/servicelog.py); only the lock holder rotates it.
    """
    from slurm_dlrm.service.core import PackingService, ServiceSettings
    from slurm_dlrm.store.states import PACK_ACTIVE, JobState

    paths = service_paths(site, user)
    if control is None:
        # Before the lock (and so the pid file) exists: a `submit` that sees the pid may
        # send SIGUSR1 at once, and its default action would kill us.
        control = LoopControl()
        control.install_signal_handlers()
    period = round_seconds if round_seconds is not None else site.packing.round_seconds
    holder = LeaseHolder(site, user, paths, lease_ttl_s(site, period))
    # A service on another login node holds the store: stand by (reading only its lease
    # file) until that lease ends, before anything here is taken, the flock included: a
    # network filesystem may share flocks between hosts, or not.
    while True:
        if not holder.wait_free(control, period, idle_exit_s):
            return 0
        lock = ServiceLock.acquire(paths)
        if lock is not None:
            break
        if elsewhere(paths) is None:
            log.info("a packing service already runs for %s (pid %s)", user, read_pid(paths))
            return 0
        # This filesystem shares flocks between hosts and the holder runs on another one,
        # its lease not yet written or just renewed: stand by on the lease again.
        time.sleep(min(period, 1.0))
    with lock:
        handler = None
        if log_file is not None:
            from slurm_dlrm.service import servicelog

            handler = servicelog.install(log_file, redirect_std=True)
        if slurm is None:
            from slurm_dlrm.slurm import SlurmClient, SlurmError
            from slurm_dlrm.slurm.client import UnsupportedSlurm

            slurm = SlurmClient()
            try:
                slurm.release()  # an unsupported Slurm release stops the service at once, in one line
            except UnsupportedSlurm:
                raise
            except SlurmError as exc:
                # Unreachable is not unsupported: the rounds back off and retry, and
                # `queue`/`show` say why jobs wait (docs/service.md, failures are visible).
                log.warning("Slurm not reachable at start (%s); retrying in the rounds", exc)
        store = holder.wait(control, period, idle_exit_s)
        if store is None:
            return 0
        remove_stale_temporaries(paths.store_dir)  # what a killed service or command left (leftovers.py)
        slurm = holder.guard(store, slurm)  # every write and Slurm command checks the lease first
        # A little under the period, so a timer round never just misses its window.
        svc = PackingService(store, slurm, site, ServiceSettings(user=user, policy=policy,
                                                                 dispatch_window_s=0.9 * period))
        if not holder.renew(store):  # building the service may take a while: renew before the first round
            control.stop = True  # lost meanwhile: no round runs (the loop below returns at once)
        own_job = int(os.environ.get("SLURM_JOB_ID", "0") or 0) or None
        if slurm_job and not control.stop:  # [service] run_as = "slurm-job": a successor waits (singleton)
            _queue_successor(site, user, slurm, own_job)
        requests = appliers(site, user, slurm)
        snapshots = SnapshotPublisher(paths.store_dir)
        idle_since = time.monotonic()
        host, started_t = this_host(), time.time()  # several login nodes may see this store folder
        log.info("packing service for %s: pid file %s, round every %.1f s, policy %s",
                 user, paths.pid, period, svc.policy)

        def one_round() -> float | None:
            if not holder.renew(store):
                control.stop = True  # another host's service holds the store now: write nothing more
                return None
            try:
                return fenced_round()
            except LeaseLost:
                holder.lost = True
            # taken mid-round (slow Slurm commands, a pause, clock skew): every write and
            # Slurm command after that was refused by the fence (LeaseHolder.guard)
            log.error("another host's service took the store's lease during this round; stopping")
            control.stop = True
            return None

        def fenced_round() -> float | None:
            nonlocal idle_since
            # requests other login nodes dropped (service/dropbox.py), before this round plans
            took = ingest_requests(store, paths.store_dir, user, requests)
            if took.applied or took.refused:
                log.info("requests from other hosts: %d applied, %d refused", took.applied, took.refused)
            stats = svc.run_round()
            if holder.lost:  # a step of the round caught the fence's error and went on
                raise LeaseLost("lost during the round")
            busy = bool(store.jobs([JobState.PENDING, JobState.PLANNED, JobState.RUNNING], user=user)
                        or store.packs(PACK_ACTIVE, user=user))
            now = time.monotonic()
            if busy:
                idle_since = now
            write_status(paths, {**svc.status(), "host": host, "started_t": started_t,
                                 "round_seconds": round(stats.seconds, 4),
                                 # how long a submit on another host waits for its ids (request_wait.py)
                                 "round_period_s": period,
                                 "packs_submitted": stats.packs_submitted, "idle": not busy,
                                 # which Slurm it talks to: `submit` restarts a service whose differs
                                 "slurm_conf": os.environ.get("SLURM_CONF")})
            if stats.packs_submitted or stats.transitions or stats.ingested_lines:
                log.info("round %d: %d packs submitted, %d jobs planned, %d transitions, %d report lines "
                         "(%.3f s)", svc.rounds, stats.packs_submitted, stats.jobs_planned, stats.transitions,
                         stats.ingested_lines, stats.seconds)
            with store.write():  # the lease still ours: a copy of a store we no longer hold is not published
                pass
            snapshots.publish_if_changed(store)  # what other hosts' queue/acct read
            if idle_exit_s > 0 and not busy and now - idle_since >= idle_exit_s:
                log.info("nothing to do for %.0f s: exiting", idle_exit_s)
                control.stop = True
                if slurm_job:
                    _cancel_successors(slurm, user, own_job)
            return svc.next_delay_s()

        try:
            return run_loop(one_round, control, period)
        finally:
            holder.release(store)
            store.close()
            log.info("packing service for %s stopped", user)
            if handler is not None:
                servicelog.uninstall(handler)


def _queue_successor(site: SiteConfig, user: str, slurm: Any, own_job: int | None) -> None:
    from slurm_dlrm.service.slurmjob import queue_service_job
    from slurm_dlrm.slurm import SlurmError

    try:
        queue_service_job(site, user, slurm, running_id=own_job)
    except SlurmError as exc:  # the next submit queues one; this service runs on meanwhile
        log.warning("could not queue the next service job: %s", exc)


def _cancel_successors(slurm: Any, user: str, own_job: int | None) -> None:
    from slurm_dlrm.service.slurmjob import cancel_successors
    from slurm_dlrm.slurm import SlurmError

    try:
        cancel_successors(slurm, user, own_job)
    except SlurmError as exc:
        log.warning("could not cancel the waiting service job: %s", exc)
