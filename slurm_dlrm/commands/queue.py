"""`slurm-dlrm queue`, `show` and `cancel`: click glue over slurm_dlrm.service.queue/core."""

from __future__ import annotations

import json
import time
from typing import Any

import click

from slurm_dlrm.commands.submit import site_option
from slurm_dlrm.errors import BadInput

CTX = {"help_option_names": ["-h", "--help"]}


def _context(site_path: str | None) -> tuple[Any, str, dict[str, Any]]:
    from slurm_dlrm.service.daemon import read_status, running_pid
    from slurm_dlrm.service.reconcile import reconcile_orphan_packs
    from slurm_dlrm.service.submit import service_paths
    from slurm_dlrm.site import load_site
    from slurm_dlrm.store.store import current_user

    site = load_site(site_path)
    user = current_user()
    paths = service_paths(site, user)
    reconcile_orphan_packs(site, user)  # packs a stopped or killed service left open
    pid = running_pid(paths)
    service = {**read_status(paths), "running": pid is not None} if pid is not None else {"running": False}
    return site, user, service


def _open_store(site: Any, user: str, readonly: bool = True) -> Any:
    from slurm_dlrm.store.store import Store, store_path_for

    if not store_path_for(site, user).exists():
        return None
    return Store.for_user(site, user, readonly=readonly)


@click.command("queue", context_settings=CTX)
@click.option("-a", "--all", "include_ended", is_flag=True, help="Also list jobs that ended.")
@click.option("--no-slurm", is_flag=True, help="Do not ask Slurm for the reasons queued packs wait.")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
@site_option
def queue(include_ended: bool, no_slurm: bool, as_json: bool, site_path: str | None) -> None:
    """List your DLRM jobs, like squeue: pack, node, GPU, MPS share, state, reason.

    A job's REASON says what it waits for: a dispatch round, Slurm (when slurmctld
    cannot be reached the service retries with back-off), its pack's Slurm reason,
    or why it ended.

    \b
    Example:
      slurm-dlrm queue
      slurm-dlrm queue --all --json
    """
    from slurm_dlrm.service.queue import format_table, queue_rows, slurm_pending_reasons

    site, user, service = _context(site_path)
    store = _open_store(site, user)
    rows: list[dict[str, Any]] = []
    if store is not None:
        with store:
            reasons: dict[str, str] = {}
            if not no_slurm and any(True for _ in store.packs(["QUEUED"], user=user)):
                from slurm_dlrm.slurm import SlurmClient

                reasons = slurm_pending_reasons(SlurmClient(timeout_s=10.0), user)
            rows = queue_rows(store, user=user, service=service, include_ended=include_ended,
                              slurm_reasons=reasons)
    if as_json:
        click.echo(json.dumps({"service": service, "jobs": rows}, indent=1, sort_keys=True, default=str))
        return
    if service.get("running") is False:
        click.echo("note: your packing service is not running (it starts with `slurm-dlrm submit`, "
                   "or run `slurm-dlrm serve --daemon`)", err=True)
    elif service.get("slurm_ok") is False:
        click.echo(f"note: waiting for Slurm: {service.get('slurm_error')}", err=True)
    click.echo(format_table(rows))


@click.command("show", context_settings=CTX)
@click.argument("job_id", type=int)
@click.option("--json", "as_json", is_flag=True, help="Print everything as JSON.")
@site_option
def show(job_id: int, as_json: bool, site_path: str | None) -> None:
    """Show one job: state, reason, estimate, placements (packs, GPUs) and its events.

    \b
    Example:
      slurm-dlrm show 12
      slurm-dlrm show 12 --json | jq .estimate
    """
    from slurm_dlrm.service.queue import job_details

    site, user, service = _context(site_path)
    store = _open_store(site, user)
    if store is None:
        raise BadInput(f"job {job_id}: no such job (you have no store yet)")
    with store:
        d = job_details(store, job_id, user=user, service=service)
    if as_json:
        click.echo(json.dumps(d, indent=1, sort_keys=True, default=str))
        return
    est = d.get("estimate") or {}
    prof = est.get("profile") or {}
    gib = float(1 << 30)
    lines = [
        f"job {d['job_id']} ({d['name']}): {d['state']}" + (f" - {d['reason']}" if d["reason"] else ""),
        f"  pack {d['pack'] or '-'}  Slurm job {d['slurm_job_id'] or '-'}  node {d['node'] or '-'}  "
        f"GPU {d['gpu'] if d['gpu'] is not None else '-'}  MPS {d['mps_pct'] or '-'}%  attempt {d['attempt']}",
        f"  estimate on {d['gpu_model']}: GPU peak {float(est.get('gpu_peak_bytes') or 0) / gib:.2f} GiB, "
        f"host peak {float(est.get('host_peak_bytes') or 0) / gib:.2f} GiB, {prof.get('label', '?')}, "
        f"SM {prof.get('sm_util_pct', '?')}%; request GPU {d['gpu_mem_request_mib']} MiB, "
        f"host {d['host_mem_request_mib']} MiB",
        f"  options: {' '.join(f'{k}={v}' for k, v in sorted(d['options'].items())) or '(none)'}",
    ]
    for p in d["placements"]:
        lines.append(f"  run {p['attempt']}: pack {p['pack']} ({p['pack_state']}, Slurm {p['slurm_job_id']}) "
                     f"node {p['node'] or '-'} GPU {p['gpu']} MPS {p['mps_pct']}% fence {p['gpu_mem_limit_mib']} MiB")
    lines.append("  events:")
    for e in d["events"][-20:]:
        when = time.strftime("%H:%M:%S", time.localtime(e["t"]))
        move = f"{e['from'] or ''}->{e['to']} " if e["to"] else ""
        lines.append(f"    {when} {e['kind']:<9} {move}{e['reason']}")
    click.echo("\n".join(lines))


@click.command("cancel", context_settings=CTX)
@click.argument("job_ids", type=int, nargs=-1, required=True, metavar="JOBID...")
@site_option
def cancel(job_ids: tuple[int, ...], site_path: str | None) -> None:
    """Cancel jobs; a member of a running pack stops without disturbing its neighbours.

    The pack's agent is told to stop that member only; the pack's Slurm job ends
    when its last member does. You can cancel only your own jobs.

    \b
    Example:
      slurm-dlrm cancel 12 15
    """
    from slurm_dlrm.service.cancel import cancel_job
    from slurm_dlrm.service.daemon import wake
    from slurm_dlrm.service.submit import service_paths
    from slurm_dlrm.slurm import SlurmClient
    from slurm_dlrm.store.errors import UnknownEntity

    site, user, _service = _context(site_path)
    store = _open_store(site, user, readonly=False)
    if store is None:
        raise BadInput(f"job {job_ids[0]}: no such job (you have no store yet)")
    with store:
        for jid in job_ids:  # check all first: nothing half-done on a bad id
            try:
                job = store.get_job(jid)
            except UnknownEntity:
                raise BadInput(f"job {jid}: no such job in your store") from None
            if job.user != user:
                raise BadInput(f"job {jid}: belongs to {job.user}, not {user}")
        slurm = SlurmClient(timeout_s=15.0)
        for jid in job_ids:
            click.echo(cancel_job(store, slurm, jid, user=user))
    wake(service_paths(site, user))
