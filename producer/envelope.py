"""Per-shape Avro schemas and the Debezium-style envelope every change travels in.

Invariants:
- Pure: schemas are built from the relation's columns and codecs; encoding takes a
  wire prefix that the Kafka shell obtained (registry id or fingerprint).
- The value schema is Debezium's envelope: ``before``/``after`` (the shape's row
  record or null), ``source`` (``schemas/source.avsc``), ``op`` (``c``, ``u``,
  ``d``, ``r``, ``t``) and ``ts_ms``, plus walbridge's ``unchanged_toast``: the
  columns of ``after`` that an UPDATE left untouched in TOAST storage. Those are
  null in ``after`` and must not be applied; they are never placeholders.
- The key schema is a record of the key columns (primary key, or the replica
  identity index); keyless shapes have no key schema and null keys. The row
  record names its key fields too (``"pg.key"``, empty when keyless): a key
  change alone makes a new value schema, and consumers read the key from it.
- Row fields follow the shape's column list and order; every field is nullable
  (a DELETE's ``before`` may carry only the key) and defaults to null, so adding
  a column is a backward-compatible schema change.
- Special values (what a column's logical type cannot hold: NaN, infinity, BC
  dates, 24:00, multi-dimensional arrays; the loader gives their PostgreSQL
  text) travel, in the ``plain`` layout (``[kafka] value_layout``), in the
  record's side field ``_wb_special`` (``["null", "string"]``: a JSON object
  ``{column: text}`` with the columns in record order, the columns themselves
  null), so every column is a plain ``T`` or ``["null", T]``; a record (row or
  key) has the side field when one of its columns has special values. In the
  ``union`` layout they travel in a ``string`` branch of the column's union.
  Either way nothing is lost.
- Avro names are derived from PostgreSQL names by replacing characters Avro does
  not allow with ``_``; the original name is kept in ``"pg.column"``.
- A field carries its source column's attnum, type oid and typmod
  (``"pg.attnum"``, ``"pg.type_oid"``, ``"pg.typmod"``) when known: a
  restarted producer compares the table with them (schema changes made while
  it was stopped). Properties only: the schema stays BACKWARD-compatible.
- A renamed column's field carries its former names in Avro's ``"aliases"``
  (a reader schema with the old name resolves to it). The field's new name
  alone makes the schema new (Avro's parsing canonical form ignores aliases);
  the single-object fingerprint, of the whole schema text, differs too.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from typing import Any, Callable

from fastavro import parse_schema, schemaless_writer

import schemas
from producer.pgtypes import ColumnCodec
from schemas import wire
from schemas.wire import avro_name, avro_namespace

ENVELOPE_VERSION = "0.2.0"

SIDE_FIELD = {"name": wire.SPECIAL_FIELD, "type": ["null", "string"], "default": None,
              "doc": "special values of this record's columns, which are null: JSON {column: PostgreSQL text}"}


@dataclass(frozen=True)
class ShapeColumn:
    name: str  # PostgreSQL column name
    codec: ColumnCodec
    is_key: bool
    aliases: tuple[str, ...] = ()  # its former PostgreSQL names (RENAME COLUMN), oldest first
    # The source column's identity in the catalog: pg_attribute.attnum (None:
    # unknown), its type's oid and typmod (0: unknown).
    attnum: int | None = None
    type_oid: int = 0
    typmod: int = -1

    @property
    def field_name(self) -> str:
        return avro_name(self.name)


def _field(col: ShapeColumn, layout: str, nullable: bool = True) -> dict:
    avro_type = col.codec.field_type(layout, nullable)
    f = {"name": col.field_name, "type": avro_type, "pg.type": col.codec.pg_type}
    if isinstance(avro_type, list) and avro_type[0] == "null":
        f["default"] = None
    if col.field_name != col.name:
        f["pg.column"] = col.name
    if col.aliases:
        f["aliases"] = [avro_name(a) for a in col.aliases]
    if col.attnum is not None and col.type_oid:
        f.update({wire.ATTNUM_PROP: col.attnum, wire.TYPE_OID_PROP: col.type_oid, wire.TYPMOD_PROP: col.typmod})
    return f


def _record_fields(columns: list[ShapeColumn], layout: str, nullable: bool = True) -> list[dict]:
    fields = [_field(c, layout, nullable) for c in columns]
    if layout == "plain" and any(c.codec.special for c in columns):
        fields.append(SIDE_FIELD)
    return fields


def side_json(pairs: list[tuple[str, str]]) -> str | None:
    """The side field's value: ``pairs`` ((column, text) in record order) as JSON, None without any."""
    return json.dumps(dict(pairs), ensure_ascii=False, separators=(",", ":")) if pairs else None


def special_field(pairs: list[tuple[str, str]]) -> bytes:
    """The side field's bytes, as fastavro writes :func:`side_json`."""
    return _SECOND_BRANCH + avro_string(side_json(pairs)) if pairs else _NULL_BRANCH


def field_encoder(col: ShapeColumn, layout: str, nullable: bool = True) -> Callable[[bytes], bytes | str]:
    """One field of a row (or key) record on its own: PostgreSQL text value →
    loaded → Avro bytes, or, for a special value in the plain layout, its text
    (a str: the field is null and the value goes to the side field). A record
    is the concatenation of its fields, so this is the reference path for one
    column (the compiled encoder's fallback)."""
    parsed = parse_schema(_field(col, layout, nullable)["type"])
    load = col.codec.load
    to_side = layout == "plain" and col.codec.special
    buf = io.BytesIO()

    def encode(raw: bytes) -> bytes | str:
        value = load(raw)
        if to_side and value.__class__ is str:
            return value
        buf.seek(0)
        buf.truncate()
        schemaless_writer(buf, parsed, value)
        return buf.getvalue()

    return encode


def value_schema(namespace: str, columns: list[ShapeColumn], layout: str = "plain") -> dict:
    row = {"type": "record", "name": "Value", "namespace": namespace,
           "fields": _record_fields(columns, layout), wire.KEY_PROP: [c.field_name for c in columns if c.is_key]}
    return {
        "type": "record",
        "name": "Envelope",
        "namespace": namespace,
        "connect.name": f"{namespace}.Envelope",
        "fields": [
            {"name": "before", "type": ["null", row], "default": None},
            {"name": "after", "type": ["null", f"{namespace}.Value"], "default": None},
            {"name": "source", "type": schemas.load("source")},
            {"name": "op", "type": "string"},
            {"name": "ts_ms", "type": ["null", "long"], "default": None},
            {"name": "unchanged_toast", "type": {"type": "array", "items": "string"}, "default": []},
        ],
    }


def key_schema(namespace: str, columns: list[ShapeColumn], layout: str = "plain") -> dict | None:
    keys = [c for c in columns if c.is_key]
    if not keys:
        return None
    return {"type": "record", "name": "Key", "namespace": namespace,
            "fields": _record_fields(keys, layout, nullable=False)}


def avro_long(n: int) -> bytes:
    """Avro's zig-zag varint encoding of a long."""
    n = (n << 1) ^ (n >> 63)
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def avro_string(text: str) -> bytes:
    data = text.encode()
    return avro_long(len(data)) + data


def control_key(prefix: bytes, event: str, event_id: str) -> bytes:
    """An ``io.walbridge.ControlKey`` (``schemas/control_key.avsc``: two
    strings) behind its wire prefix."""
    return prefix + avro_string(event) + avro_string(event_id)


def avro_string_array(items) -> bytes:
    if not items:
        return b"\x00"
    return avro_long(len(items)) + b"".join(avro_string(i) for i in items) + b"\x00"


_NULL_BRANCH = b"\x00"  # union branch 0 (null)
_SECOND_BRANCH = b"\x02"  # union branch 1
_OPS = {op: avro_string(op) for op in ("c", "u", "d", "r", "t")}


def _source_part(name: str, fields: list[dict]) -> Any:
    return parse_schema({"type": "record", "name": name, "namespace": "io.walbridge", "fields": fields})


_SOURCE_FIELDS = schemas.load("source")["fields"]
# ``lsn`` (the change's own) and ``op_index`` vary per change; the rest per transaction.
_LSN_AT = [f["name"] for f in _SOURCE_FIELDS].index("lsn")
assert _SOURCE_FIELDS[_LSN_AT + 1]["name"] == "op_index"
_SOURCE_HEAD = _source_part("SourceHead", _SOURCE_FIELDS[:_LSN_AT])
_SOURCE_TAIL = _source_part("SourceTail", _SOURCE_FIELDS[_LSN_AT + 2:])


@dataclass(frozen=True)
class SourceBytes:
    """Encoded ``source`` fields before ``lsn`` and after ``op_index``, and the
    ``lsn`` of a change that does not say its own (snapshot and backfill reads)."""

    head: bytes
    tail: bytes
    lsn: int


@dataclass
class ShapeCodec:
    """Everything needed to turn one decoded change into a shape's message bytes."""

    shape: str
    topic_prefix: str
    db: str
    schema: str
    table: str
    columns: list[ShapeColumn]
    # Positions of the shape's columns in the relation's tuple.
    indexes: list[int]
    layout: str = "plain"  # [kafka] value_layout
    value_schema: dict = field(init=False)
    key_schema: dict | None = field(init=False)
    # Wire prefixes of the registered writer schemas (set by the Kafka shell).
    value_prefix: bytes = field(init=False, default=b"")
    key_prefix: bytes = field(init=False, default=b"")

    def __post_init__(self) -> None:
        namespace = avro_namespace(self.topic_prefix, self.shape)
        self.value_schema = value_schema(namespace, self.columns, self.layout)
        self.key_schema = key_schema(namespace, self.columns, self.layout)
        self._value_parsed = parse_schema(self.value_schema)
        self._row_parsed = parse_schema(self.value_schema["fields"][0]["type"][1])
        self._key_parsed = parse_schema(self.key_schema) if self.key_schema else None
        self._fields = [(c.field_name, i) for c, i in zip(self.columns, self.indexes)]
        self._key_fields = [(c.field_name, i) for c, i in zip(self.columns, self.indexes) if c.is_key]
        plain = self.layout == "plain"
        # (field, tuple index, column name) of columns whose special values go to the side field.
        self._side = [(c.field_name, i, c.name) for c, i in zip(self.columns, self.indexes)
                      if plain and c.codec.special]
        self._key_side = [(c.field_name, i, c.name) for c, i in zip(self.columns, self.indexes)
                          if plain and c.codec.special and c.is_key]
        self._toast_names = {i: c.field_name for c, i in zip(self.columns, self.indexes)}
        self._buf = io.BytesIO()

    @staticmethod
    def _with_side(record: dict, values: tuple, side: list) -> dict:
        """Moves special values (texts) of ``side`` columns to the side field."""
        pairs = []
        for name, i, column in side:
            v = values[i]
            if v.__class__ is str:
                record[name] = None
                pairs.append((column, v))
        record[wire.SPECIAL_FIELD] = side_json(pairs)
        return record

    def row(self, values: tuple) -> dict:
        record = {name: values[i] for name, i in self._fields}
        return self._with_side(record, values, self._side) if self._side else record

    def key_row(self, values: tuple) -> dict:
        record = {name: values[i] for name, i in self._key_fields}
        return self._with_side(record, values, self._key_side) if self._key_side else record

    def _encode(self, parsed: Any, prefix: bytes, record: dict) -> bytes:
        buf = self._buf
        buf.seek(0)
        buf.truncate()
        buf.write(prefix)
        schemaless_writer(buf, parsed, record)
        return buf.getvalue()

    def encode_key(self, prefix: bytes, values: tuple) -> bytes | None:
        """The key payload; ``None`` for keyless shapes."""
        if self._key_parsed is None:
            return None
        return self._encode(self._key_parsed, prefix, self.key_row(values))

    def encode_value(self, prefix: bytes, envelope: dict) -> bytes:
        """Reference encoding of a whole envelope dict (fastavro end to end)."""
        return self._encode(self._value_parsed, prefix, envelope)

    def _row_bytes(self, values: tuple | None) -> bytes:
        if values is None:
            return _NULL_BRANCH
        return _SECOND_BRANCH + self._encode(self._row_parsed, b"", self.row(values))

    def encode_change(self, prefix: bytes, op: str, before: tuple | None, after: tuple | None,
                      source: SourceBytes, op_index: int, ts_ms: int, unchanged: tuple[int, ...] = (),
                      change_lsn: int | None = None) -> bytes:
        """The envelope's bytes, composed field by field: an Avro record is the
        concatenation of its fields, so the rows are encoded by fastavro and the
        transaction-constant ``source`` block is reused (encoding is the
        producer's hot path). ``change_lsn``: the change's own LSN (default:
        ``source.lsn``). Equal to :meth:`encode_value` of :meth:`envelope`."""
        names = [self._toast_names[i] for i in unchanged if i in self._toast_names] if unchanged else ()
        return b"".join((
            prefix, self._row_bytes(before), self._row_bytes(after),
            source.head, _SECOND_BRANCH, avro_long(source.lsn if change_lsn is None else change_lsn),
            avro_long(op_index), source.tail,
            _OPS.get(op) or avro_string(op), _SECOND_BRANCH, avro_long(ts_ms),
            avro_string_array(names),
        ))

    def source_bytes(self, lsn: int, xid: int | None, ts_ms: int, snapshot: bool | str = False,
                     snapshot_id: str | None = None) -> SourceBytes:
        """The ``source`` block around ``lsn`` and ``op_index``, once per
        transaction (``lsn``: its commit LSN, or a snapshot's consistent point)."""
        src = self.source(lsn, 0, xid, ts_ms, snapshot, snapshot_id)
        return SourceBytes(self._encode(_SOURCE_HEAD, b"", src), self._encode(_SOURCE_TAIL, b"", src), lsn)

    def stream_source_parts(self) -> tuple[bytes, bytes]:
        """The constant parts of a streamed change's ``source`` block: the bytes
        before ``ts_ms`` and those between ``ts_ms`` and ``txId`` (the compiled
        encoder splices the transaction's and the change's values in between;
        equal to :meth:`source_bytes` for any ``lsn``, ``xid`` and ``ts_ms``)."""
        head = avro_string(ENVELOPE_VERSION) + avro_string("walbridge") + avro_string(self.topic_prefix)
        mid = (_SECOND_BRANCH + avro_string("false") + avro_string(self.db) + avro_string(self.schema)
               + avro_string(self.table) + avro_string(self.shape))
        return head, mid

    def toast_field_name(self, index: int) -> str | None:
        """The field name of relation column ``index`` in this shape, if it has one."""
        return self._toast_names.get(index)

    def source(self, lsn: int, op_index: int, xid: int | None, ts_ms: int,
               snapshot: bool | str = False, snapshot_id: str | None = None, change_lsn: int | None = None) -> dict:
        """``lsn``: the commit LSN (position part 1); ``change_lsn``: the change's
        own (default ``lsn``). ``snapshot``: True (initial snapshot), False
        (streamed), or Debezium's string for the kind of read (``"incremental"``
        for backfills)."""
        if not isinstance(snapshot, str):
            snapshot = "true" if snapshot else "false"
        return {
            "version": ENVELOPE_VERSION, "connector": "walbridge", "name": self.topic_prefix,
            "ts_ms": ts_ms, "snapshot": snapshot, "db": self.db,
            "schema": self.schema, "table": self.table, "shape": self.shape, "txId": xid,
            "commit_lsn": lsn, "lsn": lsn if change_lsn is None else change_lsn, "op_index": op_index,
            "snapshot_id": snapshot_id,
        }

    def envelope(self, op: str, before: tuple | None, after: tuple | None, source: dict,
                 ts_ms: int, unchanged: list[int] | None = None) -> dict:
        """``unchanged``: tuple indexes of unchanged-TOAST columns in ``after``
        (their values in ``after`` must already be None)."""
        return {
            "before": self.row(before) if before is not None else None,
            "after": self.row(after) if after is not None else None,
            "source": source,
            "op": op,
            "ts_ms": ts_ms,
            "unchanged_toast": [self._toast_names[i] for i in unchanged if i in self._toast_names]
            if unchanged else [],
        }

