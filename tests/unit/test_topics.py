"""What a topic's described settings mean for walbridge: an internal topic
that may lose records, a data topic that may delete changes before every
group read them (producer.topics, pure)."""

import pytest
from confluent_kafka import KafkaError, KafkaException

from producer.topics import data_findings, fix_command, internal_findings, replication_findings
from schemas import wire
from schemas.kafka import asked_until_complete

BOOT = "kafka:9092"


def test_topics_as_walbridge_creates_them_have_no_finding():
    assert internal_findings("wb._status", dict(wire.INTERNAL_TOPIC_CONFIG), wire.INTERNAL_TOPIC_CONFIG) == []
    assert internal_findings("wb.t.dlq", dict(wire.DLQ_TOPIC_CONFIG), wire.DLQ_TOPIC_CONFIG) == []
    assert data_findings("wb.t", dict(wire.DATA_TOPIC_CONFIG), True, BOOT) == []
    assert data_findings("wb.t", {"cleanup.policy": "delete", **wire.DATA_TOPIC_CONFIG}, True, BOOT) == []


def test_an_internal_topic_with_the_brokers_defaults_is_reported_twice():
    found = internal_findings("wb._schemas", {"cleanup.policy": "delete", "retention.ms": "604800000"},
                              wire.INTERNAL_TOPIC_CONFIG)
    assert found == ["is not compacted (cleanup.policy=delete)",
                     "deletes messages after 7 days (retention.ms=604800000)"]
    # compact,delete still deletes by time
    assert internal_findings("wb._schemas", {"cleanup.policy": "compact,delete", "retention.ms": "86400000"},
                             wire.INTERNAL_TOPIC_CONFIG) == ["deletes messages after 1 day (retention.ms=86400000)"]


@pytest.mark.parametrize("config, finding", [
    ({"cleanup.policy": "delete", "retention.ms": "3600000"}, "deletes messages after 1 h (retention.ms=3600000)"),
    ({"retention.ms": "1500"}, "deletes messages after 1.5 s (retention.ms=1500)"),  # unreported policy: delete
    ({"cleanup.policy": "delete", "retention.ms": "-1", "retention.bytes": "1073741824"},
     "deletes the oldest messages beyond 1073741824 bytes per partition (retention.bytes=1073741824)"),
])
def test_a_data_topic_that_deletes_by_time_or_size_is_found_with_its_fix(config, finding):
    found = data_findings("wb.t", config, True, BOOT)
    assert found == [f"{finding}; keep them: {fix_command(BOOT, 'wb.t', {'retention.ms': '-1', 'retention.bytes': '-1'})}"]
    assert "kafka-configs.sh --bootstrap-server kafka:9092 --alter --entity-type topics --entity-name wb.t " \
           "--add-config retention.ms=-1,retention.bytes=-1" in found[0]


def test_what_is_not_reported_is_not_guessed():
    assert data_findings("wb.t", {}, True, BOOT) == []
    assert internal_findings("wb._status", {}, wire.INTERNAL_TOPIC_CONFIG) == []


def test_a_compacted_data_topic_drops_tombstones_and_their_deletes_unless_tombstones_are_off():
    config = {"cleanup.policy": "compact", "delete.retention.ms": "3600000"}
    (found,) = data_findings("wb.t", config, True, BOOT)
    assert "drops a deleted key's tombstone, with the delete before it, 1 h after compaction" in found
    assert "tombstones_on_delete = false" in found
    assert data_findings("wb.t", config, False, BOOT) == []
    (default,) = data_findings("wb.t", {"cleanup.policy": "compact"}, True, BOOT)
    assert "1 day after compaction (delete.retention.ms=86400000)" in default


def _replication(replicas, min_isr=None, wanted=None, brokers=3):
    config = {} if min_isr is None else {"min.insync.replicas": str(min_isr)}
    return replication_findings("wb.t", replicas, config, wanted, brokers, "k:9092")


def test_three_replicas_two_in_sync_as_production_runs_them_have_no_finding():
    assert _replication(3, min_isr=2) == ([], [])
    assert _replication(3, min_isr=2, wanted=3) == ([], [])
    assert _replication(1, min_isr=1, brokers=1) == ([], [])  # a one-broker cluster has nothing better


def test_fewer_replicas_than_configured_stop_the_producer():
    refused, _ = _replication(1, min_isr=1, wanted=3)
    assert refused == ["topic wb.t has 1 replica(s), fewer than [kafka] replication_factor = 3: reassign its "
                       "partitions (kafka-reassign-partitions.sh) or lower the setting"]


def test_min_insync_replicas_above_the_replicas_would_block_every_write():
    refused, _ = _replication(2, min_isr=3)
    assert len(refused) == 1 and "no write with acks=all can be acknowledged" in refused[0]
    assert "--entity-name wb.t --add-config min.insync.replicas=2" in refused[0]


def test_weak_replication_is_warned_not_refused():
    assert _replication(3, min_isr=1)[0] == []
    assert "set min.insync.replicas=2" in _replication(3, min_isr=1)[1][0]
    assert "one replica on a cluster of 3 brokers" in _replication(1, min_isr=1)[1][0]


def test_a_topic_another_broker_does_not_know_yet_is_asked_for_again_then_named_in_a_timed_out_error():
    """A topic just created reaches the brokers one by one: an answer that
    lacks it is asked again; one that never has it ends in a transient
    (timed-out) error naming it, not a KeyError."""
    answers = iter([{"a": 1}, {"a": 1}, {"a": 1, "b": 2}])
    asked = []

    def ask():
        asked.append(1)
        return next(answers)

    def absent(answer):
        return [t for t in ("a", "b") if t not in answer]

    assert asked_until_complete(ask, absent, 5.0, "topics not visible") == {"a": 1, "b": 2}
    assert len(asked) == 3
    with pytest.raises(KafkaException) as raised:
        asked_until_complete(lambda: {"a": 1}, absent, 0.3, "topics not visible after creation")
    assert raised.value.args[0].code() == KafkaError._TIMED_OUT
    assert raised.value.args[0].str() == "topics not visible after creation: b"
    with pytest.raises(ZeroDivisionError):  # an error of the request itself is not waited out
        asked_until_complete(lambda: 1 / 0, absent, 5.0, "x")
