"""`slurm-dlrm demo`: click glue over slurm_dlrm.service.demo.

`--smoke` keeps the first demo (written with the local cluster): one real GPU job with an
srun step per node, shown with what each node saw. tests/test_localcluster.py uses it.
"""

from __future__ import annotations

import json
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

from slurm_dlrm.errors import EXIT_OK, EXIT_RUNTIME

# One task per node; each prints what Slurm gave it. Values are Slurm's, not ours.
_STEP = ('printf "%s|%s|%s|%s|%s\\n" "$SLURMD_NODENAME" "$(hostname)" '
         '"${CUDA_VISIBLE_DEVICES:-unset}" "$SLURM_JOB_ID" "$SLURM_STEP_ID"')


# The demo leaves the local cluster running (issue 17): it may have been up before the
# demo (reused, perhaps the test suite's or yours), `queue`/`acct`/`show` and the next
# demo use it, and it takes 30-60 s to start. So the last line says so, and how to stop it.
STOP_CLUSTER = "slurm-dlrm cluster down"
CLUSTER_NOTE = ("the local Slurm cluster is still running (slurmctld, slurmd, munged, MariaDB, slurmdbd); "
                f"stop it with: {STOP_CLUSTER}")

_SACCT_FIELDS = ("JobID", "JobName", "State", "ExitCode", "NodeList", "AllocTRES")


def run_demo(state_dir: Path | None = None, nodes: int | None = None, timeout_s: float = 120.0) -> dict[str, Any]:
    from slurm_dlrm import localcluster as lc
    from slurm_dlrm.slurm.base import AccountingDisabled
    from slurm_dlrm.slurm.wait import wait_for_jobs

    found = lc.LocalCluster.at((state_dir or lc.default_state_dir()).resolve())
    if found is not None and found.status(query_nodes=False).up:
        cluster = found
    else:
        cluster = lc.LocalCluster(lc.config_from_site(state_dir=state_dir, nodes=nodes, accounting=True))
        cluster.up()
    cfg = cluster.config
    n = nodes or cfg.nodes
    out_dir = cfg.state_dir / "demo"
    out_dir.mkdir(exist_ok=True)
    script = ("#!/bin/bash\nset -eu\n"
              f"srun --ntasks-per-node=1 --job-name=demo-step bash -c {shlex.quote(_STEP)}\n")
    client = cluster.client()
    job_id = client.sbatch(script, ["--job-name=slurm-dlrm-demo", f"--nodes={n}", "--ntasks-per-node=1",
                                    "--gres=gpu:1", f"--output={out_dir}/demo-%j.out", f"--chdir={out_dir}"])
    job = wait_for_jobs(client, [job_id], timeout_s=timeout_s, poll_s=0.2, max_poll_s=1.0)[job_id]
    out_file = out_dir / f"demo-{job_id}.out"
    rows = []
    for line in (out_file.read_text().splitlines() if out_file.exists() else []):
        parts = line.split("|")
        if len(parts) == 5:
            rows.append(dict(zip(("node", "hostname", "cuda_visible_devices", "job_id", "step_id"), parts,
                                 strict=True)))
    acct: list[dict[str, str]] = []
    if cfg.accounting:
        # slurmctld reports to slurmdbd asynchronously: right after the end sacct may
        # still lack a step or name the job "allocation" (22.05.8). Give it a moment.
        deadline = time.monotonic() + 10
        while True:
            try:
                acct = [r.fields for r in client.sacct([job_id], _SACCT_FIELDS)]
            except AccountingDisabled:
                break
            names = {r["JobName"] for r in acct}
            if {"slurm-dlrm-demo", "demo-step"} <= names or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    return {"cluster": cfg.cluster_name, "slurm_conf": str(cfg.slurm_conf), "job_id": job_id,
            "state": job.state.value, "exit_code": job.exit_code, "output": str(out_file),
            "tasks": sorted(rows, key=lambda r: r["node"]), "sacct": acct}


@click.command("demo", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-n", "--count", type=click.IntRange(1, 100), default=None,
              help="Submit only the first N specs of the sweep (default: all 12).")
@click.option("--spec", "specs", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="Submit these specs instead of examples/sweep/*.yaml (repeatable).")
@click.option("--workdir", type=click.Path(file_okay=False), default=None,
              help="Where the demo's store, spool and report go (default: a fresh run folder in $TMPDIR).")
@click.option("--round-seconds", type=click.FloatRange(min=0.2), default=2.0, show_default=True,
              help="Dispatch round period of the demo's packing service.")
@click.option("--timeout", "timeout_s", type=float, default=900.0, show_default=True,
              help="Give up following the jobs after this many seconds.")
@click.option("--no-report", is_flag=True, help="Skip the HTML report.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.option("--smoke", is_flag=True, help="Only check the cluster: one GPU job with an srun step per node.")
@click.option("--standin", is_flag=True,
              help="Members run a stand-in (no torch) for the spec's steps; the rest of the path is real.")
def demo(count: int | None, specs: tuple[str, ...], workdir: str | None, round_seconds: float, timeout_s: float,
         no_report: bool, as_json: bool, smoke: bool, standin: bool) -> None:
    """Run the whole path on the local cluster: pack a sweep of tiny DLRMs onto shared GPUs.

    Brings up the local Slurm cluster (2 nodes x 4 fake GPUs, with accounting; reused
    if it runs), starts your packing service, submits the tiny DLRM specs of
    examples/sweep/, follows them to the end (they train on the CPU), then prints
    the accounting summary: GPU-hours used vs one job per GPU, and the report's path.

    \b
    Example:
      slurm-dlrm demo
      slurm-dlrm demo -n 6 --json
      slurm-dlrm demo --smoke      # just check the cluster: a GPU step on every node
      slurm-dlrm demo --standin    # the Slurm path without torch (stand-in members)
      slurm-dlrm cluster down      # afterwards, to stop the local cluster

    The local cluster is left running (the last line says so): `slurm-dlrm cluster
    down` stops it. Exit code 0 if every job completed, 1 otherwise.
    """
    if smoke:
        from slurm_dlrm.errors import DlrmError

        check = run_demo()
        if as_json:
            click.echo(json.dumps({**check, "cluster_running": True, "stop_cluster": STOP_CLUSTER}, indent=1))
        else:
            _show(check)
            click.echo(CLUSTER_NOTE)
        if check["state"] != "COMPLETED":
            raise DlrmError(f"demo job {check['job_id']} ended {check['state']} (output: {check['output']})")
        return
    from slurm_dlrm.service.demo import default_specs, fresh_workdir, standin_specs
    from slurm_dlrm.service.demo import run_demo as run_sweep
    from slurm_dlrm.service.progress import follow_jobs

    chosen = [Path(s).resolve() for s in specs] if specs else default_specs(count)
    work = Path(workdir).resolve() if workdir else fresh_workdir(Path(tempfile.gettempdir()) / "slurm-dlrm-demo")
    if standin:
        chosen = standin_specs(chosen, work, sys.executable)

    def say(text: str) -> None:
        click.echo(f"demo: {text}", err=True)

    def follow(site: Any, user: str, ids: list[int], t: float) -> list[Any]:
        return follow_jobs(site, user, ids, timeout_s=t)

    result = run_sweep(chosen, work, say=say, follow=follow, round_seconds=round_seconds, timeout_s=timeout_s,
                      report=not no_report)
    saved = result.gpu_hours_saved  # acct's, summed: the demo has no formula of its own
    summary = {
        "jobs": len(result.job_ids), "states": result.states, "packs": result.packs,
        "gpus_allocated": result.pack_gpus, "gpus_at_one_job_per_gpu": len(result.job_ids),
        "gpu_hours_used": round(result.gpu_hours, 5), "gpu_hours_one_job_per_gpu": round(result.excl_gpu_hours, 5),
        "gpu_hours_saved": round(saved, 5),
        "seconds": round(result.seconds, 1), "workdir": str(result.workdir),
        "report": str(result.report_path) if result.report_path else None,
        # The cluster stays up (see CLUSTER_NOTE); say so and how to stop it.
        "cluster_running": True, "stop_cluster": STOP_CLUSTER,
    }
    if as_json:
        click.echo(json.dumps(summary, indent=1, sort_keys=True))
    else:
        pct = f" ({saved / result.excl_gpu_hours:.0%} less)" if result.excl_gpu_hours > 0 else ""
        click.echo("\n".join([
            f"{len(result.job_ids)} jobs: " + ", ".join(f"{n} {s.lower()}" for s, n in sorted(result.states.items())),
            f"packed into {result.packs} Slurm jobs on {result.pack_gpus} GPUs "
            f"(one job per GPU would take {result.excl_gpus} GPUs)",
            f"GPU-hours used: {result.gpu_hours:.4f}; at one job per GPU: {result.excl_gpu_hours:.4f}{pct}"
            " (acct's GPUHours and ExclGPUHours, summed)",
            f"took {result.seconds:.0f} s; details: slurm-dlrm acct (SLURM_DLRM_SITE={result.workdir}/site.toml)",
            f"report: {result.report_path}" if result.report_path else "report: skipped",
            CLUSTER_NOTE,
        ]))
    sys.exit(EXIT_OK if result.ok else EXIT_RUNTIME)


def _show(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 120)  # pipes and CI logs: do not squeeze the tables
    console.print(f"cluster [bold]{result['cluster']}[/]  job {result['job_id']}: [bold]{result['state']}[/]"
                  f"  (export SLURM_CONF={result['slurm_conf']})")
    table = Table(title="what each node saw (one srun task per node, --gres=gpu:1)")
    for col in ("node", "hostname", "CUDA_VISIBLE_DEVICES", "job", "step"):
        table.add_column(col)
    for t in result["tasks"]:
        table.add_row(t["node"], t["hostname"], t["cuda_visible_devices"], t["job_id"], t["step_id"])
    console.print(table)
    if result["sacct"]:
        acct = Table(title="sacct (the job, its batch step and the srun step)")
        for col in result["sacct"][0]:
            acct.add_column(col)
        for row in result["sacct"]:
            acct.add_row(*row.values())
        console.print(acct)
