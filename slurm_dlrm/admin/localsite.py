"""The site file of a local test cluster (`slurm-dlrm cluster up`), so `admin render` makes
its files and `admin check` compares it like any site's (docs/admin.md "A local test
cluster").

It is the site the cluster was started from with what differs on one host: the nodes and
the default partition as `cluster up` shapes them, device files per node under the state
folder, 127.0.0.1 and one slurmd port per node, the `[slurm]` folders under the state
folder, root as SlurmUser, the package's fake `nvidia-cuda-mps-control`, and
AccountingStorageTRES only with slurmdbd. `local_site_raw` is pure; `dump_toml` writes
the few TOML forms a site file uses.
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any

# The site's [slurm] keys that name the site's own scripts and settings: a local cluster has none.
_SITE_OWN_KEYS = ("site_prolog", "site_epilog", "site_task_prolog", "site_gres_types", "site_prolog_flags",
                  "site_job_submit_plugins", "site_accounting_tres")


def local_site_raw(raw: dict[str, Any], *, state_dir: str, hostlist: str, gpu_model: str, gpus: int, cpus: int,
                   memory_mib: int, first_slurmd_port: int, partition: str, max_time_minutes: int,
                   mps_per_gpu: int, shards_per_gpu: int, accounting: bool, fake_mps_control: str) -> dict[str, Any]:
    """The site file's table (`raw`) rewritten for a local cluster in `state_dir`."""
    out = copy.deepcopy(raw)
    out["nodes"] = [{"names": hostlist, "gpu_model": gpu_model, "gpus": gpus, "cpus": cpus,
                     "memory_mib": memory_mib, "gpu_device_files": f"{state_dir}/dev/{{node}}/nvidia{{i}}",
                     "node_addr": "127.0.0.1", "slurmd_port": first_slurmd_port}]
    parts = out.get("partitions") or [{}]
    # The default partition's rules (enforce, bounds); the others name nodes this cluster lacks.
    rules = next((p for p in parts if p.get("default")), parts[0])
    out["partitions"] = [{**rules, "name": partition, "nodes": hostlist, "default": True,
                          "max_time_minutes": max_time_minutes}]
    mps = out.setdefault("mps", {})
    mps["enabled"] = mps_per_gpu > 0
    if mps_per_gpu > 0:
        mps["mps_per_gpu"] = mps_per_gpu
        if "min_mps_share" in out["partitions"][0]:
            out["partitions"][0]["min_mps_share"] = min(int(out["partitions"][0]["min_mps_share"]), mps_per_gpu)
    mps["shards_per_gpu"] = shards_per_gpu
    # No dmem on a test host: the prolog would enable +dmem in the host's own cgroup tree.
    mps["dmem"] = "off"
    slurm = out.setdefault("slurm", {})
    for key in _SITE_OWN_KEYS:
        slurm.pop(key, None)
    slurm.update(
        config_dir=f"{state_dir}/etc",
        script_dir=f"{state_dir}/admin/scripts",
        slurm_user="root",  # the local cluster's SlurmUser
        mps_control_command=fake_mps_control,
        mps_pipe_root=f"{state_dir}/mps",
        mps_log_root=f"{state_dir}/mpslog",
        shm_dir=f"{state_dir}/shm",
        cgroup_root=f"{state_dir}/cgroup",
        accounting_tres=accounting,  # slurmctld refuses gres TRES without slurmdbd
        # Two shared cores may be busy: a fake daemon (a Python process) needs time to answer.
        mps_start_timeout_s=max(float(slurm.get("mps_start_timeout_s", 10.0)), 30.0),
    )
    return out


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"not a TOML number: {v!r}")
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a TOML basic string: JSON's escapes are TOML's
    if isinstance(v, list) and not any(isinstance(x, dict) for x in v):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    raise ValueError(f"cannot write {type(v).__name__} as a TOML value")


def dump_toml(data: dict[str, Any]) -> str:
    """Tables, arrays of tables and scalar/array values: the forms a site file uses."""
    lines: list[str] = []

    def table(prefix: str, d: dict[str, Any], header: str | None) -> None:
        if header is not None:
            lines.extend(["", header])
        nested = []
        for key, v in d.items():
            if isinstance(v, dict) or (isinstance(v, list) and v and all(isinstance(x, dict) for x in v)):
                nested.append((key, v))
            else:
                lines.append(f"{json.dumps(key)} = {_value(v)}")
        for key, v in nested:
            name = f"{prefix}{json.dumps(key)}"
            if isinstance(v, dict):
                table(f"{name}.", v, f"[{name}]")
            else:
                for item in v:
                    table(f"{name}.", item, f"[[{name}]]")

    table("", data, None)
    return "\n".join(lines).lstrip("\n") + "\n"
