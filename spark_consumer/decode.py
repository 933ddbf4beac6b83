"""Shape messages → typed Spark rows: the schema mapping and the decoding the
consumer's executors run on the messages Spark's Kafka source read
(:mod:`spark_consumer.batch_split`). Pure:
no Kafka, no Spark session; writer schemas come in through a lookup function.

Output columns (the contract the apply step builds on)
------------------------------------------------------
One row per Kafka message of the range read, in offset order per partition
(so per partition the rows' ``_wb_offset`` values are exactly the offsets that
held a message; the next offset to resume from is ``max(_wb_offset) + 1``).

First the shape's row columns, in the shape's column order, named by their
PostgreSQL column name (the Avro field's ``pg.column``, else its name), typed:

  ===========================================  ==================================
  Avro (non-null branch)                       Spark
  ===========================================  ==================================
  int / long / float / double / boolean        Integer / Long / Float / Double / Boolean
  string (incl. text-form PG types) / bytes    String / Binary
  decimal(p,s), p <= 38                        Decimal(p,s)
  decimal(p,s), p > 38                         String (exact, plain notation)
  date                                         Date
  time-micros                                  String ``HH:MM:SS`` or ``HH:MM:SS.ffffff``
  timestamp-micros                             Timestamp
  local-timestamp-micros                       TimestampNTZ
  uuid                                         String
  array<items>                                 Array<items mapped as above>
  ===========================================  ==================================

Each row column's ``StructField.metadata`` holds ``pg.type`` (the source type to
recreate, e.g. ``numeric(10,2)``), ``avro.field`` (the Avro field name) and
``wb.key`` (true for key / replica-identity columns, from the key schema).

Values come from ``after`` (ops c, u, r) or, for deletes, from ``before``
(at least the key columns; when ``before`` lacks them they are filled from the
message key). Truncates (``t``) and control rows have all row columns null.

Special values (infinite/BC dates and timestamps, ``24:00:00``, NaN/Infinity
numerics, multi-dimensional arrays) leave the typed column null and their
PostgreSQL text form goes to ``_wb_special[column]``. They arrive either in the
record's side field ``_wb_special`` (the plain layout: JSON ``{column: text}``)
or, from writers of the union layout, in a ``string`` branch beside the typed
one; a layout of either kind reads writers of both.

Then walbridge's bookkeeping columns (``BOOKKEEPING``), all nullable unless noted:

- ``_wb_op`` string: c, u, d, r, t; null on control rows.
- ``_wb_lsn`` long, ``_wb_op_index`` long: the position (commit LSN, op index),
  from the ``wb.pos`` header (else the envelope's ``source.commit_lsn`` and
  ``op_index``; writers before 0.2.0: ``source.lsn``). Set on control
  rows; null only on DLQ rows without a readable ``wb.pos``.
- ``_wb_topic`` string, ``_wb_partition`` int, ``_wb_offset`` long: where the
  message is. Never null.
- ``_wb_unchanged`` array<string>: column names whose values an UPDATE left in
  TOAST (their row columns are null and must keep the target's value); null
  when there are none.
- ``_wb_special`` map<string,string>: {column: PostgreSQL text} for special
  values (above); null when there are none.
- ``_wb_control`` string: null for changes; for a control event (on the wire a
  tombstone) its ``wb.control`` header: ``snapshot_end``, ``backfill_end``;
  ``dlq`` for a message that could not be decoded and was sent to
  ``<topic>.dlq``, ``tombstone`` for a tombstone without ``wb.control`` (a
  delete's, for compaction): those two rows exist only so progress covers
  their offsets. Apply must skip control names it does not handle.
- ``_wb_control_info`` string: the ``wb.control.info`` header (JSON) of control
  events.
- ``_wb_snapshot_id`` string: the ``wb.snapshot`` header (snapshot/backfill
  reads and their control events), else the envelope's ``source.snapshot_id``.
- ``_wb_ts_ms`` long: the envelope's ``ts_ms`` (when the producer built it);
  null on control rows.
- ``_wb_error`` string: why a ``dlq`` row could not be decoded.

Last, the old row of an UPDATE (``BEFORE_COLUMNS``), for keyless shapes and
anything else that needs it:

- ``_wb_before`` struct<the row columns, same names and types>: the envelope's
  ``before`` of a ``u`` when the source sent one (REPLICA IDENTITY FULL); null
  otherwise (for ``d`` the row columns already are the old row).
- ``_wb_before_special`` map<string,string>: special values of ``_wb_before``
  (their struct fields are null), as ``_wb_special``; null when there are none.

Invariants:
- A layout is derived from one value schema (the newest the driver knows) and
  holds for the whole decode of a micro-batch. Messages written with an
  older, known writer schema are read into it by name (columns dropped since
  are ignored, columns added since are null). A writer schema the layout was
  not derived with raises :class:`SchemaChangedError` where it cannot be read
  faithfully: with ``WriterSchemas.only_known`` (the consumer) any value
  schema not known when the layout was made, so the driver learns the schemas
  again and decodes the batch with the new layout; otherwise one that adds or
  retypes a column (a decode with a fixed layout must stop, never drop data
  silently), while one that only lacks columns is read (they are null).
- A value of an older writer in a column retyped since (numeric(10,2) →
  numeric(10,0), bigint → integer, text → integer, integer → text ...) is
  cast as PostgreSQL casts it (:func:`cast_value`: numerics rounded half away
  from zero, text parsed); where that cast fails (out of range, not a number)
  it is null, as the target's cast-or-NULL rule: never a failed batch. The
  producer re-reads a shape after a retype that is not a widening, so the
  re-read brings the source's values. Messages of such writers are read by
  fastavro.
- A message whose bytes cannot be decoded (no walbridge wire prefix, a schema
  that cannot be found, a corrupt Avro body, a schema of another shape)
  raises :class:`UndecodableMessage`; the source sends it to the DLQ. Infrastructure failures (broker, registry unreachable)
  are never classified as undecodable: they propagate.
- Decoding reads the writer schema with the date/time/timestamp/uuid logical
  types stripped (the binary encoding is the same), so those values arrive as
  plain ints/strings and go into Arrow without per-value Python objects.
- Where the compiled reader (:mod:`spark_consumer.fastdecode`) is built and
  reads the writer schema, it decodes the bodies and assembles ordinary rows;
  the rows are those of the fastavro path (``WriterSchemas(compiled=False)``),
  and a body it refuses is decoded by fastavro, so what is undecodable does
  not depend on it.
"""

from __future__ import annotations

import copy
import datetime
import io
import json
import re
from dataclasses import dataclass, field
from decimal import ROUND_HALF_UP, Context, Decimal
from typing import Any, Callable

import pyarrow as pa
from fastavro import parse_schema, schemaless_reader
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    DataType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from schemas import wire
from spark_consumer import fastdecode
from spark_consumer.shape_record import UnsupportedSchema, full_name, row_record, shape_columns

SPARK_MAX_DECIMAL_PRECISION = 38

BOOKKEEPING: tuple[StructField, ...] = (
    StructField(wire.OP_COLUMN, StringType()),
    StructField(wire.LSN_COLUMN, LongType()),
    StructField(wire.OP_INDEX_COLUMN, LongType()),
    StructField(wire.TOPIC_COLUMN, StringType(), nullable=False),
    StructField(wire.PARTITION_COLUMN, IntegerType(), nullable=False),
    StructField(wire.OFFSET_COLUMN, LongType(), nullable=False),
    StructField(wire.UNCHANGED_COLUMN, ArrayType(StringType(), containsNull=False)),
    StructField(wire.SPECIAL_COLUMN, MapType(StringType(), StringType(), valueContainsNull=False)),
    StructField(wire.CONTROL_COLUMN, StringType()),
    StructField(wire.CONTROL_INFO_COLUMN, StringType()),
    StructField(wire.SNAPSHOT_ID_COLUMN, StringType()),
    StructField(wire.TS_MS_COLUMN, LongType()),
    StructField(wire.ERROR_COLUMN, StringType()),
)
BOOKKEEPING_NAMES = tuple(f.name for f in BOOKKEEPING)
BEFORE_COLUMNS = (wire.BEFORE_COLUMN, wire.BEFORE_SPECIAL_COLUMN)

_PRIMITIVES: dict[str, DataType] = {
    "int": IntegerType(), "long": LongType(), "float": FloatType(), "double": DoubleType(),
    "boolean": BooleanType(), "string": StringType(), "bytes": BinaryType(),
}
# Logical types read as their underlying primitive (see the module docstring).
_STRIPPED_LOGICAL = frozenset({"date", "time-micros", "timestamp-micros", "local-timestamp-micros", "uuid"})
# Typed values that may have special values (a str where a writer's union has a string branch).
_SPECIAL_LOGICAL = frozenset({"decimal", "date", "time-micros", "timestamp-micros", "local-timestamp-micros"})


class SchemaChangedError(RuntimeError):
    """A writer schema the layout was not derived with: derive the layout
    again (the consumer learns the shape's schemas and decodes the batch anew).
    ``ref``: the writer schema's ref, when it is one the layout never knew."""

    def __init__(self, message: str, ref: str | None = None):
        super().__init__(message)
        self.ref = ref


class UndecodableMessage(ValueError):
    """This message's bytes cannot be read as a change of this shape (DLQ it)."""


# --------------------------------------------------------------- time format
def format_time_micros(micros: int) -> str:
    """``time-micros`` as ``HH:MM:SS`` (whole seconds) or ``HH:MM:SS.ffffff``."""
    seconds, frac = divmod(micros, 1_000_000)
    minutes, sec = divmod(seconds, 60)
    hours, minute = divmod(minutes, 60)
    if frac:
        return f"{hours:02d}:{minute:02d}:{sec:02d}.{frac:06d}"
    return f"{hours:02d}:{minute:02d}:{sec:02d}"


# Wide enough for any quantize of a numeric(38, s) value: never an InvalidOperation.
_FIT_CONTEXT = Context(prec=80, rounding=ROUND_HALF_UP)


def fit_decimal(value: Decimal, precision: int, scale: int) -> Decimal | None:
    """``value`` as PostgreSQL's cast to numeric(precision, scale) makes it
    (rounded half away from zero), or None where it has more integer digits
    than ``precision - scale``."""
    fitted = value.quantize(Decimal(1).scaleb(-scale), context=_FIT_CONTEXT)
    return fitted if not fitted or fitted.adjusted() < precision - scale else None


_INT_RANGES = {IntegerType(): (-2**31, 2**31 - 1), LongType(): (-2**63, 2**63 - 1)}


def cast_value(value: Any, spark_type: DataType) -> Any:
    """A value an older writer wrote in another type, as PostgreSQL's cast to
    the column's type now makes it (integers and numerics rounded half away
    from zero, text parsed, numbers printed), or None where that cast fails
    (out of range, not a number, a type with no cast here): the target's
    cast-or-NULL rule, which the producer's re-read of the shape fills."""
    try:
        if isinstance(spark_type, DecimalType):
            number = value if value.__class__ is Decimal else Decimal(str(value).strip())
            return None if not number.is_finite() else fit_decimal(number, spark_type.precision, spark_type.scale)
        if isinstance(spark_type, StringType):
            return format_decimal(value) if value.__class__ is Decimal else (
                str(value) if value.__class__ in (int, str) else None)
        low, high = _INT_RANGES[spark_type]
        if value.__class__ is int:
            number = value
        elif value.__class__ is Decimal:
            number = int(value.quantize(Decimal(1), context=_FIT_CONTEXT))
        elif value.__class__ is str and _INTEGER_TEXT.fullmatch(value):
            number = int(value)
        else:
            return None
        return number if low <= number <= high else None
    except (ArithmeticError, ValueError):
        return None


_INTEGER_TEXT = re.compile(r"\s*[+-]?\d+\s*")


def _caster(spark_type: DataType, has_special: bool) -> Callable[[Any], Any]:
    def cast(value: Any) -> Any:
        if has_special and value.__class__ is str:
            return value  # a special value's text (a union writer's string branch)
        return cast_value(value, spark_type)
    return cast


def _value_kinds(avro_type: Any) -> list:
    """What values a field's non-null branches hold, as decoding reads them
    (decimals with their precision and scale; logical types decoding strips as
    their primitive)."""
    branches = _non_null_branches(avro_type)
    if len(branches) > 1:  # a union layout's string branch holds special values only
        branches = [b for b in branches if b != "string"]
    return [b if isinstance(b, str) else b.get("type") if b.get("logicalType") in _STRIPPED_LOGICAL else
            _canonical_type(b) for b in branches]


def format_decimal(value: Decimal) -> str:
    """Plain notation keeping the scale, as PostgreSQL prints numeric(p,s)."""
    return format(value, "f")


# ------------------------------------------------------------ schema mapping
@dataclass(frozen=True)
class ColumnType:
    """How one Avro field becomes one Spark column."""

    spark_type: DataType
    # Special values may come as a str in the column (a union-layout writer's string branch).
    has_special: bool
    # Applied to each non-null, non-special value (None: value goes to Arrow as is).
    convert: Callable[[Any], Any] | None = None


def _non_null_branches(avro_type: Any) -> list:
    branches = avro_type if isinstance(avro_type, list) else [avro_type]
    return [b for b in branches if b != "null"]


def _map_single(t: Any, where: str) -> tuple[DataType, Callable[[Any], Any] | None]:
    """A non-union Avro type → Spark type and value converter."""
    if isinstance(t, str):
        if t in _PRIMITIVES:
            return _PRIMITIVES[t], None
        raise UnsupportedSchema(f"{where}: Avro type {t!r} is not supported")
    if not isinstance(t, dict):
        raise UnsupportedSchema(f"{where}: unexpected Avro type {t!r}")
    logical = t.get("logicalType")
    base = t.get("type")
    if logical == "decimal" and base in ("bytes", "fixed"):
        precision, scale = int(t["precision"]), int(t.get("scale", 0))
        if precision <= SPARK_MAX_DECIMAL_PRECISION and 0 <= scale <= precision:
            return DecimalType(precision, scale), None
        return StringType(), format_decimal
    if logical == "date" and base == "int":
        return DateType(), None
    if logical == "time-micros" and base == "long":
        return StringType(), format_time_micros
    if logical == "timestamp-micros" and base == "long":
        return TimestampType(), None
    if logical == "local-timestamp-micros" and base == "long":
        return TimestampNTZType(), None
    if logical == "uuid" and base == "string":
        return StringType(), None
    if base == "array":
        items = t["items"]
        item_branches = _non_null_branches(items)
        if len(item_branches) != 1:
            raise UnsupportedSchema(f"{where}: array items {items!r} are not a nullable single type")
        element, convert_item = _map_single(item_branches[0], f"{where}[]")
        contains_null = isinstance(items, list) and "null" in items
        if convert_item is None:
            return ArrayType(element, contains_null), None

        def convert_array(values: list) -> list:
            return [None if v is None else convert_item(v) for v in values]

        return ArrayType(element, contains_null), convert_array
    if isinstance(base, str) and base in _PRIMITIVES and not logical:
        return _PRIMITIVES[base], None
    raise UnsupportedSchema(f"{where}: Avro type {t!r} is not supported")


def _may_be_special(t: Any) -> bool:
    return isinstance(t, dict) and (t.get("logicalType") in _SPECIAL_LOGICAL or t.get("type") == "array")


def column_type(avro_type: Any, where: str = "field") -> ColumnType:
    """The Spark column for an Avro field type (a union with null, as the
    producer writes them, or a bare type)."""
    branches = _non_null_branches(avro_type)
    string_branch = "string" in branches and len(branches) > 1
    typed = [b for b in branches if b != "string"] if string_branch else branches
    if len(typed) != 1:
        raise UnsupportedSchema(f"{where}: union {avro_type!r} has no single typed branch")
    spark_type, convert = _map_single(typed[0], where)
    return ColumnType(spark_type, string_branch or _may_be_special(typed[0]), convert)


@dataclass(frozen=True)
class LayoutColumn:
    name: str  # PostgreSQL column name = Spark column name
    avro_field: str
    avro_type: Any
    pg_type: str | None
    is_key: bool
    type: ColumnType
    aliases: tuple[str, ...] = ()  # the Avro field's aliases: its names in older writers (a renamed column)

    def struct_field(self) -> StructField:
        meta = {"avro.field": self.avro_field, "wb.key": self.is_key}
        if self.pg_type is not None:
            meta["pg.type"] = self.pg_type
        return StructField(self.name, self.type.spark_type, nullable=True, metadata=meta)


def _canonical_type(avro_type: Any) -> str:
    return json.dumps(avro_type, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class ShapeLayout:
    """The Spark view of one shape: its columns (from the value schema) plus
    the bookkeeping columns."""

    envelope_name: str
    columns: tuple[LayoutColumn, ...]

    @classmethod
    def from_schemas(cls, value_schema: dict, key_schema: dict | None = None) -> ShapeLayout:
        columns = tuple(LayoutColumn(c.name, c.field, c.avro_type, c.pg_type, c.is_key,
                                     column_type(c.avro_type, f"column {c.name!r}"), c.aliases)
                        for c in shape_columns(value_schema, key_schema))
        return cls(full_name(value_schema), columns)

    def spark_schema(self) -> StructType:
        """Row columns, ``BOOKKEEPING``, then ``BEFORE_COLUMNS``."""
        row = [c.struct_field() for c in self.columns]
        return StructType(row + list(BOOKKEEPING) + [
            StructField(BEFORE_COLUMNS[0], StructType(row)),
            StructField(BEFORE_COLUMNS[1], MapType(StringType(), StringType(), valueContainsNull=False))])

    @property
    def key_columns(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns if c.is_key)

    def renamed_fields(self) -> dict[str, str]:
        """{earlier Avro field name: the column's field name now}, from the
        fields' aliases (a renamed column)."""
        fields = {c.avro_field for c in self.columns}
        return {a: c.avro_field for c in self.columns for a in c.aliases if a not in fields}

    def row_fields(self) -> list[str]:
        """The Avro fields a decoded row holds, in order: the columns', then the side field."""
        return [c.avro_field for c in self.columns] + [wire.SPECIAL_FIELD]

    def unscaled_decimals(self) -> dict[str, tuple[int, int]]:
        """{Avro field: (precision, scale)} of the Spark decimal columns the
        compiled reader may hand on as unscaled integers."""
        return {c.avro_field: (c.type.spark_type.precision, c.type.spark_type.scale) for c in self.columns
                if isinstance(c.type.spark_type, DecimalType)
                and c.type.spark_type.precision <= fastdecode.MAX_UNSCALED_PRECISION}

    def retyped_columns(self, writer_schema: dict) -> tuple[tuple[int, Callable[[Any], Any]], ...]:
        """(column index, cast) of the layout's columns whose values
        ``writer_schema`` (an older writer, fields named as the layout's) has
        in another type than the column takes now, for the types a cast is
        defined for (:func:`cast_value`): a retype at the source."""
        writer = {f["name"]: f["type"] for f in row_record(writer_schema)["fields"]}
        out = []
        for i, c in enumerate(self.columns):
            spark = c.type.spark_type
            if c.avro_field not in writer or c.type.convert is not None or not isinstance(
                    spark, (DecimalType, IntegerType, LongType, StringType)):
                continue  # (a converted column is no plain text: time, numeric beyond Spark's precision)
            if _value_kinds(writer[c.avro_field]) != _value_kinds(c.avro_type):
                out.append((i, _caster(spark, c.type.has_special)))
        return tuple(out)

    def check_writer(self, writer_schema: dict, known: bool) -> None:
        """Raise if a message written with ``writer_schema`` cannot be read into
        this layout: :class:`UndecodableMessage` for a schema of another shape
        (or not an envelope), :class:`SchemaChangedError` for a writer schema the
        stream did not know at its start (``known``) that adds or retypes a column."""
        if full_name(writer_schema) != self.envelope_name:
            raise UndecodableMessage(f"written with schema {full_name(writer_schema)!r}, "
                                     f"not this shape's {self.envelope_name!r}")
        try:
            writer_row = row_record(writer_schema)
        except UnsupportedSchema as e:
            raise UndecodableMessage(str(e)) from None
        if known:
            return  # an older version: read by name, dropped columns ignored
        by_field = {c.avro_field: c for c in self.columns}
        for f in writer_row["fields"]:
            if f["name"] == wire.SPECIAL_FIELD:
                continue
            col = by_field.get(f["name"])
            if col is None:
                raise SchemaChangedError(
                    f"a newer schema of {self.envelope_name} adds column {f.get('pg.column', f['name'])!r}; "
                    "restart the stream to pick it up")
            if _canonical_type(f["type"]) != _canonical_type(col.avro_type):
                raise SchemaChangedError(
                    f"a newer schema of {self.envelope_name} changes the type of column {col.name!r} "
                    f"from {col.avro_type!r} to {f['type']!r}; restart the stream to pick it up")


# ------------------------------------------------------------- writer schemas
def strip_logical_types(schema: Any) -> Any:
    """A copy of an Avro schema whose date/time/timestamp/uuid logical types are
    removed (same binary encoding; values decode to plain ints and strings)."""
    if isinstance(schema, list):
        return [strip_logical_types(s) for s in schema]
    if isinstance(schema, dict):
        if schema.get("logicalType") in _STRIPPED_LOGICAL:
            rest = {k: v for k, v in schema.items() if k != "logicalType"}
            return rest["type"] if len(rest) == 1 else rest
        out = {}
        for k, v in schema.items():
            if k == "fields":
                out[k] = [{**f, "type": strip_logical_types(f["type"])} for f in v]
            elif k in ("type", "items", "values"):
                out[k] = strip_logical_types(v)
            else:
                out[k] = v
        return out
    return schema


def with_renamed_fields(schema: dict, renamed: dict[str, str], envelope: bool) -> dict:
    """A writer schema (an envelope, or a key record) whose row fields that
    the layout knows by an alias (an older writer of a renamed column) carry
    the column's current field name, so their values land in its column; the
    binary encoding does not depend on field names."""
    if not renamed:
        return schema
    schema = copy.deepcopy(schema)
    record = row_record(schema) if envelope else schema
    names = {f["name"] for f in record.get("fields", ())}
    for f in record.get("fields", ()):
        new = renamed.get(f["name"])
        if new is not None and new not in names:
            f["name"] = new
    return schema


def schema_ref_key(ref: wire.SchemaRef) -> str:
    """A writer schema's identity as a string: ``id:<registry id>`` or ``fp:<hex>``."""
    return f"id:{ref.ref}" if ref.kind == "confluent" else f"fp:{ref.ref.hex()}"


# Looks up a writer schema (as JSON) by reference; raises UndecodableMessage when
# it does not exist, anything else when the lookup itself failed.
SchemaLookup = Callable[[wire.SchemaRef, bytes], dict]


@dataclass
class WriterSchemas:
    """Writer schemas by reference, checked against the layout once each and
    parsed for decoding. ``known`` holds the refs of the value schemas that
    existed when the stream started."""

    layout: ShapeLayout
    lookup: SchemaLookup
    known: frozenset[str] = frozenset()
    # True: any value schema not in ``known`` raises SchemaChangedError (the
    # driver then derives the layout again); False: only one that adds or
    # retypes a column.
    only_known: bool = False
    # Refs the driver looked for and nobody published: looked up like any
    # (not found: the message is undecodable), never taken for a new schema.
    unpublished: frozenset[str] = frozenset()
    # Read value bodies with the compiled reader where it applies (false: fastavro only).
    compiled: bool = True
    _parsed: dict[tuple, Any] = field(default_factory=dict)
    _readers: dict[tuple, Any] = field(default_factory=dict)
    # Value schemas of older writers with retyped columns (ShapeLayout.retyped_columns): fastavro reads them.
    _retyped: dict[tuple, tuple] = field(default_factory=dict)
    # Refs found not to exist (or not to fit): the producer publishes a schema
    # before its first message, so a failed lookup is final; asking again for
    # each message of a poison burst would only hammer the registry/topic.
    _undecodable: dict[tuple, str] = field(default_factory=dict)

    def _get(self, key: tuple, ref: wire.SchemaRef, data: bytes, check: bool) -> Any:
        parsed = self._parsed.get(key)
        if parsed is not None:
            return parsed
        if key in self._undecodable:
            raise UndecodableMessage(self._undecodable[key])
        try:
            name = schema_ref_key(ref)
            if check and self.only_known and name not in self.known and name not in self.unpublished:
                raise SchemaChangedError(f"written with value schema {name}, which the layout was not derived "
                                         "with", name)
            raw = self.lookup(ref, data)
            if check:
                self.layout.check_writer(raw, schema_ref_key(ref) in self.known)
        except UndecodableMessage as e:
            self._undecodable[key] = str(e)
            raise
        stripped = with_renamed_fields(strip_logical_types(raw), self.layout.renamed_fields(), check)
        retyped = self.layout.retyped_columns(stripped) if check else ()
        if retyped:
            self._retyped[key] = retyped
        elif check and self.compiled:
            self._readers[key] = fastdecode.envelope_reader(
                stripped, self.layout.row_fields(), self.layout.unscaled_decimals())
        parsed = self._parsed[key] = parse_schema(stripped)
        return parsed

    def parsed(self, ref: wire.SchemaRef, data: bytes) -> Any:
        """The parsed value writer schema, checked against the layout."""
        return self._get((ref.kind, ref.ref), ref, data, True)

    def reader(self, ref: wire.SchemaRef) -> Any:
        """The compiled envelope reader of a value schema :meth:`parsed` returned,
        or None (fastavro reads its messages)."""
        return self._readers.get((ref.kind, ref.ref))

    def retyped(self, ref: wire.SchemaRef) -> tuple[tuple[int, Callable[[Any], Any]], ...]:
        """The retyped columns of a value schema :meth:`parsed` returned."""
        return self._retyped.get((ref.kind, ref.ref), ())

    def parsed_key(self, ref: wire.SchemaRef, data: bytes) -> Any:
        return self._get(("key", ref.kind, ref.ref), ref, data, False)


def decode_body(data: bytes, body_offset: int, parsed: Any) -> Any:
    """The Avro body after the wire prefix; every byte must belong to it."""
    buf = io.BytesIO(data)
    buf.seek(body_offset)
    try:
        record = schemaless_reader(buf, parsed, None)
    except Exception as e:  # fastavro raises EOFError, ValueError, IndexError, UnicodeDecodeError, ...
        raise UndecodableMessage(f"corrupt Avro body: {type(e).__name__}: {e}") from None
    if buf.tell() != len(data):
        raise UndecodableMessage(f"corrupt Avro body: {len(data) - buf.tell()} bytes after the record")
    return record


def parse_prefix(data: bytes) -> wire.SchemaRef:
    try:
        return wire.parse_prefix(data)
    except ValueError as e:
        raise UndecodableMessage(str(e)) from None


# --------------------------------------------------------------- row building
class BatchBuilder:
    """Accumulates decoded messages and turns them into Arrow record batches
    with exactly Spark's Arrow schema for the layout.

    Each message becomes one Python list (row values, then bookkeeping values
    in ``BOOKKEEPING`` order, then ``BEFORE_COLUMNS``); a batch transposes them
    into columns at once. Row values are fastavro's, except that decimal
    columns of precision <= 18 may hold ``fastdecode.Unscaled`` integers
    (compiled reads), which only ``to_record_batch`` turns into Arrow."""

    def __init__(self, layout: ShapeLayout, schemas: WriterSchemas, arrow_schema: Any = None):
        self.layout = layout
        self.schemas = schemas
        if arrow_schema is None:
            arrow_schema = to_arrow_schema(layout.spark_schema())
        self.arrow_schema = arrow_schema
        self._fields = [c.avro_field for c in layout.columns]
        self._row_fields = layout.row_fields()
        self._special = [(i, c.name) for i, c in enumerate(layout.columns) if c.type.has_special]
        self._converters = [c.type.convert for c in layout.columns]
        # Avro field -> column name; an older writer's name of a renamed column too (its unchanged_toast).
        self._name_by_field = {**{a: c.name for c in layout.columns for a in c.aliases},
                               **{c.avro_field: c.name for c in layout.columns}}
        self._key_fields = [(i, c.avro_field) for i, c in enumerate(layout.columns) if c.is_key]
        self._names = [c.name for c in layout.columns]
        self._column_names = frozenset(self._names)
        self._struct_converters = [(c.name, c.type.convert) for c in layout.columns if c.type.convert is not None]
        self._empty_row = [None] * len(self._fields)
        # wire prefix bytes -> (parsed writer schema, body offset, compiled reader or None,
        # retyped columns), for schemas that decoded
        self._by_prefix: dict[bytes, tuple[Any, int, Any, tuple]] = {}
        self._records: list[list] = []
        compiled = schemas.compiled and fastdecode.AVAILABLE
        unscaled = layout.unscaled_decimals()
        # Row columns whose values may be fastdecode.Unscaled (compiled reads): index -> Arrow type.
        self._unscaled = {i: arrow_schema.field(i).type for i, c in enumerate(layout.columns)
                          if c.avro_field in unscaled} if compiled else {}
        # The compiled row of an ordinary change (None: every message takes the steps below).
        self._assembler = fastdecode.row_assembler(
            self._by_prefix, self._special, [i for i, _ in self._key_fields], self._name_by_field, self._names,
            list(self._unscaled),
        ) if compiled else None

    @property
    def count(self) -> int:
        return len(self._records)

    def _writer(self, value: bytes) -> tuple[Any, int, Any, tuple]:
        head = value[:10] if value[:1] == b"\xc3" else value[:5]
        found = self._by_prefix.get(head)
        if found is None:
            ref = parse_prefix(value)
            found = (self.schemas.parsed(ref, value), ref.body_offset, self.schemas.reader(ref),
                     self.schemas.retyped(ref))
            if len(head) == ref.body_offset:
                self._by_prefix[head] = found
        return found

    def _envelope(self, value: bytes) -> list:
        """The envelope's parts as ``fastdecode.ENVELOPE_SLOTS`` orders them:
        [before, after, source, op, ts_ms, unchanged_toast], rows as lists in
        the layout's column order followed by the side field, source as [lsn,
        op_index, snapshot_id, commit_lsn]."""
        parsed, body_offset, reader, retyped = self._writer(value)
        if reader is not None:
            try:
                return reader.read(value, body_offset)
            except Exception:
                pass  # a body the compiled reader refuses: fastavro decides (values or UndecodableMessage)
        env = decode_body(value, body_offset, parsed)
        fields = self._row_fields
        before, after, source = env.get("before"), env.get("after"), env.get("source") or {}
        rows = [None if row is None else [row.get(f) for f in fields] for row in (before, after)]
        for i, cast in retyped:
            for row in rows:
                if row is not None and row[i] is not None:
                    row[i] = cast(row[i])
        return [*rows,
                [source.get("lsn"), source.get("op_index"), source.get("snapshot_id"), source.get("commit_lsn")],
                env.get("op"), env.get("ts_ms"), env.get("unchanged_toast")]

    def add(self, topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None,
            headers: list | None) -> None:
        """Add one message; raises :class:`UndecodableMessage` (nothing added)
        or :class:`SchemaChangedError`."""
        if self._assembler is not None:
            row = self._assembler.add(topic, partition, offset, key, value, headers)
            if row is not None:
                self._records.append(row)
                return
        pos = control = info = snapshot = None
        if headers:
            for name, hv in headers:
                if name == wire.POSITION_HEADER:
                    pos = hv
                elif name == wire.CONTROL_HEADER:
                    control = hv
                elif name == wire.CONTROL_INFO_HEADER:
                    info = hv
                elif name == wire.SNAPSHOT_HEADER:
                    snapshot = hv
        lsn = op_index = None
        if pos is not None:
            try:
                lsn, op_index = wire.parse_position(pos)
            except Exception:
                raise UndecodableMessage(f"unreadable {wire.POSITION_HEADER} header {bytes(pos).hex()}") from None
        if control is not None:
            self._records.append(self._empty_row + [
                None, lsn, op_index, topic, partition, offset, None, None, _text(control), _text(info),
                _text(snapshot), None, None, None, None])
            return
        if value is None:  # a delete's tombstone (for compaction): nothing to apply, its offset is read
            self._records.append(self._empty_row + [
                None, lsn, op_index, topic, partition, offset, None, None, wire.TOMBSTONE_CONTROL, None,
                _text(snapshot), None, None, None, None])
            return
        before, after, source, op, ts_ms, unchanged = self._envelope(value)
        if op not in wire.OPS:
            raise UndecodableMessage(f"envelope op {op!r} is not one of c, u, d, r, t")
        if (lsn is None or snapshot is None) and source is not None:
            if lsn is None:
                lsn, op_index = source[0] if source[3] is None else source[3], source[1]
            if snapshot is None:
                snapshot = source[2]
        row = before if op == "d" else after
        if op == "d" and key is not None and self._key_fields and (
                row is None or any(row[i] is None for i, _ in self._key_fields)):
            row = self._fill_key(row, key)
        special = None
        if row is None:
            values = list(self._empty_row)
        else:
            values = row  # a fresh list per message, ours to extend
            special = self._take_specials(values)
        if unchanged:
            unchanged = [self._name_by_field.get(f, f) for f in unchanged]
        before_special = None
        if op == "u" and before is not None:
            before, before_special = self._old_row(before)
        else:
            before = None
        values += (op, lsn, op_index, topic, partition, offset, unchanged or None, special, None, None,
                   _text(snapshot), ts_ms, None, before, before_special)
        self._records.append(values)

    def _take_specials(self, values: list) -> list | None:
        """Takes the side field off a decoded row and moves the special-value
        texts (NaN, infinity, ...: the side field's, and a union writer's
        string branch values) out of ``values``: their [(column, text)], or None."""
        side = values.pop()
        special = None
        for i, name in self._special:
            v = values[i]
            if v.__class__ is str:
                if special is None:
                    special = []
                special.append((name, v))
                values[i] = None
        if side is not None:  # columns dropped since the writer's schema are ignored, as their values are
            special = (special or []) + [p for p in side_pairs(side) if p[0] in self._column_names]
        return special

    def _old_row(self, record: list) -> tuple[dict, list | None]:
        special = self._take_specials(record)
        for i in self._unscaled:
            if fastdecode.is_unscaled(record[i]):
                record[i] = record[i].to_decimal()
        return dict(zip(self._names, record)), special

    def add_dlq(self, topic: str, partition: int, offset: int, headers: list | None, error: str) -> None:
        """The row of a message sent to the DLQ (row columns null)."""
        lsn = op_index = None
        pos = wire.header(headers, wire.POSITION_HEADER)
        if pos is not None:
            try:
                lsn, op_index = wire.parse_position(pos)
            except Exception:
                pass
        self.add_control(topic, partition, offset, wire.DLQ_CONTROL, error, lsn, op_index)

    def add_control(self, topic: str, partition: int, offset: int, control: str, error: str,
                    lsn: int | None = None, op_index: int | None = None, info: str | None = None) -> None:
        """A row of the decoder's own (row columns null): ``_wb_control``, why
        in ``_wb_error`` and ``info`` in ``_wb_control_info``."""
        self._records.append(self._empty_row + [
            None, lsn, op_index, topic, partition, offset, None, None, control, info, None, None, error,
            None, None])

    def _fill_key(self, row: list | None, key: bytes) -> list | None:
        try:
            ref = wire.parse_prefix(key)
            parsed = self.schemas.parsed_key(ref, key)
            key_record = decode_body(key, ref.body_offset, parsed)
        except (ValueError, UndecodableMessage):
            return row  # the value is what counts; an unreadable key adds nothing
        filled = list(row) if row is not None else self._empty_row + [None]
        for i, f in self._key_fields:
            if filled[i] is None:
                filled[i] = key_record.get(f)
        key_side = key_record.get(wire.SPECIAL_FIELD)
        if key_side is not None:  # the plain layout's key: its special values, merged into the row's
            merged = dict(side_pairs(filled[-1])) if filled[-1] is not None else {}
            merged.update(side_pairs(key_side))
            filled[-1] = json.dumps(merged)
        return filled

    def to_record_batch(self):
        """The rows added since the last call, as one ``pyarrow.RecordBatch``."""
        schema = self.arrow_schema
        records, self._records = self._records, []
        if not records:
            return pa.RecordBatch.from_pylist([], schema=schema)
        arrays = []
        n_row = len(self._fields)
        before_index = n_row + len(BOOKKEEPING)
        for i, values in enumerate(zip(*records)):
            convert = self._converters[i] if i < n_row else None
            if i in self._unscaled:
                arrays.append(fastdecode.decimal_array(list(values), self._unscaled[i]))
                continue
            if convert is not None:
                values = [None if v is None else convert(v) for v in values]
            elif i == before_index and self._struct_converters:
                for old in values:
                    if old is not None:
                        for name, conv in self._struct_converters:
                            if old[name] is not None:
                                old[name] = conv(old[name])
            arrays.append(pa.array(values, type=schema.field(i).type))
        return pa.RecordBatch.from_arrays(arrays, schema=schema)

    def rows(self) -> list[dict]:
        """The rows added since the last call as plain dicts (tests, debugging)."""
        return self.to_record_batch().to_pylist()


def side_pairs(side: str) -> list[tuple[str, str]]:
    """The (column, text) pairs of a side field's JSON."""
    try:
        pairs = json.loads(side)
    except ValueError:
        pairs = None
    if not isinstance(pairs, dict) or not all(isinstance(v, str) for v in pairs.values()):
        raise UndecodableMessage(f"side field {wire.SPECIAL_FIELD} is not a JSON object of texts: {side[:100]!r}")
    return list(pairs.items())


def _text(value: bytes | str | None) -> str | None:
    """A header's value as text (a value from the envelope already is)."""
    if value is None or value.__class__ is str:
        return value
    return bytes(value).decode("utf-8", "replace")


# ------------------------------------------------------------ driver side
_UTC_NAMES = frozenset({"UTC", "utc", "Etc/UTC", "+00:00", "Z"})
_MICROS_PER_UNIT = {"s": 1_000_000, "ms": 1000, "us": 1}


def arrow_rows(data: Any) -> tuple[tuple[str, ...], list[tuple]]:
    """Decoded rows from Arrow (a ``pyarrow.Table`` or record batches, e.g.
    ``DataFrame.toArrow()``) as (column names, one tuple per row): the input
    :func:`spark_consumer.apply_plan.plan_batch` plans without copying.

    The values are what ``to_pylist()`` gives, converted column by column
    instead of a dict per row (a few times faster); UTC timestamps, which
    ``to_pylist`` turns into datetimes through a time zone lookup per value, are
    built from their integer value with ``datetime.timezone.utc`` (equal values)."""
    epoch = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
    delta = datetime.timedelta
    if not isinstance(data, pa.Table):
        batches = list(data)
        if not batches:
            return (), []
        data = pa.Table.from_batches(batches)
    table = data
    columns = []
    for col in table.columns:
        t = col.type
        if pa.types.is_timestamp(t) and t.tz in _UTC_NAMES and t.unit in _MICROS_PER_UNIT:
            scale = _MICROS_PER_UNIT[t.unit]
            columns.append([None if v is None else epoch + delta(0, 0, v * scale)
                            for v in col.cast(pa.int64()).to_pylist()])
        else:
            columns.append(col.to_pylist())
    rows = list(zip(*columns)) if columns else []
    return tuple(table.column_names), rows
