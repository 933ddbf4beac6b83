"""ShapeApplier.quiesce: a query is stopped only while its foreachBatch is
outside Spark (stopping it inside a Spark call overflows the stream thread's
stack in Spark's interruption check, issue 16)."""

from __future__ import annotations

import threading

import pyarrow as pa
import pytest

from schemas.config import parse_config
from spark_consumer.job import ShapeApplier, _headline, stop_queries
from tests.helpers import make_config
from tests.integration.test_target_apply import items_target


class SlowBatch:
    """A batch whose read (Spark's job) waits until released."""

    def __init__(self) -> None:
        self.reading = threading.Event()
        self.release = threading.Event()
        self.reads = 0

    def toArrow(self):  # noqa: N802 - Spark's name
        self.reads += 1
        self.reading.set()
        self.release.wait(10)
        return pa.table({})


def _applier() -> ShapeApplier:
    cfg = parse_config(make_config("postgresql://unused@127.0.0.1:1/x", "127.0.0.1:1", "wb", [{"table": "app.items"}],
                                   consumer={"group": "g", "target_dsn": "postgresql://unused@127.0.0.1:1/t"}))
    return ShapeApplier(cfg, cfg.shapes[0], items_target(), {"bootstrap.servers": "127.0.0.1:1"})


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


def test_a_batch_being_read_holds_the_stop_back_until_it_is_handed_over():
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


class BusyApplier:
    """An applier whose batch in hand is never handed over: each settle waits
    its whole timeout (on a fake clock)."""

    def __init__(self, clock: list[float], events: list) -> None:
        self.clock, self.events = clock, events

    def quiesce(self) -> bool:
        self.events.append(("quiesce", self))
        return False

    def settle(self, timeout: float) -> None:
        self.events.append(("settle", timeout))
        self.clock[0] += timeout


class Query:
    def __init__(self, events: list) -> None:
        self.events = events

    def stop(self) -> None:
        self.events.append(("stop", self))


def test_shutdown_waits_for_all_busy_queries_within_one_deadline():
    clock, events = [100.0], []
    appliers = [BusyApplier(clock, events) for _ in range(3)]
    queries = [Query(events) for _ in range(3)]
    stop_queries(queries, appliers, 10.0, clock=lambda: clock[0])
    assert [e[0] for e in events[:3]] == ["quiesce"] * 3  # all refuse new batches first
    assert [t for kind, t in events if kind == "settle"] == [10.0, 0.0, 0.0]
    assert [q for kind, q in events if kind == "stop"] == queries
    assert clock[0] == 110.0


@pytest.mark.parametrize("text,headline", [
    ("plain failure\nits details", "plain failure"),
    ("Return Message: Traceback (most recent call last):\nRuntimeError: injected\nIdentifier: q",
     "RuntimeError: injected"),
    # Spark wraps the foreachBatch function's Python traceback: the raised exception says what happened
    ("[FOREACH_BATCH_USER_FUNCTION_ERROR] ... Return Message: Traceback (most recent call last):\n"
     '  File "job.py", line 3, in apply\n    raise ProgressGapError(msg)\n'
     "spark_consumer.progress.ProgressGapError: t[0]: offsets from 9 on were never applied\n\n"
     "\tat py4j.Protocol.getReturnValue(Protocol.java:476)\n=== Streaming Query ===\n"
     "Identifier: walbridge:public.t [id = 1, runId = 2]\nCurrent Committed Offsets: {}\n",
     "spark_consumer.progress.ProgressGapError: t[0]: offsets from 9 on were never applied"),
])
def test_a_failed_query_is_logged_by_what_went_wrong(text, headline):
    assert _headline(RuntimeError(text)) == headline
