"""`slurm-dlrm admin`: render the Slurm configuration from the site file, check a cluster against it."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path
from typing import Any

import click

from slurm_dlrm.agent import fences
from slurm_dlrm.errors import EXIT_RUNTIME, BadInput
from slurm_dlrm.site import load_site

SITE_OPTION = click.option("--site", "site_path", type=click.Path(dir_okay=False), default=None,
                           help="Site file (default: $SLURM_DLRM_SITE, /etc/slurm-dlrm/site.toml, "
                                "then the repository's site-config/site.toml).")
JSON_OPTION = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")


@click.group("admin")
def admin() -> None:
    """Slurm configuration for slurm-dlrm: render it from the site file, check a cluster against it.

    \b
    Example:
      slurm-dlrm admin render --site /etc/slurm-dlrm/site.toml --out rendered/
      slurm-dlrm admin check --site /etc/slurm-dlrm/site.toml
    """


@admin.command("render")
@SITE_OPTION
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Folder to write the rendered files into (created).")
@click.option("--site-gres-conf", "site_gres_conf", type=click.Path(dir_okay=False, exists=True), default=None,
              help="The cluster's current gres.conf: its lines for other nodes and other gres are kept in "
                   "the rendered one (ours replaces only gpu/mps/shard and AutoDetect of the site file's nodes).")
@JSON_OPTION
def render(site_path: str | None, out_dir: str, site_gres_conf: str | None, as_json: bool) -> None:
    """Render slurm-dlrm.conf (a slurm.conf fragment), gres.conf, job_submit.lua and the MPS
    prolog, epilog and task prolog from the site file.

    Prints each file with the path it belongs at; nothing is installed. Review the files,
    copy them there, add `Include slurm-dlrm.conf` to slurm.conf, then `scontrol reconfigure`
    (see docs/admin.md).

    \b
    Example:
      slurm-dlrm admin render --site site-config/site.toml --out /tmp/slurm-dlrm-conf
      slurm-dlrm admin render --out rendered/ --json
      slurm-dlrm admin render --out rendered/ --site-gres-conf /etc/slurm/gres.conf
    """
    from slurm_dlrm.admin.render import render_site, write_rendered

    site = load_site(site_path)
    files = render_site(site)  # everything renders before anything is written
    if site_gres_conf is not None:
        import dataclasses

        from slurm_dlrm.admin.gres_merge import merge_gres_conf

        try:
            site_text = Path(site_gres_conf).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise BadInput(f"--site-gres-conf: cannot read {site_gres_conf}: {exc}") from None
        files = [dataclasses.replace(f, text=merge_gres_conf(f.text, site_text, site, site_gres_conf))
                 if f.name == "gres.conf" else f for f in files]
    written = write_rendered(files, out_dir)
    rows = [{"file": f.name, "path": str(p), "install_path": f.install_path, "mode": f"{f.mode:04o}"}
            for f, p in zip(files, written, strict=True)]
    if as_json:
        click.echo(json.dumps({"site": site.path, "out": out_dir, "files": rows}, indent=2))
        return
    for row in rows:
        click.echo(f"{row['path']} -> {row['install_path']} (mode {row['mode']})")
    click.echo("review, install, add `Include slurm-dlrm.conf` to slurm.conf, then `scontrol reconfigure` "
               "and `slurm-dlrm admin check` (docs/admin.md)", err=True)


@admin.command("check")
@SITE_OPTION
@JSON_OPTION
@click.option("--fences", "with_fences", is_flag=True,
              help="Also report this host's GPU fences (MPS v3, cgroup dmem): run it on a GPU node.")
@click.pass_context
def check(ctx: click.Context, site_path: str | None, as_json: bool, with_fences: bool) -> None:
    """Compare the site file with the live cluster: per node CPUs, memory, GPUs and their type,
    MPS and shard counts; per partition its nodes, default flag and time limit; and every
    slurm.conf key the rendered fragment sets (GresTypes, SelectType, SelectTypeParameters,
    JobSubmitPlugins, Prolog/Epilog/TaskProlog, PrologFlags, AccountingStorageTRES) against
    `scontrol show config`. Run before installing, it lists each setting the fragment would
    change on this cluster, what it adds, and what of the cluster's it would drop with the
    [slurm] site_* key that keeps it; run after, what is not as rendered. Where this host can
    read the job_submit.lua next to slurm.conf, it also says whether that script is ours or
    calls our module.

    Prints one line per difference; exit code 1 when there is any, 0 when none.

    \b
    Example:
      slurm-dlrm admin check --site /etc/slurm-dlrm/site.toml
      slurm-dlrm admin check --json
      slurm-dlrm admin check --fences      # on a GPU node: MPS v3 and dmem as mps.mode/dmem ask
    """
    from slurm_dlrm.admin.check import Difference, check_job_submit_script, compare, compare_config

    site = load_site(site_path)
    nodes, partitions, config = _live_records()
    diffs = compare_config(site, config) + compare(site, nodes, partitions)
    if "lua" in config.get("JobSubmitPlugins", "").lower():
        diffs += check_job_submit_script(site, _read_if_here(Path(site.slurm.config_dir) / "job_submit.lua"))
    caps = None
    if with_fences:
        caps = _fence_caps(site)
        host = f"host {socket.gethostname().split('.')[0]}"
        diffs += [Difference(host, key, want, have) for key, want, have in
                  fences.site_gaps(site.mps.mode, site.mps.dmem, caps)]
    if as_json:
        click.echo(json.dumps({"site": site.path, "differences": [d.to_dict() for d in diffs],
                               **({"fences": caps.to_dict()} if caps else {})}, indent=2))
    else:
        if caps is not None:
            click.echo(f"fences on this host: {caps.summary()}", err=True)
        for d in diffs:
            click.echo(str(d))
        if not diffs:
            click.echo(f"the cluster matches {site.path}", err=True)
    if diffs:
        ctx.exit(EXIT_RUNTIME)


def _read_if_here(path: Path) -> str | None:
    """The file's text if this host can read it (a login node may not see the controller's)."""
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


def _fence_caps(site: Any) -> fences.FenceCaps:
    """This host's fence capabilities: the site's MPS control command, NVML's driver version."""
    from slurm_dlrm.agent.nvml import Nvml

    nvml = Nvml()
    driver = nvml.driver_version if nvml.init() else None
    nvml.shutdown()
    binary = shutil.which(site.slurm.mps_control_command)
    return fences.detect_capabilities(binary=binary, driver_version=driver, root=Path(site.slurm.cgroup_root))


def _live_records() -> tuple[list[Any], list[Any], dict[str, str]]:
    """Nodes, partitions and configuration of the live cluster, through the Slurm seam ($SLURM_CONF)."""
    from slurm_dlrm.admin.check import nodes_from_seam, parse_scontrol_config, partitions_from_sinfo
    from slurm_dlrm.slurm import SlurmClient

    client = SlurmClient()
    config = parse_scontrol_config(client.run(["scontrol", "show", "config"]).stdout)
    return nodes_from_seam(client.show_nodes()), partitions_from_sinfo(client.sinfo()), config
