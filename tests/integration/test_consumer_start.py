"""A shape query's start on a real target: ``ShapeApplier.recover`` reads the
target's progress and has Spark replay a batch its checkpoint logged as done
but the target lacks; an unreachable target is waited for with backoff (up to
``[consumer] reconnect_max_elapsed``), a target that refuses the consumer ends
it at once."""

from __future__ import annotations

import functools
import logging
import threading
import time

import psycopg
import pytest

from schemas.config import parse_config
from schemas.failures import TARGET, Failure
from schemas.retry import RetryPolicy
from spark_consumer.apply_driver import apply_batch
from spark_consumer.job import ShapeApplier
from spark_consumer.kafka_source import SourceOptions, discover_schemas
from spark_consumer.progress import ensure_progress
from spark_consumer.starting import Stopped, wait_for_schemas
from spark_consumer.target_layout import ensure_table
from tests.helpers import make_config, wait_for
from tests.integration.test_target_apply import TOPIC, change, items_target, part
from tests.unit.test_checkpoint import names, write_batches
from walbridge.embedded import free_port

GROUP = "g-start"


def applier(target_dsn: str, tmp_path, **consumer) -> ShapeApplier:
    cfg = parse_config(make_config("postgresql://unused@127.0.0.1:1/x", "127.0.0.1:1", "wb", [{"table": "app.items"}],
                                   consumer={"group": GROUP, "target_dsn": target_dsn,
                                             "checkpoint_dir": str(tmp_path / "ck"), **consumer}))
    return ShapeApplier(cfg, cfg.shapes[0], items_target(), {"bootstrap.servers": "127.0.0.1:1"})


def test_recover_uncommits_the_batch_the_target_lacks(target_db, tmp_path, caplog):
    ck = tmp_path / "ck" / "app.items"
    # Spark: batch 0 = [0, 3), batch 1 = [3, 6), both logged as done; batch 2 planned.
    write_batches(ck, [{"0": 3}, {"0": 6}, {"0": 9}], committed=1)
    a = applier(str(target_db), tmp_path)
    try:
        with psycopg.connect(target_db, autocommit=True) as conn:
            ensure_progress(conn)
            ensure_table(conn, items_target())
            # The target committed batch 0 only.
            apply_batch(conn, GROUP, items_target(),
                        [part([change("c", 100 + i, off=i, id=i) for i in range(3)])])
        caplog.set_level(logging.INFO, logger="walbridge.consumer")
        a.recover(ck, TOPIC)
        assert names(ck / "commits") == [".0.crc", "0"]  # Spark re-runs batch 1
        assert names(ck / "offsets") == [".0.crc", ".1.crc", "0", "1"]
        assert "batch 1 as done but the target never committed all of it" in caplog.text
        caplog.clear()
        a.recover(ck, TOPIC)  # batch 0 is in the target: nothing to repair
        assert names(ck / "commits") == [".0.crc", "0"]
        assert "never committed" not in caplog.text
    finally:
        a.close()


def test_recover_waits_for_an_unreachable_target_then_gives_up_after_max_elapsed(tmp_path, caplog):
    a = applier(f"postgresql://postgres@127.0.0.1:{free_port()}/nowhere?connect_timeout=2", tmp_path,
                reconnect_max_backoff=0.2, reconnect_max_elapsed=1.5)
    started = time.monotonic()
    try:
        with pytest.raises(Failure) as e:
            a.recover(tmp_path / "ck" / "app.items", TOPIC)
    finally:
        a.close()
    assert e.value.endpoint == TARGET and not e.value.permanent and "Connection refused" in e.value.problem
    assert 1.5 <= time.monotonic() - started < 10
    waits = [r.getMessage() for r in caplog.records if "retrying in" in r.getMessage()]
    assert len(waits) >= 2 and all(w.startswith("target postgresql://postgres@127.0.0.1:") for w in waits)


def test_recover_fails_at_once_on_a_target_that_refuses_the_consumer(pg_cluster, tmp_path):
    a = applier(pg_cluster.dsn("no_such_database"), tmp_path)
    started = time.monotonic()
    try:
        with pytest.raises(Failure, match='database "no_such_database" does not exist') as e:
            a.recover(tmp_path / "ck" / "app.items", TOPIC)
    finally:
        a.close()
    assert e.value.permanent and time.monotonic() - started < 5


def test_the_start_waits_for_a_broker_that_is_down_and_goes_on_when_it_is_back(private_kafka_broker, caplog):
    """The consumer never exits on an unreachable broker: its start waits
    (saying for what), then goes on to wait for the producer's schema."""
    caplog.set_level(logging.INFO, logger="walbridge.consumer")
    private_kafka_broker.stop()
    opts = SourceOptions(topic="wb.app.items", bootstrap_servers=private_kafka_broker.bootstrap, topic_prefix="wb")
    stop = threading.Event()
    outcome: list = []

    def start() -> None:
        try:
            outcome.append(wait_for_schemas(opts, functools.partial(discover_schemas, timeout=1.0),
                                             RetryPolicy(max_backoff=1.0), stop))
        except BaseException as e:  # noqa: BLE001 - the test reads it
            outcome.append(e)

    thread = threading.Thread(target=start)
    thread.start()
    try:
        waiting = f"kafka {private_kafka_broker.bootstrap}: cannot reach the broker"
        wait_for(lambda: sum(waiting in r.getMessage() for r in caplog.records) >= 2, timeout=30,
                 what="two waits for the broker")
        assert not outcome
        private_kafka_broker.start()
        wait_for(lambda: "waiting for the producer to publish the schema of wb.app.items" in caplog.text,
                 timeout=30, what="the wait for the producer")
    finally:
        stop.set()
        thread.join(30)
    assert len(outcome) == 1 and isinstance(outcome[0], Stopped)
