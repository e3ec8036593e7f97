"""A rank's place from Slurm's task variables (issue 48: one runner per `srun` task).

`srun` sets SLURM_PROCID (the global rank), SLURM_LOCALID (the rank on its node),
SLURM_NTASKS (the world size), SLURM_NODEID and SLURM_TASKS_PER_NODE ("2(x2),1": two
tasks on each of two nodes, then one). The batch script of a multi-node job sets
MASTER_ADDR (the first node's address as Slurm knows it) and MASTER_PORT (from the job
id) and SLURM_DLRM_RANKS_FROM_SLURM=1 (service/multinode.py), so a runner started by
someone's own `srun` is left to its own environment. No torch here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from slurm_dlrm.errors import BadInput

ENV_RANKS_FROM_SLURM = "SLURM_DLRM_RANKS_FROM_SLURM"


def tasks_per_node(text: str) -> list[int]:
    """SLURM_TASKS_PER_NODE ("2(x3),1") -> [2, 2, 2, 1]."""
    out: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise BadInput(f"SLURM_TASKS_PER_NODE: cannot read {text!r}")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def dist_env_from_slurm(env: Mapping[str, str]) -> dict[str, str]:
    """torch.distributed's variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
    GROUP_RANK) for this task; {} unless the batch script asked for it."""
    if env.get(ENV_RANKS_FROM_SLURM) != "1" or "SLURM_PROCID" not in env:
        return {}
    missing = [k for k in ("SLURM_NTASKS", "SLURM_LOCALID", "MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
    if missing:
        raise BadInput(f"a rank started by srun lacks {', '.join(missing)} in its environment")
    node = int(env.get("SLURM_NODEID", "0"))
    per_node = tasks_per_node(env["SLURM_TASKS_PER_NODE"]) if env.get("SLURM_TASKS_PER_NODE") else []
    local_world = per_node[node] if node < len(per_node) else int(env.get("SLURM_NTASKS_PER_NODE", "1"))
    return {"RANK": env["SLURM_PROCID"], "LOCAL_RANK": env["SLURM_LOCALID"], "WORLD_SIZE": env["SLURM_NTASKS"],
            "LOCAL_WORLD_SIZE": str(local_world), "GROUP_RANK": str(node)}
