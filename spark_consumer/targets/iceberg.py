"""The Apache Iceberg target: an Iceberg table per shape in the catalog of
``[consumer.iceberg]`` (a Hadoop catalog on a warehouse folder, or a JDBC
catalog on a PostgreSQL database), applied by
:class:`spark_consumer.targets.lake.LakeTarget` (one ``MERGE`` per shape and
micro-batch, the progress in its snapshot).

Layout
------
- ``<catalog>.<namespace>.`<shape>```: the shape's columns and the
  bookkeeping columns, as on Delta (Iceberg holds any column name as it is).
  Format version 2, copy-on-write (Iceberg's default: every reader reads it).
- ``<catalog>.<namespace>_walbridge.`<shape>```: its tombstones or (keyless)
  its pending removals.
- The progress of the shape's topic: the ``walbridge.progress`` property of
  the table's snapshot summaries (:data:`SNAPSHOT_PROPERTY`); the newest
  snapshot of the table's current line that carries the group's is the record.

Invariants:
- Every MERGE commits a snapshot, an empty one too (Iceberg's own
  behaviour), with the record set in the session for that statement only.
- A compaction (``rewrite_data_files``) commits without the record (the
  session property does not reach procedures): an empty MERGE then commits
  it again, so the newest snapshot always carries it, and expiring old
  snapshots (``expire_snapshots``, keeping the newest) never loses it.
- The target's sessions (one per apply thread) write the same tables in
  turn, so their catalogs cache no table metadata: each statement reads the
  table's current metadata, never a version another session has replaced.
- A keyless shape's pending removals roll back with ``rollback_to_snapshot``
  to the parent of the first snapshot ahead of the table (or are emptied,
  when that snapshot was their first).
"""

from __future__ import annotations

import datetime
import time
from contextlib import AbstractContextManager
from typing import Callable, Sequence

from psycopg.conninfo import conninfo_to_dict
from pyspark.sql import SparkSession
from pyspark.sql.types import StructField

from schemas import wire
from schemas.config import IcebergConfig
from spark_consumer.shape_record import ShapeTarget
from spark_consumer.targets.lake import LakeTarget, Upkeep, session_setting
from spark_consumer.targets.merge_sql import ddl_columns, literal, quote

EXTENSIONS = "org.apache.iceberg.spark.extensions.IcebergSparkSessionExtensions"
SNAPSHOT_PROPERTY = wire.ICEBERG_PROGRESS_PROPERTY  # the snapshot summary key of the record
SESSION_PROPERTY = f"spark.sql.iceberg.snapshot-property.{SNAPSHOT_PROPERTY}"  # the next writes' summary entry
TOMBSTONES_SUFFIX = "_walbridge"  # the namespace of tombstones: <namespace>_walbridge
TABLE_PROPERTIES = {"format-version": "2",
                    # every commit rewrites metadata.json: keep a few old ones, not all
                    "write.metadata.delete-after-commit.enabled": "true",
                    "write.metadata.previous-versions-max": "20"}


def spark_settings(cfg: IcebergConfig) -> dict[str, str]:
    """The Spark settings of the catalog ``cfg`` names (at session start)."""
    prefix = f"spark.sql.catalog.{cfg.name}"
    out = {"spark.sql.extensions": EXTENSIONS, prefix: "org.apache.iceberg.spark.SparkCatalog",
           f"{prefix}.type": cfg.catalog, f"{prefix}.warehouse": cfg.warehouse_uri}
    if cfg.catalog == "jdbc":
        out.update({f"{prefix}.{k}": v for k, v in jdbc_settings(cfg.catalog_dsn).items()})
    return out


def jdbc_settings(dsn: str) -> dict[str, str]:
    """A PostgreSQL DSN as the JDBC catalog's settings (URL, user, password)."""
    info = conninfo_to_dict(dsn)
    host, port = info.get("host") or "localhost", info.get("port") or "5432"
    out = {"uri": f"jdbc:postgresql://{host}:{port}/{info.get('dbname') or info.get('user') or 'postgres'}",
           "jdbc.schema-version": "V1"}
    if info.get("user"):
        out["jdbc.user"] = info["user"]
    if info.get("password"):
        out["jdbc.password"] = info["password"]
    return out


class IcebergTarget(LakeTarget):
    """See the module docstring."""

    format_name = "Iceberg"

    def __init__(self, spark: SparkSession, cfg: IcebergConfig, on_dropped_column: str = "keep",
                 upkeep: Upkeep = Upkeep(), clock: Callable[[], float] = time.monotonic):
        super().__init__(spark, f"{cfg.name}.{cfg.namespace} ({cfg.catalog} catalog, {cfg.warehouse})",
                         on_dropped_column, upkeep, clock)
        self.catalog, self.namespace = cfg.name, cfg.namespace
        self._namespaces_made = False
        # Each session's catalog would cache a table's metadata, and the
        # target's sessions write the same tables (module docstring).
        self.set_conf(f"spark.sql.catalog.{cfg.name}.cache-enabled", "false")

    def table_ref(self, target: ShapeTarget) -> str:
        return f"{self.catalog}.{self.namespace}.{quote(target.shape)}"

    def tombstones_ref(self, target: ShapeTarget) -> str:
        return f"{self.catalog}.{self.namespace}{TOMBSTONES_SUFFIX}.{quote(target.shape)}"

    def _columns(self, table: str) -> list[StructField] | None:
        try:
            return list(self.spark.table(table).schema.fields)
        except Exception as e:  # noqa: BLE001 - Spark's AnalysisException: no table there yet
            if "TABLE_OR_VIEW_NOT_FOUND" in str(e) or "NoSuchTableException" in str(e):
                return None
            raise

    def _create(self, table: str, fields: Sequence[StructField], properties: dict[str, str]) -> None:
        if not self._namespaces_made:
            for ns in (self.namespace, self.namespace + TOMBSTONES_SUFFIX):
                self.spark.sql(f"CREATE NAMESPACE IF NOT EXISTS {self.catalog}.{ns}")
            self._namespaces_made = True
        props = {**TABLE_PROPERTIES, **properties}
        self.spark.sql(f"CREATE TABLE IF NOT EXISTS {table} ({ddl_columns(fields)}) USING iceberg TBLPROPERTIES ("
                       + ", ".join(f"{literal(k)} = {literal(v)}" for k, v in props.items()) + ")")

    def _snapshots(self, table: str) -> list[tuple[int, int | None, str | None]]:
        """The snapshots of the table's current line, newest first: (id, parent, record)."""
        current = self.spark.sql(f"SELECT snapshot_id FROM {table}.refs WHERE name = 'main'").collect()
        if not current:
            return []
        rows = {r.snapshot_id: (r.parent_id, r.record) for r in self.spark.sql(
            f"SELECT snapshot_id, parent_id, summary[{literal(SNAPSHOT_PROPERTY)}] AS record "
            f"FROM {table}.snapshots").collect()}
        line, at = [], current[0].snapshot_id
        while at in rows:
            parent, record = rows[at]
            line.append((at, parent, record))
            at = parent
        return line

    def _history(self, table: str, limit: int | None) -> list[tuple[int, str | None]]:
        line = self._snapshots(table)
        return [(sid, record) for sid, _, record in (line[:limit] if limit else line)]

    def _carrying(self, metadata: str | None) -> AbstractContextManager:
        return session_setting(self.spark, SESSION_PROPERTY, metadata)

    def _has_rows(self, table: str) -> bool:
        return bool(self.spark.sql(f"SELECT 1 FROM {table}.files LIMIT 1").collect())

    def _replace_empty(self, table: str, fields: Sequence[StructField]) -> None:
        self.spark.sql(f"DROP TABLE IF EXISTS {table} PURGE")
        self._create(table, fields, {})

    def _retype(self, target: ShapeTarget, table: str, widened: Sequence[StructField],
                retyped: Sequence[StructField]) -> None:
        """Widenings are Iceberg's type promotions, in place. Another retype
        replaces the table by its rows cast (NULL where a value does not cast,
        until the shape's re-read brings it) in one atomic commit, which starts
        a new line of snapshots: it carries the newest record."""
        if not retyped:
            return super()._retype(target, table, widened, retyped)
        record = next((text for _, text in self._history(table, None) if text), None)
        new = {f.name: f.dataType.simpleString() for f in (*widened, *retyped)}
        columns = ", ".join(f"try_cast({quote(c)} AS {new[c]}) AS {quote(c)}" if c in new else quote(c)
                            for c in (f.name for f in self._columns(table) or ()))
        with self._carrying(record):
            self.spark.sql(f"CREATE OR REPLACE TABLE {table} USING iceberg AS SELECT {columns} FROM {table}")

    def _roll_back(self, table: str, version: int) -> None:
        parent = next((p for sid, p, _ in self._snapshots(table) if sid == version), None)
        if parent is None:  # the table's first snapshot: before it, nothing
            self.spark.sql(f"DELETE FROM {table}").collect()
        else:
            self.spark.sql(f"CALL {self.catalog}.system.rollback_to_snapshot(table => {literal(table)}, "
                           f"snapshot_id => {int(parent)})").collect()

    def _keep_up_table(self, table: str, command: str, record: str | None) -> None:
        name = literal(table)  # the whole reference: a name without the catalog is first tried as one
        if command == "compact":
            self.spark.sql(f"CALL {self.catalog}.system.rewrite_data_files(table => {name})").collect()
            line = self._snapshots(table)
            if record and line and line[0][2] != record:  # commit the record again (module docstring)
                self.spark.sql(f"MERGE INTO {table} t USING (SELECT * FROM {table} WHERE false) s ON false "
                               "WHEN NOT MATCHED THEN INSERT *").collect()
        else:
            older = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(hours=self.upkeep.retain_hours)
            self.spark.sql(f"CALL {self.catalog}.system.expire_snapshots(table => {name}, "
                           f"older_than => TIMESTAMP {literal(older.strftime('%Y-%m-%d %H:%M:%S.%f+00:00'))}, "
                           "retain_last => 1)").collect()
