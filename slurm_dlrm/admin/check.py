"""Compare the site config with a live cluster: nodes (CPUs, memory, GPUs and their type,
MPS and shard counts), partitions (nodes, default, time limit), and the slurm.conf keys
the rendered fragment sets (`scontrol show config`: GresTypes, SelectType, the lua plugin,
Prolog/Epilog/TaskProlog, AccountingStorageTRES).

Pure: the live side comes in as `LiveNode`/`LivePartition`, made from the Slurm seam's
`NodeInfo` (`sinfo --json`) and `PartitionRow` (`sinfo`), or from `scontrol show
node|partition -o` records. The CLI fetches them through `slurm_dlrm.slurm`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from slurm_dlrm.admin.render import build_context
from slurm_dlrm.site import SiteConfig, expand_hostlist
from slurm_dlrm.slurm.base import NodeInfo, PartitionRow


@dataclass(frozen=True)
class Difference:
    subject: str  # "node node1", "partition dlrm", "cluster"
    field: str  # "gres/gpu", "CPUs", "Nodes", ...
    site: str  # the site file's value ("-" when it has none)
    cluster: str  # the live value ("-" when the cluster has none)

    def __str__(self) -> str:
        return f"{self.subject}: {self.field}: site {self.site}, cluster {self.cluster}"

    def to_dict(self) -> dict[str, str]:
        return {"subject": self.subject, "field": self.field, "site": self.site, "cluster": self.cluster}


@dataclass(frozen=True)
class GresCount:
    type: str | None
    count: int

    def __str__(self) -> str:
        return f"{self.type}:{self.count}" if self.type else str(self.count)


@dataclass(frozen=True)
class LiveNode:
    name: str
    cpus: int
    real_memory_mib: int
    gres: str  # configured, e.g. "gpu:h100:4,mps:h100:400"


@dataclass(frozen=True)
class LivePartition:
    name: str
    nodes: tuple[str, ...]  # expanded host names
    nodes_text: str  # as Slurm printed them
    default: bool
    max_time_minutes: int | None  # None = unlimited


def nodes_from_seam(infos: Iterable[NodeInfo]) -> list[LiveNode]:
    """From `SlurmClient.show_nodes()`."""
    return [LiveNode(n.name, n.cpus, n.real_memory_mib, n.gres) for n in infos]


def partitions_from_sinfo(rows: Iterable[PartitionRow]) -> list[LivePartition]:
    """From `SlurmClient.sinfo()`: one row per partition and node state, merged per partition."""
    merged: dict[str, list[PartitionRow]] = {}
    for row in rows:
        merged.setdefault(row.partition, []).append(row)
    out = []
    for name, part_rows in merged.items():
        hosts: list[str] = []
        for row in part_rows:
            if row.nodes and row.nodes != "(null)":
                hosts.extend(expand_hostlist(row.nodes))
        out.append(LivePartition(name, tuple(sorted(set(hosts))), ",".join(r.nodes for r in part_rows),
                                 any(r.default for r in part_rows),
                                 parse_time_limit_minutes(part_rows[0].time_limit)))
    return out


def nodes_from_scontrol(records: Iterable[dict[str, str]]) -> list[LiveNode]:
    """From `scontrol show node -o` records."""
    return [LiveNode(r.get("NodeName", ""), _int(r.get("CPUTot")), _int(r.get("RealMemory")), r.get("Gres", ""))
            for r in records]


def partitions_from_scontrol(records: Iterable[dict[str, str]]) -> list[LivePartition]:
    """From `scontrol show partition -o` records."""
    out = []
    for r in records:
        raw = r.get("Nodes", "")
        hosts = () if raw in ("", "(null)") else tuple(sorted(expand_hostlist(raw)))
        out.append(LivePartition(r.get("PartitionName", ""), hosts, raw, r.get("Default", "NO").upper() == "YES",
                                 parse_time_limit_minutes(r.get("MaxTime"))))
    return out


# `Key=value` pairs of `scontrol show ... -o`; a value runs to the next ` Key=`.
_PAIR = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/.]*)=(.*?)(?=\s+[A-Za-z][A-Za-z0-9_:/.]*=|\s*$)")


def parse_scontrol_oneliner(line: str) -> dict[str, str]:
    """One line of `scontrol show node|partition -o` as a dict."""
    return {m.group(1): m.group(2) for m in _PAIR.finditer(line.strip())}


def parse_scontrol_output(text: str) -> list[dict[str, str]]:
    return [parse_scontrol_oneliner(line) for line in text.splitlines() if line.strip()]


def parse_gres(value: str | None) -> dict[str, GresCount]:
    """``gpu:h100:4(S:0-1),mps:h100:400,shard:32`` -> {gpu: h100:4, mps: h100:400, shard: 32}."""
    out: dict[str, GresCount] = {}
    if not value or value == "(null)":
        return out
    # Commas also separate socket ranges inside "(S:0,1)"; drop those parentheses first.
    for item in re.sub(r"\([^)]*\)", "", value).split(","):
        fields = item.strip().split(":")
        if not fields[0]:
            continue
        name, typ, count = fields[0], None, 1
        if len(fields) == 2:
            if fields[1].isdigit():
                count = int(fields[1])
            else:
                typ = fields[1]
        elif len(fields) >= 3:
            typ, count = fields[1], _int(fields[2])
        out[name] = GresCount(typ, count)
    return out


def parse_time_limit_minutes(value: str | None) -> int | None:
    """Slurm time limit (``UNLIMITED``, ``MM``, ``HH:MM:SS``, ``D-HH:MM:SS``) in minutes; None = unlimited."""
    if not value or value.upper() in ("UNLIMITED", "INFINITE", "NONE"):
        return None
    days = 0
    if "-" in value:
        d, value = value.split("-", 1)
        days = int(d)
    parts = [int(p) for p in value.split(":")]
    if len(parts) == 1:  # minutes
        hours, minutes, seconds = 0, parts[0], 0
    elif len(parts) == 2:  # MM:SS
        hours, minutes, seconds = 0, parts[0], parts[1]
    else:
        hours, minutes, seconds = parts[-3], parts[-2], parts[-1]
    return days * 1440 + hours * 60 + minutes + (1 if seconds else 0)


def _int(value: Any) -> int:
    m = re.match(r"\d+", str(value))
    return int(m.group()) if m else 0


def _expected_gres(site: SiteConfig, gpus: int, gpu_model: str) -> dict[str, GresCount]:
    if gpus == 0:
        return {}
    out = {"gpu": GresCount(gpu_model, gpus)}
    if site.mps.enabled:
        out["mps"] = GresCount(None, gpus * site.mps.mps_per_gpu)
    if site.mps.shards_per_gpu:
        out["shard"] = GresCount(None, gpus * site.mps.shards_per_gpu)
    return out


def compare(site: SiteConfig, nodes: list[LiveNode], partitions: list[LivePartition]) -> list[Difference]:
    """Every difference between the site file and the cluster's nodes and partitions."""
    diffs: list[Difference] = []
    live_nodes = {n.name: n for n in nodes}
    for group in site.nodes:
        want_gres = _expected_gres(site, group.gpus, group.gpu_model)
        for host in group.hostnames:
            subject = f"node {host}"
            live = live_nodes.get(host)
            if live is None:
                diffs.append(Difference(subject, "NodeName", "defined", "-"))
                continue
            if live.cpus != group.cpus:
                diffs.append(Difference(subject, "CPUs", str(group.cpus), str(live.cpus)))
            if live.real_memory_mib != group.memory_mib:
                diffs.append(Difference(subject, "RealMemory", str(group.memory_mib), str(live.real_memory_mib)))
            have_gres = parse_gres(live.gres)
            for name in sorted(set(want_gres) | set(have_gres)):
                want, have = want_gres.get(name), have_gres.get(name)
                if want is None or have is None:
                    diffs.append(Difference(subject, f"gres/{name}", str(want or "-"), str(have or "-")))
                elif want.count != have.count or (name == "gpu" and want.type != have.type):
                    # Slurm tags mps/shard with the GPU's type; only the gpu type is ours to set.
                    shown = have if name == "gpu" else GresCount(None, have.count)
                    diffs.append(Difference(subject, f"gres/{name}", str(want), str(shown)))

    live_parts = {p.name: p for p in partitions}
    for part in site.partitions:
        subject = f"partition {part.name}"
        lp = live_parts.get(part.name)
        if lp is None:
            diffs.append(Difference(subject, "PartitionName", "defined", "-"))
            continue
        if sorted(expand_hostlist(part.nodes)) != list(lp.nodes):
            diffs.append(Difference(subject, "Nodes", part.nodes, lp.nodes_text or "-"))
        if lp.default != part.default:
            diffs.append(Difference(subject, "Default", "YES" if part.default else "NO", "YES" if lp.default else "NO"))
        if lp.max_time_minutes != part.max_time_minutes:
            diffs.append(Difference(subject, "MaxTime", f"{part.max_time_minutes} min",
                                    "UNLIMITED" if lp.max_time_minutes is None else f"{lp.max_time_minutes} min"))
    return diffs


def parse_scontrol_config(text: str) -> dict[str, str]:
    """`scontrol show config`: ``Key = value`` lines (others, e.g. headers, are skipped)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        key = key.strip()
        if not (sep and key and " " not in key):
            continue
        # 23.11+ lists several Prolog/Epilog scripts as `Prolog[0] = ...`, `Prolog[1] = ...`
        # (22.05: one `Prolog = ...`): join them into one comma-separated value.
        m = re.fullmatch(r"(\w+)\[(\d+)\]", key)
        if m is not None:
            key = m.group(1)
            if key in out and out[key] not in ("", "(null)"):
                out[key] = f"{out[key]},{value.strip()}"
                continue
        out[key] = value.strip()
    return out


def _items(value: str | None) -> set[str]:
    if not value or value == "(null)":
        return set()
    return {v.strip() for v in value.split(",") if v.strip()}


def compare_config(site: SiteConfig, config: dict[str, str]) -> list[Difference]:
    """The slurm.conf keys `admin render` sets, against the running configuration."""
    ctx = build_context(site)["slurm_conf"]
    diffs: list[Difference] = []

    def differ(key: str, want: str, have: str | None) -> None:
        diffs.append(Difference("config", key, want, have if have not in (None, "", "(null)") else "-"))

    want_gres = _items(ctx["gres_types"])
    if _items(config.get("GresTypes")) != want_gres:
        differ("GresTypes", ctx["gres_types"], config.get("GresTypes"))
    if config.get("SelectType") != "select/cons_tres":
        differ("SelectType", "select/cons_tres", config.get("SelectType"))
    if (config.get("SelectTypeParameters") or "").upper() != ctx["select_type_parameters"].upper():
        differ("SelectTypeParameters", ctx["select_type_parameters"], config.get("SelectTypeParameters"))
    if not {"lua", "job_submit/lua"} & _items(config.get("JobSubmitPlugins")):
        differ("JobSubmitPlugins", "lua", config.get("JobSubmitPlugins"))
    if site.mps.enabled:
        for key, script in (("Prolog", "prolog"), ("Epilog", "epilog"), ("TaskProlog", "task_prolog")):
            if ctx["scripts"][script] not in _items(config.get(key)):
                differ(key, ctx["scripts"][script], config.get(key))
        if "Alloc" not in _items(config.get("PrologFlags")):
            differ("PrologFlags", "Alloc", config.get("PrologFlags"))
    if ctx["accounting_storage_tres"]:
        missing = _items(ctx["accounting_storage_tres"]) - _items(config.get("AccountingStorageTRES"))
        if missing:
            differ("AccountingStorageTRES", ctx["accounting_storage_tres"], config.get("AccountingStorageTRES"))
    return diffs
