"""copy_chunks, the snapshot's and backfills' COPY reader (libpq itself, a
chunk per loop), against PostgreSQL: the same bytes as psycopg's own COPY,
and every way a COPY ends (done, failed in the server, connection lost,
abandoned) leaves no half-read connection behind."""

from __future__ import annotations

import psycopg
import pytest
from psycopg import sql

from producer.snapshot import copy_chunks

ROWS = sql.SQL("COPY (SELECT g, repeat(chr(65 + g % 26), g % 300), E'tab\\there', NULL::text "
               "FROM generate_series(1, 20000) g) TO STDOUT")


def test_chunks_hold_the_bytes_psycopg_reads_and_the_connection_goes_on(source_db):
    with psycopg.connect(source_db) as conn:
        with conn.cursor().copy(ROWS) as copy:
            want = b"".join(bytes(block) for block in copy)
        chunks = list(copy_chunks(conn, ROWS, 3000))
        assert b"".join(data for data, _ in chunks) == want
        assert [n for _, n in chunks] == [3000] * 6 + [2000]
        assert all(data.count(b"\n") == n for data, n in chunks)
        assert conn.execute("SELECT 1").fetchone() == (1,)  # the same transaction, usable after the COPY
        assert list(copy_chunks(conn, sql.SQL("COPY (SELECT 1 WHERE false) TO STDOUT"), 10)) == []


def test_a_query_that_fails_mid_copy_raises_the_servers_error(source_db):
    failing = sql.SQL("COPY (SELECT 1 / (5000 - g) FROM generate_series(1, 10000) g) TO STDOUT")
    with psycopg.connect(source_db) as conn:
        with pytest.raises(psycopg.errors.DivisionByZero):
            for _ in copy_chunks(conn, failing, 100):
                pass
        assert conn.closed
    with psycopg.connect(source_db) as conn:
        with pytest.raises(psycopg.errors.UndefinedTable):
            list(copy_chunks(conn, sql.SQL("COPY no_such_table TO STDOUT"), 100))


def test_a_lost_connection_is_an_operational_error(source_db):
    big = sql.SQL("COPY (SELECT g, repeat('x', 500) FROM generate_series(1, 2000000) g) TO STDOUT")
    with psycopg.connect(source_db) as conn, psycopg.connect(source_db, autocommit=True) as other:
        pid = conn.info.backend_pid
        with pytest.raises(psycopg.OperationalError):
            for i, _ in enumerate(copy_chunks(conn, big, 500)):
                if i == 2:
                    other.execute("SELECT pg_terminate_backend(%s)", (pid,))
        assert conn.closed


def test_a_copy_left_unfinished_closes_its_connection(source_db):
    with psycopg.connect(source_db) as conn:
        chunks = copy_chunks(conn, ROWS, 100)
        next(chunks)
        chunks.close()
        assert conn.closed
