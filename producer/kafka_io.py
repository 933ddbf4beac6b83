"""Kafka shell of the producer: topics, schema publication, partition tails and
the idempotent producer with its delivery bookkeeping.

Invariants:
- The producer is idempotent with ``acks=all``; a delivery error is fatal (the
  process stops and resumes from the slot, which never passed undelivered data).
- Messages are placed on partitions by walbridge itself (CRC-32 of the Avro key
  body, like librdkafka's ``consistent`` partitioner; keyless rows by position),
  so a replayed change lands on the partition it landed on before.
- Partition tails are found by reading, never by trusting the broker's reported
  end offset (Tansu reports the last batch's base offset + 1): reading starts a
  little before the reported end and goes until end-of-partition.
- A writer schema is published (registry, or the ``<prefix>._schemas`` topic,
  flushed) before the first message that uses it is produced.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
import zlib
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any, Iterable

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from schemas import wire

log = logging.getLogger(__name__)

Writer = tuple[str, int]


def client_config(bootstrap: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    conf: dict[str, Any] = {"bootstrap.servers": bootstrap}
    conf.update(extra or {})
    return conf


def producer_config(base: dict[str, Any]) -> dict[str, Any]:
    conf = dict(base)
    conf.setdefault("enable.idempotence", True)
    conf.setdefault("acks", "all")
    # Batching decides broker throughput (Tansu serves 1-record batches ~30x slower).
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


def partition_for(key_body: bytes | None, fallback: int, partitions: int) -> int:
    if key_body is None:
        return fallback % partitions
    return zlib.crc32(key_body) % partitions


def ensure_topics(admin: AdminClient, topics: Iterable[str], partitions: int, replication: int,
                  config: dict[str, str] | None = None, timeout: float = 30.0) -> dict[str, int]:
    """Create missing topics; returns each topic's actual partition count."""
    topics = list(dict.fromkeys(topics))
    existing = admin.list_topics(timeout=timeout).topics
    missing = [t for t in topics if t not in existing]
    if missing:
        futures = admin.create_topics(
            [NewTopic(t, num_partitions=partitions, replication_factor=replication, config=config or {})
             for t in missing], request_timeout=timeout)
        for topic, fut in futures.items():
            try:
                fut.result()
                log.info("created topic %s with %d partitions", topic, partitions)
            except KafkaException as e:
                if e.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                    raise
    deadline = time.monotonic() + timeout
    while True:
        meta = admin.list_topics(timeout=timeout).topics
        counts = {t: len(meta[t].partitions) for t in topics if t in meta and meta[t].partitions}
        if len(counts) == len(topics) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    absent = [t for t in topics if t not in counts]
    if absent:
        raise RuntimeError(f"topics not visible after creation: {', '.join(absent)}")
    return counts


@dataclass(frozen=True)
class Tail:
    """The last walbridge message of a partition."""

    offset: int
    position: tuple[int, int]
    control: str | None  # e.g. "snapshot_end" when the last message is a control event
    snapshot_id: str | None  # set on snapshot reads


def scan_consumer(conf: dict[str, Any], purpose: str) -> Consumer:
    # A scan ends at end-of-partition, which an empty fetch reports: the broker
    # must not hold that fetch for the default 500 ms (each restart reads the
    # partition tails and the backfill requests this way).
    return Consumer({"fetch.wait.max.ms": 10, **conf, "group.id": f"walbridge-{purpose}-{uuid.uuid4().hex}",
                     "enable.auto.commit": False, "enable.partition.eof": True, "auto.offset.reset": "earliest"})


def _scan(consumer: Consumer, ranges: dict[Writer, tuple[int, int | None]], timeout: float):
    """Yield the messages of several partitions at once, each from its start to
    its stop (exclusive) or to end-of-partition (stop None). Order is per
    partition only."""
    if not ranges:
        return
    consumer.assign([TopicPartition(t, p, start if start > 0 else OFFSET_BEGINNING)
                     for (t, p), (start, _) in ranges.items()])
    open_ = set(ranges)
    deadline = time.monotonic() + timeout
    try:
        while open_:
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading {len(open_)} partition(s) timed out, e.g. {next(iter(open_))}")
            msg = consumer.poll(0.2)
            if msg is None:
                continue
            writer = (msg.topic(), msg.partition())
            if msg.error():
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    open_.discard(writer)
                    continue
                raise KafkaException(msg.error())
            if writer not in open_:
                continue
            stop = ranges[writer][1]
            if stop is not None and msg.offset() >= stop:
                open_.discard(writer)
                continue
            yield msg
    finally:
        consumer.unassign()


def read_to_end(conf: dict[str, Any], topic: str, purpose: str = "read", timeout: float = 30.0):
    """Every message of every partition of ``topic``, from the beginning to
    end-of-partition (as Fetch reports it); nothing if the topic does not exist."""
    consumer = scan_consumer(conf, purpose)
    try:
        meta = consumer.list_topics(topic, timeout=timeout).topics.get(topic)
        if meta is None or meta.error is not None or not meta.partitions:
            return
        yield from _scan(consumer, {(topic, p): (0, None) for p in sorted(meta.partitions)}, timeout)
    finally:
        consumer.close()


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
                snap.decode() if snap else None)


def read_tails(conf: dict[str, Any], writers: Iterable[Writer], timeout: float = 30.0) -> dict[Writer, Tail | None]:
    """The last streamed (or initial-snapshot) walbridge message of each
    partition (None for partitions holding none); backfill messages are
    skipped. Reads all partitions together, from a little before the reported end
    (which may be too low) to end-of-partition, widening the window backwards
    where only foreign messages were found."""
    writers = list(writers)
    consumer = scan_consumer(conf, "tail")
    try:
        bounds = {}
        for w in writers:
            low, reported_end = consumer.get_watermark_offsets(TopicPartition(*w), timeout=timeout)
            bounds[w] = (low, max(reported_end, low + 1))
        tails: dict[Writer, Tail | None] = {w: None for w in writers}
        window = 1
        todo = {w: (max(low, end - window), None) for w, (low, end) in bounds.items()}
        while todo:
            for msg in _scan(consumer, todo, timeout):
                tail = _tail_of(msg)
                if tail is not None:
                    tails[(msg.topic(), msg.partition())] = tail
            window *= 8
            todo = {w: (max(bounds[w][0], bounds[w][1] - window), start)
                    for w, (start, _) in todo.items() if tails[w] is None and start > bounds[w][0]}
        return tails
    finally:
        consumer.close()


def read_positions(conf: dict[str, Any], start_offsets: dict[Writer, int],
                   timeout: float = 60.0) -> dict[Writer, dict[int, int]]:
    """For each writer, read from ``start_offsets[writer]`` to the end and map
    each transaction (commit LSN) to the offset of its last message there."""
    consumer = scan_consumer(conf, "replay")
    result: dict[Writer, dict[int, int]] = defaultdict(dict)
    try:
        for msg in _scan(consumer, {w: (o, None) for w, o in start_offsets.items()}, timeout):
            pos = wire.header(msg.headers(), wire.POSITION_HEADER)
            if pos is not None:
                result[(msg.topic(), msg.partition())][wire.parse_position(pos)[0]] = msg.offset()
        return dict(result)
    finally:
        consumer.close()


def group_offsets(admin: AdminClient, groups: Iterable[str], writers: list[Writer],
                  timeout: float = 10.0) -> dict[str, dict[Writer, int]]:
    """Each group's committed offset (the next offset it will read) per
    writer; 0 where the group has committed nothing."""
    from confluent_kafka import ConsumerGroupTopicPartitions

    result: dict[str, dict[Writer, int]] = {}
    for group in groups:
        req = [ConsumerGroupTopicPartitions(group, [TopicPartition(t, p) for t, p in writers])]
        res = admin.list_consumer_group_offsets(req, request_timeout=timeout)[group].result()
        result[group] = {(tp.topic, tp.partition): max(tp.offset, 0) for tp in res.topic_partitions}
    return result


_registry_clients: dict[str, Any] = {}
_registry_lock = threading.Lock()


def registry_client(url: str, extra: dict[str, Any] | None = None):
    """One client per URL per process (so ``mock://`` registries are shared
    in-process by producer, consumer and tests)."""
    from confluent_kafka.schema_registry import SchemaRegistryClient

    with _registry_lock:
        if url not in _registry_clients:
            _registry_clients[url] = SchemaRegistryClient.new_client({"url": url, **(extra or {})})
        return _registry_clients[url]


class SchemaPublisher:
    """Makes writer schemas findable and returns the wire prefix to use."""

    def __init__(self, producer: Producer, topic_prefix: str, registry_url: str | None):
        self._producer = producer
        self._schemas_topic = topic_prefix + wire.SCHEMAS_TOPIC_SUFFIX
        self._registry = registry_client(registry_url) if registry_url else None
        self._prefixes: dict[tuple[str, str], bytes] = {}

    @property
    def schemas_topic(self) -> str | None:
        return None if self._registry else self._schemas_topic

    def prefix(self, subject: str, schema: dict) -> bytes:
        text = wire.canonical_json(schema)
        cached = self._prefixes.get((subject, text))
        if cached is not None:
            return cached
        if self._registry is not None:
            from confluent_kafka.schema_registry import Schema

            schema_id = self._registry.register_schema(subject, Schema(text, "AVRO"))
            prefix = wire.confluent_prefix(schema_id)
        else:
            fp = wire.schema_fingerprint(schema)
            outcome: list = []
            self._producer.produce(self._schemas_topic, key=fp.hex().encode(), value=text.encode(),
                                   headers=[("wb.subject", subject.encode())],
                                   on_delivery=lambda err, msg: outcome.append(err))
            # Wait for this message only: a flush() would also wait for every
            # change still queued (a new relation mid-stream stalls the stream).
            deadline = time.monotonic() + 30
            while not outcome and time.monotonic() < deadline:
                self._producer.poll(0.05)
            if not outcome or outcome[0] is not None:
                raise RuntimeError(f"could not publish schema for {subject} to {self._schemas_topic}"
                                   + (f": {outcome[0].str()}" if outcome else ""))
            prefix = wire.single_object_prefix(fp)
        self._prefixes[(subject, text)] = prefix
        return prefix


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
