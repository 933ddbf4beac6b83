"""The Delta Lake target: a Delta table per shape at ``<target_path>/<shape
name>``, applied by one ``MERGE`` per shape and micro-batch on the driver's
Spark session, the shape's progress in that MERGE's commit.

Layout
------
- ``<target_path>/<shape>``: the shape's columns (the Spark types the decoder
  gives them, :func:`spark_consumer.decode.column_type`) and the bookkeeping
  columns ``_wb_lsn``, ``_wb_op_index`` (the position of the change that wrote
  the row), ``_wb_partition``, ``_wb_offset`` (where that change was in Kafka)
  and ``_wb_snapshot_id``. It holds exactly the live rows. Column mapping (by
  name) only where a column's name needs it (:func:`needs_mapping`): not every
  Delta reader follows it.
- ``<target_path>/_walbridge/tombstones/<shape>``: per deleted key, the
  position, partition and offset of its delete (keyed shapes), so that an
  older change of a deleted key (a backfill row, a replay) never brings it back.
- The progress of the shape's topic: the ``userMetadata`` of the table's
  commits (:class:`spark_consumer.lake_progress.LakeProgress`); the
  newest commit that carries the group's is the record
  (:meth:`DeltaTarget.read_progress`).

The path of one shape's batch, top to bottom:
1. Refuse a gap, skip what progress covers, plan the rest
   (:func:`spark_consumer.apply_plan.plan_batch`), as the PostgreSQL target.
2. The plan's deletes (and cuts) into the tombstones, by one MERGE that only
   moves a key's tombstone forward, and drops it when a newer upsert lands.
3. One MERGE into the shape's table: an upsert lands where the row ranks
   below it and no tombstone ranks at or above it, a delete removes an older
   row, a cut removes its partition's rows below it; the commit carries the
   shape's new progress.

Invariants:
- Every MERGE into the table commits, even one that changes no row (Delta
  skips such commits by default, and with them the progress).
- The table and its progress move in one Delta commit: a crash before it
  leaves neither (step 2 is idempotent: a replay plans the same tombstones),
  after it both; a replayed range is skipped by progress.
- Ranks and cuts are the PostgreSQL target's (:mod:`spark_consumer.statements`):
  (position, streamed over snapshot); a row without a position ranks lowest.
- What this target does not follow yet stops the shape loudly
  (:class:`~spark_consumer.target_layout.ShapeCannotFollow`), never a row
  applied wrong: keyless shapes, scoped backfill cuts, a writer schema that
  renames or retypes a column, drops one with ``on_dropped_column = "drop"``
  or changes the key (:func:`follow_changes`), a special value
  (``infinity``) Spark's type cannot hold.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from typing import Any, Callable, Mapping, Sequence

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
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
from spark_consumer.apply_plan import (
    DEFAULT_GC_CONTROLS,
    DELETE,
    STAGE_EXTRA,
    UPSERT,
    ApplyPlan,
    plan_batch,
)
from spark_consumer.batch import (
    BatchResult,
    fill_results,
    merge_plan_stats,
    progress_update,
    staged_kinds,
    unapplied_rows,
)
from spark_consumer.decode import column_type
from spark_consumer.lake_progress import LakeProgress, backfill_ends_applied
from spark_consumer.progress import Progress
from spark_consumer.shape_record import ShapeTarget
from spark_consumer.target_layout import ShapeCannotFollow
from spark_consumer.targets.base import ShapeBatch

log = logging.getLogger("walbridge.consumer")

# Spark settings the driver needs for Delta's SQL (MERGE INTO delta.`path`).
SPARK_SETTINGS = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
}
USER_METADATA = "spark.databricks.delta.commitInfo.userMetadata"  # the next commit's userMetadata
SNAPSHOT_PARTITIONS = "spark.databricks.delta.snapshotPartitions"
SKIP_EMPTY_COMMITS = "spark.databricks.delta.skipRecordingEmptyCommits"  # true by default: no commit, no progress
KEY_PROPERTY = "walbridge.key"  # table property: the shape's key columns (a JSON list) when the table was made
TOMBSTONES_DIR = "_walbridge/tombstones"
HISTORY_LOOKBACK = 100  # commits read back for the progress before the whole history
# The bookkeeping columns of a shape's table, in the stage's order (apply_plan.STAGE_EXTRA after kind and keep).
BOOKKEEPING = (StructField(wire.LSN_COLUMN, LongType()), StructField(wire.OP_INDEX_COLUMN, LongType()),
               StructField(wire.PARTITION_COLUMN, IntegerType()), StructField(wire.OFFSET_COLUMN, LongType()),
               StructField(wire.SNAPSHOT_ID_COLUMN, StringType()))
STAGE_HEAD = (StructField(wire.KIND_COLUMN, StringType()), StructField(wire.KEEP_COLUMN, ArrayType(StringType())))
assert tuple(f.name for f in STAGE_HEAD + BOOKKEEPING) == STAGE_EXTRA
TOMBSTONE_BOOKKEEPING = BOOKKEEPING[:4]
_MAPPED_CHARS = " ,;{}()\n\t="  # what Delta refuses in a column name without column mapping
_FLOAT_SPECIALS = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}


def quote(name: str) -> str:
    """A Spark SQL identifier."""
    return "`" + name.replace("`", "``") + "`"


def needs_mapping(name: str) -> bool:
    """Can Delta hold a column of this name only with column mapping (which
    some readers do not follow: delta-rs's pyarrow reader reads NULLs)?"""
    return any(ch in name for ch in _MAPPED_CHARS)


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


def table_merge(target: ShapeTarget, table: str, tombstones: str, stage: str, keep: Sequence[str],
                cuts: Cuts | None = None, collected: Sequence[int] = ()) -> str:
    """The MERGE of a staged plan into the shape's table (module docstring,
    step 3); ``collected``: the start LSNs of the backfills the batch completes."""
    gc = gc_condition(cuts, collected, "t")
    t_rank, s_rank = rank("t"), rank("s")
    cols = [quote(c) for c in target.names] + [quote(f.name) for f in BOOKKEEPING]
    sets = []
    for c in target.names:
        if c in target.key_columns:
            continue
        value = f"s.{quote(c)}"
        if c in keep:
            value = f"CASE WHEN array_contains(s.{wire.KEEP_COLUMN}, {_literal(c)}) THEN t.{quote(c)} ELSE {value} END"
        sets.append(f"{quote(c)} = {value}")
    sets += [f"{quote(f.name)} = s.{quote(f.name)}" for f in BOOKKEEPING]
    source = (f"(SELECT * FROM {stage} s WHERE s.{wire.KIND_COLUMN} = '{DELETE}' OR NOT EXISTS ("
              f"SELECT 1 FROM delta.{quote(tombstones)} d WHERE {key_eq(target, 'd', 's')} "
              f"AND {rank('d', True)} >= {s_rank}))")
    sql = [f"MERGE INTO delta.{quote(table)} t USING {source} s ON {key_eq(target, 't', 's')}",
           f"WHEN MATCHED AND s.{wire.KIND_COLUMN} = '{DELETE}' AND {t_rank} < {s_rank} THEN DELETE",
           f"WHEN MATCHED AND s.{wire.KIND_COLUMN} = '{UPSERT}' AND {t_rank} < {s_rank} THEN UPDATE SET "
           + ", ".join(sets)]
    if gc:
        sql.append(f"WHEN MATCHED AND ({gc}) THEN DELETE")
    sql.append(f"WHEN NOT MATCHED AND s.{wire.KIND_COLUMN} = '{UPSERT}' THEN INSERT ({', '.join(cols)}) "
               f"VALUES ({', '.join('s.' + c for c in cols)})")
    if gc:
        sql.append(f"WHEN NOT MATCHED BY SOURCE AND ({gc}) THEN DELETE")
    return "\n".join(sql)


def tombstones_merge(target: ShapeTarget, tombstones: str, stage: str, cuts: Cuts | None = None,
                     collected: Sequence[int] = ()) -> str:
    """The MERGE of a staged plan into the shape's tombstones (step 2): a
    delete records (or moves forward) its key's tombstone, a newer upsert
    drops it, cuts and completed backfills remove what is below them."""
    gc = gc_condition(cuts, collected, "d")
    d_rank, s_rank = rank("d", True), rank("s")
    cols = [quote(k) for k in target.key_columns] + [quote(f.name) for f in TOMBSTONE_BOOKKEEPING]
    sets = ", ".join(f"{quote(f.name)} = s.{quote(f.name)}" for f in TOMBSTONE_BOOKKEEPING)
    sql = [f"MERGE INTO delta.{quote(tombstones)} d USING {stage} s ON {key_eq(target, 'd', 's')}",
           f"WHEN MATCHED AND s.{wire.KIND_COLUMN} = '{DELETE}' AND {d_rank} < {s_rank} THEN UPDATE SET {sets}",
           f"WHEN MATCHED AND s.{wire.KIND_COLUMN} = '{UPSERT}' AND {d_rank} < {s_rank} THEN DELETE",
           f"WHEN NOT MATCHED AND s.{wire.KIND_COLUMN} = '{DELETE}' THEN INSERT ({', '.join(cols)}) "
           f"VALUES ({', '.join('s.' + c for c in cols)})"]
    if gc:
        sql.append(f"WHEN NOT MATCHED BY SOURCE AND ({gc}) THEN DELETE")
    return "\n".join(sql)


def _literal(text: str) -> str:
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
        bad = [v for v in values if isinstance(v, str) and v not in _FLOAT_SPECIALS]
        if not bad:
            return [_FLOAT_SPECIALS[v] if isinstance(v, str) else v for v in values]
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


class DeltaTarget:
    """See the module docstring. ``root``: ``[consumer] target_path``."""

    def __init__(self, spark: SparkSession, root: str, on_dropped_column: str = "keep"):
        # A session of its own: the commit metadata it sets is seen by its MERGEs only.
        self.spark = spark.newSession()
        # Delta rebuilds a table's state from its log in 50 tasks by default:
        # most of a small MERGE's time on a few cores. As many as Spark has.
        self.spark.conf.set(SNAPSHOT_PARTITIONS, str(spark.sparkContext.defaultParallelism))
        # A MERGE that changes no row must still commit: its commit carries the progress.
        self.spark.conf.set(SKIP_EMPTY_COMMITS, "false")
        self.root = root.rstrip("/")
        self.address = root
        self.on_dropped_column = on_dropped_column
        self._followed: dict[str, ShapeTarget] = {}  # topic -> what its table has
        self._records: dict[str, LakeProgress] = {}  # topic -> its table's record, as committed

    def table_path(self, target: ShapeTarget) -> str:
        return f"{self.root}/{target.shape}"

    def tombstones_path(self, target: ShapeTarget) -> str:
        return f"{self.root}/{TOMBSTONES_DIR}/{target.shape}"

    def _columns(self, path: str) -> list[StructField] | None:
        try:
            return list(self.spark.read.format("delta").load(path).schema.fields)
        except Exception as e:  # noqa: BLE001 - Spark's AnalysisException: no table there yet
            if "DELTA_MISSING_DELTA_TABLE" in str(e) or "is not a Delta table" in str(e) \
                    or "PATH_NOT_FOUND" in str(e):
                return None
            raise

    def follow(self, topic: str, target: ShapeTarget) -> None:
        """Create the shape's table and tombstones, or add the columns a new
        writer schema brings; anything else this target cannot follow yet."""
        if target.keyless:
            raise ShapeCannotFollow(f"shape {target.shape} has no key (REPLICA IDENTITY FULL without a primary "
                                    "key): the Delta target applies keyed shapes only")
        wanted = shape_fields(target)
        path = self.table_path(target)
        have = self._columns(path)
        if have is None:
            props = {KEY_PROPERTY: json.dumps(list(target.key_columns))}
            if any(needs_mapping(f.name) for f in wanted):
                props.update({"delta.columnMapping.mode": "name", "delta.minReaderVersion": "2",
                              "delta.minWriterVersion": "5"})
            self.spark.sql(f"CREATE TABLE IF NOT EXISTS delta.{quote(path)} ({ddl_columns(wanted + list(BOOKKEEPING))})"
                           " USING delta TBLPROPERTIES (" + ", ".join(f"{_literal(k)} = {_literal(v)}"
                                                                     for k, v in props.items()) + ")")
        else:
            self._follow_columns(target, path, have, wanted)
        tomb = self.tombstones_path(target)
        tomb_fields = [f for f in wanted if f.name in target.key_columns] + list(TOMBSTONE_BOOKKEEPING)
        if self._columns(tomb) is None:
            self.spark.sql(f"CREATE TABLE IF NOT EXISTS delta.{quote(tomb)} ({ddl_columns(tomb_fields)}) USING delta")
        self._followed[topic] = target

    def _follow_columns(self, target: ShapeTarget, path: str, have: list[StructField],
                        wanted: list[StructField]) -> None:
        key = self.spark.sql(f"SHOW TBLPROPERTIES delta.{quote(path)} ({_literal(KEY_PROPERTY)})").collect()
        had_key = tuple(json.loads(key[0].value)) if key and key[0].value.startswith("[") else None
        added, problems = follow_changes(target, have, wanted, had_key, self.on_dropped_column)
        if problems:
            raise ShapeCannotFollow(f"shape {target.shape}: the Delta table cannot follow its writer schema yet: "
                                    + "; ".join(problems))
        if added:
            self.spark.sql(f"ALTER TABLE delta.{quote(path)} ADD COLUMNS ({ddl_columns(added)})")
            log.info("shape %s: Delta table %s gained columns %s", target.shape, path,
                     ", ".join(f.name for f in added))

    def read_progress(self, group: str) -> dict[tuple[str, int], Progress]:
        """Each followed shape's progress: the newest commit of its table that
        carries the group's."""
        out: dict[tuple[str, int], Progress] = {}
        for topic, target in self._followed.items():
            record = self.newest_record(self.table_path(target), group)
            if record is not None and record.topic != topic:
                log.warning("shape %s: the Delta table's progress is for topic %s, not %s; read from the start",
                            target.shape, record.topic, topic)
                record = None
            self._records[topic] = record or LakeProgress(topic)
            out.update({(topic, p): pr for p, pr in self._records[topic].partitions.items()})
        return out

    def newest_record(self, path: str, group: str) -> LakeProgress | None:
        for limit in (f"LIMIT {HISTORY_LOOKBACK}", ""):
            rows = self.spark.sql(f"DESCRIBE HISTORY delta.{quote(path)} {limit}").select(
                "version", "userMetadata").orderBy("version", ascending=False).collect()
            for row in rows:
                record = LakeProgress.from_json(row.userMetadata, group)
                if record is not None:
                    return record
            if len(rows) < HISTORY_LOOKBACK:
                return None
        return None

    def apply(self, group: str, batches: Sequence[ShapeBatch], *, on_offset_reset: str,
              hold: Callable[[str, str], None]) -> BatchResult:
        result = BatchResult()
        for b in batches:
            try:
                if b.follow:
                    self.follow(b.topic, b.target)
                self._apply_shape(group, b, result, on_offset_reset)
            except ShapeCannotFollow as e:
                hold(b.topic, str(e))
                for part in b.parts:
                    result.parts.pop(part.tp, None)
        return result

    def _apply_shape(self, group: str, b: ShapeBatch, result: BatchResult, on_offset_reset: str) -> None:
        target, parts = b.target, b.parts
        record = self._records.setdefault(b.topic, LakeProgress(b.topic))
        committed = record.partitions
        progress = {part.tp: committed[part.partition].for_incarnation(part.topic_id)
                    if part.partition in committed else Progress(part.start) for part in parts}
        existed = {part.tp for part in parts if part.partition in committed}
        todo_rows, floors = unapplied_rows(parts, progress, existed, result, on_gap="raise",
                                           on_offset_reset=on_offset_reset)
        fields = parts[0].fields
        plan = plan_batch(target, todo_rows, floors=floors, gc_controls=DEFAULT_GC_CONTROLS, fields=fields)
        if plan.scoped_cuts:
            raise ShapeCannotFollow(f"shape {target.shape}: a scoped backfill reached the Delta target, which "
                                    "does not apply scoped backfills yet")
        merge_plan_stats(result, plan)
        result.controls.extend(plan.controls)
        backfills, collected = backfill_ends_applied(record.backfills, plan.backfill_ends)
        cuts = {p: c.position for p, c in plan.cuts.items()}
        staged = staged_kinds(plan)
        updates = {}
        for part in parts:
            st = plan.stats.get(part.tp)
            _, p, nxt, applied, floor, topic_id = progress_update(part, progress[part.tp], result.parts[part.tp],
                                                                  st.max_position if st else None,
                                                                  plan.cuts.get(part.partition))
            updates[p] = Progress(nxt, applied, floor, topic_id)
        new_record = LakeProgress(b.topic, {**committed, **updates}, backfills)
        self._merge(target, plan, cuts, collected, new_record.to_json(group))
        applied_counts = {"upserted": Counter({p: c[UPSERT] for p, c in staged.items()}),
                          "tombstoned": Counter({p: c[DELETE] for p, c in staged.items()})}
        fill_results(result.parts, b.topic, staged, applied_counts)
        self._records[b.topic] = new_record

    def _merge(self, target: ShapeTarget, plan: ApplyPlan, cuts: Cuts, collected: Sequence[int], metadata: str
               ) -> None:
        """Steps 2 and 3 of the module docstring."""
        stage_df: DataFrame = self.spark.createDataFrame(stage_table(target, plan))
        view = "walbridge_stage"
        stage_df.createOrReplaceTempView(view)
        tomb = self.tombstones_path(target)
        if cuts or collected or any(t[len(target.columns)] == DELETE for t in plan.stage_rows):
            self.spark.sql(tombstones_merge(target, tomb, view, cuts, collected)).collect()
        keep = sorted({c for ks in plan.keep_sets for c in (ks or ())})
        self.spark.conf.set(USER_METADATA, metadata)
        try:
            self.spark.sql(table_merge(target, self.table_path(target), tomb, view, keep, cuts, collected)).collect()
        finally:
            self.spark.conf.unset(USER_METADATA)

    def close(self) -> None:
        pass
