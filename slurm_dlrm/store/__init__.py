"""The store: SQLite (through sqlite-utils) for jobs, packs, placements, samples, events.

See docs/store.md. Typical use::

    from slurm_dlrm.store import Store, JobState
    with Store.for_user(site) as store:
        job_id = store.add_job(user=..., name=..., spec=..., spec_fingerprint=..., estimate=...)
        store.transition_job(job_id, JobState.CANCELLED, "cancelled by the user")
"""

from slurm_dlrm.store.errors import (
    IllegalTransition,
    SchemaTooNew,
    StaleState,
    StoreBusy,
    StoreError,
    UnknownEntity,
)
from slurm_dlrm.store.ingest import (
    IngestResult,
    OnRecord,
    ingest_pack_reports,
    ingest_spool_file,
    record_as_event,
)
from slurm_dlrm.store.records import CalibrationRow, Job, JobUsage, NewPlacement, Pack, Placement
from slurm_dlrm.store.states import (
    JOB_TERMINAL,
    JOB_TRANSITIONS,
    PACK_ACTIVE,
    PACK_TERMINAL,
    PACK_TRANSITIONS,
    JobState,
    PackState,
)
from slurm_dlrm.store.store import Store, current_user, store_path_for

__all__ = [
    "JOB_TERMINAL", "JOB_TRANSITIONS", "PACK_ACTIVE", "PACK_TERMINAL", "PACK_TRANSITIONS",
    "CalibrationRow", "IllegalTransition", "IngestResult", "Job", "JobState", "JobUsage", "NewPlacement",
    "OnRecord", "Pack", "PackState", "Placement", "SchemaTooNew", "StaleState", "Store",
    "StoreBusy", "StoreError", "UnknownEntity", "current_user", "ingest_pack_reports", "ingest_spool_file",
    "record_as_event", "store_path_for",
]
