"""The lakehouse targets' pure parts: the progress a commit carries, the
stage's Arrow layout, what a cut or a completed backfill removes, an Iceberg
catalog's settings. (Their MERGEs run on real Spark, Delta and Iceberg in
tests/integration/test_delta_target.py and test_iceberg_target.py.)"""

from __future__ import annotations

import dataclasses
import datetime
import math
import struct
import threading
from decimal import Decimal

import pytest
from pyspark.sql.types import (
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    StructField,
)

from producer.envelope import ShapeCodec, ShapeColumn
from producer.pgtypes import PgTypeInfo, column_codec
from schemas import wire
from schemas.config import IcebergConfig
from spark_consumer.apply_plan import make_cut, plan_batch
from spark_consumer.batch import PartResult
from spark_consumer.lake_progress import LakeProgress, backfill_ends_applied
from spark_consumer.progress import Progress
from spark_consumer.shape_record import ShapeTarget
from spark_consumer.target_layout import ShapeCannotFollow
from spark_consumer.targets.base import ShapeBatch
from spark_consumer.targets.delta import needs_mapping
from spark_consumer.targets.iceberg import spark_settings as iceberg_settings
from spark_consumer.targets.lake import SHAPES_AT_ONCE, LakeTarget
from spark_consumer.targets.merge_sql import (
    BOOKKEEPING,
    STAGE_HEAD,
    TAKE,
    equal_rows,
    follow_changes,
    gc_condition,
    kept_columns,
    keyless_table_merge,
    marked_rows,
    pending_merge,
    shape_fields,
    special_values,
    stage_table,
    table_merge,
    tombstones_merge,
    widens,
)
from tests.unit.test_apply_plan import INT, keyed_target, keyless_target, lrow, row
from walbridge.check import FAILED, Checklist, _lake, render_checks
from walbridge.verify_lake import as_float32, comparable, same_value, sqlalchemy_url


def test_a_commits_progress_reads_back_for_its_group_only():
    progress = {0: Progress(12, (100, 2), None, "id-a"), 2: Progress(5, None, (90, 0), None)}
    text = LakeProgress("wb.public.items", progress, {"b1": [80, 3, [0], False]}).to_json("g1")
    assert LakeProgress.from_json(text, "g1") == LakeProgress("wb.public.items", progress, {"b1": [80, 3, [0], False]})
    assert LakeProgress.from_json(text, "g2") is None
    assert LakeProgress.from_json("written by someone else", "g1") is None
    assert LakeProgress.from_json(None, "g1") is None
    counted = LakeProgress("t", progress, commits=7)
    assert LakeProgress.from_json(counted.to_json("g1"), "g1").commits == 7


def test_a_backfill_completes_once_when_its_end_reached_every_partition():
    def end(p):
        return make_cut(p, 500, 0, 9, wire.BACKFILL_END, {"backfill_id": "b1", "lsn": 400, "partitions": 2})

    backfills, completed = backfill_ends_applied({}, [end(0)])
    assert backfills == {"b1": [400, 2, [0], False]} and completed == []
    backfills, completed = backfill_ends_applied(backfills, [end(1), end(0)])
    assert backfills["b1"][3] and completed == [400]
    assert backfill_ends_applied(backfills, [end(1)]) == (backfills, [])  # a replayed end: nothing again
    assert LakeProgress("t", {}, backfills).complete("b1") and not LakeProgress("t").complete("b1")


def test_the_stage_is_typed_by_the_shapes_columns_then_the_bookkeeping():
    target = keyed_target()
    plan = plan_batch(target, [row("c", 10, off=0, id=1, body="a", n=Decimal("1.50"), d=datetime.date(2026, 1, 2)),
                               row("d", 11, off=1, id=2)])
    table = stage_table(target, plan)
    assert table.column_names[:4] == ["id", "body text", "n", "d"]
    # No row keeps a column: no keep column.
    assert table.column_names[4:] == [wire.KIND_COLUMN] + [f.name for f in BOOKKEEPING]
    assert str(table.schema.field("n").type) == "decimal128(10, 2)"
    by_id = {r["id"]: r for r in table.to_pylist()}
    assert by_id[1]["n"] == Decimal("1.50") and by_id[1]["_wb_kind"] == "u" and by_id[2]["_wb_kind"] == "d"
    kept = plan_batch(target, [row("u", 12, off=2, id=3, n=Decimal("2.00"), unchanged=["body text"]),
                               row("c", 13, off=3, id=4, body="b")])
    assert kept_columns(kept) == ["body text"]
    table = stage_table(target, kept)
    assert table.column_names[4:] == [f.name for f in STAGE_HEAD + BOOKKEEPING]
    assert {r["id"]: r[wire.KEEP_COLUMN] for r in table.to_pylist()} == {3: ["body text"], 4: None}


def test_a_lean_stage_drops_what_a_streamed_upsert_only_batch_does_not_need_and_the_merge_reads_only_that():
    target = keyed_target()
    streamed = plan_batch(target, [row("c", 10, off=0, id=1, body="a"), row("u", 11, off=1, id=2, body="b")])
    lean = stage_table(target, streamed, lean=True)
    assert lean.column_names == list(target.names) + [
        f.name for f in BOOKKEEPING if f.name not in (wire.SNAPSHOT_ID_COLUMN, wire.OFFSET_COLUMN)]
    assert stage_table(target, streamed).column_names[4] == wire.KIND_COLUMN  # not lean: all of it
    merge = table_merge(target, "t_ref", None, "stage", [], stage_columns=lean.column_names)
    assert wire.KIND_COLUMN not in merge
    assert not any(ref in merge for c in (wire.SNAPSHOT_ID_COLUMN, wire.OFFSET_COLUMN) for ref in (f"s.{c}", f"s.`{c}`"))
    assert "THEN DELETE" not in merge and "'s', true) THEN UPDATE" in merge
    assert merge.count("CAST(NULL AS STRING)") == 2  # the snapshot id updated and inserted as NULL
    assert merge.count("CAST(NULL AS BIGINT)") == 2  # and so the offset
    # A delete keeps the kind, a snapshot row its id: each column goes only where no row needs it.
    mixed = plan_batch(target, [row("d", 12, off=2, id=3), row("r", 9, off=3, id=4, snap="s1")])
    assert stage_table(target, mixed, lean=True).column_names == stage_table(target, mixed).column_names
    full = table_merge(target, "t_ref", None, "stage", [], stage_columns=stage_table(target, mixed).column_names)
    assert full == table_merge(target, "t_ref", None, "stage", [])
    # A keyed table keeps the offset of a snapshot row only (what tells a snapshot's rows apart).
    assert full.count("CASE WHEN s.`_wb_snapshot_id` IS NOT NULL THEN s.`_wb_offset` END") == 2
    with pytest.raises(ValueError, match="whole stage"):
        table_merge(target, "t_ref", "tomb_ref", "stage", [], stage_columns=lean.column_names)


def test_special_values_become_floats_or_hold_the_shape():
    target = keyed_target()
    plan = plan_batch(target, [row("c", 10, off=0, id=1, special={"d": "infinity"})])
    with pytest.raises(ShapeCannotFollow, match="'infinity'.*date"):
        stage_table(target, plan)
    floats = special_values(StructField("x", DoubleType()), ["NaN", "-Infinity", 1.0])
    assert math.isnan(floats[0]) and floats[1:] == [float("-inf"), 1.0]


def test_special_floats_are_staged_as_floats_and_a_text_where_arrow_would_take_it_as_bytes_is_refused():
    float8 = PgTypeInfo(701, "double precision", 701, "double precision", -1, "b")
    bytea = PgTypeInfo(17, "bytea", 17, "bytea", -1, "b")
    cols = [ShapeColumn("id", column_codec(INT), True), ShapeColumn("x", column_codec(float8), False),
            ShapeColumn("b", column_codec(bytea), False)]
    codec = ShapeCodec("public.m", "wb", "app", "public", "m", cols, [0, 1, 2])
    target = ShapeTarget.from_avro("public.m", codec.value_schema, codec.key_schema)
    plan = plan_batch(target, [row("c", 10, off=0, id=1, x=1.5, b=b"\x00"),
                               row("c", 11, off=1, id=2, special={"x": "-Infinity"})])
    by_id = {r["id"]: r for r in stage_table(target, plan).to_pylist()}
    assert by_id[1]["x"] == 1.5 and by_id[1]["b"] == b"\x00" and by_id[2]["x"] == float("-inf")
    with pytest.raises(ShapeCannotFollow, match="'oops'.*binary"):
        stage_table(target, plan_batch(target, [row("c", 12, off=2, id=3, special={"b": "oops"})]))


def test_a_cut_removes_its_partitions_rows_below_it_and_a_completed_backfill_everything_below_its_start():
    assert gc_condition({}, [], "t") is None
    cond = gc_condition({1: (50, 3)}, [40], "t")
    assert "t._wb_partition = 1" in cond and "50L" in cond and "'o', 3L" in cond and "40L" in cond
    merge = table_merge(keyed_target(), "delta.`/lake/t`", "delta.`/lake/_walbridge/tombstones/t`", "stage", ["n"],
                        {1: (50, 3)})
    assert "WHEN NOT MATCHED BY SOURCE AND" in merge and "array_contains(s._wb_keep, 'n')" in merge
    tombstones = tombstones_merge(keyed_target(), "delta.`/lake/_walbridge/tombstones/t`", "stage", {1: (50, 3)})
    assert "d._wb_partition = 1" in tombstones and "t._wb" not in tombstones


def test_only_names_delta_cannot_hold_plainly_need_column_mapping():
    assert needs_mapping("body text") and needs_mapping("a,b") and not needs_mapping("abalance")


def test_check_config_says_whether_the_lake_folder_can_be_written(tmp_path):
    checks = Checklist()
    _lake(str(tmp_path / "lake" / "cdc"), checks)
    (tmp_path / "file").write_text("")
    _lake(str(tmp_path / "file" / "cdc"), checks)
    _lake("s3a://bucket/cdc", checks)
    assert [c.state == FAILED for c in checks] == [False, True, False]
    assert f"will be created in {tmp_path}" in render_checks(checks)


def test_lake_verify_compares_nan_lists_and_reals_as_delta_holds_them():
    assert same_value(float("nan"), float("nan")) and same_value([1, [2.0]], (1, (2.0,)))
    assert not same_value([1], [1, 2])
    assert as_float32((1, 0.1, None), [1, 2]) == (1, struct.unpack("f", struct.pack("f", 0.1))[0], None)


def test_a_table_follows_renames_drops_retypes_additions_and_key_changes_and_refuses_key_retypes():
    target = keyed_target()
    wanted = shape_fields(target)
    have = [f for f in wanted if f.name != "d"] + [StructField("gone", DoubleType())]
    steps = follow_changes(target, have, wanted, ("id",), "keep")
    assert [f.name for f in steps.added] == ["d"] and not steps.problems and not steps.dropped  # "gone" is kept
    assert follow_changes(target, have, wanted, ("id",), "drop").dropped == ["gone"]
    renamed = dataclasses.replace(target, columns=tuple(
        dataclasses.replace(c, name="day", aliases=("d",)) if c.name == "d" else c for c in target.columns))
    steps = follow_changes(renamed, wanted, shape_fields(renamed), ("id",), "drop")
    assert (steps.renamed, steps.dropped, steps.added, steps.problems) == ([("d", "day")], [], [], [])
    rekeyed = dataclasses.replace(target, columns=tuple(
        dataclasses.replace(c, name="ident", aliases=("id",)) if c.name == "id" else c for c in target.columns))
    steps = follow_changes(rekeyed, wanted, shape_fields(rekeyed), ("id",), "keep")
    assert steps.renamed == [("id", "ident")] and not steps.problems  # a renamed key is the same key
    narrower = [StructField(f.name, DecimalType(8, 2)) if f.name == "n" else f for f in wanted]
    assert [(f.name, f.dataType) for f in follow_changes(target, narrower, wanted, ("id",), "keep").widened] == [
        ("n", DecimalType(10, 2))]
    retyped = [StructField(f.name, DoubleType()) if f.name == "n" else f for f in wanted]
    steps = follow_changes(target, retyped, wanted, ("id",), "keep")
    assert [f.name for f in steps.retyped] == ["n"] and not steps.widened and not steps.problems
    rekeyed_type = [StructField(f.name, StringType()) if f.name == "id" else f for f in wanted]
    assert follow_changes(target, rekeyed_type, wanted, ("id",), "keep").problems == [
        "key column 'id' is string in the table, int in the shape"]
    steps = follow_changes(target, wanted, wanted, ("n",), "keep")
    assert steps.rekeyed and not steps.problems and steps
    assert not follow_changes(target, wanted, wanted, ("id",), "keep")


def test_only_widenings_every_value_survives_are_followed_in_place():
    assert widens(IntegerType(), LongType()) and widens(ShortType(), IntegerType())
    assert widens(FloatType(), DoubleType()) and widens(DecimalType(10, 2), DecimalType(12, 2))
    assert not widens(LongType(), IntegerType()) and not widens(DecimalType(10, 2), DecimalType(12, 3))
    assert not widens(IntegerType(), DoubleType()) and not widens(IntegerType(), StringType())


def test_a_keyless_batchs_takes_are_stage_rows_that_carry_only_the_taken_rows_bookkeeping():
    target = keyless_target()
    stage = stage_table(target, plan_batch(target, [lrow("c", 10, a=1, b="x"), lrow("d", 11, a=2, b="y", off=1)]))
    marks = [(5, 0, 1, 9, None), (50, 0, 0, 3, "snap-1")]
    takes = marked_rows(stage.schema, TAKE, marks, [f.name for f in BOOKKEEPING])
    assert takes.schema == stage.schema and takes.num_rows == 2
    rows = takes.to_pylist()
    assert [r["_wb_kind"] for r in rows] == [TAKE, TAKE] and rows[1]["_wb_snapshot_id"] == "snap-1"
    assert rows[0]["a"] is None and rows[0]["_wb_offset"] == 9 and wire.KEEP_COLUMN not in rows[0]
    assert marked_rows(stage.schema, TAKE, [], ["_wb_lsn"]).num_rows == 0


def test_a_keyless_merge_joins_on_position_so_a_snapshots_rows_never_meet_each_other():
    merge = keyless_table_merge(keyless_target(), "delta.`/lake/log`", "src", {0: (7, 1)})
    on = merge.split("\n")[0]
    # Equi-join terms (no OR at the top of the condition): position, and offset for snapshot rows.
    assert "t._wb_lsn = CASE" in on and "t._wb_op_index = s._wb_op_index" in on
    assert "CASE WHEN t._wb_snapshot_id IS NULL THEN -1L ELSE t._wb_offset END" in on
    assert "WHEN NOT MATCHED BY SOURCE AND" in merge and f"s._wb_kind = '{TAKE}' THEN DELETE" in merge


def test_keyless_verify_compares_rows_as_a_multiset_with_nan_equal_to_nan():
    rows = [(1, float("nan"), [1, 2]), (1, float("nan"), [1, 2])]
    assert len({comparable(r) for r in rows}) == 1


def test_an_iceberg_catalog_becomes_spark_settings_without_naming_its_password_elsewhere():
    jdbc = IcebergConfig(catalog="jdbc", warehouse="/wh", catalog_dsn="postgresql://ice:s3cret@db:6432/cat",
                         name="lakecat")
    settings = iceberg_settings(jdbc)
    assert settings["spark.sql.catalog.lakecat"] == "org.apache.iceberg.spark.SparkCatalog"
    assert settings["spark.sql.catalog.lakecat.uri"] == "jdbc:postgresql://db:6432/cat"
    assert settings["spark.sql.catalog.lakecat.jdbc.user"] == "ice"
    assert settings["spark.sql.catalog.lakecat.jdbc.password"] == "s3cret"
    assert settings["spark.sql.catalog.lakecat.warehouse"] == "file:///wh"
    assert "IcebergSparkSessionExtensions" in settings["spark.sql.extensions"]
    hadoop = iceberg_settings(IcebergConfig(warehouse="s3a://bucket/wh"))
    assert hadoop["spark.sql.catalog.walbridge.type"] == "hadoop"
    assert hadoop["spark.sql.catalog.walbridge.warehouse"] == "s3a://bucket/wh"
    assert "s3cret" not in repr(jdbc)
    assert sqlalchemy_url(jdbc.catalog_dsn) == "postgresql+psycopg://ice:s3cret@db:6432/cat"


def test_keyless_pairing_reads_equal_rows_by_content_and_keeps_what_each_removal_took():
    target = keyless_target()
    q = equal_rows(target, "delta.`/lake/log`", None, "stage", "x", ["_wb_partition"])
    assert q.startswith("SELECT to_json(struct(CAST(x.`a` AS int) AS `a`, CAST(x.`b` AS string) AS `b`), "
                        "map('timestampFormat', 'yyyy-MM-dd HH:mm:ss.SSSSSS', ")
    assert "LEFT SEMI JOIN (SELECT * FROM stage WHERE _wb_kind = 'x') y ON x.`a` <=> y.`a` AND x.`b` <=> y.`b`" in q
    assert "JOIN" not in equal_rows(target, "stage", "x", None, None, ["_wb_seq"], changes_only=True)
    merge = pending_merge(target, "delta.`/lake/log__wb_tombstones`", "src")
    assert ("WHEN MATCHED AND s._wb_kind = 'm' THEN UPDATE SET `_wb_took_lsn` = s.`_wb_took_lsn`, "
            "`_wb_took_op_index` = s.`_wb_took_op_index`, `_wb_took_streamed` = s.`_wb_took_streamed`") in merge
    assert "`_wb_offset`, `_wb_took_lsn`, `_wb_took_op_index`, `_wb_took_streamed`) VALUES" in merge


class _Conf:
    def __init__(self):
        self.values = {}

    def set(self, key, value):
        self.values[key] = value


class _Session:
    """What a lake target asks of its Spark session here: new sessions, settings."""

    def __init__(self):
        self.conf = _Conf()

    def newSession(self):
        return _Session()


class _Shapes(LakeTarget):
    """A lake target whose shapes wait for each other at a barrier: their
    apply returns only if they run side by side."""

    def __init__(self, side_by_side: int):
        super().__init__(_Session(), "fake")
        self.set_conf("walbridge.test", "on")
        self.barrier = threading.Barrier(side_by_side, timeout=30)
        self.sessions = {}

    def _apply_shape(self, group, b, result, on_offset_reset):
        self.sessions[b.topic] = self.spark
        if b.topic.startswith("held"):
            raise ShapeCannotFollow(f"{b.topic} cannot follow")
        self.barrier.wait()
        if b.topic.startswith("bad"):
            raise RuntimeError(f"{b.topic} failed")
        result.parts[(b.topic, 0)] = PartResult(b.topic, 0, 0, 1, rows=1)

    def _keep_up(self):
        pass


def test_a_batchs_shapes_are_applied_side_by_side_each_in_a_session_of_its_own_and_a_held_one_is_left_out():
    assert SHAPES_AT_ONCE >= 3
    lake = _Shapes(side_by_side=2)
    held = []
    batches = [ShapeBatch(topic, keyed_target(), []) for topic in ("a", "held", "b")]
    result = lake.apply("g", batches, on_offset_reset="raise", hold=lambda topic, why: held.append((topic, why)))
    assert sorted(result.parts) == [("a", 0), ("b", 0)] and held == [("held", "held cannot follow")]
    sessions = [lake.sessions[t] for t in ("a", "held", "b")]
    # a and b met at the barrier: two threads at once, two sessions (a thread keeps its session).
    assert sessions[0] is not sessions[2] and all(s is not lake._main for s in sessions)
    assert all(s.conf.values["walbridge.test"] == "on" for s in sessions)  # each has the target's settings
    assert lake.spark is lake._main  # the calling thread keeps the target's session
    # One shape: on the calling thread, in the target's session.
    lake.barrier = threading.Barrier(1)
    assert list(lake.apply("g", batches[:1], on_offset_reset="raise", hold=None).parts) == [("a", 0)]
    assert lake.sessions["a"] is lake._main
    lake.close()


def test_a_shapes_error_goes_up_only_when_every_shape_of_the_batch_has_returned():
    lake = _Shapes(side_by_side=3)
    batches = [ShapeBatch(topic, keyed_target(), []) for topic in ("bad", "a", "b")]
    with pytest.raises(RuntimeError, match="bad failed"):
        lake.apply("g", batches, on_offset_reset="raise", hold=None)
    assert set(lake.sessions) == {"bad", "a", "b"} and lake.barrier.n_waiting == 0  # the others ran to the end
    lake.close()
