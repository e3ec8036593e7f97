"""The `slurm-dlrm` command: click glue only.

Subcommands live in `slurm_dlrm.commands.<name>` and are imported on first use, so
`slurm-dlrm submit` never pays for torch or matplotlib imports of other commands.
Domain errors (`DlrmError`) become one line on stderr and their exit code.
"""

from __future__ import annotations

import importlib
import logging
import sys
from typing import Any

import click

from slurm_dlrm import __version__
from slurm_dlrm.errors import EXIT_RUNTIME, DlrmError

# name -> "module:attribute"; each command module owns its own options and help.
COMMANDS: dict[str, str] = {
    "acct": "slurm_dlrm.commands.store:acct",
    "cluster": "slurm_dlrm.commands.cluster:cluster",
    "demo": "slurm_dlrm.commands.demo:demo",
    "report": "slurm_dlrm.commands.store:report",
    "train": "slurm_dlrm.commands.train:train",
    "agent": "slurm_dlrm.commands.agent:agent",
    "admin": "slurm_dlrm.commands.admin:admin",
    "cancel": "slurm_dlrm.commands.queue:cancel",
    "queue": "slurm_dlrm.commands.queue:queue",
    "serve": "slurm_dlrm.commands.serve:serve",
    "show": "slurm_dlrm.commands.queue:show",
    "submit": "slurm_dlrm.commands.submit:submit",
    "estimate": "slurm_dlrm.commands.estimate:estimate",
    "exporter": "slurm_dlrm.commands.exporter:exporter",
    "interference": "slurm_dlrm.commands.interference:interference",
    "simulate": "slurm_dlrm.commands.simulate:simulate_cmd",
}

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = COMMANDS.get(cmd_name)
        if target is None:
            return None
        module_name, attr = target.split(":")
        command = getattr(importlib.import_module(module_name), attr)
        assert isinstance(command, click.Command)
        return command

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except DlrmError as exc:
            click.echo(f"slurm-dlrm: error: {exc}", err=True)
            ctx.exit(exc.exit_code)


@click.group(cls=LazyGroup, context_settings=CONTEXT_SETTINGS)
@click.version_option(__version__, "-V", "--version", prog_name="slurm-dlrm")
@click.option("-v", "--verbose", count=True, help="More log output on stderr (-vv for debug).")
def cli(verbose: int) -> None:
    """Pack many DLRM training jobs onto shared GPUs under Slurm.

    \b
    Example:
      slurm-dlrm cluster up          # a local Slurm cluster with fake GPUs
      slurm-dlrm demo                # submit a sweep and show the accounting

    Exit codes: 0 ok, 1 runtime error, 2 usage error or bad input.
    """
    level = logging.WARNING - 10 * verbose
    logging.basicConfig(level=max(level, logging.DEBUG), format="%(levelname)s %(name)s: %(message)s")


def main() -> None:
    try:
        cli.main(prog_name="slurm-dlrm")
    except KeyboardInterrupt:
        click.echo("slurm-dlrm: interrupted", err=True)
        sys.exit(EXIT_RUNTIME)
