"""Initial snapshot on real parts: existing rows plus live changes, nothing
missing or duplicated; a crash mid-snapshot redoes it."""

from __future__ import annotations

import re
import time
from collections import Counter

import psycopg

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


def test_snapshot_of_100k_rows_then_live_changes(source_db, kafka_broker, topic_prefix):
    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE items (id int PRIMARY KEY, v int, pad text)")
        conn.execute("INSERT INTO items SELECT g, 0, repeat('p', 50) FROM generate_series(1, 100000) g")
        conn.execute("CREATE TABLE small (id int PRIMARY KEY)")
        conn.execute("INSERT INTO small SELECT generate_series(1, 10)")
    cfg = make_config(source_db, kafka_broker.bootstrap, topic_prefix,
                      [{"table": "public.items"}, {"table": "public.small"}], source={"snapshot_workers": 3})
    topic = f"{topic_prefix}.public.items"
    with ProducerThread(cfg), psycopg.connect(source_db, autocommit=True) as conn:
        # Live changes while (or right after) the snapshot runs: after the slot exists.
        wait_for(lambda: conn.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s",
                                      (cfg["source"]["slot"],)).fetchone(), what="slot")
        for i in range(20):
            conn.execute("UPDATE items SET v = v + 1 WHERE id = %s", (i * 5000 + 1,))
            conn.execute("INSERT INTO items VALUES (%s, 1, 'new')", (200000 + i,))
            conn.execute("DELETE FROM items WHERE id = %s", (i * 5000 + 2,))
        wait_for(lambda: any(r.key and r.key["id"] == 200019 for r in read_topic(
            kafka_broker.bootstrap, topic, topic_prefix, timeout=120)), timeout=180, what="last live insert")
    records = read_topic(kafka_broker.bootstrap, topic, topic_prefix, timeout=120)
    snapshot = [r for r in data_records(records) if r.value["op"] == "r"]
    # Every row existing at the snapshot point exactly once.
    counts = Counter(r.key["id"] for r in snapshot)
    assert len(counts) == len(snapshot), "a row was read twice"
    assert len({r.position for r in snapshot}) == 1
    snap_lsn = snapshot[0].position[0]
    assert all(r.position[0] > snap_lsn for r in data_records(records) if r.value["op"] != "r")
    with psycopg.connect(source_db) as conn:
        source = {row[0]: row for row in conn.execute("SELECT id, v, pad FROM items")}
    state = latest_rows(records)
    assert {k[0][1] for k in state} == set(source)
    assert all((v["id"], v["v"], v["pad"]) == source[v["id"]] for v in state.values())
    # Streamed changes: each exactly once.
    live = Counter((r.key["id"], r.value["op"]) for r in data_records(records) if r.value["op"] != "r")
    assert all(n == 1 for n in live.values()), [k for k, n in live.items() if n > 1]
    assert len(live) == 60


def test_crash_mid_snapshot_redoes_it(source_db, kafka_broker, topic_prefix, tmp_path):
    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE big (id int PRIMARY KEY, pad text)")
        conn.execute("INSERT INTO big SELECT g, repeat('z', 200) FROM generate_series(1, 400000) g")
    cfg = make_config(source_db, kafka_broker.bootstrap, topic_prefix, [{"table": "public.big"}],
                      source={"snapshot_workers": 2})
    path = write_toml(cfg, tmp_path / "wb.toml")
    topic = f"{topic_prefix}.public.big"
    proc = ProducerProcess(path, tmp_path / "producer.log").start()
    try:
        wait_for(lambda: _count(kafka_broker.bootstrap, topic) > 1000, timeout=60, interval=0.05,
                 what="snapshot under way")
        proc.kill9()
        partial = read_topic(kafka_broker.bootstrap, topic, topic_prefix, timeout=120)
        assert not any(r.control == "snapshot_end" for r in partial), "snapshot finished before the kill"
        with psycopg.connect(source_db, autocommit=True) as conn:
            conn.execute("DELETE FROM big WHERE id <= 10")  # between the two snapshots
        proc = ProducerProcess(path, tmp_path / "producer.log").start()
        # The log says when the redone snapshot's ends are acknowledged (reading the whole topic
        # again and again until they show took minutes).
        wait_for(lambda: re.search(r"snapshot \S+ done:", (tmp_path / "producer.log").read_text()), timeout=240,
                 what="redone snapshot")
    finally:
        proc.stop()
    log = (tmp_path / "producer.log").read_text()
    assert "redoing the snapshot" in log
    records = read_topic(kafka_broker.bootstrap, topic, topic_prefix, timeout=120)
    ends = [r for r in records if r.control == "snapshot_end"]
    assert len(ends) == 3  # one per partition
    snap_id = ends[0].headers["wb.snapshot"]
    complete = [r for r in data_records(records) if r.headers.get("wb.snapshot") == snap_id]
    with psycopg.connect(source_db) as conn:
        ids = {r[0] for r in conn.execute("SELECT id FROM big")}
    assert sorted(r.key["id"] for r in complete) == sorted(ids)  # the redone snapshot alone is complete
    first = data_records(partial)[:1]  # once: per record it made this check quadratic in the topic's size
    assert all(r.position > p.position for r in complete for p in first)


def _count(bootstrap, topic) -> int:
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"count-{time.monotonic_ns()}"})
    try:
        meta = c.list_topics(topic, timeout=5).topics.get(topic)
        if meta is None or meta.error is not None:
            return 0
        return sum(c.get_watermark_offsets(TopicPartition(topic, p), timeout=5)[1] for p in meta.partitions)
    except Exception:
        return 0
    finally:
        c.close()
