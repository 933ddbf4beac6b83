"""A shape as its writer schema describes it: the row record of the value
schema read once (:func:`shape_columns`) for the two that need it, decoding
(:class:`spark_consumer.decode.ShapeLayout`: the Spark columns) and apply
planning (:class:`ShapeTarget`: the target table and its columns). Pure.

Invariants:
- A shape's columns are the row record's fields in their order, but the
  plain layout's side field (:data:`schemas.wire.SPECIAL_FIELD`: special
  values, not a column); each is named by its field's ``pg.column``, else
  the field's name.
- The key columns are the row record's ``pg.key`` when it has one, else the
  key schema's fields (none: a keyless shape); a key that names no column,
  a column named like walbridge's own (``_wb_``) or named twice is refused
  (:class:`UnsupportedSchema`): decoding and applying would disagree.
- A shape's target table is named after the shape (:func:`schemas.wire.target_table`).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from schemas import wire

# PostgreSQL types for columns whose Avro field carries no "pg.type".
_AVRO_SQL = {"boolean": "boolean", "int": "integer", "long": "bigint", "float": "real",
             "double": "double precision", "bytes": "bytea", "string": "text"}
_LOGICAL_SQL = {"date": "date", "time-micros": "time", "timestamp-micros": "timestamp with time zone",
                "local-timestamp-micros": "timestamp", "uuid": "uuid"}


class UnsupportedSchema(ValueError):
    """The shape's Avro schema is not one walbridge can map."""


@dataclass(frozen=True)
class ShapeColumn:
    name: str  # PostgreSQL column name (the Avro field's "pg.column", else its name)
    field: str  # Avro field name
    pg_type: str | None  # "pg.type" of the Avro field: the type to recreate
    is_key: bool
    avro_type: Any = None
    aliases: tuple[str, ...] = ()  # the Avro field's aliases: earlier names of a renamed column

    @property
    def sql_type(self) -> str:
        """The column type to create (before checking the target knows it)."""
        if self.pg_type:
            return self.pg_type
        return _sql_from_avro(self.avro_type)


def _sql_from_avro(avro_type: Any) -> str:
    branches = avro_type if isinstance(avro_type, list) else [avro_type]
    typed = [b for b in branches if b not in ("null", "string")] or ["string"]
    t = typed[0]
    if isinstance(t, str):
        return _AVRO_SQL.get(t, "text")
    if isinstance(t, dict):
        logical = t.get("logicalType")
        if logical == "decimal":
            return f"numeric({int(t['precision'])},{int(t.get('scale', 0))})"
        if logical in _LOGICAL_SQL:
            return _LOGICAL_SQL[logical]
        if t.get("type") == "array":
            return _sql_from_avro(t["items"]) + "[]"
        if isinstance(t.get("type"), str):
            return _AVRO_SQL.get(t["type"], "text")
    return "text"


def row_record(value_schema: Mapping) -> Mapping:
    """The row record (``Value``) of an envelope schema, from its ``before``
    field; a row record given itself is returned as it is."""
    if value_schema.get("type") == "record" and value_schema.get("name") == "Value":
        return value_schema
    for f in value_schema.get("fields", ()):
        if f.get("name") == "before":
            branches = f["type"] if isinstance(f["type"], list) else [f["type"]]
            for b in branches:
                if isinstance(b, Mapping) and b.get("type") == "record":
                    return b
    raise UnsupportedSchema("value schema is not a walbridge envelope (no 'before' row record)")


def full_name(schema: Mapping) -> str:
    name = schema.get("name", "")
    ns = schema.get("namespace")
    return name if "." in name or not ns else f"{ns}.{name}"


def shape_columns(value_schema: Mapping, key_schema: Mapping | None = None,
                  key_fields: Iterable[str] = ()) -> tuple[ShapeColumn, ...]:
    """The shape's columns (module docstring); ``key_fields``: more key fields."""
    row = row_record(value_schema)
    keys = set(key_fields) | set(wire.key_fields(row, key_schema))
    cols = []
    seen: set[str] = set()
    for f in row["fields"]:
        if f["name"] == wire.SPECIAL_FIELD:
            continue
        name = f.get("pg.column", f["name"])
        if name.startswith(wire.RESERVED_PREFIX):
            raise UnsupportedSchema(f"column {name!r}: names starting with {wire.RESERVED_PREFIX!r} are reserved "
                                    "for walbridge's bookkeeping columns")
        if name in seen:
            raise UnsupportedSchema(f"column {name!r} appears twice")
        seen.add(name)
        cols.append(ShapeColumn(name, f["name"], f.get("pg.type"), f["name"] in keys or name in keys,
                                f.get("type"), tuple(f.get("aliases") or ())))
    unknown = keys - {c.field for c in cols} - {c.name for c in cols}
    if unknown:
        raise UnsupportedSchema(f"key field(s) {sorted(unknown)} are not columns of the shape")
    return tuple(cols)


def split_shape_name(shape: str) -> tuple[str, str]:
    """A shape's target table (:func:`schemas.wire.target_table`)."""
    try:
        return wire.target_table(shape)
    except ValueError as e:
        raise UnsupportedSchema(str(e)) from None


def tombstone_name(table: str) -> str:
    """``<table>__wb_tombstones``, shortened with a stable suffix if it would
    pass PostgreSQL's 63-byte identifier limit."""
    name = f"{table}{wire.TOMBSTONES_SUFFIX}"
    if len(name.encode()) <= 63:
        return name
    suffix = f"__wb_t{zlib.crc32(table.encode()):08x}"
    head = table.encode()[: 63 - len(suffix)].decode("utf-8", "ignore")
    return head + suffix


@dataclass(frozen=True)
class ShapeTarget:
    """What the apply needs to know about one shape: its name, its target table
    and its columns (in the shape's order)."""

    shape: str
    schema: str
    table: str
    columns: tuple[ShapeColumn, ...]

    @classmethod
    def from_avro(cls, shape: str, value_schema: Mapping, key_schema: Mapping | None = None, *,
                  key_fields: Iterable[str] | None = None, table: tuple[str, str] | None = None) -> ShapeTarget:
        """From the shape's Avro value schema (the envelope, or its row record)
        and its key (:func:`shape_columns`); ``table``: another target table."""
        columns = shape_columns(value_schema, key_schema, key_fields or ())
        schema, tbl = table or split_shape_name(shape)
        return cls(shape, schema, tbl, columns)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    @property
    def key_columns(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns if c.is_key)

    @property
    def keyless(self) -> bool:
        return not any(c.is_key for c in self.columns)

    @property
    def tombstone_table(self) -> str:
        return tombstone_name(self.table)
