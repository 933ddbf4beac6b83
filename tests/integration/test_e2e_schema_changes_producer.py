"""Schema changes at the source while everything streams: the producer's rows
of the README's "Schema changes" table (issue 12). ``walbridge producer`` and
``walbridge consumer`` run as processes throughout, a load writes every table
at a steady rate, and each change ends with the target equal to the source on
the source's current columns (cast back to the source's types), no manual
command, both processes alive, and no Spark query restarted. Values the WAL
did not carry (a default, a narrowing retype, a key change) arrive through the
backfill the producer asks for itself.

One producer/consumer pair serves the whole module (a table per test); the
tests that stop a shape (its WAL then stays held) come last."""

from __future__ import annotations

import re

import psycopg
import pytest

from producer.pgoutput import lsn_to_int
from tests.helpers import wait_for
from tests.integration import test_e2e_schema_changes as e2e
from tests.integration.test_e2e_schema_changes import (
    assert_alive,
    assert_no_query_restart,
    settle,
    target_columns,
    wait_equal,
)

TABLES = {
    "p_default": "CREATE TABLE p_default (id int PRIMARY KEY, a int)",
    "p_narrow": "CREATE TABLE p_narrow (id int PRIMARY KEY, a bigint, n numeric(10,2) DEFAULT 0.45, "
                "t text DEFAULT ' 12 ')",
    "p_rename": "CREATE TABLE p_rename (id int PRIMARY KEY, a int, note text DEFAULT 'n')",
    "p_key": "CREATE TABLE p_key (id int PRIMARY KEY, a int, code int NOT NULL DEFAULT 1)",
    "p_trunc": "CREATE TABLE p_trunc (id int PRIMARY KEY, a int)",
    "p_where": "CREATE TABLE p_where (id int PRIMARY KEY, a int, region text DEFAULT 'eu')",
    "p_unkey": "CREATE TABLE p_unkey (id int PRIMARY KEY, a int)",
    "p_moved": "CREATE TABLE p_moved (id int PRIMARY KEY, a int)",
    "p_cols": "CREATE TABLE p_cols (id int PRIMARY KEY, a int, label text DEFAULT 'l')",
    "p_dropped": "CREATE TABLE p_dropped (id int PRIMARY KEY, a int)",
}
ROWS = e2e.ROWS  # each table's rows before the load (e2e.streaming)
RATE = 60  # load transactions per second, over all tables


class Load(e2e.Load):
    """An insert and an update (of ``id``, ``a`` only) per transaction on the
    tables in ``tables``, round robin at ``RATE`` per second (pausing as the
    consumer's module's load does)."""

    def __init__(self, dsn: str):
        super().__init__(dsn)
        self.tables = list(TABLES)

    def _run(self) -> None:
        next_id = ROWS + 1
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                while not self.stop.wait(1 / RATE):
                    if not self.running.is_set():
                        self.idle.set()
                        continue
                    self.idle.clear()
                    table = self.tables[next_id % len(self.tables)]
                    with conn.transaction():
                        conn.execute(f"INSERT INTO {table} (id, a) VALUES (%s, %s)", (next_id, next_id % 50))
                        conn.execute(f"UPDATE {table} SET a = a + 1 WHERE id = %s", (next_id % ROWS + 1,))
                    next_id += 1
                    self.transactions += 1
        except BaseException as e:  # surfaced by the tests
            self.errors.append(e)


@pytest.fixture(scope="module")
def pipeline(pg_cluster, kafka_broker, tmp_path_factory):
    shapes = [{"table": f"public.{t}"} for t in TABLES]
    shapes.append({"table": "public.p_where", "name": "p_where_eu", "where": "region = 'eu'"})
    shapes.append({"table": "public.p_cols", "name": "p_cols_slim", "columns": ["id", "a", "label"]})
    with e2e.streaming(pg_cluster, kafka_broker, tmp_path_factory.mktemp("schema-changes-producer"), "ddlp", TABLES,
                       shapes, Load) as state:
        yield state


def ddl(state, *statements: str) -> None:
    with psycopg.connect(state["source"], autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)
    settle(state)


def producer_said(state, text: str, timeout: float = 60) -> str:
    """The producer's first log line containing ``text``, once there is one."""
    def line():
        return next((ln for ln in state["producer_log"].read_text().splitlines() if text in ln), None)
    try:
        return wait_for(line, timeout=timeout, what=f"the producer logging {text!r}")
    except AssertionError as e:
        tail = [ln for ln in state["producer_log"].read_text().splitlines() if "librdkafka" not in ln][-15:]
        with psycopg.connect(state["source"]) as conn:
            cols = conn.execute("SELECT c.relname, array_agg(a.attname ORDER BY a.attnum) FROM pg_class c JOIN "
                                "pg_attribute a ON a.attrelid = c.oid WHERE c.relname LIKE 'p\\_%%' AND a.attnum > 0 "
                                "AND NOT a.attisdropped GROUP BY 1").fetchall()
            activity = conn.execute("SELECT application_name, state, wait_event_type, left(query, 80) FROM "
                                    "pg_stat_activity WHERE backend_type IN ('client backend', 'walsender')").fetchall()
        raise AssertionError(f"{e}; the producer's log ends with:\n" + "\n".join(tail)
                             + f"\nsource tables: {cols}\nactivity: {activity}") from None


def converged(state, table: str) -> None:
    wait_equal(state, table, timeout=120)
    assert_alive(state)
    assert_no_query_restart(state)


def test_add_column_with_a_constant_or_volatile_default_fills_existing_rows(pipeline):
    ddl(pipeline, "ALTER TABLE p_default ADD COLUMN d int DEFAULT 7")
    producer_said(pipeline, "column added with a constant default d (integer): backfill")
    ddl(pipeline, "ALTER TABLE p_default ADD COLUMN e timestamptz DEFAULT clock_timestamp()")
    producer_said(pipeline, "column added with a volatile default (table rewritten) e")
    converged(pipeline, "p_default")
    with psycopg.connect(pipeline["target"]) as t:
        assert t.execute("SELECT count(*) FROM p_default WHERE id <= %s AND d = 7 AND e IS NOT NULL",
                         (ROWS,)).fetchone()[0] == ROWS


def test_narrowing_retypes_converge_by_a_re_read(pipeline):
    ddl(pipeline, "UPDATE p_narrow SET n = id + 0.45 WHERE id <= 50")
    # Values of the old types that the new ones cannot hold, in flight when the types change (and the
    # load's rows of the old writer, n = 0.45, t = ' 12 '): the consumer reads them into the new types.
    ddl(pipeline, "UPDATE p_narrow SET a = 3000000000 + id WHERE id <= 5", "UPDATE p_narrow SET a = id WHERE id <= 5",
        "ALTER TABLE p_narrow ALTER COLUMN a TYPE int, ALTER COLUMN n TYPE numeric(10,0), "
        "ALTER COLUMN t DROP DEFAULT, ALTER COLUMN t TYPE int USING t::int, ALTER COLUMN t SET DEFAULT 12")
    producer_said(pipeline, "schema change of public.p_narrow, shape public.p_narrow: column retyped a (bigint → integer)")
    converged(pipeline, "p_narrow")
    cols = target_columns(pipeline["target"], "p_narrow")
    assert (cols["a"][0], cols["n"][0], cols["t"][0]) == ("integer", "numeric(10,0)", "integer")


def test_rename_column_renames_the_target_column(pipeline):
    ddl(pipeline, "UPDATE p_rename SET note = 'before ' || id WHERE id <= 20")
    ddl(pipeline, "ALTER TABLE p_rename RENAME COLUMN note TO remark")
    producer_said(pipeline, "column renamed remark (note → remark)")
    converged(pipeline, "p_rename")
    cols = target_columns(pipeline["target"], "p_rename")
    assert "remark" in cols and "note" not in cols  # renamed, not a stale column that looks current
    with psycopg.connect(pipeline["target"]) as t:
        assert t.execute("SELECT count(*) FROM p_rename WHERE remark LIKE 'before %'").fetchone()[0] == 20


def test_a_primary_key_change_re_keys_the_shape(pipeline):
    ddl(pipeline, "ALTER TABLE p_key DROP CONSTRAINT p_key_pkey, ADD PRIMARY KEY (id, code)")
    producer_said(pipeline, "schema change of public.p_key, shape public.p_key: key changed (id → id, code)")
    with psycopg.connect(pipeline["source"], autocommit=True) as conn:
        conn.execute("UPDATE p_key SET code = 2 WHERE id <= 10")  # the new key of these rows changes
    converged(pipeline, "p_key")


def test_truncate_empties_the_target_in_the_stream(pipeline):
    ddl(pipeline, "TRUNCATE p_trunc")
    converged(pipeline, "p_trunc")
    with psycopg.connect(pipeline["target"]) as t:
        assert t.execute("SELECT count(*) FROM p_trunc WHERE id <= %s", (ROWS,)).fetchone()[0] == 0


def test_a_table_that_loses_its_key_follows_the_keyless_rules(pipeline):
    # One statement: without a key and with the default replica identity,
    # PostgreSQL would refuse the load's UPDATEs on a published table.
    ddl(pipeline, "ALTER TABLE p_unkey REPLICA IDENTITY FULL, DROP CONSTRAINT p_unkey_pkey")
    producer_said(pipeline, "public.p_unkey lost its key")
    converged(pipeline, "p_unkey")
    with psycopg.connect(pipeline["target"]) as t:
        assert t.execute("SELECT count(*) FROM pg_constraint WHERE conrelid = 'public.p_unkey'::regclass "
                         "AND contype = 'p'").fetchone()[0] == 0
    ddl(pipeline, "UPDATE p_unkey SET a = -a WHERE id <= 10", "DELETE FROM p_unkey WHERE id BETWEEN 11 AND 15")
    converged(pipeline, "p_unkey")  # FULL-identity updates and deletes of keyless rows


def _held(state, text: str) -> int:
    line = producer_said(state, text)
    return lsn_to_int(re.search(r"WAL is held from (\S+)", line).group(1))


def _confirmed(state) -> int:
    with psycopg.connect(state["source"]) as conn:
        return lsn_to_int(conn.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots "
                                       "WHERE slot_name = %s", (state["slot"],)).fetchone()[0])


def test_a_shape_whose_where_column_is_dropped_stops_alone_and_holds_wal(pipeline):
    ddl(pipeline, "ALTER TABLE p_where DROP COLUMN region")
    held = _held(pipeline, "shape p_where_eu: column region of public.p_where was dropped, and the shape's where "
                           "names it")
    converged(pipeline, "p_where")  # the other shape of the table keeps flowing
    converged(pipeline, "p_default")  # and so do the other tables
    assert _confirmed(pipeline) <= held


def test_rename_table_stops_its_shape_and_holds_wal(pipeline):
    pipeline["load"].pause()
    pipeline["load"].tables.remove("p_moved")
    pipeline["load"].resume()
    ddl(pipeline, "ALTER TABLE p_moved RENAME TO p_moved2", "INSERT INTO p_moved2 VALUES (-1, -1)")
    held = _held(pipeline, "shape public.p_moved: table public.p_moved was renamed to public.p_moved2")
    converged(pipeline, "p_default")
    assert _confirmed(pipeline) <= held
    with psycopg.connect(pipeline["target"]) as t:  # nothing of the renamed table lost or half-applied
        assert t.execute("SELECT count(*) FROM p_moved WHERE id = -1").fetchone()[0] == 0


def test_a_shape_whose_column_is_renamed_stops_alone_and_holds_wal(pipeline):
    ddl(pipeline, "ALTER TABLE p_cols RENAME COLUMN label TO tag")
    held = _held(pipeline, "shape p_cols_slim: column label of public.p_cols was renamed to tag, and the shape's "
                           "columns names it")
    converged(pipeline, "p_cols")  # the table's unfiltered shape follows the rename
    assert "tag" in target_columns(pipeline["target"], "p_cols")
    assert _confirmed(pipeline) <= held


def test_drop_table_stops_its_shape_and_holds_wal(pipeline):
    pipeline["load"].pause()
    pipeline["load"].tables.remove("p_dropped")
    pipeline["load"].resume()
    with psycopg.connect(pipeline["target"]) as t:
        before = t.execute("SELECT count(*) FROM p_dropped").fetchone()[0]
    ddl(pipeline, "DROP TABLE p_dropped")
    held = _held(pipeline, "shape public.p_dropped: table public.p_dropped was dropped (its target keeps its rows)")
    converged(pipeline, "p_default")
    assert _confirmed(pipeline) <= held
    with psycopg.connect(pipeline["target"]) as t:
        assert t.execute("SELECT count(*) FROM p_dropped").fetchone()[0] >= before
