"""The leaves of the shapes' partitioned tables, watched while the producer
streams: what the WAL does not say when a partition comes or goes.

Invariants:
- Changes of every leaf reach the root's shapes through the publication
  (``publish_via_partition_root``): a partition created or attached needs
  nothing here for the rows written after it joined.
- Rows a table already held when it was ATTACHed are no change in the WAL. A
  new leaf holding a row older than its own catalog row (``pg_class.xmin``:
  the transaction that created or attached it) had rows before it joined: every
  shape on the root is backfilled (the backfill re-reads the root; apply
  converges by position). A leaf created empty and filled afterwards asks for
  nothing.
- A DETACHed leaf's rows leave the root without a change: the target keeps
  them until a backfill of the shape; the producer says so in its log.
- Leaves that came while the producer was stopped are not seen as new.
- Reads the catalog only; what to do is the caller's ``request(shape, reason)``.
"""

from __future__ import annotations

import logging
from typing import Callable

import psycopg
from psycopg import sql

from producer.catalog import TableInfo

log = logging.getLogger("walbridge.producer")

_LEAVES_SQL = """
SELECT n.nspname, c.relname, c.oid
FROM pg_partition_tree(%s) t JOIN pg_class c ON c.oid = t.relid JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE t.isleaf AND t.relid <> %s
"""


def leaf_changes(known: dict[str, int], current: dict[str, int]) -> tuple[list[str], list[str]]:
    """Leaves (qualified name → oid) added and gone between two looks; a leaf
    dropped and re-created under its name (a new oid) is both."""
    added = sorted(q for q, oid in current.items() if known.get(q) != oid)
    gone = sorted(q for q, oid in known.items() if current.get(q) != oid)
    return added, gone


class PartitionWatch:
    """Looks at the leaves of every partitioned shape table (``poll``)."""

    def __init__(self, conn: psycopg.Connection, tables: dict[str, TableInfo], shapes: dict[str, list[str]],
                 request: Callable[[str, str], None]):
        self._conn = conn
        self._roots = {q: t for q, t in tables.items() if t.partitioned}
        self._shapes = shapes  # table → its shapes' names
        self._request = request
        self._known = {q: self._leaves(t) for q, t in self._roots.items()}

    def _leaves(self, root: TableInfo) -> dict[str, int]:
        return {f"{s}.{n}": oid for s, n, oid in self._conn.execute(_LEAVES_SQL, (root.oid, root.oid))}

    def _held_rows_before(self, qualified: str, oid: int) -> bool:
        schema, name = qualified.split(".", 1)
        query = sql.SQL("SELECT EXISTS (SELECT 1 FROM {} t WHERE age(t.xmin) >= "
                        "(SELECT age(xmin) FROM pg_class WHERE oid = {}))").format(
            sql.Identifier(schema, name), sql.Literal(oid))
        try:
            return self._conn.execute(query).fetchone()[0]
        except psycopg.errors.UndefinedTable:
            return False  # dropped since: nothing of it to read
        except psycopg.errors.InsufficientPrivilege:
            return True  # partitions do not inherit grants: unknown, so re-read (the root may be read)

    def poll(self) -> None:
        for root, table in self._roots.items():
            current = self._leaves(table)
            added, gone = leaf_changes(self._known[root], current)
            for leaf in gone:
                log.warning("%s is no longer a partition of %s: its rows stay in the target of shape(s) %s until "
                            "a backfill (walbridge backfill --shape NAME)", leaf, root, ", ".join(self._shapes[root]))
            for leaf in added:
                if self._held_rows_before(leaf, current[leaf]):
                    for shape in self._shapes[root]:
                        self._request(shape, f"{leaf} attached to {root} with rows")
                else:
                    log.info("%s is a new partition of %s", leaf, root)
            self._known[root] = current
