"""spark_consumer.kafka_source.read_offset_range and read_offset_ranges
against scripted consumers: what a reused range consumer may still hold from
an earlier read never makes a range skip a message; a gap the log itself has
(compaction) is read as one; a bundle's ranges are read with one assignment,
each partition kept to its own range."""

from __future__ import annotations

import time

import pytest
from confluent_kafka import KafkaError, KafkaException

from spark_consumer import kafka_source
from spark_consumer.kafka_source import OffsetRange, SourceOptions, read_offset_range, read_offset_ranges

pytest.importorskip("pyspark")  # the source module's optional extra

TOPIC = "p.public.t"


class Msg:
    def __init__(self, partition: int, offset: int, eof: bool = False, topic: str = TOPIC,
                 error: KafkaError | None = None):
        self._partition, self._offset, self._eof, self._topic = partition, offset, eof, topic
        self._error = error

    def topic(self):
        return self._topic

    def partition(self):
        return self._partition

    def offset(self):
        return self._offset

    def error(self):
        return KafkaError(KafkaError._PARTITION_EOF) if self._eof else self._error

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
    monkeypatch.setattr(kafka_source, "_range_consumer", lambda opts, topics: consumer)
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


OTHER = "p.public.other"


class PartitionsConsumer:
    """Partition logs (topic, partition) -> offsets (gaps compacted away),
    each read from its assigned or sought position, in turn, up to
    ``num_messages`` a call; an end-of-partition event once per position
    reached; ``stale`` events first (dropped by a seek of their partition);
    ``silent`` partitions answer nothing."""

    def __init__(self, logs: dict[tuple[str, int], list[int]], stale: list[Msg] = (),
                 high_watermarks: dict | None = None, silent: set = frozenset()):
        self.logs, self.stale, self.silent = logs, list(stale), silent
        self.high_watermarks = {tp: max(o) + 1 if o else 0 for tp, o in logs.items()} | (high_watermarks or {})
        self.positions: dict = {}
        self.eof_sent: dict = {}
        self.assigns, self.asked, self.seeks, self.let_go = [], [], [], []

    def assign(self, tps):
        self.assigns.append([(tp.topic, tp.partition, tp.offset) for tp in tps])
        self.positions = {(tp.topic, tp.partition): tp.offset for tp in tps}

    def unassign(self):
        self.positions = {}

    def incremental_unassign(self, tps):
        for tp in tps:
            self.let_go.append((tp.topic, tp.partition))
            del self.positions[(tp.topic, tp.partition)]

    def seek(self, tp):
        key = (tp.topic, tp.partition)
        self.seeks.append((tp.topic, tp.partition, tp.offset))
        self.stale = [m for m in self.stale if (m.topic(), m.partition()) != key]
        self.positions[key] = tp.offset
        self.eof_sent.pop(key, None)  # an end reached again is reported again

    def consume(self, num_messages: int, timeout: float):
        self.asked.append(num_messages)
        out, self.stale = self.stale[:num_messages], self.stale[num_messages:]
        for (topic, p), position in self.positions.items():
            if (topic, p) in self.silent or len(out) >= num_messages:
                continue
            found = [o for o in self.logs[(topic, p)] if o >= position][:num_messages - len(out)]
            if found:
                out += [Msg(p, o, topic=topic) for o in found]
                self.positions[(topic, p)] = found[-1] + 1
            elif self.eof_sent.get((topic, p)) != position:
                self.eof_sent[(topic, p)] = position
                out.append(Msg(p, self.high_watermarks[(topic, p)], eof=True, topic=topic))
        if not out:
            time.sleep(0.01)
        return out


def read_bundle(monkeypatch, consumer: PartitionsConsumer, ranges: list[OffsetRange], **options) -> list[tuple]:
    monkeypatch.setattr(kafka_source, "_range_consumer", lambda opts, topics: consumer)
    opts = SourceOptions(topic=TOPIC, bootstrap_servers="unused:9092", **options)
    batches = read_offset_ranges(lambda _: opts, ranges)
    return [(t, p, o) for b in batches for t, p, o in zip(b.column("_wb_topic").to_pylist(),
                                                          b.column("_wb_partition").to_pylist(),
                                                          b.column("_wb_offset").to_pylist())]


def test_a_bundle_reads_all_its_ranges_with_one_assignment(monkeypatch):
    consumer = PartitionsConsumer({(TOPIC, 0): list(range(30)), (TOPIC, 1): list(range(5)),
                                   (OTHER, 0): list(range(100))})
    ranges = [OffsetRange(TOPIC, 0, 10, 20), OffsetRange(TOPIC, 1, 2, 3), OffsetRange(OTHER, 0, 50, 52)]
    assert read_bundle(monkeypatch, consumer, ranges) == (
        [(TOPIC, 0, o) for o in range(10, 20)] + [(TOPIC, 1, 2)] + [(OTHER, 0, 50), (OTHER, 0, 51)])
    assert consumer.assigns == [[(TOPIC, 0, 10), (TOPIC, 1, 2), (OTHER, 0, 50)]]
    assert consumer.asked[0] == 13  # no more than is left to read: consume never waits out its timeout
    assert consumer.seeks == [] and consumer.positions == {}


def test_a_partition_whose_range_is_read_is_let_go_while_the_others_are_read(monkeypatch):
    consumer = PartitionsConsumer({(TOPIC, 0): list(range(1000)), (TOPIC, 1): list(range(1000))})
    ranges = [OffsetRange(TOPIC, 0, 0, 1), OffsetRange(TOPIC, 1, 0, 600)]
    assert read_bundle(monkeypatch, consumer, ranges) == [(TOPIC, 0, 0)] + [(TOPIC, 1, o) for o in range(600)]
    assert consumer.let_go == [(TOPIC, 0)]  # unassigned on its own, then the rest
    assert consumer.asked == [601, 600]  # then what is left of partition 1 only, none of partition 0's


@pytest.mark.parametrize("stale", [
    [Msg(1, 40, eof=True)],  # an earlier read's end of partition, past the range
    [Msg(1, 25)],  # an earlier read's prefetched message, past the range
    [Msg(1, 14), Msg(1, 15)],  # ... inside the range, beyond its start
    [Msg(0, 14), Msg(1, 17)],  # ... of both partitions
    [Msg(0, 12, topic="p.public.gone")],  # a topic not in the bundle
])
def test_what_an_earlier_read_left_never_skips_a_message_of_a_bundle(monkeypatch, stale):
    consumer = PartitionsConsumer({(TOPIC, 0): list(range(40)), (TOPIC, 1): list(range(40))}, stale)
    ranges = [OffsetRange(TOPIC, 0, 10, 20), OffsetRange(TOPIC, 1, 10, 20)]
    assert read_bundle(monkeypatch, consumer, ranges) == [(TOPIC, p, o) for p in (0, 1) for o in range(10, 20)]


def test_a_refetch_drops_only_its_own_partitions_messages_of_that_call(monkeypatch):
    # Partition 1's stale message makes it fetch again; partition 0's messages
    # returned in the same call are still read.
    consumer = PartitionsConsumer({(TOPIC, 0): list(range(40)), (TOPIC, 1): list(range(40))},
                                  [Msg(1, 15), Msg(0, 10), Msg(1, 16)])
    ranges = [OffsetRange(TOPIC, 0, 10, 20), OffsetRange(TOPIC, 1, 10, 20)]
    assert read_bundle(monkeypatch, consumer, ranges) == [(TOPIC, p, o) for p in (0, 1) for o in range(10, 20)]
    assert consumer.seeks == [(TOPIC, 1, 10)]


def test_a_skip_in_one_partitions_log_is_read_as_it_is_the_others_whole(monkeypatch):
    consumer = PartitionsConsumer({(TOPIC, 0): [0, 1, 2, 7, 8, 9], (TOPIC, 1): list(range(10)),
                                   (OTHER, 0): [0, 1]}, high_watermarks={(OTHER, 0): 5})
    ranges = [OffsetRange(TOPIC, 0, 0, 9), OffsetRange(TOPIC, 1, 0, 9), OffsetRange(OTHER, 0, 0, 5)]
    assert read_bundle(monkeypatch, consumer, ranges) == (
        [(TOPIC, 0, o) for o in (0, 1, 2, 7, 8)] + [(TOPIC, 1, o) for o in range(9)] + [(OTHER, 0, 0), (OTHER, 0, 1)])
    assert sorted(consumer.seeks) == [(OTHER, 0, 2), (TOPIC, 0, 3)]  # once each, then the skip stands


def test_a_silent_partition_fails_the_bundle_though_others_are_read(monkeypatch):
    consumer = PartitionsConsumer({(TOPIC, 0): list(range(10)), (TOPIC, 1): list(range(10))}, silent={(TOPIC, 1)})
    ranges = [OffsetRange(TOPIC, 0, 0, 5), OffsetRange(TOPIC, 1, 0, 5)]
    with pytest.raises(TimeoutError, match=r"p\.public\.t\[1\]: .* 0 for 0\.2s"):
        read_bundle(monkeypatch, consumer, ranges, read_idle_timeout_s=0.2)
    assert consumer.positions == {}


def test_a_partitions_error_fails_the_bundle_unless_its_topic_is_gone(monkeypatch):
    lost = Msg(1, 0, error=KafkaError(KafkaError.OFFSET_OUT_OF_RANGE))
    consumer = PartitionsConsumer({(TOPIC, 0): list(range(10)), (TOPIC, 1): list(range(10))}, [lost])
    ranges = [OffsetRange(TOPIC, 0, 0, 5), OffsetRange(TOPIC, 1, 0, 5)]
    with pytest.raises(KafkaException):
        read_bundle(monkeypatch, consumer, ranges)
    # With on_data_loss=follow and the topic recreated meanwhile: nothing of it is handed over.
    ids = iter([{TOPIC: "a", OTHER: "b"}, {TOPIC: "a2", OTHER: "b"}])
    monkeypatch.setattr(kafka_source, "topic_ids", lambda admin, topics, timeout: next(ids))
    monkeypatch.setattr(kafka_source, "_incarnation_gone", lambda opts, r: r.topic == TOPIC)
    consumer = PartitionsConsumer({(TOPIC, 0): list(range(10)), (TOPIC, 1): list(range(10)),
                                   (OTHER, 0): list(range(3))}, [lost])
    ranges = [OffsetRange(TOPIC, 0, 0, 5, "a"), OffsetRange(TOPIC, 1, 0, 5, "a"), OffsetRange(OTHER, 0, 0, 3, "b")]
    assert read_bundle(monkeypatch, consumer, ranges, on_data_loss="follow") == [(OTHER, 0, o) for o in range(3)]


def test_ranges_read_together_are_of_different_partitions(monkeypatch):
    consumer = PartitionsConsumer({(TOPIC, 0): list(range(10))})
    with pytest.raises(ValueError, match="different partitions"):
        read_bundle(monkeypatch, consumer, [OffsetRange(TOPIC, 0, 0, 5), OffsetRange(TOPIC, 0, 5, 10)])


def test_a_range_consumer_asks_for_every_topics_metadata_once_per_topic_new_to_it(monkeypatch):
    class MetadataConsumer:
        fail = False

        def __init__(self, conf):
            self.listed = 0

        def list_topics(self, timeout):
            self.listed += 1
            if self.fail:
                raise KafkaException(KafkaError(KafkaError._TRANSPORT))

    monkeypatch.setattr(kafka_source, "Consumer", MetadataConsumer)
    monkeypatch.setattr(kafka_source, "_consumers", {})
    monkeypatch.setattr(kafka_source, "_consumer_topics", {})
    opts = SourceOptions(topic=TOPIC, bootstrap_servers="unused:9092")
    consumer = kafka_source._range_consumer(opts, frozenset({TOPIC, OTHER}))
    assert consumer.listed == 1
    assert kafka_source._range_consumer(opts, frozenset({TOPIC})) is consumer and consumer.listed == 1
    MetadataConsumer.fail = True  # not fatal to the read; asked again next time
    kafka_source._range_consumer(opts, frozenset({TOPIC, "p.public.new"}))
    MetadataConsumer.fail = False
    kafka_source._range_consumer(opts, frozenset({"p.public.new"}))
    assert consumer.listed == 3
