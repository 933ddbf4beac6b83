"""The dead-letter topic of a shape, ``<topic>.dlq``: where a message that
cannot be decoded goes, with its key, value and headers, plus
``wb.dlq.error``, ``wb.dlq.topic``, ``wb.dlq.partition`` and ``wb.dlq.offset``.

Invariants:
- A decode task flushes what it sent before it completes; a failed delivery
  fails the task (Spark retries it), so no undecodable message is passed
  over without its dead letter.
- The DLQ is at-least-once: a retried task or a batch decoded again (a new
  writer schema) may send a message again; readers deduplicate by the origin
  headers (:func:`read_dead_letters` returns what is there).
- One producer per Python worker and client configuration, reused across
  tasks; the DLQ topic is created (compacted settings of
  :data:`schemas.wire.DLQ_TOPIC_CONFIG`) once per worker.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from schemas import wire
from schemas.kafka import ensure_topics, read_to_end

log = logging.getLogger(__name__)

_producers: dict[str, Any] = {}  # per Python worker: client config -> producer
_topics_ready: set[tuple[str, str]] = set()


class DeadLetters:
    """Sends one shape's undecodable messages to ``<topic>.dlq``."""

    def __init__(self, topic: str, client_conf: dict[str, Any]):
        self.topic = wire.dlq_topic(topic)
        self._conf = client_conf
        self.sent = 0
        self._errors: list[str] = []

    def _producer(self) -> Producer:
        key = json.dumps(self._conf, sort_keys=True, default=str)
        producer = _producers.get(key)
        if producer is None:
            producer = _producers[key] = Producer({**self._conf, "enable.idempotence": True, "acks": "all",
                                                   "linger.ms": 5})
        if (key, self.topic) not in _topics_ready:
            ensure_topics(AdminClient(self._conf), [self.topic], partitions=1, replication=-1,
                          config=wire.DLQ_TOPIC_CONFIG)
            _topics_ready.add((key, self.topic))
        return producer

    def send(self, topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None,
             headers: list | None, error: str) -> None:
        headers = list(headers or []) + [
            (wire.DLQ_ERROR_HEADER, error.encode()), (wire.DLQ_TOPIC_HEADER, topic.encode()),
            (wire.DLQ_PARTITION_HEADER, str(partition).encode()), (wire.DLQ_OFFSET_HEADER, str(offset).encode())]
        log.warning("%s[%d]@%d cannot be decoded (%s): sent to %s", topic, partition, offset, error, self.topic)
        producer = self._producer()

        def delivered(err, _msg) -> None:
            if err is not None:
                self._errors.append(err.str())

        while True:
            try:
                producer.produce(self.topic, value=value, key=key, headers=headers, on_delivery=delivered)
                break
            except BufferError:
                producer.poll(0.1)
        producer.poll(0)
        self.sent += 1

    def flush(self, timeout: float = 60.0) -> None:
        if not self.sent:
            return
        producer = self._producer()
        if producer.flush(timeout):
            raise RuntimeError(f"could not deliver {len(producer)} message(s) to {self.topic} in {timeout}s")
        if self._errors:
            raise RuntimeError(f"delivery to {self.topic} failed: {self._errors[0]}")


@dataclass(frozen=True)
class DeadLetter:
    offset: int
    key: bytes | None
    value: bytes | None
    error: str
    origin: tuple[str, int, int]  # topic, partition, offset
    headers: dict[str, bytes]


def read_dead_letters(bootstrap_servers: str, topic: str, kafka_client: dict[str, Any] | None = None,
                      timeout: float = 30.0) -> list[DeadLetter]:
    """Every message in ``<topic>.dlq`` (empty when it does not exist)."""
    out = []
    for msg in read_to_end({"bootstrap.servers": bootstrap_servers, **(kafka_client or {})}, wire.dlq_topic(topic),
                           "dlq", timeout):
        h = dict(msg.headers() or [])
        out.append(DeadLetter(msg.offset(), msg.key(), msg.value(), h.get(wire.DLQ_ERROR_HEADER, b"").decode(),
                              (h.get(wire.DLQ_TOPIC_HEADER, b"").decode(), int(h.get(wire.DLQ_PARTITION_HEADER, b"-1")),
                               int(h.get(wire.DLQ_OFFSET_HEADER, b"-1"))), h))
    return sorted(out, key=lambda d: d.offset)
