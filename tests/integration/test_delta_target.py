"""The Delta Lake target end to end on real parts: PostgreSQL → producer →
Apache Kafka → the Spark consumer's MERGEs → Delta tables, read back with
an independent reader (delta-rs, ``deltalake``) and compared with the source
row by row."""

from __future__ import annotations

import datetime
import json
import threading
from collections import Counter
from decimal import Decimal

import psycopg
import pyarrow as pa
from deltalake import DeltaTable, QueryBuilder, write_deltalake

from schemas.config import parse_config
from tests.helpers import ConsumerProcess, ConsumerThread, ProducerThread, make_config, wait_for, write_toml
from tests.pipeline import (
    FEW_ACCOUNTS,
    SHAPES,
    caught_up,
    change_items,
    create_items,
    data_files,
    delete_rows,
    newest_commit,
    pgbench,
    prepare_source,
    rekey_changed,
    target_settings,
    topic_ends,
    writing_uncommitted,
)
from walbridge.reconcile import reconcile
from walbridge.verify import verify

# shape -> (source query, key or None: keyless): what the shape's Delta table must equal
SOURCE = {
    "public.pgbench_accounts": ("SELECT aid, bid, abalance, filler FROM pgbench_accounts", "aid"),
    "public.pgbench_branches": ("SELECT bid, bbalance, filler FROM pgbench_branches", "bid"),
    "public.pgbench_tellers": ("SELECT tid, bid, tbalance, filler FROM pgbench_tellers", "tid"),
    "public.pgbench_history": ("SELECT tid, bid, aid, delta, mtime, filler FROM pgbench_history", None),
    "accounts_b1_positive": ("SELECT aid, bid, abalance FROM pgbench_accounts WHERE bid = 1 AND abalance > 0",
                             "aid"),
}


def delta_rows(path: str, columns: list[str], key: str | None) -> list[tuple] | None:
    """The table's rows as delta-rs reads them (its DataFusion reader, which
    follows column mapping), sorted by key (if any); None while there is no
    table or it lacks one of ``columns``."""
    try:
        table = DeltaTable(path)
    except Exception:  # noqa: BLE001 - delta-rs's TableNotFoundError: not created yet
        return None
    cols = ", ".join(f'"{c}"' for c in columns)
    order = f' ORDER BY "{key}"' if key else ""
    try:
        data = pa.table(QueryBuilder().register("t", table).execute(f"SELECT {cols} FROM t{order}").read_all())
    except Exception as e:  # noqa: BLE001 - delta-rs's DeltaError: a column the table does not have yet
        if "No field named" in str(e):
            return None
        raise
    return [tuple(r.values()) for r in data.to_pylist()]


def source_rows(dsn: str, query: str, key: str | None) -> tuple[list[str], list[tuple]]:
    with psycopg.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute(f"{query} ORDER BY {key}" if key else query)
        return [d.name for d in cur.description], cur.fetchall()


def hashable(value):
    """A row with its lists as tuples (a set of rows can hold it)."""
    return tuple(map(hashable, value)) if isinstance(value, (list, tuple)) else value


def lake_differences(cfg: dict, shapes: dict = SOURCE) -> list[str]:
    """Per shape whose Delta table differs from the source: how."""
    out = []
    for shape, (query, key) in shapes.items():
        columns, want = source_rows(cfg["source"]["dsn"], query, key)
        got = delta_rows(f"{cfg['consumer']['target_path']}/{shape}", columns, key)
        if got is None:
            out.append(f"{shape}: no Delta table with columns {', '.join(columns)} yet")
        elif key is None and Counter(map(hashable, got)) != Counter(map(hashable, want)):
            have, wanted = Counter(map(hashable, got)), Counter(map(hashable, want))
            out.append(f"{shape}: {len(got)} rows in Delta, {len(want)} at the source (a multiset); missing "
                       f"{list((wanted - have).items())[:3]}, extra {list((have - wanted).items())[:3]}")
        elif key is not None and got != want:
            have, wanted = set(map(hashable, got)), set(map(hashable, want))
            out.append(f"{shape}: {len(got)} rows in Delta, {len(want)} at the source; missing "
                       f"{sorted(wanted - have)[:3]}, extra {sorted(have - wanted)[:3]}")
    return out


def lake_config(source_db, bootstrap, prefix, tmp_path, shapes=SHAPES) -> dict:
    group = f"{prefix}-delta"
    return make_config(source_db, bootstrap, prefix, shapes,
                       consumer={"group": group, **target_settings("delta", "", tmp_path),
                                 "checkpoint_dir": str(tmp_path / "checkpoints")},
                       ack={"consumer_groups": [group], "interval": 0.5})


def test_pgbench_into_delta_equals_the_source_read_by_delta_rs(source_db, kafka_broker, topic_prefix, tmp_path):
    """Snapshot, then pgbench's updates and a delete, merged into Delta with
    compaction between batches: each shape's table (the filtered,
    column-limited one and the keyless history too) equals the source, each
    commit carries the shape's progress, and the slot is confirmed;
    verify finds rows another writer damaged, and reconcile repairs them."""
    prepare_source(source_db, FEW_ACCOUNTS)
    cfg = lake_config(source_db, kafka_broker.bootstrap, topic_prefix, tmp_path)
    cfg["consumer"]["compact_interval"] = 2  # compaction between batches, while pgbench runs
    with ProducerThread(cfg), ConsumerThread(cfg) as consumer:
        # At a set rate (3,200 row changes), not as fast as it can: a loaded
        # machine then brings the lake the same work, not more when it is quiet.
        pgbench(source_db, "-n", "-c", "2", "-R", "100", "-T", "8", accounts=FEW_ACCOUNTS)
        with psycopg.connect(source_db, autocommit=True) as conn:
            conn.execute("DELETE FROM pgbench_accounts WHERE aid IN (SELECT aid FROM pgbench_accounts"
                         " WHERE bid = 1 AND abalance > 0 LIMIT 3)")
            conn.execute("UPDATE pgbench_accounts SET abalance = 7 WHERE aid = 2")
        wait_for(lambda: not lake_differences(cfg) or consumer.errors, timeout=300, interval=3,
                 what="Delta tables == source", explain=lambda: "\n".join(lake_differences(cfg)))
        assert not consumer.errors, [str(e) for e in consumer.errors]
        assert lake_differences(cfg) == []
        wait_for(lambda: caught_up(cfg), timeout=60, what="confirmed_flush_lsn at the last commit")
    # Every batch committed its progress, to the end of each topic (a MERGE
    # that changed no row too).
    for shape in SOURCE:
        history = DeltaTable(f"{tmp_path}/lake/{shape}").history()
        if shape == "public.pgbench_history":  # a small file per batch: compacted (and the rows are equal)
            assert any(h.get("operation") == "OPTIMIZE" for h in history), [h.get("operation") for h in history]
        merges = [h for h in history if h.get("operation") == "MERGE"]
        assert merges and all('"walbridge"' in (h.get("userMetadata") or "") for h in merges)
        newest = json.loads(merges[0]["userMetadata"])["walbridge"]
        ends = topic_ends(kafka_broker.bootstrap, newest["topic"])
        assert {int(p): v[0] for p, v in newest["partitions"].items()} == {p: e for p, e in ends.items() if e}
    # walbridge verify reads the tables with delta-rs too: equal, then a row
    # another writer deleted, one it changed and one it added are found;
    # reconcile backfills the shape whole (what the backfill did not rewrite
    # is collected when it completes) and the table is equal again.
    config = parse_config(cfg)
    assert all(d.ok for d in verify(config)), [d for d in verify(config) if not d.ok]
    with psycopg.connect(source_db) as conn:
        gone, changed = (r[0] for r in conn.execute("SELECT aid FROM pgbench_accounts ORDER BY aid DESC LIMIT 2"))
    accounts = DeltaTable(f"{tmp_path}/lake/public.pgbench_accounts")
    stray = accounts.to_pyarrow_table(filters=[("aid", "=", changed)])
    stray = stray.set_column(stray.schema.get_field_index("aid"), "aid", pa.array([10**7], stray.schema.field("aid").type))
    accounts.delete(f"aid = {gone}")
    accounts.update(updates={"abalance": "abalance + 1"}, predicate=f"aid = {changed}")
    write_deltalake(accounts, stray, mode="append")
    diff = next(d for d in verify(config, ["public.pgbench_accounts"]))
    assert (diff.missing, diff.extra, diff.changed, diff.ok) == ([gone], [10**7], [changed], False)
    with ProducerThread(cfg), ConsumerThread(cfg) as consumer:
        before, after = reconcile(config, ["public.pgbench_accounts"], timeout=300, on_progress=lambda line: None)
        assert not consumer.errors, [str(e) for e in consumer.errors]
    assert [d.ok for d in before] == [False] and [d.ok for d in after] == [True], after


def test_types_and_a_restart_apply_each_change_once(source_db, kafka_broker, topic_prefix, tmp_path):
    """Decimal, timestamp, date, bytea, array and text columns (a name with a
    space: column mapping) round-trip into Delta; after a consumer restart the
    table still equals the source (replays skipped by the commit's progress)."""
    create_items(source_db)
    shapes = [{"table": "public.items"}]
    cfg = lake_config(source_db, kafka_broker.bootstrap, topic_prefix, tmp_path, shapes)
    query = ('SELECT id, "body text", n, d, at, raw, tags FROM items', "id")
    with ProducerThread(cfg):
        with ConsumerThread(cfg) as consumer:
            wait_for(lambda: not lake_differences(cfg, {"public.items": query}) or consumer.errors, timeout=240,
                     interval=2, what="items in Delta", explain=lambda: "\n".join(lake_differences(
                         cfg, {"public.items": query})))
            assert not consumer.errors
        change_items(source_db)
        with ConsumerThread(cfg) as consumer:
            wait_for(lambda: not lake_differences(cfg, {"public.items": query}) or consumer.errors, timeout=240,
                     interval=2, what="items in Delta after the restart",
                     explain=lambda: "\n".join(lake_differences(cfg, {"public.items": query})))
            assert not consumer.errors
    assert [d.ok for d in verify(parse_config(cfg))] == [True]
    row = delta_rows(f"{tmp_path}/lake/public.items", ["id", "body text", "n", "d", "at", "raw", "tags"], "id")[-1]
    assert row == (100, "new", Decimal("1.25"), datetime.date(2026, 2, 3),
                   datetime.datetime(2026, 2, 3, 4, 5, 6, tzinfo=datetime.timezone.utc), b"x", [7])


def test_consumer_kill9_mid_merge_and_between_commits_applies_each_change_once(source_db, kafka_broker, topic_prefix,
                                                                             tmp_path):
    """``kill -9`` of the driver (and its JVM) under pgbench: once while a
    MERGE has written data files and not committed them, once between a
    batch's tombstone commit and its table's. The tables end equal to the
    source (a key applied twice would be two rows), and each start began at
    the tables' own progress."""
    prepare_source(source_db, FEW_ACCOUNTS)
    cfg = lake_config(source_db, kafka_broker.bootstrap, topic_prefix, tmp_path)
    cfg["consumer"]["max_offsets_per_trigger"] = 20000
    path = write_toml(cfg, tmp_path / "wb.toml")
    log = tmp_path / "consumer.log"
    lake = tmp_path / "lake"
    accounts = lake / "public.pgbench_accounts"
    accounts_tombstones = lake / "_walbridge" / "tombstones" / "public.pgbench_accounts"
    load_done = threading.Event()

    def load():  # at a rate the MERGEs of a loaded 2-core machine keep up with, and deletes
        deleter = threading.Thread(target=delete_rows, args=(source_db, load_done), daemon=True)
        deleter.start()
        pgbench(source_db, "-n", "-c", "2", "-R", "40", "-T", "25", accounts=FEW_ACCOUNTS)
        load_done.set()
        deleter.join()

    moments = [("a MERGE's files written, not committed", lambda: writing_uncommitted(accounts)),
               ("tombstones committed, the table not yet",
                lambda: newest_commit(accounts_tombstones) > newest_commit(accounts) > 0)]
    with ProducerThread(cfg):
        consumer = ConsumerProcess(path, log).start()
        try:
            wait_for(lambda: data_files(accounts), timeout=240, what="the consumer merging")
            threading.Thread(target=load, daemon=True).start()
            for starts, (what, moment) in enumerate(moments, 1):
                wait_for(lambda: log.read_text().count("from the target's progress") >= starts, timeout=180,
                         what=f"start {starts} reading from the tables' progress")
                wait_for(moment, timeout=180, interval=0.01, what=what)
                consumer.kill9()
                consumer = ConsumerProcess(path, log).start()
            load_done.wait(120)
            wait_for(lambda: not lake_differences(cfg) or consumer.proc.poll() is not None, timeout=300, interval=3,
                     what="Delta tables == source", explain=lambda: "\n".join(lake_differences(cfg)))
            assert consumer.proc.poll() is None, log.read_text()[-3000:]
            assert lake_differences(cfg) == []
            wait_for(lambda: caught_up(cfg), timeout=60, what="slot at the last commit")
        finally:
            consumer.stop()
    assert log.read_text().count("from the target's progress") >= 3


def test_renamed_widened_retyped_added_columns_and_a_new_key_are_followed_while_streaming(
        source_db, kafka_broker, topic_prefix, tmp_path):
    """Columns renamed, widened (integer to bigint), retyped (text to integer:
    the producer re-reads the shape) and added at the source while the stream
    runs: the Delta table follows each (column mapping, a rewrite with the new
    type); then a new primary key, its rows re-read and re-keyed. delta-rs
    reads it equal to the source; the other shape goes on."""
    with psycopg.connect(source_db, autocommit=True) as conn:
        for t in ("changed", "free"):
            conn.execute(f"CREATE TABLE {t} (id int PRIMARY KEY, v int, s text)")
            conn.execute(f"INSERT INTO {t} SELECT g, g, g::text FROM generate_series(1, 20) g")
    shapes = [{"table": "public.changed"}, {"table": "public.free"}]
    cfg = lake_config(source_db, kafka_broker.bootstrap, topic_prefix, tmp_path, shapes)
    tables = {s: ("SELECT id, v, s FROM " + s, "id") for s in ("public.changed", "public.free")}
    with ProducerThread(cfg), ConsumerThread(cfg) as consumer:
        wait_for(lambda: not lake_differences(cfg, tables) or consumer.errors, timeout=240, interval=2,
                 what="both shapes in Delta", explain=lambda: "\n".join(lake_differences(cfg, tables)))
        with psycopg.connect(source_db, autocommit=True) as conn:
            conn.execute("ALTER TABLE changed RENAME COLUMN v TO w")
            conn.execute("INSERT INTO changed VALUES (21, 21, '21')")
            conn.execute("ALTER TABLE changed ALTER COLUMN w TYPE bigint")
            conn.execute("INSERT INTO changed VALUES (22, 5000000000, '22')")
            conn.execute("ALTER TABLE changed ALTER COLUMN s TYPE int USING s::int")
            conn.execute("ALTER TABLE changed ADD COLUMN note text")
            conn.execute("UPDATE changed SET note = 'one', s = -1 WHERE id = 1")
            conn.execute("INSERT INTO free VALUES (21, 21, '21')")
        tables = {"public.changed": ("SELECT id, w, s, note FROM changed", "id"), **{
            "public.free": tables["public.free"]}}
        wait_for(lambda: not lake_differences(cfg, tables) or consumer.errors, timeout=240, interval=2,
                 what="the changed shape followed", explain=lambda: "\n".join(lake_differences(cfg, tables)))
        rekey_changed(source_db, (23, 23, 23))
        wait_for(lambda: not lake_differences(cfg, tables) or consumer.errors, timeout=240, interval=2,
                 what="the re-keyed shape followed", explain=lambda: "\n".join(lake_differences(cfg, tables)))
        assert not consumer.errors, consumer.errors
    changed = DeltaTable(f"{tmp_path}/lake/public.changed")
    assert json.loads(changed.metadata().configuration["walbridge.key"]) == ["id", "s"]
    schema = {f.name: f.type for f in changed.schema().fields}
    assert "v" not in schema and str(schema["w"]) == 'PrimitiveType("long")' and str(schema["s"]) == \
        'PrimitiveType("integer")'
