"""A stateful stand-in for the `pynvml` module (nvidia-ml-py 13.x) for machines without a GPU.

It follows the real binding: the same function names and arguments, the same return
attribute names (`.total/.free/.used`, `.gpu/.memory`, `.pid/.usedGpuMemory/...`,
`.pid/.timeStamp/.smUtil/.memUtil/...`), the same `NVMLError` subclasses and codes
(`NVMLError_NotSupported` is code 3, `NVMLError_GpuIsLost` 15, ...), and the same
behaviour where it matters to a sampler: calls before `nvmlInit` raise Uninitialized,
a bad index raises InvalidArgument, `nvmlDeviceGetProcessUtilization` raises NotFound
when it has no sample newer than the time stamp given.

The scenario is a dict (or a JSON file, re-read when it changes, so a test can change
the world while an agent samples it):

    {"gpus": [{"name": "NVIDIA H100 80GB HBM3", "memory_total_bytes": 85899345920,
               "uuid": "GPU-...", "reserved_bytes": 536870912,
               "lost": false, "lost_after_calls": null, "compute_mode": 3,
               "not_supported": ["nvmlDeviceGetProcessUtilization"]}],
     "gpu_count": 4,                       # shorthand for 4 default H100s
     "driver_version": "550.54.15", "cuda_driver_version": 12040,
     "processes": [{"pid": 123, "gpu_index": 0, "used_gpu_memory_bytes": 1000,
                    "sm_util_pct": 30, "mem_util_pct": 10, "mps": true}],
     "discover_members": true}

With `discover_members` the fake plays the driver for the pack members on this node: a
process whose environment has `SLURM_DLRM_JOB_ID` and `CUDA_VISIBLE_DEVICES` (and the
same `SLURM_DLRM_FAKE_NVML` file and `SLURMD_NODENAME` as this process) counts as a CUDA
client of the GPU its `CUDA_VISIBLE_DEVICES` names (remapped through the fake MPS
daemon's device list when it is an MPS client, as the real MPS server remaps), using its
RSS as GPU memory and its CPU use as SM share. Processes listed in `processes` whose pid
does not exist model processes that vanished between two NVML calls. GPM (GPU
performance monitoring, Hopper and later) follows nvidia-ml-py's functions and ctypes
structures; a scenario GPU with `"gpm": false` has none.

Over 600 lines on purpose: it stands in for one module (`pynvml`), which callers reach
as `binding.X` for functions, constants, error classes and structures alike; split, it
would no longer be the one module it imitates.
"""

from __future__ import annotations

import ctypes
import json
import os
import string
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_dlrm.emulated.mps_control import STATE_FILE as MPS_STATE_FILE
from slurm_dlrm.emulated.registry import registered_gpu_mem_bytes
from slurm_dlrm.errors import ENV_FAKE_NVML, ENV_JOB_ID

# Codes as in pynvml.py (nvml.h). tests/test_agent_nvml.py checks them against the real module.
NVML_SUCCESS = 0
NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_ALREADY_INITIALIZED = 5
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_INSUFFICIENT_POWER = 8
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_IRQ_ISSUE = 11
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_CORRUPTED_INFOROM = 14
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_OPERATING_SYSTEM = 17
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_IN_USE = 19
NVML_ERROR_MEMORY = 20
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
NVML_ERROR_NO_DATA = 21
NVML_ERROR_UNKNOWN = 999

# nvmlComputeMode_t (nvml.h); a scenario GPU's "compute_mode" takes these numbers.
NVML_COMPUTEMODE_DEFAULT = 0
NVML_COMPUTEMODE_EXCLUSIVE_THREAD = 1  # support removed
NVML_COMPUTEMODE_PROHIBITED = 2
NVML_COMPUTEMODE_EXCLUSIVE_PROCESS = 3

_MESSAGES = {  # pynvml's NVMLError._errcode_to_string
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
    NVML_ERROR_ALREADY_INITIALIZED: "Already Initialized",
    NVML_ERROR_NOT_FOUND: "Not Found",
    NVML_ERROR_INSUFFICIENT_SIZE: "Insufficient Size",
    NVML_ERROR_INSUFFICIENT_POWER: "Insufficient External Power",
    NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_TIMEOUT: "Timeout",
    NVML_ERROR_IRQ_ISSUE: "Interrupt Request Issue",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
    NVML_ERROR_CORRUPTED_INFOROM: "Corrupted infoROM",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    NVML_ERROR_RESET_REQUIRED: "GPU requires restart",
    NVML_ERROR_OPERATING_SYSTEM: "The operating system has blocked the request.",
    NVML_ERROR_LIB_RM_VERSION_MISMATCH: "RM has detected an NVML/RM version mismatch.",
    NVML_ERROR_MEMORY: "Insufficient Memory",
    NVML_ERROR_UNKNOWN: "Unknown Error",
}


class NVMLError(Exception):
    """Mirrors pynvml.NVMLError: `NVMLError(code)` builds the subclass for that code."""

    _valClassMapping: dict[int, type[NVMLError]] = {}
    value: int

    def __new__(cls, value: int) -> NVMLError:  # noqa: D102
        if cls is NVMLError:
            cls = NVMLError._valClassMapping.get(value, cls)
        obj = Exception.__new__(cls)
        obj.value = value
        return obj

    def __init__(self, value: int) -> None:
        super().__init__(value)

    def __str__(self) -> str:
        return _MESSAGES.get(self.value, f"NVML Error with code {self.value}")


def _make_error_classes() -> None:
    # Same naming rule as pynvml._extractNVMLErrorsAsClasses: NVML_ERROR_GPU_IS_LOST -> NVMLError_GpuIsLost.
    module = sys.modules[__name__]
    for name in [n for n in dir(module) if n.startswith("NVML_ERROR_")]:
        class_name = "NVMLError_" + string.capwords(name.replace("NVML_ERROR_", ""), "_").replace("_", "")
        code = getattr(module, name)

        def gen_new(val: int) -> Any:
            def new(typ: type, *args: Any) -> NVMLError:
                obj: NVMLError = Exception.__new__(typ)
                obj.value = val
                return obj

            return new

        cls = type(class_name, (NVMLError,), {"__new__": gen_new(code), "__init__": lambda self, *a: None})
        cls.__module__ = __name__
        setattr(module, class_name, cls)
        NVMLError._valClassMapping[code] = cls


_make_error_classes()


class FriendlyObject:
    """Like pynvml.nvmlFriendlyObject: a plain object with the struct's field names."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)

    def __repr__(self) -> str:
        return str(self.__dict__)


# GPU performance monitoring (GPM, Hopper and later), as nvidia-ml-py spells it: the
# metric ids, the versions and the ctypes structures a caller fills.
NVML_GPM_METRIC_SM_UTIL = 2
NVML_GPM_METRIC_SM_OCCUPANCY = 3
NVML_GPM_METRIC_ANY_TENSOR_UTIL = 5
NVML_GPM_METRIC_DRAM_BW_UTIL = 10
NVML_GPM_METRIC_MAX = 477
NVML_GPM_METRICS_GET_VERSION = 1
NVML_GPM_SUPPORT_VERSION = 1


class c_metricInfo_t(ctypes.Structure):  # noqa: N801 - pynvml's name
    _fields_ = [("shortName", ctypes.c_char_p), ("longName", ctypes.c_char_p), ("unit", ctypes.c_char_p)]


class c_nvmlGpmMetric_t(ctypes.Structure):  # noqa: N801
    _fields_ = [("metricId", ctypes.c_uint), ("nvmlReturn", ctypes.c_uint), ("value", ctypes.c_double),
                ("metricInfo", c_metricInfo_t)]


class c_nvmlGpmMetricsGet_t(ctypes.Structure):  # noqa: N801
    _fields_ = [("version", ctypes.c_uint), ("numMetrics", ctypes.c_uint), ("sample1", ctypes.py_object),
                ("sample2", ctypes.py_object), ("metrics", c_nvmlGpmMetric_t * NVML_GPM_METRIC_MAX)]


@dataclass
class _GpmSample:
    """An opaque sample buffer: what the device's counters read at one moment."""

    freed: bool = False
    device: int | None = None
    t: float = 0.0
    busy: dict[int, float] | None = None  # metric id -> share over the time before it


@dataclass
class _Handle:
    index: int


_DEFAULT_GPU = {"name": "NVIDIA H100 80GB HBM3", "memory_total_bytes": 80 * (1 << 30),
                "reserved_bytes": 512 * (1 << 20)}
_NO_INSTANCE = 0xFFFFFFFF  # gpuInstanceId/computeInstanceId outside MIG


class FakeNvml:
    """Serves several GPUs from a scenario; use it where the agent would use `pynvml`."""

    # The module-level names a caller reaches through `binding.X`.
    NVMLError = NVMLError

    def __init__(self, scenario: dict[str, Any] | None = None, path: str | os.PathLike[str] | None = None) -> None:
        self.path = str(path) if path is not None else None
        self._mtime: float | None = None
        self._scenario: dict[str, Any] = {}
        self._initialized = 0
        self.calls: dict[str, int] = {}
        self._device_calls: dict[int, int] = {}
        self._lost: set[int] = set()
        self._removed_pids: set[int] = set()
        # pid -> (its start, in clock ticks since boot; what it is: (GPU, MPS pipe, env) or None)
        self._env_cache: dict[int, tuple[int | None, tuple[int, str | None, dict[str, str]] | None]] = {}
        self._cpu_prev: dict[int, tuple[float, float]] = {}
        self._discovered: list[dict[str, Any]] = []
        self._discovered_at = -1.0
        if scenario is not None:
            self._scenario = scenario
        elif self.path is not None:
            self._reload()

    # ------------------------------------------------------------ scenario control (tests)

    def __getattr__(self, name: str) -> Any:
        # NVML_ERROR_* constants and NVMLError_* classes, as on the real module.
        if name.startswith(("NVML_", "NVMLError_", "c_nvml")):
            return getattr(sys.modules[__name__], name)
        raise AttributeError(name)

    def lose_gpu(self, index: int) -> None:
        self._lost.add(index)

    def vanish(self, pid: int) -> None:
        """The process exits: it leaves every list from now on."""
        self._removed_pids.add(pid)

    def add_process(self, pid: int, gpu_index: int, used_gpu_memory_bytes: int, sm_util_pct: float = 0.0,
                    mem_util_pct: float = 0.0, mps: bool = False) -> None:
        self._scenario.setdefault("processes", []).append(
            {"pid": pid, "gpu_index": gpu_index, "used_gpu_memory_bytes": used_gpu_memory_bytes,
             "sm_util_pct": sm_util_pct, "mem_util_pct": mem_util_pct, "mps": mps})

    def _reload(self) -> None:
        assert self.path is not None
        try:
            mtime = os.stat(self.path).st_mtime
        except OSError:
            return
        if mtime == self._mtime:
            return
        try:
            self._scenario = json.loads(Path(self.path).read_text())
            self._mtime = mtime
        except (OSError, ValueError):
            pass  # half-written by a test: keep the previous scenario

    def _gpus(self) -> list[dict[str, Any]]:
        gpus = self._scenario.get("gpus")
        if gpus is None:
            gpus = [dict(_DEFAULT_GPU) for _ in range(int(self._scenario.get("gpu_count", 4)))]
        return list(gpus)

    # ------------------------------------------------------------ checks shared by calls

    def _call(self, name: str) -> None:
        if self.path is not None:
            self._reload()
        self.calls[name] = self.calls.get(name, 0) + 1
        if not self._initialized:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)

    def _device(self, name: str, handle: Any) -> dict[str, Any]:
        self._call(name)
        if not isinstance(handle, _Handle):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        gpus = self._gpus()
        if handle.index >= len(gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        gpu = gpus[handle.index]
        n = self._device_calls[handle.index] = self._device_calls.get(handle.index, 0) + 1
        after = gpu.get("lost_after_calls")
        if gpu.get("lost") or handle.index in self._lost or (after is not None and n > int(after)):
            self._lost.add(handle.index)
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        if name in gpu.get("not_supported", ()):
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return gpu

    # ------------------------------------------------------------ the pynvml API

    def nvmlInitWithFlags(self, flags: int) -> None:
        if self.path is not None:
            self._reload()
        if self._scenario.get("driver_not_loaded"):
            raise NVMLError(NVML_ERROR_DRIVER_NOT_LOADED)
        self._initialized += 1

    def nvmlInit(self) -> None:
        self.nvmlInitWithFlags(0)

    def nvmlShutdown(self) -> None:
        self._call("nvmlShutdown")
        self._initialized -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._call("nvmlSystemGetDriverVersion")
        return str(self._scenario.get("driver_version", "550.54.15"))

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        # nvml.h: major * 1000 + minor * 10, e.g. 12040 for CUDA 12.4
        self._call("nvmlSystemGetCudaDriverVersion")
        return int(self._scenario.get("cuda_driver_version", 12040))

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        self._call("nvmlSystemGetCudaDriverVersion_v2")
        return int(self._scenario.get("cuda_driver_version", 12040))

    def nvmlDeviceGetComputeMode(self, handle: _Handle) -> int:
        gpu = self._device("nvmlDeviceGetComputeMode", handle)
        return int(gpu.get("compute_mode", NVML_COMPUTEMODE_DEFAULT))

    def nvmlDeviceGetCount(self) -> int:
        self._call("nvmlDeviceGetCount")
        return len(self._gpus())

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._call("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self._gpus()):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return _Handle(index)

    def nvmlDeviceGetIndex(self, handle: _Handle) -> int:
        self._device("nvmlDeviceGetIndex", handle)
        return handle.index

    def nvmlDeviceGetName(self, handle: _Handle) -> str:
        return str(self._device("nvmlDeviceGetName", handle).get("name", _DEFAULT_GPU["name"]))

    def nvmlDeviceGetUUID(self, handle: _Handle) -> str:
        gpu = self._device("nvmlDeviceGetUUID", handle)
        return str(gpu.get("uuid") or _uuid_for(handle.index))

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle, version: int | None = None) -> FriendlyObject:
        gpu = self._device("nvmlDeviceGetMemoryInfo", handle)
        total = int(gpu.get("memory_total_bytes", _DEFAULT_GPU["memory_total_bytes"]))
        used = int(gpu.get("reserved_bytes", _DEFAULT_GPU["reserved_bytes"]))
        used += sum(p["used_gpu_memory_bytes"] or 0 for p in self._processes(handle.index))
        used = min(used, total)
        if version:
            return FriendlyObject(version=version, total=total, reserved=0, free=total - used, used=used)
        return FriendlyObject(total=total, free=total - used, used=used)

    def nvmlDeviceGetUtilizationRates(self, handle: _Handle) -> FriendlyObject:
        self._device("nvmlDeviceGetUtilizationRates", handle)
        procs = self._processes(handle.index)
        sm = min(100, int(sum(p["sm_util_pct"] for p in procs)))
        mem = min(100, int(sum(p["mem_util_pct"] for p in procs)))
        return FriendlyObject(gpu=sm, memory=mem)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: _Handle) -> list[FriendlyObject]:
        self._device("nvmlDeviceGetComputeRunningProcesses", handle)
        return [_process_info(p) for p in self._processes(handle.index)]

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: _Handle) -> list[FriendlyObject]:
        self._device("nvmlDeviceGetMPSComputeRunningProcesses", handle)
        return [_process_info(p) for p in self._processes(handle.index) if p["mps"]]

    # GPM: a scenario GPU with "gpm": false is a pre-Hopper one (isSupportedDevice 0, and
    # nvmlGpmSampleGet answers NotSupported as the driver does). Metrics come from the
    # processes' busy shares: SM util and DRAM bandwidth their sums (capped at 100),
    # occupancy and tensor activity the scenario's "gpm_occupancy_per_sm" and
    # "gpm_tensor_per_sm" times SM util (defaults 0.5 and 0.3).

    def nvmlGpmQueryDeviceSupport(self, handle: _Handle) -> FriendlyObject:
        gpu = self._device("nvmlGpmQueryDeviceSupport", handle)
        return FriendlyObject(version=NVML_GPM_SUPPORT_VERSION, isSupportedDevice=int(bool(gpu.get("gpm", True))))

    def nvmlGpmSampleAlloc(self) -> _GpmSample:
        self._call("nvmlGpmSampleAlloc")
        return _GpmSample()

    def nvmlGpmSampleFree(self, sample: _GpmSample) -> None:
        self._call("nvmlGpmSampleFree")
        if not isinstance(sample, _GpmSample) or sample.freed:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        sample.freed = True

    def nvmlGpmSampleGet(self, handle: _Handle, sample: _GpmSample) -> _GpmSample:
        gpu = self._device("nvmlGpmSampleGet", handle)
        if not isinstance(sample, _GpmSample) or sample.freed:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        if not gpu.get("gpm", True):
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        procs = self._processes(handle.index)
        sm = min(100.0, float(sum(p["sm_util_pct"] for p in procs)))
        bw = min(100.0, float(sum(p["mem_util_pct"] for p in procs)))
        sample.device, sample.t = handle.index, time.monotonic()
        sample.busy = {NVML_GPM_METRIC_SM_UTIL: sm, NVML_GPM_METRIC_DRAM_BW_UTIL: bw,
                       NVML_GPM_METRIC_SM_OCCUPANCY: sm * float(gpu.get("gpm_occupancy_per_sm", 0.5)),
                       NVML_GPM_METRIC_ANY_TENSOR_UTIL: sm * float(gpu.get("gpm_tensor_per_sm", 0.3))}
        return sample

    def nvmlGpmMetricsGet(self, metrics_get: Any) -> Any:
        """Fills `metrics[i].value` / `.nvmlReturn` for each asked metric id over the time
        between sample1 and sample2 (the mean of both readings here)."""
        self._call("nvmlGpmMetricsGet")
        if metrics_get.version != NVML_GPM_METRICS_GET_VERSION:
            raise NVMLError(NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        s1, s2 = metrics_get.sample1, metrics_get.sample2
        if not (isinstance(s1, _GpmSample) and isinstance(s2, _GpmSample)) or s1 is s2 or s1.busy is None \
                or s2.busy is None or s1.device != s2.device or s2.t <= s1.t:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        for i in range(int(metrics_get.numMetrics)):
            m = metrics_get.metrics[i]
            if m.metricId in s1.busy:
                m.value = (s1.busy[m.metricId] + s2.busy[m.metricId]) / 2.0
                m.nvmlReturn = NVML_SUCCESS
            else:
                m.nvmlReturn = NVML_ERROR_NOT_SUPPORTED
        return metrics_get

    def nvmlDeviceGetProcessUtilization(self, handle: _Handle, timeStamp: int) -> list[FriendlyObject]:
        self._device("nvmlDeviceGetProcessUtilization", handle)
        now_us = int(time.time() * 1e6)
        samples = [FriendlyObject(pid=p["pid"], timeStamp=now_us, smUtil=int(p["sm_util_pct"]),
                                  memUtil=int(p["mem_util_pct"]), encUtil=0, decUtil=0)
                   for p in self._processes(handle.index)]
        if not samples or now_us <= timeStamp:
            raise NVMLError(NVML_ERROR_NOT_FOUND)  # the driver's answer to "no newer sample"
        return samples

    # ------------------------------------------------------------ the processes on a device

    def _processes(self, index: int) -> list[dict[str, Any]]:
        out = []
        for p in self._scenario.get("processes", ()):
            if int(p["gpu_index"]) == index and int(p["pid"]) not in self._removed_pids:
                out.append({"pid": int(p["pid"]), "used_gpu_memory_bytes": p.get("used_gpu_memory_bytes"),
                            "sm_util_pct": float(p.get("sm_util_pct", 0)),
                            "mem_util_pct": float(p.get("mem_util_pct", 0)), "mps": bool(p.get("mps", False))})
        if self._scenario.get("discover_members", self.path is not None):
            out.extend(p for p in self._discover() if p["gpu_index"] == index and p["pid"] not in self._removed_pids)
        return out

    def _discover(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        if now - self._discovered_at < 0.2:  # one /proc scan serves all calls of one sampling pass
            return self._discovered
        self._discovered_at = now
        try:
            pids = {int(d) for d in os.listdir("/proc") if d.isdigit()}
        except OSError:
            return []
        for gone in set(self._env_cache) - pids:
            self._env_cache.pop(gone, None)
            self._cpu_prev.pop(gone, None)
        gpus = self._gpus()
        clients = {}
        now_ticks = _uptime_ticks()
        for pid in pids:
            # Keyed by the process's start too (a reused pid is another process); and a
            # process seen as no client while young is looked at again: between fork and
            # exec its environ is still its parent's (the real driver sees a process only
            # once it makes its CUDA context, after exec).
            started = _start_ticks(pid)
            cached = self._env_cache.get(pid)
            young = started is not None and now_ticks is not None and now_ticks - started < _YOUNG_S * _TICKS
            if cached is None or cached[0] != started or (cached[1] is None and young):
                cached = self._env_cache[pid] = (started, self._client_of(pid, gpus))
            client = cached[1]
            if client is not None:
                clients[pid] = client
        found = []
        for pid, (gpu_index, pipe, env) in clients.items():
            if _parent(pid) in clients:
                continue  # a child of a client (a loader worker): the driver sees the client only
            stat = _rss_and_cpu(pid)
            if stat is None:
                continue
            rss, cpu_s = stat
            declared = _standin_gpu_mem(env, pid, gpu_index)
            if declared is not None:
                rss = declared  # a stand-in's device memory (emulated/registry.py), not its host pages
            prev = self._cpu_prev.get(pid)
            self._cpu_prev[pid] = (cpu_s, now)
            sm = 0.0
            if prev is not None and now > prev[1]:
                sm = max(0.0, min(100.0, 100.0 * (cpu_s - prev[0]) / (now - prev[1])))
            found.append({"pid": pid, "gpu_index": gpu_index, "used_gpu_memory_bytes": rss,
                          "sm_util_pct": sm, "mem_util_pct": sm / 2, "mps": pipe is not None})
        self._discovered = found
        return found

    def _client_of(self, pid: int, gpus: list[dict[str, Any]]) -> tuple[int, str | None, dict[str, str]] | None:
        env = _environ(pid)
        if env is None or ENV_JOB_ID not in env or not env.get("CUDA_VISIBLE_DEVICES"):
            return None
        if self.path is not None and env.get(ENV_FAKE_NVML) != self.path:
            return None
        node = os.environ.get("SLURMD_NODENAME")
        if node and env.get("SLURMD_NODENAME", node) != node:
            return None
        token = env["CUDA_VISIBLE_DEVICES"].split(",")[0].strip()
        pipe = env.get("CUDA_MPS_PIPE_DIRECTORY")
        if pipe:
            try:
                state = json.loads((Path(pipe) / MPS_STATE_FILE).read_text())
            except (OSError, ValueError):
                state = None
            if state and state.get("running"):
                visible = state.get("visible_devices") or []
                if token.isdigit() and int(token) < len(visible):
                    token = str(visible[int(token)])  # the MPS server remaps client indices
            else:
                pipe = None
        keep: dict[str, str] = {k: env[k] for k in ("SLURMD_NODENAME", "SLURM_DLRM_STANDIN_REGISTRY") if k in env}
        if token.isdigit():
            index = int(token)
            return (index, pipe, keep) if index < len(gpus) else None
        for i, gpu in enumerate(gpus):
            if str(gpu.get("uuid") or _uuid_for(i)).startswith(token):
                return i, pipe, keep
        return None


def _standin_gpu_mem(env: dict[str, str], pid: int, gpu_index: int) -> int | None:
    if "SLURM_DLRM_STANDIN_REGISTRY" not in env:
        return None
    import socket

    node = env.get("SLURMD_NODENAME") or socket.gethostname()
    return registered_gpu_mem_bytes(env, pid, node, gpu_index)


def _uuid_for(index: int) -> str:
    return f"GPU-fa4e0000-0000-4000-8000-{index:012d}"


def _process_info(p: dict[str, Any]) -> FriendlyObject:
    return FriendlyObject(pid=p["pid"], usedGpuMemory=p["used_gpu_memory_bytes"],
                          gpuInstanceId=_NO_INSTANCE, computeInstanceId=_NO_INSTANCE)


def _environ(pid: int) -> dict[str, str] | None:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[1])


_PAGE = os.sysconf("SC_PAGE_SIZE")
_TICKS = os.sysconf("SC_CLK_TCK")


_YOUNG_S = 3.0  # a process younger than this may not have exec'ed yet


def _uptime_ticks() -> float | None:
    try:
        return float(Path("/proc/uptime").read_text().split()[0]) * _TICKS
    except (OSError, IndexError, ValueError):
        return None


def _start_ticks(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19])  # field 22
    except (OSError, IndexError, ValueError):
        return None


def _rss_and_cpu(pid: int) -> tuple[int, float] | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    # fields[0] is state (field 3); utime/stime are fields 14/15, rss is field 24.
    return int(fields[21]) * _PAGE, (int(fields[11]) + int(fields[12])) / _TICKS


def from_env() -> FakeNvml | None:
    """The fake named by $SLURM_DLRM_FAKE_NVML, or None when the real NVML is wanted."""
    path = os.environ.get(ENV_FAKE_NVML)
    return FakeNvml(path=path) if path else None
