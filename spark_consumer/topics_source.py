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
list) and ``starting_offsets`` (JSON ``{"<topic>": {"<partition>": next
offset}}``; a topic not listed starts at its earliest offsets).

Invariants:
- A topic joins the query (its first batch, or added since the checkpoint's
  last batch) at its starting offsets with an empty range, as a partition
  does: its messages are read from the next batch on.
- A topic not (or no longer) in ``topics`` is left out of every new offset and
  of the batches planned from now on; a replayed batch reads only the query's
  topics (the others' rows would be ignored by the apply anyway).
- ``max_offsets_per_trigger`` bounds each topic's share of a batch, not the
  whole batch (a first cut: a batch holds at most that many offsets per topic).
- Small batches are bundled across topics: all ranges of a batch holding at
  most ``SMALL_BATCH_OFFSETS`` offsets together are read by one task.
- The driver's probes of all topics share one consumer and one admin client.
"""

from __future__ import annotations

import itertools
import json
import logging
from dataclasses import replace
from typing import Any, Iterator

from pyspark.sql.datasource import DataSource, DataSourceStreamReader
from pyspark.sql.streaming.datasource import ReadLimit, SupportsTriggerAvailableNow
from pyspark.sql.types import StructType

from spark_consumer.kafka_source import (
    RAW_SCHEMA,
    OffsetRange,
    OffsetRanges,
    ProbeClients,
    ShapeStreamReader,
    SourceOptions,
    bundle_small,
    read_offset_range,
)

log = logging.getLogger(__name__)

SOURCE_NAME = "walbridge_shapes"
TopicsOffsets = dict[str, dict[str, Any]]  # topic -> that topic's offsets JSON


def topic_options(common: SourceOptions, topics: list[str], starting: dict[str, dict] | None) -> dict[str, SourceOptions]:
    """Each topic's one-topic source options: the common ones, its name and
    its starting offsets (earliest when not given)."""
    starting = starting or {}
    return {t: replace(common, topic=t, starting_offsets=json.dumps(starting[t]) if t in starting else "earliest")
            for t in topics}


def options_to_spark(common: SourceOptions, topics: list[str], starting: dict[str, dict] | None = None
                     ) -> dict[str, str]:
    """The source's Spark options for ``topics`` read with ``common``'s settings."""
    out = {k: v for k, v in common.to_options().items() if k not in ("topic", "starting_offsets")}
    out["topics"] = json.dumps(list(topics))
    out["starting_offsets"] = json.dumps(starting or {})
    return out


def options_from_spark(options: dict[str, str]) -> dict[str, SourceOptions]:
    o = {k.lower(): v for k, v in options.items()}
    try:
        topics = json.loads(o.get("topics") or "[]")
        starting = json.loads(o.get("starting_offsets") or "{}")
    except ValueError as e:
        raise ValueError(f"{SOURCE_NAME}: options topics and starting_offsets must be JSON ({e})") from None
    if not isinstance(topics, list) or not topics or not all(isinstance(t, str) for t in topics):
        raise ValueError(f"{SOURCE_NAME}: option topics must be a non-empty JSON list of topic names")
    if not isinstance(starting, dict):
        raise ValueError(f"{SOURCE_NAME}: option starting_offsets must be a JSON object by topic")
    common = SourceOptions.from_options({**o, "topic": topics[0], "starting_offsets": "earliest"})
    return topic_options(common, topics, starting)


def joined(start: TopicsOffsets | None, end: TopicsOffsets) -> set[str]:
    """The topics that join the query in the batch ``start`` → ``end``."""
    return set(end) - set(start or {}) if start is not None else set()


class TopicsStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """See the module docstring: one reader per topic behind one offset."""

    def __init__(self, opts_by_topic: dict[str, SourceOptions]):
        self._opts = opts_by_topic
        self._clients: ProbeClients | None = None
        self._readers: dict[str, ShapeStreamReader] | None = None

    def __getstate__(self) -> dict:
        return {"_opts": self._opts, "_clients": None, "_readers": None}

    def _each(self) -> dict[str, ShapeStreamReader]:
        if self._readers is None:
            first = next(iter(self._opts.values()))
            self._clients = ProbeClients(first.client_conf())
            self._readers = {t: ShapeStreamReader(o, self._clients) for t, o in self._opts.items()}
        return self._readers

    # -- driver
    def initialOffset(self) -> dict:
        return {t: r.initialOffset() for t, r in self._each().items()}

    def getDefaultReadLimit(self) -> ReadLimit:
        return next(iter(self._each().values())).getDefaultReadLimit()

    def prepareForTriggerAvailableNow(self) -> None:
        for r in self._each().values():
            r.prepareForTriggerAvailableNow()

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        out = {}
        start = start or {}
        for t, r in self._each().items():
            if t in start:
                out[t] = r.latestOffset(start[t], limit)
            else:  # joins at its starting offsets, read from the next batch on
                out[t] = r.initialOffset()
                log.info("topic %s joins the query at %s", t, out[t])
        return out

    def reportLatestOffset(self) -> dict | None:
        reported = {t: r.reportLatestOffset() for t, r in self._each().items()}
        return {t: o for t, o in reported.items() if o is not None} or None

    def partitions(self, start: dict, end: dict) -> list:
        ranges: list[OffsetRange] = []
        new = joined(start, end)
        for t, r in self._each().items():
            if t in end and t not in new:
                ranges += r.ranges((start or {}).get(t), end[t])
        if any(o.max_offsets_per_task for o in self._opts.values()):
            return ranges
        return bundle_small(ranges)

    def commit(self, end: dict) -> None:
        """Nothing to do: the apply commits group offsets after the target commits."""

    def stop(self) -> None:
        for r in (self._readers or {}).values():
            r.stop()
        if self._clients is not None:
            self._clients.close()

    # -- executors
    def read(self, partition: OffsetRange | OffsetRanges) -> Iterator[Any]:
        ranges = partition.ranges if isinstance(partition, OffsetRanges) else (partition,)
        return itertools.chain.from_iterable(read_offset_range(self._opts[r.topic], r) for r in ranges)


class TopicsDataSource(DataSource):
    """``spark.readStream.format("walbridge_shapes")``: many shape topics, one
    row per message in :data:`~spark_consumer.kafka_source.RAW_SCHEMA`."""

    @classmethod
    def name(cls) -> str:
        return SOURCE_NAME

    def __init__(self, options: dict[str, str]):
        super().__init__(options)
        self._opts = options_from_spark(dict(options))

    def schema(self) -> StructType:
        return RAW_SCHEMA

    def streamReader(self, schema: StructType) -> TopicsStreamReader:
        if schema.simpleString() != RAW_SCHEMA.simpleString():
            raise ValueError(f"{SOURCE_NAME} has a fixed schema ({RAW_SCHEMA.simpleString()}); "
                             f"do not pass one (got {schema.simpleString()})")
        return TopicsStreamReader(self._opts)


def read_topics_stream(spark, common: SourceOptions, topics: list[str], starting: dict[str, dict] | None = None):
    """The streaming DataFrame of the messages of ``topics`` as they are."""
    spark.dataSource.register(TopicsDataSource)
    return spark.readStream.format(SOURCE_NAME).options(**options_to_spark(common, topics, starting)).load()
