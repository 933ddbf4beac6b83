"""Staging with COPY: a plan's rows go into a stage, a temporary table of
the session with the shape table's exact column types (:func:`temp_stage`),
from which the set-based statements (:mod:`spark_consumer.statements`)
carry them into the target.

Invariants:
- A stage row is the shape's column values, then
  :data:`~spark_consumer.apply_plan.STAGE_EXTRA` (``_wb_kind``, ``_wb_keep``,
  then :data:`STAGED_BOOKKEEPING`), in that order.
- Values are staged in PostgreSQL's text COPY format; special values (``_wb_special``)
  are written as the PostgreSQL text they are. Naive datetimes for
  ``timestamptz`` columns are read as UTC (the apply sets ``TimeZone`` to UTC
  for its transaction). A batch whose every value has a binary form that
  PostgreSQL reads as it would read the text (plain ints in range, Decimals,
  aware datetimes for ``timestamptz``, str for text, ...: ``_BINARY_CLASSES``)
  is staged with binary COPY instead, which is faster; anything else (a
  special value, a naive datetime for ``timestamptz``, a type not listed)
  keeps the whole batch in text.
"""

from __future__ import annotations

import datetime
import zlib
from decimal import Decimal
from typing import Iterable, Mapping, Sequence

import psycopg
from psycopg import sql
from psycopg.adapt import Dumper
from psycopg.pq import Format

from spark_consumer.apply_plan import STAGE_EXTRA
from spark_consumer.shape_record import ShapeTarget
from spark_consumer.target_layout import APPLIED_AT, BOOKKEEPING_COLUMNS, table_ident

# The target's bookkeeping columns a staged row carries (STAGE_EXTRA after
# _wb_kind and _wb_keep): all but the one the applying statement sets.
STAGED_BOOKKEEPING = STAGE_EXTRA[2:]
assert STAGED_BOOKKEEPING == tuple(c for c in BOOKKEEPING_COLUMNS if c != APPLIED_AT)


def stage_select(target: ShapeTarget) -> sql.Composed:
    """SELECT list that gives a staging table the target's exact column types."""
    cols = [sql.Identifier(c) for c in target.names]
    return sql.SQL("SELECT {cols}{sep}NULL::\"char\" AS _wb_kind, NULL::text[] AS _wb_keep, _wb_lsn, "
                   "_wb_op_index, _wb_partition, _wb_offset, _wb_snapshot_id FROM {t} WITH NO DATA").format(
        cols=sql.SQL(", ").join(cols), sep=sql.SQL(", ") if cols else sql.SQL(""), t=table_ident(target))


def temp_stage(conn: psycopg.Connection, target: ShapeTarget) -> tuple[sql.Identifier, dict[str, int]]:
    """This session's staging table for the shape (created once per column
    layout, so a retyped or renamed column gets a new one; emptied at every
    commit and at every use), and its columns' types (name -> type oid), in
    one round trip."""
    sig = f"{target.schema}.{target.table}:{','.join(f'{c.name} {c.sql_type}' for c in target.columns)}"
    name = f"wb_stage_{zlib.crc32(sig.encode()):08x}"
    ident = sql.Identifier(name)
    with conn.cursor() as cur:
        # Without parameters psycopg sends the statements as one query: this
        # runs once per shape of every batch.
        cur.execute(sql.SQL(
            "SET LOCAL client_min_messages = warning; "
            "CREATE TEMP TABLE IF NOT EXISTS {s} ON COMMIT DELETE ROWS AS {select}; "
            "DELETE FROM {s}; "
            "SELECT attname::text, atttypid::int FROM pg_attribute "
            "WHERE attrelid = {name}::regclass AND attnum > 0 AND NOT attisdropped"
        ).format(s=ident, select=stage_select(target), name=sql.Literal(ident.as_string(conn))))
        while cur.nextset():
            pass  # to the last statement's rows
        return ident, dict(cur.fetchall())


def copy_rows(conn: psycopg.Connection, target: ShapeTarget, stage: sql.Composable, rows: Iterable[tuple],
              names: Sequence[str] | None = None, *, types: Mapping[str, int]) -> None:
    """COPY staged rows into ``stage`` (its columns ``names``, by default the
    shape's and ``STAGE_EXTRA``; ``types``: its columns' types, name -> type
    oid): in binary when :func:`_binary_types` finds every value one
    whose binary form means what its text form would (about twice as fast on
    both ends), else in PostgreSQL's text format."""
    names = tuple(names) if names is not None else (*target.names, *STAGE_EXTRA)
    cols = sql.SQL(", ").join(sql.Identifier(c) for c in names)
    rows = rows if isinstance(rows, list) else list(rows)
    with conn.cursor() as cur:
        oids = _binary_types(names, rows, types)
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


def _binary_types(names: Sequence[str], rows: Sequence[tuple], found: Mapping[str, int]) -> list[int] | None:
    """The type oids of the columns ``names`` (``found``: the table's
    columns' types) if every value of ``rows`` can go in binary COPY (see
    ``_BINARY_CLASSES``), else None."""
    if not rows:
        return None
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
