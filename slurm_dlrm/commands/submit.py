"""`slurm-dlrm submit`: click glue over slurm_dlrm.service.submit."""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any

import click

from slurm_dlrm.errors import EXIT_OK, EXIT_RUNTIME, BadInput

# sbatch options that apply to a pack; the same names as sbatch's.
_SBATCH_OPTIONS = (
    ("partition", ("-p", "--partition"), "PARTITION", "Slurm partition of the pack."),
    ("account", ("-A", "--account"), "ACCOUNT", "Account charged for the pack."),
    ("time_minutes", ("-t", "--time"), "TIME",
     "Time limit: MIN, MIN:SEC, H:M:S, D-H, D-H:M, D-H:M:S or UNLIMITED."),
    ("qos", ("-q", "--qos"), "QOS", "Quality of service."),
    ("job_name", ("-J", "--job-name"), "NAME", "Name of the job(s) (default: the spec's name)."),
    ("constraint", ("-C", "--constraint"), "FEATURES", "Node features the pack needs."),
    ("mail_type", ("--mail-type",), "TYPE[,TYPE]", "BEGIN, END, FAIL, ALL, ... (mail about the pack)."),
    ("mail_user", ("--mail-user",), "ADDRESS", "Where Slurm sends mail."),
    ("output", ("-o", "--output"), "PATTERN", "A link to this job's own log (%j its id, %x its name, %A_%a)."),
    ("error", ("-e", "--error"), "PATTERN", "Also a link to its log (stdout and stderr are one log)."),
    ("begin_time", ("-b", "--begin"), "TIME",
     "Start no sooner than TIME, as sbatch: now+1hour, 16:00, 2026-12-24T08:00, tomorrow (docs/service.md)."),
)


def sbatch_option_decorators(fn: Any) -> Any:
    for attr, names, metavar, help_text in reversed(_SBATCH_OPTIONS):
        fn = click.option(*names, attr, metavar=metavar, default=None, help=help_text)(fn)
    # sbatch --nice[=N]: a bare --nice lowers the priority by 100. A plain value option:
    # click's optional value read `--nice=-5` as an option -5 and `--nice spec.yaml` as
    # the value (issue 42); submit() takes a value that is no number for the spec it is.
    fn = click.option("--nice", "nice", metavar="[N]", default=None,
                      help="Priority among your own jobs, as sbatch --nice: higher N goes later "
                           "(0..2147483645; negative: root only; bare --nice: 100).")(fn)
    return fn


def site_option(fn: Any) -> Any:
    return click.option("--site", "site_path", type=click.Path(dir_okay=False), default=None,
                        help="Site config (default: $SLURM_DLRM_SITE, /etc/slurm-dlrm/site.toml, the repo's).")(fn)


@click.command("submit", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("specs", nargs=-1, required=False, metavar="SPEC...")
@sbatch_option_decorators
@click.option("--parsable", is_flag=True, help="Print only the job ids, one per line (like sbatch --parsable: "
              "an --array is one line, its array id, which cancel, queue -j and -d afterok take whole).")
@click.option("--wait", "wait_", is_flag=True, help="Block with a progress display until the jobs end; "
              "exit 0 only if every job completed.")
@click.option("--no-pack", is_flag=True, help="Submit each spec as one ordinary Slurm job sized from its "
              "estimate (--mem, --cpus-per-task, --gres=gpu:1 or an MPS share); still a job of slurm-dlrm "
              "(queue, show, acct, cancel take its id; show prints its Slurm id). "
              "MPS runs one user's jobs on a GPU at a time: on an MPS share, other users' jobs on the "
              "same GPU take turns with yours unless the site sets [mps] cross_user = \"one-user\".")
@click.option("--set", "sets", metavar="KEY=V1[,V2...]", multiple=True,
              help="A sweep: one job per value of a dotted spec field (e.g. optimizer.lr=0.01,0.1); "
                   "several --set give their product.")
@click.option("--stop", "stop", metavar="asha[:METRIC]",
              help="Stop a sweep's losers (docs/sweeps.md): at rungs min_steps x 3^k a variant goes on only "
                   "if its held-out METRIC (auc, ne or loss; default auc) is among the best third so far; "
                   "the others pause at a checkpoint and resume if later variants lower the cut.")
@click.option("--trials", "trials", metavar="N", type=int, default=None,
              help="Draw N variants instead of a grid: each --set is then a range to sample, "
                   "log:LO..HI (log-uniform), uniform:LO..HI or int:LO..HI (both ends included), "
                   "or a value list to pick from (e.g. --trials 8 --set optimizer.lr=log:1e-4..1e-1 "
                   "--set batch_size=256,512,1024). Seeded random search; show and acct --sweep say "
                   "which trial and values each variant got.")
@click.option("--trial-seed", "trial_seed", metavar="SEED", type=int, default=None,
              help="Seed of --trials' draws (default: the spec's seed): the same seed draws the same variants.")
@click.option("-a", "--array", metavar="INDEXES", help="Copies of each spec like sbatch --array (0-3, 1,3,5, "
              "0-15:4, 0-7%2: at most 2 at once): job <name>-<i> with seed + i; task i of array N is N_i "
              "to cancel, show, queue -j, acct -j.")
@click.option("-d", "--dependency", metavar="TYPE:ID[:ID...]",
              help="Start only after these jobs of yours (slurm-dlrm ids; an array's id: all its tasks): after, "
                   "afterok, afternotok, afterany, or singleton (after your earlier jobs of this name), as sbatch -d.")
@click.option("-D", "--chdir", "chdir", metavar="DIR", type=click.Path(file_okay=False, exists=True),
              help="Relative -o/-e paths are from DIR, as sbatch --chdir (the specs are read from here).")
@click.option("--export", "export", metavar="ALL", hidden=True)
@click.option("--test-only", is_flag=True, help="Validate and estimate, record and submit nothing; print the "
              "sbatch command each job would use (like sbatch --test-only).")
@click.option("--no-service", is_flag=True, hidden=True, help="Record only; do not start or wake the service.")
@click.option("--json", "as_json", is_flag=True, help="Print the recorded jobs and their estimates as JSON.")
@site_option
def submit(specs: tuple[str, ...], parsable: bool, wait_: bool, no_pack: bool, sets: tuple[str, ...],
           stop: str | None, trials: int | None, trial_seed: int | None, array: str | None, dependency: str | None, chdir: str | None, export: str | None, test_only: bool, no_service: bool, as_json: bool, site_path: str | None,
           **sbatch: str | None) -> None:
    """Submit DLRM job specs to the packing service, like sbatch.

    Each SPEC is validated and its memory and compute are estimated; the jobs are
    recorded and the user's packing service (started if needed) packs them onto
    shared GPUs. sbatch options may also be given as `#SBATCH` lines at the top of a
    spec file (read as sbatch reads them; the command line wins). Resources are not
    options: they come from the estimate.

    \b
    Example:
      slurm-dlrm submit examples/sweep/*.yaml -p dlrm -t 30
      slurm-dlrm submit --parsable --wait tiny.yaml
      slurm-dlrm submit --no-pack tiny.yaml      # one plain Slurm job, sized from the estimate:
                                                 # Submitted job 12 (Slurm 4; ...)
      slurm-dlrm submit tiny.yaml --set optimizer.lr=0.01,0.1 --set batch_size=128,256   # 4 jobs
      slurm-dlrm submit tiny.yaml --array 0-3 --test-only
      slurm-dlrm submit tiny.yaml --set optimizer.lr=0.001,0.003,0.01,0.03,0.1 --stop asha
      slurm-dlrm submit tiny.yaml --trials 8 --set optimizer.lr=log:1e-4..1e-1 --set batch_size=256,512,1024
                                                 # 8 jobs drawn at random (seeded) from the ranges

    Exit codes: 0 recorded (with --wait: all jobs completed), 1 a job failed or
    Slurm refused (on a login node whose service runs on another host: or that service
    did not record the jobs within 3 of its rounds, at least 5 s), 2 bad spec or option.

    \b
    Spec format (all fields: slurm-dlrm spec --example):
      name: my-dlrm
      tables: [{name: t0, rows: 100000, dim: 16}]    # or preset: criteo-kaggle
      dense_features: 13
      bottom_mlp: [128, 16]                          # last width = dim
      top_mlp: [128, 1]
      batch_size: 512
      optimizer: {type: adagrad, lr: 0.01}
      steps: 200
      data: {type: synthetic}                        # or {type: criteo-tsv, path: day_0.tsv}
    """
    from slurm_dlrm.service import submit as svc
    from slurm_dlrm.service.sbatch_options import options_from_mapping
    from slurm_dlrm.site import load_site
    from slurm_dlrm.store.store import current_user

    nice = sbatch.get("nice")
    if nice is not None and not re.fullmatch(r"\s*[+-]?\d+\s*", nice):
        specs, sbatch["nice"] = (nice, *specs), "100"  # a bare --nice before a spec
    if not specs:
        raise click.UsageError("Missing argument 'SPEC...'")
    if export is not None and export.strip().upper() != "ALL":
        raise BadInput(f"--export={export}: a member runs with its pack's environment (the packing service's, "
                       "ALL); set variables in the spec's command instead (command: [env, VAR=value, ...])")
    site = load_site(site_path)
    user = current_user()
    cli_options = options_from_mapping(sbatch)
    cwd = os.path.abspath(chdir) if chdir else os.getcwd()
    specs = tuple(os.path.abspath(p) for p in specs) if chdir else specs  # read from here, as sbatch reads its script
    if test_only:
        subs = svc.prepare(specs, cli_options, site, cwd, sets, array, stop, trials, trial_seed)
        test_only_checks(site, user, subs, dependency)
        lines = svc.test_only_lines(subs, site, no_pack=no_pack, user=user)
        if as_json:
            click.echo(json.dumps([{"name": s.name, "sbatch": line} for s, line in zip(subs, lines, strict=True)],
                                  indent=1))
        else:
            for s, line in zip(subs, lines, strict=True):
                click.echo(f"{s.name}: {line}")
            if no_pack and any("--gres=mps:" in line for line in lines):
                click.echo(f"slurm-dlrm: note: {site.mps.cross_user_note()}", err=True)
        return
    if no_pack and stop:
        raise BadInput("--stop: a stopping rule pauses members of packs at their rungs; not with --no-pack")
    prepared = None  # validated and estimated once, handed to the submit below
    if not no_pack:
        # A job over several nodes is never packed: it goes as a Slurm job of its own
        # (service/multinode.py); mixed with packed jobs in one command, say so first.
        prepared = svc.prepare(specs, cli_options, site, cwd, sets, array, stop, trials, trial_seed)
        multi = multinode_names(svc, prepared, site, cwd)
        if multi is not None and stop:
            raise BadInput(f"--stop: {multi[0]} runs over several nodes, not packed; a stopping rule pauses "
                           "members of packs at their rungs")
        if multi is not None:
            no_pack = True
    if no_pack and dependency:
        raise BadInput("--dependency: with --no-pack (or a multi-node job), use sbatch's own -d with Slurm job ids")
    from slurm_dlrm.service.remote import lease_elsewhere

    lease = lease_elsewhere(site, user)
    if lease is not None:
        # Another login node's service writes the store: hand it the jobs (docs/service.md).
        if no_pack or wait_:
            from slurm_dlrm.errors import DlrmError

            raise DlrmError(f"submit {'--no-pack' if no_pack else '--wait'}: your packing service runs on host "
                            f"{lease.host}, which alone writes your store; run this there")
        name, subs = svc.submit_elsewhere(specs, cli_options, site=site, user=user, cwd=cwd, sets=sets,
                                          array=array, dependency=dependency, stop=stop, trials=trials,
                                          trial_seed=trial_seed, prepared=prepared)
        ids = ids_from_elsewhere(site, user, lease.host, name, len(subs))
        print_submitted(ids, subs, parsable=parsable, as_json=as_json)
        return
    if no_pack:
        from slurm_dlrm.slurm import SlurmClient

        client = SlurmClient()
        # as sbatch: no Slurm (or an unsupported release), one line and no row recorded
        results = svc.submit_no_pack(specs, cli_options, site=site, user=user, cwd=cwd, slurm=client,
                                     sets=sets, array=array, start_service=not no_service,
                                     trials=trials, trial_seed=trial_seed, prepared=prepared,
                                     check_slurm=lambda: svc.check_slurm_reachable(client, site, user))
        # MPS runs one user's jobs on a GPU at a time: say what that means on this site.
        note = site.mps.cross_user_note()
        if as_json:
            click.echo(json.dumps([{"job_id": r.job_id, "slurm_job_id": r.slurm_job_id, "name": r.sub.name,
                                    "mem_mib": r.req.mem_mib, "cpus": r.req.cpus, "gres": r.req.gres,
                                    **({"exclusive_user": r.req.exclusive_user, "note": note} if r.req.on_mps else {}),
                                    **({"error": r.error} if r.error else {})} for r in results], indent=1))
        for r in results:
            if r.slurm_job_id is None or as_json:
                continue
            if parsable:
                # sbatch --parsable prints `jobid` (`;cluster` only on a multi-cluster site): the id
                # every slurm-dlrm command and -d afterok take; `show ID` has the Slurm id (issue 42)
                click.echo(str(r.job_id))
            elif r.req.multinode:
                click.echo(f"Submitted job {r.job_id} (Slurm {r.slurm_job_id}; {r.sub.name}: not packed, "
                           f"{r.req.nodes} nodes x {r.req.ranks_per_node} ranks: --nodes={r.req.nodes} "
                           f"--ntasks-per-node={r.req.ranks_per_node} --gres={r.req.gres} --mem={r.req.mem_mib}M "
                           f"--cpus-per-task={r.req.cpus}{' --exclusive' if r.req.exclusive else ''})")
            else:
                click.echo(f"Submitted job {r.job_id} (Slurm {r.slurm_job_id}; {r.sub.name}: --mem={r.req.mem_mib}M "
                           f"--cpus-per-task={r.req.cpus} --gres={r.req.gres}"
                           f"{' --exclusive=user' if r.req.exclusive_user else ''})")
        if not as_json and any(r.req.on_mps and r.slurm_job_id is not None for r in results):
            click.echo(f"slurm-dlrm: note: {note}", err=True)
        refused = [r for r in results if r.slurm_job_id is None]
        if refused:
            from slurm_dlrm.errors import DlrmError

            first = refused[0]
            more = f" (and {len(refused) - 1} more; slurm-dlrm queue --all)" if len(refused) > 1 else ""
            if first.unanswered:
                raise DlrmError(f"job {first.job_id} ({first.sub.name}): sbatch did not answer: {first.error}; "
                                f"the service records its Slurm job if Slurm has it (slurm-dlrm show "
                                f"{first.job_id}){more}")
            raise DlrmError(f"job {first.job_id} ({first.sub.name}): sbatch refused: {first.error}{more}")
        if wait_:
            sys.exit(wait_with_progress(site, user, [r.job_id for r in results]))
        return
    slurm = None
    if not no_service:  # as sbatch: no Slurm, no job (one line, exit 1, nothing recorded)
        from slurm_dlrm.slurm import SlurmClient

        # Asked after the specs validate (bad input first): an unreachable Slurm or an
        # unsupported release is one line, before anything is recorded
        # (svc.check_slurm_reachable).
        slurm = SlurmClient(timeout_s=10.0)
    ids, subs = svc.submit(specs, cli_options, site=site, user=user, cwd=cwd, start_service=not no_service,
                           slurm=slurm, sets=sets, array=array, dependency=dependency, stop=stop, trials=trials,
                           trial_seed=trial_seed, prepared=prepared)
    print_submitted(ids, subs, parsable=parsable, as_json=as_json)
    if wait_:
        sys.exit(wait_with_progress(site, user, ids))


def multinode_names(svc: Any, subs: list[Any], site: Any, cwd: str) -> list[str] | None:
    """The names of the multi-node jobs among `subs` (prepared) when every job is one
    (they go unpacked); None when none is. Some but not all: BadInput (one command, one
    way of running)."""
    multi = [s.name for s in subs if svc.is_multinode(s, site, os.path.relpath(s.path, cwd))]
    if not multi:
        return None
    if len(multi) != len(subs):
        raise BadInput(f"{multi[0]}: a multi-node job is not packed; submit it apart from the packed jobs")
    return multi


def print_submitted(ids: list[int], subs: list[Any], *, parsable: bool, as_json: bool) -> None:
    """What `submit` prints for recorded jobs: the same on every login node."""
    from slurm_dlrm.service import submit as svc

    if as_json:
        click.echo(json.dumps([{"job_id": i, "name": s.name, "spec": s.path, "gpu_model": s.gpu.name,
                                "options": s.options.to_dict(), "estimate": s.estimate.to_dict()}
                               for i, s in zip(ids, subs, strict=True)], indent=1, default=str))
    if not as_json:
        for line in submitted_lines(ids, subs, parsable, svc.describe):
            click.echo(line)


def ids_from_elsewhere(site: Any, user: str, host: str, request: str, n_jobs: int) -> list[int]:
    """The job ids the service on `host` gave a dropped submit request: waits a few of its
    rounds for the store's published copy to show the request's outcome (issue 43 item 11,
    service/request_wait.py). Not in time, or refused: one line, exit 1 (a late request
    is still applied once, at the service's next round)."""
    from slurm_dlrm.errors import DlrmError
    from slurm_dlrm.service.request_wait import service_round_s, wait_bound_s, wait_for_outcome

    store_dir = site.store_dir_for(user)
    bound_s = wait_bound_s(service_round_s(store_dir, site.packing.round_seconds))
    found = wait_for_outcome(store_dir, request, bound_s)
    if found is None:
        raise DlrmError(f"submit: your packing service on host {host} did not record request {request} within "
                        f"{bound_s:.0f} s; it records the job(s) once at a later round (slurm-dlrm queue shows "
                        f"their ids)")
    ids = found.result.get("job_ids")
    if not found.applied or not isinstance(ids, list) or len(ids) != n_jobs \
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        why = found.outcome if not found.applied else f"an unexpected answer {found.result!r}"
        raise DlrmError(f"submit: your packing service on host {host} did not record request {request}: {why}")
    return ids


def test_only_checks(site: Any, user: str, subs: list[Any], dependency: str | None) -> None:
    """What sbatch --test-only checks beyond the script: the partition exists and the
    dependency names known jobs (issue 42: both passed --test-only, then failed later)."""
    from slurm_dlrm.service import submit as svc

    texts = sorted({d for d in [dependency, *(s.options.dependency for s in subs)] if d})  # + #SBATCH -d
    if texts:
        from slurm_dlrm.service.depend import check_known, parse_dependency
        from slurm_dlrm.store.store import Store, store_path_for

        deps = [d for text in texts for d in parse_dependency(text)]
        if not store_path_for(site, user).exists():
            check_known(deps, _EmptyStore(), user)
        else:
            with Store.for_user(site, user, readonly=True) as store, store.read():
                check_known(deps, store, user)
    if any(s.options.partition for s in subs):
        from slurm_dlrm.slurm import SlurmClient, SlurmError

        try:
            client: Any = SlurmClient(timeout_s=10.0)
        except SlurmError:
            client = None
        svc.check_partitions(client, site, subs)


class _EmptyStore:
    def get_job(self, job_id: int) -> Any:
        from slurm_dlrm.store.errors import UnknownEntity

        raise UnknownEntity("job", job_id)


def submitted_lines(ids: list[int], subs: list[Any], parsable: bool, describe: Any) -> list[str]:
    """What submit prints: a line per job; an array's tasks as `ARRAY_TASK` (issue 42).
    With --parsable an array is one line, its id, as sbatch prints it (so `-d afterok:$jid`
    and `cancel $jid` take the whole array)."""
    lines: list[str] = []
    array_of: dict[Any, int] = {}
    for i, s in zip(ids, subs, strict=True):
        if s.array_task_id is None:
            lines.append(str(i) if parsable else f"Submitted job {i} ({describe(s)})")
            continue
        first = s.array_group not in array_of
        aid = array_of.setdefault(s.array_group, i)
        if parsable:
            if first:
                lines.append(str(aid))
        else:
            lines.append(f"Submitted job {i} (task {aid}_{s.array_task_id}; {describe(s)})")
    return lines


def wait_with_progress(site: Any, user: str, ids: list[int]) -> int:
    """Follow jobs until they end (a live table on a terminal, state changes otherwise)."""
    try:
        from slurm_dlrm.service.progress import follow_jobs

        jobs = follow_jobs(site, user, ids)
    except KeyboardInterrupt:
        # Only the waiting stops: the jobs are the service's, as sbatch --wait's are Slurm's.
        click.echo(f"\nslurm-dlrm: interrupted; job(s) {','.join(map(str, ids))} go on "
                   f"(slurm-dlrm queue to see them, slurm-dlrm cancel ID to stop one)", err=True)
        return EXIT_RUNTIME
    return EXIT_OK if all(j.state == "COMPLETED" for j in jobs) else EXIT_RUNTIME
