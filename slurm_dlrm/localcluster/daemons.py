"""Starting the cluster's daemons: one process each (munged here; MariaDB and slurmdbd
in `accounting.py`; slurmctld and the slurmd by `LocalCluster.up`), started with the
instance's marker in its environment, and awaited until its pid file names a live
process of ours. When one does not start, the error carries its log's `fatal:` line.

Apart from `cluster.py` because how one daemon is started, and why it failed, is
the same for every daemon and reads on its own.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path

from slurm_dlrm.localcluster.config import ClusterConfig, ClusterError
from slurm_dlrm.localcluster.processes import MARKER, is_ours, read_pid


def _daemon_env(c: ClusterConfig) -> dict[str, str]:
    env = dict(os.environ)
    env["SLURM_CONF"] = str(c.slurm_conf)
    env[MARKER] = str(c.state_dir)
    return env


def spawn(c: ClusterConfig, name: str, argv: list[str], *, daemonizes: bool, wait_s: float = 20.0) -> int:
    """Start one daemon; return its pid once its pid file names a live process of ours."""
    pid_file = c.run_dir / f"{name}.pid"
    with contextlib.suppress(FileNotFoundError):
        pid_file.unlink()
    out = open(c.log_dir / f"{name}.out", "ab")  # noqa: SIM115 - handed to the child
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,  # noqa: S603
                                stderr=subprocess.STDOUT, env=_daemon_env(c), start_new_session=True,
                                cwd=c.state_dir)
    except FileNotFoundError:
        raise ClusterError(f"{argv[0]} not found: run scripts/setup.sh (apt-get install "
                           "slurm-wlm munge mariadb-server slurmdbd)") from None
    finally:
        out.close()
    if not daemonizes:
        pid_file.write_text(f"{proc.pid}\n")
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if daemonizes and proc.poll() not in (None, 0):
            break
        pid = read_pid(pid_file)
        if pid is not None and is_ours(pid, c.state_dir):
            if daemonizes:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)  # reap the parent that forked the daemon
            return pid
        if not daemonizes and proc.poll() is not None:
            break
        time.sleep(0.1)
    logs = [c.log_dir / f"{name}.out", c.log_dir / f"{name}.log"]
    tail = _fatal_line(logs) or log_tail(logs[0]) or log_tail(logs[1])
    raise ClusterError(f"{name} did not start (see {c.log_dir}): {tail}")


def start_munged(c: ClusterConfig) -> None:
    key = c.etc_dir / "munge.key"
    if not key.exists():
        key.write_bytes(secrets.token_bytes(1024))
    key.chmod(0o400)
    spawn(c, "munged", ["munged", "--force", f"--socket={c.munge_socket}",
                        f"--pid-file={c.run_dir / 'munged.pid'}", f"--key-file={key}",
                        f"--log-file={c.log_dir / 'munged.log'}",
                        f"--seed-file={c.state_dir / 'munged.seed'}"], daemonizes=True)


def _fatal_line(paths: list[Path]) -> str:
    """The last `fatal:` line of a daemon's logs: why it stopped, which its last lines
    (config warnings printed after it) may not say."""
    found = ""
    for path in paths:
        with contextlib.suppress(OSError):
            for line in path.read_text(errors="replace").splitlines():
                if "fatal:" in line:
                    found = line.strip()
    return found


def log_tail(path: Path, lines: int = 3) -> str:
    """The last lines of a log file, joined on one line (empty if it cannot be read)."""
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


def which_missing() -> list[str]:
    """Binaries `up` needs that are not on PATH."""
    return [b for b in ("munged", "slurmctld", "slurmd", "sbatch", "scontrol") if shutil.which(b) is None]
