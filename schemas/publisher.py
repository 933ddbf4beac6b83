"""Publishing writer schemas, so that every message can be decoded by stock tools.

Invariants:
- A schema is findable before the first message that uses it is produced:
  registered in the Schema Registry (Confluent wire format), or, without one,
  delivered to ``<prefix>._schemas`` keyed by its fingerprint (single-object
  encoding) — :mod:`schemas.reader` is the other side of both.
- Each (subject, schema) is published once per publisher; the wire prefix is cached.
"""

from __future__ import annotations

import time

from confluent_kafka import KafkaException, Producer
from confluent_kafka.schema_registry import Schema

from schemas import wire
from schemas.kafka import timed_out
from schemas.registry import registry_client

PUBLISH_TIMEOUT_S = 30.0


class SchemaPublisher:
    """Makes writer schemas findable and returns the wire prefix to use."""

    def __init__(self, producer: Producer, topic_prefix: str, registry_url: str | None):
        self._producer = producer
        self._schemas_topic = wire.schemas_topic(topic_prefix)
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
            schema_id = self._registry.register_schema(subject, Schema(text, "AVRO"))
            prefix = wire.confluent_prefix(schema_id)
        else:
            fp = wire.schema_fingerprint(schema)
            outcome: list = []
            self._producer.produce(self._schemas_topic, key=fp.hex().encode(), value=text.encode(),
                                   headers=[(wire.SUBJECT_HEADER, subject.encode())],
                                   on_delivery=lambda err, msg: outcome.append(err))
            # Wait for this message only: a flush() would also wait for every
            # change still queued (a new relation mid-stream stalls the stream).
            deadline = time.monotonic() + PUBLISH_TIMEOUT_S
            while not outcome and time.monotonic() < deadline:
                self._producer.poll(0.05)
            if not outcome:
                raise timed_out(f"could not publish schema for {subject} to {self._schemas_topic}")
            if outcome[0] is not None:
                raise KafkaException(outcome[0])
            prefix = wire.single_object_prefix(fp)
        self._prefixes[(subject, text)] = prefix
        return prefix
