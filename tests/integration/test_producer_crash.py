"""kill -9 of the producer mid-stream, restart: no gap and no duplicate in any
partition."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import psycopg

from tests.helpers import ProducerProcess, data_records, make_config, read_topic, wait_for, write_toml


def test_kill9_mid_stream_no_gap_no_duplicate(source_db, kafka_broker, topic_prefix, tmp_path):
    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE acct (id int PRIMARY KEY, balance bigint)")
        conn.execute("INSERT INTO acct SELECT g, 0 FROM generate_series(1, 200) g")
    cfg = make_config(source_db, kafka_broker.bootstrap, topic_prefix, [{"table": "public.acct"}])
    path = write_toml(cfg, tmp_path / "wb.toml")
    topic = f"{topic_prefix}.public.acct"
    stop = threading.Event()
    written = Counter()

    def workload():
        rnd = random.Random(7)
        with psycopg.connect(source_db, autocommit=True) as conn:
            n = 0
            while not stop.is_set() and n < 3000:
                with conn.transaction():
                    for _ in range(rnd.randint(1, 8)):
                        key = rnd.randint(1, 200)
                        conn.execute("UPDATE acct SET balance = balance + 1 WHERE id = %s", (key,))
                        written[key] += 1
                n += 1

    proc = ProducerProcess(path, tmp_path / "producer.log").start()
    load = threading.Thread(target=workload)
    try:
        wait_for(lambda: len([r for r in read_topic(kafka_broker.bootstrap, topic, topic_prefix)
                              if r.control]) == 3, timeout=60, what="snapshot")
        load.start()
        for _ in range(3):
            time.sleep(random.uniform(0.5, 1.5))
            proc.kill9()
            time.sleep(0.3)
            proc = ProducerProcess(path, tmp_path / "producer.log").start()
        load.join(120)
        stop.set()
        with psycopg.connect(source_db) as conn:
            expected = dict(conn.execute("SELECT id, balance FROM acct"))
        wait_for(lambda: _final_balances(kafka_broker.bootstrap, topic, topic_prefix) == expected, timeout=120,
                 what="every update in Kafka")
    finally:
        stop.set()
        proc.stop()
    records = read_topic(kafka_broker.bootstrap, topic, topic_prefix, timeout=60)
    updates = [r for r in data_records(records) if r.value["op"] == "u"]
    # No duplicate: every update message is distinct, and each partition's positions strictly increase.
    for p in range(3):
        positions = [r.position for r in updates if r.partition == p]
        assert positions == sorted(positions) and len(set(positions)) == len(positions)
    # No gap: one message per update the workload made, with consecutive balances per key.
    per_key = Counter(r.key["id"] for r in updates)
    assert per_key == +written
    for key in per_key:
        balances = [r.value["after"]["balance"] for r in updates if r.key["id"] == key]
        assert balances == list(range(1, len(balances) + 1))
    assert "streaming from slot" in (tmp_path / "producer.log").read_text()


def _final_balances(bootstrap, topic, prefix) -> dict:
    state = {}
    for r in data_records(read_topic(bootstrap, topic, prefix, timeout=60)):
        state[r.key["id"]] = r.value["after"]["balance"]
    return state
