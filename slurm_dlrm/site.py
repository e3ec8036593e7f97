"""Site configuration: load and validate `site-config/*.toml`.

Pure parsing: the only I/O is reading the one file given. Every error names the key
(dotted path) and the reason, e.g. ``packing.memory_margin_pct: must be >= 0``.

Lookup order when no file is given: $SLURM_DLRM_SITE, /etc/slurm-dlrm/site.toml,
then the shipped site-config/site.toml (the repository's, or the wheel's copy).

Over 600 lines: one schema, each section's dataclass beside the checks of its keys, so
a key's type, default and error message are read in one place.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_dlrm.errors import ConfigError, short_repr
from slurm_dlrm.package_data import data_dir

MIB = 1 << 20
GIB = 1 << 30

# The example site file shipped with the package (the repository's site-config/site.toml;
# a wheel's copy inside the package, slurm_dlrm/package_data.py).
REPO_SITE_FILE = data_dir("site-config") / "site.toml"
POLICIES = ("exclusive", "first-fit", "mem-best-fit", "complementary", "exact")
# NVIDIA MPS fails to start when CUDA_MPS_PIPE_DIRECTORY/LOG_DIRECTORY is longer than
# 87 characters (seen with driver 535, CUDA 12.2).
MPS_DIR_MAX_CHARS = 87
_SLURM_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# Size limits (issue 32; docs/admin.md, above "1. Write the site file"). A site file is a few KiB;
# the largest Slurm clusters have tens of thousands of nodes.
MAX_SITE_BYTES = 1 << 20
MAX_HOSTS = 100_000  # names one hostlist expands to
MAX_INT = 1 << 53  # any integer key: exact in JSON and SQLite, printable by str()


_short = short_repr


@dataclass(frozen=True)
class GpuModel:
    name: str
    memory_gib: float
    sm_count: int
    mem_bandwidth_gbps: float
    fp32_tflops: float
    tf32_tflops: float
    cuda_context_mib: float
    cublas_workspace_mib: float
    # Measured by `slurm-dlrm selftest --write-site` on this model (None: the estimator's
    # assumptions in slurm_dlrm/estimate/analytic.py apply; docs/estimator.md).
    gemm_efficiency: float | None = None  # MLP-sized FP32 GEMM FLOP/s over fp32_tflops
    bf16_gemm_efficiency: float | None = None  # bf16 GEMM FLOP/s over 2 x tf32_tflops
    stream_bandwidth_gbps: float | None = None  # device-to-device copy, GB/s
    gather_bandwidth_gbps: float | None = None  # embedding-like random row gather, GB/s
    kernel_launch_us: float | None = None  # per small kernel, launch + tail
    # Memory as the GPU counts it (issue 37; docs/estimator.md), measured per process by
    # `selftest --write-site`: NVML's process memory minus torch's reserved memory (the
    # planner's room: context, loaded kernels, handles outside torch's allocator), and
    # what the MPS pinned-memory limit counts beyond the allocations (the fence).
    nvml_overhead_mib: float | None = None  # None: cuda_context_mib
    fence_overhead_mib: float | None = None  # None: nvml_overhead_mib, else cuda_context_mib
    measured_with: str | None = None  # "driver 580.159.04, CUDA 13.0": what the figures were measured on
    # NVML's busy shares from the estimator's times (issue 37; estimate/gpu_calibration.py
    # ProfileCalibration), fitted on a GPU run's alone windows. All six or none.
    gpu_us_per_kernel: float | None = None
    host_us_per_kernel: float | None = None
    sm_busy_ceiling: float | None = None
    membw_intercept_pct: float | None = None
    membw_per_est_membw: float | None = None
    membw_per_est_sm: float | None = None

    @property
    def context_bytes_nvml(self) -> int:
        """Per-process memory outside torch's allocator, as NVML counts it."""
        mib = self.nvml_overhead_mib if self.nvml_overhead_mib is not None else self.cuda_context_mib
        return int(mib * MIB)

    @property
    def context_bytes_fence(self) -> int:
        """What the MPS pinned-memory limit counts beyond torch's allocations."""
        for mib in (self.fence_overhead_mib, self.nvml_overhead_mib, self.cuda_context_mib):
            if mib is not None:
                return int(mib * MIB)
        return 0  # unreachable: cuda_context_mib is required

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GIB)

    @property
    def cuda_context_bytes(self) -> int:
        return int(self.cuda_context_mib * MIB)

    @property
    def cublas_workspace_bytes(self) -> int:
        return int(self.cublas_workspace_mib * MIB)


@dataclass(frozen=True)
class NodeGroup:
    names: str  # Slurm hostlist, e.g. "node[1-2]"
    gpu_model: str
    gpus: int
    cpus: int
    memory_mib: int
    gpu_device_files: str
    # Only a local test cluster (several slurmd on one host) needs these two.
    node_addr: str = ""  # NodeAddr=; "" leaves it to Slurm (the node name resolves)
    slurmd_port: int = 0  # Port= of the first node of the group, +1 per next node; 0 = SlurmdPort

    @property
    def hostnames(self) -> list[str]:
        return expand_hostlist(self.names)

    @property
    def uses_nvml(self) -> bool:
        return self.gpu_device_files == "nvml"

    @property
    def per_node_devices(self) -> bool:
        """The pattern names the node ({node}): each node has its own device files."""
        return "{node}" in self.gpu_device_files

    def gpu_device_file(self, index: int, node: str = "") -> str:
        return self.gpu_device_files.replace("{i}", str(index)).replace("{node}", node)


@dataclass(frozen=True)
class Partition:
    name: str
    nodes: str
    default: bool
    max_time_minutes: int
    max_gpus_per_job: int
    min_mps_share: int
    enforce: bool = True  # job_submit.lua requires the slurm-dlrm wrapper's fields here


@dataclass(frozen=True)
class MpsConfig:
    enabled: bool
    mps_per_gpu: int
    shards_per_gpu: int
    client_limit: int
    # Who holds a member to its memory fence (docs/admin.md "Fences"): "v3" MPS v3
    # namespaces/servers (driver r615+), "v2" the client's own environment (legacy),
    # "auto" v3 where the node has it. dmem: cgroup v2 dmem limits "auto" where the kernel
    # has the controller, "on" required, "off" never.
    mode: str = "auto"
    dmem: str = "auto"
    # Jobs of different users on one GPU (docs/admin.md "MPS across users"): MPS runs one
    # user's server per GPU at a time, so they take turns. "time-slice" accepts that;
    # "one-user" has job_submit.lua give every gres/mps job --exclusive=user.
    cross_user: str = "time-slice"

    def cross_user_note(self) -> str:
        """What a --no-pack job on an MPS share should know on this site (estimate, submit)."""
        if self.cross_user == "one-user":
            return ("a --no-pack job on an MPS share runs with --exclusive=user here ([mps] cross_user = "
                    "\"one-user\"): no other user's job shares its node while it runs, so no other user's MPS "
                    "job shares its GPU (docs/admin.md \"MPS across users\")")
        return ("a --no-pack job on an MPS share may share its GPU with other users' MPS jobs; MPS runs one "
                "user's jobs on a GPU at a time, so yours and theirs take turns, each slowed by the others "
                "([mps] cross_user = \"time-slice\"; docs/admin.md \"MPS across users\"); packs are not affected")


@dataclass(frozen=True)
class SlurmAdminConfig:
    """Where the rendered Slurm files go and what the node scripts call (`[slurm]`)."""

    config_dir: str = "/etc/slurm"
    script_dir: str = "/etc/slurm/slurm-dlrm"
    select_type_parameters: str = "CR_Core_Memory"
    slurm_user: str = "slurm"
    mps_control_command: str = "nvidia-cuda-mps-control"
    mps_pipe_root: str = "/run/slurm-dlrm/mps"
    mps_log_root: str = "/var/log/slurm-dlrm/mps"
    mps_start_timeout_s: float = 10.0
    mps_stop_timeout_s: float = 10.0
    shm_dir: str = "/dev/shm"
    accounting_tres: bool = True
    # cgroup v2 mount, and the job's cgroup under it as slurmd's cgroup/v2 plugin makes it
    # ({job_id} replaced): the prolog writes a --no-pack job's dmem limits there.
    cgroup_root: str = "/sys/fs/cgroup"
    job_cgroup: str = "system.slice/slurmstepd.scope/job_{job_id}"
    # What the site already has in slurm.conf, kept by the fragment (docs/admin.md
    # "Installs that chain"): its own Prolog/Epilog/TaskProlog (a path or a glob, as
    # slurm.conf takes them; "" = none), which our scripts run, and list items the fragment
    # keeps beside its own (comma-separated, as in slurm.conf).
    site_prolog: str = ""
    site_epilog: str = ""
    site_task_prolog: str = ""
    site_gres_types: str = ""
    site_prolog_flags: str = ""
    site_job_submit_plugins: str = ""
    site_accounting_tres: str = ""


@dataclass(frozen=True)
class PackingConfig:
    policy: str
    max_members_per_gpu: int
    memory_margin_pct: float
    max_gpus_per_pack: int
    round_seconds: float
    round_batch_size: int
    max_wait_rounds: int
    # A refilling pack's reserve, % of its members' CPUs / host memory; None ("share"):
    # its GPUs' whole share of the node.
    refill_headroom_pct: float | None = 100.0
    # "slowdown" (the default, issue 40): the slowdown bound of issue 31, gangs get their
    # turn (docs/packing.md "Every job gets its turn"); "rounds": round-based aging, a site
    # choice (gangs wait until the stream of one-GPU jobs ends).
    fairness: str = "slowdown"
    # The slowdown rule's tuning (`FairConfig`): a job is overdue past this slowdown
    # (wait + run) / run and this wait; a waiting gang reserves room past its own point.
    overdue_slowdown: float = 100.0
    gang_reserve_slowdown: float = 2.0
    # `policy = "exact"` (issue 50): CP-SAT's deterministic time per round and the
    # job-GPU pairs past which a round keeps complementary's plan.
    exact_budget_s: float = 0.2
    exact_max_pairs: int = 600
    exact_window: int = 8  # pending jobs beyond the heuristic's picks it may choose from
    overdue_min_wait_s: float = 600.0


@dataclass(frozen=True)
class AgentConfig:
    sample_interval_s: float
    host_mem_tolerance_pct: float
    term_grace_s: float
    heartbeat_timeout_s: float
    # an agent whose members all ended waits this long for joiners (refill) before it
    # exits; None: 2 x the service's dispatch round (packing.round_seconds, or
    # `serve --round-seconds`), so that at least one round can plan a join (docs/agent.md)
    join_grace_s: float | None = None


@dataclass(frozen=True)
class AdaptConfig:
    """Run-time adaptation by the service (docs/recovery.md)."""

    repack_threshold_pct: float = 10.0  # predicted speed gain a run-time move must clear
    repack_restart_cost_s: float = 120.0  # what a move costs: checkpoint, requeue, restart, warm-up
    repack_interval_s: float = 300.0  # a running member is reconsidered at most this often
    refit_every_rounds: int = 30  # refit the interference model at most once per this many rounds
    refit_min_samples: int = 3  # co-located GPUs with solo rates needed before a refit
    # A learned model file (`slurm-dlrm interference fit`) to plan with; yours or root's,
    # writable by no one else ("" = none). A model the service learnt itself wins.
    interference_model: str = ""
    learned_refit_every_groups: int = 50  # refit the learned model every N new co-located GPUs (0: never)
    learned_min_groups: int = 30  # co-located GPUs before the first learned fit


@dataclass(frozen=True)
class MultinodeConfig:
    """[multinode]: jobs over several whole nodes (issue 48, service/multinode.py)."""

    exclusive: bool = True  # --exclusive: no other job on the job's nodes
    whole_nodes: bool = True  # world_size must be a multiple of the GPUs per node
    # Folders every node sees though statfs calls them local ({user} and ~ expanded)
    shared_paths: tuple[str, ...] = ()

    def shared_paths_for(self, user: str) -> list[str]:
        return [os.path.expanduser(p.replace("{user}", user)) for p in self.shared_paths]


@dataclass(frozen=True)
class SiteConfig:
    name: str
    store_dir: str
    spool_dir: str
    gpu_models: dict[str, GpuModel]
    nodes: tuple[NodeGroup, ...]
    partitions: tuple[Partition, ...]
    mps: MpsConfig
    packing: PackingConfig
    agent: AgentConfig
    path: str | None = field(default=None, compare=False)
    slurm: SlurmAdminConfig = field(default_factory=SlurmAdminConfig)
    # The service deletes samples older than this from each store (0: keep them all);
    # acct's per-job aggregates stay (Store.prune_samples).
    sample_retention_days: float = 30.0
    adapt: AdaptConfig = field(default_factory=AdaptConfig)
    exporter_address: str = "127.0.0.1"  # `slurm-dlrm exporter`'s default --address
    # [store] filesystem: "auto" asks statfs whether the store folder is on a network
    # filesystem (no WAL there: store/fstype.py); "network"/"local" declare it.
    store_filesystem: str = "auto"
    # [service] lease_s: how long the service's lease on the store lasts without a
    # renewal (0: 3 rounds, at least 30 s); another host's service takes over after it.
    service_lease_s: float = 0.0
    # [service] run_as: "login" (a process on a login node) or "slurm-job" (a small batch
    # job in `partition`, `job_minutes` long, chained by --dependency=singleton).
    service_run_as: str = "login"
    service_partition: str = ""
    service_job_minutes: int = 60
    multinode: MultinodeConfig = field(default_factory=MultinodeConfig)

    def store_dir_for(self, user: str) -> Path:
        return Path(os.path.expanduser(self.store_dir.replace("{user}", user)))

    def spool_dir_for(self, user: str) -> Path:
        return Path(os.path.expanduser(self.spool_dir.replace("{user}", user)))

    def gpu_model(self, name: str) -> GpuModel:
        try:
            return self.gpu_models[name]
        except KeyError:
            raise ConfigError("gpu", f"unknown GPU model {name!r} (site has: {', '.join(sorted(self.gpu_models))})") from None

    @property
    def default_partition(self) -> Partition:
        for p in self.partitions:
            if p.default:
                return p
        return self.partitions[0]


# ---------------------------------------------------------------- validation helpers

class _Section:
    """Reads typed keys from one TOML table and refuses the ones it never read."""

    def __init__(self, data: Any, where: str, path: str | None) -> None:
        if not isinstance(data, dict):
            raise ConfigError(where, f"must be a table, got {type(data).__name__}", path)
        self.data = data
        self.where = where
        self.path = path
        self.seen: set[str] = set()

    def _key(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = ..., *, min_value: float | None = None,
            max_value: float | None = None, choices: tuple[str, ...] | None = None) -> Any:
        self.seen.add(key)
        if key not in self.data:
            if default is ...:
                raise ConfigError(self._key(key), "missing", self.path)
            return default
        value = self.data[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        # bool is an int subclass in Python; a TOML `true` is never a count.
        if isinstance(value, bool) and bool not in kinds:
            raise ConfigError(self._key(key), f"must be {_kind_name(kinds)}, got a boolean", self.path)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kinds):
            raise ConfigError(self._key(key), f"must be {_kind_name(kinds)}, got {type(value).__name__} {_short(value)}",
                              self.path)
        # TOML has inf and nan, and integers of any size: neither is a count or a size here.
        if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
            raise ConfigError(self._key(key), f"must be a finite number, got {value!r}", self.path)
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
            raise ConfigError(self._key(key), f"must be at most {MAX_INT:,} in size, got {_short(value)}", self.path)
        if min_value is not None and value < min_value:  # type: ignore[operator]
            raise ConfigError(self._key(key), f"must be >= {min_value:g}, got {_short(value)}", self.path)
        if max_value is not None and value > max_value:  # type: ignore[operator]
            raise ConfigError(self._key(key), f"must be <= {max_value:g}, got {_short(value)}", self.path)
        if choices is not None and value not in choices:
            raise ConfigError(self._key(key), f"must be one of {', '.join(choices)}; got {_short(value)}", self.path)
        return value

    def table(self, key: str) -> _Section:
        self.seen.add(key)
        return _Section(self.data.get(key, {}), self._key(key), self.path)

    def done(self) -> None:
        unknown = sorted(set(self.data) - self.seen)
        if unknown:
            key = unknown[0] if len(unknown[0]) <= 60 else unknown[0][:60] + "..."  # never a whole value
            raise ConfigError(self._key(key), "unknown key", self.path)


def _kind_name(kinds: tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "a list"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


_HOSTLIST = re.compile(r"^([A-Za-z0-9_.-]*)(?:\[([0-9,\-]+)\])?([A-Za-z0-9_.-]*)$")


def expand_hostlist(expr: str, max_hosts: int = MAX_HOSTS) -> list[str]:
    """Expand a Slurm hostlist such as ``node[1-3,7],gpu01`` (one bracket per name).
    ValueError past `max_hosts` names, counted from the ranges' bounds before any name
    is made (``node[0-999999999]`` was a MemoryError, issue 32)."""
    if len(expr) > 64 * max_hosts:
        raise ValueError(f"hostlist of {len(expr):,} characters: at most {max_hosts:,} hosts")
    parsed: list[tuple[str, str, list[tuple[int, int, int]]]] = []
    count = 0
    for part in _split_top_level(expr):
        m = _HOSTLIST.match(part)
        if not m or not part:
            raise ValueError(f"bad hostlist {_short(expr)}")
        prefix, ranges, suffix = m.groups()
        spans = []
        for r in (ranges.split(",") if ranges is not None else []):
            lo, _, hi = r.partition("-")
            if not lo or len(lo) > 18 or len(hi) > 18:  # int() of thousands of digits fails
                raise ValueError(f"bad hostlist range {_short(r)} in {_short(expr)}")
            spans.append((int(lo), int(hi or lo), len(lo)))
            count += max(0, spans[-1][1] - spans[-1][0] + 1)
        count += ranges is None
        if count > max_hosts:
            raise ValueError(f"hostlist {_short(expr)} names more than {max_hosts:,} hosts")
        parsed.append((prefix, suffix, spans) if ranges is not None else (prefix + suffix, "", []))
    out: list[str] = []
    for prefix, suffix, spans in parsed:
        if not spans:
            out.append(prefix)
        for lo_i, hi_i, width in spans:
            out.extend(f"{prefix}{i:0{width}d}{suffix}" for i in range(lo_i, hi_i + 1))
    return out


def _split_top_level(expr: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in expr:
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += ch == "["
        depth -= ch == "]"
        cur += ch
    parts.append(cur)
    return [p.strip() for p in parts]


# ---------------------------------------------------------------- loading

def _headroom_pct(k: _Section) -> float | None:
    """`[packing] refill_headroom_pct`: 0..1000, or "share" (None) for nodes that run
    nothing but packs, where holding the GPUs' whole share costs no other job."""
    raw = k.data.get("refill_headroom_pct")
    if isinstance(raw, str):
        k.seen.add("refill_headroom_pct")
        if raw != "share":
            raise ConfigError(k._key("refill_headroom_pct"), f'must be a percentage (0..1000) or "share", got {raw!r}',
                              k.path)
        return None
    value: float = k.get("refill_headroom_pct", float, 100.0, min_value=0, max_value=1000)
    return value


def parse_site(data: dict[str, Any], path: str | None = None) -> SiteConfig:
    top = _Section(data, "", path)
    s = top.table("site")
    name = s.get("name", str)
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,40}", name):
        raise ConfigError("site.name", "letters, digits, '_' and '-' only (it becomes ClusterName)", path)
    store_dir = s.get("store_dir", str, "~/.local/share/slurm-dlrm")
    spool_dir = s.get("spool_dir", str, "~/.local/share/slurm-dlrm/spool")
    sample_retention_days = s.get("sample_retention_days", float, 30.0, min_value=0)
    # where `slurm-dlrm exporter` listens unless --address says otherwise (loopback: its
    # /metrics has no authentication; docs/admin.md "Exporter security")
    exporter_address = s.get("exporter_address", str, "127.0.0.1")
    s.done()

    models_t = top.table("gpu_models")
    gpu_models: dict[str, GpuModel] = {}
    for model_name in list(models_t.data):
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,32}", model_name):
            cut = model_name if len(model_name) <= 60 else model_name[:60] + "..."
            raise ConfigError(f"gpu_models.{cut}", "letters, digits, '_' and '-' only (it becomes the gres Type=)",
                              path)
        g = models_t.table(model_name)
        gpu_models[model_name] = GpuModel(
            name=model_name,
            memory_gib=g.get("memory_gib", float, min_value=1),
            sm_count=g.get("sm_count", int, min_value=1),
            mem_bandwidth_gbps=g.get("mem_bandwidth_gbps", float, min_value=1),
            fp32_tflops=g.get("fp32_tflops", float, min_value=0.1),
            tf32_tflops=g.get("tf32_tflops", float, min_value=0.1),
            cuda_context_mib=g.get("cuda_context_mib", float, min_value=0),
            cublas_workspace_mib=g.get("cublas_workspace_mib", float, min_value=0),
            gemm_efficiency=g.get("gemm_efficiency", float, None, min_value=0.001, max_value=1.5),
            bf16_gemm_efficiency=g.get("bf16_gemm_efficiency", float, None, min_value=0.001, max_value=1.5),
            stream_bandwidth_gbps=g.get("stream_bandwidth_gbps", float, None, min_value=0.001),
            gather_bandwidth_gbps=g.get("gather_bandwidth_gbps", float, None, min_value=0.001),
            kernel_launch_us=g.get("kernel_launch_us", float, None, min_value=0.01, max_value=10000),
            nvml_overhead_mib=g.get("nvml_overhead_mib", float, None, min_value=0, max_value=65536),
            fence_overhead_mib=g.get("fence_overhead_mib", float, None, min_value=0, max_value=65536),
            measured_with=g.get("measured_with", str, None),
            gpu_us_per_kernel=g.get("gpu_us_per_kernel", float, None, min_value=0, max_value=10000),
            host_us_per_kernel=g.get("host_us_per_kernel", float, None, min_value=0, max_value=10000),
            sm_busy_ceiling=g.get("sm_busy_ceiling", float, None, min_value=0.01, max_value=1),
            membw_intercept_pct=g.get("membw_intercept_pct", float, None, min_value=-100, max_value=100),
            membw_per_est_membw=g.get("membw_per_est_membw", float, None, min_value=-100, max_value=100),
            membw_per_est_sm=g.get("membw_per_est_sm", float, None, min_value=-100, max_value=100),
        )
        calib = ("gpu_us_per_kernel", "host_us_per_kernel", "sm_busy_ceiling", "membw_intercept_pct",
                 "membw_per_est_membw", "membw_per_est_sm")
        given = [k for k in calib if getattr(gpu_models[model_name], k) is not None]
        if given and len(given) != len(calib):
            absent = ", ".join(k for k in calib if k not in given)
            raise ConfigError(f"gpu_models.{model_name}", f"a profile calibration needs all six keys; missing {absent}",
                              path)
        g.done()
    models_t.done()
    if not gpu_models:
        raise ConfigError("gpu_models", "at least one GPU model is required", path)

    top.seen.add("nodes")
    raw_nodes = data.get("nodes", [])
    if not isinstance(raw_nodes, list) or not raw_nodes:
        raise ConfigError("nodes", "at least one [[nodes]] entry is required", path)
    nodes = []
    all_hosts: set[str] = set()
    for i, raw in enumerate(raw_nodes):
        n = _Section(raw, f"nodes[{i}]", path)
        group = NodeGroup(
            names=n.get("names", str),
            gpu_model=n.get("gpu_model", str, choices=tuple(gpu_models)),
            gpus=n.get("gpus", int, min_value=0, max_value=64),
            cpus=n.get("cpus", int, min_value=1),
            memory_mib=n.get("memory_mib", int, min_value=1),
            gpu_device_files=n.get("gpu_device_files", str, "/dev/nvidia{i}"),
            node_addr=n.get("node_addr", str, ""),
            slurmd_port=n.get("slurmd_port", int, 0, min_value=0, max_value=65535),
        )
        n.done()
        _check_device_files(group, f"nodes[{i}].gpu_device_files", path)
        if group.node_addr and not re.fullmatch(r"[A-Za-z0-9_.:-]+", group.node_addr):
            raise ConfigError(f"nodes[{i}].node_addr", "a host name or IP address, no spaces", path)
        try:
            hosts = group.hostnames
        except ValueError as exc:
            raise ConfigError(f"nodes[{i}].names", str(exc), path) from None
        dup = all_hosts.intersection(hosts)
        if dup:
            raise ConfigError(f"nodes[{i}].names", f"node {sorted(dup)[0]} is listed twice", path)
        all_hosts.update(hosts)
        nodes.append(group)

    top.seen.add("partitions")
    raw_parts = data.get("partitions", [])
    if not isinstance(raw_parts, list) or not raw_parts:
        raise ConfigError("partitions", "at least one [[partitions]] entry is required", path)
    partitions: list[Partition] = []
    for i, raw in enumerate(raw_parts):
        p = _Section(raw, f"partitions[{i}]", path)
        part = Partition(
            name=p.get("name", str),
            nodes=p.get("nodes", str),
            default=p.get("default", bool, False),
            max_time_minutes=p.get("max_time_minutes", int, 1440, min_value=1),
            max_gpus_per_job=p.get("max_gpus_per_job", int, 8, min_value=1),
            min_mps_share=p.get("min_mps_share", int, 1, min_value=1),
            enforce=p.get("enforce", bool, True),
        )
        p.done()
        if not _SLURM_NAME.fullmatch(part.name):
            raise ConfigError(f"partitions[{i}].name", "letters, digits, '_', '.' and '-' only", path)
        if any(q.name == part.name for q in partitions):
            raise ConfigError(f"partitions[{i}].name", f"partition {part.name!r} is listed twice", path)
        try:
            missing = set(expand_hostlist(part.nodes)) - all_hosts
        except ValueError as exc:
            raise ConfigError(f"partitions[{i}].nodes", str(exc), path) from None
        if missing:
            raise ConfigError(f"partitions[{i}].nodes", f"node {sorted(missing)[0]} is not in [[nodes]]", path)
        partitions.append(part)
    if sum(p.default for p in partitions) > 1:
        raise ConfigError("partitions", "more than one partition has default = true", path)

    m = top.table("mps")
    mps = MpsConfig(
        enabled=m.get("enabled", bool, True),
        mps_per_gpu=m.get("mps_per_gpu", int, 100, min_value=1),
        shards_per_gpu=m.get("shards_per_gpu", int, 0, min_value=0),
        client_limit=m.get("client_limit", int, 48, min_value=1, max_value=48),
        mode=m.get("mode", str, "auto", choices=("auto", "v3", "v2")),
        dmem=m.get("dmem", str, "auto", choices=("auto", "on", "off")),
        cross_user=m.get("cross_user", str, "time-slice", choices=("time-slice", "one-user")),
    )
    m.done()
    for i, part in enumerate(partitions):
        if part.min_mps_share > mps.mps_per_gpu:
            raise ConfigError(f"partitions[{i}].min_mps_share", f"exceeds mps.mps_per_gpu ({mps.mps_per_gpu})", path)

    sl = top.table("slurm")
    slurm = SlurmAdminConfig(
        config_dir=_abs_path(sl, "config_dir", "/etc/slurm"),
        script_dir=_abs_path(sl, "script_dir", "/etc/slurm/slurm-dlrm"),
        select_type_parameters=_select_type_parameters(sl),
        slurm_user=sl.get("slurm_user", str, "slurm"),
        mps_control_command=sl.get("mps_control_command", str, "nvidia-cuda-mps-control"),
        mps_pipe_root=_abs_path(sl, "mps_pipe_root", "/run/slurm-dlrm/mps"),
        mps_log_root=_abs_path(sl, "mps_log_root", "/var/log/slurm-dlrm/mps"),
        mps_start_timeout_s=sl.get("mps_start_timeout_s", float, 10.0, min_value=0.5, max_value=600),
        mps_stop_timeout_s=sl.get("mps_stop_timeout_s", float, 10.0, min_value=0.5, max_value=600),
        shm_dir=_abs_path(sl, "shm_dir", "/dev/shm"),
        accounting_tres=sl.get("accounting_tres", bool, True),
        cgroup_root=_abs_path(sl, "cgroup_root", "/sys/fs/cgroup"),
        job_cgroup=sl.get("job_cgroup", str, "system.slice/slurmstepd.scope/job_{job_id}"),
        site_prolog=_site_script(sl, "site_prolog"),
        site_epilog=_site_script(sl, "site_epilog"),
        site_task_prolog=_site_script(sl, "site_task_prolog"),
        site_gres_types=_site_items(sl, "site_gres_types"),
        site_prolog_flags=_site_items(sl, "site_prolog_flags"),
        site_job_submit_plugins=_site_items(sl, "site_job_submit_plugins"),
        site_accounting_tres=_site_items(sl, "site_accounting_tres"),
    )
    sl.done()
    if not re.fullmatch(r"[a-z_][a-z0-9_-]{0,31}", slurm.slurm_user):
        raise ConfigError("slurm.slurm_user", "not a valid user name", path)
    for key, ours in (("site_prolog", "prolog.sh"), ("site_epilog", "epilog.sh"), ("site_task_prolog", "task_prolog.sh")):
        # Ours runs the site's: naming ours would make it run itself forever.
        if getattr(slurm, key) == f"{slurm.script_dir}/{ours}":
            raise ConfigError(f"slurm.{key}", f"names slurm-dlrm's own {ours}; name the site's script, or leave it out",
                              path)
    if not slurm.mps_control_command or any(c.isspace() for c in slurm.mps_control_command):
        raise ConfigError("slurm.mps_control_command", "one command name or absolute path, no spaces", path)
    if slurm.job_cgroup.startswith("/") or "{job_id}" not in slurm.job_cgroup or ".." in slurm.job_cgroup \
            or not re.fullmatch(r"[A-Za-z0-9_.@:/{}-]+", slurm.job_cgroup):
        raise ConfigError("slurm.job_cgroup", "a path under cgroup_root with {job_id} (letters, digits, _.@:-/)", path)
    max_gpu_index = max(max(n.gpus for n in nodes) - 1, 0)
    for key in ("mps_pipe_root", "mps_log_root"):
        longest = f"{getattr(slurm, key)}/gpu{max_gpu_index}/pipe"
        if len(longest) > MPS_DIR_MAX_CHARS:
            raise ConfigError(f"slurm.{key}", f"too long: {longest} has {len(longest)} characters, "
                              f"MPS fails to start beyond {MPS_DIR_MAX_CHARS}", path)

    k = top.table("packing")
    packing = PackingConfig(
        policy=k.get("policy", str, "complementary", choices=POLICIES),
        max_members_per_gpu=k.get("max_members_per_gpu", int, 8, min_value=1),
        memory_margin_pct=k.get("memory_margin_pct", float, 5.0, min_value=0, max_value=100),
        max_gpus_per_pack=k.get("max_gpus_per_pack", int, 4, min_value=1),
        round_seconds=k.get("round_seconds", float, 10.0, min_value=0.1),
        round_batch_size=k.get("round_batch_size", int, 16, min_value=1),
        max_wait_rounds=k.get("max_wait_rounds", int, 30, min_value=1),
        refill_headroom_pct=_headroom_pct(k),
        fairness=k.get("fairness", str, "slowdown", choices=("rounds", "slowdown")),
        overdue_slowdown=k.get("overdue_slowdown", float, 100.0, min_value=1.0),  # FairConfig's
        gang_reserve_slowdown=k.get("gang_reserve_slowdown", float, 2.0, min_value=1.0),
        overdue_min_wait_s=k.get("overdue_min_wait_s", float, 600.0, min_value=0.0),
        exact_budget_s=k.get("exact_budget_s", float, 0.2, min_value=0.001, max_value=60.0),
        exact_max_pairs=k.get("exact_max_pairs", int, 600, min_value=1),
        exact_window=k.get("exact_window", int, 8, min_value=0),
    )
    k.done()
    if packing.max_members_per_gpu > mps.client_limit:
        raise ConfigError("packing.max_members_per_gpu", f"exceeds mps.client_limit ({mps.client_limit})", path)

    a = top.table("agent")
    agent = AgentConfig(
        sample_interval_s=a.get("sample_interval_s", float, 2.0, min_value=0.05),
        host_mem_tolerance_pct=a.get("host_mem_tolerance_pct", float, 10.0, min_value=0),
        term_grace_s=a.get("term_grace_s", float, 60.0, min_value=0),
        heartbeat_timeout_s=a.get("heartbeat_timeout_s", float, 120.0, min_value=1),
        join_grace_s=a.get("join_grace_s", float, None, min_value=0),
    )
    a.done()
    d = AdaptConfig()
    r = top.table("adapt")
    adapt = AdaptConfig(
        repack_threshold_pct=r.get("repack_threshold_pct", float, d.repack_threshold_pct, min_value=0),
        repack_restart_cost_s=r.get("repack_restart_cost_s", float, d.repack_restart_cost_s, min_value=0),
        repack_interval_s=r.get("repack_interval_s", float, d.repack_interval_s, min_value=1),
        refit_every_rounds=r.get("refit_every_rounds", int, d.refit_every_rounds, min_value=1),
        refit_min_samples=r.get("refit_min_samples", int, d.refit_min_samples, min_value=1),
        interference_model=r.get("interference_model", str, d.interference_model),
        learned_refit_every_groups=r.get("learned_refit_every_groups", int, d.learned_refit_every_groups,
                                         min_value=0),
        learned_min_groups=r.get("learned_min_groups", int, d.learned_min_groups, min_value=5),
    )
    r.done()
    st = top.table("store")
    store_filesystem = st.get("filesystem", str, "auto", choices=("auto", "network", "local"))
    st.done()
    sv = top.table("service")
    service_lease_s = sv.get("lease_s", float, 0.0, min_value=0)
    service_run_as = sv.get("run_as", str, "login", choices=("login", "slurm-job"))
    service_partition = sv.get("partition", str, "")
    service_job_minutes = sv.get("job_minutes", int, 60, min_value=5, max_value=7 * 24 * 60)
    if service_partition and not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", service_partition):
        raise ConfigError("service.partition", "a Slurm partition name (letters, digits, '_', '.', '-')", path)
    if service_run_as == "slurm-job" and not service_partition:
        raise ConfigError("service.partition", 'run_as = "slurm-job" needs the CPU partition the service runs in',
                          path)
    sv.done()
    mn = top.table("multinode")
    shared = mn.get("shared_paths", list, [])
    if not all(isinstance(p, str) and (p.startswith("/") or p.startswith("~")) for p in shared):
        raise ConfigError("multinode.shared_paths", "must be a list of absolute paths (or ~...)", path)
    multinode = MultinodeConfig(exclusive=mn.get("exclusive", bool, True), whole_nodes=mn.get("whole_nodes", bool, True),
                                shared_paths=tuple(shared))
    mn.done()
    top.done()
    return SiteConfig(name, store_dir, spool_dir, gpu_models, tuple(nodes), tuple(partitions), mps, packing, agent,
                      path, slurm, sample_retention_days, adapt, exporter_address, store_filesystem,
                      service_lease_s, service_run_as, service_partition, service_job_minutes, multinode)


def _abs_path(section: _Section, key: str, default: str) -> str:
    value: str = section.get(key, str, default)
    # The paths land unquoted in slurm.conf, where '#' starts a comment.
    if not value.startswith("/") or any(c.isspace() or c in "\"'$`#" for c in value):
        raise ConfigError(section._key(key), f"must be an absolute path without spaces, quotes or '#', got {value!r}",
                          section.path)
    return value.rstrip("/") or "/"


def _select_type_parameters(section: _Section) -> str:
    """SelectTypeParameters: a memory-consumable CR_* first (packing needs memory as a
    consumable), then any other flags the site sets (e.g. CR_ONE_TASK_PER_CORE), kept."""
    value: str = section.get("select_type_parameters", str, "CR_Core_Memory")
    items = [v.strip() for v in value.split(",") if v.strip()]
    choices = ("CR_Core_Memory", "CR_CPU_Memory", "CR_Socket_Memory")
    if not items or items[0] not in choices or any(not re.fullmatch(r"[A-Za-z_]+", v) for v in items[1:]):
        raise ConfigError(section._key("select_type_parameters"),
                          f"must start with one of {', '.join(choices)} (further flags comma-separated); got {value!r}",
                          section.path)
    return ",".join(items)


def _site_script(section: _Section, key: str) -> str:
    """A site's own Prolog/Epilog/TaskProlog: "" or an absolute path (a glob allowed, as
    slurm.conf takes it); no spaces or shell quoting characters (our scripts expand it)."""
    value: str = section.get(key, str, "")
    if value and (not value.startswith("/") or not re.fullmatch(r"[A-Za-z0-9_./*?\[\]@+-]+", value)):
        raise ConfigError(section._key(key), f"an absolute path or glob (letters, digits, _./*?[]@+-), got {value!r}",
                          section.path)
    return value


def _site_items(section: _Section, key: str) -> str:
    """A comma-separated list of slurm.conf items (e.g. "Contain,X11"); normalised to no spaces."""
    value: str = section.get(key, str, "")
    items = [v.strip() for v in value.split(",") if v.strip()]
    if any(not re.fullmatch(r"[A-Za-z0-9_./:=-]+", v) for v in items):
        raise ConfigError(section._key(key), f"comma-separated slurm.conf items (letters, digits, _./:=-), got {value!r}",
                          section.path)
    return ",".join(items)


def _check_device_files(group: NodeGroup, key: str, path: str | None) -> None:
    pattern = group.gpu_device_files
    if group.uses_nvml or group.gpus == 0:
        return
    if not pattern.startswith("/") or any(c.isspace() or c in ",[]\"'$`#" for c in pattern):
        raise ConfigError(key, f"must be \"nvml\" or an absolute path pattern with {{i}}, got {pattern!r}", path)
    if "{" in pattern.replace("{i}", "").replace("{node}", "") or "}" in pattern.replace("{i}", "").replace("{node}", ""):
        raise ConfigError(key, f"only {{i}} and {{node}} may be filled in, got {pattern!r}", path)
    if "{i}" not in pattern and group.gpus > 1:
        raise ConfigError(key, f"needs {{i}} (the GPU index) for {group.gpus} GPUs per node", path)


def default_site_path() -> Path:
    env = os.environ.get("SLURM_DLRM_SITE")
    if env:
        return Path(env)
    etc = Path("/etc/slurm-dlrm/site.toml")
    if etc.is_file():
        return etc
    return REPO_SITE_FILE


def load_site(path: str | os.PathLike[str] | None = None) -> SiteConfig:
    p = Path(path) if path is not None else default_site_path()
    try:
        with p.open("rb") as f:
            raw = f.read(MAX_SITE_BYTES + 1)
    except OSError as exc:
        raise ConfigError("site", f"cannot read {p}: {exc.strerror}") from None
    if len(raw) > MAX_SITE_BYTES:
        raise ConfigError("site", f"file is larger than {MAX_SITE_BYTES >> 20} MiB (the limit)", str(p))
    try:
        text = raw.decode()
        data = tomllib.loads(text)
    except UnicodeDecodeError as exc:
        raise ConfigError("site", f"not valid TOML: {exc}", str(p)) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("site", _toml_error(text, exc), str(p)) from None
    except RecursionError:  # tomllib recurses into nested arrays and inline tables
        raise ConfigError("site", "not valid TOML: arrays or tables nested too deep", str(p)) from None
    except ValueError as exc:  # an integer past 4,300 digits
        raise ConfigError("site", f"not valid TOML: {_short(str(exc))}", str(p)) from None
    return parse_site(data, str(p))


def _toml_error(text: str, exc: tomllib.TOMLDecodeError) -> str:
    """tomllib refuses a key or table given twice ("Cannot overwrite a value", "Cannot
    declare ... twice") but names only the position (Python 3.11-3.13): add the key."""
    import re

    msg = str(exc)
    m = re.search(r"at line (\d+)", msg)
    if m and ("overwrite" in msg or "twice" in msg):
        lines = text.splitlines()
        no = int(m.group(1))
        src = lines[no - 1].strip() if 0 < no <= len(lines) else ""
        key = src.strip("[] ").strip() if src.startswith("[") else src.split("=", 1)[0].strip()
        if key:
            return f"duplicate key {key!r} at line {no}: {msg}"
    return f"not valid TOML: {msg}"
