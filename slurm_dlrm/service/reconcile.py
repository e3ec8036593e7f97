"""Settle packs whose service is gone, for the commands that read the store.

A pack stays QUEUED/RUNNING in the store until a service round sees its Slurm job end.
If the service was stopped (`serve stop`) or killed before that, nothing moves it, and
`acct` would charge its allocation up to "now" (issue 17). So `queue`, `show`, `acct`
and `report` call `reconcile_orphan_packs` first: when no service runs and the store
has active packs, it takes the service's lock (so no service starts meanwhile and no
two processes move one pack), ingests the packs' agent reports, asks Slurm once
(`squeue`, then `sacct` for the packs gone from it) and records the ends with Slurm's
end time. It never submits, cancels or requeues anything in Slurm: that is the service's
job. If Slurm cannot be reached, the store is left as it is and the command goes on.
"""

from __future__ import annotations

import logging
import signal
from typing import Any

from slurm_dlrm.site import SiteConfig

log = logging.getLogger(__name__)


def reconcile_orphan_packs(site: SiteConfig, user: str, *, slurm: Any = None) -> int:
    """Settle the user's QUEUED/RUNNING packs if no service runs. Returns packs ended."""
    from slurm_dlrm.errors import DlrmError
    from slurm_dlrm.service.daemon import ServiceLock, running_pid
    from slurm_dlrm.service.hosts import LeaseHolder, writer_elsewhere
    from slurm_dlrm.service.submit import service_paths
    from slurm_dlrm.store.states import PackState
    from slurm_dlrm.store.store import Store, store_path_for

    paths = service_paths(site, user)
    if writer_elsewhere(paths) is not None:
        return 0  # a service on another host holds the store (and settles its packs)
    if not store_path_for(site, user).exists() or running_pid(paths) is not None:
        return 0  # nothing recorded yet, or the service does this every round
    from slurm_dlrm.service.native import active_native_jobs

    with Store.for_user(site, user) as store:
        if not store.packs([PackState.QUEUED, PackState.RUNNING], user=user) \
                and not any(j.slurm_job_id for j in active_native_jobs(store, user)):
            return 0
    # While we hold the lock, a `submit` takes us for the service and may send SIGUSR1
    # (wake up): its default action would kill this command.
    old = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        lock = ServiceLock.acquire(paths, attempts=1)
        if lock is None:
            return 0  # a service just started
        with lock, Store.for_user(site, user) as store:
            # No service holds the store anywhere: hold its lease while settling, so a
            # service starting on another host waits for us (service/hosts.py).
            holder = LeaseHolder(site, user, paths, ttl_s=60.0)
            if holder.take(store) is None:
                return 0
            try:
                return _reconcile(store, site, user, slurm)
            except DlrmError as exc:
                log.warning("could not reconcile packs with Slurm: %s", exc)
                return 0
            finally:
                holder.release(store)
    finally:
        signal.signal(signal.SIGUSR1, old)


def _reconcile(store: Any, site: SiteConfig, user: str, slurm: Any) -> int:
    from slurm_dlrm.service.core import PackingService, RoundStats, ServiceSettings
    from slurm_dlrm.service.native import active_native_jobs, observe_native
    from slurm_dlrm.store.states import PackState

    if slurm is None:
        from slurm_dlrm.slurm import SlurmClient

        slurm = SlurmClient(timeout_s=10.0)  # a reader: do not hang on a dead controller
    svc = PackingService(store, slurm, site, ServiceSettings(user=user))
    stats = RoundStats()
    packs = store.packs([PackState.QUEUED, PackState.RUNNING], user=user)
    for pack in packs:
        svc.ingest(pack)
    packs = store.packs([PackState.QUEUED, PackState.RUNNING], user=user)  # reports may have moved some
    # submit --no-pack jobs the service would follow (not the ones whose sbatch may still run)
    native = [j for j in active_native_jobs(store, user) if j.slurm_job_id]
    if not packs and not native:
        return 0
    infos = slurm.squeue(user=user)
    if native:
        before = stats.transitions
        observe_native(svc, native, infos, stats)
        if stats.transitions > before:
            log.info("reconciled %d no-pack job(s) of a service that is gone", stats.transitions - before)
    by_name = {i.name: i for i in infos}
    by_id = {str(i.job_id): i for i in infos}
    ended = 0
    for pack in packs:
        info = by_name.get(pack.name) or by_id.get(pack.slurm_job_id or "")
        if info is not None and not info.state.is_terminal:
            continue  # still queued or running in Slurm: the next service round follows it
        before = stats.transitions
        svc.observe_pack(pack, info, stats)
        ended += stats.transitions > before
    if ended:
        log.info("reconciled %d pack(s) of a service that is gone", ended)
    return ended
