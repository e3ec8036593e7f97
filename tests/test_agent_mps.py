"""The MPS seam against the fake `nvidia-cuda-mps-control` executable (its real protocol)."""

import json
import os
import subprocess

import pytest

from slurm_dlrm.agent.mps import MpsDaemon, MpsError, open_mps
from slurm_dlrm.emulated import mps_control as fake_mps_control


@pytest.fixture
def fake_bin(tmp_path):
    bin_dir = tmp_path / "bin"
    fake_mps_control.install_launcher(bin_dir)
    return bin_dir


def _env(fake_bin, **extra):
    env = dict(os.environ, PATH=f"{fake_bin}:{os.environ['PATH']}")
    env.pop("CUDA_MPS_PIPE_DIRECTORY", None)
    env.update(extra)
    return env


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0] != "Z"


def test_own_daemon_start_commands_quit(fake_bin, tmp_path):
    setup = open_mps(True, ["3", "1"], tmp_path / "tmp", "job9", env=_env(fake_bin))
    assert setup.mode == "own" and setup.daemon is not None
    d = setup.daemon
    assert oct(d.pipe_dir.stat().st_mode & 0o777) == "0o700"
    pid = d.pid()
    assert pid and _alive(pid)
    state = json.loads((d.pipe_dir / fake_mps_control.STATE_FILE).read_text())
    assert state["visible_devices"] == ["3", "1"]  # the daemon got the allocation's GPUs
    assert d.server_list() == []
    d.set_default_active_thread_percentage(40)
    assert d.command("get_default_active_thread_percentage") == "40.0"
    d.set_default_device_pinned_mem_limit(1, 3000)
    assert d.command("get_default_device_pinned_mem_limit 1") == "2G"  # the driver shows whole GiB
    d.set_default_device_pinned_mem_limit(0, 700)
    assert d.command("get_default_device_pinned_mem_limit 0") == "700M"
    d.command(f"start_server -uid {os.getuid()}")
    (server,) = d.server_list()
    assert _alive(server)
    assert d.command(f"get_active_thread_percentage {server}") == "40.0"
    assert d.command(f"get_device_pinned_mem_limit {server} 1") == "2G"
    log = (d.log_dir / "control.log").read_text()
    assert "Cmd:set_default_active_thread_percentage 40" in log and "Starting control daemon using socket" in log
    d.quit()
    assert not _alive(pid) and not _alive(server)
    assert not d.root_dir.exists()  # pipe and log folders removed


def test_a_server_ends_with_its_daemon_killed_outright(fake_bin, tmp_path):
    import signal
    import time

    setup = open_mps(True, ["0"], tmp_path / "tmp", "job9", env=_env(fake_bin))
    assert setup.daemon is not None
    d = setup.daemon
    d.command(f"start_server -uid {os.getuid()}")
    (server,) = d.server_list()
    daemon_pid = d.pid()
    assert daemon_pid and _alive(server)
    os.kill(daemon_pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _alive(server) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(server), "the fake MPS server outlived its control daemon"


def test_a_second_daemon_on_the_same_pipe_is_refused(fake_bin, tmp_path):
    env = _env(fake_bin, CUDA_MPS_PIPE_DIRECTORY=str(tmp_path / "p"), CUDA_MPS_LOG_DIRECTORY=str(tmp_path / "l"))
    exe = str(fake_bin / "nvidia-cuda-mps-control")
    assert subprocess.run([exe, "-d"], env=env, timeout=20).returncode == 0  # noqa: S603
    try:
        second = subprocess.run([exe, "-d"], env=env, capture_output=True, text=True, timeout=20)  # noqa: S603
        assert second.returncode == 1 and "already running" in second.stderr
        reply = subprocess.run([exe], input="bogus_command\nget_server_list\n", env=env, capture_output=True,  # noqa: S603
                               text=True, timeout=20)
        assert "Unrecognized command: bogus_command" in reply.stdout
    finally:
        subprocess.run([exe], input="quit\n", env=env, text=True, timeout=20)  # noqa: S603
    gone = subprocess.run([exe], input="get_server_list\n", env=env, capture_output=True, text=True, timeout=20)  # noqa: S603
    assert gone.returncode == 1 and "Cannot find MPS control daemon" in gone.stderr


def test_off_when_disabled_or_missing(fake_bin, tmp_path):
    assert open_mps(False, ["0"], tmp_path, "t", env=_env(fake_bin)).mode == "off"
    setup = open_mps(True, ["0"], tmp_path, "t", env={"PATH": str(tmp_path / "empty")})
    assert setup.mode == "off" and "not found" in setup.detail
    assert list(tmp_path.glob("mps-*")) == []


def test_site_daemon_is_used_and_left_running(fake_bin, tmp_path):
    pipe, logs = tmp_path / "site-pipe", tmp_path / "site-log"
    env = _env(fake_bin, CUDA_MPS_PIPE_DIRECTORY=str(pipe), CUDA_MPS_LOG_DIRECTORY=str(logs))
    exe = str(fake_bin / "nvidia-cuda-mps-control")
    subprocess.run([exe, "-d"], env=env, timeout=20, check=True)  # noqa: S603
    try:
        setup = open_mps(True, ["0", "1"], tmp_path / "tmp", "t", env=env)
        assert setup.mode == "site" and setup.daemon is not None and setup.daemon.pipe_dir == pipe
        setup.daemon.quit()  # not ours: a no-op
        assert setup.daemon.server_list() == []
        assert list((tmp_path / "tmp").glob("mps-*")) == []
    finally:
        subprocess.run([exe], input="quit\n", env=env, text=True, timeout=20)  # noqa: S603
    # gres/mps mode without an answering daemon: run without MPS and say why.
    setup = open_mps(True, ["0"], tmp_path / "tmp", "t", env=env, site_mode="site")
    assert setup.mode == "off" and "no MPS daemon answers" in setup.detail


def test_a_refused_command_raises(fake_bin, tmp_path):
    d = MpsDaemon(tmp_path / "nopipe", tmp_path / "nolog", str(fake_bin / "nvidia-cuda-mps-control"), owned=True)
    with pytest.raises(MpsError, match="Cannot find MPS control daemon"):
        d.server_list()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to another user")
def test_a_client_of_another_user_connects_from_a_folder_it_cannot_enter(tmp_path):
    # A fresh clone under root's 0700 home: a forked client that drops to nobody keeps
    # that folder as its working directory and must still reach the daemon's socket.
    import pwd
    import shutil
    import tempfile
    from pathlib import Path

    short = Path(tempfile.mkdtemp(prefix="mpsc", dir="/tmp"))
    short.chmod(0o755)
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    nobody = pwd.getpwnam("nobody")
    fake_mps_control.install_launcher(short / "bin")
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(short / "p"), CUDA_MPS_LOG_DIRECTORY=str(short / "l"))
    subprocess.run([str(short / "bin" / "nvidia-cuda-mps-control"), "-d"], env=env, check=True, timeout=30)  # noqa: S603
    try:
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                os.close(rfd)
                os.chdir(private)
                os.setgid(nobody.pw_gid)
                os.setuid(nobody.pw_uid)
                os.write(wfd, json.dumps(fake_mps_control.connect_client(
                    {"CUDA_MPS_PIPE_DIRECTORY": str(short / "p")})).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(wfd)
        with os.fdopen(rfd) as r:
            text = r.read()
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0 and json.loads(text)
    finally:
        subprocess.run([str(short / "bin" / "nvidia-cuda-mps-control")], input="quit\n", text=True, env=env,  # noqa: S603
                       timeout=30, check=False)
        shutil.rmtree(short, ignore_errors=True)
