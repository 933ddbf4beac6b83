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
  partition of the shape's topic, produced after all of the backfill's reads
  (the idempotent producer keeps per-partition order). It is a Kafka tombstone
  with headers, which Debezium-envelope consumers skip. Its info:
  ``{"backfill_id", "shape", "lsn": S, "partitions", "rows", "scope"}``; the
  consumer garbage-collects rows of the scope below S once it has applied it
  on every partition (``scope`` null = the whole shape; else key buckets, see
  :mod:`schemas.buckets`).
- Live changes first: the pipeline encodes a chunk (``[backfill] chunk_rows``)
  only when the replication stream has nothing waiting, or when none has gone
  for ``[backfill] force_after`` seconds, so a never-idle stream cannot starve
  a backfill and a live change waits at most one chunk. Reading runs in a
  thread (I/O), at most ``QUEUE_CHUNKS`` chunks ahead; loading, filtering and
  encoding run in the pipeline's thread.
- Backfill messages carry ``wb.backfill``; partition tails (replay
  de-duplication) skip them, so they never hide a streamed change.
- Requests and their state: :mod:`producer.backfill_requests`. A producer
  that restarts re-runs every request not ``done``, from a new snapshot: the
  interrupted attempt's rows are older than the new S and are overwritten or,
  lacking a ``backfill_end``, simply never trigger garbage collection.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from psycopg import sql

from producer.catalog import TableInfo
from producer.replication import ReplicationConnection, connect
from producer.snapshot import copy_chunks
from schemas import buckets

log = logging.getLogger("walbridge.backfill")

QUEUE_CHUNKS = 4
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
                for chunk in copy_chunks(conn, self._copy_sql, self._chunk_rows):
                    if not self._put(chunk):
                        return
                conn.rollback()
        except BaseException as e:  # reported to the pipeline
            self.error = e
        finally:
            self._put(_DONE)

    def take(self) -> list | None:
        """The next chunk, or None if none is ready; sets ``finished`` at the end."""
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
    """One attempt at one request, as the pipeline drives it."""

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
