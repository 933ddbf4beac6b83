"""The end-to-end set-up the integration modules share: the pgbench source
and its five shapes, the pipeline's config, the checks of a run (target
equals source, the slot released, each change applied once) and the moments
a kill test waits for."""

from __future__ import annotations

import subprocess
import tempfile
import threading
from pathlib import Path

import psycopg
from confluent_kafka import Consumer, TopicPartition

from producer.pgoutput import lsn_to_int
from schemas.config import parse_config
from spark_consumer.targets.postgresql import TARGET_APP_NAME
from tests.helpers import data_records, make_config, read_topic
from walbridge.embedded import find_pg_bin
from walbridge.verify import verify

SHAPES = [
    {"table": "public.pgbench_accounts"},
    {"table": "public.pgbench_branches"},
    {"table": "public.pgbench_tellers"},
    {"table": "public.pgbench_history"},
    {"table": "public.pgbench_accounts", "name": "accounts_b1_positive", "where": "bid = 1 AND abalance > 0",
     "columns": ["aid", "bid", "abalance"]},
]


def topic_ends(bootstrap: str, topic: str) -> dict[int, int]:
    """Each partition's end offset."""
    client = Consumer({"bootstrap.servers": bootstrap, "group.id": "wb-test-ends"})
    try:
        parts = client.list_topics(topic, timeout=10).topics[topic].partitions
        return {p: client.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in parts}
    finally:
        client.close()


def delete_rows(dsn: str, done: threading.Event) -> None:
    """Delete a few accounts and history rows (keyless: removals) every 0.2 s until ``done``."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        while not done.wait(0.2):
            conn.execute("DELETE FROM pgbench_accounts WHERE aid IN (SELECT aid FROM pgbench_accounts"
                         " ORDER BY random() LIMIT 5)")
            conn.execute("DELETE FROM pgbench_history WHERE ctid IN (SELECT ctid FROM pgbench_history"
                         " ORDER BY random() LIMIT 2)")


def create_items(dsn: str) -> None:
    """The typed table of the lakehouse tests: numeric, date, timestamptz,
    bytea, int[] and a column named with a space, 50 rows."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute('CREATE TABLE items (id int PRIMARY KEY, "body text" text, n numeric(10,2), d date,'
                     " at timestamptz, raw bytea, tags int[])")
        conn.execute("INSERT INTO items SELECT g, 'row ' || g, g / 4.0, date '2026-01-01' + g,"
                     " timestamptz '2026-01-01 00:00:00+00' + g * interval '1 minute', decode('beef', 'hex'),"
                     " ARRAY[g, g + 1] FROM generate_series(1, 50) g")


def change_items(dsn: str) -> None:
    """Ten updates, ten deletes and the insert of row 100 ('new', 1.25, 2026-02-03, b'x', [7])."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE items SET \"body text\" = 'changed', n = 99.99 WHERE id <= 10")
        conn.execute("DELETE FROM items WHERE id > 40")
        conn.execute("INSERT INTO items VALUES (100, 'new', 1.25, '2026-02-03', '2026-02-03 04:05:06+00',"
                     " 'x', '{7}')")


# pgbench_accounts of the tests whose point is what happens to the changes
# after the snapshot (kills, faults), not the snapshot's size: scale 1 makes
# 100,000, whose apply (a lakehouse's MERGEs above all) was most of their time.
FEW_ACCOUNTS = 20_000
# pgbench's built-in TPC-B-like transaction, on the first {accounts} accounts.
TPCB_LIKE = """\\set aid random(1, {accounts})
\\set bid random(1, 1 * :scale)
\\set tid random(1, 10 * :scale)
\\set delta random(-5000, 5000)
BEGIN;
UPDATE pgbench_accounts SET abalance = abalance + :delta WHERE aid = :aid;
SELECT abalance FROM pgbench_accounts WHERE aid = :aid;
UPDATE pgbench_tellers SET tbalance = tbalance + :delta WHERE tid = :tid;
UPDATE pgbench_branches SET bbalance = bbalance + :delta WHERE bid = :bid;
INSERT INTO pgbench_history (tid, bid, aid, delta, mtime) VALUES (:tid, :bid, :aid, :delta, CURRENT_TIMESTAMP);
END;
"""


def pgbench(dsn: str, *args: str, accounts: int | None = None) -> None:
    """pgbench ``args`` on ``dsn``; ``accounts``: its transactions on the
    first that many accounts (what ``prepare_source(accounts=)`` kept)."""
    with tempfile.TemporaryDirectory(prefix="walbridge-pgbench-") as scratch:
        if accounts is not None:
            script = Path(scratch, "tpcb-like.sql")
            script.write_text(TPCB_LIKE.format(accounts=accounts))
            args = ("-f", str(script), *args)
        subprocess.run([str(find_pg_bin() / "pgbench"), *args, dsn], check=True, capture_output=True)


def e2e_config(source_db, target_db, bootstrap, prefix, tmp_path):
    group = f"{prefix}-spark"
    return make_config(source_db, bootstrap, prefix, SHAPES,
                       consumer={"group": group, "target_dsn": str(target_db),
                                 "checkpoint_dir": str(tmp_path / "checkpoints")},
                       ack={"consumer_groups": [group], "interval": 0.5})


def target_settings(kind: str, target_db: str, scratch: Path) -> dict:
    """The ``[consumer]`` settings that apply to ``kind``: the PostgreSQL
    database ``target_db``, or a Delta folder / an Iceberg Hadoop catalog's
    warehouse under ``scratch``."""
    if kind == "postgresql":
        return {"target_dsn": str(target_db)}
    if kind == "delta":
        return {"target": "delta", "target_path": str(scratch / "lake")}
    return {"target": "iceberg", "iceberg": {"warehouse": str(scratch / "warehouse")}}


def rekey_changed(source_db, new_row: tuple) -> None:
    """The schema-change tests' table ``changed`` gets a new primary key
    (id, s), so the producer re-reads it re-keyed; then a row whose key
    changes, a delete under the new key and ``new_row`` inserted."""
    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute("ALTER TABLE changed DROP CONSTRAINT changed_pkey, ADD PRIMARY KEY (id, s)")
        conn.execute("UPDATE changed SET s = 99 WHERE id = 2")
        conn.execute("DELETE FROM changed WHERE id = 3")
        conn.execute("INSERT INTO changed VALUES (%s, %s, %s)", new_row)


def prepare_source(source_db, accounts: int | None = None):
    """pgbench's tables at scale 1 (only the first ``accounts`` accounts, if
    given), history and accounts with REPLICA IDENTITY FULL."""
    pgbench(source_db, "-i", "-q", "-s", "1")
    with psycopg.connect(source_db, autocommit=True) as conn:
        if accounts is not None:
            conn.execute("DELETE FROM pgbench_accounts WHERE aid > %s", (accounts,))
        conn.execute("ALTER TABLE pgbench_history REPLICA IDENTITY FULL")
        conn.execute("ALTER TABLE pgbench_accounts REPLICA IDENTITY FULL")  # exact move-in/move-out


def caught_up(cfg) -> bool:
    """Has the slot confirmed the source's current WAL position?"""
    with psycopg.connect(cfg["source"]["dsn"]) as conn:
        row = conn.execute("SELECT confirmed_flush_lsn::text, pg_current_wal_lsn()::text FROM pg_replication_slots"
                           " WHERE slot_name = %s", (cfg["source"]["slot"],)).fetchone()
    return row is not None and lsn_to_int(row[0]) >= lsn_to_int(row[1])


def pipeline_state(cfg) -> str:
    """Where each part of the pipeline is, for a test that timed out waiting
    on it: the slot against the source's WAL, each topic's end offsets
    against the target's progress and the group's commits, the shapes that
    differ."""
    lines = []
    with psycopg.connect(cfg["source"]["dsn"], autocommit=True) as conn:
        slot = conn.execute("SELECT confirmed_flush_lsn::text, active_pid, pg_current_wal_lsn()::text,"
                            " pg_size_pretty(pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn))"
                            " FROM pg_replication_slots WHERE slot_name = %s", (cfg["source"]["slot"],)).fetchone()
    lines.append(f"slot {cfg['source']['slot']}: " + (
        f"confirmed {slot[0]}, current {slot[2]} ({slot[3]} behind), active pid {slot[1]}" if slot else "none"))
    progress = {}
    try:
        if "target_dsn" in cfg["consumer"]:  # a lake target's progress is in its tables' commits
            with psycopg.connect(cfg["consumer"]["target_dsn"]) as conn:
                for topic, partition, next_offset in conn.execute(
                        "SELECT topic, partition, next_offset FROM _walbridge.progress"):
                    progress[(topic, partition)] = next_offset
    except psycopg.Error as e:
        lines.append(f"target progress: unreadable ({e})")
    bootstrap, prefix = cfg["kafka"]["bootstrap_servers"], cfg["kafka"]["topic_prefix"]
    group = cfg["consumer"]["group"]
    client = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    try:
        topics = sorted(t for t in client.list_topics(timeout=10).topics if t.startswith(prefix + "."))
        for topic in topics:
            parts = [TopicPartition(topic, p) for p in client.list_topics(topic, timeout=10).topics[topic].partitions]
            ends = [client.get_watermark_offsets(tp, timeout=10)[1] for tp in parts]
            committed = [tp.offset for tp in client.committed(parts, timeout=10)]
            applied = [progress.get((topic, tp.partition), "-") for tp in parts]
            lines.append(f"{topic}: end {ends}, target progress {applied}, group committed {committed}")
    except Exception as e:  # a broker that is down is part of the state
        lines.append(f"kafka: unreadable ({e!r})")
    finally:
        client.close()
    try:
        lines += [str(line) for line in differences(cfg)]
    except Exception as e:
        lines.append(f"verify: failed ({e!r})")
    return "\n".join(lines)


def differences(cfg) -> list:
    """What differs, and for the first differing key of each shape: its
    source row, every message of that key in Kafka, the target's row (with
    its bookkeeping) and tombstone, and the target's progress."""
    out = []
    prefix = cfg["kafka"]["topic_prefix"]
    for d in verify_ok(cfg)[1]:
        if d.ok:
            continue
        out.append(f"shape {d.shape}: source {d.source_rows} rows, target {d.target_rows}, buckets differing "
                   f"{d.differing_buckets}, missing {d.missing[:5]}, extra {d.extra[:5]}, changed {d.changed[:5]}"
                   f" ({len(d.missing)}/{len(d.extra)}/{len(d.changed)})")
        key = next(iter(d.missing or d.extra or d.changed), None)
        if key is None or not d.keyed or "target_dsn" not in cfg["consumer"]:
            continue
        where = f'WHERE ROW({", ".join(d.bucket_columns)})::text = %s'
        schema, table = d.source_table.split(".", 1)
        with psycopg.connect(cfg["source"]["dsn"]) as conn:
            out.append(("source row", conn.execute(f'SELECT * FROM {schema}."{table}" {where}', (key,)).fetchall()))
        value = key.strip("()")
        records = read_topic(cfg["kafka"]["bootstrap_servers"], f"{prefix}.{d.shape}", prefix, timeout=120)
        out.append([(r.partition, r.offset, r.position, r.control, r.value and r.value["op"],
                     r.value and (r.value["after"] or r.value["before"]))
                    for r in records if r.control or (r.key and str(list(r.key.values())[0]) == value)])
        schema, table = d.target_table.split(".", 1)
        with psycopg.connect(cfg["consumer"]["target_dsn"]) as conn:
            out.append(("target row", conn.execute(f'SELECT * FROM {schema}."{table}" {where}', (key,)).fetchall()))
            tombstones = f'{schema}."{table}__wb_tombstones"'
            if conn.execute("SELECT to_regclass(%s) IS NULL", (tombstones,)).fetchone()[0]:
                out.append(f"{tombstones} does not exist")
            else:
                out.append(("tombstones", conn.execute(f"SELECT * FROM {tombstones} {where}", (key,)).fetchall()))
            out.append(conn.execute("SELECT * FROM _walbridge.progress").fetchall())
    return out


def verify_ok(cfg):
    """(does every shape's target equal its source, the differences)."""
    diffs = verify(parse_config(cfg))
    return all(d.ok for d in diffs), diffs


def applied_offsets(target_db) -> int:
    """The sum of the target's next offsets (0 before the consumer made its tables)."""
    try:
        with psycopg.connect(target_db) as conn:
            return conn.execute("SELECT coalesce(sum(next_offset), 0) FROM _walbridge.progress").fetchone()[0]
    except psycopg.Error:
        return 0


def applying(target_db) -> bool:
    """Is the consumer inside an apply: a target transaction of its that has
    written and not committed yet?"""
    with psycopg.connect(target_db) as conn:
        return conn.execute("SELECT EXISTS (SELECT FROM pg_stat_activity WHERE application_name = %s "
                            "AND backend_xid IS NOT NULL)", (TARGET_APP_NAME,)).fetchone()[0]


def consumer_sessions(target_db) -> int:
    """The consumer's sessions in the target (a killed consumer's linger until the server sees it gone)."""
    with psycopg.connect(target_db) as conn:
        return conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                            (TARGET_APP_NAME,)).fetchone()[0]


def assert_applied_once(target_db, bootstrap: str, topic_prefix: str) -> None:
    """No streamed pgbench_history insert applied twice, and every live
    pgbench_accounts row written by exactly the newest message of its key in
    Kafka (position and Kafka origin recorded in the bookkeeping columns)."""
    with psycopg.connect(target_db) as conn:
        history = conn.execute("SELECT count(*), count(DISTINCT (_wb_lsn, _wb_op_index)) FROM public.pgbench_history"
                               " WHERE _wb_snapshot_id IS NULL").fetchone()
        assert history[0] == history[1] > 0
        applied = {r[0]: ((r[1], r[2]), r[3], r[4]) for r in conn.execute(
            "SELECT aid, _wb_lsn, _wb_op_index, _wb_partition, _wb_offset FROM public.pgbench_accounts")}
    newest = {}
    for r in data_records(read_topic(bootstrap, f"{topic_prefix}.public.pgbench_accounts", topic_prefix,
                                     timeout=180)):
        newest[r.key["aid"]] = (r.position, r.partition, r.offset)  # partition order = position order per key
    assert applied == newest


def newest_commit(table: Path) -> float:
    """When the table's newest commit was written (0: none yet): a Delta
    table's log entry, or an Iceberg table's metadata file (Hadoop catalog)."""
    commits = "metadata/v*.metadata.json" if (table / "metadata").is_dir() else "_delta_log/*.json"
    try:
        return max((f.stat().st_mtime for f in table.glob(commits)), default=0.0)
    except OSError:  # a file replaced while listed
        return 0.0


def data_files(table: Path) -> list[Path]:
    """The Delta or Iceberg table's data files (committed or not)."""
    return [f for pattern in ("*.parquet", "data/*.parquet") for f in table.glob(pattern)]


def writing_uncommitted(table: Path) -> bool:
    """Is a MERGE into the Delta or Iceberg table between writing its data
    files and committing them?"""
    newest = newest_commit(table)
    try:
        return newest > 0 and any(f.stat().st_mtime > newest for f in data_files(table))
    except OSError:
        return False
