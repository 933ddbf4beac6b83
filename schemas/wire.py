"""How walbridge messages look on the wire, for producers and consumers alike.

Invariants:
- A message value (and key) is Avro binary data behind one of two standard
  prefixes, so stock tools can decode it:
  * Confluent wire format, when a Schema Registry is configured:
    ``0x00`` + 4-byte big-endian schema id + Avro body.
  * Avro single-object encoding, without a registry: ``0xC3 0x01`` + the 8-byte
    little-endian CRC-64-AVRO fingerprint of the writer schema + Avro body. The
    schema itself is published, keyed by its fingerprint (hex), to the topic
    ``<topic_prefix>._schemas`` before any message uses it.
- Every message carries the header ``wb.pos``: its position as two big-endian
  unsigned 64-bit integers (commit LSN, op index). Within a partition the
  positions of streamed changes never decrease. Snapshot and backfill reads
  carry their snapshot's position and the header ``wb.snapshot`` (the
  snapshot's or backfill's id); backfill reads and ``backfill_end`` also carry
  ``wb.backfill`` (the backfill id). A backfill runs while the stream goes on, so
  its messages sit among streamed changes of higher *and* lower positions: they
  never count as a partition's streamed position.
- Control events (``snapshot_end``, ``backfill_end``) are Kafka tombstones (null
  key, null value) with a ``wb.control`` header naming the event and a
  ``wb.control.info`` header holding a small JSON object. Debezium-envelope
  consumers skip tombstones, so they ignore control events safely.
"""

from __future__ import annotations

import json
import struct
from typing import Any, NamedTuple

from fastavro import parse_schema
from fastavro.schema import fingerprint, to_parsing_canonical_form

CONFLUENT_MAGIC = 0x00
SINGLE_OBJECT_MAGIC = b"\xc3\x01"
POSITION_HEADER = "wb.pos"
CONTROL_HEADER = "wb.control"
CONTROL_INFO_HEADER = "wb.control.info"
SNAPSHOT_HEADER = "wb.snapshot"
BACKFILL_HEADER = "wb.backfill"
SCHEMAS_TOPIC_SUFFIX = "._schemas"

_POS = struct.Struct(">QQ")
_CONFLUENT = struct.Struct(">bI")


def schema_fingerprint(schema: dict | list | str) -> bytes:
    """CRC-64-AVRO fingerprint (8 bytes, little-endian as single-object encoding wants)."""
    canonical = to_parsing_canonical_form(parse_schema(schema, _write_hint=False))
    return bytes.fromhex(fingerprint(canonical, "CRC-64-AVRO"))


def canonical_json(schema: dict | list | str) -> str:
    return json.dumps(schema, separators=(",", ":"), sort_keys=False)


def single_object_prefix(fp: bytes) -> bytes:
    return SINGLE_OBJECT_MAGIC + fp


def confluent_prefix(schema_id: int) -> bytes:
    return _CONFLUENT.pack(CONFLUENT_MAGIC, schema_id)


class SchemaRef(NamedTuple):
    kind: str  # "confluent" or "single-object"
    ref: int | bytes  # registry schema id, or the fingerprint
    body_offset: int


def parse_prefix(data: bytes) -> SchemaRef:
    """Which writer schema a value or key was written with. Raises ValueError
    for anything that is neither wire format."""
    if len(data) >= 10 and data[:2] == SINGLE_OBJECT_MAGIC:
        return SchemaRef("single-object", bytes(data[2:10]), 10)
    if len(data) >= 5 and data[0] == CONFLUENT_MAGIC:
        return SchemaRef("confluent", _CONFLUENT.unpack_from(data)[1], 5)
    head = bytes(data[:10]).hex() if data else "(empty)"
    raise ValueError(f"not a walbridge Avro message: unknown wire prefix {head}")


def position_header(tx_offset: int, op_offset: int) -> bytes:
    return _POS.pack(tx_offset, op_offset)


def parse_position(value: bytes) -> tuple[int, int]:
    return _POS.unpack(value)


def header(headers: list[tuple[str, Any]] | None, name: str) -> bytes | None:
    for key, value in headers or ():
        if key == name:
            return value
    return None
