"""Atomic, verifiable checkpoints of a (sharded) training state.

Layout, in the checkpoint folder:

    step-000000500/            one complete checkpoint
      rank0.bin                raw tensor bytes of rank 0, back to back
      rank0.json               index: name, dtype, shape, offset, nbytes per tensor
      manifest.json            written last: step, world size, spec fingerprint, plan
                               hash, and size + sha256 of every other file
    .tmp-step-000000600/       being written; never read, removed on the next start

A checkpoint is written into a `.tmp-` folder, every file fsynced, the manifest written
and fsynced last, then the folder renamed into place (and the parent fsynced), so a
SIGKILL at any moment leaves either the old set or the new one. Loading verifies sizes
and hashes first; anything that fails is skipped with a warning, never loaded.

Tensors are stored raw (no pickle): a state is streamed to disk tensor by tensor, so a
large table is never copied in memory, and loading copies into the live tensors
(sharded tables, fused optimizer state) in place.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

FORMAT = 1
PREFIX = "step-"
TMP_PREFIX = ".tmp-"
MANIFEST = "manifest.json"
_CHUNK = 1 << 24

_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "float32", torch.float64: "float64", torch.float16: "float16",
    torch.bfloat16: "bfloat16", torch.int64: "int64", torch.int32: "int32", torch.int16: "int16",
    torch.int8: "int8", torch.uint8: "uint8", torch.bool: "bool",
}
_BY_NAME = {v: k for k, v in _DTYPES.items()}


class CheckpointError(Exception):
    """A checkpoint that must not be loaded (the message says why)."""


def step_dir_name(step: int) -> str:
    return f"{PREFIX}{step:09d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, data: Any) -> None:
    with open(path, "w") as fh:
        json.dump(data, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())


def _as_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: store the bits
        t = t.view(torch.int16)
    return t.numpy().data.cast("B")


def write_rank_files(tmp_dir: Path, rank: int, tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """Write rank<r>.bin and rank<r>.json into `tmp_dir`; return {file: {bytes, sha256}}."""
    index: list[dict[str, Any]] = []
    digest = hashlib.sha256()
    offset = 0
    bin_path = tmp_dir / f"rank{rank}.bin"
    with open(bin_path, "wb") as fh:
        for name, t in tensors.items():
            if t.dtype not in _DTYPES:
                raise CheckpointError(f"{name}: cannot store dtype {t.dtype}")
            data = _as_bytes(t)
            fh.write(data)
            digest.update(data)
            index.append({"name": name, "dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                          "offset": offset, "nbytes": len(data)})
            offset += len(data)
        fh.flush()
        os.fsync(fh.fileno())
    json_path = tmp_dir / f"rank{rank}.json"
    _write_json(json_path, {"tensors": index})
    return {
        bin_path.name: {"bytes": offset, "sha256": digest.hexdigest()},
        json_path.name: {"bytes": json_path.stat().st_size, "sha256": _sha256(json_path)},
    }


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def prepare_tmp(ckpt_dir: Path, step: int) -> Path:
    """(rank 0) A fresh, empty `.tmp-` folder for the checkpoint of `step`."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    tmp = ckpt_dir / f"{TMP_PREFIX}{step_dir_name(step)}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def commit(ckpt_dir: Path, step: int, files: dict[str, dict[str, Any]], meta: dict[str, Any]) -> Path:
    """(rank 0) Write the manifest into the `.tmp-` folder and rename it into place."""
    tmp = ckpt_dir / f"{TMP_PREFIX}{step_dir_name(step)}"
    manifest = {"format": FORMAT, "step": step, "created_t": time.time(), "files": files, **meta}
    _write_json(tmp / MANIFEST, manifest)
    _fsync_dir(tmp)
    final = ckpt_dir / step_dir_name(step)
    if final.exists():  # the same step again (e.g. a signal right after a resume)
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(ckpt_dir)
    return final


def save(ckpt_dir: Path, step: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> Path:
    """Single-process save: tmp folder, data, manifest, rename."""
    tmp = prepare_tmp(ckpt_dir, step)
    files = write_rank_files(tmp, 0, tensors)
    return commit(ckpt_dir, step, files, meta)


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    manifest: dict[str, Any]


def list_steps(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """Complete-looking checkpoint folders, newest first (not yet verified)."""
    if not ckpt_dir.is_dir():
        return []
    out: list[tuple[int, Path]] = []
    for p in ckpt_dir.iterdir():
        if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit():
            out.append((int(p.name[len(PREFIX):]), p))
    return sorted(out, reverse=True)


def verify(path: Path, expect: dict[str, Any]) -> Checkpoint:
    """Read and check a checkpoint folder: manifest, every file's size and sha256, and
    that `expect`'s keys (world size, spec fingerprint, plan hash) match. Raise
    CheckpointError saying what is wrong."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise CheckpointError("no manifest (a partial write)") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"unreadable manifest: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"unknown manifest format {manifest.get('format') if isinstance(manifest, dict) else manifest!r}")
    for key, want in expect.items():
        if manifest.get(key) != want:
            raise CheckpointError(f"{key} is {manifest.get(key)!r}, this run has {want!r}")
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise CheckpointError("manifest lists no files")
    for name, info in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{name} is missing")
        size = f.stat().st_size
        if size != info.get("bytes"):
            raise CheckpointError(f"{name} has {size} bytes, the manifest says {info.get('bytes')}")
        if _sha256(f) != info.get("sha256"):
            raise CheckpointError(f"{name} does not match its sha256")
    return Checkpoint(path=path, step=int(manifest["step"]), manifest=manifest)


def newest_valid(ckpt_dir: Path, expect: dict[str, Any],
                 verify_fn: Callable[[Path, dict[str, Any]], Checkpoint] = verify) -> Checkpoint | None:
    """The newest checkpoint that verifies; the ones that do not are logged and skipped."""
    for _step, path in list_steps(ckpt_dir):
        try:
            return verify_fn(path, expect)
        except CheckpointError as exc:
            log.warning("checkpoint %s skipped: %s", path, exc)
    return None


def read_rank(ckpt: Checkpoint, rank: int) -> dict[str, torch.Tensor]:
    """The tensors of one rank, read from the verified files."""
    index = json.loads((ckpt.path / f"rank{rank}.json").read_text())["tensors"]
    out: dict[str, torch.Tensor] = {}
    with open(ckpt.path / f"rank{rank}.bin", "rb") as fh:
        for entry in index:
            fh.seek(int(entry["offset"]))
            raw = fh.read(int(entry["nbytes"]))
            dtype = _BY_NAME[entry["dtype"]]
            np_dtype = np.int16 if dtype == torch.bfloat16 else getattr(np, entry["dtype"])
            arr = np.frombuffer(bytearray(raw), dtype=np_dtype).reshape(entry["shape"])
            t = torch.from_numpy(arr)
            out[entry["name"]] = t.view(torch.bfloat16) if dtype == torch.bfloat16 else t
    return out


def check_compatible(targets: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> None:
    """Raise CheckpointError unless names, shapes and dtypes all match."""
    missing = sorted(set(targets) - set(saved))
    extra = sorted(set(saved) - set(targets))
    if missing or extra:
        raise CheckpointError(f"tensors differ: missing {missing[:3]}, unexpected {extra[:3]}")
    for name, t in targets.items():
        s = saved[name]
        if tuple(s.shape) != tuple(t.shape) or s.dtype != t.dtype:
            raise CheckpointError(f"{name}: saved {s.dtype}{tuple(s.shape)}, live {t.dtype}{tuple(t.shape)}")


def load_into(targets: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> None:
    """Copy saved tensors into the live ones, after checking that names, shapes and
    dtypes all match (nothing is copied when anything differs)."""
    check_compatible(targets, saved)
    with torch.no_grad():
        for name, t in targets.items():
            t.copy_(saved[name])


def prune(ckpt_dir: Path, keep: int, written_step: int | None = None) -> None:
    """Keep the `keep` newest checkpoints up to `written_step` (the one just written);
    remove older ones. Folders of later steps (left by another spec, or broken) are
    not this run's to judge: they stay, and resume skips them with a warning."""
    steps = [(s, p) for s, p in list_steps(ckpt_dir) if written_step is None or s <= written_step]
    for _step, path in steps[max(keep, 1):]:
        shutil.rmtree(path, ignore_errors=True)


def remove_all(ckpt_dir: Path) -> int:
    """Remove every checkpoint folder (a run told to start over); return how many."""
    found = list_steps(ckpt_dir)
    for _step, path in found:
        shutil.rmtree(path, ignore_errors=True)
    return len(found)


def remove_stale_tmp(ckpt_dir: Path) -> None:
    if not ckpt_dir.is_dir():
        return
    for p in ckpt_dir.iterdir():
        if p.name.startswith(TMP_PREFIX):
            log.warning("removing partial checkpoint %s (a write that did not finish)", p)
            shutil.rmtree(p, ignore_errors=True)
