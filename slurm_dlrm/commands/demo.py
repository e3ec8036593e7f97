"""`slurm-dlrm demo`: bring the local cluster up and run a real job through the Slurm seam.

Until the packing service exists this submits one torchrec-free job that takes one
GPU on each node (`--gres=gpu:1`, one srun step per node), waits for it and shows what
each node saw. The service work replaces `run_demo` with the real demo.
"""

from __future__ import annotations

import json
import shlex
import time
from pathlib import Path
from typing import Any

import click

# One task per node; each prints what Slurm gave it. Values are Slurm's, not ours.
_STEP = ('printf "%s|%s|%s|%s|%s\\n" "$SLURMD_NODENAME" "$(hostname)" '
         '"${CUDA_VISIBLE_DEVICES:-unset}" "$SLURM_JOB_ID" "$SLURM_STEP_ID"')


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


@click.command("demo")
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Local cluster state folder (default as for `slurm-dlrm cluster`).")
@click.option("--nodes", type=int, help="Nodes the demo job spans (default: all of the cluster's).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def demo(state_dir: Path | None, nodes: int | None, as_json: bool) -> None:
    """Start the local cluster if needed and run a real GPU job on every node.

    The job asks Slurm for one GPU per node (--gres=gpu:1) and runs one srun step per
    node that reports the node and its CUDA_VISIBLE_DEVICES; with accounting on, the
    job and its steps are shown from sacct. Exit 1 if the job did not complete.

    \b
    Example:
      slurm-dlrm demo
      slurm-dlrm demo --json | jq .tasks
    """
    from slurm_dlrm.errors import DlrmError

    result = run_demo(state_dir, nodes)
    if as_json:
        click.echo(json.dumps(result, indent=1))
    else:
        _show(result)
    if result["state"] != "COMPLETED":
        raise DlrmError(f"demo job {result['job_id']} ended {result['state']} (output: {result['output']})")


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
