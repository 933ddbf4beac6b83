"""``walbridge consumer`` as a real process through outages (issue 16): it
never exits on a broker that does not answer, and restarting its query
again and again (each target restart fails the apply) leaves a query as it
was the first time, with no ``StackOverflowError``."""

from __future__ import annotations

import os
import signal
import time

import psycopg

from tests.helpers import (
    ConsumerProcess,
    ProducerProcess,
    ProducerThread,
    make_config,
    wait_for,
    wait_snapshot_done,
    write_toml,
)
from walbridge.embedded import PostgresCluster

FREEZE = 40.0  # seconds the broker stays frozen: longer than the clients' timeouts (30 s)
STARTED_WAITING = 180.0  # at most until a consumer started against the frozen broker says it waits
TARGET_RESTARTS = 25


def _config(source_db, target_dsn: str, bootstrap: str, prefix: str, tmp_path) -> dict:
    group = f"{prefix}-spark"
    return make_config(source_db, bootstrap, prefix, [{"table": "public.items"}],
                       consumer={"group": group, "target_dsn": target_dsn,
                                 "checkpoint_dir": str(tmp_path / "checkpoints"), "trigger_interval": 0.5,
                                 "reconnect_max_backoff": 2.0},
                       ack={"consumer_groups": [group], "interval": 0.5})


def _items_source(source_db) -> None:
    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE items (id int PRIMARY KEY, name text)")
        conn.execute("INSERT INTO items VALUES (1, 'before')")


def _target_ids(target_dsn: str) -> set[int]:
    try:
        with psycopg.connect(target_dsn, connect_timeout=5) as conn:
            return {r[0] for r in conn.execute("SELECT id FROM public.items")}
    except psycopg.Error:  # not created yet, or the target is restarting
        return set()


def _insert(source_db, id_: int) -> None:
    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute("INSERT INTO items VALUES (%s, 'after')", (id_,))


def _wait_applied(consumer: ConsumerProcess, target_dsn: str, ids: set[int], log) -> None:
    wait_for(lambda: _target_ids(target_dsn) == ids or consumer.proc.poll() is not None, timeout=240, interval=1,
             what=f"rows {sorted(ids)} in the target")
    assert consumer.proc.poll() is None, log.read_text()[-4000:]
    assert _target_ids(target_dsn) == ids


def test_a_consumer_started_while_the_broker_is_frozen_waits_then_applies(source_db, target_db,
                                                                          private_kafka_broker, topic_prefix,
                                                                          tmp_path):
    """Started while the broker is stopped with SIGSTOP (it accepts connections
    and never answers), the consumer says what it waits for, outlives every
    client timeout, and applies changes once the broker is back; so it does
    when the broker freezes again while its queries run."""
    broker = private_kafka_broker
    _items_source(source_db)
    cfg = _config(source_db, str(target_db), broker.bootstrap, topic_prefix, tmp_path)
    path = write_toml(cfg, tmp_path / "wb.toml")
    log = tmp_path / "consumer.log"
    consumer = ConsumerProcess(path, log)
    with ProducerProcess(path, tmp_path / "producer.log") as producer:
        wait_snapshot_done(broker.bootstrap, f"{topic_prefix}.public.items", topic_prefix)
        os.kill(broker.pid, signal.SIGSTOP)
        try:
            frozen = time.monotonic()
            consumer.start()
            waiting = f"kafka {broker.bootstrap}: "
            # Spark's JVM starts before the first request, and on a loaded
            # machine that alone can take longer than FREEZE: the bound only
            # tells a consumer that says nothing from a slow one.
            wait_for(lambda: waiting in log.read_text() and "retrying in" in log.read_text(),
                     timeout=STARTED_WAITING, interval=1, what="the consumer saying it waits for the broker",
                     explain=lambda: log.read_text()[-4000:])
            time.sleep(max(0.0, FREEZE - (time.monotonic() - frozen)))
            assert consumer.proc.poll() is None, log.read_text()[-4000:]
        finally:
            os.kill(broker.pid, signal.SIGCONT)
        try:
            _insert(source_db, 2)
            _wait_applied(consumer, str(target_db), {1, 2}, log)
            # Frozen again while the queries run: a change made meanwhile
            # arrives once the broker is back.
            os.kill(broker.pid, signal.SIGSTOP)
            try:
                _insert(source_db, 3)
                time.sleep(FREEZE)
                assert consumer.proc.poll() is None, log.read_text()[-4000:]
            finally:
                os.kill(broker.pid, signal.SIGCONT)
            _wait_applied(consumer, str(target_db), {1, 2, 3}, log)
            assert producer.proc.poll() is None, (tmp_path / "producer.log").read_text()[-4000:]
        finally:
            consumer.stop()
    assert "Traceback" not in log.read_text(), log.read_text()[-4000:]


def test_query_restarted_after_each_target_restart_stays_healthy(source_db, pg_base_dir, kafka_broker,
                                                                 topic_prefix, tmp_path):
    """Each immediate restart of the target fails the next apply and the run
    loop restarts the query in the same Spark session: TARGET_RESTARTS times
    over, every change is applied and no query execution overflows its stack."""
    _items_source(source_db)
    with PostgresCluster(pg_base_dir / "target") as target:
        target_dsn = target.create_database("warehouse")
        cfg = _config(source_db, target_dsn, kafka_broker.bootstrap, topic_prefix, tmp_path)
        log = tmp_path / "consumer.log"
        consumer = ConsumerProcess(write_toml(cfg, tmp_path / "wb.toml"), log)
        with ProducerThread(cfg):
            consumer.start()
            try:
                wait_for(lambda: _target_ids(target_dsn) == {1} or consumer.proc.poll() is not None,
                         timeout=180, interval=1, what="the snapshot applied")
                for n in range(1, TARGET_RESTARTS + 1):
                    target.stop("immediate")
                    target.start()
                    # Two changes a trigger apart: the failed apply of the
                    # first is seen by the run loop (which stops the query) or
                    # raised by the next batch's foreachBatch (which ends it).
                    _insert(source_db, 2 * n)
                    time.sleep(0.6)
                    _insert(source_db, 2 * n + 1)
                    wait_for(lambda: {2 * n, 2 * n + 1} <= _target_ids(target_dsn) or consumer.proc.poll() is not None,
                             timeout=120, interval=0.5, what=f"rows of target restart {n} applied")
                    assert consumer.proc.poll() is None, log.read_text()[-4000:]
                assert _target_ids(target_dsn) == set(range(1, 2 * TARGET_RESTARTS + 2))
            finally:
                consumer.stop()
    text = log.read_text()
    restarts = text.count("restarting it from the target's progress")
    assert restarts >= TARGET_RESTARTS, text[-4000:]
    assert "StackOverflowError" not in text, text[text.index("StackOverflowError") - 3000:][:6000]
