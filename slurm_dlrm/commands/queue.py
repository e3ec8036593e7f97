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
    from slurm_dlrm.service.remote import lease_elsewhere

    lease = lease_elsewhere(site, user)
    if lease is not None:  # its flock may not be seen from here (a network filesystem); its lease is
        service = {**read_status(paths), "running": True, "host": lease.host, "pid": lease.pid}
    return site, user, service


def _open_store(site: Any, user: str, readonly: bool = True) -> Any:
    """The user's store; on a login node whose service does not hold it, the copy that
    service publishes (read-only: cancel and requeue then send it a request)."""
    from slurm_dlrm.service.remote import lease_elsewhere, open_snapshot
    from slurm_dlrm.store.store import Store, store_path_for

    lease = lease_elsewhere(site, user)
    if lease is not None:
        return open_snapshot(site, user, lease)
    if not store_path_for(site, user).exists():
        return None
    return Store.for_user(site, user, readonly=readonly)


def parse_queue_filters(jobs: str | None, states: str | None, names: str | None, users: str | None,
                        user: str) -> dict[str, Any]:
    """squeue's -j/-t/-n/-u as sets (None: no filter); -u names only you (your store)."""
    from slurm_dlrm.store.acct import parse_job_ids, parse_states

    if users and {u.strip() for u in users.split(",") if u.strip()} - {user}:
        raise BadInput(f"-u/--user: your store holds only {user}'s jobs (admins: slurm-dlrm acct --all-users)")
    return {"job_ids": set(parse_job_ids(jobs)) if jobs else None,
            "states": {str(st) for st in parse_states(states)} if states else None,
            "names": {n.strip() for n in names.split(",") if n.strip()} if names else None}


def parse_columns(fmt: str | None) -> list[str]:
    """`-o JOBID,NAME,STATE,REASON` (our headers, any case) -> row keys."""
    from slurm_dlrm.service.queue import HEADERS, QUEUE_COLUMNS

    if not fmt:
        return list(QUEUE_COLUMNS)
    by_header = {h.lower(): k for k, h in HEADERS.items()} | {k.lower(): k for k in HEADERS}
    cols = []
    for item in fmt.split(","):
        key = by_header.get(item.strip().lower())
        if key is None:
            raise BadInput(f"-o/--format: unknown column {item.strip()!r} (one of {','.join(HEADERS.values())})")
        cols.append(key)
    return cols


def complete_columns(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[Any]:
    """Shell completion of `-o A,B,C`: the columns, after what is typed already."""
    from slurm_dlrm.service.queue import HEADERS

    head, _, last = incomplete.rpartition(",")
    prefix = f"{head}," if head else ""
    return [prefix + h for h in HEADERS.values() if h.lower().startswith(last.lower())]


def complete_job_ids(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[Any]:
    """Shell completion of job ids: your jobs in the store (active ones first), with names."""
    from click.shell_completion import CompletionItem

    try:
        from slurm_dlrm.site import load_site
        from slurm_dlrm.store.store import current_user

        site = load_site(ctx.params.get("site_path"))
        user = current_user()
        store = _open_store(site, user)
        if store is None:
            return []
        with store, store.read():
            jobs = store.jobs(user=user)
    except Exception:  # noqa: BLE001 - completion must never print a traceback into the shell
        return []
    jobs.sort(key=lambda j: (str(j.state) not in ("PENDING", "PLANNED", "RUNNING"), -j.id))
    return [CompletionItem(str(j.id), help=f"{j.name} {j.state}") for j in jobs if str(j.id).startswith(incomplete)]


@click.command("queue", context_settings=CTX)
@click.option("-a", "--all", "include_ended", is_flag=True, help="Also list jobs that ended.")
@click.option("-j", "--jobs", metavar="ID[,ID...]", help="Only these jobs (like squeue -j).")
@click.option("-t", "--states", metavar="STATE[,STATE...]",
              help="Only jobs in these states, names or squeue's abbreviations (PD,R,CD,F,CA,OOM,PL); "
                   "ended states imply --all.")
@click.option("-n", "--name", "names", metavar="NAME[,NAME...]", help="Only jobs with these names.")
@click.option("-u", "--user", "users", metavar="USER", help="Accepted for your own user (the store is yours).")
@click.option("--me", is_flag=True, help="Accepted: your jobs are the only ones listed.")
@click.option("-o", "--format", "fmt", metavar="COL[,COL...]", shell_complete=complete_columns,
              help="Columns: JOBID,NAME,STATE,PACK,SLURMID,NODE,GPU,MPS%,GPU_MiB,TRY,REASON (any case).")
@click.option("--noheader", is_flag=True, help="No header line (like squeue -h).")
@click.option("--no-slurm", is_flag=True, help="Do not ask Slurm for the reasons queued packs wait.")
@click.option("--start", "start", is_flag=True,
              help="Waiting jobs and their expected start (START_TIME), like squeue --start: the simulator "
                   "run forward from the current state (running jobs' time left, the queue, --nice, --begin).")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
@site_option
def queue(include_ended: bool, jobs: str | None, states: str | None, names: str | None, users: str | None,
          me: bool, fmt: str | None, noheader: bool, no_slurm: bool, start: bool, as_json: bool,
          site_path: str | None) -> None:
    """List your DLRM jobs, like squeue: pack, node, GPU, MPS share, state, reason.

    A job's REASON says what it waits for: its --begin time, the policy's reason from
    the last dispatch round (no free GPU, GPUs reserved for a waiting multi-GPU job,
    room held for a job that waited longest), a dispatch round, Slurm (when slurmctld
    cannot be reached the service retries with back-off), its pack's Slurm reason,
    or why it ended.

    \b
    Example:
      slurm-dlrm queue
      slurm-dlrm queue --start
      slurm-dlrm queue --me -t PD,R -o JOBID,NAME,STATE,REASON
      slurm-dlrm queue --all --json
    """
    from slurm_dlrm.service.queue import (
        START_COLUMNS,
        format_table,
        queue_rows,
        slurm_pending_reasons,
    )
    from slurm_dlrm.store.states import JOB_TERMINAL

    site, user, service = _context(site_path)
    wanted = parse_queue_filters(jobs, states, names, users, user)
    columns = parse_columns(fmt)
    if wanted["states"] and wanted["states"] & {str(st) for st in JOB_TERMINAL}:
        include_ended = True
    if wanted["job_ids"]:
        include_ended = True  # squeue -j shows a job however it is
    store = _open_store(site, user)
    rows: list[dict[str, Any]] = []
    if store is not None:
        with store:
            reasons: dict[str, str] = {}
            if not no_slurm and (any(True for _ in store.packs(["QUEUED"], user=user))
                                 or any(j.no_pack for j in store.jobs(["PLANNED"], user=user))):
                from slurm_dlrm.slurm import SlurmClient

                reasons = slurm_pending_reasons(SlurmClient(timeout_s=10.0), user)
            rows = queue_rows(store, user=user, service=service, include_ended=include_ended,
                              slurm_reasons=reasons)
            if start:
                rows = with_start_times(store, site, user, [r for r in rows if r["state"] == "PENDING"])
                if fmt is None:
                    columns = list(START_COLUMNS)
    rows = [r for r in rows if (wanted["job_ids"] is None or r["job_id"] in wanted["job_ids"])
            and (wanted["states"] is None or r["state"] in wanted["states"])
            and (wanted["names"] is None or r["name"] in wanted["names"])]
    if as_json:
        click.echo(json.dumps({"service": service, "jobs": rows}, indent=1, sort_keys=True, default=str))
        return
    if service.get("running") is False:
        click.echo("note: your packing service is not running (it starts with `slurm-dlrm submit`, "
                   "or run `slurm-dlrm serve --daemon`)", err=True)
    elif service.get("slurm_ok") is False:
        from slurm_dlrm.service.queue import slurm_error_line

        click.echo(f"note: waiting for Slurm: {slurm_error_line(service.get('slurm_error'), 200)} "
                   f"(slurm-dlrm serve status has the whole error)", err=True)
    table = format_table(rows, columns)
    click.echo(table.split("\n", 1)[1] if noheader and "\n" in table else "" if noheader else table,
               nl=bool(rows) or not noheader)


def with_start_times(store: Any, site: Any, user: str, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows with START_TIME: the expected start in local time (N/A: the forward run
    did not place it)."""
    from slurm_dlrm.service.start_times import expected_start_times

    now = time.time()
    starts = expected_start_times(store, site, user, now)
    out = []
    for r in rows:
        t = starts.get(r["job_id"])
        out.append({**r, "start_time": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(max(t, now)))
                    if t is not None else "N/A", "start_epoch_s": t})
    return out


def job_files(spool_dir: Any, job_id: int, tail: int) -> dict[str, Any]:
    """The job's files `show` points at: its output logs (with their last lines), its
    last metrics line and its newest checkpoint."""
    from slurm_dlrm.agent.outlog import tail_lines
    from slurm_dlrm.service.joblog import last_checkpoint_step, last_metrics, log_paths

    return {"logs": [{"path": str(p), "tail": tail_lines(p, tail)} for p in log_paths(spool_dir, job_id)],
            "last_metrics": last_metrics(spool_dir, job_id),
            "last_eval": last_metrics(spool_dir, job_id, "eval"),
            "stopped_early": last_metrics(spool_dir, job_id, "stop"),
            "checkpoint_step": last_checkpoint_step(spool_dir, job_id)}


@click.command("show", context_settings=CTX)
@click.argument("job_id", type=int, shell_complete=complete_job_ids)
@click.option("-n", "--lines", "tail", type=click.IntRange(0, 1000), default=10, show_default=True,
              help="Last lines of the job's log to print.")
@click.option("--json", "as_json", is_flag=True, help="Print everything as JSON.")
@site_option
def show(job_id: int, tail: int, as_json: bool, site_path: str | None) -> None:
    """Show one job: state, reason, estimate, placements (packs, GPUs), its events, its
    progress (last step, loss, samples/s), and its log's path and last lines.

    \b
    Example:
      slurm-dlrm show 12
      slurm-dlrm show 12 -n 40
      slurm-dlrm show 12 --json | jq .estimate
    """
    from slurm_dlrm.service.queue import job_details

    site, user, service = _context(site_path)
    store = _open_store(site, user)
    if store is None:
        raise BadInput(f"job {job_id}: no such job (you have no store yet)")
    with store:
        d = job_details(store, job_id, user=user, service=service)
    d.update(job_files(site.spool_dir_for(user), job_id, tail))
    if as_json:
        click.echo(json.dumps(d, indent=1, sort_keys=True, default=str))
        return
    est = d.get("estimate") or {}
    prof = est.get("profile") or {}
    gib = float(1 << 30)
    slurm_note = []
    if d["state"] in ("PENDING", "PLANNED") and service.get("slurm_ok") is False:
        err = str(service.get("slurm_error"))
        slurm_note = [f"  Slurm: {err}"]
        if "configuration source" in err or "slurm.conf" in err:
            slurm_note.append(f"  your packing service runs with SLURM_CONF={service.get('slurm_conf') or '(unset)'}: "
                              "export SLURM_CONF and submit again (it restarts the service), or slurm-dlrm serve stop")
    lines = [
        f"job {d['job_id']} ({d['name']}): {d['state']}" + (f" - {d['reason']}" if d["reason"] else ""),
        *slurm_note,
        f"  pack {d['pack'] or '-'}  Slurm job {d['slurm_job_id'] or '-'}  node {d['node'] or '-'}  "
        f"GPU {d['gpu'] if d['gpu'] is not None else '-'}  MPS {d['mps_pct'] or '-'}%  attempt {d['attempt']}",
        f"  estimate on {d['gpu_model']}: GPU peak {float(est.get('gpu_peak_bytes') or 0) / gib:.2f} GiB, "
        f"host peak {float(est.get('host_peak_bytes') or 0) / gib:.2f} GiB, {prof.get('label', '?')}, "
        f"SM {prof.get('sm_util_pct', '?')}%; request GPU {d['gpu_mem_request_mib']} MiB, "
        f"host {d['host_mem_request_mib']} MiB",
        f"  options: {' '.join(f'{k}={v}' for k, v in sorted(d['options'].items())) or '(none)'}",
    ]
    if d.get("no_pack"):
        req = d["no_pack"]
        lines.append(f"  --no-pack: its own Slurm job, --gres={req.get('gres')} --mem={req.get('mem_mib')}M "
                     f"--cpus-per-task={req.get('cpus')}, GPU memory fence {req.get('gpu_mem_mib')} MiB")
    for p in d["placements"]:
        rank = f" rank {p['rank']}/{p['world_size']}" if "rank" in p else ""
        lines.append(f"  run {p['attempt']}: pack {p['pack']} ({p['pack_state']}, Slurm {p['slurm_job_id']}){rank} "
                     f"node {p['node'] or '-'} GPU {p['gpu']} MPS {p['mps_pct']}% fence {p['gpu_mem_limit_mib']} MiB")
    lines.append("  events:")
    for e in d["events"][-20:]:
        when = time.strftime("%H:%M:%S", time.localtime(e["t"]))
        move = f"{e['from'] or ''}->{e['to']} " if e["to"] else ""
        lines.append(f"    {when} {e['kind']:<9} {move}{e['reason']}")
    m = d.get("last_metrics")
    if m:
        sps = m.get("samples_per_s")
        lines.append(f"  progress: step {m.get('step')}" + (f", loss {m['loss']:.4g}" if isinstance(m.get("loss"), (int, float)) else "")
                     + (f", {sps:,.0f} samples/s" if isinstance(sps, (int, float)) else "")
                     + (f" ({time.strftime('%H:%M:%S', time.localtime(m['t']))})" if isinstance(m.get("t"), (int, float)) else ""))
    e = d.get("last_eval")
    if e:
        from slurm_dlrm.train.metrics import human_eval_line

        lines.append(f"  {human_eval_line(e)}")
    stop = d.get("stopped_early")
    if stop:
        lines.append(f"  stopped early (eval.stop_when) at step {stop['step']}: {stop.get('reason')}")
    if d.get("checkpoint_step") is not None:
        lines.append(f"  checkpoint: step {d['checkpoint_step']}")
    if d["logs"]:
        for log in d["logs"]:
            lines.append(f"  log: {log['path']}   (slurm-dlrm log {d['job_id']} [-f])")
            lines.extend(f"    | {line}" for line in log["tail"])
    else:
        lines.append("  log: none yet (the runner writes <spool>/jobs/<id>/output-<node>.log once it starts)")
    click.echo("\n".join(lines))


@click.command("cancel", context_settings=CTX)
@click.argument("job_ids", type=int, nargs=-1, metavar="[JOBID...]", shell_complete=complete_job_ids)
@click.option("-n", "--name", "names", metavar="NAME[,NAME...]", help="Your active jobs with these names.")
@click.option("-t", "--state", "states", metavar="STATE[,STATE...]",
              help="Your active jobs in these states (PENDING/PD, PLANNED/PL, RUNNING/R).")
@click.option("--pack", metavar="ID|NAME", help="Your active jobs in this pack (the PACK of queue).")
@click.option("-u", "--user", "users", metavar="USER", help="Accepted for your own user.")
@click.option("--me", is_flag=True, help="Accepted: you cancel only your own jobs.")
@site_option
def cancel(job_ids: tuple[int, ...], names: str | None, states: str | None, pack: str | None,
           users: str | None, me: bool, site_path: str | None) -> None:
    """Cancel jobs; a member of a running pack stops without disturbing its neighbours.

    The pack's agent is told to stop that member only; it checkpoints and exits, and
    `slurm-dlrm requeue ID` runs it again from there. Like scancel, filters select your
    active jobs (all of the filters, and the ids if given). You can cancel only your
    own jobs.

    \b
    Example:
      slurm-dlrm cancel 12 15
      slurm-dlrm cancel -n tiny-a -t PD        # pending jobs named tiny-a
      slurm-dlrm cancel --pack dlrm-1a2b3c4d   # every member of a pack
    """
    from slurm_dlrm.service.cancel import cancel_job
    from slurm_dlrm.service.daemon import wake
    from slurm_dlrm.service.submit import service_paths
    from slurm_dlrm.slurm import SlurmClient
    from slurm_dlrm.store.errors import UnknownEntity

    site, user, _service = _context(site_path)
    filtered = bool(names or states or pack)
    if not job_ids and not filtered:
        raise BadInput("give job ids, or -n NAME, -t STATE or --pack to select your jobs")
    wanted = parse_queue_filters(None, states, names, users, user)
    if wanted["states"] and wanted["states"] - {"PENDING", "PLANNED", "RUNNING"}:
        raise BadInput(f"-t/--state: only active jobs can be cancelled, not {sorted(wanted['states'])[0]}")
    store = _open_store(site, user, readonly=False)
    if store is None:
        raise BadInput(f"job {job_ids[0]}: no such job (you have no store yet)" if job_ids
                       else "no such job (you have no store yet)")
    with store:
        for jid in job_ids:  # check all first: nothing half-done on a bad id
            try:
                job = store.get_job(jid)
            except UnknownEntity:
                raise BadInput(f"job {jid}: no such job in your store") from None
            if job.user != user:
                raise BadInput(f"job {jid}: belongs to {job.user}, not {user}")
        selected = list(job_ids)
        if filtered:
            pack_id = None
            if pack:
                try:
                    p = store.get_pack(int(pack)) if pack.isdigit() else store.find_pack_by_name(pack)
                except UnknownEntity:
                    p = None
                if p is None or p.user != user:
                    raise BadInput(f"--pack: no pack {pack} of yours")
                pack_id = p.id
            active = store.jobs(["PENDING", "PLANNED", "RUNNING"], user=user)
            selected = [j.id for j in active
                        if (not job_ids or j.id in job_ids)
                        and (wanted["names"] is None or j.name in wanted["names"])
                        and (wanted["states"] is None or str(j.state) in wanted["states"])
                        and (pack_id is None or (j.pack_id == pack_id and str(j.state) != "PENDING"))]
            if not selected:
                click.echo("slurm-dlrm cancel: no active job of yours matches", err=True)
                return
        if store.readonly:  # another host's service writes the store: it cancels them
            _request_elsewhere(site, user, "cancel", selected)
            return
        slurm = SlurmClient(timeout_s=15.0)
        for jid in selected:
            click.echo(cancel_job(store, slurm, jid, user=user))
    wake(service_paths(site, user))


def _request_elsewhere(site: Any, user: str, kind: str, job_ids: list[int]) -> None:
    from slurm_dlrm.service.remote import drop, lease_elsewhere

    lease = lease_elsewhere(site, user)
    name = drop(site, user, kind, {"job_ids": job_ids})
    click.echo(f"{kind} of job(s) {','.join(map(str, job_ids))} requested ({name}) from your packing service on "
               f"host {lease.host if lease else '?'}; it applies it at its next round")


@click.command("log", context_settings=CTX)
@click.argument("job_id", type=int, shell_complete=complete_job_ids)
@click.option("-f", "--follow", is_flag=True, help="Keep printing what the job writes until it ends (like tail -f).")
@click.option("-n", "--lines", "tail", type=click.IntRange(0, 10**6), default=None,
              help="Only the last N lines (default: the whole log).")
@site_option
def log(job_id: int, follow: bool, tail: int | None, site_path: str | None) -> None:
    """Print a job's output: what the runner wrote on every node it ran on (like `hq job cat`).

    The files are `<spool>/jobs/<id>/output-<node>.log`, appended over the job's runs;
    `show ID` prints their paths and last lines.

    \b
    Example:
      slurm-dlrm log 12
      slurm-dlrm log 12 -f          # follow until the job ends
    """
    from slurm_dlrm.agent.outlog import tail_lines
    from slurm_dlrm.service.joblog import log_paths
    from slurm_dlrm.store.states import JOB_TERMINAL

    site, user, _service = _context(site_path)
    store = _open_store(site, user)
    if store is None:
        raise BadInput(f"job {job_id}: no such job (you have no store yet)")
    spool = site.spool_dir_for(user)

    def state() -> Any:
        from slurm_dlrm.store.errors import UnknownEntity

        try:
            with store.read():
                job = store.get_job(job_id)
        except UnknownEntity:
            raise BadInput(f"job {job_id}: no such job in your store") from None
        if job.user != user:
            raise BadInput(f"job {job_id}: belongs to {job.user}, not {user}")
        return job.state

    with store:
        st = state()
        paths = log_paths(spool, job_id)
        offsets: dict[str, int] = {}
        for p in paths:
            prefix = f"==> {p.name} <==\n" if len(paths) > 1 else ""
            if tail is not None:
                text = "\n".join(tail_lines(p, tail, max_bytes=max(16384, tail * 400)))
                text += "\n" if text else ""
                offsets[str(p)] = p.stat().st_size
            else:
                data = p.read_bytes()
                offsets[str(p)] = len(data)
                text = data.decode(errors="replace")
            click.echo(prefix + text, nl=False)
        if not paths and not follow:
            click.echo(f"slurm-dlrm log: job {job_id} ({st}) has no output yet", err=True)
        while follow:
            ended = st in JOB_TERMINAL
            for p in log_paths(spool, job_id):
                off = offsets.get(str(p), 0)
                with open(p, "rb") as f:
                    f.seek(off)
                    new = f.read()
                if new:
                    offsets[str(p)] = off + len(new)
                    click.echo(new.decode(errors="replace"), nl=False)
            if ended:
                break
            time.sleep(0.5)
            st = state()


@click.command("requeue", context_settings=CTX)
@click.argument("job_ids", type=int, nargs=-1, required=True, metavar="JOBID...", shell_complete=complete_job_ids)
@click.option("--no-service", is_flag=True, hidden=True, help="Record only; do not start or wake the service.")
@site_option
def requeue(job_ids: tuple[int, ...], no_service: bool, site_path: str | None) -> None:
    """Run cancelled or failed jobs again, from their last checkpoint (like scontrol requeue).

    A cancelled member stops with a checkpoint (runner exit 5); requeued, it goes back
    to PENDING and its next run, in whatever pack, resumes at that step. A failed job
    (say, a missing data file, now fixed) runs again the same way.

    \b
    Example:
      slurm-dlrm cancel 12 && slurm-dlrm requeue 12
    """
    from slurm_dlrm.service.cancel import requeue_job
    from slurm_dlrm.service.submit import ensure_service

    site, user, _service = _context(site_path)
    store = _open_store(site, user, readonly=False)
    if store is None:
        raise BadInput(f"job {job_ids[0]}: no such job (you have no store yet)")
    from slurm_dlrm.store.errors import UnknownEntity
    from slurm_dlrm.store.states import JobState

    with store:
        for jid in job_ids:  # check all first: nothing half-done on a bad id
            try:
                job = store.get_job(jid)
            except UnknownEntity:
                raise BadInput(f"job {jid}: no such job in your store") from None
            if job.user != user:
                raise BadInput(f"job {jid}: belongs to {job.user}, not {user}")
            if job.state not in (JobState.CANCELLED, JobState.FAILED):
                raise BadInput(f"job {jid}: is {job.state}; only CANCELLED or FAILED jobs can be requeued")
        if store.readonly:  # another host's service writes the store: it requeues them
            _request_elsewhere(site, user, "requeue", list(job_ids))
            return
        for jid in job_ids:
            click.echo(requeue_job(store, site.spool_dir_for(user), jid, user=user))
    if not no_service:
        ensure_service(site, user)
