"""The producer's schema-change classifier (producer.schema_changes): one scenario per row of the README's table."""

import pytest
from rich.console import Console

from producer import schema_changes as sc
from producer.schema_changes import CatalogFacts, ColumnFacts, ShapeRef
from walbridge.render import render_status

VARCHAR_10, VARCHAR_20 = 14, 24  # typmod = n + 4
NUMERIC_10_2 = ((10 << 16) | 2) + 4
NUMERIC_12_2 = ((12 << 16) | 2) + 4
NUMERIC_10_0 = (10 << 16) + 4
NUMERIC_18_0 = (18 << 16) + 4

TYPES = {sc.INT2: "smallint", sc.INT4: "integer", sc.INT8: "bigint", sc.TEXT: "text", sc.VARCHAR: "varchar",
         sc.NUMERIC: "numeric", sc.TIMESTAMP: "timestamp", sc.TIMESTAMPTZ: "timestamptz"}


def col(attnum, name, type_oid=sc.INT4, typmod=-1, missing=False, default=False):
    return ColumnFacts(attnum, name, type_oid, typmod, missing, default)


def catalog(*columns, key=("id",), identity="d", name="t"):
    return CatalogFacts("public", name, tuple(columns), key, identity)


def shape(cat: CatalogFacts, message=None, previous=None):
    """The relation of a Relation message (default: what ``cat`` says) with ``cat``'s facts."""
    cols = message if message is not None else [(c.name, c.type_oid, c.typmod) for c in cat.columns]
    return sc.shape_of("public", cat.name, [(n, t, m, TYPES[t]) for n, t, m in cols], cat.key, cat.identity, cat,
                       previous)


BASE = catalog(col(1, "id"), col(2, "a"), col(3, "b", sc.TEXT))


def changes_to(after: CatalogFacts, before: CatalogFacts = BASE, message=None):
    old = shape(before)
    return sc.classify(old, shape(after, message, old), after)


def kinds(changes):
    return [(c.kind, c.column) for c in changes]


def test_nothing_changed_is_no_change():
    assert changes_to(BASE) == []


def test_added_column_without_default():
    after = catalog(*BASE.columns, col(4, "c"))
    assert kinds(changes_to(after)) == [(sc.ADDED, "c")]


def test_added_column_with_constant_default_has_missing():
    after = catalog(*BASE.columns, col(4, "c", missing=True, default=True))
    assert kinds(changes_to(after)) == [(sc.ADDED_CONSTANT_DEFAULT, "c")]


def test_added_column_with_volatile_default_rewrote_the_table():
    after = catalog(*BASE.columns, col(4, "c", sc.TIMESTAMPTZ, default=True))
    assert kinds(changes_to(after)) == [(sc.ADDED_VOLATILE_DEFAULT, "c")]


def test_dropped_column():
    after = catalog(col(1, "id"), col(3, "b", sc.TEXT))
    assert kinds(changes_to(after)) == [(sc.DROPPED, "a")]


def test_renamed_column_keeps_its_attnum():
    after = catalog(col(1, "id"), col(2, "a2"), col(3, "b", sc.TEXT))
    changes = changes_to(after)
    assert kinds(changes) == [(sc.RENAMED, "a2")]
    assert (changes[0].was, changes[0].now) == ("a", "a2")


def test_drop_and_add_under_other_names_is_not_a_rename():
    after = catalog(col(1, "id"), col(3, "b", sc.TEXT), col(4, "a2"))
    assert sorted(kinds(changes_to(after))) == sorted([(sc.DROPPED, "a"), (sc.ADDED, "a2")])


def test_renamed_again_since_the_message_is_in_doubt_never_a_rename():
    # The message says a → a2, the catalog (read later) already says a3.
    after = catalog(col(1, "id"), col(2, "a3"), col(3, "b", sc.TEXT))
    message = [("id", sc.INT4, -1), ("a2", sc.INT4, -1), ("b", sc.TEXT, -1)]
    assert sorted(kinds(changes_to(after, message=message))) == sorted([(sc.IN_DOUBT, "a2"), (sc.DROPPED, "a")])


def test_a_repeated_relation_is_no_change_whatever_the_catalog_did_since():
    message = [(c.name, c.type_oid, c.typmod) for c in BASE.columns]
    retyped_since = catalog(col(1, "id"), col(2, "a", sc.INT8), col(3, "b", sc.TEXT))
    renamed_since = catalog(col(1, "id"), col(2, "a2"), col(3, "b", sc.TEXT))
    assert changes_to(retyped_since, message=message) == []
    assert changes_to(renamed_since, message=message) == []
    # ... and the rename, when its own Relation comes, is still one: the attnum was carried over.
    old = shape(BASE)
    repeated = shape(renamed_since, message, old)
    assert kinds(sc.classify(repeated, shape(renamed_since, None, repeated), renamed_since)) == [(sc.RENAMED, "a2")]


def test_dropped_and_added_again_under_its_name_is_recreated():
    after = catalog(col(1, "id"), col(3, "b", sc.TEXT), col(4, "a", missing=True, default=True))
    message = [("id", sc.INT4, -1), ("b", sc.TEXT, -1), ("a", sc.INT4, -1)]
    assert kinds(changes_to(after, message=message)) == [(sc.RECREATED, "a")]


@pytest.mark.parametrize("old,new", [
    ((sc.INT2, -1), (sc.INT4, -1)), ((sc.INT4, -1), (sc.INT8, -1)), ((sc.INT2, -1), (sc.INT8, -1)),
    ((sc.VARCHAR, VARCHAR_10), (sc.VARCHAR, VARCHAR_20)), ((sc.VARCHAR, VARCHAR_10), (sc.TEXT, -1)),
    ((sc.VARCHAR, VARCHAR_10), (sc.VARCHAR, -1)),
    ((sc.NUMERIC, NUMERIC_10_2), (sc.NUMERIC, NUMERIC_12_2)), ((sc.NUMERIC, NUMERIC_10_2), (sc.NUMERIC, -1)),
    ((sc.INT4, -1), (sc.NUMERIC, -1)), ((sc.INT4, -1), (sc.NUMERIC, NUMERIC_10_0)),
    ((sc.TIMESTAMP, -1), (sc.TIMESTAMPTZ, -1)),
])
def test_widening_retypes(old, new):
    before = catalog(col(1, "id"), col(2, "a", *old))
    after = catalog(col(1, "id"), col(2, "a", *new))
    assert kinds(changes_to(after, before)) == [(sc.RETYPED_WIDENING, "a")]


@pytest.mark.parametrize("old,new", [
    ((sc.INT8, -1), (sc.INT4, -1)), ((sc.TEXT, -1), (sc.INT4, -1)), ((sc.INT4, -1), (sc.TEXT, -1)),
    ((sc.VARCHAR, VARCHAR_20), (sc.VARCHAR, VARCHAR_10)), ((sc.VARCHAR, -1), (sc.VARCHAR, VARCHAR_10)),
    ((sc.NUMERIC, NUMERIC_10_2), (sc.NUMERIC, NUMERIC_10_0)), ((sc.NUMERIC, -1), (sc.NUMERIC, NUMERIC_12_2)),
    ((sc.INT8, -1), (sc.NUMERIC, NUMERIC_18_0)), ((sc.TIMESTAMPTZ, -1), (sc.TIMESTAMP, -1)),
])
def test_other_retypes_are_not_widening(old, new):
    before = catalog(col(1, "id"), col(2, "a", *old))
    after = catalog(col(1, "id"), col(2, "a", *new))
    changes = changes_to(after, before)
    assert kinds(changes) == [(sc.RETYPED, "a")]
    assert changes[0].was == TYPES[old[0]] and changes[0].now == TYPES[new[0]]


def test_key_changed_and_lost():
    after = catalog(*BASE.columns, key=("id", "a"))
    assert kinds(changes_to(after)) == [(sc.KEY_CHANGED, None)]
    lost = catalog(*BASE.columns, key=())
    change = changes_to(lost)[0]
    assert (change.kind, change.was, change.now) == (sc.KEY_LOST, "id", "none")


def test_replica_identity_changed():
    after = catalog(*BASE.columns, identity="f")
    change = changes_to(after)[0]
    assert (change.kind, change.was, change.now) == (sc.IDENTITY_CHANGED, "default", "full")


def test_table_renamed():
    after = catalog(*BASE.columns, name="t2")
    change = changes_to(after)[0]
    assert (change.kind, change.was, change.now) == (sc.TABLE_RENAMED, "public.t", "public.t2")


# ------------------------------------------------------------ what shapes do

ALL = ShapeRef("all", None)
ON_A = ShapeRef("on_a", None, frozenset({"a"}))
COLS_AB = ShapeRef("cols_ab", ("id", "a", "b"))
COLS_B = ShapeRef("cols_b", ("id", "b"))


def decide(after, shapes=(ALL, ON_A, COLS_AB, COLS_B), aliases=None, message=None):
    return sc.consequences(changes_to(after, message=message), list(shapes), "public.t", after.key, aliases)


def test_plain_add_and_widening_need_nothing_but_the_schema():
    out = decide(catalog(col(1, "id"), col(2, "a", sc.INT8), col(3, "b", sc.TEXT), col(4, "c")))
    assert (out.reread, out.stop, out.aliases) == ({}, {}, {})


def test_default_rereads_the_shapes_that_carry_the_new_column():
    out = decide(catalog(*BASE.columns, col(4, "c", missing=True, default=True)))
    assert set(out.reread) == {"all", "on_a"} and not out.stop
    assert "constant default c" in out.reread["all"]


def test_narrowing_rereads_shapes_carrying_or_filtering_on_the_column():
    out = decide(catalog(col(1, "id"), col(2, "a", sc.INT2), col(3, "b", sc.TEXT)))
    assert set(out.reread) == {"all", "on_a", "cols_ab"}
    narrowed_filter = sc.consequences(changes_to(catalog(col(1, "id"), col(2, "a", sc.INT2),
                                                         col(3, "b", sc.TEXT))),
                                      [ShapeRef("f", ("id", "b"), frozenset({"a"}))], "public.t", ("id",))
    assert "filters on it" in narrowed_filter.reread["f"]


def test_dropped_column_stops_the_shapes_naming_it_only():
    out = decide(catalog(col(1, "id"), col(3, "b", sc.TEXT)))
    assert set(out.stop) == {"on_a", "cols_ab"} and not out.reread
    assert out.stop["on_a"] == ("shape on_a: column a of public.t was dropped, and the shape's where names it; "
                                "fix the shape in the config and restart")
    assert "columns names it" in out.stop["cols_ab"]


def test_renamed_column_gets_an_alias_and_stops_shapes_naming_the_old_name():
    out = decide(catalog(col(1, "id"), col(2, "a2"), col(3, "b", sc.TEXT)))
    assert out.aliases == {"a2": ("a",)}
    assert set(out.stop) == {"on_a", "cols_ab"} and "renamed to a2" in out.stop["on_a"]


def test_renamed_twice_keeps_every_former_name():
    after = catalog(col(1, "id"), col(2, "a3"), col(3, "b", sc.TEXT))
    before = catalog(col(1, "id"), col(2, "a2"), col(3, "b", sc.TEXT))
    out = sc.consequences(changes_to(after, before), [ALL], "public.t", ("id",), {"a2": ("a",)})
    assert out.aliases == {"a3": ("a", "a2")}


def test_aliases_carry_over_a_change_that_is_no_rename_and_go_with_the_column():
    kept = sc.consequences([], [ALL], "public.t", ("id",), {"a2": ("a",)})
    assert kept.aliases == {"a2": ("a",)}
    gone = sc.consequences([sc.Change(sc.DROPPED, "a2")], [ALL], "public.t", ("id",), {"a2": ("a",)})
    assert gone.aliases == {}


def test_table_renamed_stops_every_shape():
    out = decide(catalog(*BASE.columns, name="t2"))
    assert set(out.stop) == {"all", "on_a", "cols_ab", "cols_b"}
    assert "table public.t was renamed to public.t2" in out.stop["all"]


def test_a_rename_to_what_the_config_names_is_followed():
    renamed_back = [sc.Change(sc.TABLE_RENAMED, None, "public.t_old", "public.t")]
    assert sc.consequences(renamed_back, [ALL], "public.t", ("id",)).stop == {}


def test_first_sight_of_a_table_compares_its_name_with_the_config():
    assert sc.first_sight("public.t", "public.t") == []
    out = sc.consequences(sc.first_sight("public.t", "public.t2"), [ALL], "public.t", ("id",))
    assert "table public.t was renamed to public.t2" in out.stop["all"]


def test_key_change_rereads_and_stops_shapes_whose_columns_lack_the_new_key():
    out = decide(catalog(*BASE.columns, key=("a",)))
    assert set(out.reread) == {"all", "on_a", "cols_ab"}
    assert set(out.stop) == {"cols_b"} and "lack a" in out.stop["cols_b"]


def test_lost_key_rereads_every_shape():
    out = decide(catalog(*BASE.columns, key=()))
    assert set(out.reread) == {"all", "on_a", "cols_ab", "cols_b"} and not out.stop


def test_in_doubt_rereads():
    after = catalog(col(1, "id"), col(2, "a3"), col(3, "b", sc.TEXT))
    message = [("id", sc.INT4, -1), ("a2", sc.INT4, -1), ("b", sc.TEXT, -1)]
    out = decide(after, shapes=[ALL, COLS_B], message=message)
    assert set(out.reread) == {"all"} and out.aliases == {}


def test_unknown_columns_of_a_relation_stop_the_shapes_naming_them():
    out = sc.unknown_columns([ALL, ON_A, COLS_AB, COLS_B], ["id", "b"], "public.t")
    assert set(out) == {"on_a", "cols_ab"}
    assert out["on_a"] == ("shape on_a: public.t has no column a (in its where) any more; fix the shape in the "
                           "config and restart")


def test_status_shows_a_stopped_shape_with_its_error_and_held_wal():
    error = "shape on_a: column a of public.t was dropped, and the shape's where names it"
    status = {"slot": None, "groups": [], "writers": [], "producer": {
        "age_s": 1, "stopped_shapes": {"on_a": {"error": error, "held_lsn": "0/16B3748", "wal_held": True}}}}
    console = Console(record=True, width=300)
    console.print(render_status(status))
    text = console.export_text()
    assert "STOPPED on_a" in text and "column a of public.t was dropped" in text and "WAL held from 0/16B3748" in text


def test_a_change_wider_than_its_relation_is_an_error_not_a_truncation():
    assert sc.unannounced("public.t", ["id", "a"], 2) is None
    assert sc.unannounced("public.t", ["id", "a"], 3) == (
        "a change of public.t carries 3 columns, but its last Relation message named 2 (id, a): a schema change "
        "the stream did not announce; reading the relation again")
