"""Offset commits tagged with their topic incarnation: the metadata format,
the producer's reading of it and the committer's retry queue (issue 16)."""

from confluent_kafka import KafkaError, KafkaException

from schemas.kafka import trusted_offsets
from schemas.wire import commit_metadata, commit_topic_id
from spark_consumer.group_commits import OffsetCommitter, retry_queue


def test_commit_metadata_round_trips_and_ignores_foreign_metadata():
    assert commit_topic_id(commit_metadata("AaINNHIIdbC+pfPTCpORwA")) == "AaINNHIIdbC+pfPTCpORwA"
    assert commit_metadata(None) == ""
    assert commit_topic_id("") is None
    assert commit_topic_id(None) is None
    assert commit_topic_id("some other tool's note") is None


def test_a_commit_for_another_incarnation_counts_as_nothing_read():
    commits = {("t", 0): (500, "old"), ("t", 1): (7, "new"), ("u", 0): (9, None), ("v", 0): (-1001, None)}
    got, untrusted = trusted_offsets("g", commits, {"t": "new", "u": "x"}, {("t", 0): 900, ("u", 0): 9})
    assert got == {("t", 0): 0, ("t", 1): 7, ("u", 0): 9, ("v", 0): 0}
    assert len(untrusted) == 1 and "g" in untrusted[0] and "t[0]" in untrusted[0] and "old" in untrusted[0]


def test_a_commit_on_a_missing_topic_is_not_trusted():
    assert trusted_offsets("g", {("t", 0): (5, "old")}, {"t": None}, {})[0] == {("t", 0): 0}


def test_a_commit_beyond_the_partitions_end_counts_as_nothing_read():
    commits = {("t", 0): (500, None), ("t", 1): (40, None), ("t", 2): (41, None)}
    got, untrusted = trusted_offsets("g", commits, {}, {("t", 0): 40, ("t", 1): 40, ("t", 2): 40})
    assert got == {("t", 0): 0, ("t", 1): 40, ("t", 2): 0}
    assert len(untrusted) == 2 and "beyond the partition's end 40" in untrusted[0] and "t[0]" in untrusted[0]


def test_retry_queue_drops_commits_read_from_an_earlier_incarnation():
    failed = {("t", 0): (500, "old"), ("u", 0): (3, "u1"), ("w", 0): (4, None)}
    keep, drop = retry_queue(failed, {"t": "new", "u": "u1", "w": None})
    assert keep == {("u", 0): (3, "u1"), ("w", 0): (4, None)}
    assert drop == {("t", 0): (500, "old")}


def test_retry_queue_drops_an_untagged_commit_once_the_topic_has_an_id():
    keep, drop = retry_queue({("t", 0): (5, None)}, {"t": "new"})
    assert keep == {} and drop == {("t", 0): (5, None)}


class _FlakyGroup:
    """Stands in for the committer's Kafka consumer: the first commit fails."""

    def __init__(self):
        self.commits: list[list] = []
        self.fail = True

    def poll(self, timeout):
        return None

    def commit(self, offsets, asynchronous):
        if self.fail:
            self.fail = False
            raise KafkaException(KafkaError(KafkaError.COORDINATOR_NOT_AVAILABLE))
        self.commits.append([(tp.topic, tp.partition, tp.offset) for tp in offsets])


def test_a_failed_commit_is_retried_alone_once_due_when_no_batch_follows(monkeypatch):
    committer = OffsetCommitter({"bootstrap.servers": "127.0.0.1:9"}, "g")
    group = committer._consumer = _FlakyGroup()
    monkeypatch.setattr(committer, "_current_ids", lambda topics: {"t": "id1"})
    committer.commit({("t", 0): 7})
    assert group.commits == []
    committer.retry(after=3600)  # not due yet
    assert group.commits == []
    committer.retry(after=0)
    assert group.commits == [[("t", 0, 7)]]
    committer.retry(after=0)  # nothing queued any more
    assert group.commits == [[("t", 0, 7)]]


def test_offsets_read_from_an_earlier_incarnation_are_not_committed(monkeypatch):
    committer = OffsetCommitter({"bootstrap.servers": "127.0.0.1:9"}, "g")
    group = committer._consumer = _FlakyGroup()
    group.fail = False
    monkeypatch.setattr(committer, "_current_ids", lambda topics: {"t": "new", "u": "u1"})
    committer.commit({("t", 0): 500, ("u", 0): 3}, read_from="old")
    assert group.commits == []  # neither topic has the id "old" now
    committer.commit({("t", 0): 9}, read_from="new")
    assert group.commits == [[("t", 0, 9)]]
