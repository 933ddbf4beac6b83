"""PostgreSQL column types → Avro types, and PostgreSQL text values → the Python
values both the shape filters and the Avro encoder use.

Invariants:
- Pure: the catalog facts about a type come in as a :class:`PgTypeInfo` (read by
  :mod:`producer.catalog`); nothing here talks to a database.
- Values are parsed by psycopg's own loaders for the type's OID (text format),
  once per change, whatever the number of shapes.
- Nothing is lost. Where a logical type cannot hold every PostgreSQL value
  (``NaN``/``±Infinity`` numerics, ``±infinity`` and out-of-range
  dates/timestamps, ``24:00:00``, multi-dimensional arrays) the column is
  ``special``: its loader returns such a value as its PostgreSQL text form (a
  ``str``, which no typed value of these columns is), and the envelope carries
  it beside the typed values (:meth:`ColumnCodec.field_type`: in the plain
  layout's side field, or the union layout's ``string`` branch).
- Types with no Avro counterpart (interval, money, inet, enums, ranges,
  composites, geometric, bit strings, xml, json/jsonb, ...) travel as their
  PostgreSQL text form, exactly as PostgreSQL printed it.
- Domains map as their base type; enums as strings.
- Each field carries ``"pg.type"`` (the source column type, e.g.
  ``numeric(10,2)``) so a consumer can recreate a faithful target column.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from psycopg import DataError
from psycopg import adapters as default_adapters
from psycopg.pq import Format

# Builtin type OIDs (pg_type.h); stable across PostgreSQL versions.
BOOL, BYTEA, CHAR, NAME, INT8, INT2, INT4, TEXT, OID = 16, 17, 18, 19, 20, 21, 23, 25, 26
JSON, XML, FLOAT4, FLOAT8, MONEY, BPCHAR, VARCHAR = 114, 142, 700, 701, 790, 1042, 1043
DATE, TIME, TIMESTAMP, TIMESTAMPTZ, INTERVAL, TIMETZ = 1082, 1083, 1114, 1184, 1186, 1266
NUMERIC, UUID, JSONB = 1700, 2950, 3802

_DECIMAL_BRANCH_MAX_PRECISION = 1000

# Typed values whose logical type may not hold every PostgreSQL value; their
# unions get a string branch for the exceptions.
_TEMPORAL = {
    DATE: {"type": "int", "logicalType": "date"},
    TIME: {"type": "long", "logicalType": "time-micros"},
    TIMESTAMP: {"type": "long", "logicalType": "local-timestamp-micros"},
    TIMESTAMPTZ: {"type": "long", "logicalType": "timestamp-micros"},
}
_PLAIN = {
    BOOL: "boolean",
    BYTEA: "bytes",
    INT2: "int",
    INT4: "int",
    INT8: "long",
    OID: "long",
    FLOAT4: "float",
    FLOAT8: "double",
    UUID: {"type": "string", "logicalType": "uuid"},
}
_ARRAY_ITEMS = {**_PLAIN, **_TEMPORAL, TEXT: "string", VARCHAR: "string", BPCHAR: "string", NAME: "string"}


@dataclass(frozen=True, slots=True)
class PgTypeInfo:
    """What the catalog says about a column's type, domains already resolved."""

    oid: int  # the column's declared type (may be a domain)
    name: str  # format_type(oid, typmod), e.g. "numeric(10,2)", "mood"
    base_oid: int  # after resolving domains
    base_name: str  # format_type(base_oid, base_typmod)
    base_typmod: int  # typmod that applies to the base type
    kind: str  # pg_type.typtype of the base type: b, e, c, r, m, p
    elem_oid: int = 0  # element type when the base type is an array
    elem_kind: str = ""
    elem_typmod: int = -1


@dataclass(frozen=True, slots=True)
class ColumnCodec:
    """How one column travels: the Avro type of its values and its text-value loader."""

    typed: Any  # the Avro type of its typed values ("string" for text forms)
    special: bool  # some values do not fit ``typed``: the loader returns their text (a str)
    load: Callable[[bytes], Any]
    pg_type: str  # the target-side type to recreate (builtin name, or "text")
    # How the compiled encoder (:mod:`producer.fastcodec`) may read the text
    # value straight into Avro: one of :data:`WIRE_KINDS`; "py" means only
    # through ``load`` and fastavro.
    wire: str = "py"

    def field_type(self, layout: str, nullable: bool = True) -> Any:
        """The Avro type of the column's field in ``layout`` ("plain": special
        values travel in the record's side field, so the field is ``[null, T]``,
        nullable even in a key; "union": in a ``string`` branch before ``T``).
        A key field (``nullable`` False) loses the null branch where it can."""
        if layout == "plain":
            return ["null", self.typed] if nullable or self.special else self.typed
        branches = ["string", self.typed] if self.special else [self.typed]
        if nullable:
            return ["null", *branches]
        return branches if len(branches) > 1 else branches[0]


# Text forms the compiled encoder turns into Avro itself, byte-identical to
# ``load`` + fastavro; anything it does not recognise goes through ``load``.
WIRE_KINDS = ("py", "text", "bool", "int", "long", "float", "double", "bytea", "date", "time", "timestamp",
              "timestamptz", "decimal")
_WIRE_OF = {BOOL: "bool", INT2: "int", INT4: "int", INT8: "long", OID: "long", FLOAT4: "float", FLOAT8: "double",
            BYTEA: "bytea", UUID: "text", DATE: "date", TIME: "time", TIMESTAMP: "timestamp",
            TIMESTAMPTZ: "timestamptz", NUMERIC: "decimal"}


def _utf8(context: Any) -> bool:
    """Whether text values decode as UTF-8 (the compiled encoder copies them as is)."""
    if context is None:
        return True
    try:
        return context.info.encoding.replace("_", "-").lower() in ("utf-8", "utf8")
    except AttributeError:
        return False


def numeric_precision_scale(typmod: int) -> tuple[int, int] | None:
    """``numeric(p,s)``'s precision and scale from its typmod; None when unbounded."""
    if typmod < 4:
        return None
    mod = typmod - 4
    precision = (mod >> 16) & 0xFFFF
    scale = mod & 0x7FF
    if scale & 0x400:  # PostgreSQL 15 allows negative scales (11-bit two's complement)
        scale -= 0x800
    return precision, scale


def _loader(oid: int, context: Any) -> Callable[[bytes], Any]:
    adapters = context.adapters if context is not None else default_adapters
    cls = adapters.get_loader(oid, Format.TEXT)
    if cls is None:
        raise LookupError(f"psycopg has no text loader for type oid {oid}")
    return cls(oid, context).load


def _text_loader(context: Any) -> Callable[[bytes], Any]:
    return _loader(TEXT, context)


def _with_text_fallback(load: Callable[[bytes], Any], text: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """Values the Python type cannot hold (PostgreSQL's infinities, NaN, 24:00,
    years outside 1..9999) keep their PostgreSQL text form."""

    def load_or_text(raw: bytes) -> Any:
        try:
            return load(raw)
        except (DataError, ValueError, OverflowError):
            return text(raw)

    return load_or_text


def _scalar(oid: int, typmod: int, context: Any) -> tuple[Any, bool, Callable[[bytes], Any]] | None:
    """Avro type, whether it has special values, and loader for a builtin
    scalar; None if it travels as text."""
    if oid in _PLAIN:
        return _PLAIN[oid], False, _loader(oid, context)
    if oid in _TEMPORAL:
        return dict(_TEMPORAL[oid]), True, _with_text_fallback(_loader(oid, context), _text_loader(context))
    if oid == NUMERIC:
        ps = numeric_precision_scale(typmod)
        if ps is None or not (0 <= ps[1] <= ps[0] <= _DECIMAL_BRANCH_MAX_PRECISION):
            return None  # unbounded (or negative scale): exact text form
        decimal = {"type": "bytes", "logicalType": "decimal", "precision": ps[0], "scale": ps[1]}
        load_decimal = _loader(NUMERIC, context)
        text = _text_loader(context)

        def load_numeric(raw: bytes) -> Any:
            value = load_decimal(raw)
            return value if value.is_finite() else text(raw)  # NaN, ±Infinity

        return decimal, True, load_numeric
    return None


def column_codec(info: PgTypeInfo, context: Any = None) -> ColumnCodec:
    """The codec of a column of the given type. ``context`` is a psycopg
    connection (or None) whose adapters and settings the loaders follow."""
    text = _text_loader(context)
    if info.kind == "b" and info.elem_oid == 0:
        scalar = _scalar(info.base_oid, info.base_typmod, context)
        if scalar is not None:
            typed, special, load = scalar
            wire = _WIRE_OF.get(info.base_oid, "py")
            if wire == "text" and not _utf8(context):
                wire = "py"
            return ColumnCodec(typed, special, load, _target_type(info), wire)
    elif info.elem_oid and info.elem_kind == "b" and info.elem_oid in _ARRAY_ITEMS:
        # 1-D arrays of a plain, textual or temporal builtin: an Avro array of
        # nullable items; anything psycopg or Avro cannot hold (multi-dimensional
        # arrays, infinities inside) falls back to the array's text form.
        item = _ARRAY_ITEMS[info.elem_oid]
        load_array = _loader(info.base_oid, context)

        def load_1d_array(raw: bytes) -> Any:
            try:
                values = load_array(raw)
            except (DataError, ValueError, OverflowError):
                return text(raw)
            if any(isinstance(v, list) for v in values):
                return text(raw)
            return values

        return ColumnCodec({"type": "array", "items": ["null", item]}, True, load_1d_array, _target_type(info))
    return ColumnCodec("string", False, text, _target_type(info), "text" if _utf8(context) else "py")


_BUILTIN_MAX_OID = 16383  # FirstNormalObjectId - 1


def _target_type(info: PgTypeInfo) -> str:
    """The type a target table should use: the source type when it is builtin
    (so values round-trip exactly), otherwise ``text`` (enums, composites and
    domains over them do not exist in the target database)."""
    if info.kind != "b" or info.base_oid > _BUILTIN_MAX_OID or info.elem_oid > _BUILTIN_MAX_OID:
        return "text"
    return info.base_name  # a domain over a builtin becomes that builtin
