"""The shape's tables in the target database, created from the shape's
columns and followed as the shape gains columns (:func:`ensure_table`).
walbridge's own tables (progress, backfills, staging) are
:mod:`spark_consumer.progress`'s.

Layout in the target database
-----------------------------
- The shape's table, named after the shape (``schema.table`` keeps its schema,
  an undotted name goes to ``public``): the shape's columns (types from the Avro
  fields' ``pg.type``; a type the target does not know becomes ``text``), primary
  key = the shape's key columns, plus ``_wb_lsn bigint``, ``_wb_op_index bigint``
  (the position of the change that wrote the row), ``_wb_partition int``,
  ``_wb_offset bigint`` (where that change was in Kafka), ``_wb_applied_at
  timestamptz`` (the applying transaction's start) and ``_wb_snapshot_id text``
  (:data:`BOOKKEEPING_DDL`). It holds exactly the live rows. The position
  columns are nullable: a row written behind walbridge's back has none.
  Keyless shapes have no primary key but a unique index on ``(_wb_lsn,
  _wb_op_index) WHERE _wb_snapshot_id IS NULL``: one change position yields at
  most one message per shape, so a live append is applied once whatever the
  replays (snapshot rows all share the snapshot's position, so they are
  de-duplicated by progress alone).
- ``<schema>."<table>__wb_tombstones"`` (keyed shapes): the key columns and the
  position, partition and offset of the delete (:data:`TOMBSTONE_DDL`). A key is
  in the table or in its tombstones, never both, and what is recorded there is
  the highest position applied for that key, so an older change for a deleted
  key is ignored. Tombstones of a partition below a cut (TRUNCATE,
  ``snapshot_end``, ``backfill_end``; a scoped one: only in its scope) go with
  the cut; :func:`spark_consumer.statements.gc_tombstones` drops others.

Invariants:
- :func:`ensure_table` never drops or retypes a column: it creates what is
  missing and adds the columns the shape has gained.
"""

from __future__ import annotations

import logging
import zlib

import psycopg
from psycopg import sql

from spark_consumer.apply_plan import ShapeTarget
from spark_consumer.progress import ensure_progress, lock_ddl

log = logging.getLogger(__name__)

# The target table's bookkeeping columns. Positions are nullable there: rows
# written behind walbridge's back (or there before it) have none, and count as
# the lowest position.
POSITION_DDL = (("_wb_lsn", "bigint"), ("_wb_op_index", "bigint"), ("_wb_partition", "integer"),
                ("_wb_offset", "bigint"))
APPLIED_AT = "_wb_applied_at"  # the applying transaction's start: the statements write now()
APPLIED_AT_DDL = (APPLIED_AT, "timestamptz NOT NULL DEFAULT now()")
BOOKKEEPING_DDL = (*POSITION_DDL, APPLIED_AT_DDL, ("_wb_snapshot_id", "text"))
# Tombstones are only ever written by walbridge: their positions are never NULL.
TOMBSTONE_DDL = (*((name, f"{typ} NOT NULL") for name, typ in POSITION_DDL), APPLIED_AT_DDL)
POSITION_COLUMNS = tuple(name for name, _ in POSITION_DDL)
BOOKKEEPING_COLUMNS = tuple(name for name, _ in BOOKKEEPING_DDL)


def table_ident(target: ShapeTarget) -> sql.Identifier:
    return sql.Identifier(target.schema, target.table)


def tombstones_ident(target: ShapeTarget) -> sql.Identifier:
    return sql.Identifier(target.schema, target.tombstone_table)


def ensure_table(conn: psycopg.Connection, target: ShapeTarget) -> None:
    """Create the shape's table (and schema, tombstone table, progress tables)
    if missing; add columns the shape has gained. Never drops or retypes."""
    ensure_progress(conn)
    with conn.transaction():
        lock_ddl(conn)
        types = _resolve_types(conn, target)
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(target.schema)))
        exists = conn.execute("SELECT to_regclass(%s) IS NOT NULL",
                              (table_ident(target).as_string(conn),)).fetchone()[0]
        col_defs = [sql.SQL("{} {}").format(sql.Identifier(c.name), sql.SQL(t))
                    for c, t in zip(target.columns, types)]
        book_defs = [sql.SQL("{} {}").format(sql.Identifier(n), sql.SQL(d)) for n, d in BOOKKEEPING_DDL]
        keys = [sql.Identifier(k) for k in target.key_columns]
        if not exists:
            defs = col_defs + book_defs
            if keys:
                defs.append(sql.SQL("PRIMARY KEY ({})").format(sql.SQL(", ").join(keys)))
            conn.execute(sql.SQL("CREATE TABLE {} ({})").format(table_ident(target), sql.SQL(", ").join(defs)))
            log.info("created target table %s.%s for shape %s", target.schema, target.table, target.shape)
        else:
            for d in col_defs + book_defs:
                conn.execute(sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS {}").format(table_ident(target), d))
            # Tables of earlier versions had NOT NULL positions: relax them (once).
            for (col,) in conn.execute(
                    "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attname = ANY(%s) "
                    "AND attnotnull", (table_ident(target).as_string(conn), list(POSITION_COLUMNS))).fetchall():
                conn.execute(sql.SQL("ALTER TABLE {} ALTER COLUMN {} DROP NOT NULL").format(
                    table_ident(target), sql.Identifier(col)))
        if target.keyless:
            conn.execute(sql.SQL("CREATE UNIQUE INDEX IF NOT EXISTS {} ON {} (_wb_lsn, _wb_op_index) "
                                 "WHERE _wb_snapshot_id IS NULL").format(
                sql.Identifier(_short_name(target.table, "__wb_pos")), table_ident(target)))
        else:
            key_defs = [sql.SQL("{} {} NOT NULL").format(sql.Identifier(c.name), sql.SQL(t))
                        for c, t in zip(target.columns, types) if c.is_key]
            defs = key_defs + [sql.SQL("{} {}").format(sql.Identifier(n), sql.SQL(d)) for n, d in TOMBSTONE_DDL]
            defs.append(sql.SQL("PRIMARY KEY ({})").format(sql.SQL(", ").join(keys)))
            conn.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} ({})").format(
                tombstones_ident(target), sql.SQL(", ").join(defs)))


def _resolve_types(conn: psycopg.Connection, target: ShapeTarget) -> list[str]:
    """Each column's type; ``text`` where the target does not know the type."""
    out = []
    for col in target.columns:
        t = col.sql_type
        try:
            with conn.transaction():
                known = conn.execute("SELECT to_regtype(%s) IS NOT NULL", (t,)).fetchone()[0]
        except psycopg.Error:
            known = False
        if not known:
            log.warning("shape %s: column %s has type %r, which the target does not know: using text",
                        target.shape, col.name, t)
            t = "text"
        out.append(t)
    return out


def _short_name(base: str, suffix: str) -> str:
    name = base + suffix
    if len(name.encode()) <= 63:
        return name
    tag = f"_{zlib.crc32(name.encode()):08x}"
    return base.encode()[: 63 - len(suffix) - len(tag)].decode("utf-8", "ignore") + tag + suffix
