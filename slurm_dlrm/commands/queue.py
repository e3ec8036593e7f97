"""`slurm-dlrm queue`, `show` and `cancel`: click glue over slurm_dlrm.service.queue/core.

Over 600 lines: the squeue/scancel-like commands (queue, show, cancel, log, requeue)
share one reading of job ids, one set of filters and one shell completion, which
belong next to each other; the formats are in slurm_dlrm.service.squeue_format."""

from __future__ import annotations

import json
import sys
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
    from slurm_dlrm.service.squeue_format import parse_squeue_states
    from slurm_dlrm.store.acct import parse_job_ids

    if users and {u.strip() for u in users.split(",") if u.strip()} - {user}:
        raise BadInput(f"-u/--user: your store holds only {user}'s jobs (admins: slurm-dlrm acct --all-users)")
    return {"job_refs": parse_job_ids(jobs) if jobs else None, "job_ids": None,
            "states": parse_squeue_states(states)[0] if states else None,
            "names": {n.strip() for n in names.split(",") if n.strip()} if names else None}


def _sweep_name(job: Any) -> str | None:
    """The name of the sweep with a stopping rule a job is a variant of (`cancel -n NAME` stops them all)."""
    sw = (job.spec or {}).get("sweep")
    if not isinstance(sw, dict) or not sw.get("id"):
        return None
    from slurm_dlrm.service.sweep_stop import sweep_name

    return sweep_name(str(sw["id"]))


def name_matches(row: dict[str, Any], names: set[str]) -> bool:
    """-n NAME: the job's name, or for a task of an array submitted with -J NAME (named
    NAME-<task>) that NAME, as Slurm names every task of an array alike (issue 42)."""
    if row["name"] in names or (row.get("sweep") and row["sweep"] in names):  # a sweep's name: its variants
        return True
    sid = str(row.get("slurm_id") or "")
    return "_" in sid and any(row["name"] == f"{n}-{sid.split('_', 1)[1]}" for n in names)


def parse_columns(fmt: str | None, long: bool = False) -> list[str]:
    """`-o JOBID,NAME,STATE,REASON` (our headers, any case) -> row keys."""
    from slurm_dlrm.service.queue import HEADERS, LONG_COLUMNS, QUEUE_COLUMNS

    if not fmt:
        return list(LONG_COLUMNS if long else QUEUE_COLUMNS)
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


def complete_job_ids(ctx: click.Context, param: click.Parameter, incomplete: str,
                     states: frozenset[str] | None = None) -> list[Any]:
    """Shell completion of job ids: your jobs in the store (active ones first), with names;
    `states`: only jobs in these (cancel offers active jobs, requeue ended ones)."""
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
    return [CompletionItem(str(j.id), help=f"{j.name} {j.state}") for j in jobs
            if str(j.id).startswith(incomplete) and (states is None or str(j.state) in states)]


def complete_active_ids(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[Any]:
    return complete_job_ids(ctx, param, incomplete, frozenset({"PENDING", "PLANNED", "RUNNING"}))


def complete_requeuable_ids(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[Any]:
    return complete_job_ids(ctx, param, incomplete, frozenset({"CANCELLED", "FAILED", "TIMEOUT"}))


def complete_states(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[Any]:
    """`-t PD,R`: squeue's codes and all, after what is typed already."""
    from slurm_dlrm.service.squeue_format import STATE_CODES

    head, _, last = incomplete.rpartition(",")
    prefix = f"{head}," if head else ""
    return [prefix + c for c in [*STATE_CODES.values(), "all"] if c.lower().startswith(last.lower())]


@click.command("queue", context_settings={"help_option_names": ["--help"]})
@click.option("-a", "--all", "include_ended", is_flag=True, help="Also list jobs that ended.")
@click.option("-j", "--jobs", metavar="ID[,ID...]", help="Only these jobs (like squeue -j): N, N_M (task M of "
              "array N), N_[M-K].")
@click.option("-t", "--states", metavar="STATE[,STATE...]", shell_complete=complete_states,
              help="Only jobs in these states, names or squeue's codes (PD,PL,R,CD,F,CA,OOM,TO) or all; "
                   "Slurm's other states (CG, S, ...) match nothing here; ended states imply --all.")
@click.option("-p", "--partition", "partitions", metavar="PART[,PART...]", help="Only jobs of these partitions.")
@click.option("-r", "--array", "one_per_task", is_flag=True,
              help="Accepted (squeue -r): every array task is a line of its own here already.")
@click.option("-l", "--long", "long_format", is_flag=True,
              help="Also PARTITION, TIME and TIME_LIMIT (like squeue -l).")
@click.option("-S", "--sort", "sort", metavar="KEY[,KEY...]",
              help="Sort by squeue's keys (i, j, t, P, M, l, N, r, p) or column names; -KEY descending.")
@click.option("-n", "--name", "names", metavar="NAME[,NAME...]", help="Only jobs with these names.")
@click.option("-u", "--user", "users", metavar="USER", help="Accepted for your own user (the store is yours).")
@click.option("--me", is_flag=True, help="Accepted: your jobs are the only ones listed.")
@click.option("-o", "--format", "fmt", metavar="COL[,COL...]", shell_complete=complete_columns,
              help="Columns: JOBID,NAME,STATE,PACK,SLURMID,NODE,GPU,MPS%,GPU_MiB,TRY,REASON,PARTITION,TIME,"
                   "TIME_LIMIT (any case), or squeue's %-format (\"%.18i %.9P %.8j %.2t %.10M %R\"; %i prints "
                   "an array task as N_M).")
@click.option("-h", "--noheader", is_flag=True,
              help="No header line. -h is squeue's (scripts use `squeue -h -o %i`), so help is --help alone.")
@click.option("--no-slurm", is_flag=True, help="Do not ask Slurm for the reasons queued packs wait.")
@click.option("--start", "start", is_flag=True,
              help="Waiting jobs and their expected start (START_TIME), like squeue --start: the simulator "
                   "run forward from the current state (running jobs' time left, the queue, --nice, --begin).")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
@site_option
def queue(include_ended: bool, jobs: str | None, states: str | None, partitions: str | None, one_per_task: bool,
          long_format: bool,
          sort: str | None, names: str | None, users: str | None,
          me: bool, fmt: str | None, noheader: bool, no_slurm: bool, start: bool, as_json: bool,
          site_path: str | None) -> None:
    """List your DLRM jobs, like squeue: pack, node, GPU, MPS share, state, reason.

    A job's REASON says what it waits for: its --begin time, the policy's reason from
    the last dispatch round (no free GPU, GPUs reserved for a waiting multi-GPU job,
    room held for a job that waited longest), a dispatch round, Slurm (when slurmctld
    cannot be reached the service retries with back-off), its pack's Slurm reason,
    or why it ended.

    Where our habits and squeue's collide, squeue's win here: -h is --noheader (help is
    --help), as `squeue -h -o %i` in scripts expects.

    \b
    Example:
      slurm-dlrm queue
      slurm-dlrm queue -h -o %i -t PD          # ids of pending jobs, as squeue prints them
      slurm-dlrm queue -l --sort=-M            # with TIME and TIME_LIMIT, longest running first
      slurm-dlrm queue --start
      slurm-dlrm queue --me -t PD,R -o JOBID,NAME,STATE,REASON
      slurm-dlrm queue --all --json
    """
    from slurm_dlrm.service.queue import (
        START_COLUMNS,
        STARTED_IN_SLURM,
        format_table,
        queue_rows,
        slurm_pending_reasons,
    )
    from slurm_dlrm.service.squeue_format import (
        is_percent_format,
        parse_squeue_states,
        render_percent,
        sort_rows,
        squeue_time,
        time_limit,
    )
    from slurm_dlrm.store.states import JOB_TERMINAL

    site, user, service = _context(site_path)
    wanted = parse_queue_filters(jobs, states, names, users, user)
    percent = bool(fmt) and is_percent_format(str(fmt))
    columns = parse_columns(None if percent else fmt, long_format)
    if percent:
        render_percent([], str(fmt), False)  # a bad field is a usage error before any work
    if states and parse_squeue_states(states)[1]:
        include_ended = True  # `-t all` or an ended state, as squeue lists them
    if wanted["states"] and wanted["states"] & {str(st) for st in JOB_TERMINAL}:
        include_ended = True
    # squeue -j lists an ended job only with -t (Slurm 22.05: `squeue -j ID` of a cancelled
    # or completed job prints nothing, exit 0); an id that names no job is an error
    store = _open_store(site, user)
    rows: list[dict[str, Any]] = []
    if store is None and wanted["job_refs"]:
        wanted["job_ids"] = set()
    if store is not None:
        with store:
            if wanted["job_refs"]:
                from slurm_dlrm.store.jobids import resolve_job_refs

                with store.read():
                    wanted["job_ids"] = set(resolve_job_refs(store, wanted["job_refs"], missing_ok=True))
                if not wanted["job_ids"]:
                    from slurm_dlrm.errors import DlrmError

                    # squeue -j on ids none of which exists: "slurm_load_jobs error: Invalid job id
                    # specified", exit 1
                    raise DlrmError(f"-j/--jobs {jobs}: invalid job id specified (no such job in your store)")
            reasons: dict[str, str] = {}
            if not no_slurm and (any(True for _ in store.packs(["QUEUED"], user=user))
                                 or any(j.no_pack for j in store.jobs(["PLANNED"], user=user))):
                from slurm_dlrm.slurm import SlurmClient

                reasons = slurm_pending_reasons(SlurmClient(timeout_s=10.0), user)
                if STARTED_IN_SLURM in reasons.values() and service.get("running"):
                    from slurm_dlrm.service.daemon import wake
                    from slurm_dlrm.service.submit import service_paths

                    wake(service_paths(site, user))  # its round sees the start now, not in up to 10 s
            rows = queue_rows(store, user=user, service=service, include_ended=include_ended,
                              slurm_reasons=reasons)
            if start:
                rows = with_start_times(store, site, user, [r for r in rows if r["state"] == "PENDING"])
                if fmt is None:
                    columns = list(START_COLUMNS)
    default_part = site.default_partition.name if site.partitions else ""
    for r in rows:
        r["partition"] = r.get("partition") or default_part
        r["user"] = user
        r["time"] = squeue_time(r.get("time_s"))
        r["time_limit"] = time_limit(r.get("time_limit_min"))
    parts = {p.strip() for p in partitions.split(",") if p.strip()} if partitions else None
    rows = [r for r in rows if (wanted["job_ids"] is None or r["job_id"] in wanted["job_ids"])
            and (wanted["states"] is None or r["state"] in wanted["states"])
            and (wanted["names"] is None or name_matches(r, wanted["names"]))
            and (parts is None or r["partition"] in parts)]
    if sort:
        rows = sort_rows(rows, sort)
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
    if percent:
        text = render_percent(rows, str(fmt), not noheader)
        click.echo(text, nl=bool(text))
        return
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


def resolve_one(store: Any, text: str) -> int:
    """One job id as Slurm reads it (`12`, `12_3`: task 3 of array 12); BadInput if none."""
    from slurm_dlrm.store.jobids import parse_job_ref, resolve_job_refs

    ref = parse_job_ref(text)
    with store.read():
        ids = resolve_job_refs(store, [ref])
    if ref.tasks is None and len(ids) > 1:
        return int(ref.job_id)  # an array's id is its first task's job id, as in Slurm
    if len(ids) != 1:
        raise BadInput(f"job {ref}: names {len(ids)} jobs; give one (N or N_M)")
    return ids[0]


def resolve_many(store: Any, texts: tuple[str, ...]) -> list[int]:
    """Job ids as Slurm reads them, each once, in order; BadInput on the first unknown."""
    from slurm_dlrm.store.jobids import parse_job_refs, resolve_job_refs

    refs = parse_job_refs(texts)
    with store.read():
        return resolve_job_refs(store, refs)


@click.command("show", context_settings=CTX)
@click.argument("job_ref", metavar="JOBID", shell_complete=complete_job_ids)
@click.option("-n", "--lines", "tail", type=click.IntRange(0, 1000), default=10, show_default=True,
              help="Last lines of the job's log to print.")
@click.option("--json", "as_json", is_flag=True, help="Print everything as JSON.")
@site_option
def show(job_ref: str, tail: int, as_json: bool, site_path: str | None) -> None:
    """Show one job: state, reason, estimate, placements (packs, GPUs), its events, its
    progress (last step, loss, samples/s), and its log's path and last lines.

    \b
    Example:
      slurm-dlrm show 12
      slurm-dlrm show 12 -n 40
      slurm-dlrm show 12 --json | jq .estimate
      slurm-dlrm show 12_3           # task 3 of array 12
    """
    from slurm_dlrm.service.queue import job_details
    from slurm_dlrm.store.jobids import parse_job_ref

    parse_job_ref(job_ref)  # the form first: a usage error whether or not a store exists
    site, user, service = _context(site_path)
    store = _open_store(site, user)
    if store is None:
        raise BadInput(f"job {job_ref}: no such job (you have no store yet)")
    with store:
        job_id = resolve_one(store, job_ref)
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
    if d.get("no_pack") and int(d["no_pack"].get("nodes") or 1) > 1:
        req = d["no_pack"]
        lines.append(f"  not packed: {req['nodes']} nodes x {req.get('ranks_per_node')} ranks (one Slurm job, srun "
                     f"starts a runner per rank), --gres={req.get('gres')} per node --mem={req.get('mem_mib')}M per "
                     f"node --cpus-per-task={req.get('cpus')}{' --exclusive' if req.get('exclusive') else ''}, GPU "
                     f"memory fence {req.get('gpu_mem_mib')} MiB per rank")
    elif d.get("no_pack"):
        req = d["no_pack"]
        lines.append(f"  --no-pack: its own Slurm job, --gres={req.get('gres')} --mem={req.get('mem_mib')}M "
                     f"--cpus-per-task={req.get('cpus')}, GPU memory fence {req.get('gpu_mem_mib')} MiB")
    for p in d["placements"]:
        rank = f" rank {p['rank']}/{p['world_size']}" if "rank" in p else ""
        lines.append(f"  run {p['attempt']}: pack {p['pack']} ({p['pack_state']}, Slurm {p['slurm_job_id'] or '-'}){rank} "
                     f"node {p['node'] or '-'} GPU {p['gpu']} MPS {p['mps_pct']}% fence {p['gpu_mem_limit_mib']} MiB "
                     f"host {p['host_mem_limit_mib']} MiB")  # a host OOM's retry shows its larger share of --mem
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
@click.argument("job_refs", nargs=-1, metavar="[JOBID...]", shell_complete=complete_active_ids)
@click.option("-n", "--name", "names", metavar="NAME[,NAME...]", help="Your active jobs with these names.")
@click.option("-t", "--state", "states", metavar="STATE[,STATE...]",
              help="Your active jobs in these states (PENDING/PD, PLANNED/PL, RUNNING/R).")
@click.option("--pack", metavar="ID|NAME", help="Your active jobs in this pack (the PACK of queue).")
@click.option("-u", "--user", "users", metavar="USER",
              help="Your own user; alone, as scancel -u, it selects all your active jobs.")
@click.option("--me", is_flag=True, help="All your active jobs when alone (scancel --me); you cancel only your own.")
@click.option("-s", "--signal", "signal_name", metavar="SIG", hidden=True)
@site_option
def cancel(job_refs: tuple[str, ...], names: str | None, states: str | None, pack: str | None,
           users: str | None, me: bool, signal_name: str | None, site_path: str | None) -> None:
    """Cancel jobs; a member of a running pack stops without disturbing its neighbours.

    The pack's agent is told to stop that member only; it checkpoints and exits, and
    `slurm-dlrm requeue ID` runs it again from there. Like scancel, filters select your
    active jobs (all of the filters, and the ids if given). You can cancel only your
    own jobs. As scancel: the ids that name your jobs are cancelled, each other one is
    an error line on stderr, and the exit status stays 0 (Slurm 22.05's); what was done
    goes to stderr too (scancel prints nothing). 12_3 is task 3 of array 12; 12, the
    whole array.

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
    from slurm_dlrm.store.jobids import parse_job_refs

    parse_job_refs(job_refs)  # the form first: `2_0` is task 0 of array 2, never job 20
    if signal_name is not None:
        raise BadInput("-s/--signal: a member is stopped only with its checkpoint (slurm-dlrm cancel ID); to send "
                       "a signal to a whole pack, scancel --signal=SIG the SLURMID that slurm-dlrm queue shows")
    site, user, _service = _context(site_path)
    filtered = bool(names or states or pack or users or me)
    if not job_refs and not filtered:
        raise BadInput("give job ids, or -n NAME, -t STATE or --pack to select your jobs")
    wanted = parse_queue_filters(None, states, names, users, user)
    if wanted["states"] and wanted["states"] - {"PENDING", "PLANNED", "RUNNING"}:
        raise BadInput(f"-t/--state: only active jobs can be cancelled, not {sorted(wanted['states'])[0]}")
    store = _open_store(site, user, readonly=False)
    if store is None:
        raise BadInput(f"job {job_refs[0]}: no such job (you have no store yet)" if job_refs
                       else "no such job (you have no store yet)")
    with store:
        # As scancel: the ids that name your jobs are cancelled, each other one is an error
        # line (issue 42: `cancel 33 27 9999` cancelled nothing); the exit status is
        # scancel's too (Slurm 22.05: 0 with "Invalid job id specified" on stderr).
        job_ids = []
        for text in job_refs:
            try:
                found = resolve_many(store, (text,))
            except BadInput as exc:
                click.echo(f"slurm-dlrm: error: {exc}", err=True)
                continue
            for jid in found:
                job = store.get_job(jid)
                if job.user != user:
                    click.echo(f"slurm-dlrm: error: job {jid}: belongs to {job.user}, not {user}", err=True)
                elif jid not in job_ids:
                    job_ids.append(jid)
        if job_refs and not job_ids and not filtered:
            return
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
                        and (wanted["names"] is None or name_matches(
                            {"name": j.name, "slurm_id": f"{j.array_job_id}_{j.array_task_id}"
                             if j.array_job_id is not None else str(j.id), "sweep": _sweep_name(j)},
                            wanted["names"]))
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
            # what was done, on stderr: scancel prints nothing on stdout (issue 42's habits table)
            click.echo(cancel_job(store, slurm, jid, user=user), err=True)
    wake(service_paths(site, user))


def _wait_for_cancels(store: Any, site: Any, user: str, job_ids: list[int]) -> None:
    """Jobs whose cancel is on its way (the member checkpoints first, seconds): wait for
    it to land, so `cancel 12 && requeue 12` works as the help says (issue 42), bounded
    by the agent's grace before it kills a member that does not stop."""
    from slurm_dlrm.service.cancel import cancel_in_flight
    from slurm_dlrm.service.daemon import wake
    from slurm_dlrm.service.submit import service_paths

    def waiting() -> list[int]:
        with store.read():
            return [j for j in job_ids if cancel_in_flight(store, store.get_job(j))]

    pending = waiting()
    if not pending:
        return
    wait_s = site.agent.term_grace_s + 30.0
    click.echo(f"slurm-dlrm requeue: waiting for the cancel of job(s) {','.join(map(str, pending))} to land "
               f"(the member checkpoints first; at most {wait_s:.0f} s)", err=True)
    deadline = time.monotonic() + wait_s
    while pending and time.monotonic() < deadline:
        wake(service_paths(site, user))
        time.sleep(0.5)
        pending = waiting()
    if pending:
        from slurm_dlrm.errors import DlrmError

        raise DlrmError(f"job {pending[0]}: its cancel has not landed after {wait_s:.0f} s "
                        f"(slurm-dlrm show {pending[0]}); requeue it once it is CANCELLED")


def _request_elsewhere(site: Any, user: str, kind: str, job_ids: list[int]) -> None:
    from slurm_dlrm.service.remote import drop, lease_elsewhere

    lease = lease_elsewhere(site, user)
    name = drop(site, user, kind, {"job_ids": job_ids})
    click.echo(f"{kind} of job(s) {','.join(map(str, job_ids))} requested ({name}) from your packing service on "
               f"host {lease.host if lease else '?'}; it applies it at its next round")


@click.command("log", context_settings=CTX)
@click.argument("job_ref", metavar="JOBID", shell_complete=complete_job_ids)
@click.option("-f", "--follow", is_flag=True, help="Keep printing what the job writes until it ends (like tail -f).")
@click.option("-n", "--lines", "tail", type=click.IntRange(0, 10**6), default=None,
              help="Only the last N lines (default: the whole log).")
@site_option
def log(job_ref: str, follow: bool, tail: int | None, site_path: str | None) -> None:
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
    from slurm_dlrm.store.jobids import parse_job_ref
    from slurm_dlrm.store.states import JOB_TERMINAL

    parse_job_ref(job_ref)
    site, user, _service = _context(site_path)
    store = _open_store(site, user)
    if store is None:
        raise BadInput(f"job {job_ref}: no such job (you have no store yet)")
    spool = site.spool_dir_for(user)

    def state() -> Any:
        from slurm_dlrm.store.jobids import own_job

        with store.read():
            return own_job(store, job_id, user).state

    with store:
        job_id = resolve_one(store, job_ref)
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
@click.argument("job_refs", nargs=-1, required=True, metavar="JOBID...", shell_complete=complete_requeuable_ids)
@click.option("--no-service", is_flag=True, hidden=True, help="Record only; do not start or wake the service.")
@site_option
def requeue(job_refs: tuple[str, ...], no_service: bool, site_path: str | None) -> None:
    """Run cancelled, failed or timed-out jobs again, from their last checkpoint (like scontrol requeue).

    A cancelled member stops with a checkpoint (runner exit 5); requeued, it goes back
    to PENDING and its next run, in whatever pack, resumes at that step. A sweep
    variant paused at a rung (queue: SweepPaused) is promoted by hand the same way. A failed job
    (say, a missing data file, now fixed) or one that reached its time limit (TIMEOUT)
    runs again the same way. A job whose cancel is still on its way is waited for.

    \b
    Example:
      slurm-dlrm cancel 12 && slurm-dlrm requeue 12
    """
    from slurm_dlrm.service.cancel import not_requeuable, requeue_job
    from slurm_dlrm.service.native import is_multinode_job, resubmit_native
    from slurm_dlrm.service.submit import ensure_service
    from slurm_dlrm.service.sweep_stop import is_paused
    from slurm_dlrm.store.jobids import parse_job_refs
    from slurm_dlrm.store.states import JOB_REQUEUABLE

    parse_job_refs(job_refs)
    site, user, _service = _context(site_path)
    store = _open_store(site, user, readonly=False)
    if store is None:
        raise BadInput(f"job {job_refs[0]}: no such job (you have no store yet)")
    from slurm_dlrm.store.jobids import own_job

    with store:
        job_ids = resolve_many(store, job_refs)
        if not store.readonly:
            _wait_for_cancels(store, site, user, job_ids)
        for jid in job_ids:  # check all first: nothing half-done on a bad id
            job = own_job(store, jid, user)
            if job.state not in JOB_REQUEUABLE and not is_paused(store, job):  # a paused sweep variant: promoted
                raise BadInput(not_requeuable(jid, str(job.state)))
        if store.readonly:  # another host's service writes the store: it requeues them
            _request_elsewhere(site, user, "requeue", list(job_ids))
            return
        for jid in job_ids:
            job = own_job(store, jid, user)
            if is_multinode_job(job):  # its own Slurm job: sbatch it again (service/native.py)
                from slurm_dlrm.service.joblog import last_checkpoint_step
                from slurm_dlrm.slurm import SlurmClient

                step = last_checkpoint_step(site.spool_dir_for(user), jid)
                how = f"resumes from its checkpoint at step {step}" if step is not None else "starts from step 0"
                click.echo(resubmit_native(store, SlurmClient(), job, spool_dir=site.spool_dir_for(user),
                                           python=sys.executable, reason=f"requeued by the user; it {how}", how=how))
                continue
            click.echo(requeue_job(store, site.spool_dir_for(user), jid, user=user))
    if not no_service:
        ensure_service(site, user)
