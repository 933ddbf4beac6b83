"""spark_consumer.kafka_source.read_offset_range against a scripted consumer:
what a reused range consumer may still hold from an earlier read never makes
a range skip a message; a gap the log itself has (compaction) is read as one."""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError

from spark_consumer import kafka_source
from spark_consumer.kafka_source import OffsetRange, SourceOptions, read_offset_range

pytest.importorskip("pyspark")  # the source module's optional extra

TOPIC = "p.public.t"


class Msg:
    def __init__(self, partition: int, offset: int, eof: bool = False, topic: str = TOPIC):
        self._partition, self._offset, self._eof, self._topic = partition, offset, eof, topic

    def topic(self):
        return self._topic

    def partition(self):
        return self._partition

    def offset(self):
        return self._offset

    def error(self):
        return KafkaError(KafkaError._PARTITION_EOF) if self._eof else None

    def key(self):
        return b"k%d" % self._offset

    def value(self):
        return b"v%d" % self._offset

    def headers(self):
        return []


class ScriptedConsumer:
    """A partition log (its offsets; gaps are compacted away) read from the
    assigned or sought position, after ``stale`` events an earlier read left
    in the queue (dropped by a seek, as librdkafka's fetch versions do)."""

    def __init__(self, offsets: list[int], stale: list[Msg], high_watermark: int | None = None):
        self.log, self.stale, self.position, self.seeks = offsets, list(stale), None, []
        self.high_watermark = max(offsets) + 1 if high_watermark is None else high_watermark

    def assign(self, tps):
        self.position = tps[0].offset

    def unassign(self):
        self.position = None

    def seek(self, tp):
        self.seeks.append(tp.offset)
        self.stale, self.position = [], tp.offset

    def consume(self, num_messages: int, timeout: float):
        if self.stale:
            out, self.stale = self.stale[:num_messages], self.stale[num_messages:]
            return out
        out = [Msg(0, o) for o in self.log if o >= self.position][:num_messages]
        if out:
            self.position = out[-1].offset() + 1
            return out
        return [Msg(0, self.high_watermark, eof=True)]


def read(monkeypatch, consumer: ScriptedConsumer, start: int, end: int) -> list[int]:
    monkeypatch.setattr(kafka_source, "_range_consumer", lambda opts: consumer)
    opts = SourceOptions(topic=TOPIC, bootstrap_servers="unused:9092")
    batches = read_offset_range(opts, OffsetRange(TOPIC, 0, start, end))
    return [o for b in batches for o in b.column("_wb_offset").to_pylist()]


@pytest.mark.parametrize("stale", [
    [Msg(0, 40, eof=True)],  # an earlier read's end of partition, past the range
    [Msg(0, 25)],  # an earlier read's prefetched message, past the range
    [Msg(0, 14), Msg(0, 15)],  # ... inside the range, beyond its start
    [Msg(1, 3), Msg(1, 4, eof=True)],  # another partition's
    [Msg(0, 12, topic="p.public.other")],  # another topic's
])
def test_what_an_earlier_read_left_never_skips_a_message(monkeypatch, stale):
    consumer = ScriptedConsumer(list(range(40)), stale)
    assert read(monkeypatch, consumer, 10, 20) == list(range(10, 20))


def test_a_skip_in_the_log_itself_is_fetched_once_more_then_read_as_it_is(monkeypatch):
    consumer = ScriptedConsumer([0, 1, 2, 7, 8, 9], [])  # 3..6 compacted away
    assert read(monkeypatch, consumer, 0, 9) == [0, 1, 2, 7, 8]
    assert consumer.seeks == [3]
    consumer = ScriptedConsumer([0, 1, 2], [], high_watermark=6)  # 3..5 compacted away, at the end
    assert read(monkeypatch, consumer, 0, 6) == [0, 1, 2]
    assert consumer.seeks == [3]


def test_a_range_whose_messages_are_all_compacted_away_ends_at_the_end_of_partition(monkeypatch):
    consumer = ScriptedConsumer([0, 1, 2, 8], [])  # 3..7 compacted away
    assert read(monkeypatch, consumer, 3, 8) == []
    assert consumer.seeks == [3]


def test_a_plain_read_never_fetches_again(monkeypatch):
    consumer = ScriptedConsumer(list(range(100)), [])
    assert read(monkeypatch, consumer, 5, 60) == list(range(5, 60))
    assert consumer.seeks == []
