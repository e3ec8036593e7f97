"""The service's lease on the store: which host may write it, until when (issue 30).

`flock` on a network filesystem may or may not be seen from another host, so it cannot
say which login node's service owns a store. The lease is a row in the store itself,
taken and renewed by compare-and-set inside a write transaction: a service takes it
only when it is free, expired, or already its own (same token); a holder that finds
another token there has lost it and must stop writing.

Times are wall-clock seconds (the hosts of one site keep their clocks in step with
NTP; a skew shortens or lengthens the lease by as much). The table is created on first
use (CREATE TABLE IF NOT EXISTS) rather than by a numbered migration: a store that
never ran a service has none, and older readers ignore it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from slurm_dlrm.store.errors import LeaseLost

LEASE_TABLE = """CREATE TABLE IF NOT EXISTS service_lease (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    host TEXT NOT NULL,
    pid INTEGER NOT NULL,
    token TEXT NOT NULL,
    acquired_t REAL NOT NULL,
    heartbeat_t REAL NOT NULL,
    expires_t REAL NOT NULL
)"""


@dataclass(frozen=True)
class Lease:
    host: str
    pid: int
    token: str
    acquired_t: float
    heartbeat_t: float
    expires_t: float

    def live(self, now_t: float) -> bool:
        return now_t < self.expires_t

    def to_dict(self) -> dict[str, Any]:
        return {"host": self.host, "pid": self.pid, "token": self.token, "acquired_t": self.acquired_t,
                "heartbeat_t": self.heartbeat_t, "expires_t": self.expires_t}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Lease:
        return cls(host=str(d["host"]), pid=int(d["pid"]), token=str(d["token"]),
                   acquired_t=float(d["acquired_t"]), heartbeat_t=float(d["heartbeat_t"]),
                   expires_t=float(d["expires_t"]))


def may_take(current: Lease | None, token: str, now_t: float, *, dead_host: str | None = None) -> bool:
    """Free, expired, or ours already: never while another holder's lease runs.

    `dead_host`: the caller holds that host's service `flock` (a local lock, which the
    kernel drops when its holder dies), so a lease that host's earlier service held is
    a dead one's and need not be waited out."""
    return (current is None or current.token == token or not current.live(now_t)
            or (dead_host is not None and current.host == dead_host))


def _read(conn: Any) -> Lease | None:
    row = conn.execute("SELECT host, pid, token, acquired_t, heartbeat_t, expires_t FROM service_lease "
                       "WHERE id = 1").fetchone()
    return None if row is None else Lease(*row)


def read_lease(store: Any) -> Lease | None:
    exists = store.conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'service_lease'")
    if exists.fetchone() is None:
        return None
    return _read(store.conn)


def check_held(store: Any, token: str, *, renew_ttl_s: float | None = None) -> Lease:
    """Inside the caller's write transaction: the lease is still `token`'s, else
    LeaseLost (issue 41 item 4). The check and the writes after it commit together, so a
    holder paused, slow or skewed past its lease writes nothing once another host took
    over. `renew_ttl_s`: also renew it for that long (before a Slurm command, which no
    transaction covers). An expired lease nobody took yet is still ours: taking it needs
    this very write lock."""
    exists = store.conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'service_lease'")
    cur = _read(store.conn) if exists.fetchone() is not None else None
    if cur is None or cur.token != token:
        who = "nobody" if cur is None else f"host {cur.host} (pid {cur.pid})"
        raise LeaseLost(f"the store's lease is held by {who} now, not by this service; nothing more is written "
                        f"or sent to Slurm from here")
    if renew_ttl_s is None:
        return cur
    now = store.clock()
    lease = replace(cur, heartbeat_t=now, expires_t=max(cur.expires_t, now + renew_ttl_s))
    store.conn.execute("UPDATE service_lease SET heartbeat_t = ?, expires_t = ? WHERE id = 1 AND token = ?",
                       (lease.heartbeat_t, lease.expires_t, token))
    return lease


def acquire(store: Any, *, host: str, pid: int, token: str, ttl_s: float,
            holds_host_lock: bool = False) -> tuple[Lease | None, Lease | None]:
    """Take or renew the lease. Returns (ours, previous): ours is None if another holds it
    (previous is that holder); an event row records a takeover from another holder."""
    with store.write(fenced=False):  # the compare-and-set is its own check
        store.conn.execute(LEASE_TABLE)
        now = store.clock()
        prev = _read(store.conn)
        if not may_take(prev, token, now, dead_host=host if holds_host_lock else None):
            return None, prev
        acquired = prev.acquired_t if prev is not None and prev.token == token else now
        lease = Lease(host=host, pid=pid, token=token, acquired_t=acquired, heartbeat_t=now, expires_t=now + ttl_s)
        store.conn.execute(
            "INSERT INTO service_lease (id, host, pid, token, acquired_t, heartbeat_t, expires_t) "
            "VALUES (1, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET host = excluded.host, pid = excluded.pid, "
            "token = excluded.token, acquired_t = excluded.acquired_t, heartbeat_t = excluded.heartbeat_t, "
            "expires_t = excluded.expires_t",
            (lease.host, lease.pid, lease.token, lease.acquired_t, lease.heartbeat_t, lease.expires_t))
        if prev is None or prev.token != token:
            what = "free" if prev is None else (
                f"taken over from host {prev.host} (pid {prev.pid}), expired {now - prev.expires_t:.1f} s ago")
            store.event_in_tx("lease", f"service lease on host {host} (pid {pid}): {what}",
                              data={"host": host, "pid": pid, "previous": None if prev is None else prev.to_dict()})
        return lease, prev


def release(store: Any, token: str) -> bool:
    """End our lease now (a clean stop), so another host's service need not wait it out.
    False: it was not ours any more (nothing changed)."""
    with store.write(fenced=False):
        store.conn.execute(LEASE_TABLE)
        cur = store.conn.execute("UPDATE service_lease SET expires_t = ? WHERE id = 1 AND token = ?",
                                 (store.clock(), token))
        return bool(cur.rowcount)
