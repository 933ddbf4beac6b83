"""Routing of decoded changes to shapes: filters, move-in/out, key changes, TOAST."""

from decimal import Decimal

from producer.pgoutput import UNCHANGED_TOAST, Column, Delete, Insert, Relation, Update
from producer.pgtypes import PgTypeInfo, column_codec
from producer.shapes import RelationPlan, ShapeSpec, StreamTx, change_messages, truncate_messages
from schemas import wire
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


def test_a_key_change_s_messages_name_the_other_key_and_the_delete_is_followed_by_its_tombstone():
    """The reference path's messages (``change_messages``): each at its own
    position, Debezium's key headers on the two halves, the tombstone after
    the delete on the old key's partition."""
    p = plan(ALL)
    change = Update(1, (b"1", b"eu", b"1.00", b"x"), False, (b"2", b"eu", b"1.00", b"x"))
    tx = StreamTx(lsn=0x5000, xid=7, ts_ms=1_700_000_000_000, seen_ms=1_700_000_000_100)
    messages = list(change_messages(p, change, 4, tx, 0x4F00, {"wb.public.orders": 3}, tombstones=True))
    (w_del, k_del, v_del, h_del, op_del, s_del), (w_tomb, k_tomb, v_tomb, h_tomb, op_tomb, s_tomb), \
        (w_new, k_new, v_new, h_new, op_new, s_new) = messages
    codec = p.routes[0].codec
    assert (s_del, s_tomb, s_new) == (("public.orders", "d"), None, ("public.orders", "c"))
    assert (op_del, op_tomb, op_new) == (4, 4, 5)
    assert w_tomb == w_del and k_tomb == k_del and v_tomb is None
    assert h_del == [(wire.POSITION_HEADER, wire.position_header(0x5000, 4)),
                     (wire.NEW_KEY_HEADER, k_new)]
    assert h_tomb == [(wire.POSITION_HEADER, wire.position_header(0x5000, 4))]
    assert h_new == [(wire.POSITION_HEADER, wire.position_header(0x5000, 5)), (wire.OLD_KEY_HEADER, k_del)]
    assert k_del == codec.encode_key(codec.key_prefix, (1,)) and v_del and v_new
    assert list(tx.sources) == ["public.orders"]  # the source block encoded once for the transaction


def test_a_truncate_reaches_every_partition_at_one_position():
    p = plan(ALL)
    tx = StreamTx(lsn=0x5000, xid=7, ts_ms=1, seen_ms=2)
    messages = list(truncate_messages(p.routes[0], tx, 3, 0x4F00, 3, b"KEY", ts_ms=9))
    assert [m[0] for m in messages] == [("wb.public.orders", n) for n in range(3)]
    assert {(m[1], m[2], m[4], m[5]) for m in messages} == {(b"KEY", messages[0][2], 3, None)}
    assert messages[0][3] == [(wire.POSITION_HEADER, wire.position_header(0x5000, 3))]
