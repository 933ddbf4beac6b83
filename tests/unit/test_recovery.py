"""Restart recovery, one scenario each: what a producer does with the slot it
finds, from what the source database and Kafka hold."""

import pytest

from producer.kafka_io import Tail
from producer.recovery import Binding, Checkpoint, PartitionFacts, SlotElsewhereError, check_binding, decide

SLOT, DB = "wb", "app"
TOPICS = {"wb.orders": 2, "wb.users": 1}
IDS = {"wb.orders": "id-orders", "wb.users": "id-users"}


def complete(consumed: bool = False) -> Checkpoint:
    return Checkpoint(SLOT, DB, "wb@0/100", 0x100, True, dict(TOPICS), {"wb.orders": [5, 3], "wb.users": [4]},
                      dict(IDS), consumed)


def streamed(offset: int) -> Tail:
    return Tail(offset, (0x200, 0), None, None)


def facts(override: dict | None = None) -> dict:
    """Every partition holding its snapshot and some streamed changes, but ``override``."""
    out = {("wb.orders", 0): PartitionFacts(0, 9, streamed(8), "id-orders"),
           ("wb.orders", 1): PartitionFacts(0, 3, Tail(2, (0x100, 0), "snapshot_end", "wb@0/100"), "id-orders"),
           ("wb.users", 0): PartitionFacts(0, 6, streamed(5), "id-users")}
    out.update(override or {})
    return out


def run(checkpoint, partitions=None, committed=None, topics=TOPICS):
    return decide(slot=SLOT, database=DB, checkpoint=checkpoint, topics=dict(topics),
                  partitions=partitions or facts(), committed=committed)


def test_a_complete_snapshot_streams_on():
    d = run(complete(), committed={})
    assert not d.resnapshot and d.new_topics == frozenset() and d.checkpoint is None


def test_an_idle_partition_whose_data_expired_after_it_was_read_streams_on():
    # retention deleted all of wb.orders[1] (log start = end): every group had read it
    expired = {("wb.orders", 1): PartitionFacts(3, 3, None, "id-orders")}
    d = run(complete(consumed=True), facts(expired))
    assert not d.resnapshot and "wb.orders[1]" in d.notes[0]
    # not recorded as read yet, but the groups' commits say so
    d = run(complete(), facts(expired), committed={("wb.orders", 0): 5, ("wb.orders", 1): 3, ("wb.users", 0): 4})
    assert not d.resnapshot


def test_a_recreated_idle_topic_after_every_group_read_it_streams_on():
    recreated = {("wb.users", 0): PartitionFacts(0, 0, None, "id-new")}
    assert not run(complete(consumed=True), facts(recreated)).resnapshot
    # without topic ids: an end below the snapshot's end tells
    assert not run(complete(consumed=True), facts({("wb.users", 0): PartitionFacts(0, 0, None, None)})).resnapshot


def test_kafka_losing_a_snapshot_no_group_had_read_redoes_it():
    recreated = {("wb.users", 0): PartitionFacts(0, 0, None, "id-new")}
    d = run(complete(), facts(recreated), committed={("wb.orders", 0): 5, ("wb.orders", 1): 3})
    assert d.resnapshot and "wb.users[0]" in d.reason
    # broker acknowledgements only ([ack] consumer_groups = []): nothing waits on a group
    assert not run(complete(), facts(recreated), committed=None).resnapshot


def test_an_end_reported_low_is_not_a_loss():
    # a message appended between the end's report (1) and the tail read (offset 2): the read tells
    low_report = {("wb.orders", 1): PartitionFacts(0, 1, Tail(2, (0x100, 0), "snapshot_end", "wb@0/100"), "id-orders")}
    assert not run(complete(), facts(low_report), committed={}).resnapshot


def test_a_broker_that_lost_everything_redoes_the_snapshot():
    empty = {w: PartitionFacts(0, 0, None, "new") for w in facts()}
    d = run(None, empty)
    assert d.resnapshot and "no complete snapshot" in d.reason


def test_a_crash_mid_snapshot_redoes_it():
    started = Checkpoint(SLOT, DB, "wb@0/300", 0x300, topics=dict(TOPICS))
    d = run(started)
    assert d.resnapshot and "wb@0/300" in d.reason


def test_a_shape_added_to_the_config_is_new_and_then_covered():
    topics = {**TOPICS, "wb.added": 3}
    partitions = facts({("wb.added", p): PartitionFacts(0, 0, None, "id-added") for p in range(3)})
    d = run(complete(), partitions, committed={}, topics=topics)
    assert not d.resnapshot and d.new_topics == {"wb.added"}
    assert d.checkpoint.topics == topics and d.checkpoint.ends == complete().ends
    assert run(d.checkpoint, partitions, committed={}, topics=topics).new_topics == frozenset()


def test_a_deployment_from_before_the_checkpoint_is_adopted_from_its_tails():
    topics = {**TOPICS, "wb.added": 1}
    partitions = facts({("wb.added", 0): PartitionFacts(0, 0, None, None)})
    d = run(None, partitions, topics=topics)
    assert not d.resnapshot and d.new_topics == {"wb.added"}
    cp = d.checkpoint
    assert cp.complete and not cp.consumed and cp.topics == topics
    assert cp.ends == {"wb.orders": [9, 3], "wb.users": [6]}  # everything there now must be read first
    # a snapshot cut short (its rows but no snapshot_end) is not adopted
    cut = {("wb.orders", 1): PartitionFacts(0, 2, Tail(1, (0x100, 0), None, "wb@0/100"), "id-orders")}
    assert run(None, facts(cut)).resnapshot


def test_topics_holding_another_slots_data_stop_the_producer():
    other = Checkpoint("other", DB, "other@0/1", 1, True, dict(TOPICS))
    with pytest.raises(SlotElsewhereError, match="share a \\[kafka\\] topic_prefix"):
        run(other)


def test_checkpoint_round_trips_as_json():
    cp = complete(consumed=True)
    assert Checkpoint.from_json(cp.to_json()) == cp


def test_a_changed_topic_prefix_is_refused_with_the_way_back_and_the_way_forward():
    with pytest.raises(SlotElsewhereError) as e:
        check_binding(SLOT, Binding("wb", "c1"), "wb2", "c1")
    text = str(e.value)
    assert "topic_prefix = 'wb'" in text and "SELECT pg_drop_replication_slot('wb');" in text


def test_another_kafka_cluster_is_refused():
    with pytest.raises(SlotElsewhereError, match="cluster c2") as e:
        check_binding(SLOT, Binding("wb", "c1"), "wb", "c2")
    assert "UPDATE _walbridge.producer_slots SET kafka_cluster_id = 'c2'" in str(e.value)


def test_a_binding_stands_or_is_adopted():
    assert check_binding(SLOT, Binding("wb", "c1"), "wb", "c1") is None
    assert check_binding(SLOT, Binding("wb", None), "wb", "c1") is None  # a broker without cluster ids
    assert check_binding(SLOT, None, "wb", "c1") == Binding("wb", "c1")
