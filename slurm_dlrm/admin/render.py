"""Render the site config into Slurm files: slurm.conf fragment, gres.conf, job_submit.lua,
and the MPS prolog/epilog/task prolog.

Every value is computed here, in Python (`build_context`, pure); the jinja2 templates in
``templates/admin/`` only lay values out, each Slurm key documented once. Values that reach
a shell script go through the ``sh`` filter (shlex.quote), values that reach Lua through the
``lua`` filter (a Lua string literal).
"""

from __future__ import annotations

import math
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_dlrm.admin.marker import MARKER_PREFIX, MODE_NO_PACK, MODE_PACK
from slurm_dlrm.errors import DlrmError
from slurm_dlrm.package_data import data_dir
from slurm_dlrm.site import MIB, NodeGroup, Partition, SiteConfig, expand_hostlist

TEMPLATE_DIR = data_dir("templates") / "admin"

# Slurm 22.05's job_submit/lua exposes only a few ESLURM_* names; the others are looked up
# as slurm.ESLURM_X and fall back to the number in slurm_errno.h (unchanged since 2.x).
ESLURM_FALLBACK = {
    "ESLURM_ACCESS_DENIED": 2002,
    "ESLURM_JOB_MISSING_SIZE_SPECIFICATION": 2008,
    "ESLURM_INVALID_GRES": 2072,
}

# The job_submit module a site's own job_submit.lua calls; installed next to slurm.conf.
MODULE_NAME = "slurm_dlrm_submit.lua"

SUBMIT_HINT = ("Submit DLRM jobs with `slurm-dlrm submit SPEC.yaml [sbatch options]` "
               "(packed with others) or `slurm-dlrm submit --no-pack SPEC.yaml` (a job of its own).")


@dataclass(frozen=True)
class RenderedFile:
    name: str  # path under the output folder
    template: str
    install_path: str  # where the admin puts it
    mode: int  # file mode to install with
    text: str


def lua_str(value: object) -> str:
    """A Lua 5.1 string literal for ``value``: quotes, backslashes, control and non-ASCII
    bytes escaped as \\ddd, so no value can end the literal or the line."""
    out = ['"']
    for byte in str(value).encode():
        ch = chr(byte)
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif 0x20 <= byte < 0x7F:
            out.append(ch)
        else:
            out.append(f"\\{byte:03d}")
    out.append('"')
    return "".join(out)


def sh_quote(value: object) -> str:
    return shlex.quote(str(value))


def _node_gres(group: NodeGroup, site: SiteConfig) -> str:
    """Gres= of a NodeName line: gpu:<type>:<n>[,mps:<n*mps_per_gpu>][,shard:<n*shards>]."""
    if group.gpus == 0:
        return ""
    parts = [f"gpu:{group.gpu_model}:{group.gpus}"]
    if site.mps.enabled:
        parts.append(f"mps:{group.gpus * site.mps.mps_per_gpu}")
    if site.mps.shards_per_gpu:
        parts.append(f"shard:{group.gpus * site.mps.shards_per_gpu}")
    return ",".join(parts)


def _node_lines(site: SiteConfig) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for group in site.nodes:
        common = {"cpus": group.cpus, "memory_mib": group.memory_mib, "gres": _node_gres(group, site),
                  "node_addr": group.node_addr}
        if group.slurmd_port:
            # One slurmd per port: every node needs its own NodeName line.
            for k, host in enumerate(group.hostnames):
                out.append({"names": host, "port": group.slurmd_port + k, **common})
        else:
            out.append({"names": group.names, "port": 0, **common})
    return out


def _gres_lines(site: SiteConfig) -> list[dict[str, Any]]:
    """One entry per node group: AutoDetect plus per-GPU gpu/mps/shard lines."""
    groups = []
    for group in site.nodes:
        if group.gpus == 0:
            continue
        entry: dict[str, Any] = {"names": group.names, "gpu_type": group.gpu_model, "nvml": group.uses_nvml,
                                 "gpus": group.gpus, "devices": []}
        if group.uses_nvml:
            # NVML finds the device files; mps/shard counts are spread evenly over the GPUs.
            entry["mps_count"] = group.gpus * site.mps.mps_per_gpu if site.mps.enabled else 0
            entry["shard_count"] = group.gpus * site.mps.shards_per_gpu
        else:
            entry["devices"] = [group.gpu_device_file(i) for i in range(group.gpus)]
            entry["mps_count"] = site.mps.mps_per_gpu if site.mps.enabled else 0
            entry["shard_count"] = site.mps.shards_per_gpu
        if group.per_node_devices:
            # {node} in the pattern: the same lines once per node, with its own files.
            for host in group.hostnames:
                groups.append(dict(entry, names=host,
                                   devices=[group.gpu_device_file(i, host) for i in range(group.gpus)]))
            continue
        groups.append(entry)
    return groups


def _groups_of(part: Partition, site: SiteConfig) -> list[NodeGroup]:
    hosts = set(expand_hostlist(part.nodes))
    return [g for g in site.nodes if hosts.intersection(g.hostnames)]


def _partition_rules(site: SiteConfig) -> list[dict[str, Any]]:
    """The bounds job_submit.lua enforces, per partition."""
    rules = []
    for part in site.partitions:
        groups = _groups_of(part, site)
        gpu_groups = [g for g in groups if g.gpus > 0]
        gpu_mem_mib = min((int(site.gpu_models[g.gpu_model].memory_bytes // MIB) for g in gpu_groups), default=0)
        max_gpus_per_node = max((g.gpus for g in gpu_groups), default=0)
        rules.append({
            "name": part.name,
            "enforce": part.enforce,
            "max_gpus_per_job": part.max_gpus_per_job,
            "max_gpus_per_node": max_gpus_per_node,
            "min_mps_share": part.min_mps_share,
            "max_mps_share": site.mps.mps_per_gpu,
            "gpu_mem_mib_max": gpu_mem_mib,
        })
    return rules


def merge_items(ours: list[str], site_items: str) -> list[str]:
    """The site's own items first, then ours not already there (case-insensitive, as Slurm
    reads these keys): the fragment keeps what the site has and adds what we need."""
    out: list[str] = []
    for item in [*(v for v in site_items.split(",") if v), *ours]:
        if item.lower() not in {o.lower() for o in out}:
            out.append(item)
    return out


def build_context(site: SiteConfig) -> dict[str, Any]:
    """Everything the templates print, computed from the site config (pure)."""
    s = site.slurm
    mps_on = site.mps.enabled
    gres_types = ["gpu"] + (["mps"] if mps_on else []) + (["shard"] if site.mps.shards_per_gpu else [])
    gpu_types = sorted({g.gpu_model for g in site.nodes if g.gpus > 0})
    tres = [f"gres/{t}" for t in gres_types]
    tres[1:1] = [f"gres/gpu:{t}" for t in gpu_types]
    gres_types = merge_items(gres_types, s.site_gres_types)
    tres = merge_items(tres, s.site_accounting_tres)
    default = next((p.name for p in site.partitions if p.default), None)
    scripts = {"prolog": f"{s.script_dir}/prolog.sh", "epilog": f"{s.script_dir}/epilog.sh",
               "task_prolog": f"{s.script_dir}/task_prolog.sh"}
    max_gpu_index = max((g.gpus for g in site.nodes), default=1) - 1
    # The prolog's ceiling on a --comment gpu_mem_mib: the largest GPU of the site (a fence
    # beyond the GPU's memory fences nothing; job_submit.lua holds each partition tighter).
    gpu_mem_mib_max = max((int(site.gpu_models[g.gpu_model].memory_bytes // MIB) for g in site.nodes if g.gpus > 0),
                          default=0)
    return {
        "site_name": site.name,
        "site_path": os.path.basename(site.path) if site.path else "(built in)",
        "mps_enabled": mps_on,
        "slurm_conf": {
            "gres_types": ",".join(gres_types),
            "job_submit_plugins": ",".join(merge_items(["lua"], s.site_job_submit_plugins)),
            "prolog_flags": ",".join(merge_items(["Alloc"], s.site_prolog_flags)),
            "select_type_parameters": s.select_type_parameters,
            "accounting_storage_tres": ",".join(tres) if s.accounting_tres else "",
            "scripts": scripts,
            "nodes": _node_lines(site),
            "partitions": [{
                "name": p.name,
                "nodes": p.nodes,
                "default": "YES" if p.default else "NO",
                "max_time_minutes": p.max_time_minutes,
            } for p in site.partitions],
        },
        "gres_conf": {"groups": _gres_lines(site)},
        "job_submit": {
            "marker_prefix": MARKER_PREFIX,
            "mode_no_pack": MODE_NO_PACK,
            "mode_pack": MODE_PACK,
            "submit_hint": SUBMIT_HINT,
            "module_path": f"{s.config_dir}/{MODULE_NAME}",
            "mps_one_user": site.mps.cross_user == "one-user",
            "slurm_user": s.slurm_user,
            "default_partition": default,
            "partitions": _partition_rules(site),
            "eslurm": ESLURM_FALLBACK,
        },
        "mps_scripts": {
            "control_command": s.mps_control_command,
            "pipe_root": s.mps_pipe_root,
            "log_root": s.mps_log_root,
            "shm_dir": s.shm_dir,
            # Polls every 0.1 s, so the bound is a count of polls.
            "start_polls": math.ceil(s.mps_start_timeout_s * 10),
            "stop_polls": math.ceil(s.mps_stop_timeout_s * 10),
            "mps_per_gpu": site.mps.mps_per_gpu,
            # Slurm 22.05.8 divides the mps count by the *shard* count per GPU when both are
            # configured (mps:50 with 8 shards gave CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=625):
            # then the scripts recompute the percentage from the job's mps count.
            "recompute_thread_pct": mps_on and site.mps.shards_per_gpu > 0,
            "marker_prefix": MARKER_PREFIX,
            "mode_no_pack": MODE_NO_PACK,
            "max_gpu_index": max_gpu_index,
            "gpu_mem_mib_max": gpu_mem_mib_max,
            "fence_mode": site.mps.mode,
            "dmem_mode": site.mps.dmem,
            "cross_user": site.mps.cross_user,
            "cgroup_root": s.cgroup_root,
            # The site's own scripts ours run (docs/admin.md "Installs that chain").
            "site_prolog": s.site_prolog,
            "site_epilog": s.site_epilog,
            "site_task_prolog": s.site_task_prolog,
            "job_cgroup": s.job_cgroup,
        },
    }


def _environment() -> Any:
    import jinja2  # deferred: only `admin render` pays for it

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["sh"] = sh_quote
    env.filters["lua"] = lua_str
    return env


def render_site(site: SiteConfig) -> list[RenderedFile]:
    """All files for the site, in install order."""
    ctx = build_context(site)
    s = site.slurm
    plan = [
        ("slurm-dlrm.conf", "slurm.conf.j2", f"{s.config_dir}/slurm-dlrm.conf", 0o644),
        ("gres.conf", "gres.conf.j2", f"{s.config_dir}/gres.conf", 0o644),
        # The checks as a module a site's own job_submit.lua calls, and the same checks as a
        # whole job_submit.lua for a site without one (docs/admin.md "Installs that chain").
        (MODULE_NAME, "slurm_dlrm_submit.lua.j2", ctx["job_submit"]["module_path"], 0o644),
        ("job_submit.lua", "job_submit.lua.j2", f"{s.config_dir}/job_submit.lua", 0o644),
    ]
    if site.mps.enabled:
        plan += [
            ("scripts/prolog.sh", "prolog.sh.j2", ctx["slurm_conf"]["scripts"]["prolog"], 0o755),
            ("scripts/epilog.sh", "epilog.sh.j2", ctx["slurm_conf"]["scripts"]["epilog"], 0o755),
            ("scripts/task_prolog.sh", "task_prolog.sh.j2", ctx["slurm_conf"]["scripts"]["task_prolog"], 0o755),
        ]
    env = _environment()
    return [RenderedFile(name, tpl, dest, mode, env.get_template(tpl).render(**ctx)) for name, tpl, dest, mode in plan]


def write_rendered(files: list[RenderedFile], out_dir: str | os.PathLike[str]) -> list[Path]:
    """Write the files under ``out_dir`` (created); each written whole via a temp file."""
    root = Path(out_dir)
    written = []
    try:
        root.mkdir(parents=True, exist_ok=True)
        for f in files:
            dest = root / f.name
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(f".{dest.name}.tmp")
            tmp.write_text(f.text)
            tmp.chmod(f.mode)
            tmp.replace(dest)
            written.append(dest)
    except OSError as exc:
        raise DlrmError(f"cannot write {out_dir}: {exc.strerror or exc}") from None
    return written
