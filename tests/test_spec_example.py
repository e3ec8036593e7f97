"""`slurm-dlrm spec --example` says what holds today (issue 32, also noticed)."""

from __future__ import annotations

from click.testing import CliRunner

from slurm_dlrm.cli import cli


def test_spec_example_no_longer_says_multi_gpu_needs_no_pack():
    """Multi-GPU jobs are packed since issue 18; the example said `> 1 only with --no-pack`."""
    res = CliRunner().invoke(cli, ["spec", "--example"])
    assert res.exit_code == 0
    line = next(ln for ln in res.output.splitlines() if ln.startswith("world_size:"))
    assert "only with submit --no-pack" not in line and "packed" in line
