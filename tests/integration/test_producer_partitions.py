"""Partitioned and inheriting tables at the producer, on a real PostgreSQL and
broker: changes arriving under a partition's own name (WAL written while the
publication lacked ``publish_via_partition_root``) or an INHERITS child's reach
the shape above them, and set-ups that would lose changes are refused."""

from __future__ import annotations

import json
import uuid
from datetime import date

import psycopg
import pytest

from producer import catalog
from schemas import wire
from schemas.config import parse_config
from tests.helpers import (
    ProducerThread,
    data_records,
    latest_rows,
    make_config,
    raw_messages,
    read_topic,
    wait_for,
    wait_snapshot_done,
)

DDL = """
CREATE TABLE ev (id int, at date, note text, PRIMARY KEY (id, at)) PARTITION BY RANGE (at);
CREATE TABLE ev_1 PARTITION OF ev FOR VALUES FROM ('2024-01-01') TO ('2025-01-01');
CREATE TABLE ev_2 PARTITION OF ev FOR VALUES FROM ('2025-01-01') TO ('2026-01-01');
INSERT INTO ev SELECT i, date '2024-01-01' + i * 5, 'snap' FROM generate_series(1, 100) i;
CREATE TABLE animals (id int PRIMARY KEY, name text);
CREATE TABLE cats (whiskers int, PRIMARY KEY (id)) INHERITS (animals);
INSERT INTO animals VALUES (1, 'dog');
INSERT INTO cats VALUES (2, 'tom', 12);
"""


def _rows(dsn, query):
    with psycopg.connect(dsn) as conn:
        return conn.execute(query).fetchall()


def _current(bootstrap, topic, prefix, columns):
    return sorted(tuple(row[c] for c in columns) for row in latest_rows(read_topic(bootstrap, topic, prefix)).values())


def test_changes_under_a_partitions_or_childs_own_name_reach_the_shape_above(source_db, kafka_broker, topic_prefix):
    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute(DDL)
    cfg = make_config(source_db, kafka_broker.bootstrap, topic_prefix,
                      [{"table": "public.ev"}, {"table": "public.animals"}])
    ev_topic, animals_topic = f"{topic_prefix}.public.ev", f"{topic_prefix}.public.animals"
    with ProducerThread(cfg):
        wait_snapshot_done(kafka_broker.bootstrap, ev_topic, topic_prefix)
    with psycopg.connect(source_db, autocommit=True) as conn:
        # As a publication from before walbridge set the option: the WAL below
        # names the leaves, whatever the publication says when it is decoded.
        conn.execute(f"ALTER PUBLICATION {cfg['source']['publication']} SET (publish_via_partition_root = false)")
        conn.execute("INSERT INTO ev VALUES (505, '2024-02-02', 'leaf'), (501, '2025-02-02', 'leaf')")
        conn.execute("UPDATE ev_1 SET note = 'upd' WHERE id % 10 = 0")
        conn.execute("UPDATE ev SET at = at + 366 WHERE id = 3")  # moves ev_1 → ev_2
        conn.execute("DELETE FROM ev_2 WHERE id = 99")
        conn.execute("INSERT INTO cats VALUES (3, 'felix', 20)")
        conn.execute("UPDATE cats SET name = 'thomas' WHERE id = 2")
        conn.execute("TRUNCATE ev_2")  # one leaf alone: a backfill of the shape, not a shape-wide truncate
    with ProducerThread(cfg):
        with psycopg.connect(source_db, autocommit=True) as conn:
            conn.execute("INSERT INTO ev VALUES (600, '2024-03-03', 'root')")  # published through the root again
        wait_for(lambda: any(r.value["after"]["id"] == 600 for r in data_records(
            read_topic(kafka_broker.bootstrap, ev_topic, topic_prefix)) if r.value["after"]), what="the marker row")
        backfills = wire.backfills_topic(topic_prefix)
        wait_for(lambda: any(json.loads(m.value()).get("state") == "done"
                             for m in raw_messages(kafka_broker.bootstrap, backfills)), timeout=60,
                 what="the backfill the leaf's TRUNCATE asked for")
        with psycopg.connect(source_db) as conn:
            via_root = conn.execute("SELECT pubviaroot FROM pg_publication WHERE pubname = %s",
                                    (cfg["source"]["publication"],)).fetchone()[0]
    assert via_root is True  # the next start set it back
    reasons = {json.loads(m.value())["reason"] for m in raw_messages(kafka_broker.bootstrap, backfills)}
    assert reasons == {"truncate of public.ev_2"}
    records = read_topic(kafka_broker.bootstrap, ev_topic, topic_prefix)
    streamed = [r for r in data_records(records) if r.value["op"] in "cud"]
    assert {r.value["source"]["table"] for r in streamed} == {"ev"}
    assert not any(r.value["op"] == "t" for r in data_records(records))
    # Folded by position, the topic holds the table, plus the truncated leaf's
    # rows: the backfill's reads leave those out and the consumer drops them
    # at its backfill_end.
    source_now = set(_rows(source_db, "SELECT id, at, note FROM ev"))
    topic_now = {(row["id"], row["at"], row["note"]) for row in latest_rows(records).values()}
    assert source_now <= topic_now and (505, date(2024, 2, 2), "leaf") in source_now
    assert topic_now - source_now and all(at.year == 2025 for _, at, _ in topic_now - source_now)
    animals = read_topic(kafka_broker.bootstrap, animals_topic, topic_prefix)
    assert _current(kafka_broker.bootstrap, animals_topic, topic_prefix, ("id", "name")) == \
        _rows(source_db, "SELECT id, name FROM animals ORDER BY id")
    assert all(set(r.value["after"]) == {"id", "name"} and r.value["source"]["table"] == "animals"
               for r in data_records(animals) if r.value["after"])


def test_a_shape_on_a_partition_and_one_on_its_root_are_refused(source_db, kafka_broker, topic_prefix):
    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute(DDL)
    cfg = parse_config(make_config(source_db, kafka_broker.bootstrap, topic_prefix,
                                   [{"table": "public.ev"}, {"table": "public.ev_1"}]))
    with psycopg.connect(source_db) as conn, pytest.raises(catalog.SourceError) as refused:
        catalog.check_source(conn, cfg)
    assert "public.ev_1 is a partition of public.ev" in str(refused.value)


def test_another_roles_publication_without_publish_via_partition_root_is_refused(source_db):
    owner, user = f"wbpart_owner_{uuid.uuid4().hex[:6]}", f"wbpart_user_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute(DDL)
        conn.execute(f"CREATE ROLE {owner}; CREATE ROLE {user}")
        conn.execute(f"GRANT CREATE ON DATABASE {source_db.name} TO {owner}")
        conn.execute("CREATE PUBLICATION theirs FOR TABLE ev")
        conn.execute(f"ALTER PUBLICATION theirs OWNER TO {owner}")
    try:
        with psycopg.connect(source_db, autocommit=True) as conn:
            info = catalog.table_info(conn, "public", "ev")
            plan = catalog.plan_publication([info], "refuse")
            conn.execute(f"SET ROLE {user}")
            with pytest.raises(catalog.SourceError) as refused:
                catalog.ensure_publications(conn, "theirs", plan)
            conn.execute("RESET ROLE")
            conn.execute("ALTER PUBLICATION theirs SET (publish_via_partition_root = true)")
            conn.execute(f"SET ROLE {user}")
            assert catalog.ensure_publications(conn, "theirs", plan) == ["theirs"]  # serves the plan: used as is
    finally:
        with psycopg.connect(source_db, autocommit=True) as conn:
            conn.execute("DROP PUBLICATION theirs")
            conn.execute(f"REVOKE CREATE ON DATABASE {source_db.name} FROM {owner}")
            conn.execute(f"DROP ROLE {owner}; DROP ROLE {user}")
    message = str(refused.value)
    assert "publication theirs" in message and "public.ev" in message and "publish_via_partition_root" in message
    assert "ALTER PUBLICATION theirs SET" in message
