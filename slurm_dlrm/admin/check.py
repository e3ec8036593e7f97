"""Compare the site config with a live cluster: nodes (CPUs, memory, GPUs and their type,
MPS and shard counts), partitions (nodes, default, time limit), and the slurm.conf keys
the rendered fragment sets (`scontrol show config`: GresTypes, SelectType, the lua plugin,
Prolog/Epilog/TaskProlog, AccountingStorageTRES).

Pure: the live side comes in as `LiveNode`/`LivePartition`, made from the Slurm seam's
`NodeInfo` (`sinfo --json`) and `PartitionRow` (`sinfo`), or from `scontrol show
node|partition -o` records. The CLI fetches them through `slurm_dlrm.slurm`.
"""

from __future__ import annotations

import fnmatch
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
    note: str = ""  # what exactly differs and how to keep the cluster's ("" = nothing to add)

    def __str__(self) -> str:
        text = f"{self.subject}: {self.field}: site {self.site}, cluster {self.cluster}"
        return f"{text} ({self.note})" if self.note else text

    def to_dict(self) -> dict[str, str]:
        return {"subject": self.subject, "field": self.field, "site": self.site, "cluster": self.cluster,
                "note": self.note}


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


# Slurm always accounts these TRES, whatever AccountingStorageTRES says (slurm.conf(5)),
# and `scontrol show config` lists them: they are never the site's to keep.
SLURM_DEFAULT_TRES = frozenset({"cpu", "mem", "energy", "node", "billing", "fs/disk", "vmem", "pages"})
# ... and from 23.02 on, tracking gres/gpu adds these two by itself (seen in 24.11.5's and
# 26.05.5's `scontrol show config` of a fragment that names only gres/gpu items).
SLURM_GPU_IMPLIED_TRES = frozenset({"gres/gpumem", "gres/gpuutil"})


def _norm(item: str) -> str:
    """Items compare as Slurm reads them: case-insensitive, `job_submit/lua` = `lua`."""
    return item.lower().removeprefix("job_submit/")


def _list_difference(key: str, want: list[str], have: str | None, site_key: str, site_value: str,
                     ignore: frozenset[str] = frozenset()) -> Difference | None:
    """A list key (GresTypes, PrologFlags, ...): every item the fragment adds, every item of
    the cluster's it would drop, and the site key that keeps the latter."""
    have_items = sorted(_items(have), key=lambda i: _items_order(have, i))
    wanted = {_norm(i) for i in want}
    present = {_norm(i) for i in have_items}
    missing = [i for i in want if _norm(i) not in present]
    dropped = [i for i in have_items if _norm(i) not in wanted and _norm(i) not in ignore]
    if not missing and not dropped:
        return None
    notes = []
    if missing:
        notes.append(f"missing {','.join(missing)}")
    if dropped:
        keep = ",".join([*(v for v in site_value.split(",") if v), *dropped])
        notes.append(f"the fragment drops {','.join(dropped)}: keep with [slurm] {site_key} = \"{keep}\"")
    return Difference("config", key, ",".join(want), _shown(have), "; ".join(notes))


def _items_order(value: str | None, item: str) -> int:
    return [v.strip() for v in (value or "").split(",")].index(item)


def _shown(value: str | None) -> str:
    return value if value not in (None, "", "(null)") else "-"


def _script_difference(key: str, ours: str, have: str | None, site_key: str, site_value: str) -> Difference | None:
    """Prolog/Epilog/TaskProlog: the fragment sets ours, which runs the site's own
    (`site_value`). A script of the cluster's that the site key does not name would no
    longer run."""
    have_items = sorted(_items(have), key=lambda i: _items_order(have, i))
    if have_items == [ours]:
        return None
    others = [i for i in have_items if i != ours]
    notes = []
    lost = [i for i in others if not (site_value and (i == site_value or fnmatch.fnmatchcase(i, site_value)))]
    if lost:
        notes.append(f"the fragment replaces {','.join(lost)}: set [slurm] {site_key} = \"{lost[0]}\" "
                     "so ours runs it")
    elif others:
        notes.append(f"ours runs {site_value} first ([slurm] {site_key})")
    if ours not in have_items and not notes:
        notes.append("not installed")
    return Difference("config", key, ours, _shown(have), "; ".join(notes))


def compare_config(site: SiteConfig, config: dict[str, str]) -> list[Difference]:
    """Every slurm.conf key the rendered fragment sets whose running value (`scontrol show
    config`) differs: before an install, what the fragment would change on this cluster;
    after it, what is not as rendered. Each names what is missing, and what of the
    cluster's the fragment would drop with the site key that keeps it."""
    ctx = build_context(site)["slurm_conf"]
    s = site.slurm
    diffs: list[Difference | None] = []
    diffs.append(_list_difference("GresTypes", ctx["gres_types"].split(","), config.get("GresTypes"),
                                  "site_gres_types", s.site_gres_types))
    if config.get("SelectType") != "select/cons_tres":
        diffs.append(Difference("config", "SelectType", "select/cons_tres", _shown(config.get("SelectType")),
                                "GPU gres need cons_tres"))
    want_stp = ctx["select_type_parameters"]
    if {_norm(i) for i in _items(config.get("SelectTypeParameters"))} != {_norm(i) for i in _items(want_stp)}:
        diffs.append(Difference("config", "SelectTypeParameters", want_stp, _shown(config.get("SelectTypeParameters")),
                                "the fragment sets [slurm] select_type_parameters"))
    diffs.append(_list_difference("JobSubmitPlugins", ctx["job_submit_plugins"].split(","),
                                  config.get("JobSubmitPlugins"), "site_job_submit_plugins", s.site_job_submit_plugins))
    if site.mps.enabled:
        for key, script, site_key in (("Prolog", "prolog", "site_prolog"), ("Epilog", "epilog", "site_epilog"),
                                      ("TaskProlog", "task_prolog", "site_task_prolog")):
            diffs.append(_script_difference(key, ctx["scripts"][script], config.get(key), site_key,
                                            getattr(s, site_key)))
        diffs.append(_list_difference("PrologFlags", ctx["prolog_flags"].split(","), config.get("PrologFlags"),
                                      "site_prolog_flags", s.site_prolog_flags))
    if ctx["accounting_storage_tres"]:
        diffs.append(_list_difference("AccountingStorageTRES", ctx["accounting_storage_tres"].split(","),
                                      config.get("AccountingStorageTRES"), "site_accounting_tres",
                                      s.site_accounting_tres, ignore=SLURM_DEFAULT_TRES | SLURM_GPU_IMPLIED_TRES))
    return [d for d in diffs if d is not None]


def check_job_submit_script(site: SiteConfig, text: str | None) -> list[Difference]:
    """The job_submit.lua next to slurm.conf, if this host can read it: ours (the standalone
    script) or a site's that calls our module. A site script that does not would let DLRM
    jobs in unchecked."""
    if text is None:
        return []
    from slurm_dlrm.admin.render import MODULE_NAME

    if "slurm-dlrm admin render" in text.split("--]==]", 1)[0] or MODULE_NAME in text:
        return []
    path = f"{site.slurm.config_dir}/job_submit.lua"
    return [Difference("config", "job_submit.lua", f"calls {site.slurm.config_dir}/{MODULE_NAME}",
                       f"{path} (the site's own) does not",
                       "add the dofile() lines of docs/admin.md \"Installs that chain\"")]
