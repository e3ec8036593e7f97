"""`slurm-dlrm completion bash|zsh`: the shell completion script (click's)."""

from __future__ import annotations

import click

COMPLETE_VAR = "_SLURM_DLRM_COMPLETE"


@click.command("completion", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]))
@click.pass_context
def completion(ctx: click.Context, shell: str) -> None:
    """Print the shell completion script: commands, options, your job ids (show, log,
    cancel, requeue) and the columns of `queue -o`.

    \b
    Example:
      eval "$(slurm-dlrm completion bash)"                      # this shell
      slurm-dlrm completion bash > ~/.local/share/bash-completion/completions/slurm-dlrm
      slurm-dlrm completion zsh > "${fpath[1]}/_slurm-dlrm"     # zsh
    """
    from click.shell_completion import get_completion_class

    cls = get_completion_class(shell)
    assert cls is not None  # the Choice above names only shells click knows
    root = ctx.find_root().command  # the `slurm-dlrm` group (commands sit below cli.py)
    click.echo(cls(root, {}, "slurm-dlrm", COMPLETE_VAR).source())
