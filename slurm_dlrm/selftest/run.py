"""`slurm-dlrm selftest` inside an allocation: the acceptance test of one GPU node.

Order matters: NVML first (what is this GPU), then MPS (our own daemon, started and
quit through `slurm_dlrm.agent.mps`, clients given the environment of
`slurm_dlrm.agent.launch.member_env`, sampled through `slurm_dlrm.agent.nvml`: the agent's
code paths), then, with the daemon gone, the estimator and the calibration, each in a
child process with its own CUDA context. This process never imports torch: a CUDA
context here would be a non-MPS client holding an EXCLUSIVE_PROCESS GPU.

Every hardware figure needs the driver's NVML and a CUDA device. Against the fake NVML
($SLURM_DLRM_FAKE_NVML, or `--fake`, which also puts the fake `nvidia-cuda-mps-control`
first on PATH) the steps that can run do run, and are reported DRY, not PASS.

Over 600 lines on purpose: the four steps share one state (the daemon, the child
processes, the NVML handle, what was measured) and one cleanup path that must run on
every exit; split, that state would travel through every call.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_dlrm.agent.launch import member_env
from slurm_dlrm.agent.mps import MPS_CONTROL, MpsSetup, open_mps
from slurm_dlrm.agent.nvml import Nvml
from slurm_dlrm.agent.placement import MemberPlacement, allocation_gpus
from slurm_dlrm.emulated import mps_control as fake_mps_control
from slurm_dlrm.emulated import nvml as fake_nvml
from slurm_dlrm.errors import BadInput, DlrmError
from slurm_dlrm.osutil import pid_alive
from slurm_dlrm.selftest import verdict as V
from slurm_dlrm.selftest.verdict import DRY, FAIL, PASS, SKIP, Check
from slurm_dlrm.site import GpuModel, SiteConfig, load_site

log = logging.getLogger(__name__)
MIB = 1 << 20

# The two MPS clients: different thread shares and different pinned memory limits.
LOW_PCT, HIGH_PCT = 25, 50
# 2 GiB: large beside what an MPS client's own context may count against its limit.
GREEDY_LIMIT_MIB, STEADY_LIMIT_MIB = 2048, 4096
BENCH_SECONDS = 3.0
CLIENT_TIMEOUT_S = 120.0
PROBE_TIMEOUT_S = 240.0

# Small specs for the estimator on CUDA: dot and DCN, fused Adam, row-wise Adagrad, bf16.
_TABLES = [{"rows": 200_000, "dim": 64}, {"rows": 50_000, "dim": 64}, {"rows": 10_000, "dim": 64}]
ESTIMATOR_SPECS: tuple[dict[str, Any], ...] = (
    {"name": "st-dot-adam", "optimizer": {"type": "adam", "fused": True}},
    {"name": "st-dcn-rowwise", "optimizer": {"type": "rowwise_adagrad"},
     "interaction": {"type": "dcn", "layers": 2, "low_rank": 32}},
    {"name": "st-dot-bf16", "optimizer": {"type": "rowwise_adagrad"}, "mixed_precision": "bf16"},
    {"name": "st-dcn-adam-bf16", "optimizer": {"type": "adam", "fused": True}, "mixed_precision": "bf16",
     "interaction": {"type": "dcn", "layers": 3, "low_rank": 64}},
    {"name": "st-dot-sgd-big-batch", "optimizer": {"type": "sgd"}, "batch_size": 8192},
)


def estimator_spec(overrides: dict[str, Any], steps: int) -> dict[str, Any]:
    base = {"tables": _TABLES, "dense_features": 13, "bottom_mlp": [256, 64], "top_mlp": [256, 1],
            "batch_size": 2048, "steps": steps, "checkpoint_every_steps": 0, "metrics_every_steps": 1}
    return {**base, **overrides}


@dataclass
class Options:
    gpu: int = 0  # position in the allocation's GPU list
    site_path: str | None = None
    write_site: str | None = None
    fake: bool = False  # set up the fake NVML and MPS daemon ourselves
    model: str | None = None  # the site's GPU model name; default: the node's, else by memory
    steps: int = 5
    tmp_root: str | None = None


@dataclass
class Context:
    """What the run found out about where it runs (printed with the verdict)."""

    host: str
    node: str = ""  # $SLURMD_NODENAME inside an allocation, else the host name
    gpu_name: str = ""
    nvml_index: int | None = None
    nvml: str = ""  # "driver" | "fake" | "unavailable: ..."
    mps_control: str = ""  # path, "(fake)" noted
    model: str | None = None
    hardware: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def is_fake_mps_control(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return any(m.encode() in head for m in fake_mps_control.LAUNCHER_MODULES)


def other_users_mps_daemons(uid: int) -> list[tuple[int, str]]:
    """(pid, user) of MPS control daemons and servers that another user runs on this node."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{entry}")
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if st.st_uid == uid or not argv or not argv[0]:
            continue
        exe = os.path.basename(argv[0].decode(errors="replace"))
        fake = (any(m.encode() in argv for m in fake_mps_control.LAUNCHER_MODULES)
                and (b"-d" in argv or b"-f" in argv))
        if exe in ("nvidia-cuda-mps-control", "nvidia-cuda-mps-server") or fake:
            try:
                user = pwd.getpwuid(st.st_uid).pw_name
            except KeyError:
                user = str(st.st_uid)
            found.append((int(entry), user))
    return found


def fake_scenario(site: SiteConfig, model: GpuModel, gpus: int) -> dict[str, Any]:
    gpu = {"name": f"NVIDIA {model.name.upper()} (fake)", "memory_total_bytes": int(model.memory_gib * (1 << 30)),
           "reserved_bytes": 512 * MIB, "compute_mode": fake_nvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS}
    return {"gpus": [dict(gpu) for _ in range(gpus)], "discover_members": True}


# ---------------------------------------------------------------- child processes


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    status: Path

    def events(self) -> list[dict[str, Any]]:
        try:
            lines = self.status.read_text().splitlines()
        except OSError:
            return []
        out = []
        for line in lines:
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out

    def last(self, *kinds: str) -> dict[str, Any] | None:
        for ev in reversed(self.events()):
            if ev.get("event") in kinds:
                return ev
        return None

    def wait_for(self, kinds: tuple[str, ...], timeout_s: float) -> dict[str, Any] | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ev = self.last(*kinds, "error")
            if ev is not None:
                return ev
            if self.proc.poll() is not None:
                return self.last(*kinds, "error")
            time.sleep(0.05)
        return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


def probe_argv(role: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "slurm_dlrm.selftest.probe", role, *args]


def start_child(name: str, argv: list[str], env: dict[str, str], work: Path) -> Child:
    status = work / f"{name}.jsonl"
    log_file = open(work / f"{name}.log", "wb")  # noqa: SIM115 - handed to the child
    with log_file:
        proc = subprocess.Popen([*argv, "--status", str(status)], env=env, stdin=subprocess.DEVNULL,  # noqa: S603
                                stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    return Child(name, proc, status)


def _child_error(child: Child) -> str:
    ev = child.last("error")
    if ev is not None:
        return str(ev.get("error"))
    try:
        tail = (child.status.parent / f"{child.name}.log").read_text().strip().splitlines()[-1:]
    except OSError:
        tail = []
    return tail[0][:300] if tail else f"exit {child.proc.poll()}"


# ---------------------------------------------------------------- the run


class Selftest:
    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.checks: list[Check] = []
        host = socket.gethostname()
        self.ctx = Context(host=host, node=os.environ.get("SLURMD_NODENAME") or host.split(".")[0])
        self.children: list[Child] = []
        self.mps: MpsSetup | None = None
        self.env = dict(os.environ)
        self.work = Path(tempfile.mkdtemp(prefix="selftest-", dir=opts.tmp_root))
        self.nvml = Nvml()
        self.model: GpuModel | None = None
        self.sm_count: int | None = None
        self.measured: dict[str, float | str] = {}
        self.measured_with = ""

    def add(self, name: str, status: str, figure: str, detail: str = "", fix: str = "", **values: Any) -> Check:
        check = Check(name, status, figure, detail, fix, values)
        self.checks.append(check)
        return check

    # -------------------------------------------------- set-up and bad input (before anything starts)

    def prepare(self) -> SiteConfig:
        o = self.opts
        site = load_site(o.site_path)
        if o.write_site:
            from slurm_dlrm.selftest.sitefile import check_writable

            check_writable(o.write_site)
        if o.model is not None:
            site.gpu_model(o.model)  # an unknown name is bad input
        gpus = allocation_gpus(self.env)
        if o.fake:
            model = site.gpu_model(o.model) if o.model else self._node_model(site) or next(iter(site.gpu_models.values()))
            count = max(len(gpus or []), 1, *[int(g) + 1 for g in gpus or [] if g.isdigit()])
            if not self.env.get(fake_nvml.ENV_FAKE_NVML):
                scenario = self.work / "fake-nvml.json"
                scenario.write_text(json.dumps(fake_scenario(site, model, count)))
                self.env[fake_nvml.ENV_FAKE_NVML] = str(scenario)
            if not is_fake_mps_control(shutil.which(MPS_CONTROL, path=self.env.get("PATH")) or ""):
                fake_mps_control.install_launcher(self.work / "bin")
                self.env["PATH"] = f"{self.work / 'bin'}:{self.env.get('PATH', '')}"
        # The NVML seam reads the fake's location from os.environ; run() puts it back.
        if self.env.get(fake_nvml.ENV_FAKE_NVML):
            os.environ[fake_nvml.ENV_FAKE_NVML] = self.env[fake_nvml.ENV_FAKE_NVML]
        self.nvml = Nvml()
        nvml_ok = self.nvml.init()
        self.ctx.nvml = ("fake" if self.nvml.is_fake else "driver") if nvml_ok else f"unavailable: {self.nvml.reason}"
        if gpus is None:
            gpus = [str(i) for i in range(self.nvml.device_count())] if nvml_ok else ["0"]
        if not 0 <= o.gpu < len(gpus):
            raise BadInput(f"--gpu {o.gpu}: no such GPU here (this allocation has {len(gpus)}: {','.join(gpus) or 'none'})")
        self.gpus = gpus
        self.ctx.gpu_name = gpus[o.gpu]
        if nvml_ok:
            self.ctx.nvml_index = self._nvml_index(gpus[o.gpu])
            if self.ctx.nvml_index is None or self.ctx.nvml_index >= self.nvml.device_count():
                raise BadInput(f"--gpu {o.gpu}: GPU {gpus[o.gpu]} is not known to NVML "
                               f"({self.nvml.device_count()} devices)")
        others = other_users_mps_daemons(os.getuid())
        if others:
            pid, user = others[0]
            raise DlrmError(f"MPS: a control daemon or server of user {user} (pid {pid}) runs on this node: MPS "
                            "time-slices clients of different users, so nothing measured now would be true; "
                            "run when the node is free (sbatch --exclusive)")
        self.ctx.hardware = self.nvml.available and not self.nvml.is_fake
        return site

    def _node_model(self, site: SiteConfig) -> GpuModel | None:
        node = self.env.get("SLURMD_NODENAME") or self.ctx.host.split(".")[0]
        for group in site.nodes:
            with contextlib.suppress(ValueError):
                if node in group.hostnames:
                    return site.gpu_model(group.gpu_model)
        return None

    def _nvml_index(self, name: str) -> int | None:
        if name.isdigit():
            return int(name)
        for i in range(self.nvml.device_count()):
            with contextlib.suppress(Exception):
                uuid = self.nvml.device_info(i).uuid
                if uuid and uuid.startswith(name):
                    return i
        return None

    # -------------------------------------------------- 1. NVML

    def check_nvml(self, site: SiteConfig) -> None:
        hw = DRY if self.nvml.is_fake else PASS
        fake_note = "against the fake NVML: no GPU was looked at" if self.nvml.is_fake else ""
        if not self.nvml.available:
            self.add("nvml.driver", FAIL, f"NVML: {self.nvml.reason}",
                     fix="run on a GPU node with the NVIDIA driver loaded (nvidia-smi must work); on a machine "
                         "without a GPU use --fake")
            for name in ("nvml.gpu_model", "nvml.gpu_idle", "nvml.compute_mode"):
                self.add(name, SKIP, "not measured", "NVML is unavailable")
            self.model = self._pick_model(site, None)
            return
        cuda = self.nvml.cuda_driver_version()
        cuda_txt = f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda else "unknown"
        self.add("nvml.driver", hw, f"driver {self.nvml.driver_version}, CUDA {cuda_txt}", fake_note,
                 driver_version=self.nvml.driver_version, cuda_driver_version=cuda)
        self.measured_with = f"driver {self.nvml.driver_version}, CUDA {cuda_txt}"
        assert self.ctx.nvml_index is not None
        info = self.nvml.device_info(self.ctx.nvml_index)
        self.model = self._pick_model(site, info.memory_total_bytes)
        self.ctx.model = self.model.name if self.model else None
        if self.model is None:
            self.add("nvml.gpu_model", FAIL, f"{info.name}, {(info.memory_total_bytes or 0) / (1 << 30):.1f} GiB",
                     fix="no [gpu_models] entry of the site matches this GPU's memory: add one, or name it with "
                         "--model, and set the node's gpu_model")
        else:
            mem_gib = (info.memory_total_bytes or 0) / (1 << 30)
            ok = info.memory_total_bytes is not None and V.memory_matches(self.model.memory_gib, info.memory_total_bytes)
            figure = f"{info.name}: {mem_gib:.1f} GiB (site {self.model.name}: {self.model.memory_gib:g} GiB)"
            detail = fake_note or "SM count is compared once CUDA runs (calibration)"
            if ok:
                self.add("nvml.gpu_model", hw, figure, detail, memory_total_bytes=info.memory_total_bytes)
            else:
                self.add("nvml.gpu_model", FAIL, figure,
                         fix=f"set [gpu_models.{self.model.name}] memory_gib to {mem_gib:.0f}, or point this node "
                             "at the model it has (its [[nodes]] gpu_model)")
        snap = self.nvml.sample([self.ctx.nvml_index])
        busy = [p for p in snap.processes if p.pid != os.getpid()]
        used = snap.gpus[0].memory_used_bytes if snap.gpus else None
        figure = (f"{len(busy)} compute process(es) on the GPU, "
                  f"{'?' if used is None else f'{used / MIB:.0f} MiB'} in use")
        if busy:
            self.add("nvml.gpu_idle", FAIL, figure + ": pids " + ",".join(str(p.pid) for p in busy[:5]),
                     fix="run on an idle GPU (sbatch/srun --exclusive): other processes skew every figure below")
        else:
            self.add("nvml.gpu_idle", hw, figure, fake_note)
        mode = info.compute_mode
        names = {0: "DEFAULT", 1: "EXCLUSIVE_THREAD", 2: "PROHIBITED", 3: "EXCLUSIVE_PROCESS"}
        figure = f"compute mode {names.get(mode, mode) if mode is not None else 'unknown'}"
        if mode == V.EXCLUSIVE_PROCESS:
            self.add("nvml.compute_mode", hw, figure, fake_note)
        elif mode is None:
            self.add("nvml.compute_mode", SKIP, figure, "NVML does not report the compute mode on this GPU")
        else:
            self.add("nvml.compute_mode", FAIL, figure,
                     fix=f"nvidia-smi -i {self.ctx.nvml_index} -c EXCLUSIVE_PROCESS (as root; at boot): in DEFAULT "
                         "mode a process outside MPS shares the GPU with the MPS server unfenced")

    def _pick_model(self, site: SiteConfig, memory_total_bytes: int | None) -> GpuModel | None:
        if self.opts.model:
            return site.gpu_model(self.opts.model)
        node = self._node_model(site)
        if node is not None:
            return node
        if memory_total_bytes is None:
            return None
        matches = [m for m in site.gpu_models.values() if V.memory_matches(m.memory_gib, memory_total_bytes)]
        return matches[0] if len(matches) == 1 else None

    # -------------------------------------------------- 2. MPS

    def _member(self, job_id: int, name: str, pct: int, limit_mib: int) -> MemberPlacement:
        return MemberPlacement(job_id=job_id, name=name, node_index=0, gpu_index=0, mps_thread_pct=pct,
                               gpu_mem_limit_mib=limit_mib, host_mem_limit_bytes=0, cpus=1, command=(),
                               checkpoint_dir=str(self.work / name), metrics_path=str(self.work / name / "m.jsonl"))

    def _client(self, name: str, role: str, pct: int, limit_mib: int, *args: str) -> Child:
        assert self.mps is not None
        member = self._member(900_000 + len(self.children), name, pct, limit_mib)
        env = member_env(self.env, member, [self.ctx.gpu_name], self.mps)  # the agent's member environment
        child = start_child(name, probe_argv(role, "--timeout", str(CLIENT_TIMEOUT_S), *args), env, self.work)
        self.children.append(child)
        return child

    def check_fences(self, site: SiteConfig) -> None:
        """Which fences this node can enforce (issue 22: MPS v3 namespaces, cgroup dmem),
        through the same detection the agent and `admin check --fences` use; FAIL when the
        site requires one the node lacks."""
        from slurm_dlrm.agent.fences import detect_capabilities, site_gaps

        caps = detect_capabilities(env=self.env, driver_version=self.nvml.driver_version)
        figure = (f"MPS v3: {'yes' if caps.mps_v3 else 'no'} ({caps.mps_v3_detail}); cgroup dmem: "
                  f"{'yes' if caps.dmem else 'no'} ({caps.dmem_detail}); driver {caps.driver_version or 'unknown'}")
        gaps = site_gaps(site.mps.mode, site.mps.dmem, caps)
        values: dict[str, Any] = {"mps_v3": caps.mps_v3, "dmem": caps.dmem, "dmem_regions": caps.dmem_regions}
        if gaps:
            self.add("fences.capabilities", FAIL, figure,
                     fix="; ".join(f"the site sets {f} = {want} but this node has {has}" for f, want, has in gaps)
                     + ": upgrade the driver (MPS v3 needs r615+) / kernel (dmem needs 6.14+), or set "
                       "mps.mode = auto and mps.dmem = auto in the site file", **values)
        elif self.ctx.hardware:
            self.add("fences.capabilities", PASS, figure,
                     detail="fences without v3 or dmem are the clients' own environment (docs/admin.md)", **values)
        else:
            self.add("fences.capabilities", DRY, figure,
                     detail="detected against this machine without a GPU driver: says nothing of a GPU node", **values)

    def check_mps(self, site: SiteConfig) -> None:
        names = ("mps.daemon_start", "mps.memory_fence", "mps.neighbour_runs_on", "mps.thread_share_scaling",
                 "mps.nvml_sees_clients", "mps.daemon_shutdown")
        if not site.mps.enabled:
            for n in names:
                self.add(n, SKIP, "not measured", "[mps] enabled = false in the site file")
            return
        exe = shutil.which(MPS_CONTROL, path=self.env.get("PATH"))
        fake = exe is not None and is_fake_mps_control(exe)
        self.ctx.mps_control = f"{exe} (fake)" if fake else (exe or "not found")
        tmp_root = self.env.get("TMPDIR") or tempfile.gettempdir()
        tag = f"st{self.env.get('SLURM_JOB_ID') or os.getpid()}"
        t0 = time.monotonic()
        self.mps = open_mps(True, [self.ctx.gpu_name], tmp_root, tag, env=self.env, site_mode="own")
        if self.mps.daemon is None:
            self.add("mps.daemon_start", FAIL, self.mps.detail,
                     fix="install the driver's nvidia-cuda-mps-control on the node's PATH; if it starts but does not "
                         "answer, read control.log in the log folder (pipe folder <= 87 characters)")
            for n in names[1:]:
                self.add(n, SKIP, "not measured", "no MPS daemon")
            return
        daemon = self.mps.daemon
        status = DRY if fake else PASS
        fake_note = "against the fake nvidia-cuda-mps-control: the agent's code path, no GPU" if fake else ""
        self.add("mps.daemon_start", status, f"pid {daemon.pid()} answered after {time.monotonic() - t0:.2f} s, "
                 f"pipe {daemon.pipe_dir}", fake_note, daemon_pid=daemon.pid(), root_dir=str(daemon.root_dir))
        try:
            # The agent's backstop defaults (loop._configure_mps): the largest limit and share.
            daemon.set_default_device_pinned_mem_limit(0, STEADY_LIMIT_MIB)
            daemon.set_default_active_thread_percentage(HIGH_PCT)
            if self.ctx.hardware and not fake:
                self._mps_on_gpu()
            else:
                why = ("no GPU: the fake NVML cannot run CUDA" if not self.ctx.hardware
                       else "the MPS daemon is the fake: CUDA clients cannot reach it")
                for n in ("mps.memory_fence", "mps.neighbour_runs_on", "mps.thread_share_scaling"):
                    self.add(n, SKIP, "not measured (needs CUDA clients on a GPU)", why)
                self._mps_clients_seen_dry()
        finally:
            self._stop_children()
            self._stop_daemon(status, fake_note)

    def _mps_clients_seen_dry(self) -> None:
        if not (self.nvml.available and self.nvml.is_fake):
            # stand-in clients are visible only to the fake NVML, which plays the driver for them
            why = "NVML is unavailable" if not self.nvml.available else "CUDA clients cannot reach a fake daemon"
            self.add("mps.nvml_sees_clients", SKIP, "not measured", why)
            return
        a = self._client("client-low", "idle", LOW_PCT, GREEDY_LIMIT_MIB, "--stop", str(self.work / "stop"))
        b = self._client("client-high", "idle", HIGH_PCT, STEADY_LIMIT_MIB, "--stop", str(self.work / "stop"))
        for c in (a, b):
            c.wait_for(("ready",), 30)
        self._judge_nvml_clients([a, b], dry=True)

    def _judge_nvml_clients(self, clients: list[Child], dry: bool) -> None:
        want = {c.proc.pid: c.name for c in clients}
        seen: dict[int, int | None] = {}
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            assert self.ctx.nvml_index is not None
            snap = self.nvml.sample([self.ctx.nvml_index])
            seen = {p.pid: p.gpu_mem_bytes for p in snap.processes if p.pid in want}
            if len(seen) == len(want):
                break
            time.sleep(0.5)
        parts = []
        for pid, name in want.items():
            mem = seen.get(pid)
            shown = "not listed" if pid not in seen else (f"{mem / MIB:.0f} MiB" if mem is not None else "listed")
            parts.append(f"{name} pid {pid}: {shown}")
        figure = ", ".join(parts)
        if len(seen) == len(want):
            self.add("mps.nvml_sees_clients", DRY if dry else PASS, figure,
                     "the fake NVML's process list (it plays the driver for our clients)" if dry else "")
        else:
            self.add("mps.nvml_sees_clients", FAIL, figure,
                     fix="NVML does not list the MPS clients (nvmlDeviceGetMPSComputeRunningProcesses): per-member "
                         "GPU memory will read 0; update the driver (>= 470) and nvidia-ml-py")

    def _mps_on_gpu(self) -> None:
        # Thread share: the same kernel solo at two shares.
        tflops: dict[int, float | None] = {}
        errors = []
        for pct in (LOW_PCT, HIGH_PCT):
            c = self._client(f"bench-{pct}", "bench", pct, STEADY_LIMIT_MIB, "--seconds", str(BENCH_SECONDS))
            ev = c.wait_for(("bench",), 60 + BENCH_SECONDS)
            tflops[pct] = float(ev["tflops"]) if ev and ev.get("event") == "bench" else None
            if tflops[pct] is None:
                errors.append(f"{pct}%: {_child_error(c)}")
            c.kill()
        status, figure, fix = V.judge_scaling(tflops[LOW_PCT], tflops[HIGH_PCT], LOW_PCT, HIGH_PCT, self.sm_count)
        self.add("mps.thread_share_scaling", status, figure, "; ".join(errors), fix=fix,
                 tflops_low=tflops[LOW_PCT], tflops_high=tflops[HIGH_PCT])
        # Fence: the greedy client (low share, 1 GiB) allocates past its limit while the
        # steady one (high share, 2 GiB) computes on.
        stop = str(self.work / "stop")
        steady = self._client("steady", "steady", HIGH_PCT, STEADY_LIMIT_MIB, "--stop", stop)
        ready = steady.wait_for(("ready",), 60)
        greedy = self._client("greedy", "greedy", LOW_PCT, GREEDY_LIMIT_MIB, "--stop", stop,
                              "--chunk-mib", str(V.FENCE_BLOCK_MIB), "--max-mib", str(4 * GREEDY_LIMIT_MIB))
        oom = greedy.wait_for(("oom", "no_oom"), 60)
        status, figure, fix = V.judge_fence(oom, GREEDY_LIMIT_MIB)
        detail = _child_error(greedy) if oom is None or oom.get("event") == "error" else ""
        self.add("mps.memory_fence", status, figure, detail, fix, limit_mib=GREEDY_LIMIT_MIB,
                 allocated_mib=(oom or {}).get("allocated_mib"))
        if status == PASS and oom is not None:
            # What the limit counts beyond the client's allocations (issue 37): the fence's
            # per-process overhead (an upper bound, within one block).
            self.measured["fence_overhead_mib"] = float(GREEDY_LIMIT_MIB - int(oom["allocated_mib"]))
        self._judge_nvml_clients([steady, greedy], dry=False)
        before = steady.last("progress")
        time.sleep(2.0)  # the neighbour keeps computing after the other client's OOM
        after = steady.last("progress")
        Path(stop).touch()
        code = None
        with contextlib.suppress(subprocess.TimeoutExpired):
            code = steady.proc.wait(timeout=30)
        progressed = None
        if ready is not None and ready.get("event") == "ready" and after is not None:
            progressed = int(after["iterations"]) - int((before or {"iterations": 0})["iterations"])
        status, figure, fix = V.judge_neighbour(progressed, code)
        self.add("mps.neighbour_runs_on", status, figure, "" if status == PASS else _child_error(steady), fix)

    def _stop_children(self) -> None:
        with contextlib.suppress(OSError):
            (self.work / "stop").touch()  # clients that can, end on their own (greedy frees its memory)
        deadline = time.monotonic() + 5
        for c in self.children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            c.kill()
        self.children = []

    def _stop_daemon(self, status: str = PASS, fake_note: str = "") -> None:
        if self.mps is None or self.mps.daemon is None:
            return
        daemon, self.mps = self.mps.daemon, None
        pid = daemon.pid()
        servers: list[int] = []
        with contextlib.suppress(Exception):
            servers = daemon.server_list()
        t0 = time.monotonic()
        daemon.quit()
        # The servers exit after the daemon; give them the daemon's own quit bound.
        deadline = time.monotonic() + 10
        while any(pid_alive(p) for p in servers) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [p for p in [pid, *servers] if p is not None and pid_alive(p)]
        folder_left = daemon.root_dir is not None and daemon.root_dir.exists()
        figure = (f"quit in {time.monotonic() - t0:.2f} s; daemon pid {pid}, {len(servers)} server(s); "
                  f"{'still alive: ' + ','.join(map(str, left)) if left else 'none left'}")
        if left or folder_left:
            for p in left:  # nothing we started may outlive the run
                with contextlib.suppress(OSError):
                    os.kill(p, signal.SIGKILL)
            self.add("mps.daemon_shutdown", FAIL, figure + ("; pipe folder left" if folder_left else ""),
                     fix="the daemon did not exit on quit: read control.log; the epilog's SIGTERM/SIGKILL path "
                         "will be what stops it on this node")
        else:
            self.add("mps.daemon_shutdown", status, figure, fake_note)

    # -------------------------------------------------- 3. estimator on CUDA

    def check_estimator(self) -> None:
        from slurm_dlrm.estimate import estimate
        from slurm_dlrm.spec import parse_spec

        if not self.ctx.hardware or self.model is None:
            why = "no GPU (CUDA and the driver's NVML are needed)" if not self.ctx.hardware else "no site GPU model"
            for s in ESTIMATOR_SPECS:
                self.add(f"estimator.{s['name']}", SKIP, "not measured", why)
            self.add("estimator.cuda_context", SKIP, "not measured", why)
            return
        contexts = []
        env = dict(self.env, CUDA_VISIBLE_DEVICES=self.ctx.gpu_name, CUDA_DEVICE_ORDER="PCI_BUS_ID")
        for k in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"):
            env.pop(k, None)
        unavailable = ""
        for overrides in ESTIMATOR_SPECS:
            data = estimator_spec(overrides, self.opts.steps)
            spec = parse_spec(data, data["name"])
            if unavailable:  # the same libraries are missing for every spec
                self.add(f"estimator.{spec.name}", SKIP, "not measured", unavailable)
                continue
            est = estimate(spec, self.model)
            work = self.work / spec.name
            work.mkdir()
            (work / "spec.json").write_text(json.dumps(data))
            child = start_child(spec.name, probe_argv("estimate", "--spec", str(work / "spec.json"), "--workdir",
                                                      str(work), "--steps", str(self.opts.steps), "--nvml-index",
                                                      str(self.ctx.nvml_index)), env, self.work)
            self.children.append(child)
            ev = child.wait_for(("estimate", "unavailable"), PROBE_TIMEOUT_S)
            child.kill()
            if ev is not None and ev.get("event") == "unavailable":
                unavailable = str(ev.get("reason"))
                self.add(f"estimator.{spec.name}", SKIP, "not measured", unavailable)
                continue
            if ev is None or ev.get("event") != "estimate":
                self.add(f"estimator.{spec.name}", FAIL, "the run did not finish", _child_error(child),
                         fix="train the spec by hand with slurm-dlrm train to see why (CUDA build of torch/fbgemm?)")
                continue
            reserved, nvml_bytes = int(ev["max_memory_reserved_bytes"]), ev.get("nvml_process_bytes")
            context = est.gpu_breakdown.get("cuda_context", 0)
            status, err_r, err_n = V.judge_estimate(est.gpu_peak_bytes - context, est.gpu_peak_bytes, reserved,
                                                    nvml_bytes)
            if nvml_bytes:
                contexts.append(int(nvml_bytes) - reserved)
            figure = (f"estimate {est.gpu_peak_bytes / MIB:.0f} MiB; reserved {reserved / MIB:.0f} MiB "
                      f"({err_r:+.1f}% w/o context), allocated {int(ev['max_memory_allocated_bytes']) / MIB:.0f} MiB, "
                      f"NVML {'n/a' if not nvml_bytes else f'{int(nvml_bytes) / MIB:.0f} MiB ({err_n:+.1f}%)'}")
            fix = "" if status == PASS else (
                "the estimate is under what ran (members would OOM) or far over (packing wastes memory): set "
                "cuda_context_mib from estimator.cuda_context, rerun with --write-site; report the spec if it persists")
            self.add(f"estimator.{spec.name}", status, figure, fix=fix, estimate_bytes=est.gpu_peak_bytes,
                     max_memory_reserved_bytes=reserved, max_memory_allocated_bytes=ev["max_memory_allocated_bytes"],
                     nvml_process_bytes=nvml_bytes, err_vs_reserved_pct=err_r, err_vs_nvml_pct=err_n,
                     breakdown=est.gpu_breakdown)
        if contexts:
            ctx_mib = max(contexts) / MIB
            site_mib = self.model.cuda_context_mib
            self.measured["cuda_context_mib"] = round(ctx_mib)
            self.add("estimator.cuda_context", PASS,
                     f"NVML process memory minus torch's reserved: {ctx_mib:.0f} MiB (site says {site_mib:g} MiB)",
                     "context, kernels and cuBLAS/cuDNN handles outside PyTorch's allocator", cuda_context_mib=ctx_mib)
        else:
            self.add("estimator.cuda_context", SKIP, "not measured", "no run reported NVML process memory")

    # -------------------------------------------------- 4. calibration

    def check_calibration(self) -> None:
        if not self.ctx.hardware or self.model is None:
            why = "no GPU (CUDA and the driver's NVML are needed)" if not self.ctx.hardware else "no site GPU model"
            self.add("calibration.compute", SKIP, "not measured", why)
            return
        env = dict(self.env, CUDA_VISIBLE_DEVICES=self.ctx.gpu_name, CUDA_DEVICE_ORDER="PCI_BUS_ID")
        env.pop("CUDA_MPS_PIPE_DIRECTORY", None)
        child = start_child("calibrate", probe_argv("calibrate", "--nvml-index", str(self.ctx.nvml_index)), env,
                            self.work)
        self.children.append(child)
        ev = child.wait_for(("calibrate",), PROBE_TIMEOUT_S)
        child.kill()
        if ev is None or ev.get("event") != "calibrate":
            self.add("calibration.compute", FAIL, "the calibration did not finish", _child_error(child),
                     fix="check that torch sees the GPU: python -c 'import torch; print(torch.cuda.is_available())'")
            return
        m = self.model
        figures: dict[str, Any] = {
            "gemm_efficiency": float(ev["gemm_tflops"]) / m.fp32_tflops,
            "bf16_gemm_efficiency": float(ev["bf16_gemm_tflops"]) / (2 * m.tf32_tflops),
            "stream_bandwidth_gbps": float(ev["stream_bandwidth_gbps"]),
            "gather_bandwidth_gbps": float(ev["gather_bandwidth_gbps"]),
            "kernel_launch_us": float(ev["kernel_launch_us"]),
        }
        self.sm_count = int(ev["sm_count"]) if ev.get("sm_count") else None
        figure = (f"GEMM {ev['gemm_tflops']:.1f} TFLOP/s ({figures['gemm_efficiency']:.0%} of {m.fp32_tflops:g}), "
                  f"bf16 {ev['bf16_gemm_tflops']:.1f} ({figures['bf16_gemm_efficiency']:.0%}), copy "
                  f"{figures['stream_bandwidth_gbps']:.0f} GB/s, gather {figures['gather_bandwidth_gbps']:.0f} GB/s, "
                  f"launch {figures['kernel_launch_us']:.1f} us")
        problems = []
        if figures["stream_bandwidth_gbps"] > 1.15 * m.mem_bandwidth_gbps:
            problems.append(f"copy bandwidth above the site's mem_bandwidth_gbps {m.mem_bandwidth_gbps:g}")
        if figures["gemm_efficiency"] > 1.15:
            problems.append(f"GEMM above the site's fp32_tflops {m.fp32_tflops:g}")
        if self.sm_count is not None and self.sm_count != m.sm_count:
            problems.append(f"{self.sm_count} SMs, the site says {m.sm_count}")
        if problems:
            self.add("calibration.compute", FAIL, figure, "; ".join(problems),
                     fix=f"the [gpu_models.{m.name}] figures do not describe this GPU: correct sm_count, "
                         "fp32_tflops/tf32_tflops and mem_bandwidth_gbps from its data sheet", **figures)
            return
        self.measured.update({k: round(v, 4) for k, v in figures.items()})
        if ev.get("cublas_workspace_bytes") is not None:
            self.measured["cublas_workspace_mib"] = round(max(0, int(ev["cublas_workspace_bytes"])) / MIB, 1)
        if ev.get("nvml_overhead_bytes") is not None:
            # NVML's process memory minus torch's reserved after a few plain-torch DLRM steps
            # (issue 37): the per-process room outside torch's allocator.
            self.measured["nvml_overhead_mib"] = round(max(0, int(ev["nvml_overhead_bytes"])) / MIB, 1)
        workspace = ev.get("cublas_workspace_bytes")
        ws_text = f", cuBLAS workspace {int(workspace) / MIB:.0f} MiB" if workspace is not None else ""
        self.add("calibration.compute", PASS, figure, f"{self.sm_count} SMs{ws_text}", **figures)

    def write_site(self) -> None:
        if not self.opts.write_site:
            return
        if not self.measured or self.model is None:
            self.add("calibration.write_site", SKIP, f"{self.opts.write_site} unchanged",
                     "nothing was measured on a GPU, so nothing is written")
            return
        from slurm_dlrm.selftest.sitefile import write_gpu_model

        if self.measured_with:
            self.measured["measured_with"] = self.measured_with
        write_gpu_model(self.opts.write_site, self.model.name, self.measured)
        self.add("calibration.write_site", PASS, f"{len(self.measured)} figures written to "
                 f"[gpu_models.{self.model.name}] of {self.opts.write_site}", ", ".join(sorted(self.measured)),
                 written=dict(self.measured))

    # -------------------------------------------------- all

    def run(self) -> tuple[list[Check], dict[str, Any]]:
        saved_fake = os.environ.get(fake_nvml.ENV_FAKE_NVML)
        # scancel, a time limit or a closed terminal must not leave the daemon running:
        # turn SIGTERM/SIGHUP into an exception, so the finally below runs.
        old_handlers = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGHUP):
                old_handlers[sig] = signal.signal(sig, _on_signal)
        try:
            site = self.prepare()
            self.check_nvml(site)
            self.check_fences(site)
            if self.ctx.hardware and self.model is not None:
                self.check_calibration()  # first: the SM count it reads sharpens the share check
            self.check_mps(site)
            self.check_estimator()
            if not (self.ctx.hardware and self.model is not None):
                self.check_calibration()
            self.write_site()
        finally:
            self._stop_children()
            self._stop_daemon()
            self.nvml.shutdown()
            shutil.rmtree(self.work, ignore_errors=True)
            if saved_fake is None:
                os.environ.pop(fake_nvml.ENV_FAKE_NVML, None)
            else:
                os.environ[fake_nvml.ENV_FAKE_NVML] = saved_fake
            for sig, handler in old_handlers.items():
                signal.signal(sig, handler)
        return self.checks, self.ctx.to_dict()


class Stopped(DlrmError):
    """The selftest got SIGTERM/SIGHUP; what it started has been stopped."""


def _on_signal(signum: int, frame: Any) -> None:
    raise Stopped(f"selftest: stopped by {signal.Signals(signum).name}; the MPS daemon and clients it started "
                  "were stopped")


def run_selftest(opts: Options) -> tuple[list[Check], dict[str, Any]]:
    return Selftest(opts).run()
