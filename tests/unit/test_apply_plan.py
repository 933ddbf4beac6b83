"""Apply planning (pure): highest position wins per key, TOAST merge, cuts,
keyless multiset semantics, replay filtering."""

from __future__ import annotations

import datetime
import json
from decimal import Decimal

import pytest

from producer.envelope import ShapeCodec, ShapeColumn
from producer.pgtypes import PgTypeInfo, column_codec
from spark_consumer import apply_plan
from spark_consumer.apply_plan import (
    APPEND,
    DELETE,
    REMOVE,
    UPSERT,
    OffsetResetError,
    PlanError,
    split_replayed,
)
from spark_consumer.decode import BEFORE_COLUMNS, BOOKKEEPING_NAMES
from spark_consumer.progress import Progress
from spark_consumer.shape_record import ShapeTarget, split_shape_name, tombstone_name

INT = PgTypeInfo(23, "integer", 23, "integer", -1, "b")
TEXT = PgTypeInfo(25, "text", 25, "text", -1, "b")
NUM = PgTypeInfo(1700, "numeric(10,2)", 1700, "numeric(10,2)", (10 << 16 | 2) + 4, "b")
DATE = PgTypeInfo(1082, "date", 1082, "date", -1, "b")
TOPIC = "wb.public.items"


def keyed_target() -> ShapeTarget:
    cols = [ShapeColumn("id", column_codec(INT), True), ShapeColumn("body text", column_codec(TEXT), False),
            ShapeColumn("n", column_codec(NUM), False), ShapeColumn("d", column_codec(DATE), False)]
    codec = ShapeCodec("public.items", "wb", "app", "public", "items", cols, [0, 1, 2, 3])
    return ShapeTarget.from_avro("public.items", codec.value_schema, codec.key_schema)


def keyless_target() -> ShapeTarget:
    cols = [ShapeColumn("a", column_codec(INT), False), ShapeColumn("b", column_codec(TEXT), False)]
    codec = ShapeCodec("log", "wb", "app", "public", "log", cols, [0, 1])
    return ShapeTarget.from_avro("log", codec.value_schema, codec.key_schema)


def row(op, lsn, idx=0, *, p=0, off=0, id=None, body=None, n=None, d=None, unchanged=None, special=None,
        control=None, snap=None, **extra):
    r = {"id": id, "body text": body, "n": n, "d": d, "_wb_op": op, "_wb_lsn": lsn, "_wb_op_index": idx,
         "_wb_topic": TOPIC, "_wb_partition": p, "_wb_offset": off, "_wb_unchanged": unchanged,
         "_wb_special": special, "_wb_control": control, "_wb_snapshot_id": snap, "_wb_ts_ms": 0}
    r.update(extra)
    return r


def lrow(op, lsn, idx=0, *, p=0, off=0, a=None, b=None, before=None):
    return {"a": a, "b": b, "_wb_op": op, "_wb_lsn": lsn, "_wb_op_index": idx, "_wb_topic": TOPIC,
            "_wb_partition": p, "_wb_offset": off, "_wb_unchanged": None, "_wb_special": None,
            "_wb_control": None, "_wb_snapshot_id": None, "_wb_ts_ms": 0, "_wb_before": before}


def as_tuples(target, rows):
    """Rows as the job hands them over: tuples in decode.py's column order."""
    fields = (*target.names, *BOOKKEEPING_NAMES, *BEFORE_COLUMNS)
    by_field = {c.name: c.field for c in target.columns}
    return fields, [tuple(r.get(f, r.get(by_field.get(f, f))) for f in fields) for r in rows]


def plan_tuples(target, rows, **kw):
    """plan_batch on the tuple form of ``rows`` (its controls are then dicts of every field)."""
    fields, tuples = as_tuples(target, rows)
    return apply_plan.plan_batch(target, tuples, fields=fields, **kw)


@pytest.fixture(params=["mappings", "tuples"], autouse=True)
def row_form(request, monkeypatch):
    """Every planner test runs on mapping rows and on the job's tuple rows."""
    if request.param == "tuples":
        monkeypatch.setitem(globals(), "plan_batch", plan_tuples)
    return request.param


plan_batch = apply_plan.plan_batch


def by_key(plan):
    return {r.values[0]: r for r in plan.rows}


def test_target_from_avro_schema():
    t = keyed_target()
    assert (t.schema, t.table) == ("public", "items")
    assert t.names == ("id", "body text", "n", "d") and t.key_columns == ("id",) and not t.keyless
    assert [c.sql_type for c in t.columns] == ["integer", "text", "numeric(10,2)", "date"]
    assert t.columns[1].field == "body_text"
    assert keyless_target().keyless and (keyless_target().schema, keyless_target().table) == ("public", "log")
    assert split_shape_name("sales.orders-eu") == ("sales", "orders-eu")
    assert split_shape_name("orders-eu") == ("public", "orders-eu")
    assert len(tombstone_name("x" * 60).encode()) <= 63


def test_highest_position_wins_whatever_the_order():
    t = keyed_target()
    rows = [row("u", 30, id=1, body="third", off=2), row("c", 10, id=1, body="first", off=0),
            row("u", 20, id=1, body="second", off=1), row("c", 10, 1, id=2, body="other", off=3)]
    plan = plan_batch(t, rows)
    got = by_key(plan)
    assert got[1].kind == UPSERT and got[1].values[1] == "third" and got[1].position == (30, 0)
    assert got[2].values[1] == "other"
    st = plan.stats[(TOPIC, 0)]
    assert (st.rows, st.planned, st.superseded) == (4, 2, 2)
    assert st.max_position == (30, 0) and st.max_offset == 3


def test_op_index_orders_within_a_transaction():
    plan = plan_batch(keyed_target(), [row("u", 10, 5, id=1, body="late"), row("u", 10, 2, id=1, body="early")])
    assert by_key(plan)[1].values[1] == "late"


def test_delete_wins_over_older_insert_and_reinsert_wins_over_delete():
    t = keyed_target()
    plan = plan_batch(t, [row("d", 20, id=1), row("c", 10, id=1, body="old")])
    assert by_key(plan)[1].kind == DELETE and by_key(plan)[1].position == (20, 0)
    plan = plan_batch(t, [row("c", 10, id=1, body="v1"), row("d", 20, id=1), row("c", 30, id=1, body="v2")])
    assert by_key(plan)[1].kind == UPSERT and by_key(plan)[1].values[1] == "v2"


def test_unchanged_toast_merged_from_earlier_change_in_batch():
    t = keyed_target()
    rows = [row("c", 10, id=1, body="big", n=Decimal("1.00")),
            row("u", 20, id=1, body=None, n=Decimal("2.00"), unchanged=["body text"])]
    got = by_key(plan_batch(t, rows))[1]
    assert got.values[1] == "big" and got.values[2] == Decimal("2.00") and got.keep == ()


def test_unchanged_toast_without_source_is_kept_from_target():
    t = keyed_target()
    got = by_key(plan_batch(t, [row("u", 20, id=1, n=Decimal("2.00"), unchanged=["body text"])]))[1]
    assert got.keep == ("body text",) and got.values[1] is None
    # Also by Avro field name, and not across a delete.
    rows = [row("c", 5, id=1, body="gone"), row("d", 6, id=1), row("c", 7, id=1, body="new"),
            row("u", 8, id=1, unchanged=["body_text"]), row("u", 9, id=1, unchanged=["body_text"])]
    got = by_key(plan_batch(t, rows))[1]
    assert got.values[1] == "new" and got.keep == ()
    rows = [row("c", 5, id=1, body="gone"), row("d", 6, id=1), row("u", 9, id=1, unchanged=["body text"])]
    assert by_key(plan_batch(t, rows))[1].keep == ("body text",)


def test_special_values_replace_typed_value():
    t = keyed_target()
    got = by_key(plan_batch(t, [row("c", 1, id=1, special={"n": "NaN", "d": "infinity"})]))[1]
    assert got.values[2] == "NaN" and got.values[3] == "infinity"
    # Arrow maps arrive as lists of pairs.
    got = by_key(plan_batch(t, [row("c", 1, id=1, special=[("d", "-infinity")])]))[1]
    assert got.values[3] == "-infinity"
    with pytest.raises(PlanError):
        plan_batch(t, [row("c", 1, id=1, special={"nope": "x"})])


def test_truncate_erases_older_changes_of_its_partition_only():
    t = keyed_target()
    rows = [row("c", 10, id=1, p=0, off=0), row("c", 11, id=2, p=1, off=0),
            row("t", 20, p=0, off=1), row("t", 20, p=1, off=1),
            row("c", 30, id=3, p=0, off=2), row("c", 15, id=4, p=2, off=0)]
    plan = plan_batch(t, rows)
    assert set(by_key(plan)) == {3, 4}  # partition 2 has not seen its truncate yet
    assert {p: c.position for p, c in plan.cuts.items()} == {0: (20, 0), 1: (20, 0)}
    assert plan.stats[(TOPIC, 0)].erased == 1 and plan.stats[(TOPIC, 0)].truncates == 1


def test_floor_drops_changes_below_an_earlier_cut():
    plan = plan_batch(keyed_target(), [row("c", 10, id=1, p=0), row("c", 10, id=2, p=1)], floors={0: (20, 0)})
    assert set(by_key(plan)) == {2} and plan.stats[(TOPIC, 0)].below_floor == 1


def test_gc_controls_cut_and_controls_returned():
    t = keyed_target()
    rows = [row("r", 50, id=1, snap="s1", off=0), row(None, 50, control="snapshot_end", snap="s1", off=1),
            row(None, 60, control="custom", off=2), row(None, None, control="dlq", off=3)]
    plan = plan_batch(t, rows)
    assert plan.cuts[0].position == (50, 0) and plan.cuts[0].reason == "snapshot_end"
    assert [c["_wb_control"] for c in plan.controls] == ["snapshot_end", "custom"]
    assert by_key(plan)[1].snapshot_id == "s1"  # same position as the cut: not erased
    st = plan.stats[(TOPIC, 0)]
    assert (st.control, st.dlq, st.planned) == (2, 1, 1)
    assert plan_batch(t, rows, gc_controls=()).cuts == {}


def test_snapshot_rows_sharing_a_position_are_all_kept():
    rows = [row("r", 50, id=i, off=i, snap="s") for i in range(5)]
    assert len(plan_batch(keyed_target(), rows).rows) == 5


def test_a_change_committed_at_the_snapshot_point_outranks_the_snapshot_row():
    # A commit record that begins exactly at the slot's consistent point is
    # streamed (it is not in the snapshot) at the snapshot's own position:
    # whatever the offsets, the change is the newer.
    t = keyed_target()
    snapshot, change = row("r", 50, id=1, body="snapshot", off=9, snap="s"), row("u", 50, id=1, body="change", off=3)
    for rows in ([snapshot, change], [change, snapshot]):
        got = by_key(plan_batch(t, rows))[1]
        assert got.values[1] == "change" and got.position == (50, 0)
    # The same rule at equal positions for a keyless update of a snapshot row.
    snap_row = lrow("r", 50, a=1, b="old", off=9)
    snap_row["_wb_snapshot_id"] = "s"
    plan = plan_batch(keyless_target(), [snap_row, lrow("u", 50, a=1, b="new", before={"a": 1, "b": "old"}, off=3)])
    assert [(r.kind, r.values) for r in plan.rows] == [(APPEND, (1, "new"))]


def test_keyless_appends_and_removals():
    t = keyless_target()
    rows = [lrow("c", 10, a=1, b="x", off=0), lrow("c", 11, a=1, b="x", p=1, off=0),
            lrow("d", 12, a=1, b="x", off=1),  # cancels one pending append (any partition)
            lrow("d", 13, a=9, b="old", off=2),  # removes a target row
            lrow("u", 14, a=2, b="new", before={"a": 2, "b": "old"}, off=3)]
    plan = plan_batch(t, rows)
    appends = [r.values for r in plan.rows if r.kind == APPEND]
    removes = [r.values for r in plan.rows if r.kind == REMOVE]
    assert sorted(appends) == [(1, "x"), (2, "new")]
    assert removes == [(9, "old"), (2, "old")]
    total = sum(s.planned + s.superseded for s in plan.stats.values())
    assert total == 5


def test_keyless_pairs_off_leaves_every_append_and_removal_to_the_target():
    rows = [lrow("c", 10, a=1, b="x", off=0), lrow("d", 12, a=1, b="x", off=1)]
    plan = plan_batch(keyless_target(), rows, keyless_pairs=False)
    assert [(r.kind, r.values, r.position) for r in plan.rows] == [(APPEND, (1, "x"), (10, 0)),
                                                                   (REMOVE, (1, "x"), (12, 0))]


def test_a_keyless_update_without_an_old_row_only_appends():
    # Written while the table had a key (the producer re-reads a table that loses it): no row to remove.
    plan = plan_batch(keyless_target(), [lrow("u", 14, a=2, b="new")])
    assert [(r.kind, r.values) for r in plan.rows] == [(APPEND, (2, "new"))]
    assert sum(s.planned for s in plan.stats.values()) == 1


def test_keyless_update_removes_the_old_row_with_its_special_values():
    # The old row's NaN/infinity travel as text in _wb_before_special (its
    # struct holds null there); the removal must match the row that holds them.
    cols = [ShapeColumn("a", column_codec(INT), False), ShapeColumn("n", column_codec(NUM), False)]
    t = ShapeTarget.from_avro("m", ShapeCodec("m", "wb", "app", "public", "m", cols, [0, 1]).value_schema, None)
    u = lrow("u", 14, before={"a": 2, "n": None}, off=3)
    del u["b"]
    u.update(n=Decimal("1.5"), _wb_before_special=[("n", "NaN")])
    plan = plan_batch(t, [u])
    assert {r.kind: r.values for r in plan.rows} == {REMOVE: (2, "NaN"), APPEND: (None, Decimal("1.5"))}


def test_keyless_removal_does_not_cancel_a_later_append():
    t = keyless_target()
    plan = plan_batch(t, [lrow("d", 10, a=1, b="x", off=0), lrow("c", 11, a=1, b="x", off=1)])
    assert sorted(r.kind for r in plan.rows) == [APPEND, REMOVE]


def test_replay_filter_by_offset_and_reset_detection():
    rows = [row("c", 10 + i, id=i, off=i) for i in range(6)]
    todo, skipped, reset = split_replayed(rows, Progress(3, (12, 0)))
    assert [r["_wb_offset"] for r in todo] == [3, 4, 5] and skipped == 3 and not reset
    assert split_replayed(rows, None)[1] == 0
    with pytest.raises(OffsetResetError):
        split_replayed(rows, Progress(3, (5, 0)))
    todo, skipped, reset = split_replayed(rows, Progress(3, (5, 0)), on_offset_reset="follow")
    assert len(todo) == 6 and reset


def test_null_key_and_unknown_op_are_errors():
    with pytest.raises(PlanError):
        plan_batch(keyed_target(), [row("c", 1, id=None)])
    with pytest.raises(PlanError):
        plan_batch(keyed_target(), [row("x", 1, id=1)])
    with pytest.raises(PlanError):
        plan_batch(keyed_target(), [row(None, 1, id=1)])


def test_values_are_passed_through_untouched():
    ts = datetime.date(2024, 2, 29)
    got = by_key(plan_batch(keyed_target(), [row("c", 1, id=1, d=ts, n=Decimal("1.50"))]))[1]
    assert got.values == (1, None, Decimal("1.50"), ts)


def test_composite_keys():
    cols = [ShapeColumn("tenant", column_codec(TEXT), True), ShapeColumn("id", column_codec(INT), True),
            ShapeColumn("v", column_codec(TEXT), False)]
    codec = ShapeCodec("s.t", "wb", "app", "s", "t", cols, [0, 1, 2])
    t = ShapeTarget.from_avro("s.t", codec.value_schema, codec.key_schema)
    assert t.key_columns == ("tenant", "id")
    mk = lambda op, lsn, tenant, id, v=None, off=0: {"tenant": tenant, "id": id, "v": v, "_wb_op": op, "_wb_lsn": lsn,
                                                      "_wb_op_index": 0, "_wb_topic": TOPIC, "_wb_partition": 0,
                                                      "_wb_offset": off}
    plan = plan_batch(t, [mk("c", 1, "a", 1, "x"), mk("c", 1, "b", 1, "y", 1), mk("u", 2, "a", 1, "z", 2)])
    assert sorted((r.values, r.kind) for r in plan.rows) == [(("a", 1, "z"), UPSERT), (("b", 1, "y"), UPSERT)]
    with pytest.raises(PlanError, match="null key"):
        plan_batch(t, [mk("c", 1, "a", None)])


def test_keyless_insert_only_batch_keeps_every_row():
    t = keyless_target()
    rows = [lrow("c", 10 + i, a=1, b="same", p=i % 2, off=i) for i in range(6)]
    plan = plan_batch(t, rows)
    assert plan.count(APPEND) == 6 and all(s.planned == 3 for s in plan.stats.values())


# ------------------------------------------------------------------ backfills
SCOPE = {"columns": ["id"], "bucket_count": 8, "buckets": [1, 5]}


def backfill_end(lsn, *, p=0, off=0, scope=None, bid="bf1", partitions=2, info=True):
    info_json = json.dumps({"backfill_id": bid, "shape": "public.items", "lsn": lsn, "partitions": partitions,
                            "rows": 3, "scope": scope}) if info else None
    return row(None, lsn, 0, p=p, off=off, control="backfill_end", snap=bid, _wb_control_info=info_json)


def test_scoped_backfill_end_erases_nothing_and_is_no_floor_cut():
    t = keyed_target()
    rows = [row("c", 100, id=1, off=0), row("u", 200, id=2, off=1),  # below S: other keys' changes must apply
            row("r", 500, id=3, snap="bf1", off=2), backfill_end(500, off=3, scope=SCOPE),
            row("c", 90, id=4, p=1, off=0)]
    plan = plan_batch(t, rows)
    assert set(by_key(plan)) == {1, 2, 3, 4}
    assert plan.cuts == {}  # so no limit on the partition, and no floor for progress
    [cut] = plan.scoped_cuts
    assert (cut.partition, cut.position, cut.offset, cut.reason) == (0, (500, 0), 3, "backfill_end")
    assert cut.scope == SCOPE and cut.backfill_id == "bf1" and cut.info["partitions"] == 2
    assert plan.backfill_ends == [cut]
    st = plan.stats[(TOPIC, 0)]
    assert (st.rows, st.erased, st.below_floor, st.control, st.planned) == (4, 0, 0, 1, 3)
    assert [c["_wb_control"] for c in plan.controls] == ["backfill_end"]
    # Scoped cuts do not count towards the floor either: an earlier floor still erases.
    plan = plan_batch(t, rows, floors={0: (150, 0)})
    assert set(by_key(plan)) == {2, 3, 4} and plan.stats[(TOPIC, 0)].below_floor == 1


def test_unscoped_backfill_end_is_a_floor_cut_and_a_backfill_end():
    t = keyed_target()
    rows = [row("c", 100, id=1, off=0), row("r", 500, id=3, snap="bf1", off=1), backfill_end(500, off=2),
            row("c", 600, id=5, off=3)]
    plan = plan_batch(t, rows)
    assert set(by_key(plan)) == {3, 5} and plan.stats[(TOPIC, 0)].erased == 1
    assert plan.cuts[0].position == (500, 0) and plan.cuts[0].scope is None and plan.scoped_cuts == []
    assert plan.backfill_ends == [plan.cuts[0]]
    # A later TRUNCATE is the partition's floor cut; the backfill_end is still reported.
    plan = plan_batch(t, rows + [row("t", 700, off=4)])
    assert plan.cuts[0].reason == "t" and [c.offset for c in plan.backfill_ends] == [2]
    # Without info (an older producer): a plain cut, no backfill to record.
    plan = plan_batch(t, [row("c", 100, id=1, off=0), backfill_end(500, off=1, info=False)])
    assert plan.cuts[0].position == (500, 0) and plan.backfill_ends == [] and by_key(plan) == {}
    # Not a GC control: neither a cut nor a backfill_end.
    plan = plan_batch(t, [row("c", 100, id=1), backfill_end(500, off=1, scope=SCOPE)], gc_controls={"snapshot_end"})
    assert (plan.cuts, plan.scoped_cuts, plan.backfill_ends) == ({}, [], []) and set(by_key(plan)) == {1}


def test_backfill_end_info_must_be_readable():
    t = keyed_target()
    bad = backfill_end(500, scope=SCOPE)
    with pytest.raises(PlanError, match="not JSON"):
        plan_batch(t, [dict(bad, _wb_control_info="{nope")])
    with pytest.raises(PlanError, match="scope"):
        plan_batch(t, [backfill_end(500, scope={"columns": ["id"], "buckets": [1]})])
    with pytest.raises(PlanError, match="key columns"):  # tombstones hold the key only
        plan_batch(t, [backfill_end(500, scope=dict(SCOPE, columns=["n"]))])
    with pytest.raises(PlanError, match="partition count"):
        plan_batch(t, [backfill_end(500, partitions=0)])
    # Keyless shapes bucket by every row column.
    plan = plan_batch(keyless_target(), [lrow("c", 100, a=1, b="x"), dict(
        backfill_end(500, off=1, scope={"columns": ["a", "b"], "bucket_count": 4, "buckets": [0]}),
        a=None, b=None)])
    assert plan.count(APPEND) == 1 and plan.cuts == {} and plan.scoped_cuts[0].scope["columns"] == ["a", "b"]


def test_tuple_rows_plan_like_mappings_in_any_field_order():
    """The job's form (tuples named by a fields list, decode.py's order) and
    other field orders plan exactly what the mapping rows plan."""
    t = keyed_target()
    rows = [row("c", 10, id=1, body="big", n=Decimal("1.00"), off=0),
            row("u", 20, id=1, n=Decimal("2.00"), unchanged=["body text"], off=1),
            row("u", 21, id=2, unchanged=["body text"], special={"d": "infinity"}, off=2),
            row("t", 5, p=1, off=0), row("c", 4, id=3, p=1, off=1), row("c", 6, id=4, p=1, off=2),
            row(None, 9, control="snapshot_end", snap="s1", off=3), row(None, None, control="dlq", off=4),
            backfill_end(40, p=2, off=0, scope=SCOPE), row("d", 41, id=5, p=2, off=1)]
    want = apply_plan.plan_batch(t, rows, floors={2: (1, 0)})
    fields, tuples = as_tuples(t, rows)
    for order in (fields, tuple(reversed(fields))):
        lay = [tuple(dict(zip(fields, r))[f] for f in order) for r in tuples]
        got = apply_plan.plan_batch(t, iter(lay), fields=order, floors={2: (1, 0)})
        assert got.stage_rows == want.stage_rows and got.stats == want.stats and got.cuts == want.cuts
        assert (got.keep_sets, got.scoped_cuts, got.backfill_ends) == (want.keep_sets, want.scoped_cuts,
                                                                       want.backfill_ends)
        assert [(c["_wb_control"], c["_wb_offset"], c["_wb_snapshot_id"]) for c in got.controls] == [
            (c["_wb_control"], c["_wb_offset"], c["_wb_snapshot_id"]) for c in want.controls]
    assert by_key(want)[2].values[3] == "infinity" and by_key(want)[2].keep == ("body text",)
    with pytest.raises(PlanError, match="_wb_offset"):
        apply_plan.plan_batch(t, [(1, 2)], fields=("id", "_wb_partition"))


def test_replay_filter_on_tuple_rows():
    t = keyed_target()
    fields, rows = as_tuples(t, [row("c", 10 + i, id=i, off=i) for i in range(6)])
    off = fields.index("_wb_offset")
    todo, skipped, reset = split_replayed(rows, Progress(3, (12, 0)), fields=fields)
    assert [r[off] for r in todo] == [3, 4, 5] and skipped == 3 and not reset
    with pytest.raises(OffsetResetError):
        split_replayed(rows, Progress(3, (5, 0)), fields=fields)
    assert split_replayed(rows, Progress(3, (5, 0)), on_offset_reset="follow", fields=fields)[2]
