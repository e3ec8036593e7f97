"""Whether the local cluster can have Slurm constrain each job's memory as a site does
(`TaskPlugin=task/cgroup`, cgroup.conf `ConstrainRAMSpace=yes`), and how its slurmd are
started so that several clusters on one host do not share job cgroups.

Slurm's cgroup/v1 plugin puts a job at ``<mount>/memory/slurm_<node>/uid_<uid>/job_<id>``
(22.05, 24.11, 26.05): the same path for node1's job 5 of every local cluster on the host
(each git worktree and each leg of scripts/slurm-matrix.sh has a node1 and counts job ids
from 1), so two clusters would share one job's limit and OOM count. Each slurmd is
therefore started in the cluster's own memory cgroup (``slurm-dlrm-<hash>`` under the
hierarchy's root) and in a new cgroup and mount namespace, where the memory hierarchy is
mounted again: that mount's root is the cluster's cgroup, so Slurm's ``slurm_<node>``
folders (and every job's) land below it. The slurmstepd and the tasks inherit the
namespaces, so the agent reads its job's cgroup at the path /proc/self/cgroup names.

Only cgroup v1 (this project's hosts: hybrid, the memory controller on its own
hierarchy) is used. On a cgroup v2 host the cluster keeps `TaskPlugin=task/none`: Slurm's
cgroup/v2 plugin with several slurmd on one host (and without systemd: IgnoreSystemd)
is untested here.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from slurm_dlrm.errors import BadInput

CGROUP_ROOT = Path("/sys/fs/cgroup")
# "off": keep task/none even where the host allows task/cgroup (a host where Slurm's
# cgroup plugin misbehaves); "auto" or unset: detect.
ENV_SWITCH = "SLURM_DLRM_CLUSTER_CGROUP"
# What `up` decided, one line, for `cluster status` (the state folder's, not the host's now).
DECISION_FILE = "memory-cgroup.txt"
# Run by sh: join the cluster's memory cgroup, then in a new cgroup + mount namespace mount
# the memory hierarchy again over its mount point (its root is now that cgroup) and exec
# the daemon. Mounts are made private first, so nothing reaches the host's namespace: "/"
# (unshare's own --propagation private fails in a chroot, where "/" is no mount point:
# EINVAL), else the hierarchy's parent (/sys/fs/cgroup). umount first: the same hierarchy
# cannot be mounted twice on one mount point. The source name is ours: util-linux's
# mount refuses a second "cgroup" source as already mounted.
ENTER_SCRIPT = (
    'cg=$1 mnt=$2; shift 2; echo $$ > "$cg/cgroup.procs" && '
    "exec unshare --cgroup --mount --propagation unchanged -- "
    "sh -c '{ mount --make-rprivate / 2>/dev/null || mount --make-rprivate \"${0%/*}\"; } && "
    "umount \"$0\" && mount -t cgroup -o memory slurm-dlrm-memory \"$0\" && exec \"$@\"' \"$mnt\" \"$@\""
)


@dataclass(frozen=True)
class MemoryCgroup:
    """Whether jobs' memory is constrained, and in one line why (or why not)."""

    usable: bool
    why: str
    mount: Path | None = None  # the v1 memory hierarchy's mount point
    swap: bool = False  # memory.memsw.* exist (swap accounting): constrain swap too

    def status_line(self) -> str:
        if self.usable:
            return f"constrained per job by Slurm (task/cgroup, cgroup v1 at {self.mount})"
        return f"not constrained (TaskPlugin=task/none): {self.why}"


def _mounts(proc_mounts: Path) -> list[tuple[str, str, str]]:
    """(mount point, fs type, options) of every mount."""
    out = []
    with contextlib.suppress(OSError):
        for line in proc_mounts.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 4:
                out.append((parts[1].replace("\\040", " "), parts[2], parts[3]))
    return out


def detect(root: Path = CGROUP_ROOT, proc_mounts: Path = Path("/proc/self/mounts"),
           tools: tuple[str, ...] = ("unshare", "mount", "umount"),
           env: Mapping[str, str] | None = None) -> MemoryCgroup:
    """Whether this host lets the local cluster constrain memory: a cgroup v1 memory
    hierarchy mounted at <root>/memory that we may write (root, not a read-only mount),
    and the util-linux tools that start slurmd in its own cgroup namespace; not if
    $SLURM_DLRM_CLUSTER_CGROUP is "off"."""
    switch = (os.environ if env is None else env).get(ENV_SWITCH, "").strip().lower()
    if switch == "off":
        return MemoryCgroup(False, f"turned off (${ENV_SWITCH}=off)")
    if switch not in ("", "auto"):
        raise BadInput(f"${ENV_SWITCH}: must be auto or off, got {switch!r}")
    mounts = _mounts(proc_mounts)
    v1 = root / "memory"
    for point, fstype, opts in mounts:
        if Path(point) == v1 and fstype == "cgroup" and "memory" in opts.split(","):
            if "ro" in opts.split(",") or not os.access(v1, os.W_OK):
                return MemoryCgroup(False, f"the cgroup v1 memory controller at {v1} is not writable (not root, "
                                           "or a read-only mount in a container)")
            if not (v1 / "memory.oom_control").exists():
                return MemoryCgroup(False, f"{v1} has no memory.oom_control")
            missing = [t for t in tools if shutil.which(t) is None]
            if missing:
                return MemoryCgroup(False, f"not installed: {', '.join(missing)} (util-linux, mount)")
            return MemoryCgroup(True, f"cgroup v1 memory controller at {v1}", mount=v1,
                                swap=(v1 / "memory.memsw.limit_in_bytes").exists())
    if any(Path(p) == root and t == "cgroup2" for p, t, _ in mounts):
        return MemoryCgroup(False, "cgroup v2 host: the local cluster uses Slurm's cgroup/v1 plugin only "
                                   "(cgroup/v2 with several slurmd on one host is untested)")
    return MemoryCgroup(False, f"no cgroup v1 memory controller mounted at {v1}")


def cluster_cgroup(mount: Path, state_dir: Path) -> Path:
    """The memory cgroup of one cluster's slurmd (and so of all its jobs): named by its
    state folder, which no two running clusters share."""
    return mount / f"slurm-dlrm-{hashlib.sha256(str(state_dir).encode()).hexdigest()[:8]}"


def wrap_argv(argv: list[str], cgroup: Path, mount: Path) -> list[str]:
    """`argv` started in `cgroup` and in its own cgroup + mount namespace (ENTER_SCRIPT)."""
    return ["sh", "-c", ENTER_SCRIPT, "slurm-dlrm-cgroup", str(cgroup), str(mount), *argv]


def remove_tree(cgroup: Path) -> list[Path]:
    """Remove the cluster's cgroup folders, deepest first (rmdir: only those no process is
    in; a cgroup's files cannot be deleted, only the folder). Returns what stayed."""
    stayed: list[Path] = []
    if not cgroup.is_dir():
        return stayed
    for here, _dirs, _files in sorted(os.walk(cgroup), key=lambda w: -len(Path(w[0]).parts)):
        try:
            Path(here).rmdir()
        except OSError:
            stayed.append(Path(here))
    return stayed


def recorded(state_dir: Path) -> str | None:
    """The line `up` recorded in the state folder (None: a cluster from before it did)."""
    try:
        return (state_dir / DECISION_FILE).read_text().strip() or None
    except OSError:
        return None
