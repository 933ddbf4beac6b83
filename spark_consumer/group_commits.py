"""Committing applied offsets to the consumer group, tagged with the topic
incarnation they were read from.

Invariants:
- Every committed offset carries the id of the topic it was read from in its
  metadata (:func:`schemas.wire.commit_metadata`), so the producer can tell a
  commit for an earlier incarnation of a re-created topic from progress on the
  current one. A batch's offsets name the id its batch was planned on (in
  Spark's checkpoint, ``offsets/<batch>``); if the topic's id is another by
  commit time, they are not committed at all.
- A commit that failed is retried with the next batch's, or on its own when
  no batch follows (:meth:`OffsetCommitter.retry`, from the driver's loop: the
  producer holds the partition's WAL until the commit lands), but never for a
  topic whose id changed since it was queued (:func:`retry_queue`): old
  offsets on a re-created topic would point into data no consumer applied.
- At a query's start the target's progress is committed for the topic
  incarnation its checkpoint's newest batch was read from (a consumer killed
  between the target's commit and the group's leaves partitions that get no
  new batch behind, and their WAL held).
- One commit at a time per committer (a lock): the batch's thread and the
  driver's retry never interleave their queues.
- Failures are logged, not raised: the target's progress table, not the
  group, decides what is applied; meanwhile the producer holds the WAL those
  offsets would release.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Mapping

from confluent_kafka import Consumer, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from schemas.kafka import Writer, raise_refusal, topic_ids
from schemas.wire import commit_metadata

log = logging.getLogger("walbridge.consumer")

Queued = dict[Writer, tuple[int, str | None]]  # offset, topic id it was read from
COMMIT_RETRY_S = 5.0  # seconds after a failed commit before it is retried without a new batch


def retry_queue(failed: Queued, current_ids: dict[str, str | None]) -> tuple[Queued, Queued]:
    """(the failed commits still worth retrying, those to drop): a commit
    queued for another topic id than the topic's current one is dropped; one
    queued without a known id is kept only while the topic's id is unknown too."""
    keep, drop = {}, {}
    for w, (offset, tid) in failed.items():
        (keep if tid == current_ids.get(w[0]) else drop)[w] = (offset, tid)
    return keep, drop


class OffsetCommitter:
    """Commits offsets for the consumer group without joining it as a member."""

    def __init__(self, kafka_conf: dict[str, Any], group: str, timeout: float = 10.0):
        self._conf = kafka_conf
        self._consumer = Consumer({**kafka_conf, "group.id": group, "enable.auto.commit": False})
        self._admin = AdminClient(kafka_conf)
        self._timeout = timeout
        self._ids: dict[str, str | None] = {}  # the last id seen per topic
        self._failed: Queued = {}
        self._failed_at = 0.0  # monotonic time of the last failed commit
        self._lock = threading.Lock()

    def _current_ids(self, topics: set[str]) -> dict[str, str | None]:
        """Each topic's id now (one request for all); the last one seen where
        the broker does not answer."""
        for topic, found in topic_ids(self._admin, topics, self._timeout).items():
            if isinstance(found, LookupError):
                self._ids[topic] = None
            elif isinstance(found, KafkaException):
                log.warning("reading the id of topic %s failed (using the last seen): %s", topic,
                            found.args[0].str() if found.args else found)
            else:
                self._ids[topic] = found
        return self._ids

    def commit(self, offsets: dict[Writer, int], read_from: str | Mapping[str, str | None] | None = None) -> None:
        """Commit ``offsets`` (and the failed commits still worth retrying);
        a failure is logged and the commit queued for the next call. With
        ``read_from`` (the topic id the offsets were read from; or per topic,
        None for a topic not to check), nothing is committed for a topic whose
        id is another by now."""
        with self._lock:
            self._commit(offsets, read_from)

    def retry(self, after: float) -> None:
        """Retry the queued failed commits, if the last failure is ``after``
        seconds old (a shape whose partitions get no new batch)."""
        with self._lock:
            if self._failed and time.monotonic() - self._failed_at >= after:
                self._commit({})

    def _commit(self, offsets: dict[Writer, int], read_from: str | Mapping[str, str | None] | None = None) -> None:
        raise_refusal(self._consumer, self._conf)  # serves the client's log records, raises a denied group
        if not offsets and not self._failed:
            return
        ids = self._current_ids({t for t, _ in (*offsets, *self._failed)})
        expected = read_from if isinstance(read_from, Mapping) else dict.fromkeys({t for t, _ in offsets}, read_from)
        stale = {w for w in offsets if expected.get(w[0]) is not None and ids.get(w[0]) != expected[w[0]]}
        for t, p in sorted(stale):
            log.warning("not committing offset %d on %s[%d]: it was read from topic id %s, the topic's "
                        "id is now %s (re-created)", offsets[(t, p)], t, p, expected[t], ids.get(t))
        offsets = {w: o for w, o in offsets.items() if w not in stale}
        retry, dropped = retry_queue(self._failed, ids)
        for (t, p), (o, tid) in dropped.items():
            log.warning("not retrying the commit of offset %d on %s[%d]: it was read from topic id %s, the "
                        "topic's id is now %s (re-created)", o, t, p, tid, ids.get(t))
        queue = {**retry, **{w: (o, ids.get(w[0])) for w, o in offsets.items()}}
        if not queue:
            self._failed = {}
            return
        try:
            self._consumer.commit(offsets=[TopicPartition(t, p, o, metadata=commit_metadata(tid))
                                           for (t, p), (o, tid) in queue.items()], asynchronous=False)
            if self._failed and not offsets:
                log.info("committed the offsets of an earlier failed commit: %s",
                         ", ".join(f"{t}[{p}]@{o}" for (t, p), (o, _) in sorted(queue.items())))
            self._failed = {}
        except KafkaException as e:
            raise_refusal(self._consumer, self._conf)  # a group the principal may not use: permanent
            self._failed, self._failed_at = queue, time.monotonic()
            log.warning("committing offsets to the consumer group failed (retried with the next batch, or "
                        "alone in %.0fs): %s", COMMIT_RETRY_S, e.args[0].str() if e.args else e)

    def close(self) -> None:
        self._consumer.close()
