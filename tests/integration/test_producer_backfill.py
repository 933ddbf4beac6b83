"""Backfills on real parts (PostgreSQL + Apache Kafka), producer side: a shape re-read
while changes stream, a bucket-scoped backfill, a shape added to a running
deployment, and a producer killed mid-backfill."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import psycopg
from confluent_kafka import Consumer, TopicPartition

from producer.backfill_requests import read_states, request_backfill
from producer.kafka_io import read_tails
from schemas import buckets, wire
from schemas.config import parse_config
from tests.helpers import (
    ProducerProcess,
    ProducerThread,
    data_records,
    latest_rows,
    make_config,
    read_topic,
    wait_for,
    write_toml,
)
from walbridge.render import render_status
from walbridge.status import collect_status


def _state(bootstrap: str, prefix: str, request_id: str) -> dict | None:
    states, _ = read_states({"bootstrap.servers": bootstrap}, wire.backfills_topic(prefix))
    return states.get(request_id)


def _wait_done(bootstrap: str, prefix: str, request_id: str, timeout: float = 180) -> dict:
    return wait_for(lambda: (s := _state(bootstrap, prefix, request_id)) and s["state"] == "done" and s,
                    timeout=timeout, interval=0.5, what=f"backfill {request_id} done")


def _source_rows(dsn: str, query: str = "SELECT id, v FROM items") -> dict:
    with psycopg.connect(dsn) as conn:
        return {r[0]: r for r in conn.execute(query)}


def _writer(dsn: str, stop: threading.Event, counter: list) -> None:
    """Updates, inserts and deletes of random keys until stopped."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        i = 0
        while not stop.is_set():
            i += 1
            conn.execute("UPDATE items SET v = v + 1 WHERE id = (random() * 20000)::int")
            conn.execute("INSERT INTO items VALUES (100000 + %s, 1)", (i,))
            conn.execute("DELETE FROM items WHERE id = (random() * 20000)::int")
            counter[0] = i
            time.sleep(0.002)


def test_backfill_while_streaming_converges(source_db, kafka_broker, topic_prefix):
    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE items (id int PRIMARY KEY, v int)")
        conn.execute("INSERT INTO items SELECT g, 0 FROM generate_series(1, 20000) g")
    cfg = make_config(source_db, kafka_broker.bootstrap, topic_prefix, [{"table": "public.items"}],
                      backfill={"chunk_rows": 500})
    topic = f"{topic_prefix}.public.items"
    stop, counter = threading.Event(), [0]
    with ProducerThread(cfg) as producer:
        wait_for(lambda: sum(r.control == "snapshot_end" for r in read_topic(
            kafka_broker.bootstrap, topic, topic_prefix)) == 3, timeout=120, what="initial snapshot")
        writer = threading.Thread(target=_writer, args=(source_db, stop, counter), daemon=True)
        writer.start()
        try:
            wait_for(lambda: counter[0] > 50, what="writes under way")
            rid = request_backfill(producer.config, "public.items")
            done = _wait_done(kafka_broker.bootstrap, topic_prefix, rid)
        finally:
            stop.set()
            writer.join(10)
        last = 100000 + counter[0]
        wait_for(lambda: any(r.key and r.key["id"] == last for r in read_topic(
            kafka_broker.bootstrap, topic, topic_prefix)), timeout=120, what="the last insert")
    records = read_topic(kafka_broker.bootstrap, topic, topic_prefix)
    ends = [r for r in records if r.control == "backfill_end"]
    assert sorted(r.partition for r in ends) == [0, 1, 2]
    info = json.loads(ends[0].headers[wire.CONTROL_INFO_HEADER])
    assert info["backfill_id"] == done["backfill_id"] and info["scope"] is None and info["partitions"] == 3
    reads = [r for r in data_records(records) if r.headers.get(wire.BACKFILL_HEADER) == done["backfill_id"].encode()]
    assert reads and all(r.position == (info["lsn"], 0) and r.value["op"] == "r" for r in reads)
    assert all(r.value["source"]["snapshot"] == "incremental" for r in reads)
    assert len({r.key["id"] for r in reads}) == len(reads) == info["rows"], "a row was read twice"
    # Every backfill read precedes its partition's backfill_end.
    end_offset = {r.partition: r.offset for r in ends}
    assert all(r.offset < end_offset[r.partition] for r in reads)
    # Live changes ran before, during and after the backfill, on both sides of its position.
    live = [r for r in data_records(records) if r.value["source"]["snapshot"] == "false"]
    assert any(r.position[0] < info["lsn"] for r in live) and any(r.position[0] > info["lsn"] for r in live)
    # The backfill alone holds exactly the rows that existed at its snapshot...
    with psycopg.connect(source_db) as conn:
        now = {r[0]: r[1] for r in conn.execute("SELECT id, v FROM items")}
    # ...and folding the topic by position (what the consumer does) gives the source.
    state = latest_rows(records)
    assert {k[0][1]: v["v"] for k, v in state.items()} == now
    # Progress is visible in `walbridge status`: the request, its state and rows.
    status = collect_status(parse_config(cfg))
    record = next(r for r in status["backfills"] if r["request_id"] == rid)
    assert record["state"] == "done" and record["rows"] == info["rows"]
    done_view = status["producer"]["backfills_done"][-1]
    assert done_view["shape"] == "public.items" and done_view["sent"] == info["rows"]
    from rich.console import Console

    Console(file=open("/dev/null", "w")).print(render_status(status))
    # Tails ignore backfill messages: the replay de-duplication sees streamed positions only.
    tails = read_tails({"bootstrap.servers": kafka_broker.bootstrap}, [(topic, p) for p in range(3)])
    assert all(t is not None and t.position != (info["lsn"], 0) for t in tails.values())


def test_scoped_backfill_reads_exactly_its_buckets(source_db, kafka_broker, topic_prefix):
    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE items (id int PRIMARY KEY, v int)")
        conn.execute("INSERT INTO items SELECT g, g FROM generate_series(1, 5000) g")
    cfg = make_config(source_db, kafka_broker.bootstrap, topic_prefix,
                      [{"table": "public.items", "where": "v > 1000"}])
    topic = f"{topic_prefix}.public.items"
    scope = {"columns": ["id"], "bucket_count": 64, "buckets": [3, 17, 40]}
    with ProducerThread(cfg) as producer:
        wait_for(lambda: sum(r.control == "snapshot_end" for r in read_topic(
            kafka_broker.bootstrap, topic, topic_prefix)) == 3, timeout=120, what="initial snapshot")
        rid = request_backfill(producer.config, "public.items", scope, reason="test")
        done = _wait_done(kafka_broker.bootstrap, topic_prefix, rid)
    with psycopg.connect(source_db) as conn:
        buckets.set_session(conn)
        expected = {r[0] for r in conn.execute(
            psycopg.sql.SQL("SELECT id FROM items WHERE v > 1000 AND {}").format(buckets.in_scope(scope)))}
    records = read_topic(kafka_broker.bootstrap, topic, topic_prefix)
    reads = [r for r in data_records(records) if r.headers.get(wire.BACKFILL_HEADER) == done["backfill_id"].encode()]
    assert 100 < len(expected) < 5000 and {r.key["id"] for r in reads} == expected
    ends = [r for r in records if r.control == "backfill_end"]
    assert len(ends) == 3 and json.loads(ends[0].headers[wire.CONTROL_INFO_HEADER])["scope"] == scope


def test_shape_added_to_running_deployment_is_backfilled_then_streamed(source_db, kafka_broker, topic_prefix):
    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE a (id int PRIMARY KEY)")
        conn.execute("CREATE TABLE b (id int PRIMARY KEY, v text)")
        conn.execute("INSERT INTO a SELECT generate_series(1, 10)")
        conn.execute("INSERT INTO b SELECT g, 'old' FROM generate_series(1, 3000) g")
    cfg = make_config(source_db, kafka_broker.bootstrap, topic_prefix, [{"table": "public.a"}])
    with ProducerThread(cfg):
        wait_for(lambda: sum(r.control == "snapshot_end" for r in read_topic(
            kafka_broker.bootstrap, f"{topic_prefix}.public.a", topic_prefix)) == 3, timeout=120, what="snapshot")
        with psycopg.connect(source_db, autocommit=True) as conn:
            conn.execute("UPDATE b SET v = 'changed while b was not a shape' WHERE id <= 100")
    cfg["shapes"].append({"table": "public.b"})
    topic_b = f"{topic_prefix}.public.b"
    with ProducerThread(cfg), psycopg.connect(source_db, autocommit=True) as conn:
        wait_for(lambda: sum(r.control == "backfill_end" for r in read_topic(
            kafka_broker.bootstrap, topic_b, topic_prefix)) == 3, timeout=120, what="b backfilled")
        conn.execute("UPDATE b SET v = 'live' WHERE id = 7")
        conn.execute("DELETE FROM b WHERE id = 8")
        conn.execute("INSERT INTO b VALUES (5000, 'new')")
        wait_for(lambda: any(r.key and r.key["id"] == 5000 for r in read_topic(
            kafka_broker.bootstrap, topic_b, topic_prefix)), timeout=60, what="live change on b")
    records = read_topic(kafka_broker.bootstrap, topic_b, topic_prefix)
    assert not any(r.control == "snapshot_end" for r in records), "the other shapes were not re-snapshotted"
    state = {k[0][1]: v["v"] for k, v in latest_rows(records).items()}
    assert state == {r[0]: r[1] for r in _source_rows(source_db, "SELECT id, v FROM b").values()}
    a_ends = [r for r in read_topic(kafka_broker.bootstrap, f"{topic_prefix}.public.a", topic_prefix)
              if r.control is not None]
    assert [r.control for r in a_ends] == ["snapshot_end"] * 3


def test_producer_killed_mid_backfill_restarts_it(source_db, kafka_broker, topic_prefix, tmp_path):
    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE items (id int PRIMARY KEY, v int, pad text)")
        conn.execute("INSERT INTO items SELECT g, 0, repeat('x', 100) FROM generate_series(1, 400000) g")
    cfg = make_config(source_db, kafka_broker.bootstrap, topic_prefix, [{"table": "public.items"}],
                      backfill={"chunk_rows": 200})
    path = write_toml(cfg, tmp_path / "wb.toml")
    topic = f"{topic_prefix}.public.items"
    log = tmp_path / "producer.log"
    proc = ProducerProcess(path, log).start()
    try:
        wait_for(lambda: sum(r.control == "snapshot_end" for r in read_topic(
            kafka_broker.bootstrap, topic, topic_prefix, timeout=120)) == 3, timeout=180, what="initial snapshot")
        base = _end_offsets(kafka_broker.bootstrap, topic)
        rid = request_backfill(parse_config(cfg), "public.items")
        wait_for(lambda: (s := _state(kafka_broker.bootstrap, topic_prefix, rid)) and s["state"] == "running",
                 timeout=60, what="backfill running")
        wait_for(lambda: _end_offsets(kafka_broker.bootstrap, topic) > base + 2000, timeout=60, interval=0.05,
                 what="backfill rows in Kafka")
        proc.kill9()
        killed = _state(kafka_broker.bootstrap, topic_prefix, rid)
        assert killed["state"] == "running" and killed["lsn"]  # its snapshot point, recorded before its rows
        with psycopg.connect(source_db, autocommit=True) as conn:
            conn.execute("DELETE FROM items WHERE id <= 10")
            conn.execute("UPDATE items SET v = 9 WHERE id BETWEEN 11 AND 20")
        proc = ProducerProcess(path, log).start()
        done = _wait_done(kafka_broker.bootstrap, topic_prefix, rid, timeout=240)
    finally:
        proc.stop()
    records = read_topic(kafka_broker.bootstrap, topic, topic_prefix, timeout=120)
    ends = [r for r in records if r.control == "backfill_end"]
    assert {r.headers[wire.BACKFILL_HEADER].decode() for r in ends} == {done["backfill_id"]}
    complete = [r for r in data_records(records) if r.headers.get(wire.BACKFILL_HEADER) == done["backfill_id"].encode()]
    assert sorted(r.key["id"] for r in complete) == sorted(_source_rows(source_db))
    killed_id = killed["backfill_id"].encode()
    partial = [r for r in data_records(records) if r.headers.get(wire.BACKFILL_HEADER) == killed_id]
    assert partial and all(r.position == (killed["lsn"], 0) for r in partial)
    state = {k[0][1]: v["v"] for k, v in latest_rows(records).items()}
    assert state == {i: v for i, v in _source_rows(source_db).values()}


def _end_offsets(bootstrap: str, topic: str) -> int:
    """Messages in the topic, by the broker's (approximate) end offsets: cheap enough to poll."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"count-{time.monotonic_ns()}"})
    try:
        parts = c.list_topics(topic, timeout=5).topics[topic].partitions
        return sum(c.get_watermark_offsets(TopicPartition(topic, p), timeout=5)[1] for p in parts)
    finally:
        c.close()


def test_reads_kafka_never_acknowledged_stop_the_run_and_the_backfill_is_read_again(source_db, private_kafka_broker,
                                                                                   topic_prefix, tmp_path):
    """Reads go out through a producer that reports failed deliveries only
    (``kafka_io.ReadChannel``). A broker frozen past ``message.timeout.ms``
    mid-backfill fails reads: the run stops (on the first failed delivery, a
    read's or its own), and its successor reads the shape again. The request is done only by an attempt whose every
    row is in Kafka, ahead of its ``backfill_end``."""
    broker = private_kafka_broker
    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE items (id int PRIMARY KEY, v int, pad text)")
        conn.execute("INSERT INTO items SELECT g, 0, repeat('x', 100) FROM generate_series(1, 300000) g")
    cfg = make_config(source_db, broker.bootstrap, topic_prefix, [{"table": "public.items"}],
                      backfill={"chunk_rows": 200}, kafka={"client": {"message.timeout.ms": 3000}})
    topic = f"{topic_prefix}.public.items"
    log = tmp_path / "producer.log"
    with ProducerProcess(write_toml(cfg, tmp_path / "wb.toml"), log) as producer:
        wait_for(lambda: "snapshot " in log.read_text() and " done:" in log.read_text(), timeout=180,
                 what="initial snapshot")
        rid = request_backfill(parse_config(cfg), "public.items")
        wait_for(lambda: f"backfill of shape public.items started ({rid}" in log.read_text(), timeout=60,
                 interval=0.01, what="backfill started")
        os.kill(broker.pid, signal.SIGSTOP)
        try:
            # The run stops on the first failed delivery: a read's, or one of the
            # producer's own messages (its status) timing out first on a busy machine.
            wait_for(lambda: any(sign in log.read_text() for sign in ("delivery of a read to ", "Message timed out")),
                     timeout=60, what="a read or a message failing")
        finally:
            os.kill(broker.pid, signal.SIGCONT)
        done = _wait_done(broker.bootstrap, topic_prefix, rid, timeout=240)
        assert producer.proc.poll() is None, log.read_text()[-4000:]  # the process lived on: its run restarted
    records = read_topic(broker.bootstrap, topic, topic_prefix, timeout=120)
    ends = [r for r in records if r.control == "backfill_end"]
    assert {r.headers[wire.BACKFILL_HEADER].decode() for r in ends} == {done["backfill_id"]}
    complete = [r for r in data_records(records) if r.headers.get(wire.BACKFILL_HEADER) == done["backfill_id"].encode()]
    assert sorted(r.key["id"] for r in complete) == list(range(1, 300001))  # every row of the attempt that ended
    end_at = {r.partition: r.offset for r in ends}
    assert all(r.offset < end_at[r.partition] for r in complete)  # each ahead of its partition's backfill_end
