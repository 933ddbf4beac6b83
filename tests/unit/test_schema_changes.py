"""Schema changes on the consumer side, pure parts: the raw rows of Spark's
Kafka source, the per-batch decode that notices a new writer schema, and the
target DDL a new schema plans (issue 12)."""

from __future__ import annotations

import pickle
from dataclasses import replace

import pyarrow as pa
import pytest
from psycopg import sql

from schemas import wire
from spark_consumer.batch_split import decode_batches, raw_messages
from spark_consumer.shape_schemas import ShapeSchemas, ShapeSource, writer_schemas_for
from spark_consumer.target_ddl import ExistingColumn, WantedColumn, plan_changes, widens
from tests.unit.test_spark_decode import TOPIC, Shape, _col, pos

# ------------------------------------------------------------ raw rows
# The columns of Spark's Kafka source, as Arrow hands them to mapInArrow.
RAW_ARROW = pa.schema([("topic", pa.string()), ("partition", pa.int32()), ("offset", pa.int64()),
                       ("key", pa.binary()), ("value", pa.binary()),
                       ("headers", pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())])))])


def raw_batch(topic: str, partition: int, messages) -> pa.RecordBatch:
    """(offset, key, value, headers) messages as one raw record batch."""
    rows = [{"topic": topic, "partition": partition, "offset": o, "key": k, "value": v,
             "headers": None if h is None else [{"key": n, "value": hv} for n, hv in h]} for o, k, v, h in messages]
    return pa.RecordBatch.from_pylist(rows, schema=RAW_ARROW)


def test_raw_messages_give_back_every_message_as_read_also_from_a_slice():
    messages = [(10, b"k1", b"v1", [("wb.pos", b"\x00" * 16), ("x", None)]),
                (11, None, None, None),
                (12, b"k3", b"v3", [("wb.control", b"snapshot_end")])]
    batch = raw_batch(TOPIC, 3, messages)
    assert list(raw_messages(batch)) == [(TOPIC, 3, *m) for m in messages]
    assert list(raw_messages(batch.slice(1))) == [(TOPIC, 3, *m) for m in messages[1:]]


# ---------------------------------------------------- per-batch decoding
OLD = [_col("id", 20, "bigint", key=True), _col("v", 23, "integer")]
NEW = [_col("id", 20, "bigint", key=True), _col("v", 20, "bigint"), _col("note", 25, "text")]


def _raw(*messages) -> list:
    return [raw_batch(TOPIC, 0, messages)]


def _schemas(*shapes: Shape) -> ShapeSchemas:
    newest = shapes[-1]
    every = {f"fp:{fp.hex()}": s for shape in shapes for fp, s in shape.schemas.items()}
    return ShapeSchemas(newest.codec.value_schema, newest.codec.key_schema,
                        tuple(f"fp:{wire.schema_fingerprint(s.codec.value_schema).hex()}" for s in shapes), every)


SRC = ShapeSource(topic=TOPIC, bootstrap_servers="127.0.0.1:1", topic_prefix="wb")


def test_a_batch_with_a_value_schema_the_layout_lacks_is_marked_for_decoding_again():
    old, new = Shape(OLD), Shape(NEW)
    batch = _raw((0, None, old.value("c", after=(1, 5)), pos(1)),
                 (1, None, new.value("c", after=(2, 2 ** 40, "n")), pos(2)),
                 (2, None, old.value("c", after=(3, 7)), pos(3)))
    [marked] = decode_batches(SRC, _schemas(old), iter(batch))
    assert marked.num_rows == 1  # the rows before it are dropped: the whole batch is decoded again
    [row] = marked.to_pylist()
    assert row["_wb_control"] == wire.NEW_SCHEMA_CONTROL and row["_wb_offset"] == 1
    assert "which the layout was not derived with" in row["_wb_error"]

    # With the schemas learned again, the same batch decodes into the new layout, older rows by name.
    [decoded] = decode_batches(SRC, _schemas(old, new), iter(batch))
    assert [(r["id"], r["v"], r["note"]) for r in decoded.to_pylist()] == [(1, 5, None), (2, 2 ** 40, "n"),
                                                                          (3, 7, None)]


def test_an_unknown_schema_that_only_drops_columns_is_also_learned():
    """A DROP COLUMN must reach the target too (keep nullable, or drop)."""
    old, narrower = Shape(OLD), Shape(OLD[:1])
    batch = _raw((0, None, narrower.value("c", after=(1,)), pos(1)))
    [marked] = decode_batches(SRC, _schemas(old), iter(batch))
    assert marked.to_pylist()[0]["_wb_control"] == wire.NEW_SCHEMA_CONTROL
    # Learned, the narrower schema is the layout: the dropped column is gone from it.
    [typed] = decode_batches(SRC, _schemas(old, narrower), iter(batch))
    assert typed.to_pylist()[0]["id"] == 1 and "v" not in typed.schema.names


def test_a_schema_nobody_published_is_learned_once_then_its_messages_are_dead_letters(monkeypatch):
    """A ref the driver's discovery does not find either is no new schema:
    marked once (with its ref), then undecodable (the DLQ's), the batch's
    other rows decoded."""
    old = Shape(OLD)
    ghost = wire.single_object_prefix(b"\x07" * 8) + old.value("c", after=(2, 2))[10:]
    batch = _raw((0, None, old.value("c", after=(1, 5)), pos(1)), (1, None, ghost, pos(2)))
    [marked] = decode_batches(SRC, _schemas(old), iter(batch))
    [row] = marked.to_pylist()
    assert row["_wb_control"] == wire.NEW_SCHEMA_CONTROL and row["_wb_control_info"] == "fp:" + "07" * 8
    sent = []

    def not_published(self, data):
        raise ValueError("the schemas topic holds no schema with this fingerprint")

    monkeypatch.setattr("spark_consumer.shape_schemas.SchemaResolver.raw_schema", not_published)
    monkeypatch.setattr("spark_consumer.batch_split.DeadLetters.send", lambda self, *a: sent.append(a[:3]))
    monkeypatch.setattr("spark_consumer.batch_split.DeadLetters.flush", lambda self: None)
    learned = replace(_schemas(old), unpublished=(row["_wb_control_info"],))
    [decoded] = decode_batches(SRC, learned, iter(batch))
    assert [(r["id"], r["_wb_control"]) for r in decoded.to_pylist()] == [(1, None), (None, "dlq")]
    assert sent == [(TOPIC, 0, 1)]


# -------------------------------------------------------------- target DDL
T = sql.Identifier("public", "t")
TOMB = sql.Identifier("public", "t__wb_tombstones")


def _plan(existing, key, wanted, on_dropped="keep", constraint="t_pkey"):
    steps = plan_changes(T, TOMB, [ExistingColumn(*c) for c in existing], key, constraint,
                         [WantedColumn(*c) for c in wanted], on_dropped)
    return [(s.kind, s.text(), s.fallback.as_string() if s.fallback else None, bool(s.fatal)) for s in steps]


def test_same_columns_plan_nothing():
    cols = [("id", "bigint", True), ("v", "text")]
    assert _plan(cols, ["id"], [("id", "bigint", True), ("v", "text")]) == []


def test_added_column_is_added_nullable():
    assert _plan([("id", "bigint", True)], ["id"], [("id", "bigint", True), ("note", "character varying(20)")]) == [
        ("add", 'ALTER TABLE "public"."t" ADD COLUMN "note" character varying(20)', None, False)]


def test_dropped_column_is_kept_nullable_or_dropped_as_configured():
    existing = [("id", "bigint", True), ("gone", "integer", True), ("also", "text", False)]
    assert _plan(existing, ["id"], [("id", "bigint", True)]) == [
        ("relax", 'ALTER TABLE "public"."t" ALTER COLUMN "gone" DROP NOT NULL', None, False)]
    assert _plan(existing, ["id"], [("id", "bigint", True)], on_dropped="drop") == [
        ("drop", 'ALTER TABLE "public"."t" DROP COLUMN "gone"', None, False),
        ("drop", 'ALTER TABLE "public"."t" DROP COLUMN "also"', None, False)]


@pytest.mark.parametrize("old, new", [
    ("integer", "bigint"), ("smallint", "integer"), ("integer", "numeric"), ("real", "double precision"),
    ("character varying(10)", "text"), ("character varying(10)", "character varying(20)"),
    ("character varying(10)", "character varying"), ("numeric(10,2)", "numeric(12,2)"),
    ("numeric(10,2)", "numeric(12,3)"), ("numeric(10,2)", "numeric"), ("integer", "text"),
    ("timestamp without time zone", "timestamp with time zone"),
])
def test_widenings(old, new):
    assert widens(old, new)


@pytest.mark.parametrize("old, new", [
    ("bigint", "integer"), ("text", "integer"), ("character varying(20)", "character varying(10)"),
    ("numeric(12,2)", "numeric(10,2)"), ("numeric(10,2)", "numeric(10,3)"), ("numeric", "numeric(10,2)"),
    ("timestamp with time zone", "timestamp without time zone"), ("double precision", "real"),
])
def test_not_widenings(old, new):
    assert not widens(old, new)


def test_widened_type_keeps_the_values_and_the_key_column_follows_in_the_tombstones():
    assert _plan([("id", "integer", True), ("v", "integer")], ["id"], [("id", "bigint", True), ("v", "bigint")]) == [
        ("widen", 'ALTER TABLE "public"."t" ALTER COLUMN "id" TYPE bigint', None, False),
        ("widen", 'ALTER TABLE "public"."t__wb_tombstones" ALTER COLUMN "id" TYPE bigint', None, False),
        ("widen", 'ALTER TABLE "public"."t" ALTER COLUMN "v" TYPE bigint', None, False)]


def test_other_retypes_cast_and_fall_back_to_null_but_a_key_column_stops_the_shape():
    steps = _plan([("id", "text", True), ("v", "text")], ["id"], [("id", "integer", True), ("v", "integer")])
    assert steps[0] == ("retype", 'ALTER TABLE "public"."t" ALTER COLUMN "id" TYPE integer USING "id"::integer',
                        None, True)
    assert steps[1][:2] == ("retype", 'ALTER TABLE "public"."t__wb_tombstones" ALTER COLUMN "id" TYPE integer '
                                      'USING "id"::integer')
    assert steps[2] == ("retype", 'ALTER TABLE "public"."t" ALTER COLUMN "v" TYPE integer USING "v"::integer',
                        'ALTER TABLE "public"."t" ALTER COLUMN "v" TYPE integer USING NULL', False)


def test_an_aliased_field_renames_the_column_before_anything_compares_names():
    steps = _plan([("id", "integer", True), ("old_name", "integer")], ["id"],
                  [("id", "integer", True), ("new_name", "bigint", False, ("old_name",))])
    assert steps == [
        ("rename", 'ALTER TABLE "public"."t" RENAME COLUMN "old_name" TO "new_name"', None, False),
        ("widen", 'ALTER TABLE "public"."t" ALTER COLUMN "new_name" TYPE bigint', None, False)]
    # done once: the target already has the new name
    assert _plan([("id", "integer", True), ("new_name", "bigint")], ["id"],
                 [("id", "integer", True), ("new_name", "bigint", False, ("old_name",))]) == []
    # a renamed key column is renamed in the tombstones too
    assert _plan([("k", "integer", True)], ["k"], [("key", "integer", True, ("k",))]) == [
        ("rename", 'ALTER TABLE "public"."t" RENAME COLUMN "k" TO "key"', None, False),
        ("rename", 'ALTER TABLE "public"."t__wb_tombstones" RENAME COLUMN "k" TO "key"', None, False)]


def test_an_alias_naming_a_column_still_wanted_is_no_rename():
    assert [s[0] for s in _plan([("id", "integer", True), ("a", "integer")], ["id"],
                                [("id", "integer", True), ("a", "integer"), ("b", "integer", False, ("a",))])] == [
        "add"]


def test_a_changed_key_swaps_the_primary_key_and_a_lost_key_goes_keyless():
    existing = [("id", "integer", True), ("code", "text", True)]
    assert _plan(existing, ["id"], [("id", "integer"), ("code", "text", True)]) == [
        ("drop_key", 'ALTER TABLE "public"."t" DROP CONSTRAINT "t_pkey"', None, False),
        ("relax", 'ALTER TABLE "public"."t" ALTER COLUMN "id" DROP NOT NULL', None, False),
        ("add_key", 'ALTER TABLE "public"."t" ADD PRIMARY KEY ("code")', None, False)]
    assert [s[0] for s in _plan(existing, ["id"], [("id", "integer"), ("code", "text")])] == [
        "drop_key", "relax", "relax", "keyless"]


def test_older_messages_of_a_renamed_column_land_in_it_by_its_alias():
    """The producer marks a rename with Avro aliases: a batch that still holds
    messages written before it decodes their values into the new column (not
    NULL over the target's value), fastavro and the compiled reader alike."""
    import copy

    from spark_consumer.decode import BatchBuilder, ShapeLayout, WriterSchemas, row_record

    old = Shape([_col("id", 20, "bigint", key=True), _col("v", 25, "text")])
    renamed = Shape([_col("id", 20, "bigint", key=True), _col("w", 25, "text")])
    value_schema = copy.deepcopy(renamed.codec.value_schema)
    [field] = [f for f in row_record(value_schema)["fields"] if f["name"] == "w"]
    field["aliases"] = ["v"]
    layout = ShapeLayout.from_schemas(value_schema, renamed.codec.key_schema)
    for compiled in (True, False):
        b = BatchBuilder(layout, WriterSchemas(layout, old.lookup, old.known(), compiled=compiled))
        b.add(TOPIC, 0, 0, None, old.value("c", after=(1, "five")), pos(1))
        b.add(TOPIC, 0, 1, None, old.value("u", after=(1, None), unchanged=[1]), pos(2))
        rows = b.rows()
        assert [(r["id"], r["w"]) for r in rows] == [(1, "five"), (1, None)]
        assert rows[1]["_wb_unchanged"] == ["w"]


def test_on_dropped_column_is_validated():
    from schemas.config import ConfigError, parse_config
    from tests.helpers import make_config

    def config(value):
        return parse_config(make_config("postgresql://u@127.0.0.1:1/x", "127.0.0.1:1", "wb", [{"table": "a.b"}],
                                        consumer={"on_dropped_column": value}))

    assert config("drop").consumer.on_dropped_column == "drop"
    with pytest.raises(ConfigError, match="consumer.on_dropped_column"):
        config("purge")


def test_a_worker_reads_with_the_same_writer_schemas_while_the_shape_and_its_schemas_are_the_same():
    """Each task unpickles the shapes anew: equal content finds the cache, a
    changed schema set does not."""
    old, new = Shape(OLD), Shape(NEW)
    first = writer_schemas_for(SRC, _schemas(old))
    assert writer_schemas_for(pickle.loads(pickle.dumps(SRC)), pickle.loads(pickle.dumps(_schemas(old)))) is first
    assert writer_schemas_for(SRC, _schemas(old, new)) is not first
    assert writer_schemas_for(replace(SRC, topic_prefix="other"), _schemas(old)) is not first
