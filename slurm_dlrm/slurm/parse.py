"""Pure parsers of Slurm's machine-readable output (no I/O; tested on recorded output)."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from typing import Any

from slurm_dlrm.slurm.base import AcctRow, JobInfo, NodeInfo, PartitionRow
from slurm_dlrm.slurm.states import to_job_state

log = logging.getLogger(__name__)


class ParseError(ValueError):
    """Slurm printed something we cannot read."""


def parse_sbatch_parsable(stdout: str) -> int:
    """`sbatch --parsable` prints ``<id>`` or ``<id>;<cluster>`` (federation/-M)."""
    line = stdout.strip().splitlines()[-1] if stdout.strip() else ""
    head = line.split(";", 1)[0].strip()
    if not head.isdigit():
        raise ParseError(f"sbatch --parsable printed {stdout.strip()!r}, not a job id")
    return int(head)


# ---------------------------------------------------------------- helpers

def _none_if(value: Any, *nulls: str) -> str:
    """Slurm's many spellings of 'nothing' become ''."""
    if value is None:
        return ""
    s = str(value)
    return "" if s in ("(null)", "None", "N/A", "n/a", "Unknown", *nulls) else s


def _epoch(value: Any) -> int | None:
    """squeue --json gives unix seconds, 0 for 'not yet'."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def _wait_status(code: Any) -> tuple[int | None, int | None]:
    """squeue --json `exit_code` is a wait(2) status: 768 = exit 3, 15 = killed by SIGTERM."""
    if not isinstance(code, int) or isinstance(code, bool):
        return None, None
    if code & 0x7F:
        return None, code & 0x7F
    return (code >> 8) & 0xFF, None


def _load_json(stdout: str, what: str) -> dict[str, Any]:
    try:
        data = json.loads(stdout)
    except json.JSONDecodeError as exc:
        raise ParseError(f"{what} did not print JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ParseError(f"{what} printed JSON that is not an object")
    errors = [e for e in data.get("errors") or [] if e]
    if errors:
        log.warning("%s reported errors: %s", what, errors)
    return data


# ---------------------------------------------------------------- jobs

def job_from_json(j: dict[str, Any]) -> JobInfo:
    """One element of `squeue --json` .jobs (Slurm 22.05 openapi v0.0.38 layout)."""
    raw_state = j.get("job_state")
    exit_code, sig = _wait_status(j.get("exit_code"))
    array_job = j.get("array_job_id")
    array_task = j.get("array_task_id")
    return JobInfo(
        job_id=int(j["job_id"]),
        name=str(j.get("name") or ""),
        state=to_job_state(raw_state),
        slurm_state=(" ".join(raw_state) if isinstance(raw_state, list) else str(raw_state or "")),
        user=str(j.get("user_name") or ""),
        partition=str(j.get("partition") or ""),
        nodes=_none_if(j.get("nodes")),
        num_nodes=int(j.get("node_count") or 0),
        reason=_none_if(j.get("state_reason")),
        exit_code=exit_code,
        signal=sig,
        tres=str(j.get("tres_alloc_str") or j.get("tres_req_str") or ""),
        restart_count=int(j.get("restart_cnt") or 0),
        submit_time=_epoch(j.get("submit_time")),
        start_time=_epoch(j.get("start_time")),
        end_time=_epoch(j.get("end_time")) if to_job_state(raw_state).is_terminal else None,
        work_dir=str(j.get("current_working_directory") or ""),
        std_out=str(j.get("standard_output") or ""),
        comment=str(j.get("comment") or ""),
        array_job_id=int(array_job) if isinstance(array_job, int) and array_job > 0 else None,
        array_task_id=int(array_task) if isinstance(array_task, int) else None,
    )


def parse_squeue_json(stdout: str) -> list[JobInfo]:
    data = _load_json(stdout, "squeue --json")
    jobs = data.get("jobs")
    if not isinstance(jobs, list):
        raise ParseError("squeue --json: no 'jobs' list")
    return [job_from_json(j) for j in jobs]


# Keys of `scontrol show job -o` start with a capital and may hold '/' or ':'
# (CPUs/Task, ReqB:S:C:T). Splitting only before ' Key=' keeps values with spaces
# (JobName=my job, Reason=...) whole; a free-text value that itself contains
# ' Capital=' cannot be told apart, which is why squeue --json is preferred.
_SCONTROL_KEY = re.compile(r"(?:^|\s)([A-Z][A-Za-z0-9_/:]*)=")


def parse_scontrol_oneliner(stdout: str) -> list[dict[str, str]]:
    """`scontrol show job|node -o`: one record per line, ``Key=value`` pairs."""
    records = []
    for line in stdout.splitlines():
        line = line.rstrip()
        if not line:
            continue
        matches = list(_SCONTROL_KEY.finditer(line))
        if not matches:
            raise ParseError(f"scontrol: no Key=value in {line[:80]!r}")
        rec: dict[str, str] = {}
        for i, m in enumerate(matches):
            end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
            rec[m.group(1)] = line[m.end():end].strip()
        records.append(rec)
    return records


def _scontrol_time(value: str) -> int | None:
    """scontrol prints local time without zone (2026-11-22T00:21:35) or Unknown/None."""
    import datetime as _dt

    if not value or value in ("Unknown", "None", "N/A", "(null)"):
        return None
    try:
        return int(_dt.datetime.fromisoformat(value).timestamp())
    except ValueError:
        return None


def job_from_scontrol(rec: dict[str, str]) -> JobInfo:
    raw_exit = rec.get("ExitCode", "")
    exit_s, _, sig_s = raw_exit.partition(":")
    sig = int(sig_s) if sig_s.isdigit() and int(sig_s) else None
    state = to_job_state(rec.get("JobState"))
    num_nodes = rec.get("NumNodes", "0").split("-", 1)[0]
    return JobInfo(
        job_id=int(rec["JobId"]),
        name=rec.get("JobName", ""),
        state=state,
        slurm_state=rec.get("JobState", ""),
        user=rec.get("UserId", "").split("(", 1)[0],
        partition=_none_if(rec.get("Partition")),
        nodes=_none_if(rec.get("NodeList")),
        num_nodes=int(num_nodes) if num_nodes.isdigit() else 0,
        reason=_none_if(rec.get("Reason")),
        exit_code=int(exit_s) if exit_s.isdigit() and sig is None else None,
        signal=sig,
        tres=_none_if(rec.get("TRES")),
        restart_count=int(rec.get("Restarts", "0") or 0),
        submit_time=_scontrol_time(rec.get("SubmitTime", "")),
        start_time=_scontrol_time(rec.get("StartTime", "")) if state is not state.PENDING else None,
        end_time=_scontrol_time(rec.get("EndTime", "")) if state.is_terminal else None,
        work_dir=_none_if(rec.get("WorkDir")),
        std_out=_none_if(rec.get("StdOut")),
        comment=_none_if(rec.get("Comment")),
        array_job_id=int(rec["ArrayJobId"]) if rec.get("ArrayJobId", "").isdigit() else None,
        array_task_id=int(rec["ArrayTaskId"]) if rec.get("ArrayTaskId", "").isdigit() else None,
    )


# ---------------------------------------------------------------- nodes and partitions

def node_from_json(n: dict[str, Any]) -> NodeInfo:
    """One element of `sinfo --json` .nodes (22.05: state is a lower-case word)."""
    state = str(n.get("state") or "unknown").lower()
    flags = tuple(str(f).upper() for f in n.get("state_flags") or [])
    port = n.get("port")
    return NodeInfo(
        name=str(n["name"]),
        state=state,
        flags=flags,
        cpus=int(n.get("cpus") or 0),
        cpus_alloc=int(n.get("alloc_cpus") or 0),
        real_memory_mib=int(n.get("real_memory") or 0),
        alloc_memory_mib=int(n.get("alloc_memory") or 0),
        gres=_none_if(n.get("gres")),
        gres_used=_none_if(n.get("gres_used")),
        partitions=tuple(str(p) for p in n.get("partitions") or []),
        address=str(n.get("address") or ""),
        port=int(port) if isinstance(port, int) else None,
        reason=str(n.get("reason") or ""),
    )


def parse_nodes_json(stdout: str) -> list[NodeInfo]:
    data = _load_json(stdout, "sinfo --json")
    nodes = data.get("nodes")
    if not isinstance(nodes, list):
        raise ParseError("sinfo --json: no 'nodes' list")
    return [node_from_json(n) for n in nodes]


# `sinfo --format`: partition (with * on the default), availability, long state,
# nodes, node count, CPUs per node, memory per node (MiB), gres, time limit.
SINFO_FORMAT = "%P|%a|%T|%N|%D|%c|%m|%G|%l"


def parse_sinfo(stdout: str) -> list[PartitionRow]:
    rows = []
    for line in stdout.splitlines():
        if not line.strip():
            continue
        cols = line.split("|")
        if len(cols) != 9:
            raise ParseError(f"sinfo: expected 9 '|'-separated columns, got {len(cols)} in {line!r}")
        part, avail, state, nodes, count, cpus, mem, gres, limit = (c.strip() for c in cols)
        rows.append(PartitionRow(
            partition=part.rstrip("*"), available=avail, state=state, nodes=nodes,
            num_nodes=int(count), cpus=int(cpus.rstrip("+")) if cpus.rstrip("+").isdigit() else 0,
            memory_mib=int(mem.rstrip("+")) if mem.rstrip("+").isdigit() else 0,
            gres=_none_if(gres), time_limit=limit, default=part.endswith("*")))
    return rows


# ---------------------------------------------------------------- accounting

def parse_sacct_parsable2(stdout: str, fields: Sequence[str]) -> list[AcctRow]:
    """`sacct --parsable2 --noheader --format F1,F2,...`: '|' between fields, none at the end."""
    cols = list(fields)
    try:
        id_col = cols.index("JobID")
    except ValueError:
        raise ParseError("sacct: the JobID field is required") from None
    rows = []
    for line in stdout.splitlines():
        if not line.strip():
            continue
        values = line.split("|")
        if len(values) != len(cols):
            # Only free text (JobName, Comment) can hold '|'; fold extras into the
            # JobName field if it is the only text column, else refuse.
            if len(values) > len(cols) and "JobName" in cols:
                extra = len(values) - len(cols)
                k = cols.index("JobName")
                values = values[:k] + ["|".join(values[k:k + extra + 1])] + values[k + extra + 1:]
            else:
                raise ParseError(f"sacct: expected {len(cols)} fields, got {len(values)} in {line!r}")
        rows.append(AcctRow(job_id=values[id_col], fields=dict(zip(cols, values, strict=True))))
    return rows


def parse_sacct_exit_code(value: str) -> tuple[int | None, int | None]:
    """sacct ExitCode ``3:0`` -> (3, None); ``0:15`` -> (None, 15)."""
    code, _, sig = value.partition(":")
    if sig.isdigit() and int(sig):
        return None, int(sig)
    return (int(code), None) if code.isdigit() else (None, None)


def compress_hostlist(names: Sequence[str]) -> str:
    """``["node1", "node2", "node4", "gpu"]`` -> ``"gpu,node[1-2,4]"``, as Slurm prints
    node lists (the inverse of `slurm_dlrm.site.expand_hostlist` for one number per name)."""
    groups: dict[tuple[str, str], list[str]] = {}
    plain: list[str] = []
    for name in dict.fromkeys(names):
        m = re.fullmatch(r"(.*?)(\d+)([^\d]*)", name)
        if m is None:
            plain.append(name)
        else:
            groups.setdefault((m.group(1), m.group(3)), []).append(m.group(2))
    parts = list(plain)
    for (prefix, suffix), nums in groups.items():
        if len(nums) == 1:
            parts.append(f"{prefix}{nums[0]}{suffix}")
            continue
        ordered = sorted(nums, key=lambda n: (int(n), len(n)))
        ranges: list[list[str]] = []
        for n in ordered:
            if ranges and int(n) == int(ranges[-1][-1]) + 1 and len(n) == len(ranges[-1][-1]):
                ranges[-1].append(n)
            else:
                ranges.append([n])
        spans = ",".join(r[0] if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in ranges)
        parts.append(f"{prefix}[{spans}]{suffix}")
    return ",".join(sorted(parts))
