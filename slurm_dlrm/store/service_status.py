"""The packing service's status file (`service.status.json`, in the store folder) as
a reader who does not trust its writer sees it: the exporter reads every user's, and
each user can write anything there (a FIFO, a link, a huge file, fields of any type, another user's name).

Validated here, one line of why when it is not what the service writes
(`service.daemon.write_status`); kept apart from `service/` so that the exporter does
not import the service.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# What each user's packing service writes after every round, in its store folder
# (`service.daemon.ServicePaths.status`; the exporter sits beside `service/`, not above it).
SERVICE_STATUS_FILE = "service.status.json"


# The service writes a few hundred bytes; anything much larger is not its file.
MAX_STATUS_BYTES = 64 * 1024
_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")
_USER = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_.@-]{0,63}")


class BadStatus(ValueError):
    """A service status file that is not what the service writes (one line: why)."""


@dataclass(frozen=True)
class ServiceStatus:
    """The fields of `service.status.json` the exporter shows, validated."""

    last_round_t: float
    round_s: float | None
    slurm_ok: bool
    host: str  # where the service runs ("" if the file does not say)
    user: str | None  # the file's own claim: used only for a shared ("*") store


def _number(data: dict[str, Any], key: str, *, required: bool) -> float | None:
    v = data.get(key)
    if v is None and not required:
        return None
    # bool is an int to Python, and JSON has no NaN/inf but json.loads accepts them
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise BadStatus(f"{key}: {'missing' if v is None else 'not a finite number >= 0'}")
    return float(v)


def parse_service_status(data: Any) -> ServiceStatus | None:
    """The validated status, None if the service never finished a round; BadStatus if
    any field the exporter shows is not what the service writes."""
    if not isinstance(data, dict):
        raise BadStatus("not a JSON object")
    if data.get("last_round_t") in (None, 0):
        return None  # written at start, before the first round
    t = _number(data, "last_round_t", required=True)
    assert t is not None
    round_s = _number(data, "round_seconds", required=False)
    slurm_ok = data.get("slurm_ok", True)
    if not isinstance(slurm_ok, bool):
        raise BadStatus("slurm_ok: not true or false")
    # label values only: one that is not a plain name is left out, not the figures
    host = data.get("host", "")
    if not isinstance(host, str) or not _HOST.fullmatch(host):
        host = ""
    user = data.get("user")
    if not isinstance(user, str) or not _USER.fullmatch(user):
        user = None
    return ServiceStatus(t, round_s, slurm_ok, host, user)


def read_service_status(store_dir: Path, owner_uid: int | None = None) -> ServiceStatus | None:
    """The status file beside a store: None if there is none (or no round yet);
    BadStatus if it is not a regular file of at most MAX_STATUS_BYTES owned by
    `owner_uid` (the store's owner, with --all-users), or not valid."""
    path = store_dir / SERVICE_STATUS_FILE
    try:
        # O_NONBLOCK: a FIFO put in its place must not block the scrape; O_NOFOLLOW: a
        # link to someone else's file is not this user's status
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise BadStatus(f"cannot open: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadStatus("not a regular file")
        if owner_uid is not None and st.st_uid != owner_uid:
            raise BadStatus(f"owned by uid {st.st_uid}, not by the store's owner (uid {owner_uid})")
        raw = os.read(fd, MAX_STATUS_BYTES + 1)
    finally:
        os.close(fd)
    if len(raw) > MAX_STATUS_BYTES:
        raise BadStatus(f"larger than {MAX_STATUS_BYTES} bytes")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        raise BadStatus("not JSON") from None
    return parse_service_status(data)
