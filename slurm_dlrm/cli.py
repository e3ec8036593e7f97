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
from slurm_dlrm.errors import EXIT_RUNTIME, EXIT_USAGE, DlrmError, one_line

# name -> "module:attribute"; each command module owns its own options and help.
COMMANDS: dict[str, str] = {
    "acct": "slurm_dlrm.commands.store:acct",
    "cluster": "slurm_dlrm.commands.cluster:cluster",
    "completion": "slurm_dlrm.commands.completion:completion",
    "demo": "slurm_dlrm.commands.demo:demo",
    "report": "slurm_dlrm.commands.store:report",
    "train": "slurm_dlrm.commands.train:train",
    "agent": "slurm_dlrm.commands.agent:agent",
    "admin": "slurm_dlrm.commands.admin:admin",
    "cancel": "slurm_dlrm.commands.queue:cancel",
    "log": "slurm_dlrm.commands.queue:log",
    "requeue": "slurm_dlrm.commands.queue:requeue",
    "queue": "slurm_dlrm.commands.queue:queue",
    "selftest": "slurm_dlrm.commands.selftest:selftest",
    "serve": "slurm_dlrm.commands.serve:serve",
    "show": "slurm_dlrm.commands.queue:show",
    "submit": "slurm_dlrm.commands.submit:submit",
    "spec": "slurm_dlrm.commands.spec:spec",
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

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        """click's main, but every error is the documented one line (not click's usage
        block): `slurm-dlrm: error: <what>: <why>`, exit 2 for usage."""
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.UsageError as exc:
            click.echo(f"slurm-dlrm: error: {one_line(usage_message(exc))}", err=True)
            sys.exit(exc.exit_code if exc.exit_code else EXIT_USAGE)
        except click.ClickException as exc:
            click.echo(f"slurm-dlrm: error: {one_line(exc.format_message())}", err=True)
            sys.exit(exc.exit_code)
        except click.exceptions.Abort:
            click.echo("slurm-dlrm: interrupted", err=True)
            sys.exit(EXIT_RUNTIME)
        sys.exit(rv if isinstance(rv, int) and not isinstance(rv, bool) else 0)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except DlrmError as exc:
            click.echo(f"slurm-dlrm: error: {one_line(str(exc))}", err=True)
            ctx.exit(exc.exit_code)


def usage_message(exc: click.UsageError) -> str:
    """One line: the command, what is wrong, where to look."""
    ctx = exc.ctx
    path = ctx.command_path if ctx is not None else "slurm-dlrm"
    sub = path.split(" ", 1)[1] if " " in path else ""
    path = f"slurm-dlrm {sub}".rstrip()
    if isinstance(exc, click.NoSuchOption) and sub == "submit":
        from slurm_dlrm.service.sbatch_options import refused_option

        refused = refused_option(exc.option_name)
        if refused is not None:
            return str(refused)
    msg = " ".join(exc.format_message().split())
    if msg.endswith("."):
        msg = msg[:-1]
    return f"{sub + ': ' if sub else ''}{msg} (see {path} --help)"


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
