"""The Delta Lake target: a Delta table per shape at ``<target_path>/<shape
name>``, applied by :class:`spark_consumer.targets.lake.LakeTarget` (one
``MERGE`` per shape and micro-batch, the progress in its commit).

Layout
------
- ``<target_path>/<shape>``: the shape's columns (the Spark types the decoder
  gives them, :func:`spark_consumer.decode.column_type`) and the bookkeeping
  columns ``_wb_lsn``, ``_wb_op_index`` (the position of the change that wrote
  the row), ``_wb_partition``, ``_wb_offset`` (where that change was in Kafka)
  and ``_wb_snapshot_id``. It holds exactly the live rows. Column mapping (by
  name) only where a column's name needs it (:func:`needs_mapping`) or the
  shape renames or drops a column: not every Delta reader follows it. A
  widened column is rewritten (one commit), not type-widened: delta-rs
  refuses Delta's type widening feature.
- ``<target_path>/_walbridge/tombstones/<shape>``: the shape's tombstones, or
  (keyless) its pending removals.
- The progress of the shape's topic: the ``userMetadata`` of the table's
  commits (:class:`spark_consumer.lake_progress.LakeProgress`); the newest
  commit that carries the group's is the record.

Invariants:
- Every commit commits: Delta skips a MERGE that changes no row by default,
  and with it the progress (:data:`SKIP_EMPTY_COMMITS` off).
- Upkeep is ``OPTIMIZE`` (its commit carries the record, as every commit of
  the session does while it is set) and ``VACUUM ... RETAIN <hours>``; a
  keyless shape's pending removals roll back by ``RESTORE``.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from typing import Callable, Sequence

from pyspark.sql import SparkSession
from pyspark.sql.functions import expr
from pyspark.sql.types import StructField, StructType

from spark_consumer.shape_record import ShapeTarget
from spark_consumer.targets.lake import LakeTarget, Upkeep, session_setting
from spark_consumer.targets.merge_sql import ddl_columns, literal, quote

# Spark settings the driver needs for Delta's SQL (MERGE INTO delta.`path`).
SPARK_SETTINGS = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
}
USER_METADATA = "spark.databricks.delta.commitInfo.userMetadata"  # the next commit's userMetadata
SNAPSHOT_PARTITIONS = "spark.databricks.delta.snapshotPartitions"
SKIP_EMPTY_COMMITS = "spark.databricks.delta.skipRecordingEmptyCommits"  # true by default: no commit, no progress
RETENTION_CHECK = "spark.databricks.delta.retentionDurationCheck.enabled"  # refuses a VACUUM under 7 days
DELTA_MIN_RETAIN_HOURS = 168
LISTING_PARALLELISM = "spark.sql.sources.parallelPartitionDiscovery.parallelism"  # VACUUM's file listing tasks
TOMBSTONES_DIR = "_walbridge/tombstones"
# Column mapping, turned on where a name needs it or the shape renames or drops a column.
COLUMN_MAPPING = {"delta.columnMapping.mode": "name", "delta.minReaderVersion": "2", "delta.minWriterVersion": "5"}
_MAPPED_CHARS = " ,;{}()\n\t="  # what Delta refuses in a column name without column mapping


def ref(path: str) -> str:
    """The Spark SQL reference of the Delta table at ``path``."""
    return f"delta.{quote(path)}"


def path_of(table: str) -> str:
    """The path of the Delta table whose Spark SQL reference is ``table``."""
    return table[len("delta.`"):-1].replace("``", "`")


def needs_mapping(name: str) -> bool:
    """Can Delta hold a column of this name only with column mapping (which
    some readers do not follow: delta-rs's pyarrow reader reads NULLs)?"""
    return any(ch in name for ch in _MAPPED_CHARS)


class DeltaTarget(LakeTarget):
    """See the module docstring. ``root``: ``[consumer] target_path``."""

    format_name = "Delta"

    def __init__(self, spark: SparkSession, root: str, on_dropped_column: str = "keep",
                 upkeep: Upkeep = Upkeep(), clock: Callable[[], float] = time.monotonic):
        super().__init__(spark, root, on_dropped_column, upkeep, clock)
        # Delta rebuilds a table's state from its log in 50 tasks by default:
        # most of a small MERGE's time on a few cores. As many as Spark has.
        self.set_conf(SNAPSHOT_PARTITIONS, str(spark.sparkContext.defaultParallelism))
        # A MERGE that changes no row must still commit: its commit carries the progress.
        self.set_conf(SKIP_EMPTY_COMMITS, "false")
        if upkeep.retain_hours < DELTA_MIN_RETAIN_HOURS:  # asked for: Delta refuses it otherwise
            self.set_conf(RETENTION_CHECK, "false")
        self.root = root.rstrip("/")

    def table_path(self, target: ShapeTarget) -> str:
        return f"{self.root}/{target.shape}"

    def tombstones_path(self, target: ShapeTarget) -> str:
        return f"{self.root}/{TOMBSTONES_DIR}/{target.shape}"

    def table_ref(self, target: ShapeTarget) -> str:
        return ref(self.table_path(target))

    def tombstones_ref(self, target: ShapeTarget) -> str:
        return ref(self.tombstones_path(target))

    def _columns(self, table: str) -> list[StructField] | None:
        try:
            return list(self.spark.table(table).schema.fields)
        except Exception as e:  # noqa: BLE001 - Spark's AnalysisException: no table there yet
            if any(sign in str(e) for sign in ("PATH_NOT_FOUND", "DELTA_TABLE_NOT_FOUND", "DELTA_MISSING_DELTA_TABLE",
                                               "is not a Delta table")):
                return None
            raise

    def _create(self, table: str, fields: Sequence[StructField], properties: dict[str, str]) -> None:
        props = dict(properties)
        if any(needs_mapping(f.name) for f in fields):
            props.update(COLUMN_MAPPING)
        tblprops = " TBLPROPERTIES (" + ", ".join(f"{literal(k)} = {literal(v)}" for k, v in props.items()) + ")" \
            if props else ""
        self.spark.sql(f"CREATE TABLE IF NOT EXISTS {table} ({ddl_columns(fields)}) USING delta{tblprops}")

    def _replace_empty(self, table: str, fields: Sequence[StructField]) -> None:
        if any(needs_mapping(f.name) for f in fields):
            self._allow_renames(table)
        self.spark.createDataFrame([], StructType(list(fields))).write.format("delta").mode("overwrite") \
            .option("overwriteSchema", "true").save(path_of(table))

    def _allow_renames(self, table: str) -> None:
        have = {r.key: r.value for r in self.spark.sql(f"SHOW TBLPROPERTIES {table}").collect()}
        wanted = {k: v for k, v in COLUMN_MAPPING.items()
                  if have.get(k) != v and not (k.startswith("delta.min") and int(have.get(k, 0)) >= int(v))}
        if wanted:
            self.spark.sql(f"ALTER TABLE {table} SET TBLPROPERTIES ("
                           + ", ".join(f"{literal(k)} = {literal(v)}" for k, v in wanted.items()) + ")")

    def _retype(self, target: ShapeTarget, table: str, widened: Sequence[StructField],
                retyped: Sequence[StructField]) -> None:
        """Rewrite the table with the new types, in one commit (Delta's own
        type widening is a reader feature delta-rs and others refuse); a value
        that does not cast is NULL until the shape's re-read brings it."""
        new = {f.name: f.dataType.simpleString() for f in (*widened, *retyped)}
        rows = self.spark.table(table)
        rows.select(*(expr(f"try_cast({quote(c)} AS {new[c]})").alias(c) if c in new else rows[c]
                      for c in rows.columns)).write \
            .format("delta").mode("overwrite").option("overwriteSchema", "true").save(path_of(table))

    def _history(self, table: str, limit: int | None) -> list[tuple[int, str | None]]:
        rows = self.spark.sql(f"DESCRIBE HISTORY {table}" + (f" LIMIT {limit}" if limit else "")).select(
            "version", "userMetadata").orderBy("version", ascending=False).collect()
        return [(row.version, row.userMetadata) for row in rows]

    def _carrying(self, metadata: str | None) -> AbstractContextManager:
        return session_setting(self.spark, USER_METADATA, metadata)

    def _has_rows(self, table: str) -> bool:
        """Does the Delta table have data files (read from its log, no scan)?"""
        return bool(self.spark.sql(f"DESCRIBE DETAIL {table}").first().numFiles)

    def _roll_back(self, table: str, version: int) -> None:
        self.spark.sql(f"RESTORE TABLE {table} TO VERSION AS OF {version - 1}").collect()

    def _keep_up_table(self, table: str, command: str, record: str | None) -> None:
        if command == "compact":
            self.spark.sql(f"OPTIMIZE {table}").collect()
        else:  # listing the table's files in as many tasks as the cluster has cores, not Spark's 10,000
            with session_setting(self.spark, LISTING_PARALLELISM, str(self.spark.sparkContext.defaultParallelism)):
                self.spark.sql(f"VACUUM {table} RETAIN {self.upkeep.retain_hours:g} HOURS").collect()
