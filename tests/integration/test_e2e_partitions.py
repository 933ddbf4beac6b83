"""Partitioned tables end to end on real parts (PostgreSQL → producer → Apache Kafka →
Spark consumer → target PostgreSQL): a shape on a RANGE-partitioned root
follows every leaf — changes in the leaves, a row moving between partitions,
a partition created and one attached while streaming, rows a table held before
it was attached — and a shape on a single leaf works alongside. A detached partition's rows stay in the target until a
backfill is asked for, as the README says."""

from __future__ import annotations

import psycopg

from producer.backfill_requests import request_backfill
from schemas.config import parse_config
from spark_consumer.progress import read_backfills
from tests.helpers import ConsumerThread, ProducerThread, make_config, wait_for
from tests.pipeline import caught_up

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


def _rows(dsn: str, table: str, columns: str, key: str) -> list[tuple] | None:
    with psycopg.connect(dsn) as conn:
        try:
            return conn.execute(f"SELECT {columns} FROM {table} ORDER BY {key}").fetchall()
        except psycopg.errors.UndefinedTable:
            return None  # the consumer has not created it yet


def _equal(source_db, target_db) -> bool:
    return (_rows(source_db, "readings", COLUMNS, "id, at") == _rows(target_db, "public.readings", COLUMNS, "id, at")
            and _rows(source_db, "logs_a", "id, part, msg", "id")
            == _rows(target_db, "public.logs_a", "id, part, msg", "id"))


def _wait_equal(source_db, target_db, consumer, what):
    ok = wait_for(lambda: consumer.errors or _equal(source_db, target_db), timeout=180, interval=1, what=what)
    assert ok is True, [repr(e) for e in consumer.errors]


def test_partitioned_root_follows_every_leaf_created_attached_and_moved(source_db, target_db, kafka_broker,
                                                                        topic_prefix, tmp_path):
    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute(SOURCE_DDL)
    group = f"{topic_prefix}-spark"
    cfg = make_config(source_db, kafka_broker.bootstrap, topic_prefix, SHAPES,
                      consumer={"group": group, "target_dsn": str(target_db),
                                "checkpoint_dir": str(tmp_path / "checkpoints"), "trigger_interval": 0.5},
                      ack={"consumer_groups": [group], "interval": 0.5})
    with ProducerThread(cfg), ConsumerThread(cfg) as consumer:
        _wait_equal(source_db, target_db, consumer, "the snapshot applied")
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
        _wait_equal(source_db, target_db, consumer, "every leaf change applied")
        wait_for(lambda: caught_up(cfg), timeout=60, what="the slot confirmed past the last change")
        with psycopg.connect(target_db) as conn:
            in_new = conn.execute("SELECT count(*) FROM public.readings WHERE at >= '2026-01-01' "
                                  "AND at < '2028-01-01'").fetchone()[0]
        assert in_new == 50 + 40 - 1  # created partition's and attached partition's rows, less one delete

        # DETACH: the partition's rows leave the root without a change; the
        # target keeps them (and misses later changes of the detached table)
        # until a backfill of the shape re-reads the root.
        with psycopg.connect(source_db, autocommit=True) as conn:
            detached = conn.execute("SELECT count(*) FROM readings_2026").fetchone()[0]
            conn.execute("ALTER TABLE readings DETACH PARTITION readings_2026")
            conn.execute("INSERT INTO readings_2026 VALUES (9001, '2026-05-05', 'after detach', 1)")
            conn.execute("INSERT INTO readings VALUES (9002, '2025-05-05', 'marker', 2)")
        wait_for(lambda: _rows(target_db, "public.readings", "id", "id")[-1] == (9002,), timeout=60,
                 what="the marker row applied")
        with psycopg.connect(target_db) as conn:
            kept = conn.execute("SELECT count(*) FROM public.readings WHERE at >= '2026-01-01' "
                                "AND at < '2027-01-01'").fetchone()[0]
            after = conn.execute("SELECT count(*) FROM public.readings WHERE id = 9001").fetchone()[0]
        assert (kept, after) == (detached, 0)
        request_backfill(parse_config(cfg), "public.readings", reason="test: partition detached")
        _wait_equal(source_db, target_db, consumer, "the backfill dropped the detached rows")
        wait_for(lambda: caught_up(cfg), timeout=60, what="the slot confirmed past the last change")
    assert not consumer.errors
    with psycopg.connect(target_db) as conn:
        # One for the table attached with rows (asked for by the producer), one for the detach.
        assert [b["shape"] for b in read_backfills(conn, group) if b["completed_at"]] == ["public.readings"] * 2
