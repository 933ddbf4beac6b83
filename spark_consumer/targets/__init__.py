"""Where the consumer applies: one module per kind of target behind one small
interface (:class:`Target`), chosen by ``[consumer] target``
(:func:`open_target`).

- ``postgresql`` (:mod:`spark_consumer.targets.postgresql`): a table per shape
  in a PostgreSQL database; every shape of a micro-batch in one transaction.
- ``delta`` (:mod:`spark_consumer.targets.delta`): a Delta Lake table per
  shape under ``[consumer] target_path``; one table commit per shape.
- ``iceberg`` (:mod:`spark_consumer.targets.iceberg`): an Apache Iceberg table
  per shape in ``[consumer.iceberg]``'s catalog; one snapshot per shape.

The two lakehouse formats share their apply (:mod:`spark_consumer.targets.lake`)
and its SQL (:mod:`spark_consumer.targets.merge_sql`).

Invariants (every target):
- A shape's progress (next offset per topic-partition, with the topic id it
  counts in) is written in the same commit as the shape's rows, and read back
  at every start (:meth:`Target.read_progress`): a crash between any two steps
  neither loses nor doubles a row.
- Rows are applied by the pure plan (:func:`spark_consumer.apply_plan.plan_batch`):
  per key the newest change by position, an older change never overwriting a
  newer one, a deleted key never coming back.
- A shape whose table cannot follow its writer schema raises
  :class:`~spark_consumer.target_layout.ShapeCannotFollow` from
  :meth:`Target.follow` (or from :meth:`Target.apply` through ``hold``): the
  shape is held, loudly, never applied wrong.
- Kafka offsets may be committed to the consumer group only after
  :meth:`Target.apply` returned (``BatchResult.offsets``).
"""

from __future__ import annotations

from schemas.config import Config
from spark_consumer.targets.base import ShapeBatch, Target
from spark_consumer.targets.delta import SPARK_SETTINGS as DELTA_SPARK_SETTINGS
from spark_consumer.targets.delta import DeltaTarget
from spark_consumer.targets.iceberg import IcebergTarget
from spark_consumer.targets.iceberg import spark_settings as iceberg_spark_settings
from spark_consumer.targets.lake import Upkeep
from spark_consumer.targets.postgresql import PostgresTarget

__all__ = ["ShapeBatch", "Target", "open_target", "target_spark_settings"]


def target_spark_settings(config: Config) -> dict[str, str]:
    """The Spark settings the configured target needs at session start
    (where walbridge starts the driver)."""
    if config.consumer.target == "delta":
        return dict(DELTA_SPARK_SETTINGS)
    if config.consumer.target == "iceberg":
        return iceberg_spark_settings(config.consumer.iceberg)
    return {}


def open_target(config: Config, spark) -> Target:
    """The configured target (``[consumer] target``), not yet connected."""
    c = config.consumer
    upkeep = Upkeep(c.compact_interval, c.vacuum_interval, c.vacuum_retain_hours)
    if c.target == "delta":
        return DeltaTarget(spark, c.target_path, c.on_dropped_column, upkeep)
    if c.target == "iceberg":
        return IcebergTarget(spark, c.iceberg, c.on_dropped_column, upkeep)
    return PostgresTarget(config.consumer.target_dsn, config.consumer.on_dropped_column)
