"""Decoding walbridge messages with stock parts: finds each message's writer
schema (Schema Registry by id, or the ``<prefix>._schemas`` topic by
fingerprint) and reads the Avro body with fastavro. The other side of
:mod:`schemas.publisher`.

Invariants:
- A writer schema is looked up once per id/fingerprint and cached; an unknown
  fingerprint triggers one re-read of the schemas topic before it is an error.
- Decoding never guesses: data in neither wire format, or with a schema that
  cannot be found, raises ``ValueError`` naming the problem.
"""

from __future__ import annotations

import io
import json
import threading
from typing import Any

from fastavro import parse_schema, schemaless_reader

from schemas import wire
from schemas.kafka import read_to_end
from schemas.registry import RegistryConf, registry_client


def read_schemas_topic(conf: dict[str, Any], schemas_topic: str,
                       timeout: float = 30.0) -> list[tuple[str, str, dict]]:
    """``(subject, fingerprint hex, schema)`` of every record of the schemas
    topic, in publication order (read to end-of-partition, as it is reported
    by Fetch)."""
    out: list[tuple[int, int, str, str, dict]] = []
    for msg in read_to_end(conf, schemas_topic, "schemas", timeout):
        subject = wire.header(msg.headers(), wire.SUBJECT_HEADER)
        if subject is None or msg.key() is None or msg.value() is None:
            continue
        out.append((msg.partition(), msg.offset(), subject.decode(), msg.key().decode(), json.loads(msg.value())))
    out.sort(key=lambda r: (r[0], r[1]))
    return [(subject, fp, schema) for _, _, subject, fp, schema in out]


class SchemaResolver:
    def __init__(self, kafka_conf: dict[str, Any] | None = None, topic_prefix: str | None = None,
                 registry: RegistryConf | str | None = None):
        self._kafka_conf = kafka_conf
        self._schemas_topic = wire.schemas_topic(topic_prefix) if topic_prefix else None
        self._registry = registry
        self._by_id: dict[int, Any] = {}
        self._by_fp: dict[bytes, Any] = {}
        self._raw_by_fp: dict[bytes, dict] = {}
        self._lock = threading.Lock()

    def writer_schema(self, ref: wire.SchemaRef) -> Any:
        if ref.kind == "confluent":
            parsed = self._by_id.get(ref.ref)
            if parsed is None:
                parsed = self._by_id[ref.ref] = parse_schema(json.loads(self._registry_schema(ref.ref)))
            return parsed
        parsed = self._by_fp.get(ref.ref)
        if parsed is None:
            with self._lock:
                if ref.ref not in self._by_fp:
                    self._load_schemas_topic()
                parsed = self._by_fp.get(ref.ref)
            if parsed is None:
                raise ValueError(f"unknown schema fingerprint {ref.ref.hex()} (not in {self._schemas_topic})")
        return parsed

    def raw_schema(self, data: bytes) -> dict:
        """The writer schema (as JSON) of an encoded key or value. A registry
        that does not know the id raises its own ``SchemaRegistryError``."""
        ref = wire.parse_prefix(data)
        if ref.kind == "confluent":
            return json.loads(self._registry_schema(ref.ref))
        self.writer_schema(ref)
        return self._raw_by_fp[ref.ref]

    def _registry_schema(self, schema_id: int) -> str:
        if not self._registry:
            raise ValueError(f"message uses registry schema id {schema_id} but no schema registry is configured")
        return registry_client(self._registry).get_schema(schema_id).schema_str

    def _load_schemas_topic(self) -> None:
        if not self._schemas_topic or self._kafka_conf is None:
            raise ValueError("single-object encoded message but no schemas topic is configured")
        for _, fp_hex, raw in read_schemas_topic(self._kafka_conf, self._schemas_topic):
            fp = bytes.fromhex(fp_hex)
            if fp not in self._by_fp:
                self._raw_by_fp[fp] = raw
                self._by_fp[fp] = parse_schema(raw)

    def decode(self, data: bytes | None) -> Any:
        """Decode a key or value; None stays None (keyless keys, control events)."""
        if data is None:
            return None
        ref = wire.parse_prefix(data)
        schema = self.writer_schema(ref)
        return schemaless_reader(io.BytesIO(data[ref.body_offset:]), schema, None)
