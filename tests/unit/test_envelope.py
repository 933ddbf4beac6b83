"""The composed envelope encoding equals fastavro's encoding of the same dict."""

import datetime
import io
from decimal import Decimal

import pytest
from fastavro import parse_schema, schemaless_reader

from producer.envelope import ShapeCodec, ShapeColumn, avro_long, avro_name
from producer.pgtypes import PgTypeInfo, column_codec

INT = PgTypeInfo(23, "integer", 23, "integer", -1, "b")
TEXT = PgTypeInfo(25, "text", 25, "text", -1, "b")
NUM = PgTypeInfo(1700, "numeric(10,2)", 1700, "numeric(10,2)", (10 << 16 | 2) + 4, "b")
TSTZ = PgTypeInfo(1184, "timestamp with time zone", 1184, "timestamp with time zone", -1, "b")


def codec(layout: str = "plain"):
    cols = [ShapeColumn("id", column_codec(INT), True), ShapeColumn("body text", column_codec(TEXT), False),
            ShapeColumn("n", column_codec(NUM), False), ShapeColumn("at", column_codec(TSTZ), False)]
    return ShapeCodec("orders-eu", "wb", "app", "public", "orders", cols, [0, 2, 3, 4], layout)


ROW = (7, "unused", "hé", Decimal("1.25"), datetime.datetime(2024, 1, 1, tzinfo=datetime.timezone.utc))


@pytest.mark.parametrize("op,before,after,unchanged", [
    ("c", None, ROW, ()), ("u", ROW, ROW, (2,)), ("d", ROW, None, ()), ("r", None, ROW, ()),
    ("t", None, None, ()), ("u", None, (7, None, None, "NaN", None), (2, 4)),
])
@pytest.mark.parametrize("op_index", [0, 1, 63, 64, 300, 2**40])
@pytest.mark.parametrize("layout", ["plain", "union"])
def test_composed_encoding_equals_fastavro(op, before, after, unchanged, op_index, layout):
    c = codec(layout)
    src = c.source(0x16B3748, op_index, 991, 1_700_000_000_000, change_lsn=0x16B3000)
    reference = c.encode_value(b"P", c.envelope(op, before, after, src, 1_700_000_000_123, list(unchanged)))
    composed = c.encode_change(b"P", op, before, after, c.source_bytes(0x16B3748, 991, 1_700_000_000_000),
                               op_index, 1_700_000_000_123, unchanged, change_lsn=0x16B3000)
    assert composed == reference
    decoded = schemaless_reader(io.BytesIO(composed[1:]), parse_schema(c.value_schema), None)
    assert decoded["source"]["op_index"] == op_index and decoded["op"] == op
    # Debezium's meaning: source.lsn is the change's own LSN; the position's LSN is the commit's.
    assert decoded["source"]["lsn"] == 0x16B3000 and decoded["source"]["commit_lsn"] == 0x16B3748


def test_reads_carry_the_snapshot_point_as_both_lsns():
    c = codec()
    value = c.encode_change(b"", "r", None, ROW, c.source_bytes(0x5000, None, 0, True, "s@0/5000"), 0, 1)
    source = schemaless_reader(io.BytesIO(value), parse_schema(c.value_schema), None)["source"]
    assert source["lsn"] == source["commit_lsn"] == 0x5000 and source["snapshot"] == "true"


@pytest.mark.parametrize("n", [0, 1, -1, 63, -64, 64, 2**31, -(2**63), 2**63 - 1])
def test_avro_long_matches_fastavro(n):
    from fastavro import schemaless_writer

    buf = io.BytesIO()
    schemaless_writer(buf, "long", n)
    assert avro_long(n) == buf.getvalue()


def test_plain_layout_has_plain_columns_and_a_side_field():
    c = codec("plain")
    row = c.value_schema["fields"][0]["type"][1]
    types = {f["name"]: f["type"] for f in row["fields"]}
    assert types["n"] == ["null", {"type": "bytes", "logicalType": "decimal", "precision": 10, "scale": 2}]
    assert types["_wb_special"] == ["null", "string"]
    assert all(not isinstance(t, list) or (len(t) == 2 and t[0] == "null") for t in types.values())
    special = (7, None, "x", "NaN", "-infinity")
    value = c.encode_change(b"", "c", None, special, c.source_bytes(1, 2, 3), 0, 4)
    after = schemaless_reader(io.BytesIO(value), parse_schema(c.value_schema), None)["after"]
    assert after == {"id": 7, "body_text": "x", "n": None, "at": None,
                     "_wb_special": '{"n":"NaN","at":"-infinity"}'}
    union = codec("union").value_schema["fields"][0]["type"][1]["fields"]
    assert union[2]["type"][:2] == ["null", "string"] and len(union) == 4  # no side field


def test_avro_names_are_sanitised():
    assert avro_name("body text") == "body_text" and avro_name("1st") == "_1st" and avro_name("ok_1") == "ok_1"
    schema = codec().value_schema
    row = schema["fields"][0]["type"][1]
    assert [f["name"] for f in row["fields"]] == ["id", "body_text", "n", "at", "_wb_special"]
    assert row["fields"][1]["pg.column"] == "body text"
    assert codec().key_schema["fields"] == [{"name": "id", "type": "int", "pg.type": "integer"}]
