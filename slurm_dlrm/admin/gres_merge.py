"""Keep a site's own gres.conf lines in the rendered gres.conf (`admin render
--site-gres-conf PATH`).

Slurm reads one gres.conf, next to slurm.conf, and ours describes every GPU of the
site file's GPU nodes. Installed as it is, it drops whatever else the site's file said:
other gres (an fpga, a NIC) on our nodes, and every line for nodes we do not render. So
the site's lines are carried over, except those ours replaces: `gpu`, `mps`, `shard`
and AutoDetect lines whose nodes are all ours (a node-less AutoDetect stays: it is the
default that our per-node AutoDetect lines override). A line that names one of those
gres (or AutoDetect) for nodes both ours and not ours, or a gpu/mps/shard line for every
node (no NodeName), cannot be split safely by us: it is refused, naming the line, and
nothing is written.
"""

from __future__ import annotations

from dataclasses import dataclass

from slurm_dlrm.errors import BadInput
from slurm_dlrm.site import SiteConfig, expand_hostlist

OURS = frozenset({"gpu", "mps", "shard"})  # the gres names our gres.conf describes


@dataclass(frozen=True)
class GresLine:
    number: int  # first line in the file, 1-based
    text: str  # as written (continuations joined)
    fields: dict[str, str]  # keys lower-cased


def parse_gres_conf(text: str) -> list[GresLine]:
    """The configuration lines of a gres.conf: comments dropped, `\\` continuations joined."""
    out: list[GresLine] = []
    pending, start = "", 0
    for i, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].rstrip()
        if not pending:
            start = i
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = " ".join((pending + line).split())  # continuations joined, one space between words
        pending = ""
        if not line:
            continue
        fields: dict[str, str] = {}
        for word in line.split():
            key, sep, value = word.partition("=")
            fields[key.lower()] = value if sep else ""
        out.append(GresLine(start, line, fields))
    return out


def our_gpu_nodes(site: SiteConfig) -> frozenset[str]:
    """Nodes our gres.conf speaks for: every node of a group with GPUs."""
    return frozenset(n for g in site.nodes if g.gpus > 0 for n in expand_hostlist(g.names))


def kept_lines(site_text: str, ours: frozenset[str], where: str) -> list[str]:
    """The site's lines to carry over; BadInput for one that cannot be kept or dropped whole."""
    kept: list[str] = []
    for line in parse_gres_conf(site_text):
        name = line.fields.get("name", "").lower()
        replaced_kind = name in OURS or (not name and "autodetect" in line.fields)
        node_expr = line.fields.get("nodename")
        if node_expr is None:
            # a node-less AutoDetect is the default our per-node AutoDetect lines override
            if name in OURS:
                raise BadInput(f"{where}:{line.number}: {line.text[:120]!r} applies to every node, ours "
                               f"included; give it a NodeName= of the nodes it is for, then render again")
            kept.append(line.text)
            continue
        try:
            nodes = set(expand_hostlist(node_expr))
        except Exception as exc:  # noqa: BLE001 - the site's own text: say which line
            raise BadInput(f"{where}:{line.number}: NodeName={node_expr[:80]!r}: {exc}") from None
        mine = nodes & ours
        if not mine or not replaced_kind:
            kept.append(line.text)  # other nodes, or other gres on our nodes
        elif mine != nodes:
            raise BadInput(f"{where}:{line.number}: {line.text[:120]!r} names nodes in the site file "
                           f"({', '.join(sorted(mine)[:3])}) and others ({', '.join(sorted(nodes - mine)[:3])}); "
                           f"split it so that ours can replace their {name or 'AutoDetect'} lines")
        # else: all ours, and ours describes it: dropped
    return kept


def merge_gres_conf(rendered: str, site_text: str, site: SiteConfig, where: str) -> str:
    """The rendered gres.conf with the site's lines that it does not replace appended."""
    kept = kept_lines(site_text, our_gpu_nodes(site), where)
    if not kept:
        return rendered
    shown = "".join(c if c.isprintable() else "?" for c in where)  # a comment line stays one line
    return (rendered.rstrip("\n") + f"\n\n# Kept from the site's own gres.conf ({shown}): other nodes, other gres.\n"
            + "\n".join(kept) + "\n")
