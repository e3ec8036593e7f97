"""What the service's round (`core`), its recovery and refill halves and `cancel` share:
the pack folder's file names, the agent's own memory, a job's sbatch options, the
members of a pack, and atomic owner-only writes. It sits below them all so that none
of them imports another's helpers (docs/architecture.md)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from slurm_dlrm.osutil import write_atomic  # noqa: F401 - re-exported (cancel, refill, spool)

# What the agent itself takes of each node of a pack, added to --cpus-per-task/--mem
# (the simulator counts them too: packing/model.py).
from slurm_dlrm.packing.model import AGENT_CPUS, AGENT_MEM_MIB  # noqa: F401 - re-exported
from slurm_dlrm.service.sbatch_options import SbatchOptions

SBATCH_MARKER = "sbatch.started"
PLACEMENT_FILE = "placement.json"
SCRIPT_FILE = "pack.sbatch"


# Slurm's messages when slurmctld cannot be reached (Slurm 22.05 slurm_strerror texts):
# the request may not have arrived, so the service retries instead of failing jobs.
UNREACHABLE_MARKERS = (
    "Unable to contact slurm controller",
    "Socket timed out",
    "Zero Bytes were transmitted or received",
    "Connection refused",
    "Communication connection failure",
    "Slurm backup controller in standby mode",
    "Slurm temporarily unable to accept job",
    "Could not establish a configuration source",
)

def is_unreachable(exc: BaseException) -> bool:
    """True if a Slurm failure means "could not talk to slurmctld", not "refused"."""
    from slurm_dlrm.slurm import SlurmError, SlurmNotFound, SlurmTimeout

    if isinstance(exc, SlurmTimeout | SlurmNotFound):
        return True
    if isinstance(exc, SlurmError):
        text = f"{exc.stderr}\n{exc}"
        return any(m.lower() in text.lower() for m in UNREACHABLE_MARKERS)
    return False


def slurm_message(exc: BaseException) -> str:
    """Slurm's own words, one line (`sbatch: error: ...` without the prefix noise)."""
    stderr = getattr(exc, "stderr", "") or ""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()] or lines
    text = errors[-1] if errors else str(exc)
    for prefix in ("sbatch: error: ", "sbatch: fatal: "):
        text = text.removeprefix(prefix)
    return text


def sacct_time(value: str) -> float | None:
    """sacct prints local time without a zone (2026-11-24T14:05:03), or Unknown."""
    import datetime

    try:
        return datetime.datetime.fromisoformat(value).timestamp() if value[:1].isdigit() else None
    except ValueError:
        return None


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


def fault_runs(store: Any, job_id: int) -> int:
    """How many of the job's runs ended by a fault not its own (a lost node or pack, a
    killed agent or member, preemption): its requeues marked `fault` (core._requeue).
    They are bounded apart from the runs its own memory ended (settings.MAX_FAULT_RUNS)."""
    return sum(1 for e in store.events(job_id=job_id, kind="job_state") if (e.get("data") or {}).get("fault"))
