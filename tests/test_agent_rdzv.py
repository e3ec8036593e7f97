"""A multi-rank job's rendezvous is a FileStore in a private folder, not a TCP store on
127.0.0.1:MASTER_PORT that any process on the node could join (issue 32 item 13)."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from agent_harness import agent_options

from slurm_dlrm.agent.loop import Agent
from slurm_dlrm.agent.placement import parse_placement
from slurm_dlrm.errors import BadInput
from tests.test_agent_ranks import _pack, _rank_env

ROOT = Path(__file__).resolve().parent.parent


def test_ranks_rendezvous_through_a_private_file_of_their_own_job(agent_world):
    pack, pd = _pack(agent_world, ["--steps", "20", "--step-s", "0.05"])
    agent = Agent(parse_placement(pd), agent_options(agent_world))
    seen: list[tuple[int, int]] = []
    real_launch = agent._launch

    def spy(m, joined=False):
        real_launch(m, joined)
        if m.placement.world_size == 1:
            assert "SLURM_DLRM_RDZV_FILE" not in m.env  # a single member is no rank of anything
            return
        folder = Path(m.env["SLURM_DLRM_RDZV_FILE"]).parent
        st = folder.stat()
        seen.append((stat.S_IMODE(st.st_mode), st.st_uid))

    agent._launch = spy  # type: ignore[method-assign]
    agent.run()
    assert agent.job_states == {5: "COMPLETED", 6: "COMPLETED"}
    envs = [_rank_env(agent_world, r)["env"] for r in (0, 1)]
    files = {e["SLURM_DLRM_RDZV_FILE"] for e in envs}
    assert len(files) == 1  # one store for the job's ranks
    (rdzv,) = files
    assert Path(rdzv).parent.parent == Path(agent_options(agent_world).tmp_root) / agent.run_dir.name
    assert seen == [(0o700, os.geteuid())] * 2  # a folder only its user can enter


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a folder owned by another uid")
def test_a_run_folder_someone_else_made_first_is_refused(agent_world):
    pack, pd = _pack(agent_world, ["--steps", "5"])
    agent = Agent(parse_placement(pd), agent_options(agent_world))
    agent.run_dir.mkdir(parents=True)
    os.chmod(agent.run_dir, 0o777)
    os.chown(agent.run_dir, 65534, 65534)  # nobody squatted the predictable name in /tmp
    with pytest.raises(BadInput, match="not a folder of this user's"):
        agent.run()
    assert list(agent.run_dir.iterdir()) == []  # nothing written into it


def test_agents_of_two_clusters_on_one_host_keep_their_run_folders_apart(agent_world):
    """Issue 49 (chaos_live seed 2): two local clusters on one host number their Slurm jobs
    alike; the agents of job 14, node 0, of both used <tmp>/slurm-dlrm-agent-14-0 and the
    first to exit removed it under the other, whose gang then failed to launch (ENOENT on
    its rendezvous folder). The cluster's name (SLURM_CLUSTER_NAME) keeps them apart."""
    pack, pd = _pack(agent_world, ["--steps", "5", "--step-s", "0.01"])
    mine = Agent(parse_placement(pd), agent_options(agent_world, slurm_job_id="14", cluster_name="site6820"))
    other = Agent(parse_placement(pd), agent_options(agent_world, slurm_job_id="14", cluster_name="site6830"))
    assert mine.run_dir != other.run_dir and "site6820" in mine.run_dir.name
    mine.run_dir.mkdir(parents=True, mode=0o700)
    (mine.run_dir / "rdzv-61-x").mkdir()  # a gang's rendezvous folder, in use
    other.run()  # the other cluster's agent runs its pack and exits, removing its folder
    assert not other.run_dir.exists() and (mine.run_dir / "rdzv-61-x").is_dir()


RANK = textwrap.dedent("""
    import os, socket, sys, time
    import torch
    from slurm_dlrm.train.runner import init_distributed
    import torch.distributed as dist
    info = init_distributed(torch.device("cpu"))
    port = int(os.environ["MASTER_PORT"])
    with socket.socket() as s:  # nothing of this job listens on MASTER_PORT
        open_ = s.connect_ex(("127.0.0.1", port)) == 0
    dist.barrier()
    print("rank", info.rank, "port-open", open_, flush=True)
    dist.destroy_process_group()
""")


def test_the_runner_opens_no_tcp_store_when_given_the_file(tmp_path):
    pytest.importorskip("torch")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    folder = tmp_path / "rdzv"
    folder.mkdir(mode=0o700)
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), SLURM_DLRM_RDZV_FILE=str(folder / "store"),
                   PYTHONPATH=str(ROOT))
        procs.append(subprocess.Popen([sys.executable, "-c", RANK], env=env, stdout=subprocess.PIPE,  # noqa: S603
                                      stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert all("port-open False" in o for o in outs), outs
