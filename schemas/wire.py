"""How walbridge messages look on the wire, for producers and consumers alike.

Invariants:
- A message value (and key) is Avro binary data behind one of two standard
  prefixes, so stock tools can decode it:
  * Confluent wire format, when a Schema Registry is configured:
    ``0x00`` + 4-byte big-endian schema id + Avro body.
  * Avro single-object encoding, without a registry: ``0xC3 0x01`` + the 8-byte
    little-endian CRC-64-AVRO fingerprint of the writer schema + Avro body. The
    schema itself is published, keyed by its fingerprint (hex), to the topic
    ``<topic_prefix>._schemas`` before any message uses it. The fingerprint is
    of the schema's whole JSON text: two writer schemas that differ only in a
    logical type (numeric(10,2) → numeric(10,0), timestamp → timestamptz)
    never share one, so each message names the schema it was written with.
- Every message carries the header ``wb.pos``: its position as two big-endian
  unsigned 64-bit integers (commit LSN, op index). Within a partition the
  positions of streamed changes never decrease. Snapshot and backfill reads
  carry their snapshot's position and the header ``wb.snapshot`` (the
  snapshot's or backfill's id); backfill reads and ``backfill_end`` also carry
  ``wb.backfill`` (the backfill id). A backfill runs while the stream goes on, so
  its messages sit among streamed changes of higher *and* lower positions: they
  never count as a partition's streamed position.
- Control events (``snapshot_end``, ``backfill_end``) are Kafka tombstones (null
  value) with a ``wb.control`` header naming the event and a
  ``wb.control.info`` header holding a small JSON object. Debezium-envelope
  consumers skip tombstones, so they ignore control events safely. Their key
  (so that compacted topics accept them), and a truncate's, is an Avro
  ``io.walbridge.ControlKey`` record (``schemas/control_key.avsc``: the event
  and its snapshot/backfill id, or the truncate's position) in the topic's
  wire format.
- A delete is followed, on its key's partition and with its position, by a
  tombstone (the key, null value, no ``wb.control``) unless ``[kafka]
  tombstones_on_delete = false``; consumers skip it. A primary-key change is a
  delete of the old key carrying the new key in ``__debezium.newkey`` and a
  create of the new one carrying the old key in ``__debezium.oldkey``
  (Debezium's headers; the key bytes as written).
- Avro record names follow the topic: a data topic's records are
  ``<namespace>.Envelope`` and ``<namespace>.Key``, the namespace being the
  topic name with every character Avro does not allow replaced by ``_``.
- A consumer group's offset commit carries, as its per-partition metadata,
  ``wb.topic_id=<id>``: the id of the topic incarnation the offset was read
  from. An offset whose metadata names another id is not progress on the
  topic as it is now (the topic was re-created since).
"""

from __future__ import annotations

import json
import re
import struct
import uuid
from typing import Any, NamedTuple

from fastavro.schema import fingerprint

CONFLUENT_MAGIC = 0x00
SINGLE_OBJECT_MAGIC = b"\xc3\x01"

# Headers of data topics.
POSITION_HEADER = "wb.pos"
CONTROL_HEADER = "wb.control"
CONTROL_INFO_HEADER = "wb.control.info"
SNAPSHOT_HEADER = "wb.snapshot"
BACKFILL_HEADER = "wb.backfill"
# Header of ``<prefix>._schemas`` records: the subject (``<topic>-value``/``-key``).
SUBJECT_HEADER = "wb.subject"
# Headers a dead letter gets on top of its original ones: why, and where it was.
DLQ_ERROR_HEADER = "wb.dlq.error"
DLQ_TOPIC_HEADER = "wb.dlq.topic"
DLQ_PARTITION_HEADER = "wb.dlq.partition"
DLQ_OFFSET_HEADER = "wb.dlq.offset"

# The envelope's ``op``: insert, update, delete, snapshot/backfill read, truncate.
OPS = frozenset("cudrt")

# Debezium's headers of a primary-key change: the other key, as written.
NEW_KEY_HEADER = "__debezium.newkey"  # on the delete of the old key
OLD_KEY_HEADER = "__debezium.oldkey"  # on the create of the new key

# Control events (the ``wb.control`` header's value).
SNAPSHOT_END = "snapshot_end"
BACKFILL_END = "backfill_end"
# The ControlKey's event of a truncate (a change, not a control event).
TRUNCATE_KEY_EVENT = "truncate"
CONTROL_KEY_RECORD = "io.walbridge.ControlKey"
# Not on the wire: the stream rows that stand for a message sent to the DLQ,
# and for a delete's tombstone (skipped; the row covers its offset).
DLQ_CONTROL = "dlq"
TOMBSTONE_CONTROL = "tombstone"
# The consumer's decode met a value schema its layout was not derived with:
# the driver learns the schemas again and decodes the micro-batch anew.
NEW_SCHEMA_CONTROL = "new_schema"

# Topics: ``<prefix>.<shape>`` for data, these for the rest.
SCHEMAS_TOPIC_SUFFIX = "._schemas"  # writer schemas without a registry, keyed by fingerprint
STATUS_TOPIC_SUFFIX = "._status"  # the producer's own view, for ``walbridge status``
BACKFILLS_TOPIC_SUFFIX = "._backfills"  # backfill requests and their state
CHECKPOINT_TOPIC_SUFFIX = "._checkpoint"  # the producer's recovery checkpoint (snapshot, coverage)
DLQ_SUFFIX = ".dlq"  # after a data topic's name: its undecodable messages

COMMIT_TOPIC_ID = "wb.topic_id="  # an offset commit's metadata: the incarnation it was read from
# Group ids of walbridge's own readers (scans, probes, status): never joined,
# never committed, but a Kafka consumer needs one and an authorizer asks for
# Describe on it (grant it on this prefix).
READER_GROUP_PREFIX = "walbridge-"

# Topic settings. The internal topics hold keyed records of which the latest per
# key counts, needed for as long as the deployment lives: compacted, no time limit.
INTERNAL_TOPIC_CONFIG = {"cleanup.policy": "compact", "retention.ms": "-1"}
# A dead-letter topic keeps every message: compaction would drop a dead letter
# whose key repeats (or reject one without a key).
DLQ_TOPIC_CONFIG = {"cleanup.policy": "delete", "retention.ms": "-1", "retention.bytes": "-1"}
# Data topics walbridge creates, unless ``[kafka.topic_config]`` says otherwise:
# nothing is deleted before every consumer has read it, however late.
DATA_TOPIC_CONFIG = {"retention.ms": "-1", "retention.bytes": "-1"}

# Names in the target database.
RESERVED_PREFIX = "_wb_"  # walbridge's columns; a source column may not start so
# The plain layout's side field of a row or key record (walbridge's, so ``_wb_``):
# its special values as JSON {column: PostgreSQL text}, their columns being null.
SPECIAL_FIELD = "_wb_special"
# Properties of a row field naming the source column it was written from (the
# catalog's identity of it), so a restarted producer compares the table's
# first Relation with what it last published: pg_attribute.attnum, the type's
# oid and typmod. Fields written before they were lack them.
ATTNUM_PROP = "pg.attnum"
TYPE_OID_PROP = "pg.type_oid"
TYPMOD_PROP = "pg.typmod"
# A property of the row record: its key fields' names in key order ([] when
# keyless). A key change alone thus makes a new value schema, and a consumer
# takes the key from the value schema it decodes with, never from a key
# subject that may lag behind it (or, once keyless, keep an old version).
# Value schemas written before it lack it: their key is the key schema's.
KEY_PROP = "pg.key"
META_SCHEMA = "_walbridge"  # progress, backfills
# In the source database: per slot, the topics, Kafka cluster and PostgreSQL server its data came from and went to.
SLOT_BINDING_TABLE = "producer_slots"
TOMBSTONES_SUFFIX = "__wb_tombstones"  # after a keyed shape's table name: its deleted keys

# The consumer's decoded rows (spark_consumer.decode: what each means) and the
# target tables' bookkeeping columns (spark_consumer.target_layout).
OP_COLUMN = "_wb_op"
LSN_COLUMN = "_wb_lsn"
OP_INDEX_COLUMN = "_wb_op_index"
TOPIC_COLUMN = "_wb_topic"
PARTITION_COLUMN = "_wb_partition"
OFFSET_COLUMN = "_wb_offset"
UNCHANGED_COLUMN = "_wb_unchanged"
SPECIAL_COLUMN = SPECIAL_FIELD
CONTROL_COLUMN = "_wb_control"
CONTROL_INFO_COLUMN = "_wb_control_info"
SNAPSHOT_ID_COLUMN = "_wb_snapshot_id"
TS_MS_COLUMN = "_wb_ts_ms"
ERROR_COLUMN = "_wb_error"
BEFORE_COLUMN = "_wb_before"
BEFORE_SPECIAL_COLUMN = "_wb_before_special"
APPLIED_AT_COLUMN = "_wb_applied_at"  # target tables: the applying transaction's start
ROW_COLUMN = "_wb_row"  # a keyless shape's removals: the removed row as text
# A keyless removal's take: the rank (position, streamed) of the row it took, NULL while it waits.
TOOK_COLUMNS = ("_wb_took_lsn", "_wb_took_op_index", "_wb_took_streamed")
# A staged plan row's kind and kept columns (spark_consumer.staging).
KIND_COLUMN = "_wb_kind"
KEEP_COLUMN = "_wb_keep"
ICEBERG_PROGRESS_PROPERTY = "walbridge.progress"  # an Iceberg snapshot summary's key of the consumer's record
SEQ_COLUMN = "_wb_seq"  # a staged row's index in its stage (lakehouse targets' keyless matching)
# The executors' decoded parts of one micro-batch: a shape's rows as an Arrow IPC stream.
ARROW_COLUMN = "_wb_arrow"

_POS = struct.Struct(">QQ")
_BAD_AVRO_CHARS = re.compile(r"[^A-Za-z0-9_]")


def avro_name(name: str) -> str:
    """A PostgreSQL (or topic) name as an Avro name: characters Avro does not
    allow become ``_``, a leading digit gets a ``_`` before it."""
    clean = _BAD_AVRO_CHARS.sub("_", name)
    return clean if clean and not clean[0].isdigit() else f"_{clean}"


def avro_namespace(*parts: str) -> str:
    return ".".join(avro_name(seg) for part in parts for seg in part.split("."))


def record_names(topic: str) -> tuple[str, str]:
    """Full names of a data topic's value (envelope) and key records."""
    namespace = avro_namespace(topic)
    return f"{namespace}.Envelope", f"{namespace}.Key"
_CONFLUENT = struct.Struct(">bI")


def key_fields(row: dict, key_schema: dict | None) -> list[str]:
    """The Avro names of a shape's key fields, in key order: the row record's
    ``KEY_PROP`` when it has one, else the key schema's fields (none: keyless)."""
    if KEY_PROP in row:
        return list(row[KEY_PROP])
    return [f["name"] for f in (key_schema or {}).get("fields", ()) if f["name"] != SPECIAL_FIELD]


def schemas_topic(topic_prefix: str) -> str:
    return topic_prefix + SCHEMAS_TOPIC_SUFFIX


def status_topic(topic_prefix: str) -> str:
    return topic_prefix + STATUS_TOPIC_SUFFIX


def backfills_topic(topic_prefix: str) -> str:
    return topic_prefix + BACKFILLS_TOPIC_SUFFIX


def checkpoint_topic(topic_prefix: str) -> str:
    return topic_prefix + CHECKPOINT_TOPIC_SUFFIX


def internal_topics(topic_prefix: str) -> list[str]:
    """The compacted topics of a deployment (``_schemas`` exists only without a registry)."""
    return [schemas_topic(topic_prefix), status_topic(topic_prefix), backfills_topic(topic_prefix),
            checkpoint_topic(topic_prefix)]


def dlq_topic(topic: str) -> str:
    return topic + DLQ_SUFFIX


def target_table(shape_name: str) -> tuple[str, str]:
    """The target table of a shape, ``(schema, table)``: a ``schema.table``
    shape name keeps its schema, an undotted one goes to ``public``."""
    schema, dot, table = shape_name.partition(".")
    if not dot:
        return "public", shape_name
    if not schema or not table:
        raise ValueError(f"shape name {shape_name!r} does not name a table")
    return schema, table


def schema_fingerprint(schema: dict | list | str) -> bytes:
    """CRC-64-AVRO fingerprint (8 bytes, little-endian as single-object encoding
    wants) of the schema's JSON text. Not of its Parsing Canonical Form alone:
    that drops ``logicalType``, ``precision`` and ``scale``, so the writers
    before and after a numeric retype would share a fingerprint and the rows of
    one be decoded with the other's scale."""
    return bytes.fromhex(fingerprint(canonical_json(schema), "CRC-64-AVRO"))


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


def commit_metadata(topic_id: str | None) -> str:
    """An offset commit's metadata for the topic incarnation ``topic_id``."""
    return f"{COMMIT_TOPIC_ID}{topic_id}" if topic_id else ""


def reader_group(purpose: str) -> str:
    """A group id of one's own for a reader that never joins nor commits."""
    return f"{READER_GROUP_PREFIX}{purpose}-{uuid.uuid4().hex}"


def commit_topic_id(metadata: str | None) -> str | None:
    """The topic id an offset commit's metadata names; None if it names none
    (a commit by another tool)."""
    if metadata and metadata.startswith(COMMIT_TOPIC_ID):
        return metadata[len(COMMIT_TOPIC_ID):] or None
    return None
