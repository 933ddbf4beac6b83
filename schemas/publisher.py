"""Publishing writer schemas, so that every message can be decoded by stock tools.

Invariants:
- A schema is findable before the first message that uses it is produced:
  registered in the Schema Registry under the subject its strategy names
  (:mod:`schemas.registry`; Confluent wire format), or, without one,
  delivered to ``<prefix>._schemas`` keyed by its fingerprint with the
  subject ``<topic>-key``/``<topic>-value`` (``io.walbridge.ControlKey`` for
  the control key) in ``wb.subject`` (single-object encoding) —
  :mod:`schemas.reader` is the other side of both.
- Each (subject, schema) is published once per publisher; the wire prefix is
  cached once the schema is findable. Within :meth:`SchemaPublisher.together`
  the schemas topic's messages are sent at its end, in the order asked, and
  their prefixes cached only once all are acknowledged (a key schema is
  still in Kafka before its value schema: one partition, one idempotent
  producer); no message may use them before then.
- A registry that refuses a schema (incompatible with the subject's latest
  version, no permission) stops the producer with the subject and the
  registry's own reason, the registry's URL shown without credentials.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from confluent_kafka import Producer
from confluent_kafka.schema_registry import Schema
from confluent_kafka.schema_registry.error import SchemaRegistryError

import schemas
from schemas import wire
from schemas.config import redact_dsn
from schemas.failures import REGISTRY, Failure
from schemas.kafka import Headers, produce_all_acknowledged
from schemas.reader import read_schemas_topic
from schemas.registry import RegistryConf, control_key_subject, registry_client, subject_name, subject_versions

PUBLISH_TIMEOUT_S = 30.0

CONTROL_KEY_SCHEMA = schemas.load("control_key")


class SchemaRegistrationError(Failure):
    """The Schema Registry refused a writer schema (incompatible or invalid):
    permanent, a ``registry`` failure (exit code 4)."""

    def __init__(self, problem: str, fix: str, address: str | None):
        super().__init__(REGISTRY, problem, fix, address=address)


class SchemaPublisher:
    """Makes writer schemas findable and returns the wire prefix to use."""

    def __init__(self, producer: Producer, topic_prefix: str, registry: RegistryConf | None,
                 strategy: str = "topic"):
        self._producer = producer
        self._schemas_topic = wire.schemas_topic(topic_prefix)
        self._registry = registry_client(registry) if registry else None
        self._registry_conf = registry
        self._registry_url = redact_dsn(str(registry["url"])) if registry else None
        self._strategy = strategy
        self._prefixes: dict[tuple[str, str], bytes] = {}
        # Inside together(): (subject, text) -> prefix and message, sent at its end.
        self._together: dict[tuple[str, str], tuple[bytes, tuple[str, bytes, bytes, Headers]]] | None = None

    @property
    def schemas_topic(self) -> str | None:
        return None if self._registry else self._schemas_topic

    def prefix(self, topic: str, schema: dict, is_key: bool = False) -> bytes:
        """The wire prefix of a data topic's key or value schema."""
        return self._publish(self._subject(topic, is_key), schema)

    @contextmanager
    def together(self) -> Iterator[None]:
        """The schemas-topic publishes asked for within, sent together at the
        end and waited for at once: a snapshot of many shapes pays one linger
        and round trip, not one per schema (a registry is still asked one
        schema at a time)."""
        self._together = pending = {}
        try:
            yield
            if pending:
                produce_all_acknowledged(self._producer, [message for _, message in pending.values()],
                                         PUBLISH_TIMEOUT_S, f"publishing {len(pending)} schemas")
                self._prefixes.update({k: prefix for k, (prefix, _) in pending.items()})
        finally:
            self._together = None

    def _subject(self, topic: str, is_key: bool) -> str:
        if self._registry is not None:
            return subject_name(self._strategy, topic, wire.record_names(topic)[1 if is_key else 0], is_key)
        return f"{topic}-{'key' if is_key else 'value'}"

    def latest(self, conf: dict, topics: list[str]) -> dict[str, tuple[int, dict, dict | None]]:
        """The newest published (value, key) writer schemas of each data topic
        that has a value schema: topic → (publication order across topics,
        value schema, key schema or None). Read from the registry's latest
        versions (ordered by schema id), or from the schemas topic (``conf``:
        a Kafka client's settings)."""
        subjects = {self._subject(t, k): (t, k) for t in topics for k in (False, True)}
        found: dict[tuple[str, bool], tuple[int, dict]] = {}
        if self._registry is not None:
            for subject, which in subjects.items():
                versions = subject_versions(self._registry_conf, subject)
                if versions:
                    found[which] = versions[-1][1:]
        else:
            for order, (subject, _, schema) in enumerate(read_schemas_topic(conf, self._schemas_topic)):
                if subject in subjects:
                    found[subjects[subject]] = (order, schema)
        return {t: (found[(t, False)][0], found[(t, False)][1], found.get((t, True), (0, None))[1])
                for t in topics if (t, False) in found}

    def control_key_prefix(self, topic: str) -> bytes:
        """The wire prefix of the control-event key on ``topic``."""
        subject = (control_key_subject(self._strategy, topic) if self._registry is not None
                   else wire.CONTROL_KEY_RECORD)
        return self._publish(subject, CONTROL_KEY_SCHEMA)

    def _publish(self, subject: str, schema: dict) -> bytes:
        text = wire.canonical_json(schema)
        cached = self._prefixes.get((subject, text))
        if cached is not None:
            return cached
        if self._registry is not None:
            try:
                schema_id = self._registry.register_schema(subject, Schema(text, "AVRO"))
            except SchemaRegistryError as e:
                if e.http_status_code not in (409, 422):
                    raise  # credentials, availability: judged by schemas.failures
                raise SchemaRegistrationError(
                    f"refused the schema of subject {subject!r} (HTTP {e.http_status_code}, error {e.error_code}): "
                    f"{e.error_message}",
                    "HTTP 409 is the subject's compatibility level refusing the table's new schema: set the "
                    "subject's compatibility (PUT /config/<subject>) to one this change meets, or NONE",
                    self._registry_url) from None
            prefix = wire.confluent_prefix(schema_id)
        else:
            fp = wire.schema_fingerprint(schema)
            prefix = wire.single_object_prefix(fp)
            message = (self._schemas_topic, text.encode(), fp.hex().encode(), [(wire.SUBJECT_HEADER, subject.encode())])
            if self._together is not None:
                self._together.setdefault((subject, text), (prefix, message))
                return prefix
            produce_all_acknowledged(self._producer, [message], PUBLISH_TIMEOUT_S, f"publishing the schema of {subject}")
        self._prefixes[(subject, text)] = prefix
        return prefix
