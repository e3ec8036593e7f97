"""The Slurm seam: every call slurm-dlrm makes to Slurm goes through a `SlurmBackend`.

`SlurmClient` runs the commands (the default); `FakeSlurm` is the stateful stand-in for
unit tests. A pyslurm backend can implement the same protocol later.
"""

from slurm_dlrm.slurm.base import (
    AccountingDisabled,
    AcctRow,
    JobInfo,
    NodeInfo,
    PartitionRow,
    SlurmBackend,
    SlurmError,
    SlurmNotFound,
    SlurmTimeout,
)
from slurm_dlrm.slurm.client import SlurmClient, UnsupportedSlurm
from slurm_dlrm.slurm.states import JobState, to_job_state

__all__ = [
    "AccountingDisabled", "AcctRow", "JobInfo", "JobState", "NodeInfo", "PartitionRow", "SlurmBackend",
    "SlurmClient", "SlurmError", "SlurmNotFound", "SlurmTimeout", "UnsupportedSlurm", "make_backend",
    "to_job_state",
]

ENV_BACKEND = "SLURM_DLRM_SLURM_BACKEND"


def make_backend(slurm_conf: str | None = None, kind: str | None = None,
                 timeout_s: float = 30.0) -> SlurmBackend:
    """The backend to use: `kind` or $SLURM_DLRM_SLURM_BACKEND, default "cli".

    "cli" runs the Slurm commands (Slurm 22.05 to 26.05; an older release is refused
    in one line at the first command).
    "pyslurm" is reserved for a backend on pyslurm (which builds only against the
    matching Slurm release); it is not written yet.
    """
    import os

    from slurm_dlrm.errors import BadInput

    kind = kind or os.environ.get(ENV_BACKEND) or "cli"
    if kind == "cli":
        return SlurmClient(slurm_conf, timeout_s=timeout_s)
    if kind == "pyslurm":
        raise BadInput(f"${ENV_BACKEND}=pyslurm: the pyslurm backend is not implemented yet; use cli")
    raise BadInput(f"${ENV_BACKEND}: unknown backend {kind!r} (cli or pyslurm)")
