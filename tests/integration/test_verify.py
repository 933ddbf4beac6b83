"""`walbridge verify` against a real source and target: equal tables pass;
damage is found, key by key, without loading tables into memory."""

from __future__ import annotations

import psycopg

from schemas.config import parse_config
from tests.helpers import make_config, write_toml
from walbridge.cli import main
from walbridge.verify import verify

DDL = """
CREATE TYPE mood AS ENUM ('sad', 'happy');
CREATE TABLE orders (id int PRIMARY KEY, region text, total numeric(10,2), at timestamptz, m mood, j jsonb);
CREATE TABLE events (at int, what text);
"""
TARGET_DDL = """
CREATE TABLE public.orders (id int PRIMARY KEY, region text, total numeric(10,2), at timestamptz, m text, j jsonb,
                            _wb_lsn bigint, _wb_op_index bigint);
CREATE TABLE public.orders_eu (id int PRIMARY KEY, total numeric(10,2), _wb_lsn bigint);
CREATE TABLE public.events (at int, what text, _wb_lsn bigint);
"""


def _copy(src: str, dst: str, query: str, table: str, columns: str):
    with psycopg.connect(src) as s, psycopg.connect(dst, autocommit=True) as d:
        with s.cursor().copy(f"COPY ({query}) TO STDOUT") as out, \
                d.cursor().copy(f"COPY {table} ({columns}) FROM STDIN") as into:
            for block in out:
                into.write(block)


def _config(source_db, target_db):
    return make_config(source_db, "127.0.0.1:1", "v", [
        {"table": "public.orders"},
        {"table": "public.orders", "name": "orders_eu", "where": "region = 'eu' AND total > 100",
         "columns": ["id", "total"]},
        {"table": "public.events"},
    ], consumer={"target_dsn": str(target_db)})


def test_verify_equal_then_damaged(source_db, target_db, tmp_path, capsys):
    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute(DDL)
        conn.execute("INSERT INTO orders SELECT g, CASE WHEN g % 2 = 0 THEN 'eu' ELSE 'us' END, g * 0.5,"
                     " '2024-01-01'::timestamptz + g * interval '1 minute', 'happy', jsonb_build_object('g', g)"
                     " FROM generate_series(1, 200000) g")
        conn.execute("INSERT INTO events SELECT g % 100, 'x' FROM generate_series(1, 5000) g")
    with psycopg.connect(target_db, autocommit=True) as conn:
        conn.execute(TARGET_DDL)
    _copy(source_db, target_db, "SELECT * FROM orders", "public.orders", "id, region, total, at, m, j")
    _copy(source_db, target_db, "SELECT id, total FROM orders WHERE region = 'eu' AND total > 100",
          "public.orders_eu", "id, total")
    _copy(source_db, target_db, "SELECT * FROM events", "public.events", "at, what")
    cfg = parse_config(_config(source_db, target_db))
    diffs = verify(cfg)
    assert [d.ok for d in diffs] == [True, True, True], [(d.shape, d.error, d.differing_buckets) for d in diffs]
    assert diffs[0].source_rows == diffs[0].target_rows == 200000 and diffs[0].buckets >= 100

    with psycopg.connect(target_db, autocommit=True) as conn:
        conn.execute("DELETE FROM public.orders WHERE id IN (5, 77)")
        conn.execute("UPDATE public.orders SET total = total + 1 WHERE id = 1000")
        conn.execute("UPDATE public.orders SET at = at + interval '1 microsecond' WHERE id = 1002")
        conn.execute("INSERT INTO public.orders (id, region, total) VALUES (900000, 'eu', 1)")
        conn.execute("DELETE FROM public.orders_eu WHERE id = 1000")
        conn.execute("DELETE FROM public.events WHERE ctid IN (SELECT ctid FROM public.events LIMIT 1)")
    diffs = {d.shape: d for d in verify(cfg)}
    o = diffs["public.orders"]
    assert not o.ok and o.missing == ["(5)", "(77)"] and o.extra == ["(900000)"]
    assert sorted(o.changed) == ["(1000)", "(1002)"]
    assert diffs["orders_eu"].missing == ["(1000)"] and not diffs["orders_eu"].changed
    assert not diffs["public.events"].ok and len(diffs["public.events"].missing) == 1

    path = write_toml(_config(source_db, target_db), tmp_path / "wb.toml")
    assert main(["verify", "-c", str(path)]) == 1
    out = capsys.readouterr().out
    assert "DIFFERENT" in out and "2 key(s) missing in target: (5), (77)" in out


def test_verify_names_missing_target_table(source_db, target_db):
    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute(DDL)
    (diff, *_) = verify(parse_config(_config(source_db, target_db)))
    assert diff.error == "target table public.orders does not exist" and not diff.ok
