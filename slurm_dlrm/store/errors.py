"""Typed errors of the store (all `DlrmError`, so the CLI prints one line)."""

from __future__ import annotations

from slurm_dlrm.errors import DlrmError


class StoreError(DlrmError):
    """Base of the store's errors."""


class IllegalTransition(StoreError):
    """A state change that the lifecycle table does not allow."""

    def __init__(self, entity: str, entity_id: int, src: str, dst: str) -> None:
        self.entity = entity
        self.entity_id = entity_id
        self.src = src
        self.dst = dst
        super().__init__(f"{entity} {entity_id}: illegal transition {src} -> {dst}")


class StaleState(StoreError):
    """The caller expected another current state (someone else moved it first)."""

    def __init__(self, entity: str, entity_id: int, expected: str, actual: str) -> None:
        self.entity = entity
        self.entity_id = entity_id
        self.expected = expected
        self.actual = actual
        super().__init__(f"{entity} {entity_id}: expected state {expected}, found {actual}")


class UnknownEntity(StoreError):
    """No job/pack with that id (or name)."""

    def __init__(self, entity: str, key: object) -> None:
        self.entity = entity
        self.key = key
        super().__init__(f"no {entity} {key!r} in the store")


class StoreBusy(StoreError):
    """The write lock could not be taken within the retry budget."""


class SchemaTooNew(StoreError):
    """The database was migrated by a newer slurm-dlrm than this one."""


class StoreNotOwned(StoreError):
    """The store's folder or file belongs to another uid (exit 2: pick a folder of your own).

    Under a shared parent (``store_dir = "/shared/{user}"``) whoever creates the folder
    first owns it: using it as found would put our data where its owner can read and
    replace it."""

    exit_code = 2  # errors.EXIT_USAGE: bad input (the site's store_dir), not a runtime fault


class StoreUntrusted(StoreError):
    """Another user's store whose schema is not ours (views, unknown columns): not read."""


class StoreTimeout(StoreError):
    """A read of the store ran past its time budget and was interrupted."""


class StoreWalOnNetwork(StoreError):
    """A WAL store on a network filesystem that could not be switched to the rollback
    journal (another process has it open); nothing was changed."""


class LeaseLost(StoreError):
    """This service's lease on the store was taken by another host's: nothing more may be
    written or sent to Slurm (store/lease.py, `check_held`)."""


class StoreFull(StoreError):
    """The store's file system is full (SQLite's SQLITE_FULL): the write was rolled back,
    nothing of it is kept; a later write succeeds once there is room (issue 49)."""
