"""Shapes on real parts: filters, column lists, move-in/move-out, TRUNCATE,
unchanged TOAST and tables without a primary key."""

from __future__ import annotations

import psycopg
import pytest

from tests.helpers import (
    ProducerThread,
    data_records,
    latest_rows,
    make_config,
    read_topic,
    wait_for,
    wait_snapshot_done,
)


def _source_rows(dsn, query):
    with psycopg.connect(dsn) as conn:
        return conn.execute(query).fetchall()


@pytest.mark.parametrize("identity", ["default", "full"])
def test_filtered_and_column_limited_shapes_track_the_source(source_db, kafka_broker, topic_prefix, identity):
    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (id int PRIMARY KEY, region text, total numeric(10,2), note text)")
        if identity == "full":
            conn.execute("ALTER TABLE orders REPLICA IDENTITY FULL")
        conn.execute("INSERT INTO orders SELECT g, CASE WHEN g % 3 = 0 THEN 'eu' ELSE 'us' END, g * 10, 'n'"
                     " FROM generate_series(1, 60) g")
    shapes = [{"table": "public.orders"},
              {"table": "public.orders", "name": "orders_eu", "where": "region = 'eu' AND total > 100",
               "columns": ["id", "total"]}]
    cfg = make_config(source_db, kafka_broker.bootstrap, topic_prefix, shapes)
    eu_topic = f"{topic_prefix}.orders_eu"
    with ProducerThread(cfg):
        wait_snapshot_done(kafka_broker.bootstrap, eu_topic, topic_prefix)
        with psycopg.connect(source_db, autocommit=True) as conn:
            conn.execute("UPDATE orders SET region = 'eu' WHERE id IN (20, 25)")  # move in
            conn.execute("UPDATE orders SET region = 'us' WHERE id IN (30, 33)")  # move out
            conn.execute("UPDATE orders SET total = total + 1 WHERE id = 36")  # stays in
            conn.execute("UPDATE orders SET total = 5 WHERE id = 39")  # moves out by total
            conn.execute("DELETE FROM orders WHERE id IN (42, 2)")
            conn.execute("INSERT INTO orders VALUES (100, 'eu', 500, 'n'), (101, 'us', 500, 'n')")
            conn.execute("UPDATE orders SET id = 1000 WHERE id = 45")  # key change, stays in
            conn.execute("INSERT INTO orders VALUES (102, 'eu', 1, 'marker')")
        wait_for(lambda: any(r.key["id"] == 102 for r in data_records(
            read_topic(kafka_broker.bootstrap, f"{topic_prefix}.public.orders", topic_prefix))), what="marker row")
    eu = read_topic(kafka_broker.bootstrap, eu_topic, topic_prefix)
    # numeric(10,2) could meet a NaN: the plain layout's side field is there, empty
    expected = {(r[0],): {"id": r[0], "total": r[1], "_wb_special": None} for r in _source_rows(
        source_db, "SELECT id, total FROM orders WHERE region = 'eu' AND total > 100")}
    got = {(k[0][1],): v for k, v in latest_rows(eu).items()}
    assert got == expected
    assert all(set(r.value["after"]) == {"id", "total", "_wb_special"} for r in data_records(eu) if r.value["after"])
    ops = {r.key["id"]: r.value["op"] for r in data_records(eu) if r.value["op"] != "r"}
    if identity == "full":
        assert ops[20] == ops[25] == "c" and ops[30] == ops[33] == ops[39] == "d" and ops[36] == "u"
        assert 101 not in ops  # never in the shape, never mentioned
    else:
        assert ops[20] == ops[25] == "u" and ops[30] == ops[33] == ops[39] == "d"
    full = read_topic(kafka_broker.bootstrap, f"{topic_prefix}.public.orders", topic_prefix)
    assert {k[0][1] for k in latest_rows(full)} == {r[0] for r in _source_rows(source_db, "SELECT id FROM orders")}
    # positions only grow within each partition
    for p in range(3):
        positions = [r.position for r in full if r.partition == p]
        assert positions == sorted(positions)


def test_truncate_reaches_every_partition(source_db, kafka_broker, topic_prefix):
    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        conn.execute("INSERT INTO t SELECT g, 'x' FROM generate_series(1, 30) g")
    cfg = make_config(source_db, kafka_broker.bootstrap, topic_prefix, [{"table": "public.t"}])
    topic = f"{topic_prefix}.public.t"
    with ProducerThread(cfg):
        wait_snapshot_done(kafka_broker.bootstrap, topic, topic_prefix)
        with psycopg.connect(source_db, autocommit=True) as conn:
            conn.execute("TRUNCATE t")
            conn.execute("INSERT INTO t VALUES (7, 'after')")
        wait_for(lambda: any(r.value and r.value["op"] == "c" for r in read_topic(
            kafka_broker.bootstrap, topic, topic_prefix)), what="insert after truncate")
    records = read_topic(kafka_broker.bootstrap, topic, topic_prefix)
    truncates = [r for r in data_records(records) if r.value["op"] == "t"]
    assert sorted(r.partition for r in truncates) == [0, 1, 2]
    assert len({r.position for r in truncates}) == 1
    lsn, op = truncates[0].position
    # Keyed, so a compacted topic accepts it: a ControlKey naming the truncate's position.
    assert all(r.key == {"event": "truncate", "id": f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}:{op}"} for r in truncates)
    assert latest_rows(records) == {(("id", 7),): {"id": 7, "v": "after"}}


def test_unchanged_toast_is_flagged_not_sent(source_db, kafka_broker, topic_prefix):
    big = "x" * 20000 + "y"  # compressible but TOASTed out of line
    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE docs (id int PRIMARY KEY, title text, body text)")
        conn.execute("ALTER TABLE docs ALTER COLUMN body SET STORAGE EXTERNAL")  # no compression: stays TOASTed
        conn.execute("INSERT INTO docs VALUES (1, 'a', %s)", (big,))
    cfg = make_config(source_db, kafka_broker.bootstrap, topic_prefix, [{"table": "public.docs"}])
    topic = f"{topic_prefix}.public.docs"
    with ProducerThread(cfg):
        wait_snapshot_done(kafka_broker.bootstrap, topic, topic_prefix)
        with psycopg.connect(source_db, autocommit=True) as conn:
            conn.execute("UPDATE docs SET title = 'b' WHERE id = 1")
            conn.execute("UPDATE docs SET body = 'short' WHERE id = 1")
        wait_for(lambda: len(data_records(read_topic(kafka_broker.bootstrap, topic, topic_prefix))) == 3,
                 what="3 changes")
    snap, upd_title, upd_body = data_records(read_topic(kafka_broker.bootstrap, topic, topic_prefix))
    assert snap.value["after"]["body"] == big
    assert upd_title.value["op"] == "u" and upd_title.value["unchanged_toast"] == ["body"]
    assert upd_title.value["after"] == {"id": 1, "title": "b", "body": None}
    assert upd_body.value["unchanged_toast"] == [] and upd_body.value["after"]["body"] == "short"


def test_keyless_table_with_replica_identity_full(source_db, kafka_broker, topic_prefix):
    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE events (at int, what text)")
        conn.execute("ALTER TABLE events REPLICA IDENTITY FULL")
        conn.execute("INSERT INTO events VALUES (1, 'a')")
    cfg = make_config(source_db, kafka_broker.bootstrap, topic_prefix, [{"table": "public.events"}])
    topic = f"{topic_prefix}.public.events"
    with ProducerThread(cfg):
        wait_snapshot_done(kafka_broker.bootstrap, topic, topic_prefix)
        with psycopg.connect(source_db, autocommit=True) as conn:
            conn.execute("INSERT INTO events VALUES (2, 'b')")
            conn.execute("UPDATE events SET what = 'c' WHERE at = 2")
            conn.execute("DELETE FROM events WHERE at = 1")
        wait_for(lambda: len(data_records(read_topic(kafka_broker.bootstrap, topic, topic_prefix))) == 4,
                 what="4 changes")
    recs = data_records(read_topic(kafka_broker.bootstrap, topic, topic_prefix))
    assert all(r.key is None for r in recs)
    by_op = sorted((r.value["op"], r.value["before"], r.value["after"]) for r in recs)
    assert by_op == [("c", None, {"at": 2, "what": "b"}), ("d", {"at": 1, "what": "a"}, None),
                     ("r", None, {"at": 1, "what": "a"}), ("u", {"at": 2, "what": "b"}, {"at": 2, "what": "c"})]


def test_keyless_default_identity_is_refused_or_inserts_only(source_db, kafka_broker, topic_prefix):
    from producer.catalog import SourceError
    from producer.pipeline import Pipeline
    from schemas.config import parse_config

    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE log (msg text)")
    cfg = make_config(source_db, kafka_broker.bootstrap, topic_prefix, [{"table": "public.log"}])
    pipeline = Pipeline(parse_config(cfg))
    with pytest.raises(SourceError, match="public.log have no primary key and REPLICA IDENTITY DEFAULT"):
        pipeline.prepare()
    pipeline.close()
    with psycopg.connect(source_db, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM pg_publication").fetchone()[0] == 0
        assert conn.execute("SELECT count(*) FROM pg_replication_slots WHERE database = current_database()"
                            ).fetchone()[0] == 0

    cfg["source"]["keyless_tables"] = "inserts_only"
    topic = f"{topic_prefix}.public.log"
    with ProducerThread(cfg):
        wait_snapshot_done(kafka_broker.bootstrap, topic, topic_prefix)
        with psycopg.connect(source_db, autocommit=True) as conn:
            conn.execute("INSERT INTO log VALUES ('one')")
            conn.execute("UPDATE log SET msg = 'two'")  # the application's own write still works
            conn.execute("DELETE FROM log")
            conn.execute("INSERT INTO log VALUES ('three')")
        wait_for(lambda: len(data_records(read_topic(kafka_broker.bootstrap, topic, topic_prefix))) == 2,
                 what="two inserts")
    assert sorted(r.value["after"]["msg"] for r in data_records(
        read_topic(kafka_broker.bootstrap, topic, topic_prefix))) == ["one", "three"]
