"""The compiled fast path for streamed changes and for rows read with COPY
(snapshot, backfills), and when it applies.

``producer._fastcodec`` (Cython, built by ``pip install``) turns a pgoutput
INSERT, DELETE or UPDATE message, or a chunk of COPY text rows, straight into
the Kafka messages of its relation's shapes: key and value bytes, partition,
without building Python values. This module builds its per-relation encoders
from a ``RelationPlan``.

Invariants:
- The reference is the pure-Python path (``RelationPlan.events`` → psycopg
  loaders → ``ShapeCodec``/fastavro); the compiled output is byte-identical to
  it (``tests/unit/test_fastcodec.py``), and it is what runs whenever the
  extension is missing or declines a change.
- Row filters are evaluated by the reference's own functions (streamed
  changes: ``shapes._safe_match``, reads: ``RowFilter.matches``) over the
  filter's columns loaded by the reference loaders; the encoder decides
  insert/update/delete, move-in and move-out as ``RelationPlan.events`` does,
  REPLICA IDENTITY FULL updates included. Per change it declines key changes
  (two events naming each other), a filter that needs an unchanged TOAST value
  (read back from the source) and anything unusual; per value it hands forms
  it does not parse to the column's Python field encoder.
- Set ``WALBRIDGE_PURE_PYTHON=1`` to run without the extension.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

from producer.envelope import ShapeColumn, SourceBytes, avro_long, avro_string, field_encoder, special_field
from producer.shapes import RelationPlan, _safe_match
from schemas import compiled_extension
from schemas.kafka import Writer
from schemas.shape_filter import RowFilter

_fastcodec = compiled_extension("producer._fastcodec")

AVAILABLE = _fastcodec is not None

# pgoutput message kinds the encoder may take: Insert, Update, Delete.
CHANGE_KINDS = frozenset(b"IUD")


def _column_spec(name: str, codec, layout: str) -> tuple:
    typed = codec.typed
    decimal = typed if isinstance(typed, dict) and typed.get("logicalType") == "decimal" else {}
    column = ShapeColumn(name, codec, is_key=True)
    row_type, key_type = codec.field_type(layout, True), codec.field_type(layout, False)
    return (codec.wire, row_type.index(typed), key_type.index(typed) if isinstance(key_type, list) else -1,
            decimal.get("precision", 0), decimal.get("scale", 0),
            field_encoder(column, layout, nullable=True), field_encoder(column, layout, nullable=False))


def _side_columns(codec, keys_only: bool) -> list | None:
    """(relation column index, column name) of a record's columns with special
    values in the plain layout; None when the record has no side field."""
    cols = [(i, c.name) for c, i in zip(codec.columns, codec.indexes)
            if (c.is_key or not keys_only) and codec.layout == "plain" and c.codec.special]
    return cols or None


def relation_encoder(plan: RelationPlan, partitions: dict[str, int], tombstones: bool = True):
    """The compiled encoder of ``plan``'s relation, or None where the reference
    path must take every change (no extension, no shape).
    ``tombstones``: a delete is followed by its key's tombstone. Call after the
    shapes' writer schemas are registered (it copies the prefixes)."""
    return _encoder(plan, partitions, tombstones, lambda f: partial(_safe_match, f))


def read_encoder(plan: RelationPlan, partitions: dict[str, int]):
    """The compiled encoder of rows read from ``plan``'s relation with ``COPY``
    (``encode_reads``), filtered shapes included; None without the extension
    or a shape. Call after the shapes' writer schemas are registered."""
    return _encoder(plan, partitions, False, lambda f: f.matches)


def read_suffix(source: SourceBytes, ts_ms: int) -> bytes:
    """The bytes of a read's envelope after ``after`` (``encode_reads``):
    its ``source`` at ``(source.lsn, 0)``, ``op = r``, ``ts_ms`` and no
    unchanged TOAST, as ``ShapeCodec.encode_change`` writes them."""
    return (source.head + b"\x02" + avro_long(source.lsn) + avro_long(0) + source.tail + avro_string("r")
            + b"\x02" + avro_long(ts_ms) + b"\x00")


def _encoder(plan: RelationPlan, partitions: dict[str, int], tombstones: bool,
             matcher: Callable[[RowFilter], Callable[[dict], bool]]):
    if _fastcodec is None or not plan.routes:
        return None
    relation = plan.relation
    layout = plan.routes[0].codec.layout
    columns = [_column_spec(col.name, codec, layout) for col, codec in zip(relation.columns, plan.codecs)]
    routes = []
    for route in plan.routes:
        codec = route.codec
        keys = [i for col, i in zip(codec.columns, codec.indexes) if col.is_key]
        head, mid = codec.stream_source_parts()
        writers: list[Writer] = [(route.topic, p) for p in range(partitions[route.topic])]
        toast_names = [codec.toast_field_name(i) for i in range(len(relation.columns))]
        routes.append(_fastcodec.Route(
            list(codec.indexes), keys, codec.value_prefix, codec.key_prefix, head, mid, writers,
            {op: (route.name, op) for op in "cudr"},
            [avro_string(n) if n is not None else None for n in toast_names], tombstones,
            _side_columns(codec, False), _side_columns(codec, True), special_field,
            matcher(route.row_filter) if route.row_filter is not None else None))
    read = {c for r in plan.routes if r.row_filter is not None for c in r.row_filter.columns}
    filter_columns = [(i, name, codec.load) for i, (name, codec) in enumerate(zip(plan.names, plan.codecs))
                      if name in read]
    return _fastcodec.RelationEncoder(relation.oid, columns, routes, filter_columns)
