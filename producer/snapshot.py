"""The initial snapshot: parallel COPYs inside the replication slot's exported
snapshot, sent as reads and ended by ``snapshot_end`` on every partition.

Invariants:
- Every worker connection imports the slot's exported snapshot
  (``SET TRANSACTION SNAPSHOT``) in a REPEATABLE READ READ ONLY transaction, so
  all COPYs see the database exactly at the slot's consistent point: the rows they
  read plus the changes streamed after that point are the table, once each.
- Large tables are split into ctid page ranges so several workers share them.
- Workers only read: COPY text lines, unparsed, reach the caller's ``emit``
  from the calling thread in chunks, so parsing, filtering and encoding (the
  compiled read encoder, :mod:`producer.reads`) stay single-threaded.
- The exporting replication connection stays idle until the snapshot is done.
- Every read carries the position ``(consistent point, 0)`` and the snapshot's id
  ``<slot>@<LSN>`` (``wb.snapshot``). The ``snapshot_end`` control events go out
  only after every read is acknowledged by Kafka, and the snapshot counts as
  taken only once they are too: a snapshot is complete in Kafka exactly when
  every partition of every shape topic holds its ``snapshot_end``.
"""

from __future__ import annotations

import logging
import queue
import select
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import psycopg
import psycopg.errors
from psycopg import Connection, pq, sql

from producer import metrics
from producer.catalog import TableInfo, row_estimate
from producer.pgoutput import lsn_to_str
from producer.reads import Reads
from producer.replication import connect
from producer.shapes import RelationPlan
from schemas import wire
from schemas.config import Config
from schemas.kafka import Writer

log = logging.getLogger("walbridge.producer")

CHUNK_ROWS = 500  # rows per chunk handed to the encoder (bench/RESULTS.md: 500 beat 1000 and 2000)
_SPLIT_MIN_PAGES = 1024  # ~8 MB: below this a table is one piece of work


@dataclass(frozen=True)
class Piece:
    table: TableInfo
    columns: tuple[str, ...]
    page_range: tuple[int, int] | None  # [first, last) heap pages; None = whole table

    def query(self) -> sql.Composable:
        cols = sql.SQL(", ").join(sql.Identifier(c) for c in self.columns)
        q = sql.SQL("SELECT {} FROM {}").format(cols, sql.Identifier(self.table.schema, self.table.name))
        if self.page_range is not None:
            lo, hi = self.page_range
            q += sql.SQL(" WHERE ctid >= {} AND ctid < {}").format(
                sql.Literal(f"({lo},0)"), sql.Literal(f"({hi},0)"))
        return sql.SQL("COPY ({}) TO STDOUT").format(q)


def plan_pieces(tables: list[tuple[TableInfo, tuple[str, ...], int]], workers: int) -> list[Piece]:
    """Split work: ``tables`` is (table, columns to read, relpages). Big tables
    are cut into page ranges, roughly ``workers`` pieces each; biggest first."""
    pieces = []
    for table, columns, pages in sorted(tables, key=lambda t: -t[2]):
        if pages < _SPLIT_MIN_PAGES or workers == 1:
            pieces.append(Piece(table, columns, None))
            continue
        step = -(-pages // workers)
        bounds = list(range(0, pages, step))
        for i, lo in enumerate(bounds):
            # The last range is open-ended: pages added after relpages was read.
            hi = bounds[i + 1] if i + 1 < len(bounds) else 2**31 - 1
            pieces.append(Piece(table, columns, (lo, hi)))
    return pieces


def copy_chunks(conn: Connection, copy_sql: sql.Composable, chunk_rows: int) -> Iterator[tuple[bytes, int]]:
    """The rows of a ``COPY ... TO STDOUT`` as chunks of at most ``chunk_rows``
    whole lines of COPY text, with their row counts: the form the read encoder
    takes, parsed by nothing on the reading thread.

    Read from libpq itself (``psycopg.pq``), a chunk per loop: psycopg's
    ``Copy`` drives a generator round per row, which doubled the reading
    thread's CPU, and the encoding thread waits for that CPU (the GIL;
    bench/RESULTS.md). Errors are psycopg's: the server's as its
    ``error_from_result`` gives them, a lost connection as ``OperationalError``.
    Left unfinished (an error, or the caller stopped), the connection is
    closed: it is still inside the COPY."""
    pgconn = conn.pgconn
    readable = select.poll()
    readable.register(pgconn.socket, select.POLLIN)
    finished = False
    try:
        pgconn.send_query(copy_sql.as_bytes(conn))
        while pgconn.flush():  # a non-blocking connection (psycopg's): the query may go out in parts
            writable = select.poll()
            writable.register(pgconn.socket, select.POLLIN | select.POLLOUT)
            writable.poll()
            pgconn.consume_input()
        _check(conn, _next_result(pgconn, readable), pq.ExecStatus.COPY_OUT)
        get_copy_data = pgconn.get_copy_data
        blocks: list = []
        while True:
            nbytes, data = get_copy_data(1)  # one CopyData message: one row; 0: none buffered yet
            if nbytes > 0:
                blocks.append(data)
                if len(blocks) >= chunk_rows:
                    yield b"".join(blocks), len(blocks)
                    blocks = []
            elif nbytes == 0:
                readable.poll()
                pgconn.consume_input()
            else:  # -1: the COPY is over (-2, a failure, is raised by psycopg)
                break
        _check(conn, _next_result(pgconn, readable), pq.ExecStatus.COMMAND_OK)
        if _next_result(pgconn, readable) is not None:
            raise psycopg.ProgrammingError(f"more results than the COPY's: {copy_sql.as_string(conn)}")
        finished = True
        if blocks:
            yield b"".join(blocks), len(blocks)
    finally:
        if not finished:
            conn.close()


def _next_result(pgconn: pq.abc.PGconn, readable: select.poll) -> pq.abc.PGresult | None:
    while pgconn.is_busy():
        readable.poll()
        pgconn.consume_input()
    return pgconn.get_result()


def _check(conn: Connection, result: pq.abc.PGresult | None, status: pq.ExecStatus) -> None:
    if result is None or result.status != status:
        if result is not None and result.status == pq.ExecStatus.FATAL_ERROR:
            raise psycopg.errors.error_from_result(result, encoding=conn.info.encoding)
        raise psycopg.ProgrammingError(f"COPY: {status.name} expected, not "
                                       f"{result.status.name if result is not None else 'no result'}")


def relpages(conn, table: TableInfo) -> int:
    # pg_relation_size is exact where relpages may be stale (never analysed).
    size = conn.execute("SELECT pg_relation_size(%s)", (table.oid,)).fetchone()[0]
    return size // 8192


_DONE = object()


def run_snapshot(dsn: str, snapshot_name: str, pieces: list[Piece], workers: int,
                 emit: Callable[[TableInfo, bytes, int], None]) -> int:
    """COPY every piece inside the exported snapshot; calls ``emit(table, data,
    rows)`` with chunks of COPY text lines (:func:`copy_chunks`). Returns rows read."""
    work: queue.Queue = queue.Queue()
    for p in pieces:
        work.put(p)
    out: queue.Queue = queue.Queue(maxsize=workers * 4)
    errors: list[BaseException] = []
    n_workers = max(1, min(workers, len(pieces)))

    def worker() -> None:
        try:
            with connect(dsn) as conn:
                conn.autocommit = False
                conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
                conn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot_name)))
                while not errors:
                    try:
                        piece = work.get_nowait()
                    except queue.Empty:
                        break
                    for data, n in copy_chunks(conn, piece.query(), CHUNK_ROWS):
                        out.put((piece.table, data, n))
                conn.rollback()
        except BaseException as e:  # reported to the caller
            errors.append(e)
        finally:
            out.put(_DONE)

    threads = [threading.Thread(target=worker, name=f"snapshot-{i}", daemon=True) for i in range(n_workers)]
    for t in threads:
        t.start()
    finished = 0
    rows = 0
    try:
        while finished < n_workers:
            item = out.get()
            if item is _DONE:
                finished += 1
                continue
            table, data, n = item
            rows += n
            emit(table, data, n)
    finally:
        if finished < n_workers:
            errors.append(RuntimeError("snapshot aborted"))
            while finished < n_workers:  # drain so workers can exit
                if out.get() is _DONE:
                    finished += 1
        for t in threads:
            t.join()
    real = [e for e in errors if not (isinstance(e, RuntimeError) and str(e) == "snapshot aborted")]
    if real:
        raise real[0]
    return rows


def snapshot_id(slot: str, lsn: int) -> str:
    return f"{slot}@{lsn_to_str(lsn)}"


class InitialSnapshot:
    """Takes the initial snapshot at a new slot's consistent point: every
    table's rows as reads, then ``snapshot_end`` on every partition."""

    def __init__(self, config: Config, conn: Connection, tables: dict[str, TableInfo],
                 plan_tables: Callable[[Iterable[TableInfo]], list[RelationPlan]], reads: Reads):
        self._config = config
        self._conn = conn  # the catalog connection: sizes and row estimates
        self._tables = tables
        self._plan_tables = plan_tables  # their schemas findable once it returns
        self._reads = reads
        self.progress: dict[str, Any] = {}  # for status: id, rows, total_estimate, started, done, finished

    def take(self, lsn: int, snapshot_name: str, writers: list[Writer], between_chunks: Callable[[], None],
             flush: Callable[[], None]) -> None:
        """Read everything in ``snapshot_name`` (exported at ``lsn``) and end it on
        ``writers``. ``between_chunks`` serves the producer after each chunk;
        ``flush`` waits until Kafka has acknowledged everything sent."""
        source = self._config.source
        this_id = snapshot_id(source.slot, lsn)
        now_ms = int(time.time() * 1000)
        plans: dict[str, RelationPlan] = {}
        encoders = {}
        work = []
        for (qualified, table), plan in zip(self._tables.items(), self._plan_tables(self._tables.values())):
            plans[qualified] = plan
            encoders[qualified] = self._reads.encoder(plan)
            work.append((table, tuple(plan.names), relpages(self._conn, table)))
        total = sum(row_estimate(self._conn, t) for t in self._tables.values())
        self.progress = {"id": this_id, "rows": 0, "total_estimate": total, "started": time.time(),
                         "done": False}
        sources = {route.name: route.codec.source_bytes(lsn, None, now_ms, True, this_id)
                   for plan in plans.values() for route in plan.routes}
        headers = [(wire.POSITION_HEADER, wire.position_header(lsn, 0)), (wire.SNAPSHOT_HEADER, this_id.encode())]
        started = time.monotonic()
        sent = 0

        def emit(table: TableInfo, data: bytes, rows: int) -> None:
            nonlocal sent
            plan = plans[table.qualified]
            sent = self._reads.send_copy(plan, encoders[table.qualified], plan.routes, data, sources, headers,
                                         now_ms, sent)
            self.progress["rows"] += rows
            metrics.SNAPSHOT_ROWS.inc(rows)
            between_chunks()

        pieces = plan_pieces(work, source.snapshot_workers)
        rows = run_snapshot(source.dsn, snapshot_name, pieces, source.snapshot_workers, emit)
        flush()
        self._reads.send_end(writers, headers, wire.SNAPSHOT_END, this_id,
                             {"snapshot_id": this_id, "lsn": lsn, "rows": rows})
        flush()
        self.progress.update(rows=rows, done=True, finished=time.time())
        log.info("snapshot %s done: %d rows in %.2fs", this_id, rows, time.monotonic() - started)
