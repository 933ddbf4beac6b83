"""The Confluent Schema Registry, as every walbridge process reaches it.

Invariants:
- One client per URL per process, so a ``mock://`` registry (which lives in
  one process) is shared by the producer, the consumer's driver and tests.
- A subject that does not exist yet has no versions: ``[]``, not an error.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.error import SchemaRegistryError

_clients: dict[str, SchemaRegistryClient] = {}
_lock = threading.Lock()


def registry_client(url: str, extra: dict[str, Any] | None = None) -> SchemaRegistryClient:
    with _lock:
        if url not in _clients:
            _clients[url] = SchemaRegistryClient.new_client({"url": url, **(extra or {})})
        return _clients[url]


def subject_versions(url: str, subject: str) -> list[tuple[int, int, dict]]:
    """``(version, schema id, schema)`` of every version of ``subject``, oldest first."""
    client = registry_client(url)
    try:
        found = [client.get_version(subject, v) for v in client.get_versions(subject)]
    except SchemaRegistryError as e:
        if e.http_status_code == 404:
            return []
        raise
    return sorted(((r.version, r.schema_id, json.loads(r.schema.schema_str)) for r in found), key=lambda t: t[0])
