"""The compiled encoder against the reference path, byte for byte.

Every supported type, its edge values (NULL, unchanged TOAST, negative and huge
numerics, infinities, NaN, BC and 5-digit years, 24:00, time zones, escape
bytea, arrays, text that COPY escapes), as key and as row field, through
INSERT, UPDATE and DELETE, on a full shape, a column-limited one and a keyless
relation; and the same rows read with COPY (snapshot, backfill), filtered
shapes included. The references are ``shapes.change_messages`` (what the
pipeline's reference path sends) and ``Reads.send_rows`` (psycopg loaders + fastavro).
"""

import collections
import itertools
import struct

import pytest

from producer import fastcodec
from producer.envelope import avro_long, avro_string
from producer.pgoutput import UNCHANGED_TOAST, Column, Delete, Insert, Relation, Update
from producer.pgtypes import PgTypeInfo, column_codec
from producer.reads import Reads, copy_rows
from producer.shapes import RelationPlan, ShapeSpec, StreamTx, change_messages
from schemas.shape_filter import compile_filter
from tests.fakes import ListChannel

pytestmark = pytest.mark.skipif(not fastcodec.AVAILABLE, reason="producer._fastcodec is not built")


def numeric(p: int, s: int) -> int:
    return ((p << 16) | (s & 0x7FF)) + 4


def base(oid: int, name: str, typmod: int = -1, kind: str = "b") -> PgTypeInfo:
    return PgTypeInfo(oid, name, oid, name, typmod, kind)


def array(oid: int, name: str, elem: int) -> PgTypeInfo:
    return PgTypeInfo(oid, name, oid, name, -1, "b", elem, "b", -1)


# (column name, type, text values); NULL and unchanged TOAST are added per row.
COLUMNS = [
    ("b", base(16, "boolean"), ["t", "f"]),
    ("i2", base(21, "smallint"), ["0", "-32768", "32767", "7"]),
    ("i4", base(23, "integer"), ["-2147483648", "2147483647", "5", "-1"]),
    ("i8", base(20, "bigint"), ["-9223372036854775808", "9223372036854775807", "0", "64", "-65"]),
    ("o", base(26, "oid"), ["4294967295", "0"]),
    ("f4", base(700, "real"), ["1.5", "-0", "3.4028235e+38", "1e-45", "NaN", "Infinity", "-Infinity", "0.1",
                               "1.1754944e-38"]),
    ("f8", base(701, "double precision"), ["0.1", "1e+308", "5e-324", "-1.2345678901234567", "NaN", "Infinity",
                                           "-Infinity", "-0", "2.2250738585072014e-308"]),
    ("t", base(25, "text"), ["", "héllo ✓", "with\nnewline and \\ backslash", "x" * 300,
                             "tab\there\r\b\f\v\x01", "\\N", "N", "\\", "\\x41\\101"]),
    ("vc", base(1043, "character varying(20)", 24), ["abc", "ü"]),
    ("bp", base(1042, "character(5)", 9), ["ab   ", "abcde"]),
    ("nm", base(19, "name"), ["pg_catalog"]),
    ("ch", base(18, '"char"'), ["a"]),
    ("by", base(17, "bytea"), ["\\x", "\\xdeadbeef", "\\xDEADBEEF", "abc\\000def", "\\x0"]),
    ("u", base(2950, "uuid"), ["a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", "00000000-0000-0000-0000-000000000000"]),
    ("d", base(1082, "date"), ["2024-02-29", "0001-01-01", "9999-12-31", "1970-01-01", "1969-12-31", "infinity",
                               "-infinity", "0044-03-15 BC", "10000-01-01", "2000-03-01", "1900-02-28"]),
    ("tm", base(1083, "time without time zone"), ["00:00:00", "23:59:59.999999", "12:34:56.5", "24:00:00",
                                                 "01:02:03.000001"]),
    ("ts", base(1114, "timestamp without time zone"), [
        "2024-01-02 03:04:05", "2024-01-02 03:04:05.123456", "0001-01-01 00:00:00", "9999-12-31 23:59:59.999999",
        "1969-12-31 23:59:59.9", "infinity", "-infinity", "0044-03-15 12:00:00 BC", "10000-01-01 00:00:00"]),
    ("tz", base(1184, "timestamp with time zone"), [
        "2024-01-02 03:04:05+00", "2024-01-02 03:04:05.5+00", "1900-01-01 00:00:00+00", "2024-06-01 12:00:00+02",
        "2024-06-01 12:00:00+05:30", "1883-11-18 12:03:58-00:03:58", "infinity", "-infinity",
        "0001-01-01 00:00:00+00", "9999-12-31 23:59:59.999999+00", "1969-12-31 23:59:59.999999+00"]),
    ("n12", base(1700, "numeric(12,2)", numeric(12, 2)), [
        "0.00", "-0.01", "1234567890.12", "-9999999999.99", "1.27", "-1.28", "1.28", "-1.29", "327.67", "-327.68",
        "NaN", "Infinity", "-Infinity", "0.50"]),
    ("n38", base(1700, "numeric(38,10)", numeric(38, 10)), [
        "12345678901234567890.1234567890", "-0.0000000001", "1.0000000000", "-99999999.9999999999",
        "9999999999999999999999999999.9999999999", "-92233720.3685477580", "-92233720.3685477581"]),
    ("n5", base(1700, "numeric(5,0)", numeric(5, 0)), [
        "99999", "-99999", "0", "-128", "128", "127", "-127", "255", "256", "-256", "32767", "-32768"]),
    ("n18", base(1700, "numeric(18,0)", numeric(18, 0)), [
        "999999999999999999", "-999999999999999999", "100000000000000000"]),
    ("nu", base(1700, "numeric"), ["1.50", "NaN", "-123456789012345678901234567890.5", "Infinity"]),
    ("nneg", base(1700, "numeric(5,-2)", numeric(5, -2)), ["12300"]),
    ("js", base(114, "json"), ['{"a": 1}', "[]"]),
    ("jb", base(3802, "jsonb"), ['{"a": [1, 2], "b": "ü"}']),
    ("iv", base(1186, "interval"), ["1 day 02:00:00", "-00:00:01"]),
    ("ttz", base(1266, "time with time zone"), ["12:00:00+02"]),
    ("ai4", array(1007, "integer[]", 23), ["{1,2,NULL}", "{{1,2},{3,4}}", "{}"]),
    ("atx", array(1009, "text[]", 25), ['{a,"b c",NULL}']),
    ("ats", array(1115, "timestamp without time zone[]", 1114), ['{"2024-01-01 00:00:00",infinity}']),
    ("en", PgTypeInfo(90001, "mood", 90001, "mood", -1, "e"), ["happy"]),
    ("dom", PgTypeInfo(90002, "posint", 23, "integer", -1, "b"), ["42"]),
]
KEY_COLUMNS = ["i4", "t", "d", "tz", "n12", "u"]
NAMES = [c[0] for c in COLUMNS]
CODECS = [column_codec(c[1]) for c in COLUMNS]
LSN, XID, TS_MS, SEEN_MS = 0x1_2345_6789, 987_654, 1_732_000_000_123, 1_732_000_000_456
CHANGE_LSN = 0x1_2345_0001  # a change's own LSN: before its transaction's commit
PARTITIONS = 5


def relation(oid: int, keys) -> Relation:
    return Relation(oid, "public", "all_types", "d",
                    tuple(Column(n, c[1].oid, c[1].base_typmod, n in keys) for n, c in zip(NAMES, COLUMNS)))


def build(oid: int, keys, specs, tombstones: bool = True, layout: str = "plain") -> tuple[RelationPlan, object]:
    plan = RelationPlan(relation(oid, keys), CODECS, tuple(keys), specs, "wb", "app", layout)
    for i, route in enumerate(plan.routes):
        route.codec.value_prefix = b"\xc3\x01" + bytes([i]) * 8
        route.codec.key_prefix = b"\x00\x00\x00\x00" + bytes([i + 1]) if route.codec.key_schema else None
    encoder = fastcodec.relation_encoder(plan, {r.topic: PARTITIONS for r in plan.routes}, tombstones)
    assert encoder is not None
    return plan, encoder


SHAPES = [ShapeSpec("public.all_types", "wb.public.all_types", None, None),
          ShapeSpec("narrow", "wb.narrow", ("tz", "n12", "i4", "t", "d", "u", "f8", "by"), None)]


FILTERED = [ShapeSpec("public.all_types", "wb.public.all_types", None, None),
            ShapeSpec("positive", "wb.positive", None, compile_filter("i4 > 0 AND t <> ''", {"i4": "integer",
                                                                                            "t": "text"})),
            ShapeSpec("narrow_eu", "wb.narrow_eu", ("i4", "t", "d", "tz", "n12", "u", "f8"),
                      compile_filter("f8 IS NOT NULL OR b", {"f8": "double precision", "b": "boolean"}))]
FILTER_COLUMNS = {c for spec in FILTERED if spec.row_filter for c in spec.row_filter.columns}


def rows(keyed: bool):
    """Rows cycling through every column's values; key columns never NULL."""
    longest = max(len(c[2]) for c in COLUMNS)
    for r in range(longest):
        yield tuple(c[2][r % len(c[2])].encode() for c in COLUMNS)
    # NULLs everywhere but the key.
    yield tuple(c[2][0].encode() if keyed and n in KEY_COLUMNS else None for n, c in zip(NAMES, COLUMNS))


def tuple_data(values) -> bytes:
    out = struct.pack("!h", len(values))
    for v in values:
        if v is None:
            out += b"n"
        elif v is UNCHANGED_TOAST:
            out += b"u"
        else:
            out += b"t" + struct.pack("!i", len(v)) + v
    return out


def frame(payload: bytes) -> bytes:
    """An XLogData frame around a pgoutput message: its own LSN, WAL end, clock."""
    return b"w" + struct.pack("!QQQ", CHANGE_LSN, CHANGE_LSN + 100, 0) + payload


def changes(oid: int, keyed: bool):
    """(pgoutput message bytes, decoded change) pairs."""
    rel = struct.pack("!I", oid)
    previous = None
    for row in rows(keyed):
        yield b"I" + rel + b"N" + tuple_data(row), Insert(oid, row)
        toasted = tuple(UNCHANGED_TOAST if n in ("t", "js", "by") and not (keyed and n in KEY_COLUMNS) else v
                        for n, v in zip(NAMES, row))
        yield b"U" + rel + b"N" + tuple_data(toasted), Update(oid, None, False, toasted)
        key_only = tuple(v if keyed and n in KEY_COLUMNS else None for n, v in zip(NAMES, row))
        # REPLICA IDENTITY FULL: the old row whole (detoasted), the new one with unchanged TOAST.
        old = previous if previous is not None else row
        old = tuple(row[i] if keyed and n in KEY_COLUMNS else v for i, (n, v) in enumerate(zip(NAMES, old)))
        yield (b"U" + rel + b"O" + tuple_data(old) + b"N" + tuple_data(toasted), Update(oid, old, False, toasted))
        if keyed:  # an old key equal to the new one (a key column updated to its value)
            yield (b"U" + rel + b"K" + tuple_data(key_only) + b"N" + tuple_data(row),
                   Update(oid, key_only, True, row))
            yield b"D" + rel + b"K" + tuple_data(key_only), Delete(oid, key_only, True)
        yield b"D" + rel + b"O" + tuple_data(row), Delete(oid, row, False)
        previous = row


def reference(plan: RelationPlan, change, op_index: int, tombstones: bool = True) -> list:
    """What the pipeline's reference path sends: each event, a keyed delete followed by its tombstone."""
    partitions = {route.topic: PARTITIONS for route in plan.routes}
    return [(writer, key, value, stat) for writer, key, value, _, _, stat in change_messages(
        plan, change, op_index, StreamTx(LSN, XID, TS_MS, SEEN_MS), CHANGE_LSN, partitions, tombstones)]


@pytest.mark.parametrize("layout", ["plain", "union"])
@pytest.mark.parametrize("tombstones", [True, False], ids=["tombstones", "no-tombstones"])
@pytest.mark.parametrize("keyed", [True, False], ids=["keyed", "keyless"])
@pytest.mark.parametrize("filtered", [False, True], ids=["shapes", "filtered"])
def test_byte_identical_to_reference(keyed, tombstones, layout, filtered):
    keys = KEY_COLUMNS if keyed else ()
    specs = (FILTERED if keyed else FILTERED[:2]) if filtered else (SHAPES if keyed else SHAPES[:1])
    plan, encoder = build(4242, keys, specs, tombstones, layout)
    n = specials = 0
    ops, moves = set(), set()  # moves: REPLICA IDENTITY FULL updates into (c) and out of (d) a shape
    for op_index, (payload, change) in enumerate(changes(4242, keyed)):
        if filtered and isinstance(change, Update) and change.old is None and "t" in FILTER_COLUMNS and \
                change.new[NAMES.index("t")] is UNCHANGED_TOAST:
            continue  # the filter needs a value pgoutput did not send (read back from the source): declined
        fast = encoder.encode(frame(payload), 25, op_index, LSN, XID, TS_MS, SEEN_MS)
        assert fast is not None, change
        expected = reference(plan, change, op_index, tombstones)
        for got, want in itertools.zip_longest(fast, expected):
            assert got == want, (change, got, want)
        assert encoder.span == plan.span(change)
        ops.update(m[3][1] for m in fast if m[3] is not None)
        if isinstance(change, Update) and change.old is not None and not change.old_is_key_only:
            moves.update(m[3][1] for m in fast if m[3] is not None and m[3][1] != "u")
        n += len(fast)
        specials += sum(b'"d":"infinity"' in (m[2] or b"") for m in fast)
    assert n > 40
    assert specials > 0 if layout == "plain" else specials == 0  # the side field was exercised
    assert ops == {"c", "u", "d"}
    assert moves == ({"d"} if keyed else {"c", "d"}) if filtered else not moves


def test_declines_what_it_does_not_handle():
    plan, encoder = build(7, KEY_COLUMNS, SHAPES)
    row = next(rows(True))
    rel = struct.pack("!I", 7)
    other_key = tuple(b"99" if n == "i4" else v for n, v in zip(NAMES, row))
    toasted_old = tuple(UNCHANGED_TOAST if n == "js" else v for n, v in zip(NAMES, row))
    declined = [
        b"U" + rel + b"K" + tuple_data(tuple(v if n in KEY_COLUMNS else None for n, v in zip(NAMES, other_key)))
        + b"N" + tuple_data(row),  # a key change: two events naming each other
        b"U" + rel + b"O" + tuple_data(other_key) + b"N" + tuple_data(row),  # the same, REPLICA IDENTITY FULL
        b"U" + rel + b"O" + tuple_data(toasted_old) + b"N" + tuple_data(row),  # an old row with unchanged TOAST
        b"I" + struct.pack("!I", 8) + b"N" + tuple_data(row),  # another relation
        b"I" + rel + b"N" + tuple_data(row[:-1]),  # a column count that does not match
        b"I" + rel + b"N" + tuple_data(tuple(None if n == "i4" else v for n, v in zip(NAMES, row))),  # NULL key
        b"I" + rel + b"N" + tuple_data(row)[:-3],  # truncated
        b"U" + rel + b"O" + tuple_data(row),  # an old tuple and no new one
        b"B" + bytes(20),
    ]
    for payload in declined:
        assert encoder.encode(frame(payload), 25, 0, LSN, XID, TS_MS, SEEN_MS) is None, payload[:1]


def test_a_filter_on_an_unchanged_toast_value_takes_the_reference_path():
    plan, encoder = build(9, KEY_COLUMNS, FILTERED)
    toasted = tuple(UNCHANGED_TOAST if n == "t" else v for n, v in zip(NAMES, next(rows(True))))
    payload = b"U" + struct.pack("!I", 9) + b"N" + tuple_data(toasted)
    assert encoder.encode(frame(payload), 25, 0, LSN, XID, TS_MS, SEEN_MS) is None


def test_stream_source_parts_match_the_source_block():
    plan, _ = build(11, KEY_COLUMNS, SHAPES[:1])
    codec = plan.routes[0].codec
    head, mid = codec.stream_source_parts()
    src = codec.source_bytes(LSN, XID, TS_MS)
    assert src.head == head + avro_long(TS_MS) + mid + b"\x02" + avro_long(XID) + b"\x02" + avro_long(LSN)
    assert src.tail == b"\x00" and src.lsn == LSN
    assert avro_string("x") == b"\x02x"


# ------------------------------------------------------------ COPY reads
_COPY_ESCAPES = {ord("\\"): "\\\\", ord("\b"): "\\b", ord("\f"): "\\f", ord("\n"): "\\n",
                 ord("\r"): "\\r", ord("\t"): "\\t", ord("\v"): "\\v"}


def copy_text(rows) -> bytes:
    """Rows as ``COPY ... TO STDOUT`` writes them (PostgreSQL's CopyAttributeOutText)."""
    return b"".join(b"\t".join(b"\\N" if v is None else v.decode().translate(_COPY_ESCAPES).encode() for v in row)
                    + b"\n" for row in rows)


def read_reference(plan: RelationPlan, routes, rows, sources, sent: int = 0) -> tuple[list, int]:
    """What the reference read path (``Reads.send_rows``) sends."""
    channel = ListChannel()
    reads = Reads(channel, None, {r.topic: PARTITIONS for r in plan.routes}, collections.Counter(), None)
    sent = reads.send_rows(plan, routes, rows, sources, [], SEEN_MS, sent)
    return [m[:3] for m in channel.sent], sent


def read_sources(plan: RelationPlan) -> dict:
    return {r.name: r.codec.source_bytes(LSN, None, TS_MS, True, "wb_slot@1/23456789") for r in plan.routes}


@pytest.mark.parametrize("layout", ["plain", "union"])
@pytest.mark.parametrize("keyed", [True, False], ids=["keyed", "keyless"])
@pytest.mark.parametrize("specs", [SHAPES, FILTERED], ids=["shapes", "filtered"])
def test_copy_reads_byte_identical_to_reference(keyed, layout, specs):
    keys = KEY_COLUMNS if keyed else ()
    plan, _ = build(4243, keys, specs, True, layout)
    encoder = fastcodec.read_encoder(plan, {r.topic: PARTITIONS for r in plan.routes})
    sources = read_sources(plan)
    raw = list(rows(keyed)) * 3
    data = copy_text(raw)
    assert copy_rows(data) == raw  # the reference parser undoes COPY's escaping
    for wanted in (plan.routes, plan.routes[-1:]):  # the snapshot: every shape; a backfill: one
        suffixes = [fastcodec.read_suffix(sources[r.name], SEEN_MS) if r in wanted else None for r in plan.routes]
        got, sent = encoder.encode_reads(data, suffixes, 3)
        want, want_sent = read_reference(plan, wanted, raw, sources, 3)
        assert sent == want_sent
        assert len(got) == len(want) > 0
        for g, w in zip(got, want):
            assert g[:3] == w
        assert {g[3] for g in got} <= {(r.name, "r") for r in wanted}
        for route in wanted:  # each filter lets some rows through, not all
            if route.row_filter is not None:
                assert 0 < sum(g[0][0] == route.topic for g in got) < len(raw)


def test_copy_escapes_read_as_postgresql_reads_them():
    """Octal, hex and other backslash sequences (never written by COPY TO, read
    by COPY FROM) and ``\\N`` only as a whole field."""
    line = b"7\t\\101\\x41\\x4\\xg\\q\\Nz\\0\\\\N\t\\N\n"
    assert copy_rows(line) == [(b"7", b"AA\x04xgqNz\x00\\N", None)]
    names = [("i4", base(23, "integer")), ("t", base(25, "text")), ("d", base(1082, "date"))]
    rel = Relation(12, "public", "small", "d", tuple(Column(n, t.oid, -1, n == "i4") for n, t in names))
    plan = RelationPlan(rel, [column_codec(t) for _, t in names], ("i4",),
                        [ShapeSpec("small", "wb.small", None, None)], "wb", "app")
    plan.routes[0].codec.value_prefix, plan.routes[0].codec.key_prefix = b"V", b"K"
    encoder = fastcodec.read_encoder(plan, {"wb.small": PARTITIONS})
    sources = read_sources(plan)
    got, _ = encoder.encode_reads(line, [fastcodec.read_suffix(sources["small"], SEEN_MS)], 0)
    assert [g[:3] for g in got] == read_reference(plan, plan.routes, copy_rows(line), sources)[0]


@pytest.mark.parametrize("data", [b"1\t2\n", b"1\tx\t\\N\t4\n", b"1\tab\\\n", b"1\tx\t\\N"])
def test_copy_rows_of_another_width_are_an_error(data):
    plan, _ = build(4244, KEY_COLUMNS, SHAPES)
    encoder = fastcodec.read_encoder(plan, {r.topic: PARTITIONS for r in plan.routes})
    with pytest.raises(ValueError, match="COPY"):
        encoder.encode_reads(data, [b"" for _ in plan.routes], 0)


def test_copy_reads_with_a_null_key_take_the_reference_path():
    plan, _ = build(4245, KEY_COLUMNS, SHAPES)
    encoder = fastcodec.read_encoder(plan, {r.topic: PARTITIONS for r in plan.routes})
    row = tuple(None if n == "i4" else v for n, v in zip(NAMES, next(rows(True))))
    assert encoder.encode_reads(copy_text([row]), [b"" for _ in plan.routes], 0) is None


def test_send_copy_gives_the_same_messages_with_and_without_the_extension():
    plan, _ = build(4246, KEY_COLUMNS, FILTERED)
    sources = read_sources(plan)
    data = copy_text(list(rows(True)))
    sent = {}
    for mode, encoder in (("compiled", fastcodec.read_encoder(plan, {r.topic: PARTITIONS for r in plan.routes})),
                          ("reference", None)):
        channel, events = ListChannel(), collections.Counter()
        reads = Reads(channel, None, {r.topic: PARTITIONS for r in plan.routes}, events, None)
        n = reads.send_copy(plan, encoder, plan.routes, data, sources, [("h", b"1")], SEEN_MS, 0)
        sent[mode] = (channel.sent, dict(events), n)
        with pytest.raises(ValueError, match="COPY row"):
            reads.send_copy(plan, encoder, plan.routes, b"1\t2\n", sources, [], SEEN_MS, 0)
    assert sent["compiled"] == sent["reference"] and sent["compiled"][2] > len(list(rows(True)))
