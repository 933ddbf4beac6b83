"""A Spark Structured Streaming source for one walbridge shape topic, built on
confluent-kafka (a Python data source: no Kafka jar is needed).

Use::

    from spark_consumer.kafka_source import read_shape_stream

    df = read_shape_stream(spark, "wb.public.orders", bootstrap_servers="broker:9092",
                           topic_prefix="wb", schema_registry_url=None,
                           kafka_client={"security.protocol": "SSL"},
                           max_offsets_per_trigger=50_000)
    query = df.writeStream.foreachBatch(apply).option("checkpointLocation", ...).start()

The source itself is schema-free: ``spark.readStream.format("walbridge_shape")``
(:func:`read_raw_stream`) yields one row per message as it is on the wire
(:data:`RAW_SCHEMA`: ``_wb_topic``, ``_wb_partition``, ``_wb_offset``,
``_wb_key``, ``_wb_value``, ``_wb_headers``), so a new writer schema never
needs a new stream. Decoding is a ``mapInArrow`` over those rows
(:func:`decode_batches`, on the executors, with the compiled decoder) into the
typed layout of a :class:`ShapeSchemas` (rows and columns: see
:mod:`spark_consumer.decode`). The consumer job decides each micro-batch's
layout in its ``foreachBatch``; ``read_shape_stream`` gives a typed stream
whose layout is fixed when it is called.

Options (all strings): ``topic``, ``bootstrap_servers``, ``topic_prefix`` (for
``<prefix>._schemas``), ``schema_registry_url`` (optional),
``schema_registry_secrets`` (JSON object of further Schema Registry client
settings, credentials among them: Spark redacts options so named),
``subject_name_strategy`` (``topic`` (default), ``record``, ``topic_record``),
``kafka_client`` (JSON object of extra librdkafka settings), ``max_offsets_per_trigger`` (alias
``maxOffsetsPerTrigger``), ``starting_offsets`` (``earliest`` (default),
``latest``, or JSON ``{"<partition>": next offset}``, unlisted partitions earliest;
an offset outside [earliest, end] is an error, never silently moved),
``max_offsets_per_task`` (cut a partition's range into tasks of at most this
many offsets; default: the batch's ranges packed into tasks of about
``SMALL_BATCH_OFFSETS`` offsets, :func:`plan_tasks`), ``read_idle_timeout_s``
(default 120: a task that gets no message for that long fails), ``on_data_loss``
(``fail`` (default) or ``follow``, see below).

Schema discovery (:func:`discover_schemas`, in the driver's process): the
newest value schema (registry: the latest version of the value subject the
strategy names, ``<topic>-value`` by default; without a registry: the last
``<prefix>._schemas`` record whose ``wb.subject`` header is ``<topic>-value``)
defines the layout, and the newest key schema marks the key columns. Every
value schema version existing at that moment is "known" (older messages are
read into the newest by name), and all value/key schemas found are handed to
the executors with the decode function. With ``mark_new_schemas`` (the job's
decode), a message written with any value schema not known then ends its
task's output with a ``new_schema`` row: the driver discovers again and
decodes the batch anew. Without it (``read_shape_stream``), a schema published
later that adds or retypes a column fails the task with ``SchemaChangedError``.

Invariants:
- Offsets are ``{"<partition>": next offset, "topic_id": id}`` (partitions
  sorted numerically; the id where the broker has topic ids). Each
  micro-batch is the fixed range [start, end) per partition that Spark wrote to
  its offset log, so a replayed batch reads exactly the same messages: ``read``
  takes every message with start <= offset < end and stops, whatever arrived since.
- An end offset is never beyond what the broker has: ends come from the high
  watermark of a Fetch response (the probe fetches each non-empty partition from
  its reported end - 1), never from ListOffsets alone, because Tansu's
  ListOffsets reports the last batch's base offset + 1. The probe's result is
  never below ListOffsets', so nothing is lost on brokers that report right, and
  nothing is stranded on Tansu. A partition whose reported end has not moved
  since its last probe keeps that probe's end (no Fetch while idle). An end that stays below what was already read
  (asked again 3 times, 1 s apart), or a topic id that changed, means the
  broker lost data (the topic was recreated): with ``on_data_loss=fail`` the
  query stops with an error; with ``follow`` the next batch reads the new
  incarnation from offset 0 (a changed id, or an end below the start, marks the
  reset), for an apply that writes by position (walbridge's does). A topic that
  is briefly missing yields no new data with ``follow``. A read task hands
  its rows over only after checking that the topic id it was planned with
  still stands (a consumer would read on into a new incarnation by offset).
  Without topic ids, a
  new incarnation that outgrew the read offsets before the first look cannot
  be told from the old one: ``walbridge reconcile`` finds what that skipped.
- Read limits: ``ReadMaxRows`` (``max_offsets_per_trigger``) is shared across
  partitions in proportion to their backlog; ``Trigger.AvailableNow`` records the
  ends at its start and never reads beyond them. A partition added to the topic
  joins with an empty range at its earliest offset and is read from the next batch.
- A task reads all its ranges (one or several, of one topic or many:
  :func:`plan_tasks`) with one assignment on one consumer, each
  partition with its own bookkeeping: read from its range's start, fetched
  once more from its next offset before a skip is taken as the log's own
  (compaction), done at its range's end (or at an end of partition that
  reaches it), then unassigned. A message outside the range is never handed over.
- Clients are created lazily where they are used: the end-offset probe in the
  driver's long-lived Python process, consumers and the DLQ producer in executor
  workers (cached per worker process, reused across tasks). Nothing with a
  socket is pickled.
- A message that cannot be decoded is produced by :func:`decode_batches` to
  ``<topic>.dlq`` (created if missing) with its key, value and headers plus
  ``wb.dlq.error``, ``wb.dlq.topic``, ``wb.dlq.partition`` and
  ``wb.dlq.offset``; the task flushes the DLQ before it completes (a failed
  delivery fails the task), and the decoded rows get a ``_wb_control = 'dlq'``
  row for it. A replayed batch, or one decoded again for a new writer schema,
  may send it again: the DLQ is at-least-once, deduplicate by the origin headers.
- The raw rows are the messages exactly: decoding a batch twice (a new writer
  schema) reads the same offsets and yields the same rows but for the layout.
  ``read_dead_letters`` reads it back (its length is the count).
- ``commit`` does nothing: group offsets are committed by the apply step after
  the target transaction commits (Spark only commits batch N-1 while planning N).
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import json
import logging
import time
from contextlib import closing
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import pyarrow as pa
from confluent_kafka import Consumer, IsolationLevel, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec
from confluent_kafka.schema_registry.error import SchemaRegistryError
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    ReadMinRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import ArrayType, BinaryType, IntegerType, LongType, StringType, StructField, StructType

from schemas import wire
from schemas.config import redact_dsn
from schemas.failures import READ_GAP
from schemas.kafka import ask_topic_ids, client_config, ensure_topics, read_to_end, topic_ids
from schemas.kafka import topic_id as describe_topic_id
from schemas.reader import SchemaResolver, read_schemas_topic
from schemas.registry import STRATEGIES, data_subjects, subject_versions
from spark_consumer.decode import (
    BatchBuilder,
    SchemaChangedError,
    ShapeLayout,
    UndecodableMessage,
    WriterSchemas,
    schema_ref_key,
)

log = logging.getLogger(__name__)

SOURCE_NAME = "walbridge_shape"
ARROW_BATCH_ROWS = 8192
CONSUME_BATCH = 5000
RANGE_CONSUME_WAIT_S = 1.0  # one consume() call of a range read
RANGE_FETCH_QUEUE_BACKOFF_MS = 10  # librdkafka fetch.queue.backoff.ms of the range consumers (see _range_consumer)
RANGE_CONSUMERS_KEPT = 8  # per Python worker: one per query run and client config
METADATA_TIMEOUT_S = 5.0  # a range consumer's request for every topic's metadata
RANGE_FETCH_WAIT_MS = 50  # librdkafka fetch.wait.max.ms of the executors' range consumers (10 ms livelocked on Tansu)
# librdkafka fetch.wait.max.ms of the driver's probe consumer. A probe starts at
# a message that exists, so its own fetch answers at once; but the fetch after
# it (from the end, nothing there) is held by the broker this long, and the
# shared consumer's next probe (another topic's partitions) waits for it: with
# librdkafka's 500 ms, one query over 50 topics spent 24.6 s of a 27.5 s
# trigger in latestOffset (bench/RESULTS.md, issue 17).
PROBE_FETCH_WAIT_MS = 50
LOST_DATA_RETRIES = 3
# A batch of at most this many offsets is read by one task (all its partitions
# in one assignment), a larger one by tasks of about this many: each task's
# fixed cost (a Python worker's turn, the topic-id looks, a fresh consumer's
# first fetch of a topic, ~1 s) dominates small reads, and every shape's query
# shares the same few cores (bench/RESULTS.md, "End-to-end latency", "Many shapes").
SMALL_BATCH_OFFSETS = 10_000
# A task hands its rows over after a look at their topics' incarnations, at
# least once per this many rows read (and at the end).
HELD_ROWS = SMALL_BATCH_OFFSETS

# What the source yields: one row per message, as it is on the wire. Decoding
# happens per micro-batch (decode_batches), so a new writer schema never
# needs a new stream.
RAW_SCHEMA = StructType([
    StructField("_wb_topic", StringType(), nullable=False),
    StructField("_wb_partition", IntegerType(), nullable=False),
    StructField("_wb_offset", LongType(), nullable=False),
    StructField("_wb_key", BinaryType()),
    StructField("_wb_value", BinaryType()),
    StructField("_wb_headers", ArrayType(StructType([StructField("key", StringType()),
                                                     StructField("value", BinaryType())]), containsNull=False)),
])
RAW_ARROW_SCHEMA = to_arrow_schema(RAW_SCHEMA)


# ------------------------------------------------------------------ options
@dataclass(frozen=True)
class SourceOptions:
    topic: str
    bootstrap_servers: str
    topic_prefix: str | None = None
    schema_registry_url: str | None = None
    schema_registry_client: dict[str, Any] = field(default_factory=dict)  # credentials among them
    subject_name_strategy: str = "topic"
    kafka_client: dict[str, Any] = field(default_factory=dict)
    max_offsets_per_trigger: int | None = None
    starting_offsets: str = "earliest"
    max_offsets_per_task: int | None = None
    read_idle_timeout_s: float = 120.0
    on_data_loss: str = "fail"  # or "follow"
    # The query run this source serves: a restarted query reads its ranges
    # (a replay among them) with range consumers of its own, never with a
    # consumer whose state an interrupted run left behind.
    run: str = ""

    @classmethod
    def from_options(cls, options: dict[str, str]) -> SourceOptions:
        o = {k.lower(): v for k, v in options.items()}
        missing = [k for k in ("topic", "bootstrap_servers") if not o.get(k)]
        if missing:
            raise ValueError(f"{SOURCE_NAME}: missing option(s) {', '.join(missing)}")
        limit = o.get("max_offsets_per_trigger") or o.get("maxoffsetspertrigger")
        client = json.loads(o["kafka_client"]) if o.get("kafka_client") else {}
        registry_client = json.loads(o["schema_registry_secrets"]) if o.get("schema_registry_secrets") else {}
        if not isinstance(client, dict) or not isinstance(registry_client, dict):
            raise ValueError(f"{SOURCE_NAME}: options kafka_client and schema_registry_secrets must be JSON objects")
        opts = cls(topic=o["topic"], bootstrap_servers=o["bootstrap_servers"],
                   topic_prefix=o.get("topic_prefix") or None,
                   schema_registry_url=o.get("schema_registry_url") or None,
                   schema_registry_client=registry_client,
                   subject_name_strategy=o.get("subject_name_strategy") or "topic", kafka_client=client,
                   max_offsets_per_trigger=int(limit) if limit else None,
                   starting_offsets=o.get("starting_offsets") or "earliest",
                   max_offsets_per_task=int(o["max_offsets_per_task"]) if o.get("max_offsets_per_task") else None,
                   read_idle_timeout_s=float(o.get("read_idle_timeout_s") or 120.0),
                   on_data_loss=o.get("on_data_loss") or "fail", run=o.get("run") or "")
        if opts.on_data_loss not in ("fail", "follow"):
            raise ValueError(f"{SOURCE_NAME}: on_data_loss must be 'fail' or 'follow', not {opts.on_data_loss!r}")
        if opts.subject_name_strategy not in STRATEGIES:
            raise ValueError(f"{SOURCE_NAME}: subject_name_strategy must be one of {', '.join(STRATEGIES)}, "
                             f"not {opts.subject_name_strategy!r}")
        for name in ("max_offsets_per_trigger", "max_offsets_per_task"):
            if getattr(opts, name) is not None and getattr(opts, name) < 1:
                raise ValueError(f"{SOURCE_NAME}: {name} must be >= 1")
        return opts

    def to_options(self) -> dict[str, str]:
        out = {"topic": self.topic, "bootstrap_servers": self.bootstrap_servers,
               "starting_offsets": self.starting_offsets, "read_idle_timeout_s": str(self.read_idle_timeout_s),
               "on_data_loss": self.on_data_loss}
        if self.topic_prefix:
            out["topic_prefix"] = self.topic_prefix
        if self.schema_registry_url:
            out["schema_registry_url"] = self.schema_registry_url
            out["subject_name_strategy"] = self.subject_name_strategy
        if self.schema_registry_client:
            out["schema_registry_secrets"] = json.dumps(self.schema_registry_client)
        if self.kafka_client:
            out["kafka_client"] = json.dumps(self.kafka_client)
        if self.max_offsets_per_trigger is not None:
            out["max_offsets_per_trigger"] = str(self.max_offsets_per_trigger)
        if self.max_offsets_per_task is not None:
            out["max_offsets_per_task"] = str(self.max_offsets_per_task)
        if self.run:
            out["run"] = self.run
        return out

    def client_conf(self) -> dict[str, Any]:
        """Settings of a client made where it runs (driver or executor): it logs
        through Python logging there, never straight to stderr."""
        return client_config(self.bootstrap_servers, self.kafka_client)

    def registry(self) -> dict[str, Any] | None:
        """The Schema Registry client settings, or None without a registry."""
        if not self.schema_registry_url:
            return None
        return {"url": self.schema_registry_url, **self.schema_registry_client}


# ---------------------------------------------------------- schema discovery
@dataclass(frozen=True)
class ShapeSchemas:
    """What a stream decodes with: the layout's value/key schemas, the refs
    (``id:<n>`` / ``fp:<hex>``) of value schemas known at discovery, and every
    value/key writer schema of the topic found then, by ref, handed to the
    executors (they look up only schemas published later)."""

    value_schema: dict
    key_schema: dict | None = None
    known_value_refs: tuple[str, ...] = ()
    writer_schemas: dict[str, dict] = field(default_factory=dict)

    def layout(self) -> ShapeLayout:
        return ShapeLayout.from_schemas(self.value_schema, self.key_schema)


def discover_schemas(opts: SourceOptions, timeout: float = 30.0,
                     records: list[tuple[str, str, dict]] | None = None) -> ShapeSchemas:
    """The shape's newest value schema (and key schema) from the registry or
    the ``<prefix>._schemas`` topic (or ``records`` already read from it:
    :func:`read_schemas_records`). Raises ``LookupError`` when the topic has
    no value schema yet (the producer publishes it before the first message)."""
    value_subject, key_subject = f"{opts.topic}-value", f"{opts.topic}-key"
    registry = opts.registry()
    if registry is not None:
        value_subject, key_subject = data_subjects(opts.subject_name_strategy, opts.topic)
        values = subject_versions(registry, value_subject)
        if not values:
            raise LookupError(f"no schema under subject {value_subject!r} in {redact_dsn(registry['url'])}: "
                              "has the producer published this shape yet?")
        keys = subject_versions(registry, key_subject)
        return ShapeSchemas(values[-1][2], keys[-1][2] if keys else None,
                            tuple(f"id:{i}" for _, i, _ in values),
                            {f"id:{schema_id}": schema for _, schema_id, schema in values + keys})
    if not opts.topic_prefix:
        raise ValueError(f"{SOURCE_NAME}: without schema_registry_url the option topic_prefix is needed "
                         "(schemas live in <topic_prefix>._schemas)")
    if records is None:
        records = read_schemas_records(opts, timeout)
    values = [(fp, s) for subject, fp, s in records if subject == value_subject]
    keys = [(fp, s) for subject, fp, s in records if subject == key_subject]
    if not values:
        raise LookupError(f"no schema for subject {value_subject!r} in {opts.topic_prefix}{wire.SCHEMAS_TOPIC_SUFFIX}: "
                          "has the producer published this shape yet?")
    return ShapeSchemas(values[-1][1], keys[-1][1] if keys else None,
                        tuple(dict.fromkeys(f"fp:{fp}" for fp, _ in values)),
                        {f"fp:{fp}": schema for fp, schema in values + keys})


def read_schemas_records(opts: SourceOptions, timeout: float = 30.0) -> list[tuple[str, str, dict]]:
    """Every record of ``<prefix>._schemas`` (:func:`schemas.reader.read_schemas_topic`)."""
    # On the driver, at the query's start: librdkafka's records go through Python logging.
    conf = client_config(opts.bootstrap_servers, opts.kafka_client)
    return read_schemas_topic(conf, wire.schemas_topic(opts.topic_prefix), timeout)


# ---------------------------------------------------------- offset planning
Offsets = dict[int, int]


TOPIC_ID = "topic_id"


def offsets_to_json(offsets: Offsets, topic_id: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {str(p): int(offsets[p]) for p in sorted(offsets)}
    if topic_id:
        out[TOPIC_ID] = topic_id
    return out


def offsets_from_json(offsets: dict | None) -> Offsets:
    """Partition -> offset; other keys (``topic_id``, a many-topic source's
    marks) are not partitions."""
    return {int(p): int(o) for p, o in (offsets or {}).items() if p.isdigit()}


def recreated(start: dict | None, end: dict | None) -> bool:
    """Do two offsets of a query belong to different incarnations of the topic?"""
    a, b = (start or {}).get(TOPIC_ID), (end or {}).get(TOPIC_ID)
    return bool(a and b and a != b)


def plan_end_offsets(start: Offsets, available: Offsets, max_rows: int | None) -> Offsets:
    """The end of the next batch for each partition of ``start``: everything
    up to ``available`` or, when that exceeds ``max_rows`` offsets in total, a
    share of ``max_rows`` proportional to each partition's backlog (largest
    remainders get the leftover). Never below start, never above available."""
    lag = {p: max(0, available.get(p, s) - s) for p, s in start.items()}
    total = sum(lag.values())
    if max_rows is None or total <= max_rows:
        return {p: start[p] + lag[p] for p in start}
    shares = {p: lag[p] * max_rows // total for p in start}
    leftover = max_rows - sum(shares.values())
    by_remainder = sorted((p for p in start if shares[p] < lag[p]),
                          key=lambda p: (-(lag[p] * max_rows % total), p))
    for p in by_remainder[:leftover]:
        shares[p] += 1
    return {p: start[p] + shares[p] for p in start}


def fair_shares(wants: dict[Any, int], max_rows: int) -> dict[Any, int]:
    """Max-min fair shares of ``max_rows``: each key gets what it wants or an
    equal share of what is left, whichever is less, smallest wants first, so
    a large backlog never starves a small one and nothing is left unused
    while some key wants more (but integer remainders)."""
    shares, left = {}, max_rows
    waiting = sorted(wants, key=lambda k: (wants[k], str(k)))
    for i, k in enumerate(waiting):
        shares[k] = min(wants[k], left // (len(waiting) - i))
        left -= shares[k]
    return shares


@dataclass
class OffsetRange(InputPartition):
    """One Spark task: the messages of ``topic[partition]`` with
    ``start <= offset < end``, in the topic incarnation ``topic_id`` (if known)."""

    topic: str
    partition: int
    start: int
    end: int
    topic_id: str | None = None

    def __post_init__(self) -> None:
        InputPartition.__init__(self, (self.topic, self.partition, self.start, self.end, self.topic_id))


@dataclass
class OffsetRanges(InputPartition):
    """One Spark task reading several :class:`OffsetRange` together (:func:`plan_tasks`)."""

    ranges: tuple[OffsetRange, ...]

    def __post_init__(self) -> None:
        InputPartition.__init__(self, tuple(r.value for r in self.ranges))


def plan_tasks(ranges: list[OffsetRange], task_offsets: int = SMALL_BATCH_OFFSETS) -> list:
    """The batch's Spark tasks: ``ranges`` packed into ``ceil(offsets /
    task_offsets)`` tasks (at most one per range) of near-equal offsets, the
    largest range first onto the task holding fewest; a task of several ranges
    is an :class:`OffsetRanges`, read in one assignment. So a small batch is one
    task, and a large one over many topics does not pay a task's fixed cost per
    partition (200 one-partition tasks were most of a 50-shape snapshot:
    bench/RESULTS.md, "Many shapes")."""
    total = sum(r.end - r.start for r in ranges)
    count = min(len(ranges), -(-total // task_offsets))
    if count == len(ranges):
        return list(ranges)
    tasks: list[tuple[int, int, list[OffsetRange]]] = [(0, i, []) for i in range(count)]  # (offsets, order, ranges)
    for r in sorted(ranges, key=lambda r: r.end - r.start, reverse=True):
        held, order, group = heapq.heappop(tasks)
        group.append(r)
        heapq.heappush(tasks, (held + r.end - r.start, order, group))
    groups = [g for _, _, g in sorted(tasks, key=lambda t: t[1])]
    return [OffsetRanges(tuple(sorted(g, key=lambda r: (r.topic, r.partition)))) if len(g) > 1 else g[0]
            for g in groups]


def plan_ranges(topic: str, start: Offsets, end: Offsets, max_per_task: int | None = None,
                topic_id: str | None = None) -> list[OffsetRange]:
    """The tasks of a batch: each partition's non-empty range, cut into
    consecutive near-equal pieces of at most ``max_per_task`` offsets when set
    (default: one task per partition). A partition absent from ``start``
    (added to the topic in this batch) has an empty range by construction. An
    end below the start marks a partition the broker lost and recreated: it is
    read from offset 0."""
    tasks = []
    for p in sorted(end):
        if p not in start or end[p] == start[p]:
            continue
        s, e = (start[p], end[p]) if end[p] > start[p] else (0, end[p])
        if e == s:
            continue
        pieces = 1 if not max_per_task else -(-(e - s) // max_per_task)
        bounds = [s + (e - s) * i // pieces for i in range(pieces)] + [e]
        tasks += [OffsetRange(topic, p, a, b, topic_id) for a, b in zip(bounds, bounds[1:])]
    return tasks


# ------------------------------------------------------------- driver side
class ProbeClients:
    """The driver's Kafka clients for probing ends and topic ids, created on
    first use: one pair per topic's probe, or one pair shared by the probes
    of many topics (used one after the other, never at once).

    For many topics, :meth:`prefetch` asks every topic's id, partitions and
    reported (earliest, end) offsets in four requests for one round of
    probes, instead of a few requests per topic; :meth:`end_round` forgets
    them. A topic's answer may be the error a per-topic request would raise."""

    def __init__(self, conf: dict[str, Any]):
        self._conf = conf
        self._consumer = None
        self._admin = None
        self.round_ids: dict[str, Any] | None = None  # topic -> id, None or the error
        self.round_reported: dict[str, Any] | None = None  # topic -> {partition: (earliest, end)} or the error
        self.round_probed: dict[tuple[str, int], int] | None = None  # (topic, partition) -> high watermark fetched

    def prefetch(self, topics: list[str], timeout: float = 30.0) -> None:
        admin = self.admin()
        ids_asked = ask_topic_ids(admin, topics)  # in flight with the offsets' requests below
        meta = self.consumer().list_topics(timeout=timeout).topics
        reported: dict[str, Any] = {}
        for t in topics:
            m = meta.get(t)
            if m is None or m.error is not None or not m.partitions:
                reported[t] = LookupError(f"topic {t} does not exist or has no partitions "
                                          f"({m.error if m is not None else 'not in metadata'})")
            else:
                reported[t] = {p: [0, 0] for p in sorted(m.partitions)}
        tps = [TopicPartition(t, p) for t, ps in reported.items() if isinstance(ps, dict) for p in ps]
        asked = [admin.list_offsets({tp: spec for tp in tps}, isolation_level=IsolationLevel.READ_COMMITTED,
                                    request_timeout=timeout)
                 for spec in (OffsetSpec.earliest(), OffsetSpec.latest())] if tps else []
        ids = ids_asked(timeout)
        for i, futures in enumerate(asked):
            for tp, future in futures.items():
                if not isinstance(reported[tp.topic], dict):
                    continue
                try:
                    reported[tp.topic][tp.partition][i] = future.result().offset
                except KafkaException as e:
                    reported[tp.topic] = e
        self.round_ids = ids
        self.round_reported = {t: {p: (lo, hi) for p, (lo, hi) in v.items()} if isinstance(v, dict) else v
                               for t, v in reported.items()}

    def probe_ends(self, ends: dict[str, PartitionEnds], timeout: float = 30.0) -> None:
        """After :meth:`prefetch`: fetch the true end of every partition of
        ``ends``' topics that its probe would fetch this round
        (:meth:`PartitionEnds.to_probe`), all at once on the shared consumer:
        one assignment, one fetch round, instead of one per topic one after
        the other. A partition that does not answer in time is left to its
        topic's own probe."""
        wanted: dict[tuple[str, int], int] = {}
        for topic, pe in ends.items():
            try:
                wanted.update({(topic, p): hi for p, hi in pe.to_probe().items()})
            except (LookupError, KafkaException):
                continue  # its own probe raises (or waits out) the error
        self.round_probed = {}
        if wanted:
            self.round_probed = fetch_ends(self.consumer(), {tp: hi - 1 for tp, hi in wanted.items()}, timeout)

    def end_round(self) -> None:
        self.round_ids = self.round_reported = self.round_probed = None

    def consumer(self):
        if self._consumer is None:
            self._consumer = Consumer({
                **self._conf, "group.id": wire.reader_group("probe"),
                "enable.auto.commit": False, "enable.partition.eof": True, "auto.offset.reset": "latest",
                "max.partition.fetch.bytes": 65536, "queued.max.messages.kbytes": 4096,
                "fetch.wait.max.ms": PROBE_FETCH_WAIT_MS})
        return self._consumer

    def admin(self):
        if self._admin is None:
            self._admin = AdminClient(self._conf)
        return self._admin

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
        self._admin = None


_NOT_FETCHED = object()


def _of_round(answers: dict[str, Any] | None, topic: str) -> Any:
    """A topic's prefetched answer (raised if it is an error), or _NOT_FETCHED."""
    if answers is None or topic not in answers:
        return _NOT_FETCHED
    found = answers[topic]
    if isinstance(found, Exception):
        raise found
    return found


class PartitionEnds:
    """The driver's view of the topic: partitions, earliest offsets and true end
    offsets (see the module invariants on Tansu). One consumer, created on first
    use, never committing."""

    def __init__(self, opts: SourceOptions, timeout: float = 30.0, clients: ProbeClients | None = None):
        self._opts = opts
        self._timeout = timeout
        self._own = clients is None  # closed with this probe; shared ones by their owner
        self._clients = clients if clients is not None else ProbeClients(opts.client_conf())
        # partition -> (reported end, true end) of its last successful probe
        self._probed: dict[int, tuple[int, int]] = {}

    def _client(self):
        return self._clients.consumer()

    def close(self) -> None:
        if self._own:
            self._clients.close()

    def forget(self) -> None:
        """Drop remembered probes (the topic was recreated)."""
        self._probed.clear()

    def topic_id(self) -> str | None:
        found = _of_round(self._clients.round_ids, self._opts.topic)
        if found is not _NOT_FETCHED:
            return found
        return describe_topic_id(self._clients.admin(), self._opts.topic, self._timeout)

    def partitions(self) -> list[int]:
        topic = self._opts.topic
        meta = self._client().list_topics(topic, timeout=self._timeout).topics.get(topic)
        if meta is None or meta.error is not None or not meta.partitions:
            raise LookupError(f"topic {topic} does not exist or has no partitions "
                              f"({meta.error if meta is not None else 'not in metadata'})")
        return sorted(meta.partitions)

    def reported(self) -> dict[int, tuple[int, int]]:
        """ListOffsets' (earliest, end) per partition; the end may be low.
        A partition with no offsets to report (-1001: its leader is down, a
        cluster mid-election) is an outage, raised as one, never a loss."""
        found = _of_round(self._clients.round_reported, self._opts.topic)
        if found is _NOT_FETCHED:
            c = self._client()
            found = {p: c.get_watermark_offsets(TopicPartition(self._opts.topic, p), timeout=self._timeout)
                     for p in self.partitions()}
        if isinstance(found, dict):
            unknown = sorted(p for p, (lo, hi) in found.items() if lo < 0 or hi < 0)
            if unknown:
                raise KafkaException(KafkaError(KafkaError.LEADER_NOT_AVAILABLE,
                                                f"{self._opts.topic}{unknown}: no offsets reported (no leader)"))
        return found

    def to_probe(self) -> dict[int, int]:
        """The partitions :meth:`lows_and_ends` would fetch now, with their
        reported ends (see there)."""
        return {p: max(hi, lo) for p, (lo, hi) in self.reported().items()
                if hi > lo and (self._probed.get(p) is None or self._probed[p][0] != hi)}

    def lows_and_ends(self) -> tuple[Offsets, Offsets]:
        """(earliest offsets, true end offsets) per partition."""
        topic = self._opts.topic
        reported = self.reported()
        lows = {p: lo for p, (lo, _) in reported.items()}
        ends = {p: max(hi, lo) for p, (lo, hi) in reported.items()}
        # Partitions ListOffsets calls empty are: Tansu's value is then 0 as
        # well. Probe the others from the last reported offset: that message
        # exists, so the Fetch answers at once and carries the high watermark.
        # A reported end unchanged since the last probe means no batch was
        # appended since (Kafka: it is the true end; Tansu: a new batch's base
        # is >= the old true end, so its report would exceed the old one), so
        # the end probed then still holds and an idle topic costs no Fetch.
        probe = []
        for p, (lo, hi) in reported.items():
            last = self._probed.get(p)
            if last is not None and last[0] == hi:
                ends[p] = max(ends[p], last[1])
            elif hi > lo:
                probe.append(p)
        # Fetched with every topic's this round (ProbeClients.probe_ends), or now.
        fetched = {p: hwm for (t, p), hwm in (self._clients.round_probed or {}).items() if t == topic and p in probe}
        own = {(topic, p): ends[p] - 1 for p in probe if p not in fetched}
        if own:
            fetched.update({p: hwm for (_, p), hwm in fetch_ends(self._client(), own, self._timeout).items()})
        for p in probe:
            if p not in fetched:
                log.warning("probing the end of %s[%d] timed out; using the reported end %d", topic, p, ends[p])
                continue
            reported_end = ends[p]
            ends[p] = max(reported_end, fetched[p])
            self._probed[p] = (reported_end, ends[p])
        return lows, ends


def fetch_ends(consumer, starts: Mapping[tuple[str, int], int], timeout: float) -> dict[tuple[str, int], int]:
    """The high watermark of each (topic, partition) of ``starts``, fetched
    from the offset given (the last reported one: that message exists, so the
    broker answers at once), all in one assignment; a partition that did not
    answer within ``timeout`` seconds is absent."""
    consumer.assign([TopicPartition(t, p, o) for (t, p), o in starts.items()])
    try:
        pending = set(starts)
        deadline = time.monotonic() + timeout
        while pending and time.monotonic() < deadline:
            # poll, not consume(n): consume waits for n messages or its whole
            # timeout, 0.5 s of every trigger (bench/RESULTS.md, "End-to-end latency").
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            err = msg.error()
            if err is not None and err.code() != KafkaError._PARTITION_EOF:
                if err.fatal():
                    raise KafkaException(err)
                log.warning("probing the end of %s[%s]: %s", msg.topic(), msg.partition(), err)
                if msg.partition() is None:
                    continue  # a client-level event, not a partition's answer
            # (a late answer to an earlier probe of a shared consumer is in no one's pending set)
            pending.discard((msg.topic(), msg.partition()))
        return {(t, p): consumer.get_watermark_offsets(TopicPartition(t, p), cached=True)[1]
                for t, p in starts if (t, p) not in pending}
    finally:
        consumer.unassign()


class ShapeStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """See the module docstring. Driver-side state (probe, availableNow target)
    lives only in Spark's long-lived source process; executors only ``read``."""

    def __init__(self, opts: SourceOptions, clients: ProbeClients | None = None):
        self._opts = opts
        self._clients = clients  # shared probe clients (one query over many topics), or None: its own
        self._ends: PartitionEnds | None = None
        self._target: Offsets | None = None
        self._last_ends: Offsets | None = None

    def __getstate__(self) -> dict:
        return {"_opts": self._opts, "_clients": None, "_ends": None, "_target": None, "_last_ends": None}

    def _probe(self) -> PartitionEnds:
        if self._ends is None:
            self._ends = PartitionEnds(self._opts, clients=self._clients)
        return self._ends

    # -- driver
    def initialOffset(self) -> dict:
        topic_id = self._probe().topic_id()
        lows, ends = self._probe().lows_and_ends()
        how = self._opts.starting_offsets.strip()
        if how == "earliest":
            start = lows
        elif how == "latest":
            start = ends
        else:
            given_json = json.loads(how)
            given = offsets_from_json(given_json)
            if recreated(given_json, {TOPIC_ID: topic_id}):
                # Offsets counted in a lost incarnation of the topic: the new one is read whole.
                log.warning("%s: the starting offsets %s were counted in topic id %s, which is gone (now %s): "
                            "reading the topic from its earliest offsets", self._opts.topic, given,
                            given_json.get(TOPIC_ID), topic_id)
                given = {}
            start = {p: given.get(p, lows[p]) for p in lows}
            outside = {p: o for p, o in start.items() if not lows[p] <= o <= ends[p]}
            if outside:
                raise ValueError(
                    f"{self._opts.topic}: starting offsets outside what the broker holds: "
                    + ", ".join(f"[{p}] {o} not in [{lows[p]}, {ends[p]}]" for p, o in sorted(outside.items()))
                    + " (messages were deleted, or the broker lost data)")
        log.info("%s starts at %s", self._opts.topic, start)
        return offsets_to_json(start, topic_id)

    def getDefaultReadLimit(self) -> ReadLimit:
        if self._opts.max_offsets_per_trigger is not None:
            return ReadMaxRows(self._opts.max_offsets_per_trigger)
        return ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._probe().lows_and_ends()[1]
        log.info("%s: availableNow reads up to %s", self._opts.topic, self._target)

    def _ends_at_least(self, begin: Offsets) -> tuple[Offsets, Offsets]:
        """(earliest, end) offsets, where every end is at least ``begin``'s.
        An end below it is asked again a few times (a new partition leader may
        briefly report a lower high watermark); if it stays, the broker lost
        data and the query stops."""
        for attempt in range(LOST_DATA_RETRIES + 1):
            lows, ends = self._probe().lows_and_ends()
            lost = {p: (begin[p], ends[p]) for p in begin if p in ends and ends[p] < begin[p]}
            if not lost:
                return lows, ends
            if attempt < LOST_DATA_RETRIES:
                log.warning("%s: end offsets %s below what was read; asking again", self._opts.topic, lost)
                time.sleep(1.0)
        if self._opts.on_data_loss == "follow":
            log.warning("%s: the broker lost data (partition: (read, end) %s); reading those partitions again "
                        "from offset 0, applied by position", self._opts.topic, lost)
            self._probe().forget()
            return lows, ends
        raise RuntimeError(
            f"{self._opts.topic}: the broker holds fewer messages than already read "
            + ", ".join(f"[{p}] end {e} < read {s}" for p, (s, e) in sorted(lost.items()))
            + " (the broker lost data); not continuing")

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        begin = offsets_from_json(start)
        try:
            topic_id = self._probe().topic_id()
            if start.get(TOPIC_ID) and not topic_id:
                # The topic had an id and now shows none (a broker still making
                # it): planned without one, a new incarnation would be read on
                # from the old one's offsets, never from its first.
                log.warning("%s shows no topic id (it had %s): no new data this time", self._opts.topic,
                            start[TOPIC_ID])
                return start
            if recreated(start, {TOPIC_ID: topic_id}):
                if self._opts.on_data_loss != "follow":
                    raise RuntimeError(f"{self._opts.topic} was recreated (topic id {start[TOPIC_ID]} is now "
                                       f"{topic_id}): the broker lost data; not continuing")
                log.warning("%s was recreated (the broker lost data): reading the new topic from offset 0, "
                            "applied by position", self._opts.topic)
                self._probe().forget()
                begin = {p: 0 for p in begin}  # ``partitions`` starts the ranges there too
            lows, ends = self._ends_at_least(begin)
        except LookupError:
            if self._opts.on_data_loss != "follow":
                raise
            log.warning("%s is missing (being recreated?): no new data", self._opts.topic)
            return start
        except KafkaException as e:
            if e.args and e.args[0].fatal():
                raise
            # A broker restarting or unreachable: like any Kafka client, wait it out.
            log.warning("%s: asking the broker for offsets failed (%s); no new data this time", self._opts.topic,
                        e.args[0].str() if e.args else e)
            return start
        if self._target is not None:
            ends = {p: min(e, self._target[p]) for p, e in ends.items() if p in self._target}
        self._last_ends = ends
        available = {p: ends.get(p, s) for p, s in begin.items()}
        max_rows = None
        if isinstance(limit, ReadMaxRows):
            max_rows = limit.max_rows
        elif isinstance(limit, ReadMinRows):
            if sum(max(0, available[p] - s) for p, s in begin.items()) < limit.min_rows:
                return offsets_to_json(begin, topic_id)  # with the id: the next look must still tell incarnations
        end = plan_end_offsets(begin, available, max_rows)
        for p, e in ends.items():
            if p in begin and e < begin[p]:  # lost and recreated (on_data_loss=follow): [0, e) next
                end[p] = min(e, max_rows) if max_rows else e
        for p in ends:
            if p not in begin:  # a new partition: joins empty, read from the next batch on
                end[p] = lows[p]
                log.info("%s: partition %d joins at offset %d", self._opts.topic, p, lows[p])
        return offsets_to_json(end, topic_id)

    def reportLatestOffset(self) -> dict | None:
        return offsets_to_json(self._last_ends) if self._last_ends is not None else None

    def ranges(self, start: dict | None, end: dict) -> list[OffsetRange]:
        """The batch's offset ranges, before they are packed into tasks."""
        begin = offsets_from_json(start)
        if recreated(start, end):
            begin = {p: 0 for p in begin}
        return plan_ranges(self._opts.topic, begin, offsets_from_json(end), self._opts.max_offsets_per_task,
                           (end or {}).get(TOPIC_ID))

    def partitions(self, start: dict, end: dict) -> list[OffsetRange]:
        ranges = self.ranges(start, end)
        return ranges if self._opts.max_offsets_per_task else plan_tasks(ranges)

    def commit(self, end: dict) -> None:
        """Nothing to do: the apply step commits group offsets after its target commits."""

    def stop(self) -> None:
        if self._ends is not None:
            self._ends.close()

    # -- executors
    def read(self, partition: OffsetRange | OffsetRanges) -> Iterator[Any]:
        if isinstance(partition, OffsetRanges):
            return read_offset_ranges(lambda _: self._opts, partition.ranges)
        return read_offset_range(self._opts, partition)


class ShapeTopicDataSource(DataSource):
    """``spark.readStream.format("walbridge_shape")``: one shape topic, one
    row per message in the schema-free :data:`RAW_SCHEMA`."""

    @classmethod
    def name(cls) -> str:
        return SOURCE_NAME

    def __init__(self, options: dict[str, str]):
        super().__init__(options)
        self._opts = SourceOptions.from_options(dict(options))

    def schema(self) -> StructType:
        return RAW_SCHEMA

    def streamReader(self, schema: StructType) -> ShapeStreamReader:
        if schema.simpleString() != RAW_SCHEMA.simpleString():
            raise ValueError(f"{SOURCE_NAME} has a fixed schema ({RAW_SCHEMA.simpleString()}); "
                             f"do not pass one (got {schema.simpleString()})")
        return ShapeStreamReader(self._opts)


def read_raw_stream(spark, opts: SourceOptions):
    """The streaming DataFrame of one shape topic's messages as they are
    (:data:`RAW_SCHEMA`): what the consumer job reads, decoding each
    micro-batch with the writer schemas it carries (:func:`decode_batches`)."""
    spark.dataSource.register(ShapeTopicDataSource)
    return spark.readStream.format(SOURCE_NAME).options(**opts.to_options()).load()


def read_shape_stream(spark, topic: str, bootstrap_servers: str, topic_prefix: str | None = None,
                      schema_registry_url: str | None = None, kafka_client: dict[str, Any] | None = None,
                      max_offsets_per_trigger: int | None = None, starting_offsets: str | dict = "earliest",
                      max_offsets_per_task: int | None = None, schemas: ShapeSchemas | None = None,
                      on_data_loss: str = "fail", schema_registry_client: dict[str, Any] | None = None,
                      subject_name_strategy: str = "topic"):
    """The streaming DataFrame of one shape topic decoded into the layout of
    its newest value schema at this call (schemas discovered here, in the
    calling process, unless given): a message written with a schema published
    later that adds or retypes a column fails its task with
    :class:`~spark_consumer.decode.SchemaChangedError` (the consumer job reads
    :func:`read_raw_stream` instead and picks new layouts up per batch). Spark's Python workers must be
    able to import walbridge: start the session with ``PYSPARK_PYTHON`` set to
    this environment's interpreter (the data source planner reads that
    variable, not ``spark.pyspark.python``)."""
    if isinstance(starting_offsets, dict):
        starting_offsets = json.dumps(offsets_to_json(offsets_from_json(starting_offsets)))
    opts = SourceOptions(topic=topic, bootstrap_servers=bootstrap_servers, topic_prefix=topic_prefix,
                         schema_registry_url=schema_registry_url,
                         schema_registry_client=dict(schema_registry_client or {}),
                         subject_name_strategy=subject_name_strategy, kafka_client=dict(kafka_client or {}),
                         max_offsets_per_trigger=max_offsets_per_trigger, starting_offsets=starting_offsets,
                         max_offsets_per_task=max_offsets_per_task, on_data_loss=on_data_loss)
    schemas = schemas or discover_schemas(opts)
    layout = schemas.layout()  # fail here, not in a worker, on an unmappable schema
    return read_raw_stream(spark, opts).mapInArrow(
        functools.partial(decode_batches, opts, schemas, False), layout.spark_schema())


# ----------------------------------------------------------- executor side
# Per worker process (Python workers are reused across tasks): Kafka clients,
# writer-schema caches and DLQ topic creation happen once, not once per task.
_consumers: dict[str, Any] = {}
_admins: dict[str, Any] = {}
_dlq_producers: dict[str, Any] = {}
_writer_schemas: dict[str, WriterSchemas] = {}
_consumer_topics: dict[str, set[str]] = {}  # range consumer key -> the topics it has metadata for
_dlq_topics_ready: set[tuple[str, str]] = set()


def _conf_key(conf: dict[str, Any]) -> str:
    return json.dumps(conf, sort_keys=True, default=str)


def _incarnation_gone(opts: SourceOptions, task: OffsetRange) -> bool:
    """With ``on_data_loss=follow``: is the topic incarnation ``task`` was
    planned in gone (recreated or missing)? Its messages are then lost: the
    driver plans the new incarnation from offset 0."""
    if not task.topic_id or opts.on_data_loss != "follow":
        return False
    conf = opts.client_conf()
    admin = _admins.get(_conf_key(conf))
    if admin is None:
        admin = _admins[_conf_key(conf)] = AdminClient(conf)
    try:
        current = describe_topic_id(admin, task.topic, 30.0)
    except LookupError:
        current = None
    if current != task.topic_id:
        log.warning("%s[%d] [%d, %d): the topic was recreated (id %s, now %s); its messages are gone",
                    task.topic, task.partition, task.start, task.end, task.topic_id, current)
        return True
    return False


def _incarnations_gone(opts_of: Callable[[str], SourceOptions], ranges: Sequence[OffsetRange]) -> set[int]:
    """:func:`_incarnation_gone` of many ranges, every topic asked in one
    request: the indexes of the ranges whose incarnation is gone."""
    watched = [(i, r) for i, r in enumerate(ranges) if r.topic_id and opts_of(r.topic).on_data_loss == "follow"]
    if not watched:
        return set()
    conf = opts_of(watched[0][1].topic).client_conf()
    admin = _admins.get(_conf_key(conf))
    if admin is None:
        admin = _admins[_conf_key(conf)] = AdminClient(conf)
    current = topic_ids(admin, {r.topic for _, r in watched}, 30.0)
    gone = set()
    for i, r in watched:
        now = current[r.topic]
        if isinstance(now, LookupError):
            now = None
        elif isinstance(now, Exception):
            raise now
        if now != r.topic_id:
            log.warning("%s[%d] [%d, %d): the topic was recreated (id %s, now %s); its messages are gone",
                        r.topic, r.partition, r.start, r.end, r.topic_id, now)
            gone.add(i)
    return gone


def read_offset_ranges(opts_of: Callable[[str], SourceOptions], ranges: Sequence[OffsetRange]) -> Iterator[Any]:
    """Arrow record batches (:data:`RAW_SCHEMA`) of every message of
    ``ranges``, each range's in offset order (executor side), read all at
    once: one assignment on one consumer (:func:`_read_together`; read one
    after the other, each range cost a fetch round, ~51 ms on a used consumer
    and ~1 s on one new to the topic: issue 17).

    A consumer fetches by topic name and offset: a topic recreated while it
    is read hands the new incarnation's messages on from the next offset.
    Applied as this range's, they would lift the partition's applied position
    above the new incarnation's first messages, later skipped as replays. So
    rows are handed over only while their incarnation stands: read rows are
    held until a look at every range's topic (one request for all of them),
    taken every ``HELD_ROWS`` rows and at the end, and those of an incarnation
    gone by then are dropped with the rest of their range (the driver plans
    the new incarnation from offset 0). A range already gone before the read
    is not read."""
    before = _incarnations_gone(opts_of, ranges)
    live = [r for i, r in enumerate(ranges) if i not in before]
    if not live:
        return
    gone: set[int] = set()
    held: list[tuple[int, Any]] = []

    def standing() -> list:
        gone.update(_incarnations_gone(opts_of, live))
        return [batch for i, batch in sorted(held, key=lambda h: h[0]) if i not in gone]

    with closing(_read_together(opts_of, live)) as batches:
        for i, batch in batches:
            if i in gone:
                continue
            held.append((i, batch))
            if sum(b.num_rows for _, b in held) >= HELD_ROWS:
                yield from standing()
                held = []
    if held:
        yield from standing()


def _consumer_key(opts: SourceOptions) -> str:
    """Which range consumer reads for ``opts``: one per query run and client configuration."""
    return f"{opts.run}/{_conf_key(opts.client_conf())}"


def _range_consumer(opts: SourceOptions, topics: frozenset[str] = frozenset()):
    """The worker's range consumer for ``opts`` (created on first use), with
    the metadata of every one of ``topics`` in its cache."""
    key = _consumer_key(opts)
    consumer = _consumers.pop(key, None)
    if consumer is None:
        while len(_consumers) >= RANGE_CONSUMERS_KEPT:  # runs of restarted queries: the least recently used
            old = next(iter(_consumers))
            _consumers.pop(old).close()
            _consumer_topics.pop(old, None)
        consumer = Consumer({
            # A range's messages are all there (its end is a high watermark): a
            # fetch has no reason to wait for data, which would delay each task.
            "fetch.wait.max.ms": RANGE_FETCH_WAIT_MS,
            # A consumer reused for the next range must not wait out the default
            # 1 s queue back-off before its first messages (bench/RESULTS.md).
            "fetch.queue.backoff.ms": RANGE_FETCH_QUEUE_BACKOFF_MS,
            **opts.client_conf(), "group.id": wire.reader_group("source"), "enable.auto.commit": False,
            "enable.auto.offset.store": False, "enable.partition.eof": True,
            # An offset that is no longer there is data loss: fail, never skip.
            "auto.offset.reset": "error"})
    _consumers[key] = consumer  # the most recently used last
    known = _consumer_topics.setdefault(key, set())
    if not topics <= known:
        # A partition of a topic the consumer holds no metadata for is fetched
        # only after a metadata round of its own: 0.54 s for 100 such topics
        # on Tansu, 0.04 s after one request for every topic (issue 17).
        try:
            consumer.list_topics(timeout=METADATA_TIMEOUT_S)
            known |= topics
        except KafkaException as e:  # the read asks for what it lacks (and waits out an outage) itself
            log.info("asking the broker for every topic's metadata failed: %s", e)
    return consumer


def schema_lookup(opts: SourceOptions, preloaded: dict[str, dict]):
    """Writer schema (JSON) by wire reference: handed-over schemas first, then
    the registry (by id) or the schemas topic (by fingerprint). Not found →
    :class:`UndecodableMessage`; failures to look up propagate."""
    resolver = SchemaResolver(opts.client_conf(), opts.topic_prefix, opts.registry())

    def lookup(ref: wire.SchemaRef, data: bytes) -> dict:
        found = preloaded.get(schema_ref_key(ref))
        if found is not None:
            return found
        try:
            return resolver.raw_schema(data)
        except SchemaRegistryError as e:
            if e.http_status_code == 404:
                hint = (" (a mock:// registry lives in one process: executors only know the schemas "
                        "handed over at stream start)") if opts.schema_registry_url.startswith("mock://") else ""
                raise UndecodableMessage(f"unknown schema id {ref.ref}{hint}") from None
            raise
        except ValueError as e:  # no registry, no schemas topic, or a fingerprint it does not hold
            raise UndecodableMessage(str(e)) from None

    return lookup


def _writer_schemas_for(opts: SourceOptions, schemas: ShapeSchemas, only_known: bool) -> WriterSchemas:
    key = hashlib.sha256(_conf_key({"opts": asdict(opts), "schemas": asdict(schemas),
                                    "only_known": only_known}).encode()).hexdigest()
    ws = _writer_schemas.get(key)
    if ws is None:
        ws = _writer_schemas[key] = WriterSchemas(schemas.layout(), schema_lookup(opts, schemas.writer_schemas),
                                                  frozenset(schemas.known_value_refs), only_known=only_known)
    return ws


class DeadLetters:
    """Sends undecodable messages to ``<topic>.dlq`` (per-process producer)."""

    def __init__(self, opts: SourceOptions):
        self._opts = opts
        self.topic = wire.dlq_topic(opts.topic)
        self.sent = 0
        self._errors: list[str] = []

    def _producer(self):
        conf = self._opts.client_conf()
        key = _conf_key(conf)
        producer = _dlq_producers.get(key)
        if producer is None:
            producer = _dlq_producers[key] = Producer({**conf, "enable.idempotence": True, "acks": "all",
                                                       "linger.ms": 5})
        if (key, self.topic) not in _dlq_topics_ready:
            ensure_topics(AdminClient(conf), [self.topic], partitions=1, replication=-1,
                          config=wire.DLQ_TOPIC_CONFIG)
            _dlq_topics_ready.add((key, self.topic))
        return producer

    def send(self, topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None,
             headers: list | None, error: str) -> None:
        headers = list(headers or []) + [
            (wire.DLQ_ERROR_HEADER, error.encode()), (wire.DLQ_TOPIC_HEADER, topic.encode()),
            (wire.DLQ_PARTITION_HEADER, str(partition).encode()), (wire.DLQ_OFFSET_HEADER, str(offset).encode())]
        log.warning("%s[%d]@%d cannot be decoded (%s): sent to %s", topic, partition, offset, error, self.topic)
        producer = self._producer()

        def delivered(err, _msg) -> None:
            if err is not None:
                self._errors.append(err.str())

        while True:
            try:
                producer.produce(self.topic, value=value, key=key, headers=headers, on_delivery=delivered)
                break
            except BufferError:
                producer.poll(0.1)
        producer.poll(0)
        self.sent += 1

    def flush(self, timeout: float = 60.0) -> None:
        if not self.sent:
            return
        producer = self._producer()
        if producer.flush(timeout):
            raise RuntimeError(f"could not deliver {len(producer)} message(s) to {self.topic} in {timeout}s")
        if self._errors:
            raise RuntimeError(f"delivery to {self.topic} failed: {self._errors[0]}")


_TRANSIENT = frozenset({KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN, KafkaError._TIMED_OUT,
                        KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE,
                        KafkaError.REQUEST_TIMED_OUT, KafkaError._RESOLVE})


def read_offset_range(opts: SourceOptions, task: OffsetRange) -> Iterator[Any]:
    """:func:`read_offset_ranges` of one range."""
    return read_offset_ranges(lambda _: opts, [task])


@dataclass
class _RangeRead:
    """One range's read in progress (:func:`_read_together`): its partition's
    own bookkeeping on a consumer that may read other partitions too."""

    range: OffsetRange
    opts: SourceOptions
    rows: RawRows
    next_offset: int
    heard_at: float  # when the consumer last returned anything of this partition
    eof_at: int | None = None  # the broker's end of partition, last reported
    # The next offset at which the read was fetched again: a read that would
    # skip offsets (a message beyond the next offset, an end-of-partition
    # past it) fetches once more from the next offset first. What a reused
    # consumer still held from an earlier read cannot skip a message so; a
    # skip that comes back is the log's own (compaction, deleted records).
    refetched_at: int | None = None

    @property
    def done(self) -> bool:
        return self.next_offset >= self.range.end

    def take(self, msg, consumer) -> bool:
        """Read ``msg`` (of this range's partition). True when the partition was
        fetched again from the next offset: what else the consumer returned of
        it with ``msg`` predates that and is not read."""
        r = self.range
        err = msg.error()
        if err is not None:
            if err.code() == KafkaError._PARTITION_EOF:
                self.eof_at = msg.offset()
                if self.eof_at < r.end:
                    return False
                if self._refetch(consumer):
                    return True
                self.next_offset = r.end  # the rest of the range holds no visible message
                return False
            if not err.fatal() and err.code() in _TRANSIENT:
                log.warning("%s[%d]: %s (retrying)", r.topic, r.partition, err.str())
                return False
            if _incarnation_gone(self.opts, r):
                self.next_offset = r.end  # lost mid-read: its rows are not handed over
                return False
            raise KafkaException(err)
        offset = msg.offset()
        if offset < self.next_offset:
            return False
        if offset > self.next_offset and self._refetch(consumer):
            return True
        if offset >= r.end:
            self.next_offset = r.end
            return False
        self.rows.add(offset, msg.key(), msg.value(), msg.headers())
        self.next_offset = offset + 1
        return False

    def _refetch(self, consumer) -> bool:
        """Fetch again from the next offset, once per next offset; False when
        done already there or it cannot seek now (the skip then stands)."""
        if self.refetched_at == self.next_offset or not _refetch(
                consumer, self.range.topic, self.range.partition, self.next_offset):
            return False
        self.refetched_at = self.next_offset
        return True


def _read_together(opts_of: Callable[[str], SourceOptions], ranges: Sequence[OffsetRange]
                   ) -> Iterator[tuple[int, Any]]:
    """(index in ``ranges``, Arrow record batch) of every message of each
    range, each range's in offset order, its last batch once it is read
    (executor side). Every range is assigned at once on one range consumer
    (one fetch round for all of them, not one per range) and read with its
    own bookkeeping (:class:`_RangeRead`). A partition whose range is read
    is unassigned (not paused: a pause outlives the assignment, and the
    consumer is reused). One silent for its ``read_idle_timeout_s`` fails
    the read, unless its incarnation is gone: then it is read no further,
    and its rows must not be handed over. ``ranges`` are one query's (one
    client configuration), at most one per partition. Incarnations are the
    caller's to check."""
    if len({(r.topic, r.partition) for r in ranges}) < len(ranges):
        raise ValueError("ranges read together must be of different partitions")
    if len({_consumer_key(opts_of(r.topic)) for r in ranges}) > 1:
        raise ValueError("ranges read together must share their client configuration")
    now = time.monotonic()
    reads = {(r.topic, r.partition): _RangeRead(r, opts_of(r.topic), RawRows(r.topic, r.partition), r.start, now)
             for r in ranges}
    index = {tp: i for i, tp in enumerate(reads)}
    consumer = _range_consumer(opts_of(ranges[0].topic), frozenset(r.topic for r in ranges))
    consumer.assign([TopicPartition(r.topic, r.partition, r.start) for r in ranges])
    try:
        pending = {tp: rr for tp, rr in reads.items() if not rr.done}
        while pending:
            # At most what is left to read: consume returns as soon as it is all there.
            left = sum(rr.range.end - rr.next_offset for rr in pending.values())
            msgs = consumer.consume(num_messages=min(CONSUME_BATCH, left), timeout=RANGE_CONSUME_WAIT_S)
            now = time.monotonic()
            fetched_again = set()
            for msg in msgs:
                tp = (msg.topic(), msg.partition())
                rr = pending.get(tp)
                if rr is None or rr.done or tp in fetched_again:
                    # another partition's, left over from the consumer's previous
                    # range (it is reused); one read already; or predating a seek
                    continue
                rr.heard_at = now
                if rr.take(msg, consumer):
                    fetched_again.add(tp)
            for tp, rr in list(pending.items()):
                if rr.rows.count >= ARROW_BATCH_ROWS:
                    yield index[tp], rr.rows.to_record_batch()
                if not rr.done:
                    if now - rr.heard_at <= rr.opts.read_idle_timeout_s:
                        continue
                    r = rr.range
                    if not _incarnation_gone(rr.opts, r):
                        raise TimeoutError(
                            f"{r.topic}[{r.partition}]: {READ_GAP} {rr.next_offset} for "
                            f"{rr.opts.read_idle_timeout_s}s (batch range ends at {r.end}; broker end of "
                            f"partition {rr.eof_at}): the broker lost data?")
                del pending[tp]
                if pending:  # the others are still read: fetch nothing more of this one
                    consumer.incremental_unassign([TopicPartition(*tp)])
        for tp, rr in reads.items():
            if rr.rows.count:
                yield index[tp], rr.rows.to_record_batch()
    finally:
        consumer.unassign()


def _refetch(consumer, topic: str, partition: int, offset: int) -> bool:
    """Fetch ``partition`` again from ``offset`` (what the consumer held is
    dropped); False when it cannot seek now (the skip then stands)."""
    try:
        consumer.seek(TopicPartition(topic, partition, offset))
        return True
    except KafkaException:
        return False


class RawRows:
    """Messages of one topic-partition as :data:`RAW_ARROW_SCHEMA` batches."""

    def __init__(self, topic: str, partition: int):
        self.topic, self.partition = topic, partition
        self._offsets: list[int] = []
        self._keys: list = []
        self._values: list = []
        self._headers: list = []

    @property
    def count(self) -> int:
        return len(self._offsets)

    def add(self, offset: int, key: bytes | None, value: bytes | None, headers: list | None) -> None:
        self._offsets.append(offset)
        self._keys.append(key)
        self._values.append(value)
        self._headers.append(headers)

    def to_record_batch(self):
        n = len(self._offsets)
        batch = pa.RecordBatch.from_arrays([
            pa.array([self.topic] * n, pa.string()), pa.array([self.partition] * n, pa.int32()),
            pa.array(self._offsets, pa.int64()), pa.array(self._keys, pa.binary()),
            pa.array(self._values, pa.binary()), pa.array(self._headers, RAW_ARROW_SCHEMA.field(5).type)],
            schema=RAW_ARROW_SCHEMA)
        self._offsets, self._keys, self._values, self._headers = [], [], [], []
        return batch


def raw_messages(batch) -> Iterator[tuple]:
    """(topic, partition, offset, key, value, headers) of each row of a raw
    record batch; headers as confluent-kafka gives them (a list of (name,
    value) pairs, or None)."""
    topics = batch.column(0).to_pylist()
    partitions = batch.column(1).to_pylist()
    offsets = batch.column(2).to_pylist()
    keys = batch.column(3).to_pylist()
    values = batch.column(4).to_pylist()
    hcol = batch.column(5)
    bounds = hcol.offsets.to_pylist()
    flat = hcol.flatten()  # the slice's headers, from bounds[0] on
    pairs = list(zip(flat.field(0).to_pylist(), flat.field(1).to_pylist()))
    base = bounds[0]
    for i in range(len(offsets)):
        lo, hi = bounds[i] - base, bounds[i + 1] - base
        yield topics[i], partitions[i], offsets[i], keys[i], values[i], pairs[lo:hi] if hi > lo else None


def decode_batches(opts: SourceOptions, schemas: ShapeSchemas, mark_new_schemas: bool,
                   batches: Iterator[Any]) -> Iterator[Any]:
    """``mapInArrow`` over raw record batches (executor side): the typed rows
    of ``schemas.layout()`` (:mod:`spark_consumer.decode`), undecodable
    messages sent to ``<topic>.dlq`` (flushed before the task completes) and
    given a ``dlq`` row.

    ``mark_new_schemas``: a message written with a value schema not among
    ``schemas.known_value_refs`` ends the task's output with one
    ``new_schema`` row (:data:`schemas.wire.NEW_SCHEMA_CONTROL`): the driver
    then learns the schemas again and decodes the batch with the newest
    layout. Without it, only a new schema that adds or retypes a column
    stops, raising :class:`~spark_consumer.decode.SchemaChangedError`."""
    layout = schemas.layout()
    builder = BatchBuilder(layout, _writer_schemas_for(opts, schemas, mark_new_schemas))
    dead_letters = DeadLetters(opts)
    for batch in batches:
        for topic, partition, offset, key, value, headers in raw_messages(batch):
            try:
                builder.add(topic, partition, offset, key, value, headers)
            except UndecodableMessage as e:
                dead_letters.send(topic, partition, offset, key, value, headers, str(e))
                builder.add_dlq(topic, partition, offset, headers, str(e))
            except SchemaChangedError as e:
                if not mark_new_schemas:
                    log.error("%s[%d]@%d: %s; stopping", topic, partition, offset, e)
                    raise
                builder.to_record_batch()  # dropped: the batch is decoded again
                builder.add_control(topic, partition, offset, wire.NEW_SCHEMA_CONTROL, str(e))
                dead_letters.flush()
                yield builder.to_record_batch()
                return
            if builder.count >= ARROW_BATCH_ROWS:
                yield builder.to_record_batch()
    if builder.count:
        yield builder.to_record_batch()
    dead_letters.flush()


# ---------------------------------------------------------------- DLQ reading
@dataclass(frozen=True)
class DeadLetter:
    offset: int
    key: bytes | None
    value: bytes | None
    error: str
    origin: tuple[str, int, int]  # topic, partition, offset
    headers: dict[str, bytes]


def read_dead_letters(bootstrap_servers: str, topic: str, kafka_client: dict[str, Any] | None = None,
                      timeout: float = 30.0) -> list[DeadLetter]:
    """Every message in ``<topic>.dlq`` (empty when it does not exist)."""
    out = []
    for msg in read_to_end({"bootstrap.servers": bootstrap_servers, **(kafka_client or {})}, wire.dlq_topic(topic),
                           "dlq", timeout):
        h = dict(msg.headers() or [])
        out.append(DeadLetter(msg.offset(), msg.key(), msg.value(), h.get(wire.DLQ_ERROR_HEADER, b"").decode(),
                              (h.get(wire.DLQ_TOPIC_HEADER, b"").decode(), int(h.get(wire.DLQ_PARTITION_HEADER, b"-1")),
                               int(h.get(wire.DLQ_OFFSET_HEADER, b"-1"))), h))
    return sorted(out, key=lambda d: d.offset)
