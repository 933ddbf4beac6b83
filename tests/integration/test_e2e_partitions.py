"""Partitioned tables end to end on real parts (PostgreSQL → producer → Apache Kafka →
Spark consumer → each target: PostgreSQL, Delta Lake, Apache Iceberg): a shape on a
RANGE-partitioned root follows every leaf — changes in the leaves, a row moving
between partitions, a partition created and one attached while streaming, rows a
table held before it was attached — and a shape on a single leaf works alongside.
A detached partition's rows stay in the target until a backfill is asked for, as
the README says. The lakehouse tables are read back with delta-rs and pyiceberg,
not with the Spark that wrote them."""

from __future__ import annotations

import datetime

import psycopg
import pytest

from producer.backfill_requests import request_backfill
from schemas.config import parse_config
from spark_consumer.progress import read_backfills
from tests.helpers import ConsumerThread, ProducerThread, make_config, wait_for
from tests.pipeline import caught_up, target_settings
from walbridge.verify_lake import lake_reader

COLUMNS = "id, at, sensor, value"
SHAPES = [{"table": "public.readings"}, {"table": "public.logs_a"}]

SOURCE_DDL = """
CREATE TABLE readings (id int, at date, sensor text, value numeric(10,2), PRIMARY KEY (id, at))
    PARTITION BY RANGE (at);
CREATE TABLE readings_2024 PARTITION OF readings FOR VALUES FROM ('2024-01-01') TO ('2025-01-01');
CREATE TABLE readings_2025 PARTITION OF readings FOR VALUES FROM ('2025-01-01') TO ('2026-01-01');
INSERT INTO readings SELECT i, date '2024-01-01' + (i % 700), 's' || (i % 7), i / 4.0 FROM generate_series(1, 1000) i;
CREATE TABLE logs (id int, part text, msg text, PRIMARY KEY (id, part)) PARTITION BY LIST (part);
CREATE TABLE logs_a PARTITION OF logs FOR VALUES IN ('a');
CREATE TABLE logs_b PARTITION OF logs FOR VALUES IN ('b');
INSERT INTO logs SELECT i, CASE WHEN i % 2 = 0 THEN 'a' ELSE 'b' END, 'm' || i FROM generate_series(1, 100) i;
"""

WHILE_STREAMING = [
    # Leaf changes, written through the root and through the leaves themselves.
    "INSERT INTO readings SELECT i, date '2024-03-01' + (i % 600), 'new', i FROM generate_series(1001, 1200) i",
    "UPDATE readings_2024 SET value = value + 1000 WHERE id % 10 = 0",
    "UPDATE readings SET sensor = 'moved' WHERE at >= '2025-01-01' AND id % 9 = 0",
    "DELETE FROM readings_2025 WHERE id % 13 = 0",
    # A partition created while streaming, with rows and changes.
    "CREATE TABLE readings_2026 PARTITION OF readings FOR VALUES FROM ('2026-01-01') TO ('2027-01-01')",
    "INSERT INTO readings SELECT i, date '2026-01-01' + (i % 300), 'y26', i FROM generate_series(2001, 2050) i",
    "UPDATE readings_2026 SET value = -value WHERE id % 2 = 0",
    # A table attached while streaming (its columns in another order), then filled.
    "CREATE TABLE readings_2027 (value numeric(10,2), sensor text, at date NOT NULL, id int NOT NULL)",
    "ALTER TABLE readings ATTACH PARTITION readings_2027 FOR VALUES FROM ('2027-01-01') TO ('2028-01-01')",
    "INSERT INTO readings SELECT i, date '2027-01-01' + (i % 300), 'y27', i FROM generate_series(3001, 3040) i",
    "UPDATE readings SET at = date '2027-12-31' WHERE id = 2001",  # from the created into the attached one
    "DELETE FROM readings_2027 WHERE id = 3002",
    # A table that already holds rows, attached: they are no change in the WAL (a backfill brings them).
    "CREATE TABLE readings_2028 (LIKE readings)",
    "INSERT INTO readings_2028 SELECT i, date '2028-01-01' + (i % 300), 'held', i FROM generate_series(4001, 4030) i",
    "ALTER TABLE readings ATTACH PARTITION readings_2028 FOR VALUES FROM ('2028-01-01') TO ('2029-01-01')",
    "UPDATE readings SET value = 0 WHERE id = 4001",
    # The single-leaf shape, and its sibling that no shape names.
    "INSERT INTO logs SELECT i, 'a', 'late' FROM generate_series(101, 120) i",
    "UPDATE logs SET msg = 'edited' WHERE id % 4 = 0",
    "UPDATE logs SET part = 'b' WHERE id = 2",  # leaves the shape's leaf: a delete for it
    "DELETE FROM logs_a WHERE id = 4",
    "INSERT INTO logs SELECT i, 'b', 'other' FROM generate_series(121, 130) i",
]


def _source_rows(dsn: str, table: str, columns: str, key: str) -> list[tuple]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(f"SELECT {columns} FROM {table} ORDER BY {key}").fetchall()


class Target:
    """One target's config and its rows of a shape, read by an independent reader."""

    def __init__(self, kind: str, target_db, tmp_path):
        self.kind = kind
        self.consumer = target_settings(kind, target_db, tmp_path)
        self.target_db = target_db
        self.config = None

    def rows(self, shape: str, columns: str, key: str) -> list[tuple] | None:
        """The shape's rows sorted by ``key``; None while it has no table."""
        if self.kind == "postgresql":
            try:
                return _source_rows(self.target_db, shape, columns, key)
            except psycopg.errors.UndefinedTable:
                return None  # the consumer has not created it yet
        names = [c.strip() for c in columns.split(",")]
        at = [names.index(c.strip()) for c in key.split(",")]
        spec = next(s for s in self.config.shapes if s.shape_name == shape)
        try:
            table = lake_reader(self.config).read(spec, names)
        except Exception:  # noqa: BLE001 - MissingTable, or a table being committed while read: look again
            return None
        rows = [tuple(r[c] for c in names) for r in table.to_pylist()]
        return sorted(rows, key=lambda r: tuple(r[i] for i in at))

    def equal(self, source_db) -> bool:
        return all(_source_rows(source_db, table, columns, key) == self.rows(shape, columns, key)
                   for shape, table, columns, key in (("public.readings", "readings", COLUMNS, "id, at"),
                                                      ("public.logs_a", "logs_a", "id, part, msg", "id")))


def _wait_equal(source_db, target: Target, consumer, what):
    ok = wait_for(lambda: consumer.errors or target.equal(source_db), timeout=180, interval=1, what=what)
    assert ok is True, [repr(e) for e in consumer.errors]


@pytest.mark.parametrize("kind", ["postgresql", "delta", "iceberg"])
def test_partitioned_root_follows_every_leaf_created_attached_and_moved(kind, source_db, target_db, kafka_broker,
                                                                        topic_prefix, tmp_path):
    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute(SOURCE_DDL)
    group = f"{topic_prefix}-spark"
    target = Target(kind, target_db, tmp_path)
    cfg = make_config(source_db, kafka_broker.bootstrap, topic_prefix, SHAPES,
                      consumer={"group": group, "checkpoint_dir": str(tmp_path / "checkpoints"),
                                "trigger_interval": 0.5, **target.consumer},
                      ack={"consumer_groups": [group], "interval": 0.5})
    target.config = parse_config(cfg)
    with ProducerThread(cfg), ConsumerThread(cfg) as consumer:
        _wait_equal(source_db, target, consumer, "the snapshot applied")
        with psycopg.connect(source_db, autocommit=True) as conn:
            via_root = conn.execute("SELECT pubviaroot FROM pg_publication WHERE pubname = %s",
                                    (cfg["source"]["publication"],)).fetchone()[0]
            # Rows moving between partitions (the partition key is in the key: a new key).
            moved = conn.execute("UPDATE readings SET at = at + 400 WHERE at < '2024-06-01' AND id % 5 = 1 "
                                 "RETURNING tableoid::regclass::text").fetchall()
            for statement in WHILE_STREAMING:
                conn.execute(statement)
        assert via_root is True
        assert moved and {leaf for (leaf,) in moved} == {"readings_2025"}
        _wait_equal(source_db, target, consumer, "every leaf change applied")
        wait_for(lambda: caught_up(cfg), timeout=60, what="the slot confirmed past the last change")

        def dated(start: str, end: str) -> list[tuple]:
            return [r for r in target.rows("public.readings", COLUMNS, "id, at")
                    if datetime.date.fromisoformat(start) <= r[1] < datetime.date.fromisoformat(end)]

        assert len(dated("2026-01-01", "2028-01-01")) == 50 + 40 - 1  # created and attached ones' rows, less a delete

        # DETACH: the partition's rows leave the root without a change; the
        # target keeps them (and misses later changes of the detached table)
        # until a backfill of the shape re-reads the root.
        with psycopg.connect(source_db, autocommit=True) as conn:
            detached = conn.execute("SELECT count(*) FROM readings_2026").fetchone()[0]
            conn.execute("ALTER TABLE readings DETACH PARTITION readings_2026")
            conn.execute("INSERT INTO readings_2026 VALUES (9001, '2026-05-05', 'after detach', 1)")
            conn.execute("INSERT INTO readings VALUES (9002, '2025-05-05', 'marker', 2)")
        wait_for(lambda: (target.rows("public.readings", "id", "id") or [None])[-1] == (9002,), timeout=60,
                 what="the marker row applied")
        assert len(dated("2026-01-01", "2027-01-01")) == detached
        assert (9001,) not in target.rows("public.readings", "id", "id")
        request_backfill(parse_config(cfg), "public.readings", reason="test: partition detached")
        _wait_equal(source_db, target, consumer, "the backfill dropped the detached rows")
        wait_for(lambda: caught_up(cfg), timeout=60, what="the slot confirmed past the last change")
    assert not consumer.errors
    # One backfill for the table attached with rows (asked for by the producer), one for the detach.
    if kind == "postgresql":
        with psycopg.connect(target_db) as conn:
            assert [b["shape"] for b in read_backfills(conn, group) if b["completed_at"]] == ["public.readings"] * 2
    else:
        spec = next(s for s in target.config.shapes if s.shape_name == "public.readings")
        record = lake_reader(target.config).newest_record(spec, group)
        assert sum(map(record.complete, record.backfills)) == 2, record.backfills
