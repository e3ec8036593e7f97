"""Reading a store someone else wrote: its schema checked, every read bounded in time.

An admin's `acct --all-users`, `report --all-users` and `exporter --all-users` open every
user's store, files those users can rewrite at will. A user can replace `jobs` by a VIEW
over an unbounded recursive CTE (the admin's reader then never returns), or add
functions to the schema through views, triggers or expression indexes. So a store read
on someone's behalf is opened with `PRAGMA trusted_schema = OFF` (SQLite 3.31+: schema
objects may call only innocuous functions), its schema is compared with the one our
migrations build (tables, never views; the known columns), and every read runs under a
progress handler that interrupts it past a time budget.
"""

from __future__ import annotations

import functools
import os
import pwd
import sqlite3
from collections.abc import Callable
from pathlib import Path

from slurm_dlrm.store.errors import StoreNotOwned, StoreUntrusted
from slurm_dlrm.store.migrations import MIGRATIONS, MIGRATIONS_TABLE
from slurm_dlrm.store.store import Store

# sqlite_master types a reader could be made to run code through; indexes are checked
# only for their table (an expression index can call functions: trusted_schema=OFF).
_CODE_TYPES = ("view", "trigger")


@functools.cache
def expected_schema() -> tuple[dict[str, frozenset[tuple[str, int]]], frozenset[tuple[str, str, str]]]:
    """(table -> column names, {(type, name, sql)} of views and triggers) of a store at
    the latest version, built once by running the migrations on an in-memory database."""
    conn = sqlite3.connect(":memory:")
    try:
        conn.execute(MIGRATIONS_TABLE)
        for m in MIGRATIONS:
            for stmt in m.statements:
                conn.execute(stmt)
            if m.apply is not None:
                m.apply(conn)
        return _tables(conn), _code(conn)
    finally:
        conn.close()


def _tables(conn: sqlite3.Connection) -> dict[str, frozenset[tuple[str, int]]]:
    out: dict[str, frozenset[tuple[str, int]]] = {}
    for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' "
                                "AND name NOT LIKE 'sqlite\\_%' ESCAPE '\\'").fetchall():
        out[name] = _columns(conn, name)
    return out


def _columns(conn: sqlite3.Connection, table: str) -> frozenset[tuple[str, int]]:
    """(name, hidden) of every column: table_xinfo also lists generated columns (hidden
    2 or 3), whose expression a reader would evaluate. A set: a store migrated from an
    older layout has the same columns in another order."""
    return frozenset((str(r[1]), int(r[6])) for r in conn.execute("SELECT * FROM pragma_table_xinfo(?)", (table,)))


def _code(conn: sqlite3.Connection) -> frozenset[tuple[str, str, str]]:
    marks = ", ".join("?" * len(_CODE_TYPES))
    rows = conn.execute(f"SELECT type, name, coalesce(sql, '') FROM sqlite_master WHERE type IN ({marks})",
                        _CODE_TYPES).fetchall()
    return frozenset((str(t), str(n), str(s)) for t, n, s in rows)


def check_schema(conn: sqlite3.Connection, where: str) -> None:
    """Raise StoreUntrusted unless the schema is the one our migrations build: every
    table we read is a table with exactly our columns, and no view or trigger of its own."""
    tables, code = expected_schema()
    kinds = {str(n): (str(t), str(s or "")) for n, t, s in
             conn.execute("SELECT name, type, sql FROM sqlite_master").fetchall()}
    for name, cols in tables.items():
        kind, sql = kinds.get(name, ("", ""))
        # a virtual table is type 'table' too; its module would run on every read
        if kind != "table" or not sql.upper().startswith("CREATE TABLE"):
            what = "missing" if not kind else "a virtual table" if kind == "table" else f"a {kind}"
            raise StoreUntrusted(f"{where}: {name!r} is {what}, not the table slurm-dlrm creates; not read")
        # table_xinfo of a *table* compiles nothing the user wrote (views are refused above)
        found = _columns(conn, name)
        if found != cols:
            odd = sorted(c for c, _ in found ^ cols)
            raise StoreUntrusted(f"{where}: table {name!r} differs from slurm-dlrm's in column(s) "
                                 f"{', '.join(odd)[:200]}; not read")
    extra = _code(conn) - code
    if extra:
        kind, name, _ = sorted(extra)[0]
        raise StoreUntrusted(f"{where}: {kind} {name[:80]!r} is not slurm-dlrm's; not read")


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
