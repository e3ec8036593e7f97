"""How a running pack takes new members on this node (refill, docs/interfaces.md 3b):
the join files the service writes under `<pack_dir>/joins/`, read once each, and the
`<pack_dir>/closed/<node_index>` marker after which the node takes no more.

Apart from the agent loop (loop.py), which launches what these yield exactly like its
first members and decides when the node closes (docs/agent.md "Joins (refill)").
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

from slurm_dlrm.agent.placement import MemberPlacement, parse_join
from slurm_dlrm.agent.reports import ReportWriter
from slurm_dlrm.errors import BadInput

log = logging.getLogger(__name__)


def read_joins(joins_dir: Path, seen: set[str], node_index: int, known: set[int],
               reports: ReportWriter) -> Iterator[list[MemberPlacement]]:
    """This node's new joiners, one job's entries at a time (all W ranks of a multi-rank
    job), in file name order. `seen`: join file names already handled, updated here;
    `known`: job ids this agent runs or ran, updated with each job yielded. Lazily, so
    each job is launched before the next file is read."""
    try:
        names = sorted(n for n in os.listdir(joins_dir)
                       if n.endswith(".json") and not n.startswith(".") and n not in seen)
    except OSError:
        return
    for name in names:
        path = joins_dir / name
        try:
            data = json.loads(path.read_text())
            entries = parse_join(data, f"joins/{name}")
        except (OSError, ValueError, BadInput) as exc:
            # written by the service atomically, so a bad file stays bad: report it once
            seen.add(name)
            reports.agent("join_refused", f"{name}: {exc}")
            continue
        seen.add(name)
        entry = entries[0]
        if entry.node_index != node_index:
            continue  # another node's joiner (a job's ranks share one node)
        if entry.job_id in known:
            continue
        known.add(entry.job_id)
        yield entries


def close_node(closed_path: Path, node_index: int, reports: ReportWriter) -> None:
    """Tell the service this node takes no more joins; reports first, so a joiner the
    service finds unstarted after seeing the marker really never started."""
    reports.flush()
    try:
        closed_path.parent.mkdir(mode=0o700, exist_ok=True)
        tmp = closed_path.with_name(f".{closed_path.name}.tmp")
        tmp.write_text(f"{time.time()}\n")
        os.replace(tmp, closed_path)
        reports.agent("closed", f"node {node_index} takes no more joins")
    except OSError as exc:
        log.warning("cannot write %s: %s", closed_path, exc)
