"""A restarted producer's schema comparison (producer.schema_changes.from_published / resumed):
the table's first Relation of a run resumed from its slot against what its shapes last published."""

import uuid

from producer import schema_changes as sc
from producer.envelope import ShapeColumn, key_schema, value_schema
from producer.pgtypes import ColumnCodec
from producer.schema_changes import CatalogFacts, ColumnFacts, ShapeRef
from schemas.publisher import SchemaPublisher

TYPES = {sc.INT2: "smallint", sc.INT4: "integer", sc.INT8: "bigint", sc.TEXT: "text", sc.NUMERIC: "numeric"}
CODECS = {sc.INT2: ColumnCodec("int", False, int, "smallint"), sc.INT4: ColumnCodec("int", False, int, "integer"),
          sc.INT8: ColumnCodec("long", False, int, "bigint"), sc.TEXT: ColumnCodec("string", False, str, "text"),
          sc.NUMERIC: ColumnCodec("string", False, str, "numeric")}


def type_name(oid, typmod):
    return TYPES[oid]


def col(attnum, name, type_oid=sc.INT4, typmod=-1, missing=False, default=False):
    return ColumnFacts(attnum, name, type_oid, typmod, missing, default)


def catalog(*columns, key=("id",)):
    return CatalogFacts("public", "t", tuple(columns), key, "d")


def published(cat: CatalogFacts, columns=None, attnums=True):
    """The (value, key) schemas a shape carrying ``columns`` (None: all) of ``cat`` published."""
    shape_cols = [ShapeColumn(c.name, CODECS[c.type_oid], c.name in cat.key, (),
                              c.attnum if attnums else None, c.type_oid if attnums else 0, c.typmod)
                  for c in cat.columns if columns is None or c.name in columns]
    return value_schema("wb.db.t", shape_cols), key_schema("wb.db.t", shape_cols)


def relation(cat: CatalogFacts, message=None):
    cols = message if message is not None else [(c.name, c.type_oid, c.typmod) for c in cat.columns]
    return sc.shape_of("public", "t", [(n, t, m, TYPES[t]) for n, t, m in cols], cat.key, "d", cat)


def resumed(before, after, shapes=((None, ()),), attnums=True, message=None):
    """Changes seen by a restart: ``shapes`` (columns, filter columns) published ``before``; the table is now ``after``."""
    seed = sc.from_published([published(before, cols, attnums) for cols, _ in shapes], type_name, "d")
    carried = None if any(cols is None for cols, _ in shapes) else frozenset(c for cols, _ in shapes for c in cols)
    filtered = frozenset(c for _, f in shapes for c in f)
    return sc.resumed(seed, relation(after, message), after, carried, filtered)


def kinds(changes):
    return [(c.kind, c.column) for c in changes]


BASE = catalog(col(1, "id"), col(2, "a"), col(3, "b", sc.TEXT))


def test_published_fields_carry_attnum_type_oid_and_typmod():
    value, key = published(BASE)
    row = value["fields"][0]["type"][1]["fields"]
    assert [(f["name"], f["pg.attnum"], f["pg.type_oid"], f["pg.typmod"]) for f in row] == [
        ("id", 1, sc.INT4, -1), ("a", 2, sc.INT4, -1), ("b", 3, sc.TEXT, -1)]
    assert [f["name"] for f in key["fields"]] == ["id"]


def test_read_back_from_published_schemas_is_confirmed_and_exact():
    seed = sc.from_published([published(BASE)], type_name, "d")
    assert seed.confirmed and seed.key == ("id",)
    assert [(c.name, c.attnum, c.type_oid, c.type_name) for c in seed.columns] == [
        ("id", 1, sc.INT4, "integer"), ("a", 2, sc.INT4, "integer"), ("b", 3, sc.TEXT, "text")]
    assert sc.from_published([], type_name, "d") is None


def test_nothing_changed_while_stopped_is_no_change():
    assert resumed(BASE, BASE) == []


def test_column_added_with_a_default_while_stopped_rereads():
    after = catalog(*BASE.columns, col(4, "c", missing=True, default=True))
    changes = resumed(BASE, after)
    assert kinds(changes) == [(sc.ADDED_CONSTANT_DEFAULT, "c")]
    out = sc.consequences(changes, [ShapeRef("s", None)], "public.t", ("id",))
    assert list(out.reread) == ["s"] and not out.stop


def test_plain_column_added_while_stopped_needs_no_reread():
    changes = resumed(BASE, catalog(*BASE.columns, col(4, "c")))
    assert kinds(changes) == [(sc.ADDED, "c")]
    assert not sc.consequences(changes, [ShapeRef("s", None)], "public.t", ("id",)).reread


def test_rename_while_stopped_is_exact_by_attnum():
    after = catalog(col(1, "id"), col(2, "a2"), col(3, "b", sc.TEXT))
    changes = resumed(BASE, after)
    assert kinds(changes) == [(sc.RENAMED, "a2")]
    out = sc.consequences(changes, [ShapeRef("s", None)], "public.t", ("id",))
    assert out.aliases == {"a2": ("a",)} and not out.reread and not out.stop


def test_narrowing_retype_while_stopped_rereads_widening_does_not():
    narrowed = resumed(BASE, catalog(col(1, "id"), col(2, "a", sc.INT2), col(3, "b", sc.TEXT)))
    assert [(c.kind, c.column, c.was, c.now) for c in narrowed] == [(sc.RETYPED, "a", "integer", "smallint")]
    widened = resumed(BASE, catalog(col(1, "id"), col(2, "a", sc.INT8), col(3, "b", sc.TEXT)))
    assert kinds(widened) == [(sc.RETYPED_WIDENING, "a")]
    shapes = [ShapeRef("s", None)]
    assert sc.consequences(narrowed, shapes, "public.t", ("id",)).reread
    assert not sc.consequences(widened, shapes, "public.t", ("id",)).reread


def test_key_changed_while_stopped_is_read_from_the_key_schema():
    after = catalog(*BASE.columns, key=("id", "a"))
    changes = resumed(BASE, after)
    assert kinds(changes) == [(sc.KEY_CHANGED, None)]
    assert sc.consequences(changes, [ShapeRef("s", None)], "public.t", ("id", "a")).reread


def test_where_column_dropped_while_stopped_stops_the_shape():
    after = catalog(col(1, "id"), col(3, "b", sc.TEXT))
    changes = resumed(BASE, after)
    assert kinds(changes) == [(sc.DROPPED, "a")]
    out = sc.consequences(changes, [ShapeRef("eu", None, frozenset({"a"})), ShapeRef("all", None)], "public.t",
                          ("id",))
    assert "column a of public.t was dropped" in out.stop["eu"] and "all" not in out.stop


def test_schemas_published_before_attnums_are_unconfirmed_and_reread_every_shape():
    after = catalog(col(1, "id"), col(2, "a2"), col(3, "b", sc.TEXT))
    changes = resumed(BASE, after, attnums=False)
    # Without attnums a rename can only look like a drop and a column in doubt; never a silent add.
    assert kinds(changes) == [(sc.IN_DOUBT, "a2"), (sc.DROPPED, "a"), (sc.UNCONFIRMED, None)]
    out = sc.consequences(resumed(BASE, BASE, attnums=False), [ShapeRef("s", ("id", "b"))], "public.t", ("id",))
    assert list(out.reread) == ["s"]


def test_unconfirmed_columns_compare_by_type_name():
    changes = resumed(BASE, catalog(col(1, "id"), col(2, "a", sc.INT8), col(3, "b", sc.TEXT)), attnums=False)
    assert kinds(changes) == [(sc.RETYPED, "a"), (sc.UNCONFIRMED, None)]


def test_columns_no_shape_carries_are_not_compared():
    after = catalog(col(1, "id"), col(2, "a", sc.INT2), col(3, "b", sc.TEXT), col(4, "c", missing=True))
    assert resumed(BASE, after, shapes=((("id", "b"), ()),)) == []


def test_a_column_only_filtered_on_was_never_published_so_its_shape_is_reread():
    changes = resumed(BASE, BASE, shapes=((("id", "b"), ("a",)),))
    assert kinds(changes) == [(sc.UNPUBLISHED, "a")]
    out = sc.consequences(changes, [ShapeRef("eu", ("id", "b"), frozenset({"a"})), ShapeRef("ids", ("id",))],
                          "public.t", ("id",))
    assert list(out.reread) == ["eu"]


def test_shapes_published_later_win_per_column():
    older, newer = published(BASE), published(catalog(col(1, "id"), col(2, "a", sc.INT8), col(3, "b", sc.TEXT)))
    seed = sc.from_published([older, newer], type_name, "d")
    assert {c.name: c.type_oid for c in seed.columns} == {"id": sc.INT4, "a": sc.INT8, "b": sc.TEXT}


def test_a_relation_older_than_what_was_published_is_not_taken_for_a_drop():
    """The last run published the added column, but the slot resumes before the
    ADD COLUMN: the replayed Relation lacks it while the catalog still has it."""
    now = catalog(*BASE.columns, col(4, "c"))
    assert resumed(now, now, message=[("id", sc.INT4, -1), ("a", sc.INT4, -1), ("b", sc.TEXT, -1)]) == []


def test_latest_published_schemas_from_the_registry():
    """``SchemaPublisher.latest`` with a (mock) registry: each topic's newest value and key schemas, in
    registration order; a topic that never published is absent."""
    publisher = SchemaPublisher(None, "wb", {"url": f"mock://resume-{uuid.uuid4().hex[:8]}"})
    first, key = published(BASE)
    wider, _ = published(catalog(col(1, "id"), col(2, "a", sc.INT8), col(3, "b", sc.TEXT)))
    publisher.prefix("wb.t", first)
    publisher.prefix("wb.t", key, is_key=True)
    publisher.prefix("wb.t", wider)
    publisher.prefix("wb.u", first)
    found = publisher.latest({}, ["wb.t", "wb.u", "wb.none"])
    assert set(found) == {"wb.t", "wb.u"}
    assert found["wb.t"][1:] == (wider, key) and found["wb.u"][2] is None
    assert found["wb.t"][0] < found["wb.u"][0]
