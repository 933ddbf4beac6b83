"""Schema changes at the producer, on a real PostgreSQL and broker (no Spark):
DDL runs while a load writes, and the topics, ``._schemas``, ``._backfills``,
``._status`` and the slot show what each change became. One producer serves
every table of a scenario."""

from __future__ import annotations

import json
import logging
import threading
import uuid
from decimal import Decimal

import psycopg
import pytest
from confluent_kafka.schema_registry.error import SchemaRegistryError

from producer import catalog, metrics
from producer.pgoutput import lsn_to_int
from schemas import wire
from schemas.reader import read_schemas_topic
from schemas.registry import data_subjects, registry_client, subject_versions
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
CREATE TABLE acct (id int PRIMARY KEY, a int NOT NULL DEFAULT 0, n numeric(10,2), v varchar(10), note text);
INSERT INTO acct SELECT i, i, i + 0.45, 'v' || i, 'note ' || i FROM generate_series(1, 200) i;
CREATE TABLE orders (id int PRIMARY KEY, region text, total int);
INSERT INTO orders SELECT i, CASE WHEN i % 2 = 0 THEN 'eu' ELSE 'us' END, i FROM generate_series(1, 100) i;
CREATE TABLE moved (id int PRIMARY KEY, x int);
CREATE TABLE dropme (id int PRIMARY KEY, x int);
INSERT INTO moved VALUES (1, 1);
INSERT INTO dropme VALUES (1, 1);
"""


class Load(threading.Thread):
    """pgbench-style writes while the DDL runs: updates and inserts on acct,
    inserts on orders (columns that every version of the table has)."""

    def __init__(self, dsn: str):
        super().__init__(daemon=True)
        self.dsn = dsn
        self.stop = threading.Event()
        self.next_id = 1000
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                while not self.stop.wait(0.01):
                    self.next_id += 1
                    conn.execute("UPDATE acct SET a = a + 1 WHERE id = %s", (self.next_id % 200 + 1,))
                    conn.execute("INSERT INTO acct (id, a) VALUES (%s, 1)", (self.next_id,))
                    conn.execute("INSERT INTO orders (id, total) VALUES (%s, %s)", (self.next_id, self.next_id % 97))
        except BaseException as e:  # surfaced by the test
            self.error = e

    def __enter__(self) -> Load:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.join(30)
        assert self.error is None, self.error


def _sql(dsn: str, statement: str, args=None) -> list:
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(statement, args)
        return cur.fetchall() if cur.description else []


def _confirmed(dsn: str, slot: str) -> int:
    return lsn_to_int(_sql(dsn, "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                           (slot,))[0][0])


def _status(bootstrap: str, prefix: str) -> dict:
    return json.loads(raw_messages(bootstrap, wire.status_topic(prefix))[-1].value())


def _backfills(bootstrap: str, prefix: str) -> dict[str, dict]:
    states = {}
    for m in raw_messages(bootstrap, wire.backfills_topic(prefix)):
        record = json.loads(m.value())
        states[record["request_id"]] = record
    return states


def _logged(caplog, text: str, timeout: float = 30.0) -> None:
    wait_for(lambda: text in caplog.text, timeout=timeout, what=repr(text))


def _ids(bootstrap: str, topic: str, prefix: str) -> set[int]:
    return {r.value["after"]["id"] for r in data_records(read_topic(bootstrap, topic, prefix)) if r.value["after"]}


def test_ddl_under_load_becomes_versions_aliases_backfills_and_stopped_shapes(source_db, kafka_broker,
                                                                             topic_prefix, caplog):
    caplog.set_level(logging.INFO, logger="walbridge")
    bootstrap = kafka_broker.bootstrap
    _sql(source_db, DDL)
    shapes = [{"table": "public.acct"}, {"table": "public.orders", "name": "orders_all"},
              {"table": "public.orders", "name": "orders_eu", "where": "region = 'eu'"},
              {"table": "public.moved"}, {"table": "public.dropme"}]
    cfg = make_config(source_db, bootstrap, topic_prefix, shapes)
    slot = cfg["source"]["slot"]
    acct = f"{topic_prefix}.public.acct"
    with ProducerThread(cfg) as producer, Load(source_db) as load:
        wait_snapshot_done(bootstrap, acct, topic_prefix)
        # Each change, then the producer's line for it: the catalog facts are read when its Relation arrives.
        for ddl, line in [
            ("ALTER TABLE acct ADD COLUMN c int", "column added c"),
            ("ALTER TABLE acct ADD COLUMN d int DEFAULT 7", "column added with a constant default d"),
            ("ALTER TABLE acct ADD COLUMN e timestamptz DEFAULT clock_timestamp()",
             "column added with a volatile default (table rewritten) e"),
            ("ALTER TABLE acct ALTER COLUMN a TYPE bigint", "column widened a (integer → bigint)"),
            ("ALTER TABLE acct ALTER COLUMN n TYPE numeric(10,0)",
             "column retyped n (numeric(10,2) → numeric(10,0))"),
            ("ALTER TABLE acct RENAME COLUMN note TO remark", "column renamed remark (note → remark)"),
        ]:
            _sql(source_db, ddl)
            _logged(caplog, f"schema change of public.acct, shape public.acct: {line}")

        # A shape whose where names a dropped column stops alone; the WAL is held for it.
        orders_all, orders_eu = f"{topic_prefix}.orders_all", f"{topic_prefix}.orders_eu"
        _sql(source_db, "ALTER TABLE orders DROP COLUMN region")
        _logged(caplog, "shape orders_eu: column region of public.orders was dropped, and the shape's where "
                        "names it; fix the shape in the config and restart. Shape orders_eu is stopped")
        stopped_at = load.next_id
        wait_for(lambda: any(i > stopped_at + 20 for i in _ids(bootstrap, orders_all, topic_prefix)),
                 what="orders_all flowing after orders_eu stopped")
        eu = wait_for(lambda: _status(bootstrap, topic_prefix)["stopped_shapes"].get("orders_eu"),
                      what="orders_eu stopped in the status")
        assert eu["wal_held"] and "column region" in eu["error"]
        held = lsn_to_int(eu["held_lsn"])
        assert _confirmed(source_db, slot) <= held < lsn_to_int(_sql(source_db, "SELECT pg_current_wal_lsn()::text")[0][0])
        assert metrics.STOPPED_SHAPES._value.get() >= 1

        # RENAME TABLE (at its next change) and DROP TABLE (no WAL at all) stop their shapes too.
        _sql(source_db, "ALTER TABLE moved RENAME TO moved2; INSERT INTO moved2 VALUES (2, 2)")
        _sql(source_db, "DROP TABLE dropme")
        _logged(caplog, "shape public.moved: table public.moved was renamed to public.moved2")
        _logged(caplog, "shape public.dropme: table public.dropme was dropped")
        requests = wait_for(lambda: (lambda s: s if sum(r["state"] == "done" for r in s.values()) >= 3 else None)(
            _backfills(bootstrap, topic_prefix)), timeout=90, what="three backfills of public.acct done")
        _sql(source_db, "TRUNCATE acct")
        wait_for(lambda: _status(bootstrap, topic_prefix)["events"].get("public.acct", {}).get("t"),
                 what="the truncate produced")
        # The load stops first: the topic is compared with the source below, once
        # the producer (stopped with this block) has published every row of it.
        load.stop.set()
        load.join(30)
        _sql(source_db, "INSERT INTO acct (id, a) VALUES (-1, -1)")
        source_ids = {r[0] for r in _sql(source_db, "SELECT id FROM acct")}
        wait_for(lambda: source_ids <= _ids(bootstrap, acct, topic_prefix), what="every source row, the marker last")
        assert producer.thread.is_alive()
    # What was asked for: a re-read of public.acct for each change whose rows changed without WAL, and one of
    # each stopped shape for after the fix (not run while it is stopped).
    by_shape: dict[str, list[dict]] = {}
    for r in requests.values():
        by_shape.setdefault(r["shape"], []).append(r)
    assert sorted(r["state"] for r in by_shape["public.acct"]) == ["done"] * 3
    reasons = " | ".join(r["reason"] for r in by_shape["public.acct"])
    assert "constant default d" in reasons and "volatile default" in reasons and "column retyped n" in reasons
    assert "column added c" not in reasons and "widened" not in reasons and "renamed" not in reasons
    assert {s: [r["state"] for r in rs] for s, rs in by_shape.items() if s != "public.acct"} == {
        "orders_eu": ["requested"], "public.moved": ["requested"], "public.dropme": ["requested"]}
    assert "orders_all" not in by_shape

    # Every writer schema is in ._schemas: the first and one per change (the rename's with its alias).
    versions = [s for subject, _, s in read_schemas_topic({"bootstrap.servers": bootstrap},
                                                          wire.schemas_topic(topic_prefix))
                if subject == f"{acct}-value"]
    row_fields = [[f["name"] for f in v["fields"][0]["type"][1]["fields"] if not f["name"].startswith("_wb_")]
                  for v in versions]
    assert row_fields[0] == ["id", "a", "n", "v", "note"]
    assert ["id", "a", "n", "v", "note", "c"] in row_fields and len(versions) >= 7
    last = versions[-1]["fields"][0]["type"][1]["fields"]
    assert [f["name"] for f in last if not f["name"].startswith("_wb_")] == ["id", "a", "n", "v", "remark", "c",
                                                                               "d", "e"]
    assert next(f for f in last if f["name"] == "remark")["aliases"] == ["note"]

    # Folded by position, the topic is the table on its current columns.
    records = read_topic(bootstrap, acct, topic_prefix)
    assert any(r.value["op"] == "t" for r in data_records(records))
    # (A backfill that started before the rename wrote its rows with the schema of then: "note".)
    topic_rows = sorted((r["id"], r["a"], r["n"], r.get("remark", r.get("note")), r["d"], r["e"])
                        for r in latest_rows(records, lambda r: (r.value["after"] or r.value["before"])["id"]).values())
    source_rows = sorted(_sql(source_db, "SELECT id, a, n, remark, d, e FROM acct"))
    assert topic_rows == source_rows and all(isinstance(r[2], Decimal) or r[2] is None for r in topic_rows)

    # The operator fixes the config: orders_eu resumes from its first unpublished change and is re-read;
    # public.moved follows the renamed table under its old name (its topic); dropme is gone.
    fixed = [{"table": "public.acct"}, {"table": "public.orders", "name": "orders_all"},
             {"table": "public.orders", "name": "orders_eu", "where": "total > 50"},
             {"table": "public.moved2", "name": "public.moved"}]
    cfg = make_config(source_db, bootstrap, topic_prefix, fixed)
    with ProducerThread(cfg):
        wait_for(lambda: {r["shape"] for r in _backfills(bootstrap, topic_prefix).values()
                          if r["state"] == "done"} >= {"orders_eu", "public.moved"}, timeout=90,
                 what="the stopped shapes re-read")
        wait_for(lambda: _confirmed(source_db, slot) > held, what="the slot confirmed past the hold")
    eu_records = data_records(read_topic(bootstrap, orders_eu, topic_prefix))
    streamed = {r.value["after"]["id"] for r in eu_records if r.value["op"] == "c"}
    assert {i for (i,) in _sql(source_db, "SELECT id FROM orders WHERE id > %s AND total > 50",
                               (stopped_at + 20,))} <= streamed
    reread = {r.value["after"]["id"] for r in eu_records if wire.BACKFILL_HEADER in r.headers}
    assert reread == {i for (i,) in _sql(source_db, "SELECT id FROM orders WHERE total > 50")}
    assert 2 in _ids(bootstrap, f"{topic_prefix}.public.moved", topic_prefix)
    states = {r["shape"]: r["state"] for r in _backfills(bootstrap, topic_prefix).values()
              if r["shape"] == "public.dropme"}
    assert states == {"public.dropme": "failed"}


def test_ddl_before_a_tables_first_change_is_compared_with_the_snapshot(source_db, kafka_broker, topic_prefix,
                                                                         caplog):
    """Tables nobody writes between the snapshot and the DDL: their first
    Relation in the stream already has the new columns (issue 12: the default
    was never re-read, the rename looked like drop + add)."""
    caplog.set_level(logging.INFO, logger="walbridge")
    bootstrap = kafka_broker.bootstrap
    _sql(source_db, "CREATE TABLE q_default (id int PRIMARY KEY, a int); CREATE TABLE q_rename (id int PRIMARY KEY, "
                    "note text); INSERT INTO q_default SELECT i, i FROM generate_series(1, 50) i; "
                    "INSERT INTO q_rename SELECT i, 'n' || i FROM generate_series(1, 50) i")
    cfg = make_config(source_db, bootstrap, topic_prefix, [{"table": "public.q_default"}, {"table": "public.q_rename"}])
    q_default = f"{topic_prefix}.public.q_default"
    with ProducerThread(cfg) as producer:
        wait_snapshot_done(bootstrap, q_default, topic_prefix)
        _sql(source_db, "ALTER TABLE q_default ADD COLUMN d int DEFAULT 7; ALTER TABLE q_rename RENAME COLUMN note "
                        "TO remark; INSERT INTO q_default VALUES (51, 51); INSERT INTO q_rename VALUES (51, 'x')")
        _logged(caplog, "schema change of public.q_default, shape public.q_default: column added with a constant "
                        "default d (integer)")
        _logged(caplog, "schema change of public.q_rename, shape public.q_rename: column renamed remark (note → remark)")
        wait_for(lambda: [r["state"] for r in _backfills(bootstrap, topic_prefix).values()] == ["done"], timeout=60,
                 what="the backfill of public.q_default done")
        assert producer.thread.is_alive()
    rows = latest_rows(read_topic(bootstrap, q_default, topic_prefix), lambda r: r.value["after"]["id"])
    assert sorted((r["id"], r.get("d")) for r in rows.values()) == [(i, 7) for i in range(1, 52)]
    assert "column dropped" not in caplog.text


def test_a_decoded_transaction_is_awaited_until_the_catalog_sees_it(source_db):
    """The stream decodes a transaction once its commit record is flushed, a
    moment before other sessions see it; the catalog is read for its Relation
    message only once they do (the race that made a column added with a
    constant default look changed again since)."""
    with psycopg.connect(source_db) as writer, psycopg.connect(source_db, autocommit=True) as reader:
        writer.execute("CREATE TABLE visible_probe (id int PRIMARY KEY)")
        xid = writer.execute("SELECT pg_current_xact_id()::text::bigint & 4294967295").fetchone()[0]
        assert not catalog.await_visible(reader, xid, timeout=0.2)
        writer.commit()
        assert catalog.await_visible(reader, xid, timeout=0.2)
        older = reader.execute("SELECT xmin::text::bigint FROM pg_class WHERE relname = 'pg_class'").fetchone()[0]
        assert catalog.await_visible(reader, older, timeout=0.2)


def test_ddl_while_the_producer_was_stopped_is_compared_with_what_it_published(source_db, kafka_broker,
                                                                                topic_prefix, caplog):
    """A producer restarted on its slot compares each table's first Relation
    with its shapes' last published writer schemas (their fields carry the
    catalog's attnum, type oid and typmod): DDL made while it was stopped is
    followed like DDL in the stream (issue 12)."""
    caplog.set_level(logging.INFO, logger="walbridge")
    bootstrap = kafka_broker.bootstrap
    _sql(source_db, "CREATE TABLE s_default (id int PRIMARY KEY, a int); CREATE TABLE s_rename (id int PRIMARY KEY, "
                    "note text); CREATE TABLE s_narrow (id int PRIMARY KEY, n numeric(10,2)); "
                    "CREATE TABLE s_where (id int PRIMARY KEY, x int); "
                    "INSERT INTO s_default SELECT i, i FROM generate_series(1, 50) i; "
                    "INSERT INTO s_rename SELECT i, 'n' || i FROM generate_series(1, 50) i; "
                    "INSERT INTO s_narrow SELECT i, i + 0.5 FROM generate_series(1, 50) i; "
                    "INSERT INTO s_where SELECT i, i FROM generate_series(1, 50) i")
    cfg = make_config(source_db, bootstrap, topic_prefix,
                      [{"table": "public.s_default"}, {"table": "public.s_rename"}, {"table": "public.s_narrow"},
                       {"table": "public.s_where", "name": "ids_only", "columns": ["id"]},
                       {"table": "public.s_where", "name": "x_ids", "columns": ["id"], "where": "x > 10"}])
    topic = {t: f"{topic_prefix}.public.{t}" for t in ("s_default", "s_rename", "s_narrow")}
    with ProducerThread(cfg):
        for t in topic.values():
            wait_snapshot_done(bootstrap, t, topic_prefix)
    _sql(source_db, "ALTER TABLE s_default ADD COLUMN d int DEFAULT 7; ALTER TABLE s_rename RENAME COLUMN note TO "
                    "remark; ALTER TABLE s_narrow ALTER COLUMN n TYPE numeric(10,0); "
                    "INSERT INTO s_default VALUES (51, 51); "
                    "INSERT INTO s_rename VALUES (51, 'x'); INSERT INTO s_narrow VALUES (51, 51); "
                    "INSERT INTO s_where VALUES (51, 51)")
    with ProducerThread(cfg) as producer:
        for table, shape, line in [
            ("s_default", "public.s_default", "column added with a constant default d (integer)"),
            ("s_rename", "public.s_rename", "column renamed remark (note → remark)"),
            ("s_narrow", "public.s_narrow", "column retyped n (numeric(10,2) → numeric(10,0))"),
        ]:
            _logged(caplog, f"schema change of public.{table}, shape {shape}: {line}")
        # x_ids filters on x without carrying it: x was never published, so x_ids is re-read.
        _logged(caplog, "schema change of public.s_where, shape x_ids: column filtered on but never published "
                        "(unknown while stopped) x")
        requests = wait_for(lambda: (lambda s: s if sum(r["state"] == "done" for r in s.values()) == 3 else None)(
            _backfills(bootstrap, topic_prefix)), timeout=90, what="three backfills done")
        wait_for(lambda: 51 in _ids(bootstrap, f"{topic_prefix}.ids_only", topic_prefix), what="ids_only streaming")
        assert producer.thread.is_alive()
    assert sorted((r["shape"], r["state"]) for r in requests.values()) == [
        ("public.s_default", "done"), ("public.s_narrow", "done"), ("x_ids", "done")]
    assert "shape public.s_rename: column dropped" not in caplog.text
    reread = {r.value["after"]["id"] for r in data_records(read_topic(bootstrap, f"{topic_prefix}.x_ids", topic_prefix))
              if wire.BACKFILL_HEADER in r.headers}
    assert reread == set(range(11, 52))
    rows = latest_rows(read_topic(bootstrap, topic["s_default"], topic_prefix), lambda r: r.value["after"]["id"])
    assert sorted((r["id"], r.get("d")) for r in rows.values()) == [(i, 7) for i in range(1, 52)]
    rows = latest_rows(read_topic(bootstrap, topic["s_narrow"], topic_prefix), lambda r: r.value["after"]["id"])
    assert sorted((r["id"], r["n"]) for r in rows.values()) == sorted(_sql(source_db, "SELECT id, n FROM s_narrow"))
    versions = [s for subject, _, s in read_schemas_topic({"bootstrap.servers": bootstrap},
                                                          wire.schemas_topic(topic_prefix))
                if subject == f"{topic['s_rename']}-value"]
    remark = next(f for f in versions[-1]["fields"][0]["type"][1]["fields"] if f["name"] == "remark")
    assert remark["aliases"] == ["note"] and remark[wire.ATTNUM_PROP] == 2


def test_a_schema_the_registry_refuses_stops_that_shape_only(source_db, kafka_broker, topic_prefix, caplog,
                                                              monkeypatch):
    caplog.set_level(logging.INFO, logger="walbridge")
    bootstrap = kafka_broker.bootstrap
    url = f"mock://ddl-{uuid.uuid4().hex[:8]}"
    _sql(source_db, "CREATE TABLE r1 (id int PRIMARY KEY, x int); CREATE TABLE r2 (id int PRIMARY KEY, x int)")
    cfg = make_config(source_db, bootstrap, topic_prefix, [{"table": "public.r1"}, {"table": "public.r2"}],
                      ack={"on_stall": "drop", "stall_timeout": 8})
    cfg["kafka"]["schema_registry_url"] = url
    client = registry_client(url)
    register = client.register_schema

    def compatibility_check(subject, schema, *args, **kwargs):
        # mock:// checks no compatibility: refuse, as a BACKWARD registry would a retype, the one with "bad".
        if '"name":"bad"' in schema.schema_str:
            raise SchemaRegistryError(409, 409, "Schema being registered is incompatible with an earlier schema")
        return register(subject, schema, *args, **kwargs)

    monkeypatch.setattr(client, "register_schema", compatibility_check)
    r1, r2 = f"{topic_prefix}.public.r1", f"{topic_prefix}.public.r2"
    with ProducerThread(cfg):
        wait_snapshot_done(bootstrap, r1, topic_prefix, registry_url=url)
        _sql(source_db, "INSERT INTO r1 VALUES (1, 1); INSERT INTO r2 VALUES (1, 1)")
        _sql(source_db, "ALTER TABLE r1 ADD COLUMN bad int; ALTER TABLE r2 ADD COLUMN fine int")
        _sql(source_db, "INSERT INTO r1 VALUES (2, 2, 2); INSERT INTO r2 VALUES (2, 2, 2)")
        _logged(caplog, f"shape public.r1: registry {url}: refused the schema of subject '{r1}-value' (HTTP 409")
        stop = wait_for(lambda: _status(bootstrap, topic_prefix)["stopped_shapes"].get("public.r1"),
                        what="public.r1 stopped in the status")
        held = lsn_to_int(stop["held_lsn"])
        assert stop["wal_held"] and _confirmed(source_db, cfg["source"]["slot"]) <= held
        _sql(source_db, "INSERT INTO r2 VALUES (3, 3, 3)")
        wait_for(lambda: 3 in {r.value["after"]["id"] for r in data_records(read_topic(
            bootstrap, r2, topic_prefix, url)) if r.value["after"]}, what="r2 flowing")
        # [ack] on_stall = "drop": after stall_timeout the hold is let go, loudly.
        _logged(caplog, "no longer holding WAL for the stopped shape public.r1")
        wait_for(lambda: _confirmed(source_db, cfg["source"]["slot"]) > held, what="the slot released")
    assert [1, 2] == [v for v, _, _ in subject_versions(url, data_subjects("topic", r2)[0])]
    assert [1] == [v for v, _, _ in subject_versions(url, data_subjects("topic", r1)[0])]
    r1_rows = [r.value["after"] for r in data_records(read_topic(bootstrap, r1, topic_prefix, url))]
    assert [row["id"] for row in r1_rows] == [1] and "bad" not in r1_rows[0]  # nothing consumers can't decode
    r2_rows = {r.value["after"]["id"]: r.value["after"] for r in data_records(read_topic(bootstrap, r2, topic_prefix,
                                                                                           url))}
    assert r2_rows[2]["fine"] == 2 and r2_rows[3]["fine"] == 3


@pytest.fixture(autouse=True)
def _no_stopped_shapes_leak():
    yield
    metrics.STOPPED_SHAPES.set(0)
