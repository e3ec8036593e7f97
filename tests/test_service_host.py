"""The packing service names its host (issue 24): several login nodes see one store folder.

A live process holds the service lock and its status names another host: from here
the service is reported as running there, and neither `serve stop` nor a `submit`'s
wake signals its pid (on this host that pid is some other process: here, the holder,
which SIGTERM or SIGUSR1 would kill).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from service_harness import write_site_file

from slurm_dlrm.cli import cli
from slurm_dlrm.service.daemon import (
    ServiceElsewhere,
    ServiceLock,
    ServicePaths,
    elsewhere,
    read_status,
    running_pid,
    stop,
    this_host,
    wake,
)
from slurm_dlrm.service.submit import ensure_service, service_paths
from slurm_dlrm.site import load_site
from slurm_dlrm.store.store import current_user

OTHER = "login2.example.org"

_HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from slurm_dlrm.service.daemon import ServiceLock, ServicePaths, read_status, write_status
    paths = ServicePaths(Path(sys.argv[1]))
    lock = ServiceLock.acquire(paths)
    assert lock is not None
    write_status(paths, {**read_status(paths), "host": sys.argv[2], "last_round_t": time.time(), "rounds": 3})
    print("ready", flush=True)
    time.sleep(120)
""")


@pytest.fixture
def site_file(tmp_path, monkeypatch) -> Path:
    path = write_site_file(tmp_path)
    monkeypatch.setenv("SLURM_DLRM_SITE", str(path))
    return path


def _hold(store_dir: Path, host: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(store_dir), host],  # noqa: S603
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


@pytest.fixture
def held_elsewhere(site_file) -> Iterator[tuple[ServicePaths, subprocess.Popen[str]]]:
    paths = service_paths(load_site(site_file), current_user())
    proc = _hold(paths.store_dir, OTHER)
    try:
        yield paths, proc
    finally:
        proc.kill()
        proc.wait()


def test_the_lock_holder_names_its_host(tmp_path):
    paths = ServicePaths(tmp_path / "store")
    with ServiceLock.acquire(paths) as lock:
        assert lock is not None
        st = read_status(paths)
        assert st["host"] == this_host() and st["pid"] == os.getpid()
        assert elsewhere(paths) is None and running_pid(paths) == os.getpid()


def test_a_service_on_another_host_is_never_signalled_from_here(held_elsewhere):
    paths, holder = held_elsewhere
    assert elsewhere(paths) == OTHER
    assert running_pid(paths) == holder.pid  # the pid file's, not checked here
    with pytest.raises(ServiceElsewhere, match=f"runs on host {OTHER} \\(pid {holder.pid}\\), not on this one"):
        stop(paths, timeout_s=1)
    assert wake(paths) is False
    assert holder.poll() is None  # neither SIGTERM nor SIGUSR1 reached it


def test_submit_leaves_a_service_on_another_host_alone(held_elsewhere, site_file):
    paths, holder = held_elsewhere
    assert ensure_service(load_site(site_file), current_user()) == f"running on host {OTHER}"
    assert holder.poll() is None and read_status(paths)["host"] == OTHER


def test_serve_stop_on_another_host_is_one_line_exit_1(held_elsewhere, site_file):
    _, holder = held_elsewhere
    out = subprocess.run([sys.executable, "-m", "slurm_dlrm", "serve", "stop"], capture_output=True,  # noqa: S603
                         text=True, timeout=60, env={**os.environ, "SLURM_DLRM_SITE": str(site_file)})
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        f"slurm-dlrm: error: packing service: it runs on host {OTHER} (pid {holder.pid}), not on this one "
        f"({this_host()}); run this command on {OTHER}"]
    assert holder.poll() is None


def test_serve_status_says_where_it_runs(held_elsewhere):
    _, holder = held_elsewhere
    text = CliRunner().invoke(cli, ["serve", "status"])
    assert text.exit_code == 0
    assert f"running on host {OTHER}, not this one ({this_host()}) (pid {holder.pid})" in text.output
    data = json.loads(CliRunner().invoke(cli, ["serve", "status", "--json"]).output)
    assert data["running"] and data["host"] == OTHER and data["this_host"] == this_host()
    assert data["on_this_host"] is False and data["pid"] == holder.pid


def test_serve_status_on_this_host(site_file):
    paths = service_paths(load_site(site_file), current_user())
    holder = _hold(paths.store_dir, this_host())
    try:
        data = json.loads(CliRunner().invoke(cli, ["serve", "status", "--json"]).output)
        assert data["on_this_host"] is True and data["host"] == this_host() and data["pid"] == holder.pid
        assert f"running on host {this_host()} (pid {holder.pid})" in CliRunner().invoke(cli, ["serve", "status"]).output
    finally:
        holder.kill()
        holder.wait()
    # Lock gone with the holder: not running; the status file still names where it ran.
    result = CliRunner().invoke(cli, ["serve", "status"])
    assert result.exit_code == 1 and result.output.strip() == "packing service: not running"


def test_status_of_another_host_with_no_lock_seen_here(site_file):
    """NFS without shared locks: the lock is not seen, the status file tells where it ran."""
    paths = service_paths(load_site(site_file), current_user())
    holder = _hold(paths.store_dir, OTHER)
    holder.kill()
    holder.wait()
    result = CliRunner().invoke(cli, ["serve", "status"])
    assert result.exit_code == 1
    assert result.output.startswith(f"packing service: not running (last seen on host {OTHER}, ")
