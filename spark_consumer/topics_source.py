"""A Spark streaming source over many shape topics at once
(``spark.readStream.format("walbridge_shapes")``): what the consumer's one
query over every shape reads (``[consumer] queries = "one"``,
:mod:`spark_consumer.shapes_query`).

It is one :class:`~spark_consumer.kafka_source.ShapeStreamReader` per topic
behind one offset: ``{"<topic>": <that topic's offsets>, ...}``, each topic's
offsets exactly as the one-topic source writes them (partitions and the
topic's ``topic_id``), so every per-topic protection holds per topic: ranges
replayed exactly, an end below what was read or a changed topic id is the
broker's data loss (``on_data_loss``), a partition added joins empty.
Rows are the one-topic source's :data:`~spark_consumer.kafka_source.RAW_SCHEMA`;
``_wb_topic`` says whose they are.

Options: those of the one-topic source but ``topic``, plus ``topics`` (a JSON
list), ``starting_offsets`` (JSON ``{"<topic>": {"<partition>": next
offset}}``; a topic not listed starts at its earliest offsets) and ``rejoin``
(a JSON list of topics whose offsets in the checkpoint are not to be trusted:
they rejoin at their starting offsets).

Invariants:
- A topic joins the query (added since the checkpoint's last batch, or told
  to rejoin) at its starting offsets with an empty range, as a partition
  does: the batch's end offsets for it carry ``"joined": true`` and its
  messages are read from the next batch on. Starting offsets outside what
  the broker holds fail the query, or with ``on_data_loss=follow`` start
  the topic at its earliest offsets (the apply goes by position).
- A topic told to rejoin is read by no batch planned before it rejoined (a
  batch Spark re-runs from its log): its checkpointed offsets may lie beyond
  what the target applied (a shape held back, then a crash), and reading on
  from there would leave a gap.
- A topic not (or no longer) in ``topics`` is left out of every new offset and
  of the batches planned from now on; a replayed batch reads only the query's
  topics (the others' rows would be ignored by the apply anyway).
- ``max_offsets_per_trigger`` bounds the whole batch: each topic with a
  backlog gets a fair share (:func:`share_read_limit`), so a large snapshot
  bounds the batch without starving a small shape behind it.
- A batch's ranges are packed into tasks across topics, about
  ``SMALL_BATCH_OFFSETS`` offsets each (one task for a small batch), each
  task's ranges read with one assignment on one consumer
  (:func:`~spark_consumer.kafka_source.plan_tasks`,
  :func:`~spark_consumer.kafka_source.read_offset_ranges`).
- The driver's probes of all topics share one consumer and one admin client,
  and each trigger asks every topic's id, partitions and offsets in a few
  requests for all of them (:meth:`~spark_consumer.kafka_source.ProbeClients.prefetch`),
  then fetches the true end of every partition that moved, of every topic,
  in one assignment (:meth:`~spark_consumer.kafka_source.ProbeClients.probe_ends`):
  a trigger, idle or not, costs about the same for 5 topics as for 200 (one
  probe per topic, one after the other, was ~0.5 s per moved topic: 24.6 s
  of a 27.5 s trigger at 50 shapes).
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from typing import Any, Iterable, Iterator

from confluent_kafka import KafkaException
from pyspark.sql.datasource import DataSource, DataSourceStreamReader
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows, SupportsTriggerAvailableNow
from pyspark.sql.types import StructType

from spark_consumer.kafka_source import (
    RAW_SCHEMA,
    OffsetRange,
    OffsetRanges,
    ProbeClients,
    ShapeStreamReader,
    SourceOptions,
    fair_shares,
    offsets_from_json,
    plan_end_offsets,
    plan_tasks,
    read_offset_range,
    read_offset_ranges,
    recreated,
)

log = logging.getLogger(__name__)

SOURCE_NAME = "walbridge_shapes"
JOINED = "joined"  # in a topic's end offsets: it joins the query here, its range in this batch is empty
TopicsOffsets = dict[str, dict[str, Any]]  # topic -> that topic's offsets JSON


def topic_options(common: SourceOptions, topics: list[str], starting: dict[str, dict] | None) -> dict[str, SourceOptions]:
    """Each topic's one-topic source options: the common ones, its name and
    its starting offsets (earliest when not given)."""
    starting = starting or {}
    return {t: replace(common, topic=t, starting_offsets=json.dumps(starting[t]) if t in starting else "earliest")
            for t in topics}


def options_to_spark(common: SourceOptions, topics: list[str], starting: dict[str, dict] | None = None,
                     rejoin: list[str] | None = None) -> dict[str, str]:
    """The source's Spark options for ``topics`` read with ``common``'s settings."""
    out = {k: v for k, v in common.to_options().items() if k not in ("topic", "starting_offsets")}
    out["topics"] = json.dumps(list(topics))
    out["starting_offsets"] = json.dumps(starting or {})
    out["rejoin"] = json.dumps(sorted(rejoin or []))
    return out


def options_from_spark(options: dict[str, str]) -> tuple[dict[str, SourceOptions], set[str]]:
    """(each topic's source options, the topics told to rejoin)."""
    o = {k.lower(): v for k, v in options.items()}
    try:
        topics = json.loads(o.get("topics") or "[]")
        starting = json.loads(o.get("starting_offsets") or "{}")
        rejoin = json.loads(o.get("rejoin") or "[]")
    except ValueError as e:
        raise ValueError(f"{SOURCE_NAME}: options topics, starting_offsets and rejoin must be JSON ({e})") from None
    for name, value in (("topics", topics), ("rejoin", rejoin)):
        if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
            raise ValueError(f"{SOURCE_NAME}: option {name} must be a JSON list of topic names")
    if not topics:
        raise ValueError(f"{SOURCE_NAME}: option topics names no topic")
    if not isinstance(starting, dict):
        raise ValueError(f"{SOURCE_NAME}: option starting_offsets must be a JSON object by topic")
    common = SourceOptions.from_options({**o, "topic": topics[0], "starting_offsets": "earliest"})
    return topic_options(common, topics, starting), set(rejoin)


def read_ranges(start: TopicsOffsets | None, end: TopicsOffsets, topics: Iterable[str]
                ) -> Iterator[tuple[str, dict | None, dict]]:
    """(topic, start, end) of each of ``topics`` the batch ``start`` → ``end``
    reads: one that joins in it (``JOINED``, or absent from ``start`` after
    the first batch) reads nothing yet."""
    for topic in topics:
        if topic not in end or end[topic].get(JOINED) or (start is not None and topic not in start):
            continue
        yield topic, (start or {}).get(topic), end[topic]


def share_read_limit(start: TopicsOffsets, end: TopicsOffsets, max_rows: int) -> TopicsOffsets:
    """``end`` cut to at most ``max_rows`` offsets read in all: each topic's
    fair share (:func:`~spark_consumer.kafka_source.fair_shares`) spread over
    its partitions by backlog. Only partitions read on from ``start`` count and
    are cut; a topic that joins, or a new incarnation read from offset 0,
    keeps its end (rare, and bounded by what the broker held)."""
    moving: dict[str, tuple[dict[int, int], dict[int, int]]] = {}
    for t, e in end.items():
        if t not in start or e.get(JOINED) or recreated(start[t], e):
            continue
        begin, stop = offsets_from_json(start[t]), offsets_from_json(e)
        ahead = {p: b for p, b in begin.items() if stop.get(p, b) > b}
        if ahead:
            moving[t] = (ahead, stop)
    wants = {t: sum(stop[p] - b for p, b in ahead.items()) for t, (ahead, stop) in moving.items()}
    if sum(wants.values()) <= max_rows:
        return end
    out = dict(end)
    for t, share in fair_shares(wants, max_rows).items():
        ahead, stop = moving[t]
        cut = plan_end_offsets(ahead, stop, share)
        out[t] = {**end[t], **{str(p): o for p, o in cut.items()}}
    return out


class TopicsStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """See the module docstring: one reader per topic behind one offset."""

    def __init__(self, opts_by_topic: dict[str, SourceOptions], rejoin: set[str] | None = None):
        self._opts = opts_by_topic
        self._rejoin = set(rejoin or ())  # until the first latestOffset, which makes them join
        self._clients: ProbeClients | None = None
        self._readers: dict[str, ShapeStreamReader] | None = None

    def __getstate__(self) -> dict:
        return {"_opts": self._opts, "_rejoin": set(), "_clients": None, "_readers": None}

    def _each(self) -> dict[str, ShapeStreamReader]:
        if self._readers is None:
            first = next(iter(self._opts.values()))
            self._clients = ProbeClients(first.client_conf())
            self._readers = {t: ShapeStreamReader(o, self._clients) for t, o in self._opts.items()}
        return self._readers

    # -- driver
    def initialOffset(self) -> dict:
        readers = self._each()
        self._prefetch(readers)
        try:
            return {t: self._start_of(t) for t in readers}
        finally:
            self._clients.end_round()

    def _prefetch(self, probed: dict[str, ShapeStreamReader]) -> None:
        """Every topic's id, partitions and offsets, and the true ends of the
        ``probed`` topics' moved partitions, in a few requests for all of
        them: one round of answers for the topics' own probes."""
        try:
            self._clients.prefetch(list(self._each()))
        except (KafkaException, LookupError) as e:  # each topic's probe asks (and waits out) on its own
            log.info("asking for every topic's offsets at once failed (%s); asking per topic", e)
            return
        try:
            self._clients.probe_ends({t: r._probe() for t, r in probed.items()})
        except KafkaException as e:
            log.info("probing every topic's ends at once failed (%s); probing per topic", e)

    def _start_of(self, topic: str) -> dict:
        """The topic's offsets where it joins (its starting offsets)."""
        try:
            return self._each()[topic].initialOffset()
        except ValueError as e:  # starting offsets outside what the broker holds
            if self._opts[topic].on_data_loss != "follow":
                raise
            log.warning("%s; reading %s from its earliest offsets, applied by position", e, topic)
            return ShapeStreamReader(replace(self._opts[topic], starting_offsets="earliest"),
                                     self._clients).initialOffset()

    def getDefaultReadLimit(self) -> ReadLimit:
        return next(iter(self._each().values())).getDefaultReadLimit()

    def prepareForTriggerAvailableNow(self) -> None:
        for r in self._each().values():
            r.prepareForTriggerAvailableNow()

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        out = {}
        start = start or {}
        rejoin, self._rejoin = self._rejoin, set()
        readers = self._each()
        self._prefetch(readers)  # a joining topic's probe (its starting offsets) is one of the round's too
        # A row limit is the whole batch's: each topic looks at all it has, then the limit is shared.
        each_limit = ReadAllAvailable() if isinstance(limit, ReadMaxRows) else limit
        try:
            for t, r in readers.items():
                if t in start and t not in rejoin:
                    out[t] = r.latestOffset(start[t], each_limit)
                else:  # joins at its starting offsets, read from the next batch on
                    out[t] = {**self._start_of(t), JOINED: True}
                    log.info("topic %s %s the query at %s", t, "rejoins" if t in start else "joins", out[t])
        finally:
            self._clients.end_round()
        return share_read_limit(start, out, limit.max_rows) if isinstance(limit, ReadMaxRows) else out

    def reportLatestOffset(self) -> dict | None:
        reported = {t: r.reportLatestOffset() for t, r in self._each().items()}
        return {t: o for t, o in reported.items() if o is not None} or None

    def ranges(self, start: dict | None, end: dict) -> list[OffsetRange]:
        """The batch's offset ranges, before they are packed into tasks."""
        ranges: list[OffsetRange] = []
        readers = self._each()
        for t, first, last in read_ranges(start, end, [t for t in readers if t not in self._rejoin]):
            ranges += readers[t].ranges(first, last)
        return ranges

    def partitions(self, start: dict, end: dict) -> list:
        ranges = self.ranges(start, end)
        if any(o.max_offsets_per_task for o in self._opts.values()):
            return ranges
        return plan_tasks(ranges)

    def commit(self, end: dict) -> None:
        """Nothing to do: the apply commits group offsets after the target commits."""

    def stop(self) -> None:
        for r in (self._readers or {}).values():
            r.stop()
        if self._clients is not None:
            self._clients.close()

    # -- executors
    def read(self, partition: OffsetRange | OffsetRanges) -> Iterator[Any]:
        if isinstance(partition, OffsetRanges):
            return read_offset_ranges(self._opts.__getitem__, partition.ranges)
        return read_offset_range(self._opts[partition.topic], partition)


class TopicsDataSource(DataSource):
    """``spark.readStream.format("walbridge_shapes")``: many shape topics, one
    row per message in :data:`~spark_consumer.kafka_source.RAW_SCHEMA`."""

    @classmethod
    def name(cls) -> str:
        return SOURCE_NAME

    def __init__(self, options: dict[str, str]):
        super().__init__(options)
        self._opts, self._rejoin = options_from_spark(dict(options))

    def schema(self) -> StructType:
        return RAW_SCHEMA

    def streamReader(self, schema: StructType) -> TopicsStreamReader:
        if schema.simpleString() != RAW_SCHEMA.simpleString():
            raise ValueError(f"{SOURCE_NAME} has a fixed schema ({RAW_SCHEMA.simpleString()}); "
                             f"do not pass one (got {schema.simpleString()})")
        return TopicsStreamReader(self._opts, self._rejoin)


def read_topics_stream(spark, common: SourceOptions, topics: list[str], starting: dict[str, dict] | None = None,
                       rejoin: list[str] | None = None):
    """The streaming DataFrame of the messages of ``topics`` as they are."""
    spark.dataSource.register(TopicsDataSource)
    return spark.readStream.format(SOURCE_NAME).options(
        **options_to_spark(common, topics, starting, rejoin)).load()
