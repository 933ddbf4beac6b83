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
- The same table of a keyless shape holds its removals: ``_wb_row`` (the
  removed row as ``ROW(columns)::text``, hash-indexed), the removal's
  position, partition and offset, primary key ``(_wb_lsn, _wb_op_index)``, and
  the rank of the row it took (``wire.TOOK_COLUMNS``). A removal that finds no
  equal target row older than itself waits there (took NULL) for its row
  (appended by an older change on another partition, in a later batch), which
  it then cancels. A removal that took a row stays to take a later re-read
  copy of it instead (:mod:`spark_consumer.multiset`). Unscoped cuts of its
  partition and a completed unscoped backfill drop both kinds (their rows,
  below the cut, are gone too).

Invariants:
- :func:`ensure_table` creates what is missing and makes an existing table
  follow the shape's current writer schema (:mod:`spark_consumer.target_ddl`:
  renames, added columns, widened or cast types, a changed key; a dropped
  column is kept nullable unless ``on_dropped_column = "drop"``), all in the
  caller's transaction when there is one (the consumer's: the first batch that
  carries the new schema).
- A key column whose values do not cast to its new type raises
  :class:`ShapeCannotFollow`; nothing of that batch is applied.
"""

from __future__ import annotations

import logging
import zlib

import psycopg
from psycopg import sql

from schemas import wire
from spark_consumer.progress import ensure_progress, lock_ddl
from spark_consumer.shape_record import ShapeTarget
from spark_consumer.target_ddl import ExistingColumn, OnDropped, Step, WantedColumn, plan_changes

log = logging.getLogger(__name__)

# The target table's bookkeeping columns. Positions are nullable there: rows
# written behind walbridge's back (or there before it) have none, and count as
# the lowest position.
POSITION_DDL = ((wire.LSN_COLUMN, "bigint"), (wire.OP_INDEX_COLUMN, "bigint"), (wire.PARTITION_COLUMN, "integer"),
                (wire.OFFSET_COLUMN, "bigint"))
APPLIED_AT = wire.APPLIED_AT_COLUMN  # the applying transaction's start: the statements write now()
APPLIED_AT_DDL = (APPLIED_AT, "timestamptz NOT NULL DEFAULT now()")
BOOKKEEPING_DDL = (*POSITION_DDL, APPLIED_AT_DDL, (wire.SNAPSHOT_ID_COLUMN, "text"))
# Tombstones are only ever written by walbridge: their positions are never NULL.
TOMBSTONE_DDL = (*((name, f"{typ} NOT NULL") for name, typ in POSITION_DDL), APPLIED_AT_DDL)
POSITION_COLUMNS = tuple(name for name, _ in POSITION_DDL)
BOOKKEEPING_COLUMNS = tuple(name for name, _ in BOOKKEEPING_DDL)


def table_ident(target: ShapeTarget) -> sql.Identifier:
    return sql.Identifier(target.schema, target.table)


def tombstones_ident(target: ShapeTarget) -> sql.Identifier:
    return sql.Identifier(target.schema, target.tombstone_table)


class ShapeCannotFollow(RuntimeError):
    """The target cannot follow the shape's new writer schema (a key column
    whose values do not cast): that shape stops."""


def ensure_table(conn: psycopg.Connection, target: ShapeTarget, on_dropped_column: OnDropped = "keep") -> None:
    """Create the shape's table (and schema, tombstone table, progress tables)
    if missing; make an existing one follow ``target`` (module invariants)."""
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
            log.info("created target table %s.%s for shape %s (%s)", target.schema, target.table, target.shape,
                     f"key {', '.join(target.key_columns)}" if keys else "keyless: its value schema names no key")
        else:
            key_changed = _follow(conn, target, types, on_dropped_column)
            if key_changed:
                conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(tombstones_ident(target)))
            for d in book_defs:
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
            # Removals: the whole row, one per removal's position, and what it took.
            lead = [sql.SQL("{} text NOT NULL").format(sql.Identifier(wire.ROW_COLUMN))]
            pk = [sql.Identifier(wire.LSN_COLUMN), sql.Identifier(wire.OP_INDEX_COLUMN)]
        else:
            lead = [sql.SQL("{} {} NOT NULL").format(sql.Identifier(c.name), sql.SQL(t))
                    for c, t in zip(target.columns, types) if c.is_key]
            pk = keys
        defs = lead + [sql.SQL("{} {}").format(sql.Identifier(n), sql.SQL(d)) for n, d in TOMBSTONE_DDL]
        defs.append(sql.SQL("PRIMARY KEY ({})").format(sql.SQL(", ").join(pk)))
        conn.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} ({})").format(
            tombstones_ident(target), sql.SQL(", ").join(defs)))
        if target.keyless:  # tables of earlier versions lack what a removal took
            for name, typ in zip(wire.TOOK_COLUMNS, ("bigint", "bigint", "boolean")):
                conn.execute(sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS {} {}").format(
                    tombstones_ident(target), sql.Identifier(name), sql.SQL(typ)))
            conn.execute(sql.SQL("CREATE INDEX IF NOT EXISTS {} ON {} USING hash ({})").format(
                sql.Identifier(_short_name(target.tombstone_table, "__wb_row")), tombstones_ident(target),
                sql.Identifier(wire.ROW_COLUMN)))


def _follow(conn: psycopg.Connection, target: ShapeTarget, types: list[str], on_dropped: OnDropped) -> bool:
    """Run the steps that make the existing table hold ``target``'s columns;
    True when its key changed (the tombstone table is then made anew)."""
    ident = table_ident(target)
    regclass = ident.as_string(conn)
    existing = [ExistingColumn(name, typ, not_null) for name, typ, not_null in conn.execute(
        "SELECT attname, format_type(atttypid, atttypmod), attnotnull FROM pg_attribute "
        "WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped AND attname NOT LIKE '\\_wb\\_%%' "
        "ORDER BY attnum", (regclass,)).fetchall()]
    row = conn.execute(
        "SELECT c.conname, array_agg(a.attname ORDER BY k.i) FROM pg_constraint c "
        "CROSS JOIN LATERAL unnest(c.conkey) WITH ORDINALITY AS k(attnum, i) "
        "JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = k.attnum "
        "WHERE c.conrelid = %s::regclass AND c.contype = 'p' GROUP BY c.conname", (regclass,)).fetchone()
    constraint, key = (row[0], list(row[1])) if row else (None, [])
    wanted = [WantedColumn(c.name, t, c.is_key, c.aliases) for c, t in zip(target.columns, _format_types(conn, types))]
    steps = plan_changes(ident, tombstones_ident(target), existing, key, constraint, wanted, on_dropped)
    for step in steps:
        _run(conn, target, step)
    return any(s.kind in ("drop_key", "add_key", "keyless") for s in steps)


def _run(conn: psycopg.Connection, target: ShapeTarget, step: Step) -> None:
    if step.kind == "keyless":
        log.warning("shape %s has no key any more: its table %s.%s follows the rules of keyless shapes "
                    "(appends and removals of whole rows)", target.shape, target.schema, target.table)
        return
    if step.tombstones and conn.execute("SELECT to_regclass(%s) IS NULL",
                                        (tombstones_ident(target).as_string(conn),)).fetchone()[0]:
        return
    try:
        with conn.transaction():
            conn.execute(step.statement)
    except psycopg.Error as e:
        if step.fallback is None:
            if step.fatal is not None:
                raise ShapeCannotFollow(f"shape {target.shape}: {step.fatal} ({str(e).strip().splitlines()[0]})"
                                        ) from e
            raise
        log.warning("shape %s: column %s does not cast to its new type (%s): its values become NULL until the "
                    "producer's re-read of the shape brings them", target.shape, step.column,
                    str(e).strip().splitlines()[0])
        conn.execute(step.fallback)
    log.info("shape %s: %s", target.shape, step.statement.as_string(conn))


def _format_types(conn: psycopg.Connection, types: list[str]) -> list[str]:
    """Each type as the target's ``format_type`` prints it (what the catalog
    shows of an existing column)."""
    if not types:
        return []
    cur = conn.execute(sql.SQL("SELECT {} LIMIT 0").format(sql.SQL(", ").join(
        sql.SQL("NULL::{}").format(sql.SQL(t)) for t in types)))
    oids = [c.type_code for c in cur.description]
    mods = [cur.pgresult.fmod(i) for i in range(len(types))]
    return [r[0] for r in conn.execute(
        "SELECT format_type(o, m) FROM unnest(%s::oid[], %s::int[]) WITH ORDINALITY AS t(o, m, i) ORDER BY i",
        (oids, mods)).fetchall()]


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
