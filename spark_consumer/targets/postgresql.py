"""The PostgreSQL target: a table per shape in the database of ``[consumer]
target_dsn``, walbridge's progress in ``_walbridge.progress`` beside them
(layout: :mod:`spark_consumer.target_layout`, :mod:`spark_consumer.progress`).

Invariants:
- Every shape of a micro-batch is applied in ONE transaction with every
  part's progress (:func:`spark_consumer.apply_driver.apply_shapes`): the
  commit is one decision for the whole micro-batch.
- A table follows a new writer schema in that transaction, in a savepoint: a
  shape that cannot follow (:class:`~spark_consumer.target_layout.ShapeCannotFollow`)
  has its DDL rolled back and is held; the other shapes commit.
- One connection, opened on first use and again after it broke (walbridge's
  own tables made on connecting).
"""

from __future__ import annotations

from typing import Callable, Sequence

import psycopg

from schemas.failures import TARGET, attributed
from spark_consumer.apply_driver import apply_shapes
from spark_consumer.batch import BatchResult
from spark_consumer.progress import Progress, ensure_progress, read_progress
from spark_consumer.shape_record import ShapeTarget
from spark_consumer.target_layout import ShapeCannotFollow, ensure_table
from spark_consumer.targets.base import ShapeBatch

TARGET_APP_NAME = "walbridge-consumer"  # application_name of the consumer's target connection


class PostgresTarget:
    """See the module docstring."""

    def __init__(self, dsn: str, on_dropped_column: str = "keep"):
        self.dsn = dsn
        self.address = dsn
        self.on_dropped_column = on_dropped_column
        self._conn: psycopg.Connection | None = None

    def _connection(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            with attributed(database=(TARGET, self.dsn)):
                self._conn = psycopg.connect(self.dsn, autocommit=True, application_name=TARGET_APP_NAME)
                ensure_progress(self._conn)
        return self._conn

    def follow(self, topic: str, target: ShapeTarget) -> None:
        ensure_table(self._connection(), target, self.on_dropped_column)

    def read_progress(self, group: str) -> dict[tuple[str, int], Progress]:
        with attributed(database=(TARGET, self.dsn)):
            return read_progress(self._connection(), group)

    def apply(self, group: str, batches: Sequence[ShapeBatch], *, on_offset_reset: str,
              hold: Callable[[str, str], None]) -> BatchResult:
        conn = self._connection()
        with conn.transaction():
            todo = []
            for b in batches:
                if b.follow:
                    try:
                        ensure_table(conn, b.target, self.on_dropped_column)  # a savepoint: rolled back alone
                    except ShapeCannotFollow as e:
                        hold(b.topic, str(e))
                        continue
                todo.append((b.target, b.parts))
            return apply_shapes(conn, group, todo, on_offset_reset=on_offset_reset)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
