"""Routing of decoded changes to shapes: filters, move-in/out, key changes, TOAST."""

from decimal import Decimal

from producer.pgoutput import UNCHANGED_TOAST, Column, Delete, Insert, Relation, Update
from producer.pgtypes import PgTypeInfo, column_codec
from producer.shapes import RelationPlan, ShapeSpec
from schemas.shape_filter import compile_filter

INT4 = PgTypeInfo(23, "integer", 23, "integer", -1, "b")
TEXT = PgTypeInfo(25, "text", 25, "text", -1, "b")
NUM = PgTypeInfo(1700, "numeric(10,2)", 1700, "numeric(10,2)", (10 << 16 | 2) + 4, "b")

REL = Relation(1, "public", "orders", "f", (
    Column("id", 23, -1, True), Column("region", 25, -1, False), Column("total", 1700, -1, False),
    Column("note", 25, -1, False)))
TYPES = {"id": "integer", "region": "text", "total": "numeric", "note": "text"}


def plan(*specs, identity_full=True):
    rel = REL if identity_full else Relation(1, "public", "orders", "d", REL.columns)
    return RelationPlan(rel, [column_codec(t) for t in (INT4, TEXT, NUM, TEXT)], ("id",), list(specs), "wb", "app")


ALL = ShapeSpec("public.orders", "wb.public.orders", None, None)
EU = ShapeSpec("eu", "wb.eu", ("id", "total"), compile_filter("region = 'eu'", TYPES))


def ops(events):
    return [(e.route.name, e.op, e.op_offset) for e in events]


def test_insert_goes_to_matching_shapes_only():
    p = plan(ALL, EU)
    ev = list(p.events(Insert(1, (b"1", b"us", b"10.00", b"x")), 0))
    assert ops(ev) == [("public.orders", "c", 0)]
    ev = list(p.events(Insert(1, (b"2", b"eu", b"10.00", b"x")), 3))
    assert ops(ev) == [("public.orders", "c", 3), ("eu", "c", 3)]
    assert ev[0].after == (2, "eu", Decimal("10.00"), "x")


def test_column_limited_shape_rows():
    p = plan(EU)
    (ev,) = p.events(Insert(1, (b"2", b"eu", b"10.00", b"x")), 0)
    assert ev.route.codec.row(ev.after) == {"id": 2, "total": Decimal("10.00"), "_wb_special": None}
    (ev,) = p.events(Insert(1, (b"3", b"eu", b"NaN", b"x")), 1)
    assert ev.route.codec.row(ev.after) == {"id": 3, "total": None, "_wb_special": '{"total":"NaN"}'}


def test_update_move_in_move_out_with_full_identity():
    p = plan(EU)
    move_in = Update(1, (b"1", b"us", b"1.00", b"x"), False, (b"1", b"eu", b"1.00", b"x"))
    move_out = Update(1, (b"1", b"eu", b"1.00", b"x"), False, (b"1", b"us", b"1.00", b"x"))
    stay_in = Update(1, (b"1", b"eu", b"1.00", b"x"), False, (b"1", b"eu", b"2.00", b"x"))
    stay_out = Update(1, (b"1", b"us", b"1.00", b"x"), False, (b"1", b"us", b"2.00", b"x"))
    assert [e.op for e in p.events(move_in, 0)] == ["c"]
    assert [e.op for e in p.events(move_out, 0)] == ["d"]
    assert [e.op for e in p.events(stay_in, 0)] == ["u"]
    assert list(p.events(stay_out, 0)) == []


def test_update_without_old_row_upserts_or_deletes():
    p = plan(EU, identity_full=False)
    assert [e.op for e in p.events(Update(1, None, False, (b"1", b"eu", b"1", b"x")), 0)] == ["u"]
    assert [e.op for e in p.events(Update(1, None, False, (b"1", b"us", b"1", b"x")), 0)] == ["d"]


def test_key_change_is_delete_then_insert_with_distinct_positions():
    p = plan(ALL, identity_full=False)
    upd = Update(1, (b"1", None, None, None), True, (b"9", b"eu", b"1.00", b"x"))
    ev = list(p.events(upd, 4))
    assert [(e.op, e.op_offset, e.key_values[0]) for e in ev] == [("d", 4, 1), ("c", 5, 9)]
    assert p.span(upd) == 2
    assert p.span(Update(1, None, False, (b"1", b"eu", b"1", b"x"))) == 1


def test_unchanged_toast_is_flagged_not_sent():
    p = plan(ALL, identity_full=False)
    (ev,) = p.events(Update(1, None, False, (b"1", b"eu", b"1.00", UNCHANGED_TOAST)), 0)
    assert ev.after[3] is None and ev.unchanged == (3,)
    env = ev.route.codec.envelope("u", None, ev.after, {}, 0, ev.unchanged)
    assert env["unchanged_toast"] == ["note"] and env["after"]["note"] is None


def test_filter_on_unchanged_toast_column_reads_current_value():
    on_note = ShapeSpec("n", "wb.n", None, compile_filter("note = 'x'", TYPES))
    p = plan(on_note, identity_full=False)
    change = Update(1, None, False, (b"1", b"eu", b"1", UNCHANGED_TOAST))
    # Unknown and no way to read it: not a match.
    assert [e.op for e in p.events(change, 0)] == ["d"]
    asked = []
    p.fetch_current = lambda rel, key, cols: asked.append((key, cols)) or {"note": "x"}
    (ev,) = p.events(change, 0)
    assert ev.op == "u" and ev.unchanged == (3,) and asked == [({"id": 1}, ["note"])]


def test_full_identity_fills_unchanged_toast_from_old_row():
    p = plan(ALL)
    (ev,) = p.events(Update(1, (b"1", b"eu", b"1.00", b"big"), False, (b"1", b"us", b"1.00", UNCHANGED_TOAST)), 0)
    assert ev.after == (1, "us", Decimal("1.00"), "big") and ev.unchanged == ()


def test_delete_with_key_only_goes_to_every_shape():
    p = plan(ALL, EU, identity_full=False)
    ev = list(p.events(Delete(1, (b"1", None, None, None), True), 2))
    assert ops(ev) == [("public.orders", "d", 2), ("eu", "d", 2)]


def test_delete_with_full_old_row_is_filtered():
    p = plan(ALL, EU)
    ev = list(p.events(Delete(1, (b"1", b"us", b"1.00", b"x"), False), 0))
    assert ops(ev) == [("public.orders", "d", 0)]


def test_a_partition_arriving_under_its_own_name_is_routed_in_its_roots_order():
    # An ATTACHed table may order its columns differently from the root; the
    # routed shape keeps the root's column order, key, writer schema and name.
    leaf = Relation(2, "public", "orders_2024", "d", (
        Column("note", 25, -1, False), Column("total", 1700, -1, False), Column("id", 23, -1, True),
        Column("region", 25, -1, False)))
    routed = ShapeSpec(ALL.name, ALL.topic, tuple(c.name for c in REL.columns), None, ("public", "orders"))
    leaf_plan = RelationPlan(leaf, [column_codec(t) for t in (TEXT, NUM, INT4, TEXT)], ("id",), [routed], "wb", "app")
    root_plan = plan(ALL)
    assert leaf_plan.routed and not root_plan.routed
    leaf_codec, root_codec = leaf_plan.routes[0].codec, root_plan.routes[0].codec
    assert leaf_codec.value_schema == root_codec.value_schema and leaf_codec.key_schema == root_codec.key_schema
    assert (leaf_codec.schema, leaf_codec.table) == ("public", "orders")
    (event,) = leaf_plan.events(Insert(2, (b"x", b"10.00", b"5", b"eu")), 0)
    assert leaf_codec.row(event.after) == root_codec.row((5, "eu", Decimal("10.00"), "x"))
    assert leaf_codec.encode_key(b"", event.key_values) == root_codec.encode_key(b"", (5, "eu", None, None))
