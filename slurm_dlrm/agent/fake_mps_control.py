"""A fake `nvidia-cuda-mps-control` executable for machines without a GPU.

It speaks the real command-line protocol (NVIDIA MPS documentation, "Tools and Interface
Reference"): `nvidia-cuda-mps-control -d` starts a background control daemon that
listens on `$CUDA_MPS_PIPE_DIRECTORY/control` (default /tmp/nvidia-mps), writes
`nvidia-cuda-mps-control.pid` there and logs to `$CUDA_MPS_LOG_DIRECTORY/control.log`
(default /var/log/nvidia-mps) in the driver's log format; `nvidia-cuda-mps-control` without
options reads commands on stdin, one a line, and prints each reply. Commands:

    get_server_list                               pids of MPS servers, one a line
    start_server -uid <uid>                        starts a server for that user
    get_server_status <PID>                        ACTIVE
    get_client_list <PID>                          client pids (none: the fake has no CUDA clients)
    set_default_active_thread_percentage <pct>     replies the value, e.g. 25.0
    get_default_active_thread_percentage           e.g. 100.0
    set_active_thread_percentage <PID> <pct>       / get_active_thread_percentage <PID>
    set_default_device_pinned_mem_limit <dev> <value>   value = integer + M or G
    get_default_device_pinned_mem_limit <dev>      shown as whole G from 1 GiB up, else M
    set_device_pinned_mem_limit <PID> <dev> <value> / get_device_pinned_mem_limit <PID> <dev>
    terminate_client <server PID> <client PID>
    quit [-t <seconds>]                            stops servers and the daemon

Like the real daemon, defaults set after a server started only affect the next server,
and everything is lost on quit. The daemon mirrors its state into
`<pipe>/fake-mps-state.json` (visible devices, defaults, servers, commands received), so
tests and the fake NVML can see what the agent asked for. Servers are real `sleep`
processes, so `get_server_list` names live pids.

`install_launcher(bin_dir)` writes a small `nvidia-cuda-mps-control` script that runs this
module; put `bin_dir` first on PATH and the agent runs its real code path against it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PID_FILE = "nvidia-cuda-mps-control.pid"
STATE_FILE = "fake-mps-state.json"
SOCKET_NAME = "control"
_END = b"\0"  # ends one reply on the control socket (private to the fake)


def _pipe_dir() -> Path:
    return Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps")


def _log_dir() -> Path:
    return Path(os.environ.get("CUDA_MPS_LOG_DIRECTORY") or "/var/log/nvidia-mps")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _running_pid(pipe: Path) -> int | None:
    try:
        pid = int((pipe / PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if _alive(pid) else None


class _Daemon:
    def __init__(self, pipe: Path, logdir: Path) -> None:
        self.pipe = pipe
        self.logdir = logdir
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        self.state: dict[str, Any] = {
            "running": True,
            "pid": os.getpid(),
            "started_at": time.time(),
            "visible_devices": [d.strip() for d in visible.split(",") if d.strip()] if visible else None,
            "default_active_thread_percentage": 100.0,
            "default_device_pinned_mem_limit_mib": {},
            "servers": {},
            "commands": [],
        }
        self.servers: dict[int, subprocess.Popen[bytes]] = {}
        self.log = open(logdir / "control.log", "a", buffering=1)  # noqa: SIM115 - lives as long as the daemon

    def write_log(self, text: str) -> None:
        now = time.time()
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)) + f".{int(now * 1000) % 1000:03d}"
        self.log.write(f"[{stamp} Control {os.getpid():6d}] {text}\n")

    def save(self) -> None:
        tmp = self.pipe / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(self.state, indent=1))
        os.replace(tmp, self.pipe / STATE_FILE)

    # -------------------------------------------------------- commands

    def execute(self, line: str) -> tuple[str, bool]:
        """(reply, quit?) for one command line."""
        words = line.split()
        cmd, args = words[0], words[1:]
        self.state["commands"].append(line)
        try:
            handler = getattr(self, "cmd_" + cmd)
        except AttributeError:
            return f"Unrecognized command: {cmd}", False
        try:
            return handler(*args)
        except (TypeError, ValueError):
            return f"Invalid arguments for {cmd}", False

    def _server(self, pid: str) -> dict[str, Any]:
        server = self.state["servers"].get(str(int(pid)))
        if server is None:
            raise ValueError(pid)
        return server  # type: ignore[no-any-return]

    def cmd_get_server_list(self) -> tuple[str, bool]:
        return "\n".join(self.state["servers"]), False

    def cmd_start_server(self, flag: str, uid: str) -> tuple[str, bool]:
        if flag != "-uid":
            raise ValueError(flag)
        for s in self.state["servers"].values():
            if s["uid"] == int(uid):
                return "", False
        proc = subprocess.Popen(["sleep", "infinity"], stdin=subprocess.DEVNULL,  # noqa: S603
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.servers[proc.pid] = proc
        self.state["servers"][str(proc.pid)] = {
            "uid": int(uid),
            "active_thread_percentage": self.state["default_active_thread_percentage"],
            "device_pinned_mem_limit_mib": dict(self.state["default_device_pinned_mem_limit_mib"]),
        }
        self.write_log(f"Starting new server {proc.pid} for user {uid}")
        return "", False

    def cmd_get_server_status(self, pid: str) -> tuple[str, bool]:
        self._server(pid)
        return "ACTIVE", False

    def cmd_get_client_list(self, pid: str) -> tuple[str, bool]:
        self._server(pid)
        return "", False

    def cmd_get_device_client_list(self, *pid: str) -> tuple[str, bool]:
        return "", False

    def cmd_set_default_active_thread_percentage(self, pct: str) -> tuple[str, bool]:
        value = float(pct)
        if not 0 < value <= 100:
            raise ValueError(pct)
        self.state["default_active_thread_percentage"] = value
        return f"{value:.1f}", False

    def cmd_get_default_active_thread_percentage(self) -> tuple[str, bool]:
        return f"{self.state['default_active_thread_percentage']:.1f}", False

    def cmd_set_active_thread_percentage(self, pid: str, pct: str) -> tuple[str, bool]:
        value = float(pct)
        if not 0 < value <= 100:
            raise ValueError(pct)
        self._server(pid)["active_thread_percentage"] = value
        return f"{value:.1f}", False

    def cmd_get_active_thread_percentage(self, pid: str) -> tuple[str, bool]:
        return f"{self._server(pid)['active_thread_percentage']:.1f}", False

    def cmd_set_default_device_pinned_mem_limit(self, dev: str, value: str) -> tuple[str, bool]:
        self.state["default_device_pinned_mem_limit_mib"][str(int(dev))] = _parse_mem(value)
        return "", False

    def cmd_get_default_device_pinned_mem_limit(self, dev: str) -> tuple[str, bool]:
        return _show_mem(self.state["default_device_pinned_mem_limit_mib"].get(str(int(dev)))), False

    def cmd_set_device_pinned_mem_limit(self, pid: str, dev: str, value: str) -> tuple[str, bool]:
        self._server(pid)["device_pinned_mem_limit_mib"][str(int(dev))] = _parse_mem(value)
        return "", False

    def cmd_get_device_pinned_mem_limit(self, pid: str, dev: str) -> tuple[str, bool]:
        return _show_mem(self._server(pid)["device_pinned_mem_limit_mib"].get(str(int(dev)))), False

    def cmd_terminate_client(self, server_pid: str, client_pid: str) -> tuple[str, bool]:
        self._server(server_pid)
        int(client_pid)
        return "", False

    def cmd_quit(self, *args: str) -> tuple[str, bool]:
        if args and (args[0] != "-t" or len(args) != 2):
            raise ValueError(args)
        return "", True

    # -------------------------------------------------------- life cycle

    def stop(self) -> None:
        for proc in self.servers.values():
            proc.terminate()
        for proc in self.servers.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        self.state["servers"] = {}
        self.state["running"] = False
        self.state["stopped_at"] = time.time()
        self.save()
        for name in (SOCKET_NAME, PID_FILE):
            with contextlib.suppress(OSError):
                (self.pipe / name).unlink()
        self.write_log("Exit")

    def serve(self, server: socket.socket) -> None:
        stop = False

        def on_term(signum: int, frame: Any) -> None:
            raise SystemExit(0)

        signal.signal(signal.SIGTERM, on_term)
        try:
            while not stop:
                conn, _ = server.accept()
                self.write_log("Accepting connection...")
                self.write_log("NEW UI")
                with conn, conn.makefile("rb") as reader:
                    for raw in reader:
                        line = raw.decode(errors="replace").strip()
                        if not line:
                            continue
                        self.write_log(f"Cmd:{line}")
                        reply, stop = self.execute(line)
                        if reply:
                            self.write_log(reply)
                        self.save()
                        conn.sendall(reply.encode() + _END)
                        if stop:
                            break
                self.write_log("UI closed")
        finally:
            self.stop()


def _parse_mem(value: str) -> int:
    m = re.fullmatch(r"(\d+)([MG])", value)
    if not m:
        raise ValueError(value)
    return int(m.group(1)) * (1024 if m.group(2) == "G" else 1)


def _show_mem(mib: int | None) -> str:
    if mib is None:
        return "0M"  # no limit set
    return f"{mib // 1024}G" if mib >= 1024 else f"{mib}M"


def _start_daemon(foreground: bool) -> int:
    pipe, logdir = _pipe_dir(), _log_dir()
    pipe.mkdir(parents=True, exist_ok=True)
    logdir.mkdir(parents=True, exist_ok=True)
    if _running_pid(pipe) is not None:
        print("An instance of this daemon is already running", file=sys.stderr)
        return 1
    sock_path = pipe / SOCKET_NAME
    with contextlib.suppress(OSError):
        sock_path.unlink()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(sock_path))
    server.listen(8)
    if not foreground:
        pid = os.fork()
        if pid:
            return 0  # the socket listens already: clients can connect as soon as we return
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
    daemon = _Daemon(pipe, logdir)
    (pipe / PID_FILE).write_text(f"{os.getpid()}\n")
    daemon.write_log(f"Starting control daemon using socket {sock_path}")
    daemon.write_log(f"To connect CUDA applications to this daemon, set env CUDA_MPS_PIPE_DIRECTORY={pipe}")
    daemon.save()
    try:
        daemon.serve(server)
    finally:
        server.close()
    if not foreground:
        os._exit(0)
    return 0


def _client() -> int:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(_pipe_dir() / SOCKET_NAME))
    except OSError:
        print("Cannot find MPS control daemon process", file=sys.stderr)
        return 1
    buf = b""
    with sock:
        for line in sys.stdin:
            if not line.strip():
                continue
            sock.sendall(line.strip().encode() + b"\n")
            while _END not in buf:
                chunk = sock.recv(65536)
                if not chunk:
                    return 0  # the daemon went away (quit)
                buf += chunk
            reply, _, buf = buf.partition(_END)
            if reply:
                sys.stdout.write(reply.decode() + "\n")
                sys.stdout.flush()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args in (["-d"], ["-f"]):
        return _start_daemon(foreground=args == ["-f"])
    if args in (["-h"], ["--help"]):
        print("Usage: nvidia-cuda-mps-control [-d | -f]")
        return 0
    if args:
        print(f"Unrecognized option: {args[0]}", file=sys.stderr)
        return 1
    return _client()


def install_launcher(bin_dir: str | os.PathLike[str], python: str | None = None) -> Path:
    """Write `bin_dir/nvidia-cuda-mps-control` that runs this fake; returns its path."""
    bin_path = Path(bin_dir)
    bin_path.mkdir(parents=True, exist_ok=True)
    root = Path(__file__).resolve().parents[2]
    exe = bin_path / "nvidia-cuda-mps-control"
    exe.write_text(
        "#!/bin/sh\n"
        "# Fake MPS control daemon for machines without a GPU (slurm_dlrm.agent.fake_mps_control).\n"
        f"PYTHONPATH={shlex.quote(str(root))}${{PYTHONPATH:+:$PYTHONPATH}}\n"
        "export PYTHONPATH\n"
        f"exec {shlex.quote(python or sys.executable)} -m slurm_dlrm.agent.fake_mps_control \"$@\"\n")
    exe.chmod(0o755)
    return exe


if __name__ == "__main__":
    sys.exit(main())
