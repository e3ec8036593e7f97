import click
from click.testing import CliRunner

from slurm_dlrm import __version__
from slurm_dlrm.cli import cli


def test_version():
    result = CliRunner().invoke(cli, ["--version"])
    assert result.exit_code == 0
    assert __version__ in result.output


def _all_commands(group: click.Group, ctx: click.Context, prefix=()):
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        assert cmd is not None, name
        yield prefix + (name,)
        if isinstance(cmd, click.Group):
            yield from _all_commands(cmd, ctx, prefix + (name,))


def test_every_command_has_help_with_an_example():
    runner = CliRunner()
    with click.Context(cli) as ctx:
        paths = list(_all_commands(cli, ctx))
    for path in paths:
        result = runner.invoke(cli, [*path, "--help"])
        assert result.exit_code == 0, (path, result.output)
        assert "Example" in result.output, f"{' '.join(path)} --help has no Example"
