"""Parallel initial snapshot inside the replication slot's exported snapshot.

Invariants:
- Every worker connection imports the slot's exported snapshot
  (``SET TRANSACTION SNAPSHOT``) in a REPEATABLE READ READ ONLY transaction, so
  all COPYs see the database exactly at the slot's consistent point: the rows they
  read plus the changes streamed after that point are the table, once each.
- Large tables are split into ctid page ranges so several workers share them.
- Workers only read; rows reach the caller's ``emit`` from the calling thread, in
  chunks, so loading, filtering and encoding stay single-threaded.
- The exporting replication connection stays idle until the snapshot is done.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Callable, Iterator

from psycopg import sql

from producer.catalog import TableInfo
from producer.replication import connect

log = logging.getLogger(__name__)

CHUNK_ROWS = 2000
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


def copy_chunks(conn, copy_sql: sql.Composable, chunk_rows: int) -> Iterator[list[tuple[bytes | None, ...]]]:
    """The rows of a ``COPY ... TO STDOUT`` as lists of at most ``chunk_rows``
    raw rows (text bytes or None per column), the form the loaders take."""
    with conn.cursor().copy(copy_sql) as copy:
        chunk = []
        for row in copy.rows():
            chunk.append(tuple(None if v is None else v.encode() for v in row))
            if len(chunk) >= chunk_rows:
                yield chunk
                chunk = []
        if chunk:
            yield chunk


def relpages(conn, table: TableInfo) -> int:
    # pg_relation_size is exact where relpages may be stale (never analysed).
    size = conn.execute("SELECT pg_relation_size(%s)", (table.oid,)).fetchone()[0]
    return size // 8192


_DONE = object()


def run_snapshot(dsn: str, snapshot_name: str, pieces: list[Piece], workers: int,
                 emit: Callable[[TableInfo, list[tuple[bytes | None, ...]]], None]) -> int:
    """COPY every piece inside the exported snapshot; calls ``emit(table, rows)``
    with chunks of raw rows (text bytes or None per column). Returns rows read."""
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
                    for chunk in copy_chunks(conn, piece.query(), CHUNK_ROWS):
                        out.put((piece.table, chunk))
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
            table, chunk = item
            rows += len(chunk)
            emit(table, chunk)
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
