"""The apply shell on the target PostgreSQL (psycopg 3): target tables,
progress, staging with COPY and the set-based statements that carry out an
:class:`~spark_consumer.apply_plan.ApplyPlan`.

Layout in the target database
-----------------------------
- The shape's table, named after the shape (``schema.table`` keeps its schema,
  an undotted name goes to ``public``): the shape's columns (types from the Avro
  fields' ``pg.type``; a type the target does not know becomes ``text``), primary
  key = the shape's key columns, plus ``_wb_lsn bigint``, ``_wb_op_index bigint``
  (the position of the change that wrote the row), ``_wb_partition int``,
  ``_wb_offset bigint`` (where that change was in Kafka), ``_wb_applied_at
  timestamptz`` (the applying transaction's start) and ``_wb_snapshot_id text``.
  It holds exactly the live rows. The position columns are nullable: a row
  written behind walbridge's back has none. Keyless shapes have no primary
  key but a unique index on ``(_wb_lsn, _wb_op_index) WHERE _wb_snapshot_id IS NULL``:
  one change position yields at most one message per shape, so a live append is
  applied once whatever the replays (snapshot rows all share the snapshot's
  position, so they are de-duplicated by progress alone).
- ``<schema>."<table>__wb_tombstones"`` (keyed shapes): the key columns and the
  position, partition and offset of the delete. A key is in the table or in
  its tombstones, never both, and what is recorded there is the highest position
  applied for that key, so an older change for a deleted key is ignored.
  Tombstones of a partition below a cut (TRUNCATE, ``snapshot_end``,
  ``backfill_end``; a scoped one: only in its scope) go with the cut;
  :func:`gc_tombstones` drops others.
- ``_walbridge.progress(consumer_group, topic, partition, next_offset,
  applied_lsn, applied_op_index, floor_lsn, floor_op_index, updated_at)``:
  per consumer group and topic-partition, the next Kafka offset to apply, the
  highest position applied and the highest cut applied. Written in the same
  transaction as the rows it covers.
- ``_walbridge.backfills(consumer_group, topic, backfill_id, shape, start_lsn,
  partitions, partitions_done, scope, rows, started_at, updated_at,
  completed_at, gc_deleted, gc_tombstones)``: per backfill, the partitions
  whose ``backfill_end`` is applied (written in the batch's transaction; a
  replay adds nothing) and, once all are, when its final GC ran and what it
  removed (:func:`read_backfills`).
- Staged apply only: ``_walbridge.staged_parts`` (UNLOGGED, one row per staged
  part) and ``_walbridge."stage_<hash>"`` (UNLOGGED, one per staged part).

Invariants:
- One transaction per batch: lock the parts' progress rows (in a fixed order),
  skip what they cover, stage the plan with COPY, run the set-based statements,
  move progress to the end of each part, commit. A crash anywhere leaves
  either all of it or none of it; a replayed micro-batch finds its offsets
  covered and is skipped part by part (rows below ``next_offset``).
- Every write is guarded by position: an upsert lands only where the target
  row's position is lower and no tombstone has an equal or higher one; a delete
  removes only an older row and leaves a tombstone; a cut removes only rows of
  its partition below it. So apply is idempotent and order-independent per key
  even when progress cannot help (offset reset with ``on_offset_reset="follow"``,
  keys that moved between partitions).
- A NULL position (a target row written behind walbridge's back) is lower
  than every position: any change or backfill row overwrites (or deletes) it.
- Cuts run after the batch's writes. A scoped ``backfill_end`` (see
  :mod:`spark_consumer.apply_plan`) deletes rows and tombstones of its
  partition in its key buckets (:func:`schemas.buckets.in_scope`, under
  ``SESSION_SETTINGS``) below its position, and leaves the floor alone.
- Final GC: the transaction that applies a backfill's ``backfill_end`` on the
  last of its ``partitions`` also deletes every target row in its scope (any
  ``_wb_partition``, NULL included) whose position is below the backfill's
  start ``(S, 0)`` or NULL, and the tombstones in scope below it, and sets
  ``completed_at`` (once: a completed backfill is never collected again).
  ``BatchResult.backfills_completed`` reports it.
- Values are staged in PostgreSQL's text COPY format; special values (``_wb_special``)
  are written as the PostgreSQL text they are. Naive datetimes for
  ``timestamptz`` columns are read as UTC (the apply sets ``TimeZone`` to UTC
  for its transaction). A batch whose every value has a binary form that
  PostgreSQL reads as it would read the text (plain ints in range, Decimals,
  aware datetimes for ``timestamptz``, str for text, ...: ``_BINARY_CLASSES``)
  is staged with binary COPY instead, which is faster; anything else (a
  special value, a naive datetime for ``timestamptz``, a type not listed)
  keeps the whole batch in text.
- ``apply_batch`` commits, unless the connection is already inside a
  transaction: then it runs in a savepoint and the caller commits (or rolls back).
- Kafka offsets may be committed to the consumer group only after this commit
  (``BatchResult.offsets``); a crash between the two is harmless because the
  progress table, not the group, decides what is applied.

Why no replication origins: an origin records one remote LSN per origin and
transaction (``pg_replication_origin_xact_setup``), and a session can drive one
origin at a time. A walbridge batch commits many topic-partitions (and shapes)
at once, each at its own position, and partitions do not share an LSN order
that would make one "applied up to" LSN true for all of them; what must be
exact is the Kafka offset per partition, which an origin cannot hold. The
progress table carries both, and since it is written once per partition per
micro-batch (not per source transaction), the bloat that origins avoid is a
few HOT updates per batch (the table has fillfactor 50). Origins also need
superuser (or explicit grants) on the target.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import zlib
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from decimal import Decimal
from operator import itemgetter
from typing import Any, Iterable, Mapping, Sequence

import psycopg
from psycopg import sql
from psycopg.adapt import Dumper
from psycopg.pq import Format
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from schemas import wire
from schemas.buckets import SESSION_SETTINGS, in_scope
from spark_consumer.apply_plan import (
    APPEND, DEFAULT_GC_CONTROLS, DELETE, REMOVE, STAGE_EXTRA, UPSERT, ApplyPlan, Cut, OffsetResetError, PlanError, Position,
    Progress, ShapeTarget, TargetColumn, classify_cuts, field_getter, field_index, make_cut, plan_batch,
    split_replayed,
)

__all__ = [
    "ShapeTarget", "TargetColumn", "Part", "PartResult", "BatchResult", "BackfillGC", "Progress", "StagedPart",
    "ProgressGapError", "OffsetResetError", "StagingMissingError", "PlanError",
    "ensure_progress", "ensure_table", "read_progress", "read_backfills", "apply_batch", "apply_shapes",
    "stage_part", "commit_batch", "drop_stale_staging", "gc_tombstones", "parts_from_rows", "staging_table_name",
]

log = logging.getLogger(__name__)

META_SCHEMA = wire.META_SCHEMA
# Positions are nullable in the target table: rows written behind walbridge's
# back (or there before it) have none, and count as the lowest position.
BOOKKEEPING_DDL = (
    ("_wb_lsn", "bigint"),
    ("_wb_op_index", "bigint"),
    ("_wb_partition", "integer"),
    ("_wb_offset", "bigint"),
    ("_wb_applied_at", "timestamptz NOT NULL DEFAULT now()"),
    ("_wb_snapshot_id", "text"),
)
POSITION_COLUMNS = ("_wb_lsn", "_wb_op_index", "_wb_partition", "_wb_offset")
TOMBSTONE_DDL = (  # tombstones are only ever written by walbridge
    ("_wb_lsn", "bigint NOT NULL"),
    ("_wb_op_index", "bigint NOT NULL"),
    ("_wb_partition", "integer NOT NULL"),
    ("_wb_offset", "bigint NOT NULL"),
    ("_wb_applied_at", "timestamptz NOT NULL DEFAULT now()"),
)
CUT_KIND = "t"

_META_DDL = f"""
CREATE SCHEMA IF NOT EXISTS {META_SCHEMA};
CREATE TABLE IF NOT EXISTS {META_SCHEMA}.progress (
    consumer_group text NOT NULL,
    topic text NOT NULL,
    partition integer NOT NULL,
    next_offset bigint NOT NULL,
    applied_lsn bigint,
    applied_op_index bigint,
    floor_lsn bigint,
    floor_op_index bigint,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_group, topic, partition)
) WITH (fillfactor = 50);
CREATE UNLOGGED TABLE IF NOT EXISTS {META_SCHEMA}.staged_parts (
    consumer_group text NOT NULL,
    topic text NOT NULL,
    partition integer NOT NULL,
    end_offset bigint NOT NULL,
    start_offset bigint NOT NULL,
    stage_table text NOT NULL,
    shape text NOT NULL,
    info jsonb NOT NULL,
    staged_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_group, topic, partition, end_offset)
);
CREATE TABLE IF NOT EXISTS {META_SCHEMA}.backfills (
    consumer_group text NOT NULL,
    topic text NOT NULL,
    backfill_id text NOT NULL,
    shape text NOT NULL,
    start_lsn bigint NOT NULL,
    partitions integer NOT NULL,
    partitions_done integer[] NOT NULL DEFAULT '{{}}',
    scope jsonb,
    rows bigint,
    started_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    completed_at timestamptz,
    gc_deleted bigint,
    gc_tombstones bigint,
    PRIMARY KEY (consumer_group, topic, backfill_id)
);
"""


class ProgressGapError(RuntimeError):
    """A part starts after the partition's applied offsets end: messages in
    between would never be applied."""


class StagingMissingError(RuntimeError):
    """``commit_batch`` was asked for a part that is not (or no longer) staged."""


# ------------------------------------------------------------------ inputs
@dataclass(frozen=True)
class Part:
    """One topic-partition's share of a micro-batch: the offset range
    ``[start, end)`` the batch covers and the decoded rows in it: mappings,
    or (the fast form) tuples whose items ``fields`` names (see
    :func:`spark_consumer.apply_plan.plan_batch`)."""

    topic: str
    partition: int
    start: int
    end: int
    rows: Sequence = ()
    fields: tuple[str, ...] | None = None

    @property
    def tp(self) -> tuple[str, int]:
        return (self.topic, self.partition)


def parts_from_rows(rows: Iterable, ranges: Mapping[tuple[str, int], tuple[int, int]] | None = None,
                    fields: Sequence[str] | None = None) -> list[Part]:
    """Group rows (mappings, or tuples laid out by ``fields``) by (topic,
    partition). ``ranges`` gives each partition's ``[start, end)`` (the
    micro-batch's offsets, which may include partitions without rows); without
    it a part spans its rows' offsets."""
    fields = tuple(fields) if fields is not None else None
    if fields is None:
        def tp_of(r):
            return (r["_wb_topic"], int(r["_wb_partition"]))
    else:
        tp_of = itemgetter(field_index(fields, "_wb_topic"), field_index(fields, "_wb_partition"))
    offset_of = field_getter(fields, "_wb_offset")
    grouped: dict[tuple[str, int], list] = defaultdict(list)
    for r in rows:
        grouped[tp_of(r)].append(r)
    parts = []
    for tp in sorted(set(grouped) | set(ranges or {})):
        rs = grouped.get(tp, [])
        if ranges and tp in ranges:
            start, end = ranges[tp]
        else:
            offsets = [int(offset_of(r)) for r in rs]
            start, end = min(offsets), max(offsets) + 1
        parts.append(Part(tp[0], int(tp[1]), int(start), int(end), rs, fields))
    return parts


# ----------------------------------------------------------------- results
@dataclass
class PartResult:
    """What happened to one topic-partition's part of a batch."""

    topic: str
    partition: int
    start: int
    end: int
    rows: int = 0
    skipped_replayed: int = 0  # offsets progress already covered
    control: int = 0
    dlq: int = 0
    superseded: int = 0  # replaced in the batch by a newer change of the same key
    erased: int = 0  # below a cut (same batch) or the partition's floor (earlier batch)
    truncates: int = 0
    upserted: int = 0  # rows inserted or updated
    appended: int = 0  # keyless rows inserted
    deleted: int = 0  # live rows removed by deletes (keyed) or removals (keyless)
    tombstoned: int = 0
    stale: int = 0  # changes not applied: the target had the key at an equal or newer position
    truncated: int = 0  # rows removed by this partition's cuts (scoped ones included)
    tombstones_dropped: int = 0
    offset_reset: bool = False
    next_offset: int = 0  # progress after this batch

    @property
    def applied(self) -> int:
        return self.upserted + self.appended + self.deleted + self.tombstoned + self.truncated


@dataclass(frozen=True)
class BackfillGC:
    """A backfill this batch completed (its ``backfill_end`` applied on every
    partition) and what its final GC removed."""

    topic: str
    backfill_id: str
    shape: str
    gc_deleted: int  # target rows in scope below the backfill's start or without a position
    gc_tombstones: int


@dataclass
class BatchResult:
    parts: dict[tuple[str, int], PartResult] = field(default_factory=dict)
    controls: list[Mapping] = field(default_factory=list)
    backfills_completed: list[BackfillGC] = field(default_factory=list)

    @property
    def offsets(self) -> dict[tuple[str, int], int]:
        """Next offset per (topic, partition): what to commit to the consumer
        group once the target transaction has committed."""
        return {tp: r.next_offset for tp, r in self.parts.items()}

    def total(self, name: str) -> int:
        return sum(getattr(r, name) for r in self.parts.values())


# --------------------------------------------------------------- DDL / setup
def _ident(*parts: str) -> sql.Identifier:
    return sql.Identifier(*parts)


def _table(target: ShapeTarget) -> sql.Identifier:
    return _ident(target.schema, target.table)


def _tombstones(target: ShapeTarget) -> sql.Identifier:
    return _ident(target.schema, target.tombstone_table)


def _short_name(base: str, suffix: str) -> str:
    name = base + suffix
    if len(name.encode()) <= 63:
        return name
    tag = f"_{zlib.crc32(name.encode()):08x}"
    return base.encode()[: 63 - len(suffix) - len(tag)].decode("utf-8", "ignore") + tag + suffix


def ensure_progress(conn: psycopg.Connection) -> None:
    """Create ``_walbridge.progress``, ``_walbridge.staged_parts`` and
    ``_walbridge.backfills`` if missing."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtext('walbridge.ddl'))")
        conn.execute(_META_DDL)


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


def ensure_table(conn: psycopg.Connection, target: ShapeTarget) -> None:
    """Create the shape's table (and schema, tombstone table, progress tables)
    if missing; add columns the shape has gained. Never drops or retypes."""
    ensure_progress(conn)
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtext('walbridge.ddl'))")
        types = _resolve_types(conn, target)
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(_ident(target.schema)))
        exists = conn.execute("SELECT to_regclass(%s) IS NOT NULL",
                              (sql.Identifier(target.schema, target.table).as_string(conn),)).fetchone()[0]
        col_defs = [sql.SQL("{} {}").format(_ident(c.name), sql.SQL(t)) for c, t in zip(target.columns, types)]
        book_defs = [sql.SQL("{} {}").format(_ident(n), sql.SQL(d)) for n, d in BOOKKEEPING_DDL]
        keys = [_ident(k) for k in target.key_columns]
        if not exists:
            defs = col_defs + book_defs
            if keys:
                defs.append(sql.SQL("PRIMARY KEY ({})").format(sql.SQL(", ").join(keys)))
            conn.execute(sql.SQL("CREATE TABLE {} ({})").format(_table(target), sql.SQL(", ").join(defs)))
            log.info("created target table %s.%s for shape %s", target.schema, target.table, target.shape)
        else:
            for d in col_defs + book_defs:
                conn.execute(sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS {}").format(_table(target), d))
            # Tables of earlier versions had NOT NULL positions: relax them (once).
            for (col,) in conn.execute(
                    "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attname = ANY(%s) "
                    "AND attnotnull", (sql.Identifier(target.schema, target.table).as_string(conn),
                                       list(POSITION_COLUMNS))).fetchall():
                conn.execute(sql.SQL("ALTER TABLE {} ALTER COLUMN {} DROP NOT NULL").format(
                    _table(target), _ident(col)))
        if target.keyless:
            conn.execute(sql.SQL("CREATE UNIQUE INDEX IF NOT EXISTS {} ON {} (_wb_lsn, _wb_op_index) "
                                 "WHERE _wb_snapshot_id IS NULL").format(
                _ident(_short_name(target.table, "__wb_pos")), _table(target)))
        else:
            key_defs = [sql.SQL("{} {} NOT NULL").format(_ident(c.name), sql.SQL(t))
                        for c, t in zip(target.columns, types) if c.is_key]
            defs = key_defs + [sql.SQL("{} {}").format(_ident(n), sql.SQL(d)) for n, d in TOMBSTONE_DDL]
            defs.append(sql.SQL("PRIMARY KEY ({})").format(sql.SQL(", ").join(keys)))
            conn.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} ({})").format(
                _tombstones(target), sql.SQL(", ").join(defs)))


# ---------------------------------------------------------------- progress
def read_progress(conn: psycopg.Connection, group: str, topic: str | None = None
                  ) -> dict[tuple[str, int], Progress]:
    """The group's progress per (topic, partition) (e.g. to resume a source
    whose checkpoint is gone)."""
    q = ("SELECT topic, partition, next_offset, applied_lsn, applied_op_index, floor_lsn, floor_op_index "
         f"FROM {META_SCHEMA}.progress WHERE consumer_group = %s")
    params: list[Any] = [group]
    if topic is not None:
        q += " AND topic = %s"
        params.append(topic)
    return {(r[0], r[1]): _progress(r[2:]) for r in conn.execute(q, params)}


def read_backfills(conn: psycopg.Connection, group: str | None = None) -> list[dict]:
    """The ``_walbridge.backfills`` rows (of ``group``, or all) as dicts, oldest
    first; ``[]`` if the table does not exist yet."""
    if not conn.execute(f"SELECT to_regclass('{META_SCHEMA}.backfills') IS NOT NULL").fetchone()[0]:
        return []
    q = ("SELECT consumer_group, topic, backfill_id, shape, start_lsn, partitions, partitions_done, scope, rows, "
         "started_at, updated_at, completed_at, gc_deleted, gc_tombstones "
         f"FROM {META_SCHEMA}.backfills")
    params: list[Any] = []
    if group is not None:
        q += " WHERE consumer_group = %s"
        params.append(group)
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(q + " ORDER BY consumer_group, topic, started_at, backfill_id", params).fetchall()


def _progress(r: Sequence) -> Progress:
    nxt, al, ao, fl, fo = r
    return Progress(nxt, (al, ao) if al is not None else None, (fl, fo) if fl is not None else None)


def _lock_progress(conn: psycopg.Connection, group: str, parts: Sequence[Part]
                   ) -> tuple[dict[tuple[str, int], Progress], set[tuple[str, int]]]:
    """Create missing progress rows (at the part's start) and lock all of them,
    in (topic, partition) order. Returns the progress and the set of rows that
    existed before."""
    ordered = sorted({p.tp: p for p in parts}.values(), key=lambda p: p.tp)
    topics = [p.topic for p in ordered]
    partitions = [p.partition for p in ordered]
    created = conn.execute(
        f"INSERT INTO {META_SCHEMA}.progress AS g (consumer_group, topic, partition, next_offset) "
        "SELECT %s, t, p, s FROM unnest(%s::text[], %s::int[], %s::bigint[]) AS u(t, p, s) "
        "ON CONFLICT DO NOTHING RETURNING topic, partition",
        (group, topics, partitions, [p.start for p in ordered])).fetchall()
    rows = conn.execute(
        "SELECT topic, partition, next_offset, applied_lsn, applied_op_index, floor_lsn, floor_op_index "
        f"FROM {META_SCHEMA}.progress WHERE consumer_group = %s "
        "AND (topic, partition) IN (SELECT * FROM unnest(%s::text[], %s::int[])) "
        "ORDER BY topic, partition FOR UPDATE", (group, topics, partitions)).fetchall()
    progress = {(r[0], r[1]): _progress(r[2:]) for r in rows}
    new = {(t, p) for t, p in created}
    return progress, set(progress) - new


def _check_gap(part: Part, progress: Progress, on_gap: str) -> None:
    if part.start > progress.next_offset:
        msg = (f"{part.topic}[{part.partition}]: the batch starts at offset {part.start} but offsets from "
               f"{progress.next_offset} on were never applied")
        if on_gap == "raise":
            raise ProgressGapError(msg + " (pass on_gap='ignore' to accept the gap)")
        log.warning("%s; accepting the gap", msg)


def _write_progress(conn: psycopg.Connection, group: str, updates: list[tuple]) -> None:
    """``updates``: (topic, partition, next_offset, applied, floor)."""
    if not updates:
        return
    cols = list(zip(*[(t, p, n, a[0] if a else None, a[1] if a else None, f[0] if f else None,
                       f[1] if f else None) for t, p, n, a, f in updates]))
    conn.execute(
        f"UPDATE {META_SCHEMA}.progress AS g SET next_offset = u.n, applied_lsn = u.al, applied_op_index = u.ao, "
        "floor_lsn = u.fl, floor_op_index = u.fo, updated_at = now() "
        "FROM unnest(%s::text[], %s::int[], %s::bigint[], %s::bigint[], %s::bigint[], %s::bigint[], %s::bigint[]) "
        "AS u(t, p, n, al, ao, fl, fo) WHERE g.consumer_group = %s AND g.topic = u.t AND g.partition = u.p",
        (*[list(c) for c in cols], group))


def _pmax(a: Position | None, b: Position | None) -> Position | None:
    if a is None:
        return tuple(b) if b is not None else None
    if b is None:
        return tuple(a)
    return max(tuple(a), tuple(b))


# ----------------------------------------------------------------- staging
def _stage_select(target: ShapeTarget) -> sql.Composed:
    """SELECT list that gives a staging table the target's exact column types."""
    cols = [_ident(c) for c in target.names]
    return sql.SQL("SELECT {cols}{sep}NULL::\"char\" AS _wb_kind, NULL::text[] AS _wb_keep, _wb_lsn, "
                   "_wb_op_index, _wb_partition, _wb_offset, _wb_snapshot_id FROM {t} WITH NO DATA").format(
        cols=sql.SQL(", ").join(cols), sep=sql.SQL(", ") if cols else sql.SQL(""), t=_table(target))


def _temp_stage(conn: psycopg.Connection, target: ShapeTarget) -> sql.Identifier:
    """This session's staging table for the shape (created once; emptied at
    every commit and at every use)."""
    sig = f"{target.schema}.{target.table}:{','.join(target.names)}"
    name = f"wb_stage_{zlib.crc32(sig.encode()):08x}"
    ident = _ident(name)
    with conn.cursor() as cur:
        cur.execute("SET LOCAL client_min_messages = warning")
        cur.execute(sql.SQL("CREATE TEMP TABLE IF NOT EXISTS {} ON COMMIT DELETE ROWS AS ").format(ident)
                    + _stage_select(target))
        cur.execute(sql.SQL("DELETE FROM {}").format(ident))
    return ident


def _copy_rows(conn: psycopg.Connection, target: ShapeTarget, stage: sql.Composable, rows: Iterable[tuple],
               names: Sequence[str] | None = None) -> None:
    """COPY staged rows into ``stage`` (its columns ``names``, by default the
    shape's and ``STAGE_EXTRA``): in binary when :func:`_binary_types` finds
    every value one whose binary form means what its text form would (about
    twice as fast on both ends), else in PostgreSQL's text format."""
    names = tuple(names) if names is not None else (*target.names, *STAGE_EXTRA)
    cols = sql.SQL(", ").join(_ident(c) for c in names)
    rows = rows if isinstance(rows, list) else list(rows)
    with conn.cursor() as cur:
        oids = _binary_types(cur, stage, names, rows)
        if oids is None:
            query = sql.SQL("COPY {} ({}) FROM STDIN").format(stage, cols)
        else:
            query = sql.SQL("COPY {} ({}) FROM STDIN (FORMAT BINARY)").format(stage, cols)
            cur.adapters.register_dumper(None, _CharBinaryDumper)
        with cur.copy(query) as cp:
            if oids is not None:
                cp.set_types(oids)
            write = cp.write_row
            for row in rows:
                write(row)


class _CharBinaryDumper(Dumper):
    """``"char"`` (``_wb_kind``) in binary COPY: its one byte."""

    oid = 18
    format = Format.BINARY

    def dump(self, obj: str) -> bytes:
        return obj.encode()


_INT_RANGE = {21: (-(1 << 15), (1 << 15) - 1), 23: (-(1 << 31), (1 << 31) - 1)}
# Column types staged in binary, by oid: the Python classes whose binary form
# psycopg writes exactly as PostgreSQL would read the text form psycopg writes
# otherwise (exact classes: a bool is no int, a datetime no date). Anything
# else in a batch (special values as text, an unknown type, a value out of
# range that binary would wrap silently) keeps the whole batch in text.
_BINARY_CLASSES: dict[int, frozenset[type]] = {
    16: frozenset({bool}), 21: frozenset({int}), 23: frozenset({int}), 20: frozenset({int}),
    701: frozenset({float}), 1700: frozenset({Decimal}), 25: frozenset({str}),
    1043: frozenset({str}), 17: frozenset({bytes}), 1082: frozenset({datetime.date}),
    1114: frozenset({datetime.datetime}), 1184: frozenset({datetime.datetime}), 18: frozenset({str}),
    1009: frozenset({list}),  # text[]: _wb_keep, lists of column names
}


def _binary_types(cur: psycopg.Cursor, stage: sql.Composable, names: Sequence[str], rows: Sequence[tuple]
                  ) -> list[int] | None:
    """The type oids of ``stage``'s columns ``names`` if every value of
    ``rows`` can go in binary COPY (see ``_BINARY_CLASSES``), else None."""
    if not rows:
        return None
    found = dict(cur.execute(
        "SELECT attname, atttypid::int FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 "
        "AND NOT attisdropped AND attname = ANY(%s)", (stage.as_string(cur), list(names))).fetchall())
    oids = [found.get(n) for n in names]
    if any(o not in _BINARY_CLASSES for o in oids):
        return None
    for oid, column in zip(oids, zip(*rows)):
        classes = set(map(type, column))
        classes.discard(type(None))
        if not classes <= _BINARY_CLASSES[oid]:
            return None
        if not classes:
            continue
        if oid in _INT_RANGE:
            lo, hi = _INT_RANGE[oid]
            values = [v for v in column if v is not None] if None in column else column
            if min(values) < lo or max(values) > hi:
                return None
        elif oid in (1114, 1184):  # timestamp takes naive datetimes only, timestamptz aware ones
            aware = {v.tzinfo is not None for v in column if v is not None}
            if aware != {oid == 1184}:
                return None
        elif oid == 1009 and any(v is not None and not all(type(x) is str for x in v) for v in column):
            return None
    return oids


def _plan_rows(plan: ApplyPlan, with_cuts: bool = False) -> Iterable[tuple]:
    """The plan's staged rows, plus (staged path) one row per cut event:
    ``_wb_keep`` = [reason] or, for a backfill_end, [reason, info JSON]."""
    yield from plan.stage_rows
    if with_cuts:
        nulls = (None,) * len(plan.target.columns)
        for c in plan.cut_events:
            keep = [c.reason, json.dumps(c.info)] if c.info else [c.reason]
            yield (*nulls, CUT_KIND, keep, c.lsn, c.op_index, c.partition, c.offset, c.backfill_id)


def _staged_kinds(plan: ApplyPlan) -> dict[int, Counter]:
    n = len(plan.target.columns)
    counts = Counter(map(itemgetter(n + 4, n), plan.stage_rows))  # (partition, kind)
    out: dict[int, Counter] = defaultdict(Counter)
    for (p, kind), c in counts.items():
        out[p][kind] = c
    return out


# ------------------------------------------------- the set-based statements
def _counts(cur: psycopg.Cursor, query: sql.Composable, params: Sequence = ()) -> Counter:
    """Run ``WITH x AS (<dml> RETURNING <partition>) SELECT partition, count(*)``."""
    wrapped = sql.SQL("WITH x(p) AS ({}) SELECT p, count(*) FROM x GROUP BY p").format(query)
    return Counter({p: n for p, n in cur.execute(wrapped, params).fetchall()})


def _key_eq(target: ShapeTarget, a: str, b: str) -> sql.Composable:
    return sql.SQL(" AND ").join(sql.SQL("{}.{} = {}.{}").format(_ident(a), _ident(k), _ident(b), _ident(k))
                                 for k in target.key_columns)


def _pos(a: str) -> sql.Composable:
    """The position of a target (or tombstone) row; none (NULL: written behind
    walbridge's back) is lower than every real position."""
    return sql.SQL("(coalesce({a}._wb_lsn, -1), coalesce({a}._wb_op_index, -1))").format(a=_ident(a))


def _pos_lt(a: str, b: str) -> sql.Composable:
    """Target/tombstone row ``a`` is older than staged row ``b``."""
    return sql.SQL("{} < ({b}._wb_lsn, {b}._wb_op_index)").format(_pos(a), b=_ident(b))


def _apply_cuts(cur: psycopg.Cursor, target: ShapeTarget, cuts: Iterable[Cut]) -> tuple[Counter, Counter]:
    cuts = list(cuts)
    if not cuts:
        return Counter(), Counter()
    params = ([c.partition for c in cuts], [c.lsn for c in cuts], [c.op_index for c in cuts])
    src = sql.SQL("unnest(%s::int[], %s::bigint[], %s::bigint[]) AS c(p, l, o)")
    cond = sql.SQL("t._wb_partition = c.p AND {} < (c.l, c.o)").format(_pos("t"))
    truncated = _counts(cur, sql.SQL("DELETE FROM {} AS t USING {} WHERE {} RETURNING c.p").format(
        _table(target), src, cond), params)
    dropped = Counter()
    if not target.keyless:
        dropped = _counts(cur, sql.SQL("DELETE FROM {} AS t USING {} WHERE {} RETURNING c.p").format(
            _tombstones(target), src, cond), params)
    return truncated, dropped


def _bucket_session(cur: psycopg.Cursor) -> None:
    """The settings under which bucket hashes match the source's (for this
    transaction only)."""
    for name, value in SESSION_SETTINGS:
        cur.execute("SELECT set_config(%s, %s, true)", (name, value))


def _apply_scoped_cuts(cur: psycopg.Cursor, target: ShapeTarget, cuts: Iterable[Cut]) -> tuple[Counter, Counter]:
    """Scoped backfill_ends: rows (and tombstones) of the cut's partition, in
    its buckets, below it. One statement per cut: each has its own scope."""
    truncated, dropped = Counter(), Counter()
    cuts = list(cuts)
    if cuts:
        _bucket_session(cur)
    for c in cuts:
        tables = [(_table(target), truncated)] + ([] if target.keyless else [(_tombstones(target), dropped)])
        for table, counter in tables:
            n = cur.execute(sql.SQL("DELETE FROM {} AS t WHERE t._wb_partition = {} AND {} < ({}, {}) AND {}").format(
                table, sql.Literal(c.partition), _pos("t"), sql.Literal(c.lsn), sql.Literal(c.op_index),
                in_scope(c.scope, "t"))).rowcount
            counter[c.partition] += n
    return truncated, dropped


def _record_backfills(cur: psycopg.Cursor, group: str, topic: str, target: ShapeTarget,
                      ends: Iterable[Cut]) -> list[BackfillGC]:
    """Record the partitions on which backfill_ends were applied (idempotent:
    a set union). The batch that completes a backfill (every partition done)
    also collects, whatever their partition, the target rows in its scope with
    a position below its start or none, and the tombstones below its start:
    every row the backfill saw was rewritten at its start or later."""
    by_id: dict[str, tuple[Cut, set[int]]] = {}
    for c in ends:
        by_id.setdefault(c.backfill_id, (c, set()))[1].add(c.partition)
    done: list[BackfillGC] = []
    for bid, (cut, partitions) in sorted(by_id.items()):
        info = cut.info
        start = int(info["lsn"]) if info.get("lsn") is not None else cut.lsn
        # The first record's shape, start and scope are the backfill's.
        shape, start, n, done_parts, scope, completed = cur.execute(
            f"INSERT INTO {META_SCHEMA}.backfills AS b (consumer_group, topic, backfill_id, shape, start_lsn, "
            "partitions, partitions_done, scope, rows) VALUES (%s, %s, %s, %s, %s, %s, %s::int[], %s, %s) "
            "ON CONFLICT (consumer_group, topic, backfill_id) DO UPDATE SET partitions_done = "
            "ARRAY(SELECT DISTINCT x FROM unnest(b.partitions_done || EXCLUDED.partitions_done) AS u(x) ORDER BY x), "
            "updated_at = now() "
            "RETURNING shape, start_lsn, partitions, partitions_done, scope, completed_at IS NOT NULL",
            (group, topic, bid, info.get("shape") or target.shape, start, int(info["partitions"]),
             sorted(partitions), Jsonb(cut.scope) if cut.scope else None, info.get("rows"))).fetchone()
        if completed or not set(range(n)) <= set(done_parts):
            continue
        if scope:
            _bucket_session(cur)
        deleted = cur.execute(sql.SQL("DELETE FROM {} AS t WHERE {} < ({}, 0) AND {}").format(
            _table(target), _pos("t"), sql.Literal(start), in_scope(scope, "t"))).rowcount
        tombstones = 0
        if not target.keyless:
            tombstones = cur.execute(sql.SQL("DELETE FROM {} AS t WHERE (t._wb_lsn, t._wb_op_index) < ({}, 0) "
                                             "AND {}").format(_tombstones(target), sql.Literal(start),
                                                              in_scope(scope, "t"))).rowcount
        cur.execute(f"UPDATE {META_SCHEMA}.backfills SET completed_at = now(), updated_at = now(), gc_deleted = %s, "
                    "gc_tombstones = %s WHERE consumer_group = %s AND topic = %s AND backfill_id = %s",
                    (deleted, tombstones, group, topic, bid))
        done.append(BackfillGC(topic, bid, shape, deleted, tombstones))
    return done


# The target's bookkeeping columns a staged row carries: STAGE_EXTRA after _wb_kind and _wb_keep.
_STAGED_BOOKKEEPING = STAGE_EXTRA[2:]
assert _STAGED_BOOKKEEPING == (*POSITION_COLUMNS, "_wb_snapshot_id")


def _apply_keyed(cur: psycopg.Cursor, target: ShapeTarget, stage: sql.Identifier,
                 keep_sets: Iterable[tuple[str, ...]], n_upserts: int | None = None, n_deletes: int | None = None,
                 upsert_keys: list[int] | None = None) -> dict[str, Counter]:
    """``n_upserts``/``n_deletes``: how many the stage holds, when known (a
    statement for a kind the stage lacks is skipped); ``upsert_keys``: the
    upserted keys, when the shape has one integer key column."""
    t, tb = _table(target), _tombstones(target)
    keys = sql.SQL(", ").join(_ident(k) for k in target.key_columns)
    s_keys = sql.SQL(", ").join(sql.SQL("s.{}").format(_ident(k)) for k in target.key_columns)
    out: dict[str, Counter] = {"deleted": Counter(), "tombstoned": Counter(), "upserted": Counter()}
    if n_deletes != 0:
        _apply_deletes(cur, target, stage, out, t, tb, keys, s_keys)
    if n_upserts == 0:
        return out
    # Upserts: a newer upsert lifts an older tombstone; an equal or newer one wins.
    cur.execute(sql.SQL(
        "DELETE FROM {tb} AS tb USING {s} AS s WHERE s._wb_kind = 'u' AND {eq} AND {lt}"
    ).format(tb=tb, s=stage, eq=_key_eq(target, "tb", "s"), lt=_pos_lt("tb", "s")))
    names = target.names
    all_cols, s_cols = _insert_columns(target)
    # Keys the target holds: update where the change is newer. A statement per
    # set of kept (unchanged TOAST) columns, which it leaves alone. None when
    # the target holds none of the upserted keys (e.g. a snapshot into an
    # empty or disjoint table): the join would find nothing.
    upserted = Counter()
    for keep in keep_sets if upsert_keys is None or _holds_any_key(cur, target, upsert_keys) else ():
        kept = set(keep)
        sets = [sql.SQL("{c} = s.{c}").format(c=_ident(c))
                for c in (*[n for n, col in zip(names, target.columns) if not col.is_key and n not in kept],
                          "_wb_lsn", "_wb_op_index", "_wb_partition", "_wb_offset", "_wb_snapshot_id")]
        sets.append(sql.SQL("_wb_applied_at = now()"))
        upserted += _counts(cur, sql.SQL(
            "UPDATE {t} AS t SET {sets} FROM {s} AS s "
            "WHERE s._wb_kind = 'u' AND s._wb_keep IS NOT DISTINCT FROM %s::text[] AND {eq} AND {lt} "
            "RETURNING s._wb_partition"
        ).format(t=t, sets=sql.SQL(", ").join(sets), s=stage, eq=_key_eq(target, "t", "s"), lt=_pos_lt("t", "s")),
            (list(keep) if keep else None,))
    # New keys (not live, not tombstoned at an equal or newer position): insert.
    # A plain INSERT, not ON CONFLICT: progress locks serialize the writers of
    # a partition, and keys stay on their partition; should two appliers ever
    # race on a key, the loser's transaction fails and its batch is retried.
    if n_upserts is not None and sum(upserted.values()) >= n_upserts:
        out["upserted"] = upserted  # every key existed and was updated: nothing to insert
        return out
    upserted += _counts(cur, sql.SQL(
        "INSERT INTO {t} ({cols}) SELECT {s_cols} FROM {s} AS s WHERE s._wb_kind = 'u' "
        "AND NOT EXISTS (SELECT 1 FROM {t} AS t WHERE {eq_t}) "
        "AND NOT EXISTS (SELECT 1 FROM {tb} AS tb WHERE {eq_tb}) RETURNING _wb_partition"
    ).format(t=t, cols=all_cols, s_cols=s_cols, s=stage, eq_t=_key_eq(target, "t", "s"),
             tb=tb, eq_tb=_key_eq(target, "tb", "s")))
    out["upserted"] = upserted
    return out


def _holds_any_key(cur: psycopg.Cursor, target: ShapeTarget, keys: list[int], tombstones: bool = False) -> bool:
    """Does the target (or, with ``tombstones``, its tombstones) hold any of
    ``keys``? True unless its key column is an integer column holding none.
    A probe of the keys' range first (one index lookup, enough for appends
    with rising keys), then the keys themselves (for a snapshot, whose
    partitions interleave the parallel readers' key ranges)."""
    [key] = target.key_columns
    typ = cur.execute("SELECT atttypid::int FROM pg_attribute WHERE attrelid = %s::regclass AND attname = %s",
                      (_table(target).as_string(cur), key)).fetchone()
    if typ is None or typ[0] not in (20, 21, 23):
        return True
    tables = [_table(target)] + ([_tombstones(target)] if tombstones else [])

    def any_of(condition: str, params: tuple) -> bool:
        return cur.execute(sql.SQL("SELECT {}").format(sql.SQL(" OR ").join(
            sql.SQL("EXISTS (SELECT 1 FROM {} WHERE {} " + condition + ")").format(t, _ident(key))
            for t in tables)), params * len(tables)).fetchone()[0]

    return any_of("BETWEEN %s::bigint AND %s::bigint", (min(keys), max(keys))) and any_of(
        "= ANY(%s::bigint[])", (keys,))


def _only_new_keys(cur: psycopg.Cursor, target: ShapeTarget, plan: ApplyPlan, staged: Mapping[int, Counter],
                   upsert_keys: list[int] | None) -> bool:
    """Is the plan upserts only (no deletes, cuts or kept TOAST columns) of
    keys neither the target nor its tombstones hold? Then each is an insert
    and nothing else can happen to the target (a snapshot or backfill into an
    empty or disjoint table, appends of new keys)."""
    if upsert_keys is None or plan.cuts or plan.scoped_cuts or any(k not in ((), None) for k in plan.keep_sets):
        return False
    if any(kind != UPSERT for counts in staged.values() for kind, c in counts.items() if c):
        return False
    # COPY FROM refuses a table under row-level security: such a table takes
    # the stage's INSERT, which applies its policies.
    secured = cur.execute("SELECT relrowsecurity FROM pg_class WHERE oid = %s::regclass",
                          (_table(target).as_string(cur),)).fetchone()
    if secured is None or secured[0]:
        return False
    return not _holds_any_key(cur, target, upsert_keys, tombstones=True)


def _insert_new_keys(conn: psycopg.Connection, target: ShapeTarget, plan: ApplyPlan,
                     staged: Mapping[int, Counter]) -> dict[str, Counter]:
    """:func:`_only_new_keys` plans: COPY the rows straight into the target,
    as the stage's INSERT would write them (``_wb_applied_at``: ``now()``)."""
    n = len(target.columns)
    now = (conn.execute("SELECT now()").fetchone()[0],)
    _copy_rows(conn, target, _table(target), [t[:n] + t[n + 2:] + now for t in plan.stage_rows],
               (*target.names, *_STAGED_BOOKKEEPING, "_wb_applied_at"))
    return {"deleted": Counter(), "tombstoned": Counter(), "truncated": Counter(), "tombstones_dropped": Counter(),
            "upserted": Counter({p: c[UPSERT] for p, c in staged.items()})}


def upsert_keys(plan: ApplyPlan) -> list[int] | None:
    """The keys of the plan's upserts, for a shape with one key column whose
    values are all ``int`` (None otherwise)."""
    target = plan.target
    if target.keyless or len(target.key_columns) != 1:
        return None
    n = len(target.columns)
    k = next(i for i, c in enumerate(target.columns) if c.is_key)
    keys = [t[k] for t in plan.stage_rows if t[n] == UPSERT]
    if not keys or set(map(type, keys)) != {int}:
        return None
    return keys


def _apply_deletes(cur: psycopg.Cursor, target: ShapeTarget, stage: sql.Identifier, out: dict[str, Counter],
                   t: sql.Composable, tb: sql.Composable, keys: sql.Composable, s_keys: sql.Composable) -> None:
    # Deletes: remove older live rows, then tombstone every delete no live row outranks.
    out["deleted"] = _counts(cur, sql.SQL(
        "DELETE FROM {t} AS t USING {s} AS s WHERE s._wb_kind = 'd' AND {eq} AND {lt} RETURNING s._wb_partition"
    ).format(t=t, s=stage, eq=_key_eq(target, "t", "s"), lt=_pos_lt("t", "s")))
    out["tombstoned"] = _counts(cur, sql.SQL(
        "INSERT INTO {tb} AS tb ({keys}, _wb_lsn, _wb_op_index, _wb_partition, _wb_offset, _wb_applied_at) "
        "SELECT {s_keys}, s._wb_lsn, s._wb_op_index, s._wb_partition, s._wb_offset, now() FROM {s} AS s "
        "WHERE s._wb_kind = 'd' AND NOT EXISTS (SELECT 1 FROM {t} AS t WHERE {eq}) "
        "ON CONFLICT ({keys}) DO UPDATE SET _wb_lsn = EXCLUDED._wb_lsn, _wb_op_index = EXCLUDED._wb_op_index, "
        "_wb_partition = EXCLUDED._wb_partition, _wb_offset = EXCLUDED._wb_offset, "
        "_wb_applied_at = EXCLUDED._wb_applied_at "
        "WHERE {tbpos} < (EXCLUDED._wb_lsn, EXCLUDED._wb_op_index) "
        "RETURNING tb._wb_partition"
    ).format(tb=tb, keys=keys, s_keys=s_keys, s=stage, t=t, eq=_key_eq(target, "t", "s"), tbpos=_pos("tb")))


def _insert_columns(target: ShapeTarget) -> tuple[sql.Composable, sql.Composable]:
    """The target table's column list for an INSERT, and the matching select
    list from the stage aliased ``s`` (bookkeeping columns included)."""
    names = target.names
    all_cols = sql.SQL(", ").join(_ident(c) for c in (*names, "_wb_lsn", "_wb_op_index", "_wb_partition",
                                                       "_wb_offset", "_wb_applied_at", "_wb_snapshot_id"))
    s_cols = sql.SQL(", ").join([sql.SQL("s.{}").format(_ident(c)) for c in names]
                                + [sql.SQL(x) for x in ("s._wb_lsn", "s._wb_op_index", "s._wb_partition",
                                                        "s._wb_offset", "now()", "s._wb_snapshot_id")])
    return all_cols, s_cols


def _apply_keyless(cur: psycopg.Cursor, target: ShapeTarget, stage: sql.Identifier) -> dict[str, Counter]:
    t = _table(target)
    names = target.names
    all_cols, s_cols = _insert_columns(target)
    out: dict[str, Counter] = {}
    # Appends first: a removal later in the batch (on any partition) may target them.
    out["appended"] = _counts(cur, sql.SQL(
        "INSERT INTO {t} AS t ({cols}) SELECT {s_cols} FROM {s} AS s WHERE s._wb_kind = 'a' "
        "ON CONFLICT (_wb_lsn, _wb_op_index) WHERE _wb_snapshot_id IS NULL DO NOTHING RETURNING t._wb_partition"
    ).format(t=t, cols=all_cols, s_cols=s_cols, s=stage))

    def content(alias: str) -> sql.Composable:
        return sql.SQL("ROW({})::text").format(sql.SQL(", ").join(
            sql.SQL("{}.{}").format(_ident(alias), _ident(c)) for c in names))

    # The k-th removal of a row value (by position) takes the k-th oldest equal
    # target row, if that row is older than the removal.
    out["deleted"] = _counts(cur, sql.SQL(
        "WITH r AS (SELECT {sc} AS c, s._wb_lsn, s._wb_op_index, s._wb_partition, "
        "  row_number() OVER (PARTITION BY {sc} ORDER BY s._wb_lsn, s._wb_op_index, s._wb_partition, s._wb_offset) AS rn "
        "  FROM {s} AS s WHERE s._wb_kind = 'x'), "
        "cand AS (SELECT t.ctid AS tid, {tc} AS c, {tpos} AS pos, "
        "  row_number() OVER (PARTITION BY {tc} ORDER BY {tpos}, t._wb_partition, t._wb_offset) AS rn "
        "  FROM {t} AS t WHERE {tc} IN (SELECT c FROM r)), "
        "m AS (SELECT cand.tid, r._wb_partition FROM r JOIN cand ON cand.c = r.c AND cand.rn = r.rn "
        "  WHERE cand.pos < (r._wb_lsn, r._wb_op_index)) "
        "DELETE FROM {t} AS t USING m WHERE t.ctid = m.tid RETURNING m._wb_partition"
    ).format(sc=content("s"), tc=content("t"), s=stage, t=t, tpos=_pos("t")))
    return out


def _apply_stage(cur: psycopg.Cursor, target: ShapeTarget, stage: sql.Identifier, cuts: Iterable[Cut],
                 keep_sets: Iterable[tuple[str, ...]], staged: Mapping[int, Counter],
                 scoped_cuts: Iterable[Cut] = (), upserted_keys: list[int] | None = None) -> dict[str, Counter]:
    """``staged``: per partition, the stage's rows by kind (exact: statements
    for kinds it lacks are skipped)."""
    if target.keyless:
        out = _apply_keyless(cur, target, stage)
    else:
        out = _apply_keyed(cur, target, stage, keep_sets, sum(c[UPSERT] for c in staged.values()),
                           sum(c[DELETE] for c in staged.values()), upserted_keys)
    # Cuts last: the plan holds nothing of a cut's partition below the cut, so
    # what the batch wrote there survives it, and rows a re-snapshot rewrites
    # are updated in place instead of deleted and inserted again.
    # Scoped cuts too: in-scope rows the batch wrote below one are gone with it.
    truncated, dropped = _apply_cuts(cur, target, cuts)
    s_truncated, s_dropped = _apply_scoped_cuts(cur, target, scoped_cuts)
    out["truncated"] = truncated + s_truncated
    out["tombstones_dropped"] = dropped + s_dropped
    return out


def _fill_results(results: dict[tuple[str, int], PartResult], topic: str, staged: Mapping[int, Counter],
                  applied: Mapping[str, Counter]) -> None:
    for (t, p), res in results.items():
        if t != topic:
            continue
        for name in ("upserted", "appended", "deleted", "tombstoned", "truncated", "tombstones_dropped"):
            setattr(res, name, getattr(res, name) + applied.get(name, Counter()).get(p, 0))
        kinds = staged.get(p, Counter())
        if applied.get("tombstoned") is not None:  # keyed
            res.stale += (kinds[UPSERT] - applied["upserted"].get(p, 0)) + (
                kinds[DELETE] - applied["tombstoned"].get(p, 0))
        else:
            res.stale += (kinds[APPEND] - applied["appended"].get(p, 0)) + (
                kinds[REMOVE] - applied["deleted"].get(p, 0))


# ------------------------------------------------- single-connection apply
def apply_batch(conn: psycopg.Connection, group: str, target: ShapeTarget, parts: Sequence[Part], *,
                on_gap: str = "raise", on_offset_reset: str = "raise",
                gc_controls: Iterable[str] = DEFAULT_GC_CONTROLS) -> BatchResult:
    """Apply one micro-batch of one shape (its parts: one per topic-partition)
    in one target transaction, progress included. ``on_gap``: ``"raise"``
    (default) or ``"ignore"`` when a part starts after the applied offsets;
    ``on_offset_reset``: see :func:`~spark_consumer.apply_plan.split_replayed`."""
    return apply_shapes(conn, group, [(target, parts)], on_gap=on_gap, on_offset_reset=on_offset_reset,
                        gc_controls=gc_controls)


def apply_shapes(conn: psycopg.Connection, group: str, batches: Sequence[tuple[ShapeTarget, Sequence[Part]]], *,
                 on_gap: str = "raise", on_offset_reset: str = "raise",
                 gc_controls: Iterable[str] = DEFAULT_GC_CONTROLS) -> BatchResult:
    """Apply several shapes' parts of one micro-batch in ONE transaction (the
    commit is one decision for the whole micro-batch)."""
    gc = frozenset(gc_controls)
    result = BatchResult()
    all_parts = [p for _, parts in batches for p in parts]
    if len({p.tp for p in all_parts}) != len(all_parts):
        raise ValueError("a (topic, partition) appears in more than one part of the batch")
    if not all_parts:
        return result
    with conn.transaction(), conn.cursor() as cur:
        cur.execute("SELECT set_config('TimeZone', 'UTC', true)")
        progress, existed = _lock_progress(conn, group, all_parts)
        updates = []
        for target, parts in batches:
            if not parts:
                continue
            todo_rows: list = []
            floors: dict[int, Position] = {}
            fields = parts[0].fields
            if any(part.fields != fields for part in parts):
                raise ValueError(f"the parts of shape {target.shape} lay their rows out differently")
            for part in parts:
                res = result.parts[part.tp] = PartResult(part.topic, part.partition, part.start, part.end,
                                                         rows=len(part.rows))
                prog = progress[part.tp]
                if part.tp in existed:
                    _check_gap(part, prog, on_gap)
                _check_range(part)
                if prog.next_offset <= part.start:  # the usual case: nothing of this part was applied
                    todo_rows.extend(part.rows)
                else:
                    todo, skipped, reset = split_replayed(part.rows, prog, where=f"{part.topic}[{part.partition}]",
                                                          on_offset_reset=on_offset_reset, fields=fields)
                    res.skipped_replayed, res.offset_reset = skipped, reset
                    todo_rows.extend(todo)
                if prog.floor is not None:
                    floors[part.partition] = prog.floor
            plan = plan_batch(target, todo_rows, floors=floors, gc_controls=gc, fields=fields)
            _merge_plan_stats(result, plan)
            result.controls.extend(plan.controls)
            if plan.stage_rows or plan.cuts or plan.scoped_cuts:
                staged = _staged_kinds(plan)
                keys = upsert_keys(plan)
                if _only_new_keys(cur, target, plan, staged, keys):
                    applied = _insert_new_keys(conn, target, plan, staged)
                else:
                    stage = _temp_stage(conn, target)
                    if plan.stage_rows:
                        _copy_rows(conn, target, stage, _plan_rows(plan))
                    applied = _apply_stage(cur, target, stage, plan.cuts.values(), plan.keep_sets, staged,
                                           plan.scoped_cuts, keys)
                _fill_results(result.parts, parts[0].topic, staged, applied)
            if plan.backfill_ends:
                result.backfills_completed += _record_backfills(cur, group, parts[0].topic, target,
                                                                plan.backfill_ends)
            for part in parts:
                st = plan.stats.get(part.tp)
                updates.append(_progress_update(part, progress[part.tp], result.parts[part.tp],
                                                st.max_position if st else None, plan.cuts.get(part.partition)))
        _write_progress(conn, group, updates)
    return result


def _check_range(part: Part) -> None:
    if not part.rows:
        return
    offsets = list(map(field_getter(part.fields, "_wb_offset"), part.rows))
    lo, hi = min(offsets), max(offsets)
    if lo < part.start or hi >= part.end:
        raise ValueError(f"{part.topic}[{part.partition}]: rows at offsets {lo}..{hi} are outside the part's "
                         f"range [{part.start}, {part.end})")


def _merge_plan_stats(result: BatchResult, plan: ApplyPlan) -> None:
    for tp, st in plan.stats.items():
        res = result.parts.get(tp)
        if res is None:
            raise ValueError(f"rows of {tp[0]}[{tp[1]}] are not in any part of the batch")
        res.control += st.control
        res.dlq += st.dlq
        res.superseded += st.superseded
        res.erased += st.erased + st.below_floor
        res.truncates += st.truncates


def _progress_update(part: Part, prog: Progress, res: PartResult, max_position: Position | None,
                     cut: Cut | None) -> tuple:
    applied = _pmax(prog.applied, max_position)
    floor = _pmax(prog.floor, cut.position if cut is not None else None)
    nxt = part.end if res.offset_reset else max(prog.next_offset, part.end)
    res.next_offset = nxt
    return (part.topic, part.partition, nxt, applied, floor)


# --------------------------------------------------------- staged (parallel)
def staging_table_name(group: str, topic: str, partition: int, end: int) -> str:
    """The UNLOGGED staging table of one part: named by (group, topic,
    partition, end offset) of the micro-batch, so a replay recreates it."""
    digest = hashlib.sha1(f"{group}\x00{topic}\x00{partition}\x00{end}".encode()).hexdigest()[:20]
    return f"stage_{digest}"


@dataclass(frozen=True)
class StagedPart:
    topic: str
    partition: int
    start: int
    end: int
    table: str
    rows: int  # planned rows staged
    skipped_replayed: int


def stage_part(conn: psycopg.Connection, group: str, target: ShapeTarget, part: Part, *,
               on_offset_reset: str = "raise", gc_controls: Iterable[str] = DEFAULT_GC_CONTROLS) -> StagedPart:
    """Executor side of the staged apply: plan one part and COPY it into its
    own UNLOGGED staging table, in a transaction of its own (so executors stage
    in parallel, each on its connection). Nothing becomes visible in the
    target: :func:`commit_batch` decides. Staging the same part again (a
    replayed batch, a retried task) replaces the earlier staging."""
    name = staging_table_name(group, part.topic, part.partition, part.end)
    ident = _ident(META_SCHEMA, name)
    _check_range(part)
    with conn.transaction(), conn.cursor() as cur:
        cur.execute("SELECT set_config('TimeZone', 'UTC', true)")
        row = cur.execute(
            "SELECT next_offset, applied_lsn, applied_op_index, floor_lsn, floor_op_index "
            f"FROM {META_SCHEMA}.progress WHERE consumer_group = %s AND topic = %s AND partition = %s",
            (group, part.topic, part.partition)).fetchone()
        prog = _progress(row) if row else None
        todo, skipped, reset = split_replayed(part.rows, prog, where=f"{part.topic}[{part.partition}]",
                                              on_offset_reset=on_offset_reset, fields=part.fields)
        floors = {part.partition: prog.floor} if prog is not None and prog.floor is not None else {}
        plan = plan_batch(target, todo, floors=floors, gc_controls=gc_controls, fields=part.fields)
        cur.execute("SET LOCAL client_min_messages = warning")
        cur.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(ident))
        cur.execute(sql.SQL("CREATE UNLOGGED TABLE {} AS ").format(ident) + _stage_select(target))
        _copy_rows(conn, target, ident, _plan_rows(plan, with_cuts=True))
        st = plan.stats.get(part.tp)
        info = {
            "rows": len(part.rows), "skipped_replayed": skipped, "offset_reset": reset, "planned": len(plan.stage_rows),
            "control": st.control if st else 0, "dlq": st.dlq if st else 0,
            "superseded": st.superseded if st else 0,
            "erased": (st.erased + st.below_floor) if st else 0, "truncates": st.truncates if st else 0,
            "max_position": list(st.max_position) if st and st.max_position else None,
            "controls": [_jsonable(c) for c in plan.controls],
        }
        cur.execute(
            f"INSERT INTO {META_SCHEMA}.staged_parts (consumer_group, topic, partition, end_offset, start_offset, "
            "stage_table, shape, info) VALUES (%s, %s, %s, %s, %s, %s, %s, %s) "
            "ON CONFLICT (consumer_group, topic, partition, end_offset) DO UPDATE SET "
            "start_offset = EXCLUDED.start_offset, stage_table = EXCLUDED.stage_table, shape = EXCLUDED.shape, "
            "info = EXCLUDED.info, staged_at = now()",
            (group, part.topic, part.partition, part.end, part.start, name, target.shape,
             Jsonb(info)))
    return StagedPart(part.topic, part.partition, part.start, part.end, name, len(plan.stage_rows), skipped)


def _info_pos(info: Mapping) -> Position | None:
    return tuple(info["max_position"]) if info.get("max_position") else None


def _jsonable(row: Mapping) -> dict:
    out = {}
    for k, v in row.items():
        if k.startswith("_wb_"):
            out[k] = v if isinstance(v, (str, int, float, bool, type(None), list)) else str(v)
    return out


def commit_batch(conn: psycopg.Connection, group: str, batches: Sequence[tuple[ShapeTarget, Sequence[Part]]], *,
                 on_gap: str = "raise") -> BatchResult:
    """Driver side of the staged apply: in ONE transaction, lock the parts'
    progress, apply every staged part not yet covered by it, advance progress,
    drop the staging tables. ``batches`` names the parts (their rows are not
    needed). Raises :class:`StagingMissingError` if a part was not staged (the
    batch must be retried, which re-stages it)."""
    result = BatchResult()
    all_parts = [p for _, parts in batches for p in parts]
    if not all_parts:
        return result
    with conn.transaction(), conn.cursor() as cur:
        progress, existed = _lock_progress(conn, group, all_parts)
        metas = {(r[0], r[1]): r for r in cur.execute(
            f"SELECT topic, partition, start_offset, stage_table, info FROM {META_SCHEMA}.staged_parts "
            "WHERE consumer_group = %s AND (topic, partition, end_offset) IN "
            "(SELECT * FROM unnest(%s::text[], %s::int[], %s::bigint[]))",
            (group, [p.topic for p in all_parts], [p.partition for p in all_parts],
             [p.end for p in all_parts])).fetchall()}
        updates = []
        drop = []
        for target, parts in batches:
            if not parts:
                continue
            selects = []
            params: list[Any] = []
            infos = {}
            skipped_parts: set[tuple[str, int]] = set()
            for part in parts:
                meta = metas.get(part.tp)
                if meta is None or meta[2] != part.start:
                    raise StagingMissingError(f"{part.topic}[{part.partition}] [{part.start}, {part.end}) is not "
                                              f"staged for group {group!r}: re-run the batch")
                _, _, _, table, info = meta
                drop.append(table)
                prog = progress[part.tp]
                if part.tp in existed:
                    _check_gap(part, prog, on_gap)
                res = result.parts[part.tp] = PartResult(part.topic, part.partition, part.start, part.end,
                                                         rows=info["rows"], offset_reset=info["offset_reset"])
                infos[part.tp] = info
                if not info["offset_reset"] and prog.next_offset >= part.end:
                    res.skipped_replayed = res.rows  # the whole part was applied meanwhile
                    skipped_parts.add(part.tp)
                    continue
                res.skipped_replayed = info["skipped_replayed"]
                res.control, res.dlq = info["control"], info["dlq"]
                res.superseded, res.erased, res.truncates = info["superseded"], info["erased"], info["truncates"]
                result.controls.extend(info["controls"])
                cond = sql.SQL("TRUE")
                if not info["offset_reset"]:
                    cond = sql.SQL("_wb_offset >= %s")
                    params.append(prog.next_offset)
                if prog.floor is not None:
                    # Cut events below the floor still count (a backfill_end must be
                    # recorded); their deletes find nothing the floor's cut left.
                    cond = cond + sql.SQL(" AND (_wb_kind = 't' OR (_wb_lsn, _wb_op_index) >= (%s, %s))")
                    params.extend(prog.floor)
                selects.append(sql.SQL("SELECT * FROM {} WHERE {}").format(_ident(META_SCHEMA, table), cond))
            if not selects:
                for part in parts:
                    updates.append(_progress_update(part, progress[part.tp], result.parts[part.tp],
                                                    _info_pos(infos[part.tp]), None))
                continue
            union = sql.SQL(" UNION ALL ").join(selects)
            stage = _temp_stage(conn, target)
            cols = sql.SQL(", ").join(_ident(c) for c in (*target.names, *STAGE_EXTRA))
            cuts, scoped_cuts, backfill_ends = classify_cuts(
                make_cut(p, lsn, op, off, keep[0], json.loads(keep[1]) if len(keep) > 1 and keep[1] else None)
                for p, lsn, op, off, keep in cur.execute(sql.SQL(
                    "SELECT _wb_partition, _wb_lsn, _wb_op_index, _wb_offset, _wb_keep FROM ({}) q "
                    "WHERE _wb_kind = 't'").format(union), params).fetchall())
            if target.keyless:
                fill = sql.SQL("INSERT INTO {s} ({cols}) SELECT {cols} FROM ({u}) q WHERE _wb_kind <> 't'").format(
                    s=stage, cols=cols, u=union)
            else:
                # Keys live on one partition, unless the topic was repartitioned:
                # across parts, too, the highest position wins.
                keys = sql.SQL(", ").join(_ident(k) for k in target.key_columns)
                fill = sql.SQL("INSERT INTO {s} ({cols}) SELECT DISTINCT ON ({keys}) {cols} FROM ({u}) q "
                               "WHERE _wb_kind <> 't' ORDER BY {keys}, _wb_lsn DESC, _wb_op_index DESC, "
                               "_wb_partition DESC, _wb_offset DESC").format(keys=keys, s=stage, cols=cols,
                                                                             u=union)
            cur.execute(fill, params)
            staged: dict[int, Counter] = defaultdict(Counter)
            for p, kind, n in cur.execute(sql.SQL("SELECT _wb_partition, _wb_kind, count(*) FROM {} GROUP BY 1, 2")
                                          .format(stage)).fetchall():
                staged[p][kind] = n
            # Staged rows the current progress covers count as replayed; rows
            # dropped by DISTINCT ON as superseded.
            in_union: dict[int, int] = defaultdict(int)
            for p, n in cur.execute(sql.SQL("SELECT _wb_partition, count(*) FROM ({}) q WHERE _wb_kind <> 't' "
                                            "GROUP BY 1").format(union), params).fetchall():
                in_union[p] = n
            keep_sets = [tuple(k) if k else () for (k,) in cur.execute(sql.SQL(
                "SELECT DISTINCT _wb_keep FROM {} WHERE _wb_kind = 'u'").format(stage)).fetchall()]
            applied = _apply_stage(cur, target, stage, cuts.values(), keep_sets, staged, scoped_cuts)
            topic = parts[0].topic
            if backfill_ends:
                result.backfills_completed += _record_backfills(cur, group, topic, target, backfill_ends)
            for part in parts:
                res = result.parts[part.tp]
                if part.tp not in skipped_parts:
                    res.superseded += in_union[part.partition] - sum(staged[part.partition].values())
                    res.skipped_replayed += max(0, infos[part.tp]["planned"] - in_union[part.partition])
            _fill_results(result.parts, topic, staged, applied)
            for part in parts:
                updates.append(_progress_update(part, progress[part.tp], result.parts[part.tp],
                                                _info_pos(infos[part.tp]), cuts.get(part.partition)))
        _write_progress(conn, group, updates)
        for table in drop:
            cur.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(_ident(META_SCHEMA, table)))
        cur.execute(
            f"DELETE FROM {META_SCHEMA}.staged_parts WHERE consumer_group = %s AND (topic, partition, end_offset) IN "
            "(SELECT * FROM unnest(%s::text[], %s::int[], %s::bigint[]))",
            (group, [p.topic for p in all_parts], [p.partition for p in all_parts], [p.end for p in all_parts]))
    return result


def drop_stale_staging(conn: psycopg.Connection, group: str | None = None) -> int:
    """Drop staging left behind by crashes: parts whose offsets progress now
    covers, and staging tables without a ``staged_parts`` row (after a server
    crash, which empties UNLOGGED tables). Returns the number dropped."""
    dropped = 0
    with conn.transaction(), conn.cursor() as cur:
        q = (f"SELECT s.consumer_group, s.topic, s.partition, s.end_offset, s.stage_table FROM {META_SCHEMA}.staged_parts s "
             f"JOIN {META_SCHEMA}.progress g USING (consumer_group, topic, partition) WHERE g.next_offset >= s.end_offset")
        params: list[Any] = []
        if group is not None:
            q += " AND s.consumer_group = %s"
            params.append(group)
        for g, t, p, e, table in cur.execute(q, params).fetchall():
            cur.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(_ident(META_SCHEMA, table)))
            cur.execute(f"DELETE FROM {META_SCHEMA}.staged_parts WHERE consumer_group = %s AND topic = %s "
                        "AND partition = %s AND end_offset = %s", (g, t, p, e))
            dropped += 1
        orphans = cur.execute(
            "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            f"WHERE n.nspname = %s AND c.relkind = 'r' AND c.relname LIKE 'stage\\_%%' AND NOT EXISTS "
            f"(SELECT 1 FROM {META_SCHEMA}.staged_parts s WHERE s.stage_table = c.relname)",
            (META_SCHEMA,)).fetchall()
        for (table,) in orphans:
            cur.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(_ident(META_SCHEMA, table)))
            dropped += 1
    return dropped


def gc_tombstones(conn: psycopg.Connection, target: ShapeTarget, partition: int | None = None,
                  below: Position | None = None) -> int:
    """Drop tombstones (of ``partition``, or all) below ``below`` (or all).
    Tombstones guard against changes older than a delete arriving after it:
    replays (progress skips those anyway), backfill rows (which carry the
    backfill's start position) and keys moving between partitions. Drop them
    only below the start of any backfill that may still be running."""
    if target.keyless:
        return 0
    cond = [sql.SQL("TRUE")]
    params: list[Any] = []
    if partition is not None:
        cond.append(sql.SQL("_wb_partition = %s"))
        params.append(partition)
    if below is not None:
        cond.append(sql.SQL("(_wb_lsn, _wb_op_index) < (%s, %s)"))
        params.extend(below)
    with conn.transaction():
        return conn.execute(sql.SQL("DELETE FROM {} WHERE {}").format(
            _tombstones(target), sql.SQL(" AND ").join(cond)), params).rowcount
