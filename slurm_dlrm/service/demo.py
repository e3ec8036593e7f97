"""`slurm-dlrm demo`: the whole path on the local cluster, in a few minutes.

Local cluster up (reused if running) -> a demo site whose store and spool live in a
fresh folder -> the packing service -> a sweep of tiny DLRM specs submitted -> followed
until they end -> the accounting summary (GPU-hours used vs one job per GPU) and the
HTML report.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_dlrm.package_data import data_dir
from slurm_dlrm.site import REPO_SITE_FILE, SiteConfig, load_site

log = logging.getLogger(__name__)

EXAMPLES_DIR = data_dir("examples") / "sweep"


@dataclass
class DemoResult:
    workdir: Path
    job_ids: list[int]
    states: dict[str, int]
    packs: int
    pack_gpus: int
    excl_gpus: int  # one job per GPU: a job's ranks take a GPU each
    gpu_hours: float  # charged to the jobs (allocated GPU time split among members)
    # acct's figures (one definition, in the store's query; docs/store.md "GPU-hours"):
    excl_gpu_hours: float  # the same work at one job per GPU
    gpu_hours_saved: float  # excl_gpu_hours - gpu_hours
    report_path: Path | None
    seconds: float
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return set(self.states) == {"COMPLETED"}


def demo_site(workdir: Path, base: Path = REPO_SITE_FILE) -> Path:
    """A copy of the site config whose store and spool are in `workdir` (fresh per demo)."""
    text = base.read_text()
    lines = []
    for line in text.splitlines():
        if line.startswith("store_dir ="):
            line = f'store_dir = "{workdir}/store-{{user}}"'
        elif line.startswith("spool_dir ="):
            line = f'spool_dir = "{workdir}/spool-{{user}}"'
        lines.append(line)
    path = workdir / "site.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def ensure_cluster(say: Callable[[str], None]) -> Any:
    """The local cluster of this checkout, with accounting; started if not running."""
    from slurm_dlrm.localcluster import LocalCluster, config_from_site, default_state_dir

    state_dir = default_state_dir()
    existing = LocalCluster.at(state_dir)
    if existing is not None and existing.status(query_nodes=False).up:
        say(f"local cluster: already up ({existing.config.slurm_conf})")
        return existing
    if existing is not None:
        existing.down()
    cluster = LocalCluster(config_from_site(load_site(REPO_SITE_FILE), state_dir=state_dir, accounting=True))
    t0 = time.monotonic()
    say("local cluster: starting slurmctld, 2 slurmd with fake GPUs, MariaDB + slurmdbd ...")
    cluster.up(wait_s=120)
    say(f"local cluster: up in {time.monotonic() - t0:.0f} s ({cluster.config.slurm_conf})")
    return cluster


def run_demo(specs: Sequence[Path], workdir: Path, *, say: Callable[[str], None], follow: Callable[..., Any],
             round_seconds: float = 2.0, timeout_s: float = 900.0, start_cluster: bool = True,
             report: bool = True) -> DemoResult:
    from slurm_dlrm.service.daemon import spawn_service, stop, wait_until_running
    from slurm_dlrm.service.sbatch_options import SbatchOptions
    from slurm_dlrm.service.submit import service_paths, submit
    from slurm_dlrm.store.store import current_user

    t0 = time.monotonic()
    if start_cluster:
        cluster = ensure_cluster(say)
        os.environ["SLURM_CONF"] = str(cluster.config.slurm_conf)
    workdir.mkdir(parents=True, exist_ok=True, mode=0o700)
    site_path = demo_site(workdir)
    os.environ["SLURM_DLRM_SITE"] = str(site_path)
    site = load_site(site_path)
    user = current_user()
    paths = service_paths(site, user)
    spawn_service(paths, ["--round-seconds", str(round_seconds), "--idle-exit", "120"])
    if wait_until_running(paths, timeout_s=60) is None:
        raise RuntimeError(f"the packing service did not start; see {paths.log}")
    say(f"packing service: running (log {paths.log})")
    try:
        ids, subs = submit([str(s) for s in specs], SbatchOptions(), site=site, user=user, cwd=os.getcwd(),
                           start_service=True)
        say(f"submitted {len(ids)} jobs: " + ", ".join(f"{i}:{s.name}" for i, s in zip(ids, subs, strict=True)))
        jobs = follow(site, user, ids, timeout_s)
        # The members reported their ends; the pack (the Slurm job) ends a moment later.
        # Stopping the service before it saw that would leave the pack open in the store
        # (and charged up to "now" by acct, issue 17): wait for it, a few rounds at most.
        wait_packs_final(site, user, timeout_s=max(30.0, 15 * round_seconds))
    finally:
        try:
            stop(paths, timeout_s=60)
        except TimeoutError as exc:
            log.warning("%s", exc)
    return summarize(site, user, ids, [str(j.state) for j in jobs], workdir, time.monotonic() - t0, report)


def wait_packs_final(site: SiteConfig, user: str, timeout_s: float) -> bool:
    """Until the user's store has no SUBMITTING/QUEUED/RUNNING pack; False on timeout."""
    from slurm_dlrm.store.states import PACK_ACTIVE
    from slurm_dlrm.store.store import Store

    deadline = time.monotonic() + timeout_s
    with Store.for_user(site, user, readonly=True) as store:
        while store.packs(PACK_ACTIVE, user=user):
            if time.monotonic() > deadline:
                log.warning("packs still active after %.0f s; stopping the service anyway "
                            "(queue/acct settle them from Slurm later)", timeout_s)
                return False
            time.sleep(0.5)
    return True


def summarize(site: SiteConfig, user: str, ids: list[int], states: list[str], workdir: Path, seconds: float,
              report: bool) -> DemoResult:
    from slurm_dlrm.store.acct import AcctFilter, acct_rows
    from slurm_dlrm.store.store import Store

    counts: dict[str, int] = {}
    for s in states:
        counts[s] = counts.get(s, 0) + 1
    with Store.for_user(site, user) as store:
        rows = acct_rows(store, AcctFilter(job_ids=tuple(ids)))
        packs = {p.id: p for p in store.packs(user=user) if p.id in {r["pack_id"] for r in rows}}
        report_path: Path | None = None
        if report:
            import warnings

            from slurm_dlrm.store.report import write_report

            since = min(r["submit_time"] for r in rows) - 60
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # matplotlib's empty-legend notes
                report_path = write_report(store, workdir / "report.html", since=since,
                                           until=time.time() + 60).html
    return DemoResult(
        workdir=workdir, job_ids=ids, states=counts, packs=len(packs), pack_gpus=sum(p.n_gpus for p in packs.values()),
        excl_gpus=sum(max(1, int(r["n_gpus"] or 1)) for r in rows),
        gpu_hours=sum(r["gpu_hours"] for r in rows), excl_gpu_hours=sum(r["excl_gpu_hours"] for r in rows),
        gpu_hours_saved=sum(r["gpu_hours_saved"] for r in rows), report_path=report_path,
        seconds=seconds)


def default_specs(count: int | None = None) -> list[Path]:
    specs = sorted(EXAMPLES_DIR.glob("*.yaml"))
    return specs[:count] if count else specs


def standin_specs(specs: Sequence[Path], workdir: Path, python: str, step_s: float = 0.1) -> list[Path]:
    """Copies of `specs` whose members run the stand-in (slurm_dlrm/emulated/standin/, no
    torch) for the same steps, so the demo's Slurm path runs where torch is not installed
    (scripts/slurm-matrix.sh on Python 3.13+). Everything else, estimate, packing, fences,
    the agent, accounting, is the real path."""
    import json

    import yaml

    workdir.mkdir(parents=True, exist_ok=True, mode=0o700)
    out_dir = workdir / "standin-specs"
    out_dir.mkdir(exist_ok=True)
    out = []
    for path in specs:
        text = path.read_text()
        spec = yaml.safe_load(text)
        steps = int(spec.get("steps") or 50)
        every = int(spec.get("checkpoint_every_steps") or 10)
        argv = [python, "-m", "slurm_dlrm.emulated.standin", "--steps", str(steps), "--step-s", str(step_s),
                "--checkpoint-every", str(every)]
        # JSON is YAML: appended as one flow line after the original (its #SBATCH lines stay).
        copy = out_dir / path.name
        copy.write_text(text.rstrip("\n") + "\n# demo --standin: the member is a stand-in\n"
                        f"command: {json.dumps(argv)}\n")
        out.append(copy)
    return out


def fresh_workdir(root: Path) -> Path:
    """`<root>/run-<time>`; older runs beyond the last 3 are removed."""
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    runs = sorted(root.glob("run-*"))
    for old in runs[:-3]:
        shutil.rmtree(old, ignore_errors=True)
    return root / time.strftime("run-%Y%m%d-%H%M%S")
