"""`slurm-dlrm agent`: click glue over slurm_dlrm.agent.loop."""

from __future__ import annotations

import getpass
import json
import os
import shutil
import socket
import sys
from pathlib import Path

import click

from slurm_dlrm.agent.placement import allocation_gpus
from slurm_dlrm.errors import BadInput, DlrmError


def find_pack_file(spool: Path, pack_id: int | None, name: str) -> Path:
    """<spool>/<pack name>/placement.json of the pack with this id (docs/interfaces.md 3a)."""
    for candidate in sorted(spool.glob(f"*/{name}")):
        try:
            if json.loads(candidate.read_text()).get("pack_id") == pack_id:
                return candidate
        except (OSError, ValueError, AttributeError):
            continue
    raise BadInput(f"--pack {pack_id}: no {name} with that pack_id under {spool}")


@click.command("agent", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--pack-file", type=click.Path(dir_okay=False), help="The pack's placement.json.")
@click.option("--pack", "pack_id", type=int, help="Pack id: finds <spool_dir>/<pack name>/placement.json with this pack_id.")
@click.option("--site", "site_path", type=click.Path(dir_okay=False), help="Site config (default: lookup order).")
@click.option("--node-index", type=int, help="This node's position in the allocation [default: $SLURM_NODEID or 0].")
@click.option("--node-name", help="Name used in reports [default: $SLURMD_NODENAME or the host name].")
@click.option("--gpus", help="Allocated GPUs, comma-separated [default: $CUDA_VISIBLE_DEVICES, $SLURM_JOB_GPUS, or all NVML GPUs].")
@click.option("--launch", type=click.Choice(["auto", "step", "process"]), default="auto", show_default=True,
              help="step: each member as its own `srun --overlap` job step (listed by sacct; stop it gracefully with SIGUSR1); process: child process group; auto: process.")
@click.option("--mps", "mps_mode", type=click.Choice(["auto", "own", "site", "off"]), default="auto", show_default=True,
              help="own: start a daemon; site: use the one at $CUDA_MPS_PIPE_DIRECTORY (gres/mps); auto: site if it answers, else own.")
@click.option("--sample-interval", type=float, help="Seconds between samples [default: the placement's].")
@click.option("--json", "as_json", is_flag=True, help="Print the end summary as JSON.")
def agent(pack_file: str | None, pack_id: int | None, site_path: str | None, node_index: int | None,
          node_name: str | None, gpus: str | None, launch: str, mps_mode: str, sample_interval: float | None,
          as_json: bool) -> None:
    """Run one node's members of a pack: MPS, launch, sampling, enforcement, reports.

    Started once per node by the pack's batch script. Reports go to
    <pack_dir>/reports/<node>.jsonl; the command exits after every member has ended
    and the last report is written. SIGTERM is forwarded to every member (so each
    checkpoints), then members still running after term_grace_s are killed.

    \b
    Example:
      srun --ntasks-per-node=1 slurm-dlrm agent --pack-file /spool/pack-7/placement.json
      slurm-dlrm agent --pack 7 --launch process --mps off    # outside Slurm
    """
    from slurm_dlrm.agent.loop import Agent, AgentOptions
    from slurm_dlrm.agent.nvml import Nvml
    from slurm_dlrm.agent.placement import PLACEMENT_FILE, load_placement
    from slurm_dlrm.site import load_site

    if (pack_file is None) == (pack_id is None):
        raise BadInput("give exactly one of --pack-file or --pack")
    if sample_interval is not None and sample_interval < 0.05:
        raise BadInput(f"--sample-interval: must be >= 0.05, got {sample_interval:g}")
    site = load_site(site_path)
    if pack_file is None:
        pack_file = str(find_pack_file(site.spool_dir_for(getpass.getuser()), pack_id, PLACEMENT_FILE))
    placement = load_placement(pack_file)
    env = dict(os.environ)
    if node_index is None:
        raw = env.get("SLURM_NODEID", "0")
        if not raw.isdigit():
            raise BadInput(f"SLURM_NODEID: not a number: {raw!r}")
        node_index = int(raw)
    node = node_name or env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    gpu_list = [g.strip() for g in gpus.split(",") if g.strip()] if gpus else allocation_gpus(env)
    nvml = Nvml()
    if gpu_list is None:
        gpu_list = [str(i) for i in range(nvml.device_count())]
    in_allocation = bool(env.get("SLURM_JOB_ID")) and shutil.which("srun") is not None
    if launch == "auto":
        # Child processes: a SIGTERM to the allocation then reaches each member as SIGTERM.
        # Member steps are opt-in because Slurm 22.05's srun answers SIGTERM with SIGKILL
        # to its step (src/srun signals: SIGTERM -> launch_fwd_signal(SIGKILL)), and every
        # srun the agent starts is signalled with the agent's own step (docs/agent.md).
        launch = "process"
    elif launch == "step" and not in_allocation:
        raise BadInput("--launch step: not inside a Slurm allocation (no SLURM_JOB_ID or no srun)")
    opts = AgentOptions(
        node_index=node_index, node_name=node, gpus=gpu_list, launch=launch, mps_mode=mps_mode,
        site_mps_enabled=site.mps.enabled, fence_mode=site.mps.mode, dmem_mode=site.mps.dmem, tmp_root=env.get("TMPDIR") or "/tmp", python=sys.executable,
        sample_interval_s=sample_interval, slurm_job_id=env.get("SLURM_JOB_ID"),
        cluster_name=env.get("SLURM_CLUSTER_NAME"),
        heartbeat_every_s=max(10.0, min(30.0, site.agent.heartbeat_timeout_s / 4)),
    )
    try:
        runner = Agent(placement, opts, nvml=nvml, env=env)
    except OSError as exc:
        raise DlrmError(f"cannot write reports under {placement.pack_dir}: {exc}") from None
    if not runner.members:
        click.echo(f"agent: no members on node index {node_index}", err=True)
    runner.run()
    # one state per job: a multi-rank job's, as a whole (docs/agent.md "Multi-rank jobs")
    states = {m.placement.job_id: runner.job_states.get(m.placement.job_id, m.state) for m in runner.members}
    if as_json:
        click.echo(json.dumps({"pack_id": placement.pack_id, "node": node, "mps": runner.mps.mode, "launch": launch,
                               "report": str(runner.reports.path), "members": states}))
    else:
        summary = ", ".join(f"{job}={state}" for job, state in states.items()) or "none"
        click.echo(f"agent: pack {placement.pack_id} node {node}: mps {runner.mps.mode}; members {summary}")
