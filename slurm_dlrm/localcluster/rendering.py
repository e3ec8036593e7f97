"""The files of a local cluster instance: slurm.conf, gres.conf and (with accounting)
slurmdbd.conf from `templates/localcluster/`, the fake GPU devices (character devices
c 1 3), and, unless `--no-admin`, what `slurm-dlrm admin render` makes for the
cluster's own site file (the slurm.conf fragment, gres.conf, job_submit.lua, the MPS
scripts). `one_source_per_key` keeps one setting per key where a fragment is appended.

Apart because writing the configuration starts nothing: it is read, and golden-tested
(tests/data/localcluster/), without a daemon.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import stat
from pathlib import Path
from typing import Any

import jinja2

from slurm_dlrm.errors import BadInput
from slurm_dlrm.localcluster.config import (
    MYSQL_DB,
    MYSQL_USER,
    PORT_MYSQL,
    PORT_SLURMCTLD,
    PORT_SLURMDBD,
    ClusterConfig,
    ClusterError,
    saved_config_path,
)
from slurm_dlrm.localcluster.memory_cgroup import DECISION_FILE, MemoryCgroup
from slurm_dlrm.package_data import data_dir

TEMPLATE_DIR = data_dir("templates") / "localcluster"


def render(c: ClusterConfig, memory: MemoryCgroup) -> None:
    """Write slurm.conf, gres.conf, cgroup.conf where Slurm constrains memory (`memory`,
    memory_cgroup.detect), slurmdbd.conf and the fake GPU devices."""
    # slurmd's spool folder (SlurmdSpoolDir=<state>/spool/slurmd-%n) holds its domain
    # sockets; 24.11+ log an error at start when it does not exist yet.
    for d in (c.etc_dir, c.run_dir, c.log_dir, c.state_dir / "ctld", c.state_dir / "spool",
              c.state_dir / "dev", *(c.state_dir / "spool" / f"slurmd-{n}" for n in c.node_names)):
        d.mkdir(parents=True, exist_ok=True)
    c.state_dir.chmod(0o755)  # munged refuses group/other-writable socket folders
    c.run_dir.chmod(0o755)
    nodes = []
    for i, name in enumerate(c.node_names):
        devices = []
        for g in range(c.gpus_per_node):
            dev = c.state_dir / "dev" / name / f"nvidia{g}"
            _mknod_null(dev)
            devices.append(str(dev))
        gres = [f"gpu:{c.gpu_type}:{c.gpus_per_node}"] if c.gpus_per_node else []
        if c.gpus_per_node and c.mps_per_gpu:
            gres.append(f"mps:{c.mps_per_gpu * c.gpus_per_node}")
        if c.gpus_per_node and c.shards_per_gpu:
            gres.append(f"shard:{c.shards_per_gpu * c.gpus_per_node}")
        nodes.append({"name": name, "port": c.slurmd_port(i), "cpus": c.cpus_per_node,
                      "memory_mib": c.memory_mib, "gres": ",".join(gres) or "(null)",
                      "devices": devices})
    extra = c.slurm_conf_extra.read_text().rstrip() if c.slurm_conf_extra else ""
    gres_text = Path(c.gres_conf).read_text() if c.gres_conf else None
    lua_text = Path(c.job_submit_lua).read_text() if c.job_submit_lua else None
    extra_source = str(c.slurm_conf_extra or "")
    if c.admin_files:
        admin = _render_admin(c)
        extra, gres_text, lua_text = admin["slurm-dlrm.conf"].rstrip(), admin["gres.conf"], admin["job_submit.lua"]
        extra_source = f"{c.state_dir / 'admin' / 'rendered' / 'slurm-dlrm.conf'} (slurm-dlrm admin render)"
    # Slurm refuses a node defined twice: a fragment with its own NodeName/PartitionName
    # lines (e.g. `slurm-dlrm admin render`'s) replaces ours.
    extra_keys = {line.split("=", 1)[0].strip() for line in extra.splitlines() if "=" in line}
    values = dict(
        cluster_name=c.cluster_name, hostname=socket.gethostname().split(".")[0],
        slurmctld_port=c.port(PORT_SLURMCTLD), slurmdbd_port=c.port(PORT_SLURMDBD),
        mysql_port=c.port(PORT_MYSQL), munge_socket=str(c.munge_socket), state_dir=str(c.state_dir),
        accounting=c.accounting, job_submit_lua=lua_text is not None, nodes=nodes,
        own_nodes="NodeName" not in extra_keys, own_partition="PartitionName" not in extra_keys,
        node_list=c.node_hostlist, partition=c.partition,
        max_time=c.max_time_minutes, min_job_age_s=c.min_job_age_s,
        def_mem_per_cpu_mib=c.def_mem_per_cpu_mib, gpu_type=c.gpu_type,
        mps_per_gpu=c.mps_per_gpu, shards_per_gpu=c.shards_per_gpu, extra=extra,
        extra_source=extra_source, mysql_user=MYSQL_USER, mysql_db=MYSQL_DB,
        mysql_password="", **memory_cgroup_values(c, memory))
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATE_DIR), undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    _write(c.slurm_conf, one_source_per_key(env.get_template("slurm.conf.j2").render(values), extra))
    gres_path = c.etc_dir / "gres.conf"
    if gres_text is not None:
        _write(gres_path, gres_text)
    else:
        _write(gres_path, env.get_template("gres.conf.j2").render(values))
    cgroup_conf = c.etc_dir / "cgroup.conf"
    if values["task_plugin"] == "task/cgroup":
        _write(cgroup_conf, env.get_template("cgroup.conf.j2").render(values))
    else:
        cgroup_conf.unlink(missing_ok=True)
    lua = c.etc_dir / "job_submit.lua"
    if lua_text is not None:
        _write(lua, lua_text)
    elif lua.exists():
        lua.unlink()
    if c.accounting:
        pw_file = c.etc_dir / "mysql.password"
        if not pw_file.exists():
            pw_file.write_text(secrets.token_hex(16))
        pw_file.chmod(0o600)
        values["mysql_password"] = pw_file.read_text().strip()
        dbd = c.etc_dir / "slurmdbd.conf"
        _write(dbd, env.get_template("slurmdbd.conf.j2").render(values))
        dbd.chmod(0o600)  # slurmdbd refuses a world-readable file (it holds a password)
    saved_config_path(c.state_dir).write_text(json.dumps(c.to_json(), indent=1) + "\n")

def _render_admin(c: ClusterConfig) -> dict[str, str]:
    """`slurm-dlrm admin render` for this cluster: write its site file, render, install
    the MPS scripts and the fake MPS control command; return the rendered texts by name
    (the caller puts slurm-dlrm.conf, gres.conf and job_submit.lua in place)."""
    import tomllib

    from slurm_dlrm.admin.localsite import dump_toml, local_site_raw
    from slurm_dlrm.admin.render import MODULE_NAME, render_site, write_rendered
    from slurm_dlrm.emulated.mps_control import install_launcher
    from slurm_dlrm.site import REPO_SITE_FILE

    admin_dir = c.state_dir / "admin"
    fake = install_launcher(admin_dir / "bin")
    try:
        raw = tomllib.loads(Path(c.site_path or REPO_SITE_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise BadInput(f"--site: cannot read {c.site_path or REPO_SITE_FILE}: {exc}") from None
    local = local_site_raw(
        raw, state_dir=str(c.state_dir), hostlist=c.node_hostlist, gpu_model=c.gpu_type,
        gpus=c.gpus_per_node, cpus=c.cpus_per_node, memory_mib=c.memory_mib,
        first_slurmd_port=c.slurmd_port(0), partition=c.partition, max_time_minutes=c.max_time_minutes,
        mps_per_gpu=c.mps_per_gpu, shards_per_gpu=c.shards_per_gpu, accounting=c.accounting,
        fake_mps_control=str(fake))
    _write(c.site_file, "# The local cluster's site file, written by `slurm-dlrm cluster up` from "
           f"{c.site_path or REPO_SITE_FILE}.\n# Check the cluster against it: "
           f"SLURM_CONF={c.slurm_conf} slurm-dlrm admin check --site {c.site_file}\n" + dump_toml(local))
    from slurm_dlrm.site import load_site

    files = render_site(load_site(c.site_file))
    write_rendered(files, admin_dir / "rendered")
    for f in files:
        if f.name.startswith("scripts/") or f.name == MODULE_NAME:
            dest = Path(f.install_path)
            dest.parent.mkdir(parents=True, exist_ok=True)
            _write(dest, f.text)
            dest.chmod(f.mode)
    (c.state_dir / "shm").mkdir(exist_ok=True)
    return {f.name: f.text for f in files}


# Records, not settings: one line per node/partition, several lines by design.
_RECORD_KEYS = frozenset({"nodename", "partitionname", "nodeset", "downnodes", "frontendname", "include"})
_EXTRA_MARK = "# ---- from --slurm-conf-extra"


def _conf_key(line: str) -> str | None:
    text = line.strip()
    if not text or text.startswith("#") or "=" not in text:
        return None
    return text.split("=", 1)[0].strip().lower()  # slurm.conf keys are case-insensitive


def one_source_per_key(conf: str, extra: str) -> str:
    """slurm.conf with each setting the appended fragment (`admin render`'s, or
    --slurm-conf-extra) also sets left to the fragment: slurmctld logs "KEY specified
    more than once, latest value used" for every key set twice (SelectTypeParameters,
    JobSubmitPlugins, AccountingStorageTRES, GresTypes, SelectType on the local
    cluster), and one source is what an admin reads. Pure."""
    overridden = {k for k in map(_conf_key, extra.splitlines()) if k and k not in _RECORD_KEYS}
    head, mark, tail = conf.partition(_EXTRA_MARK)
    out = []
    for line in head.splitlines(keepends=True):
        key = _conf_key(line)
        if key in overridden:
            out.append(f"# {line.split('=', 1)[0].strip()}: set by the fragment below\n")
        else:
            out.append(line)
    return "".join(out) + mark + tail


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _mknod_null(path: Path) -> None:
    """A character device c 1 3 (what /dev/null is): Slurm accepts it as a GPU file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        st = path.stat()
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3):
            return
        path.unlink()
    except FileNotFoundError:
        pass
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except PermissionError:
        raise ClusterError(f"cannot create device file {path}: `cluster up` must run as root "
                           "(mknod)") from None



def memory_cgroup_values(c: ClusterConfig, memory: MemoryCgroup) -> dict[str, Any]:
    """Slurm constrains each job's memory where the host allows (memory_cgroup.py); the
    decision is kept in the state folder for `cluster status` (one line)."""
    (c.state_dir / DECISION_FILE).write_text(memory.status_line() + "\n")
    return {"task_plugin": "task/cgroup" if memory.usable else "task/none",
            "constrain_swap": "yes" if memory.swap else "no"}
