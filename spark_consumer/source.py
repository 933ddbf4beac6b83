"""Spark's own Kafka source (``spark.readStream.format("kafka")``) as the
consumer reads it: one subscription to every shape topic, started at the
target's progress, read in bounded micro-batches.

The path of a start, top to bottom:
1. Every topic described (:func:`schemas.kafka.describe_topics`: its id, its
   partitions) and the group's progress read from the target.
2. :func:`plan_start` decides where each partition starts (``startingOffsets``,
   every partition named: Spark requires all of a subscription's partitions
   when any is given) and which topic incarnation each topic is read in.
3. :func:`read_kafka` builds the stream: ``subscribe`` to the topics, the
   ``[kafka.client]`` settings translated to the Java client's
   (:func:`kafka_options`), ``maxOffsetsPerTrigger``, ``failOnDataLoss``,
   ``kafkaConsumer.pollTimeoutMs``, headers included, and ``minPartitions``:
   a batch whose rows lie in fewer topic-partitions than Spark has cores
   (one busy shape) has its ranges split into that many reads, so one
   partition per topic does not mean one core decoding it.

Invariants:
- The target's progress is the one record of what is applied: a start never
  reads Spark's checkpoint (each run gets a fresh one, Spark's scratch), so
  every start and restart begins exactly where the target's commits end.
- A partition's progress counts only in the topic incarnation (topic id) it
  was recorded in: a topic recreated while the consumer was down starts at
  its earliest offsets and is read whole, never resumed at offsets of the
  lost one. While the query runs, the batch applier compares every topic's id
  with the one it was started in after each read (:func:`incarnation_changes`):
  Spark's source follows a topic by name and offset, so a recreated topic
  whose offsets grew past ours would be read on as if nothing happened
  (``failOnDataLoss`` sees only offsets that went backwards).
- Batches are bounded by default (``[consumer] max_offsets_per_trigger``):
  a restart in front of a large backlog reads it a batch at a time.
- A read that gets nothing from the broker fails its task after ``[consumer]
  poll_timeout`` (Spark's ``kafkaConsumer.pollTimeoutMs``). Spark's default,
  120 s, is what each partition of a batch planned on a topic the broker then
  lost costs before Spark sees the offsets gone (``bench/poll_stall.py``).
- ``[kafka.client]`` is written in librdkafka's names (the producer's and the
  consumer's own clients use it as is); what Spark's Java client gets is its
  translation (:func:`schemas.kafka.java_client_options`), and a setting
  with no translation is a config error, never silently dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable, Mapping

from pyspark.sql import DataFrame, SparkSession

from schemas.config import Config
from schemas.kafka import Described
from spark_consumer.progress import Progress

EARLIEST = -2  # Spark's startingOffsets for "the partition's earliest offset"

@dataclass(frozen=True)
class StartPlan:
    """Where one run of the query starts.

    ``topic_ids``: the incarnation each topic is read in (None: the topic did
    not exist at the start, or the broker keeps no ids). ``starting_offsets``:
    Spark's ``startingOffsets`` (every partition of every existing topic).
    ``starts``: the offset each partition's first part starts at (a part
    covers from where the last one ended: offsets compaction removed or
    deleted records count as read). ``reread``: topics whose progress counts
    in another incarnation, read again from their start."""

    topic_ids: dict[str, str | None]
    starting_offsets: dict[str, dict[str, int]]
    starts: dict[tuple[str, int], int]
    reread: frozenset[str] = frozenset()


def plan_start(topics: Iterable[str], progress: Mapping[tuple[str, int], Progress],
               described: Mapping[str, Described | None]) -> StartPlan:
    """Pure: each topic's start from the group's ``progress`` and what the
    topics are now (``described``; None: missing)."""
    ids: dict[str, str | None] = {}
    starting: dict[str, dict[str, int]] = {}
    starts: dict[tuple[str, int], int] = {}
    reread = set()
    for topic in sorted(set(topics)):
        d = described.get(topic)
        ids[topic] = d.topic_id if d is not None else None
        if d is None:
            continue  # read from its first offset once it exists (Spark: a new partition starts at its earliest)
        offsets = starting[topic] = {}
        for p in d.partitions:
            prog = progress.get((topic, p))
            if prog is not None and prog.topic_id and d.topic_id and prog.topic_id != d.topic_id:
                reread.add(topic)
                prog = None
            offsets[str(p)] = prog.next_offset if prog is not None else EARLIEST
            starts[(topic, p)] = prog.next_offset if prog is not None else 0
    return StartPlan(ids, starting, starts, frozenset(reread))


def incarnation_changes(read_in: Mapping[str, str | None], now: Mapping[str, str | None | Exception]
                        ) -> tuple[dict[str, str], dict[str, str]]:
    """Pure: (the topics whose incarnation is no longer the one they are read
    in, with why; the topics missing when the run began that exist now, with
    the id they are read in from now on). ``read_in``: each topic's id at the
    start (None: missing, or no id kept); ``now``: its id now, None, or the
    exception met asking (LookupError: missing). Any other exception is
    raised: a read whose incarnation cannot be confirmed is not applied."""
    changed, appeared = {}, {}
    for topic, was in read_in.items():
        found = now.get(topic)
        if isinstance(found, LookupError):
            if was is not None:
                changed[topic] = "the topic was deleted"
        elif isinstance(found, Exception):
            raise found
        elif was is None:
            if found is not None:
                appeared[topic] = found
        elif found != was:
            changed[topic] = f"the topic was recreated (id {was}, now {found})"
    return changed, appeared


def read_kafka(spark: SparkSession, config: Config, topics: list[str], plan: StartPlan,
               options: Mapping[str, str], tasks: int) -> DataFrame:
    """The raw messages of ``topics`` (Spark's Kafka source columns), from
    ``plan``; ``options``: :func:`schemas.kafka.java_client_options`;
    ``tasks``: the read tasks a batch of fewer topic-partitions with rows is
    split into (Spark's ``minPartitions``)."""
    reader = (spark.readStream.format("kafka").options(**options)
              .option("subscribe", ",".join(topics))
              .option("startingOffsets", json.dumps(plan.starting_offsets) if plan.starting_offsets else "earliest")
              .option("maxOffsetsPerTrigger", str(config.consumer.max_offsets_per_trigger))
              .option("kafkaConsumer.pollTimeoutMs", str(round(config.consumer.poll_timeout * 1000)))
              .option("failOnDataLoss", "true" if config.consumer.on_data_loss == "stop" else "false")
              .option("includeHeaders", "true")
              # A batch of one partition (a shape's backlog) still reads and decodes on every core.
              .option("minPartitions", str(tasks))
              # Spark's consumers' group ids start with the group's name: its ACLs cover them.
              .option("groupIdPrefix", config.consumer.group))
    return reader.load().select("topic", "partition", "offset", "key", "value", "headers")
