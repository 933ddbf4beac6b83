"""The apply shell on a real target PostgreSQL: tables from the Avro schema,
idempotence, crash safety, position guards, tombstones, TOAST, special values,
cuts, keyless dedupe, and throughput."""

from __future__ import annotations

import dataclasses
import datetime
import json
import time
from decimal import Decimal

import psycopg
import pytest
from psycopg import sql

from producer.envelope import ShapeCodec, ShapeColumn
from producer.pgtypes import PgTypeInfo, column_codec
from schemas.buckets import bucket_of
from spark_consumer.apply_driver import apply_batch, apply_shapes
from spark_consumer.apply_plan import OffsetResetError
from spark_consumer.batch import BackfillGC, Part, parts_from_rows
from spark_consumer.progress import (
    Progress,
    ProgressGapError,
    ensure_progress,
    read_backfills,
    read_progress,
)
from spark_consumer.shape_record import ShapeTarget
from spark_consumer.statements import gc_tombstones
from spark_consumer.target_layout import ensure_table

INT = PgTypeInfo(23, "integer", 23, "integer", -1, "b")
INT8 = PgTypeInfo(20, "bigint", 20, "bigint", -1, "b")
TEXT = PgTypeInfo(25, "text", 25, "text", -1, "b")
NUM = PgTypeInfo(1700, "numeric(10,2)", 1700, "numeric(10,2)", (10 << 16 | 2) + 4, "b")
DATE = PgTypeInfo(1082, "date", 1082, "date", -1, "b")
TSTZ = PgTypeInfo(1184, "timestamp with time zone", 1184, "timestamp with time zone", -1, "b")
BYTEA = PgTypeInfo(17, "bytea", 17, "bytea", -1, "b")
INT_ARR = PgTypeInfo(1007, "integer[]", 1007, "integer[]", -1, "b", 23, "b")
JSONB = PgTypeInfo(3802, "jsonb", 3802, "jsonb", -1, "b")
MOOD = PgTypeInfo(16500, "mood", 16500, "mood", -1, "e")  # an enum: no such type in the target

GROUP = "g1"
TOPIC = "wb.app.items"


def items_target(shape: str = "app.items") -> ShapeTarget:
    cols = [ShapeColumn("id", column_codec(INT), True), ShapeColumn("body text", column_codec(TEXT), False),
            ShapeColumn("n", column_codec(NUM), False), ShapeColumn("d", column_codec(DATE), False),
            ShapeColumn("at", column_codec(TSTZ), False), ShapeColumn("raw", column_codec(BYTEA), False),
            ShapeColumn("tags", column_codec(INT_ARR), False), ShapeColumn("doc", column_codec(JSONB), False),
            ShapeColumn("mood", column_codec(MOOD), False)]
    schema, table = shape.split(".") if "." in shape else ("public", shape)
    codec = ShapeCodec(shape, "wb", "app", schema, table, cols, list(range(len(cols))))
    return ShapeTarget.from_avro(shape, codec.value_schema, codec.key_schema)


def log_target() -> ShapeTarget:
    cols = [ShapeColumn("a", column_codec(INT), False), ShapeColumn("b", column_codec(TEXT), False)]
    codec = ShapeCodec("eventlog", "wb", "app", "public", "eventlog", cols, [0, 1])
    return ShapeTarget.from_avro("eventlog", codec.value_schema, codec.key_schema)


def change(op, lsn, idx=0, *, p=0, off, id=None, topic=TOPIC, unchanged=None, special=None, control=None,
           snap=None, **values):
    r = {"id": id, "body text": None, "n": None, "d": None, "at": None, "raw": None, "tags": None, "doc": None,
         "mood": None}
    r.update({k.replace("body", "body text") if k == "body" else k: v for k, v in values.items()})
    r.update({"_wb_op": op, "_wb_lsn": lsn, "_wb_op_index": idx, "_wb_topic": topic, "_wb_partition": p,
              "_wb_offset": off, "_wb_unchanged": unchanged, "_wb_special": special, "_wb_control": control,
              "_wb_snapshot_id": snap, "_wb_ts_ms": 0})
    return r


def part(rows, p=0, start=None, end=None, topic=TOPIC):
    offs = [r["_wb_offset"] for r in rows]
    return Part(topic, p, start if start is not None else min(offs), end if end is not None else max(offs) + 1,
                rows)


@pytest.fixture
def conn(target_db):
    with psycopg.connect(target_db, autocommit=True) as c:
        yield c


@pytest.fixture
def items(conn):
    t = items_target()
    ensure_table(conn, t)
    return t


def table_rows(conn, sql="SELECT id, \"body text\", n FROM app.items ORDER BY id"):
    return conn.execute(sql).fetchall()


def progress(conn, topic=TOPIC):
    return {p: (v.next_offset, v.applied) for (t, p), v in read_progress(conn, GROUP, topic).items()}


# --------------------------------------------------------------------- tables
def test_table_created_from_avro_schema(conn, items):
    cols = conn.execute(
        "SELECT a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull FROM pg_attribute a "
        "WHERE a.attrelid = 'app.items'::regclass AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum"
    ).fetchall()
    assert cols == [
        ("id", "integer", True), ("body text", "text", False), ("n", "numeric(10,2)", False), ("d", "date", False),
        ("at", "timestamp with time zone", False), ("raw", "bytea", False), ("tags", "integer[]", False),
        ("doc", "jsonb", False), ("mood", "text", False),
        ("_wb_lsn", "bigint", False), ("_wb_op_index", "bigint", False), ("_wb_partition", "integer", False),
        ("_wb_offset", "bigint", False), ("_wb_applied_at", "timestamp with time zone", True),
        ("_wb_snapshot_id", "text", False)]
    pk = conn.execute("SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conrelid = 'app.items'::regclass "
                      "AND contype = 'p'").fetchone()[0]
    assert pk == "PRIMARY KEY (id)"
    assert conn.execute("SELECT to_regclass('app.items__wb_tombstones') IS NOT NULL").fetchone()[0]
    assert conn.execute("SELECT to_regclass('_walbridge.progress') IS NOT NULL").fetchone()[0]
    # Idempotent, and a column the shape gained is added.
    ensure_table(conn, items)
    grown = ShapeTarget(items.shape, items.schema, items.table,
                        items.columns + (type(items.columns[0])("extra", "extra", "bigint", False),))
    ensure_table(conn, grown)
    assert conn.execute("SELECT format_type(atttypid, atttypmod) FROM pg_attribute WHERE attrelid = "
                        "'app.items'::regclass AND attname = 'extra'").fetchone()[0] == "bigint"
    # Undotted names go to public; keyless tables get the position index, and tombstones that hold rows
    # (removals, with what they took); a table of an earlier version gains the took columns.
    ensure_table(conn, log_target())
    assert conn.execute("SELECT to_regclass('public.eventlog') IS NOT NULL").fetchone()[0]
    tombstone_columns = lambda: conn.execute(
        "SELECT array_agg(attname::text ORDER BY attnum) FROM pg_attribute WHERE attrelid = "
        "'public.eventlog__wb_tombstones'::regclass AND attnum > 0 AND NOT attisdropped").fetchone()[0]
    assert tombstone_columns() == ["_wb_row", "_wb_lsn", "_wb_op_index", "_wb_partition", "_wb_offset",
                                   "_wb_applied_at", "_wb_took_lsn", "_wb_took_op_index", "_wb_took_streamed"]
    conn.execute("ALTER TABLE eventlog__wb_tombstones DROP COLUMN _wb_took_lsn, DROP COLUMN _wb_took_op_index, "
                 "DROP COLUMN _wb_took_streamed")
    ensure_table(conn, log_target())
    assert tombstone_columns()[-3:] == ["_wb_took_lsn", "_wb_took_op_index", "_wb_took_streamed"]
    assert conn.execute("SELECT indexdef FROM pg_indexes WHERE tablename = 'eventlog'").fetchone()[0].endswith(
        "(_wb_lsn, _wb_op_index) WHERE (_wb_snapshot_id IS NULL)")


# ---------------------------------------------------------- idempotence/crash
def batch_one():
    p0 = [change("c", 100, 0, id=1, body="a", n=Decimal("1.00"), off=0),
          change("c", 100, 1, id=2, body="b", off=1),
          change("u", 110, 0, id=1, body="a2", n=Decimal("1.50"), off=2)]
    p1 = [change("c", 105, 0, id=3, body="c", p=1, off=0), change("d", 120, 0, id=3, p=1, off=1)]
    return [part(p0, 0), part(p1, 1)]


def test_apply_then_replay_is_skipped(conn, items):
    res = apply_batch(conn, GROUP, items, batch_one())
    r0, r1 = res.parts[(TOPIC, 0)], res.parts[(TOPIC, 1)]
    assert (r0.rows, r0.upserted, r0.superseded, r0.skipped_replayed) == (3, 2, 1, 0)
    assert (r1.superseded, r1.tombstoned, r1.deleted, r1.upserted) == (1, 1, 0, 0)
    assert res.offsets == {(TOPIC, 0): 3, (TOPIC, 1): 2}
    assert table_rows(conn) == [(1, "a2", Decimal("1.50")), (2, "b", None)]
    before = conn.execute("SELECT id, _wb_lsn, _wb_op_index, _wb_partition, _wb_offset, _wb_applied_at "
                          "FROM app.items ORDER BY id").fetchall()
    assert [b[1:5] for b in before] == [(110, 0, 0, 2), (100, 1, 0, 1)]
    assert progress(conn) == {0: (3, (110, 0)), 1: (2, (120, 0))}
    # The same micro-batch again (Spark replays it after a crash): skipped part by part.
    again = apply_batch(conn, GROUP, items, batch_one())
    assert again.total("skipped_replayed") == 5 and again.total("applied") == 0 and again.total("stale") == 0
    assert conn.execute("SELECT id, _wb_lsn, _wb_op_index, _wb_partition, _wb_offset, _wb_applied_at "
                        "FROM app.items ORDER BY id").fetchall() == before
    assert again.offsets == res.offsets


def test_tuple_rows_apply_like_mappings(conn, items):
    """The job's form: tuples named by a fields list (decode.py's order)."""
    fields = (*items.names, "_wb_op", "_wb_lsn", "_wb_op_index", "_wb_topic", "_wb_partition", "_wb_offset",
              "_wb_unchanged", "_wb_special", "_wb_control", "_wb_control_info", "_wb_snapshot_id", "_wb_ts_ms",
              "_wb_error", "_wb_before", "_wb_before_special")
    rows = [tuple(r.get(f) for f in fields) for p in batch_one() for r in p.rows]
    parts = parts_from_rows(rows, fields=fields)
    assert [(p.partition, p.start, p.end, len(p.rows)) for p in parts] == [(0, 0, 3, 3), (1, 0, 2, 2)]
    res = apply_batch(conn, GROUP, items, parts)
    r0, r1 = res.parts[(TOPIC, 0)], res.parts[(TOPIC, 1)]
    assert (r0.rows, r0.upserted, r0.superseded, r1.tombstoned) == (3, 2, 1, 1)
    assert table_rows(conn) == [(1, "a2", Decimal("1.50")), (2, "b", None)]
    # A replay in either form is skipped, also when it reaches further (offset filter on tuples).
    assert apply_batch(conn, GROUP, items, batch_one()).total("skipped_replayed") == 5
    more = rows[:3] + [tuple(dict(zip(fields, rows[0]), _wb_offset=3, _wb_lsn=130, **{"body text": "a3"})[f]
                             for f in fields)]
    res = apply_batch(conn, GROUP, items, parts_from_rows(more, fields=fields)[:1])
    assert (res.total("skipped_replayed"), res.total("upserted")) == (3, 1)
    assert table_rows(conn)[0] == (1, "a3", Decimal("1.00"))
    mixed = [parts[0], batch_one()[1]]
    with pytest.raises(ValueError, match="differently"):
        apply_batch(conn, GROUP, items, mixed)


def test_replay_with_a_longer_range_applies_only_the_rest(conn, items):
    rows = [change("c", 100 + i, id=i, body=f"v{i}", off=i) for i in range(6)]
    apply_batch(conn, GROUP, items, [part(rows[:3], 0)])
    res = apply_batch(conn, GROUP, items, [part(rows, 0)])
    assert res.parts[(TOPIC, 0)].skipped_replayed == 3 and res.parts[(TOPIC, 0)].upserted == 3
    assert len(table_rows(conn)) == 6 and progress(conn)[0] == (6, (105, 0))


def test_rolled_back_apply_leaves_nothing_and_reapplies(target_db, items):
    with psycopg.connect(target_db) as c:  # not autocommit: the caller owns the transaction
        c.execute("SELECT 1")
        res = apply_batch(c, GROUP, items, batch_one())  # runs in a savepoint of the caller's transaction
        assert res.total("upserted") == 2
        c.rollback()  # "crash" before commit
        assert c.execute("SELECT count(*) FROM app.items").fetchone()[0] == 0
        assert read_progress(c, GROUP) == {}
        c.rollback()
    with psycopg.connect(target_db, autocommit=True) as c:
        with pytest.raises(RuntimeError):
            with c.transaction():
                apply_batch(c, GROUP, items, batch_one())
                raise RuntimeError("killed between apply and commit")
        assert read_progress(c, GROUP) == {}
        res = apply_batch(c, GROUP, items, batch_one())
        assert res.total("skipped_replayed") == 0 and res.total("upserted") == 2
        assert table_rows(c) == [(1, "a2", Decimal("1.50")), (2, "b", None)]


def test_gap_and_offset_reset_are_loud(conn, items):
    apply_batch(conn, GROUP, items, [part([change("c", 100, id=1, off=0)], 0)])
    with pytest.raises(ProgressGapError):
        apply_batch(conn, GROUP, items, [part([change("c", 101, id=2, off=5)], 0)])
    # Offsets below next_offset again, but with newer positions: Kafka lost its data.
    assert apply_batch(conn, GROUP, items, [part([change("c", 101, id=2, off=1)], 0)]).total("upserted") == 1
    reborn = [change("c", 200, id=7, off=0), change("c", 201, id=8, off=1)]
    with pytest.raises(OffsetResetError):
        apply_batch(conn, GROUP, items, [part(reborn, 0)])
    res = apply_batch(conn, GROUP, items, [part(reborn, 0)], on_offset_reset="follow")
    assert res.parts[(TOPIC, 0)].offset_reset and res.total("upserted") == 2 and progress(conn)[0] == (2, (201, 0))


def test_progress_of_another_topic_incarnation_counts_nothing(conn, items):
    """Kafka lost the topic and it was recreated: offsets counted in the lost
    incarnation say nothing of the new one, so a new part that does not start
    at the new topic's beginning is a gap, never a pass on stale offsets."""
    lost = part([change("c", 100, id=1, off=0), change("c", 101, id=2, off=1), change("c", 102, id=3, off=2)], 0)
    apply_batch(conn, GROUP, items, [dataclasses.replace(lost, topic_id="A")])
    assert read_progress(conn, GROUP, TOPIC)[(TOPIC, 0)].topic_id == "A"
    # The new incarnation's second batch, its first never applied: offsets 1..2
    # are below the lost topic's next offset (3), yet nothing of B is applied.
    second = part([change("c", 201, id=5, off=1), change("c", 202, id=6, off=2)], 0, start=1)
    with pytest.raises(ProgressGapError):
        apply_batch(conn, GROUP, items, [dataclasses.replace(second, topic_id="B")], on_offset_reset="follow")
    first = part([change("c", 200, id=4, off=0)], 0)
    res = apply_batch(conn, GROUP, items, [dataclasses.replace(first, topic_id="B")])  # no OffsetResetError
    assert res.total("upserted") == 1 and not res.parts[(TOPIC, 0)].offset_reset
    assert progress(conn)[0] == (1, (200, 0)) and read_progress(conn, GROUP, TOPIC)[(TOPIC, 0)].topic_id == "B"
    assert apply_batch(conn, GROUP, items, [dataclasses.replace(second, topic_id="B")]).total("upserted") == 2
    assert [r[0] for r in table_rows(conn)] == [1, 2, 3, 4, 5, 6]
    # Read as a part of another incarnation sees it, nothing of it counts.
    assert read_progress(conn, GROUP, TOPIC)[(TOPIC, 0)].for_incarnation("B").next_offset == 3
    assert read_progress(conn, GROUP, TOPIC)[(TOPIC, 0)].for_incarnation("C").next_offset == 0


def test_progress_made_before_incarnations_were_recorded_gains_the_column(conn):
    conn.execute("CREATE SCHEMA _walbridge; CREATE TABLE _walbridge.progress (consumer_group text, topic text, "
                 "partition integer, next_offset bigint NOT NULL, applied_lsn bigint, applied_op_index bigint, "
                 "floor_lsn bigint, floor_op_index bigint, updated_at timestamptz NOT NULL DEFAULT now(), "
                 "PRIMARY KEY (consumer_group, topic, partition))")
    conn.execute("INSERT INTO _walbridge.progress (consumer_group, topic, partition, next_offset) "
                 "VALUES (%s, %s, 0, 9)", (GROUP, TOPIC))
    ensure_progress(conn)
    ensure_progress(conn)  # again: nothing to add
    assert read_progress(conn, GROUP, TOPIC)[(TOPIC, 0)] == Progress(9)  # no id: taken as is by any incarnation


# ------------------------------------------------------------ position guards
def test_out_of_order_older_change_is_ignored(conn, items):
    apply_batch(conn, GROUP, items, [part([change("c", 300, id=1, body="new", off=0)], 0)])
    # The same key with an older position arrives later (e.g. from another partition).
    res = apply_batch(conn, GROUP, items, [part([change("u", 200, id=1, body="old", p=1, off=0)], 1)])
    assert res.parts[(TOPIC, 1)].stale == 1 and res.total("upserted") == 0
    assert table_rows(conn) == [(1, "new", None)]


def test_delete_never_comes_back_to_life(conn, items):
    apply_batch(conn, GROUP, items, [part([change("c", 100, id=1, body="x", off=0),
                                           change("d", 200, id=1, off=1)], 0)])
    assert table_rows(conn) == []
    assert conn.execute("SELECT id, _wb_lsn, _wb_partition FROM app.items__wb_tombstones").fetchall() == [(1, 200, 0)]
    res = apply_batch(conn, GROUP, items, [part([change("c", 150, id=1, body="zombie", p=1, off=0)], 1)])
    assert res.parts[(TOPIC, 1)].stale == 1 and table_rows(conn) == []
    # A newer insert does bring the key back, and lifts the tombstone.
    res = apply_batch(conn, GROUP, items, [part([change("c", 250, id=1, body="reborn", p=1, off=1)], 1)])
    assert res.total("upserted") == 1 and table_rows(conn) == [(1, "reborn", None)]
    assert conn.execute("SELECT count(*) FROM app.items__wb_tombstones").fetchone()[0] == 0
    # An older delete does not remove the newer row.
    res = apply_batch(conn, GROUP, items, [part([change("d", 220, id=1, off=2)], 0)])
    assert res.parts[(TOPIC, 0)].stale == 1 and table_rows(conn) == [(1, "reborn", None)]
    assert gc_tombstones(conn, items) == 0


def test_a_change_at_the_snapshot_point_outranks_the_snapshot_row_applied_before_it(conn, items):
    # A commit record that begins exactly at the slot's consistent point is
    # streamed at the snapshot's own position (it is not in the snapshot).
    snapshot = [change("r", 500, id=i, body="snapshot", off=i - 1, snap="s") for i in (1, 2)]
    apply_batch(conn, GROUP, items, [part(snapshot, 0)])
    apply_batch(conn, GROUP, items, [part([change("u", 500, id=1, body="change", off=2)], 0)])
    apply_batch(conn, GROUP, items, [part([change("d", 500, id=2, p=1, off=0)], 1)])
    assert table_rows(conn) == [(1, "change", None)]
    # The snapshot rows again (a replay at new offsets): neither comes back over its change.
    res = apply_batch(conn, GROUP, items, [part([dict(r, _wb_partition=1, _wb_offset=1 + i)
                                                 for i, r in enumerate(snapshot)], 1)])
    assert res.parts[(TOPIC, 1)].stale == 2 and table_rows(conn) == [(1, "change", None)]
    # And the same change replayed is not applied twice (its position is taken).
    res = apply_batch(conn, GROUP, items, [part([change("u", 500, id=1, body="change", off=3)], 0)])
    assert res.parts[(TOPIC, 0)].stale == 1


def test_unchanged_toast_keeps_the_current_value(conn, items):
    big = "x" * 10_000
    apply_batch(conn, GROUP, items, [part([change("c", 100, id=1, body=big, n=Decimal("1.00"), off=0)], 0)])
    res = apply_batch(conn, GROUP, items, [part([
        change("u", 110, id=1, n=Decimal("2.00"), unchanged=["body text"], off=1),
        change("c", 111, id=2, body="fresh", off=2),
        change("u", 112, id=2, n=Decimal("3.00"), unchanged=["body text"], off=3)], 0)])
    assert res.total("upserted") == 2
    assert table_rows(conn) == [(1, big, Decimal("2.00")), (2, "fresh", Decimal("3.00"))]


def test_binary_copy_stages_exactly_what_text_would(conn, monkeypatch):
    """Batches whose values all fit go to the stage in binary COPY; the table
    ends up as with text COPY, and a batch with a value that does not fit
    (a special value, an int out of range) is staged in text."""
    from spark_consumer import staging

    types = [PgTypeInfo(16, "boolean", 16, "boolean", -1, "b"), PgTypeInfo(21, "smallint", 21, "smallint", -1, "b"),
             INT8, PgTypeInfo(701, "double precision", 701, "double precision", -1, "b"), NUM, TEXT, DATE, TSTZ,
             PgTypeInfo(1114, "timestamp without time zone", 1114, "timestamp without time zone", -1, "b"), BYTEA]
    names = ["flag", "small", "big", "dbl", "n", "body", "d", "at", "local", "raw"]
    cols = [ShapeColumn("id", column_codec(INT), True)] + [ShapeColumn(n, column_codec(t), False)
                                                           for n, t in zip(names, types)]
    utc = datetime.timezone.utc
    values = [dict(flag=True, small=-7, big=2**40, dbl=0.1, n=Decimal("12.345"), body="a\tb\\c\nd", d=datetime.date(2024, 2, 29),
                   at=datetime.datetime(2024, 1, 1, 10, 0, 0, 5, tzinfo=datetime.timezone(datetime.timedelta(hours=2))),
                   local=datetime.datetime(1999, 12, 31, 23, 59, 59, 999999), raw=b"\x00\xff"),
              dict(flag=False, small=None, big=None, dbl=float("nan"), n=Decimal("-0.5"), body="", d=None,
                   at=datetime.datetime(1, 1, 1, tzinfo=utc), local=None, raw=b""),
              {k: None for k in names}]
    used = []
    real = staging._binary_types

    def spy(*a):
        oids = real(*a)
        used.append(oids is not None)
        return oids

    monkeypatch.setattr(staging, "_binary_types", spy)
    tables = {}
    for shape, form in (("app.bin", "binary"), ("app.txt", "text")):
        codec = ShapeCodec(shape, "wb", "app", "app", shape[4:], cols, list(range(len(cols))))
        t = ShapeTarget.from_avro(shape, codec.value_schema, codec.key_schema)
        ensure_table(conn, t)
        if form == "text":
            monkeypatch.setattr(staging, "_binary_types", lambda *a: used.append(False))
        topic = f"wb.{shape}"
        rows = [dict(v, id=i, _wb_op="c", _wb_lsn=100 + i, _wb_op_index=0, _wb_topic=topic, _wb_partition=0,
                     _wb_offset=i, _wb_snapshot_id="s" if i else None) for i, v in enumerate(values)]
        assert apply_batch(conn, GROUP, t, parts_from_rows(rows)).total("upserted") == 3
        tables[form] = conn.execute(sql.SQL("SELECT id, {}, _wb_lsn, _wb_op_index, _wb_partition, _wb_offset, "
                                            "_wb_snapshot_id FROM {} ORDER BY id").format(
            sql.SQL(", ").join(sql.Identifier(n) for n in names), sql.Identifier("app", shape[4:]))).fetchall()
    assert used == [True, False]
    assert str(tables["binary"]) == str(tables["text"])  # str: NaN == NaN
    assert tables["binary"][0][1:6] == (True, -7, 2**40, 0.1, Decimal("12.35"))
    assert tables["binary"][0][8] == datetime.datetime(2024, 1, 1, 8, 0, 0, 5, tzinfo=utc)
    # Values that do not fit binary: the batch goes in text (and fails or not as text would).
    t = ShapeTarget.from_avro("app.bin", ShapeCodec("app.bin", "wb", "app", "app", "bin", cols,
                                                    list(range(len(cols)))).value_schema, key_fields=["id"])
    row = dict({k: None for k in names}, id=9, _wb_op="c", _wb_lsn=200, _wb_op_index=0, _wb_topic="wb.app.bin",
               _wb_partition=0, _wb_offset=3, _wb_special={"d": "infinity"})
    used.clear()
    monkeypatch.setattr(staging, "_binary_types", spy)
    assert apply_batch(conn, GROUP, t, parts_from_rows([row])).total("upserted") == 1
    assert conn.execute("SELECT d::text FROM app.bin WHERE id = 9").fetchone()[0] == "infinity"
    with pytest.raises(psycopg.errors.NumericValueOutOfRange):
        apply_batch(conn, GROUP, t, parts_from_rows([dict(row, id=10, small=40000, _wb_offset=4, _wb_special=None)]))
    assert used == [False, False]


def test_new_keys_go_straight_in_and_updates_run_only_when_keys_may_exist(conn, items, monkeypatch):
    """Upserts of keys neither the table nor its tombstones hold anywhere in
    the batch's key range are COPYed straight into the table; otherwise the
    stage's statements run (the UPDATE only when the table holds one of the
    keys, asked once for the table and its tombstones apart)."""
    from spark_consumer import apply_driver, statements

    direct, between = [], []
    real_insert, real_holders = apply_driver.insert_new_keys, statements._key_holders
    monkeypatch.setattr(apply_driver, "insert_new_keys", lambda *a: direct.append(1) or real_insert(*a))

    def holders(conn, asks, **k):  # one entry per table asked about
        held = real_holders(conn, asks, **k)
        between.extend((h, k.get("tombstones", False)) for h in held)
        return held

    monkeypatch.setattr(statements, "_key_holders", holders)

    def apply(*rows):
        direct.clear(), between.clear()
        return apply_batch(conn, GROUP, items, [part(list(rows))])

    res = apply(*[change("c", 100 + i, id=i, body=f"v{i}", off=i - 1) for i in (1, 2, 3)])
    assert res.total("upserted") == 3 and direct == [1] and between == [((False, False), True)]  # empty target
    res = apply(change("c", 200, id=10, off=3), change("c", 201, id=12, off=4))
    assert res.total("upserted") == 2 and direct == [1]  # 10..12: no key there
    res = apply(change("u", 300, id=2, body="new", off=5), change("u", 90, id=3, body="stale", off=6),
                change("c", 301, id=20, off=7))
    # One probe: the table's own answer decides the UPDATE too.
    assert (res.total("upserted"), res.total("stale"), direct, between) == (2, 1, [], [((True, False), True)])
    assert table_rows(conn, 'SELECT id, "body text" FROM app.items ORDER BY id') == [
        (1, "v1"), (2, "new"), (3, "v3"), (10, None), (12, None), (20, None)]
    res = apply(change("d", 400, id=1, off=8), change("d", 401, id=99, off=9))  # deletes only: no upsert statement
    assert (res.total("deleted"), res.total("tombstoned"), direct, between) == (1, 2, [], [])
    # A tombstone in range: the stage's statements (an older upsert stays deleted, a newer one lifts it).
    res = apply(change("c", 350, id=99, off=10), change("c", 500, id=100, off=11))
    assert (res.total("upserted"), res.total("stale"), direct) == (1, 1, [])
    res = apply(change("c", 600, id=99, off=12), change("c", 601, id=98, off=13))
    assert (res.total("upserted"), direct) == (2, [])
    assert [r[0] for r in table_rows(conn, "SELECT id FROM app.items ORDER BY id")] == [2, 3, 10, 12, 20, 98, 99, 100]
    assert conn.execute("SELECT count(*) FROM app.items__wb_tombstones").fetchone()[0] == 1  # id 1
    # Rows that went straight in carry what the stage would have written.
    assert conn.execute("SELECT _wb_lsn, _wb_op_index, _wb_partition, _wb_offset, _wb_snapshot_id, "
                        "_wb_applied_at IS NOT NULL FROM app.items WHERE id = 10").fetchone() == (
        200, 0, 0, 3, None, True)
    # New keys between held ones (a snapshot's partitions interleave key ranges) still go straight in.
    res = apply(change("c", 650, id=11, off=14), change("c", 651, id=13, off=15))
    assert (res.total("upserted"), direct) == (2, [1])
    # Row-level security (COPY FROM refuses it for roles under it) keeps new keys on the stage's INSERT.
    conn.execute("ALTER TABLE app.items ENABLE ROW LEVEL SECURITY")
    res = apply(change("c", 700, id=1000, off=16))
    assert (res.total("upserted"), direct) == (1, [])
    conn.execute("ALTER TABLE app.items DISABLE ROW LEVEL SECURITY")


def test_values_and_special_values_are_written_exactly(conn, items):
    at = datetime.datetime(2024, 3, 1, 12, 30, 0, 123456, tzinfo=datetime.timezone.utc)
    rows = [change("c", 100, id=1, body="tab\there\nnewline \\ back", n=Decimal("12.34"), d=datetime.date(2024, 2, 29),
                   at=at, raw=b"\x00\xff\\", tags=[1, None, 3], doc='{"a": [1, "b"]}', mood="happy", off=0),
            change("c", 101, id=2, special={"n": "NaN", "d": "infinity", "at": "-infinity"}, off=1),
            change("c", 102, id=3, special={"d": "0044-03-15 BC", "tags": "{{1,2},{3,4}}"},
                   at=datetime.datetime(2024, 1, 1, 10, 0), off=2)]
    apply_batch(conn, GROUP, items, [part(rows, 0)])
    got = conn.execute("SELECT id, \"body text\", n::text, d::text, CASE WHEN isfinite(at) THEN at END, raw, "
                       "tags::text, doc::text, mood FROM app.items ORDER BY id").fetchall()
    assert got[0] == (1, "tab\there\nnewline \\ back", "12.34", "2024-02-29", at, b"\x00\xff\\", "{1,NULL,3}",
                      '{"a": [1, "b"]}', "happy")
    assert got[1][2:4] == ("NaN", "infinity")
    assert conn.execute("SELECT at = '-infinity' FROM app.items WHERE id = 2").fetchone()[0]
    assert got[2][3] == "0044-03-15 BC" and got[2][6] == "{{1,2},{3,4}}"
    # A naive timestamp for a timestamptz column is read as UTC.
    assert got[2][4] == datetime.datetime(2024, 1, 1, 10, 0, tzinfo=datetime.timezone.utc)


# ----------------------------------------------------------------------- cuts
def test_truncate_at_position(conn, items):
    apply_batch(conn, GROUP, items, [
        part([change("c", 100, id=1, off=0), change("c", 101, id=2, off=1), change("d", 102, id=9, off=2)], 0),
        part([change("c", 100, id=3, p=1, off=0)], 1)])
    # TRUNCATE at 150 reached partition 0 only so far; a newer insert follows it.
    res = apply_batch(conn, GROUP, items, [
        part([change("c", 140, id=4, off=3), change("t", 150, off=4), change("c", 160, id=5, off=5)], 0)])
    r0 = res.parts[(TOPIC, 0)]
    assert (r0.truncates, r0.erased, r0.truncated, r0.tombstones_dropped, r0.upserted) == (1, 1, 2, 1, 1)
    assert [r[0] for r in table_rows(conn)] == [3, 5]
    # Partition 1 gets its truncate later: its older rows go, nothing else.
    res = apply_batch(conn, GROUP, items, [part([change("t", 150, p=1, off=1)], 1)])
    assert res.parts[(TOPIC, 1)].truncated == 1 and [r[0] for r in table_rows(conn)] == [5]
    # A change below the partition's floor (the cut) arriving late is dropped.
    res = apply_batch(conn, GROUP, items, [part([change("c", 120, id=6, p=1, off=2)], 1)])
    assert res.parts[(TOPIC, 1)].erased == 1 and [r[0] for r in table_rows(conn)] == [5]
    assert read_progress(conn, GROUP)[(TOPIC, 1)].floor == (150, 0)


def test_snapshot_end_collects_rows_the_snapshot_did_not_see(conn, items):
    apply_batch(conn, GROUP, items, [part([change("c", 100, id=1, off=0), change("c", 101, id=2, off=1)], 0)])
    # Re-snapshot at 500 sees only id 2; snapshot_end at its position collects id 1.
    res = apply_batch(conn, GROUP, items, [part([
        change("r", 500, id=2, body="snap", snap="s2", off=2),
        change(None, 500, control="snapshot_end", snap="s2", off=3)], 0)])
    assert res.parts[(TOPIC, 0)].truncated == 1 and [c["_wb_control"] for c in res.controls] == ["snapshot_end"]
    assert table_rows(conn) == [(2, "snap", None)]
    assert conn.execute("SELECT _wb_snapshot_id FROM app.items").fetchone()[0] == "s2"


# -------------------------------------------------------------------- keyless
def lchange(op, lsn, idx=0, *, p=0, off, a=None, b=None, before=None, snap=None):
    return {"a": a, "b": b, "_wb_op": op, "_wb_lsn": lsn, "_wb_op_index": idx, "_wb_topic": "wb.eventlog",
            "_wb_partition": p, "_wb_offset": off, "_wb_unchanged": None, "_wb_special": None, "_wb_control": None,
            "_wb_snapshot_id": snap, "_wb_ts_ms": 0, "_wb_before": before}


def test_keyless_append_dedupe_and_removals(conn):
    t = log_target()
    ensure_table(conn, t)
    snap = [lchange("r", 50, p=i % 2, off=i // 2, a=1, b="same", snap="s") for i in range(4)]
    res = apply_shapes(conn, GROUP, [(t, parts_from_rows(snap))])
    assert res.total("appended") == 4  # snapshot rows share a position and are all kept
    live = [lchange("c", 100, p=0, off=2, a=2, b="x"), lchange("c", 101, p=1, off=2, a=2, b="x")]
    assert apply_batch(conn, GROUP, t, parts_from_rows(live)).total("appended") == 2
    # The same changes re-produced at new offsets: deduped by position.
    again = [lchange("c", 100, p=0, off=3, a=2, b="x"), lchange("c", 101, p=1, off=3, a=2, b="x")]
    res = apply_batch(conn, GROUP, t, parts_from_rows(again))
    assert res.total("appended") == 0 and res.total("stale") == 2
    count = lambda: conn.execute("SELECT a, b, count(*) FROM eventlog GROUP BY 1, 2 ORDER BY 1").fetchall()
    assert count() == [(1, "same", 4), (2, "x", 2)]
    # delete removes one equal row; update replaces one; an older-positioned removal finds nothing newer.
    res = apply_batch(conn, GROUP, t, parts_from_rows([
        lchange("d", 200, p=0, off=4, a=1, b="same"),
        lchange("u", 201, p=1, off=4, a=3, b="y", before={"a": 2, "b": "x"}),
        lchange("c", 202, p=0, off=5, a=4, b="z"), lchange("d", 203, p=1, off=5, a=4, b="z")]))
    assert res.total("deleted") == 3 and res.total("appended") == 2  # 202 lands, 203 takes it
    assert count() == [(1, "same", 3), (2, "x", 1), (3, "y", 1)]
    # An older-positioned removal finds nothing older than itself: it waits for its row (see below).
    res = apply_batch(conn, GROUP, t, parts_from_rows([lchange("d", 90, p=0, off=6, a=2, b="x")]))
    assert (res.total("deleted"), res.total("tombstoned")) == (0, 1)
    assert count() == [(1, "same", 3), (2, "x", 1), (3, "y", 1)]


def test_a_keyless_update_at_the_snapshot_point_replaces_the_snapshot_row(conn):
    t = log_target()
    ensure_table(conn, t)
    apply_batch(conn, GROUP, t, parts_from_rows([lchange("r", 500, off=0, a=1, b="old", snap="s")]))
    res = apply_batch(conn, GROUP, t, parts_from_rows([
        lchange("u", 500, off=1, a=1, b="new", before={"a": 1, "b": "old"})]))
    assert (res.total("deleted"), res.total("appended"), res.total("tombstoned")) == (1, 1, 0)
    assert conn.execute("SELECT a, b FROM eventlog").fetchall() == [(1, "new")]


def test_a_keyless_removal_that_comes_before_its_row_waits_for_it(conn):
    # Keyless changes are spread over the partitions: an update's removal of the
    # row an older change appended can be applied first (that partition lags).
    t = log_target()
    ensure_table(conn, t)
    rows = lambda: conn.execute("SELECT a, b FROM eventlog ORDER BY a").fetchall()
    pending = lambda: conn.execute("SELECT _wb_row, _wb_lsn, _wb_partition FROM eventlog__wb_tombstones "
                                   "WHERE _wb_took_lsn IS NULL ORDER BY _wb_lsn").fetchall()
    res = apply_batch(conn, GROUP, t, parts_from_rows([
        lchange("u", 201, p=1, off=0, a=3, b="y", before={"a": 2, "b": "x"}),
        lchange("d", 300, p=1, off=1, a=5, b="z"),
        lchange("d", 310, p=1, off=2, a=6, b="w")]))
    assert (res.total("appended"), res.total("tombstoned"), res.total("deleted")) == (1, 3, 0)
    assert rows() == [(3, "y")] and pending() == [("(2,x)", 201, 1), ("(5,z)", 300, 1), ("(6,w)", 310, 1)]
    # The lagging partition: its appends below a pending removal of their row are cancelled, a newer
    # equal append lands.
    res = apply_batch(conn, GROUP, t, parts_from_rows([
        lchange("c", 100, p=0, off=0, a=2, b="x"), lchange("c", 290, p=0, off=1, a=5, b="z"),
        lchange("c", 320, p=0, off=2, a=6, b="w")]))
    assert (res.total("appended"), res.total("cancelled"), res.total("stale")) == (1, 2, 0)
    assert rows() == [(3, "y"), (6, "w")] and pending() == [("(6,w)", 310, 1)]
    # Replayed at new offsets (the producer re-sent them): nothing twice.
    res = apply_batch(conn, GROUP, t, parts_from_rows([lchange("d", 310, p=1, off=3, a=6, b="w")]))
    assert res.total("tombstoned") == 0 and pending() == [("(6,w)", 310, 1)]
    # The removals that cancelled their rows are kept with what they took.
    assert conn.execute("SELECT _wb_lsn, _wb_took_lsn, _wb_took_streamed FROM eventlog__wb_tombstones "
                        "WHERE _wb_took_lsn IS NOT NULL ORDER BY 1").fetchall() == [(201, 100, True), (300, 290, True)]
    # A cut of its partition takes the removals below it (their rows, below the cut, are gone too).
    res = apply_batch(conn, GROUP, t, parts_from_rows([lchange("t", 400, p=1, off=4)]))
    assert res.parts[("wb.eventlog", 1)].tombstones_dropped == 3 and pending() == []


def keyless_backfill_end(lsn, *, off, rows):
    end = lchange(None, lsn, off=off)
    end.update({"_wb_control": "backfill_end", "_wb_snapshot_id": "bf1", "_wb_control_info": json.dumps(
        {"backfill_id": "bf1", "shape": "eventlog", "lsn": lsn, "partitions": 1, "rows": rows, "scope": None})})
    return end


@pytest.mark.parametrize("order", ["re-read copy first", "removal first", "removal in the append's batch"])
def test_a_keyless_removal_after_a_backfill_start_takes_the_re_read_copy(conn, order):
    # The source holds (1,v) twice and (2,w) once; a backfill re-reads them at
    # 500; after 500 one (1,v) and the (2,w) are removed. However the re-read
    # copies and the removals interleave, the backfill's end leaves one (1,v).
    t = log_target()
    ensure_table(conn, t)
    before = [lchange("c", 100, off=0, a=1, b="v"), lchange("c", 110, off=1, a=1, b="v")]
    old_w = [lchange("c", 120, off=2, a=2, b="w")]
    reread = [lchange("r", 500, off=0, a=1, b="v", snap="bf1"), lchange("r", 500, off=0, a=1, b="v", snap="bf1"),
              lchange("r", 500, off=0, a=2, b="w", snap="bf1")]
    removals = [lchange("d", 600, off=0, a=1, b="v"), lchange("d", 610, off=0, a=2, b="w")]
    if order == "re-read copy first":
        batches = [before + old_w, reread, removals]
    elif order == "removal first":
        batches = [before + old_w, removals, reread]
    else:
        batches = [before, old_w + removals, reread]
    off = 0
    for batch in batches:
        for r in batch:
            r["_wb_offset"], off = off, off + 1
        apply_batch(conn, GROUP, t, parts_from_rows(batch))
    apply_batch(conn, GROUP, t, parts_from_rows([keyless_backfill_end(500, off=off, rows=3)]))
    assert conn.execute("SELECT a, b, _wb_lsn FROM eventlog").fetchall() == [(1, "v", 500)]


# ----------------------------------------------------------------- throughput
def test_throughput_keyed_upserts_vs_raw_copy(conn, items, capsys):
    n = 100_000
    at = datetime.datetime(2024, 1, 1, tzinfo=datetime.timezone.utc)
    rows = [change("c", 1000 + i // 10, i % 10, id=i, body=f"row {i}", n=Decimal(i % 1000) / 4, d=datetime.date(2024, 1, 1),
                   at=at, p=i % 3, off=i // 3) for i in range(n)]
    parts = parts_from_rows(rows)
    conn.execute("CREATE TABLE plain (id integer, \"body text\" text, n numeric(10,2), d date, at timestamptz, "
                 "_wb_lsn bigint, _wb_op_index bigint, _wb_partition int, _wb_offset bigint)")
    names = ("id", "body text", "n", "d", "at", "_wb_lsn", "_wb_op_index", "_wb_partition", "_wb_offset")
    t0 = time.perf_counter()
    with conn.transaction(), conn.cursor() as cur:
        with cur.copy('COPY plain (id, "body text", n, d, at, _wb_lsn, _wb_op_index, _wb_partition, _wb_offset) '
                      "FROM STDIN") as cp:
            for r in rows:
                cp.write_row(tuple(r[k] for k in names))
    copy_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    res = apply_batch(conn, GROUP, items, parts)
    apply_s = time.perf_counter() - t0
    assert res.total("upserted") == n
    # Second round: every row is an update of an existing key (newer positions).
    ends = {pt.partition: pt.end for pt in parts}
    rows2 = [dict(r, _wb_op="u", _wb_lsn=r["_wb_lsn"] + 10_000, _wb_offset=r["_wb_offset"] + ends[r["_wb_partition"]])
             for r in rows]
    t0 = time.perf_counter()
    res = apply_batch(conn, GROUP, items, parts_from_rows(rows2))
    update_s = time.perf_counter() - t0
    assert res.total("upserted") == n
    with capsys.disabled():
        print(f"\n[throughput] raw COPY {n / copy_s:,.0f} rows/s; apply_batch inserts {n / apply_s:,.0f} rows/s "
              f"({copy_s / apply_s:.0%} of COPY); apply_batch updates {n / update_s:,.0f} rows/s "
              f"({copy_s / update_s:.0%} of COPY)")


def test_several_shapes_commit_or_fail_together(conn, items):
    t = log_target()
    ensure_table(conn, t)
    good = (items, [part([change("c", 100, id=1, off=0)], 0)])
    unplannable = lchange("c", 101, off=0, a=1, b="toast")
    unplannable["_wb_unchanged"] = ["b"]  # an insert never leaves a column unchanged
    bad = (t, parts_from_rows([unplannable]))
    with pytest.raises(Exception, match="unchanged TOAST"):
        apply_shapes(conn, GROUP, [good, bad])
    assert table_rows(conn) == [] and read_progress(conn, GROUP) == {}
    res = apply_shapes(conn, GROUP, [good, (t, parts_from_rows([lchange("c", 101, off=0, a=1, b="ok")]))])
    assert res.total("upserted") == 1 and res.total("appended") == 1
    assert set(res.offsets) == {(TOPIC, 0), ("wb.eventlog", 0)}



def test_a_batch_asks_every_shapes_target_at_once(conn, items, monkeypatch):
    """Whether each shape's plan brings only new keys is asked of every
    target together (two pipelined rounds for the batch, not two a shape); a
    table two entries write takes the stage's statements, which see what
    the first entry wrote."""
    from spark_consumer import statements

    others = [items_target(f"app.items{i}") for i in (2, 3)]
    for t in others:
        ensure_table(conn, t)
    rounds = []  # the queries of each round trip
    real_first_rows = statements._first_rows

    def first_rows(c, queries):
        if queries:
            rounds.append(len(queries))
        return real_first_rows(c, queries)

    monkeypatch.setattr(statements, "_first_rows", first_rows)
    batch = [(t, [part([change("c", 100 + i, id=i, off=0, topic=f"wb.{t.shape}")], topic=f"wb.{t.shape}")])
             for i, t in enumerate([items, *others], start=1)]
    res = apply_shapes(conn, GROUP, batch)
    assert res.total("upserted") == 3
    assert rounds == [3, 6]  # each table's facts; the range probes of each table and its tombstones
    assert [conn.execute(f"SELECT id FROM app.{t} ORDER BY id").fetchall() for t in ("items", "items2", "items3")] \
        == [[(1,)], [(2,)], [(3,)]]
    # Two entries writing one table: the second sees the first's row and wins only where it is newer.
    rounds.clear()
    res = apply_shapes(conn, GROUP, [(items, [part([change("c", 300, id=7, off=1, body="first")])]),
                                     (items, [part([change("c", 200, id=7, off=0, body="older")], topic="wb.other")])])
    assert (res.total("upserted"), res.total("stale")) == (1, 1)
    assert table_rows(conn, 'SELECT id, "body text" FROM app.items ORDER BY id') == [(1, None), (7, "first")]

# ------------------------------------------------------------------ backfills
def backfill_end(lsn, *, p, off, n=2, scope=None, bid="bf1", topic=TOPIC, shape="app.items"):
    r = change(None, lsn, 0, p=p, off=off, control="backfill_end", snap=bid, topic=topic)
    r["_wb_control_info"] = json.dumps({"backfill_id": bid, "shape": shape, "lsn": lsn, "partitions": n,
                                        "rows": 0, "scope": scope})
    return r


def scope_split(conn, ids, bucket_count=4, buckets=(0, 2)):
    """A scope on id, and which of ``ids`` are in it (by PostgreSQL's bucket hash)."""
    scope = {"columns": ["id"], "bucket_count": bucket_count, "buckets": list(buckets)}
    bucket = dict(conn.execute(sql.SQL("SELECT id, {} FROM unnest({}::int[]) AS q(id)").format(
        bucket_of(["id"], bucket_count), sql.Literal(list(ids)))).fetchall())  # no params: '%' in the SQL
    inside = {i for i in ids if bucket[i] in buckets}
    assert inside and inside != set(ids)
    return scope, inside


def ids(conn, where="TRUE"):
    return {r[0] for r in conn.execute(f"SELECT id FROM app.items WHERE {where}").fetchall()}


def test_null_position_rows_are_the_lowest(conn, items):
    # A table from an earlier version had NOT NULL positions: ensure_table relaxes them.
    conn.execute("ALTER TABLE app.items ALTER COLUMN _wb_lsn SET NOT NULL, ALTER COLUMN _wb_offset SET NOT NULL")
    ensure_table(conn, items)
    conn.execute("INSERT INTO app.items (id, \"body text\") VALUES (1, 'junk'), (2, 'junk'), (3, 'junk')")
    res = apply_batch(conn, GROUP, items, [part([
        change("r", 500, id=1, body="backfilled", snap="bf1", off=0),
        change("u", 510, id=2, body="updated", off=1), change("d", 520, id=3, off=2)], 0)])
    assert (res.total("upserted"), res.total("deleted"), res.total("tombstoned"), res.total("stale")) == (2, 1, 1, 0)
    assert conn.execute("SELECT id, \"body text\", _wb_lsn, _wb_op_index, _wb_partition, _wb_snapshot_id "
                        "FROM app.items ORDER BY id").fetchall() == [(1, "backfilled", 500, 0, 0, "bf1"),
                                                                     (2, "updated", 510, 0, 0, None)]
    # Keyless: a removal takes a NULL-position row too.
    t = log_target()
    ensure_table(conn, t)
    conn.execute("INSERT INTO eventlog (a, b) VALUES (1, 'x')")
    res = apply_batch(conn, GROUP, t, parts_from_rows([lchange("d", 100, off=0, a=1, b="x")]))
    assert res.total("deleted") == 1 and conn.execute("SELECT count(*) FROM eventlog").fetchone()[0] == 0


def test_scoped_backfill_end_cuts_its_partition_in_scope_only(conn, items):
    all_ids = range(1, 31)
    scope, inside = scope_split(conn, all_ids)
    p0, p1 = [i for i in all_ids if i <= 20], [i for i in all_ids if i > 20]
    apply_batch(conn, GROUP, items, [part([change("c", 100, i, id=i, body="old", off=i) for i in p0], 0),
                                     part([change("c", 100, i, id=i, body="old", p=1, off=i) for i in p1], 1)])
    gone = next(i for i in p0 if i in inside)
    apply_batch(conn, GROUP, items, [part([change("d", 150, id=gone, off=21)], 0)])  # tombstone in scope
    kept_tomb = next(i for i in p0 if i not in inside)
    apply_batch(conn, GROUP, items, [part([change("d", 160, id=kept_tomb, off=22)], 0)])  # out of scope
    rewritten = sorted(i for i in p0 if i in inside and i != gone)[:2]  # the backfill saw these
    late_in, late_out = max(i for i in p0 if i in inside), max(i for i in p0 if i not in inside)
    rows = [change("u", 300, id=late_out, body="below S, other key", off=23),  # must apply
            change("u", 310, id=late_in, body="below S, in scope", off=24),  # applied, then cut
            *[change("r", 500, id=i, body="backfilled", snap="bf1", off=25 + k) for k, i in enumerate(rewritten)],
            backfill_end(500, p=0, off=27, scope=scope),
            change("c", 600, id=99, body="after", off=28)]
    res = apply_batch(conn, GROUP, items, [part(rows, 0)])
    r0 = res.parts[(TOPIC, 0)]
    expected_p0 = ({i for i in p0 if i not in inside} - {kept_tomb}) | set(rewritten) | {99}
    assert ids(conn, "_wb_partition = 0") == expected_p0
    assert ids(conn, "_wb_partition = 1") == set(p1)  # other partitions untouched, in scope or not
    cut_away = {i for i in p0 if i in inside} - set(rewritten) - {gone}
    assert late_in in cut_away and late_out not in rewritten
    assert r0.truncated == len(cut_away) and r0.erased == 0 and r0.upserted == 2 + len(rewritten) + 1
    assert conn.execute(f"SELECT \"body text\" FROM app.items WHERE id = {late_out}").fetchone()[0] == \
        "below S, other key"
    assert {r[0] for r in conn.execute("SELECT id FROM app.items__wb_tombstones")} == {kept_tomb}
    assert r0.tombstones_dropped == 1
    # No floor: a later change below S of an out-of-scope key still applies.
    assert read_progress(conn, GROUP)[(TOPIC, 0)].floor is None
    res = apply_batch(conn, GROUP, items, [part([change("c", 200, id=98, off=29)], 0)])
    assert res.total("upserted") == 1 and res.total("erased") == 0
    [bf] = read_backfills(conn, GROUP)
    assert (bf["backfill_id"], bf["shape"], bf["start_lsn"], bf["partitions"], bf["partitions_done"], bf["scope"],
            bf["completed_at"]) == ("bf1", "app.items", 500, 2, [0], scope, None)
    assert res.backfills_completed == []


def test_backfill_end_on_every_partition_runs_the_final_gc(conn, items):
    scope, inside = scope_split(conn, range(1, 41))
    ins, outs = sorted(inside), sorted(set(range(1, 41)) - inside)
    apply_batch(conn, GROUP, items, [part([change("c", 100, id=ins[0], off=0), change("c", 100, id=outs[0], off=1)], 0),
                                     part([change("c", 100, id=ins[1], p=1, off=0)], 1)])
    # Junk written behind walbridge's back (no position), a row from a partition
    # the topic no longer has, a stray tombstone: in scope and out of it.
    conn.execute("INSERT INTO app.items (id, \"body text\") VALUES (%s, 'junk'), (%s, 'junk')", (ins[2], outs[1]))
    conn.execute("INSERT INTO app.items (id, _wb_lsn, _wb_op_index, _wb_partition, _wb_offset) VALUES "
                 "(%s, 50, 0, 7, 0)", (ins[3],))
    conn.execute("INSERT INTO app.items__wb_tombstones (id, _wb_lsn, _wb_op_index, _wb_partition, _wb_offset) "
                 "VALUES (%s, 60, 0, 7, 0), (%s, 60, 0, 7, 1)", (ins[4], outs[2]))
    res = apply_batch(conn, GROUP, items, [part([change("r", 500, id=ins[0], snap="bf1", off=2),
                                                 backfill_end(500, p=0, off=3, scope=scope)], 0)])
    assert res.backfills_completed == [] and ids(conn) == {ins[0], outs[0], ins[1], ins[2], outs[1], ins[3]}
    # The last partition: its cut, then the GC over every partition (NULL included).
    res = apply_batch(conn, GROUP, items, [part([backfill_end(500, p=1, off=1, scope=scope)], 1)])
    assert res.parts[(TOPIC, 1)].truncated == 1  # ins[1]: not rewritten by the backfill
    assert res.backfills_completed == [BackfillGC(TOPIC, "bf1", "app.items", 2, 1)]
    assert ids(conn) == {ins[0], outs[0], outs[1]}
    assert {r[0] for r in conn.execute("SELECT id FROM app.items__wb_tombstones")} == {outs[2]}
    [bf] = read_backfills(conn)
    assert bf["partitions_done"] == [0, 1] and bf["completed_at"] is not None
    assert (bf["gc_deleted"], bf["gc_tombstones"]) == (2, 1)
    # The backfill_end again (re-sent at a new offset; a replay is skipped by
    # progress anyway): recorded once, collected once.
    conn.execute("INSERT INTO app.items (id) VALUES (%s)", (ins[5],))
    res = apply_batch(conn, GROUP, items, [part([backfill_end(500, p=1, off=2, scope=scope)], 1)])
    assert res.backfills_completed == [] and ins[5] in ids(conn)
    assert read_backfills(conn, GROUP)[0]["partitions_done"] == [0, 1]
    assert read_backfills(conn, "other-group") == []


def test_unscoped_backfill_end_cuts_raises_floor_and_collects_everything(conn, items):
    apply_batch(conn, GROUP, items, [part([change("c", 100, id=1, off=0), change("c", 100, 1, id=2, off=1)], 0)])
    conn.execute("INSERT INTO app.items (id) VALUES (3)")  # no position, no partition
    res = apply_batch(conn, GROUP, items, [part([change("r", 500, id=1, snap="bf1", off=2),
                                                 change("c", 200, id=4, off=3),  # below the cut: erased
                                                 backfill_end(500, p=0, off=4, n=1)], 0)])
    assert res.parts[(TOPIC, 0)].truncated == 1 and res.parts[(TOPIC, 0)].erased == 1
    assert res.backfills_completed == [BackfillGC(TOPIC, "bf1", "app.items", 1, 0)]
    assert ids(conn) == {1} and read_progress(conn, GROUP)[(TOPIC, 0)].floor == (500, 0)


def test_keyless_scoped_backfill(conn):
    t = log_target()
    ensure_table(conn, t)
    rows = [(i, f"v{i}") for i in range(1, 21)]
    bucket = dict(conn.execute(sql.SQL("SELECT a, {} FROM unnest({}::int[], {}::text[]) AS q(a, b)").format(
        bucket_of(["a", "b"], 4), sql.Literal([a for a, _ in rows]), sql.Literal([b for _, b in rows]))).fetchall())
    scope = {"columns": ["a", "b"], "bucket_count": 4, "buckets": [1, 3]}
    inside = {a for a, _ in rows if bucket[a] in (1, 3)}
    assert inside and len(inside) < len(rows)
    apply_batch(conn, GROUP, t, parts_from_rows([lchange("c", 100, i, off=i, a=a, b=b) for i, (a, b) in enumerate(rows)]))
    junk_in, junk_out = min(inside), min(set(bucket) - inside)
    conn.execute("INSERT INTO eventlog (a, b) VALUES (%s, %s), (%s, %s)",  # behind walbridge's back
                 (junk_in, f"v{junk_in}", junk_out, f"v{junk_out}"))
    rewritten = sorted(inside)[:-1]  # the last in-scope row is gone at the source
    end = change(None, 500, 0, off=20 + len(rewritten), control="backfill_end", snap="bf1", topic="wb.eventlog")
    end["_wb_control_info"] = json.dumps({"backfill_id": "bf1", "shape": "eventlog", "lsn": 500, "partitions": 1,
                                          "rows": len(rewritten), "scope": scope})
    res = apply_batch(conn, GROUP, t, parts_from_rows(
        [lchange("r", 500, off=20 + k, a=a, b=f"v{a}", snap="bf1") for k, a in enumerate(rewritten)] + [end]))
    got = conn.execute("SELECT a, _wb_lsn FROM eventlog ORDER BY a, _wb_lsn NULLS LAST").fetchall()
    # The old in-scope copies are cut, the in-scope junk is collected, the rest stays.
    expected = sorted([(a, 100) for a, _ in rows if a not in inside] + [(a, 500) for a in rewritten]
                      + [(junk_out, None)], key=lambda r: (r[0], r[1] is None))
    assert got == expected
    assert res.parts[("wb.eventlog", 0)].truncated == len(inside)  # every old in-scope copy of partition 0
    [gc] = res.backfills_completed
    assert (gc.backfill_id, gc.shape, gc.gc_deleted, gc.gc_tombstones) == ("bf1", "eventlog", 1, 0)


def test_a_backfill_end_below_the_floor_is_still_recorded(conn, items):
    # A TRUNCATE during the backfill put p0's floor above the backfill's start.
    apply_batch(conn, GROUP, items, [part([change("t", 700, off=0)], 0)])
    res = apply_batch(conn, GROUP, items, [part([backfill_end(500, p=0, off=1, n=1)], 0)])
    assert res.backfills_completed == [BackfillGC(TOPIC, "bf1", "app.items", 0, 0)]
    assert read_progress(conn, GROUP)[(TOPIC, 0)].floor == (700, 0)
