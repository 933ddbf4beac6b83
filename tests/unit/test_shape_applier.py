"""ShapeApplier.quiesce: a query is stopped only while its foreachBatch is
outside Spark (stopping it inside a Spark call overflows the stream thread's
stack in Spark's interruption check, issue 16)."""

from __future__ import annotations

import threading

import pyarrow as pa
import pytest

from schemas.config import parse_config
from spark_consumer.job import ShapeApplier
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
