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
  :data:`BOOKKEEPING`, in :data:`spark_consumer.apply_plan.STAGE_EXTRA`'s order,
  less the keep column when no row keeps a column (:func:`kept_columns`
  empty: no statement reads it, and each column is width the JVM copies).
  A *lean* stage, for a keyed batch whose one statement is the table's MERGE
  (no tombstones), also lacks the kind when every row is an upsert and the
  snapshot id and offset when no row has a snapshot id; :func:`table_merge`
  reads only what the stage has (a streamed row ranks as streamed, its
  snapshot id NULL).
- A keyed table's offset is set on snapshot rows only. A keyed MERGE joins
  on the key and ranks by position; the offset tells apart only a
  snapshot's rows, which share one position (should the shape lose its key
  and follow the keyless rules). On a streamed row it would be the one
  value per row that no encoding shrinks, written again by every
  copy-on-write rewrite of its file.
- Every MERGE a batch runs joins on equalities (key, or position and offset)
  so that Spark plans a hash join, never a nested loop over the table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, Mapping, Sequence

import pyarrow as pa
from pyspark.sql.pandas.types import to_arrow_type
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    ByteType,
    DataType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    ShortType,
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
MOVE = "m"  # a kept removals MERGE's source row: the removal at its position took the row its took columns name
# What a keyless shape's kept removal took (wire.TOOK_COLUMNS; NULL: it waits for its row).
TOOK = (StructField(wire.TOOK_COLUMNS[0], LongType()), StructField(wire.TOOK_COLUMNS[1], LongType()),
        StructField(wire.TOOK_COLUMNS[2], BooleanType()))
MICROS = "'yyyy-MM-dd HH:mm:ss.SSSSSS'"  # a Spark SQL literal: a timestamp pattern to the microsecond
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


def bookkeeping_value(name: str, snapshots: bool) -> str:
    """What a keyed table's bookkeeping column ``name`` gets from the stage
    (``snapshots``: the stage has the snapshot id and offset): the offset on
    snapshot rows only (module docstring)."""
    if name == wire.SNAPSHOT_ID_COLUMN and not snapshots:
        return "CAST(NULL AS STRING)"
    if name == wire.OFFSET_COLUMN:
        snapshot = f"s.{quote(wire.SNAPSHOT_ID_COLUMN)}"
        return f"CASE WHEN {snapshot} IS NOT NULL THEN s.{quote(name)} END" if snapshots else "CAST(NULL AS BIGINT)"
    return f"s.{quote(name)}"


def table_merge(target: ShapeTarget, table: str, tombstones: str | None, stage: str, keep: Sequence[str],
                cuts: Cuts | None = None, collected: Sequence[int] = (),
                stage_columns: Sequence[str] | None = None) -> str:
    """The MERGE of a staged plan into the shape's table (module docstring,
    step 3); ``collected``: the start LSNs of the backfills the batch
    completes; ``tombstones``: None when the shape has none (no anti-join);
    ``stage_columns``: a lean stage's columns (:func:`stage_table`; None:
    every column), what the statement reads of it."""
    kinds = stage_columns is None or wire.KIND_COLUMN in stage_columns
    snapshots = stage_columns is None or wire.SNAPSHOT_ID_COLUMN in stage_columns
    if tombstones is not None and not (kinds and snapshots):
        raise ValueError("the anti-join against a shape's tombstones reads the whole stage, not a lean one")
    gc = gc_condition(cuts, collected, "t")
    t_rank, s_rank = rank("t"), rank("s", changes_only=not snapshots)
    cols = [quote(c) for c in target.names] + [quote(f.name) for f in BOOKKEEPING]
    values = [f"s.{quote(c)}" for c in target.names] + [bookkeeping_value(f.name, snapshots) for f in BOOKKEEPING]
    sets = []
    for c, value in zip(target.names, values):
        if c in target.key_columns:
            continue
        if c in keep:
            value = f"CASE WHEN array_contains(s.{wire.KEEP_COLUMN}, {literal(c)}) THEN t.{quote(c)} ELSE {value} END"
        sets.append(f"{quote(c)} = {value}")
    sets += [f"{c} = {v}" for c, v in zip(cols[len(target.names):], values[len(target.names):])]
    source = stage if tombstones is None else (
        f"(SELECT * FROM {stage} s WHERE s.{wire.KIND_COLUMN} = '{DELETE}' OR NOT EXISTS ("
        f"SELECT 1 FROM {tombstones} d WHERE {key_eq(target, 'd', 's')} "
        f"AND {rank('d', True)} >= {s_rank}))")
    upsert = f"s.{wire.KIND_COLUMN} = '{UPSERT}' AND " if kinds else ""
    sql = [f"MERGE INTO {table} t USING {source} s ON {key_eq(target, 't', 's')}"]
    if kinds:
        sql.append(f"WHEN MATCHED AND s.{wire.KIND_COLUMN} = '{DELETE}' AND {t_rank} < {s_rank} THEN DELETE")
    sql.append(f"WHEN MATCHED AND {upsert}{t_rank} < {s_rank} THEN UPDATE SET " + ", ".join(sets))
    return "\n".join(sql + inserts_and_gc(UPSERT if kinds else None, cols, gc, values=values))


def inserts_and_gc(kind: str | None, cols: Sequence[str], gc: str | None, gc_matched: bool = True,
                   values: Sequence[str] | None = None) -> list[str]:
    """A MERGE's last clauses: rows of ``kind`` (None: every row) no table
    row matched are inserted (``values``: what goes in ``cols``, by default
    the source's same columns); the rows ``gc`` names go (matched ones too,
    with ``gc_matched``)."""
    clauses = [f"WHEN MATCHED AND ({gc}) THEN DELETE"] if gc and gc_matched else []
    when = f"WHEN NOT MATCHED AND s.{wire.KIND_COLUMN} = '{kind}'" if kind is not None else "WHEN NOT MATCHED"
    clauses.append(f"{when} THEN INSERT ({', '.join(cols)}) "
                   f"VALUES ({', '.join(values or ['s.' + c for c in cols])})")
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


def content(target: ShapeTarget, a: str) -> str:
    """A keyless row's whole content as text: equal rows, equal text. Each
    column as the shape's type (a stage made from Arrow holds timestamps
    with a time zone), timestamps to the microsecond (``to_json`` would stop
    at the millisecond)."""
    cols = ", ".join(f"CAST({a}.{quote(f.name)} AS {f.dataType.simpleString()}) AS {quote(f.name)}"
                     for f in shape_fields(target))
    return f"to_json(struct({cols}), map('timestampFormat', {MICROS}, 'timestampNTZFormat', {MICROS}))"


def equal_rows(target: ShapeTarget, rows: str, kind: str | None, other: str | None, other_kind: str | None,
               columns: Sequence[str], changes_only: bool = False) -> str:
    """The rows of ``rows`` (of ``kind``, when a stage) equal to some row of
    ``other`` (of ``other_kind``; None: every row): content, rank (lsn,
    op_index, streamed), then ``columns``; what :mod:`spark_consumer.multiset`
    pairs."""
    def of(ref: str, k: str | None) -> str:
        return ref if k is None else f"(SELECT * FROM {ref} WHERE {wire.KIND_COLUMN} = '{k}')"
    streamed = "true" if changes_only else f"x.{wire.SNAPSHOT_ID_COLUMN} IS NULL"
    extra = "".join(f", x.{quote(c)}" for c in columns)
    join = "" if other is None else f" LEFT SEMI JOIN {of(other, other_kind)} y ON {same_row(target, 'x', 'y')}"
    return (f"SELECT {content(target, 'x')}, coalesce(x.{wire.LSN_COLUMN}, -1L), "
            f"coalesce(x.{wire.OP_INDEX_COLUMN}, -1L), {streamed}{extra} FROM {of(rows, kind)} x{join}")


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
    """The MERGE of a keyless batch into its kept removals: those that took a
    newer row (kind :data:`MOVE`) get its rank, the batch's removals (kind
    REMOVE) go in once per position with what they took, those below a cut or
    a completed backfill's start out."""
    gc = gc_condition(cuts, collected, "d")
    took = [quote(f.name) for f in TOOK]
    cols = [quote(c) for c in target.names] + [quote(f.name) for f in TOMBSTONE_BOOKKEEPING] + took
    sql = [f"MERGE INTO {pending} d USING {source} s ON d.{wire.LSN_COLUMN} = s.{wire.LSN_COLUMN} "
           f"AND d.{wire.OP_INDEX_COLUMN} = s.{wire.OP_INDEX_COLUMN}",
           f"WHEN MATCHED AND s.{wire.KIND_COLUMN} = '{MOVE}' THEN UPDATE SET "
           + ", ".join(f"{c} = s.{c}" for c in took)]
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


def kept_columns(plan: ApplyPlan) -> list[str]:
    """The columns some upsert of the plan keeps the table's value of
    (unchanged TOAST), sorted; empty: the stage has no keep column."""
    return sorted({c for ks in plan.keep_sets for c in (ks or ())})


def stage_table(target: ShapeTarget, plan: ApplyPlan, lean: bool = False) -> pa.Table:
    """The plan's staged rows as Arrow in the stage's layout (shape columns,
    then :data:`STAGE_HEAD` and :data:`BOOKKEEPING`, the keep column only
    when :func:`kept_columns` has some). ``lean`` (a keyed batch whose one
    statement is :func:`table_merge`, no tombstones): also without the kind
    when every row is an upsert and without the snapshot id and offset when
    no row has a snapshot id (a streamed batch). A special value that the
    column's Spark type cannot hold raises :class:`ShapeCannotFollow`."""
    fields = shape_fields(target) + list(STAGE_HEAD + BOOKKEEPING)
    rows = plan.stage_rows
    # Column by column (one C loop each): zip(*rows) makes a tuple per column
    # from 50,000 arguments, and is 3× slower once the collector runs.
    columns = [list(map(itemgetter(i), rows)) for i in range(len(fields))]
    drop = set() if kept_columns(plan) else {wire.KEEP_COLUMN}
    if lean:
        at = {f.name: i for i, f in enumerate(fields)}
        if columns[at[wire.KIND_COLUMN]].count(UPSERT) == len(rows):
            drop.add(wire.KIND_COLUMN)
        if columns[at[wire.SNAPSHOT_ID_COLUMN]].count(None) == len(rows):
            drop.update((wire.SNAPSHOT_ID_COLUMN, wire.OFFSET_COLUMN))
    if drop:
        fields, columns = zip(*((f, v) for f, v in zip(fields, columns) if f.name not in drop))
    arrays = []
    for f, values in zip(fields, columns):
        arrow_type = to_arrow_type(f.dataType)
        if f.name in target.names and isinstance(f.dataType, (BinaryType, ArrayType)):
            values = special_values(f, values)  # Arrow would take a text as bytes or as a list
        try:
            arrays.append(pa.array(values, type=arrow_type))
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            # Arrow refuses a text in any other typed column: a special value (looked for
            # only then, since a scan of every value costs more than the conversion).
            if f.name not in target.names:
                raise
            arrays.append(pa.array(special_values(f, values), type=arrow_type))
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


@dataclass
class SchemaSteps:
    """What a shape's table does to follow a new writer schema, in this
    order: renames (old, new), drops, retypes (the field with its new type;
    widenings, every value kept, and others), additions; and what it cannot
    follow (``problems``)."""

    renamed: list[tuple[str, str]] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    widened: list[StructField] = field(default_factory=list)
    retyped: list[StructField] = field(default_factory=list)  # not a widening: some values may not cast
    added: list[StructField] = field(default_factory=list)
    rekeyed: bool = False  # the key changed (a renamed key column is the same key)
    problems: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.renamed or self.dropped or self.widened or self.retyped or self.added or self.rekeyed)


def widens(old: DataType, new: DataType) -> bool:
    """A type change every value survives and both formats make in place
    (Iceberg's promotions; Delta's type widening)."""
    ints = (ByteType, ShortType, IntegerType, LongType)
    if isinstance(old, ints) and isinstance(new, ints):
        return ints.index(type(new)) > ints.index(type(old))
    if isinstance(old, FloatType) and isinstance(new, DoubleType):
        return True
    return (isinstance(old, DecimalType) and isinstance(new, DecimalType) and new.scale == old.scale
            and new.precision > old.precision)


def follow_changes(target: ShapeTarget, have: Sequence[StructField], wanted: Sequence[StructField],
                   had_key: tuple[str, ...] | None, on_dropped_column: str) -> SchemaSteps:
    """What a table with columns ``have`` does to follow the shape's
    ``wanted`` columns: a renamed column (the shape's field names it among
    its aliases) is renamed, a retyped one retyped (values that do not cast
    are NULL until the producer's re-read of the shape brings them, as on
    PostgreSQL), a new one added; a column the shape lost is kept (later rows
    leave it NULL) or, with ``on_dropped_column = "drop"``, dropped; a
    changed key is noted (``rekeyed``). A key column retyped but not widened
    is a problem."""
    steps = SchemaSteps()
    have_types = {f.name: f.dataType for f in have}
    wanted_names = {f.name for f in wanted}
    for c in target.columns:
        old = next((a for a in c.aliases if a in have_types and a not in wanted_names), None)
        if c.name not in have_types and old is not None:
            steps.renamed.append((old, c.name))
            have_types[c.name] = have_types.pop(old)
    for f in wanted:
        was = have_types.get(f.name)
        if was is None:
            steps.added.append(f)
        elif was != f.dataType and widens(was, f.dataType):
            steps.widened.append(f)
        elif was != f.dataType and f.name in target.key_columns:
            steps.problems.append(f"key column {f.name!r} is {was.simpleString()} in the table, "
                                  f"{f.dataType.simpleString()} in the shape")
        elif was != f.dataType:
            steps.retyped.append(f)
    gone = [n for n in have_types if n not in wanted_names and not n.startswith(wire.RESERVED_PREFIX)]
    if gone and on_dropped_column == "drop":
        steps.dropped.extend(gone)
    renames = dict(steps.renamed)
    steps.rekeyed = had_key is not None and tuple(renames.get(k, k) for k in had_key) != target.key_columns
    return steps


def ddl_columns(fields: Sequence[StructField]) -> str:
    return ", ".join(f"{quote(f.name)} {f.dataType.simpleString()}" for f in fields)
