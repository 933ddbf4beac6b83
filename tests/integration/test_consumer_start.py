"""The consumer's start on real endpoints: an unreachable target is waited
for with backoff (up to ``[consumer] reconnect_max_elapsed``), a target
that refuses the consumer ends it at once, and a broker that is down is
waited for before the wait for the producer's schemas."""

from __future__ import annotations

import functools
import logging
import threading
import time

import pytest

from schemas.config import parse_config
from schemas.failures import TARGET, Failure
from schemas.retry import RetryPolicy
from spark_consumer.query import BatchApplier
from spark_consumer.shape_schemas import ShapeSource, Stopped, discover_schemas, wait_for_schemas
from spark_consumer.targets import open_target
from tests.helpers import make_config, wait_for
from walbridge.embedded import free_port


def applier(target_dsn: str, tmp_path, **consumer) -> BatchApplier:
    cfg = parse_config(make_config("postgresql://unused@127.0.0.1:1/x", "127.0.0.1:1", "wb", [{"table": "app.items"}],
                                   consumer={"group": "g-start", "target_dsn": target_dsn,
                                             "checkpoint_dir": str(tmp_path / "ck"), **consumer}))
    return BatchApplier(cfg, {}, {"bootstrap.servers": "127.0.0.1:1"}, open_target(cfg, spark=None))


def test_a_start_waits_for_an_unreachable_target_then_gives_up_after_max_elapsed(tmp_path, caplog):
    a = applier(f"postgresql://postgres@127.0.0.1:{free_port()}/nowhere?connect_timeout=2", tmp_path,
                reconnect_max_backoff=0.2, reconnect_max_elapsed=1.5)
    started = time.monotonic()
    try:
        with pytest.raises(Failure) as e:
            a.target_progress(None)
    finally:
        a.close()
    assert e.value.endpoint == TARGET and not e.value.permanent and "Connection refused" in e.value.problem
    assert 1.5 <= time.monotonic() - started < 10
    waits = [r.getMessage() for r in caplog.records if "retrying in" in r.getMessage()]
    assert len(waits) >= 2 and all(w.startswith("target postgresql://postgres@127.0.0.1:") for w in waits)


def test_a_start_fails_at_once_on_a_target_that_refuses_the_consumer(pg_cluster, tmp_path):
    a = applier(pg_cluster.dsn("no_such_database"), tmp_path)
    started = time.monotonic()
    try:
        with pytest.raises(Failure, match='database "no_such_database" does not exist') as e:
            a.target_progress(None)
    finally:
        a.close()
    assert e.value.permanent and time.monotonic() - started < 5


def test_the_start_waits_for_a_broker_that_is_down_and_goes_on_when_it_is_back(private_kafka_broker, caplog):
    """The consumer never exits on an unreachable broker: its start waits
    (saying for what), then goes on to wait for the producer's schema."""
    caplog.set_level(logging.INFO, logger="walbridge.consumer")
    private_kafka_broker.stop()
    src = ShapeSource(topic="wb.app.items", bootstrap_servers=private_kafka_broker.bootstrap, topic_prefix="wb")
    stop = threading.Event()
    outcome: list = []

    def start() -> None:
        try:
            outcome.append(wait_for_schemas(src, functools.partial(discover_schemas, timeout=1.0),
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
