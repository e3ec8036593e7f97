"""The marker slurm-dlrm puts in a job's ``--comment`` (docs/interfaces.md section 6).

``job_submit.lua`` lets a job into a DLRM partition only when its comment carries this
marker; the task prolog reads ``gpu_mem_mib`` back to set ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``.
Grammar: ``slurm-dlrm:`` then comma-separated ``key=value`` pairs, keys ``[a-z_]+``,
values ``[A-Za-z0-9._-]+`` (nothing a shell, Lua or Slurm's comment field must escape).

Pure: no I/O, so the submit path can import it cheaply.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from slurm_dlrm.errors import BadInput

MARKER_PREFIX = "slurm-dlrm:"
MODE_NO_PACK = "no-pack"  # one user job, one Slurm job (`slurm-dlrm submit --no-pack`)
MODE_PACK = "pack"  # one pack of members, submitted by the packing service
MODES = (MODE_NO_PACK, MODE_PACK)

_KEY = re.compile(r"[a-z_]{1,32}")
_VALUE = re.compile(r"[A-Za-z0-9._-]{1,64}")


@dataclass(frozen=True)
class Marker:
    mode: str
    gpu_mem_mib: int | None = None  # per GPU; required for no-pack
    pack_id: int | None = None  # required for pack
    job_id: int | None = None  # the store's job id, optional
    extra: tuple[tuple[str, str], ...] = ()  # keys a newer writer added; kept, not checked


def format_marker(mode: str, *, gpu_mem_mib: int | None = None, pack_id: int | None = None,
                  job_id: int | None = None, extra: dict[str, str] | None = None) -> str:
    """The ``--comment`` value for a job: ``slurm-dlrm:mode=no-pack,gpu_mem_mib=3000,job_id=12``.

    ``extra`` adds keys of the writer's own (e.g. ``{"pack": "alice-7"}``); job_submit.lua
    ignores them. BadInput if a key or value falls outside the grammar.
    """
    marker = Marker(mode, gpu_mem_mib, pack_id, job_id, tuple(sorted((extra or {}).items())))
    _check(marker)
    pairs = [("mode", mode)]
    for key in ("gpu_mem_mib", "pack_id", "job_id"):
        value = getattr(marker, key)
        if value is not None:
            pairs.append((key, str(value)))
    for key, value in marker.extra:
        if key in ("mode", "gpu_mem_mib", "pack_id", "job_id") or not _KEY.fullmatch(key) \
                or not _VALUE.fullmatch(value):
            raise BadInput(f"comment: bad marker field {key}={value!r}")
        pairs.append((key, value))
    return MARKER_PREFIX + ",".join(f"{k}={v}" for k, v in pairs)


def parse_marker(comment: str | None) -> Marker | None:
    """The marker in a job comment, ``None`` when the comment has none; BadInput when malformed."""
    if not comment or not comment.startswith(MARKER_PREFIX):
        return None
    fields: dict[str, str] = {}
    for pair in comment[len(MARKER_PREFIX):].split(","):
        key, eq, value = pair.partition("=")
        if not eq or not _KEY.fullmatch(key) or not _VALUE.fullmatch(value):
            raise BadInput(f"comment: bad marker field {pair!r} in {comment!r}")
        fields[key] = value
    ints: dict[str, int | None] = {}
    for key in ("gpu_mem_mib", "pack_id", "job_id"):
        raw = fields.pop(key, None)
        if raw is not None and not raw.isdigit():
            raise BadInput(f"comment: {key} must be a whole number, got {raw!r}")
        ints[key] = int(raw) if raw is not None else None
    marker = Marker(fields.pop("mode", ""), ints["gpu_mem_mib"], ints["pack_id"], ints["job_id"],
                    tuple(sorted(fields.items())))
    _check(marker)
    return marker


def _check(marker: Marker) -> None:
    if marker.mode not in MODES:
        raise BadInput(f"comment: mode must be one of {', '.join(MODES)}, got {marker.mode!r}")
    if marker.mode == MODE_NO_PACK and (marker.gpu_mem_mib is None or marker.gpu_mem_mib < 1):
        raise BadInput("comment: a no-pack job needs gpu_mem_mib >= 1")
    if marker.mode == MODE_PACK and (marker.pack_id is None or marker.pack_id < 0):
        raise BadInput("comment: a pack needs pack_id >= 0")
    for key in ("gpu_mem_mib", "pack_id", "job_id"):
        value = getattr(marker, key)
        if value is not None and value < 0:
            raise BadInput(f"comment: {key} must be >= 0, got {value}")
