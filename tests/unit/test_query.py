"""The query's foreachBatch apply and its supervision, pure parts
(spark_consumer/query.py, pipelined.py, supervisor.py): a query is stopped
only while its foreachBatch is outside Spark (stopping it inside a Spark call
overflows the stream thread's stack in Spark's interruption check, issue 16);
consecutive parts leave no gap; the decode UDF is made again only for new
schemas; what a failed query costs."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import psycopg
import pyarrow as pa
import pytest
from py4j.protocol import Py4JError, Py4JNetworkError

from schemas import wire
from schemas.config import parse_config
from schemas.failures import KAFKA, Failure
from schemas.retry import RetryPolicy
from spark_consumer import query, supervisor
from spark_consumer.query import BatchApplier
from spark_consumer.session import local_master
from spark_consumer.source import StartPlan
from spark_consumer.supervisor import headline
from spark_consumer.targets import open_target
from tests.helpers import make_config

TOPIC = "wb.app.items"


def config():
    return parse_config(make_config("postgresql://unused@127.0.0.1:1/x", "127.0.0.1:1", "wb", [{"table": "app.items"}],
                                    consumer={"group": "g", "target_dsn": "postgresql://unused@127.0.0.1:1/t"}))


class SlowBatch:
    """A batch whose read (Spark's job) waits until released."""

    def __init__(self) -> None:
        self.reading = threading.Event()
        self.release = threading.Event()
        self.reads = 0

    def coalesce(self, n):
        return self

    def toArrow(self):  # noqa: N802 - Spark's name
        self.reads += 1
        self.reading.set()
        self.release.wait(10)
        return pa.table({wire.TOPIC_COLUMN: pa.array([], pa.string()), wire.ARROW_COLUMN: pa.array([], pa.binary())})


def _applier(plan: StartPlan | None = None) -> BatchApplier:
    cfg = config()
    return BatchApplier(cfg, {}, {"bootstrap.servers": "127.0.0.1:1"}, open_target(cfg, spark=None), plan)


def test_an_idle_applier_can_be_stopped_and_refuses_further_batches_unread():
    applier = _applier()
    try:
        assert applier.quiesce() is True
        batch = SlowBatch()
        with pytest.raises(RuntimeError, match="being restarted"):
            applier(batch, 7)
        assert batch.reads == 0  # refused before any Spark call
    finally:
        applier.close()


def test_a_batch_being_read_holds_the_stop_back_until_it_is_handed_over(monkeypatch):
    monkeypatch.setattr(query, "arrow_map_udf", lambda *args: "decode")
    monkeypatch.setattr(query, "map_in_arrow", lambda df, udf: df)
    applier = _applier()
    batch = SlowBatch()
    call = threading.Thread(target=applier, args=(batch, 3))
    try:
        call.start()
        assert batch.reading.wait(10)
        assert applier.quiesce() is False  # inside Spark: not now
        batch.release.set()
        call.join(10)
        assert applier.quiesce() is True
    finally:
        batch.release.set()
        call.join(10)
        applier.close()


def test_the_decode_udf_is_made_again_only_when_a_shape_or_its_schemas_change(monkeypatch):
    made = []
    monkeypatch.setattr(query, "arrow_map_udf", lambda func, schema, columns: made.append(func.args[0]) or len(made))
    shape = SimpleNamespace(source=object(), schemas=object())
    other = SimpleNamespace(source=object(), schemas=object())
    applier = _applier()
    applier.states = {TOPIC: shape, "wb.app.other": other}
    try:
        assert applier._decode_udf([TOPIC, "wb.app.other"]) == applier._decode_udf([TOPIC, "wb.app.other"]) == 1
        assert applier._decode_udf([TOPIC]) == 2  # a re-decode of one shape's part
        assert applier._decode_udf([TOPIC]) == 2
        shape.schemas = object()  # learned again (a new writer schema)
        assert applier._decode_udf([TOPIC]) == 3
        assert made[-1] == {TOPIC: (shape.source, shape.schemas)}
    finally:
        applier.close()


def decoded(rows: list[tuple[int, int]]) -> pa.Table:
    """Decoded rows of TOPIC: (partition, offset)."""
    return pa.table({wire.TOPIC_COLUMN: [TOPIC] * len(rows), wire.PARTITION_COLUMN: [p for p, _ in rows],
                     wire.OFFSET_COLUMN: [o for _, o in rows]})


def test_parts_run_from_where_the_previous_part_of_the_partition_ended():
    applier = _applier(StartPlan({TOPIC: "id1"}, {TOPIC: {"0": 10, "1": -2}}, {(TOPIC, 0): 10, (TOPIC, 1): 0}))
    try:
        first = applier._parts(TOPIC, decoded([(0, 12), (0, 13), (1, 4)]))  # compaction left 10, 11 and 0-3 out
        assert [(p.partition, p.start, p.end, p.topic_id) for p in first] == [(0, 10, 14, "id1"), (1, 0, 5, "id1")]
        second = applier._parts(TOPIC, decoded([(0, 20), (2, 7)]))  # partition 2: added since the run began
        assert [(p.partition, p.start, p.end) for p in second] == [(0, 14, 21), (2, 0, 8)]
        with pytest.raises(RuntimeError, match="below the end of the previous batch"):
            applier._parts(TOPIC, decoded([(0, 15)]))
    finally:
        applier.close()


def test_a_held_or_recreated_topic_asks_for_a_restart():
    applier = _applier()
    try:
        applier.reading = [TOPIC]
        assert not applier.needs_restart
        applier.held[TOPIC] = "cannot follow"
        assert applier.needs_restart
        other = _applier()
        other.recreated["wb.app.other"] = "the topic was recreated"
        assert other.needs_restart
        other.close()
    finally:
        applier.close()


def test_a_refusal_ends_the_consumer_an_outage_backs_off_anything_else_is_restarted_a_few_times():
    cfg, policy = config(), RetryPolicy(max_backoff=1.0, max_elapsed=None)
    refused = Failure(KAFKA, "group authorization failed")
    with pytest.raises(Failure, match="group authorization"):
        supervisor._restart_delay(cfg, refused, policy, [], [])
    with pytest.raises(Failure):
        supervisor._restart_delay(cfg, psycopg.OperationalError("password authentication failed for user x"),
                                  policy, [], [])
    outages: list[float] = []
    delay = supervisor._restart_delay(cfg, Failure(KAFKA, "broker down", permanent=False), policy, [], outages)
    assert 0 <= delay <= 1.0 and len(outages) == 1
    failures: list[float] = []
    for _ in range(supervisor.QUERY_RESTARTS):
        assert supervisor._restart_delay(cfg, RuntimeError("a statement failed"), policy, failures, []) > 0
    with pytest.raises(RuntimeError, match="failed 6 times"):
        supervisor._restart_delay(cfg, RuntimeError("a statement failed"), policy, failures, [])


def test_local_tasks_are_retried_as_on_a_cluster():
    assert local_master("local[2]") == "local[2,4]"
    assert local_master("local[*]") == "local[*,4]"
    assert local_master("local") == "local[1,4]"
    assert local_master("local[2,8]") == "local[2,8]"
    assert local_master("spark://h:7077") == "spark://h:7077"


@pytest.mark.parametrize("text,expected", [
    ("plain failure\nits details", "plain failure"),
    ("Return Message: Traceback (most recent call last):\nRuntimeError: injected\nIdentifier: q",
     "RuntimeError: injected"),
    # Spark wraps the foreachBatch function's Python traceback: the raised exception says what happened
    ("[FOREACH_BATCH_USER_FUNCTION_ERROR] ... Return Message: Traceback (most recent call last):\n"
     '  File "query.py", line 3, in apply\n    raise ProgressGapError(msg)\n'
     "spark_consumer.progress.ProgressGapError: t[0]: offsets from 9 on were never applied\n\n"
     "\tat py4j.Protocol.getReturnValue(Protocol.java:476)\n=== Streaming Query ===\n"
     "Identifier: walbridge [id = 1, runId = 2]\nCurrent Committed Offsets: {}\n",
     "spark_consumer.progress.ProgressGapError: t[0]: offsets from 9 on were never applied"),
])
def test_a_failed_query_is_logged_by_what_went_wrong(text, expected):
    assert headline(RuntimeError(text)) == expected


class _StoppedQuery:
    def __init__(self, error: Exception):
        self.error = error

    def stop(self):
        raise self.error


class _Applier:
    closed = False

    def settle(self, timeout):
        pass

    def close(self):
        self.closed = True


def test_a_query_whose_spark_the_signal_stopped_first_is_a_clean_stop():
    """Ctrl-C reaches Spark's JVM too: its shutdown hook may stop Spark before
    the supervisor stops the query."""
    for gone in (Py4JError("An error occurred while calling o390.stop.\n: java.lang.IllegalStateException: "
                           "Cannot call methods on a stopped SparkContext."), Py4JNetworkError("Answer from Java side is empty")):
        applier = _Applier()
        supervisor._stop_query(_StoppedQuery(gone), applier, 0)
        assert applier.closed
    with pytest.raises(Py4JError, match="something else"):
        supervisor._stop_query(_StoppedQuery(Py4JError("something else")), _Applier(), 0)
