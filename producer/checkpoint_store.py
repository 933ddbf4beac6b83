"""The ``<prefix>._checkpoint`` topic: what Kafka holds of the slot
(:class:`producer.recovery.Checkpoint`), read at start and kept up to date.

Invariants:
- One compacted partition; the record keyed ``snapshot`` is the checkpoint
  (the latest wins). It is written when a snapshot starts, when it is
  complete (after its ``snapshot_end`` events are acknowledged), when new
  topics are covered, and once every ack group has read the snapshot.
- A write the recovery decision depends on (a snapshot started or complete)
  is waited for; a failed delivery stops the producer like any other.
- Whether the groups have read the snapshot is looked up at most every
  ``CONSUMED_INTERVAL`` seconds, and only until they have.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from confluent_kafka import KafkaException, Producer

from producer.recovery import Checkpoint
from schemas import wire
from schemas.kafka import GroupOffsets, Writer, produce_acknowledged, read_to_end

log = logging.getLogger("walbridge.producer")

KEY = b"snapshot"
CONSUMED_INTERVAL = 5.0
DELIVERY_TIMEOUT_S = 30.0


class CheckpointStore:
    def __init__(self, kafka_conf: dict[str, Any], producer: Producer, offsets: GroupOffsets, topic_prefix: str,
                 groups: list[str]):
        self._conf = kafka_conf
        self._producer = producer
        self._offsets = offsets
        self.topic = wire.checkpoint_topic(topic_prefix)
        self._groups = groups
        self.current: Checkpoint | None = None
        self._last_look = 0.0

    def read(self) -> Checkpoint | None:
        """The latest checkpoint in the topic (None: none, or unreadable)."""
        found = None
        for msg in read_to_end(self._conf, self.topic, "checkpoint"):
            if msg.key() == KEY and msg.value() is not None:
                try:
                    found = Checkpoint.from_json(msg.value())
                except (ValueError, TypeError) as e:
                    log.warning("ignoring an unreadable checkpoint at %s[0]@%d: %s", self.topic, msg.offset(), e)
        self.current = found
        return found

    def write(self, checkpoint: Checkpoint, wait: bool = False) -> None:
        self.current = checkpoint
        if wait:
            produce_acknowledged(self._producer, self.topic, checkpoint.to_json(), KEY, DELIVERY_TIMEOUT_S,
                                 "writing the checkpoint")
        else:
            self._producer.produce(self.topic, checkpoint.to_json(), KEY)

    def watch_consumed(self, now: float) -> None:
        """Record once every ack group has committed past the snapshot."""
        cp = self.current
        if cp is None or not cp.complete or cp.consumed or now - self._last_look < CONSUMED_INTERVAL:
            return
        self._last_look = now
        if self._groups:
            try:
                committed = self.committed(cp)
            except KafkaException as e:
                log.warning("reading committed offsets for the checkpoint failed (will retry): %s", e)
                return
            if not cp.consumed_by(committed):
                return
        log.info("every consumer group has read snapshot %s", cp.snapshot_id)
        self.write(replace(cp, consumed=True))

    def committed(self, cp: Checkpoint) -> dict[Writer, int]:
        """The lowest offset the ack groups committed on each snapshot partition."""
        writers = [(t, p) for t, ends in cp.ends.items() for p in range(len(ends))]
        if not writers or not self._groups:
            return {}
        per_group = self._offsets.read(self._groups, writers)
        return {w: min(offsets.get(w, 0) for offsets in per_group.values()) for w in writers}
