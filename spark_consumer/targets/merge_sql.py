"""The SQL of a lakehouse target's apply, and the stage it reads: pure
functions of a shape and a plan, no Spark session, no storage. Tables are
passed as Spark SQL references (``delta.`/lake/public.orders```,
``lake.cdc.`public.orders```), so every format with Spark's ``MERGE INTO``
shares them; what each statement does: :mod:`spark_consumer.targets.delta`.

Invariants:
- Ranks and cuts are the PostgreSQL target's (:mod:`spark_consumer.statements`):
  (position, streamed over snapshot); a row without a position ranks lowest.
- The stage's layout is the shape's columns (the decoder's Spark types,
  :func:`spark_consumer.decode.column_type`), then :data:`STAGE_HEAD` and
  :data:`BOOKKEEPING`, in :data:`spark_consumer.apply_plan.STAGE_EXTRA`'s order.
- Every MERGE a batch runs joins on equalities (key, or position and offset)
  so that Spark plans a hash join, never a nested loop over the table.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import pyarrow as pa
from pyspark.sql.pandas.types import to_arrow_type
from pyspark.sql.types import (
    ArrayType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    StringType,
    StructField,
)

from schemas import wire
from spark_consumer.apply_plan import APPEND, DELETE, REMOVE, STAGE_EXTRA, UPSERT, ApplyPlan
from spark_consumer.decode import column_type
from spark_consumer.shape_record import ShapeTarget
from spark_consumer.target_layout import ShapeCannotFollow

# The bookkeeping columns of a shape's table, in the stage's order (apply_plan.STAGE_EXTRA after kind and keep).
BOOKKEEPING = (StructField(wire.LSN_COLUMN, LongType()), StructField(wire.OP_INDEX_COLUMN, LongType()),
               StructField(wire.PARTITION_COLUMN, IntegerType()), StructField(wire.OFFSET_COLUMN, LongType()),
               StructField(wire.SNAPSHOT_ID_COLUMN, StringType()))
STAGE_HEAD = (StructField(wire.KIND_COLUMN, StringType()), StructField(wire.KEEP_COLUMN, ArrayType(StringType())))
assert tuple(f.name for f in STAGE_HEAD + BOOKKEEPING) == STAGE_EXTRA
TOMBSTONE_BOOKKEEPING = BOOKKEEPING[:4]
TAKE = "r"  # a keyless table MERGE's source row that deletes the table row its bookkeeping names
CONSUME = "c"  # a pending removals MERGE's source row that drops the pending removal at its position
FLOAT_SPECIALS = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}


def quote(name: str) -> str:
    """A Spark SQL identifier."""
    return "`" + name.replace("`", "``") + "`"


def shape_fields(target: ShapeTarget) -> list[StructField]:
    """The shape's columns as Spark fields (the decoder's types)."""
    return [StructField(c.name, column_type(c.avro_type, f"column {c.name!r}").spark_type) for c in target.columns]


def rank(a: str, changes_only: bool = False) -> str:
    """A row's rank as :mod:`spark_consumer.statements` has it: position, then
    streamed over snapshot; no position ranks lowest."""
    streamed = "true" if changes_only else f"{a}.{wire.SNAPSHOT_ID_COLUMN} IS NULL"
    return (f"named_struct('l', coalesce({a}.{wire.LSN_COLUMN}, -1L), 'o', coalesce({a}.{wire.OP_INDEX_COLUMN}, -1L),"
            f" 's', {streamed})")


def position(a: str) -> str:
    return f"named_struct('l', coalesce({a}.{wire.LSN_COLUMN}, -1L), 'o', coalesce({a}.{wire.OP_INDEX_COLUMN}, -1L))"


def below(a: str, lsn: int, op_index: int) -> str:
    return f"{position(a)} < named_struct('l', {int(lsn)}L, 'o', {int(op_index)}L)"


def key_eq(target: ShapeTarget, a: str, b: str) -> str:
    return " AND ".join(f"{a}.{quote(k)} = {b}.{quote(k)}" for k in target.key_columns)


Cuts = Mapping[int, tuple[int, int]]  # partition -> the position of the batch's highest cut there


def gc_condition(cuts: Cuts | None, collected: Sequence[int], a: str) -> str | None:
    """Which rows of the table (or its tombstones) the batch removes besides
    its keys' changes: those of a cut partition below its cut, and every row
    below a backfill's start that the batch completed."""
    terms = [f"({a}.{wire.PARTITION_COLUMN} = {int(p)} AND {below(a, *pos)})" for p, pos in sorted((cuts or {}).items())]
    terms += [f"({position(a)} < named_struct('l', {int(lsn)}L, 'o', 0L))" for lsn in collected]
    return " OR ".join(terms) or None


def table_merge(target: ShapeTarget, table: str, tombstones: str | None, stage: str, keep: Sequence[str],
                cuts: Cuts | None = None, collected: Sequence[int] = ()) -> str:
    """The MERGE of a staged plan into the shape's table (module docstring,
    step 3); ``collected``: the start LSNs of the backfills the batch
    completes; ``tombstones``: None when the shape has none (no anti-join)."""
    gc = gc_condition(cuts, collected, "t")
    t_rank, s_rank = rank("t"), rank("s")
    cols = [quote(c) for c in target.names] + [quote(f.name) for f in BOOKKEEPING]
    sets = []
    for c in target.names:
        if c in target.key_columns:
            continue
        value = f"s.{quote(c)}"
        if c in keep:
            value = f"CASE WHEN array_contains(s.{wire.KEEP_COLUMN}, {literal(c)}) THEN t.{quote(c)} ELSE {value} END"
        sets.append(f"{quote(c)} = {value}")
    sets += [f"{quote(f.name)} = s.{quote(f.name)}" for f in BOOKKEEPING]
    source = stage if tombstones is None else (
        f"(SELECT * FROM {stage} s WHERE s.{wire.KIND_COLUMN} = '{DELETE}' OR NOT EXISTS ("
        f"SELECT 1 FROM {tombstones} d WHERE {key_eq(target, 'd', 's')} "
        f"AND {rank('d', True)} >= {s_rank}))")
    sql = [f"MERGE INTO {table} t USING {source} s ON {key_eq(target, 't', 's')}",
           f"WHEN MATCHED AND s.{wire.KIND_COLUMN} = '{DELETE}' AND {t_rank} < {s_rank} THEN DELETE",
           f"WHEN MATCHED AND s.{wire.KIND_COLUMN} = '{UPSERT}' AND {t_rank} < {s_rank} THEN UPDATE SET "
           + ", ".join(sets)]
    return "\n".join(sql + inserts_and_gc(UPSERT, cols, gc))


def inserts_and_gc(kind: str, cols: Sequence[str], gc: str | None, gc_matched: bool = True) -> list[str]:
    """A MERGE's last clauses: rows of ``kind`` no table row matched are
    inserted; the rows ``gc`` names go (matched ones too, with ``gc_matched``)."""
    clauses = [f"WHEN MATCHED AND ({gc}) THEN DELETE"] if gc and gc_matched else []
    clauses.append(f"WHEN NOT MATCHED AND s.{wire.KIND_COLUMN} = '{kind}' THEN INSERT ({', '.join(cols)}) "
                   f"VALUES ({', '.join('s.' + c for c in cols)})")
    if gc:
        clauses.append(f"WHEN NOT MATCHED BY SOURCE AND ({gc}) THEN DELETE")
    return clauses


def tombstones_merge(target: ShapeTarget, tombstones: str, stage: str, cuts: Cuts | None = None,
                     collected: Sequence[int] = ()) -> str:
    """The MERGE of a staged plan into the shape's tombstones (step 2): a
    delete records (or moves forward) its key's tombstone, a newer upsert
    drops it, cuts and completed backfills remove what is below them."""
    gc = gc_condition(cuts, collected, "d")
    d_rank, s_rank = rank("d", True), rank("s")
    cols = [quote(k) for k in target.key_columns] + [quote(f.name) for f in TOMBSTONE_BOOKKEEPING]
    sets = ", ".join(f"{quote(f.name)} = s.{quote(f.name)}" for f in TOMBSTONE_BOOKKEEPING)
    sql = [f"MERGE INTO {tombstones} d USING {stage} s ON {key_eq(target, 'd', 's')}",
           f"WHEN MATCHED AND s.{wire.KIND_COLUMN} = '{DELETE}' AND {d_rank} < {s_rank} THEN UPDATE SET {sets}",
           f"WHEN MATCHED AND s.{wire.KIND_COLUMN} = '{UPSERT}' AND {d_rank} < {s_rank} THEN DELETE"]
    return "\n".join(sql + inserts_and_gc(DELETE, cols, gc, gc_matched=False))


def same_row(target: ShapeTarget, a: str, b: str) -> str:
    """Equal rows of a keyless shape (NULL equal to NULL)."""
    return " AND ".join(f"{a}.{quote(c)} <=> {b}.{quote(c)}" for c in target.names)


def row_columns(target: ShapeTarget, a: str) -> str:
    return ", ".join(f"{a}.{quote(c)}" for c in target.names)


def keyless_takes(target: ShapeTarget, table: str, stage: str) -> str:
    """The table rows a keyless batch's removals take: the k-th removal of a
    row value (by position) takes the k-th oldest equal row, if that row is
    older than the removal. One row per take: the removal's stage index and
    the taken row's bookkeeping."""
    marks = ", ".join(f"c.{quote(f.name)}" for f in BOOKKEEPING)
    return (f"WITH r AS (SELECT s.*, row_number() OVER (PARTITION BY {row_columns(target, 's')} ORDER BY "
            f"s.{wire.LSN_COLUMN}, s.{wire.OP_INDEX_COLUMN}, s.{wire.PARTITION_COLUMN}, s.{wire.OFFSET_COLUMN}) AS _rn"
            f" FROM {stage} s WHERE s.{wire.KIND_COLUMN} = '{REMOVE}'), "
            f"c AS (SELECT t.*, row_number() OVER (PARTITION BY {row_columns(target, 't')} ORDER BY {rank('t')}, "
            f"t.{wire.PARTITION_COLUMN}, t.{wire.OFFSET_COLUMN}) AS _rn FROM {table} t "
            f"LEFT SEMI JOIN r ON {same_row(target, 't', 'r')}) "
            f"SELECT r.{wire.SEQ_COLUMN}, {marks} FROM r JOIN c ON {same_row(target, 'c', 'r')} AND c._rn = r._rn "
            f"WHERE {rank('c')} < {rank('r', True)}")


def keyless_cancels(target: ShapeTarget, pending: str, stage: str) -> str:
    """The appends of a keyless batch that pending removals cancel: the k-th
    append of a row value (by rank) meets the k-th pending removal of it, if
    the append is the older. One row per cancel: the append's stage index and
    the removal's position."""
    return (f"WITH a AS (SELECT s.*, row_number() OVER (PARTITION BY {row_columns(target, 's')} ORDER BY "
            f"{rank('s')}, s.{wire.PARTITION_COLUMN}, s.{wire.OFFSET_COLUMN}) AS _rn FROM {stage} s "
            f"WHERE s.{wire.KIND_COLUMN} = '{APPEND}'), "
            f"d AS (SELECT d.*, row_number() OVER (PARTITION BY {row_columns(target, 'd')} ORDER BY "
            f"d.{wire.LSN_COLUMN}, d.{wire.OP_INDEX_COLUMN}) AS _rn FROM {pending} d "
            f"LEFT SEMI JOIN a ON {same_row(target, 'd', 'a')}) "
            f"SELECT a.{wire.SEQ_COLUMN}, d.{wire.LSN_COLUMN}, d.{wire.OP_INDEX_COLUMN} FROM a JOIN d "
            f"ON {same_row(target, 'a', 'd')} AND a._rn = d._rn WHERE {rank('a')} < {rank('d', True)}")


def keyless_table_merge(target: ShapeTarget, table: str, source: str, cuts: Cuts | None = None,
                        collected: Sequence[int] = ()) -> str:
    """The MERGE of a keyless batch into its table: appends (kind APPEND; a
    streamed one lands once per position) and takes (kind :data:`TAKE`, the
    taken row's bookkeeping), on an equi-join of position and (snapshot rows)
    offset, so that a snapshot's rows, which share one position, are never
    joined with each other."""
    gc = gc_condition(cuts, collected, "t")
    lsn, opi, off, snap = (wire.LSN_COLUMN, wire.OP_INDEX_COLUMN, wire.OFFSET_COLUMN, wire.SNAPSHOT_ID_COLUMN)
    cols = [quote(c) for c in target.names] + [quote(f.name) for f in BOOKKEEPING]
    sql = [f"MERGE INTO {table} t USING {source} s ON "
           f"t.{lsn} = CASE WHEN s.{wire.KIND_COLUMN} = '{APPEND}' AND s.{snap} IS NOT NULL THEN NULL ELSE s.{lsn} END"
           f" AND t.{opi} = s.{opi}"
           f" AND CASE WHEN t.{snap} IS NULL THEN -1L ELSE t.{off} END = "
           f"CASE WHEN s.{snap} IS NULL THEN -1L ELSE s.{off} END"
           f" AND (s.{wire.KIND_COLUMN} = '{APPEND}' OR (t.{wire.PARTITION_COLUMN} <=> s.{wire.PARTITION_COLUMN}"
           f" AND t.{snap} <=> s.{snap}))"
           f" AND (s.{wire.KIND_COLUMN} = '{TAKE}' OR t.{snap} IS NULL)",
           f"WHEN MATCHED AND s.{wire.KIND_COLUMN} = '{TAKE}' THEN DELETE"]
    return "\n".join(sql + inserts_and_gc(APPEND, cols, gc))


def pending_merge(target: ShapeTarget, pending: str, source: str, cuts: Cuts | None = None,
                  collected: Sequence[int] = ()) -> str:
    """The MERGE of a keyless batch into its pending removals: consumed ones
    (kind :data:`CONSUME`) out, unmatched removals (kind REMOVE) in once per
    position, those below a cut or a completed backfill's start out."""
    gc = gc_condition(cuts, collected, "d")
    cols = [quote(c) for c in target.names] + [quote(f.name) for f in TOMBSTONE_BOOKKEEPING]
    sql = [f"MERGE INTO {pending} d USING {source} s ON d.{wire.LSN_COLUMN} = s.{wire.LSN_COLUMN} "
           f"AND d.{wire.OP_INDEX_COLUMN} = s.{wire.OP_INDEX_COLUMN}",
           f"WHEN MATCHED AND s.{wire.KIND_COLUMN} = '{CONSUME}' THEN DELETE"]
    return "\n".join(sql + inserts_and_gc(REMOVE, cols, gc, gc_matched=False))


def marked_rows(schema: pa.Schema, kind: str, marks: Sequence[tuple], names: Sequence[str]) -> pa.Table:
    """Rows of the stage's layout that carry only a kind and the columns
    ``names`` (``marks``: one tuple of their values per row), NULL elsewhere."""
    columns = dict(zip(names, zip(*marks))) if marks else {n: () for n in names}
    n = len(marks)
    arrays = [pa.array([kind] * n, f.type) if f.name == wire.KIND_COLUMN
              else pa.array(columns[f.name], f.type) if f.name in columns else pa.nulls(n, f.type) for f in schema]
    return pa.Table.from_arrays(arrays, schema=schema)


def literal(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def stage_table(target: ShapeTarget, plan: ApplyPlan) -> pa.Table:
    """The plan's staged rows as Arrow in the stage's layout (shape columns,
    then :data:`STAGE_HEAD` and :data:`BOOKKEEPING`). A special value that the
    column's Spark type cannot hold raises :class:`ShapeCannotFollow`."""
    fields = shape_fields(target) + list(STAGE_HEAD + BOOKKEEPING)
    columns = list(zip(*plan.stage_rows)) if plan.stage_rows else [() for _ in fields]
    arrays = []
    for f, values in zip(fields, columns):
        values = special_values(f, values) if f.name in target.names else values
        arrays.append(pa.array(values, type=to_arrow_type(f.dataType)))
    return pa.Table.from_arrays(arrays, names=[f.name for f in fields])


def special_values(f: StructField, values: Sequence[Any]) -> Sequence[Any]:
    """Special values (PostgreSQL text in a typed column) as the Spark type
    holds them; refused where it cannot."""
    if isinstance(f.dataType, StringType) or not any(isinstance(v, str) for v in values):
        return values
    if isinstance(f.dataType, (FloatType, DoubleType)):
        bad = [v for v in values if isinstance(v, str) and v not in FLOAT_SPECIALS]
        if not bad:
            return [FLOAT_SPECIALS[v] if isinstance(v, str) else v for v in values]
    bad = next(v for v in values if isinstance(v, str))
    raise ShapeCannotFollow(f"column {f.name!r} holds {bad!r}, which a Delta {f.dataType.simpleString()} "
                            "column cannot hold")


def follow_changes(target: ShapeTarget, have: Sequence[StructField], wanted: Sequence[StructField],
                   had_key: tuple[str, ...] | None, on_dropped_column: str) -> tuple[list[StructField], list[str]]:
    """What a table with columns ``have`` must gain to follow the shape's
    ``wanted`` columns, and what it cannot follow (a rename, which would
    otherwise read as a new empty column beside the old one; a retype; a
    column to drop; a changed key). A column the shape lost is kept with
    ``on_dropped_column = "keep"`` (later rows leave it NULL), as on PostgreSQL."""
    have_types = {f.name: f.dataType for f in have}
    wanted_names = {f.name for f in wanted}
    added = [f for f in wanted if f.name not in have_types]
    problems = [f"column {f.name!r} is {have_types[f.name].simpleString()} in the table, "
                f"{f.dataType.simpleString()} in the shape"
                for f in wanted if f.name in have_types and have_types[f.name] != f.dataType]
    problems += [f"column {old!r} was renamed to {c.name!r}" for c in target.columns if c.name not in have_types
                 for old in c.aliases if old in have_types and old not in wanted_names]
    gone = [n for n in have_types if n not in wanted_names and not n.startswith(wire.RESERVED_PREFIX)]
    if gone and on_dropped_column == "drop":
        problems.append(f"columns {', '.join(gone)} left the shape (on_dropped_column = \"drop\")")
    if had_key is not None and had_key != target.key_columns:
        problems.append(f"the key changed from ({', '.join(had_key)}) to ({', '.join(target.key_columns)})")
    return added, problems


def ddl_columns(fields: Sequence[StructField]) -> str:
    return ", ".join(f"{quote(f.name)} {f.dataType.simpleString()}" for f in fields)
