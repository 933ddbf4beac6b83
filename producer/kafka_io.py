"""Kafka shell of the producer: producer settings, partitioning, partition
tails and the delivery bookkeeping of the idempotent producers.

Invariants:
- Two producers, both idempotent with ``acks=all``: the stream's, which reports
  every delivery (its offsets align transactions with consumer commits), and
  the reads' (:class:`ReadChannel`, snapshot and backfill rows), which reports
  failures only. A delivery error on either is fatal (the process stops and
  resumes from the slot, which never passed undelivered data; an unfinished
  snapshot or backfill is read again).
- Messages are placed on partitions by walbridge itself (``partitioner.py``:
  murmur2 of the whole key, as Java clients do; keyless rows by position), so a
  replayed change lands on the partition it landed on before.
- A partition's tail is its last walbridge message, found by reading back from
  the end offset (widening the window past backfill and foreign messages)
  until one is found.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from confluent_kafka import KafkaError, KafkaException, Producer, TopicPartition

from schemas import wire
from schemas.kafka import Writer, scan, scan_consumer


def producer_config(base: dict[str, Any]) -> dict[str, Any]:
    conf = dict(base)
    conf.setdefault("enable.idempotence", True)
    conf.setdefault("acks", "all")
    # Batching decides broker throughput: one request per change would cost a round trip each.
    conf.setdefault("linger.ms", 10)
    conf.setdefault("batch.num.messages", 10000)
    conf.setdefault("queue.buffering.max.messages", 200000)
    conf.setdefault("queue.buffering.max.kbytes", 262144)
    conf.setdefault("compression.type", "lz4")
    # A message not acknowledged in 30 s fails, and a failed delivery restarts the
    # pipeline from the slot and the partition tails: that is also how a broker
    # that lost its data (its idempotence state gone with it) is noticed.
    conf.setdefault("message.timeout.ms", 30000)
    # Topics are created by walbridge, with the configured partition count; a
    # producer retrying into a wiped broker must not auto-create them.
    conf.setdefault("allow.auto.create.topics", False)
    return conf


@dataclass(frozen=True)
class Tail:
    """The last walbridge message of a partition."""

    offset: int
    position: tuple[int, int]
    control: str | None  # e.g. "snapshot_end" when the last message is a control event
    snapshot_id: str | None  # set on snapshot reads
    tombstone: bool = False  # a delete's tombstone (it follows the delete, at its position)


def _tail_of(msg: Any) -> Tail | None:
    headers = msg.headers()
    pos = wire.header(headers, wire.POSITION_HEADER)
    if pos is None:
        return None  # not ours (a foreign producer's message)
    if wire.header(headers, wire.BACKFILL_HEADER) is not None:
        return None  # a backfill's position says nothing about what the stream produced
    control = wire.header(headers, wire.CONTROL_HEADER)
    snap = wire.header(headers, wire.SNAPSHOT_HEADER)
    return Tail(msg.offset(), wire.parse_position(pos), control.decode() if control else None,
                snap.decode() if snap else None, control is None and msg.value() is None)


def read_tails(conf: dict[str, Any], writers: Iterable[Writer], timeout: float = 30.0) -> dict[Writer, Tail | None]:
    """The last streamed (or initial-snapshot) walbridge message of each
    partition (None for partitions holding none); backfill messages are
    skipped."""
    return {w: tail for w, (_, _, tail) in read_partitions(conf, writers, timeout).items()}


def read_partitions(conf: dict[str, Any], writers: Iterable[Writer],
                    timeout: float = 30.0) -> dict[Writer, tuple[int, int, Tail | None]]:
    """Each partition's earliest offset, end offset and tail
    (:func:`read_tails`). Reads all partitions together, from just before the
    end to end-of-partition, widening the window backwards where only backfill
    or foreign messages were found."""
    writers = list(writers)
    consumer = scan_consumer(conf, "tail")
    try:
        bounds = {w: consumer.get_watermark_offsets(TopicPartition(*w), timeout=timeout) for w in writers}
        tails: dict[Writer, Tail | None] = {w: None for w in writers}
        window = 1
        todo = {w: (max(low, end - window), None) for w, (low, end) in bounds.items() if end > low}
        while todo:
            for msg in scan(consumer, todo, timeout):
                tail = _tail_of(msg)
                if tail is not None:
                    tails[(msg.topic(), msg.partition())] = tail
            window *= 8
            todo = {w: (max(bounds[w][0], bounds[w][1] - window), start)
                    for w, (start, _) in todo.items() if tails[w] is None and start > bounds[w][0]}
        return {w: (*bounds[w], tails[w]) for w in writers}
    finally:
        consumer.close()


def read_positions(conf: dict[str, Any], start_offsets: dict[Writer, int],
                   timeout: float = 60.0) -> dict[Writer, dict[int, int]]:
    """For each writer, read from ``start_offsets[writer]`` to the end and map
    each transaction (commit LSN) to the offset of its last message there."""
    consumer = scan_consumer(conf, "replay")
    result: dict[Writer, dict[int, int]] = defaultdict(dict)
    try:
        for msg in scan(consumer, {w: (o, None) for w, o in start_offsets.items()}, timeout):
            pos = wire.header(msg.headers(), wire.POSITION_HEADER)
            if pos is not None:
                result[(msg.topic(), msg.partition())][wire.parse_position(pos)[0]] = msg.offset()
        return dict(result)
    finally:
        consumer.close()


class DeliveryLedger:
    """Per-writer produce/delivery counts, and the Kafka offsets of messages that
    end a transaction on their writer (resolved when their delivery report
    arrives). Delivery order per partition equals produce order (idempotent
    producer), so counting deliveries identifies each message.

    Resolved boundaries are collected, not pushed: :meth:`take_boundaries`
    returns, per writer, the latest ``(kafka_offset, tx_last)`` resolved since
    the previous call. A later boundary of a writer implies every earlier one
    (its transaction's messages, and all before them, are in Kafka), so the
    shell handles one per writer per round instead of one per transaction and
    writer."""

    def __init__(self) -> None:
        self.produced: dict[Writer, int] = {}
        self.delivered: dict[Writer, int] = {}
        self.last_offset: dict[Writer, int] = {}
        # writer -> (produced count at the transaction's last message, tx_last), oldest first
        self._awaiting: dict[Writer, deque[tuple[int, Any]]] = {}
        self._resolved: dict[Writer, tuple[int, Any]] = {}
        self.error: KafkaError | None = None
        self.error_message: str | None = None

    def count_produce(self, writer: Writer) -> None:
        self.produced[writer] = self.produced.get(writer, 0) + 1

    def on_delivery(self, err: KafkaError | None, msg: Any) -> None:
        if err is not None:
            self.error = err
            self.error_message = f"delivery to {msg.topic()}[{msg.partition()}] failed: {err.str()}"
            return
        writer = (msg.topic(), msg.partition())
        n = self.delivered.get(writer, 0) + 1
        self.delivered[writer] = n
        offset = msg.offset()
        self.last_offset[writer] = offset
        awaiting = self._awaiting.get(writer)
        if awaiting and awaiting[0][0] == n:
            self._resolved[writer] = (offset, awaiting.popleft()[1])

    def end_transaction(self, writer: Writer, tx_last: Any) -> None:
        """Called at commit for each writer the transaction produced to."""
        seq = self.produced.get(writer, 0)
        awaiting = self._awaiting.get(writer)
        if self.delivered.get(writer, 0) == seq and not awaiting:
            self._resolved[writer] = (self.last_offset[writer], tx_last)
        elif awaiting is None:
            self._awaiting[writer] = deque([(seq, tx_last)])
        else:
            awaiting.append((seq, tx_last))

    def take_boundaries(self) -> list[tuple[Writer, int, Any]]:
        """``(writer, kafka_offset, tx_last)`` of the latest transaction end
        resolved on each writer since the previous call."""
        if not self._resolved:
            return []
        resolved = self._resolved
        self._resolved = {}
        return [(w, offset, tx_last) for w, (offset, tx_last) in resolved.items()]

    def in_flight(self) -> int:
        return sum(self.produced.values()) - sum(self.delivered.values())


class ReadChannel:
    """The producer of rows read whole (initial snapshot, backfills), beside
    the stream's.

    A read needs no offset, only the certainty that Kafka holds it, so
    librdkafka reports this producer's failed deliveries only
    (``delivery.report.only.error``): a report per row, which builds a Python
    ``Message`` and calls back into Python, cost as much as encoding the row.

    Invariants:
    - No failure goes unseen: every failed read reaches :meth:`_on_failure`
      when the producer is served, and :meth:`in_flight` (which serves it)
      raises the first one. ``in_flight() == 0`` therefore means every read
      sent so far is in Kafka.
    - A control event that must follow reads on their partitions (``snapshot_end``,
      ``backfill_end``) is sent, through the stream's producer, only once
      ``in_flight()`` is 0: the reads precede it in the log although the two
      producers' messages interleave otherwise (reads converge with live
      changes by position, not by order).
    - A full local queue waits here, serving ``on_full`` (the stream's
      keepalive) meanwhile: memory stays bounded.
    """

    def __init__(self, conf: dict[str, Any], on_full: Callable[[], None]):
        self.kafka = Producer({**producer_config(conf), "delivery.report.only.error": True,
                               "on_delivery": self._on_failure})
        self._on_full = on_full
        self.error: KafkaError | None = None

    def _on_failure(self, err: KafkaError | None, msg: Any) -> None:
        if err is not None and self.error is None:
            self.error = KafkaError(err.code(), f"delivery of a read to {msg.topic()}[{msg.partition()}] "
                                                f"failed: {err.str()}", fatal=err.fatal())

    def send(self, writer: Writer, key: bytes | None, value: bytes | None, headers: list) -> None:
        while True:
            try:
                self.kafka.produce(writer[0], value, key, partition=writer[1], headers=headers)
                return
            except BufferError:
                self.kafka.poll(0.05)
                self.raise_error()
                self._on_full()

    def send_all(self, messages: list, headers: list, events: dict) -> None:
        """:meth:`send` of the read encoder's ``(writer, key, value, stats key)``
        messages, each counted in ``events`` (unrolled: it runs once per row)."""
        produce = self.kafka.produce
        for writer, key, value, stat in messages:
            try:
                produce(writer[0], value, key, partition=writer[1], headers=headers)
            except BufferError:
                self.send(writer, key, value, headers)
            events[stat] += 1

    def in_flight(self) -> int:
        """Reads not yet in Kafka, after serving the producer; raises the
        first failed delivery."""
        self.kafka.poll(0)
        self.raise_error()
        return len(self.kafka)

    def raise_error(self) -> None:
        if self.error is not None:
            raise KafkaException(self.error)

    def flush(self, timeout: float) -> int:
        remaining = self.kafka.flush(timeout)
        self.raise_error()
        return remaining

    def close(self) -> None:
        """Drop what is still queued: it must never land after a restart's own messages."""
        try:
            self.kafka.purge()
            self.kafka.flush(0)
        except Exception:
            pass
