"""One local cluster instance's lifecycle (`LocalCluster`): `up` starts what is not
running yet (munged, with accounting MariaDB and slurmdbd, then slurmctld and one
slurmd per node) and waits until every node is usable; `down` cancels all jobs and
stops the daemons in reverse order, then any stray process of ours; `status` lists
the daemons and the nodes. `instance_lock` serialises `up` and `down` on one state
folder across processes.

The steps live beside it: the settings in `config.py`, the files in `rendering.py`,
starting a daemon in `daemons.py` and `accounting.py`, the ownership check that
guards every signal in `processes.py`.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_dlrm.localcluster import memory_cgroup, rendering
from slurm_dlrm.localcluster.accounting import start_mariadb, start_slurmdbd
from slurm_dlrm.localcluster.config import (
    PORT_MYSQL,
    PORT_SLURMCTLD,
    PORT_SLURMDBD,
    ClusterConfig,
    ClusterError,
    default_state_dir,
    load_saved_config,
)
from slurm_dlrm.localcluster.daemons import log_tail, spawn, start_munged
from slurm_dlrm.localcluster.processes import (
    Daemon,
    is_ours,
    ours_by_environ,
    read_pid,
    stop_fake_mps_daemons,
    terminate,
)
from slurm_dlrm.slurm.base import SlurmError
from slurm_dlrm.slurm.client import SlurmClient

log = logging.getLogger(__name__)


@dataclass
class ClusterStatus:
    config: ClusterConfig
    daemons: list[Daemon] = field(default_factory=list)
    nodes: list[dict[str, Any]] = field(default_factory=list)

    @property
    def up(self) -> bool:
        return bool(self.daemons) and all(d.running for d in self.daemons)

    def to_json(self) -> dict[str, Any]:
        c = self.config
        return {
            "up": self.up,
            "state_dir": str(c.state_dir),
            "slurm_conf": str(c.slurm_conf),
            "cluster_name": c.cluster_name,
            "accounting": c.accounting,
            "site_file": str(c.site_file) if c.admin_files else None,
            "ports": {"slurmctld": c.port(PORT_SLURMCTLD),
                      **({"slurmdbd": c.port(PORT_SLURMDBD), "mysql": c.port(PORT_MYSQL)} if c.accounting else {}),
                      **{n: c.slurmd_port(i) for i, n in enumerate(c.node_names)}},
            "logs": str(c.log_dir),
            "munge_socket": str(c.munge_socket),
            "daemons": [{"name": d.name, "pid": d.pid, "running": d.running, "pid_file": str(d.pid_file)}
                        for d in self.daemons],
            "nodes": self.nodes,
        }



# ---------------------------------------------------------------- locking

_held_locks: dict[str, tuple[int, int]] = {}  # path -> (fd, depth): re-entrant within a process


@contextlib.contextmanager
def instance_lock(state_dir: Path) -> Iterator[None]:
    """Serialise `up`/`down` on one state folder across processes (two pytest runs in
    one checkout, or `cluster up` typed twice). Re-entrant within a process."""
    state_dir.mkdir(parents=True, exist_ok=True)
    key = str(state_dir / ".lock")
    if key in _held_locks:
        fd, depth = _held_locks[key]
        _held_locks[key] = (fd, depth + 1)
        try:
            yield
        finally:
            fd, depth = _held_locks[key]
            _held_locks[key] = (fd, depth - 1)
        return
    fd = os.open(key, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        _held_locks[key] = (fd, 1)
        try:
            yield
        finally:
            del _held_locks[key]
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- the cluster

class LocalCluster:
    def __init__(self, config: ClusterConfig) -> None:
        self.memory_cgroup: memory_cgroup.MemoryCgroup | None = None  # set by render()
        self.config = config

    @classmethod
    def at(cls, state_dir: Path | None = None) -> LocalCluster | None:
        """The cluster recorded in a state folder (running or not), if any."""
        cfg = load_saved_config((state_dir or default_state_dir()).resolve())
        return cls(cfg) if cfg is not None else None

    def client(self, timeout_s: float = 30.0) -> SlurmClient:
        return SlurmClient(self.config.slurm_conf, timeout_s=timeout_s)

    # ------------------------------------------------------------ daemons

    def daemons(self) -> list[Daemon]:
        c = self.config
        names = ["munged"]
        if c.accounting:
            names += ["mariadbd", "slurmdbd"]
        names.append("slurmctld")
        names += [f"slurmd-{n}" for n in c.node_names]
        out = []
        for name in names:
            pid_file = c.run_dir / f"{name}.pid"
            pid = read_pid(pid_file)
            out.append(Daemon(name, pid_file, pid, pid is not None and is_ours(pid, c.state_dir)))
        return out

    def status(self, query_nodes: bool = True) -> ClusterStatus:
        st = ClusterStatus(self.config, self.daemons())
        if query_nodes and st.up:
            try:
                st.nodes = [{"name": n.name, "state": n.state, "flags": list(n.flags), "gres": n.gres,
                             "gres_used": n.gres_used, "cpus": n.cpus, "port": n.port}
                            for n in self.client(timeout_s=10).show_nodes()]
            except SlurmError as exc:
                log.warning("cluster is up but scontrol failed: %s", exc)
        return st

    # ------------------------------------------------------------ files

    def render(self) -> None:
        """Write slurm.conf, gres.conf, cgroup.conf (and slurmdbd.conf) and the fake GPU devices."""
        # first: a bad $SLURM_DLRM_CLUSTER_CGROUP writes nothing
        self.memory_cgroup = memory_cgroup.detect()
        rendering.render(self.config, self.memory_cgroup)

    # ------------------------------------------------------------ up / down

    def up(self, wait_s: float = 90.0) -> ClusterStatus:
        """Start what is not running yet; safe to call when the cluster is up."""
        with instance_lock(self.config.state_dir):
            return self._up(wait_s)

    def _up(self, wait_s: float) -> ClusterStatus:
        c = self.config
        c.validate()
        running = LocalCluster.at(c.state_dir)
        partly_up = running is not None and any(d.running for d in running.daemons())
        if running is not None and partly_up:
            if running.config != c:
                raise ClusterError(
                    f"a cluster with other settings runs in {c.state_dir} (base port "
                    f"{running.config.base_port}, {running.config.nodes} nodes, accounting "
                    f"{'on' if running.config.accounting else 'off'}); run `slurm-dlrm cluster down "
                    f"--state-dir {c.state_dir}` first")
            if running.status(query_nodes=False).up:
                self.wait_idle(wait_s)
                return self.status()
        c.state_dir.mkdir(parents=True, exist_ok=True)
        if not partly_up:
            # Started from nothing: whoever starts it owns it (tests/conftest.py's marker is
            # stale). A restart of some daemons (a test's killed slurmd brought back) keeps
            # the owner: dropping the marker then left the suite's cluster running after it.
            (c.state_dir / "fixture-started").unlink(missing_ok=True)
        t0 = time.monotonic()
        self.render()
        by_name = {d.name: d for d in self.daemons()}
        try:
            if not by_name["munged"].running:
                start_munged(c)
            if c.accounting:
                if not by_name["mariadbd"].running:
                    start_mariadb(c)
                if not by_name["slurmdbd"].running:
                    start_slurmdbd(c)
            if not by_name["slurmctld"].running:
                spawn(c, "slurmctld", ["slurmctld", "-f", str(c.slurm_conf), *self._ctld_recovery_flags()],
                      daemonizes=True)
            for name in c.node_names:
                if not by_name[f"slurmd-{name}"].running:
                    spawn(c, f"slurmd-{name}", self._slurmd_argv(name), daemonizes=True)
            self.wait_idle(wait_s)
        except BaseException:
            # Nothing half-up: stop what this call started (newest first), keep what ran before.
            started = [d for d in self.daemons() if d.running and not by_name[d.name].running]
            for d in reversed(started):
                if d.pid is not None:
                    terminate(d.pid, c.state_dir, 10.0)
                d.pid_file.unlink(missing_ok=True)
            raise
        log.info("local cluster up in %.1f s", time.monotonic() - t0)
        return self.status()

    def _ctld_recovery_flags(self) -> list[str]:
        """`-i` when the last slurmctld died before its first state save (killed, crashed,
        the machine stopped): its state folder then has `clustername` but no
        `assoc_usage`, which Slurm 26.05 refuses with accounting on ("fatal: No Assoc usage
        file ... to recover"; 22.05 and 24.11 only log it). `-i` ignores the missing file
        and keeps whatever job and node state is there (issue 28)."""
        ctld = self.config.state_dir / "ctld"
        if (ctld / "clustername").exists() and not (ctld / "assoc_usage").exists():
            log.warning("%s: no assoc_usage beside clustername (a slurmctld ended before saving its "
                        "state): starting slurmctld with -i", ctld)
            return ["-i"]
        return []

    def wait_idle(self, wait_s: float) -> None:
        """Wait until every node answers and is not down/drained (idle, or busy with jobs)."""
        cl = self.client(timeout_s=10)
        deadline = time.monotonic() + wait_s
        last = "no answer"
        while time.monotonic() < deadline:
            dead = [d for d in self.daemons() if not d.running]
            if dead:
                name = dead[0].name
                tail = log_tail(self.config.log_dir / f"{name}.log") or log_tail(self.config.log_dir / f"{name}.out")
                raise ClusterError(f"{name} stopped while starting (see {self.config.log_dir}): {tail}")
            try:
                nodes = cl.show_nodes()
            except SlurmError as exc:
                last = str(exc)
            else:
                if len(nodes) == self.config.nodes and all(n.usable for n in nodes):
                    return
                last = ", ".join(f"{n.name}={n.state}{'+' + '+'.join(n.flags) if n.flags else ''}"
                                 for n in nodes)
            time.sleep(0.5)
        raise ClusterError(f"nodes not idle after {wait_s:g} s ({last}); logs in {self.config.log_dir}")

    def down(self, timeout_s: float = 20.0) -> list[str]:
        """Cancel all jobs, stop our daemons (pid files + marker check), sweep strays."""
        with instance_lock(self.config.state_dir):
            return self._down(timeout_s)

    def _down(self, timeout_s: float) -> list[str]:
        c = self.config
        daemons = self.daemons()
        stopped: list[str] = []
        by_name = {d.name: d for d in daemons}
        if by_name.get("slurmctld") and by_name["slurmctld"].running:
            self._cancel_all_jobs()
        # Reverse start order: slurmd first, munged last (the others need it to talk).
        order = [d for d in daemons if d.name.startswith("slurmd-")] + \
            [by_name[n] for n in ("slurmctld", "slurmdbd", "mariadbd", "munged") if n in by_name]
        for d in order:
            if d.running and d.pid is not None:
                terminate(d.pid, c.state_dir, timeout_s)
                stopped.append(d.name)
            with contextlib.suppress(FileNotFoundError):
                d.pid_file.unlink()
        # slurmstepd of jobs that outlived the cancel inherit the marker from slurmd;
        # their tasks are recognised by SLURM_CONF + SLURM_JOB_ID (see processes.is_ours).
        stopped += stop_fake_mps_daemons(c.state_dir)
        strays = list(ours_by_environ(c.state_dir))
        for pid in strays:
            terminate(pid, c.state_dir, 5.0)
        if strays:
            stopped.append(f"{len(strays)} stray process(es)")
        # Slurm's slurm_<node> folders below ours, whatever $SLURM_DLRM_CLUSTER_CGROUP says
        # now (a bad value must not keep `down` from stopping the cluster; one changed to
        # "off" since `up` must not leave its folders behind)
        memory_cgroup.remove_tree(memory_cgroup.cluster_cgroup(memory_cgroup.CGROUP_ROOT / "memory", c.state_dir))
        return stopped

    def _slurmd_argv(self, name: str) -> list[str]:
        """slurmd, inside this cluster's own memory cgroup where Slurm constrains memory
        (memory_cgroup.py: every local cluster on a host has a node1 and a job 1)."""
        argv = ["slurmd", "-f", str(self.config.slurm_conf), "-N", name]
        mc = self.memory_cgroup
        if mc is None or not mc.usable or mc.mount is None:
            return argv
        cgroup = memory_cgroup.cluster_cgroup(mc.mount, self.config.state_dir)
        cgroup.mkdir(exist_ok=True)
        return memory_cgroup.wrap_argv(argv, cgroup, mc.mount)

    def _cancel_all_jobs(self) -> None:
        cl = self.client(timeout_s=10)
        try:
            jobs = [j for j in cl.squeue() if not j.state.is_terminal]
            if not jobs:
                return
            cl.scancel([j.job_id for j in jobs])
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                if all(j.state.is_terminal for j in cl.squeue()):
                    return
                time.sleep(0.5)
        except SlurmError as exc:
            log.warning("could not cancel jobs before stopping: %s", exc)

