"""Reading a store someone else wrote: its schema checked, every read bounded in time.

An admin's `acct --all-users`, `report --all-users` and `exporter --all-users` open every
user's store, files those users can rewrite at will. A user can replace `jobs` by a VIEW
over an unbounded recursive CTE (the admin's reader then never returns), or add
functions to the schema through views, triggers or expression indexes. So a store read
on someone's behalf is opened with `PRAGMA trusted_schema = OFF` (SQLite 3.31+: schema
objects may call only innocuous functions), its schema is compared with the one our
migrations build (tables, never views; the known columns), and every read runs under a
progress handler that interrupts it past a time budget (`Store(untrusted=True,
read_budget_s=...)`; whose store it is and how it is opened: store/others.py).
"""

from __future__ import annotations

import functools
import sqlite3

from slurm_dlrm.store.errors import StoreUntrusted
from slurm_dlrm.store.migrations import MIGRATIONS, MIGRATIONS_TABLE

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

