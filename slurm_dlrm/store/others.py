"""Other users' stores, as an admin's reader opens them (`acct`/`report`/`exporter
--all-users`): whose figures a store holds (its file's owner, not its folder's name or
its rows), and a read-only `Store` with its schema checked (store/guard.py) and every
read bounded in time.
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Callable
from pathlib import Path

from slurm_dlrm.store.errors import StoreNotOwned
from slurm_dlrm.store.store import Store


def _uid_of(name: str) -> int | None:
    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        return None


def _name_of(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid:{uid}"


def store_user(folder_user: str, file_uid: int, *, reader_uid: int | None = None,
               uid_of: Callable[[str], int | None] = _uid_of, name_of: Callable[[int], str] = _name_of) -> str:
    """Whose figures a store found under `folder_user`'s folder holds: its file's owner.

    The folder's name is kept only where the owner vouches for it: the account of that
    name owns the file, or the reader does (an admin's own test stores). A folder named
    after an account that does not own the file raises StoreNotOwned (someone made it
    first, or put a file in it); any other name gives way to the owner's account name.
    ``*`` (one shared store for everyone, rows name their users) is kept as it is.
    """
    if folder_user == "*":
        return folder_user
    uid = uid_of(folder_user)
    if uid is not None:
        if uid != file_uid:
            raise StoreNotOwned(f"owned by {name_of(file_uid)} (uid {file_uid}), not {folder_user} (uid {uid})")
        return folder_user
    me = os.geteuid() if reader_uid is None else reader_uid
    return folder_user if file_uid == me else name_of(file_uid)


# Another user's store: lock waits short (their service writes in bursts), every read bounded.
OTHER_BUSY_TIMEOUT_S = 1.0
OTHER_READ_BUDGET_S = 30.0
# What one store's reads may take in the exporter's scrape, and in a command that reads
# the copy another host's service published (service/remote.py).
UNTRUSTED_READ_BUDGET_S = 10.0


def open_other_store(path: Path, folder_user: str, *, read_budget_s: float = OTHER_READ_BUDGET_S,
                     busy_timeout_s: float = OTHER_BUSY_TIMEOUT_S) -> Store:
    """`path` read-only as someone else's store: its owner checked and made the label of
    every row (`Store.owner_user`), its schema checked, each read bounded in time."""
    st = os.stat(path)
    user = store_user(folder_user, st.st_uid)
    store = Store(path, readonly=True, busy_timeout_s=busy_timeout_s, retry_s=read_budget_s,
                  read_budget_s=read_budget_s, untrusted=True)
    if user != "*":
        store.owner_user = user
    return store
