"""Whether the local cluster constrains jobs' memory (slurm_dlrm/localcluster/memory_cgroup.py): the host
check on made-up mount tables, and the slurmd wrapper on this host's real cgroup v1."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from slurm_dlrm.errors import BadInput
from slurm_dlrm.localcluster import memory_cgroup as localcgroup
from slurm_dlrm.localcluster.memory_cgroup import MemoryCgroup


def _host(tmp_path: Path, mounts: str, *, memsw: bool = True) -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    (root / "memory").mkdir(parents=True)
    (root / "memory" / "memory.oom_control").write_text("oom_kill 0\n")
    if memsw:
        (root / "memory" / "memory.memsw.limit_in_bytes").write_text("0\n")
    table = tmp_path / "mounts"
    table.write_text(mounts.replace("ROOT", str(root)))
    return root, table


V1 = "cgroup ROOT/memory cgroup rw,nosuid,relatime,memory 0 0\n"


def test_a_writable_v1_memory_controller_is_used(tmp_path):
    root, table = _host(tmp_path, "tmpfs ROOT tmpfs rw 0 0\n" + V1)
    mc = localcgroup.detect(root, table, tools=("sh",), env={})
    assert mc == MemoryCgroup(True, f"cgroup v1 memory controller at {root / 'memory'}", mount=root / "memory",
                              swap=True)
    assert mc.status_line().startswith("constrained per job by Slurm (task/cgroup")
    root, table = _host(tmp_path / "noswap", V1, memsw=False)
    assert localcgroup.detect(root, table, tools=("sh",), env={}).swap is False  # ConstrainSwapSpace=no


@pytest.mark.parametrize(("mounts", "why"), [
    (V1.replace("rw,", "ro,"), "is not writable"),
    ("cgroup2 ROOT cgroup2 rw,nsdelegate 0 0\n", "cgroup v2 host"),
    ("cgroup ROOT/cpu cgroup rw,cpu 0 0\n", "no cgroup v1 memory controller mounted"),
    ("", "no cgroup v1 memory controller mounted"),
])
def test_without_a_usable_v1_memory_controller_the_cluster_keeps_task_none(tmp_path, mounts, why):
    root, table = _host(tmp_path, mounts)
    mc = localcgroup.detect(root, table, tools=("sh",), env={})
    assert not mc.usable and why in mc.why, mc
    assert mc.status_line().startswith("not constrained (TaskPlugin=task/none): ")


def test_the_switch_turns_it_off_and_refuses_other_words(tmp_path):
    root, table = _host(tmp_path, V1)
    off = localcgroup.detect(root, table, tools=("sh",), env={"SLURM_DLRM_CLUSTER_CGROUP": "off"})
    assert not off.usable and "SLURM_DLRM_CLUSTER_CGROUP=off" in off.why
    assert localcgroup.detect(root, table, tools=("sh",), env={"SLURM_DLRM_CLUSTER_CGROUP": "auto"}).usable
    with pytest.raises(BadInput, match="must be auto or off"):
        localcgroup.detect(root, table, tools=("sh",), env={"SLURM_DLRM_CLUSTER_CGROUP": "yes"})


def test_missing_tools_are_named(tmp_path):
    root, table = _host(tmp_path, V1)
    mc = localcgroup.detect(root, table, tools=("sh", "no-such-tool-here"), env={})
    assert not mc.usable and "no-such-tool-here" in mc.why


def test_each_cluster_has_its_own_cgroup(tmp_path):
    a = localcgroup.cluster_cgroup(Path("/m"), tmp_path / "a")
    assert a == localcgroup.cluster_cgroup(Path("/m"), tmp_path / "a") != localcgroup.cluster_cgroup(Path("/m"), tmp_path / "b")
    assert a.parent == Path("/m") and a.name.startswith("slurm-dlrm-")


HOST = localcgroup.detect()


@pytest.mark.skipif(os.geteuid() != 0 or not HOST.usable, reason=f"needs root and a writable cgroup v1 memory "
                    f"controller: {HOST.why}")
def test_the_wrapped_daemon_sees_its_clusters_cgroup_as_the_root(tmp_path):
    """What Slurm's cgroup/v1 plugin creates at the memory hierarchy's root (slurm_<node>/...)
    lands in the cluster's own cgroup, and /proc/self/cgroup names it from there, so the
    agent finds the job's folder at <mount>/<that path>."""
    assert HOST.mount is not None
    cg = localcgroup.cluster_cgroup(HOST.mount, tmp_path)
    cg.mkdir()
    try:
        probe = 'grep -E "^[0-9]+:memory:" /proc/self/cgroup && mkdir "$0/slurm_node1" && ls "$0/slurm_node1/memory.oom_control"'
        out = subprocess.run(localcgroup.wrap_argv(["sh", "-c", probe, str(HOST.mount)], cg, HOST.mount),  # noqa: S603
                             capture_output=True, text=True, timeout=30, check=True).stdout.split()
        assert out[0].endswith(":memory:/") and out[1] == str(HOST.mount / "slurm_node1" / "memory.oom_control"), out
        assert (cg / "slurm_node1").is_dir()  # below the cluster's cgroup, not at the host's root
    finally:
        assert localcgroup.remove_tree(cg) == []
    assert not cg.exists()


def test_down_stops_whatever_the_switch_says_now(tmp_path, monkeypatch):
    """A bad $SLURM_DLRM_CLUSTER_CGROUP set after `up` must not keep `down` from stopping
    the cluster (down read the switch again and raised)."""
    from slurm_dlrm import localcluster as lc

    monkeypatch.setenv("SLURM_DLRM_CLUSTER_CGROUP", "bogus")
    cluster = lc.LocalCluster(lc.ClusterConfig(state_dir=tmp_path / "state", base_port=23100))
    assert cluster.down(timeout_s=1.0) == []
