"""The node's GPUs as the agent knows them: each allocated GPU's NVML index (the
allocation may name GPUs by UUID), its total memory and UUID, the NVML index that
names a GPU's dmem region, and `<pack_dir>/nodes/<node_index>.json`, the node's GPUs as
the node numbers them for `queue`.

Apart from the agent loop (loop.py): plain functions over the NVML seam and the
environment, read once when the agent starts.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from slurm_dlrm.agent.nvml import Nvml

log = logging.getLogger(__name__)

NODES_DIR = "nodes"  # <pack_dir>/nodes/<node_index>.json: the node's real GPU indexes


def nvml_indices(nvml: Nvml, gpus: list[str]) -> list[int]:
    """Each allocated GPU's NVML index (-1: a UUID NVML does not list); [] when NVML does
    not initialise."""
    indices: list[int] = []
    if not nvml.init():
        return indices
    if all(g.isdigit() for g in gpus):
        indices = [int(g) for g in gpus]
    else:
        # UUID names: find each one's NVML index.
        snap = nvml.sample(list(range(nvml.device_count())))
        by_uuid = {g.uuid: g.index for g in snap.gpus if g.uuid}
        for name in gpus:
            match = [i for u, i in by_uuid.items() if u.startswith(name)]
            indices.append(match[0] if match else -1)
    return indices


def gpu_facts(nvml: Nvml, indices: list[int]) -> tuple[dict[int, int], dict[int, str]]:
    """Each GPU's total memory in bytes and its UUID, by position in the allocation
    (enforced fences only, so v2 nodes sample NVML as before): a fence above its GPU is
    refused, SM partitions name the UUID."""
    total_bytes: dict[int, int] = {}
    uuids: dict[int, str] = {}
    if not indices:
        return total_bytes, uuids
    by_index = {g.index: g for g in nvml.sample([i for i in indices if i >= 0]).gpus}
    for pos, idx in enumerate(indices):
        g = by_index.get(idx)
        if g is not None and g.memory_total_bytes:
            total_bytes[pos] = g.memory_total_bytes
        if g is not None and g.uuid:
            uuids[pos] = g.uuid
    return total_bytes, uuids


def nvml_position(gpu_index: int, indices: list[int], gpus: list[str]) -> int:
    """The GPU's NVML index (dmem regions are listed per physical GPU)."""
    if gpu_index < len(indices) and indices[gpu_index] >= 0:
        return indices[gpu_index]
    g = gpus[gpu_index] if gpu_index < len(gpus) else ""
    return int(g) if g.isdigit() else gpu_index


def write_node_gpus(pack_dir: str, node_index: int, node_name: str, gpus: list[str], env: dict[str, str]) -> None:
    """`<pack_dir>/nodes/<node_index>.json`: the node and its GPUs as the node numbers
    them (Slurm's IDX, from SLURM_STEP_GPUS/SLURM_JOB_GPUS, which device cgroups do
    not renumber; else the CUDA names), so `queue` shows the GPU a member really
    has, not its position in the allocation (docs/interfaces.md 3a)."""
    real = None
    for key in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
        value = env.get(key, "").strip()
        if value and value != "NoDevFiles":
            real = [g.strip() for g in value.split(",") if g.strip()]
            break
    if real is None or len(real) != len(gpus):
        real = list(gpus)
    d = Path(pack_dir) / NODES_DIR
    try:
        d.mkdir(mode=0o700, exist_ok=True)
        tmp = d / f".{node_index}.tmp"
        tmp.write_text(json.dumps({"node": node_name, "gpus": real, "cuda_visible_devices": list(gpus)}))
        os.replace(tmp, d / f"{node_index}.json")
    except OSError as exc:  # only `queue`'s GPU column depends on it
        log.warning("could not write %s: %s", d, exc)
