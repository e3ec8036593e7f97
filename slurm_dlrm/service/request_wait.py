"""`submit` on a login node whose service does not hold the store waits for the job ids.

The request file (service/dropbox.py) is applied by the service at its next round, and
the outcome is recorded with the request's file name in the store's `requests` table,
which the service then publishes in the store's read-only copy (service/snapshot.py).
Without the ids, `--parsable`, `-d afterok:$(slurm-dlrm submit --parsable ...)` chains
and users' scripts broke on that host (issue 43 item 11). So `submit` there reads the
copy until its request's row shows up, bounded by a few of the service's rounds: then
it prints what `submit` prints on the service's own host. Past the bound it says so in
one line and exits 1; the request file stays and is applied once, as any other.

Reading only: the copy is opened read-only and immutable (as `queue` reads it there),
never the live store another host writes.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_dlrm.service.snapshot import snapshot_path

# How many of the service's rounds a submit on another host waits for its ids: the
# request waits for the next round (up to one), is applied at its start, and the copy
# is published at its end; a third covers a round that runs long or a copy put off.
WAIT_ROUNDS = 3
# ... and at least this long: a service with sub-second rounds (a test site) under load
# misses 3 of them by the scheduling of the processes alone.
MIN_WAIT_S = 5.0
POLL_S = 0.05  # how often the copy is looked at (an open and one indexed row: cheap)


@dataclass(frozen=True)
class RequestOutcome:
    applied: bool
    outcome: str  # "applied", or "refused: <why>"
    result: dict[str, Any]  # what the service's handler returned (submit: {"job_ids": [...]})


def wait_bound_s(round_s: float) -> float:
    """How long a submit on another host waits for its ids: WAIT_ROUNDS service rounds,
    at least MIN_WAIT_S."""
    return max(MIN_WAIT_S, WAIT_ROUNDS * round_s)


def service_round_s(store_dir: Path, default_s: float) -> float:
    """The running service's round period, from its status file (`serve --round-seconds`
    may differ from the site's); `default_s` (the site's) when it does not say."""
    from slurm_dlrm.service.daemon import ServicePaths, read_status

    value = read_status(ServicePaths(store_dir)).get("round_period_s")
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) and value > 0 else default_s


def read_outcome(store_dir: Path, request_file: str) -> RequestOutcome | None:
    """The request's recorded outcome in the published copy, None while it has none."""
    path = snapshot_path(store_dir)
    if not path.is_file():
        return None
    try:
        conn = sqlite3.connect(f"{path.as_uri()}?mode=ro&immutable=1", uri=True)
    except sqlite3.Error:
        return None
    try:
        row = conn.execute("SELECT outcome, result_json FROM requests WHERE file = ?", (request_file,)).fetchone()
    except sqlite3.Error:
        return None  # no requests table yet (a copy from before the first request), or a copy being replaced
    finally:
        conn.close()
    if row is None:
        return None
    outcome = str(row[0])
    try:
        result = json.loads(row[1]) if row[1] else {}
    except ValueError:
        result = {}
    return RequestOutcome(outcome == "applied", outcome, result if isinstance(result, dict) else {})


def wait_for_outcome(store_dir: Path, request_file: str, timeout_s: float, *,
                     clock: Callable[[], float] = time.monotonic,
                     sleep: Callable[[float], None] = time.sleep) -> RequestOutcome | None:
    """Poll the copy until the request has an outcome; None after `timeout_s`."""
    deadline = clock() + timeout_s
    while True:
        found = read_outcome(store_dir, request_file)
        if found is not None or clock() >= deadline:
            return found
        sleep(POLL_S)


__all__ = ["MIN_WAIT_S", "RequestOutcome", "WAIT_ROUNDS", "read_outcome", "service_round_s", "wait_bound_s", "wait_for_outcome"]
