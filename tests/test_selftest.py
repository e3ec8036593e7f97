"""`slurm-dlrm selftest`: the verdict logic, the site-file writer, the run against the fakes.

No GPU here: the MPS daemon is the fake `nvidia-cuda-mps-control`, NVML the fake, and for
the GPU steps `tests/fake_cuda_probe.py` plays the CUDA clients (it reads the MPS
variables the agent's member_env sets and behaves as MPS would, or as a broken node).
"""

from __future__ import annotations

import importlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_dlrm.cli import cli
from slurm_dlrm.emulated import mps_control as fake_mps_control
from slurm_dlrm.emulated import nvml as fake_nvml
from slurm_dlrm.errors import BadInput
from slurm_dlrm.estimate import estimate
from slurm_dlrm.selftest import run as run_mod
from slurm_dlrm.selftest import verdict as V
from slurm_dlrm.selftest.sitefile import check_writable, update_gpu_model_text, write_gpu_model
from slurm_dlrm.selftest.submit import batch_script, submit_and_wait
from slurm_dlrm.site import REPO_SITE_FILE, load_site
from slurm_dlrm.slurm.fake import FakeSlurm
from slurm_dlrm.spec import parse_spec

FAKE_PROBE = Path(__file__).resolve().parent / "fake_cuda_probe.py"


# ---------------------------------------------------------------- verdict (pure)


def test_fence_judgement():
    assert V.judge_fence({"event": "oom", "allocated_mib": 1024}, 1024)[0] == V.PASS
    assert V.judge_fence({"event": "oom", "allocated_mib": 800}, 1024)[0] == V.PASS  # within max(256, 25 %)
    status, figure, fix = V.judge_fence({"event": "no_oom", "allocated_mib": 4096}, 1024)
    assert status == V.FAIL and "not enforced" in fix and "4096" in figure
    assert V.judge_fence({"event": "oom", "allocated_mib": 200}, 1024)[0] == V.FAIL  # a full GPU, not the fence
    assert V.judge_fence({"event": "oom", "allocated_mib": 1100}, 1024)[0] == V.FAIL  # past the limit
    assert V.judge_fence(None, 1024)[0] == V.FAIL


def test_scaling_judgement_counts_whole_sms():
    assert V.expected_ratio(25, 50, None) == 2.0
    assert V.expected_ratio(25, 50, 108) == 54 / 27
    assert V.expected_ratio(25, 50, 80) == 40 / 20
    assert round(V.expected_ratio(30, 50, 132), 3) == round(66 / 40, 3)  # 39.6 SMs -> 40
    assert V.judge_scaling(10.0, 20.0, 25, 50, 132)[0] == V.PASS
    assert V.judge_scaling(10.0, 17.0, 25, 50, 132)[0] == V.PASS  # -15 %: clocks and rounding
    status, figure, fix = V.judge_scaling(10.0, 10.5, 25, 50, 132)  # the share does not throttle
    assert status == V.FAIL and "ratio 1.05" in figure and "THREAD_PERCENTAGE" in fix
    assert V.judge_scaling(None, 10.0, 25, 50, 132)[0] == V.FAIL


def test_estimate_judgement_is_never_under():
    assert V.judge_estimate(1000, 1500, 950, 1400)[0] == V.PASS
    status, err_r, err_n = V.judge_estimate(900, 1400, 1000, 1500)
    assert status == V.FAIL and err_r == -10.0 and round(err_n or 0, 2) == -6.67
    assert V.judge_estimate(2000, 2500, 1000, 1500)[0] == V.FAIL  # far over: wasted memory
    assert V.judge_estimate(1000, 1500, 950, None)[0] == V.PASS


def test_verdict_and_exit_code():
    dry = V.Check("nvml.driver", V.DRY, "driver 550")
    skip = V.Check("mps.memory_fence", V.SKIP, "not measured")
    ok = V.Check("calibration.compute", V.PASS, "30 TFLOP/s")
    bad = V.Check("mps.thread_share_scaling", V.FAIL, "ratio 1.0", fix="...")
    assert V.exit_code([dry, skip]) == 0 and not V.accepted([dry, skip])
    assert "NOT accepted" in V.summary([dry, skip, ok])["text"]
    assert V.accepted([ok]) and V.exit_code([ok]) == 0
    assert V.exit_code([ok, bad]) == 1 and V.summary([ok, bad])["counts"]["FAIL"] == 1
    with pytest.raises(ValueError):
        V.Check("x", V.FAIL, "y")  # a FAIL must say what to fix
    with pytest.raises(ValueError):
        V.Check("x", "PASS (fake)", "y")


# ---------------------------------------------------------------- the site file


SITE_TEXT = REPO_SITE_FILE.read_text()


def test_site_update_keeps_comments_and_other_keys():
    text = update_gpu_model_text(SITE_TEXT, "a100", {"cuda_context_mib": 432, "gemm_efficiency": 0.61234,
                                                     "kernel_launch_us": 4.5})
    before, after = SITE_TEXT.splitlines(), text.splitlines()
    changed = [(b, a) for b, a in zip(before, after, strict=False) if b != a]
    assert changed[0] == ("cuda_context_mib = 450", "cuda_context_mib = 432")
    assert "gemm_efficiency = 0.6123  # measured by slurm-dlrm selftest" in text
    data = tomllib.loads(text)
    assert data["gpu_models"]["a100"]["kernel_launch_us"] == 4.5
    assert data["gpu_models"]["h100"] == tomllib.loads(SITE_TEXT)["gpu_models"]["h100"]
    # every comment line of the original is still there
    assert [x for x in before if x.lstrip().startswith("#")] == [x for x in after if x.lstrip().startswith("#")]
    again = update_gpu_model_text(text, "h100", {"cuda_context_mib": 500})
    assert "cuda_context_mib = 500              # CUDA context + kernels loaded at first use" in again
    with pytest.raises(BadInput, match=r"no \[gpu_models.v100\]"):
        update_gpu_model_text(SITE_TEXT, "v100", {"cuda_context_mib": 1})


def test_written_figures_drive_the_compute_profile(tmp_path):
    site_file = tmp_path / "site.toml"
    site_file.write_text(SITE_TEXT)
    site_file.chmod(0o640)
    # Wide MLPs: compute-bound, so the step time follows the GEMM efficiency.
    spec = parse_spec({"name": "p", "tables": [{"rows": 100000, "dim": 64}], "dense_features": 13,
                       "bottom_mlp": [4096, 4096, 64], "top_mlp": [4096, 4096, 1], "batch_size": 8192})
    h100 = load_site(site_file).gpu_model("h100")
    before = estimate(spec, h100).profile
    write_gpu_model(site_file, "h100", {"gemm_efficiency": 0.25, "gather_bandwidth_gbps": 670.0,
                                        "stream_bandwidth_gbps": 3000.0, "kernel_launch_us": 4.0})
    assert site_file.stat().st_mode & 0o777 == 0o640
    assert not list(tmp_path.glob(".site.toml.*"))  # no temporary left
    measured = load_site(site_file).gpu_model("h100")
    assert measured.gemm_efficiency == 0.25 and measured.kernel_launch_us == 4.0
    after = estimate(spec, measured).profile
    assert before.label == after.label == "compute-bound"
    assert 1.8 < before.solo_samples_per_s / after.solo_samples_per_s < 2.05  # 0.25 measured, 0.5 assumed


def test_a_bad_update_leaves_the_file_alone(tmp_path):
    site_file = tmp_path / "site.toml"
    site_file.write_text(SITE_TEXT)
    with pytest.raises(Exception, match="would not load"):
        write_gpu_model(site_file, "h100", {"gemm_efficiency": 7.0})  # above the key's bound
    assert site_file.read_text() == SITE_TEXT


def _as_nobody(fn) -> int:
    """Run fn() in a forked child with nobody's uid; its exit code (tests that need a non-root writer)."""
    nobody = pwd.getpwnam("nobody")
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            code = fn()
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_site_file_without_write_access(tmp_path):
    # pytest's own folders are 0700 to root: a folder nobody can read but not write.
    folder = Path(tempfile.mkdtemp(prefix="selftest-ro-"))
    folder.chmod(0o755)
    site_file = folder / "site.toml"
    site_file.write_text(SITE_TEXT)
    site_file.chmod(0o644)
    runner = CliRunner()

    # The child runs as nobody, who may not read the checkout (a clone under root's 0700
    # home): what the command imports is imported here first, and it reads this site file.
    for module in ("slurm_dlrm.commands.selftest", "slurm_dlrm.selftest.verdict", "slurm_dlrm.selftest.run",
                   "slurm_dlrm.selftest.submit", "slurm_dlrm.selftest.sitefile", "slurm_dlrm.slurm",
                   "rich.console", "rich.table", "getpass"):
        importlib.import_module(module)

    def attempt() -> int:
        result = runner.invoke(cli, ["selftest", "--fake", "--site", str(site_file), "--write-site", str(site_file)])
        ok = result.exit_code == 2 and "no write access" in result.output and len(result.output.splitlines()) == 1
        return 0 if ok else 1

    if os.geteuid() == 0:
        assert _as_nobody(attempt) == 0
    else:
        site_file.chmod(0o444)
        assert attempt() == 0
    assert site_file.read_text() == SITE_TEXT
    shutil.rmtree(folder)
    with pytest.raises(BadInput, match="no such file"):
        check_writable(tmp_path / "missing.toml")


# ---------------------------------------------------------------- runs against the fakes


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0] != "Z"


def _fake_daemons() -> set[int]:
    """Fake MPS control daemons this test process started (other sessions share the machine)."""
    ours = f"{tempfile.gettempdir()}/mps-st{os.getpid()}-".encode()
    out = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                argv = Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0")
                env = Path(f"/proc/{d}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"slurm_dlrm.emulated.mps_control" in argv and b"-d" in argv and any(
                    e.startswith(b"CUDA_MPS_PIPE_DIRECTORY=" + ours) for e in env):
                out.add(int(d))
    return out


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for var in ("CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "GPU_DEVICE_ORDINAL",
                "CUDA_MPS_PIPE_DIRECTORY", fake_nvml.ENV_FAKE_NVML, "SLURM_JOB_ID"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


def _run_json(*args: str) -> tuple[int, dict]:
    result = CliRunner().invoke(cli, ["selftest", "--json", *args])
    return result.exit_code, json.loads(result.output) if result.output.startswith("{") else {"raw": result.output}


def test_fake_run_is_dry_never_pass_and_leaves_nothing(clean_env):
    code, data = _run_json("--fake")
    assert code == 0, data
    status = {c["name"]: c["status"] for c in data["checks"]}
    assert V.PASS not in status.values()  # nothing measured on hardware
    for name in ("nvml.driver", "nvml.gpu_model", "nvml.gpu_idle", "nvml.compute_mode", "mps.daemon_start",
                 "mps.nvml_sees_clients",
                 "mps.daemon_shutdown"):
        assert status[name] == V.DRY, name
    for name in ("mps.memory_fence", "mps.neighbour_runs_on", "mps.thread_share_scaling", "calibration.compute",
                 "estimator.st-dot-adam", "estimator.cuda_context"):
        assert status[name] == V.SKIP, name
    assert not data["verdict"]["accepted"] and "NOT accepted" in data["verdict"]["text"]
    started = next(c for c in data["checks"] if c["name"] == "mps.daemon_start")["values"]
    assert not _alive(started["daemon_pid"]) and not Path(started["root_dir"]).exists()
    assert _fake_daemons() == set()
    table = CliRunner().invoke(cli, ["selftest", "--fake"])
    assert table.exit_code == 0 and "DRY" in table.output and "NOT accepted" in table.output


def test_fences_capabilities_are_detected_and_a_required_one_missing_fails(clean_env, monkeypatch):
    from slurm_dlrm.site import REPO_SITE_FILE

    code, data = _run_json("--fake")
    fences = next(c for c in data["checks"] if c["name"] == "fences.capabilities")
    # the default fake control daemon is a pre-r615 driver: no v3; no GPU: nothing said of a node
    assert fences["status"] == V.DRY and fences["values"]["mps_v3"] is False and "MPS v3: no" in fences["figure"]
    site = clean_env / "site.toml"
    site.write_text(REPO_SITE_FILE.read_text().replace('mode = "auto"', 'mode = "v3"', 1))
    monkeypatch.setenv("SLURM_DLRM_SITE", str(site))
    code, data = _run_json("--fake")
    fences = next(c for c in data["checks"] if c["name"] == "fences.capabilities")
    assert code == 1 and fences["status"] == V.FAIL and "mps.mode = v3" in fences["fix"]
    assert _fake_daemons() == set()


def test_without_nvml_and_mps_it_fails_and_says_what_to_fix(clean_env, monkeypatch):
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("this machine has a working NVML")
    except pynvml.NVMLError:
        pass
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no nvidia-cuda-mps-control
    code, data = _run_json()
    checks = {c["name"]: c for c in data["checks"]}
    assert code == 1
    assert checks["nvml.driver"]["status"] == V.FAIL and "--fake" in checks["nvml.driver"]["fix"]
    assert checks["mps.daemon_start"]["status"] == V.FAIL and "nvidia-cuda-mps-control" in checks["mps.daemon_start"]["fix"]


def test_bad_gpu_index_is_one_line_and_starts_nothing(clean_env):
    result = CliRunner().invoke(cli, ["selftest", "--fake", "--gpu", "3"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "slurm-dlrm: error: --gpu 3: no such GPU here (this allocation has 1: 0)"]
    assert _fake_daemons() == set()


def test_another_users_daemon_refuses_and_starts_none(clean_env, tmp_path, monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("needs root to run a daemon as another user")
    folder = Path(tempfile.mkdtemp(prefix="selftest-other-"))  # pytest's folders are 0700 to root
    folder.chmod(0o777)
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(folder / "p"), CUDA_MPS_LOG_DIRECTORY=str(folder / "l"))
    # the launcher runs a copy of the fake nobody can read (the checkout may be private)
    launcher = fake_mps_control.install_launcher(folder / "bin")
    as_nobody = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", str(launcher)]
    subprocess.run([*as_nobody, "-d"], env=env, check=True, timeout=30)  # noqa: S603
    started = []
    monkeypatch.setattr(run_mod, "open_mps", lambda *a, **k: started.append(a))
    try:
        result = CliRunner().invoke(cli, ["selftest", "--fake"])
        assert result.exit_code == 1
        (line,) = result.output.strip().splitlines()
        assert line.startswith("slurm-dlrm: error: MPS: a control daemon or server of user nobody")
        assert started == []  # ours never started
    finally:
        subprocess.run(as_nobody, input="quit\n", text=True, env=env, timeout=30, check=False)  # noqa: S603
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def gpu_node(clean_env, monkeypatch):
    """The fakes as if they were a GPU node: the selftest's hardware path with fake CUDA clients."""
    monkeypatch.setattr(run_mod, "probe_argv", lambda role, *a: [sys.executable, str(FAKE_PROBE), role, *a])
    monkeypatch.setattr(run_mod, "is_fake_mps_control", lambda path: False)
    monkeypatch.setattr(run_mod.Nvml, "is_fake", property(lambda self: False))
    monkeypatch.setenv("FAKE_CUDA_MODEL", "h100")
    monkeypatch.setattr(run_mod, "BENCH_SECONDS", 0.1)
    return clean_env


def test_gpu_path_passes_and_writes_the_site(gpu_node, tmp_path, monkeypatch):
    site_file = tmp_path / "site.toml"
    site_file.write_text(SITE_TEXT)
    code, data = _run_json("--fake", "--write-site", str(site_file))
    checks = {c["name"]: c for c in data["checks"]}
    assert code == 0, [(c["name"], c["status"], c["figure"], c["detail"]) for c in data["checks"]]
    assert data["verdict"]["accepted"], data["verdict"]
    assert "ratio 2.00, expected 2.00" in checks["mps.thread_share_scaling"]["figure"]
    assert checks["mps.memory_fence"]["values"]["allocated_mib"] == 2048  # the member_env limit for that client
    assert "468 MiB" in checks["estimator.cuda_context"]["figure"]
    written = load_site(site_file).gpu_model("h100")
    assert written.gemm_efficiency == round(30.0 / 67.0, 4) and written.cuda_context_mib == 468
    assert written.kernel_launch_us == 5.5 and written.cublas_workspace_mib == 8.0
    assert _fake_daemons() == set()


def test_gpu_path_broken_node_fails_with_fixes_and_stops_the_daemon(gpu_node, monkeypatch):
    monkeypatch.setenv("FAKE_CUDA_BROKEN", "share,fence,neighbour,estimate")
    code, data = _run_json("--fake")
    checks = {c["name"]: c for c in data["checks"]}
    assert code == 1
    for name in ("mps.thread_share_scaling", "mps.memory_fence", "mps.neighbour_runs_on", "estimator.st-dot-adam"):
        assert checks[name]["status"] == V.FAIL and checks[name]["fix"], name
    assert checks["mps.daemon_shutdown"]["status"] == V.PASS
    assert _fake_daemons() == set()


# ---------------------------------------------------------------- --submit (the Slurm seam's fake)


def test_submit_refuses_a_partition_without_gpus(tmp_path):
    slurm = FakeSlurm(gpus_per_node=0)
    with pytest.raises(BadInput, match="has no GPUs"):
        submit_and_wait(slurm, "dlrm", None, [], tmp_path, [], 10)
    with pytest.raises(BadInput, match="no such partition"):
        submit_and_wait(FakeSlurm(), "gpuq", None, [], tmp_path, [], 10)
    assert slurm.submitted == []


def test_batch_script_quotes_every_value(tmp_path):
    weird = tmp_path / "a b;'$(x)"
    script = batch_script(["--write-site", str(weird / "site.toml")], weird / "selftest-root-")
    out = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True, check=False)
    assert out.returncode == 0, out.stderr
    assert "#SBATCH --job-name=slurm-dlrm-selftest" in script
    # Run the command line with a stub in place of python: the arguments arrive intact.
    stub = script.replace(sys.executable, "printf '%s\\n'", 1)
    weird.mkdir()
    subprocess.run(["bash", "-c", stub], env={"SLURM_JOB_ID": "7", "PATH": os.environ["PATH"]}, check=True)  # noqa: S603
    lines = (weird / "selftest-root-7.json").read_text().splitlines()
    assert lines[-1] == str(weird / "site.toml")


_SIGTERM_DRIVER = """
import sys
from slurm_dlrm.selftest import run as run_mod
# a GPU node whose first CUDA client hangs: the selftest waits in the MPS step
run_mod.probe_argv = lambda role, *a: ["sh", "-c", "exec sleep 600", "probe"]
run_mod.is_fake_mps_control = lambda path: False
run_mod.Nvml.is_fake = property(lambda self: False)
run_mod.Selftest.check_calibration = lambda self: None
try:
    run_mod.run_selftest(run_mod.Options(fake=True))
except run_mod.Stopped as exc:
    print(exc, file=sys.stderr)
    sys.exit(1)
"""


def test_sigterm_stops_the_daemon_and_the_clients(clean_env):
    env = dict(os.environ)
    proc = subprocess.Popen([sys.executable, "-c", _SIGTERM_DRIVER], env=env, stderr=subprocess.PIPE, text=True)  # noqa: S603
    ours = f"{tempfile.gettempdir()}/mps-st{proc.pid}-".encode()
    daemon, sleeper = None, None
    deadline = time.monotonic() + 120  # generous: the whole suite and the Slurm legs may share 2 cores
    while time.monotonic() < deadline and (daemon is None or sleeper is None) and proc.poll() is None:
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                argv = Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0")
                environ = Path(f"/proc/{d}/environ").read_bytes()
            except OSError:
                continue
            if b"CUDA_MPS_PIPE_DIRECTORY=" + ours in environ:
                if b"-d" in argv and b"slurm_dlrm.emulated.mps_control" in argv:
                    daemon = int(d)
                elif argv[:2] == [b"sleep", b"600"]:
                    sleeper = int(d)  # the hanging client, in the agent's member environment
        time.sleep(0.1)
    if not (daemon and sleeper):
        proc.kill()
        raise AssertionError(f"the selftest never reached its MPS clients (exit {proc.wait()}): "
                             f"{proc.stderr.read() if proc.stderr else ''}")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "stopped by SIGTERM" in err
    assert not _alive(daemon) and not _alive(sleeper)
    assert not list(Path(tempfile.gettempdir()).glob(f"mps-st{proc.pid}-*"))


def test_gpus_requested_and_a_gpu_the_job_will_not_have():
    from slurm_dlrm.selftest.submit import gpus_requested

    assert gpus_requested(None) == 1 and gpus_requested("gpu:h100:2") == 2 and gpus_requested("gpu:3,mps:50") == 3
    assert gpus_requested("gpu") == 1
    with pytest.raises(BadInput, match="asks for no GPU"):
        gpus_requested("mps:50")
    result = CliRunner().invoke(cli, ["selftest", "--submit", "-p", "dlrm", "--gpu", "1"])
    assert result.exit_code == 2
    assert result.output.strip() == "slurm-dlrm: error: --gpu 1: the job asks for 1 GPU(s) (--gres gpu:1)"


def test_probe_runs_the_runner_and_reports_cuda_errors_as_events(tmp_path):
    """The real probe, without a GPU: the estimate role drives the runner (on the CPU), and a
    CUDA role reports CUDA's absence as an `error` event the parent shows, not a traceback."""
    pytest.importorskip("torchrec")
    data = run_mod.estimator_spec(dict(run_mod.ESTIMATOR_SPECS[1]), steps=2)
    data["tables"] = [{"rows": 1000, "dim": 64}]
    data["batch_size"] = 64
    (tmp_path / "spec.json").write_text(json.dumps(data))
    status = tmp_path / "events.jsonl"
    base = [sys.executable, "-m", "slurm_dlrm.selftest.probe"]
    out = subprocess.run([*base, "estimate", "--device", "cpu", "--spec", str(tmp_path / "spec.json"),  # noqa: S603
                          "--workdir", str(tmp_path), "--steps", "2", "--status", str(status)],
                         capture_output=True, text=True, timeout=300, check=False)
    events = [json.loads(x) for x in status.read_text().splitlines()]
    assert out.returncode == 0, out.stderr[-2000:]
    assert events[-1]["event"] == "estimate" and events[-1]["exit_code"] == 0 and events[-1]["steps"] == 2
    assert events[-1]["spec"] == "st-dcn-rowwise"
    if not subprocess.run([sys.executable, "-c", "import torch,sys; sys.exit(torch.cuda.is_available())"],  # noqa: S603
                          check=False).returncode:
        bench = subprocess.run([*base, "bench", "--seconds", "0.1"], capture_output=True, text=True,  # noqa: S603
                               timeout=120, check=False)
        (event,) = [json.loads(x) for x in bench.stdout.splitlines() if '"error"' in x]
        assert bench.returncode == 1 and event["event"] == "error" and event["error"]


def test_probe_without_torchrec_says_unavailable_not_error(tmp_path):
    """A GPU machine with torch alone (scripts/gpu-check.sh's): the estimate role says the
    runner's libraries are missing, as an "unavailable" event, not as a broken node."""
    pytest.importorskip("torch")
    data = run_mod.estimator_spec(dict(run_mod.ESTIMATOR_SPECS[0]), steps=2)
    (tmp_path / "spec.json").write_text(json.dumps(data))
    status = tmp_path / "events.jsonl"
    argv = ["estimate", "--device", "cpu", "--spec", str(tmp_path / "spec.json"), "--workdir", str(tmp_path),
            "--status", str(status)]
    code = ("import sys; sys.modules['torchrec'] = None\n"
            "from slurm_dlrm.selftest import probe\n"
            f"sys.exit(probe.main({argv!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,  # noqa: S603
                         check=False)
    (event,) = [json.loads(x) for x in status.read_text().splitlines()]
    assert out.returncode == 0, out.stderr[-2000:]
    assert event["event"] == "unavailable" and event["reason"].startswith("torchrec is not installed")


def test_gpu_path_without_torchrec_skips_the_runner_specs_and_says_why(gpu_node, monkeypatch):
    monkeypatch.setenv("FAKE_CUDA_BROKEN", "torchrec")
    code, data = _run_json("--fake")
    checks = {c["name"]: c for c in data["checks"]}
    assert code == 0, [(c["name"], c["status"], c["figure"]) for c in data["checks"] if c["status"] == V.FAIL]
    for overrides in run_mod.ESTIMATOR_SPECS:
        check = checks[f"estimator.{overrides['name']}"]
        assert check["status"] == V.SKIP and "torchrec is not installed" in check["detail"]
    assert checks["estimator.cuda_context"]["status"] == V.SKIP
    assert checks["mps.memory_fence"]["status"] == V.PASS  # the other steps still ran
    assert not data["verdict"]["accepted"]  # a SKIP is never an acceptance
    assert _fake_daemons() == set()


def test_the_estimator_specs_cover_what_the_issue_asks():
    specs = [parse_spec(run_mod.estimator_spec(o, 5)) for o in run_mod.ESTIMATOR_SPECS]
    assert {s.interaction.type for s in specs} == {"dot", "dcn"}
    assert any(s.optimizer.type == "adam" and s.optimizer.fused for s in specs)
    assert any(s.optimizer.type == "rowwise_adagrad" for s in specs)
    assert any(s.mixed_precision == "bf16" for s in specs)
    h100 = load_site().gpu_model("h100")
    for s in specs:  # small: each fits one GPU many times over, and runs in seconds
        assert estimate(s, h100).gpu_peak_bytes < 2 * (1 << 30)
        assert s.checkpoint_every_steps == 0 and s.steps == 5


def test_gpu_path_when_cuda_does_not_start_says_why(gpu_node, monkeypatch):
    monkeypatch.setenv("FAKE_CUDA_BROKEN", "cuda")
    code, data = _run_json("--fake")
    checks = {c["name"]: c for c in data["checks"]}
    assert code == 1
    busy = "all CUDA-capable devices are busy"
    assert checks["calibration.compute"]["status"] == V.FAIL and busy in checks["calibration.compute"]["detail"]
    assert checks["mps.thread_share_scaling"]["status"] == V.FAIL
    assert busy in checks["mps.thread_share_scaling"]["detail"]
    assert checks["mps.memory_fence"]["status"] == V.FAIL and busy in checks["mps.memory_fence"]["detail"]
    assert checks["estimator.st-dot-adam"]["status"] == V.FAIL and busy in checks["estimator.st-dot-adam"]["detail"]
    assert checks["mps.daemon_shutdown"]["status"] == V.PASS
    assert _fake_daemons() == set()


def test_a_busy_gpu_fails_before_anything_is_measured_on_it(clean_env, tmp_path, monkeypatch):
    scenario = tmp_path / "nvml.json"
    gpu = {"name": "NVIDIA H100 80GB HBM3", "memory_total_bytes": 80 << 30, "compute_mode": 3}
    scenario.write_text(json.dumps({"gpus": [gpu, gpu], "processes": [
        {"pid": 4242, "gpu_index": 1, "used_gpu_memory_bytes": 3 << 30, "sm_util_pct": 80}]}))
    monkeypatch.setenv(fake_nvml.ENV_FAKE_NVML, str(scenario))
    code, data = _run_json("--fake", "--gpu", "1")
    checks = {c["name"]: c for c in data["checks"]}
    assert code == 1
    assert checks["nvml.gpu_idle"]["status"] == V.FAIL and "pids 4242" in checks["nvml.gpu_idle"]["figure"]
    assert "--exclusive" in checks["nvml.gpu_idle"]["fix"]
    code, data = _run_json("--fake", "--gpu", "0")  # its neighbour GPU is idle
    assert code == 0 and {c["name"]: c for c in data["checks"]}["nvml.gpu_idle"]["status"] == V.DRY
    gpu["compute_mode"] = 0  # DEFAULT: what MPS does not want
    scenario.write_text(json.dumps({"gpus": [gpu]}))
    code, data = _run_json("--fake")
    mode = {c["name"]: c for c in data["checks"]}["nvml.compute_mode"]
    assert code == 1 and mode["status"] == V.FAIL and "-c EXCLUSIVE_PROCESS" in mode["fix"]


def test_write_site_without_a_gpu_writes_nothing(clean_env, tmp_path):
    site_file = tmp_path / "site.toml"
    site_file.write_text(SITE_TEXT)
    code, data = _run_json("--fake", "--write-site", str(site_file))
    row = {c["name"]: c for c in data["checks"]}["calibration.write_site"]
    assert code == 0 and row["status"] == V.SKIP and "nothing was measured" in row["detail"]
    assert site_file.read_text() == SITE_TEXT


def test_a_fake_launcher_installed_before_the_move_is_still_the_fake(tmp_path):
    """A local cluster brought up before the fakes moved to slurm_dlrm/emulated/ keeps its
    launcher, which runs the old module name: selftest must still see it as the fake."""
    old = tmp_path / "old" / "nvidia-cuda-mps-control"
    old.parent.mkdir()
    old.write_text("#!/bin/sh\nexec /usr/bin/python3 -m slurm_dlrm.agent.fake_mps_control \"$@\"\n")
    assert run_mod.is_fake_mps_control(str(old))
    assert run_mod.is_fake_mps_control(str(fake_mps_control.install_launcher(tmp_path / "bin")))
    other = tmp_path / "other" / "nvidia-cuda-mps-control"
    other.parent.mkdir()
    other.write_text("#!/bin/sh\nexec /usr/bin/nvidia-cuda-mps-control.real \"$@\"\n")
    assert not run_mod.is_fake_mps_control(str(other))
