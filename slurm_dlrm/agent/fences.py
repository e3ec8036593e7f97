"""GPU memory fences that a member cannot lift itself: MPS v3 namespaces and cgroup dmem.

What the public documentation says (cited in docs/agent.md, "Fences"):

* NVIDIA MPS v3 (driver r615, CUDA 13.4; "MPS v3 Interface"): selected with
  `nvidia-cuda-mps-control -p 3` (or `CUDA_MPS_PROTOCOL_VERSION=3`, which wins over the
  flag); `-a/--apply <file>` applies a TOML configuration at start-up. A daemon that has
  v3 lists `server` and `namespace` in `nvidia-cuda-mps-control -p 3 -h` (NVIDIA's
  "Per-GPU Compute and Memory Limits with MPS" guide gives exactly this check).
* "MPS v3 Configuration File": `schema_version = "1.0"`; `[servers.<name>]` accepts
  allowed_devices, pinned_memory_limit, active_thread_percentage, client_priority, uid,
  locality_domains, "any other key is a configuration error"; `[servers.<s>.namespaces.<n>]`
  accepts pinned_memory_limit, active_thread_percentage, client_priority (r620 adds
  cgroup, cgroup_depth and per-device `sm_partition`); SM partitions are
  `[[servers.<s>.devices]] uuid` with `[[servers.<s>.devices.sm_partitions]] name, chunks,
  include_remainder`.
* "MPS v3 Namespaces": a client picks its namespace by the socket it connects to,
  `$CUDA_MPS_PIPE_DIRECTORY/<server>/<namespace>/control`; we therefore give each member
  `CUDA_MPS_PIPE_DIRECTORY=<pipe>/<server>/<namespace>`.
* "MPS v3 Memory Partitioning": cgroup v2 at /sys/fs/cgroup, CUDA 13.4+, no MIG; hard
  limit = `dmem.max` (an allocation past it fails), soft limit = `dmem.min` (crossing it
  makes the client an eviction candidate under real memory pressure only). The kernel's
  cgroup-v2.rst ("DMEM"): `dmem.capacity` (root only) lists regions and bytes,
  `dmem.min/low/max` are nested-keyed "<region> <bytes|max>" files of non-root cgroups,
  `dmem.current` the usage; NVIDIA GPUs appear as `nvidia/<pci>/vidmem` regions.

Not in the documentation we could reach (said in docs/agent.md, not guessed silently):
the flag spelling of the v3 `namespace create` verb (we use `--<key>=<value>` with the
configuration keys' names, dashes for underscores) and whether a v3 client's own
`CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` can raise its namespace's limit (we assume not, which
is what the namespace limit is for; `selftest` checks it on hardware).

Everything here is plain functions over paths and strings; the agent (loop.py) and the
admin scripts call them, the fakes (emulated/mps_control.py, `make_fake_cgroup_tree`) serve
them in tests.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

from slurm_dlrm.errors import DlrmError

MIB = 1 << 20
MODES = ("auto", "v3", "v2")
DMEM_MODES = ("auto", "on", "off")
CGROUP_ROOT = "/sys/fs/cgroup"
ENV_CGROUP_ROOT = "SLURM_DLRM_CGROUP_ROOT"  # tests point the agent at a fake cgroup tree
V3_MIN_DRIVER = 615  # NVIDIA r615 (CUDA 13.4) introduced MPS v3
V3_NAMESPACE_SM_DRIVER = 620  # per-namespace sm_partition is in the r620 schema only
V3_SERVER = "pack"  # the agent's daemon has one server (the pack's user)
PROBE_TIMEOUT_S = 10.0


class FenceError(DlrmError):
    """A fence could not be set: names what and why, in one line."""


@dataclass(frozen=True)
class FenceCaps:
    """What this node can enforce (`detect_capabilities`)."""

    driver_version: str | None
    mps_control: str | None  # the binary found, or None
    mps_v3: bool
    mps_v3_detail: str
    cgroup_v2: bool
    dmem: bool
    dmem_detail: str
    dmem_regions: dict[str, int] = field(default_factory=dict)  # region -> capacity bytes
    cgroup_root: str = CGROUP_ROOT

    @property
    def driver_major(self) -> int | None:
        m = re.match(r"(\d+)", self.driver_version or "")
        return int(m.group(1)) if m else None

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["driver_major"] = self.driver_major
        return d

    def summary(self) -> str:
        return (f"driver {self.driver_version or 'unknown'}; MPS v3 {'yes' if self.mps_v3 else 'no'} "
                f"({self.mps_v3_detail}); cgroup v2 {'yes' if self.cgroup_v2 else 'no'}; "
                f"dmem {'yes' if self.dmem else 'no'} ({self.dmem_detail})")


def cgroup_root(env: dict[str, str] | None = None) -> Path:
    e = os.environ if env is None else env
    return Path(e.get(ENV_CGROUP_ROOT) or CGROUP_ROOT)


def probe_mps_v3(binary: str, env: dict[str, str] | None = None) -> tuple[bool, str]:
    """(has v3, why): `<binary> -p 3 -h` must succeed and list the server and namespace modules."""
    run_env = dict(os.environ if env is None else env)
    run_env.pop("CUDA_MPS_PROTOCOL_VERSION", None)  # it would win over -p (NVIDIA docs)
    try:
        # stdin /dev/null: a pre-v3 binary may ignore the options and read commands from it.
        proc = subprocess.run([binary, "-p", "3", "-h"], capture_output=True, text=True,  # noqa: S603
                              stdin=subprocess.DEVNULL, env=run_env, timeout=PROBE_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"{binary} -p 3 -h: {exc}"
    text = proc.stdout + proc.stderr
    if proc.returncode != 0:
        first = text.strip().splitlines()[0] if text.strip() else f"exit {proc.returncode}"
        return False, f"{binary} -p 3 -h: {first}"
    words = set(re.findall(r"[a-z_]+", text.lower()))
    if {"server", "namespace"} <= words:
        return True, f"{binary} -p 3 -h lists server and namespace"
    return False, f"{binary} -p 3 -h lists no server/namespace commands"


def read_dmem_capacity(root: Path) -> dict[str, int]:
    """`dmem.capacity` of the root cgroup: region -> bytes (kernel cgroup-v2.rst, DMEM)."""
    out: dict[str, int] = {}
    for line in (root / "dmem.capacity").read_text().splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            out[parts[0]] = int(parts[1])
    return out


def probe_dmem(root: Path) -> tuple[bool, bool, str, dict[str, int]]:
    """(cgroup v2, dmem usable, why, regions)."""
    try:
        controllers = (root / "cgroup.controllers").read_text().split()
    except OSError:
        return False, False, f"{root} is not a cgroup v2 mount (no cgroup.controllers)", {}
    if "dmem" not in controllers:
        return True, False, f"no dmem controller in {root}/cgroup.controllers (kernel 6.14+ has it)", {}
    try:
        regions = read_dmem_capacity(root)
    except OSError as exc:
        return True, False, f"{root}/dmem.capacity: {exc.strerror or exc}", {}
    gpu = {r: b for r, b in regions.items() if r.startswith("nvidia/")}
    if not gpu:
        return True, False, f"{root}/dmem.capacity lists no nvidia/<pci>/vidmem region", regions
    return True, True, f"{len(gpu)} nvidia region(s) in {root}/dmem.capacity", regions


def detect_capabilities(binary: str | None = None, env: dict[str, str] | None = None,
                        driver_version: str | None = None, root: Path | None = None) -> FenceCaps:
    """What the node can enforce; never raises. `selftest` and `admin check` call it too."""
    e = dict(os.environ if env is None else env)
    exe = binary or shutil.which("nvidia-cuda-mps-control", path=e.get("PATH"))
    if exe is None:
        v3, v3_detail = False, "nvidia-cuda-mps-control not found on PATH"
    else:
        v3, v3_detail = probe_mps_v3(exe, e)
    croot = root or cgroup_root(e)
    v2, dmem, dmem_detail, regions = probe_dmem(croot)
    return FenceCaps(driver_version, exe, v3, v3_detail, v2, dmem, dmem_detail, regions, str(croot))


def choose_mode(site_mode: str, caps: FenceCaps) -> str:
    """"v3" or "v2" for `mps.mode`; FenceError when the site asks v3 of a node without it."""
    if site_mode not in MODES:
        raise FenceError(f"mps.mode: one of {', '.join(MODES)}, got {site_mode!r}")
    if site_mode == "v2":
        return "v2"
    if caps.mps_v3:
        return "v3"
    if site_mode == "v3":
        raise FenceError(f"mps.mode = v3 but this node has no MPS v3: {caps.mps_v3_detail} "
                         f"(driver {caps.driver_version or 'unknown'}; v3 needs r{V3_MIN_DRIVER}+)")
    return "v2"


def site_gaps(site_mode: str, dmem_mode: str, caps: FenceCaps) -> list[tuple[str, str, str]]:
    """(field, what the site asks, what this node has) for each fence the site requires and
    the node cannot set; `admin check --fences` prints them."""
    gaps = []
    if site_mode == "v3" and not caps.mps_v3:
        gaps.append(("mps.mode", "v3", caps.mps_v3_detail))
    if dmem_mode == "on" and not caps.dmem:
        gaps.append(("mps.dmem", "on", caps.dmem_detail))
    return gaps


def use_dmem(dmem_mode: str, caps: FenceCaps) -> bool:
    """Whether to set dmem limits; FenceError when the site asks for dmem the node lacks."""
    if dmem_mode not in DMEM_MODES:
        raise FenceError(f"mps.dmem: one of {', '.join(DMEM_MODES)}, got {dmem_mode!r}")
    if dmem_mode == "off":
        return False
    if caps.dmem:
        return True
    if dmem_mode == "on":
        raise FenceError(f"mps.dmem = on but {caps.dmem_detail}")
    return False


# ---------------------------------------------------------------- MPS v3 configuration


@dataclass(frozen=True)
class NamespaceLimits:
    name: str
    pinned_memory_limit_mib: int
    active_thread_percentage: int
    gpu_uuid: str | None = None  # for an SM partition
    sm_chunks: int | None = None  # static SM partition of this many chunks (isolation)


def namespace_name(key: int | str) -> str:
    """`job<id>`, or `job<id>-r<rank>` for a rank of a multi-rank job (MemberPlacement.key)."""
    return f"job{key}"


def mem_value(mib: int) -> str:
    """A v3 memory value: whole G when exact (the docs' examples use "10G"), else M."""
    return f"{mib // 1024}G" if mib % 1024 == 0 and mib >= 1024 else f"{mib}M"


def _toml_str(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def namespace_table(ns: NamespaceLimits) -> dict[str, object]:
    """The keys of one `[servers.<s>.namespaces.<n>]` table."""
    return {"pinned_memory_limit": mem_value(ns.pinned_memory_limit_mib),
            "active_thread_percentage": str(ns.active_thread_percentage)}


def v3_config_toml(uid: int, namespaces: list[NamespaceLimits], server: str = V3_SERVER) -> str:
    """The `-a` configuration of the agent's daemon: one server for the pack's user, one
    namespace per member with its memory limit and thread share (docs: MPS v3 Configuration
    File). SM partitions (r620 schema) only for members that ask for isolation."""
    lines = ['schema_version = "1.0"', "", f"[servers.{server}]", f"uid = {int(uid)}"]
    for ns in namespaces:
        lines += ["", f"[servers.{server}.namespaces.{ns.name}]"]
        for key, value in namespace_table(ns).items():
            lines.append(f"{key} = {_toml_str(str(value))}")
        if ns.sm_chunks and ns.gpu_uuid:
            lines += ["", f"[[servers.{server}.namespaces.{ns.name}.devices]]",
                      f"uuid = {_toml_str(ns.gpu_uuid)}", f"sm_partition = {_toml_str(ns.name)}"]
    parts = [ns for ns in namespaces if ns.sm_chunks and ns.gpu_uuid]
    for uuid in sorted({ns.gpu_uuid for ns in parts if ns.gpu_uuid}):
        lines += ["", f"[[servers.{server}.devices]]", f"uuid = {_toml_str(uuid)}"]
        for ns in parts:
            if ns.gpu_uuid == uuid:
                lines += ["", f"  [[servers.{server}.devices.sm_partitions]]", f"  name = {_toml_str(ns.name)}",
                          f"  chunks = {int(ns.sm_chunks or 0)}", "  include_remainder = false"]
    return "\n".join(lines) + "\n"


def namespace_create_argv(ns: NamespaceLimits, server: str = V3_SERVER) -> list[str]:
    """`namespace create` for a member that joins a running daemon (module verb syntax;
    flag names are the configuration keys with dashes: not spelled out in the docs)."""
    argv = ["namespace", "create", f"--server={server}", f"--name={ns.name}"]
    for key, value in namespace_table(ns).items():
        argv.append(f"--{key.replace('_', '-')}={value}")
    return argv


def refused_namespace(message: str) -> str | None:
    """The namespace a daemon's configuration error names (`...namespaces.<n>...`), if any."""
    m = re.search(r"namespaces\.([A-Za-z0-9_-]+)", message)
    return m.group(1) if m else None


# ---------------------------------------------------------------- cgroup dmem


def own_cgroup(root: Path, proc_cgroup: str = "/proc/self/cgroup") -> Path:
    """This process's cgroup v2 folder under `root` (the "0::<path>" line)."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError as exc:
        raise FenceError(f"{proc_cgroup}: {exc.strerror or exc}") from None
    for line in lines:
        if line.startswith("0::"):
            return root / line[3:].strip().lstrip("/")
    raise FenceError(f"{proc_cgroup}: no cgroup v2 entry (0::)")


def oom_cgroup(root: Path, slurm_job_id: str | None, proc_cgroup: str = "/proc/self/cgroup") -> Path | None:
    """The cgroup whose OOM-kill counter tells whether the kernel OOM-killed one of the
    agent's members: the Slurm job's own (layout ``.../job_<id>/step_<id>``, where every
    step of the job, members run as steps included, sits below), else the agent's own
    (members run as its children sit there or below). cgroup v2 (memory.events) first;
    on a host whose memory controller is on a cgroup v1 hierarchy (``N:memory:/path`` in
    /proc/self/cgroup, memory.oom_control under ``<root>/memory``: RHEL 8 and other
    sites Slurm's cgroup/v1 plugin serves) that one. None: neither."""
    v2: Path | None = None
    with contextlib.suppress(FenceError):
        v2 = _job_or_own(own_cgroup(root, proc_cgroup), root, slurm_job_id)
    if v2 is not None and (v2 / "memory.events").exists():
        return v2
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if "memory" in controllers.split(","):
            v1_root = root / "memory"
            v1 = _job_or_own(v1_root / path.strip().lstrip("/"), v1_root, slurm_job_id)
            if (v1 / "memory.oom_control").exists():
                return v1
    return v2


def _job_or_own(own: Path, root: Path, slurm_job_id: str | None) -> Path:
    if slurm_job_id:
        for folder in (own, *own.parents):
            if folder.name == f"job_{slurm_job_id}":
                return folder
            if folder == root:
                break
    return own


# cgroup v1 counts an OOM kill only in the cgroup whose limit was hit (v2 also counts it
# in every ancestor): the job's folder and those below it are summed, at most this many.
_V1_MAX_FOLDERS = 4096


def oom_kill_count(folder: Path | None) -> int | None:
    """How many processes the kernel OOM-killed in the folder's cgroup: `oom_kill` of
    memory.events (v2, hierarchical: kills in any descendant count), else the sum of
    `oom_kill` in memory.oom_control (v1, kernel 4.13+) over the folder and its
    descendants; None if neither can be read (no memory controller)."""
    if folder is None:
        return None
    try:
        return _oom_kill_line((folder / "memory.events").read_text())
    except OSError:
        pass
    total: int | None = None
    seen = 0
    for here, dirs, _files in os.walk(folder):
        seen += 1
        if seen > _V1_MAX_FOLDERS:
            break
        try:
            n = _oom_kill_line((Path(here) / "memory.oom_control").read_text())
        except OSError:
            continue
        if n is not None:
            total = (total or 0) + n
        dirs.sort()
    return total


def _oom_kill_line(text: str) -> int | None:
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None


def region_for_gpu(regions: dict[str, int], gpu_position: int, pci_bus_id: str | None = None) -> str:
    """The dmem region of a GPU: the nvidia region naming its PCI bus id, else the
    `gpu_position`-th nvidia region in PCI order (the order NVML and CUDA_DEVICE_ORDER=PCI_BUS_ID use)."""
    nvidia = sorted(r for r in regions if r.startswith("nvidia/"))
    if pci_bus_id:
        bus = pci_bus_id.lower()[-12:]  # NVML's 00000000:3B:00.0 vs the kernel's 0000:3b:00.0
        for r in nvidia:
            if bus in r.lower():
                return r
    if 0 <= gpu_position < len(nvidia):
        return nvidia[gpu_position]
    raise FenceError(f"dmem: no nvidia region for GPU {gpu_position} in dmem.capacity ({len(nvidia)} listed)")


@dataclass
class DmemFence:
    """One member's cgroup with its dmem limits."""

    path: Path
    region: str
    min_bytes: int
    max_bytes: int

    def read(self, name: str) -> dict[str, str]:
        out = {}
        for line in (self.path / name).read_text().splitlines():
            parts = line.split()
            if len(parts) == 2:
                out[parts[0]] = parts[1]
        return out


class DmemTree:
    """Member cgroups under the agent's own cgroup, each with dmem.min/dmem.max for its GPU.

    cgroup v2's no-internal-process rule: a cgroup that enables a controller for its
    children holds no processes itself, so the agent first moves itself into a leaf
    `agent/`, then enables +dmem in its cgroup's subtree_control and makes `member-<id>/`.
    """

    def __init__(self, root: Path, base: Path, regions: dict[str, int]) -> None:
        self.root = root
        self.base = base
        self.regions = regions
        self._prepared = False

    @classmethod
    def for_self(cls, root: Path, regions: dict[str, int], proc_cgroup: str = "/proc/self/cgroup") -> DmemTree:
        return cls(root, own_cgroup(root, proc_cgroup), regions)

    def _write(self, path: Path, text: str) -> None:
        try:
            with open(path, "w") as f:
                f.write(text)
        except OSError as exc:
            raise FenceError(f"dmem: cannot write {text.strip()!r} to {path}: {exc.strerror or exc}") from None

    def prepare(self) -> None:
        if self._prepared:
            return
        leaf = self.base / "agent"
        try:
            leaf.mkdir(exist_ok=True)
        except OSError as exc:
            raise FenceError(f"dmem: cannot create {leaf}: {exc.strerror or exc}") from None
        self._write(leaf / "cgroup.procs", f"{os.getpid()}\n")
        self._write(self.base / "cgroup.subtree_control", "+dmem\n")
        self._prepared = True

    def fence(self, job_id: int | str, region: str, min_bytes: int, max_bytes: int) -> DmemFence:
        """Create `member-<job_id>/` with dmem.min = min_bytes, dmem.max = max_bytes on region."""
        if region not in self.regions:
            raise FenceError(f"dmem: region {region} not in dmem.capacity")
        if max_bytes > self.regions[region]:
            raise FenceError(f"dmem: limit {max_bytes // MIB} MiB above {region}'s capacity "
                             f"{self.regions[region] // MIB} MiB")
        self.prepare()
        path = self.base / f"member-{job_id}"
        try:
            path.mkdir(exist_ok=True)
        except OSError as exc:
            raise FenceError(f"dmem: cannot create {path}: {exc.strerror or exc}") from None
        self._write(path / "dmem.max", f"{region} {max_bytes}\n")
        self._write(path / "dmem.min", f"{region} {min(min_bytes, max_bytes)}\n")
        return DmemFence(path, region, min(min_bytes, max_bytes), max_bytes)

    def remove(self, job_id: int | str) -> None:
        """rmdir the member's cgroup (cgroupfs removes an empty one; a busy one, or a fake
        tree's folder of plain files, stays)."""
        try:
            (self.base / f"member-{job_id}").rmdir()
        except OSError:
            pass


def join_cgroup(path: Path) -> None:
    """Move the calling process into cgroup `path` (used in the member's preexec, before exec)."""
    with open(path / "cgroup.procs", "w") as f:
        f.write(f"{os.getpid()}\n")


def make_fake_cgroup_tree(root: Path, regions: dict[str, int], dmem: bool = True,
                          proc_cgroup: str = "/proc/self/cgroup") -> Path:
    """A fake cgroup v2 tree for tests: root interface files and this process's cgroup
    folder (as /proc/self/cgroup names it). Returns that folder."""
    root.mkdir(parents=True, exist_ok=True)
    controllers = "cpuset cpu io memory hugetlb pids rdma misc" + (" dmem" if dmem else "")
    (root / "cgroup.controllers").write_text(controllers + "\n")
    (root / "cgroup.subtree_control").write_text("")
    if dmem:
        (root / "dmem.capacity").write_text("".join(f"{r} {b}\n" for r, b in regions.items()))
    own = own_cgroup(root, proc_cgroup)
    own.mkdir(parents=True, exist_ok=True)
    (own / "cgroup.controllers").write_text(controllers + "\n")
    (own / "cgroup.procs").write_text(f"{os.getpid()}\n")
    (own / "cgroup.subtree_control").write_text("")
    return own
