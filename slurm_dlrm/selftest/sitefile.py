"""Write measured figures into one `[gpu_models.<name>]` entry of a site file.

Line-based, so comments, key order and every other table stay as they are: a key that
is there gets its value replaced (its trailing comment kept), a missing key is added
after the entry's last key line. The result is parsed and validated as a site file
before it replaces the original (same folder, fsync, os.replace, the original's mode),
so a failure leaves the file untouched.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import tomllib
from pathlib import Path

from slurm_dlrm.errors import BadInput, DlrmError
from slurm_dlrm.site import parse_site

_HEADER = re.compile(r"^\s*\[\[?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
_KEY = re.compile(r"^(\s*)([A-Za-z0-9_-]+)(\s*=\s*)([^#]*?)(\s*#.*)?$")


def check_writable(path: str | os.PathLike[str]) -> Path:
    """The site file must exist, parse, and be replaceable by this user (before anything runs)."""
    p = Path(path)
    if not p.is_file():
        raise BadInput(f"--write-site {p}: no such file (copy site-config/site.toml first)")
    folder = p.parent if str(p.parent) else Path(".")
    if not os.access(p, os.R_OK | os.W_OK) or not os.access(folder, os.W_OK | os.X_OK):
        raise BadInput(f"--write-site {p}: no write access to the file or its folder (it is replaced atomically)")
    try:
        parse_site(tomllib.loads(p.read_text()), str(p))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise BadInput(f"--write-site {p}: not valid TOML: {exc}") from None
    return p


def _format(value: float | int | str) -> str:
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: JSON's escapes are TOML's
    if isinstance(value, int):
        return str(value)
    return f"{value:.4g}" if abs(value) < 1000 else f"{value:.0f}"


def update_gpu_model_text(text: str, model: str, values: dict[str, float | int | str]) -> str:
    """The file's text with `values` set in `[gpu_models.<model>]` (pure)."""
    lines = text.splitlines(keepends=True)
    start = None
    for i, line in enumerate(lines):
        m = _HEADER.match(line)
        if m and m.group(1).replace(" ", "") in (f"gpu_models.{model}", f'gpu_models."{model}"'):
            start = i
            break
    if start is None:
        raise BadInput(f"site file: no [gpu_models.{model}] entry to write the figures into")
    end = len(lines)
    for i in range(start + 1, len(lines)):
        if _HEADER.match(lines[i]):
            end = i
            break
    todo = dict(values)
    last_key = start
    for i in range(start + 1, end):
        m = _KEY.match(lines[i].rstrip("\n"))
        if not m:
            continue
        last_key = i
        key = m.group(2)
        if key in todo:
            newline = "\n" if lines[i].endswith("\n") else ""
            lines[i] = f"{m.group(1)}{key}{m.group(3)}{_format(todo.pop(key))}{m.group(5) or ''}{newline}"
    if todo:
        if not lines[last_key].endswith("\n"):
            lines[last_key] += "\n"
        added = [f"{key} = {_format(v)}  # measured by slurm-dlrm selftest\n" for key, v in todo.items()]
        lines[last_key + 1:last_key + 1] = added
    return "".join(lines)


def write_gpu_model(path: str | os.PathLike[str], model: str, values: dict[str, float | int | str]) -> None:
    """Set `values` in the model's entry of the site file at `path`, atomically."""
    p = Path(path)
    text = update_gpu_model_text(p.read_text(), model, values)
    try:
        parse_site(tomllib.loads(text), str(p))  # never write a file the loader would refuse
    except (tomllib.TOMLDecodeError, DlrmError) as exc:
        raise DlrmError(f"--write-site {p}: the updated file would not load ({exc}); left unchanged") from None
    mode = p.stat().st_mode & 0o7777
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
