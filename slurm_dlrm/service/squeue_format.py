"""squeue's habits for `slurm-dlrm queue` (issue 42): state names and codes, `-t all`,
`%`-format strings (`-o "%.18i %.9P %.8j %.2t %.10M %R"`), `--sort`, TIME as squeue
prints it. Pure: rows in, text out.

Our states map onto Slurm's: PENDING PD, PLANNED PL (ours: in a pack Slurm has not
started), RUNNING R, COMPLETED CD, FAILED F, OOM OOM, CANCELLED CA, TIMEOUT TO. A Slurm
state we never use (CG, S, PR, ...) is a valid filter that matches nothing, as squeue's
`-t CG` lists nothing when no job is completing.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from slurm_dlrm.errors import BadInput

STATE_CODES = {"PENDING": "PD", "PLANNED": "PL", "RUNNING": "R", "COMPLETED": "CD", "FAILED": "F",
               "OOM": "OOM", "CANCELLED": "CA", "TIMEOUT": "TO"}
# squeue's other states (squeue(1) JOB STATE CODES): accepted, never ours
SLURM_ONLY_STATES = {"BF": "BOOT_FAIL", "CF": "CONFIGURING", "CG": "COMPLETING", "DL": "DEADLINE",
                     "NF": "NODE_FAIL", "PR": "PREEMPTED", "RD": "RESV_DEL_HOLD", "RF": "REQUEUE_FED",
                     "RH": "REQUEUE_HOLD", "RQ": "REQUEUED", "RS": "RESIZING", "RV": "REVOKED",
                     "SI": "SIGNALING", "SE": "SPECIAL_EXIT", "SO": "STAGE_OUT", "ST": "STOPPED",
                     "S": "SUSPENDED"}
ACTIVE = ("PENDING", "PLANNED", "RUNNING")


def parse_squeue_states(text: str) -> tuple[set[str], bool]:
    """`-t/--states` as squeue reads it: names or codes, any case, comma list, `all`.
    Returns (our states to list, whether that includes ended ones)."""
    ours: set[str] = set()
    by_code = {v: k for k, v in STATE_CODES.items()}
    for item in (x.strip().upper() for x in text.split(",")):
        if not item:
            continue
        if item == "ALL":
            return set(STATE_CODES), True
        if item in STATE_CODES:
            ours.add(item)
        elif item in by_code:
            ours.add(by_code[item])
        elif item in SLURM_ONLY_STATES or item in SLURM_ONLY_STATES.values():
            continue  # a Slurm state none of our jobs is ever in
        else:
            raise BadInput(f"-t/--states: invalid job state specified: {item} (one of "
                           f"{','.join(STATE_CODES.values())}, their names, or all)")
    return ours, bool(ours - set(ACTIVE))


def squeue_time(seconds: float | None) -> str:
    """squeue's TIME: M:SS, H:MM:SS, D-HH:MM:SS."""
    s = int(seconds or 0)
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    if days:
        return f"{days}-{hours:02d}:{minutes:02d}:{s:02d}"
    if hours:
        return f"{hours}:{minutes:02d}:{s:02d}"
    return f"{minutes}:{s:02d}"


def time_limit(minutes: Any) -> str:
    if minutes is None:
        return "N/A"  # the partition's limit, not known here
    from slurm_dlrm.service.sbatch_options import TIME_UNLIMITED

    if int(minutes) == TIME_UNLIMITED:
        return "UNLIMITED"
    return squeue_time(int(minutes) * 60)


# %-letters: (header, row -> text)
def _reason(r: dict[str, Any]) -> str:
    return str(r.get("reason") or "None")


FIELDS: dict[str, tuple[str, Any]] = {
    "i": ("JOBID", lambda r: r.get("slurm_id") or r["job_id"]),
    "A": ("JOBID", lambda r: r["job_id"]),
    "F": ("ARRAY_JOB_ID", lambda r: str(r.get("slurm_id") or r["job_id"]).split("_")[0]),
    "K": ("ARRAY_TASK_ID", lambda r: str(r.get("slurm_id")).split("_")[1] if "_" in str(r.get("slurm_id")) else "N/A"),
    "j": ("NAME", lambda r: r["name"]),
    "t": ("ST", lambda r: STATE_CODES.get(r["state"], r["state"])),
    "T": ("STATE", lambda r: r["state"]),
    "P": ("PARTITION", lambda r: r.get("partition") or ""),
    "u": ("USER", lambda r: r.get("user") or ""),
    "M": ("TIME", lambda r: squeue_time(r.get("time_s"))),
    "l": ("TIME_LIMIT", lambda r: time_limit(r.get("time_limit_min"))),
    "D": ("NODES", lambda r: 1),
    "N": ("NODELIST", lambda r: r.get("node") or ""),
    "R": ("NODELIST(REASON)", lambda r: (f"({_reason(r)})" if r["state"] != "RUNNING" else r.get("node") or "")),
    "r": ("REASON", _reason),
    "b": ("TRES_PER_NODE", lambda r: "gres:gpu:1"),
    "p": ("PRIORITY", lambda r: r.get("nice") or 0),
}
_SPEC = re.compile(r"%(\.?)(-?)(\d*)([A-Za-z%])")


def is_percent_format(fmt: str) -> bool:
    return "%" in fmt


def render_percent(rows: Sequence[dict[str, Any]], fmt: str, header: bool) -> str:
    """squeue's `-o "%.18i %.9P %j"`: `%[.]WIDTHletter`, `.` right-aligns, text between
    fields kept; a letter we do not have is refused (one line, exit 2)."""
    parts: list[Any] = []
    pos = 0
    for m in _SPEC.finditer(fmt):
        parts.append(fmt[pos:m.start()])
        right, _minus, width, letter = m.groups()
        if letter == "%":
            parts.append("%")
        elif letter not in FIELDS:
            raise BadInput(f"-o/--format: %{letter}: not a field slurm-dlrm queue has "
                           f"(one of %{' %'.join(sorted(FIELDS))})")
        else:
            parts.append((letter, int(width) if width else 0, bool(right)))
        pos = m.end()
    parts.append(fmt[pos:])

    def line(get: Any) -> str:
        out = []
        for p in parts:
            if isinstance(p, str):
                out.append(p)
                continue
            letter, width, right = p
            text = str(get(letter))
            if width:
                text = text[:width].rjust(width) if right else text[:width].ljust(width)
            out.append(text)
        return "".join(out).rstrip()

    lines = [line(lambda c: FIELDS[c][0])] if header else []
    lines += [line(lambda c, r=r: FIELDS[c][1](r)) for r in rows]
    return "\n".join(lines)


# --sort keys: squeue's letters and our column names
SORT_KEYS = {"i": "array_job_id", "A": "job_id", "j": "name", "t": "state", "T": "state", "P": "partition",
             "M": "time_s", "l": "time_limit_min", "N": "node", "r": "reason", "p": "nice"}


def sort_rows(rows: list[dict[str, Any]], spec: str) -> list[dict[str, Any]]:
    """squeue's `--sort=-t,i`: keys in order, `-` descending, `+` ascending."""
    keys = []
    for item in (x.strip() for x in spec.split(",")):
        if not item:
            continue
        desc = item.startswith("-")
        name = item.lstrip("+-")
        key = SORT_KEYS.get(name) or (name.lower() if name.lower() in {"job_id", "name", "state", "partition",
                                                                          "node", "reason", "pack"} else None)
        if key is None:
            raise BadInput(f"--sort: {name}: not a sort key (one of {','.join(SORT_KEYS)} or a column name)")
        keys.append((key, desc))
    out = list(rows)
    for key, desc in reversed(keys):  # stable sorts, last key first
        out.sort(key=_sort_key(key), reverse=desc)
    return out


def _sort_key(key: str) -> Any:
    def get(r: dict[str, Any]) -> tuple[bool, str, float]:
        # squeue's `i` is the array's id for its tasks (they keep their order among themselves)
        v = int(str(r.get("slurm_id") or r["job_id"]).split("_")[0]) if key == "array_job_id" else r.get(key)
        num = isinstance(v, (int, float)) and not isinstance(v, bool)
        return (v is None, "" if num or v is None else str(v), float(v) if num else 0.0)  # type: ignore[arg-type]
    return get
