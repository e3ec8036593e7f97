"""What the service's round (`core`), its recovery and refill halves and `cancel` share:
the pack folder's file names, the agent's own memory, a job's sbatch options, the
members of a pack, and atomic owner-only writes. It sits below them all so that none
of them imports another's helpers (docs/architecture.md)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from slurm_dlrm.service.sbatch_options import SbatchOptions

SBATCH_MARKER = "sbatch.started"
PLACEMENT_FILE = "placement.json"
SCRIPT_FILE = "pack.sbatch"
AGENT_MEM_MIB = 512  # host memory the agent itself needs on each node, added to --mem


def job_options(job: Any) -> SbatchOptions:
    raw = getattr(job, "sbatch_json", None)
    if not raw:
        return SbatchOptions()
    return SbatchOptions.from_dict(json.loads(raw))


def pack_member_ids(store: Any, pack_id: int, states: Sequence[str]) -> list[int]:
    """Ids of the jobs whose current pack is `pack_id`, in `states` (indexed by pack)."""
    marks = ", ".join("?" * len(states))
    rows = store.conn.execute(f"SELECT id FROM jobs WHERE pack_id = ? AND state IN ({marks}) ORDER BY id",
                              (pack_id, *states)).fetchall()
    return [int(r[0]) for r in rows]


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
