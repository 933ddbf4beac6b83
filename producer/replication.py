"""The replication connection: slot creation with an exported snapshot,
START_REPLICATION, reading CopyBoth frames and sending standby status updates.
A thin shell over psycopg 3's libpq connection; protocol parsing lives in
:mod:`producer.pgoutput`.

Invariants:
- Sessions use ``DateStyle=ISO``, ``TimeZone=UTC``, ``IntervalStyle=postgres``
  and ``extra_float_digits=3`` so the text forms pgoutput and COPY produce are the
  ones the loaders expect, identical between snapshot and stream.
- The flush LSN sent to PostgreSQL never decreases within a session.
- An exported snapshot stays valid only while this connection runs nothing else;
  :meth:`ReplicationConnection.start` is the next command after the snapshot is
  no longer needed.
"""

from __future__ import annotations

import select
import time

import psycopg
from psycopg import pq

from producer.failover import Server
from producer.pgoutput import PG_EPOCH_UNIX_US, lsn_to_int, lsn_to_str, standby_status
from schemas.failures import SOURCE, Failure, postgres_failure

SESSION_OPTIONS = "-c DateStyle=ISO -c TimeZone=UTC -c IntervalStyle=postgres -c extra_float_digits=3"


def connect(dsn: str, **kwargs) -> psycopg.Connection:
    return psycopg.connect(dsn, autocommit=True, options=SESSION_OPTIONS, **kwargs)


def _now_pg_us() -> int:
    return int(time.time() * 1_000_000) - PG_EPOCH_UNIX_US


class ReplicationError(Failure):
    """The replication protocol failed; permanent or transient as its SQLSTATE
    (or, without one, its message) says (:func:`schemas.failures.postgres_failure`)."""

    def __init__(self, problem: str, sqlstate: str | None = None):
        verdict = postgres_failure(SOURCE, problem, sqlstate)
        super().__init__(SOURCE, problem, verdict.fix, permanent=verdict.permanent)


def _sqlstate(res: pq.abc.PGresult | None) -> str | None:
    code = res.error_field(pq.DiagnosticField.SQLSTATE) if res is not None else None
    return code.decode() if code else None


class ReplicationConnection:
    def __init__(self, dsn: str, slot: str):
        self.dsn = dsn
        self.slot = slot
        self.conn = connect(dsn, replication="database")
        self._pg = self.conn.pgconn
        self.flushed = 0
        self.written = 0

    def identify(self) -> Server:
        """The server this connection reached (``IDENTIFY_SYSTEM``)."""
        system_id, timeline, _, _ = self.conn.execute("IDENTIFY_SYSTEM").fetchone()
        return Server(str(system_id), int(timeline))

    def timeline_history(self, timeline: int) -> str:
        """The history file of ``timeline`` (``TIMELINE_HISTORY``; 2 or later:
        timeline 1 has none): a line per ancestor timeline, with where it ended."""
        _, content = self.conn.execute(f"TIMELINE_HISTORY {int(timeline)}").fetchone()
        return bytes(content).decode() if isinstance(content, (bytes, memoryview)) else content

    def create_slot(self, temporary: bool = False, failover: bool = False) -> tuple[int, str]:
        """Create the slot, exporting its snapshot; returns (consistent LSN, snapshot
        name). A temporary slot goes away with this connection; a failover slot
        (PostgreSQL 17+) is synchronized to standbys that ask for it."""
        kind = "TEMPORARY LOGICAL" if temporary else "LOGICAL"
        options = "SNAPSHOT 'export'" + (", FAILOVER true" if failover else "")
        row = self.conn.execute(f'CREATE_REPLICATION_SLOT "{self.slot}" {kind} pgoutput ({options})').fetchone()
        return lsn_to_int(row[1]), row[2]

    def enable_failover(self) -> None:
        """Let standbys synchronize the (inactive) slot from now on (PostgreSQL 17+)."""
        self.conn.execute(f'ALTER_REPLICATION_SLOT "{self.slot}" (FAILOVER true)')

    def start(self, publications: list[str], start_lsn: int = 0) -> None:
        names = ",".join(f'"{p}"' for p in publications)
        cmd = (f'START_REPLICATION SLOT "{self.slot}" LOGICAL {lsn_to_str(start_lsn)} '
               f"(proto_version '1', publication_names '{names}')")
        self._pg.send_query(cmd.encode())
        res = self._pg.get_result()
        if res.status != pq.ExecStatus.COPY_BOTH:
            msg = (res.error_message or b"").decode(errors="replace").strip()
            raise ReplicationError(f"START_REPLICATION failed: {msg or pq.ExecStatus(res.status).name}",
                                   _sqlstate(res))
        self.flushed = max(self.flushed, start_lsn)
        self.written = max(self.written, start_lsn)

    def read(self, timeout: float) -> bytes | None:
        """One CopyData frame, or None if none arrived within ``timeout``."""
        n, data = self._pg.get_copy_data(1)
        if n == 0:
            ready, _, _ = select.select([self._pg.socket], [], [], timeout)
            if not ready:
                return None
            self._pg.consume_input()
            n, data = self._pg.get_copy_data(1)
            if n == 0:
                return None
        if n > 0:
            return bytes(data)
        # -1: COPY ended (server closed the stream); -2: error.
        res = self._pg.get_result()
        msg = (res.error_message if res is not None else self._pg.error_message) or b""
        raise ReplicationError(f"replication stream ended: {msg.decode(errors='replace').strip() or 'closed'}",
                               _sqlstate(res))

    def send_status(self, flush_lsn: int | None = None, write_lsn: int | None = None, reply: bool = False) -> None:
        if flush_lsn is not None and flush_lsn > self.flushed:
            self.flushed = flush_lsn
        if write_lsn is not None and write_lsn > self.written:
            self.written = write_lsn
        self.written = max(self.written, self.flushed)
        frame = standby_status(self.written, self.flushed, self.flushed, _now_pg_us(), reply)
        if self._pg.put_copy_data(frame) != 1:
            raise ReplicationError("could not send standby status update")
        self._pg.flush()

    def close(self) -> None:
        try:
            self.conn.close()
        except Exception:
            pass
