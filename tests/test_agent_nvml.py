"""The NVML seam and its fake: faithful to pynvml, and tolerant of every GPU failure."""

import inspect
import json
import os
import subprocess
import sys
import time

import pynvml
import pytest

from slurm_dlrm.agent.nvml import Nvml
from slurm_dlrm.emulated import nvml as fake_nvml
from slurm_dlrm.emulated.nvml import FakeNvml
from slurm_dlrm.errors import ENV_JOB_ID

USED = [
    "nvmlInit", "nvmlShutdown", "nvmlSystemGetDriverVersion", "nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex",
    "nvmlDeviceGetName", "nvmlDeviceGetUUID", "nvmlDeviceGetIndex", "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetComputeRunningProcesses",
    "nvmlDeviceGetMPSComputeRunningProcesses", "nvmlDeviceGetProcessUtilization",
]


def test_fake_follows_the_real_binding():
    fake = FakeNvml({"gpu_count": 1})
    for name in USED:
        real = inspect.signature(getattr(pynvml, name))
        ours = inspect.signature(getattr(fake, name))
        assert list(real.parameters) == list(ours.parameters), name
    codes = [n for n in dir(pynvml) if n.startswith("NVML_ERROR_") and hasattr(fake_nvml, n)]
    assert len(codes) >= 20
    for name in codes:
        assert getattr(pynvml, name) == getattr(fake_nvml, name), name
        cls = "NVMLError_" + name.replace("NVML_ERROR_", "").title().replace("_", "")
        assert hasattr(pynvml, cls) and hasattr(fake_nvml, cls), cls
        # NVMLError(code) builds the subclass, as in pynvml
        assert type(fake_nvml.NVMLError(getattr(fake_nvml, name))).__name__ == type(pynvml.NVMLError(getattr(pynvml, name))).__name__
    assert isinstance(fake_nvml.NVMLError_GpuIsLost(), fake_nvml.NVMLError)
    assert fake_nvml.NVMLError_NotSupported().value == pynvml.NVML_ERROR_NOT_SUPPORTED
    # Same struct attribute names as the real ctypes structs.
    fake.nvmlInit()
    h = fake.nvmlDeviceGetHandleByIndex(0)
    assert {f for f, _ in pynvml.c_nvmlMemory_t._fields_} <= set(vars(fake.nvmlDeviceGetMemoryInfo(h)))
    assert {f for f, _ in pynvml.c_nvmlUtilization_t._fields_} <= set(vars(fake.nvmlDeviceGetUtilizationRates(h)))
    fake.add_process(4242, 0, 100, sm_util_pct=10)
    (p,) = fake.nvmlDeviceGetComputeRunningProcesses(h)
    assert {f for f, _ in pynvml.c_nvmlProcessInfo_t._fields_} <= set(vars(p))
    (u,) = fake.nvmlDeviceGetProcessUtilization(h, 0)
    assert {f for f, _ in pynvml.c_nvmlProcessUtilizationSample_t._fields_} <= set(vars(u))


def test_fake_refuses_like_the_driver():
    fake = FakeNvml({"gpu_count": 2})
    with pytest.raises(fake_nvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()
    fake.nvmlInit()
    with pytest.raises(fake_nvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetHandleByIndex(2)
    h = fake.nvmlDeviceGetHandleByIndex(1)
    with pytest.raises(fake_nvml.NVMLError_NotFound):  # no process, so no utilisation sample
        fake.nvmlDeviceGetProcessUtilization(h, 0)
    fake.add_process(7, 1, 5 << 20)
    first = fake.nvmlDeviceGetProcessUtilization(h, 0)
    with pytest.raises(fake_nvml.NVMLError_NotFound):  # nothing newer than the last time stamp
        fake.nvmlDeviceGetProcessUtilization(h, first[0].timeStamp + 10**9)


def test_snapshot_with_units_and_per_process_shares():
    fake = FakeNvml({"gpus": [{"memory_total_bytes": 80 << 30, "reserved_bytes": 1 << 30, "uuid": "GPU-a"},
                              {"memory_total_bytes": 40 << 30, "reserved_bytes": 0}]})
    fake.add_process(101, 0, 3 << 30, sm_util_pct=30, mem_util_pct=10, mps=True)
    fake.add_process(102, 0, 2 << 30, sm_util_pct=25, mem_util_pct=5)
    fake.add_process(103, 1, 1 << 30, sm_util_pct=90, mem_util_pct=40)
    nv = Nvml(fake)
    snap = nv.sample([0, 1])
    g0, g1 = snap.gpus
    assert (g0.uuid, g0.memory_total_bytes, g0.memory_used_bytes) == ("GPU-a", 80 << 30, (1 + 3 + 2) << 30)
    assert (g0.sm_util_pct, g0.mem_util_pct) == (55.0, 15.0)
    assert g1.memory_used_bytes == 1 << 30 and g1.sm_util_pct == 90.0
    procs = snap.by_pid()
    assert procs[101].gpu_mem_bytes == 3 << 30 and procs[101].sm_util_pct == 30.0 and procs[101].gpu_index == 0
    assert procs[103].gpu_index == 1 and procs[103].mem_util_pct == 40.0


def test_not_supported_becomes_none_and_is_not_asked_again():
    fake = FakeNvml({"gpus": [{"not_supported": ["nvmlDeviceGetProcessUtilization", "nvmlDeviceGetUtilizationRates"]}]})
    fake.add_process(5, 0, 1 << 20, sm_util_pct=50)
    nv = Nvml(fake)
    for _ in range(3):
        snap = nv.sample([0])
    (g,) = snap.gpus
    assert g.sm_util_pct is None and g.mem_util_pct is None and g.memory_used_bytes is not None
    (p,) = snap.processes
    assert p.gpu_mem_bytes == 1 << 20 and p.sm_util_pct is None
    assert fake.calls["nvmlDeviceGetProcessUtilization"] == 1


def test_a_lost_gpu_is_a_value_and_the_others_keep_reporting():
    fake = FakeNvml({"gpus": [{}, {"lost_after_calls": 7}]})
    fake.add_process(9, 0, 1 << 20)
    nv = Nvml(fake)
    assert not nv.sample([0, 1]).gpus[1].lost
    snap = nv.sample([0, 1])
    assert snap.gpus[1].lost and "lost" in (snap.gpus[1].error or "")
    calls = dict(fake.calls)
    snap = nv.sample([0, 1])
    assert snap.gpus[1].lost and not snap.gpus[0].lost and snap.gpus[0].memory_used_bytes
    assert fake.calls["nvmlDeviceGetUUID"] == calls["nvmlDeviceGetUUID"] + 1  # the lost GPU is not asked again


def test_vanished_processes_are_tolerated():
    fake = FakeNvml({"gpu_count": 1})
    fake.add_process(11, 0, 1 << 20, sm_util_pct=10)
    fake.add_process(12, 0, 2 << 20, sm_util_pct=20)
    nv = Nvml(fake)
    assert set(nv.sample([0]).by_pid()) == {11, 12}
    fake.vanish(11)
    assert set(nv.sample([0]).by_pid()) == {12}
    fake.vanish(12)
    snap = nv.sample([0])
    assert snap.processes == () and snap.gpus[0].sm_util_pct == 0.0


def test_no_driver_means_unavailable_not_an_error():
    nv = Nvml(FakeNvml({"driver_not_loaded": True}))
    assert nv.init() is False and "Driver Not Loaded" in (nv.reason or "")
    snap = nv.sample([0, 1])
    assert snap.gpus == () and snap.processes == ()


def test_scenario_file_is_reread_and_members_are_discovered(tmp_path, monkeypatch):
    scenario = tmp_path / "nvml.json"
    scenario.write_text(json.dumps({"gpu_count": 3}))
    monkeypatch.setenv(fake_nvml.ENV_FAKE_NVML, str(scenario))
    monkeypatch.delenv("SLURMD_NODENAME", raising=False)
    # An MPS client of a daemon that sees GPUs 2,0: its device 0 is NVML GPU 2.
    pipe = tmp_path / "pipe"
    pipe.mkdir()
    (pipe / fake_nvml.MPS_STATE_FILE).write_text(json.dumps({"running": True, "visible_devices": ["2", "0"]}))
    code = "import time; b = bytearray(40 << 20); b[::4096] = b'x' * len(b[::4096]); time.sleep(30)"
    env = dict(os.environ, **{ENV_JOB_ID: "5", "CUDA_VISIBLE_DEVICES": "0", "CUDA_MPS_PIPE_DIRECTORY": str(pipe)})
    plain_env = dict(os.environ, **{ENV_JOB_ID: "6", "CUDA_VISIBLE_DEVICES": "1"})
    other_env = dict(plain_env, **{fake_nvml.ENV_FAKE_NVML: str(tmp_path / "other.json")})
    procs = [subprocess.Popen([sys.executable, "-c", code], env=e) for e in (env, plain_env, other_env)]  # noqa: S603
    try:
        nv = Nvml()
        assert nv.init()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            snap = nv.sample([0, 1, 2])
            found = snap.by_pid()
            if procs[0].pid in found and (found[procs[0].pid].gpu_mem_bytes or 0) > 40 << 20 and procs[1].pid in found:
                break
            time.sleep(0.2)
        assert found[procs[0].pid].gpu_index == 2  # remapped through the MPS daemon's device list
        assert found[procs[1].pid].gpu_index == 1
        assert procs[2].pid not in found  # another fake world's member
        assert snap.gpus[2].memory_used_bytes >= found[procs[0].pid].gpu_mem_bytes
        scenario.write_text(json.dumps({"gpus": [{}, {}, {"lost": True}]}))
        os.utime(scenario, (time.time() + 5, time.time() + 5))
        snap = nv.sample([0, 1, 2])
        assert snap.gpus[2].lost and not snap.gpus[1].lost
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_the_real_binding_without_a_driver_is_unavailable(monkeypatch):
    monkeypatch.delenv(fake_nvml.ENV_FAKE_NVML, raising=False)
    nv = Nvml()  # pynvml itself; this machine has no libnvidia-ml.so.1
    try:
        import ctypes

        ctypes.CDLL("libnvidia-ml.so.1")
        pytest.skip("an NVIDIA driver is installed here")
    except OSError:
        pass
    assert nv.init() is False and "NVML Shared Library Not Found" in (nv.reason or "")
    assert nv.sample([0]).gpus == () and nv.device_count() == 0


def test_the_real_path_never_loads_the_emulated_node(tmp_path):
    """The agent meets the fake NVML only when $SLURM_DLRM_FAKE_NVML selects it: without it,
    the agent's modules and an initialised seam leave slurm_dlrm.emulated unimported."""
    code = ("import sys\nfrom slurm_dlrm.agent import loop, mps, nvml\nnv = nvml.Nvml()\nnv.init()\n"
            "print(any(m.startswith('slurm_dlrm.emulated') for m in sys.modules), nv.is_fake)\n")
    env = {k: v for k, v in os.environ.items() if k != fake_nvml.ENV_FAKE_NVML}
    real = subprocess.run([sys.executable, "-c", code], env=env,  # noqa: S603
                          capture_output=True, text=True, timeout=60)
    assert real.returncode == 0, real.stderr
    assert real.stdout.split() == ["False", "False"]
    scenario = tmp_path / "scenario.json"
    scenario.write_text(json.dumps({"gpu_count": 1}))
    fake = subprocess.run([sys.executable, "-c", code],  # noqa: S603
                          env={**env, fake_nvml.ENV_FAKE_NVML: str(scenario)},
                          capture_output=True, text=True, timeout=60)
    assert fake.returncode == 0, fake.stderr
    assert fake.stdout.split() == ["True", "True"]


def test_a_member_first_seen_before_its_exec_is_found_after_it(tmp_path, monkeypatch):
    # Between fork and exec a child's environ is its parent's: a scan then must not
    # decide for good that it is no member (the Slurm legs' pid namespaces hit this race).
    import threading

    scenario = tmp_path / "nvml.json"
    scenario.write_text(json.dumps({"gpu_count": 1}))
    monkeypatch.setenv(fake_nvml.ENV_FAKE_NVML, str(scenario))
    monkeypatch.delenv("SLURMD_NODENAME", raising=False)
    monkeypatch.delenv(ENV_JOB_ID, raising=False)
    env = dict(os.environ, **{ENV_JOB_ID: "5", "CUDA_VISIBLE_DEVICES": "0"})
    nv = Nvml()
    assert nv.init()
    spawning = threading.Event()
    spawning.set()

    def scan() -> None:  # samples while Popen waits for the child's exec
        while spawning.is_set():
            nv.sample([0])
            time.sleep(0.05)

    t = threading.Thread(target=scan)
    t.start()
    try:
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env=env,  # noqa: S603
                             preexec_fn=lambda: time.sleep(1.0))  # noqa: PLW1509 - the window under test
    finally:
        spawning.clear()
        t.join()
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and p.pid not in nv.sample([0]).by_pid():
            time.sleep(0.25)
        assert p.pid in nv.sample([0]).by_pid()
    finally:
        p.kill()
        p.wait()


def test_gpm_metrics_over_a_window_and_none_before_hopper():
    """Issue 38: GPM (SM util, occupancy, DRAM bandwidth, tensor activity) through the
    seam; a GPU without GPM (isSupportedDevice 0) gives None, and the fake follows the
    real binding's names and structures."""
    import time as _time

    from slurm_dlrm.agent.nvml import GPM_METRICS, Nvml
    from slurm_dlrm.emulated import nvml as fake_nvml

    fake = fake_nvml.FakeNvml({"gpus": [{"name": "H100"}, {"name": "A100", "gpm": False}]})
    fake.add_process(11, 0, 1 << 30, sm_util_pct=40, mem_util_pct=30)
    fake.add_process(12, 0, 1 << 30, sm_util_pct=30, mem_util_pct=50)
    nv = Nvml(fake)
    assert nv.init()
    window = nv.gpm_begin(0)
    assert window is not None
    _time.sleep(0.01)
    got = nv.gpm_end(window)
    assert got == {"sm_util_pct": 70.0, "sm_occupancy_pct": 35.0, "tensor_util_pct": 21.0, "dram_bw_util_pct": 80.0}
    assert set(got) == set(GPM_METRICS)
    assert fake.calls["nvmlGpmSampleFree"] == 2  # both samples given back
    assert nv.gpm_begin(1) is None and nv.gpm_begin(1) is None
    assert fake.calls["nvmlGpmQueryDeviceSupport"] == 2  # asked once for the GPU without GPM
    pynvml = pytest.importorskip("pynvml")
    for name in ("nvmlGpmQueryDeviceSupport", "nvmlGpmSampleAlloc", "nvmlGpmSampleGet", "nvmlGpmMetricsGet",
                 "nvmlGpmSampleFree", "NVML_GPM_METRICS_GET_VERSION"):
        assert hasattr(pynvml, name), name
    for metric, metric_id in GPM_METRICS.items():
        real = {"sm_util_pct": "NVML_GPM_METRIC_SM_UTIL", "sm_occupancy_pct": "NVML_GPM_METRIC_SM_OCCUPANCY",
                "tensor_util_pct": "NVML_GPM_METRIC_ANY_TENSOR_UTIL",
                "dram_bw_util_pct": "NVML_GPM_METRIC_DRAM_BW_UTIL"}[metric]
        assert getattr(pynvml, real) == metric_id == getattr(fake_nvml, real)
    for struct in ("c_nvmlGpmMetricsGet_t", "c_nvmlGpmMetric_t"):
        assert [f[0] for f in getattr(pynvml, struct)._fields_] == [f[0] for f in getattr(fake_nvml, struct)._fields_]
