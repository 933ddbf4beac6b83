"""Kafka lost its data (the broker stopped, its log dirs deleted, formatted again
with the same cluster id): the producer
notices, re-creates its topics and redoes the snapshot at a new consistent
point, so the topics again describe the whole table."""

from __future__ import annotations

import psycopg

from tests.helpers import ProducerThread, data_records, latest_rows, make_config, read_topic, wait_for


def test_broker_wipe_redoes_the_snapshot(source_db, private_kafka_broker, topic_prefix, caplog):
    broker = private_kafka_broker
    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, v int)")
        conn.execute("INSERT INTO t SELECT g, 0 FROM generate_series(1, 1000) g")
    cfg = make_config(source_db, broker.bootstrap, topic_prefix, [{"table": "public.t"}])
    topic = f"{topic_prefix}.public.t"

    def snapshot_ends():
        try:
            return [r for r in read_topic(broker.bootstrap, topic, topic_prefix, timeout=20)
                    if r.control == "snapshot_end"]
        except Exception:  # topic not there (yet)
            return []

    with ProducerThread(cfg), psycopg.connect(source_db, autocommit=True) as conn:
        first = wait_for(lambda: len(snapshot_ends()) == 3 and snapshot_ends(), what="first snapshot")
        conn.execute("UPDATE t SET v = 1 WHERE id <= 10")
        broker.lose_data()  # every topic, record and committed offset is gone
        conn.execute("UPDATE t SET v = 2 WHERE id <= 5")
        conn.execute("DELETE FROM t WHERE id > 990")
        second = wait_for(lambda: len(snapshot_ends()) == 3 and snapshot_ends(), timeout=120,
                          what="snapshot redone after the broker lost its data")
        assert second[0].headers["wb.snapshot"] != first[0].headers["wb.snapshot"]
        conn.execute("UPDATE t SET v = 3 WHERE id = 1")
        wait_for(lambda: any(r.value and r.value["after"] and r.value["after"]["v"] == 3
                             for r in data_records(read_topic(broker.bootstrap, topic, topic_prefix))),
                 timeout=60, what="streaming after the redo")
    assert "redoing the snapshot" in caplog.text
    with psycopg.connect(source_db) as conn:
        source = {r[0]: r[1] for r in conn.execute("SELECT id, v FROM t")}
    state = {k[0][1]: v["v"] for k, v in latest_rows(read_topic(broker.bootstrap, topic, topic_prefix)).items()}
    assert state == source
