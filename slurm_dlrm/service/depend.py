"""`submit --dependency`: a job waits for others of yours, as sbatch's `-d` does.

`TYPE:ID[:ID...][,TYPE:ID...]` with TYPE after (started), afterok (completed),
afternotok (ended otherwise), afterany (ended); ids are slurm-dlrm job ids. Kept in the
job's sbatch document under `dependency` (not a pack option: packs are not asked to
wait in Slurm). The service plans a job only once all its dependencies are met; one
that can no longer be met fails the job (Slurm's kill_invalid_depend), with the reason."""

from __future__ import annotations

import json
import re
from typing import Any

from slurm_dlrm.errors import BadInput

TYPES = ("after", "afterok", "afternotok", "afterany")
_ITEM = re.compile(r"(after|afterok|afternotok|afterany)((?::\d+)+)")
_ENDED = ("COMPLETED", "FAILED", "OOM", "CANCELLED")


def parse_dependency(text: str) -> list[tuple[str, int]]:
    """`afterok:12:13,afterany:9` -> [("afterok", 12), ("afterok", 13), ("afterany", 9)]."""
    out: list[tuple[str, int]] = []
    for item in text.split(","):
        m = _ITEM.fullmatch(item.strip())
        if not m:
            raise BadInput(f"--dependency {text}: expected TYPE:ID[:ID...][,...] with TYPE one of "
                           f"{', '.join(TYPES)} (ids are slurm-dlrm job ids)")
        out.extend((m.group(1), int(i)) for i in m.group(2).split(":")[1:])
    return out


def check_known(deps: list[tuple[str, int]], store: Any, user: str) -> None:
    """Every id names a job of this user (sbatch: "Job dependency problem")."""
    from slurm_dlrm.store.errors import UnknownEntity

    for _kind, jid in deps:
        try:
            job = store.get_job(jid)
        except UnknownEntity:
            raise BadInput(f"--dependency: job {jid}: no such job in your store") from None
        if job.user != user:
            raise BadInput(f"--dependency: job {jid}: belongs to {job.user}, not {user}")


def job_dependency(job: Any) -> list[tuple[str, int]]:
    raw = getattr(job, "sbatch_json", None)
    if not raw:
        return []
    text = json.loads(raw).get("dependency")
    return parse_dependency(text) if text else []


def dependency_state(job: Any, state_of: Any) -> tuple[str, str]:
    """("ready" | "wait" | "never", why) for a pending job; `state_of(id)` -> state or None."""
    waits = []
    for kind, jid in job_dependency(job):
        st = state_of(jid)
        if st is None:
            return "never", f"dependency never satisfied: job {jid} is gone ({kind})"
        ended = st in _ENDED
        if kind == "after":
            ok, never = st not in ("PENDING", "PLANNED"), False
        elif kind == "afterany":
            ok, never = ended, False
        elif kind == "afterok":
            ok, never = st == "COMPLETED", ended and st != "COMPLETED"
        else:  # afternotok
            ok, never = ended and st != "COMPLETED", st == "COMPLETED"
        if never:
            return "never", f"dependency never satisfied: job {jid} ended {st} ({kind})"
        if not ok:
            waits.append(f"{kind}:{jid}")
    if waits:
        return "wait", f"Dependency: waiting for {','.join(waits)}"
    return "ready", ""


def ready_jobs(store: Any, pending: list[Any]) -> tuple[list[Any], list[tuple[Any, str]]]:
    """The pending jobs whose dependencies are met, and those whose can never be."""
    if not any(job_dependency(j) for j in pending):
        return pending, []
    cache: dict[int, str | None] = {}

    def state_of(jid: int) -> str | None:
        from slurm_dlrm.store.errors import UnknownEntity

        if jid not in cache:
            try:
                cache[jid] = str(store.get_job(jid).state)
            except UnknownEntity:
                cache[jid] = None
        return cache[jid]

    ready, never = [], []
    for j in pending:
        verdict, why = dependency_state(j, state_of)
        if verdict == "ready":
            ready.append(j)
        elif verdict == "never":
            never.append((j, why))
    return ready, never
