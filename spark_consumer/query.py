"""The consumer's one Structured Streaming query over every shape topic, and
its foreachBatch apply (:class:`BatchApplier`).

The path of one micro-batch, top to bottom:
1. Spark's Kafka source (:mod:`spark_consumer.source`) reads the batch's
   messages of every shape topic, in the JVM.
2. ``BatchApplier._decode`` has the executors split them by topic and decode
   each shape's part with that shape's writer schemas
   (:func:`spark_consumer.batch_split.decode_shapes`), in one Spark job; a
   shape whose part carries a value schema it had not seen learns its
   schemas again and only its part is decoded anew (no query restart).
3. Every topic's id is compared with the incarnation the run reads it in:
   the parts of a topic recreated since are not applied, and the run ends
   for a restart that reads the new incarnation from its start.
4. The apply thread hands every shape's part to the target
   (:mod:`spark_consumer.targets`: PostgreSQL applies them in ONE
   transaction, Delta in one commit per shape), with the DDL of the shapes
   whose table follows a new writer schema, and each topic-partition's
   progress (with the topic id) in the rows' commit; meanwhile Spark reads
   the next batch (:mod:`spark_consumer.pipelined`).
5. After that commit, the group's offsets of every topic it moved, in one
   commit, each tagged with the topic id its range was read from
   (:mod:`spark_consumer.group_commits`).

Invariants:
- Exactly once per shape: the target's progress per (group, topic,
  partition) decides what is applied, written with the rows. Every run of
  the query starts at that progress (:func:`spark_consumer.source.plan_start`)
  with a fresh Spark checkpoint, so nothing Spark logged and the target
  never committed can be skipped; a replayed range is skipped part by part.
- A part covers the offsets from where the run's previous part of its
  partition ended (its start: the target's progress) to its last message:
  consecutive parts leave no gap for the apply to refuse, whatever
  compaction removed.
- A shape whose target cannot follow its new writer schema
  (:class:`~spark_consumer.target_layout.ShapeCannotFollow`) is *held*:
  none of its rows are applied, its progress and group offsets stay (the
  producer keeps its WAL), and the others' parts commit. The query is then
  restarted without it (:attr:`BatchApplier.needs_restart`); it rejoins at
  its target progress when the consumer next starts.
- Undecodable messages go to each shape's own ``<topic>.dlq``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.compute as pc
from confluent_kafka.admin import AdminClient
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.pandas.functions import pandas_udf
from pyspark.sql.types import StructType
from pyspark.util import PythonEvalType

from schemas import wire
from schemas.config import Config, ShapeConfig
from schemas.failures import KAFKA, TARGET, Failure, attributed
from schemas.kafka import describe_topics, topic_ids
from schemas.retry import Outage, RetryPolicy
from spark_consumer import metrics
from spark_consumer.batch import BatchResult, Part, parts_from_rows
from spark_consumer.batch_split import DECODED_SCHEMA, RAW_COLUMNS, decode_shapes, new_schema_reason, tables_by_topic
from spark_consumer.decode import arrow_rows
from spark_consumer.pipelined import PipelinedApply
from spark_consumer.shape_record import ShapeTarget
from spark_consumer.shape_schemas import (
    ShapeSchemas,
    ShapeSource,
    Stopped,
    discover_schemas,
    read_schemas_records,
    wait_for_schemas,
)
from spark_consumer.source import StartPlan, incarnation_changes, plan_start, read_kafka
from spark_consumer.target_layout import ShapeCannotFollow
from spark_consumer.targets import ShapeBatch, Target, open_target

log = logging.getLogger("walbridge.consumer")

QUERY_NAME = "walbridge"
CHECKPOINT_NAME = "query"  # <checkpoint_dir>/query: the running query's scratch, removed at every start
NEW_SCHEMA_ROUNDS = 3  # lookups of the schemas for one batch (the producer publishes before it writes)
OFFSET_RESET = {"follow": "follow", "stop": "raise"}  # [consumer] on_data_loss -> the apply's on_offset_reset


@dataclass
class ShapeState:
    """One shape inside the query: where its messages and schemas are, the
    writer schemas its parts are decoded with and the target they were
    derived for (``batch_target``), the target as its tables last followed
    (``target``)."""

    shape: ShapeConfig
    source: ShapeSource
    schemas: ShapeSchemas
    target: ShapeTarget
    batch_target: ShapeTarget
    batches: int = 0
    rows: int = 0
    dlq: int = 0

    @property
    def name(self) -> str:
        return self.shape.shape_name


class BatchApplier(PipelinedApply):
    """The query's foreachBatch function (module docstring). ``held``: topic
    -> why its shape is held back; ``recreated``: topic -> why this run must
    read it no further (both read by the supervisor, which restarts the query)."""

    def __init__(self, config: Config, states: dict[str, ShapeState], kafka_conf: dict[str, Any], target: Target,
                 plan: StartPlan | None = None, held: dict[str, str] | None = None):
        super().__init__("the query", "apply", kafka_conf, config.consumer.group, target)
        self.config = config
        self.states = states  # topic -> the shape it carries
        self.held: dict[str, str] = dict(held or {})
        self.recreated: dict[str, str] = {}
        self.reading: list[str] = []  # the topics the started query reads
        self.read_in: dict[str, str | None] = dict(plan.topic_ids) if plan else {}
        self._next_start: dict[tuple[str, int], int] = dict(plan.starts) if plan else {}
        self._admin: AdminClient | None = None
        self.query = None  # the StreamingQuery, once started
        self.ui_url: str | None = None
        self.tasks = 2  # decode tasks per batch at most (the cores Spark has: set at the start)
        self._decoder: tuple[tuple, dict, Column] | None = None  # (its shapes' identities, its shapes, its UDF)

    @property
    def needs_restart(self) -> bool:
        """A topic the query reads was held back or recreated: restart the query."""
        return bool(self.recreated) or any(t in self.held for t in self.reading)

    @property
    def topics(self) -> list[str]:
        """The topics the query applies (held ones aside)."""
        return [t for t in self.states if t not in self.held]

    def _follow_all(self) -> None:
        """At a start: every shape's table follows its writer schema (holding
        those that cannot)."""
        for topic in self.topics:
            try:
                self.target.follow(topic, self.states[topic].target)
            except ShapeCannotFollow as e:
                self._hold(topic, str(e))

    def _hold(self, topic: str, why: str) -> None:
        if topic not in self.held:
            log.error("shape %s stopped: %s. The other shapes go on; this one's WAL is held (or dropped per "
                      "[ack] on_stall); it is tried again when the consumer next starts",
                      self.states[topic].name, why)
        self.held[topic] = why

    def target_progress(self, stop: threading.Event | None) -> dict:
        """The group's progress in the target (waiting out an outage; the
        tables follow their shapes on connecting)."""
        progress = None
        for attempt in Outage(RetryPolicy.of(self.config.consumer), stop, log):
            with attempt, attributed(database=(TARGET, self.target.address)):
                self._follow_all()
                progress = self.target.read_progress(self.config.consumer.group)
        if progress is None:
            raise Stopped()
        return progress

    def commit_progress(self, progress: dict) -> None:
        """At a start: the group's offsets at the target's progress, for the
        topics read in the incarnation it counts in (a consumer killed
        between the target's commit and the group's would leave partitions
        that get no new batch, and their WAL, held)."""
        offsets = {tp: p.next_offset for tp, p in progress.items()
                   if tp[0] in self.read_in and p.topic_id and p.topic_id == self.read_in[tp[0]]}
        if offsets:
            self._apply_thread.submit(self._group().commit, offsets, {t: self.read_in[t] for t, _ in offsets})

    def _call(self, batch_df, batch_id: int) -> None:
        started = time.monotonic()
        tables = self._decode(functools.partial(self._decode_on_executors, batch_df), batch_id)
        self._check_incarnations()
        tables = {t: table for t, table in tables.items() if t not in self.recreated}
        targets = {t: self.states[t].batch_target for t in tables}
        parts = {t: self._parts(t, table) for t, table in tables.items() if table.num_rows}
        read_s = time.monotonic() - started
        self._finish_pending()  # batch N-1 committed (or its error fails this batch)
        if parts:
            self._pending = self._apply_thread.submit(self._apply_parts, parts, targets, tables, batch_id,
                                                      started, read_s)

    def _check_incarnations(self) -> None:
        """After a read: topics recreated since the run began are read no
        further (their rows may mix two incarnations); topics that did not
        exist then are read in the incarnation they have now."""
        if self._admin is None:
            self._admin = AdminClient(self.kafka_conf)
        with attributed(kafka=self.config.kafka.bootstrap_servers):
            now = topic_ids(self._admin, self.reading)
        changed, appeared = incarnation_changes(self.read_in, now)
        self.read_in.update(appeared)
        for topic, why in changed.items():
            if topic not in self.recreated:
                log.warning("shape %s: %s; its rows of this batch are not applied, and the query restarts to "
                            "read it from its start", self.states[topic].name, why)
                self.recreated[topic] = why

    def _parts(self, topic: str, table: pa.Table) -> list[Part]:
        """The topic's parts of the batch, each from where the run's previous
        part of its partition ended (module docstring)."""
        fields, rows = arrow_rows(table)
        parts = []
        for part in parts_from_rows(rows, fields=fields, topic_ids={topic: self.read_in.get(topic)}):
            start = self._next_start.get(part.tp, 0)
            if start > part.start:
                raise RuntimeError(f"{topic}[{part.partition}]: the batch starts at offset {part.start}, below the "
                                   f"end of the previous batch ({start})")
            parts.append(dataclasses.replace(part, start=start))
            self._next_start[part.tp] = part.end
        return parts

    def _decode_on_executors(self, batch_df, topics: list[str], first: bool) -> dict[str, pa.Table]:
        """``topics``' rows of the batch decoded by the executors, in one Spark job."""
        df = batch_df if first else batch_df.filter(F.col("topic").isin(topics))
        # One Spark task per topic-partition is one Python worker's turn each:
        # a batch's partitions are read and decoded by as many tasks as Spark has cores.
        df = df.coalesce(self.tasks)
        return tables_by_topic(map_in_arrow(df, self._decode_udf(topics)).toArrow())

    def _decode_udf(self, topics: list[str]) -> Column:
        """The decode of ``topics`` as one UDF, made again only when the
        shapes or their writer schemas change (learning schemas replaces
        a shape's :class:`ShapeSchemas`)."""
        shapes = {t: (self.states[t].source, self.states[t].schemas) for t in topics}
        # By identity: the cache holds the objects, so no id is reused while it does.
        key = tuple((t, id(src), id(schemas)) for t, (src, schemas) in shapes.items())
        if self._decoder is None or self._decoder[0] != key:
            self._decoder = (key, shapes, arrow_map_udf(functools.partial(decode_shapes, shapes), DECODED_SCHEMA,
                                                        RAW_COLUMNS))
        return self._decoder[2]

    def _decode(self, decode: Callable[[list[str], bool], dict[str, pa.Table]], batch_id: int
                ) -> dict[str, pa.Table]:
        """Each shape's rows of the batch as Arrow, decoded (by ``decode(topics,
        first)``) with the newest writer schemas its part needs (see the module
        docstring)."""
        done: dict[str, pa.Table] = {}
        pending = self.topics
        for round_ in range(NEW_SCHEMA_ROUNDS):
            again = []
            for topic, table in decode(pending, round_ == 0).items():
                if topic not in self.states or topic in self.held:
                    continue
                mark = new_schema_reason(table)
                if mark is None:
                    done[topic] = table
                else:
                    self._learn_schemas(topic, batch_id, *mark)
                    again.append(topic)
            if not again:
                return done
            pending = again
        raise RuntimeError(f"batch {batch_id}: shapes {', '.join(self.states[t].name for t in pending)} are still "
                           f"written with value schemas their schemas do not hold after {NEW_SCHEMA_ROUNDS} lookups")

    def _learn_schemas(self, topic: str, batch_id: int, why: str, ref: str | None) -> None:
        """Discover the shape's schemas again; a ref the batch named that is
        still not among them was never published: its messages are poison."""
        st = self.states[topic]
        log.info("shape %s batch %d: %s; learning the shape's schemas again", st.name, batch_id, why)
        unpublished = st.schemas.unpublished
        st.schemas = wait_for_schemas(st.source, discover_schemas, RetryPolicy.of(self.config.consumer))
        if ref and ref not in st.schemas.known_value_refs:
            log.warning("shape %s: no schema %s is published; its messages go to the DLQ", st.name, ref)
            unpublished += (ref,)
        st.schemas = dataclasses.replace(st.schemas, unpublished=unpublished)
        st.batch_target = ShapeTarget.from_avro(st.name, st.schemas.value_schema, st.schemas.key_schema)

    def _apply_parts(self, parts: dict[str, list[Part]], targets: dict[str, ShapeTarget],
                     tables: dict[str, pa.Table], batch_id: int, started: float, read_s: float) -> None:
        """Apply thread: every shape's part to the target, then the group's
        offsets (module docstring)."""
        began = time.monotonic()
        batches = [ShapeBatch(topic, targets[topic], topic_parts, follow=targets[topic] is not self.states[topic].target)
                   for topic, topic_parts in parts.items() if topic not in self.held]
        result = self.target.apply(self.config.consumer.group, batches,
                                   on_offset_reset=OFFSET_RESET[self.config.consumer.on_data_loss], hold=self._hold)
        for b in batches:
            if b.follow and b.topic not in self.held:
                self.states[b.topic].target = b.target
        self._applied(batch_id, result, tables, started, f"read {read_s:.2f}s, apply {time.monotonic() - began:.2f}s")

    def _applied(self, batch_id: int, result: BatchResult, tables: dict[str, pa.Table], started: float,
                 timings: str) -> None:
        """After the target committed: the group's offsets (each topic's
        tagged with the incarnation its range was read in), counters,
        metrics, one log line."""
        self._group().commit(result.offsets, {t: self.read_in.get(t) for t, _ in result.offsets})
        for b in result.backfills_completed:
            log.info("backfill %s of shape %s complete: GC deleted %d rows, %d tombstones",
                     b.backfill_id, b.shape, b.gc_deleted, b.gc_tombstones)
        per_topic: dict[str, list] = {}
        for (t, _), r in result.parts.items():
            per_topic.setdefault(t, []).append(r)
        n_rows = 0
        for topic, parts in per_topic.items():
            st = self.states[topic]
            rows, dlq = sum(r.rows for r in parts), sum(r.dlq for r in parts)
            st.batches += 1
            st.rows += rows
            st.dlq += dlq
            n_rows += rows
            metrics.APPLY_BATCHES.labels(st.name).inc()
            metrics.APPLIED_ROWS.labels(st.name).inc(sum(r.applied for r in parts))
            metrics.APPLY_SKIPPED.labels(st.name).inc(sum(r.skipped_replayed for r in parts))
            if dlq:
                metrics.DLQ_MESSAGES.labels(st.name).inc(dlq)
            newest = pc.max(tables[topic].column(wire.TS_MS_COLUMN)).as_py()
            if newest:
                metrics.APPLY_LATENCY.labels(st.name).observe(max(time.time() - newest / 1000, 0))
        self.batches += 1
        self.rows += n_rows
        self.dlq += result.total("dlq")
        log.info("batch %d: %d rows of %d shapes (%d applied, %d replayed skipped, %d dead-lettered) in %.2fs (%s)",
                 batch_id, n_rows, len(per_topic), result.total("applied"), result.total("skipped_replayed"),
                 result.total("dlq"), time.monotonic() - started, timings)


def arrow_map_udf(func: Callable, schema: StructType, columns: tuple[str, ...]) -> Column:
    """``func`` as the UDF ``DataFrame.mapInArrow`` makes of it, over ``columns``
    by name, to be applied to many DataFrames (:func:`map_in_arrow`)."""
    udf = pandas_udf(func, returnType=schema, functionType=PythonEvalType.SQL_MAP_ARROW_ITER_UDF)
    return udf(*[F.col(c) for c in columns])


def map_in_arrow(df: DataFrame, udf: Column) -> DataFrame:
    """``df.mapInArrow`` with a UDF made once (:func:`arrow_map_udf`). PySpark's
    own makes the UDF again on every call: the function pickled and shipped
    to the JVM and each column looked up, a dozen gateway round trips on every
    micro-batch (bench/RESULTS.md, "The decode UDF made once")."""
    return DataFrame(df._jdf.mapInArrow(udf._jc, False, None), df.sparkSession)


def shape_states(config: Config, stop: threading.Event | None = None) -> dict[str, ShapeState]:
    """Every shape's state, by topic: where it is and the writer schemas it
    has now (waited for; without a registry the ``_schemas`` topic is read
    once for all shapes, again after a miss)."""
    states = {}
    read: list = []

    def discover(src: ShapeSource) -> ShapeSchemas:
        if src.registry() is not None:
            return discover_schemas(src)
        if not read:
            read.append(read_schemas_records(src))
        try:
            return discover_schemas(src, records=read[0])
        except LookupError:
            read.clear()
            raise

    for shape in config.shapes:
        src = ShapeSource.of(config, shape)
        schemas = wait_for_schemas(src, discover, RetryPolicy.of(config.consumer), stop)
        target = ShapeTarget.from_avro(shape.shape_name, schemas.value_schema, schemas.key_schema)
        states[src.topic] = ShapeState(shape, src, schemas, target, target)
    return states


def start_query(spark, config: Config, kafka_conf: dict[str, Any], source_options: dict[str, str],
                stop: threading.Event | None = None, held: dict[str, str] | None = None):
    """The query over every shape not ``held``, started at the target's
    progress, and its applier; (None, applier) when every shape is held."""
    states = shape_states(config, stop)
    applier = BatchApplier(config, states, kafka_conf, open_target(config, spark), held=held)
    applier.tasks = spark.sparkContext.defaultParallelism
    progress = applier.target_progress(stop)  # the tables follow their shapes first (holding those that cannot)
    topics = applier.reading = applier.topics
    if not topics:
        log.error("every shape is held back; nothing to consume")
        return None, applier
    described = {}
    for attempt in Outage(RetryPolicy.of(config.consumer), stop, log):
        with attempt, attributed(kafka=config.kafka.bootstrap_servers):
            found = describe_topics(AdminClient(kafka_conf), topics)
            for topic, d in found.items():
                if isinstance(d, Exception) and not isinstance(d, LookupError):
                    raise d
            described = {t: d for t, d in found.items() if not isinstance(d, Exception)}
    if stop is not None and stop.is_set():
        raise Stopped()
    plan = plan_start(topics, progress, described)
    if plan.reread and config.consumer.on_data_loss == "stop":
        raise Failure(KAFKA, f"topics {', '.join(sorted(plan.reread))} were recreated since the target's progress "
                             "was recorded (Kafka lost data)",
                      'set [consumer] on_data_loss = "follow" to read them again from their start',
                      address=config.kafka.bootstrap_servers)
    for topic in sorted(plan.reread):
        log.warning("shape %s: the topic was recreated since the target's progress was recorded; it is read "
                    "again from its start (rows are applied by position)", states[topic].name)
    applier.read_in, applier._next_start = dict(plan.topic_ids), dict(plan.starts)
    applier.commit_progress(progress)
    checkpoint = Path(config.consumer.checkpoint_dir) / CHECKPOINT_NAME
    shutil.rmtree(checkpoint, ignore_errors=True)  # Spark's scratch: the target's progress is the record
    df = read_kafka(spark, config, topics, plan, source_options, applier.tasks)
    applier.query = (df.writeStream.queryName(QUERY_NAME).foreachBatch(applier)
                     .option("checkpointLocation", str(checkpoint))
                     .trigger(processingTime=f"{config.consumer.trigger_interval} seconds").start())
    applier.ui_url = spark.sparkContext.uiWebUrl
    log.info("consuming %d shape topics in one query, from the target's progress", len(topics))
    return applier.query, applier

