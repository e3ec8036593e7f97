"""The NVIDIA MPS control daemon behind one module.

Two ways to have MPS in a pack allocation:

* own daemon (default): `nvidia-cuda-mps-control -d` with `CUDA_MPS_PIPE_DIRECTORY` and
  `CUDA_MPS_LOG_DIRECTORY` in a fresh 0700 folder under the job's temporary folder and
  `CUDA_VISIBLE_DEVICES` = the allocation's GPUs. The MPS server then renumbers those
  GPUs 0..n-1 for its clients (NVIDIA MPS docs, CUDA_VISIBLE_DEVICES), so a member's
  `CUDA_VISIBLE_DEVICES` is its position in the allocation. `quit` at the end, folders
  removed.
* site daemon (Slurm gres/mps with a prolog-started daemon): found through
  `$CUDA_MPS_PIPE_DIRECTORY`; used as it is, never configured or stopped by us.
* own daemon with MPS v3 (`open_mps(..., v3_config=TOML)`, driver r615+): started with
  `-d -p 3 -a <config>`; commands are module verbs given as arguments (`server list`,
  `namespace create ...`, `-q`), not lines on stdin (NVIDIA MPS docs, "MPS v3 Interface").

Commands go to the daemon on stdin of `nvidia-cuda-mps-control`, one a line, as the
NVIDIA docs describe (`get_server_list`, `set_default_active_thread_percentage`, ...).
When MPS is off in the site config or the binary is missing, `open_mps` says so and the
agent runs members without it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from slurm_dlrm.errors import DlrmError
from slurm_dlrm.osutil import pid_alive

log = logging.getLogger(__name__)

MPS_CONTROL = "nvidia-cuda-mps-control"
PID_FILE = "nvidia-cuda-mps-control.pid"
COMMAND_TIMEOUT_S = 15.0


class MpsError(DlrmError):
    """The MPS control daemon did not start or refused a command."""


@dataclass
class MpsDaemon:
    """One MPS control daemon, reached through its pipe folder."""

    pipe_dir: Path
    log_dir: Path
    binary: str
    owned: bool  # we started it: we configure it, quit it and remove its folders
    visible_devices: list[str] | None = None
    root_dir: Path | None = None  # the folder holding pipe/ and log/, removed after quit
    commands: list[str] = field(default_factory=list)
    protocol: int = 2  # 3: MPS v3 (module verb commands, -a configuration)
    config_file: Path | None = None  # v3: the TOML applied at start

    def env(self) -> dict[str, str]:
        """What an MPS client (a member) needs to find this daemon."""
        return {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir), "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir)}

    def _run(self, argv: list[str], stdin: str | None, extra_env: dict[str, str] | None = None) -> str:
        env = dict(os.environ)
        env.update(self.env())
        env.update(extra_env or {})
        try:
            # No command input: stdin is /dev/null, never the agent's own (a client waits on it).
            feed: dict[str, object] = {"input": stdin} if stdin is not None else {"stdin": subprocess.DEVNULL}
            proc = subprocess.run(  # noqa: S603 - argv list, no shell
                argv, capture_output=True, text=True, env=env, timeout=COMMAND_TIMEOUT_S, check=False,
                **feed)  # type: ignore[call-overload]
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise MpsError(f"{' '.join(argv)}: {exc}") from None
        if proc.returncode != 0:
            raise MpsError(f"{' '.join(argv)} exited {proc.returncode}: {(proc.stderr or proc.stdout).strip()}")
        return proc.stdout

    def command(self, line: str) -> str:
        """Send one command; its reply without the trailing newline."""
        self.commands.append(line)
        return self._run([self.binary], line + "\n").rstrip("\n")

    def v3(self, *args: str) -> str:
        """One MPS v3 module verb command (`server list`, `namespace create --server=...`)."""
        self.commands.append(" ".join(args))
        return self._run([self.binary, *args], None).rstrip("\n")

    def start(self) -> None:
        for d in (self.pipe_dir, self.log_dir):
            d.mkdir(parents=True, exist_ok=True)
            d.chmod(0o700)
        extra = {"CUDA_VISIBLE_DEVICES": ",".join(self.visible_devices)} if self.visible_devices else {}
        argv = [self.binary, "-d"]
        if self.protocol == 3:
            # -p 3 selects v3; CUDA_MPS_PROTOCOL_VERSION would win over it, so it goes too.
            argv += ["-p", "3"] + (["-a", str(self.config_file)] if self.config_file else [])
            extra["CUDA_MPS_PROTOCOL_VERSION"] = "3"
        self._run(argv, None, extra)
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        while True:  # -d returns before the daemon may accept commands
            try:
                if self.protocol == 3:
                    self.v3("server", "list")
                else:
                    self.server_list()
                return
            except MpsError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def pid(self) -> int | None:
        try:
            return int((self.pipe_dir / PID_FILE).read_text().strip())
        except (OSError, ValueError):
            return None

    def server_list(self) -> list[int]:
        return [int(x) for x in self.command("get_server_list").split() if x.strip().isdigit()]

    def set_default_active_thread_percentage(self, pct: float) -> None:
        self.command(f"set_default_active_thread_percentage {pct:g}")

    def set_default_device_pinned_mem_limit(self, device: int, mib: int) -> None:
        self.command(f"set_default_device_pinned_mem_limit {device} {mib}M")

    def quit(self, timeout_s: float = 10.0) -> None:
        """`quit`, wait for the daemon to go, remove the folders (own daemon only)."""
        if not self.owned:
            return
        pid = self.pid()
        try:
            if self.protocol == 3:
                self.v3("-q")
            else:
                self.command("quit")
        except MpsError as exc:
            log.warning("MPS quit: %s", exc)
        deadline = time.monotonic() + timeout_s
        while pid is not None and pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if pid is not None and pid_alive(pid):
            log.warning("MPS control daemon %d still alive after quit; sending SIGTERM", pid)
            with contextlib.suppress(OSError):
                os.kill(pid, 15)
        for d in (self.root_dir,) if self.root_dir else (self.pipe_dir, self.log_dir):
            shutil.rmtree(d, ignore_errors=True)


@dataclass
class MpsSetup:
    """What the agent got: `mode` is own | site | off, `detail` says why."""

    mode: str
    daemon: MpsDaemon | None
    detail: str

    @property
    def on(self) -> bool:
        return self.daemon is not None


def open_mps(wanted: bool, visible_devices: list[str], tmp_root: str | os.PathLike[str], tag: str,
             env: dict[str, str] | None = None, binary: str | None = None,
             site_mode: str = "auto", v3_config: str | None = None) -> MpsSetup:
    """Start or find the MPS daemon for this allocation; never raises for a missing MPS.

    site_mode: "auto" (use a daemon at $CUDA_MPS_PIPE_DIRECTORY if one answers, else start
    our own), "site" (only an existing daemon), "own" (always start our own).
    v3_config: start our own daemon with MPS v3 and this configuration (`-p 3 -a FILE`);
    a configuration the daemon refuses gives mode "off" with its message in `detail`.
    """
    env = dict(os.environ if env is None else env)
    if not wanted:
        return MpsSetup("off", None, "MPS is off (site config or placement)")
    exe = binary or shutil.which(MPS_CONTROL, path=env.get("PATH"))
    if exe is None:
        return MpsSetup("off", None, f"{MPS_CONTROL} not found on PATH")
    existing = env.get("CUDA_MPS_PIPE_DIRECTORY")
    if site_mode in ("auto", "site") and existing:
        daemon = MpsDaemon(Path(existing), Path(env.get("CUDA_MPS_LOG_DIRECTORY") or "/var/log/nvidia-mps"),
                           exe, owned=False)
        try:
            servers = daemon.server_list()
            return MpsSetup("site", daemon, f"using the daemon at {existing} ({len(servers)} servers)")
        except MpsError as exc:
            if site_mode == "site":
                return MpsSetup("off", None, f"no MPS daemon answers at {existing}: {exc}")
            log.info("no daemon at %s (%s); starting our own", existing, exc)
    elif site_mode == "site":
        return MpsSetup("off", None, "gres/mps mode but CUDA_MPS_PIPE_DIRECTORY is not set")
    Path(tmp_root).mkdir(parents=True, exist_ok=True)
    # Short names: the pipe folder holds a UNIX socket, and socket paths are limited to 107 bytes.
    root = Path(tempfile.mkdtemp(prefix=f"mps-{tag}-", dir=tmp_root))
    daemon = MpsDaemon(root / "pipe", root / "log", exe, owned=True,
                       visible_devices=list(visible_devices), root_dir=root)
    if v3_config is not None:
        daemon.protocol = 3
        daemon.config_file = root / "mps-v3.toml"
    try:
        if daemon.config_file is not None and v3_config is not None:
            daemon.config_file.write_text(v3_config)
            daemon.config_file.chmod(0o600)
        daemon.start()
    except (MpsError, OSError) as exc:
        shutil.rmtree(root, ignore_errors=True)
        return MpsSetup("off", None, f"MPS control daemon did not start: {exc}")
    how = f"-d -p 3 -a {daemon.config_file}" if daemon.protocol == 3 else "-d"
    return MpsSetup("own", daemon, f"started {exe} {how}, pipe {daemon.pipe_dir}, GPUs {','.join(visible_devices)}")
