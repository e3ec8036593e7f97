"""Pure parsers of Slurm's machine-readable output (no I/O; tested on recorded output)."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from typing import Any

from slurm_dlrm.errors import DlrmError
from slurm_dlrm.slurm.base import AcctRow, JobInfo, NodeInfo, PartitionRow
from slurm_dlrm.slurm.states import to_job_state

log = logging.getLogger(__name__)


class ParseError(DlrmError, ValueError):
    """Slurm printed something we cannot read (exit 1, one line: never a traceback).

    Most likely a Slurm release whose output differs from the ones recorded under
    tests/data/slurm/; the message names what was expected.
    """


# The oldest release whose output the parsers are tested on (tests/data/slurm/22.05.8).
MIN_RELEASE = (22, 5)


def parse_version(stdout: str) -> tuple[int, int, int]:
    """`sinfo --version`: ``slurm 24.11.5`` or ``slurm-wlm 22.05.8`` -> (24, 11, 5)."""
    m = re.fullmatch(r"\s*slurm(?:-wlm)?\s+(\d+)\.(\d+)(?:\.(\d+))?\S*\s*", stdout)
    if m is None:
        raise ParseError(f"sinfo --version printed {stdout.strip()[:80]!r}, not 'slurm X.Y.Z'")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


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


def _number(value: Any, what: str) -> int | None:
    """A number of `squeue --json` in either shape; None for 'not set' / 'infinite'.

    22.05 (data parser v0.0.38) prints plain integers; 23.02+ (v0.0.39 and later, seen
    on 24.11 and 26.05) prints ``{"set": bool, "infinite": bool, "number": int}``.
    Anything else is a shape we do not know: refuse rather than guess.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise ParseError(f"squeue --json: {what}: a boolean where a number was expected")
    if isinstance(value, int):
        return value
    if isinstance(value, dict) and {"set", "number"} <= value.keys():
        if not value["set"] or value.get("infinite"):
            return None
        n = value["number"]
        if isinstance(n, int) and not isinstance(n, bool):
            return n
    raise ParseError(f"squeue --json: {what}: unknown shape {json.dumps(value)[:80]}")


def _epoch(value: Any, what: str) -> int | None:
    """Unix seconds; 0 means 'not yet'."""
    n = _number(value, what)
    return n if n is not None and n > 0 else None


def _exit_code(code: Any) -> tuple[int | None, int | None]:
    """`squeue --json` exit_code -> (exit code, signal); (None, None) while unknown.

    22.05: a wait(2) status (768 = exit 3, 15 = killed by SIGTERM). 23.02+: an object
    ``{"status": ["EXITED"|"SIGNALED"|"PENDING"|...], "return_code": N, "signal":
    {"id": N, "name": "TERM"}}`` whose numbers are themselves set/number objects.
    """
    if code is None:
        return None, None
    if isinstance(code, int) and not isinstance(code, bool):
        if code & 0x7F:
            return None, code & 0x7F
        return (code >> 8) & 0xFF, None
    if isinstance(code, dict) and "status" in code:
        status = code["status"]
        status = set(status) if isinstance(status, list) else {status}
        signal_obj = code.get("signal")
        sig = _number(signal_obj.get("id") if isinstance(signal_obj, dict) else signal_obj, "exit_code.signal")
        if "SIGNALED" in status or "CORE_DUMPED" in status:
            return None, sig or None
        if "EXITED" in status or "SUCCESS" in status or "ERROR" in status:
            return _number(code.get("return_code"), "exit_code.return_code"), None
        if status <= {"PENDING", "INVALID", "INVALID_ID", "UNKNOWN"}:
            return None, None
        raise ParseError(f"squeue --json: exit_code: unknown status {sorted(status)}")
    raise ParseError(f"squeue --json: exit_code: unknown shape {json.dumps(code)[:80]}")


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

def _text(value: Any, what: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    raise ParseError(f"squeue --json: {what}: expected text, got {json.dumps(value)[:80]}")


def job_from_json(j: dict[str, Any]) -> JobInfo:
    """One element of `squeue --json` .jobs: 22.05 (v0.0.38) or 23.02+ (v0.0.39..v0.0.44)."""
    if not isinstance(j, dict) or not isinstance(j.get("job_id"), int):
        raise ParseError(f"squeue --json: a job without a numeric job_id: {json.dumps(j)[:80]}")
    raw_state = j.get("job_state")
    if not (isinstance(raw_state, str) or (isinstance(raw_state, list) and raw_state)):
        raise ParseError(f"squeue --json: job {j['job_id']}: job_state {raw_state!r} is not a state")
    state = to_job_state(raw_state)
    exit_code, sig = _exit_code(j.get("exit_code"))
    array_job = _number(j.get("array_job_id"), "array_job_id")
    array_task = _number(j.get("array_task_id"), "array_task_id")
    return JobInfo(
        job_id=int(j["job_id"]),
        name=str(j.get("name") or ""),
        state=state,
        slurm_state=(" ".join(raw_state) if isinstance(raw_state, list) else raw_state),
        user=_text(j.get("user_name"), "user_name"),
        partition=_text(j.get("partition"), "partition"),
        nodes=_none_if(_text(j.get("nodes"), "nodes")),
        num_nodes=_number(j.get("node_count"), "node_count") or 0,
        reason=_none_if(_text(j.get("state_reason"), "state_reason")),
        exit_code=exit_code,
        signal=sig,
        tres=_text(j.get("tres_alloc_str") or j.get("tres_req_str"), "tres_alloc_str"),
        restart_count=_number(j.get("restart_cnt"), "restart_cnt") or 0,
        submit_time=_epoch(j.get("submit_time"), "submit_time"),
        start_time=_epoch(j.get("start_time"), "start_time"),
        end_time=_epoch(j.get("end_time"), "end_time") if state.is_terminal else None,
        work_dir=_text(j.get("current_working_directory"), "current_working_directory"),
        std_out=_text(j.get("standard_output"), "standard_output"),
        comment=_comment(j.get("comment")),
        array_job_id=array_job if array_job is not None and array_job > 0 else None,
        array_task_id=array_task,
        gres_detail=",".join(str(g) for g in j.get("gres_detail") or [] if g),
    )


def _comment(value: Any) -> str:
    """22.05: `comment` is the job's --comment; 23.02+: ``{"job": ..., "administrator": ...,
    "system": ...}`` (the --comment is "job")."""
    if isinstance(value, dict):
        return _text(value.get("job"), "comment.job")
    return _text(value, "comment")


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
        # 22.05 prints TRES= (allocated once running); 24.11+ ReqTRES= and AllocTRES=
        tres=_none_if(rec.get("AllocTRES")) or _none_if(rec.get("TRES")) or _none_if(rec.get("ReqTRES")),
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


# What a job allows on its nodes besides itself (sbatch --exclusive[=user|mcs|topo]).
_OVERSUBSCRIBE_SHARING = {"NO": "node", "USER": "user", "MCS": "mcs", "TOPO": "topo"}


def job_node_sharing(rec: dict[str, str]) -> str:
    """Whom a job shares its nodes with, from `scontrol show job -o`: "node" (nobody,
    --exclusive), "user" (the job's user only, --exclusive=user), "mcs", "topo", or "any".
    Slurm 26.05 prints exclusivity in its own `Exclusive=` field (NO, NODE, USER, ...) and
    keeps `OverSubscribe=` for CPU oversubscription alone; 22.05 and 24.11 print it as
    `OverSubscribe=NO|USER|MCS|TOPO` (OK/YES/FORCE: may share)."""
    if "Exclusive" in rec:
        value = rec["Exclusive"].upper()
        return "any" if value == "NO" else value.lower()
    return _OVERSUBSCRIBE_SHARING.get(rec.get("OverSubscribe", "").upper(), "any")


# ---------------------------------------------------------------- nodes and partitions

# Base node states (slurm.h node_state_string); anything after '+' is a flag.
NODE_BASE_STATES = frozenset({"idle", "mixed", "allocated", "down", "error", "future", "unknown",
                              "completing", "planned"})


def _int_field(rec: dict[str, str], key: str, what: str) -> int:
    raw = rec.get(key)
    if raw is None or raw in ("", "N/A", "(null)"):
        return 0
    if not raw.isdigit():
        raise ParseError(f"{what}: {key}={raw!r} is not a number")
    return int(raw)


def node_from_scontrol(rec: dict[str, str]) -> NodeInfo:
    """One record of `scontrol show node -o` (the same Key=value text on 22.05 .. 26.05).

    State is ``BASE[*][+FLAG...]``: ``IDLE``, ``MIXED+DRAIN``, ``DOWN*+NOT_RESPONDING``
    (a trailing ``*`` on the base also means not responding), ``IDLE+DRAIN+DYNAMIC_NORM``.
    """
    name = rec.get("NodeName")
    if not name:
        raise ParseError("scontrol show node: a record without NodeName")
    raw_state = rec.get("State", "")
    base, *flags = raw_state.split("+")
    base = base.strip()
    if base.endswith("*"):
        base = base.rstrip("*")
        flags.append("NOT_RESPONDING")
    # Old releases print the flag forms (DRAINED/DRAINING) in some paths: a drain word
    # as base means idle/mixed + DRAIN.
    if base.upper() in ("DRAIN", "DRAINED", "DRAINING"):
        flags.append("DRAIN")
        base = "idle" if base.upper() != "DRAINING" else "mixed"
    state = base.lower()
    if state not in NODE_BASE_STATES:
        raise ParseError(f"scontrol show node {name}: unknown State={raw_state!r}")
    what = f"scontrol show node {name}"
    port = rec.get("Port", "")
    return NodeInfo(
        name=name,
        state=state,
        flags=tuple(dict.fromkeys(f.strip().upper() for f in flags if f.strip())),
        cpus=_int_field(rec, "CPUTot", what),
        cpus_alloc=_int_field(rec, "CPUAlloc", what),
        real_memory_mib=_int_field(rec, "RealMemory", what),
        alloc_memory_mib=_int_field(rec, "AllocMem", what),
        gres=_none_if(rec.get("Gres")),
        gres_used=_none_if(rec.get("GresUsed")),
        partitions=tuple(p for p in _none_if(rec.get("Partitions")).split(",") if p),
        address=_none_if(rec.get("NodeAddr")),
        port=int(port) if port.isdigit() else None,
        reason=_none_if(rec.get("Reason")),
    )


def _index_list(text: str) -> set[int]:
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        if lo.isdigit() and (not hi or hi.isdigit()):
            out.update(range(int(lo), int(hi or lo) + 1))
    return out


def busy_gpu_count(gres_used: str) -> int:
    """How many of a node's GPUs its jobs hold, from `scontrol show node`'s GresUsed: a
    GPU given whole (`gpu:h100:3(IDX:0-2)`) or in part (an `mps` or `shard` share on it:
    22.05 `mps:h100:1(IDX:0)`, 24.11+ per device `shard:h100:2(0/8,0/8,0/8,2/8)`, 26.05
    `-/8` for a device given whole). Slurm gives a GPU either whole or as shares, never
    both, so any use makes it busy for a pack."""
    busy: set[int] = set()
    unplaced = 0
    for item in re.findall(r"(\w+)(?::[^:(,]+)?:(\d+)\(([^)]*)\)", gres_used or ""):
        name, count, detail = item[0], int(item[1]), item[2]
        if name not in ("gpu", "mps", "shard") or count == 0:
            continue
        if detail.startswith("IDX:"):
            idx = _index_list(detail[4:])
            busy |= idx
            if not idx:  # IDX:N/A with a count: held, on devices not named
                unplaced = max(unplaced, count if name == "gpu" else 1)
        else:  # per device: used/total
            for i, used_total in enumerate(detail.split(",")):
                used = used_total.split("/")[0].strip()
                if used.isdigit() and int(used) > 0:
                    busy.add(i)
    return len(busy) + unplaced


def parse_scontrol_nodes(stdout: str) -> list[NodeInfo]:
    """`scontrol show node -o` (one node per line)."""
    return [node_from_scontrol(r) for r in parse_scontrol_oneliner(stdout)]


def tres_items(value: str) -> dict[str, str]:
    """A TRES list in either spelling -> {"gres/mps": "60", "gres/gpu:h100": "2", ...}.

    `scontrol show job` prints TresPerNode as ``gres:mps:60`` up to 23.02 and as
    ``gres/mps:60`` from 23.11 (seen on 24.11 and 26.05); AllocTRES uses ``gres/gpu=1``.
    """
    out: dict[str, str] = {}
    for item in _none_if(value).split(","):
        item = item.strip()
        if not item:
            continue
        if "=" in item:
            key, _, count = item.partition("=")
        else:
            key, _, count = item.rpartition(":")
            if not count.isdigit():
                key, count = item, "1"
        if key.startswith("gres:"):
            key = "gres/" + key[len("gres:"):]
        out[key] = count
    return out


def allocated_gpus(tres: str) -> int | None:
    """Whole GPUs in a job's allocated TRES over all its nodes (squeue's tres_alloc_str,
    `scontrol show job`'s TRES, sacct's AllocTRES: "cpu=4,mem=8G,node=2,billing=4,gres/gpu=4",
    typed ones also as "gres/gpu:h100=4"); None when it names no GPU (an MPS share, none)."""
    items = tres_items(tres)
    if "gres/gpu" in items and items["gres/gpu"].isdigit():
        return int(items["gres/gpu"])
    typed = [int(v) for k, v in items.items() if k.startswith("gres/gpu:") and v.isdigit()]
    return sum(typed) if typed else None


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
