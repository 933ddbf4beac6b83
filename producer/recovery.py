"""Restart recovery: what a producer that finds its slot does with it — stream
on, or drop it and redo the snapshot, or stop and ask.

The slot is never dropped, nor the database re-snapshotted, without a reason:

- **These topics never held this slot's data** (``topic_prefix`` changed, other
  Kafka cluster, another slot's topics): stop with :class:`SlotElsewhereError`,
  which says how to go back and which command re-snapshots on purpose. What
  the slot's data went to is recorded in the source database
  (:mod:`producer.slot_binding`), so it survives a broker that lost everything.
- **Kafka lost data no consumer group had read** (broker wiped, topics
  re-created or records deleted before every group read the snapshot): drop
  the slot and redo the snapshot, as by itself, without a manual step.
- Otherwise stream on from the slot; a partition whose data is gone after every
  group read it (retention, deleted records, a re-created idle topic) costs
  nothing: the slot replays what no group committed, the rest is applied.

What Kafka holds of a slot is recorded in the compacted ``<prefix>._checkpoint``
topic (:class:`Checkpoint`), never inferred from data-topic messages that
retention or compaction may delete: the snapshot (started, complete), the
topics it and later shape backfills cover, per snapshot partition the offset
after its ``snapshot_end`` and the topic's id, and whether every consumer group
has read that far (``consumed``). A deployment from before the checkpoint is
adopted from its partition tails, as they were read then.

Pure: every fact comes in as an argument.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Iterable

from producer.failover import Server
from producer.kafka_io import Tail
from schemas.failures import SOURCE, Failure
from schemas.kafka import Writer


class SlotElsewhereError(Failure):
    """The slot's data went to other topics than the config names (permanent:
    the config or the slot must change; a ``source`` failure, exit code 3)."""

    def __init__(self, problem: str, fix: str):
        super().__init__(SOURCE, problem, fix)


@dataclass(frozen=True)
class Binding:
    """Where a slot's data goes: the topic prefix and Kafka cluster id; the
    PostgreSQL server it was last read on (None: not recorded); the resend
    mark of a run whose deliveries failed (``slot_binding.mark_resend``)."""

    topic_prefix: str
    cluster_id: str | None
    server: Server | None = None
    resend_until: int | None = None  # a run's deliveries failed with changes up to this commit LSN produced


@dataclass(frozen=True)
class Checkpoint:
    """What Kafka holds of a slot (the ``_checkpoint`` topic's record)."""

    slot: str
    database: str
    snapshot_id: str
    lsn: int
    complete: bool = False
    topics: dict[str, int] = field(default_factory=dict)  # covered topics: partitions
    ends: dict[str, list[int]] = field(default_factory=dict)  # snapshot topic: offset after snapshot_end, per partition
    topic_ids: dict[str, str | None] = field(default_factory=dict)
    consumed: bool = False  # every ack group has committed up to every end

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Checkpoint:
        raw = json.loads(data)
        return cls(**{k: raw[k] for k in cls.__dataclass_fields__ if k in raw})

    def consumed_by(self, committed: dict[Writer, int]) -> bool:
        """Has every group committed (``committed``: the lowest offset over the
        groups per writer) up to the end of every snapshot partition?"""
        return all(committed.get((t, p), 0) >= end for t, ends in self.ends.items() for p, end in enumerate(ends))


@dataclass(frozen=True)
class PartitionFacts:
    """What the broker holds of a data partition at start."""

    low: int  # earliest offset
    end: int  # end offset
    tail: Tail | None  # the last walbridge message
    topic_id: str | None


@dataclass(frozen=True)
class Decision:
    resnapshot: bool
    reason: str = ""
    new_topics: frozenset[str] = frozenset()
    checkpoint: Checkpoint | None = None  # to record (adopted, or covering new topics)
    bind: Binding | None = None  # to record in the source database
    notes: tuple[str, ...] = ()  # worth a log line


def check_binding(slot: str, binding: Binding | None, prefix: str, cluster_id: str | None) -> Binding | None:
    """The binding to record (None: it stands), or :class:`SlotElsewhereError`."""
    if binding is None:
        return Binding(prefix, cluster_id)  # a slot from before bindings: adopted with the running config
    redo = (f"To start over into the configured topics instead (a full re-snapshot, on purpose), run "
            f"SELECT pg_drop_replication_slot('{slot}'); in the source database, then start the producer again.")
    if binding.topic_prefix != prefix:
        raise SlotElsewhereError(
            f"slot {slot} streams into the topics of prefix {binding.topic_prefix!r}, but the config says "
            f"[kafka] topic_prefix = {prefix!r}: those topics never held this slot's data, so walbridge neither "
            f"drops the slot nor re-snapshots by itself",
            f"to go on streaming, set topic_prefix = {binding.topic_prefix!r} again. {redo} A second deployment "
            f"needs a [source] slot of its own.")
    if binding.cluster_id and cluster_id and binding.cluster_id != cluster_id:
        raise SlotElsewhereError(
            f"slot {slot} streams into Kafka cluster {binding.cluster_id}, but the configured bootstrap servers "
            f"reach cluster {cluster_id}: its topics never held this slot's data, so walbridge neither drops the "
            f"slot nor re-snapshots by itself",
            f"if cluster {cluster_id} does hold that data (a migrated cluster), record it: UPDATE "
            f"_walbridge.producer_slots SET kafka_cluster_id = '{cluster_id}' WHERE slot_name = "
            f"'{slot}'; {redo}")
    return None


def snapshot_in_tails(tails: dict[Writer, Tail | None]) -> tuple[bool, set[str]]:
    """A deployment from before the checkpoint, judged by its partition tails:
    (is the snapshot complete on every topic holding anything, those topics)."""
    by_topic: dict[str, list[Tail | None]] = {}
    for (topic, _), tail in tails.items():
        by_topic.setdefault(topic, []).append(tail)
    holding = {t for t, ts in by_topic.items() if any(x is not None for x in ts)}
    complete = all(tail is not None and not (tail.snapshot_id is not None and tail.control is None)
                   for (topic, _), tail in tails.items() if topic in holding)
    return bool(holding) and complete, holding


def _gone(cp: Checkpoint, writer: Writer, facts: PartitionFacts) -> bool:
    """Has this snapshot partition lost records below its end (deleted, or a
    new incarnation of the topic)?"""
    topic, p = writer
    was = cp.topic_ids.get(topic)
    if was and facts.topic_id and was != facts.topic_id:
        return True
    end = max(facts.end, facts.tail.offset + 1 if facts.tail is not None else 0)
    return facts.low > 0 or end < cp.ends[topic][p]


def decide(*, slot: str, database: str, checkpoint: Checkpoint | None, topics: dict[str, int],
           partitions: dict[Writer, PartitionFacts], committed: dict[Writer, int] | None) -> Decision:
    """What to do with an existing slot whose binding stands. ``topics``: the
    configured data topics and their partition counts; ``committed``: per
    snapshot partition the lowest offset the ack groups committed (None: no
    groups, broker acknowledgements suffice)."""
    if checkpoint is None:
        complete, holding = snapshot_in_tails({w: f.tail for w, f in partitions.items()})
        if not complete:
            return Decision(True, f"Kafka holds no complete snapshot of slot {slot} (the broker lost its data, or "
                                  "the producer stopped mid-snapshot)")
        ends = {t: [max(partitions[(t, p)].end, _after(partitions[(t, p)].tail)) for p in range(topics[t])]
                for t in sorted(holding)}
        # Covering the topics without data too: they are backfilled as new now.
        adopted = Checkpoint(slot, database, "adopted", 0, True, dict(topics), ends,
                             {t: partitions[(t, 0)].topic_id for t in holding})
        return Decision(False, new_topics=frozenset(set(topics) - holding), checkpoint=adopted,
                        notes=(f"recorded what Kafka holds of slot {slot} in its checkpoint (from the partition "
                               "tails: a deployment from before the checkpoint)",))
    if checkpoint.slot != slot or checkpoint.database != database:
        raise SlotElsewhereError(
            f"these topics hold the data of slot {checkpoint.slot} of database {checkpoint.database}, not of slot "
            f"{slot} of {database}: two deployments share a [kafka] topic_prefix",
            "give each deployment its own [kafka] topic_prefix")
    if not checkpoint.complete:
        return Decision(True, f"the producer stopped before the snapshot {checkpoint.snapshot_id} was complete")
    gone = sorted(w for w in _snapshot_partitions(checkpoint) if w in partitions and _gone(checkpoint, w, partitions[w]))
    notes = ()
    if gone:
        listed = ", ".join(f"{t}[{p}]" for t, p in gone)
        if not (checkpoint.consumed or committed is None or checkpoint.consumed_by(committed)):
            return Decision(True, f"Kafka lost snapshot data that not every consumer group had read ({listed})")
        notes = (f"Kafka no longer holds all records of {listed}, but every consumer group had read them: "
                 "streaming on",)
    new = frozenset(set(topics) - set(checkpoint.topics))
    covering = replace(checkpoint, topics={**checkpoint.topics, **{t: topics[t] for t in new}}) if new else None
    return Decision(False, new_topics=new, checkpoint=covering, notes=notes)


def _after(tail: Tail | None) -> int:
    return tail.offset + 1 if tail is not None else 0


def _snapshot_partitions(cp: Checkpoint) -> Iterable[Writer]:
    return ((t, p) for t, ends in cp.ends.items() for p in range(len(ends)))
