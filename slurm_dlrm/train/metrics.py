"""Progress reporting: JSON lines for the agent, a human line (or a bar) for people.

Metrics file (docs/interfaces.md section 5), one line per report, appended and flushed:
    {"t", "step", "samples_per_s", "step_time_s", "loss", "peak_gpu_bytes",
     "peak_tensor_bytes", "rss_bytes", ...}
plus `loss_avg` (over the report window), `peak_rss_bytes`, `steps_total`,
`world_size` and `device`. `samples_per_s` counts the whole job (all ranks).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import IO, Any

import psutil

_SELF = psutil.Process()


def rss_bytes() -> int:
    return int(_SELF.memory_info().rss)


def peak_rss_bytes() -> int:
    """This process's high-water RSS since it exec'd: VmHWM on Linux. Not ru_maxrss:
    the kernel carries the parent's high-water mark into it across fork+exec (a runner
    started from a 740 MiB pytest reported 742 MiB after one step at 528)."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux


_status_fd: tuple[int, int] | None = None  # (pid, fd of its /proc/self/status)


def _read_status() -> bytes:
    """/proc/self/status, read again through one kept-open descriptor (a third of the
    time of open+read+close; reopened in a forked child, whose status it is not)."""
    global _status_fd
    pid = os.getpid()
    if _status_fd is None or _status_fd[0] != pid:
        _status_fd = (pid, os.open("/proc/self/status", os.O_RDONLY | os.O_CLOEXEC))
    return os.pread(_status_fd[1], 1 << 16, 0)


def rss_and_peak_bytes() -> tuple[int, int]:
    """(rss_bytes(), peak_rss_bytes()) from one read of /proc/self/status: the runner
    reports both every metrics window, where psutil's statm read, then opening status,
    took about 4x as long (issue 47, the runner's overhead)."""
    rss = peak = None
    try:
        for line in _read_status().splitlines():
            if line.startswith(b"VmHWM:"):
                peak = int(line.split()[1]) * 1024  # kB
            elif line.startswith(b"VmRSS:"):
                rss = int(line.split()[1]) * 1024
                break  # VmRSS comes after VmHWM
    except (OSError, ValueError, IndexError):
        pass
    return (rss if rss is not None else rss_bytes()), (peak if peak is not None else peak_rss_bytes())


class MetricsWriter:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fh: IO[str] = open(path, "a", buffering=1)  # noqa: SIM115 - closed in close()

    def write(self, record: dict[str, Any]) -> None:
        self._fh.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def _human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 2**20:,.0f} MiB"


class Progress:
    """A rich progress bar on a terminal, else one plain line per report on stdout."""

    def __init__(self, name: str, total_steps: int, start_step: int, tty: bool | None = None) -> None:
        self.name = name
        self.total = total_steps
        self.tty = sys.stdout.isatty() if tty is None else tty
        self._bar: Any = None
        if self.tty:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[info]}"), TimeRemainingColumn())
            self._task = self._bar.add_task(name, total=total_steps, completed=start_step, info="")
            self._bar.start()

    def report(self, record: dict[str, Any]) -> None:
        info = (f"{record['samples_per_s']:,.0f} samples/s  loss {record['loss']:.4f}  "
                f"step {record['step_time_s'] * 1e3:.1f} ms  rss {_human_bytes(record['rss_bytes'])}")
        if record.get("peak_gpu_bytes") is not None:
            info += f"  gpu peak {_human_bytes(record['peak_gpu_bytes'])}"
        if self._bar is not None:
            self._bar.update(self._task, completed=record["step"], info=info)
        else:
            print(f"{self.name}: step {record['step']}/{self.total}  {info}", flush=True)

    def say(self, text: str) -> None:
        if self._bar is not None:
            self._bar.console.print(text)
        else:
            print(f"{self.name}: {text}", flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def human_eval_line(record: dict[str, Any]) -> str:
    """`eval at step 200: auc 0.7712 (planted 0.7813)  ne 0.8215 ...` for the job's log."""
    planted = record.get("planted_auc")
    text = f"eval at step {record['step']}: auc {record['eval_auc']:.4f}"
    if isinstance(planted, float):
        text += f" (planted model {planted:.4f})"
    return (text + f"  ne {record['eval_ne']:.4f}  log_loss {record['eval_log_loss']:.4f}  "
            f"calibration {record['eval_calibration']:.3f}  accuracy {record['eval_accuracy']:.4f}  "
            f"{record['eval_samples']:,} samples  {record['eval_s']:.2f} s")


def now() -> float:
    return time.time()
