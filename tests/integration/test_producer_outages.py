"""``walbridge producer`` as a real process through a frozen broker (issue 16):
while the broker is stopped with SIGSTOP (it accepts connections and never
answers) for longer than every client timeout, the producer keeps reading
the consumer groups' commits and producing, says what it waits for, and once
the broker is back every change made meanwhile arrives."""

from __future__ import annotations

import os
import signal
import time

import psycopg

from tests.helpers import (
    ProducerProcess,
    latest_rows,
    make_config,
    read_topic,
    wait_for,
    wait_snapshot_done,
    write_toml,
)

FREEZE = 40.0  # seconds: longer than message.timeout.ms (30 s) and the group-offset reads' 10 s


def _source_rows(source_db) -> dict:
    with psycopg.connect(source_db) as conn:
        return {(("id", r[0]),): {"id": r[0], "name": r[1]} for r in conn.execute("SELECT id, name FROM items")}


def test_producer_outlives_a_broker_frozen_past_its_timeouts(source_db, private_kafka_broker, topic_prefix,
                                                             tmp_path):
    """The producer waits on a consumer group that commits nothing, so every
    ``[ack] interval`` it asks the group's coordinator for committed offsets;
    with the broker frozen those reads time out again and again. Once the
    broker answers again the process is still alive (the admin client's group
    request aborted it here, librdkafka issue #4605) and the topic holds
    every row of the source: the messages that timed out too, though Kafka
    took later ones of their partitions (the idempotent producer's epoch bump
    after a timeout), which the next run must not skip as already there."""
    broker = private_kafka_broker
    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE items (id int PRIMARY KEY, name text)")
        conn.execute("INSERT INTO items SELECT g, 'before' FROM generate_series(1, 20) g")
    cfg = make_config(source_db, broker.bootstrap, topic_prefix, [{"table": "public.items"}],
                      ack={"consumer_groups": [f"{topic_prefix}-silent"], "interval": 0.5})
    topic = f"{topic_prefix}.public.items"
    log = tmp_path / "producer.log"
    with ProducerProcess(write_toml(cfg, tmp_path / "wb.toml"), log) as producer, \
            psycopg.connect(source_db, autocommit=True) as conn:
        wait_snapshot_done(broker.bootstrap, topic, topic_prefix)
        # Streaming, so the ack loop asks the group's coordinator during the freeze.
        wait_for(lambda: "streaming from slot" in log.read_text(), timeout=60, what="the producer streaming")
        conn.execute("UPDATE items SET name = 'flowing' WHERE id <= 5")
        os.kill(broker.pid, signal.SIGSTOP)
        try:
            end = time.monotonic() + FREEZE
            n = 100
            while time.monotonic() < end:  # changes keep coming while the broker is frozen
                conn.execute("INSERT INTO items VALUES (%s, 'frozen')", (n,))
                n += 1
                time.sleep(1.0)
                assert producer.proc.poll() is None, log.read_text()[-4000:]
        finally:
            os.kill(broker.pid, signal.SIGCONT)
        conn.execute("UPDATE items SET name = 'after' WHERE id % 3 = 0")
        source = _source_rows(source_db)
        wait_for(lambda: latest_rows(read_topic(broker.bootstrap, topic, topic_prefix)) == source
                 or producer.proc.poll() is not None, timeout=180, interval=2,
                 what="every source row in the topic after the freeze")
        time.sleep(5)  # the ack loop's reads, answered again, run a few rounds
        assert producer.proc.poll() is None, log.read_text()[-4000:]
        assert latest_rows(read_topic(broker.bootstrap, topic, topic_prefix)) == source
    text = log.read_text()
    assert "reading committed offsets failed (will retry)" in text, text[-4000:]
    assert "Assertion" not in text, text[-4000:]


def _resend_mark(source_db, slot: str):
    with psycopg.connect(source_db) as conn:
        row = conn.execute("SELECT resend_until FROM _walbridge.producer_slots WHERE slot_name = %s",
                           (slot,)).fetchone()
    return row and row[0]


def test_a_producer_killed_after_failed_deliveries_still_sends_its_replay_again(source_db, private_kafka_broker,
                                                                               topic_prefix, tmp_path):
    """Deliveries time out while the broker is frozen; the run that saw it
    records its resend mark with the slot before anything else. The process
    is killed -9 before any later run could re-send; the next process reads
    the mark from the source database and takes nothing of its replay for
    already in Kafka (the partition tails may be later messages than those
    that failed), so the topic ends up holding every source row."""
    broker = private_kafka_broker
    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE items (id int PRIMARY KEY, name text)")
        conn.execute("INSERT INTO items SELECT g, 'before' FROM generate_series(1, 20) g")
    cfg = make_config(source_db, broker.bootstrap, topic_prefix, [{"table": "public.items"}])
    path, topic, slot = write_toml(cfg, tmp_path / "wb.toml"), f"{topic_prefix}.public.items", cfg["source"]["slot"]
    first, second = tmp_path / "first.log", tmp_path / "second.log"
    with psycopg.connect(source_db, autocommit=True) as conn:
        with ProducerProcess(path, first) as producer:
            wait_snapshot_done(broker.bootstrap, topic, topic_prefix)
            wait_for(lambda: "streaming from slot" in first.read_text(), timeout=60, what="the producer streaming")
            conn.execute("UPDATE items SET name = 'flowing' WHERE id <= 10")
            os.kill(broker.pid, signal.SIGSTOP)
            try:
                n = 100

                def marked():
                    nonlocal n
                    conn.execute("INSERT INTO items VALUES (%s, 'frozen')", (n,))  # changes keep coming
                    n += 1
                    return _resend_mark(source_db, slot)

                wait_for(marked, timeout=120, interval=1.0,
                         what="the resend mark recorded after deliveries timed out",
                         explain=lambda: producer.log_tail())
                producer.kill9()
            finally:
                os.kill(broker.pid, signal.SIGCONT)
        conn.execute("UPDATE items SET name = 'after' WHERE id % 3 = 0")
        source = _source_rows(source_db)
        with ProducerProcess(path, second) as producer:
            wait_for(lambda: latest_rows(read_topic(broker.bootstrap, topic, topic_prefix)) == source
                     or producer.proc.poll() is not None, timeout=180, interval=2,
                     what="every source row in the topic after the kill", explain=lambda: producer.log_tail())
            assert producer.proc.poll() is None, producer.log_tail()
            assert latest_rows(read_topic(broker.bootstrap, topic, topic_prefix)) == source
            text = second.read_text()
            assert "an earlier run's deliveries failed" in text, text[-4000:]
            # Once a run confirmed past it, the mark goes (a later start trusts the tails again).
            producer.stop()
    assert _resend_mark(source_db, slot) is None, second.read_text()[-4000:]
