"""`slurm-dlrm submit`: validate, estimate, record, make sure the service runs, return.

Everything is checked before anything is recorded: a bad spec or option among several
leaves the store untouched (exit 2). No torch on this path (the estimate is pure).

Over 600 lines: the three ways a submission goes (packed, --no-pack, from another
login node) share validation, the checks sbatch makes at once (Slurm reachable, the
partition, the dependency) and recording; split, each would import the others.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shlex
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_dlrm.errors import BadInput, DlrmError
from slurm_dlrm.service.daemon import (
    ServicePaths,
    ensure_private_dir,
    running_pid,
    spawn_service,
    wake,
)
from slurm_dlrm.service.native import NativeRequest
from slurm_dlrm.service.sbatch_options import (
    SbatchOptions,
    format_time_minutes,
    parse_sbatch_script,
)
from slurm_dlrm.site import GIB, MIB, GpuModel, SiteConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Submission:
    """One validated spec with its options and estimate, ready to record."""

    path: str
    name: str  # -J if given, else the spec's name
    spec: Any  # slurm_dlrm.spec.JobSpec
    spec_data: dict[str, Any]  # what the runner reads back (paths made absolute)
    fingerprint: str
    options: SbatchOptions
    gpu: GpuModel
    estimate: Any  # slurm_dlrm.estimate.Estimate
    source: str = ""  # the path as given (errors name it so, as `estimate` does)
    # a task of `--array` (issue 42): its index, and which array of this submission it
    # belongs to (one per spec file and --set combination); None: not an array task
    array_task_id: int | None = None
    array_group: int | None = None
    array_throttle: int | None = None  # --array's %N: at most N of its tasks at once
    # a variant drawn by `--trials` (service/trials.py draw_record): recorded as a
    # `sweep_draw` event, so show and acct --sweep say where it came from
    draw: dict[str, Any] | None = None


def partition_for(site: SiteConfig, options: SbatchOptions) -> Any:
    """The partition the job goes to: its first `-p` one if the site knows it, else the
    site default."""
    part = site.default_partition
    if options.partition:
        wanted = options.partition.split(",")[0]
        part = next((p for p in site.partitions if p.name == wanted), part)
    return part


def partition_groups(site: SiteConfig, options: SbatchOptions) -> list[Any]:
    """The GPU node groups of the job's partition."""
    from slurm_dlrm.site import expand_hostlist

    hosts = set(expand_hostlist(partition_for(site, options).nodes))
    return [g for g in site.nodes if g.gpus > 0 and hosts.intersection(g.hostnames)]


def gpu_for(site: SiteConfig, options: SbatchOptions) -> GpuModel:
    """The GPU model the job will get: its partition's (the site default otherwise)."""
    groups = partition_groups(site, options)
    return site.gpu_model(groups[0].gpu_model) if groups else next(iter(site.gpu_models.values()))


def prepare(paths: Sequence[str], cli_options: SbatchOptions, site: SiteConfig, cwd: str,
            sets: Sequence[str] = (), array: str | None = None, stop: str | None = None,
            trials: int | None = None, trial_seed: int | None = None) -> list[Submission]:
    """Validate and estimate every spec (each variant of a `--set`/`--array` sweep, or
    `trials` variants drawn from its ranges, seeded by `trial_seed` or the spec's seed;
    with its stopping rule: `--stop`, or the spec's `sweep:`); raise BadInput naming the
    first bad one."""
    from slurm_dlrm.estimate import estimate
    from slurm_dlrm.service.sweep import (
        apply_stop_rule,
        array_throttle,
        new_sweep_id,
        parse_array,
        parse_sets,
        parse_stop,
        variants_with_draws,
    )
    from slurm_dlrm.spec import load_spec, read_spec_text, spec_fingerprint

    sweep_sets = parse_sets(sets, trials)
    if stop is not None:
        parse_stop(stop)  # the option's form first

    if not paths:
        raise BadInput("SPEC: give at least one spec file")
    out: list[Submission] = []
    sweep_names: list[str] = []  # -J, else each file's spec name: the first names a sweep
    for raw in paths:
        path = os.path.abspath(os.path.join(cwd, raw))
        # read once, bounded, a regular file only (a FIFO would block open() for ever)
        text = read_spec_text(path)
        options = cli_options.merged_over(parse_sbatch_script(text, raw)).with_paths_from(cwd)
        file_array = array if array else options.array  # `#SBATCH --array` unless the command line has one
        sweep_array = parse_array(file_array) if file_array else None
        throttle = array_throttle(file_array) if file_array else None
        gpu = gpu_for(site, options)
        swept = bool(sweep_sets or sweep_array)
        group_base = 1 + max((sb.array_group or 0 for sb in out), default=0)
        loaded = load_spec(path, text)
        sweep_names.append(options.job_name or loaded.name)
        for spec, task, group, draw in variants_with_draws(loaded, sweep_sets, sweep_array,
                                                           options.job_name if swept else None, trials, trial_seed):
            est = estimate(spec, gpu)
            if spec.custom_module:
                # traced by the service (torch), after the checks that need no import (custom_trace.py)
                from slurm_dlrm.service.custom_trace import check_custom_module

                check_custom_module(spec, source=raw)
            elif est.gpu_peak_bytes > gpu.memory_bytes:
                raise BadInput(f"{spec.source if spec.source != path else raw}: needs {est.gpu_peak_bytes / GIB:.1f} "
                               f"GiB of GPU memory (estimate); a {gpu.name} has {gpu.memory_bytes / GIB:.0f} GiB "
                               f"(slurm-dlrm estimate says what would make it fit)")
            data = spec.to_dict()
            ds = data.get("data") or {}
            if ds.get("path") and not os.path.isabs(ds["path"]):
                ds["path"] = os.path.normpath(os.path.join(os.path.dirname(path), ds["path"]))
            if ds.get("path"):
                check_data_path(raw, ds["path"])
            out.append(Submission(path=path, name=spec.name if swept else options.job_name or spec.name,
                                  spec=spec, spec_data=data, fingerprint=spec_fingerprint(spec), options=options,
                                  gpu=gpu, estimate=est, source=raw, array_task_id=task,
                                  array_group=None if task is None else group_base + group,
                                  array_throttle=None if task is None else throttle, draw=draw))
    return _with_stop_rule(out, stop, new_sweep_id(sweep_names[0]), apply_stop_rule)


def _with_stop_rule(subs: list[Submission], stop: str | None, sweep_id: str, apply: Any) -> list[Submission]:
    """The jobs of one submit are one sweep: its stopping rule (`--stop`, else the first
    spec's `sweep:`) resolved into every variant's spec (service/sweep.py apply_stop_rule)."""
    import dataclasses

    if not subs or (stop is None and all(s.spec.sweep is None for s in subs)):
        return subs
    from slurm_dlrm.estimate import estimate

    first = subs[0]
    ruled = apply([s.spec for s in subs], stop, sweep_id, first.source)
    out = []
    for s, spec in zip(subs, ruled, strict=True):
        data = spec.to_dict()
        # the sweep's one held-out set (eval.samples) changes what an evaluation holds: estimated again
        est = s.estimate if spec.eval == s.spec.eval else estimate(spec, s.gpu)
        out.append(dataclasses.replace(s, spec=spec, estimate=est,
                                       spec_data={**s.spec_data, "sweep": data["sweep"], "eval": data["eval"]}))
    return out


def check_data_path(raw: str, data_path: str) -> None:
    """A data file the runner would not find fails here, not minutes later in a pack
    (the spool and data are on a file system the nodes share, as sbatch --chdir assumes)."""
    p = Path(data_path)
    if p.is_dir():
        if not any(not c.name.startswith(".") and c.is_file() for c in p.iterdir()):
            raise BadInput(f"{raw}: data.path: no data file in the folder {data_path}")
    elif not p.is_file():
        raise BadInput(f"{raw}: data.path: no such file or folder: {data_path}")
    elif not os.access(p, os.R_OK):
        raise BadInput(f"{raw}: data.path: not readable: {data_path}")


def record(store: Any, subs: Sequence[Submission], user: str, spool_dir: Path | None = None,
           dependency: str | None = None) -> list[int]:
    """All jobs in one transaction: either every spec is recorded or none.

    With `spool_dir`, each job's spec file for its runner is written right after (a
    millisecond here instead of in the service's round; the service writes any that
    a crash left missing, from the store).
    """
    return record_rows(store, [job_row(s, dependency) for s in subs], user, spool_dir, dependency=dependency)


def job_row(s: Submission, dependency: str | None = None) -> dict[str, Any]:
    """What `record_rows` stores for one submission, as plain JSON (a request file from
    another host carries these: service/dropbox.py)."""
    from slurm_dlrm.service.custom_trace import pending_trace_estimate, submit_search_path

    sbatch = s.options.to_dict()
    if dependency:
        sbatch["dependency"] = dependency  # ours, not the pack's: depend.py reads it
    if s.array_throttle is not None:
        sbatch["array_throttle"] = s.array_throttle  # ours: the service runs at most N tasks at once
    est = s.estimate.to_dict()
    if s.spec.custom_module:  # its analytic figures are placeholders until the service traced it
        est = pending_trace_estimate(est, s.source, submit_search_path(os.getcwd()))
    return {"name": s.name, "spec": s.spec_data, "spec_fingerprint": s.fingerprint, "estimate": est,
            "gpu_model": s.gpu.name, "sbatch": sbatch, "nice": s.options.nice or 0, "begin_time": s.options.begin_time,
            "reason": f"submitted from {s.path}" + (f"; --dependency={dependency}" if dependency else ""),
            **({"array_task_id": s.array_task_id, "array_group": s.array_group} if s.array_task_id is not None else {}),
            **({"draw": s.draw} if s.draw is not None else {})}


def _row_number(row: Mapping[str, Any], key: str, default: float | None, kinds: type | tuple[type, ...]) -> Any:
    """A job row's number (a request file from another host carries rows as JSON)."""
    value = row.get(key, default)
    if value is not None and (not isinstance(value, kinds) or isinstance(value, bool)):
        raise BadInput(f"job row: {key} must be a number, not {type(value).__name__}")
    return value


def record_rows(store: Any, rows: Sequence[Mapping[str, Any]], user: str, spool_dir: Path | None = None,
                dependency: str | None = None) -> list[int]:
    ids = []
    arrays: dict[Any, int] = {}  # a row's array_group -> the array's id (its first task's job id)
    with store.write():
        deps = {dependency} | {str((r.get("sbatch") or {}).get("dependency") or "") for r in rows}  # + #SBATCH -d
        for dep in sorted(d for d in deps if d):
            from slurm_dlrm.service.depend import check_known, parse_dependency

            check_known(parse_dependency(dep), store, user)  # in the transaction: nothing half-done
        for r in rows:
            task = _row_number(r, "array_task_id", None, int)
            group = r.get("array_group")
            job_id = int(store.add_job(
                user=user, name=r["name"], spec=r["spec"], spec_fingerprint=r["spec_fingerprint"],
                estimate=r["estimate"], gpu_model=r["gpu_model"], sbatch=r["sbatch"], reason=r["reason"],
                nice=_row_number(r, "nice", 0, int), begin_time=_row_number(r, "begin_time", None, (int, float)),
                array_task_id=task, array_job_id=arrays.get(group) if task is not None else None))
            if task is not None:
                arrays.setdefault(group, job_id)
            from slurm_dlrm.service.sweep import record_draw

            record_draw(store, job_id, r.get("draw"))
            ids.append(job_id)
    if spool_dir is not None:
        from slurm_dlrm.service.spool import write_job_spec

        ensure_private_dir(spool_dir)
        for job_id, r in zip(ids, rows, strict=True):
            write_job_spec(spool_dir, job_id, r["spec"])
    return ids


def service_paths(site: SiteConfig, user: str) -> ServicePaths:
    return ServicePaths(site.store_dir_for(user))


# A service started by `submit` exits after this long with nothing to do.
AUTO_IDLE_EXIT_S = 600.0


def ensure_service(site: SiteConfig, user: str,
                   serve_args: Sequence[str] = ("--idle-exit", str(AUTO_IDLE_EXIT_S))) -> str:
    """Wake the user's service, or start it if none runs. Returns what was done.

    A service started with another SLURM_CONF than this command's (say, before `export
    SLURM_CONF`) would go on talking to the wrong Slurm, or none: it is stopped (it is
    crash-safe; SIGTERM ends it after its round) and started again with this environment."""
    from slurm_dlrm.service.daemon import elsewhere, read_status, stop
    from slurm_dlrm.service.hosts import writer_elsewhere

    paths = service_paths(site, user)
    lease = writer_elsewhere(paths)
    if lease is not None:  # its lease is live: it takes the requests at its next round
        return f"running on host {lease.host}"
    if site.service_run_as == "slurm-job":
        return ensure_service_job(site, user)
    restarted = False
    if running_pid(paths) is not None:
        host = elsewhere(paths)
        if host is not None:  # not to be signalled from here; it takes the jobs at its next round
            return f"running on host {host}"
        status = read_status(paths)
        if "slurm_conf" not in status or status.get("slurm_conf") == os.environ.get("SLURM_CONF"):
            wake(paths)
            return "woken"
        try:
            stop(paths, timeout_s=30)
        except TimeoutError as exc:
            raise DlrmError(f"packing service: it runs with SLURM_CONF={status.get('slurm_conf') or '(unset)'}, "
                            f"not {os.environ.get('SLURM_CONF') or '(unset)'}, and {exc}; "
                            f"run `slurm-dlrm serve stop`") from None
        restarted = True
    env = dict(os.environ)
    if site.path:
        env["SLURM_DLRM_SITE"] = os.path.abspath(site.path)
    spawn_service(paths, list(serve_args), env=env)
    return "restarted with this SLURM_CONF" if restarted else "started"


def ensure_service_job(site: SiteConfig, user: str, slurm: Any = None) -> str:
    """`[service] run_as = "slurm-job"`: a service job queued or running, else queue one
    (service/slurmjob.py). Nothing to wake: it takes new jobs at its next round."""
    from slurm_dlrm.service.slurmjob import queue_service_job

    if slurm is None:
        from slurm_dlrm.slurm import SlurmClient

        slurm = SlurmClient(timeout_s=15.0)
    job_id, new = queue_service_job(site, user, slurm)
    return f"{'queued' if new else 'already queued or running'} as Slurm job {job_id} in partition " \
           f"{site.service_partition}"


def check_partitions(slurm: Any, site: SiteConfig, subs: Sequence[Submission]) -> None:
    """Every `-p` partition exists, or one line and exit 1 with nothing recorded, as sbatch
    refuses it at once (issue 42: the job was recorded, turned FAILED 10 s later and left
    `queue`). Slurm's own list (one sinfo); the site's where Slurm does not answer."""
    from slurm_dlrm.slurm import SlurmError

    wanted = sorted({p for s in subs if s.options.partition for p in s.options.partition.split(",")})
    if not wanted:
        return
    try:
        known = {r.partition.rstrip("*") for r in slurm.sinfo()} if slurm is not None else set()
    except SlurmError:
        known = set()
    known = known or {p.name for p in site.partitions}
    for name in wanted:
        if name not in known:
            raise DlrmError(f"-p/--partition {name}: invalid partition specified (Slurm has "
                            f"{', '.join(sorted(known))}); nothing recorded")


def check_slurm_reachable(slurm: Any, site: SiteConfig, user: str) -> None:
    """Fail at once, as sbatch would, when Slurm cannot be reached (nothing recorded).

    Skipped when this user's service answered Slurm in its last round with the same
    SLURM_CONF (a fresh status file): `submit` stays one sbatch's worth of time."""
    from slurm_dlrm.service.daemon import read_status
    from slurm_dlrm.slurm import SlurmError

    paths = service_paths(site, user)
    status = read_status(paths) if running_pid(paths) is not None else {}
    fresh = time.time() - float(status.get("last_round_t") or 0) < 3 * max(site.packing.round_seconds, 5.0)
    if (status.get("slurm_ok") and fresh and "slurm_conf" in status
            and status.get("slurm_conf") == os.environ.get("SLURM_CONF")):
        return
    conf = os.environ.get("SLURM_CONF")
    if conf and not os.path.isfile(conf):  # Slurm itself retries that for 60 s
        raise DlrmError(f"Slurm cannot be reached: SLURM_CONF={conf}: no such file; nothing recorded")
    from slurm_dlrm.slurm.client import UnsupportedSlurm

    try:
        slurm.release()  # an unsupported release is its own one line
        proc = slurm.run(["scontrol", "ping"], check=False, timeout_s=10.0)
    except UnsupportedSlurm:
        raise
    except SlurmError as exc:
        detail = short_error(exc.stderr or str(exc))
        raise DlrmError(f"Slurm cannot be reached: {detail}{_conf_hint(detail)}; nothing recorded") from None
    if proc.returncode == 0 and "UP" in proc.stdout:
        return
    detail = short_error(proc.stderr or proc.stdout or f"scontrol ping exit code {proc.returncode}")
    raise DlrmError(f"Slurm cannot be reached: {detail}{_conf_hint(detail)}; nothing recorded")


def _conf_hint(detail: str) -> str:
    if "configuration source" not in detail and "slurm.conf" not in detail:
        return ""
    if os.environ.get("SLURM_CONF"):
        return f" (SLURM_CONF is {os.environ['SLURM_CONF']})"
    return " (is SLURM_CONF set? the local cluster's: export SLURM_CONF=$(slurm-dlrm cluster status --conf))"


def short_error(text: str, limit: int = 160) -> str:
    """A Slurm command's error as one line: its last non-empty line (the fatal one)."""
    lines = [ln.strip() for ln in text.strip().replace(" | ", "\n").splitlines() if ln.strip()]
    line = lines[-1] if lines else text.strip()
    return line if len(line) <= limit else line[: limit - 3] + "..."


def submit(paths: Sequence[str], cli_options: SbatchOptions, *, site: SiteConfig, user: str, cwd: str,
           start_service: bool = True, slurm: Any = None, sets: Sequence[str] = (),
           array: str | None = None, dependency: str | None = None,
           check_slurm: Callable[[], Any] | None = None, stop: str | None = None, trials: int | None = None,
           trial_seed: int | None = None, prepared: list[Submission] | None = None,
           ) -> tuple[list[int], list[Submission]]:
    """Validate and estimate every spec (or take `prepared`, what `prepare` made of them
    with the same arguments), then ask Slurm (`slurm`: reachable and a supported release,
    svc.check_slurm_reachable; `check_slurm()`: the release check alone) so bad input is
    named first, then record them all."""
    from slurm_dlrm.store.store import Store

    if dependency:
        from slurm_dlrm.service.depend import parse_dependency

        parse_dependency(dependency)  # the form first: a usage error before anything else
    subs = prepared if prepared is not None else prepare(paths, cli_options, site, cwd, sets, array, stop, trials,
                                                         trial_seed)
    for sub in subs:
        if sub.spec.world_size > 1:
            check_ranks_fit(sub, site, os.path.relpath(sub.path, cwd))
    if check_slurm is not None:
        check_slurm()
    if slurm is not None:
        check_slurm_reachable(slurm, site, user)
        check_partitions(slurm, site, subs)
    ensure_private_dir(site.store_dir_for(user))
    with Store.for_user(site, user) as store:
        ids = record(store, subs, user, site.spool_dir_for(user), dependency=dependency)
    if start_service:
        what = ensure_service(site, user)
        log.info("packing service %s", what)
    return ids, subs


def submit_elsewhere(paths: Sequence[str], cli_options: SbatchOptions, *, site: SiteConfig, user: str, cwd: str,
                     sets: Sequence[str] = (), array: str | None = None,
                     dependency: str | None = None, stop: str | None = None, trials: int | None = None,
                     trial_seed: int | None = None, prepared: list[Submission] | None = None,
                     ) -> tuple[str, list[Submission]]:
    """`submit` on a login node whose service does not hold the store: validate and
    estimate as on its host, then drop one request with every job (service/remote.py).
    Returns the request file's name. Slurm is not asked here: the service that records
    the jobs talks to it."""
    from slurm_dlrm.service.daemon import this_host
    from slurm_dlrm.service.dropbox import write_request

    if dependency:
        from slurm_dlrm.service.depend import parse_dependency

        parse_dependency(dependency)
    subs = prepared if prepared is not None else prepare(paths, cli_options, site, cwd, sets, array, stop, trials,
                                                         trial_seed)
    for sub in subs:
        if sub.spec.world_size > 1:
            check_ranks_fit(sub, site, os.path.relpath(sub.path, cwd))
    rows = [job_row(s, dependency) for s in subs]
    name = write_request(site.store_dir_for(user), "submit", {"rows": rows, "dependency": dependency}, user=user,
                         host=this_host())
    return name, subs


def check_ranks_fit(sub: Submission, site: SiteConfig, where: str) -> None:
    """A multi-GPU job on the packing path: its ranks go to distinct GPUs of one node
    (docs/packing.md "Multi-GPU jobs"), each fenced from its own estimate. Refuse what
    no node of the partition can take: more ranks than its nodes have GPUs (or than the
    partition allows per job), a rank whose fence passes a GPU, or all ranks' host
    memory and CPUs past a node's."""
    from slurm_dlrm.packing.model import (
        demand_from_estimate,
        host_limit_bytes,
        limits_from_site,
        member_fence_bytes,
        rank_members,
        usable_gpu_bytes,
    )
    from slurm_dlrm.service.multinode import node_layout

    if node_layout(sub, site, where, partition_for(site, sub.options), partition_groups(site, sub.options)):
        raise BadInput(f"{where}: world_size {sub.spec.world_size} spans several nodes: such a job is not packed "
                       f"(slurm-dlrm submit sends it as a Slurm job of its own)")
    ranks = sub.spec.world_size
    part = partition_for(site, sub.options)
    groups = [g for g in partition_groups(site, sub.options) if g.gpu_model == sub.gpu.name]
    node_gpus = max((g.gpus for g in groups), default=0)
    if ranks > node_gpus:
        raise BadInput(f"{where}: world_size {ranks}: the largest {sub.gpu.name} node of partition {part.name} has "
                       f"{node_gpus} GPUs (the ranks run on one node, one GPU each)")
    if ranks > part.max_gpus_per_job:
        raise BadInput(f"{where}: world_size {ranks}: partition {part.name} allows at most "
                       f"{part.max_gpus_per_job} GPUs per job")
    limits = limits_from_site(site)
    members = rank_members(demand_from_estimate(sub.estimate, job_id=0, user="", submit_time_s=0.0))
    usable = usable_gpu_bytes(sub.gpu)
    for m in members:
        fence = member_fence_bytes(m, sub.gpu, limits)
        if fence > usable:
            raise BadInput(f"{where}: world_size {ranks}: rank {m.rank} needs {math.ceil(fence / MIB)} MiB of GPU "
                           f"memory with its fence (estimate + {limits.memory_margin_pct:g}% + context); a "
                           f"{sub.gpu.name} offers {usable // MIB} MiB to one member")
    host = sum(host_limit_bytes(m, limits) for m in members)
    cpus = sum(m.cpus for m in members)
    if not any(host <= g.memory_mib * MIB and cpus <= g.cpus for g in groups if g.gpus >= ranks):
        raise BadInput(f"{where}: world_size {ranks}: its ranks need {math.ceil(host / MIB)} MiB of host memory and "
                       f"{cpus} CPUs on one node; no {sub.gpu.name} node of partition {part.name} with {ranks} GPUs "
                       f"has that much")


# ---------------------------------------------------------------- --no-pack

def native_request(sub: Submission, site: SiteConfig, where: str | None = None) -> NativeRequest:
    est = sub.estimate
    margin = 1.0 + site.packing.memory_margin_pct / 100.0
    if sub.spec.world_size > 1:
        from slurm_dlrm.service.multinode import check_rank_fences, node_layout

        groups = partition_groups(site, sub.options)
        layout = node_layout(sub, site, where or sub.path, partition_for(site, sub.options), groups)
        if layout is not None:
            # one rank per GPU on each of `nodes` nodes; the fullest rank decides the request
            fence_mib, host_mib, cpus = check_rank_fences(sub, site, layout, where or sub.path, groups)
            exclusive = site.multinode.exclusive
            node_gpus = min((g.gpus for g in groups if g.gpu_model == sub.gpu.name
                             and g.gpus >= layout.ranks_per_node), default=layout.ranks_per_node)
            return NativeRequest(mem_mib=host_mib * layout.ranks_per_node, cpus=cpus,
                                 gres=f"gpu:{layout.ranks_per_node}", gpu_mem_mib=fence_mib, nodes=layout.nodes,
                                 ranks_per_node=layout.ranks_per_node, exclusive=exclusive,
                                 node_gpus=node_gpus if exclusive else layout.ranks_per_node)
    mem_mib = max(256, math.ceil(est.host_peak_bytes * margin / MIB) + 256)
    cpus = max(1, math.ceil(float(est.profile.host_cpu_cores) - 1e-9))
    gpu_fence_mib = math.ceil(est.gpu_peak_bytes * margin / MIB)
    gres = "gpu:1"
    mps_pct = None
    ranks = sub.spec.world_size
    if ranks > 1:
        # One rank per whole GPU on one node (the runner launches the ranks itself); the
        # estimate is for the fullest rank, each rank its own process.
        part = partition_for(site, sub.options)
        node_gpus = max((g.gpus for g in partition_groups(site, sub.options) if g.gpu_model == sub.gpu.name),
                        default=0)
        if ranks > node_gpus:
            raise BadInput(f"{sub.path}: world_size {ranks}: the largest {sub.gpu.name} node of partition "
                           f"{part.name} has {node_gpus} GPUs (the ranks run on one node)")
        if ranks > part.max_gpus_per_job:
            raise BadInput(f"{sub.path}: world_size {ranks}: partition {part.name} allows at most "
                           f"{part.max_gpus_per_job} GPUs per job")
        mem_mib = max(256, math.ceil(est.host_peak_bytes * margin * ranks / MIB) + 256)
        cpus *= ranks
        gres = f"gpu:{ranks}"
    elif site.mps.enabled and site.mps.mps_per_gpu > 0:
        # An MPS share as large as its SM demand and its memory share (Slurm's MPS sets
        # only the thread percentage, so memory counts too), rounded up to a tenth.
        share_pct = max(float(est.profile.sm_util_pct), 100.0 * gpu_fence_mib * MIB / sub.gpu.memory_bytes)
        share_pct = min(100.0, math.ceil(share_pct / 10.0) * 10.0)
        if share_pct < 100.0:
            n = math.ceil(share_pct * site.mps.mps_per_gpu / 100.0)
            share = min(site.mps.mps_per_gpu, max(min_mps_share(site, sub.options), n))
            gres = f"mps:{share}"
            mps_pct = round(100 * share / site.mps.mps_per_gpu)
    return NativeRequest(mem_mib=mem_mib, cpus=cpus, gres=gres, gpu_mem_mib=gpu_fence_mib, mps_pct=mps_pct,
                         exclusive_user=gres.startswith("mps:") and site.mps.cross_user == "one-user")


def check_multinode_paths(subs: Sequence[Submission], reqs: Sequence[NativeRequest], site: SiteConfig, user: str,
                          cwd: str) -> None:
    """A multi-node job's checkpoints (in its spool folder) must be seen by every node."""
    from slurm_dlrm.service.multinode import check_shared_path

    for sub, req in zip(subs, reqs, strict=True):
        if req.multinode:
            check_shared_path(site, user, str(site.spool_dir_for(user) / "jobs"), os.path.relpath(sub.path, cwd))


def is_multinode(sub: Submission, site: SiteConfig, where: str) -> bool:
    """Whether the job spans several nodes (then it is never packed)."""
    from slurm_dlrm.service.multinode import node_layout

    return sub.spec.world_size > 1 and node_layout(sub, site, where, partition_for(site, sub.options),
                                                   partition_groups(site, sub.options)) is not None


def min_mps_share(site: SiteConfig, options: SbatchOptions) -> int:
    """The partition's smallest accepted --gres=mps:N (job_submit.lua refuses less)."""
    return max(1, partition_for(site, options).min_mps_share)


def submit_no_pack(paths: Sequence[str], cli_options: SbatchOptions, *, site: SiteConfig, user: str, cwd: str,
                   slurm: Any, python: str = sys.executable, sets: Sequence[str] = (),
                   array: str | None = None, start_service: bool = True,
                   check_slurm: Callable[[], Any] | None = None, trials: int | None = None,
                   trial_seed: int | None = None, prepared: list[Submission] | None = None) -> list[Any]:
    """Each spec as its own Slurm job, each a row in the store first (service/native.py).

    Returns `NativeSubmitted` per spec: our id, the Slurm id (None if sbatch refused it:
    the row is FAILED with Slurm's words). The service is started (or woken) to follow
    the jobs, as for packed ones. `check_slurm()` runs after the specs validate and before
    anything is recorded (an unreachable Slurm or an unsupported release: one line, no row)."""
    from slurm_dlrm.service.native import record_and_submit
    from slurm_dlrm.store.store import Store

    if prepared is None:
        prepared = prepare(paths, cli_options, site, cwd, sets, array, None, trials, trial_seed)
    subs = [_traced(sub, python) if sub.spec.custom_module else sub for sub in prepared]
    if any(sub.spec.sweep is not None for sub in subs):
        raise BadInput(f"{subs[0].source}: sweep: a stopping rule pauses members of packs at their rungs; "
                       "not with --no-pack")
    reqs = [native_request(sub, site, os.path.relpath(sub.path, cwd)) for sub in subs]  # all sized first
    check_multinode_paths(subs, reqs, site, user, cwd)
    if check_slurm is not None:
        check_slurm()
    ensure_private_dir(site.store_dir_for(user))
    with Store.for_user(site, user) as store:
        out = record_and_submit(store, slurm, list(zip(subs, reqs, strict=True)), user=user, site=site,
                                spool_dir=site.spool_dir_for(user), python=python)
    if start_service and any(r.slurm_job_id is not None or r.unanswered for r in out):
        log.info("packing service %s", ensure_service(site, user))
    return out


def test_only_lines(subs: Sequence[Submission], site: SiteConfig, *, no_pack: bool,
                    user: str | None = None) -> list[str]:
    """`submit --test-only`: the sbatch command each job would use, quoted for a shell.

    --no-pack: the job's own sbatch, exactly. Packed: the options its pack carries; the
    pack's --nodes/--gres/--cpus-per-task/--mem are the plan's, sized when a round packs it
    (at least the job's own share, shown)."""
    out = []
    for sub in subs:
        if no_pack or is_multinode(sub, site, sub.source or sub.path):
            from slurm_dlrm.service.native import native_flags

            req = native_request(sub, site, sub.source or sub.path)
            if req.multinode and user is not None:  # as submit would: checkpoints every node sees
                from slurm_dlrm.service.multinode import check_shared_path

                check_shared_path(site, user, str(site.spool_dir_for(user) / "jobs"), sub.source or sub.path)
            flags = native_flags(sub, req)
            note = (f"   # not packed: {req.nodes} nodes x {req.ranks_per_node} ranks, srun starts one runner per "
                    f"rank" if req.multinode else "")
            out.append("sbatch --parsable " + " ".join(shlex.quote(f) for f in flags) + " job.sbatch" + note)
            continue
        margin = 1.0 + site.packing.memory_margin_pct / 100.0
        flags = ["--parsable", "--job-name=PACK", "--no-requeue", "--ntasks-per-node=1",
                 *sorted(sub.options.sbatch_flags(include_job_name=False))]
        out.append(f"sbatch {' '.join(shlex.quote(f) for f in flags)} pack.sbatch   # + the plan's --nodes, "
                   f"--gres=gpu:N, --cpus-per-task, --mem; this job's share: a {sub.gpu.name} GPU share, "
                   f"{max(1, math.ceil(float(sub.estimate.profile.host_cpu_cores) - 1e-9))} CPU, "
                   f"{math.ceil(sub.estimate.host_peak_bytes * margin / MIB)}M")
    return out


def _traced(sub: Submission, python: str) -> Submission:
    """A custom module's estimate, traced now (a child process with torch): --no-pack has
    no service to do it later, and `--mem`/the MPS share come from it."""
    import dataclasses

    from slurm_dlrm.estimate import Estimate
    from slurm_dlrm.service.custom_trace import submit_search_path, trace_spec

    est, error = trace_spec(sub.spec_data, sub.source, sub.gpu, submit_search_path(os.getcwd()), python)
    if est is None:
        raise BadInput(error)
    return dataclasses.replace(sub, estimate=Estimate.from_dict(est))


# ---------------------------------------------------------------- --wait

def job_progress(site: SiteConfig, user: str, job_id: int) -> int | None:
    """The last step the job's metrics file reports, if any (cheap: reads its tail)."""
    path = site.spool_dir_for(user) / "jobs" / str(job_id) / "metrics.jsonl"
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 4096))
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            continue
        if isinstance(step, int):
            return step
    return None


def wait_for_jobs(site: SiteConfig, user: str, ids: Sequence[int], *, poll_s: float = 1.0,
                  on_update: Callable[[list[Any]], None] | None = None, timeout_s: float | None = None,
                  sleep: Callable[[float], None] = time.sleep) -> list[Any]:
    """Block until every job ends; returns their final rows. `on_update` sees each poll."""
    from slurm_dlrm.store.states import JOB_TERMINAL
    from slurm_dlrm.store.store import Store

    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    with Store.for_user(site, user, readonly=True) as store:
        while True:
            with store.read():
                jobs = [store.get_job(i) for i in ids]
            if on_update is not None:
                on_update(jobs)
            if all(j.state in JOB_TERMINAL for j in jobs):
                return jobs
            if deadline is not None and time.monotonic() > deadline:
                raise DlrmError(f"--wait: jobs still running after {timeout_s:g} s")
            sleep(poll_s)


def describe(sub: Submission) -> str:
    est = sub.estimate
    t = sub.options.time_minutes
    limit = f", time limit {format_time_minutes(t)}" if t is not None else ""
    return (f"{sub.name}: estimated GPU peak {est.gpu_peak_bytes / GIB:.2f} GiB, host peak "
            f"{est.host_peak_bytes / GIB:.2f} GiB, {est.profile.label}{limit}")
