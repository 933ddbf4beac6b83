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
- Set ``WALBRIDGE_PURE_PYTHON=1`` to run without the extension.
"""

from __future__ import annotations

import os
from typing import Any

try:
    if os.environ.get("WALBRIDGE_PURE_PYTHON"):
        raise ImportError("disabled by WALBRIDGE_PURE_PYTHON")
    from spark_consumer import _fastdecode
except ImportError:  # not built (e.g. running from a source tree without pip install)
    _fastdecode = None

AVAILABLE = _fastdecode is not None

# Slots of the envelope list ``EnvelopeReader.read`` returns.
ENVELOPE_SLOTS = {"before": 0, "after": 1, "source": 2, "op": 3, "ts_ms": 4, "unchanged_toast": 5}
# Slots of its ``source`` list.
SOURCE_SLOTS = {"lsn": 0, "op_index": 1, "snapshot_id": 2}


def _full_name(schema: dict, namespace: str | None) -> str:
    name = schema.get("name", "")
    ns = schema.get("namespace", namespace)
    return name if "." in name or not ns else f"{ns}.{name}"


def _record_in(avro_type: Any) -> dict | None:
    branches = avro_type if isinstance(avro_type, list) else [avro_type]
    records = [b for b in branches if isinstance(b, dict) and b.get("type") == "record"]
    return records[0] if len(records) == 1 else None


def envelope_reader(stripped_schema: dict, row_fields: list[str]):
    """The compiled reader of envelopes written with ``stripped_schema`` (the
    writer schema with logical types stripped as for fastavro), reading each
    row into a list ordered as ``row_fields`` (the layout's Avro field names;
    fields the writer lacks are None, fields the layout lacks are dropped).
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
    slot_maps = {
        _full_name(stripped_schema, None): ENVELOPE_SLOTS,
        _full_name(row, envelope_ns): {name: i for i, name in enumerate(row_fields)},
        _full_name(source, envelope_ns): SOURCE_SLOTS,
    }
    try:
        return _fastdecode.compile_envelope(stripped_schema, slot_maps)
    except (_fastdecode.UnsupportedWriterSchema, KeyError, TypeError, ValueError):
        return None


def row_assembler(by_prefix: dict, special: list[tuple[int, str]], key_indexes: list[int],
                  name_by_field: dict[str, str], names: list[str]):
    """The compiled row assembler of a builder (its writer cache ``by_prefix``,
    special-value columns, key column indexes, Avro field → column names,
    column names), or None without the extension."""
    if _fastdecode is None:
        return None
    return _fastdecode.RowAssembler(by_prefix, special, key_indexes, name_by_field, names)
