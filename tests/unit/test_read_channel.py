"""ReadChannel: reads report failed deliveries only, and none goes unseen;
control events that end reads wait until every read is in Kafka."""

from __future__ import annotations

import collections
import time

import pytest
from confluent_kafka import KafkaException

from producer.kafka_io import ReadChannel
from producer.reads import Reads
from tests.fakes import ListChannel

NO_BROKER = {"bootstrap.servers": "127.0.0.1:1", "message.timeout.ms": 300, "log_level": 0}


def test_a_read_that_fails_is_raised_naming_its_partition():
    channel = ReadChannel(NO_BROKER, on_full=lambda: None)
    events = collections.Counter()
    channel.send_all([(("wb.t", 2), b"k", b"v", ("s", "r"))] * 3, [("wb.position", b"1")], events)
    assert events == {("s", "r"): 3}
    deadline = time.monotonic() + 20
    with pytest.raises(KafkaException, match=r"delivery of a read to wb\.t\[2\] failed"):
        while time.monotonic() < deadline:
            channel.in_flight()
            time.sleep(0.05)
    with pytest.raises(KafkaException):  # it stays raised: a failed read is never forgotten
        channel.in_flight()
    channel.close()


def test_flush_raises_a_failed_read():
    channel = ReadChannel(NO_BROKER, on_full=lambda: None)
    channel.send(("wb.t", 0), b"k", b"v", [])
    with pytest.raises(KafkaException, match="wb.t"):
        channel.flush(10)
    channel.close()


class InFlight(ListChannel):
    def __init__(self, n: int):
        super().__init__()
        self.n = n

    def in_flight(self) -> int:
        return self.n


def test_the_end_of_reads_waits_for_them():
    control = []
    channel = InFlight(2)
    reads = Reads(channel, lambda *m: control.append(m), {"wb.t": 2}, collections.Counter(),
                  lambda topic, event, id_: f"{event}:{id_}".encode())
    with pytest.raises(RuntimeError, match="still in flight"):
        reads.send_end([("wb.t", 0), ("wb.t", 1)], [], "backfill_end", "bf1", {})
    assert control == [] and channel.sent == []
    channel.n = 0
    reads.send_end([("wb.t", 0), ("wb.t", 1)], [], "backfill_end", "bf1", {})
    assert [(m[0], m[1]) for m in control] == [(("wb.t", 0), b"backfill_end:bf1"), (("wb.t", 1), b"backfill_end:bf1")]
    assert channel.sent == []  # control events go through the stream's producer, not the reads'
