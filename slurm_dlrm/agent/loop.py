"""The agent loop: launch this node's members, sample them, enforce budgets, report.

One agent per node of a pack allocation. It is single-threaded: it sleeps in `select`
on a signal wake-up pipe, so SIGTERM and child exits are handled at once and sampling
happens every `sample_interval_s` otherwise.

`Agent` holds the members' state and decides what happens each turn: start (MPS and
the fences), launch a job or its gang of ranks, take joins, report ends, shut down.
How one thing is done lives beside it: launch.py (a member's environment, argv and
process), stopping.py (signals, cancels, time limits, the kill after the grace),
sampling.py (sample rows and budgets), reaping.py (exit classification and the reason
text), joins.py (refill's join files and the closed marker), node_gpus.py (the node's
GPUs as NVML and Slurm name them), member.py (the per-member state); the seams are
nvml.py, mps.py, procstat.py and reports.py, the fences' pure parts fences.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_dlrm.agent import fences
from slurm_dlrm.agent.joins import close_node, read_joins
from slurm_dlrm.agent.launch import free_port, start_process
from slurm_dlrm.agent.member import Member
from slurm_dlrm.agent.mps import MpsError, MpsSetup, open_mps
from slurm_dlrm.agent.node_gpus import gpu_facts, nvml_indices, nvml_position, write_node_gpus
from slurm_dlrm.agent.nvml import Nvml
from slurm_dlrm.agent.placement import CLOSED_DIR, JOINS_DIR, MemberPlacement, Placement
from slurm_dlrm.agent.procstat import MetricsTail
from slurm_dlrm.agent.reaping import job_outcome, killed_from_outside, reap_ended, signal_name
from slurm_dlrm.agent.reports import ReportWriter
from slurm_dlrm.agent.sampling import budget_breach, sample_gpus, sample_member
from slurm_dlrm.agent.stopping import (
    FORWARD_DELAY_S,
    begin_termination,
    cancel_members,
    cancel_requested,
    check_time_limits,
    forward,
    install_signal_handlers,
    kill_after_grace,
    restore_signal_handlers,
    signal_member,
    stop_member,
)
from slurm_dlrm.errors import BadInput

log = logging.getLogger(__name__)

MIB = 1 << 20


@dataclass
class AgentOptions:
    node_index: int
    node_name: str
    gpus: list[str]  # the allocation's GPUs on this node, as CUDA_VISIBLE_DEVICES names them
    launch: str = "process"  # "step" (srun --overlap) or "process" (child process group)
    mps_mode: str = "auto"  # auto | own | site | off
    site_mps_enabled: bool = True
    fence_mode: str = "auto"  # [mps] mode: auto | v3 | v2 (who holds a member to its memory fence)
    dmem_mode: str = "auto"  # [mps] dmem: auto | on | off (cgroup v2 dmem limits per member)
    tmp_root: str = "/tmp"
    python: str = sys.executable
    heartbeat_every_s: float = 30.0
    sample_interval_s: float | None = None  # overrides the placement's
    slurm_job_id: str | None = None
    cluster_name: str | None = None  # SLURM_CLUSTER_NAME: Slurm job ids are one cluster's numbering


class Agent:
    def __init__(self, placement: Placement, opts: AgentOptions, nvml: Nvml | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.placement = placement
        self.opts = opts
        self.nvml = nvml or Nvml()
        self.base_env = dict(os.environ if env is None else env)
        self.interval_s = opts.sample_interval_s or placement.sample_interval_s
        self.members = [Member(p) for p in placement.members_on(opts.node_index)]
        self.reports = ReportWriter(placement.pack_dir, opts.node_name, placement.pack_id)
        self.mps: MpsSetup = MpsSetup("off", None, "not started")
        # Per cluster too: two clusters on one host (the local clusters of two checkouts) number
        # their jobs alike, and an agent removes its folder when it exits (issue 49: an agent of
        # job 14 removed the other cluster's job 14's folder, whose gang then failed to launch).
        cluster = f"{opts.cluster_name}-" if opts.cluster_name else ""
        self.run_dir = Path(opts.tmp_root) / f"slurm-dlrm-agent-{cluster}{opts.slurm_job_id or os.getpid()}-{opts.node_index}"
        self._run_dir_ours = False
        self._oom_cgroup = fences.oom_cgroup(fences.cgroup_root(), opts.slurm_job_id)
        self._t0 = time.monotonic()  # about when Slurm started the pack: time limits count from here
        self._term_signal: int | None = None
        self._terminating_since: float | None = None
        self._forwarded = False
        self._last_heartbeat = 0.0
        self._nvml_indices: list[int] = []
        self.stale_after_s = max(60.0, 10 * self.interval_s)
        self.cancel_dir = Path(placement.pack_dir) / "cancel"
        self.joins_dir = Path(placement.pack_dir) / JOINS_DIR
        self.closed_path = Path(placement.pack_dir) / CLOSED_DIR / str(opts.node_index)
        self._joins_seen: set[str] = set()  # join file names already handled (launched or refused)
        self._idle_since: float | None = None  # monotonic time all members had ended
        self.fence_kind = "v2"  # v3: daemon-held namespaces; v2: the member's own environment
        self.fence_caps: fences.FenceCaps | None = None
        self.fence_error: str | None = None  # the site asked for a fence this node cannot set
        self.dmem: fences.DmemTree | None = None
        self._v3_namespaces: set[str] = set()
        self._gpu_total_bytes: dict[int, int] = {}  # position in opts.gpus -> NVML total memory
        self._gpu_uuid: dict[int, str] = {}
        self._gang_cause: dict[int, Member] = {}  # job id -> the rank whose end stopped its siblings
        self.job_states: dict[int, str] = {}  # job id -> its end state (a multi-rank job: once, as a whole)

    # ------------------------------------------------------------ main

    def run(self) -> int:
        rsock, wsock = socket.socketpair()
        rsock.setblocking(False)
        wsock.setblocking(False)
        old_handlers = install_signal_handlers(wsock, self._on_term)
        try:
            self._start()
            self._loop(rsock)
        finally:
            self._finish()
            restore_signal_handlers(old_handlers)
            rsock.close()
            wsock.close()
        return 0

    def _on_term(self, signum: int, frame: Any) -> None:
        if self._term_signal is None:
            self._term_signal = signal.SIGUSR1 if signum == signal.SIGUSR1 else signal.SIGTERM

    def _start(self) -> None:
        o = self.opts
        self.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = self.run_dir.lstat()
        # a predictable name in a shared /tmp: one someone else made first is not ours to use
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise BadInput(f"agent: {self.run_dir} exists and is not a folder of this user's; remove it")
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.chmod(self.run_dir, 0o700)
        self._run_dir_ours = True
        self.reports.agent("start", f"{len(self.members)} members on {o.node_name}, GPUs {','.join(o.gpus)}, "
                           f"launch {o.launch}, interval {self.interval_s:g}s", pid=os.getpid(),
                           members=[m.placement.job_id for m in self.members])
        self.reports.heartbeat()
        self._last_heartbeat = time.monotonic()
        write_node_gpus(self.placement.pack_dir, o.node_index, o.node_name, o.gpus, self.base_env)
        self._nvml_indices = nvml_indices(self.nvml, o.gpus)
        wanted = self.placement.mps and o.site_mps_enabled and o.mps_mode != "off"
        if not self.members:
            wanted = False  # nothing to run here: no daemon either
        if wanted:
            self._detect_fences()
        tag = f"{o.slurm_job_id or os.getpid()}-{o.node_index}"
        site_mode = o.mps_mode if o.mps_mode != "off" else "auto"
        site_daemon = site_mode in ("auto", "site") and bool(self.base_env.get("CUDA_MPS_PIPE_DIRECTORY"))
        if wanted and self.fence_kind == "v3" and not site_daemon and self.fence_error is None:
            self.mps = self._open_v3(tag)
        else:
            if wanted and self.fence_kind == "v3":
                self.fence_kind = "v2"  # a site daemon is the prolog's: its fences are the site's
            self.mps = open_mps(wanted, o.gpus, o.tmp_root, tag, env=self.base_env, site_mode=site_mode)
        if self.mps.daemon is None:
            self.reports.agent("mps_unavailable", self.mps.detail, **self._fence_report())
        else:
            self._configure_mps()
            self.reports.agent("mps_started", self.mps.detail, mode=self.mps.mode, daemon_pid=self.mps.daemon.pid(),
                               protocol=self.mps.daemon.protocol, **self._fence_report())
            if self.fence_kind == "v2" and self.dmem is None:
                # Once per pack and node: nothing but the member's own environment holds it.
                self.reports.agent("fence_env_only", "MPS v2: a member's GPU memory fence is "
                                   "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT in its own environment; a member that sets "
                                   "it higher is not held (no MPS v3 namespace, no cgroup dmem on this node)")
        self.reports.flush()
        for ms in _by_job(self.members):
            self._launch_job(ms)
        self.reports.flush()

    # ------------------------------------------------------------ fences (issue 22)

    def _detect_fences(self) -> None:
        """Which fences this node can set (reported with mps_started/mps_unavailable); strict
        site keys it cannot honour leave `fence_error` (members are then not started,
        docs/agent.md "Fences")."""
        o = self.opts
        caps = fences.detect_capabilities(env=self.base_env, driver_version=self.nvml.driver_version)
        self.fence_caps = caps
        errors = []
        try:
            self.fence_kind = fences.choose_mode(o.fence_mode, caps)
        except fences.FenceError as exc:
            self.fence_kind, errors = "v2", [str(exc)]
        try:
            if fences.use_dmem(o.dmem_mode, caps):
                if o.launch == "step":
                    self.reports.agent("dmem_not_applied", "dmem limits need --launch process: a step's cgroup "
                                       "is made by slurmstepd, not by the agent")
                else:
                    try:
                        tree = fences.DmemTree.for_self(Path(caps.cgroup_root), caps.dmem_regions)
                        tree.prepare()  # our own cgroup must be ours to divide (delegated)
                        self.dmem = tree
                    except fences.FenceError as exc:
                        if o.dmem_mode == "on":
                            raise
                        self.reports.agent("dmem_not_applied", f"{exc} (mps.dmem = auto: going on without dmem)")
        except fences.FenceError as exc:
            errors.append(str(exc))
        self.fence_error = "; ".join(errors) or None
        if self.fence_kind == "v3" or self.dmem is not None:
            self._gpu_total_bytes, self._gpu_uuid = gpu_facts(self.nvml, self._nvml_indices)

    def _fence_report(self) -> dict[str, Any]:
        """What the mps_started / mps_unavailable record says of the fences (docs/agent.md)."""
        if self.fence_caps is None:
            return {}
        return {"fence": self.fence_kind, "dmem": self.dmem is not None, "fence_caps": self.fence_caps.to_dict(),
                **({"fence_error": self.fence_error} if self.fence_error else {})}

    def _namespace(self, p: MemberPlacement) -> fences.NamespaceLimits:
        sm = p.sm_chunks if (self.fence_caps and (self.fence_caps.driver_major or 0) >= fences.V3_NAMESPACE_SM_DRIVER) \
            else None
        return fences.NamespaceLimits(fences.namespace_name(p.key), p.gpu_mem_limit_mib, p.mps_thread_pct,
                                      self._gpu_uuid.get(p.gpu_index), sm)

    def _refuse(self, m: Member, reason: str) -> None:
        """A member that is not started: one line naming why; its neighbours run."""
        m.state, m.exit_code, m.reason = "FAILED", None, reason
        log.error("%s (job %d) not started: %s", m.placement.name, m.placement.job_id, reason)
        self._ended(m)

    def _open_v3(self, tag: str) -> MpsSetup:
        """Our daemon with MPS v3, one namespace per member from the configuration file. A
        namespace the daemon refuses is that member's: it is not started, the rest go on."""
        o = self.opts
        candidates = [m for m in self.members if not m.done and self._limit_error(m.placement) is None]
        for _ in range(len(self.members) + 1):
            config = fences.v3_config_toml(os.getuid(), [self._namespace(m.placement) for m in candidates])
            setup = open_mps(True, o.gpus, o.tmp_root, tag, env=self.base_env, site_mode="own", v3_config=config)
            if setup.daemon is not None:
                self._v3_namespaces = {fences.namespace_name(m.placement.key) for m in candidates}
                return setup
            ns = fences.refused_namespace(setup.detail)
            bad = [m for m in candidates if fences.namespace_name(m.placement.key) == ns]
            if not bad:
                break
            self._refuse(bad[0], f"MPS v3 refused its namespace: {setup.detail.rpartition(': ')[2] or setup.detail}")
            candidates.remove(bad[0])
        if o.fence_mode == "v3":
            self.fence_error = f"mps.mode = v3 but the daemon did not start: {setup.detail}"
            return setup
        self.reports.agent("fence_fallback", f"MPS v3 daemon did not start ({setup.detail}); using MPS v2")
        self.fence_kind = "v2"
        return open_mps(True, o.gpus, o.tmp_root, tag, env=self.base_env, site_mode="own")

    def _limit_error(self, p: MemberPlacement) -> str | None:
        """A fence larger than its GPU cannot be enforced: refuse it (v3 or dmem only)."""
        total = self._gpu_total_bytes.get(p.gpu_index)
        if total is not None and p.gpu_mem_limit_mib * MIB > total:
            return (f"gpu_mem_limit_mib {p.gpu_mem_limit_mib} is above GPU {p.gpu_index}'s memory "
                    f"({total // MIB} MiB)")
        return None

    def _fence_member(self, m: Member) -> str | None:
        """Set what holds this member to its fence before it starts; an error line or None."""
        p = m.placement
        if self.fence_error is not None:
            return self.fence_error
        enforced = (self.fence_kind == "v3" and self.mps.daemon is not None) or self.dmem is not None
        if enforced and (err := self._limit_error(p)) is not None:
            return err
        daemon = self.mps.daemon
        if self.fence_kind == "v3" and daemon is not None and daemon.protocol == 3:
            ns = self._namespace(p)
            if ns.name not in self._v3_namespaces:  # a joiner: the daemon runs already
                try:
                    daemon.v3(*fences.namespace_create_argv(ns))
                except MpsError as exc:
                    return f"MPS v3 refused namespace {ns.name}: {exc}"
                self._v3_namespaces.add(ns.name)
            m.fence.update(kind="v3", server=fences.V3_SERVER, namespace=ns.name,
                           pinned_memory_limit_mib=p.gpu_mem_limit_mib, active_thread_percentage=p.mps_thread_pct,
                           **({"sm_chunks": ns.sm_chunks} if ns.sm_chunks else {}))
        elif daemon is not None:
            m.fence.update(kind="v2-env")
        if self.dmem is not None:
            try:
                region = fences.region_for_gpu(self.dmem.regions,
                                              nvml_position(p.gpu_index, self._nvml_indices, self.opts.gpus))
                soft = (p.gpu_mem_estimate_mib or p.gpu_mem_limit_mib) * MIB
                f = self.dmem.fence(p.key, region, soft, p.gpu_mem_limit_mib * MIB)
            except fences.FenceError as exc:
                return str(exc)
            m.cgroup = f.path
            m.fence.update(dmem_cgroup=str(f.path), dmem_region=region, dmem_min_bytes=f.min_bytes,
                           dmem_max_bytes=f.max_bytes)
        return None

    def _configure_mps(self) -> None:
        daemon = self.mps.daemon
        if daemon is None or self.mps.mode != "own" or daemon.protocol == 3:
            return  # a site daemon is configured by its owner (the prolog); v3: the namespaces hold the limits
        try:
            # Daemon-wide defaults as a backstop; each member's own variables are tighter.
            for dev in range(len(self.opts.gpus)):
                limits = [m.placement.gpu_mem_limit_mib for m in self.members if m.placement.gpu_index == dev]
                if limits:
                    daemon.set_default_device_pinned_mem_limit(dev, max(limits))
            if self.members:
                daemon.set_default_active_thread_percentage(max(m.placement.mps_thread_pct for m in self.members))
        except Exception as exc:  # noqa: BLE001 - a refused default must not stop the pack
            log.warning("MPS defaults: %s", exc)

    def _launch_job(self, ms: list[Member], joined: bool = False) -> None:
        """Start one job: a single member, or all W ranks of a multi-rank job (gang: a rank
        that cannot start, its fence refused or its cancel asked, keeps all from starting)."""
        p = ms[0].placement
        if p.job_id in cancel_requested(self.cancel_dir):
            for m in ms:
                if not m.done:
                    m.state, m.reason = "CANCELLED", "cancelled by the service before it started"
                    self._ended(m)
            return
        refused = next((m for m in ms if m.done), None)  # e.g. its MPS v3 namespace was refused
        for m in ms:
            if refused is not None:
                break
            n_gpus = len(self.opts.gpus)
            why = (f"could not launch: gpu_index {m.placement.gpu_index} but the node has {n_gpus} GPUs"
                   if m.placement.gpu_index >= n_gpus else self._fence_member(m))
            if why is not None:
                self._refuse(m, why)
                refused = m
        if refused is not None:
            for m in ms:
                if not m.done:
                    self._refuse(m, f"not started: rank {refused.placement.rank} of the job could not start "
                                    f"({refused.reason})")
            return
        if p.world_size > 1:
            try:
                port = free_port({m.master_port for m in self.members if m.master_port and not m.done})
                # fresh per launch (a FileStore left by a killed attempt would mislead the next)
                rdzv = Path(tempfile.mkdtemp(prefix=f"rdzv-{p.job_id}-", dir=self.run_dir)) / "store"
            except OSError as exc:
                for m in ms:
                    self._refuse(m, f"could not launch: {exc}")
                return
            for m in ms:
                m.master_port = port
                m.rdzv_file = str(rdzv)
        for m in ms:
            if any(r.done for r in ms):  # a rank failed to launch: the rest are not started
                if not m.done:
                    self._refuse(m, "not started: another rank of the job could not launch")
                continue
            self._launch(m, joined)

    def _launch(self, m: Member, joined: bool = False) -> None:
        """Start one member (or rank) whose cancel and fence `_launch_job` checked."""
        p = m.placement
        o = self.opts
        try:
            argv = start_process(m, base_env=self.base_env, gpus=o.gpus, mps=self.mps, launch=o.launch,
                                 node_name=o.node_name, run_dir=self.run_dir, python=o.python)
        except (OSError, ValueError) as exc:
            m.state, m.exit_code, m.reason = "FAILED", None, f"could not launch: {exc}"
            self._ended(m)
            return
        if self.opts.launch != "step":
            m.pid = m.popen.pid  # type: ignore[union-attr]
        m.launched_at = time.monotonic()
        if p.time_limit_s is not None:
            # a joiner's limit counts from its own start; the first members' from the pack's
            m.deadline = (m.launched_at if joined else self._t0) + p.time_limit_s - p.stop_lead_s
        m.oom_kills_at_launch = fences.oom_kill_count(self._oom_cgroup)
        # Rank 0 alone writes the job's metrics file: one rank's rows carry samples/s, not W.
        m.metrics = MetricsTail(p.metrics_path) if p.rank == 0 else None
        m.state = "RUNNING"
        ranks = {"rank": p.rank, "world_size": p.world_size, "master_port": m.master_port} if p.world_size > 1 else {}
        self.reports.member(p.job_id, "RUNNING", None, "", launch=self.opts.launch, argv=argv,
                            gpu=m.env.get("CUDA_VISIBLE_DEVICES"), mps=self.mps.mode, **ranks,
                            **({"joined": True} if joined else {}), **({"fence": m.fence} if m.fence else {}))
        log.info("launched %s (job %d%s) as %s", p.name, p.job_id,
                 f" rank {p.rank}/{p.world_size}" if p.world_size > 1 else "", self.opts.launch)

    def _loop(self, rsock: socket.socket) -> None:
        next_tick = time.monotonic() + self.interval_s
        while not self._may_exit():
            timeout = max(0.0, next_tick - time.monotonic())
            if self._terminating_since is not None:
                timeout = min(timeout, 0.2)
            with contextlib.suppress(InterruptedError):
                ready, _, _ = select.select([rsock], [], [], timeout)
                if ready:
                    with contextlib.suppress(OSError):
                        rsock.recv(4096)
            if self._term_signal is not None and self._terminating_since is None:
                self._begin_termination()
            self._reap()
            self._forward()
            kill_after_grace(self.members, self.placement.term_grace_s, self._terminating_since)
            check_time_limits(self.members)
            now = time.monotonic()
            if now >= next_tick:
                self._tick()
                next_tick = now + self.interval_s
            self.reports.flush()

    def _may_exit(self) -> bool:
        """All members ended and no join came for join_grace_s (at once after a signal)."""
        if not all(m.done for m in self.members):
            self._idle_since = None
            return False
        if self._terminating_since is not None or self.placement.join_grace_s <= 0:
            return True
        now = time.monotonic()
        if self._idle_since is None:
            self._idle_since = now
            self._check_joins()  # one may be waiting already
            if not all(m.done for m in self.members):
                self._idle_since = None
                return False
        return now - self._idle_since >= self.placement.join_grace_s

    def _check_joins(self) -> None:
        """Launch this node's new joiners from <pack_dir>/joins/ (docs/interfaces.md 3b)."""
        if self._terminating_since is not None:
            return  # the allocation is ending: a joiner would only be stopped again
        known = {m.placement.job_id for m in self.members}
        for entries in read_joins(self.joins_dir, self._joins_seen, self.opts.node_index, known, self.reports):
            entry = entries[0]
            ms = [Member(e) for e in entries]
            self.members.extend(ms)
            log.info("join: %s (job %d) on GPU %s", entry.name, entry.job_id, ",".join(str(e.gpu_index) for e in entries))
            self._launch_job(ms, joined=True)

    # ------------------------------------------------------------ member life cycle

    def _begin_termination(self) -> None:
        assert self._term_signal is not None
        self._terminating_since = time.monotonic()
        begin_termination(self.members, self._term_signal, self.placement.term_grace_s)

    def _forward(self) -> None:
        if self._forwarded or self._terminating_since is None or self._term_signal is None:
            return
        if time.monotonic() - self._terminating_since < min(FORWARD_DELAY_S, self.placement.term_grace_s / 2):
            return
        self._forwarded = True
        forward(self.members, self._term_signal)

    def _reap(self) -> None:
        for m in reap_ended(self.members, self.opts.launch, self._oom_cgroup):
            self._ended(m)

    # ------------------------------------------------------------ multi-rank jobs (issue 18)

    def _ranks(self, job_id: int) -> list[Member]:
        return [m for m in self.members if m.placement.job_id == job_id]

    def _ended(self, m: Member) -> None:
        """Report a member that ended. A rank of a multi-rank job gets a `rank` record; the
        first rank that ends badly (not COMPLETED or PREEMPTED, and not stopped by a cancel
        or by the agent's own signal) stops its running siblings, SIGTERM then SIGKILL after
        term_grace_s; once all ranks have ended, the job gets its one `member` record."""
        p = m.placement
        if p.world_size == 1:
            self.job_states[p.job_id] = m.state
            self.reports.member(p.job_id, m.state, m.exit_code, m.reason,
                                **({"requeue": True} if killed_from_outside(m) else {}))
            return
        self.reports.rank(p.job_id, p.rank, p.world_size, m.state, m.exit_code, m.reason, gpu_index=p.gpu_index)
        ranks = self._ranks(p.job_id)
        # KILLED outside a termination: a step that never started its rank (PID_FILE_TIMEOUT_S)
        stopping = m.stop_reason in ("CANCEL", "TERM", "GANG", "TIMEOUT") or (
            m.stop_reason == "KILLED" and self._terminating_since is not None)
        bad = m.state not in ("COMPLETED", "PREEMPTED") and not stopping
        if bad and p.job_id not in self._gang_cause:
            self._gang_cause[p.job_id] = m
            now = time.monotonic()
            for r in ranks:
                if not r.done and r.popen is not None and r.cancel_since is None and r.stop_reason is None:
                    log.warning("job %d: rank %d ended %s; stopping rank %d", p.job_id, p.rank, m.state,
                                r.placement.rank)
                    r.stop_reason, r.cancel_since = "GANG", now
                    signal_member(r, signal.SIGTERM)
        # Ranks that end in the same turn are all done by the first one's call: report once.
        if all(r.done for r in ranks) and p.job_id not in self.job_states:
            self._job_ended(p.job_id, ranks)

    def _job_ended(self, job_id: int, ranks: list[Member]) -> None:
        """The one `member` record of a multi-rank job (docs/agent.md "Multi-rank jobs")."""
        world = ranks[0].placement.world_size
        rep, reason, requeue = job_outcome(ranks, self._gang_cause.get(job_id))
        self.job_states[job_id] = rep.state
        self.reports.member(job_id, rep.state, rep.exit_code, reason, rank=rep.placement.rank, world_size=world,
                            ranks=[{"rank": r.placement.rank, "gpu_index": r.placement.gpu_index, "state": r.state,
                                    "exit_code": r.exit_code} for r in sorted(ranks, key=lambda r: r.placement.rank)],
                            **({"requeue": True} if requeue else {}))
        log.info("job %d (%d ranks) ended: %s %s", job_id, world, rep.state, reason)

    # ------------------------------------------------------------ sampling and enforcement

    def _tick(self) -> None:
        cancel_members(self.members, cancel_requested(self.cancel_dir))
        self._check_joins()
        snap, gpu_by_nvml = sample_gpus(self.nvml, self._nvml_indices, self.reports)
        for m in self.members:
            if m.done:
                continue
            measured = sample_member(m, snap, gpu_by_nvml, self._nvml_indices, self.stale_after_s, self.reports)
            if measured is None:
                continue
            breach = budget_breach(m.placement, *measured, self.placement.host_mem_tolerance_pct,
                                   mps_fenced=self.mps.daemon is not None)
            if breach is not None:
                stop_member(m, *breach)
        now = time.monotonic()
        if now - self._last_heartbeat >= self.opts.heartbeat_every_s:
            self.reports.heartbeat()
            self._last_heartbeat = now

    # ------------------------------------------------------------ shutdown

    def _finish(self) -> None:
        # Anything still running here means the loop died: stop members rather than orphan them.
        for m in self.members:
            if not m.done and m.popen is not None:
                m.stop_reason = m.stop_reason or "KILLED"
                signal_member(m, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    m.popen.wait(timeout=10)
        self._reap()
        close_node(self.closed_path, self.opts.node_index, self.reports)
        if self.dmem is not None:
            for m in self.members:
                self.dmem.remove(m.placement.key)
        if self.mps.daemon is not None and self.mps.mode == "own":
            pid = self.mps.daemon.pid()
            self.mps.daemon.quit()
            self.reports.agent("mps_stopped", f"sent quit to daemon {pid}; removed {self.mps.daemon.root_dir}",
                               daemon_pid=pid)
        self.nvml.shutdown()
        if self._run_dir_ours:  # never empty a folder someone else made (see _start)
            shutil.rmtree(self.run_dir, ignore_errors=True)
        states: dict[str, int] = {}
        for m in self.members:
            states[m.state] = states.get(m.state, 0) + 1
        signame = signal_name(self._term_signal) if self._term_signal else ""
        self.reports.agent("exit", f"members: {states}" + (f"; after {signame}" if signame else ""), states=states)
        self.reports.close()


def _by_job(members: list[Member]) -> list[list[Member]]:
    """Members grouped by job, in placement order (a multi-rank job's ranks together)."""
    jobs: dict[int, list[Member]] = {}
    for m in members:
        jobs.setdefault(m.placement.job_id, []).append(m)
    return list(jobs.values())
