"""`slurm-dlrm serve install-unit`: the packing service as a systemd user unit.

Where systemd-analyze is installed (the project's Debian 12 machine), each rendered
unit is also checked by `systemd-analyze verify --user`, which parses it as the user
manager would, resolves specifiers and checks that ExecStart's program exists. Where it
is not (a minimal image, the slurm-matrix roots, which count skips as failures), that
extra check is left out and the assertions on the text remain.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_dlrm.cli import cli
from slurm_dlrm.errors import BadInput
from slurm_dlrm.service.unit import UNIT_NAME, render_unit, systemd_quote, user_unit_dir


def verify(unit_text: str, tmp_path: Path) -> None:
    exe = shutil.which("systemd-analyze")
    if exe is None:
        return  # see the module docstring
    d = tmp_path / "verify"
    d.mkdir(exist_ok=True)
    runtime = tmp_path / "xdg-runtime"  # the user manager's runtime folder, which a root shell lacks
    runtime.mkdir(mode=0o700, exist_ok=True)
    (d / UNIT_NAME).write_text(unit_text)
    out = subprocess.run([exe, "verify", "--user", str(d / UNIT_NAME)], capture_output=True, text=True,  # noqa: S603
                         timeout=60, env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)}, check=False)
    assert out.returncode == 0, out.stderr


def test_quoting_follows_systemd_rules():
    assert systemd_quote("a b", what="x") == '"a b"'
    assert systemd_quote('100% "q" \\', what="x") == '"100%% \\"q\\" \\\\"'
    with pytest.raises(BadInput, match="control character"):
        systemd_quote("a\nb", what="SLURM_CONF")


def test_unit_runs_this_python_with_the_environment_it_needs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env = {"PATH": "/opt/slurm 24/bin:/usr/bin", "SLURM_CONF": "/etc/slurm/100%.conf",
           "SLURM_DLRM_SITE": "site.toml", "HOME": "/home/u", "OTHER": "x"}
    text = render_unit(user="alice", python=sys.executable, env=env)
    assert f'ExecStart="{sys.executable}" "-m" "slurm_dlrm" "-v" "serve"' in text
    envs = [line for line in text.splitlines() if line.startswith("Environment=")]
    assert envs == ['Environment="PATH=/opt/slurm 24/bin:/usr/bin"',
                    'Environment="SLURM_CONF=/etc/slurm/100%%.conf"',
                    f'Environment="SLURM_DLRM_SITE={tmp_path}/site.toml"']
    assert "Restart=always" in text and "WantedBy=default.target" in text
    verify(text, tmp_path)


def test_unit_with_an_awkward_python_path_passes_systemd(tmp_path):
    odd = tmp_path / "my venv 100%" / "bin"
    odd.mkdir(parents=True)
    python = odd / "python"
    python.symlink_to(sys.executable)
    text = render_unit(user="alice", python=str(python), env={"PATH": "/usr/bin", "SLURM_CONF": 'a"b\\c'})
    assert "my venv 100%%" in text and 'Environment="SLURM_CONF=a\\"b\\\\c"' in text
    verify(text, tmp_path)


def test_values_systemd_cannot_take_are_refused():
    with pytest.raises(BadInput, match="refuses a quote"):
        render_unit(user="a", python="/opt/it's/python", env={})
    with pytest.raises(BadInput, match="not an absolute path"):
        render_unit(user="a", python="python3", env={})
    with pytest.raises(BadInput, match="--env NOPE: not set"):
        render_unit(user="a", python=sys.executable, env={}, extra_env=["NOPE"])
    with pytest.raises(BadInput, match="not a variable name"):
        render_unit(user="a", python=sys.executable, env={"A-B": "1"}, extra_env=["A-B"])


def test_user_unit_dir():
    assert user_unit_dir({"XDG_CONFIG_HOME": "/x/cfg"}) == Path("/x/cfg/systemd/user")
    assert user_unit_dir({"HOME": "/home/u"}) == Path("/home/u/.config/systemd/user")


def test_install_unit_command(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/lib")
    runner = CliRunner()
    first = runner.invoke(cli, ["serve", "install-unit", "--env", "LD_LIBRARY_PATH"])
    assert first.exit_code == 0, first.output
    unit = tmp_path / "cfg" / "systemd" / "user" / UNIT_NAME
    assert first.output.splitlines() == [
        f"wrote: {unit}",
        f"start it now and at every login: systemctl --user daemon-reload && systemctl --user enable --now {UNIT_NAME}"]
    assert stat.S_IMODE(unit.stat().st_mode) == 0o644
    assert 'Environment="LD_LIBRARY_PATH=/opt/lib"' in unit.read_text()
    again = json.loads(runner.invoke(cli, ["serve", "install-unit", "--env", "LD_LIBRARY_PATH", "--json"]).output)
    assert again == {"unit": str(unit), "changed": False, "start": first.output.splitlines()[1].split(": ", 1)[1]}
    printed = runner.invoke(cli, ["serve", "install-unit", "--print", "--site", str(tmp_path / "s.toml")])
    assert printed.exit_code == 0 and f'Environment="SLURM_DLRM_SITE={tmp_path}/s.toml"' in printed.output
    verify(unit.read_text(), tmp_path)


def test_install_unit_bad_env_is_one_line_exit_2(tmp_path):
    out = subprocess.run([sys.executable, "-m", "slurm_dlrm", "serve", "install-unit", "--print",  # noqa: S603
                          "--env", "SLURM_DLRM_TEST_UNSET_VAR"], capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if k != "SLURM_DLRM_TEST_UNSET_VAR"}, check=False)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip() == ("slurm-dlrm: error: serve install-unit: --env SLURM_DLRM_TEST_UNSET_VAR: "
                                  "not set in this environment")
