"""Shared pieces of the agent tests (tests/conftest.py's `agent_world` gives the folder
they run in: fake MPS control first on PATH, fake NVML with 2 GPUs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from slurm_dlrm.agent.loop import AgentOptions


def agent_options(world: Path, **kw: Any) -> AgentOptions:
    """The agent of node 0 ("n1") over GPUs 0 and 1, members as processes, its
    temporaries under world/tmp, a heartbeat every 0.5 s; `kw` overrides."""
    base: dict[str, Any] = dict(node_index=0, node_name="n1", gpus=["0", "1"], launch="process",
                                tmp_root=str(world / "tmp"), heartbeat_every_s=0.5)
    base.update(kw)
    return AgentOptions(**base)
