"""`slurm-dlrm demo`: click glue over slurm_dlrm.service.demo."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import click

from slurm_dlrm.errors import EXIT_OK, EXIT_RUNTIME


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
def demo(count: int | None, specs: tuple[str, ...], workdir: str | None, round_seconds: float, timeout_s: float,
         no_report: bool, as_json: bool) -> None:
    """Run the whole path on the local cluster: pack a sweep of tiny DLRMs onto shared GPUs.

    Brings up the local Slurm cluster (2 nodes x 4 fake GPUs, with accounting; reused
    if it runs), starts your packing service, submits the tiny DLRM specs of
    examples/sweep/, follows them to the end (they train on the CPU), then prints
    the accounting summary: GPU-hours used vs one job per GPU, and the report's path.

    \b
    Example:
      slurm-dlrm demo
      slurm-dlrm demo -n 6 --json
      slurm-dlrm cluster down      # afterwards, to stop the local cluster

    Exit code 0 if every job completed, 1 otherwise.
    """
    from slurm_dlrm.service.demo import default_specs, fresh_workdir, run_demo
    from slurm_dlrm.service.progress import follow_jobs

    chosen = [Path(s).resolve() for s in specs] if specs else default_specs(count)
    work = Path(workdir).resolve() if workdir else fresh_workdir(Path(tempfile.gettempdir()) / "slurm-dlrm-demo")

    def say(text: str) -> None:
        click.echo(f"demo: {text}", err=True)

    def follow(site: Any, user: str, ids: list[int], t: float) -> list[Any]:
        return follow_jobs(site, user, ids, timeout_s=t)

    result = run_demo(chosen, work, say=say, follow=follow, round_seconds=round_seconds, timeout_s=timeout_s,
                      report=not no_report)
    saved = result.run_gpu_hours - result.gpu_hours
    summary = {
        "jobs": len(result.job_ids), "states": result.states, "packs": result.packs,
        "gpus_allocated": result.pack_gpus, "gpus_at_one_job_per_gpu": len(result.job_ids),
        "gpu_hours_used": round(result.gpu_hours, 5), "gpu_hours_one_job_per_gpu": round(result.run_gpu_hours, 5),
        "gpu_hours_saved": round(saved, 5), "acct_excl_gpu_hours": round(result.excl_gpu_hours, 5),
        "seconds": round(result.seconds, 1), "workdir": str(result.workdir),
        "report": str(result.report_path) if result.report_path else None,
    }
    if as_json:
        click.echo(json.dumps(summary, indent=1, sort_keys=True))
    else:
        pct = f" ({saved / result.run_gpu_hours:.0%} less)" if result.run_gpu_hours > 0 else ""
        click.echo("\n".join([
            f"{len(result.job_ids)} jobs: " + ", ".join(f"{n} {s.lower()}" for s, n in sorted(result.states.items())),
            f"packed into {result.packs} Slurm jobs on {result.pack_gpus} GPUs "
            f"(one job per GPU would take {len(result.job_ids)} GPUs)",
            f"GPU-hours used: {result.gpu_hours:.4f}; at one job per GPU: {result.run_gpu_hours:.4f}{pct}",
            f"took {result.seconds:.0f} s; details: slurm-dlrm acct (SLURM_DLRM_SITE={result.workdir}/site.toml)",
            f"report: {result.report_path}" if result.report_path else "report: skipped",
        ]))
    sys.exit(EXIT_OK if result.ok else EXIT_RUNTIME)
