"""NVML behind one seam: the only module that imports `pynvml` (nvidia-ml-py).

NVML is initialised once per process. Nothing here raises on a GPU problem: a function
the GPU does not support gives `None`, a lost GPU gives a `GpuSample` with `lost=True`,
processes that vanish between two calls are skipped. Snapshots carry units in names.

`$SLURM_DLRM_FAKE_NVML=<scenario.json>` swaps in `slurm_dlrm.emulated.nvml.FakeNvml`
(machines without a GPU, tests, and Slurm jobs on the local test cluster); the code path
is otherwise the same. That selection is the agent's one door to the emulated node: the
fake is imported only when the variable names a scenario.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from slurm_dlrm.errors import ENV_FAKE_NVML

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuSample:
    index: int  # NVML device index
    uuid: str | None
    name: str | None
    lost: bool
    sm_util_pct: float | None
    mem_util_pct: float | None  # memory-controller busy share, not capacity
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    error: str | None = None


@dataclass(frozen=True)
class ProcessGpuSample:
    pid: int
    gpu_index: int
    gpu_mem_bytes: int | None  # None: NVML could not tell (WDDM, permissions)
    sm_util_pct: float | None  # None: no utilisation sample for this pid this interval
    mem_util_pct: float | None


@dataclass(frozen=True)
class NvmlSnapshot:
    t: float  # wall clock, seconds
    gpus: tuple[GpuSample, ...]
    processes: tuple[ProcessGpuSample, ...]

    def by_pid(self) -> dict[int, ProcessGpuSample]:
        return {p.pid: p for p in self.processes}


@dataclass(frozen=True)
class DeviceInfo:
    """What a GPU is (for `slurm-dlrm selftest`); None where NVML could not tell."""

    index: int
    name: str | None
    uuid: str | None
    memory_total_bytes: int | None
    compute_mode: int | None  # nvmlComputeMode_t: 0 default, 2 prohibited, 3 exclusive process


# GPU performance monitoring (Hopper and later): our names -> NVML's metric ids
# (nvmlGpmMetricId_t: SM_UTIL 2, SM_OCCUPANCY 3, ANY_TENSOR_UTIL 5, DRAM_BW_UTIL 10).
GPM_METRICS = {"sm_util_pct": 2, "sm_occupancy_pct": 3, "tensor_util_pct": 5, "dram_bw_util_pct": 10}


@dataclass
class GpmWindow:
    """The first GPM sample of a window on one GPU (`Nvml.gpm_begin`)."""

    index: int
    sample: Any


class Nvml:
    """Samples GPUs and their compute processes; `available` is False without NVML."""

    def __init__(self, binding: Any = None) -> None:
        self._nv = binding
        self._initialized = False
        self.available = False
        self.reason: str | None = None
        self.driver_version: str | None = None
        self._handles: dict[int, Any] = {}
        self._lost: set[int] = set()
        self._util_ts_us: dict[int, int] = {}
        self._unsupported: set[tuple[int, str]] = set()
        self._last_error: dict[int, str] = {}

    # ------------------------------------------------------------ life cycle

    def init(self) -> bool:
        """Initialise once; False (with `reason`) when there is no usable NVML."""
        if self._initialized:
            return self.available
        self._initialized = True
        if self._nv is None and os.environ.get(ENV_FAKE_NVML):
            from slurm_dlrm.emulated import (
                nvml as fake_nvml,  # selected: the real path never loads it
            )

            self._nv = fake_nvml.from_env()
        if self._nv is None:
            try:
                import pynvml  # nvidia-ml-py

                self._nv = pynvml
            except ImportError as exc:  # pragma: no cover - it is a dependency
                self.reason = f"nvidia-ml-py missing: {exc}"
                return False
        try:
            self._nv.nvmlInit()
        except self._nv.NVMLError as exc:
            self.reason = f"nvmlInit failed: {exc}"
            log.warning("NVML unavailable: %s", self.reason)
            return False
        self.available = True
        try:
            self.driver_version = str(self._nv.nvmlSystemGetDriverVersion())
        except self._nv.NVMLError:
            pass
        return True

    def shutdown(self) -> None:
        if self.available:
            try:
                self._nv.nvmlShutdown()
            except self._nv.NVMLError:
                pass
        self.available = False
        self._handles.clear()

    @property
    def is_fake(self) -> bool:
        """True when the binding is the fake NVML ($SLURM_DLRM_FAKE_NVML), not the driver's."""
        fake_nvml = sys.modules.get("slurm_dlrm.emulated.nvml")  # not loaded: it cannot be the fake
        return fake_nvml is not None and isinstance(self._nv, fake_nvml.FakeNvml)

    def cuda_driver_version(self) -> int | None:
        """The CUDA version the driver supports, as nvml.h encodes it (12040 = 12.4)."""
        if not self.init():
            return None
        for fn_name in ("nvmlSystemGetCudaDriverVersion_v2", "nvmlSystemGetCudaDriverVersion"):
            fn = getattr(self._nv, fn_name, None)
            if fn is None:
                continue
            try:
                return int(fn())
            except self._nv.NVMLError:
                continue
        return None

    def device_info(self, index: int) -> DeviceInfo:
        """Name, UUID, total memory and compute mode of one device; NVMLError for a bad index."""
        nv = self._nv
        if not self.init():
            raise RuntimeError(self.reason or "NVML unavailable")
        handle = self._handle(index)
        mem = self._optional(index, nv.nvmlDeviceGetMemoryInfo, handle)
        mode_fn = getattr(nv, "nvmlDeviceGetComputeMode", None)
        mode = self._optional(index, mode_fn, handle) if mode_fn is not None else None
        name = self._optional(index, nv.nvmlDeviceGetName, handle)
        uuid = self._optional(index, nv.nvmlDeviceGetUUID, handle)
        return DeviceInfo(index, str(name) if name is not None else None, str(uuid) if uuid is not None else None,
                          int(mem.total) if mem is not None else None, int(mode) if mode is not None else None)

    def device_count(self) -> int:
        if not self.init():
            return 0
        try:
            return int(self._nv.nvmlDeviceGetCount())
        except self._nv.NVMLError as exc:
            log.warning("nvmlDeviceGetCount: %s", exc)
            return 0

    # ------------------------------------------------------------ sampling

    def sample(self, indices: list[int]) -> NvmlSnapshot:
        """One snapshot of the given devices and the compute processes on them."""
        now = time.time()
        if not self.init():
            return NvmlSnapshot(now, (), ())
        gpus = []
        procs: list[ProcessGpuSample] = []
        for index in indices:
            gpu, dev_procs = self._sample_device(index)
            gpus.append(gpu)
            procs.extend(dev_procs)
        return NvmlSnapshot(now, tuple(gpus), tuple(procs))

    def _sample_device(self, index: int) -> tuple[GpuSample, list[ProcessGpuSample]]:
        if index in self._lost:
            return GpuSample(index, None, None, True, None, None, None, None, "GPU is lost"), []
        nv = self._nv
        try:
            handle = self._handle(index)
            uuid = self._optional(index, nv.nvmlDeviceGetUUID, handle)
            name = self._optional(index, nv.nvmlDeviceGetName, handle)
            util = self._optional(index, nv.nvmlDeviceGetUtilizationRates, handle)
            mem = self._optional(index, nv.nvmlDeviceGetMemoryInfo, handle)
            procs = self._processes(index, handle)
        except nv.NVMLError as exc:
            if exc.value == nv.NVML_ERROR_GPU_IS_LOST:
                log.error("GPU %d is lost", index)
                self._lost.add(index)
                return GpuSample(index, None, None, True, None, None, None, None, str(exc)), []
            if self._last_error.get(index) != str(exc):  # once per change, not every sample
                log.warning("GPU %d: %s", index, exc)
            self._last_error[index] = str(exc)
            return GpuSample(index, None, None, False, None, None, None, None, str(exc)), []
        self._last_error.pop(index, None)
        return GpuSample(
            index=index,
            uuid=str(uuid) if uuid is not None else None,
            name=str(name) if name is not None else None,
            lost=False,
            sm_util_pct=float(util.gpu) if util is not None else None,
            mem_util_pct=float(util.memory) if util is not None else None,
            memory_used_bytes=int(mem.used) if mem is not None else None,
            memory_total_bytes=int(mem.total) if mem is not None else None,
        ), procs

    # ------------------------------------------------------------ GPM

    def gpm_begin(self, index: int) -> GpmWindow | None:
        """The first GPM sample of a window; None where the GPU or the driver has no GPM
        (before Hopper, or an old binding), said once per GPU in the log."""
        nv = self._nv
        if not self.available or (index, "gpm") in self._unsupported:
            return None
        sample = None
        try:
            handle = self._handle(index)
            if not int(nv.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice):
                raise nv.NVMLError(nv.NVML_ERROR_NOT_SUPPORTED)
            sample = nv.nvmlGpmSampleAlloc()
            nv.nvmlGpmSampleGet(handle, sample)
            return GpmWindow(index, sample)
        except (nv.NVMLError, AttributeError) as exc:
            if sample is not None:
                self._gpm_free(sample)
            self._unsupported.add((index, "gpm"))
            log.info("GPU %d: no GPM metrics (%s)", index, exc or type(exc).__name__)
            return None

    def gpm_end(self, window: GpmWindow) -> dict[str, float | None]:
        """GPM metrics over the window (percentages); None for a metric NVML refused."""
        nv = self._nv
        out: dict[str, float | None] = dict.fromkeys(GPM_METRICS)
        second = None
        try:
            second = nv.nvmlGpmSampleAlloc()
            nv.nvmlGpmSampleGet(self._handle(window.index), second)
            req = nv.c_nvmlGpmMetricsGet_t()
            req.version = nv.NVML_GPM_METRICS_GET_VERSION
            req.numMetrics = len(GPM_METRICS)
            req.sample1, req.sample2 = window.sample, second
            for i, metric_id in enumerate(GPM_METRICS.values()):
                req.metrics[i].metricId = metric_id
            nv.nvmlGpmMetricsGet(req)
            for i, name in enumerate(GPM_METRICS):
                m = req.metrics[i]
                out[name] = round(float(m.value), 2) if int(m.nvmlReturn) == 0 else None
        except nv.NVMLError as exc:
            log.warning("GPU %d: GPM metrics: %s", window.index, exc)
        finally:
            self._gpm_free(window.sample)
            if second is not None:
                self._gpm_free(second)
        return out

    def _gpm_free(self, sample: Any) -> None:
        try:
            self._nv.nvmlGpmSampleFree(sample)
        except self._nv.NVMLError:
            pass

    def _handle(self, index: int) -> Any:
        if index not in self._handles:
            self._handles[index] = self._nv.nvmlDeviceGetHandleByIndex(index)
        return self._handles[index]

    def _optional(self, index: int, fn: Any, *args: Any) -> Any:
        """Call fn; NotSupported (remembered per device) gives None; GPU lost propagates."""
        key = (index, fn.__name__)
        if key in self._unsupported:
            return None
        nv = self._nv
        try:
            return fn(*args)
        except nv.NVMLError as exc:
            if exc.value in (nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_FUNCTION_NOT_FOUND):
                self._unsupported.add(key)
                return None
            if exc.value in (nv.NVML_ERROR_NOT_FOUND, nv.NVML_ERROR_NO_PERMISSION):
                return None
            raise
        except getattr(nv, "NVMLLibraryMismatchError", ()):  # old driver behind a new binding
            self._unsupported.add(key)
            return None

    def _processes(self, index: int, handle: Any) -> list[ProcessGpuSample]:
        nv = self._nv
        mem: dict[int, int | None] = {}
        # MPS clients show up in the MPS list (type "M+C" in nvidia-smi); merge both by pid.
        for fn_name in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetMPSComputeRunningProcesses"):
            fn = getattr(nv, fn_name, None)
            if fn is None:
                continue
            for p in self._optional(index, fn, handle) or ():
                used = p.usedGpuMemory
                if mem.get(p.pid) is None:
                    mem[p.pid] = int(used) if used is not None else None
        util: dict[int, list[tuple[int, int]]] = {}
        last = self._util_ts_us.get(index, 0)
        for s in self._optional(index, nv.nvmlDeviceGetProcessUtilization, handle, last) or ():
            util.setdefault(s.pid, []).append((int(s.smUtil), int(s.memUtil)))
            last = max(last, int(s.timeStamp))
        self._util_ts_us[index] = last
        out = []
        for pid in sorted(set(mem) | set(util)):
            u = util.get(pid)
            out.append(ProcessGpuSample(
                pid=pid, gpu_index=index, gpu_mem_bytes=mem.get(pid),
                sm_util_pct=sum(x[0] for x in u) / len(u) if u else None,
                mem_util_pct=sum(x[1] for x in u) / len(u) if u else None))
        return out
