"""The source fails over (issue 33), on PostgreSQL 18: a primary and a
physical standby made with ``pg_basebackup``, the producer and the consumer
reaching the source through a multi-host DSN (``target_session_attrs=
read-write``), the primary's postmaster killed with SIGKILL and the standby
promoted.

- With the standby set up for slot synchronization (``sync_replication_slots``,
  ``hot_standby_feedback``, ``primary_slot_name``, a ``primary_conninfo``
  naming a database, and on the primary ``synchronized_standby_slots``), the
  producer finds the synchronized copy of its failover slot on the promoted
  server and streams on from it under pgbench: the target equals the new
  primary row by row, with no second snapshot, nothing applied twice, no
  walbridge process exited, and the slot confirmed to the last change.
- Without it, the promoted server holds no copy of the slot: the producer
  stops with one clear error and exit code 3, and creates no slot there.
- With a synchronized copy but an empty ``synchronized_standby_slots``, the
  producer reads what the standby has not received: cut off from the
  primary, the standby misses transactions that are in Kafka when it is
  promoted. The new timeline forks below them, so the producer stops with
  exit code 3 (streaming on would skip the new primary's changes at those
  positions as replays), produces nothing of the new timeline, and the way
  back its error names (a re-snapshot once the new primary's WAL is past
  what Kafka holds) leaves the topics folding to the new primary's rows.

``check-config --live`` says which of the two set-ups it looks at.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
from pathlib import Path
from typing import Iterator

import psycopg

from producer.pgoutput import lsn_to_int, lsn_to_str
from schemas.config import parse_config
from tests.helpers import ConsumerProcess, ProducerProcess, latest_rows, make_config, read_topic, wait_for, write_toml
from tests.pipeline import applied_offsets, assert_applied_once, caught_up, e2e_config, pipeline_state, verify_ok
from walbridge.check import OK, WARN, live_checks
from walbridge.embedded import PostgresCluster, find_pg_bin

VERSION = 18
STANDBY_SLOT = "standby1"
SLOT_SYNC = {"sync_replication_slots": "on", "hot_standby_feedback": "on"}


@contextlib.contextmanager
def primary_and_standby(base: Path, *, slot_sync: bool,
                        held_back: bool | None = None) -> Iterator[tuple[PostgresCluster, PostgresCluster]]:
    """A PostgreSQL 18 primary and its streaming standby, both running; with
    ``slot_sync`` set up to carry failover slots, and unless ``held_back`` is
    False the primary's ``synchronized_standby_slots`` naming the standby's
    slot. Stopped afterwards."""
    held_back = slot_sync if held_back is None else held_back
    primary = PostgresCluster(base / "primary", version=VERSION,
                              settings={"synchronized_standby_slots": f"'{STANDBY_SLOT}'"} if held_back else {})
    standby = None
    try:
        primary.start()
        standby = primary.standby(base / "standby", slot=STANDBY_SLOT, settings=SLOT_SYNC if slot_sync else {})
        standby.start()
        yield primary, standby
    finally:
        for server in (standby, primary):
            if server is not None:
                server.stop("immediate")


def multi_host_dsn(primary: PostgresCluster, standby: PostgresCluster, db: str) -> str:
    """Both servers, in the order libpq tries them; whichever accepts writes is used."""
    return (f"host={primary.host},{standby.host} port={primary.port},{standby.port} dbname={db} user=postgres "
            "target_session_attrs=read-write")


def replayed(standby: PostgresCluster, db: str) -> bool:
    """Has the standby replayed the creation of ``db`` (and can it be read)?"""
    try:
        psycopg.connect(standby.dsn(db), connect_timeout=5).close()
        return True
    except psycopg.OperationalError:
        return False


def fail_over(primary: PostgresCluster, standby: PostgresCluster) -> None:
    """The primary's postmaster dies with SIGKILL; the standby is promoted."""
    os.kill(primary.postmaster_pid(), signal.SIGKILL)
    wait_for(lambda: primary.postmaster_pid() is None, timeout=30, interval=0.05, what="the primary gone")
    standby.promote()


def slot_row(cluster: PostgresCluster, db: str, slot: str) -> tuple | None:
    with psycopg.connect(cluster.dsn(db), autocommit=True) as conn:
        return conn.execute("SELECT failover, synced, temporary FROM pg_replication_slots WHERE slot_name = %s",
                            (slot,)).fetchone()


def synced_copy_persistent(primary: PostgresCluster, standby: PostgresCluster, db: str, slot: str) -> bool:
    """Does the standby hold a persistent synchronized copy of ``slot``? The
    copy stays temporary until the primary's slot advances past what the
    standby reserved, which takes a running-xacts record: logged now rather
    than at the bgwriter's next one (every 15 s)."""
    with psycopg.connect(primary.dsn(db), autocommit=True) as conn:
        conn.execute("SELECT pg_log_standby_snapshot()")
    return slot_row(standby, db, slot) == (True, True, False)


def pgbench(dsn: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([str(find_pg_bin(VERSION) / "pgbench"), *args, dsn], capture_output=True, check=check)


def test_primary_killed_walbridge_carries_on_from_the_synced_slot_on_the_promoted_standby(
        pg_base_dir, target_db, kafka_broker, topic_prefix, tmp_path):
    with primary_and_standby(pg_base_dir, slot_sync=True) as (primary, standby):
        primary.create_database("src")
        wait_for(lambda: replayed(standby, "src"), timeout=60, interval=0.1, what="the standby has the database")
        source = multi_host_dsn(primary, standby, "src")
        pgbench(source, "-i", "-q", "-s", "1")
        with psycopg.connect(source, autocommit=True) as conn:
            conn.execute("ALTER TABLE pgbench_history REPLICA IDENTITY FULL")
            conn.execute("ALTER TABLE pgbench_accounts REPLICA IDENTITY FULL")
        cfg = e2e_config(source, target_db, kafka_broker.bootstrap, topic_prefix, tmp_path)
        cfg["source"]["reconnect_max_backoff"] = 1.0  # back soon after the promotion
        slot = cfg["source"]["slot"]
        path = write_toml(cfg, tmp_path / "wb.toml")
        producer_log, consumer_log = tmp_path / "producer.log", tmp_path / "consumer.log"
        stop_load, promoted = threading.Event(), threading.Event()
        rounds = {False: 0, True: 0}  # pgbench rounds done before / after the promotion

        def load() -> None:
            """pgbench in rounds of 2 s through the multi-host DSN: the rounds
            the failover breaks fail, the next ones run on the new primary."""
            while not stop_load.is_set():
                after = promoted.is_set()
                if pgbench(source, "-n", "-c", "2", "-T", "2", check=False).returncode == 0:
                    rounds[after] += 1
                else:
                    stop_load.wait(0.2)  # no server accepts writes yet

        loader = threading.Thread(target=load, daemon=True)
        with ProducerProcess(path, producer_log) as producer, ConsumerProcess(path, consumer_log) as consumer:
            try:
                wait_for(lambda: applied_offsets(target_db) > 5000, timeout=180, interval=0.5,
                         what="the consumer applying the snapshot")
                loader.start()
                wait_for(lambda: rounds[False] >= 1, timeout=60, what="pgbench on the primary")
                wait_for(lambda: synced_copy_persistent(primary, standby, "src", slot), timeout=120, interval=0.5,
                         what="a persistent synchronized copy of the slot on the standby")
                checks = {c.item: c for c in live_checks(parse_config(cfg))}
                ready = checks[f"standby host {standby.host}:{standby.port}"]
                assert ready.state == OK and "persistent synchronized copy" in ready.detail, ready
                assert checks["synchronized_standby_slots"].state == OK
                assert checks[f"slot {slot} failover"].state == OK
                fail_over(primary, standby)
                promoted.set()
                wait_for(lambda: "the source failed over" in producer_log.read_text(), timeout=90,
                         what="the producer streaming from the promoted standby")
                wait_for(lambda: rounds[True] >= 3, timeout=120,
                         what="pgbench going on against the new primary")
                stop_load.set()
                loader.join(60)
                ok = wait_for(lambda: verify_ok(cfg)[0], timeout=300, interval=3,
                              what="target == the new primary", explain=lambda: pipeline_state(cfg))
                assert ok, verify_ok(cfg)[1]
                wait_for(lambda: caught_up(cfg), timeout=90, what="the new primary's slot at the last change")
                assert producer.proc.poll() is None and consumer.proc.poll() is None, "a process exited by itself"
            finally:
                stop_load.set()
        text = producer_log.read_text()
        assert text.count("created slot") == 1 and "dropping the slot" not in text  # no second snapshot
        assert len(re.findall(r"snapshot \S+ done: ", text)) == 1
        # The slot streamed from is the synchronized copy, not a new one.
        assert slot_row(standby, "src", slot) == (True, True, False)
        with psycopg.connect(target_db) as conn:
            assert conn.execute("SELECT count(DISTINCT _wb_snapshot_id) FROM public.pgbench_accounts "
                                "WHERE _wb_snapshot_id IS NOT NULL").fetchone()[0] == 1
        with psycopg.connect(standby.dsn("src")) as conn:  # the binding follows: the promoted server
            timeline = conn.execute("SELECT timeline FROM _walbridge.producer_slots WHERE slot_name = %s",
                                    (slot,)).fetchone()[0]
        assert timeline == 2
        assert_applied_once(target_db, kafka_broker.bootstrap, topic_prefix)


def test_standby_promoted_without_a_synced_slot_stops_the_producer_with_exit_code_3(
        pg_base_dir, kafka_broker, topic_prefix, tmp_path):
    with primary_and_standby(pg_base_dir, slot_sync=False) as (primary, standby):
        primary.create_database("src")
        source = multi_host_dsn(primary, standby, "src")
        with psycopg.connect(source, autocommit=True) as conn:
            conn.execute("CREATE TABLE items (id int PRIMARY KEY, name text)")
            conn.execute("INSERT INTO items SELECT g, 'item ' || g FROM generate_series(1, 100) g")
        cfg = make_config(source, kafka_broker.bootstrap, topic_prefix, [{"table": "public.items"}],
                          source={"reconnect_max_backoff": 1.0})
        slot = cfg["source"]["slot"]
        log = tmp_path / "producer.log"
        with ProducerProcess(write_toml(cfg, tmp_path / "wb.toml"), log) as producer:
            wait_for(lambda: "streaming from slot" in log.read_text(), timeout=120, what="the producer streaming")
            with psycopg.connect(source, autocommit=True) as conn:
                conn.execute("INSERT INTO items VALUES (101, 'after the snapshot')")
            wait_for(lambda: replayed(standby, "src"), timeout=60, interval=0.1, what="the standby has the database")
            assert slot_row(standby, "src", slot) is None  # nothing synchronizes it
            checks = live_checks(parse_config(cfg))
            by_item = {c.item: c for c in checks}
            unsynchronized = by_item["synchronized_standby_slots"]
            assert unsynchronized.state == WARN and (
                f"ALTER SYSTEM SET synchronized_standby_slots = '{STANDBY_SLOT}'" in unsynchronized.detail)
            not_set_up = by_item[f"standby host {standby.host}:{standby.port}"]
            assert not_set_up.state == WARN and "sync_replication_slots = on" in not_set_up.detail
            assert checks.exit_code() == 0  # warnings fail nothing
            fail_over(primary, standby)
            code = producer.proc.wait(60)
        text = log.read_text()
        assert code == 3, text[-3000:]
        assert "the source failed over" in text and "holds no copy of the slot" in text, text[-3000:]
        assert "fix: if the old primary still runs, point [source] dsn at it" in text
        assert text.count("created slot") == 1
        assert slot_row(standby, "src", slot) is None  # no new slot, no snapshot on the promoted server


def cut_off(standby: PostgresCluster) -> int:
    """The standby stops receiving WAL, as behind a network cut: its
    ``primary_conninfo`` emptied, its walreceiver gone. Returns the end of
    the WAL it received."""
    with psycopg.connect(standby.dsn("postgres"), autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET primary_conninfo = ''")
        conn.execute("SELECT pg_reload_conf()")
        wait_for(lambda: conn.execute("SELECT count(*) FROM pg_stat_wal_receiver").fetchone()[0] == 0, timeout=60,
                 what="the standby's walreceiver gone")
        return lsn_to_int(conn.execute("SELECT pg_last_wal_receive_lsn()::text").fetchone()[0])


def wal_lsn(cluster: PostgresCluster, db: str) -> int:
    with psycopg.connect(cluster.dsn(db), autocommit=True) as conn:
        return lsn_to_int(conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])


def confirmed(cluster: PostgresCluster, db: str, slot: str) -> int:
    with psycopg.connect(cluster.dsn(db), autocommit=True) as conn:
        return lsn_to_int(conn.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots "
                                       "WHERE slot_name = %s", (slot,)).fetchone()[0])


def test_a_failover_to_a_standby_that_missed_changes_in_kafka_stops_the_producer_with_exit_code_3(
        pg_base_dir, kafka_broker, topic_prefix, tmp_path):
    with primary_and_standby(pg_base_dir, slot_sync=True, held_back=False) as (primary, standby):
        primary.create_database("src")
        source = multi_host_dsn(primary, standby, "src")
        with psycopg.connect(source, autocommit=True) as conn:
            conn.execute("CREATE TABLE items (id int PRIMARY KEY, name text)")
            conn.execute("CREATE TABLE ticks (id serial PRIMARY KEY)")
            conn.execute("INSERT INTO items SELECT g, 'item ' || g FROM generate_series(1, 100) g")
        cfg = make_config(source, kafka_broker.bootstrap, topic_prefix, [{"table": "public.items"}],
                          source={"reconnect_max_backoff": 1.0})
        slot, topic = cfg["source"]["slot"], f"{topic_prefix}.public.items"
        path, log = write_toml(cfg, tmp_path / "wb.toml"), tmp_path / "producer.log"

        def ticked_and_synced() -> bool:
            """A write for the slot to advance past what the standby reserved."""
            with psycopg.connect(primary.dsn("src"), autocommit=True) as conn:
                conn.execute("INSERT INTO ticks DEFAULT VALUES")
            return replayed(standby, "src") and synced_copy_persistent(primary, standby, "src", slot)

        with ProducerProcess(path, log) as producer:
            wait_for(lambda: "streaming from slot" in log.read_text(), timeout=120, what="the producer streaming")
            wait_for(ticked_and_synced, timeout=120, interval=0.5,
                     what="a persistent synchronized copy of the slot on the standby")
            received = cut_off(standby)
            # What the standby never gets: one large transaction and a few small ones.
            with psycopg.connect(primary.dsn("src"), autocommit=True) as conn:
                conn.execute("INSERT INTO items SELECT g, repeat('old timeline ', 20) FROM generate_series(1001, "
                             "21000) g")
                for i in range(1, 6):
                    conn.execute("UPDATE items SET name = 'old timeline' WHERE id = %s", (i,))
            sent = wal_lsn(primary, "src")
            wait_for(lambda: confirmed(primary, "src", slot) >= sent, timeout=120,
                     what="Kafka holding the transactions the standby missed")
            before = read_topic(kafka_broker.bootstrap, topic, topic_prefix)
            furthest = max(r.position[0] for r in before if r.position is not None)
            assert furthest > received
            fail_over(primary, standby)
            with psycopg.connect(standby.dsn("src"), autocommit=True) as conn:
                assert conn.execute("SELECT count(*) FROM items WHERE id > 1000").fetchone()[0] == 0
                # New-timeline changes at positions Kafka holds for the old timeline's.
                conn.execute("INSERT INTO items VALUES (50001, 'new timeline')")
                conn.execute("UPDATE items SET name = 'new timeline' WHERE id = 6")
            assert wal_lsn(standby, "src") < furthest  # streaming on would skip them as replays
            code = producer.proc.wait(60)
        text = log.read_text()
        assert code == 3, text[-3000:]
        fork = re.search(r"timeline 2 forked from timeline 1 at (\S+), but Kafka holds changes of slot \S+ up to "
                         r"(\S+):", text)
        assert fork, text[-3000:]
        assert lsn_to_int(fork[1]) <= received and fork[2] == lsn_to_str(furthest)
        assert "synchronized_standby_slots on the old primary was empty" in text
        assert f"SELECT pg_drop_replication_slot('{slot}');" in text and "walbridge stops" in text
        assert text.count("created slot") == 1
        after = read_topic(kafka_broker.bootstrap, topic, topic_prefix)
        assert [(r.partition, r.offset) for r in after] == [(r.partition, r.offset) for r in before]
        with psycopg.connect(standby.dsn("src"), autocommit=True) as conn:  # nothing recorded, nothing dropped
            assert conn.execute("SELECT timeline FROM _walbridge.producer_slots WHERE slot_name = %s",
                                (slot,)).fetchone()[0] == 1
        assert slot_row(standby, "src", slot) == (True, True, False)

        # The way back the error names: past what Kafka holds, then a new slot and snapshot.
        with psycopg.connect(standby.dsn("src"), autocommit=True) as conn:
            while wal_lsn(standby, "src") <= furthest:
                conn.execute("INSERT INTO ticks DEFAULT VALUES")
                conn.execute("SELECT pg_switch_wal()")
            conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
            conn.execute("DELETE FROM _walbridge.producer_slots WHERE slot_name = %s", (slot,))
        with ProducerProcess(path, log) as producer:
            wait_for(lambda: text.count("streaming from slot") < log.read_text().count("streaming from slot"),
                     timeout=120, what="the producer streaming again")
            with psycopg.connect(standby.dsn("src"), autocommit=True) as conn:
                conn.execute("UPDATE items SET name = 'after the way back' WHERE id = 7")
                conn.execute("DELETE FROM items WHERE id = 8")
                wanted = {(("id", i),): {"id": i, "name": n}
                          for i, n in conn.execute("SELECT id, name FROM items").fetchall()}

            def folded() -> dict:
                """The topic as the consumer applies it: the last snapshot_end
                cuts every row below it, then the highest position wins."""
                records = read_topic(kafka_broker.bootstrap, topic, topic_prefix)
                ends = [r.position for r in records if r.control == "snapshot_end"]
                return latest_rows([r for r in records if r.position is not None and r.position >= max(ends)])

            wait_for(lambda: folded() == wanted, timeout=60, interval=1, what="the topics folding to the new primary")
            assert producer.proc.poll() is None
        ends = [r.position for r in read_topic(kafka_broker.bootstrap, topic, topic_prefix)
                if r.control == "snapshot_end"]
        assert len(ends) == 6 and sorted(ends)[3][0] > furthest  # the second snapshot, past the old timeline's
