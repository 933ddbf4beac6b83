"""One Structured Streaming query over every shape (``[consumer] queries =
"one"``): the per-query fixed cost of a micro-batch (trigger, planning, a
Spark job, two checkpoint writes) is paid once per round instead of once per
shape (bench/RESULTS.md, "End-to-end latency"; bench/shapes.py).

The path of one micro-batch, top to bottom:
1. :func:`spark_consumer.topics_source.read_topics_stream` gives the raw
   messages of every shape topic the query reads (offsets per topic, each
   with its topic id).
2. ``ShapesApplier._decode`` has the executors split them by ``_wb_topic``
   and decode each shape's part with that shape's writer schemas
   (:func:`spark_consumer.batch_split.decode_shapes`), in one Spark job; a
   shape whose part carries a value schema it had not seen learns its schemas
   again and only its part is decoded anew.
3. The apply thread applies every shape's part in ONE target transaction
   (:func:`spark_consumer.apply_driver.apply_shapes`), with the DDL of the
   shapes whose target follows a new writer schema, and moves each
   topic-partition's progress in it. One transaction, not one per shape:
   one commit (one WAL flush) per round whatever the shape count, and a
   batch is applied or not as a whole, which is what Spark's checkpoint
   records (the recovery of the newest batch stays one decision).
4. After that commit, the group's offsets of every topic it moved, in one
   commit, each tagged with the topic id its range was read from.

Invariants:
- Exactly once per shape as in the one-query-per-shape mode: the target's
  progress per (group, topic, partition) decides what is applied, written
  with the rows; a replayed batch is skipped part by part.
- A shape whose target cannot follow its new writer schema
  (:class:`~spark_consumer.target_layout.ShapeCannotFollow`) is *held*: its
  DDL is rolled back to a savepoint, none of its rows are applied, its
  progress and group offsets stay (the producer keeps its WAL), and the
  others' parts commit. The query is then restarted without its topic (the
  run loop, :attr:`ShapesApplier.held`); it rejoins at its target progress
  when the consumer next starts. Its offsets in Spark's checkpoint may by
  then lie beyond that progress: at every start such topics rejoin at the
  target's progress (:func:`spark_consumer.checkpoint.topics_ahead_of_target`),
  never read on from the checkpoint over the gap.
- At every start Spark's log is checked against the target per topic: from
  the earliest batch that moved a partition the target never applied (or
  else the newest, if any topic it moved lacks it), every batch is read and
  applied again (:func:`spark_consumer.checkpoint.topics_replay_unapplied`);
  the newest batch's group commit, if the target has it, is made again.
- Undecodable messages go to each shape's own ``<topic>.dlq``.
- Not yet here: the staged apply (config refuses the pair).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import psycopg
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import functions as F

from schemas.config import Config, ShapeConfig
from schemas.failures import TARGET, attributed
from schemas.retry import Outage
from spark_consumer import metrics
from spark_consumer.apply_driver import apply_shapes
from spark_consumer.apply_plan import ShapeTarget
from spark_consumer.batch import BatchResult, parts_from_rows
from spark_consumer.batch_split import (
    DECODED_SCHEMA,
    decode_shapes,
    new_schema_reason,
    starting_offsets,
    tables_by_topic,
)
from spark_consumer.checkpoint import (
    topics_ahead_of_target,
    topics_batch_topic_ids,
    topics_newest_moved,
    topics_newest_topic_ids,
    topics_replay_unapplied,
)
from spark_consumer.decode import arrow_rows
from spark_consumer.kafka_source import ShapeSchemas, SourceOptions, discover_schemas, read_schemas_records
from spark_consumer.pipelined import PipelinedApply
from spark_consumer.progress import ensure_progress, read_progress
from spark_consumer.starting import (
    NEW_SCHEMA_ROUNDS,
    OFFSET_RESET,
    Stopped,
    retry_policy,
    source_options,
    wait_for_schemas,
)
from spark_consumer.target_layout import ShapeCannotFollow, ensure_table
from spark_consumer.topics_source import read_topics_stream

log = logging.getLogger("walbridge.consumer")

QUERY_NAME = "walbridge:shapes"
CHECKPOINT_NAME = "@shapes"  # <checkpoint_dir>/@shapes: the one query's (no shape is named so: not a topic name)


@dataclass
class ShapeState:
    """One shape inside the one query: its source options, the writer schemas
    its parts are decoded with and the target they were derived for
    (``batch_target``), the target as the tables last followed (``target``)."""

    shape: ShapeConfig
    source: SourceOptions
    schemas: ShapeSchemas
    target: ShapeTarget
    batch_target: ShapeTarget
    batches: int = 0
    rows: int = 0
    dlq: int = 0

    @property
    def name(self) -> str:
        return self.shape.shape_name


class ShapesApplier(PipelinedApply):
    """The foreachBatch function of the one query over every shape (module
    docstring). ``held``: topic -> why its shape is held back (read by the run
    loop, which restarts the query without it)."""

    def __init__(self, config: Config, states: dict[str, ShapeState], kafka_conf: dict[str, Any],
                 checkpoint: Path | None, held: dict[str, str] | None = None):
        super().__init__("the shapes' query", "apply-shapes", kafka_conf, config.consumer.group)
        self.config = config
        self.states = states  # topic -> the shape it carries, for the topics this query reads
        self.checkpoint = checkpoint
        self.held: dict[str, str] = dict(held or {})
        self.reading: list[str] = []  # the topics the started query reads

    @property
    def needs_restart(self) -> bool:
        """A shape the query reads was held back: restart the query without it."""
        return any(t in self.held for t in self.reading)

    @property
    def topics(self) -> list[str]:
        """The topics the query applies (held ones aside)."""
        return [t for t in self.states if t not in self.held]

    def _connection(self):
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(self.config.consumer.target_dsn, autocommit=True)
            ensure_progress(self._conn)
            for topic in self.topics:
                self._ensure(self._conn, topic, self.states[topic].target)
        return self._conn

    def _ensure(self, conn, topic: str, target: ShapeTarget) -> bool:
        """Make the shape's tables follow ``target`` (a savepoint inside a
        transaction); False, with the shape held, when they cannot."""
        try:
            ensure_table(conn, target, self.config.consumer.on_dropped_column)
            return True
        except ShapeCannotFollow as e:
            self._hold(topic, str(e))
            return False

    def _hold(self, topic: str, why: str) -> None:
        if topic not in self.held:
            log.error("shape %s stopped: %s. The other shapes go on; this one's WAL is held (or dropped per "
                      "[ack] on_stall); it is tried again when the consumer next starts",
                      self.states[topic].name, why)
        self.held[topic] = why

    def _target_progress(self, stop: threading.Event | None) -> dict:
        """The group's progress in the target (waiting out an outage; the
        tables follow their shapes on connecting)."""
        progress = None
        for attempt in Outage(retry_policy(self.config), stop, log):
            with attempt, attributed(database=(TARGET, self.config.consumer.target_dsn)):
                progress = read_progress(self._connection(), self.config.consumer.group)
        if progress is None:
            raise Stopped()
        return progress

    def prepare(self, stop: threading.Event | None = None) -> tuple[dict[str, dict], set[str]]:
        """Before the query starts: the tables follow their shapes (holding
        those that cannot), Spark's newest batch is replayed if the target
        lacks it, its group commit is made again if the target has it.
        Returns (each topic's starting offsets: the target's progress; the
        topics whose checkpointed offsets lie beyond it, which must rejoin)."""
        progress = self._target_progress(stop)
        initial = starting_offsets(progress, self.topics)
        initial = {t: initial.get(t, {}) for t in self.topics}
        # Offsets counted in another incarnation of a topic say nothing of
        # the newest batch's (the progress keeps the id they were read from).
        incarnations = topics_newest_topic_ids(self.checkpoint)
        by_topic: dict[str, dict[int, int]] = {}
        for (t, p), prog in progress.items():
            by_topic.setdefault(t, {})[p] = prog.for_incarnation(incarnations.get(t)).next_offset
        batch = topics_replay_unapplied(self.checkpoint, by_topic, initial)
        if batch is not None:
            log.warning("Spark's checkpoint has batch %d of the shapes' query as done but the target lacks part "
                        "of it (target progress %s); it and every later batch are read and applied again",
                        batch, {t: dict(sorted(ps.items())) for t, ps in sorted(by_topic.items())})
        else:
            moved = topics_newest_moved(self.checkpoint, by_topic, initial)
            if moved:
                offsets = {(t, p): o for t, (_, ps) in moved.items() for p, o in ps.items()}
                self._apply_thread.submit(self._group().commit, offsets, {t: tid for t, (tid, _) in moved.items()})
        ahead = topics_ahead_of_target(self.checkpoint, by_topic, self.topics)
        for t in sorted(ahead):
            log.warning("shape %s: Spark's checkpoint is past what the target applied; it rejoins at the target's "
                        "progress %s", self.states[t].name, initial.get(t) or "(none: from the earliest offsets)")
        return {t: o for t, o in initial.items() if o}, ahead

    def _call(self, batch_df, batch_id: int) -> None:
        started = time.monotonic()
        tables = self._decode(functools.partial(self._decode_on_executors, batch_df), batch_id)
        self._hand_over(tables, batch_id, topics_batch_topic_ids(self.checkpoint, batch_id), started)

    def _hand_over(self, tables: dict[str, pa.Table], batch_id: int, topic_ids: dict[str, str], started: float
                   ) -> None:
        """Batch N decoded: wait for N-1's apply, then hand N to the apply
        thread; ``topic_ids``: the incarnation each topic's range was planned in."""
        targets = {t: self.states[t].batch_target for t in tables}
        read_s = time.monotonic() - started
        self._finish_pending()  # batch N-1 committed (or its error fails this batch)
        if any(t.num_rows for t in tables.values()):
            self._pending = self._apply_thread.submit(self._apply_tables, tables, targets, topic_ids, batch_id,
                                                      started, read_s)

    def _decode_on_executors(self, batch_df, topics: list[str], first: bool) -> dict[str, pa.Table]:
        """``topics``' rows of the batch decoded by the executors, in one Spark job."""
        df = batch_df if first else batch_df.filter(F.col("_wb_topic").isin(topics))
        return tables_by_topic(df.mapInArrow(functools.partial(decode_shapes, self._shapes(topics)),
                                             DECODED_SCHEMA).toArrow())

    def _shapes(self, topics: list[str]) -> dict[str, tuple[SourceOptions, ShapeSchemas]]:
        """What a decode of ``topics`` needs: each one's source options and writer schemas now."""
        return {t: (self.states[t].source, self.states[t].schemas) for t in topics}

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
                why = new_schema_reason(table)
                if why is None:
                    done[topic] = table
                else:
                    self._learn_schemas(topic, batch_id, why)
                    again.append(topic)
            if not again:
                return done
            pending = again
        raise RuntimeError(f"batch {batch_id}: shapes {', '.join(self.states[t].name for t in pending)} are still "
                           f"written with value schemas their schemas do not hold after {NEW_SCHEMA_ROUNDS} lookups")

    def _learn_schemas(self, topic: str, batch_id: int, why: str) -> None:
        st = self.states[topic]
        log.info("shape %s batch %d: %s; learning the shape's schemas again", st.name, batch_id, why)
        st.schemas = wait_for_schemas(st.source, discover_schemas, retry_policy(self.config))
        st.batch_target = ShapeTarget.from_avro(st.name, st.schemas.value_schema, st.schemas.key_schema)

    def _apply_tables(self, tables: dict[str, pa.Table], targets: dict[str, ShapeTarget], topic_ids: dict[str, str],
                      batch_id: int, started: float, read_s: float) -> None:
        """Apply thread: every shape's part in one target transaction, then
        the group's offsets (module docstring)."""
        began = time.monotonic()
        conn = self._connection()
        followed: dict[str, ShapeTarget] = {}
        with conn.transaction():
            batches = []
            for topic, table in tables.items():
                if topic in self.held or not table.num_rows:
                    continue
                target = targets[topic]
                if target is not self.states[topic].target:
                    if not self._ensure(conn, topic, target):
                        continue
                    followed[topic] = target
                fields, rows = arrow_rows(table)
                batches.append((target, parts_from_rows(rows, fields=fields, topic_ids={topic: topic_ids.get(topic)})))
            result = apply_shapes(conn, self.config.consumer.group, batches,
                                  on_offset_reset=OFFSET_RESET[self.config.consumer.on_data_loss])
        for topic, target in followed.items():
            self.states[topic].target = target
        self._applied(batch_id, result, tables, topic_ids, started,
                      f"read {read_s:.2f}s, apply {time.monotonic() - began:.2f}s")

    def _applied(self, batch_id: int, result: BatchResult, tables: dict[str, pa.Table], topic_ids: dict[str, str],
                 started: float, timings: str) -> None:
        """After the target committed: the group's offsets (each topic's
        tagged with the incarnation its range was read from, ``topic_ids``),
        counters, metrics, one log line."""
        self._group().commit(result.offsets, {t: topic_ids.get(t) for t, _ in result.offsets})
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
            newest = pc.max(tables[topic].column("_wb_ts_ms")).as_py()
            if newest:
                metrics.APPLY_LATENCY.labels(st.name).observe(max(time.time() - newest / 1000, 0))
        self.batches += 1
        self.rows += n_rows
        self.dlq += result.total("dlq")
        log.info("shapes batch %d: %d rows of %d shapes (%d applied, %d replayed skipped, %d dead-lettered) in "
                 "%.2fs (%s)", batch_id, n_rows, len(per_topic), result.total("applied"),
                 result.total("skipped_replayed"), result.total("dlq"), time.monotonic() - started, timings)


def shape_states(config: Config, stop: threading.Event | None = None) -> dict[str, ShapeState]:
    """Every shape's state, by topic: its source options and the writer
    schemas it has now (waited for; the ``_schemas`` topic read once for all)."""
    states = {}
    read: list = []  # ._schemas read once for every shape (read again after a miss)

    def discover(opts: SourceOptions) -> ShapeSchemas:
        if opts.registry() is not None:
            return discover_schemas(opts)
        if not read:
            read.append(read_schemas_records(opts))
        try:
            return discover_schemas(opts, records=read[0])
        except LookupError:
            read.clear()
            raise

    for shape in config.shapes:
        opts = source_options(config, shape)
        schemas = wait_for_schemas(opts, discover, retry_policy(config), stop)
        target = ShapeTarget.from_avro(shape.shape_name, schemas.value_schema, schemas.key_schema)
        states[opts.topic] = ShapeState(shape, opts, schemas, target, target)
    return states


def start_shapes_query(spark, config: Config, kafka_conf: dict[str, Any], stop: threading.Event | None = None,
                       held: dict[str, str] | None = None):
    """The one query over every shape not ``held`` (from its checkpoint,
    ``<checkpoint_dir>/@shapes``) and its applier; (None, applier) when every
    shape is held."""
    states = shape_states(config, stop)
    checkpoint = Path(config.consumer.checkpoint_dir) / CHECKPOINT_NAME
    applier = ShapesApplier(config, states, kafka_conf, checkpoint, held)
    starting, rejoin = applier.prepare(stop)
    topics = applier.reading = applier.topics
    if not topics:
        log.error("every shape is held back; nothing to consume")
        return None, applier
    common = next(iter(states.values())).source
    df = read_topics_stream(spark, common, topics, starting, sorted(rejoin & set(topics)))
    query = (df.writeStream.queryName(QUERY_NAME).foreachBatch(applier)
             .option("checkpointLocation", str(checkpoint))
             .trigger(processingTime=f"{config.consumer.trigger_interval} seconds").start())
    log.info("consuming %d shape topics in one query (checkpoint %s)", len(topics), checkpoint)
    return query, applier
