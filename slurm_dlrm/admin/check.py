"""Compare the site config with a live cluster: nodes (CPUs, memory, GPUs and their type,
MPS and shard counts) and partitions (nodes, default, time limit).

Pure: the live side comes in as parsed records (`scontrol show node -o`,
`scontrol show partition -o`, one ``{Key: value}`` dict per line); the CLI fetches them
through the Slurm seam.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from slurm_dlrm.site import SiteConfig, expand_hostlist


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


def compare(site: SiteConfig, nodes: list[dict[str, str]], partitions: list[dict[str, str]]) -> list[Difference]:
    """Every difference between the site file and the cluster's node and partition records."""
    diffs: list[Difference] = []
    live_nodes = {n.get("NodeName", ""): n for n in nodes}
    for group in site.nodes:
        want_gres = _expected_gres(site, group.gpus, group.gpu_model)
        for host in group.hostnames:
            subject = f"node {host}"
            live = live_nodes.get(host)
            if live is None:
                diffs.append(Difference(subject, "NodeName", "defined", "-"))
                continue
            if _int(live.get("CPUTot")) != group.cpus:
                diffs.append(Difference(subject, "CPUs", str(group.cpus), live.get("CPUTot", "-")))
            if _int(live.get("RealMemory")) != group.memory_mib:
                diffs.append(Difference(subject, "RealMemory", str(group.memory_mib), live.get("RealMemory", "-")))
            have_gres = parse_gres(live.get("Gres"))
            for name in sorted(set(want_gres) | set(have_gres)):
                want, have = want_gres.get(name), have_gres.get(name)
                if want is None or have is None:
                    diffs.append(Difference(subject, f"gres/{name}", str(want or "-"), str(have or "-")))
                elif want.count != have.count or (name == "gpu" and want.type != have.type):
                    # Slurm tags mps/shard with the GPU's type; only the gpu type is ours to set.
                    shown = have if name == "gpu" else GresCount(None, have.count)
                    diffs.append(Difference(subject, f"gres/{name}", str(want), str(shown)))

    live_parts = {p.get("PartitionName", ""): p for p in partitions}
    for part in site.partitions:
        subject = f"partition {part.name}"
        live = live_parts.get(part.name)
        if live is None:
            diffs.append(Difference(subject, "PartitionName", "defined", "-"))
            continue
        want_nodes = expand_hostlist(part.nodes)
        raw_nodes = live.get("Nodes", "")
        have_nodes = [] if raw_nodes in ("", "(null)") else expand_hostlist(raw_nodes)
        if sorted(want_nodes) != sorted(have_nodes):
            diffs.append(Difference(subject, "Nodes", part.nodes, raw_nodes or "-"))
        have_default = live.get("Default", "NO").upper() == "YES"
        if have_default != part.default:
            diffs.append(Difference(subject, "Default", "YES" if part.default else "NO",
                                    "YES" if have_default else "NO"))
        have_max = parse_time_limit_minutes(live.get("MaxTime"))
        if have_max != part.max_time_minutes:
            diffs.append(Difference(subject, "MaxTime", f"{part.max_time_minutes} min",
                                    "UNLIMITED" if have_max is None else f"{have_max} min"))
    return diffs
