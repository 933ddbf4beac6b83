"""The Spark consumer job: one Structured Streaming query per shape topic, each
micro-batch applied to the target PostgreSQL exactly once, then its offsets
committed to the consumer group (which the producer's FlushTracker reads).
With ``[consumer] queries = "one"``, one query over every shape topic instead
(:mod:`spark_consumer.shapes_query`), under the same run loop.

    spark-submit walbridge/spark_submit.py -c walbridge.toml   # production (README: on a cluster)
    walbridge consumer -c walbridge.toml                       # the same, local[*]

The session and whose settings it takes: :mod:`spark_consumer.session`.

The path of one micro-batch, top to bottom:
1. :func:`spark_consumer.kafka_source.read_raw_stream` gives the batch's
   messages as they are (a fixed, replayable offset range per partition);
   ``ShapeApplier._decode`` has the executors decode them
   (:func:`spark_consumer.kafka_source.decode_batches`) with the newest writer
   schemas the batch needs: one it had not seen makes the driver read the
   shape's schemas again and decode the batch anew, so a schema change never
   restarts the query.
2. ``ShapeApplier.__call__`` collects them on the driver as Arrow and hands
   them to the apply thread, which groups them per partition for
   :func:`spark_consumer.apply_driver.apply_batch`: one target transaction that
   skips what the progress table says is applied, writes the rest with
   position guards and moves the progress. Meanwhile Spark reads the next
   batch (one batch in flight; foreachBatch waits for the previous apply).
   With the staged apply (``[consumer] staged_apply = true``; off by default
   in every deploy mode, being slower in local mode and on the measured
   cluster: bench/RESULTS.md, "Apply paths by deploy mode") each executor
   task stages its partitions' rows in the target instead, and the driver
   commits the staged parts and progress in one transaction
   (:mod:`spark_consumer.apply_staged`).
   A batch decoded with a new writer schema first makes the target's tables
   follow it (:func:`spark_consumer.target_layout.ensure_table`) in the same
   transaction (the staged apply: in one of its own before staging).
3. Only after that commit are the group's offsets committed to Kafka.

Invariants:
- Progress in the target, not the consumer group or Spark's checkpoint, decides
  what is applied: a crash anywhere (between apply and offset commit, or before
  Spark's commit log) is repaired by the replay being skipped part by part.
- Spark may log a batch as done before its apply commits; at every query start
  :meth:`ShapeApplier.recover` has Spark replay such a batch
  (:mod:`spark_consumer.checkpoint`), so nothing Spark skips is missing.
- A query is stopped only while its foreachBatch is outside Spark
  (:mod:`spark_consumer.pipelined`).
- Each query has its own checkpoint (``<checkpoint_dir>/<shape>``), target
  connection and offset committer; queries share nothing mutable.
- A shape whose target cannot follow its new writer schema (a key column
  whose values do not cast, :class:`~spark_consumer.target_layout.ShapeCannotFollow`)
  stops alone, with one error line; the other queries go on.
- An unreachable broker, registry or target (a transient
  :class:`~schemas.failures.Failure`) never ends the job: starts and query
  restarts wait for it with jittered exponential backoff (:mod:`schemas.retry`),
  saying what they wait for, up to ``[consumer] reconnect_max_elapsed``
  (default: forever). A permanent failure (a refused password, an unknown
  database) ends it at once.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
import time
from pathlib import Path
from typing import Any, Callable

import psycopg
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.errors import StreamingQueryException

from schemas import wire
from schemas.config import Config, ConfigError, ShapeConfig
from schemas.failures import KAFKA, TARGET, Failure, attributed, classify, classify_text
from schemas.kafka import client_config
from schemas.retry import Outage
from spark_consumer import metrics
from spark_consumer.apply_driver import apply_batch
from spark_consumer.apply_plan import ShapeTarget
from spark_consumer.apply_staged import commit_batch, stage_part
from spark_consumer.batch import Part, parts_from_rows
from spark_consumer.checkpoint import batch_topic_id, newest_moved, newest_topic_id, replay_unapplied
from spark_consumer.continuous import start_continuous
from spark_consumer.decode import arrow_rows
from spark_consumer.kafka_source import (
    ShapeSchemas,
    SourceOptions,
    decode_batches,
    discover_schemas,
    read_raw_stream,
)
from spark_consumer.pipelined import PipelinedApply
from spark_consumer.progress import ensure_progress, read_progress
from spark_consumer.session import spark_session
from spark_consumer.shapes_query import start_shapes_query
from spark_consumer.starting import (
    NEW_SCHEMA_ROUNDS,
    OFFSET_RESET,
    Stopped,
    pause,
    retry_policy,
    source_options,
    wait_for_schemas,
)
from spark_consumer.target_layout import ShapeCannotFollow, ensure_table

log = logging.getLogger("walbridge.consumer")


def reach_target(config: Config, stop: threading.Event | None = None) -> None:
    """Connect to the target once before Spark starts: a refused password or
    an unknown database ends the consumer in seconds, an unreachable target
    is waited for."""
    if not config.consumer.target_dsn:
        raise ConfigError(["consumer.target_dsn: is required by the consumer (the database to apply to)"])
    for attempt in Outage(retry_policy(config), stop, log):
        with attempt, attributed(database=(TARGET, config.consumer.target_dsn)):
            psycopg.connect(config.consumer.target_dsn, connect_timeout=10).close()


class ShapeApplier(PipelinedApply):
    """The foreachBatch function of one shape's query.

    Driver apply is pipelined one batch deep: ``__call__`` reads batch N
    (Spark's job), waits for batch N-1's apply to commit, hands batch N to
    the apply thread and returns, so Spark plans and reads batch N+1 while N
    is applied. Spark therefore logs batch N as committed before the target
    has it; :func:`spark_consumer.checkpoint.replay_unapplied` repairs that at
    every query start (a crash, a failed apply, a progress gap): the batches
    from the first the target lacks are replayed. An apply error surfaces at
    the next ``__call__`` or through :attr:`error` (the run loop restarts the
    query)."""

    def __init__(self, config: Config, shape: ShapeConfig, target: ShapeTarget, kafka_conf: dict[str, Any],
                 source: SourceOptions | None = None, schemas: ShapeSchemas | None = None):

        super().__init__(f"shape {shape.shape_name}", f"apply-{shape.shape_name}", kafka_conf, config.consumer.group)
        self.config = config
        self.shape = shape
        # The target as the connection last made it (ensure_table); a batch
        # decoded with newer schemas brings its own (see _follow_target).
        self.target = target
        # The raw stream's options and the writer schemas its batches are
        # decoded with (learned again when a batch carries a new one); None:
        # batches arrive decoded (a stream of read_shape_stream).
        self.source = source
        self.schemas = schemas
        self._batch_target = target  # the target of self.schemas
        self._checkpoint: Path | None = None  # the query's (set by recover)

    def recover(self, checkpoint: Path, topic: str, stop: threading.Event | None = None) -> None:
        """Before the query starts: have Spark replay its newest committed
        batch if the target does not hold it (:mod:`spark_consumer.checkpoint`).
        An unreachable target is waited for (:mod:`schemas.retry`)."""

        self._checkpoint = checkpoint
        progress = None
        for attempt in Outage(retry_policy(self.config), stop, log):
            with attempt, attributed(database=(TARGET, self.config.consumer.target_dsn)):
                progress = read_progress(self._connection(), self.config.consumer.group, topic)
        if progress is None:
            raise Stopped()
        # Offsets counted in another incarnation of the topic say nothing of
        # this one's batches (the progress keeps the id they were read from).
        incarnation = newest_topic_id(checkpoint)
        next_offsets = {p: prog.for_incarnation(incarnation).next_offset for (_, p), prog in progress.items()}
        batch = replay_unapplied(checkpoint, next_offsets)
        if batch is not None:
            log.warning("shape %s: Spark's checkpoint has batch %d as done but the target never committed all of "
                        "it (target progress %s); it and every later batch are read and applied again",
                        self.shape.shape_name, batch, dict(sorted(next_offsets.items())))
            return
        # The newest batch is applied; its group commit may not be (killed in
        # between): commit what the target holds, for the incarnation it was
        # read from, on the apply thread (a broker that is down holds it there).
        read_from, moved = newest_moved(checkpoint, next_offsets)
        if read_from and moved:
            self._apply_thread.submit(self._group().commit, {(topic, p): o for p, o in moved.items()}, read_from)

    def _connection(self):

        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(self.config.consumer.target_dsn, autocommit=True)
            ensure_progress(self._conn)
            ensure_table(self._conn, self.target, self.config.consumer.on_dropped_column)
        return self._conn

    def _decode(self, batch_df, batch_id: int):
        """The batch's rows as Arrow, decoded on the executors with the newest
        writer schemas the batch needs: a batch that carries a value schema
        the layout was not derived with is decoded again after the schemas
        are learned again (no query restart for a schema change)."""
        if self.schemas is None:
            return batch_df.toArrow()
        for _ in range(NEW_SCHEMA_ROUNDS):
            layout = self.schemas.layout()
            table = batch_df.mapInArrow(functools.partial(decode_batches, self.source, self.schemas, True),
                                        layout.spark_schema()).toArrow()
            marks = table.filter(pc.equal(table.column("_wb_control"), wire.NEW_SCHEMA_CONTROL))
            if not marks.num_rows:
                return table
            self._learn_schemas(batch_id, marks.column("_wb_error")[0].as_py())
        raise self._unknown_schema(batch_id)

    def _learn_schemas(self, batch_id: int, why: str) -> None:
        """Read the shape's schemas again (the batch carries a new one) and
        derive the target the next decode of the batch goes to."""
        log.info("shape %s batch %d: %s; learning the shape's schemas again", self.shape.shape_name, batch_id, why)
        self.schemas = wait_for_schemas(self.source, discover_schemas, retry_policy(self.config))
        self._batch_target = ShapeTarget.from_avro(self.shape.shape_name, self.schemas.value_schema,
                                                   self.schemas.key_schema)

    def _unknown_schema(self, batch_id: int) -> RuntimeError:
        return RuntimeError(f"shape {self.shape.shape_name} batch {batch_id}: still written with a value schema "
                            f"that the shape's schemas do not hold after {NEW_SCHEMA_ROUNDS} lookups")

    def _follow_target(self, target: ShapeTarget) -> bool:
        """Before the batch decoded for ``target`` is applied: True when the
        target's tables must follow it (done by ensure_table, in the batch's
        transaction)."""
        return target is not self.target

    def _call(self, batch_df, batch_id: int) -> None:

        started = time.monotonic()
        if self.config.consumer.staged_apply:
            # Seed 004: each executor task plans and stages its partition's part
            # (in parallel, each on its own connection); the commit of all the
            # staged parts, with progress, is one decision on the driver.
            conn = self._connection()
            group = self.config.consumer.group
            staged = self._stage(batch_df, batch_id)
            if not staged:
                return
            read_from = self._read_from(batch_id)
            parts = [Part(r.topic, r.partition, r.start, r.end, topic_id=read_from) for r in staged]
            result = commit_batch(conn, group, [(self.target, parts)])
            self._applied(batch_id, result, sum(r.rows for r in staged),
                          max((r.newest_ts_ms or 0) for r in staged), started)
            return
        # Arrow: fast, and timestamps arrive timezone-aware (collect() would
        # give naive datetimes in the driver's local zone).
        table = self._decode(batch_df, batch_id)
        target = self._batch_target
        read_s = time.monotonic() - started
        self._finish_pending()  # batch N-1 committed (or its error fails this batch)
        if table.num_rows:
            self._pending = self._apply_thread.submit(self._apply_table, table, target, batch_id, started, read_s)

    def _stage(self, batch_df, batch_id: int) -> list:
        """Staged apply: decode and stage on the executors; the target's
        tables follow a new writer schema first, in a transaction of their own
        (the staging tables are made from them)."""
        group = self.config.consumer.group
        for _ in range(NEW_SCHEMA_ROUNDS):
            target = self._batch_target
            if self._follow_target(target):
                ensure_table(self._connection(), target, self.config.consumer.on_dropped_column)
                self.target = target
            decoded = batch_df if self.schemas is None else batch_df.mapInArrow(
                functools.partial(decode_batches, self.source, self.schemas, True),
                self.schemas.layout().spark_schema())
            staged = decoded.mapInArrow(
                functools.partial(_stage_partitions, self.config.consumer.target_dsn, group, target,
                                  OFFSET_RESET[self.config.consumer.on_data_loss], self._topic_ids(batch_id)),
                _STAGED_SCHEMA).collect()
            if all(r.rows >= 0 for r in staged):
                return staged
            self._learn_schemas(batch_id, "a task met a value schema the layout was not derived with")
        raise self._unknown_schema(batch_id)

    def _apply_table(self, table, target: ShapeTarget, batch_id: int, started: float, read_s: float) -> None:
        """Apply thread: one batch in one target transaction (with the DDL
        that makes the target follow a new writer schema), then the group's offsets."""

        began = time.monotonic()
        # Rows go to the planner as tuples, converted column by column (no dict per row).
        fields, rows = arrow_rows(table)
        conn = self._connection()
        parts = parts_from_rows(rows, fields=fields, topic_ids=self._topic_ids(batch_id))
        on_reset = OFFSET_RESET[self.config.consumer.on_data_loss]
        if self._follow_target(target):
            with conn.transaction():
                ensure_table(conn, target, self.config.consumer.on_dropped_column)
                result = apply_batch(conn, self.config.consumer.group, target, parts, on_offset_reset=on_reset)
            self.target = target
        else:
            result = apply_batch(conn, self.config.consumer.group, target, parts, on_offset_reset=on_reset)
        self._applied(batch_id, result, len(rows), _newest_ts_ms(table), started,
                      f" (read {read_s:.2f}s, apply {time.monotonic() - began:.2f}s)")

    def _applied(self, batch_id: int, result, n_rows: int, newest: int | None, started: float,
                 timings: str = "") -> None:
        """After the target committed: the group's offsets, counters, metrics, log."""
        # Tagged with the incarnation the batch was planned on: if the topic
        # was re-created since, these offsets mean nothing on the new one.
        self._group().commit(result.offsets, self._read_from(batch_id))
        for b in result.backfills_completed:
            log.info("backfill %s of shape %s complete: GC deleted %d rows, %d tombstones",
                     b.backfill_id, b.shape, b.gc_deleted, b.gc_tombstones)
        self.batches += 1
        self.rows += n_rows
        self.dlq += result.total("dlq")
        self._metrics(newest, result)
        log.info("shape %s batch %d: %d rows (%d applied, %d replayed skipped, %d dead-lettered) in %.2fs%s",
                 self.shape.shape_name, batch_id, n_rows, result.total("applied"),
                 result.total("skipped_replayed"), result.total("dlq"), time.monotonic() - started, timings)

    def _read_from(self, batch_id: int) -> str | None:
        """The topic incarnation batch ``batch_id`` was planned on (Spark's
        checkpoint records it before the batch runs; None: not known)."""
        return batch_topic_id(self._checkpoint, batch_id) if self._checkpoint else None

    def _topic_ids(self, batch_id: int) -> dict[str, str | None]:
        """The incarnation of each topic batch ``batch_id`` reads."""
        return {self.config.topic(self.shape): self._read_from(batch_id)}

    def _metrics(self, newest: int | None, result) -> None:
        """``newest``: the highest ``_wb_ts_ms`` of the batch (None/0: none)."""

        name = self.shape.shape_name
        metrics.APPLY_BATCHES.labels(name).inc()
        metrics.APPLIED_ROWS.labels(name).inc(result.total("applied"))
        metrics.APPLY_SKIPPED.labels(name).inc(result.total("skipped_replayed"))
        if result.total("dlq"):
            metrics.DLQ_MESSAGES.labels(name).inc(result.total("dlq"))
        if newest:
            metrics.APPLY_LATENCY.labels(name).observe(max(time.time() - newest / 1000, 0))


def _newest_ts_ms(table) -> int | None:

    return pc.max(table.column("_wb_ts_ms")).as_py()


# rows = -1: the task met a new writer schema and staged nothing (the batch is decoded again).
_STAGED_SCHEMA = "topic string, partition int, start long, end long, rows long, newest_ts_ms long"
_STAGED_ARROW_SCHEMA = pa.schema([("topic", pa.string()), ("partition", pa.int32()), ("start", pa.int64()),
                                  ("end", pa.int64()), ("rows", pa.int64()), ("newest_ts_ms", pa.int64())])
_stage_connections: dict[str, Any] = {}  # per Python worker process, reused across tasks


def _stage_partitions(dsn: str, group: str, target, on_offset_reset: str, topic_ids: dict[str, str | None],
                      batches):
    """Executor side: stage this task's rows, one part per Kafka partition
    (``topic_ids``: the incarnation each topic was read from)."""

    fields, rows = arrow_rows(batches)
    if not rows:
        return
    control = fields.index("_wb_control")
    if any(r[control] == wire.NEW_SCHEMA_CONTROL for r in rows):  # decoded again with the new schemas
        yield pa.RecordBatch.from_pydict({"topic": [rows[0][fields.index("_wb_topic")]], "partition": [0],
                                          "start": [0], "end": [0], "rows": [-1], "newest_ts_ms": [0]},
                                         schema=_STAGED_ARROW_SCHEMA)
        return
    ts_ms = fields.index("_wb_ts_ms")
    conn = _stage_connections.get(dsn)
    if conn is None or conn.closed:
        conn = _stage_connections[dsn] = psycopg.connect(dsn, autocommit=True)
        ensure_progress(conn)
    out = {k: [] for k in ("topic", "partition", "start", "end", "rows", "newest_ts_ms")}
    for part in parts_from_rows(rows, fields=fields, topic_ids=topic_ids):
        stage_part(conn, group, target, part, on_offset_reset=on_offset_reset)
        for k, v in (("topic", part.topic), ("partition", part.partition), ("start", part.start),
                     ("end", part.end), ("rows", len(part.rows)),
                     ("newest_ts_ms", max((r[ts_ms] or 0 for r in part.rows), default=0))):
            out[k].append(v)
    yield pa.RecordBatch.from_pydict(out, schema=_STAGED_ARROW_SCHEMA)


def start_queries(spark, config: Config, stop: threading.Event | None = None) -> tuple[list, list]:
    """Every query and its applier: one per shape, or one over all shapes
    (``[consumer] queries = "one"``, :mod:`spark_consumer.shapes_query`)."""
    kafka_conf = client_config(config.kafka.bootstrap_servers, config.kafka.client)
    queries, appliers = [], []
    for i in range(len(config.shapes) if config.consumer.queries == "per_shape" else 1):
        query, applier = restart_query(spark, config, i, kafka_conf, stop)
        queries.append(query)
        appliers.append(applier)
    return queries, appliers


def restart_query(spark, config: Config, i: int, kafka_conf: dict[str, Any], stop: threading.Event | None = None,
                  before: PipelinedApply | None = None):
    """Query ``i`` (of :func:`start_queries`) started again from its
    checkpoint; ``before``: its applier until now (the one query keeps the
    shapes it held back)."""
    if config.consumer.queries == "continuous":
        return start_continuous(config, kafka_conf, stop, before.held if before is not None else None)
    if config.consumer.queries == "one":
        return start_shapes_query(spark, config, kafka_conf, stop, before.held if before is not None else None)
    return start_query(spark, config, config.shapes[i], kafka_conf, stop)


def start_query(spark, config: Config, shape: ShapeConfig, kafka_conf: dict[str, Any],
                stop: threading.Event | None = None):
    """One shape's streaming query (from its checkpoint) and its applier."""

    topic = config.topic(shape)
    opts = source_options(config, shape)
    schemas = wait_for_schemas(opts, discover_schemas, retry_policy(config), stop)
    target = ShapeTarget.from_avro(shape.shape_name, schemas.value_schema, schemas.key_schema)
    applier = ShapeApplier(config, shape, target, kafka_conf, opts, schemas)
    df = read_raw_stream(spark, opts)
    checkpoint = Path(config.consumer.checkpoint_dir) / shape.shape_name
    applier.recover(checkpoint, topic, stop)
    query = (df.writeStream.queryName(f"walbridge:{shape.shape_name}").foreachBatch(applier)
             .option("checkpointLocation", str(checkpoint))
             .trigger(processingTime=f"{config.consumer.trigger_interval} seconds").start())
    log.info("consuming %s into %s.%s (checkpoint %s, %s apply)", topic, target.schema, target.table, checkpoint,
             "staged" if config.consumer.staged_apply else "driver")
    return query, applier


def _headline(error: BaseException) -> str:
    """The line of an error that says what went wrong, for a log line
    (Spark's and libpq's run long): the raised exception of a Python
    traceback Spark wraps, else the first line."""
    lines = str(error).strip().splitlines() or ["?"]
    if "Traceback (most recent call last)" in lines[0]:
        raised = [line for line in lines if _RAISED.match(line)]
        if raised:
            return raised[-1][:300]
    return lines[0][:300]


# A Python traceback's last line: "module.Name: message" or "SomeError: message"
# (not the "Identifier: ..." lines Spark appends about the query).
_RAISED = re.compile(r"(?:[A-Za-z_]\w*\.)+[A-Za-z_]\w*: |[A-Za-z_]\w*(?:Error|Exception|Exit): ")


QUERY_RESTARTS = 5  # failures of one query tolerated within QUERY_FAILURE_WINDOW (transient ones aside)
QUERY_FAILURE_WINDOW = 600.0


def query_failure(config: Config, error: BaseException) -> Failure | None:
    """A failed query's error as a Failure of its endpoint: raised in the
    apply thread (an exception), or in a Spark task (recognised in its text);
    None when it is neither (counted against ``QUERY_RESTARTS``)."""
    failure = classify(error, database=(TARGET, config.consumer.target_dsn), kafka=config.kafka.bootstrap_servers,
                       registry=config.kafka.schema_registry_url)
    return failure if failure is not None else classify_text(str(error))


def cannot_follow(error: BaseException) -> bool:
    """Did a query fail because its target cannot follow the shape's new
    writer schema (raised in the apply thread, or through Spark as text)?"""
    return isinstance(error, ShapeCannotFollow) or ShapeCannotFollow.__name__ in str(error)


def run(config: Config, master: str | None = None, stop: threading.Event | None = None,
        appliers: list | None = None) -> None:
    """Run the queries until ``stop`` is set or one fails for good; ``appliers``
    (if given) receives each query's :class:`ShapeApplier` (for counters)."""

    reach_target(config, stop)
    if stop is not None and stop.is_set():
        return
    # The continuous reader needs no Spark (spark_consumer.continuous); the
    # session quiets Spark's log itself (spark_consumer.session).
    spark = None if config.consumer.queries == "continuous" else spark_session(master)
    queries: list = []
    started: list = []
    try:
        queries, started = start_queries(spark, config, stop)
    except Stopped:
        if spark is not None:
            spark.stop()
        return
    if appliers is not None:
        appliers.extend(started)
    kafka_conf = client_config(config.kafka.bootstrap_servers, config.kafka.client)
    policy = retry_policy(config)
    whence = "the target's progress" if config.consumer.queries == "continuous" else "its checkpoint"
    failures: list[list[float]] = [[] for _ in queries]
    given_up: set[int] = set()  # shapes whose target cannot follow their schema: stopped, the others go on
    outages: list[list[float]] = [[] for _ in queries]  # when each transient failure in a row happened
    try:
        while not (stop and stop.is_set()):
            for i, q in enumerate(queries):
                if i in given_up:
                    continue
                if q is None:  # the one query, every shape held back
                    given_up.add(i)
                    continue
                failure = None
                if q.isActive:
                    # An apply runs after its foreachBatch returned; when it
                    # fails and no batch follows to raise it, stop the query here.
                    failure = started[i].error
                    if failure is None and started[i].needs_restart:  # the one query held a shape back
                        started[i].settle(SETTLE_S)
                        q.stop()
                        started[i].close()
                        queries[i], started[i] = restart_query(spark, config, i, kafka_conf, stop, started[i])
                        if appliers is not None:
                            appliers.append(started[i])
                        continue
                    if failure is None:
                        if outages[i] and q.lastProgress is not None:
                            outages[i] = []  # batches flow again
                        started[i].retry_commits()
                        continue
                    if not started[i].quiesce():
                        continue  # the batch being read raises the error and ends the query
                    q.stop()
                elif q.exception() is None:
                    return  # stopped from outside
                failure = failure or q.exception()
                if cannot_follow(failure):
                    log.error("query %s stopped: %s. The other shapes go on; this one's WAL is held (or dropped "
                              "per [ack] on_stall)", q.name, _headline(failure).split("ShapeCannotFollow: ")[-1])
                    given_up.add(i)
                    continue
                # A failed query restarts from its checkpoint: the target's
                # progress table makes that exactly-once (a crashed Python
                # worker, a broker restart mid-read). A transient failure (an
                # endpoint that does not answer) is waited out with backoff; a
                # target refusing the connection ends the job; other failures
                # (a statement's: a restart re-reads the schemas) are restarted
                # QUERY_RESTARTS times in QUERY_FAILURE_WINDOW, then end it.
                now = time.monotonic()
                verdict = query_failure(config, failure)
                if verdict is not None and verdict.permanent and (isinstance(failure, psycopg.OperationalError)
                                                                  or verdict.endpoint == KAFKA):
                    raise verdict from failure  # refused (target login, Kafka credentials or ACLs): no restart helps
                if verdict is not None and not verdict.permanent:
                    outages[i].append(now)
                    elapsed = now - outages[i][0]
                    if policy.max_elapsed and elapsed > policy.max_elapsed:
                        log.error("query %s: %s; giving up after %.0fs (reconnect_max_elapsed)", q.name,
                                  verdict.headline, elapsed)
                        raise verdict from failure
                    delay = policy.delay(len(outages[i]))
                    log.warning("query %s failed: %s; restarting it from %s in %.1fs (failing for %.0fs)",
                                q.name, verdict.headline, whence, delay, elapsed)
                else:
                    failures[i] = [t for t in failures[i] if now - t < QUERY_FAILURE_WINDOW] + [now]
                    if len(failures[i]) > QUERY_RESTARTS:
                        log.error("query %s failed %d times in %.0fs", q.name, len(failures[i]),
                                  QUERY_FAILURE_WINDOW)
                        if verdict is not None:
                            raise verdict from failure
                        raise RuntimeError(f"query {q.name} failed {len(failures[i])} times in "
                                           f"{QUERY_FAILURE_WINDOW:.0f}s; last: {failure}")
                    delay = min(2.0 ** len(failures[i]), 30.0)
                    log.error("query %s failed (%s); restarting it from %s in %.0fs", q.name,
                              _headline(failure), whence, delay)
                if pause(stop, delay):
                    return
                started[i].close()
                queries[i], started[i] = restart_query(spark, config, i, kafka_conf, stop, started[i])
                if appliers is not None:
                    appliers.append(started[i])
            if spark is None:
                pause(stop, 1.0)
                continue
            spark.streams.resetTerminated()
            try:
                spark.streams.awaitAnyTermination(1.0)
            except StreamingQueryException:
                pass  # handled above on the next round
    except Stopped:
        return
    finally:
        stop_queries(queries, started, SETTLE_S)
        for applier in started:
            applier.close()
        if spark is not None:
            spark.stop()


SETTLE_S = 10.0  # at shutdown: how long the queries' batches in hand may take, all together


def stop_queries(queries: list, appliers: list[ShapeApplier], timeout: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
    """Stop every query, each once its applier holds no batch being read
    (:meth:`ShapeApplier.settle`), within one shared ``timeout``: all refuse
    new batches at once, so N busy queries wait ``timeout``, not N times it."""
    deadline = clock() + timeout
    for applier in appliers:
        applier.quiesce()
    for q, applier in zip(queries, appliers):
        applier.settle(max(0.0, deadline - clock()))
        if q is not None:
            q.stop()
