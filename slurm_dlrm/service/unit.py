"""The per-user packing service as a systemd user unit (`slurm-dlrm serve install-unit`).

The unit is rendered from `templates/systemd/slurm-dlrm.service.j2`; every value is
computed here. systemd's user manager does not see the login shell's environment, so
the unit carries PATH (where sbatch and squeue are), SLURM_CONF and SLURM_DLRM_SITE as
they are when the unit is installed, plus any variable named with --env.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from slurm_dlrm.errors import BadInput
from slurm_dlrm.package_data import data_dir

UNIT_NAME = "slurm-dlrm.service"
CARRIED_ENV = ("PATH", "SLURM_CONF", "SLURM_DLRM_SITE")
_ENV_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_")


def systemd_quote(value: str, *, what: str) -> str:
    """One double-quoted word of a unit file line (systemd.syntax(7), systemd.service(5)).

    `%` starts a specifier and is doubled; backslash and `"` are escaped. Used for
    Environment= assignments and fixed ExecStart arguments (which carry no `$`)."""
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise BadInput(f"serve install-unit: {what}: a control character (newline?) cannot go into a unit file")
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%") + '"'


def exec_start(python: str) -> str:
    if not os.path.isabs(python):
        raise BadInput(f"serve install-unit: the Python to run is not an absolute path: {python}")
    # systemd refuses quotes and backslashes in the executable name itself ("special characters").
    if any(c in python for c in "\"'\\"):
        raise BadInput(f"serve install-unit: systemd refuses a quote or backslash in ExecStart's program: {python}")
    return " ".join(systemd_quote(a, what="ExecStart") for a in (python, "-m", "slurm_dlrm", "-v", "serve"))


def unit_environment(env: Mapping[str, str], extra: Sequence[str] = ()) -> list[str]:
    """`"NAME=value"` assignments for the variables the service needs, as set now."""
    out = []
    for name in dict.fromkeys((*CARRIED_ENV, *extra)):
        if not name or set(name) - _ENV_NAME_CHARS or name[0].isdigit():
            raise BadInput(f"serve install-unit: --env {name!r}: not a variable name")
        value = env.get(name)
        if value is None:
            if name in extra:
                raise BadInput(f"serve install-unit: --env {name}: not set in this environment")
            continue
        if name == "SLURM_DLRM_SITE":
            value = os.path.abspath(value)  # the unit's working folder is the home folder
        out.append(systemd_quote(f"{name}={value}", what=name))
    return out


def render_unit(*, user: str, python: str, env: Mapping[str, str], extra_env: Sequence[str] = ()) -> str:
    import jinja2  # only this command renders a unit

    jenv = jinja2.Environment(loader=jinja2.FileSystemLoader(str(data_dir("templates") / "systemd")),
                              undefined=jinja2.StrictUndefined, keep_trailing_newline=True, trim_blocks=True,
                              lstrip_blocks=True, autoescape=False)  # noqa: S701 - a unit file, values quoted above
    return jenv.get_template(f"{UNIT_NAME}.j2").render(
        user=user, unit_name=UNIT_NAME, exec_start=exec_start(python),
        environment=unit_environment(env, extra_env))


def user_unit_dir(env: Mapping[str, str]) -> Path:
    """Where systemd's user manager reads units the user installs (systemd.unit(5))."""
    config = env.get("XDG_CONFIG_HOME") or os.path.join(env.get("HOME") or os.path.expanduser("~"), ".config")
    return Path(config) / "systemd" / "user"


def install_unit(text: str, unit_dir: Path) -> tuple[Path, bool]:
    """Write the unit (0644, as systemd expects); returns its path and whether it changed."""
    unit_dir.mkdir(parents=True, exist_ok=True)
    path = unit_dir / UNIT_NAME
    old = path.read_text() if path.is_file() else None
    if old != text:
        tmp = path.with_name(f".{UNIT_NAME}.{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.chmod(0o644)
        os.replace(tmp, path)
    return path, old != text
