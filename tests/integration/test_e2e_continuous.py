"""The continuous reader (``[consumer] queries = "continuous"``) end to end on
real parts: PostgreSQL → producer → Apache Kafka → the consumer's reading loop →
target, killed with -9 again and again under load, in the middle of a target
transaction and just after one committed (before or around its group
commit), then compared row by row (issue 17)."""

from __future__ import annotations

import threading

import psycopg

from tests.helpers import ConsumerProcess, ProducerThread, wait_for, write_toml
from tests.integration.test_e2e import (
    _applied_batches,
    _caught_up,
    _prepare_source,
    _verify_ok,
    assert_applied_once,
    e2e_config,
    pgbench_until,
)

KILLS = 4


def _apply_copying(target_db) -> bool:
    """Is the consumer's apply mid-way: a transaction of another session of
    the target database COPYing a round's rows in?"""
    with psycopg.connect(target_db, autocommit=True) as conn:
        return conn.execute("SELECT count(*) > 0 FROM pg_stat_activity WHERE datname = current_database() "
                            "AND pid <> pg_backend_pid() AND xact_start IS NOT NULL AND query ILIKE 'COPY%'"
                            ).fetchone()[0]


def test_continuous_reader_killed_again_and_again_ends_equal_with_nothing_applied_twice(
        source_db, target_db, kafka_broker, topic_prefix, tmp_path):
    _prepare_source(source_db)
    cfg = e2e_config(source_db, target_db, kafka_broker.bootstrap, topic_prefix, tmp_path)
    cfg["consumer"]["queries"] = "continuous"
    cfg["consumer"]["max_offsets_per_trigger"] = 2000  # per round, all topics: many rounds, kills land mid-stream
    path = write_toml(cfg, tmp_path / "wb.toml")
    log = tmp_path / "consumer.log"
    kills_done = threading.Event()
    loader = threading.Thread(target=pgbench_until, args=(source_db, kills_done), daemon=True)
    with ProducerThread(cfg):
        consumer = ConsumerProcess(path, log).start()
        try:
            wait_for(lambda: _applied_batches(target_db) > 5000, timeout=180, interval=0.5,
                     what="consumer applying")
            loader.start()
            for kill in range(KILLS):
                if kill % 2 == 0:  # mid-apply: the round's transaction is open
                    wait_for(lambda: _apply_copying(target_db), timeout=120, interval=0.002,
                             what="the consumer's apply COPYing a round in")
                else:  # just after a round committed: its group commit may not have landed
                    before = _applied_batches(target_db)
                    wait_for(lambda: _applied_batches(target_db) > before, timeout=120, interval=0.005,
                             what="a round committed")
                consumer.kill9()
                started = log.read_text().count("consuming")
                consumer = ConsumerProcess(path, log).start()
                wait_for(lambda: log.read_text().count("consuming") > started, timeout=120,
                         what="the restarted consumer reading")
            kills_done.set()
            loader.join(120)
            ok = wait_for(lambda: _verify_ok(cfg)[0], timeout=300, interval=3, what="target == source")
            assert ok, _verify_ok(cfg)[1]
            wait_for(lambda: _caught_up(cfg), timeout=60, what="slot at the last commit")
        finally:
            kills_done.set()
            consumer.stop()
    text = log.read_text()
    assert text.count("consuming 5 shape topics continuously") == KILLS + 1
    assert "shapes batch" in text
    assert not (tmp_path / "checkpoints").exists()  # no Spark query ran: the target's progress is all there is
    assert_applied_once(target_db, kafka_broker.bootstrap, topic_prefix)
