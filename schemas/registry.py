"""The Confluent Schema Registry, as every walbridge process reaches it: the
client, and which subject each writer schema is registered under.

Invariants:
- A registry is given as the client's settings (``url`` plus credentials and
  TLS settings, see ``KafkaConfig.registry_client_config``); a bare URL is
  short for ``{"url": url}``. Credentials never appear in a message: URLs are
  shown through :func:`schemas.config.redact_dsn`.
- One client per settings per process, so a ``mock://`` registry (which lives
  in one process) is shared by the producer, the consumer's driver and tests.
- Subjects follow the configured strategy with confluent-kafka's own
  functions: ``topic`` (``<topic>-key|value``), ``record`` (the record's full
  name) or ``topic_record`` (``<topic>-<record full name>``). A data topic's
  records are named after the topic (:func:`schemas.wire.record_names`), so
  every strategy gives each topic's key and value subjects of their own.
- The control-event key (``io.walbridge.ControlKey``) is never registered
  under ``<topic>-key``, where it would break the key subject's compatibility:
  with the ``topic`` strategy it goes under its record name.
- A subject that does not exist yet has no versions: ``[]``, not an error.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from confluent_kafka.schema_registry import (
    SchemaRegistryClient,
    record_subject_name_strategy,
    topic_record_subject_name_strategy,
    topic_subject_name_strategy,
)
from confluent_kafka.schema_registry.error import SchemaRegistryError
from confluent_kafka.serialization import MessageField, SerializationContext

from schemas import wire

_clients: dict[str, SchemaRegistryClient] = {}
_lock = threading.Lock()

STRATEGIES = {"topic": topic_subject_name_strategy, "record": record_subject_name_strategy,
              "topic_record": topic_record_subject_name_strategy}

RegistryConf = dict[str, Any]


def _conf(registry: RegistryConf | str) -> RegistryConf:
    return {"url": registry} if isinstance(registry, str) else registry


def registry_client(registry: RegistryConf | str) -> SchemaRegistryClient:
    conf = _conf(registry)
    key = json.dumps(conf, sort_keys=True, default=str)
    with _lock:
        if key not in _clients:
            _clients[key] = SchemaRegistryClient.new_client(dict(conf))
        return _clients[key]


def subject_name(strategy: str, topic: str, record_name: str, is_key: bool) -> str:
    ctx = SerializationContext(topic, MessageField.KEY if is_key else MessageField.VALUE)
    return STRATEGIES[strategy](ctx, record_name)


def data_subjects(strategy: str, topic: str) -> tuple[str, str]:
    """``(value subject, key subject)`` of a data topic."""
    envelope, key = wire.record_names(topic)
    return subject_name(strategy, topic, envelope, False), subject_name(strategy, topic, key, True)


def control_key_subject(strategy: str, topic: str) -> str:
    return subject_name("record" if strategy == "topic" else strategy, topic, wire.CONTROL_KEY_RECORD, True)


def subject_versions(registry: RegistryConf | str, subject: str) -> list[tuple[int, int, dict]]:
    """``(version, schema id, schema)`` of every version of ``subject``, oldest first."""
    client = registry_client(registry)
    try:
        found = [client.get_version(subject, v) for v in client.get_versions(subject)]
    except SchemaRegistryError as e:
        if e.http_status_code == 404:
            return []
        raise
    return sorted(((r.version, r.schema_id, json.loads(r.schema.schema_str)) for r in found), key=lambda t: t[0])
