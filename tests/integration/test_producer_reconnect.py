"""Lost connections: the producer retries with backoff and resumes from the
last confirmed position, with no gap and no duplicate."""

from __future__ import annotations

import threading
import time
from collections import Counter

import psycopg

from tests.helpers import ProducerThread, data_records, make_config, read_topic, wait_for


def test_walsender_killed_mid_stream_resumes_without_gap_or_duplicate(source_db, kafka_broker, topic_prefix,
                                                                     caplog):
    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE seq (id int PRIMARY KEY, n int)")
    cfg = make_config(source_db, kafka_broker.bootstrap, topic_prefix, [{"table": "public.seq"}])
    slot = cfg["source"]["slot"]
    topic = f"{topic_prefix}.public.seq"
    done = threading.Event()

    def writer():
        with psycopg.connect(source_db, autocommit=True) as conn:
            for i in range(1, 1501):
                conn.execute("INSERT INTO seq VALUES (%s, %s)", (i, i))
                if i % 50 == 0:
                    time.sleep(0.15)  # ~5 s of writes: several kills land mid-stream
        done.set()

    with ProducerThread(cfg), psycopg.connect(source_db, autocommit=True) as admin:
        wait_for(lambda: admin.execute("SELECT active FROM pg_replication_slots WHERE slot_name = %s",
                                       (slot,)).fetchone() == (True,), what="slot active")
        load = threading.Thread(target=writer)
        load.start()
        kills = 0
        while not done.is_set() and kills < 3:
            time.sleep(1.0)
            pid = admin.execute("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s",
                                (slot,)).fetchone()[0]
            if pid:
                admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
                kills += 1
        load.join(60)
        wait_for(lambda: len(data_records(read_topic(kafka_broker.bootstrap, topic, topic_prefix))) >= 1500,
                 timeout=90, what="all 1500 inserts in Kafka")
    assert kills >= 2
    assert "connection lost" in caplog.text and "reconnecting" in caplog.text
    ids = Counter(r.key["id"] for r in data_records(read_topic(kafka_broker.bootstrap, topic, topic_prefix)))
    assert set(ids) == set(range(1, 1501)) and max(ids.values()) == 1  # no gap, no duplicate
