"""Job ids as a Slurm user types them, read by one parser (issue 42).

`12` is job 12, or every task of array 12 when 12 is an array's id (Slurm's array job
id is its first task's job id, as here); `12_3` is task 3 of array 12; `12_[1-3,5]` its
tasks 1, 2, 3 and 5. Python's `int()` takes `2_0` as 20, so no command reads an id with
it: `cancel 2_0` cancelled job 20.

`parse_job_refs` is pure; `resolve_job_refs` reads the store.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from slurm_dlrm.errors import BadInput

_REF = re.compile(r"([0-9]+)(?:_([0-9]+|\[[0-9,:%-]+\]))?")  # ASCII digits only, as Slurm
_MAX_ID = 2**63 - 1  # SQLite's INTEGER


@dataclass(frozen=True)
class JobRef:
    job_id: int  # the job, or the array, the user named
    tasks: tuple[int, ...] | None = None  # array task ids (None: the job itself, or the whole array)
    text: str = ""

    def __str__(self) -> str:
        return self.text or str(self.job_id)


def parse_job_ref(text: str, what: str = "job id") -> JobRef:
    """One id: `N`, `N_M` or `N_[list]` (`slurm-dlrm: error: ...` with exit 2 otherwise)."""
    item = text.strip()
    m = _REF.fullmatch(item)
    if m is None:
        hint = " (a pack's Slurm job: --pack)" if item.startswith("dlrm-") else ""
        raise BadInput(f"{what} {item!r}: expected N, N_M (task M of array N) or N_[M-K]{hint}")
    job_id = int(m.group(1))
    if job_id > _MAX_ID:
        raise BadInput(f"{what} {item!r}: too large")
    tasks: tuple[int, ...] | None = None
    if m.group(2) is not None:
        raw = m.group(2)
        if raw.startswith("["):
            tasks = _task_list(raw[1:-1], f"{what} {item!r}")
        else:
            tasks = (int(raw),)
    return JobRef(job_id, tasks, item)


_MAX_TASKS = 100_000  # Slurm's MaxArraySize tops out at 4,000,001; a list this long is a typo


def _task_list(text: str, where: str) -> tuple[int, ...]:
    """`0-3,7` or `0-15:4` (a `%N` limit, as sbatch --array writes it, is ignored)."""
    out: list[int] = []
    for part in text.split("%", 1)[0].split(","):
        m = re.fullmatch(r"([0-9]{1,7})(?:-([0-9]{1,7})(?::([0-9]{1,7}))?)?", part.strip())
        if m is None:
            raise BadInput(f"{where}: {part!r}: expected M, M-K or M-K:STEP")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) else lo
        step = int(m.group(3)) if m.group(3) else 1
        if hi < lo or step < 1 or len(out) + (hi - lo) // step + 1 > _MAX_TASKS:
            raise BadInput(f"{where}: {part!r}: an empty or too long range")
        out.extend(range(lo, hi + 1, step))
    return tuple(sorted(set(out)))


def parse_job_refs(items: Iterable[str], what: str = "job id") -> tuple[JobRef, ...]:
    """Ids given as arguments and/or comma lists (`-j 1,2_0`), in order, each once."""
    out: list[JobRef] = []
    for item in items:
        for part in _split_list(item):
            ref = parse_job_ref(part, what)
            if ref not in out:
                out.append(ref)
    return tuple(out)


def _split_list(text: str) -> list[str]:
    # commas inside `N_[1,3]` belong to the task list
    parts: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p for p in (p.strip() for p in parts) if p]


def resolve_job_refs(store: Any, refs: Sequence[JobRef], *, missing_ok: bool = False) -> list[int]:
    """Our job ids for the refs, in order, each once. An unknown id or task raises
    BadInput naming it (missing_ok: it is left out, as squeue -j lists what exists)."""
    ids: list[int] = []
    for ref in refs:
        found = _lookup(store, ref)
        if not found and not missing_ok:
            raise BadInput(f"job {ref}: no such job in your store{_pack_hint(store, ref)}")
        ids.extend(j for j in found if j not in ids)
    return ids


def _lookup(store: Any, ref: JobRef) -> list[int]:
    tasks = {int(r["array_task_id"]): int(r["id"]) for r in store.query("array_tasks", {"array_job_id": ref.job_id})}
    if ref.tasks is None:
        if tasks:  # N names the whole array, as in scancel/squeue
            return list(tasks.values())
        return [int(r["id"]) for r in store.query("job_exists", {"id": ref.job_id})]
    # a plain job N has no task N_0: only arrays have tasks
    return [tasks[t] for t in ref.tasks if t in tasks]


def _pack_hint(store: Any, ref: JobRef) -> str:
    """Where the id is a pack's Slurm job id (what squeue shows), say so (issue 42 item 7)."""
    if ref.tasks is not None:
        return ""
    rows = store.query("pack_by_slurm_job_id", {"slurm_job_id": str(ref.job_id)})
    if not rows:
        return ""
    name = rows[0]["name"]
    return (f" ({ref.job_id} is the Slurm job of your pack {name}: slurm-dlrm cancel --pack {name}; "
            f"`slurm-dlrm queue -o JOBID,PACK,SLURMID` lists its members)")


def own_job(store: Any, job_id: int, user: str) -> Any:
    """Job `job_id` of the store, if it is `user`'s; else bad input that says which."""
    from slurm_dlrm.store.errors import UnknownEntity

    try:
        job = store.get_job(job_id)
    except UnknownEntity:
        raise BadInput(f"job {job_id}: no such job in your store") from None
    if job.user != user:
        raise BadInput(f"job {job_id}: belongs to {job.user}, not {user}")
    return job
