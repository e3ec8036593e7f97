"""The simulator checked against the live service on the same workload (issue 29 item 2).

    .venv/bin/python benchmarks/sim_vs_live.py [--workload FILE] [--cluster FILE]
        [--truth T] [--seed N] [--policies complementary,exclusive] [--round-seconds 2]

Each policy runs live on this checkout's local Slurm cluster (2 nodes x 4 fake GPUs,
`slurm-dlrm cluster up`; started if not running, left running): jobs are submitted at
their arrival times through `submit` -> the packing service (`serve --policy P`) ->
Slurm -> the agent, and each member is a stand-in (slurm_dlrm/emulated/standin/) that
runs its solo time (`solo_duration_s`) slowed down by the truth `--truth` with what
really shares its fake GPU, at its *true* profile, its device memory (what the fake NVML
reports) growing to its true peak. The same workload, cluster file and truth then go
through the simulator. The default workload is benchmarks/sim/live_mix.yaml: 60 jobs of
dlrm_mix's classes with 2-rank gangs, times compressed (benchmarks/sim/make_live_mix.py).
Per policy it prints live and simulated throughput (completed jobs per hour over the
makespan), mean JCT and allocated GPU-hours, and the errors (sim - live) / live; then
the live path's constants as measured in this run ("live timing", what the cluster
file's `slurm:` keys model, issue 29 item 4); the last line:

    sim_vs_live: jobs= live_tput_vs_exclusive= sim_tput_vs_exclusive= tput_err_pct=
                 jct_err_pct= gpuh_err_pct= live_ooms= live_done_pct= minutes=

(each *_err_pct: the policy's error largest in size, signed). Every job of the
workload must carry its `spec` (the simulator and the service then plan with the same
estimate) and fit a node; otherwise one line names it and it exits 2 before anything
is submitted. An interrupted run cancels its packs and stops its service.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from slurm_dlrm.errors import BadInput

HERE = Path(__file__).resolve().parent
DEFAULT_WORKLOAD = HERE / "sim" / "live_mix.yaml"  # 60 jobs, dlrm_mix with 2-rank gangs (make_live_mix.py)
DEFAULT_CLUSTER = HERE / "sim" / "cluster_local.yaml"
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # as a shell reports Ctrl-C


@dataclass(frozen=True)
class Row:
    policy: str
    tput_jobs_per_h: float
    jct_s: float
    gpu_h: float
    done_pct: float
    ooms: int
    timing: dict[str, float] | None = None  # the live path's constants, measured (live rows only)


def _load(args: argparse.Namespace) -> tuple[Any, Any, Any, dict[str, Any]]:
    """(workload, cluster, truth, raw workload) or BadInput naming what is wrong."""
    from slurm_dlrm.interference_io import parse_truth
    from slurm_dlrm.sim.files import parse_cluster, parse_workload

    def read(path: str, what: str) -> Any:
        try:
            return yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise BadInput(f"{what} {path}: {exc}".splitlines()[0]) from None

    raw_cluster = read(args.cluster, "--cluster")
    cluster = parse_cluster(raw_cluster)
    raw = read(args.workload, "--workload")
    if not isinstance(raw, dict):
        raise BadInput(f"--workload {args.workload}: not a mapping")
    if "generate" in raw:
        raise BadInput(f"--workload {args.workload}: generated jobs have no spec; the live run needs "
                       "explicit jobs, each with its spec")
    models = {g.name: g for g in cluster.gpu_models}
    workload = parse_workload(raw, models, seed=args.seed)
    truth = parse_truth(args.truth)
    return workload, cluster, truth, raw


def check_live(raw: dict[str, Any], workload: Any, cluster: Any) -> list[dict[str, Any]]:
    """Each job's spec, or BadInput for the first job the live run cannot honour."""
    from slurm_dlrm.packing.model import member_fence_bytes

    specs = []
    node = min(cluster.nodes, key=lambda n: (n.gpus, n.cpus, n.memory_bytes))
    limits = cluster.limits
    for i, (job, entry) in enumerate(zip(workload.jobs, raw.get("jobs") or [], strict=True)):
        where = f"workload.jobs[{i}] ({job.name})"
        spec = entry.get("spec") if isinstance(entry, dict) else None
        if not isinstance(spec, dict):
            raise BadInput(f"{where}: a profile-only job (no spec): the live service can only run a spec")
        gpu = cluster.gpu_model(node.gpu_model)
        from slurm_dlrm.packing.model import JobDemand

        d = JobDemand(job_id=i, user="", submit_time_s=0.0, priority=0.0,
                      gpu_mem_bytes=max(job.gpu_mem_bytes, job.true_gpu_mem_bytes),
                      host_mem_bytes=job.host_mem_bytes, sm_util_pct=job.sm_util_pct,
                      membw_util_pct=job.membw_util_pct, host_cpu_cores=job.host_cpu_cores)
        if member_fence_bytes(d, gpu, limits) > gpu.memory_bytes - gpu.cuda_context_bytes:
            raise BadInput(f"{where}: larger than a node: its GPU memory does not fit a {gpu.name}")
        if job.world_size > node.gpus or d.cpus + 1 > node.cpus or job.host_mem_bytes > node.memory_bytes:
            raise BadInput(f"{where}: larger than a node ({node.gpus} GPUs, {node.cpus} CPUs, "
                           f"{node.memory_bytes >> 30} GiB)")
        steps = int(spec.get("steps") or 0)
        if steps <= 0:
            raise BadInput(f"{where}.spec.steps: must be > 0")
        specs.append(spec)
    return specs


def service_estimates(workload: Any, specs: list[dict[str, Any]], cluster: Any) -> Any:
    """The workload with each job's expected run as the service is told it (the
    estimate's samples / solo samples per second), not the compressed solo time."""
    from slurm_dlrm.estimate import estimate  # type: ignore[attr-defined]
    from slurm_dlrm.packing.model import demand_from_estimate
    from slurm_dlrm.spec import parse_spec

    jobs = []
    for job, spec in zip(workload.jobs, specs, strict=True):
        gpu = cluster.gpu_model(cluster.nodes[0].gpu_model)
        est = estimate(parse_spec(dict(spec), job.name), gpu)
        d = demand_from_estimate(est, job_id=0, user="", submit_time_s=0.0,
                                 samples_to_train=float(spec["steps"]) * float(spec.get("batch_size") or 1))
        jobs.append(replace(job, est_duration_s=d.est_duration_s))
    return replace(workload, jobs=tuple(jobs))


def sim_row(workload: Any, cluster: Any, truth: Any, policy: str) -> Row:
    from slurm_dlrm.sim.engine import simulate

    r = simulate(workload, cluster, policy, true_params=truth)
    done = [j for j in r.jobs if j.state == "COMPLETED" and j.end_s is not None]
    first = min(j.arrival_s for j in r.jobs)
    span = max((j.end_s or first) for j in done) - first if done else 0.0
    return Row(policy, len(done) * 3600.0 / span if span > 0 else 0.0,
               sum((j.end_s or 0.0) - j.arrival_s for j in done) / max(1, len(done)), r.alloc_gpu_s / 3600.0,
               100.0 * len(done) / max(1, len(r.jobs)), r.ooms)


# ---------------------------------------------------------------- live

def _standin_spec(spec: dict[str, Any], job: Any, truth_text: str, python: str, ctx_bytes: int) -> dict[str, Any]:
    steps = int(spec["steps"])
    argv = [python, "-m", "slurm_dlrm.emulated.standin", "--steps", str(steps),
            "--step-s", f"{job.solo_duration_s / steps:.9f}",
            "--checkpoint-every", str(int(spec.get("checkpoint_every_steps") or max(1, steps // 10))),
            "--metrics-every", str(int(spec.get("metrics_every_steps") or 1)),
            "--truth", truth_text, "--sm-pct", f"{job.true_sm_util_pct:g}", "--bw-pct", f"{job.true_membw_util_pct:g}",
            # its true peak as device memory the fake NVML reports (with the CUDA context and
            # cuBLAS workspace, as NVML counts a process), reached where the simulator's is
            "--gpu-peak-mib", f"{(job.true_gpu_mem_bytes + ctx_bytes) / (1 << 20):.3f}",
            "--peak-at-step", str(max(1, math.ceil(job.peak_at_frac * steps)))]
    return {**spec, "name": job.name, "command": argv}


def live_timing(packs: list[Any], placements: list[Any], events: dict[int, list[dict[str, Any]]],
                solo_s: dict[int, float]) -> dict[str, float]:
    """The live path's constants as the simulator names them (issue 29 item 4), medians
    over this run: `submit_to_start_s` (the service's plan -> the member running, in a
    new pack: sbatch, the scheduler's pass, prolog, agent start), `join_start_s` (the
    same for a joiner of a running pack: the agent's look at its joins folder),
    `pack_release_s` (a pack's last member ended -> its GPUs free: the agent's join grace,
    its exit, the epilog) and, given solo run times (a run where each member runs alone),
    `member_startup_s` (a member's time on its GPU beyond its solo run: process start,
    imports, its last checkpoint, exit)."""
    def median(xs: list[float]) -> float:
        xs = sorted(xs)
        return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2 if xs else math.nan

    by_pack: dict[int, list[Any]] = {}
    for pl in placements:
        by_pack.setdefault(pl.pack_id, []).append(pl)
    new: list[float] = []
    join: list[float] = []
    for evs in events.values():  # the first attempt: PLANNED -> RUNNING
        planned = next((e for e in evs if e.get("to_state") == "PLANNED"), None)
        running = next((e for e in evs if e.get("to_state") == "RUNNING"), None)
        if planned is not None and running is not None:
            (join if (planned.get("data") or {}).get("join") else new).append(running["t"] - planned["t"])
    release = [p.end_time - max(pl.end_time for pl in by_pack[p.id]) for p in packs
               if p.end_time and p.id in by_pack and all(pl.end_time for pl in by_pack[p.id])]
    member = [pl.end_time - pl.start_time - solo_s[pl.job_id] for pl in placements
              if pl.job_id in solo_s and pl.start_time and pl.end_time and pl.attempt == 0]
    out = {"submit_to_start_s": median(new), "pack_release_s": median(release)}
    if join:
        out["join_start_s"] = median(join)
    if member:
        out["member_startup_s"] = median(member)
    return out


def _truth_for_live(text: str) -> str:
    kind, sep, arg = text.partition(":")
    if kind.strip().lower() in ("table", "learned") and sep:
        return f"{kind}:{Path(arg).resolve()}"  # the members run elsewhere
    return text


class LiveRun:
    """One policy's live run; `cleanup()` leaves no pack, service or fake daemon behind."""

    def __init__(self, policy: str, workdir: Path, round_seconds: float) -> None:
        self.policy = policy
        self.workdir = workdir
        self.round_seconds = round_seconds
        self.site: Any = None
        self.user = ""
        self.paths: Any = None

    def start(self) -> None:
        from slurm_dlrm.service.daemon import spawn_service, wait_until_running
        from slurm_dlrm.service.demo import demo_site
        from slurm_dlrm.service.submit import service_paths
        from slurm_dlrm.site import load_site
        from slurm_dlrm.store.store import current_user

        self.workdir.mkdir(parents=True, exist_ok=True, mode=0o700)
        site_path = demo_site(self.workdir)
        os.environ["SLURM_DLRM_SITE"] = str(site_path)
        os.environ["SLURM_DLRM_STANDIN_REGISTRY"] = str(self.workdir / "gpu-registry")
        self.site = load_site(site_path)
        self.user = current_user()
        self.paths = service_paths(self.site, self.user)
        spawn_service(self.paths, ["--round-seconds", str(self.round_seconds), "--policy", self.policy,
                                   "--idle-exit", "900"])
        if wait_until_running(self.paths, timeout_s=60) is None:
            raise RuntimeError(f"the packing service did not start; see {self.paths.log}")

    def run(self, workload: Any, specs: list[dict[str, Any]], truth_text: str, timeout_s: float,
            ctx_bytes: int) -> Row:
        from slurm_dlrm.service.demo import wait_packs_final
        from slurm_dlrm.service.sbatch_options import SbatchOptions
        from slurm_dlrm.service.submit import submit
        from slurm_dlrm.store.states import JOB_TERMINAL
        from slurm_dlrm.store.store import Store

        spec_dir = self.workdir / "specs"
        spec_dir.mkdir(exist_ok=True)
        for spec in specs:  # a data file submit checks exists; a stand-in never reads it
            rel = (spec.get("data") or {}).get("path")
            if rel and not os.path.isabs(rel) and not (spec_dir / rel).exists():
                (spec_dir / rel).parent.mkdir(parents=True, exist_ok=True)
                (spec_dir / rel).write_text("0\t0\n")
        t0 = time.monotonic()
        first_arrival = min(j.arrival_s for j in workload.jobs)
        ids = []
        for job, spec in sorted(zip(workload.jobs, specs, strict=True), key=lambda x: x[0].arrival_s):
            path = spec_dir / f"{job.job_id:03d}-{job.name}.yaml"
            path.write_text(yaml.safe_dump(_standin_spec(spec, job, truth_text, sys.executable, ctx_bytes),
                                           sort_keys=False))
            time.sleep(max(0.0, t0 + job.arrival_s - first_arrival - time.monotonic()))
            got, _ = submit([str(path)], SbatchOptions(), site=self.site, user=self.user, cwd=str(self.workdir),
                            start_service=False)
            ids += got
        terminal = {s.value for s in JOB_TERMINAL}
        deadline = time.monotonic() + timeout_s
        with Store.for_user(self.site, self.user, readonly=True) as store:
            while time.monotonic() < deadline:
                jobs = [store.get_job(i) for i in ids]
                if all(str(j.state) in terminal for j in jobs):
                    break
                time.sleep(1.0)
        wait_packs_final(self.site, self.user, timeout_s=max(30.0, 15 * self.round_seconds))
        with Store.for_user(self.site, self.user, readonly=True) as store:
            jobs = [store.get_job(i) for i in ids]
            packs = store.packs(user=self.user)
            ooms = sum(1 for i in ids for e in store.events(job_id=i) if e.get("to_state") == "OOM")
            placements = [pl for i in ids for pl in store.placements(job_id=i)]
            events = {i: store.events(job_id=i) for i in ids}
        solo = {i: j.solo_duration_s for i, j in zip(ids, sorted(workload.jobs, key=lambda j: j.arrival_s),
                                                         strict=True)}
        timing = live_timing(packs, placements, events, solo if self.policy == "exclusive" else {})
        done = [j for j in jobs if str(j.state) == "COMPLETED" and j.end_time is not None]
        first = min(j.submit_time for j in jobs)
        span = max(j.end_time for j in done) - first if done else 0.0
        gpu_s = sum(p.n_gpus * ((p.end_time or time.time()) - p.start_time) for p in packs if p.start_time)
        return Row(self.policy, len(done) * 3600.0 / span if span > 0 else 0.0,
                   sum(j.end_time - j.submit_time for j in done) / max(1, len(done)), gpu_s / 3600.0,
                   100.0 * len(done) / max(1, len(jobs)), ooms, timing)

    def cleanup(self) -> None:
        """Cancel this run's packs still known to Slurm, then stop its service."""
        from slurm_dlrm.service.daemon import stop
        from slurm_dlrm.slurm.client import SlurmClient
        from slurm_dlrm.store.states import PACK_ACTIVE
        from slurm_dlrm.store.store import Store

        if self.paths is None:
            return
        try:
            stop(self.paths, timeout_s=60)
        except Exception as exc:  # noqa: BLE001 - cleanup goes on: the packs must still go
            print(f"sim_vs_live: stopping the service: {exc}", file=sys.stderr)
        try:
            with Store.for_user(self.site, self.user, readonly=True) as store:
                active = [int(p.slurm_job_id) for p in store.packs(PACK_ACTIVE, user=self.user) if p.slurm_job_id]
        except Exception:  # noqa: BLE001
            active = []
        if active:
            SlurmClient().scancel(active)


def run_live(policies: list[str], workload: Any, specs: list[dict[str, Any]], truth_text: str,
             round_seconds: float, timeout_s: float, root: Path, ctx_bytes: int) -> list[Row]:
    from slurm_dlrm.service.demo import ensure_cluster

    cluster = ensure_cluster(lambda s: print(f"sim_vs_live: {s}", file=sys.stderr))
    os.environ["SLURM_CONF"] = str(cluster.config.slurm_conf)
    rows = []
    for policy in policies:
        run = LiveRun(policy, root / policy, round_seconds)
        try:
            run.start()
            print(f"sim_vs_live: live {policy}: running ({run.workdir})", file=sys.stderr)
            rows.append(run.run(workload, specs, truth_text, timeout_s, ctx_bytes))
        finally:
            run.cleanup()
    return rows


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _err(sim: float, live: float) -> float:
    return 100.0 * (sim - live) / live if live else math.inf


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sim_vs_live", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default=str(DEFAULT_WORKLOAD))
    ap.add_argument("--cluster", default=str(DEFAULT_CLUSTER))
    ap.add_argument("--truth", default="synthetic")
    ap.add_argument("--seed", type=int, default=29)
    ap.add_argument("--policies", default="complementary,exclusive")
    ap.add_argument("--round-seconds", type=float, default=2.0)
    ap.add_argument("--timeout-s", type=float, default=1500.0, help="give up on one live run after this long")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    try:
        if "exclusive" not in policies:
            raise BadInput("--policies: must include exclusive (the baseline)")
        workload, cluster, truth, raw = _load(args)
        specs = check_live(raw, workload, cluster)
        workload = service_estimates(workload, specs, cluster)
    except BadInput as exc:
        print(f"sim_vs_live: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    # SIGTERM (a CI timeout) cleans up as Ctrl-C does: the finally blocks run.
    signal.signal(signal.SIGTERM, _interrupt)
    root = Path(tempfile.mkdtemp(prefix="sim-vs-live-"))
    try:
        gpu = cluster.gpu_model(cluster.nodes[0].gpu_model)
        live = {r.policy: r for r in run_live(policies, workload, specs, _truth_for_live(args.truth),
                                              args.round_seconds, args.timeout_s, root,
                                              gpu.cuda_context_bytes + gpu.cublas_workspace_bytes)}
    except KeyboardInterrupt:
        print(f"sim_vs_live: interrupted; its packs were cancelled and its service stopped ({root})", file=sys.stderr)
        return EXIT_INTERRUPTED
    sim = {p: sim_row(workload, cluster, truth, p) for p in policies}
    print(f"{'policy':<14} {'live tput/h':>11} {'sim tput/h':>10} {'err%':>6} {'live JCT s':>10} {'sim JCT s':>9} "
          f"{'err%':>6} {'live GPUh':>9} {'sim GPUh':>8} {'err%':>6} {'live done%':>10} {'live OOMs':>9}")
    errs: dict[str, list[float]] = {"tput": [], "jct": [], "gpuh": []}
    for p in policies:
        lv, sm = live[p], sim[p]
        e = (_err(sm.tput_jobs_per_h, lv.tput_jobs_per_h), _err(sm.jct_s, lv.jct_s), _err(sm.gpu_h, lv.gpu_h))
        for k, v in zip(errs, e, strict=True):
            errs[k].append(v)
        print(f"{p:<14} {lv.tput_jobs_per_h:>11.1f} {sm.tput_jobs_per_h:>10.1f} {e[0]:>6.1f} {lv.jct_s:>10.1f} "
              f"{sm.jct_s:>9.1f} {e[1]:>6.1f} {lv.gpu_h:>9.4f} {sm.gpu_h:>8.4f} {e[2]:>6.1f} {lv.done_pct:>10.1f} "
              f"{lv.ooms:>9d}")
    for p in policies:  # what the cluster file's slurm: constants should be (item 4)
        t = live[p].timing or {}
        print(f"live timing ({p}): " + " ".join(f"{k}={v:.2f}" for k, v in sorted(t.items()))
              + f"  (cluster file: submit_to_start_s={cluster.slurm.submit_to_start_s:g} "
              f"join_start_s={cluster.slurm.join_start_s:g} member_startup_s={cluster.slurm.member_startup_s:g} "
              f"pack_release_s={cluster.slurm.pack_release_s:g})")
    main_p = next((p for p in policies if p != "exclusive"), "exclusive")

    def worst(values: list[float]) -> float:
        return max(values, key=abs)

    def ratio(rows: dict[str, Row]) -> float:
        base = rows["exclusive"].tput_jobs_per_h
        return rows[main_p].tput_jobs_per_h / base if base else 0.0

    print(json.dumps({"workdir": str(root)}), file=sys.stderr)
    print(f"sim_vs_live: jobs={len(workload.jobs)} live_tput_vs_exclusive={ratio(live):.2f} "
          f"sim_tput_vs_exclusive={ratio(sim):.2f} tput_err_pct={worst(errs['tput']):.1f} "
          f"jct_err_pct={worst(errs['jct']):.1f} gpuh_err_pct={worst(errs['gpuh']):.1f} "
          f"live_ooms={sum(r.ooms for r in live.values())} "
          f"live_done_pct={min(r.done_pct for r in live.values()):.1f} minutes={(time.monotonic() - t0) / 60:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
