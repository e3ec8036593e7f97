"""What the user's commands do on a login node whose service does not hold the store
(docs/service.md, "Several login nodes"), and what the service does with their requests.

- `submit`, `cancel`, `requeue`: checked here as far as the published snapshot allows,
  then written as a request file (service/dropbox.py); the service applies it at its next
  round, with the same functions as on its own host, in one transaction each.
- `queue`, `show`, `log`, `acct`, `report`: read the snapshot (service/snapshot.py).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from slurm_dlrm.errors import BadInput, DlrmError
from slurm_dlrm.service.dropbox import Applier, Refused, write_request
from slurm_dlrm.service.hosts import writer_elsewhere
from slurm_dlrm.service.snapshot import snapshot_path
from slurm_dlrm.site import SiteConfig
from slurm_dlrm.store.lease import Lease


def lease_elsewhere(site: SiteConfig, user: str) -> Lease | None:
    """The live lease of the user's service on another host (None: here, or none runs)."""
    from slurm_dlrm.service.daemon import ServicePaths

    return writer_elsewhere(ServicePaths(site.store_dir_for(user)))


def open_snapshot(site: SiteConfig, user: str, lease: Lease) -> Any:
    """The copy the service publishes, opened as another user's store would be: the
    folder and the file ours alone, its schema checked (a view or trigger of someone
    else's is refused), every read bounded by the exporter's budget."""
    from slurm_dlrm.store.db import check_own_dir, open_own_file
    from slurm_dlrm.store.others import UNTRUSTED_READ_BUDGET_S
    from slurm_dlrm.store.store import Store

    store_dir = site.store_dir_for(user)
    check_own_dir(store_dir)
    path = snapshot_path(store_dir)
    try:
        os.close(open_own_file(path, "store copy"))
    except FileNotFoundError:
        raise DlrmError(f"your packing service runs on host {lease.host} and has not published a copy of your "
                        f"store yet ({path}); try again after its next round, or run the command on {lease.host}") from None
    return Store(path, readonly=True, immutable=True, untrusted=True, read_budget_s=UNTRUSTED_READ_BUDGET_S)


def drop(site: SiteConfig, user: str, kind: str, payload: dict[str, Any]) -> str:
    from slurm_dlrm.service.daemon import this_host

    return write_request(site.store_dir_for(user), kind, payload, user=user, host=this_host())


def check_ids(store: Any, job_ids: Sequence[int], user: str, *, requeue: bool = False) -> None:
    """All ids first, as the commands do on the service's host: nothing half-done."""
    from slurm_dlrm.service.cancel import not_requeuable
    from slurm_dlrm.service.sweep_stop import is_paused
    from slurm_dlrm.store.jobids import own_job
    from slurm_dlrm.store.states import JOB_REQUEUABLE

    for jid in job_ids:
        job = own_job(store, int(jid), user)
        if requeue and job.state not in JOB_REQUEUABLE and not is_paused(store, job):  # a paused sweep variant
            raise BadInput(not_requeuable(int(jid), str(job.state)))


def _ids(payload: dict[str, Any]) -> list[int]:
    ids = payload.get("job_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise Refused("job_ids: a list of job ids")
    return ids


def appliers(site: SiteConfig, user: str, slurm: Any) -> dict[str, Applier]:
    """The service's handlers of the three request kinds (run inside the request's
    transaction: service/dropbox.py)."""

    def submit(store: Any, payload: dict[str, Any]) -> dict[str, Any]:
        from slurm_dlrm.service.submit import record_rows

        rows = payload.get("rows")
        if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
            raise Refused("rows: a list of jobs")
        dependency = payload.get("dependency")
        if dependency is not None and not isinstance(dependency, str):
            raise Refused("dependency: a string")
        ids = record_rows(store, rows, user, site.spool_dir_for(user), dependency=dependency)
        return {"job_ids": ids}

    def cancel(store: Any, payload: dict[str, Any]) -> dict[str, Any]:
        from slurm_dlrm.service.cancel import cancel_job

        ids = _ids(payload)
        check_ids(store, ids, user)
        return {"said": [cancel_job(store, slurm, jid, user=user) for jid in ids]}

    def requeue(store: Any, payload: dict[str, Any]) -> dict[str, Any]:
        from slurm_dlrm.service.cancel import requeue_job

        ids = _ids(payload)
        check_ids(store, ids, user, requeue=True)
        return {"said": [requeue_job(store, site.spool_dir_for(user), jid, user=user) for jid in ids]}

    return {"submit": submit, "cancel": cancel, "requeue": requeue}
