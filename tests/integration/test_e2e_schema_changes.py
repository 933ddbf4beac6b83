"""Schema changes at the source while everything streams (issue 12, the
consumer's rows of the README's "Schema changes" table): `walbridge producer`
and `walbridge consumer` run as processes throughout, a load thread writes
inserts, updates and deletes to every table at a steady rate, and each change
ends with the target equal to the source on the source's current columns (the
target's values cast back to the source's types), no manual command, both
processes alive, and no Spark query restarted: the consumer picks the new
writer schema up between micro-batches and changes the target table in the
transaction of the first batch that carries it.

One producer/consumer pair serves the module (one table per test), so Spark
starts once."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import psycopg
import pytest

from spark_consumer.shape_record import ShapeColumn, ShapeTarget
from spark_consumer.target_layout import ShapeCannotFollow, ensure_table
from tests.helpers import ConsumerProcess, ProducerProcess, make_config, wait_for, write_toml

TABLES = {
    "t_add": "CREATE TABLE t_add (id int PRIMARY KEY, a int, b text)",
    "t_drop": "CREATE TABLE t_drop (id int PRIMARY KEY, a int, gone int NOT NULL DEFAULT 7)",
    "t_widen": "CREATE TABLE t_widen (id int PRIMARY KEY, a int, v varchar(10))",
}
ROWS = 200
RATE = 60  # load transactions per second, over all tables
RESTART = "restarting"  # what spark_consumer.supervisor logs when it restarts the query, for whatever reason


class Load:
    """Inserts, updates and deletes on every table at ``RATE`` transactions/s,
    touching only columns no test changes (``id``, ``a``)."""

    def __init__(self, dsn: str):
        self.dsn = dsn
        self.stop = threading.Event()
        self.running = threading.Event()
        self.running.set()
        self.idle = threading.Event()
        self.transactions = 0
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        rnd = random.Random(12)
        next_id = {t: ROWS + 1 for t in TABLES}
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                while not self.stop.is_set():
                    if not self.running.is_set():
                        self.idle.set()
                        self.running.wait(0.1)
                        continue
                    self.idle.clear()
                    table = rnd.choice(list(TABLES))
                    with conn.transaction():
                        conn.execute(f"INSERT INTO {table} (id, a) VALUES (%s, %s)", (next_id[table], rnd.randint(0, 99)))
                        next_id[table] += 1
                        conn.execute(f"UPDATE {table} SET a = a + 1 WHERE id = %s", (rnd.randint(1, next_id[table]),))
                        if rnd.random() < 0.3:
                            conn.execute(f"DELETE FROM {table} WHERE id = %s", (rnd.randint(1, next_id[table]),))
                    self.transactions += 1
                    time.sleep(1 / RATE)
        except BaseException as e:  # surfaced by the tests
            self.errors.append(e)

    def pause(self) -> None:
        self.running.clear()
        assert self.idle.wait(10), "the load did not pause"

    def resume(self) -> None:
        self.running.set()


@contextlib.contextmanager
def streaming(pg_cluster, kafka_broker, tmp: Path, name: str, tables: dict[str, str], shapes: list[dict],
              load: Callable[[str], Load], **consumer) -> Iterator[dict]:
    """Source and target databases in ``pg_cluster`` (``tables``, ``ROWS`` rows
    each), ``walbridge producer`` and ``walbridge consumer`` processes on
    ``shapes`` (``consumer``: more of its section) and ``load(source dsn)``
    writing; the state the tests share, once every table converged."""
    suffix = f"{random.getrandbits(40):010x}"
    source, target = f"src_{name}_{suffix}", f"tgt_{name}_{suffix}"
    source_dsn, target_dsn = pg_cluster.create_database(source), pg_cluster.create_database(target)
    prefix = f"{name}{suffix}"
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        for table, ddl in tables.items():
            conn.execute(ddl)
            conn.execute(f"INSERT INTO {table} (id, a) SELECT g, g FROM generate_series(1, {ROWS}) g")
    group = f"{prefix}-spark"
    cfg = make_config(source_dsn, kafka_broker.bootstrap, prefix, shapes,
                      consumer={"group": group, "target_dsn": target_dsn, "checkpoint_dir": str(tmp / "checkpoints"),
                                "trigger_interval": 0.5, **consumer},
                      ack={"consumer_groups": [group], "interval": 0.5})
    path = write_toml(cfg, tmp / "walbridge.toml")
    writer = load(source_dsn)
    producer = ProducerProcess(path, tmp / "producer.log").start()
    consumer_process = ConsumerProcess(path, tmp / "consumer.log").start()
    try:
        writer.thread.start()
        state = {"source": source_dsn, "target": target_dsn, "load": writer, "producer": producer,
                 "consumer": consumer_process, "consumer_log": tmp / "consumer.log",
                 "producer_log": tmp / "producer.log", "slot": cfg["source"]["slot"]}
        for table in tables:
            wait_equal(state, table, timeout=180)
        yield state
    finally:
        writer.stop.set()
        writer.thread.join(10)
        consumer_process.stop()
        producer.stop()
        pg_cluster.drop_database(source)
        pg_cluster.drop_database(target)


@pytest.fixture(scope="module")
def pipeline(pg_cluster, kafka_broker, tmp_path_factory):
    with streaming(pg_cluster, kafka_broker, tmp_path_factory.mktemp("schema-changes"), "ddl", TABLES,
                   [{"table": f"public.{t}"} for t in TABLES], Load) as state:
        yield state


def source_columns(dsn: str, table: str) -> list[tuple[str, str]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute("SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute "
                            "WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
                            (table,)).fetchall()


def target_columns(dsn: str, table: str) -> dict[str, tuple[str, bool]]:
    with psycopg.connect(dsn) as conn:
        return {n: (t, nn) for n, t, nn in conn.execute(
            "SELECT attname, format_type(atttypid, atttypmod), attnotnull FROM pg_attribute "
            "WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped", (f"public.{table}",)).fetchall()}


def differences(state, table: str) -> str | None:
    """None when the target holds the source's rows on the source's current
    columns (target values cast to the source's types); else what differs."""
    cols = source_columns(state["source"], table)
    src_sql = "SELECT " + ", ".join(f'"{n}"::text' for n, _ in cols) + f" FROM {table} ORDER BY id"
    tgt_sql = "SELECT " + ", ".join(f'"{n}"::{t}::text' for n, t in cols) + f" FROM public.{table} ORDER BY id"
    with psycopg.connect(state["source"]) as s, psycopg.connect(state["target"]) as t:
        want = s.execute(src_sql).fetchall()
        try:
            got = t.execute(tgt_sql).fetchall()
        except psycopg.Error as e:
            return f"target not readable as the source's columns: {e}"
    if want == got:
        return None
    missing, extra = set(want) - set(got), set(got) - set(want)
    return f"{len(want)} source rows, {len(got)} target rows; missing {sorted(missing)[:3]}, extra {sorted(extra)[:3]}"


def wait_equal(state, table: str, timeout: float = 90) -> None:
    """Pause the load, wait until the table converged, resume."""
    state["load"].pause()
    try:
        last = {}

        def converged():
            assert_alive(state)
            last["diff"] = differences(state, table)
            return last["diff"] is None

        try:
            wait_for(converged, timeout=timeout, interval=1, what=f"target {table} == source")
        except AssertionError as e:
            raise AssertionError(f"{e}: {last.get('diff')}") from None
    finally:
        state["load"].resume()


def assert_alive(state) -> None:
    for name in ("producer", "consumer"):
        code = state[name].proc.poll()
        assert code is None, f"{name} exited with {code}: {state[name + '_log'].read_text()[-3000:]}"
    assert not state["load"].errors, state["load"].errors


def settle(state, seconds: float = 3.0) -> None:
    """Let the load write through the change for a while."""
    before = state["load"].transactions
    time.sleep(seconds)
    assert state["load"].transactions > before, "the load is not running"


def assert_no_query_restart(state) -> None:
    log = state["consumer_log"].read_text()
    assert RESTART not in log, [line for line in log.splitlines() if RESTART in line][:3]


def test_add_column_reaches_the_target_in_the_stream(pipeline):
    with psycopg.connect(pipeline["source"], autocommit=True) as conn:
        conn.execute("ALTER TABLE t_add ADD COLUMN note text")
        settle(pipeline)
        conn.execute("UPDATE t_add SET note = 'n' || id WHERE id % 10 = 0")
        conn.execute("INSERT INTO t_add (id, a, note) VALUES (100000, 1, 'new row')")
    settle(pipeline)
    wait_equal(pipeline, "t_add")
    assert target_columns(pipeline["target"], "t_add")["note"] == ("text", False)
    assert "learning the shape's schemas again" in pipeline["consumer_log"].read_text()
    assert_alive(pipeline)
    assert_no_query_restart(pipeline)


def test_drop_column_keeps_it_nullable_in_the_target(pipeline):
    with psycopg.connect(pipeline["source"], autocommit=True) as conn:
        conn.execute("ALTER TABLE t_drop DROP COLUMN gone")
    settle(pipeline)
    wait_equal(pipeline, "t_drop")
    # The target kept the column, nullable now: rows inserted since have no value for it.
    assert target_columns(pipeline["target"], "t_drop")["gone"] == ("integer", False)
    with psycopg.connect(pipeline["target"]) as t:
        assert t.execute("SELECT count(*) FROM t_drop WHERE gone IS NULL").fetchone()[0] > 0
        assert t.execute("SELECT count(*) FROM t_drop WHERE gone = 7").fetchone()[0] > 0  # history kept
    assert_alive(pipeline)
    assert_no_query_restart(pipeline)


def test_widening_retypes_follow_with_history_kept(pipeline):
    with psycopg.connect(pipeline["source"], autocommit=True) as conn:
        conn.execute("UPDATE t_widen SET v = 'v' || id WHERE id <= 50")
        settle(pipeline, 1.0)
        conn.execute("ALTER TABLE t_widen ALTER COLUMN a TYPE bigint, ALTER COLUMN v TYPE text")
        settle(pipeline)
        conn.execute("UPDATE t_widen SET a = 1099511627776 + id, v = repeat('w', 40) WHERE id BETWEEN 51 AND 60")
    settle(pipeline)
    wait_equal(pipeline, "t_widen")
    cols = target_columns(pipeline["target"], "t_widen")
    assert (cols["a"][0], cols["v"][0]) == ("bigint", "text")
    with psycopg.connect(pipeline["target"]) as t:
        assert t.execute("SELECT count(*) FROM t_widen WHERE a > 2147483647").fetchone()[0] >= 1
        assert t.execute("SELECT count(*) FROM t_widen WHERE v LIKE 'v%'").fetchone()[0] >= 1  # history kept
    assert_alive(pipeline)
    assert_no_query_restart(pipeline)


# ------------------------------------------------------------------------
# The target's side alone (real PostgreSQL, no stream): what ensure_table does
# with the rows the e2e tests above cannot reach without the producer's side
# (a cast that fails, a rename by alias, a changed or lost key).
def _target(*columns: tuple) -> ShapeTarget:
    """columns: (name, pg type, is key[, aliases])."""
    return ShapeTarget("public.s", "public", "s", tuple(
        ShapeColumn(c[0], c[0], c[1], len(c) > 2 and c[2], None, tuple(c[3]) if len(c) > 3 else ()) for c in columns))


def _table(conn, name: str = "public.s") -> dict:
    return {n: t for n, t in conn.execute(
        "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute WHERE attrelid = %s::regclass "
        "AND attnum > 0 AND NOT attisdropped AND attname NOT LIKE '\\_wb\\_%%'", (name,)).fetchall()}


def _key(conn, name: str = "public.s") -> list:
    row = conn.execute("SELECT array_agg(a.attname ORDER BY a.attnum) FROM pg_constraint c JOIN pg_attribute a "
                       "ON a.attrelid = c.conrelid AND a.attnum = ANY(c.conkey) WHERE c.conrelid = %s::regclass "
                       "AND c.contype = 'p'", (name,)).fetchone()
    return list(row[0] or [])


def test_a_retype_casts_and_a_cast_that_fails_leaves_null_for_the_re_read(target_db):
    with psycopg.connect(target_db, autocommit=True) as conn:
        ensure_table(conn, _target(("id", "integer", True), ("n", "text"), ("m", "text")))
        conn.execute("INSERT INTO s (id, n, m) VALUES (1, '12', 'x'), (2, '7', '3')")
        with conn.transaction():
            ensure_table(conn, _target(("id", "integer", True), ("n", "integer"), ("m", "integer")))
        assert _table(conn) == {"id": "integer", "n": "integer", "m": "integer"}
        assert conn.execute("SELECT id, n, m FROM s ORDER BY id").fetchall() == [(1, 12, None), (2, 7, None)]


def test_a_key_column_that_cannot_cast_stops_the_shape_and_changes_nothing(target_db):
    with psycopg.connect(target_db, autocommit=True) as conn:
        ensure_table(conn, _target(("id", "text", True), ("v", "integer")))
        conn.execute("INSERT INTO s (id, v) VALUES ('a', 1)")
        with pytest.raises(ShapeCannotFollow, match="key column 'id' changed type from text to integer"):
            with conn.transaction():
                ensure_table(conn, _target(("id", "integer", True), ("v", "bigint")))
        assert _table(conn) == {"id": "text", "v": "integer"}  # the batch's transaction rolled it all back


def test_an_aliased_field_renames_the_column_and_its_tombstones(target_db):
    with psycopg.connect(target_db, autocommit=True) as conn:
        ensure_table(conn, _target(("k", "integer", True), ("old", "text")))
        conn.execute("INSERT INTO s (k, old) VALUES (1, 'kept')")
        ensure_table(conn, _target(("key", "integer", True, ["k"]), ("new", "text", False, ["old"])))
        assert _table(conn) == {"key": "integer", "new": "text"}
        assert _table(conn, "public.s__wb_tombstones") == {"key": "integer"}
        assert conn.execute("SELECT key, new FROM s").fetchall() == [(1, "kept")]


def test_a_changed_key_moves_the_primary_key_and_a_lost_key_goes_keyless(target_db, caplog):
    with psycopg.connect(target_db, autocommit=True) as conn:
        ensure_table(conn, _target(("id", "integer", True), ("code", "text")))
        conn.execute("INSERT INTO s (id, code) VALUES (1, 'a'), (2, 'b')")
        ensure_table(conn, _target(("id", "integer", False), ("code", "text", True)))
        assert _key(conn) == ["code"] and _table(conn, "public.s__wb_tombstones") == {"code": "text"}
        ensure_table(conn, _target(("id", "integer", False), ("code", "text", False)))
        # The keyed tombstones are gone; the keyless ones hold pending removals (whole rows, as text).
        assert _key(conn) == [] and _table(conn, "public.s__wb_tombstones") == {}
        assert _key(conn, "public.s__wb_tombstones") == ["_wb_lsn", "_wb_op_index"]
        assert conn.execute("SELECT count(*) FROM pg_indexes WHERE tablename = 's' AND indexdef LIKE "
                            "'%UNIQUE%_wb_lsn%'").fetchone()[0] == 1  # the keyless rules' index
        assert "has no key any more" in caplog.text
        assert conn.execute("SELECT count(*) FROM s").fetchone()[0] == 2


def test_on_dropped_column_drop_drops_it(target_db):
    with psycopg.connect(target_db, autocommit=True) as conn:
        ensure_table(conn, _target(("id", "integer", True), ("gone", "text")))
        ensure_table(conn, _target(("id", "integer", True)), "drop")
        assert _table(conn) == {"id": "integer"}
