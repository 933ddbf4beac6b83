"""The continuous reader's loop (``[consumer] queries = "continuous"``)
with a fake source, read and apply: rounds are consecutive and carry the ids
their offsets were planned in, a stop lands between rounds, a failure ends
the loop and is reported (issue 17)."""

from __future__ import annotations

import threading
import time

import pytest

from schemas.config import ConfigError, parse_config
from spark_consumer import continuous
from spark_consumer.continuous import ContinuousQuery
from spark_consumer.kafka_source import OffsetRange


class FakeReader:
    """Ends of partition 0 of topic ``t``, one per look; then nothing new."""

    def __init__(self, ends: list[int], fail_at: int | None = None):
        self.ends = list(ends)
        self.fail_at = fail_at
        self.looks = 0
        self.stopped = False

    def initialOffset(self) -> dict:
        return {"t": {"0": 0, "topic_id": "A"}}

    def latestOffset(self, start: dict, limit) -> dict:
        self.looks += 1
        if self.fail_at is not None and self.looks >= self.fail_at:
            raise RuntimeError("t was recreated: not continuing")
        end = self.ends.pop(0) if self.ends else int(start["t"]["0"])
        return {"t": {"0": end, "topic_id": "A"}}

    def ranges(self, start: dict, end: dict) -> list[OffsetRange]:
        s, e = int(start["t"]["0"]), int(end["t"]["0"])
        return [OffsetRange("t", 0, s, e, "A")] if e > s else []

    def stop(self) -> None:
        self.stopped = True


class FakeApplier:
    def __init__(self):
        self.rounds: list[tuple[int, continuous.Round]] = []
        self.applied = threading.Event()

    def __call__(self, round_, batch_id: int) -> None:
        self.rounds.append((batch_id, round_))
        self.applied.set()


@pytest.fixture
def read_ranges(monkeypatch) -> list:
    """What the loop read, range by range (instead of a broker)."""
    read: list = []
    monkeypatch.setattr(continuous, "read_offset_ranges", lambda opts_of, ranges: read.extend(ranges) or [object()])
    monkeypatch.setattr(continuous, "IDLE_LOOK_S", 0.001)
    return read


def _query(reader: FakeReader, applier: FakeApplier) -> ContinuousQuery:
    return ContinuousQuery({}, applier, 100, reader=reader).start()


def _wait(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_rounds_are_consecutive_and_carry_their_topic_ids(read_ranges):
    reader, applier = FakeReader([5, 5, 9]), FakeApplier()
    q = _query(reader, applier)
    _wait(lambda: len(applier.rounds) == 2 and reader.looks > 4)  # idle looks after the last round
    q.stop()
    assert not q.isActive and q.exception() is None and reader.stopped
    assert [(r.start, r.end) for r in read_ranges] == [(0, 5), (5, 9)]  # the empty look between reads nothing
    assert [b for b, _ in applier.rounds] == [0, 1]
    assert all(r.topic_ids == {"t": "A"} for _, r in applier.rounds)


def test_a_failed_look_ends_the_loop_and_is_reported(read_ranges):
    reader, applier = FakeReader([5], fail_at=2), FakeApplier()
    q = _query(reader, applier)
    _wait(lambda: not q.isActive)
    assert "recreated" in str(q.exception())
    assert [b for b, _ in applier.rounds] == [0] and reader.stopped


def test_an_apply_refusing_the_round_ends_the_loop(read_ranges):
    class Refusing(FakeApplier):
        def __call__(self, round_, batch_id):
            raise RuntimeError("the shapes' query: the query is being restarted")

    q = _query(FakeReader([3]), Refusing())
    _wait(lambda: not q.isActive)
    assert "being restarted" in str(q.exception())


def test_the_continuous_reader_applies_on_the_driver_only():
    base = {"source": {"dsn": "postgresql://u@h/db"}, "kafka": {"bootstrap_servers": "b:9092"},
            "shapes": [{"table": "public.a"}]}
    assert parse_config({**base, "consumer": {"queries": "continuous"}}).consumer.queries == "continuous"
    with pytest.raises(ConfigError, match='queries = "continuous" applies on the driver'):
        parse_config({**base, "consumer": {"queries": "continuous", "staged_apply": True}})
