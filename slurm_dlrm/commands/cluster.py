"""`slurm-dlrm cluster up|down|status`: a real Slurm cluster on localhost (click glue)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import click

from slurm_dlrm import localcluster as lc
from slurm_dlrm.errors import BadInput
from slurm_dlrm.localcluster import memory_cgroup

_STATE_DIR_HELP = (f"State folder (config, logs, spool, pid files). Default: ${lc.ENV_DIR}, "
                   "else /tmp/slurm-dlrm-<hash of this checkout>.")


def _state_dir_option(f: Any) -> Any:
    return click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path),
                        help=_STATE_DIR_HELP)(f)


def _json_option(f: Any) -> Any:
    return click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")(f)


@click.group("cluster")
def cluster() -> None:
    """A real Slurm cluster on this host with fake GPUs (a development and test tool).

    Several instances can run at once (one per checkout): each has its own state
    folder and port range, its own munged, slurmctld and one slurmd per node.

    \b
    Example:
      slurm-dlrm cluster up                 # 2 nodes x 4 h100 from the site config
      export SLURM_CONF=$(slurm-dlrm cluster status --conf)
      sinfo -o '%N %t %G'; srun --gres=gpu:1 env | grep CUDA
      slurm-dlrm cluster down
    """


@cluster.command("up")
@click.option("--nodes", type=int, help="Number of nodes (default: the site config's first node group).")
@click.option("--gpus-per-node", type=int, help="Fake GPUs per node (default: from the site config).")
@click.option("--accounting", is_flag=True, help="Also start MariaDB and slurmdbd so that sacct works.")
@_state_dir_option
@click.option("--base-port", type=int,
              help=f"First of {lc.PORTS_PER_INSTANCE} ports (slurmctld; +1 slurmdbd, +2 MariaDB, +10.. "
                   f"slurmd). Default: ${lc.ENV_PORT}, else derived from the state folder.")
@click.option("--site", "site_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Site config for the defaults (node shape, GPU type, partition, mps/shard).")
@click.option("--slurm-conf-extra", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Append the lines of FILE to slurm.conf.")
@click.option("--gres-conf", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Use FILE as gres.conf instead of the generated one.")
@click.option("--job-submit-lua", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Install FILE as job_submit.lua next to slurm.conf and enable JobSubmitPlugins=lua.")
@click.option("--no-admin", "no_admin", is_flag=True,
              help="Do not render and install the admin files (slurm-dlrm.conf, gres.conf, job_submit.lua, "
                   "the MPS prolog/epilog with a fake nvidia-cuda-mps-control): a bare Slurm cluster.")
@click.option("--timeout", "timeout_s", type=float, default=90.0, show_default=True,
              help="Seconds to wait for all nodes to be idle.")
@_json_option
def up(nodes: int | None, gpus_per_node: int | None, accounting: bool, state_dir: Path | None,
       base_port: int | None, site_path: Path | None, slurm_conf_extra: Path | None,
       gres_conf: Path | None, job_submit_lua: Path | None, no_admin: bool, timeout_s: float,
       as_json: bool) -> None:
    """Start the cluster (or what of it is not running) and wait until all nodes are idle.

    Safe to run again while the cluster is up. Must run as root (device nodes, slurmd).
    As an admin would, it renders the site's Slurm files for this cluster (its own site
    file: <state>/site.toml) and installs them, so `slurm-dlrm admin check --site
    <state>/site.toml` passes here; --no-admin, or the three files by hand, skip that.

    \b
    Example:
      slurm-dlrm cluster up --nodes 2 --gpus-per-node 4
      slurm-dlrm cluster up --accounting --state-dir /tmp/c2 --base-port 12000
      slurm-dlrm cluster up --job-submit-lua out/job_submit.lua --slurm-conf-extra out/extra.conf
      SLURM_CONF=$(slurm-dlrm cluster status --conf) slurm-dlrm admin check --site $(slurm-dlrm cluster status --site)
    """
    from slurm_dlrm.site import load_site

    site = load_site(site_path)
    cfg = lc.config_from_site(site, nodes=nodes, gpus_per_node=gpus_per_node, accounting=accounting or None,
                              state_dir=state_dir, base_port=base_port, slurm_conf_extra=slurm_conf_extra,
                              gres_conf=gres_conf, job_submit_lua=job_submit_lua, admin=False if no_admin else None)
    t0 = time.monotonic()
    status = lc.LocalCluster(cfg).up(wait_s=timeout_s)
    _print_status(status, as_json, took_s=time.monotonic() - t0)


@cluster.command("down")
@_state_dir_option
@_json_option
def down(state_dir: Path | None, as_json: bool) -> None:
    """Cancel all jobs and stop the processes this cluster started (via its pid files).

    Nothing is stopped by name: a pid is signalled only if its environment carries this
    cluster's marker. The state folder stays (job state, logs); remove it by hand.

    \b
    Example:
      slurm-dlrm cluster down
      slurm-dlrm cluster down --state-dir /tmp/c2
    """
    cluster_ = _existing(state_dir)
    stopped = cluster_.down()
    if as_json:
        click.echo(json.dumps({"state_dir": str(cluster_.config.state_dir), "stopped": stopped}))
    else:
        click.echo(f"stopped: {', '.join(stopped) or 'nothing was running'} ({cluster_.config.state_dir})")


@cluster.command("status")
@_state_dir_option
@click.option("--conf", "conf_only", is_flag=True, help="Print only the path of slurm.conf.")
@click.option("--site", "site_only", is_flag=True,
              help="Print only the path of the cluster's site file (for `admin check --site`).")
@_json_option
def status(state_dir: Path | None, conf_only: bool, site_only: bool, as_json: bool) -> None:
    """Show whether the cluster runs, its daemons, ports, nodes and files. Exit 1 if down.

    \b
    Example:
      slurm-dlrm cluster status
      slurm-dlrm cluster status --json | jq .nodes
      export SLURM_CONF=$(slurm-dlrm cluster status --conf)
      slurm-dlrm admin check --site $(slurm-dlrm cluster status --site)
    """
    cluster_ = _existing(state_dir)
    if conf_only:
        click.echo(str(cluster_.config.slurm_conf))
        return
    if site_only:
        if not cluster_.config.admin_files:
            raise BadInput("--site: this cluster was started without the admin files (--no-admin or files by hand)")
        click.echo(str(cluster_.config.site_file))
        return
    st = cluster_.status()
    _print_status(st, as_json)
    if not st.up:
        raise click.exceptions.Exit(1)


def _existing(state_dir: Path | None) -> lc.LocalCluster:
    d = (state_dir or lc.default_state_dir()).resolve()
    found = lc.LocalCluster.at(d)
    if found is None:
        raise BadInput(f"--state-dir: no cluster in {d} (start one with `slurm-dlrm cluster up`)")
    return found


def _print_status(st: lc.ClusterStatus, as_json: bool, took_s: float | None = None) -> None:
    data = st.to_json()
    if took_s is not None:
        data["took_s"] = round(took_s, 1)
    data["memory"] = memory_cgroup.recorded(st.config.state_dir)  # whether Slurm constrains jobs' memory
    if as_json:
        click.echo(json.dumps(data, indent=1))
        return
    c = st.config
    lines = [f"cluster {c.cluster_name}: {'up' if st.up else 'DOWN'}"
             + (f" (ready in {took_s:.1f} s)" if took_s is not None else ""),
             f"  state dir   {c.state_dir}",
             f"  slurm.conf  {c.slurm_conf}     export SLURM_CONF={c.slurm_conf}",
             f"  logs        {c.log_dir}",
             "  ports       " + ", ".join(f"{k} {v}" for k, v in data["ports"].items()),
             f"  accounting  {'on (sacct works)' if c.accounting else 'off'}",
             "  admin files " + (f"installed (site file {c.site_file}; slurm-dlrm admin check --site {c.site_file})"
                                 if c.admin_files else "not installed")]
    if data["memory"]:
        lines.append(f"  memory      {data['memory']}")
    for d in st.daemons:
        lines.append(f"  {d.name:<14} {'running' if d.running else 'stopped':<8} pid {d.pid or '-'}")
    for n in st.nodes:
        flags = f" ({','.join(n['flags'])})" if n["flags"] else ""
        lines.append(f"  node {n['name']:<9} {n['state']}{flags}  {n['gres']}")
    click.echo("\n".join(lines))
