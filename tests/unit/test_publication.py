"""What walbridge asks of a publication it may not align (another role owns it),
where changes arriving under a partition's own name belong, and which leaves
came and went."""

from producer.catalog import PUBLISH_FULL, Published, publication_gaps, routed_to
from producer.partitions import leaf_changes

TABLES = ("public.events", "public.orders")


def published(tables=TABLES, via_root=True, actions=PUBLISH_FULL, all_tables=False):
    return Published(all_tables, via_root, frozenset(actions), frozenset(tables))


def test_a_publication_that_serves_the_plan_has_no_gaps():
    assert publication_gaps(published(), TABLES, PUBLISH_FULL, ("public.events",)) == []
    assert publication_gaps(published((), all_tables=True), TABLES, PUBLISH_FULL, ()) == []


def test_a_partitioned_table_needs_publish_via_partition_root():
    (gap,) = publication_gaps(published(via_root=False), TABLES, PUBLISH_FULL, ("public.events",))
    assert "publish_via_partition_root" in gap and "public.events" in gap
    # Without a partitioned table the option does not matter.
    assert publication_gaps(published(via_root=False), TABLES, PUBLISH_FULL, ()) == []


def test_missing_tables_and_actions_are_named():
    gaps = publication_gaps(published(("public.orders",), actions=("insert",)), TABLES, PUBLISH_FULL, ())
    assert gaps == ["does not publish public.events", "does not publish update, delete, truncate"]


def test_changes_under_a_leafs_name_belong_to_every_shape_table_above_it():
    ancestors = ("public.events_2024", "public.events")  # nearest first
    assert routed_to(ancestors, {"public.events": []}) == ("public.events",)
    assert routed_to(ancestors, {"public.orders": []}) == ()
    assert routed_to((), {"public.events": []}) == ()


def test_leaves_added_and_gone_between_two_looks():
    known = {"public.ev_1": 11, "public.ev_2": 12}
    assert leaf_changes(known, known) == ([], [])
    assert leaf_changes(known, {"public.ev_1": 11, "public.ev_3": 13}) == (["public.ev_3"], ["public.ev_2"])
    # Dropped and re-created under the same name: a new leaf, and the old one gone.
    assert leaf_changes(known, {"public.ev_1": 11, "public.ev_2": 99}) == (["public.ev_2"], ["public.ev_2"])
