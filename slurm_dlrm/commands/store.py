"""`slurm-dlrm acct` and `slurm-dlrm report`: click glue over `slurm_dlrm.store`."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import click

from slurm_dlrm.errors import BadInput


def _open_store(db: str | None, site_path: str | None) -> Any:
    from slurm_dlrm.store import Store

    if db is not None:
        return Store(Path(db))
    from slurm_dlrm.service.reconcile import reconcile_orphan_packs
    from slurm_dlrm.service.remote import lease_elsewhere, open_snapshot
    from slurm_dlrm.site import load_site
    from slurm_dlrm.store.store import current_user

    site = load_site(site_path)
    user = current_user()
    lease = lease_elsewhere(site, user)
    if lease is not None:  # another host's service writes it: read the copy it publishes
        return open_snapshot(site, user, lease)
    # your own store: settle packs a stopped or killed service left open, so they are
    # not charged up to now (issue 17); --db names a file to read as it is
    reconcile_orphan_packs(site, user)
    return Store.for_user(site, user)


def _default_partition(site_path: str | None, db: str | None) -> str | None:
    from slurm_dlrm.errors import DlrmError
    from slurm_dlrm.site import load_site

    try:
        site = load_site(site_path)
    except DlrmError:
        return None  # acct --db on a file alone needs no site
    return site.default_partition.name if site.partitions else None


def _complete_acct_columns(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[str]:
    """Shell completion of `acct -o A,B`: the columns, after what is typed already."""
    from slurm_dlrm.store.acct import COLUMNS

    head, _, last = incomplete.rpartition(",")
    prefix = f"{head}," if head else ""
    return [prefix + c.name for c in COLUMNS if c.name.lower().startswith(last.lower())]


def _acct_sweep(sweep: str | None, sort_by: str | None, as_json: bool, as_csv: bool, noheader: bool,
                all_users: bool, db: str | None, site_path: str | None) -> None:
    """`acct --sweep NAME [--sort METRIC]` (issue 39; slurm_dlrm/store/sweep_report.py)."""
    from slurm_dlrm.store.sweep_report import parse_sort, render_sweep, sweep_rows

    if sweep is None:
        raise BadInput("--sort: goes with --sweep NAME")
    if not sweep.strip():
        raise BadInput("--sweep: give the sweep's name (the spec's name)")
    if all_users:
        raise BadInput("--sweep: reads your own store; do not combine it with --all-users")
    if as_json and as_csv:
        raise BadInput("choose one of --json, --csv")
    sort = parse_sort(sort_by or "auc")
    with _open_store(db, site_path) as store:
        rows, fields = sweep_rows(store, sweep.strip(), sort)
    fmt = "json" if as_json else "csv" if as_csv else "table"
    click.echo(render_sweep(rows, fields, fmt, header=not noheader), nl=fmt == "json")


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("-j", "--jobs", "jobs", metavar="ID[,ID...]", help="Only these jobs: N, N_M (task M of array N), N_[M-K].")
@click.option("-u", "--user", "users", metavar="USER[,USER...]", help="Only these users' jobs.")
@click.option("-s", "--state", "states", metavar="STATE[,STATE...]",
              help="Only jobs in these states (PENDING PLANNED RUNNING COMPLETED FAILED OOM CANCELLED TIMEOUT, "
                   "or sacct's PD PL R CD F OOM CA TO).")
@click.option("--pack", metavar="ID|NAME", help="Only members of this pack (any attempt).")
@click.option("--name", "names", metavar="NAME[,NAME...]", help="Only jobs with these names (sacct --name).")
@click.option("-b", "--brief", is_flag=True, help="JobID,State,ExitCode only (sacct --brief).")
@click.option("-S", "--since", "--starttime", "since", metavar="TIME",
              help="Jobs not finished before TIME (2026-11-21, 2026-11-21T14:00, 14:00, 3h, now-1hours, today, @EPOCH).")
@click.option("-E", "--until", "--endtime", "until", metavar="TIME", help="Jobs submitted up to TIME.")
@click.option("-X", "--allocations", is_flag=True,
              help="Accepted for sacct's habit: a DLRM job is one row already (no steps).")
@click.option("-o", "--format", "fmt", metavar="COL[%W],...", default=None, shell_complete=_complete_acct_columns,
              help="Columns to show, comma-separated, optional width (see --helpformat).")
@click.option("--helpformat", is_flag=True, help="List the columns and exit.")
@click.option("--json", "as_json", is_flag=True, help="JSON array of objects (raw values).")
@click.option("--csv", "as_csv", is_flag=True, help="CSV with a header (raw values).")
@click.option("-P", "--parsable", "--parsable2", "parsable", is_flag=True,
              help="'|'-separated, formatted like the table (sacct --parsable2).")
@click.option("--raw", is_flag=True, help="With -P: raw values (bytes, seconds, ISO times) instead.")
@click.option("-n", "--noheader", is_flag=True, help="No header line.")
@click.option("-a", "--all-users", is_flag=True,
              help="Every user's store under the site's store folder, read-only, where readable; "
                   "the table ends with totals per user and per partition.")
@click.option("--totals", is_flag=True, help="Only the totals per user and per partition (any output format).")
@click.option("--sweep", metavar="NAME", help="The variants of a --set/--array sweep (jobs NAME-*): what varied, "
              "held-out metrics, GPU-hours.")
@click.option("--sort", "sort_by", metavar="METRIC", help="With --sweep: order by auc (default), best_auc, ne, "
              "best_ne, log_loss, accuracy, calibration, gpu_hours, job_id; best first.")
@click.option("--db", type=click.Path(dir_okay=False), help="Store file (default: your store from the site config).")
@click.option("--site", "site_path", type=click.Path(dir_okay=False), help="Site config (default: $SLURM_DLRM_SITE, ...).")
def acct(jobs: str | None, users: str | None, states: str | None, pack: str | None, names: str | None,
         brief: bool, since: str | None,
         until: str | None, allocations: bool, fmt: str | None, helpformat: bool, as_json: bool, as_csv: bool,
         parsable: bool, raw: bool, noheader: bool, all_users: bool, totals: bool, sweep: str | None,
         sort_by: str | None, db: str | None, site_path: str | None) -> None:
    """Accounting of DLRM jobs, like sacct: estimates vs measurements and GPU-hours.

    GPU-hours charged split a shared GPU's allocated hours among its members by
    their run time on it; GPU-hours saved compare with one job per GPU (docs/store.md).
    Times are local; -P prints the table's values '|'-separated (like sacct -P);
    --json, --csv and -P --raw print raw values (bytes, seconds, ISO times). ExitCode is
    code:signal as in sacct.

    \b
    Example:
      slurm-dlrm acct                                  # your jobs
      slurm-dlrm acct -s RUNNING,PENDING -S 2h
      slurm-dlrm acct -X -s CD --starttime now-1hours -P
      slurm-dlrm acct --pack 7 -o JobID,State,MaxGPUMem,GPUHours --json
      slurm-dlrm acct -a -S 2026-11-01 -P              # admin: every user's store
      slurm-dlrm acct -a --totals -S 30d --json        # admin: totals per user and partition
      slurm-dlrm acct --sweep my-dlrm --sort auc       # a sweep's variants, best AUC first
    """
    from slurm_dlrm.store import acct as A

    if sweep is not None or sort_by is not None:
        _acct_sweep(sweep, sort_by, as_json, as_csv, noheader, all_users, db, site_path)
        return

    if helpformat:
        click.echo(A.columns_help())
        return
    if sum((as_json, as_csv, parsable)) > 1:
        raise BadInput("choose one of --json, --csv, --parsable")
    if raw and not parsable:
        raise BadInput("--raw: goes with -P/--parsable (--json and --csv are raw already)")
    now = time.time()
    if brief and fmt:
        raise BadInput("-b/--brief: its columns are JobID,State,ExitCode; give -o or -b, not both")
    cols = A.parse_format(fmt or ("JobID,State,ExitCode" if brief else
                                  ("User," if all_users else "") + A.DEFAULT_FORMAT))
    f = A.AcctFilter(
        job_refs=A.parse_job_ids(jobs) if jobs else None,
        users=tuple(u.strip() for u in users.split(",") if u.strip()) if users else None,
        states=A.parse_states(states) if states else None,
        pack=pack.strip() if pack else None,
        names=tuple(n.strip() for n in names.split(",") if n.strip()) if names else None,
        default_partition=_default_partition(site_path, db),
        since=A.parse_time(since, "--since", now) if since else None,
        until=A.parse_time(until, "--until", now) if until else None,
    )
    out_fmt = "json" if as_json else "csv" if as_csv else "parsable" if parsable and raw else "table"
    if totals:
        def fetch(st: Any) -> list[Any]:
            return A.acct_totals(st, f, now)
    elif out_fmt == "table":
        def fetch(st: Any) -> list[Any]:
            return A.acct_table_cells(st, f, cols, now)
    else:
        def fetch(st: Any) -> list[Any]:
            return A.acct_rows(st, f, now)
    from slurm_dlrm.site import load_site

    site = load_site(site_path) if (all_users or db is None) else None
    default_partition = site.default_partition.name if site is not None and site.partitions else ""
    tot = A.Totals({}, {}, [])
    if all_users:
        if db is not None:
            raise BadInput("--all-users reads the site's store folder; do not combine it with --db")
        assert site is not None
        with_totals = totals or out_fmt == "table"

        def fetch_all(st: Any) -> list[Any]:
            got = fetch(st)
            if with_totals:
                tot.add(got if totals else A.acct_totals(st, f, now), default_partition)
            return [] if totals else got

        rows, warnings = A.acct_all_users(site, fetch_all)
        tot.skipped.extend(warnings)
        for w in warnings:
            click.echo(f"slurm-dlrm acct: warning: {w}", err=True)
        # by submit time across stores (cells rows start with submit_time, user, job_id)
        rows.sort(key=(lambda r: tuple(r[:3])) if out_fmt == "table"
                  else (lambda r: (r["submit_time"], r["user"], r["job_id"])))
    else:

        with _open_store(db, site_path) as store:
            rows = fetch(store)
        if totals:
            tot.add(rows, default_partition)
    if totals:
        tot_fmt = "parsable" if parsable else out_fmt
        click.echo(A.render_totals(tot, tot_fmt, header=not noheader), nl=tot_fmt == "json")
        return
    if out_fmt == "table" and parsable:  # sacct -P: the table's values, '|'-separated
        click.echo(A.render_parsable([r[3:] for r in rows], cols, header=not noheader), nl=False)
        return
    if out_fmt == "table":
        click.echo(A.render_table([r[3:] for r in rows], cols, header=not noheader), nl=False)
        if all_users:
            click.echo()
            click.echo(A.render_totals(tot, "table", header=not noheader), nl=False)
        return
    click.echo(A.render(rows, cols, out_fmt, header=not noheader), nl=False)
    if out_fmt == "json":
        click.echo()


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("-S", "--since", metavar="TIME", help="Start of the window (2026-11-21, 3h, 2d, @EPOCH; default 1d).")
@click.option("-E", "--until", metavar="TIME", help="End of the window (default now).")
@click.option("-o", "--output", "output", type=click.Path(dir_okay=False), default="report.html",
              show_default=True, help="HTML file; the PNG files are written beside it.")
@click.option("--max-gpus", type=click.IntRange(1, 256), default=16, show_default=True,
              help="At most this many GPU timelines (the busiest).")
@click.option("--max-packs", type=click.IntRange(1, 1000), default=40, show_default=True,
              help="At most this many packs in the Gantt chart (the latest).")
@click.option("--json", "as_json", is_flag=True, help="Print the files written as JSON.")
@click.option("-a", "--all-users", is_flag=True,
              help="Admins: one page across every user's store (read-only, where readable): totals per "
                   "user and per partition, the stores not read, the jobs of all.")
@click.option("--sweep", metavar="NAME", help="The sweep (jobs NAME-*) to compare in the sweep chart "
              "(default: the latest one with held-out evaluations).")
@click.option("--db", type=click.Path(dir_okay=False), help="Store file (default: your store from the site config).")
@click.option("--site", "site_path", type=click.Path(dir_okay=False), help="Site config (default: $SLURM_DLRM_SITE, ...).")
def report(since: str | None, until: str | None, output: str, max_gpus: int, max_packs: int,
           as_json: bool, all_users: bool, sweep: str | None, db: str | None, site_path: str | None) -> None:
    """Write a self-contained HTML report with plots (matplotlib) of a time window.

    Utilisation timelines per GPU, a Gantt chart of packs and their members,
    estimated vs measured memory, training loss and held-out AUC per job, a sweep's
    variants compared, and a summary table. The PNG files are embedded
    in the HTML (base64) and also written beside it.

    \b
    Example:
      slurm-dlrm report -o report.html                 # the last day
      slurm-dlrm report --since 2026-11-20 --until 2026-11-21 -o nov20.html
      slurm-dlrm report --all-users -S 7d -o cluster.html   # admin: every user's store
    """
    from slurm_dlrm.store import acct as A
    from slurm_dlrm.store.report import write_report

    now = time.time()
    t_until = A.parse_time(until, "--until", now) if until else now
    t_since = A.parse_time(since, "--since", now) if since else t_until - 86400
    if t_since >= t_until:
        raise BadInput("--since must be before --until")
    parent = Path(output).absolute().parent
    if not parent.is_dir():  # as a shell's > does: no folder is made (issue 42: it made /nonexistent/dir)
        raise BadInput(f"-o/--output {output}: no such folder {parent}")
    if all_users:
        from slurm_dlrm.site import load_site
        from slurm_dlrm.store.cluster_report import write_cluster_report

        if db is not None:
            raise BadInput("--all-users reads the site's store folder; do not combine it with --db")
        cw = write_cluster_report(load_site(site_path), Path(output), since=t_since, until=t_until, now=now)
        for w in cw.skipped:
            click.echo(f"slurm-dlrm report: warning: {w}", err=True)
        if as_json:
            click.echo(json.dumps({"html": str(cw.html), "png": [str(p) for p in cw.pngs],
                                   "stores_read": cw.stores_read, "skipped": cw.skipped}))
        else:
            click.echo(str(cw.html))
        return
    spool_dir = None
    if db is None:  # the jobs' metrics files, for the loss curves
        from slurm_dlrm.site import load_site
        from slurm_dlrm.store.store import current_user

        spool_dir = load_site(site_path).spool_dir_for(current_user())
    with _open_store(db, site_path) as store:
        written = write_report(store, Path(output), since=t_since, until=t_until,
                               max_gpus=max_gpus, max_packs=max_packs, now=now, spool_dir=spool_dir,
                               sweep=sweep.strip() if sweep else None)
    if as_json:
        click.echo(json.dumps({"html": str(written.html), "png": [str(p) for p in written.pngs]}))
    else:
        click.echo(str(written.html))
