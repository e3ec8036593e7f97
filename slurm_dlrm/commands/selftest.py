"""`slurm-dlrm selftest`: click glue over slurm_dlrm.selftest."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import click

from slurm_dlrm.errors import BadInput

HELP = """The acceptance test of a GPU node: NVML, MPS fences, the estimator on CUDA, calibration.

\b
Example:
  srun -p gpu --gres=gpu:1 --exclusive slurm-dlrm selftest
  slurm-dlrm selftest --submit -p gpu -w gpu07 --exclusive   # submits itself, waits, prints the verdict
  slurm-dlrm selftest --write-site /etc/slurm-dlrm/site.toml --json
  slurm-dlrm selftest --fake                       # no GPU: the agent's code paths against the fakes

Run inside an allocation on a GPU node (or with --submit). Checks, each PASS / FAIL /
SKIP / DRY with the figure it rests on and, on FAIL, what to fix (docs/admin.md):
NVML (driver, CUDA, the site's GPU model, compute mode); MPS (a private daemon, two
clients with different thread shares and memory limits: the one past its limit gets
CUDA out-of-memory while its neighbour runs on, throughput follows the share, NVML
lists both, the daemon quits clean); the estimator against torch's and NVML's peaks on
5 small specs; compute calibration (GEMM efficiency, bandwidth, launch overhead), which
--write-site stores in the GPU model's entry of the site file.

DRY means the step ran against the fake NVML / MPS daemon: the code path works, no GPU
was measured. The node is accepted only when every check is PASS.

Exit codes: 0 nothing failed, 1 a check failed or a runtime error (an MPS daemon of
another user runs here), 2 bad input (no such GPU, a partition without GPUs, a site
file you cannot write).
"""


@click.command("selftest", help=HELP, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--gpu", "gpu_index", type=int, default=0, show_default=True, metavar="INDEX",
              help="Which GPU of the allocation ($CUDA_VISIBLE_DEVICES order) to test.")
@click.option("--json", "as_json", is_flag=True, help="Print the checks and the verdict as JSON.")
@click.option("--write-site", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="Write the measured figures into the GPU model's entry of this site file (atomic; "
                   "comments and other keys kept).")
@click.option("--site", "site_path", type=click.Path(dir_okay=False), default=None,
              help="Site config to check against (default: $SLURM_DLRM_SITE, /etc/slurm-dlrm/site.toml, ...).")
@click.option("--model", default=None, metavar="NAME",
              help="The site's GPU model of this GPU (default: the node's gpu_model, else matched by memory).")
@click.option("--fake", is_flag=True,
              help="No GPU here: use the fake NVML and fake MPS control daemon (every hardware figure is SKIP).")
@click.option("--steps", type=click.IntRange(2, 100), default=5, show_default=True,
              help="Training steps per estimator spec.")
@click.option("--submit", is_flag=True, help="Submit this selftest as a Slurm job (needs -p), wait, print its verdict.")
@click.option("-p", "--partition", default=None, help="With --submit: the partition (it must have GPUs).")
@click.option("--gres", default=None, help="With --submit: sbatch --gres (default gpu:1).")
@click.option("-w", "--nodelist", default=None, metavar="NODE", help="With --submit: the node to test (sbatch -w).")
@click.option("--exclusive", is_flag=True, help="With --submit: the whole node (no other job, no other user's MPS).")
@click.option("--timeout", "wait_s", type=click.IntRange(30), default=1200, show_default=True, metavar="SECONDS",
              help="With --submit: how long to wait for the job (queueing included).")
@click.option("--slurm-conf", type=click.Path(dir_okay=False), default=None, envvar="SLURM_CONF",
              help="With --submit: slurm.conf (default: $SLURM_CONF).")
def selftest(gpu_index: int, as_json: bool, write_site: str | None, site_path: str | None, model: str | None,
             fake: bool, steps: int, submit: bool, partition: str | None, gres: str | None, nodelist: str | None,
             exclusive: bool, wait_s: int, slurm_conf: str | None) -> None:
    from slurm_dlrm.selftest import verdict as V

    if gpu_index < 0:
        raise BadInput(f"--gpu {gpu_index}: must be >= 0")
    if submit:
        extra = ([f"--nodelist={nodelist}"] if nodelist else []) + (["--exclusive"] if exclusive else [])
        data = _submit(gpu_index, write_site, site_path, model, fake, steps, partition, gres, extra, wait_s,
                       slurm_conf)
    else:
        if partition or gres or nodelist or exclusive:
            raise BadInput("-p/--gres/-w/--exclusive: only with --submit")
        from slurm_dlrm.selftest.run import Options, run_selftest

        checks, context = run_selftest(Options(gpu=gpu_index, site_path=site_path, write_site=write_site,
                                               fake=fake, model=model, steps=steps))
        data = V.to_json(checks, context)
    if as_json:
        click.echo(json.dumps(data, indent=2))
    else:
        _print_table(data)
    raise SystemExit(int(data["verdict"]["exit_code"]))


def _submit(gpu_index: int, write_site: str | None, site_path: str | None, model: str | None, fake: bool,
            steps: int, partition: str | None, gres: str | None, extra: list[str], wait_s: int,
            slurm_conf: str | None) -> Any:
    import getpass

    from slurm_dlrm.selftest.submit import gpus_requested, submit_and_wait
    from slurm_dlrm.site import load_site
    from slurm_dlrm.slurm import make_backend

    if not partition:
        raise BadInput("--submit: -p PARTITION is required")
    if gpu_index >= gpus_requested(gres):
        raise BadInput(f"--gpu {gpu_index}: the job asks for {gpus_requested(gres)} GPU(s) (--gres {gres or 'gpu:1'})")
    site = load_site(site_path)
    inner = ["--gpu", str(gpu_index), "--steps", str(steps)]
    if write_site:
        from slurm_dlrm.selftest.sitefile import check_writable

        check_writable(write_site)  # here too: refuse before a job is queued
        inner += ["--write-site", str(Path(write_site).resolve())]
    if site_path:
        inner += ["--site", str(Path(site_path).resolve())]
    if model:
        inner += ["--model", model]
    if fake:
        inner.append("--fake")
    out_dir = site.spool_dir_for(getpass.getuser()) / "selftest"
    backend = make_backend(slurm_conf)
    job_id, data = submit_and_wait(backend, partition, gres, inner, out_dir, extra, float(wait_s))
    data.setdefault("context", {})["slurm_job_id"] = job_id
    return data


_STYLE = {"PASS": "green", "FAIL": "bold red", "SKIP": "yellow", "DRY": "cyan"}


def _print_table(data: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(120, int(os.environ.get("COLUMNS", "0") or 0)))
    ctx = data.get("context", {})
    job = f", Slurm job {ctx['slurm_job_id']}" if ctx.get("slurm_job_id") else ""
    title = (f"slurm-dlrm selftest on {ctx.get('node') or ctx.get('host')} GPU {ctx.get('gpu_name')} "
             f"(model {ctx.get('model') or '?'}, NVML {ctx.get('nvml')}{job})")
    table = Table(title=title, show_lines=False)
    table.add_column("check")
    table.add_column("status")
    table.add_column("figure")
    table.add_column("why / fix")
    for c in data["checks"]:
        note = c["fix"] if c["status"] == "FAIL" else c["detail"]
        table.add_row(c["name"], f"[{_STYLE.get(c['status'], '')}]{c['status']}[/]", c["figure"], note)
    console.print(table)
    console.print("DRY = ran against the fake NVML / MPS daemon (code path only, no GPU measured)")
    console.print(f"verdict: {data['verdict']['text']}")
