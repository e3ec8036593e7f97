"""Which host writes a user's store, as every host sees it without opening the store.

The lease itself is a row in the store (`slurm_dlrm/store/lease.py`); its holder also
writes it to `<store_dir>/service.lease.json` (atomic replace) after each renewal, so a
command or a standby service on another login node learns who writes the store from a
small file, never by opening a database another host writes (docs/service.md,
"Several login nodes").
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from slurm_dlrm.service.daemon import ServicePaths, this_host
from slurm_dlrm.site import SiteConfig
from slurm_dlrm.store.db import check_own_dir, open_own_file
from slurm_dlrm.store.errors import LeaseLost
from slurm_dlrm.store.lease import Lease, acquire, check_held, release

log = logging.getLogger(__name__)

LEASE_FILE = "service.lease.json"
MIN_LEASE_S = 30.0


def lease_path(paths: ServicePaths) -> Path:
    return paths.store_dir / LEASE_FILE


def lease_ttl_s(site: SiteConfig, round_seconds: float) -> float:
    """`[service] lease_s`, or 3 rounds and at least 30 s: a round that runs long must
    not lose the lease, and a takeover waits at most this long plus a round."""
    return site.service_lease_s if site.service_lease_s > 0 else max(3 * round_seconds, MIN_LEASE_S)


def write_lease_file(paths: ServicePaths, lease: Lease) -> None:
    """Atomic replace; the temporary name is per process (a standby may write what it found)."""
    path = lease_path(paths)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, (json.dumps(lease.to_dict(), sort_keys=True) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def read_lease_file(paths: ServicePaths) -> Lease | None:
    """The lease file's lease (None: no folder, no file, or not a lease). A folder or
    file someone else owns or may write raises (db.check_own_dir): under a shared
    parent, another user could otherwise name a host that holds the store for ever."""
    if not check_own_dir(paths.store_dir, group_may_write=True):
        return None
    try:
        fd = open_own_file(lease_path(paths), "service lease file")
    except OSError:
        return None
    try:
        raw = os.read(fd, 1 << 16)  # a lease is about 150 bytes
    finally:
        os.close(fd)
    try:
        return Lease.from_dict(json.loads(raw))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def writer_elsewhere(paths: ServicePaths, now_t: float | None = None) -> Lease | None:
    """The live lease of a service on another host, or None (it is here, or nobody's)."""
    lease = read_lease_file(paths)
    now = time.time() if now_t is None else now_t
    if lease is None or not lease.live(now) or lease.host == this_host():
        return None
    return lease


class LeaseHolder:
    """The service's side of the lease: wait for it (standby), renew it each round,
    give it back on a clean stop."""

    def __init__(self, site: SiteConfig, user: str, paths: ServicePaths, ttl_s: float) -> None:
        self.site = site
        self.user = user
        self.paths = paths
        self.ttl_s = ttl_s
        self.token = secrets.token_hex(8)
        self.host = this_host()
        self.lease: Lease | None = None
        self.lost = False  # set by the fence: another host took the lease mid-round

    def take(self, store: Any) -> Lease | None:
        # This process holds this host's service flock (run.py takes it first), so a
        # lease of this host's that is still running is a dead service's.
        lease, prev = acquire(store, host=self.host, pid=os.getpid(), token=self.token, ttl_s=self.ttl_s,
                              holds_host_lock=True)
        if lease is not None:
            self.lost = False
            write_lease_file(self.paths, lease)
        elif prev is not None:
            write_lease_file(self.paths, prev)  # what we found, so this host's commands see it too
        self.lease = lease
        return lease

    def wait_free(self, control: Any, period_s: float, idle_exit_s: float = 0.0,
                  sleep: Callable[[float], None] = time.sleep) -> bool:
        """Stand by while another host's live lease holds the store, polling its lease
        file at least once a round. False: stopped, or idle for `idle_exit_s`."""
        waited_s = 0.0
        told = None
        while not control.stop:
            other = writer_elsewhere(self.paths)
            if other is None:
                return True
            if told != other.token:
                told = other.token
                log.info("standing by: the service on host %s (pid %d) holds the store until %s", other.host,
                         other.pid, time.strftime("%H:%M:%S", time.localtime(other.expires_t)))
            if idle_exit_s > 0 and waited_s >= idle_exit_s:
                return False
            step = min(period_s, 1.0, max(0.05, other.expires_t - time.time()))
            sleep(step)
            waited_s += step
        return False

    def wait(self, control: Any, period_s: float, idle_exit_s: float = 0.0,
             sleep: Callable[[float], None] = time.sleep) -> Any:
        """Block until this service holds the lease; returns the store, opened read-write
        (None: stopped, or idle for `idle_exit_s` while another host's service held it).

        The store is opened only once the lease file names no live holder elsewhere: a
        standby never opens a database another host writes."""
        from slurm_dlrm.store.store import Store

        while self.wait_free(control, period_s, idle_exit_s, sleep):
            store = Store.for_user(self.site, self.user)
            try:
                if self.take(store) is not None:
                    log.info("holding the store's lease on host %s for %.0f s at a time", self.host, self.ttl_s)
                    return store
            except BaseException:
                store.close()
                raise
            store.close()  # another host took it first: stand by again
            sleep(min(period_s, 1.0))
        return None

    def renew(self, store: Any) -> bool:
        """At the start of each round. False: another host took the store (this service
        was paused past its lease); the caller stops without writing."""
        if self.take(store) is not None:
            return True
        holder = read_lease_file(self.paths)
        log.error("lost the store's lease to host %s (pid %s); stopping without writing",
                  holder.host if holder else "?", holder.pid if holder else "?")
        return False

    def release(self, store: Any) -> None:
        if self.lease is None:
            return
        try:
            # not ours any more: the lease file is the new holder's, left as it is
            if not self.lost and release(store, self.token):
                write_lease_file(self.paths, replace(self.lease, expires_t=time.time()))
        except Exception:  # the store may be the reason we stop: the lease then runs out
            log.exception("could not give the lease back; it expires by itself")
        self.lease = None

    # ------------------------------------------------------------ the fence (issue 41 item 4)

    def guard(self, store: Any, slurm: Any) -> FencedSlurm:
        """Fence this service's writes and Slurm commands with the lease: every write
        transaction of `store` checks the token first (in the same transaction), and the
        returned client checks and renews it before each command that changes Slurm."""
        store.write_fence = self.check_in_tx
        return FencedSlurm(slurm, self, store)

    def check_in_tx(self, store: Any) -> None:
        if self.lost:
            raise LeaseLost("the store's lease was lost to another host; nothing more is written from here")
        try:
            check_held(store, self.token)
        except LeaseLost:
            self.lost = True
            log.error("lost the store's lease mid-round; this service writes nothing more")
            raise

    def fence_slurm(self, store: Any) -> float:
        """Before a command that changes something in Slurm: the lease still ours, renewed
        for a whole lease length (and the lease file rewritten), in a transaction of its
        own. Returns the seconds it has left: the command must end before that."""
        with store.write(fenced=False):
            self.check_in_tx(store)
            lease = check_held(store, self.token, renew_ttl_s=self.ttl_s)
        write_lease_file(self.paths, lease)
        self.lease = lease
        return lease.expires_t - store.clock()


# Slurm commands that change something: a service that lost the lease sends none.
SLURM_CHANGES = frozenset({"sbatch", "scancel", "requeue"})
# A command must end this long before the lease does (clock steps, the kill itself).
SLURM_LEASE_MARGIN_S = 1.0


class FencedSlurm:
    """The service's Slurm client, fenced by its lease (LeaseHolder.guard): `sbatch`,
    `scancel` and `requeue` run only after the lease is found ours and renewed, and with
    the client's timeout cut to what the lease has left, so no command of a holder that
    lost the lease, or is about to, reaches Slurm after another host took over (given
    clocks within the margin). Everything else goes to the client as it is."""

    def __init__(self, inner: Any, holder: LeaseHolder, store: Any) -> None:
        self._inner = inner
        self._holder = holder
        self._store = store

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name not in SLURM_CHANGES:
            return attr

        def fenced(*args: Any, **kw: Any) -> Any:
            left_s = self._holder.fence_slurm(self._store) - SLURM_LEASE_MARGIN_S
            if left_s <= 0:
                raise LeaseLost("the store's lease runs out before a Slurm command could end; not sent")
            timeout = getattr(self._inner, "timeout_s", None)
            if not isinstance(timeout, int | float) or timeout <= left_s:
                return attr(*args, **kw)
            self._inner.timeout_s = left_s  # one thread: the service's loop
            try:
                return attr(*args, **kw)
            finally:
                self._inner.timeout_s = timeout

        return fenced
