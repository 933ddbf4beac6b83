"""Pure parts of the Spark source: Avro → Spark schema mapping, message
decoding into Arrow rows, writer-schema checks, and offset planning.

Messages are built with the producer's own ShapeCodec, so the bytes are the
ones the real producer writes."""

from __future__ import annotations

import datetime as dt
import io
import json
import re
import uuid
from decimal import Decimal

import pyarrow as pa
import pytest
from fastavro import parse_schema, schemaless_writer
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    StringType,
    TimestampNTZType,
    TimestampType,
)

from producer.envelope import ShapeCodec, ShapeColumn
from producer.pgtypes import PgTypeInfo, column_codec
from schemas import wire
from spark_consumer import fastdecode
from spark_consumer.decode import (
    BEFORE_COLUMNS,
    BOOKKEEPING_NAMES,
    BatchBuilder,
    SchemaChangedError,
    ShapeLayout,
    UndecodableMessage,
    UnsupportedSchema,
    WriterSchemas,
    arrow_rows,
    cast_value,
    column_type,
    format_time_micros,
    strip_logical_types,
)
from spark_consumer.shape_schemas import ShapeSource, schema_lookup

TOPIC = "wb.public.t"


def _col(name: str, oid: int, type_name: str, typmod: int = -1, key: bool = False, elem: int = 0) -> ShapeColumn:
    info = PgTypeInfo(oid, type_name, oid, type_name, typmod, "b", elem, "b" if elem else "", -1)
    return ShapeColumn(name, column_codec(info), key)


def _numeric(p: int, s: int) -> int:
    return ((p << 16) | s) + 4


COLUMNS = [
    _col("id", 20, "bigint", key=True),
    _col("flag", 16, "boolean"),
    _col("small", 21, "smallint"),
    _col("real4", 700, "real"),
    _col("dbl", 701, "double precision"),
    _col("amount", 1700, "numeric(10,2)", _numeric(10, 2)),
    _col("huge", 1700, "numeric(50,3)", _numeric(50, 3)),
    _col("free", 1700, "numeric"),
    _col("day", 1082, "date"),
    _col("at", 1083, "time without time zone"),
    _col("local_ts", 1114, "timestamp without time zone"),
    _col("ts", 1184, "timestamp with time zone"),
    _col("uid", 2950, "uuid"),
    _col("ints", 1007, "integer[]", elem=23),
    _col("days", 1182, "date[]", elem=1082),
    _col("body", 25, "text"),
    _col("raw", 17, "bytea"),
    _col("Mixed Case", 25, "text"),
]
ROW = (
    7, True, -3, 1.5, 2.25, Decimal("12.30"), Decimal("-123456789012345678901234567890.123"), "1e-30",
    dt.date(2024, 2, 29), dt.time(13, 14, 15, 123456), dt.datetime(2024, 1, 1, 10, 0, 0, 500000),
    dt.datetime(2024, 1, 1, 7, 0, 0, 250000, tzinfo=dt.timezone.utc), uuid.UUID("a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"),
    [1, None, 3], [dt.date(2024, 1, 1), None], "héllo", b"\x00\xff", "mc",
)
SPECIAL_ROW = (
    8, None, None, float("inf"), None, "NaN", "Infinity", "NaN",
    "infinity", "24:00:00", "-infinity", "0044-03-15 00:00:00+00 BC", None,
    "{{1,2},{3,4}}", "{infinity}", None, None, None,
)


class Shape:
    """A shape's codec plus single-object prefixes and a schema lookup."""

    def __init__(self, columns=COLUMNS, shape: str = "public.t", prefix: str = "wb", layout: str = "plain"):
        self.codec = ShapeCodec(shape, prefix, "db", "public", "t", columns, list(range(len(columns))), layout)
        self.schemas: dict[bytes, dict] = {}
        self.value_prefix = self.publish(self.codec.value_schema)
        self.key_prefix = self.publish(self.codec.key_schema) if self.codec.key_schema else None
        self.layout = ShapeLayout.from_schemas(self.codec.value_schema, self.codec.key_schema)
        self.lookups = 0

    def publish(self, schema: dict) -> bytes:
        fp = wire.schema_fingerprint(schema)
        self.schemas[fp] = schema
        return wire.single_object_prefix(fp)

    def lookup(self, ref: wire.SchemaRef, data: bytes) -> dict:
        self.lookups += 1
        try:
            return self.schemas[ref.ref]
        except KeyError:
            raise UndecodableMessage(f"unknown schema fingerprint {ref.ref.hex()}") from None

    def known(self) -> frozenset[str]:
        return frozenset(f"fp:{fp.hex()}" for fp in self.schemas)

    def builder(self, known: frozenset[str] | None = None, layout: ShapeLayout | None = None) -> BatchBuilder:
        layout = layout or self.layout
        return BatchBuilder(layout, WriterSchemas(layout, self.lookup, self.known() if known is None else known))

    def value(self, op: str, before=None, after=None, lsn: int = 100, op_index: int = 0, unchanged=None,
              snapshot_id: str | None = None, prefix: bytes | None = None) -> bytes:
        source = self.codec.source(lsn, op_index, 5, 1_700_000_000_000, snapshot_id is not None, snapshot_id)
        envelope = self.codec.envelope(op, before, after, source, 1_700_000_000_123, unchanged)
        return self.codec.encode_value(self.value_prefix if prefix is None else prefix, envelope)

    def key(self, values: tuple) -> bytes:
        return self.codec.encode_key(self.key_prefix, values)


def pos(lsn: int, op_index: int = 0) -> list:
    return [(wire.POSITION_HEADER, wire.position_header(lsn, op_index))]


# ------------------------------------------------------------ schema mapping
@pytest.mark.parametrize("avro_type, spark_type, special", [
    (["null", "int"], IntegerType(), False),
    (["null", "long"], LongType(), False),
    (["null", "float"], FloatType(), False),
    (["null", "double"], DoubleType(), False),
    (["null", "boolean"], BooleanType(), False),
    (["null", "string"], StringType(), False),
    (["null", "bytes"], BinaryType(), False),
    (["null", {"type": "string", "logicalType": "uuid"}], StringType(), False),
    (["null", "string", {"type": "bytes", "logicalType": "decimal", "precision": 10, "scale": 2}],
     DecimalType(10, 2), True),
    (["null", "string", {"type": "bytes", "logicalType": "decimal", "precision": 38, "scale": 38}],
     DecimalType(38, 38), True),
    (["null", "string", {"type": "bytes", "logicalType": "decimal", "precision": 39, "scale": 2}],
     StringType(), True),
    (["null", "string", {"type": "int", "logicalType": "date"}], DateType(), True),
    (["null", "string", {"type": "long", "logicalType": "time-micros"}], StringType(), True),
    (["null", "string", {"type": "long", "logicalType": "timestamp-micros"}], TimestampType(), True),
    (["null", "string", {"type": "long", "logicalType": "local-timestamp-micros"}], TimestampNTZType(), True),
    (["null", "string", {"type": "array", "items": ["null", "int"]}], ArrayType(IntegerType(), True), True),
    (["null", "string", {"type": "array", "items": ["null", {"type": "long", "logicalType": "timestamp-micros"}]}],
     ArrayType(TimestampType(), True), True),
    ("long", LongType(), False),
])
def test_column_types(avro_type, spark_type, special):
    mapped = column_type(avro_type)
    assert mapped.spark_type == spark_type
    assert mapped.has_special is special


@pytest.mark.parametrize("avro_type", [
    ["null", "int", "long"],
    ["null", {"type": "enum", "name": "E", "symbols": ["a"]}],
    ["null", {"type": "long", "logicalType": "timestamp-millis"}],
])
def test_unsupported_types_are_refused(avro_type):
    with pytest.raises(UnsupportedSchema):
        column_type(avro_type)


def test_layout_columns_names_and_metadata():
    shape = Shape()
    schema = shape.layout.spark_schema()
    names = schema.fieldNames()
    assert names[:len(COLUMNS)] == [c.name for c in COLUMNS]  # PostgreSQL names, shape order
    assert tuple(names[len(COLUMNS):]) == BOOKKEEPING_NAMES + BEFORE_COLUMNS
    assert names[len(COLUMNS):] == [
        "_wb_op", "_wb_lsn", "_wb_op_index", "_wb_topic", "_wb_partition", "_wb_offset", "_wb_unchanged",
        "_wb_special", "_wb_control", "_wb_control_info", "_wb_snapshot_id", "_wb_ts_ms", "_wb_error",
        "_wb_before", "_wb_before_special"]
    assert schema["_wb_before"].dataType.fieldNames() == [c.name for c in COLUMNS]
    assert schema["_wb_before"].dataType["amount"].dataType == DecimalType(10, 2)
    mixed = schema["Mixed Case"]
    assert mixed.metadata == {"avro.field": "Mixed_Case", "wb.key": False, "pg.type": "text"}
    assert schema["id"].metadata["wb.key"] is True and shape.layout.key_columns == ("id",)
    assert schema["amount"].metadata["pg.type"] == "numeric(10,2)"
    assert schema["amount"].dataType == DecimalType(10, 2)
    assert schema["huge"].dataType == StringType()  # beyond Spark's 38 digits: exact text
    assert schema["free"].dataType == StringType()  # unbounded numeric travels as text
    assert schema["at"].dataType == StringType()
    assert schema["days"].dataType == ArrayType(DateType(), True)
    assert not schema["_wb_offset"].nullable and schema["_wb_op"].nullable


def test_keyless_layout_and_reserved_names():
    keyless = Shape([_col("a", 23, "integer"), _col("b", 25, "text")])
    assert keyless.codec.key_schema is None and keyless.layout.key_columns == ()
    with pytest.raises(UnsupportedSchema, match="reserved"):
        Shape([_col("id", 23, "integer", key=True), _col("_wb_op", 25, "text")])


def test_strip_logical_types_keeps_decimal():
    stripped = strip_logical_types(Shape().codec.value_schema)
    text = json.dumps(stripped)
    for logical in ("date", "time-micros", "timestamp-micros", "local-timestamp-micros", "uuid"):
        assert f'"logicalType": "{logical}"' not in text
    assert '"logicalType": "decimal"' in text


def test_format_time_micros():
    assert format_time_micros(0) == "00:00:00"
    assert format_time_micros((13 * 3600 + 14 * 60 + 15) * 1_000_000 + 123456) == "13:14:15.123456"
    assert format_time_micros(1) == "00:00:00.000001"
    assert format_time_micros(23 * 3600 * 1_000_000 + 500_000) == "23:00:00.500000"


# ------------------------------------------------------------------ decoding
def test_typed_row_from_after():
    shape = Shape()
    b = shape.builder()
    b.add(TOPIC, 2, 40, shape.key(ROW), shape.value("c", after=ROW, lsn=100, op_index=3), pos(100, 3))
    batch = b.to_record_batch()
    assert batch.schema.equals(to_arrow_schema(shape.layout.spark_schema()))
    [row] = batch.to_pylist()
    assert row["id"] == 7 and row["flag"] is True and row["small"] == -3
    assert row["real4"] == 1.5 and row["dbl"] == 2.25
    assert row["amount"] == Decimal("12.30")
    assert row["huge"] == "-123456789012345678901234567890.123"
    assert row["free"] == "1e-30"
    assert row["day"] == dt.date(2024, 2, 29)
    assert row["at"] == "13:14:15.123456"
    assert row["local_ts"] == dt.datetime(2024, 1, 1, 10, 0, 0, 500000)
    assert row["ts"].astimezone(dt.timezone.utc) == dt.datetime(2024, 1, 1, 7, 0, 0, 250000, tzinfo=dt.timezone.utc)
    assert row["uid"] == "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"
    assert row["ints"] == [1, None, 3] and row["days"] == [dt.date(2024, 1, 1), None]
    assert row["body"] == "héllo" and row["raw"] == b"\x00\xff" and row["Mixed Case"] == "mc"
    assert (row["_wb_op"], row["_wb_lsn"], row["_wb_op_index"]) == ("c", 100, 3)
    assert (row["_wb_topic"], row["_wb_partition"], row["_wb_offset"]) == (TOPIC, 2, 40)
    assert row["_wb_unchanged"] is None and row["_wb_special"] is None
    assert row["_wb_control"] is None and row["_wb_error"] is None
    assert row["_wb_ts_ms"] == 1_700_000_000_123 and row["_wb_snapshot_id"] is None


@pytest.mark.parametrize("layout", ["plain", "union"])
def test_special_values_go_to_the_special_map(layout):
    shape = Shape(layout=layout)
    b = shape.builder()
    b.add(TOPIC, 0, 1, None, shape.value("c", after=SPECIAL_ROW), pos(100))
    [row] = b.rows()
    assert row["real4"] == float("inf")  # floats hold infinities themselves
    for col in ("amount", "huge", "day", "at", "local_ts", "ts", "ints", "days"):
        assert row[col] is None, col
    assert row["free"] == "NaN"  # a text-only column is its value, never special
    assert dict(row["_wb_special"]) == {
        "amount": "NaN", "huge": "Infinity", "day": "infinity", "at": "24:00:00", "local_ts": "-infinity",
        "ts": "0044-03-15 00:00:00+00 BC", "ints": "{{1,2},{3,4}}", "days": "{infinity}"}


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "fastavro"])
@pytest.mark.parametrize("newest", ["plain", "union"])
def test_writers_of_either_layout_read_into_a_layout_of_the_other(newest, compiled):
    """A topic written in the union layout (before 0.2.0) and then in the plain
    one, or back: every message reads into the newest layout, specials included."""
    older = "union" if newest == "plain" else "plain"
    shape, old = Shape(layout=newest), Shape(layout=older)
    shape.schemas.update(old.schemas)
    layout = shape.layout
    b = BatchBuilder(layout, WriterSchemas(layout, shape.lookup, shape.known(), compiled=compiled))
    b.add(TOPIC, 0, 0, None, old.value("c", after=SPECIAL_ROW), pos(1))
    b.add(TOPIC, 0, 1, None, shape.value("c", after=SPECIAL_ROW), pos(2))
    b.add(TOPIC, 0, 2, None, old.value("u", before=SPECIAL_ROW, after=ROW), pos(3))
    b.add(TOPIC, 0, 3, None, shape.value("u", before=SPECIAL_ROW, after=ROW), pos(4))
    first, second, third, fourth = b.rows()
    for r in (first, second, third, fourth):
        del r["_wb_offset"], r["_wb_lsn"]
    assert first == second and third == fourth
    assert dict(first["_wb_special"])["days"] == "{infinity}" and first["amount"] is None
    assert dict(third["_wb_before_special"])["at"] == "24:00:00" and third["_wb_before"]["at"] is None


def test_plain_layout_delete_with_a_special_key_fills_it_from_the_key():
    shape = Shape([_col("day", 1082, "date", key=True), _col("v", 23, "integer")])
    assert shape.codec.key_schema["fields"][-1]["name"] == "_wb_special"
    b = shape.builder()
    b.add(TOPIC, 0, 0, shape.key(("infinity", None)), shape.value("d", before=None), pos(5))
    [row] = b.rows()
    assert row["day"] is None and dict(row["_wb_special"]) == {"day": "infinity"} and row["_wb_op"] == "d"


def test_a_damaged_side_field_is_undecodable():
    shape = Shape()
    good = shape.value("c", after=SPECIAL_ROW)
    text = b'"amount":"NaN"'
    assert good.count(text) == 1
    bad = good.replace(text, b'"amount":12345')
    for b in (shape.builder(), _reference_builder(shape)):
        with pytest.raises(UndecodableMessage, match="side field"):
            b.add(TOPIC, 0, 0, None, bad, pos(1))


def test_update_with_unchanged_toast_names_the_columns():
    shape = Shape()
    after = list(ROW)
    after[15] = None  # body unchanged in TOAST
    after[17] = None  # "Mixed Case" too
    b = shape.builder()
    b.add(TOPIC, 0, 1, None, shape.value("u", after=tuple(after), unchanged=[15, 17]), pos(101))
    [row] = b.rows()
    assert row["_wb_op"] == "u" and row["body"] is None and row["Mixed Case"] is None
    assert row["_wb_unchanged"] == ["body", "Mixed Case"]


@pytest.mark.parametrize("layout", ["plain", "union"])
def test_update_with_the_old_row_carries_it_in_wb_before(layout):
    shape = Shape(layout=layout)
    b = shape.builder()
    b.add(TOPIC, 0, 1, None, shape.value("u", before=SPECIAL_ROW, after=ROW), pos(101))
    b.add(TOPIC, 0, 2, None, shape.value("u", after=ROW), pos(102))  # default replica identity: no old row
    full, default = b.rows()
    assert full["id"] == 7 and full["_wb_special"] is None
    old = full["_wb_before"]
    assert old["id"] == 8 and old["real4"] == float("inf") and old["amount"] is None and old["at"] is None
    assert old["free"] == "NaN" and old["Mixed Case"] is None
    assert dict(full["_wb_before_special"])["at"] == "24:00:00"
    assert len(dict(full["_wb_before_special"])) == 8
    assert default["_wb_before"] is None and default["_wb_before_special"] is None
    b.add(TOPIC, 0, 3, None, shape.value("u", before=ROW, after=ROW), pos(103))
    [again] = b.rows()
    assert again["_wb_before"]["at"] == "13:14:15.123456"  # same conversions as the row columns
    assert again["_wb_before"]["huge"] == "-123456789012345678901234567890.123"
    assert again["_wb_before_special"] is None


def test_arrow_rows_are_to_pylist_as_tuples():
    """The driver's conversion: the values to_pylist gives (UTC datetimes
    included, also inside _wb_before), one tuple per row, no dict per row."""
    shape = Shape()
    b = shape.builder()
    b.add(TOPIC, 0, 1, None, shape.value("u", before=ROW, after=ROW), pos(101))
    b.add(TOPIC, 0, 2, None, shape.value("c", after=SPECIAL_ROW), pos(102))
    b.add(TOPIC, 1, 3, None, None, [(wire.CONTROL_HEADER, b"snapshot_end")] + pos(103))
    batch = b.to_record_batch()
    fields, rows = arrow_rows([batch])
    assert fields == tuple(batch.schema.names) and all(type(r) is tuple for r in rows)
    assert [dict(zip(fields, r)) for r in rows] == batch.to_pylist()
    ts = fields.index("ts")
    assert rows[0][ts] == ROW[11] and rows[0][ts].utcoffset() == dt.timedelta(0) and rows[1][ts] is None
    assert arrow_rows(pa.Table.from_batches([batch]))[1] == rows
    assert arrow_rows([]) == ((), [])


def test_delete_reads_before_and_fills_the_key_from_the_message_key():
    shape = Shape()
    key_only = (9,) + (None,) * (len(COLUMNS) - 1)
    b = shape.builder()
    b.add(TOPIC, 0, 1, shape.key(key_only), shape.value("d", before=key_only), pos(102))
    b.add(TOPIC, 0, 2, shape.key((10,) + key_only[1:]), shape.value("d", before=None), pos(103))
    rows = b.rows()
    assert [(r["_wb_op"], r["id"]) for r in rows] == [("d", 9), ("d", 10)]


def test_snapshot_read_truncate_and_control_rows():
    shape = Shape()
    b = shape.builder()
    snap = [("wb.snapshot", b"slot@0/1")]
    b.add(TOPIC, 1, 0, shape.key(ROW), shape.value("r", after=ROW, lsn=50, snapshot_id="slot@0/1"), pos(50) + snap)
    b.add(TOPIC, 1, 1, None, None, pos(50) + snap + [(wire.CONTROL_HEADER, b"snapshot_end"),
                                                      (wire.CONTROL_INFO_HEADER, b'{"rows": 1}')])
    b.add(TOPIC, 1, 2, None, shape.value("t", lsn=60, op_index=1), pos(60, 1))
    r, ctrl, trunc = b.rows()
    assert (r["_wb_op"], r["_wb_snapshot_id"], r["id"]) == ("r", "slot@0/1", 7)
    assert r["_wb_before"] is None and ctrl["_wb_before"] is None
    assert ctrl["_wb_op"] is None and ctrl["_wb_control"] == "snapshot_end"
    assert ctrl["_wb_control_info"] == '{"rows": 1}' and ctrl["_wb_snapshot_id"] == "slot@0/1"
    assert (ctrl["_wb_lsn"], ctrl["_wb_op_index"], ctrl["_wb_offset"]) == (50, 0, 1)
    assert all(ctrl[c.name] is None for c in COLUMNS)
    assert trunc["_wb_op"] == "t" and (trunc["_wb_lsn"], trunc["_wb_op_index"]) == (60, 1)
    assert all(trunc[c.name] is None for c in COLUMNS)


def test_a_deletes_tombstone_is_a_row_that_only_covers_its_offset():
    shape = Shape()
    b = shape.builder()
    b.add(TOPIC, 0, 7, shape.key(ROW), shape.value("d", before=ROW), pos(104))
    b.add(TOPIC, 0, 8, shape.key(ROW), None, pos(104))
    delete, tombstone = b.rows()
    assert delete["_wb_op"] == "d" and delete["_wb_control"] is None
    assert (tombstone["_wb_control"], tombstone["_wb_op"], tombstone["_wb_offset"]) == ("tombstone", None, 8)
    assert all(tombstone[c.name] is None for c in COLUMNS)


def test_snapshot_id_falls_back_to_the_envelope_source():
    # A plain client's copy of a snapshot row may drop the headers; the
    # envelope's source.snapshot_id (already text) still identifies it.
    shape = Shape()
    b = shape.builder()
    b.add(TOPIC, 1, 0, shape.key(ROW), shape.value("r", after=ROW, lsn=50, snapshot_id="slot@0/1"), pos(50))
    [r] = b.rows()
    assert (r["_wb_op"], r["_wb_snapshot_id"]) == ("r", "slot@0/1")


def test_position_falls_back_to_the_envelope_source():
    shape = Shape()
    b = shape.builder()
    source = shape.codec.source(77, 4, 5, 0, change_lsn=70)  # the change's own LSN is not the position's
    value = shape.codec.encode_value(shape.value_prefix, shape.codec.envelope("c", None, ROW, source, 0))
    b.add(TOPIC, 0, 0, None, value, None)
    [row] = b.rows()
    assert (row["_wb_lsn"], row["_wb_op_index"]) == (77, 4)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "fastavro"])
def test_position_of_a_writer_before_commit_lsn_is_its_source_lsn(compiled):
    """Before 0.2.0 ``source.lsn`` held the commit LSN and there was no
    ``commit_lsn``: such messages keep their position."""
    shape = Shape()
    old = json.loads(json.dumps(shape.codec.value_schema))
    source = old["fields"][2]["type"]
    source["fields"] = [f for f in source["fields"] if f["name"] != "commit_lsn"]
    prefix = shape.publish(old)
    envelope = shape.codec.envelope("c", None, ROW, shape.codec.source(88, 2, 5, 0, change_lsn=80), 0)
    buf = io.BytesIO()
    schemaless_writer(buf, parse_schema(old), {**envelope, "source": {**envelope["source"], "lsn": 88}})
    layout = shape.layout
    b = BatchBuilder(layout, WriterSchemas(layout, shape.lookup, shape.known(), compiled=compiled))
    b.add(TOPIC, 0, 0, None, prefix + buf.getvalue(), None)
    [row] = b.rows()
    assert (row["_wb_lsn"], row["_wb_op_index"], row["id"]) == (88, 2, 7)


@pytest.mark.parametrize("case", ["bad prefix", "unknown schema", "corrupt body", "trailing bytes",
                                  "truncated", "bad position", "other shape"])
def test_undecodable_messages_are_classified(case):
    shape = Shape()
    good = shape.value("c", after=ROW)
    headers = pos(100)
    value = {
        "bad prefix": b"not avro at all",
        "unknown schema": wire.single_object_prefix(b"\x01" * 8) + good[10:],
        "corrupt body": shape.value_prefix + b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff",
        "trailing bytes": good + b"\x00",
        "truncated": good[:-3],
        "bad position": good,
        "other shape": None,
    }[case]
    if case == "bad position":
        headers = [(wire.POSITION_HEADER, b"\x01\x02")]
    if case == "other shape":
        other = Shape(shape="public.other")
        shape.schemas.update(other.schemas)
        value = other.value("c", after=ROW)
    b = shape.builder()
    with pytest.raises(UndecodableMessage):
        b.add(TOPIC, 0, 5, None, value, headers)
    assert b.count == 0
    b.add_dlq(TOPIC, 0, 5, pos(100), "why")
    [row] = b.rows()
    assert (row["_wb_control"], row["_wb_error"], row["_wb_offset"], row["_wb_lsn"]) == ("dlq", "why", 5, 100)
    assert row["_wb_op"] is None and all(row[c.name] is None for c in COLUMNS)


def test_an_unknown_schema_is_looked_up_once():
    shape = Shape()
    b = shape.builder()
    bad = wire.single_object_prefix(b"\x02" * 8) + b"\x00"
    for offset in range(3):
        with pytest.raises(UndecodableMessage):
            b.add(TOPIC, 0, offset, None, bad, None)
    assert shape.lookups == 1


def test_writer_schema_evolution():
    old_cols = [_col("id", 20, "bigint", key=True), _col("gone", 25, "text"), _col("v", 23, "integer")]
    new_cols = [_col("id", 20, "bigint", key=True), _col("v", 23, "integer")]
    newer_cols = new_cols + [_col("added", 25, "text")]
    old, current, newer = Shape(old_cols), Shape(new_cols), Shape(newer_cols)
    retyped = Shape([_col("id", 20, "bigint", key=True), _col("v", 20, "bigint")])
    for other in (old, newer, retyped):
        current.schemas.update(other.schemas)
    layout = current.layout
    known_at_start = frozenset({f"fp:{fp.hex()}" for fp in list(old.schemas) + list(current.schemas)[:2]})

    b = current.builder(known=known_at_start, layout=layout)
    # an older known version: its dropped column is ignored, the others are read by name
    b.add(TOPIC, 0, 0, None, old.value("c", after=(1, "x", 5)), pos(1))
    b.add(TOPIC, 0, 1, None, current.value("c", after=(2, 6)), pos(2))
    assert [(r["id"], r["v"]) for r in b.rows()] == [(1, 5), (2, 6)]
    # a newer version: adding or retyping a column must stop the stream
    with pytest.raises(SchemaChangedError, match="added"):
        b.add(TOPIC, 0, 2, None, newer.value("c", after=(3, 7, "new")), pos(3))
    with pytest.raises(SchemaChangedError, match="type"):
        b.add(TOPIC, 0, 3, None, retyped.value("c", after=(4, 8)), pos(4))
    # a newer version that only drops a column is fine
    narrower = Shape([_col("id", 20, "bigint", key=True)])
    current.schemas.update(narrower.schemas)
    b.add(TOPIC, 0, 4, None, narrower.value("c", after=(5,)), pos(5))
    assert [(r["id"], r["v"]) for r in b.rows()] == [(5, None)]


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "fastavro"])
def test_rows_of_a_writer_before_a_narrowing_numeric_retype_decode_into_the_new_type(compiled):
    """numeric(10,2) → numeric(6,0), numeric(30,4) → numeric(30,0): the older
    writer's rows still decode (by their own schema), their values cast as
    PostgreSQL casts them (rounded half away from zero; too many digits:
    NULL, which the producer's re-read of the shape fills)."""
    old = Shape([_col("id", 20, "bigint", key=True), _col("n", 1700, "numeric(10,2)", _numeric(10, 2)),
                 _col("w", 1700, "numeric(30,4)", _numeric(30, 4))])
    new = Shape([_col("id", 20, "bigint", key=True), _col("n", 1700, "numeric(6,0)", _numeric(6, 0)),
                 _col("w", 1700, "numeric(30,0)", _numeric(30, 0))])
    assert old.value_prefix != new.value_prefix  # each message names its writer schema, scale included
    new.schemas.update(old.schemas)
    b = BatchBuilder(new.layout, WriterSchemas(new.layout, new.lookup, new.known(), compiled=compiled))
    values = [("12.45", "1.5000"), ("12.50", "-2.5000"), ("-0.50", "0.4999"), ("1234567.89", "12.0000"), (None, None)]
    for i, (n, w) in enumerate(values):
        row = (i, None if n is None else Decimal(n), None if w is None else Decimal(w))
        b.add(TOPIC, 0, 2 * i, None, old.value("u", before=row, after=row), pos(10 + i))
    b.add(TOPIC, 0, 99, None, new.value("c", after=(9, Decimal("7"), Decimal("8"))), pos(20))
    rows = b.rows()
    want = [(Decimal(12), Decimal(2)), (Decimal(13), Decimal(-3)), (Decimal(-1), Decimal(0)),
            (None, Decimal(12)), (None, None), (Decimal(7), Decimal(8))]
    assert [(r["n"], r["w"]) for r in rows] == want
    assert [(r["_wb_before"]["n"], r["_wb_before"]["w"]) for r in rows[:5]] == want[:5]


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "fastavro"])
def test_rows_of_a_writer_before_other_retypes_decode_as_postgresql_casts_them(compiled):
    """bigint → integer, text → integer, integer → text, numeric → bigint:
    values that cast keep their value, the others are null (the re-read)."""
    old = Shape([_col("id", 20, "bigint", key=True), _col("a", 20, "bigint"), _col("t", 25, "text"),
                 _col("i", 23, "integer"), _col("n", 1700, "numeric(10,2)", _numeric(10, 2))])
    new = Shape([_col("id", 20, "bigint", key=True), _col("a", 23, "integer"), _col("t", 23, "integer"),
                 _col("i", 25, "text"), _col("n", 20, "bigint")])
    new.schemas.update(old.schemas)
    b = BatchBuilder(new.layout, WriterSchemas(new.layout, new.lookup, new.known(), compiled=compiled))
    b.add(TOPIC, 0, 0, None, old.value("c", after=(1, 5, " 12 ", -3, Decimal("2.50"))), pos(1))
    b.add(TOPIC, 0, 1, None, old.value("c", after=(2, 3_000_000_000, "x", 0, Decimal("-2.49"))), pos(2))
    b.add(TOPIC, 0, 2, None, new.value("c", after=(3, 7, 8, "9", 10)), pos(3))
    assert [(r["a"], r["t"], r["i"], r["n"]) for r in b.rows()] == [
        (5, 12, "-3", 3), (None, None, "0", -2), (7, 8, "9", 10)]


def test_cast_value_follows_postgresql_casts():
    assert cast_value(Decimal("0.5"), DecimalType(1, 0)) == Decimal(1)
    assert cast_value(Decimal("-0.5"), DecimalType(1, 0)) == Decimal(-1)
    assert cast_value(Decimal("10"), DecimalType(1, 0)) is None  # more digits than numeric(1,0) holds
    assert cast_value("1e2", DecimalType(5, 1)) == Decimal("100.0")
    assert cast_value("NaN", DecimalType(5, 1)) is None and cast_value("abc", DecimalType(5, 1)) is None
    assert cast_value(2**31, IntegerType()) is None and cast_value(2**31, LongType()) == 2**31
    assert cast_value("1.5", IntegerType()) is None and cast_value(Decimal("1.5"), IntegerType()) == 2
    assert cast_value(Decimal("1.50"), StringType()) == "1.50" and cast_value(b"x", StringType()) is None


def test_registry_framed_messages_decode_through_the_registry_client():
    """A mock:// registry lives in one process: here (in-process) the lookup
    used by the executors resolves ids through the same client the producer
    registered with."""
    from confluent_kafka.schema_registry import Schema

    from schemas.registry import registry_client

    url = f"mock://unit-{uuid.uuid4().hex[:8]}"
    shape = Shape()
    client = registry_client(url)
    value_id = client.register_schema(f"{TOPIC}-value", Schema(wire.canonical_json(shape.codec.value_schema), "AVRO"))
    key_id = client.register_schema(f"{TOPIC}-key", Schema(wire.canonical_json(shape.codec.key_schema), "AVRO"))
    src = ShapeSource(topic=TOPIC, bootstrap_servers="unused:9092", schema_registry_url=url)
    lookup = schema_lookup(src, {})
    layout = shape.layout
    b = BatchBuilder(layout, WriterSchemas(layout, lookup, frozenset({f"id:{value_id}"})))
    value = shape.value("d", before=(3,) + (None,) * (len(COLUMNS) - 1), prefix=wire.confluent_prefix(value_id))
    key = shape.codec.encode_key(wire.confluent_prefix(key_id), (3,))
    b.add(TOPIC, 0, 0, key, value, pos(9))
    [row] = b.rows()
    assert (row["_wb_op"], row["id"], row["_wb_lsn"]) == ("d", 3, 9)
    with pytest.raises(UndecodableMessage, match="unknown schema id"):
        b.add(TOPIC, 0, 1, None, wire.confluent_prefix(value_id + 1000) + value[5:], pos(10))
    no_registry = schema_lookup(ShapeSource(topic=TOPIC, bootstrap_servers="unused:9092"), {})
    with pytest.raises(UndecodableMessage, match="no schema registry"):
        no_registry(wire.parse_prefix(value), value)


# ------------------------------------------- compiled reader against fastavro
EDGE_ROW = (
    -(2 ** 63), False, 32767, -0.0, -1e300, Decimal("-0.01"), Decimal("0.000"), "",
    dt.date(1, 1, 1), dt.time(0, 0), dt.datetime(1969, 12, 31, 23, 59, 59, 999999),
    dt.datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=dt.timezone.utc), uuid.UUID(int=0),
    [], [None], "ünïcødé \U0001F642" * 20, b"", "",
)
NULL_ROW = (11,) + (None,) * (len(COLUMNS) - 1)


def _reference_builder(shape: Shape) -> BatchBuilder:
    layout = shape.layout
    return BatchBuilder(layout, WriterSchemas(layout, shape.lookup, shape.known(), compiled=False))


def _every_kind_of_message(shape: Shape) -> list[tuple]:
    """(key, value, headers) of every row kind the builder makes."""
    key_only = (9,) + (None,) * (len(COLUMNS) - 1)
    toasted = list(ROW)
    toasted[15] = toasted[17] = None
    snap = [(wire.SNAPSHOT_HEADER, b"slot@0/1")]
    return [
        (shape.key(ROW), shape.value("c", after=ROW, lsn=100, op_index=3), pos(100, 3)),
        (None, shape.value("c", after=SPECIAL_ROW), pos(100, 4)),
        (shape.key(EDGE_ROW), shape.value("c", after=EDGE_ROW), pos(100, 5)),
        (shape.key(NULL_ROW), shape.value("c", after=NULL_ROW), pos(100, 6)),
        (None, shape.value("u", after=tuple(toasted), unchanged=[15, 17]), pos(101)),
        (None, shape.value("u", before=SPECIAL_ROW, after=ROW), pos(101, 1)),
        (None, shape.value("u", before=EDGE_ROW, after=SPECIAL_ROW), pos(101, 2)),
        (None, shape.value("u", before=ROW, after=NULL_ROW), pos(101, 3)),
        (shape.key(key_only), shape.value("d", before=key_only), pos(102)),
        (shape.key((10,) + key_only[1:]), shape.value("d", before=None), pos(103)),
        (shape.key(ROW), shape.value("d", before=ROW), pos(103, 1)),
        (shape.key(ROW), shape.value("r", after=ROW, lsn=50, snapshot_id="slot@0/1"), pos(50) + snap),
        (shape.key(ROW), shape.value("r", after=EDGE_ROW, lsn=50, snapshot_id="slot@0/1"), pos(50)),
        (None, shape.value("c", after=ROW, lsn=77, op_index=4), None),
        (None, None, pos(50) + snap + [(wire.CONTROL_HEADER, b"snapshot_end"),
                                       (wire.CONTROL_INFO_HEADER, b'{"rows": 1}')]),
        (None, shape.value("t", lsn=60, op_index=1), pos(60, 1)),
    ]


@pytest.mark.skipif(not fastdecode.AVAILABLE, reason="spark_consumer._fastdecode is not built")
@pytest.mark.parametrize("layout", ["plain", "union"])
def test_compiled_reader_rows_equal_fastavro_rows(layout):
    shape = Shape(layout=layout)
    messages = _every_kind_of_message(shape)
    compiled, reference = shape.builder(), _reference_builder(shape)
    for b in (compiled, reference):
        for offset, (key, value, headers) in enumerate(messages):
            b.add(TOPIC, 1, offset, key, value, headers)
    reader = compiled.schemas.reader(wire.parse_prefix(messages[0][1]))
    assert reader is not None and reference.schemas.reader(wire.parse_prefix(messages[0][1])) is None
    for _, value, _ in messages:  # the compiled reader took every body itself
        if value is not None:
            reader.read(value, len(shape.value_prefix))
    # and the compiled assembler every message but the control event and the delete without a before row
    handed_back = [i for i, (key, value, headers) in enumerate(messages)
                   if compiled._assembler.add(TOPIC, 1, i, key, value, headers) is None]
    assert handed_back == [9, 14]
    fast_batch, reference_batch = compiled.to_record_batch(), reference.to_record_batch()
    assert fast_batch.schema.equals(reference_batch.schema)
    fast_rows, reference_rows = fast_batch.to_pylist(), reference_batch.to_pylist()
    assert fast_rows == reference_rows
    assert len(fast_rows) == len(messages)
    assert fast_rows[2]["body"] == EDGE_ROW[15] and fast_rows[2]["id"] == -(2 ** 63)
    assert fast_rows[6]["_wb_before"]["amount"] == Decimal("-0.01")


def _outcome(builder: BatchBuilder, key, value, headers) -> tuple:
    try:
        builder.add(TOPIC, 0, 0, key, value, headers)
        return "rows", repr(builder.rows())  # repr: a NaN equals itself
    except Exception as e:
        return "error", type(e).__name__, re.sub(r" at 0x[0-9a-f]+", "", str(e))  # fastavro names its BytesIO


def _damaged(value: bytes, body: int) -> list[bytes]:
    """Every truncation, every byte overwritten with a few values, extra bytes."""
    out = [value[:n] for n in range(body, len(value))]
    out += [value[:i] + bytes([b]) + value[i + 1:]
            for i in range(body, len(value)) for b in (0x00, 0x01, 0x80, 0xFF)]
    out += [value + b"\x00", value + b"\x80\x80", value[:body] + b"\xff" * 12]
    return out


@pytest.mark.skipif(not fastdecode.AVAILABLE, reason="spark_consumer._fastdecode is not built")
@pytest.mark.parametrize("layout", ["plain", "union"])
def test_compiled_reader_refuses_exactly_what_fastavro_refuses(layout):
    """Damaged bodies: the same UndecodableMessage (same text), or the same rows."""
    shape = Shape(layout=layout)
    body = len(shape.value_prefix)
    compiled, reference = shape.builder(), _reference_builder(shape)  # a failed add leaves a builder as it was
    seen = set()
    for value in (shape.value("u", before=EDGE_ROW, after=ROW, unchanged=[15]), shape.value("d", before=NULL_ROW),
                  shape.value("c", after=SPECIAL_ROW)):
        for damaged in _damaged(value, body):
            fast = _outcome(compiled, None, damaged, pos(1))
            assert fast == _outcome(reference, None, damaged, pos(1)), damaged.hex()
            seen.add(fast[:2])
    assert ("error", "UndecodableMessage") in seen and ("rows",) in {s[:1] for s in seen}


@pytest.mark.skipif(not fastdecode.AVAILABLE, reason="spark_consumer._fastdecode is not built")
def test_unscaled_decimals_make_the_column_pyarrow_makes_of_decimals():
    shape = Shape()
    stripped = strip_logical_types(shape.codec.value_schema)
    fields = [c.avro_field for c in shape.layout.columns]
    assert shape.layout.unscaled_decimals() == {"amount": (10, 2)}  # not "huge" (50 digits, text)
    reader = fastdecode.envelope_reader(stripped, fields, shape.layout.unscaled_decimals())
    amount = reader.read(shape.value("c", after=ROW), len(shape.value_prefix))[1][5]
    assert fastdecode.is_unscaled(amount) and amount.to_decimal() == Decimal("12.30")
    t = pa.decimal128(10, 2)
    values = [amount, None, Decimal("-0.05"), Decimal("12345678.90")]
    expected = pa.array([Decimal("12.30"), None, Decimal("-0.05"), Decimal("12345678.90")], t)
    assert fastdecode.decimal_array(values, t).equals(expected)
    # a Decimal of another scale is converted value by value, as pa.array does
    assert fastdecode.decimal_array([amount, Decimal("1.5")], t).equals(
        pa.array([Decimal("12.30"), Decimal("1.50")], t))
    with pytest.raises(pa.ArrowInvalid):  # 11 digits in a decimal(10, 2): refused as pa.array refuses it
        fastdecode.decimal_array([amount, Decimal("123456789.00")], t)
    plain = fastdecode.envelope_reader(stripped, fields)  # without the layout's decimals: Decimal values
    assert plain.read(shape.value("c", after=ROW), len(shape.value_prefix))[1][5] == Decimal("12.30")


@pytest.mark.skipif(not fastdecode.AVAILABLE, reason="spark_consumer._fastdecode is not built")
@pytest.mark.parametrize("layout", ["plain", "union"])
def test_a_decimal_beyond_its_declared_precision_fails_as_with_fastavro(layout):
    shape = Shape(layout=layout)
    good = shape.value("c", after=ROW)
    branch = b"\x02" if layout == "plain" else b"\x04"  # union branch 1 of [null, T], 2 of [null, string, T]
    amount = branch + b"\x04\x04\xce"  # 2 bytes: 1230 (12.30)
    assert good.count(amount) == 1
    eleven_digits = good.replace(amount, branch + b"\x0a" + (12345678912).to_bytes(5, "big", signed=True))
    outcomes = []
    for b in (shape.builder(), _reference_builder(shape)):
        b.add(TOPIC, 0, 0, None, good, pos(1))
        outcomes.append(_outcome(b, None, eleven_digits, pos(1)))
    assert outcomes[0] == outcomes[1] and outcomes[0][:2] == ("error", "ArrowInvalid")


@pytest.mark.skipif(not fastdecode.AVAILABLE, reason="spark_consumer._fastdecode is not built")
def test_compiled_reader_declines_schemas_it_does_not_read():
    layout_fields = [c.avro_field for c in Shape().layout.columns]
    stripped = strip_logical_types(Shape().codec.value_schema)
    assert fastdecode.envelope_reader(stripped, layout_fields) is not None
    with_map = json.loads(json.dumps(stripped))
    with_map["fields"][0]["type"][1]["fields"][1]["type"] = ["null", {"type": "map", "values": "long"}]
    assert fastdecode.envelope_reader(with_map, layout_fields) is None
    with_millis = json.loads(json.dumps(stripped))
    with_millis["fields"][0]["type"][1]["fields"][1]["type"] = [
        "null", {"type": "long", "logicalType": "timestamp-millis"}]
    assert fastdecode.envelope_reader(with_millis, layout_fields) is None
    assert fastdecode.envelope_reader({"type": "record", "name": "X", "fields": []}, layout_fields) is None
