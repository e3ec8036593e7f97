"""`submit --dependency`: a job waits for others of yours, as sbatch's `-d` does.

`TYPE:ID[:ID...][,TYPE:ID...]` with TYPE after (started), afterok (completed),
afternotok (ended otherwise), afterany (ended); ids are slurm-dlrm job ids, an array's id
standing for all its tasks as in Slurm. Kept in the
job's sbatch document under `dependency` (not a pack option: packs are not asked to
wait in Slurm). The service plans a job only once all its dependencies are met; one
that can no longer be met fails the job (Slurm's kill_invalid_depend), with the reason."""

from __future__ import annotations

import json
import re
from typing import Any

from slurm_dlrm.errors import BadInput

TYPES = ("after", "afterok", "afternotok", "afterany", "singleton")
_ITEM = re.compile(r"(after|afterok|afternotok|afterany)((?::\d+)+)")
_ENDED = ("COMPLETED", "FAILED", "OOM", "CANCELLED", "TIMEOUT")


def parse_dependency(text: str) -> list[tuple[str, int]]:
    """`afterok:12:13,afterany:9` -> [("afterok", 12), ("afterok", 13), ("afterany", 9)];
    `singleton` -> ("singleton", 0): after your earlier jobs of the same name ended."""
    out: list[tuple[str, int]] = []
    for item in text.split(","):
        if item.strip() == "singleton":
            out.append(("singleton", 0))
            continue
        m = _ITEM.fullmatch(item.strip())
        if not m:
            raise BadInput(f"--dependency {text}: expected TYPE:ID[:ID...][,...] with TYPE one of "
                           f"{', '.join(TYPES)} (ids are slurm-dlrm job ids)")
        out.extend((m.group(1), int(i)) for i in m.group(2).split(":")[1:])
    return out


def check_known(deps: list[tuple[str, int]], store: Any, user: str) -> None:
    """Every id names a job of this user; else exit 1, as sbatch's "Batch job submission
    failed: Job dependency problem" (the form itself is a usage error, exit 2)."""
    from slurm_dlrm.errors import DlrmError
    from slurm_dlrm.store.errors import UnknownEntity

    for kind, jid in deps:
        if kind == "singleton":
            continue
        try:
            job = store.get_job(jid)
        except UnknownEntity:
            raise DlrmError(f"--dependency: job {jid}: no such job in your store (Job dependency problem); "
                            "nothing recorded") from None
        if job.user != user:
            raise DlrmError(f"--dependency: job {jid}: belongs to {job.user}, not {user}")


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
        if kind == "singleton":
            continue  # ready_jobs holds it while an earlier job of its name is active
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


def array_state(states: list[str]) -> str:
    """One state for the tasks of an array, as a dependency on the array's id sees it
    (Slurm: `afterok:N` on array N waits for all its tasks, issue 42): waiting while any
    task waits or runs; ended COMPLETED only if all did, else as its first other task."""
    for waiting in ("PENDING", "PLANNED", "RUNNING"):
        if waiting in states:
            return waiting
    return next((st for st in states if st != "COMPLETED"), "COMPLETED")


def ready_jobs(store: Any, pending: list[Any]) -> tuple[list[Any], list[tuple[Any, str]]]:
    """The pending jobs whose dependencies are met, and those whose can never be."""
    if not any(job_dependency(j) for j in pending):
        return pending, []
    cache: dict[int, str | None] = {}

    def state_of(jid: int) -> str | None:
        from slurm_dlrm.store.errors import UnknownEntity

        if jid not in cache:
            tasks = [int(r["id"]) for r in store.query("array_tasks", {"array_job_id": jid})]
            try:
                states = [str(store.get_job(t).state) for t in tasks or [jid]]
            except UnknownEntity:
                cache[jid] = None
            else:
                cache[jid] = array_state(states)
        return cache[jid]

    ready, never = [], []
    active_names: dict[tuple[str, str], int] = {}  # (user, name) -> lowest active job id (singleton)
    if any(kind == "singleton" for j in pending for kind, _ in job_dependency(j)):
        for a in store.jobs(["PENDING", "PLANNED", "RUNNING"]):
            key = (a.user, a.name)
            active_names[key] = min(active_names.get(key, a.id), a.id)
    for j in pending:
        if any(kind == "singleton" for kind, _ in job_dependency(j)) and active_names.get((j.user, j.name), j.id) < j.id:
            continue  # Slurm's singleton: an earlier job of this name and user has not ended
        verdict, why = dependency_state(j, state_of)
        if verdict == "ready":
            ready.append(j)
        elif verdict == "never":
            never.append((j, why))
    return ready, never


def within_array_throttle(store: Any, pending: list[Any]) -> list[Any]:
    """The pending jobs less the array tasks over their array's `%N` (sbatch --array
    0-7%2: at most 2 tasks planned or running at once; issue 42: all started), in order."""
    active: dict[int, int] = {}
    out = []
    for j in pending:
        limit = json.loads(j.sbatch_json).get("array_throttle") if j.array_job_id is not None and j.sbatch_json else None
        if not isinstance(limit, int):
            out.append(j)
            continue
        if j.array_job_id not in active:
            active[j.array_job_id] = sum(1 for r in store.query("array_tasks", {"array_job_id": j.array_job_id})
                                         if r["state"] in ("PLANNED", "RUNNING"))
        if active[j.array_job_id] < limit:
            active[j.array_job_id] += 1
            out.append(j)
    return out
