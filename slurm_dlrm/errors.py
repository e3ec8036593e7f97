"""Exit codes and the domain errors that map onto them.

Every command exits with one of these (documented in the README):

    0  success
    1  runtime error (Slurm refused, a job failed, the cluster is down, ...)
    2  usage error or bad input (bad spec, bad site config, unknown option)

The library raises these; only the CLI turns them into a one-line message and an
exit code, so nothing below the CLI prints or exits.
"""

from __future__ import annotations

import reprlib
from typing import Any

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_USAGE = 2


# Values in error messages are cut short: an error never prints a whole value (a YAML
# alias bomb's repr was 3.6 GB, issue 32).
_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60
_REPR.maxlist = _REPR.maxdict = 6
_REPR.maxlevel = 2


def short_repr(value: Any) -> str:
    """repr(value), at most about 60 characters and 2 levels deep; never walks the
    whole value (reprlib stops at its limits)."""
    return _REPR.repr(value)


def one_line(text: str) -> str:
    """`text` with control and format characters escaped (a newline in a file name or a
    --set value, a right-to-left override), so an error stays one line, as printed."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


class DlrmError(Exception):
    """Base of every error the CLI reports as one line."""

    exit_code = EXIT_RUNTIME


class BadInput(DlrmError):
    """Input the user can fix: a bad spec, site config, or option (exit 2)."""

    exit_code = EXIT_USAGE


class ConfigError(BadInput):
    """A site-config key is missing, unknown or has a bad value."""

    def __init__(self, key: str, reason: str, path: str | None = None) -> None:
        self.key = key
        self.reason = reason
        self.path = path
        where = f"{path}: " if path else ""
        super().__init__(f"{where}{key}: {reason}")


class SpecError(BadInput):
    """A job spec field is missing, unknown or has a bad value."""

    def __init__(self, field: str, reason: str, path: str | None = None) -> None:
        self.field = field
        self.reason = reason
        self.path = path
        where = f"{path}: " if path else ""
        super().__init__(f"{where}{field}: {reason}")


# Exit codes of `slurm-dlrm train`, read by the agent to classify how a member ended.
# Distinct from the 128+N codes a shell gives to a process killed by signal N.
TRAIN_EXIT_OK = 0
TRAIN_EXIT_FAILED = 1  # any other failure
TRAIN_EXIT_BAD_SPEC = 2  # the spec did not validate
TRAIN_EXIT_OOM_GPU = 3  # CUDA out of memory (torch.OutOfMemoryError)
TRAIN_EXIT_OOM_HOST = 4  # host MemoryError
TRAIN_EXIT_PREEMPTED = 5  # stopped by SIGTERM/SIGUSR1 after writing a checkpoint

# Environment the agent passes to each member it launches.
ENV_METRICS_FILE = "SLURM_DLRM_METRICS_FILE"  # JSON lines of progress, appended
ENV_CHECKPOINT_DIR = "SLURM_DLRM_CHECKPOINT_DIR"  # where checkpoints go / resume from
ENV_JOB_ID = "SLURM_DLRM_JOB_ID"  # the member's id in the store
# A scenario file: the agent's NVML seam then samples the fake NVML (slurm_dlrm/emulated/).
ENV_FAKE_NVML = "SLURM_DLRM_FAKE_NVML"
