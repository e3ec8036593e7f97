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
from slurm_dlrm.slurm.client import SlurmClient
from slurm_dlrm.slurm.states import JobState, to_job_state

__all__ = [
    "AccountingDisabled", "AcctRow", "JobInfo", "JobState", "NodeInfo", "PartitionRow", "SlurmBackend",
    "SlurmClient", "SlurmError", "SlurmNotFound", "SlurmTimeout", "to_job_state",
]
