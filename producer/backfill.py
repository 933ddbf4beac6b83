"""Backfills: re-read one shape — all of it, or some of its key buckets — from a
fresh snapshot while the replication stream goes on (pg-tube's backfill, seed 001).

Convergence is resolved in the apply, by position, not with watermarks:
- Each backfill attempt creates a *temporary* logical slot that exports its
  snapshot. The slot's consistent point S is exact: a transaction is visible in
  the snapshot iff its commit record precedes S, i.e. iff its changes carry
  positions below S. Every backfill read carries position ``(S, 0)``; the
  consumer keeps, per key, the highest position (and tombstones for deletes),
  so a backfill row and a live change of the same key converge to the source's
  current value in whatever order they arrive.
- Why not DBLog-style low/high watermarks around each chunk: a chunk's SELECT
  sees transactions in ProcArray order, not commit-LSN order, so a transaction
  whose commit record precedes the low watermark can still be invisible to the
  SELECT, and the stale chunk row would win over its change. The exported
  snapshot has no such window. Its cost: one REPEATABLE READ transaction stays
  open for the backfill's duration (it holds back vacuum's horizon), and a
  walsender lives for the moment the temporary slot is created.

Invariants:
- A backfill ends with a ``backfill_end`` control event at ``(S, 0)`` on every
  partition of the shape's topic, produced once all of the backfill's reads are
  in Kafka (:class:`producer.reads.Reads`). It is a Kafka tombstone
  with headers, which Debezium-envelope consumers skip. Its info:
  ``{"backfill_id", "shape", "lsn": S, "partitions", "rows", "scope"}``; the
  consumer garbage-collects rows of the scope below S once it has applied it
  on every partition (``scope`` null = the whole shape; else key buckets, see
  :mod:`schemas.buckets`).
- Backfills run one at a time, in request order (:class:`Backfills`, driven by
  the stream loop between its rounds).
- Live changes first: a chunk (``[backfill] chunk_rows``) is encoded only when
  the replication stream has nothing waiting, or when none has gone for
  ``[backfill] force_after`` seconds, so a never-idle stream cannot starve a
  backfill and a live change waits at most one chunk. Reading runs in a thread
  (I/O), at most ``QUEUE_CHUNKS`` chunks ahead; loading, filtering and encoding
  run in the stream's thread.
- A backfill is done once its ``backfill_end`` events are delivered on every
  partition; a source error other than a lost connection fails that request
  alone (a lost connection restarts the producer, and the backfill with it).
- Backfill messages carry ``wb.backfill``; partition tails (replay
  de-duplication) skip them, so they never hide a streamed change.
- A backfill's snapshot point S is in its request's ``running`` record, and
  Kafka acknowledged it, before its first row is sent: what Kafka may hold of
  it is known without reading its rows (a failover checks that nothing in
  Kafka lies past the new timeline's fork, :mod:`producer.failover`).
- Requests and their state: :mod:`producer.backfill_requests`. A producer
  that restarts re-runs every request not ``done``, from a new snapshot: the
  interrupted attempt's rows are older than the new S and are overwritten or,
  lacking a ``backfill_end``, simply never trigger garbage collection.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import psycopg
from confluent_kafka import Consumer, Producer, TopicPartition
from psycopg import sql

from producer import metrics
from producer.backfill_requests import publish_state, read_states, request_backfill
from producer.catalog import TableInfo, row_estimate
from producer.kafka_io import DeliveryLedger
from producer.pgoutput import lsn_to_str
from producer.reads import Reads
from producer.replication import ReplicationConnection, connect
from producer.shapes import RelationPlan
from producer.snapshot import copy_chunks
from schemas import buckets, wire
from schemas.config import Config
from schemas.kafka import produce_acknowledged, scan_consumer

log = logging.getLogger("walbridge.backfill")

QUEUE_CHUNKS = 16
STATE_TIMEOUT_S = 30.0  # for Kafka to acknowledge a backfill's snapshot point
_DONE = object()


class SnapshotReader:
    """A thread that creates a temporary slot, imports its exported snapshot
    and COPYs one query in chunks into a bounded queue. ``lsn`` (the snapshot's
    consistent point) is set before the first chunk."""

    def __init__(self, dsn: str, slot_name: str, copy_sql: sql.Composable, chunk_rows: int):
        self._dsn, self._slot, self._copy_sql, self._chunk_rows = dsn, slot_name, copy_sql, chunk_rows
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUE_CHUNKS)
        self._stop = threading.Event()
        self.lsn: int | None = None
        self.reading_since: float | None = None  # wall time its COPY began (slot created, snapshot imported)
        self.error: BaseException | None = None
        self.finished = False
        self._thread = threading.Thread(target=self._run, name=f"backfill-{slot_name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            with connect(self._dsn) as conn:
                conn.autocommit = False
                conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
                repl = ReplicationConnection(self._dsn, self._slot)
                try:
                    lsn, snapshot_name = repl.create_slot(temporary=True)
                    conn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot_name)))
                finally:
                    repl.close()  # the snapshot lives on in our transaction; the slot goes
                self.lsn = lsn
                self.reading_since = time.time()
                for chunk in copy_chunks(conn, self._copy_sql, self._chunk_rows):
                    if not self._put(chunk):
                        return
                conn.rollback()
        except BaseException as e:  # reported to the pipeline
            self.error = e
        finally:
            self._put(_DONE)

    def take(self) -> tuple[bytes, int] | None:
        """The next chunk (COPY text lines, row count), or None if none is
        ready; sets ``finished`` at the end."""
        if self.error is not None:
            raise self.error
        try:
            item = self._queue.get_nowait()
        except queue.Empty:
            return None
        if item is _DONE:
            if self.error is not None:
                raise self.error
            self.finished = True
            return None
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


# ----------------------------------------------------------------- a backfill
def backfill_query(table: TableInfo, columns: tuple[str, ...], scope: dict | None) -> sql.Composable:
    q = sql.SQL("SELECT {} FROM {}").format(sql.SQL(", ").join(sql.Identifier(c) for c in columns),
                                           sql.Identifier(table.schema, table.name))
    if scope:
        q += sql.SQL(" WHERE ") + buckets.in_scope(scope)
    return sql.SQL("COPY ({}) TO STDOUT").format(q)


@dataclass
class Backfill:
    """One attempt at one request, as :class:`Backfills` drives it."""

    request: dict
    table: TableInfo
    route: Any  # the shape's route in its RelationPlan
    plan: Any  # the table's RelationPlan
    reader: SnapshotReader
    total_estimate: int
    started: float = field(default_factory=time.time)
    backfill_id: str = ""
    rows: int = 0  # rows read from the table
    sent: int = 0  # rows produced (inside the shape's filter)
    last_chunk: float = field(default_factory=time.monotonic)
    end_counts: dict = field(default_factory=dict)  # writer -> produced count at backfill_end
    finished: float | None = None
    source: Any = None  # envelope source block, once the snapshot's LSN is known
    headers: list = field(default_factory=list)
    encoder: Any = None  # the compiled read encoder of ``plan`` (None: the reference path)

    @property
    def shape(self) -> str:
        return self.request["shape"]

    def progress(self) -> dict:
        elapsed = max(time.time() - self.started, 1e-6)
        rate = self.rows / elapsed
        remaining = max(self.total_estimate - self.rows, 0)
        return {"request_id": self.request["request_id"], "backfill_id": self.backfill_id or None,
                "shape": self.shape, "scope": self.request.get("scope"), "reason": self.request.get("reason"),
                "rows": self.rows, "sent": self.sent, "total_estimate": self.total_estimate,
                "rows_per_s": round(rate, 1), "eta_s": round(remaining / rate, 1) if rate > 0 and not
                self.finished else None, "started": self.started, "state": "ending" if self.end_counts else
                "running"}


def temp_slot_name(slot: str) -> str:
    return f"{slot[:40]}_bf_{uuid.uuid4().hex[:12]}"


class Backfills:
    """The backfill requests of one run of the producer and the one running:
    requests come from the requests topic (and from shapes new to the config),
    run one at a time in request order, and publish their state there."""

    def __init__(self, config: Config, kafka: Producer, kafka_conf: dict[str, Any], conn: psycopg.Connection,
                 tables: dict[str, TableInfo], plan_table: Callable[[TableInfo], RelationPlan], reads: Reads,
                 ledger: DeliveryLedger):
        self._config = config
        self._kafka = kafka
        self._kafka_conf = kafka_conf
        self._conn = conn  # the catalog connection: row estimates
        self._tables = tables
        self._plan_table = plan_table
        self._reads = reads
        self._ledger = ledger
        self._partitions = reads.partitions
        self.topic = wire.backfills_topic(config.kafka.topic_prefix)
        self.requests: dict[str, dict] = {}  # request id -> latest state record
        self.queue: list[dict] = []
        self.running: Backfill | None = None
        self.done: list[dict] = []  # the last few finished, for status
        self._requests_consumer: Consumer | None = None

    def request(self, shape: str, reason: str) -> None:
        """A backfill of ``shape`` for what the WAL did not carry (a schema
        change, a truncated partition, a table attached with rows)."""
        request_id = request_backfill(self._config, shape, reason=reason)
        log.warning("%s: backfill %s of shape %s requested", reason, request_id, shape)

    def defer(self, shape: str, reason: str) -> None:
        """A backfill of a stopped ``shape``, for the run after the fix: known
        to this run, so it does not start it."""
        request_id = request_backfill(self._config, shape, reason=reason)
        self.requests[request_id] = {"request_id": request_id, "shape": shape, "state": "requested"}

    def load(self, new_topics: set[str]) -> None:
        """Requests not done yet are (re)started; shapes whose topics are new get one."""
        states, end = read_states(self._kafka_conf, self.topic)
        self.requests = states
        shapes = {s.shape_name: s for s in self._config.shapes}
        for record in sorted(states.values(), key=lambda r: r.get("requested_at", 0)):
            if record["state"] in ("requested", "running"):
                if record["shape"] not in shapes:
                    self._set_state(record, "failed", error=f"shape {record['shape']!r} is not in the config")
                    continue
                self.queue.append(record)
        if self._config.backfill.new_shapes == "backfill":
            requested = {r["shape"] for r in states.values()}
            for shape in self._config.shapes:
                if self._config.topic(shape) in new_topics and shape.shape_name not in requested:
                    log.info("shape %s is new (its topic holds nothing): backfilling it", shape.shape_name)
                    record = {"request_id": f"new-shape-{shape.shape_name}-{int(time.time())}",
                              "shape": shape.shape_name, "scope": None, "reason": "new shape",
                              "state": "requested", "requested_at": time.time()}
                    self._set_state(record, "requested")
                    self.queue.append(record)
        consumer = scan_consumer(self._kafka_conf, "backfill-requests")
        consumer.assign([TopicPartition(self.topic, 0, end)])
        self._requests_consumer = consumer

    def poll(self) -> None:
        """New requests (``walbridge backfill``/``reconcile``) from the requests topic."""
        while self._requests_consumer is not None:
            msg = self._requests_consumer.poll(0)
            if msg is None or msg.error():
                break
            try:
                record = json.loads(msg.value())
                rid = record["request_id"]
            except (TypeError, ValueError, KeyError):
                continue
            known = rid in self.requests
            self.requests[rid] = record
            if record.get("state") == "requested" and not known:
                log.info("backfill of shape %s requested (%s)", record["shape"], rid)
                self.queue.append(record)
        if self.running is None and self.queue:
            self._start(self.queue.pop(0))

    def close(self) -> None:
        if self.running is not None:
            self.running.reader.close()
        if self._requests_consumer is not None:
            self._requests_consumer.close()

    def _set_state(self, record: dict, state: str, acknowledged: bool = False, **extra) -> None:
        """Publish ``record`` in ``state``; ``acknowledged``: wait until Kafka holds it."""
        record = {**record, **extra, "state": state, "updated_at": time.time()}
        self.requests[record["request_id"]] = record
        if acknowledged:
            produce_acknowledged(self._kafka, self.topic, json.dumps(record).encode(), record["request_id"].encode(),
                                 STATE_TIMEOUT_S, "recording a backfill's snapshot point")
        else:
            publish_state(self._kafka, self.topic, record)

    def _start(self, request: dict) -> None:
        shape = next((s for s in self._config.shapes if s.shape_name == request["shape"]), None)
        if shape is None:
            self._set_state(request, "failed", error=f"shape {request['shape']!r} is not in the config")
            return
        table = self._tables[shape.table]
        plan = self._plan_table(table)
        route = next(r for r in plan.routes if r.name == shape.shape_name)
        scope = request.get("scope")
        source = self._config.source
        reader = SnapshotReader(source.dsn, temp_slot_name(source.slot),
                                backfill_query(table, tuple(plan.names), scope), self._config.backfill.chunk_rows)
        estimate = row_estimate(self._conn, table)
        if scope:
            estimate = estimate * len(scope["buckets"]) // max(int(scope["bucket_count"]), 1)
        self.running = Backfill(request, table, route, plan, reader, estimate, encoder=self._reads.encoder(plan))
        reader.start()
        self._set_state(request, "running", started_at=time.time())
        log.info("backfill of shape %s started (%s, %s)", shape.shape_name, request["request_id"],
                 f"{len(scope['buckets'])} of {scope['bucket_count']} key buckets" if scope else "whole shape")

    def tick(self, idle: bool) -> bool:
        """One step of the running backfill, if any and if it is its turn
        (``idle``: the stream has nothing waiting): a chunk of rows, or its
        ``backfill_end`` events, or noticing they were delivered. Returns
        whether there is more to do at once."""
        bf = self.running
        if bf is None:
            return False
        now = time.monotonic()
        if bf.end_counts:
            delivered = all(self._ledger.delivered.get(w, 0) >= n for w, n in bf.end_counts.items())
            if delivered:
                self._finish(bf)
            return False
        if not idle and now - bf.last_chunk < self._config.backfill.force_after:
            return False
        try:
            chunk = bf.reader.take()
        except psycopg.OperationalError:
            raise  # connection trouble: the producer restarts, and so does the backfill
        except psycopg.Error as e:
            log.error("backfill %s of shape %s failed: %s", bf.request["request_id"], bf.shape, e)
            bf.reader.close()
            self._set_state(bf.request, "failed", error=str(e).strip())
            self.running = None
            return False
        if chunk is None and not bf.reader.finished:
            return False  # the reader is behind (or still creating its slot)
        if chunk is None and self._reads.in_flight():
            return False  # every row is sent: backfill_end waits for Kafka to hold them
        lsn = bf.reader.lsn
        if not bf.backfill_id:
            bf.backfill_id = f"bf:{bf.request['request_id']}@{lsn_to_str(lsn)}"
            bf.source = bf.route.codec.source_bytes(lsn, None, int(time.time() * 1000), "incremental",
                                                    bf.backfill_id)
            bf.headers = [(wire.POSITION_HEADER, wire.position_header(lsn, 0)),
                          (wire.SNAPSHOT_HEADER, bf.backfill_id.encode()),
                          (wire.BACKFILL_HEADER, bf.backfill_id.encode())]
            self._set_state(bf.request, "running", acknowledged=True, started_at=bf.started,
                            backfill_id=bf.backfill_id, lsn=lsn)
        bf.last_chunk = now
        if chunk is not None:
            route = bf.route
            data, rows = chunk
            bf.sent = self._reads.send_copy(bf.plan, bf.encoder, [route], data, {route.name: bf.source}, bf.headers,
                                            int(time.time() * 1000), bf.sent)
            bf.rows += rows
            metrics.SNAPSHOT_ROWS.inc(rows)
            return True
        # Every read is in Kafka: end the backfill on every partition, after its reads.
        topic = bf.route.topic
        writers = [(topic, p) for p in range(self._partitions[topic])]
        self._reads.send_end(writers, bf.headers, wire.BACKFILL_END, bf.backfill_id,
                             {"backfill_id": bf.backfill_id, "shape": bf.shape, "lsn": lsn,
                              "partitions": self._partitions[topic], "rows": bf.sent, "scope": bf.request.get("scope")})
        bf.end_counts = {w: self._ledger.produced[w] for w in writers}
        return False

    def _finish(self, bf: Backfill) -> None:
        bf.finished = time.time()
        bf.reader.close()
        done = {**bf.progress(), "state": "done", "finished": bf.finished}
        self.done = (self.done + [done])[-10:]
        reading_since = bf.reader.reading_since or bf.started
        self._set_state(bf.request, "done", backfill_id=bf.backfill_id, lsn=bf.reader.lsn, rows=bf.sent,
                        read=bf.rows, started_at=bf.started, reading_since=reading_since, finished_at=bf.finished)
        log.info("backfill %s of shape %s done: %d rows read, %d produced in %.2fs (%.2fs from its first COPY)",
                 bf.backfill_id, bf.shape, bf.rows, bf.sent, bf.finished - bf.started, bf.finished - reading_since)
        self.running = None
        if self.queue:
            self._start(self.queue.pop(0))
