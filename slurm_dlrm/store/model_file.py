"""Learned interference model files: read with owner and mode checks, written atomically.

The model object and its features are pure (`slurm_dlrm.packing.learned`); this module
does the file I/O for `slurm-dlrm interference fit`, `simulate --plan-model learned:FILE`
and the service (its own model in the store folder, or the site's
`adapt.interference_model`).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from slurm_dlrm.errors import BadInput

if TYPE_CHECKING:
    from slurm_dlrm.packing.learned import LearnedInterference


MODEL_MAX_BYTES = 64 << 20  # a model of 100 trees is ~0.5 MB; anything far larger is not ours


def model_file_problem(st: os.stat_result, uid: int) -> str | None:
    """Why a model file with this status must not be loaded (None: it may).

    Ours (uid) or root's, and writable by no one else: the trees steer every pack of
    the service, so a file another user can change would let them steer ours."""
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid not in (uid, 0):
        return f"owned by uid {st.st_uid}, not by you (uid {uid}) or root"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"writable by group or others (mode {stat.S_IMODE(st.st_mode):o}); chmod go-w it"
    return None


def load_model(path: str | os.PathLike[str], uid: int | None = None) -> LearnedInterference:
    """Read a model file written by `save_model` (BadInput naming the file and the problem)."""
    from slurm_dlrm.packing.learned import LearnedInterference

    where = str(path)
    try:
        fd = os.open(where, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise BadInput(f"{where}: cannot read: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as fh:
        problem = model_file_problem(os.fstat(fh.fileno()), os.geteuid() if uid is None else uid)
        if problem:
            raise BadInput(f"{where}: refused: {problem}")
        raw = fh.read(MODEL_MAX_BYTES + 1)
    if len(raw) > MODEL_MAX_BYTES:
        raise BadInput(f"{where}: larger than {MODEL_MAX_BYTES >> 20} MiB: not a model file")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadInput(f"{where}: corrupt model file (not JSON: {exc})") from None
    try:
        return LearnedInterference.from_dict(data)
    except (ValueError, RecursionError) as exc:
        raise BadInput(f"{where}: {exc}") from None


def save_model(model: LearnedInterference, path: str | os.PathLike[str]) -> None:
    """Write atomically (a temporary file in the same folder, fsync, rename), mode 0600."""
    target = Path(path)
    text = json.dumps(model.as_dict(), separators=(",", ":"))
    folder = target.parent if str(target.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
