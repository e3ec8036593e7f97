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

MPS v3 (NVIDIA docs "MPS v3 Interface", "... Configuration File", "... Namespaces"), only
when the launcher was installed with `v3=True` (`$SLURM_DLRM_FAKE_MPS_V3=1`; otherwise the
fake is a pre-r615 driver and refuses `-p`): `-p 3` / `--protocol 3` or
`CUDA_MPS_PROTOCOL_VERSION=3` (the variable wins), `-a/--apply <toml>` applied at start
(unknown keys and bad values are a configuration error: one line on stderr, exit 1, no
daemon), `-h` with `-p 3` lists the modules. A v3 daemon takes module verb commands as
arguments (`nvidia-cuda-mps-control server list`, `namespace create --server=S --name=N
--pinned-memory-limit=4G --active-thread-percentage=25`, `namespace get|set|list|delete`,
`server create --uid=N [--name=S]`, `server get|set`, `client list --all`, `-q`), not the
legacy stdin shell. Each server listens on `<pipe>/<server>/control` (its default
namespace) and each namespace on `<pipe>/<server>/<namespace>/control`.

Clients: the real client protocol lives in libcuda; the fake takes one private line
`fake_client_connect <pid> <CUDA_MPS_PINNED_DEVICE_MEM_LIMIT or ->` on any of its sockets
(`connect_client()` sends it, the stand-in member calls it with `--mps-client`) and records
the client with the limit the daemon holds it to: on a v3 namespace socket the namespace's
`pinned_memory_limit` (the client's own variable can only lower it), on v2 the client's own
variable if set (the hole MPS v2 has), else its server's or the default limit. Like the
real daemon (nvidia-cuda-mps-control(1): a client is served only by a server of its own
uid), a v3 client whose uid (SO_PEERCRED) is not the server's, on that server's or one of
its namespaces' sockets, is refused (`refused: ...`; `connect_client()` raises
PermissionError) and not recorded. A client of the server's own uid on a sibling
namespace's socket is taken there, as NVIDIA documents ("Namespace Routing": the socket
selects the namespace).
`$SLURM_DLRM_FAKE_MPS_STATE_COPY=<dir>` keeps a copy of the state there (the pipe folder is
removed when the agent quits its daemon).

`install_launcher(bin_dir)` writes a small `nvidia-cuda-mps-control` script that runs this
module; put `bin_dir` first on PATH and the agent runs its real code path against it.

Over 600 lines: it is one executable playing one program (the v2 shell, the v3 module
verbs and configuration check, the daemon's sockets and the client side share the
daemon's state); the launcher runs this one module.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import shlex
import signal
import socket
import struct
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

PID_FILE = "nvidia-cuda-mps-control.pid"
STATE_FILE = "fake-mps-state.json"
SOCKET_NAME = "control"
_SUN_PATH_MAX = 108  # sockaddr_un.sun_path on Linux, with its terminating NUL
ENV_V3 = "SLURM_DLRM_FAKE_MPS_V3"
REFUSED = "refused:"  # the daemon's reply to a client it does not connect
ENV_STATE_COPY = "SLURM_DLRM_FAKE_MPS_STATE_COPY"
CLIENT_LINE = "fake_client_connect"
MODULE = "slurm_dlrm.emulated.mps_control"  # what the launcher runs (`python -m`)
# Launchers installed before the fake moved here from agent/ (a local cluster brought up
# earlier keeps its admin/bin launcher with its own copy of the fake) still run the old
# name: their daemons are still the fake's. Drop the old name once no cluster up from
# before the move remains (`cluster up` installs the new launcher).
LAUNCHER_MODULES = (MODULE, "slurm_dlrm.agent.fake_mps_control")
_END = b"\0"  # ends one reply on the control socket (private to the fake)
_ERROR = "Error: "  # a v3 reply that the client turns into exit 1 and stderr

# MPS v3 configuration schema (NVIDIA "MPS v3 Configuration File", r615 keys plus r620's
# namespace cgroup/devices and compute_policy/timeslice): any other key is an error.
_SERVER_KEYS = {"allowed_devices", "pinned_memory_limit", "active_thread_percentage", "client_priority", "uid",
                "locality_domains", "timeslice_pct", "namespaces", "devices"}
_NAMESPACE_KEYS = {"pinned_memory_limit", "active_thread_percentage", "client_priority", "cgroup", "cgroup_depth",
                   "devices"}
_NS_DEVICE_KEYS = {"uuid", "sm_partition"}
_DEVICE_KEYS = {"uuid", "sm_partitions"}
_PARTITION_KEYS = {"name", "chunks", "include_remainder", "shareable", "max_chunks"}
_TOP_KEYS = {"schema_version", "servers", "features", "compute_policy"}


def _pipe_dir() -> Path:
    return Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps")


def _log_dir() -> Path:
    return Path(os.environ.get("CUDA_MPS_LOG_DIRECTORY") or "/var/log/nvidia-mps")


def _v3_supported() -> bool:
    return os.environ.get(ENV_V3) == "1"


def _alive(pid: int) -> bool:
    # Not slurm_dlrm.osutil.pid_alive: this fake runs from a copy beside its launcher,
    # standard library only (install_launcher), where the package cannot be imported.
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


def _bind(path: Path) -> socket.socket:
    """A listening UNIX socket at `path`, bound from inside its folder: deep pytest folders
    pass the 107-byte limit of socket paths (the real daemon needs short pipe folders)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        path.unlink()
    if len(os.fsencode(path)) < _SUN_PATH_MAX:
        sock.bind(str(path))
    else:
        cwd = os.getcwd()
        try:
            os.chdir(path.parent)
            sock.bind(path.name)
        finally:
            with contextlib.suppress(OSError):  # as in _connect: the way back may be closed to us
                os.chdir(cwd)
    sock.listen(8)
    os.chmod(path, 0o666)  # clients of every user connect (connect(2) needs write permission)
    return sock


def _connect(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if len(os.fsencode(path)) < _SUN_PATH_MAX:
        try:
            sock.connect(str(path))
        except OSError:
            sock.close()
            raise
        return sock
    # A longer path does not fit sockaddr_un: connect relative to its folder. The way
    # back may be closed to us (a client that dropped to another user in a folder that
    # user cannot enter): then we stay where the socket is.
    cwd = os.getcwd()
    try:
        os.chdir(path.parent)
        sock.connect(path.name)
    except OSError:
        sock.close()
        raise
    finally:
        with contextlib.suppress(OSError):
            os.chdir(cwd)
    return sock


class ConfigError(ValueError):
    pass


def _mem_mib(value: object, where: str) -> int:
    m = re.fullmatch(r"(\d+)([MG])", str(value))
    if not m or int(m.group(1)) <= 0:
        raise ConfigError(f"{where}: invalid memory value {value!r} (integer with M or G)")
    return int(m.group(1)) * (1024 if m.group(2) == "G" else 1)


def _pct(value: object, where: str) -> float:
    try:
        v = float(str(value))
    except ValueError:
        raise ConfigError(f"{where}: invalid percentage {value!r}") from None
    if not 0 < v <= 100:
        raise ConfigError(f"{where}: percentage {value!r} outside 1..100")
    return v


def _keys(table: dict[str, Any], allowed: set[str], where: str) -> None:
    for key in table:
        if key not in allowed:
            raise ConfigError(f"unknown key '{where}.{key}'" if where else f"unknown key '{key}'")


def _limits(table: dict[str, Any], where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "pinned_memory_limit" in table:
        out["pinned_memory_limit_mib"] = _mem_mib(table["pinned_memory_limit"], f"{where}.pinned_memory_limit")
    if "active_thread_percentage" in table:
        out["active_thread_percentage"] = _pct(table["active_thread_percentage"], f"{where}.active_thread_percentage")
    if "client_priority" in table:
        prio = str(table["client_priority"])
        if prio not in ("0", "1"):
            raise ConfigError(f"{where}.client_priority: 0 or 1, got {prio!r}")
        out["client_priority"] = int(prio)
    return out


def parse_v3_config(text: str) -> dict[str, dict[str, Any]]:
    """Servers from a v3 TOML configuration; ConfigError names the offending key."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"TOML: {exc}") from None
    _keys(data, _TOP_KEYS, "")
    if str(data.get("schema_version", "")) != "1.0":
        raise ConfigError(f"schema_version: expected \"1.0\", got {data.get('schema_version')!r}")
    servers: dict[str, dict[str, Any]] = {}
    for name, table in (data.get("servers") or {}).items():
        where = f"servers.{name}"
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: not a table")
        _keys(table, _SERVER_KEYS, where)
        server: dict[str, Any] = {"uid": int(table.get("uid", os.getuid())), **_limits(table, where),
                                  "namespaces": {}, "sm_partitions": {}}
        for dev in table.get("devices") or []:
            _keys(dev, _DEVICE_KEYS, f"{where}.devices")
            for part in dev.get("sm_partitions") or []:
                _keys(part, _PARTITION_KEYS, f"{where}.devices.sm_partitions")
                if int(part.get("chunks", 0)) <= 0:
                    raise ConfigError(f"{where}.devices.sm_partitions.{part.get('name')}.chunks: must be > 0")
                server["sm_partitions"][str(part["name"])] = {"uuid": dev.get("uuid"), "chunks": int(part["chunks"])}
        for ns_name, ns in (table.get("namespaces") or {}).items():
            nwhere = f"{where}.namespaces.{ns_name}"
            _keys(ns, _NAMESPACE_KEYS, nwhere)
            entry = _limits(ns, nwhere)
            for dev in ns.get("devices") or []:
                _keys(dev, _NS_DEVICE_KEYS, f"{nwhere}.devices")
                part = dev.get("sm_partition")
                if part is not None and part not in server["sm_partitions"]:
                    raise ConfigError(f"{nwhere}.devices.sm_partition: no partition named {part!r}")
                entry["sm_partition"] = part
            server["namespaces"][ns_name] = entry
        servers[name] = server
    return servers


def client_limit_mib(value: str) -> int | None:
    """MiB of device 0 from CUDA_MPS_PINNED_DEVICE_MEM_LIMIT ("0=3000M,1=2G" or "3000M")."""
    if not value or value == "-":
        return None
    for part in value.split(","):
        dev, sep, amount = part.partition("=")
        if not sep:
            amount, dev = dev, "0"
        if dev.strip() == "0":
            with contextlib.suppress(ConfigError):
                return _mem_mib(amount.strip(), "client")
    return None


class _Daemon:
    def __init__(self, pipe: Path, logdir: Path, protocol: int = 2,
                 servers: dict[str, dict[str, Any]] | None = None) -> None:
        self.pipe = pipe
        self.logdir = logdir
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        self.state: dict[str, Any] = {
            "running": True,
            "pid": os.getpid(),
            "protocol": protocol,
            "started_at": time.time(),
            "visible_devices": [d.strip() for d in visible.split(",") if d.strip()] if visible else None,
            "default_active_thread_percentage": 100.0,
            "default_device_pinned_mem_limit_mib": {},
            "servers": {},
            "v3_servers": servers or {},
            "clients": {},
            "commands": [],
        }
        self.servers: dict[int, subprocess.Popen[bytes]] = {}
        self.sockets: dict[socket.socket, tuple[str | None, str | None]] = {}  # -> (server, namespace)
        self.log = open(logdir / "control.log", "a", buffering=1)  # noqa: SIM115 - lives as long as the daemon

    @property
    def protocol(self) -> int:
        return int(self.state["protocol"])

    def write_log(self, text: str) -> None:
        now = time.time()
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)) + f".{int(now * 1000) % 1000:03d}"
        self.log.write(f"[{stamp} Control {os.getpid():6d}] {text}\n")

    def save(self) -> None:
        text = json.dumps(self.state, indent=1)
        tmp = self.pipe / (STATE_FILE + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.pipe / STATE_FILE)
        copy_dir = os.environ.get(ENV_STATE_COPY)
        if copy_dir:
            dest = Path(copy_dir) / f"fake-mps-state-{os.getpid()}.json"
            with contextlib.suppress(OSError):
                dest.with_suffix(".tmp").write_text(text)
                os.replace(dest.with_suffix(".tmp"), dest)

    # -------------------------------------------------------- sockets

    def listen(self, path: Path, route: tuple[str | None, str | None]) -> None:
        self.sockets[_bind(path)] = route

    def listen_v3(self) -> None:
        for name, server in self.state["v3_servers"].items():
            self.listen(self.pipe / name / SOCKET_NAME, (name, None))
            self.listen(self.pipe / name / "default" / SOCKET_NAME, (name, None))
            for ns in server["namespaces"]:
                self.listen(self.pipe / name / ns / SOCKET_NAME, (name, ns))

    # -------------------------------------------------------- commands

    def execute(self, line: str, route: tuple[str | None, str | None] = (None, None),
                peer_uid: int | None = None) -> tuple[str, bool]:
        """(reply, quit?) for one command line."""
        words = line.split()
        cmd, args = words[0], words[1:]
        if cmd == CLIENT_LINE:
            return self.client_connect(route, peer_uid, *args), False
        self.state["commands"].append(line)
        if self.protocol == 3:
            return self.execute_v3(words)
        try:
            handler = getattr(self, "cmd_" + cmd)
        except AttributeError:
            return f"Unrecognized command: {cmd}", False
        try:
            return handler(*args)
        except (TypeError, ValueError):
            return f"Invalid arguments for {cmd}", False

    def client_connect(self, route: tuple[str | None, str | None], peer_uid: int | None, pid: str,
                       requested: str = "-") -> str:
        want = client_limit_mib(requested)
        server_name, ns_name = route
        if self.protocol == 3:
            if server_name is None:  # the main control socket routes by uid (NVIDIA: Namespace Routing)
                server_name = next((n for n, s in self.state["v3_servers"].items() if s["uid"] == peer_uid), None)
            server = self.state["v3_servers"].get(server_name or "", {})
            if server and peer_uid is not None and peer_uid != server["uid"]:
                # MPS hands a client only a server of the client's own uid (nvidia-cuda-mps-control(1));
                # a client of another uid on a server's or namespace's socket gets nothing there.
                self.write_log(f"Refused client {pid}: uid {peer_uid} is not server {server_name}'s uid {server['uid']}")
                return f"{REFUSED} client uid {peer_uid} is not the uid {server['uid']} of server {server_name}"
            ns = server.get("namespaces", {}).get(ns_name or "", {})
            held = ns.get("pinned_memory_limit_mib", server.get("pinned_memory_limit_mib"))
            effective = min(want, held) if (want and held) else (held or want)
            pct = ns.get("active_thread_percentage", server.get("active_thread_percentage"))
        else:
            servers = [s for s in self.state["servers"].values() if s["uid"] == peer_uid]
            held = (servers[0]["device_pinned_mem_limit_mib"].get("0") if servers else None) \
                or self.state["default_device_pinned_mem_limit_mib"].get("0")
            effective = want or held  # v2: the client's own variable is its limit
            pct = None
        client = {"pid": int(pid), "uid": peer_uid, "server": server_name, "namespace": ns_name or
                  ("default" if self.protocol == 3 and server_name else None), "requested_limit_mib": want,
                  "effective_limit_mib": effective, "active_thread_percentage": pct}
        self.state["clients"][str(int(pid))] = client
        self.write_log(f"New client {pid} connected (server {server_name}, namespace {client['namespace']})")
        return json.dumps(client)

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
        # A server runs as its user (what `stat /proc/<pid>` shows); only root can do that here.
        # Like the real one it ends with its control daemon, also one killed outright (a
        # `sleep infinity` outlived a SIGKILLed daemon: a stray in every CI run).
        watch = 'while [ -e "/proc/$0" ]; do sleep 0.5; done'
        proc = subprocess.Popen(["sh", "-c", watch, str(os.getpid())], stdin=subprocess.DEVNULL,  # noqa: S603
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                user=int(uid) if os.getuid() == 0 else None)
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

    # -------------------------------------------------------- MPS v3 module verbs

    def execute_v3(self, words: list[str]) -> tuple[str, bool]:
        if words == ["-q"] or words == ["--quit"]:
            return "", True
        if len(words) < 2:
            return f"{_ERROR}unrecognized command: {' '.join(words)}", False
        module, verb = words[0], words[1]
        opts: dict[str, str] = {}
        for w in words[2:]:
            key, sep, value = w.partition("=")
            if not key.startswith("--") or not sep:
                return f"{_ERROR}{module} {verb}: bad argument {w!r} (--key=value)", False
            opts[key[2:].replace("-", "_")] = value
        handler = getattr(self, f"v3_{module}_{verb}", None)
        if handler is None:
            return f"{_ERROR}unrecognized command: {module} {verb}", False
        try:
            return handler(opts), False
        except ConfigError as exc:
            return f"{_ERROR}{exc}", False
        except KeyError as exc:
            return f"{_ERROR}{module} {verb}: missing --{str(exc).strip(chr(39)).replace('_', '-')}", False

    def _v3(self, name: str) -> dict[str, Any]:
        server = self.state["v3_servers"].get(name)
        if server is None:
            raise ConfigError(f"no server named {name!r}")
        return server  # type: ignore[no-any-return]

    def v3_server_list(self, opts: dict[str, str]) -> str:
        return "\n".join(self.state["v3_servers"])

    def v3_server_create(self, opts: dict[str, str]) -> str:
        uid = int(opts.pop("uid"))
        name = opts.pop("name", f"uid{uid}")
        if name in self.state["v3_servers"]:
            raise ConfigError(f"server {name!r} exists")
        _keys(opts, {"pinned_memory_limit", "active_thread_percentage", "client_priority"}, f"servers.{name}")
        self.state["v3_servers"][name] = {"uid": uid, **_limits(opts, f"servers.{name}"), "namespaces": {},
                                          "sm_partitions": {}}
        self.listen(self.pipe / name / SOCKET_NAME, (name, None))
        self.listen(self.pipe / name / "default" / SOCKET_NAME, (name, None))
        self.write_log(f"Created server {name} for user {uid}")
        return ""

    def v3_server_set(self, opts: dict[str, str]) -> str:
        server = self._v3(opts.pop("name"))
        _keys(opts, {"pinned_memory_limit", "active_thread_percentage", "client_priority"}, "server")
        server.update(_limits(opts, "server"))
        return ""

    def v3_server_get(self, opts: dict[str, str]) -> str:
        server = self._v3(opts["name"])
        return "\n".join(f"{k}={v}" for k, v in server.items() if k not in ("namespaces", "sm_partitions"))

    def v3_namespace_create(self, opts: dict[str, str]) -> str:
        server_name, name = opts.pop("server"), opts.pop("name")
        server = self._v3(server_name)
        if name in server["namespaces"] or name == "default":
            raise ConfigError(f"namespace {name!r} exists on server {server_name!r}")
        where = f"servers.{server_name}.namespaces.{name}"
        _keys(opts, {"pinned_memory_limit", "active_thread_percentage", "client_priority"}, where)
        server["namespaces"][name] = _limits(opts, where)
        self.listen(self.pipe / server_name / name / SOCKET_NAME, (server_name, name))
        self.write_log(f"Created namespace {name} on server {server_name}")
        return ""

    def v3_namespace_set(self, opts: dict[str, str]) -> str:
        server_name, name = opts.pop("server"), opts.pop("name")
        ns = self._v3(server_name)["namespaces"].get(name)
        if ns is None:
            raise ConfigError(f"no namespace {name!r} on server {server_name!r}")
        where = f"servers.{server_name}.namespaces.{name}"
        _keys(opts, {"pinned_memory_limit", "active_thread_percentage", "client_priority"}, where)
        ns.update(_limits(opts, where))
        return ""

    def v3_namespace_get(self, opts: dict[str, str]) -> str:
        ns = self._v3(opts["server"])["namespaces"].get(opts["name"])
        if ns is None:
            raise ConfigError(f"no namespace {opts['name']!r} on server {opts['server']!r}")
        return "\n".join(f"{k}={v}" for k, v in ns.items())

    def v3_namespace_list(self, opts: dict[str, str]) -> str:
        return "\n".join(["default", *self._v3(opts["server"])["namespaces"]])

    def v3_namespace_delete(self, opts: dict[str, str]) -> str:
        server = self._v3(opts["server"])
        if server["namespaces"].pop(opts["name"], None) is None:
            raise ConfigError(f"no namespace {opts['name']!r} on server {opts['server']!r}")
        return ""

    def v3_client_list(self, opts: dict[str, str]) -> str:
        return "\n".join(f"{c['pid']} {c['server']} {c['namespace']}" for c in self.state["clients"].values())

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

    def _serve_conn(self, conn: socket.socket, route: tuple[str | None, str | None]) -> bool:
        """Answer one connection's lines; True when a command asked the daemon to quit."""
        try:
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            peer_uid: int | None = struct.unpack("3i", creds)[1]
        except OSError:
            peer_uid = None
        stop = False
        self.write_log("Accepting connection...")
        self.write_log("NEW UI")
        with conn, conn.makefile("rb") as reader:
            for raw in reader:
                line = raw.decode(errors="replace").strip()
                if not line:
                    continue
                self.write_log(f"Cmd:{line}")
                reply, stop = self.execute(line, route, peer_uid)
                if reply:
                    self.write_log(reply)
                self.save()
                conn.sendall(reply.encode() + _END)
                if stop:
                    break
        self.write_log("UI closed")
        return stop

    def serve(self) -> None:
        def on_term(signum: int, frame: Any) -> None:
            raise SystemExit(0)

        signal.signal(signal.SIGTERM, on_term)
        try:
            stop = False
            while not stop:
                ready, _, _ = select.select(list(self.sockets), [], [])
                for sock in ready:
                    conn, _ = sock.accept()
                    if self._serve_conn(conn, self.sockets[sock]):
                        stop = True
                        break
        finally:
            for sock in self.sockets:
                sock.close()
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


def _start_daemon(foreground: bool, protocol: int = 2, config: str | None = None) -> int:
    pipe, logdir = _pipe_dir(), _log_dir()
    servers: dict[str, dict[str, Any]] = {}
    if config is not None:
        try:
            servers = parse_v3_config(Path(config).read_text())
        except OSError as exc:
            print(f"Cannot read configuration file {config}: {exc.strerror}", file=sys.stderr)
            return 1
        except ConfigError as exc:
            print(f"Configuration error in {config}: {exc}", file=sys.stderr)
            return 1
    pipe.mkdir(parents=True, exist_ok=True)
    logdir.mkdir(parents=True, exist_ok=True)
    if _running_pid(pipe) is not None:
        print("An instance of this daemon is already running", file=sys.stderr)
        return 1
    sock_path = pipe / SOCKET_NAME
    main_sock = _bind(sock_path)
    if not foreground:
        pid = os.fork()
        if pid:
            return 0  # the socket listens already: clients can connect as soon as we return
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
    daemon = _Daemon(pipe, logdir, protocol, servers)
    daemon.sockets[main_sock] = (None, None)
    daemon.listen_v3()
    (pipe / PID_FILE).write_text(f"{os.getpid()}\n")
    daemon.write_log(f"Starting control daemon using socket {sock_path} (protocol {protocol})")
    daemon.write_log(f"To connect CUDA applications to this daemon, set env CUDA_MPS_PIPE_DIRECTORY={pipe}")
    daemon.save()
    daemon.serve()
    if not foreground:
        os._exit(0)
    return 0


def _send(lines: list[str], path: Path | None = None) -> tuple[int, list[str]]:
    """Send lines to the daemon; (0, replies) or (1, []) when no daemon answers."""
    try:
        sock = _connect(path or _pipe_dir() / SOCKET_NAME)
    except OSError:
        print("Cannot find MPS control daemon process", file=sys.stderr)
        return 1, []
    buf = b""
    replies: list[str] = []
    with sock:
        for line in lines:
            sock.sendall(line.strip().encode() + b"\n")
            while _END not in buf:
                chunk = sock.recv(65536)
                if not chunk:
                    return 0, replies  # the daemon went away (quit)
                buf += chunk
            reply, _, buf = buf.partition(_END)
            replies.append(reply.decode())
    return 0, replies


def _daemon_protocol() -> int:
    try:
        return int(json.loads((_pipe_dir() / STATE_FILE).read_text()).get("protocol", 2))
    except (OSError, ValueError):
        return 2


def _client() -> int:
    if _running_pid(_pipe_dir()) is not None and _daemon_protocol() == 3:
        # A v3 daemon takes module verb commands, not the legacy shell (NVIDIA: MPS v3 Interface).
        lines = [line.strip() for line in sys.stdin if line.strip()]
        if lines:
            print(f"Unrecognized command: {lines[0].split()[0]} (this daemon runs protocol 3)", file=sys.stderr)
            return 1
        return 0
    lines = [line for line in sys.stdin if line.strip()]
    rc, replies = _send(lines)
    for reply in replies:
        if reply:
            sys.stdout.write(reply + "\n")
    sys.stdout.flush()
    return rc


def _client_v3(words: list[str]) -> int:
    rc, replies = _send([" ".join(words)])
    if rc:
        return rc
    reply = replies[0] if replies else ""
    if reply.startswith(_ERROR):
        print(reply, file=sys.stderr)
        return 1
    if reply:
        print(reply)
    return 0


def connect_client(env: dict[str, str] | None = None) -> dict[str, Any]:
    """What libcuda does at CUDA start under MPS, for the fake: connect to the daemon at
    `$CUDA_MPS_PIPE_DIRECTORY/control` and register with this process's
    `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`; returns the client record the daemon keeps."""
    e = os.environ if env is None else env
    pipe = Path(e.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps")
    limit = e.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT") or "-"
    rc, replies = _send([f"{CLIENT_LINE} {os.getpid()} {limit.replace(' ', '')}"], pipe / SOCKET_NAME)
    if rc or not replies:
        raise OSError(f"no MPS daemon at {pipe}")
    if replies[0].startswith(REFUSED):
        raise PermissionError(replies[0])
    return json.loads(replies[0])  # type: ignore[no-any-return]


V3_HELP = """Usage: nvidia-cuda-mps-control [options] <module> <verb> [--key=value ...]
Options: -h, --help  -d, --daemon  -f, --foreground  -m, --multiuser  -a, --apply <file>
         -p, --protocol <2|3>  -q, --quit
Modules: server (create, delete, list, get, set), namespace (create, delete, list, get, set),
         client (list), partition (list)"""


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    protocol = 2
    config: str | None = None
    daemon: str | None = None
    want_help = quit_ = False
    rest: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("-p", "--protocol") and i + 1 < len(args):
            if not _v3_supported():
                print(f"Unrecognized option: {a}", file=sys.stderr)
                return 1
            protocol = int(args[i + 1]) if args[i + 1] in ("2", "3") else -1
            if protocol < 0:
                print(f"Invalid protocol: {args[i + 1]}", file=sys.stderr)
                return 1
            i += 2
            continue
        if a in ("-a", "--apply") and i + 1 < len(args) and _v3_supported():
            config = args[i + 1]
            i += 2
            continue
        if a in ("-d", "--daemon", "-f", "--foreground"):
            daemon = a
        elif a in ("-h", "--help"):
            want_help = True
        elif a in ("-q", "--quit") and _v3_supported():
            quit_ = True
        elif a.startswith("-") and not rest:
            print(f"Unrecognized option: {a}", file=sys.stderr)
            return 1
        else:
            rest.append(a)
        i += 1
    if _v3_supported() and os.environ.get("CUDA_MPS_PROTOCOL_VERSION") in ("2", "3"):
        protocol = int(os.environ["CUDA_MPS_PROTOCOL_VERSION"])  # the variable wins (NVIDIA docs)
    if want_help:
        print(V3_HELP if protocol == 3 else "Usage: nvidia-cuda-mps-control [-d | -f]")
        return 0
    if config is not None and protocol != 3:
        print("-a/--apply needs protocol 3", file=sys.stderr)
        return 1
    if daemon is not None:
        return _start_daemon(daemon in ("-f", "--foreground"), protocol, config)
    if quit_:
        return _client_v3(["-q"])
    if rest:
        if not _v3_supported() or _daemon_protocol() != 3:
            print(f"Unrecognized option: {rest[0]}", file=sys.stderr)
            return 1
        return _client_v3(rest)
    return _client()


def install_launcher(bin_dir: str | os.PathLike[str], python: str | None = None, v3: bool = False) -> Path:
    """Write `bin_dir/nvidia-cuda-mps-control` that runs this fake; returns its path.
    v3=True: a driver with MPS v3 (r615+); otherwise an older one that refuses `-p`.

    The fake (standard library only) runs from a copy beside the launcher, by the base
    interpreter behind a venv's symlink: the daemon runs as the job's user, who may not
    read the checkout or its venv (a clone under root's 0700 home)."""
    bin_path = Path(bin_dir)
    bin_path.mkdir(parents=True, exist_ok=True)
    lib = bin_path / "fake-mps-lib"
    (lib / "slurm_dlrm" / "emulated").mkdir(parents=True, exist_ok=True)
    for rel, text in (("slurm_dlrm/__init__.py", ""), ("slurm_dlrm/emulated/__init__.py", ""),
                      ("slurm_dlrm/emulated/mps_control.py", Path(__file__).read_text())):
        (lib / rel).write_text(text)
        (lib / rel).chmod(0o644)
    for folder in (lib, lib / "slurm_dlrm", lib / "slurm_dlrm" / "emulated"):
        folder.chmod(0o755)
    exe = bin_path / "nvidia-cuda-mps-control"
    exe.write_text(
        "#!/bin/sh\n"
        f"# Fake MPS control daemon for machines without a GPU ({MODULE}).\n"
        f"PYTHONPATH={shlex.quote(str(lib))}\n"
        "export PYTHONPATH\n"
        + (f"{ENV_V3}=1\nexport {ENV_V3}\n" if v3 else "")
        + f"exec {shlex.quote(_interpreter(python))} -m {MODULE} \"$@\"\n")
    exe.chmod(0o755)
    return exe


def _interpreter(python: str | None) -> str:
    """`python`, else the interpreter behind this one's venv symlink if any user may run
    it, else the system's python3 (3.11+, as Debian 12's) if present: the fake needs
    only the standard library."""
    if python:
        return python
    candidates = [os.path.realpath(sys.executable), "/usr/bin/python3"]
    for path in candidates:
        if os.path.exists(path) and _others_may_run(path):
            return path
    return candidates[0]


def _others_may_run(path: str) -> bool:
    p = Path(path)
    return all(os.stat(d).st_mode & 0o001 for d in [p, *p.parents])


if __name__ == "__main__":
    sys.exit(main())
