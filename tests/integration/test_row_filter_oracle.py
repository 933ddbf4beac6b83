"""Shape filters judged by PostgreSQL: for every filter walbridge accepts, the
rows it selects are the rows the source's own ``WHERE`` returns; everything
else is refused.

The source database is what production looks like: an ICU ``en-US`` default
collation and ``TimeZone`` America/New_York.  One table holds generated rows
over the filterable types (special values included: NaN, ±Infinity, -0,
infinite and BC dates, DST edges, padded char(n), ...).  Seeded generated
filters (``WB_FILTER_SEED`` replays a run; the seed is printed) are each run
once in PostgreSQL over the table and once through the compiled filter over
the same rows decoded as the producer decodes them (their text form, as
pgoutput sends it in the producer's session settings, through the producer's
column loaders).  A sample then goes through the real producer: snapshot,
stream, and updates moving rows in and out.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
import uuid

import psycopg
import pytest
from psycopg import sql

from producer import catalog
from producer.pgtypes import column_codec
from producer.replication import connect
from schemas.shape_filter import FilterError, compile_filter
from tests.helpers import ProducerThread, latest_rows, make_config, read_topic, wait_for, wait_snapshot_done, write_toml

FILTERS = 2400  # generated (filter, rows) cases per run

TEXTS = ["apple", "Banana", "B", "b", "Mango", "mango", "Zed", "Straße 1", "STRASSE 2", "éclair", "Éclair", "a_b",
         "a%b", "a\\b", "İx", "ix", "ΑΣ", "ασ", "", " ", "K", "k", "ab ", None]
FLOATS = ["0", "-0", "1.5", "-2.25", "1e300", "Infinity", "-Infinity", "NaN", "0.1", "16777217", None]
NUMERICS = ["0", "1.50", "-3", "NaN", "12345678901234567890.5", "Infinity", "-Infinity", "0.1", None]
INTS = ["0", "1", "-1", "42", "2147483647", None]
BIGS = ["0", "9007199254740993", "-9223372036854775808", "42", None]
DATES = ["2024-03-09", "2024-03-10", "2024-11-03", "infinity", "-infinity", "0044-03-15 BC", "10000-01-01", None]
STAMPS = ["2024-03-10 01:59:59", "2024-03-10 02:30:00", "2024-03-10 03:00:00", "2024-11-03 01:30:00", "infinity",
          "-infinity", "0044-03-15 12:00 BC", None]
STAMPTZS = ["2024-03-10 06:59:59+00", "2024-03-10 07:00:00+00", "2024-03-10 07:30:00+00", "2024-11-03 05:30:00+00",
            "2024-11-03 06:30:00+00", "infinity", "-infinity", None]
CHARS = ["ab", "ab ", "a", "abc  ", "AB", "a_", None]
UUIDS = ["00000000-0000-0000-0000-000000000001", "ffffffff-0000-0000-0000-000000000000",
         "7fffffff-ffff-ffff-ffff-ffffffffffff", None]
MOODS = ["sad", "ok", "happy", None]
BOOLS = ["true", "false", None]
PATTERNS = ["a%", "A%", "%b", "_", "%", "a\\_%", "a\\%b", "a!_%", "%ß%", "st%", "STR%", "İ%", "i%", "ix", "_x",
            "%a_b%", "é%", "É%", "", "ab%", "ab _"]

# column -> (SQL type, value pool, kind used by the generator)
COLUMNS = {
    "name": ("text", TEXTS, "text"),
    "cname": ('text COLLATE "C"', TEXTS, "text"),
    "f8": ("double precision", FLOATS, "num"),
    "f4": ("real", [v for v in FLOATS if v != "1e300"], "num"),
    "num": ("numeric", NUMERICS, "num"),
    "num2": ("numeric(30,2)", [v for v in NUMERICS if v not in ("Infinity", "-Infinity")], "num"),
    "i": ("integer", INTS, "num"),
    "big": ("bigint", BIGS, "num"),
    "b": ("boolean", BOOLS, "bool"),
    "d": ("date", DATES, "date"),
    "ts": ("timestamp", STAMPS, "ts"),
    "tz": ("timestamptz", STAMPTZS, "tz"),
    "ch": ("char(5)", CHARS, "text"),
    "u": ("uuid", UUIDS, "uuid"),
    "m": ("mood", MOODS, "enum"),
}
CITEXT = ("ci", ("citext", ["Abc", "abc", "ABD", "straße", "STRASSE", "İ", "i̇", None], "text"))


@pytest.fixture
def icu_db(pg_cluster):
    """A source database as production has it: ICU en-US, America/New_York."""
    name = f"icu_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg_cluster.dsn(), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {} LOCALE_PROVIDER icu ICU_LOCALE 'en-US' TEMPLATE template0 "
                             "ENCODING 'UTF8'").format(sql.Identifier(name)))
        conn.execute(sql.SQL("ALTER DATABASE {} SET TimeZone = 'America/New_York'").format(sql.Identifier(name)))
    try:
        yield pg_cluster.dsn(name)
    finally:
        pg_cluster.drop_database(name)


def _create(dsn: str, table: str, rows: int, rng: random.Random) -> dict:
    """The table with ``rows`` generated rows; returns its columns."""
    columns = dict(COLUMNS)
    with psycopg.connect(dsn, autocommit=True) as conn:
        if conn.execute("SELECT count(*) FROM pg_available_extensions WHERE name = 'citext'").fetchone()[0]:
            conn.execute("CREATE EXTENSION IF NOT EXISTS citext")
            columns[CITEXT[0]] = CITEXT[1]
        conn.execute("DO $$ BEGIN CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy'); "
                     "EXCEPTION WHEN duplicate_object THEN NULL; END $$")
        conn.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, "
                     + ", ".join(f"{c} {t}" for c, (t, _, _) in columns.items()) + ")")
        conn.execute(f"ALTER TABLE {table} REPLICA IDENTITY FULL")
        for rid in range(1, rows + 1):
            insert_row(conn, table, rid, columns, rng)
    return columns


def insert_row(conn, table: str, rid: int, columns: dict, rng: random.Random) -> None:
    values = [rng.choice(pool) for _, pool, _ in columns.values()]
    conn.execute(sql.SQL("INSERT INTO {} (id, {}) VALUES (%s, {})").format(
        sql.Identifier(table), sql.SQL(", ").join(map(sql.Identifier, columns)),
        sql.SQL(", ").join(sql.Placeholder() * len(values))), [rid, *values])


def producer_rows(dsn: str, table: str) -> list[dict]:
    """The table's rows as the producer sees them: each value's text form as
    its output function prints it in the producer's session settings (what
    pgoutput sends), through the producer's column loaders."""
    with connect(dsn) as conn:
        info = catalog.table_info(conn, "public", table)
        loads = [column_codec(catalog.type_info(conn, c.type_oid, c.typmod), conn).load for c in info.columns]
        names = [c.name for c in info.columns]
        result = conn.pgconn.exec_(f"SELECT * FROM {table}".encode())  # text format: the output functions' bytes
        rows = []
        for i in range(result.ntuples):
            values = [result.get_value(i, j) for j in range(result.nfields)]
            rows.append({n: (load(v) if v is not None else None) for n, load, v in zip(names, loads, values)})
        return rows


# --------------------------------------------------------------------------- filter generator


def _lit(v: str | None) -> str:
    if v is None:
        return "NULL"
    return "'" + v.replace("'", "''") + "'"


class FilterGen:
    def __init__(self, rng: random.Random, columns: dict):
        self.rng = rng
        self.columns = columns

    def literal(self, col: str) -> str:
        _, pool, kind = self.columns[col]
        rng = self.rng
        if kind == "num" and rng.random() < 0.3:
            return rng.choice(["0", "1.5", "-1", "0.1", "9007199254740993", "'NaN'::float8", "'Infinity'::float8",
                               "'NaN'::numeric", "'-0'::float8", "1e300", "'0.1'::real"])
        if kind == "tz" and rng.random() < 0.3:
            return rng.choice(["'2024-03-10 02:30'", "'2024-11-03 01:30'", "'2024-03-10'::date",
                               "'2024-11-03 01:30'::timestamp", "'infinity'"])
        if kind == "ts" and rng.random() < 0.2:
            return rng.choice(["'2024-03-10'::date", "'-infinity'", "'0044-03-15 BC'"])
        if kind == "date" and rng.random() < 0.2:
            return rng.choice(["'10000-01-01'", "'0001-01-01'", "'-infinity'::date"])
        value = rng.choice([v for v in pool if v is not None] or ["x"])
        return _lit(value)

    def text_operand(self, col: str) -> str:
        return f'{col} COLLATE "C"' if self.rng.random() < 0.35 else col

    def atom(self) -> str:
        rng = self.rng
        col = rng.choice(list(self.columns))
        kind = self.columns[col][2]
        left = self.text_operand(col) if kind == "text" else col
        r = rng.random()
        if kind == "bool" and r < 0.3:
            return rng.choice(["b", "NOT b", "b IS TRUE", "b IS NOT FALSE", "b IS UNKNOWN", "b = 'yes'"])
        if r < 0.4:
            op = rng.choice(["=", "<>", "<", "<=", ">", ">=", "!="])
            if rng.random() < 0.15:
                other = rng.choice([c for c, v in self.columns.items() if v[2] == kind])
                return f"{left} {op} {other}"
            return f"{left} {op} {self.literal(col)}"
        if r < 0.55:
            items = [self.literal(col) for _ in range(rng.randint(1, 4))]
            if rng.random() < 0.3:
                items.append("NULL")
            return f"{left} {rng.choice(['IN', 'NOT IN'])} ({', '.join(items)})"
        if r < 0.68:
            lo, hi = self.literal(col), self.literal(col)
            return f"{left} {rng.choice(['BETWEEN', 'NOT BETWEEN'])} {lo} AND {hi}"
        if r < 0.85 and kind == "text":
            op = rng.choice(["LIKE", "ILIKE", "NOT LIKE", "NOT ILIKE"])
            pattern = rng.choice(PATTERNS)
            if "!" in pattern:
                return f"{left} {op} {_lit(pattern)} ESCAPE '!'"
            if rng.random() < 0.15:
                return f"{left} {op} {_lit(pattern)} ESCAPE ''"
            return f"{left} {op} {_lit(pattern)}"
        return f"{col} IS {rng.choice(['', 'NOT '])}NULL"

    def filter(self, depth: int = 0) -> str:
        rng = self.rng
        r = rng.random()
        if depth >= 2 or r < 0.45:
            return self.atom()
        if r < 0.65:
            return f"({self.filter(depth + 1)}) AND ({self.filter(depth + 1)})"
        if r < 0.85:
            return f"({self.filter(depth + 1)}) OR ({self.filter(depth + 1)})"
        if r < 0.93:
            return f"NOT ({self.filter(depth + 1)})"
        return f"({self.filter(depth + 1)}) IS {rng.choice(['TRUE', 'NOT TRUE', 'FALSE', 'NOT FALSE', 'UNKNOWN'])}"


# --------------------------------------------------------------------------- the oracle


class Oracle:
    def __init__(self, dsn: str, table: str):
        self.dsn = dsn
        self.table = table
        self.user = psycopg.connect(dsn, autocommit=True)  # an ordinary session: the source's TimeZone
        self.conn = connect(dsn)  # the producer's kind of session
        oid = self.conn.execute("SELECT %s::regclass::oid::int", (table,)).fetchone()[0]
        self.columns = catalog.filter_columns(self.conn, oid)
        self.source = catalog.filter_source(self.conn, dsn)
        self.rows = producer_rows(dsn, table)

    def close(self) -> None:
        self.user.close()
        self.conn.close()

    def postgres(self, where: str) -> set[int] | str:
        try:
            return {r[0] for r in self.user.execute(f"SELECT id FROM {self.table} WHERE {where}")}
        except psycopg.Error as e:
            return f"PostgreSQL refused it: {e.diag.message_primary}"

    def judge(self, where: str, shape: str = "s") -> tuple[str, str | None]:
        """("accepted" | "refused", a difference or None)."""
        try:
            f = compile_filter(where, self.columns, shape=shape, source=self.source)
        except FilterError as e:
            assert "\n" not in str(e)
            return "refused", None
        expected = self.postgres(where)
        if isinstance(expected, str):
            return "accepted", f"{where}: accepted, but {expected}"
        got = {r["id"] for r in self.rows if f.matches(r)}
        if got != expected:
            rows = {r["id"]: r for r in self.rows}
            extra = [rows[i] for i in sorted(got - expected)[:3]]
            missing = [rows[i] for i in sorted(expected - got)[:3]]
            return "accepted", f"{where}: walbridge also selects {extra}, misses {missing}"
        return "accepted", None


@pytest.fixture
def oracle(icu_db):
    rng = random.Random(7)
    _create(icu_db, "t", 160, rng)
    o = Oracle(icu_db, "t")
    yield o
    o.close()


def test_generated_filters_select_what_postgresql_selects_or_are_refused(oracle):
    seed = int(os.environ.get("WB_FILTER_SEED") or random.SystemRandom().randrange(2**32))
    print(f"filter seed: {seed} (WB_FILTER_SEED={seed} replays this run)")
    gen = FilterGen(random.Random(seed), {c: COLUMNS.get(c) or CITEXT[1] for c in oracle.columns if c != "id"})
    verdicts = {"accepted": 0, "refused": 0}
    differences = []
    started = time.monotonic()
    for _ in range(FILTERS):
        where = gen.filter()
        verdict, difference = oracle.judge(where)
        verdicts[verdict] += 1
        if difference:
            differences.append(difference)
    print(f"{FILTERS} filters over {len(oracle.rows)} rows in {time.monotonic() - started:.1f} s: {verdicts}")
    assert not differences, f"seed {seed}: {len(differences)} silent differences:\n" + "\n".join(differences[:20])
    assert verdicts["accepted"] >= FILTERS // 2, verdicts  # the generator exercises the accepted subset


@pytest.mark.parametrize("where,verdict", [
    ("name >= 'b'", "refused"),
    ("name BETWEEN 'apple' AND 'mango'", "refused"),
    ("f8 > 0", "accepted"),
    ("f4 > 0", "accepted"),
    ("num > 0", "accepted"),
    ("num2 > 0", "accepted"),
    ("name COLLATE \"C\" >= 'b'", "accepted"),
    ("name COLLATE \"C\" BETWEEN 'apple' AND 'mango'", "accepted"),
    ("cname >= 'b'", "accepted"),
    ("name = 'Banana' OR name IN ('B', 'Zed')", "accepted"),
    ("name ILIKE 'straße%'", "accepted"),
    ("tz >= '2024-03-10 02:30'", "accepted"),
    ("ch = 'ab'", "accepted"),
    ("name LIKE 'a\\_%'", "accepted"),
    ("m > 'sad'", "refused"),
    ("d > 'now'", "refused"),
])
def test_the_issues_cases(oracle, where, verdict):
    got, difference = oracle.judge(where)
    assert (got, difference) == (verdict, None)


def test_refusal_names_shape_fragment_collation_and_fix(oracle):
    with pytest.raises(FilterError) as e:
        compile_filter("name >= 'b'", oracle.columns, shape="names_b", source=oracle.source)
    assert str(e.value) == (
        "shape 'names_b': where: ordering comparison on text column 'name' under collation \"default\" "
        "(ICU en-US), whose order only PostgreSQL knows: name >= 'b'; fix: write name COLLATE \"C\" >= 'b' "
        "(code-point order), or use = or IN")


# --------------------------------------------------------------------------- the real producer path

SAMPLE = {  # shape -> filter
    "nan_above": "f8 > 0",
    "numeric_nan": "num >= 1 OR num IS NULL",
    "code_points": "name COLLATE \"C\" >= 'b'",
    "dst": "tz >= '2024-03-10 02:30' AND d < 'infinity'",
    "like_ilike": "ch LIKE 'a_%' OR name ILIKE 'straße%' OR name NOT IN ('B', NULL)",
}


def test_producer_shapes_hold_what_postgresql_selects(icu_db, kafka_broker, topic_prefix):
    rng = random.Random(11)
    columns = _create(icu_db, "p", 60, rng)
    shapes = [{"table": "public.p", "name": name, "where": where, "columns": ["id"]} for name, where in SAMPLE.items()]
    cfg = make_config(icu_db, kafka_broker.bootstrap, topic_prefix, shapes)

    def shape_ids(name: str) -> set[int]:
        return {k[0][1] for k in latest_rows(read_topic(kafka_broker.bootstrap, f"{topic_prefix}.{name}",
                                                        topic_prefix))}

    def source_ids(where: str) -> set[int]:
        with psycopg.connect(icu_db, autocommit=True) as conn:  # an ordinary session: New York time
            return {r[0] for r in conn.execute(f"SELECT id FROM p WHERE {where}")}

    with ProducerThread(cfg):
        for name in SAMPLE:
            wait_snapshot_done(kafka_broker.bootstrap, f"{topic_prefix}.{name}", topic_prefix)
        assert {n: shape_ids(n) for n in SAMPLE} == {n: source_ids(w) for n, w in SAMPLE.items()}  # snapshot
        with psycopg.connect(icu_db, autocommit=True) as conn:
            for rid in range(61, 101):  # the stream
                insert_row(conn, "p", rid, columns, rng)
            # updates moving rows in and out of every shape
            conn.execute("UPDATE p SET f8 = 'NaN', num = 'NaN', name = 'Zed', tz = 'infinity' WHERE id % 4 = 0")
            conn.execute("UPDATE p SET f8 = -1, num = 0, name = 'B', ch = 'b' WHERE id % 4 = 1")
            conn.execute("UPDATE p SET name = 'Straße 9', tz = '2024-03-10 07:00+00', d = 'infinity' "
                         "WHERE id % 4 = 2")
            conn.execute("DELETE FROM p WHERE id % 10 = 3")
        expected = {n: source_ids(w) for n, w in SAMPLE.items()}
        wait_for(lambda: {n: shape_ids(n) for n in SAMPLE} == expected, timeout=60,
                 what="every shape to hold what PostgreSQL's WHERE returns")


# --------------------------------------------------------------------------- check-config


def test_check_config_live_refuses_a_filter_in_one_line(icu_db, kafka_broker, topic_prefix, tmp_path):
    with psycopg.connect(icu_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE names (id int PRIMARY KEY, name text)")
    shapes = [{"table": "public.names", "name": "names_b", "where": "name >= 'b'"}]
    path = write_toml(make_config(icu_db, kafka_broker.bootstrap, topic_prefix, shapes), tmp_path / "wb.toml")
    started = time.monotonic()
    plain = subprocess.run([sys.executable, "-m", "walbridge", "check-config", "-c", str(path)],
                           capture_output=True, text=True, timeout=60)
    assert plain.returncode == 0, plain.stderr  # without the source it cannot know the collation: says so
    assert "checked against the source by check-config --live" in plain.stdout
    live = subprocess.run([sys.executable, "-m", "walbridge", "check-config", "--live", "-c", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert live.returncode == 2, live.stdout + live.stderr
    assert time.monotonic() - started < 30
    (line,) = [ln for ln in live.stdout.splitlines() if "✗" in ln]
    assert line.strip() == (
        "✗ shapes[0] (names_b).where: shape 'names_b': where: ordering comparison on text column 'name' under "
        "collation \"default\" (ICU en-US), whose order only PostgreSQL knows: name >= 'b'; fix: write "
        "name COLLATE \"C\" >= 'b' (code-point order), or use = or IN")
