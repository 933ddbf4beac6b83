"""The compiled envelope reader of the executors, and when it applies.

``spark_consumer._fastdecode`` (Cython, built by ``pip install``) reads the
Avro body of a message straight into the parts the batch builder needs: the
``before``/``after`` rows as lists in the layout's column order, the
``source`` position, ``op``, ``ts_ms`` and ``unchanged_toast``; its
``RowAssembler`` turns an ordinary change message (headers and body) into the
builder's whole row in one call. This module builds a reader per writer schema
and an assembler per builder from the layout.

Invariants:
- The reference is fastavro (``decode.decode_body``). A reader exists only for
  writer schemas whose every type the compiled reader handles (records of the
  envelope, ``source`` and the row, unions, primitives, decimal bytes, arrays,
  enums); otherwise ``envelope_reader`` returns None and fastavro reads every
  message of that schema.
- The assembler only builds rows the builder's own steps would build equally;
  for anything else (control events, first message of a writer schema,
  damaged headers, deletes that need the message key) it hands the message
  back to them.
- Whenever the compiled reader refuses a message body, fastavro decodes it and
  decides (:class:`spark_consumer.decode.UndecodableMessage` or the values), so
  which messages go to the DLQ never depends on this module.
- ``tests/unit/test_spark_decode.py`` holds both paths side by side (equal rows,
  equal errors).
- Decimal columns of precision <= 18 read with the layout's own (precision,
  scale) travel as :class:`Unscaled` integers to ``decimal_array``, which
  builds their Arrow column from the integers; nowhere else may an
  ``Unscaled`` stay (``_wb_before`` and the key fill hold ``Decimal``).
- Set ``WALBRIDGE_PURE_PYTHON=1`` to run without the extension.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from schemas import compiled_extension

_fastdecode = compiled_extension("spark_consumer._fastdecode")

AVAILABLE = _fastdecode is not None
# Decimals up to this precision may travel as Unscaled (none without the extension).
MAX_UNSCALED_PRECISION = _fastdecode.MAX_UNSCALED_PRECISION if AVAILABLE else 0

# Slots of the envelope list ``EnvelopeReader.read`` returns.
ENVELOPE_SLOTS = {"before": 0, "after": 1, "source": 2, "op": 3, "ts_ms": 4, "unchanged_toast": 5}
# Slots of its ``source`` list: the position is (commit_lsn, op_index); writers
# before 0.2.0 have no commit_lsn and put the commit LSN in lsn.
SOURCE_SLOTS = {"lsn": 0, "op_index": 1, "snapshot_id": 2, "commit_lsn": 3}


def _full_name(schema: dict, namespace: str | None) -> str:
    name = schema.get("name", "")
    ns = schema.get("namespace", namespace)
    return name if "." in name or not ns else f"{ns}.{name}"


def _record_in(avro_type: Any) -> dict | None:
    branches = avro_type if isinstance(avro_type, list) else [avro_type]
    records = [b for b in branches if isinstance(b, dict) and b.get("type") == "record"]
    return records[0] if len(records) == 1 else None


def envelope_reader(stripped_schema: dict, row_fields: list[str],
                    unscaled_decimals: dict[str, tuple[int, int]] | None = None):
    """The compiled reader of envelopes written with ``stripped_schema`` (the
    writer schema with logical types stripped as for fastavro), reading each
    row into a list ordered as ``row_fields`` (the layout's Avro field names;
    fields the writer lacks are None, fields the layout lacks are dropped).
    ``unscaled_decimals``: {field: (precision, scale)} of the layout's decimal
    columns (precision <= 18) whose values may come as :class:`Unscaled`.
    None when the extension is missing or the schema is not one it reads."""
    if _fastdecode is None or stripped_schema.get("type") != "record":
        return None
    fields = {f["name"]: f["type"] for f in stripped_schema.get("fields", ())}
    if not {"before", "after", "source", "op"} <= fields.keys():
        return None
    row = _record_in(fields["before"])
    source = _record_in(fields["source"])
    if row is None or source is None:
        return None
    envelope_ns = stripped_schema.get("namespace")
    row_name = _full_name(row, envelope_ns)
    slot_maps = {
        _full_name(stripped_schema, None): ENVELOPE_SLOTS,
        row_name: {name: i for i, name in enumerate(row_fields)},
        (row_name, "unscaled"): dict(unscaled_decimals or {}),
        _full_name(source, envelope_ns): SOURCE_SLOTS,
    }
    try:
        return _fastdecode.compile_envelope(stripped_schema, slot_maps)
    except (_fastdecode.UnsupportedWriterSchema, KeyError, TypeError, ValueError):
        return None


def row_assembler(by_prefix: dict, special: list[tuple[int, str]], key_indexes: list[int],
                  name_by_field: dict[str, str], names: list[str], unscaled_indexes: list[int]):
    """The compiled row assembler of a builder (its writer cache ``by_prefix``,
    special-value columns, key column indexes, Avro field → column names,
    column names, columns whose values may be :class:`Unscaled`), or None
    without the extension."""
    if _fastdecode is None:
        return None
    return _fastdecode.RowAssembler(by_prefix, special, key_indexes, name_by_field, names, unscaled_indexes)


def is_unscaled(value: Any) -> bool:
    return _fastdecode is not None and value.__class__ is _fastdecode.Unscaled


def decimal_array(values: list, arrow_type: Any) -> Any:
    """The Arrow decimal column of ``values`` (:class:`Unscaled`, ``Decimal``
    or None), built from integers when every value allows (equal to
    ``pa.array`` of the Decimals)."""
    ints = _fastdecode.decimal_column(values, arrow_type.precision, arrow_type.scale) if AVAILABLE else None
    if ints is None:
        return pa.array([v.to_decimal() if is_unscaled(v) else v for v in values], type=arrow_type)
    unscaled = pa.array(ints, type=pa.int64()).cast(pa.decimal128(38, 0))
    # Same 16-byte layout: the integers are the unscaled values at arrow_type's scale.
    return pa.Array.from_buffers(arrow_type, len(unscaled), unscaled.buffers(), unscaled.null_count)
