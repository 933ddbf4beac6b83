"""End to end on real parts: PostgreSQL → producer → Apache Kafka → Spark consumer →
target PostgreSQL, with pgbench as the workload."""

from __future__ import annotations

import subprocess
import threading

import psycopg
import pytest

from producer.pgoutput import lsn_to_int
from schemas.config import parse_config
from tests.helpers import (
    ConsumerProcess,
    ConsumerThread,
    ProducerThread,
    data_records,
    make_config,
    read_topic,
    wait_for,
    write_toml,
)
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


def pgbench(dsn: str, *args: str) -> None:
    subprocess.run([str(find_pg_bin() / "pgbench"), *args, dsn], check=True, capture_output=True)


def pgbench_until(dsn: str, done: threading.Event) -> None:
    """pgbench in rounds of 5 s until ``done`` is set, for at least 15 s
    (at most 150 s)."""
    for round_ in range(30):
        pgbench(dsn, "-n", "-c", "2", "-T", "5")
        if round_ >= 2 and done.is_set():
            break


def e2e_config(source_db, target_db, bootstrap, prefix, tmp_path):
    group = f"{prefix}-spark"
    return make_config(source_db, bootstrap, prefix, SHAPES,
                       consumer={"group": group, "target_dsn": str(target_db),
                                 "checkpoint_dir": str(tmp_path / "checkpoints"), "trigger_interval": 0.5},
                       ack={"consumer_groups": [group], "interval": 0.5})


def _prepare_source(source_db):
    pgbench(source_db, "-i", "-q", "-s", "1")
    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute("ALTER TABLE pgbench_history REPLICA IDENTITY FULL")
        conn.execute("ALTER TABLE pgbench_accounts REPLICA IDENTITY FULL")  # exact move-in/move-out


def _caught_up(cfg) -> bool:
    with psycopg.connect(cfg["source"]["dsn"]) as conn:
        row = conn.execute("SELECT confirmed_flush_lsn::text, pg_current_wal_lsn()::text FROM pg_replication_slots"
                           " WHERE slot_name = %s", (cfg["source"]["slot"],)).fetchone()
    return row is not None and lsn_to_int(row[0]) >= lsn_to_int(row[1])


def _verify_ok(cfg):
    diffs = verify(parse_config(cfg))
    return all(d.ok for d in diffs), diffs


def test_pgbench_end_to_end_equal_and_slot_released(source_db, target_db, kafka_broker, topic_prefix, tmp_path):
    _prepare_source(source_db)
    cfg = e2e_config(source_db, target_db, kafka_broker.bootstrap, topic_prefix, tmp_path)
    with ProducerThread(cfg), ConsumerThread(cfg) as consumer:
        pgbench(source_db, "-n", "-c", "2", "-T", "8")
        ok = wait_for(lambda: _verify_ok(cfg)[0] or consumer.errors, timeout=240, interval=2,
                      what="target == source")
        assert ok is True, [str(e) for e in consumer.errors] or _verify_ok(cfg)[1]
        # Once the consumer caught up, the slot is confirmed to the last commit.
        wait_for(lambda: _caught_up(cfg), timeout=60, what="confirmed_flush_lsn at the last commit")
    assert not consumer.errors
    from prometheus_client import REGISTRY

    applied = REGISTRY.get_sample_value("walbridge_apply_rows_total", {"shape": "public.pgbench_accounts"})
    assert applied and applied >= 100000  # consumer metrics: the snapshot alone is 100k rows
    with psycopg.connect(target_db) as conn:
        # Bookkeeping: every live row carries the position and Kafka origin of its last change.
        assert conn.execute("SELECT count(*) FROM public.pgbench_accounts WHERE _wb_lsn IS NULL").fetchone()[0] == 0
        # Keyless: each streamed insert once (snapshot rows share the snapshot's position).
        history = conn.execute("SELECT count(*), count(DISTINCT (_wb_lsn, _wb_op_index)) FROM public.pgbench_history"
                               " WHERE _wb_snapshot_id IS NULL").fetchone()
        assert history[0] == history[1] > 0


@pytest.mark.parametrize("fault", ["apply fails", "read hands over nothing"])
def test_failed_apply_after_spark_logged_the_batch_is_replayed(source_db, target_db, kafka_broker, topic_prefix,
                                                                tmp_path, monkeypatch, caplog, fault):
    """The pipelined apply fails after Spark logged its batch as done, or a
    batch's read handed over none of a partition's messages (the next batch
    then fails with a progress gap): the query restarts, the batches from the
    first the target lacks are read and applied again, nothing is lost."""
    from spark_consumer import job

    _prepare_source(source_db)
    cfg = e2e_config(source_db, target_db, kafka_broker.bootstrap, topic_prefix, tmp_path)
    cfg["shapes"] = [s for s in SHAPES if s["table"] == "public.pgbench_accounts" and "name" not in s]
    cfg["consumer"]["max_offsets_per_trigger"] = 20000
    calls = []
    real_apply = job.apply_batch

    def faulty_third_apply(conn, group, target, parts, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            if fault == "apply fails":
                raise RuntimeError("injected: the target went away mid-apply")
            parts = [p for p in parts if p.partition != parts[0].partition]  # as if read as empty
        return real_apply(conn, group, target, parts, **kwargs)

    monkeypatch.setattr(job, "apply_batch", faulty_third_apply)
    caplog.set_level("INFO", logger="walbridge.consumer")
    with ProducerThread(cfg), ConsumerThread(cfg) as consumer:
        ok = wait_for(lambda: _verify_ok(cfg)[0] or consumer.errors, timeout=240, interval=2,
                      what="target == source")
        assert ok is True, [str(e) for e in consumer.errors] or _verify_ok(cfg)[1]
    assert not consumer.errors
    assert len(calls) > 3
    messages = [r.getMessage() for r in caplog.records]
    assert any("never committed all of it" in m for m in messages), messages[-20:]
    if fault == "read hands over nothing":
        assert any("were never applied" in m for m in messages), messages[-20:]


def _applied_batches(target_db) -> int:
    try:
        with psycopg.connect(target_db) as conn:
            return conn.execute("SELECT coalesce(sum(next_offset), 0) FROM _walbridge.progress").fetchone()[0]
    except psycopg.Error:
        return 0


def _committed_not_applied(cfg, shape: str) -> bool:
    """Has Spark logged a batch of ``shape`` as done that the target has not
    committed yet (the pipelined apply's window)?"""
    from pathlib import Path

    from spark_consumer.checkpoint import newest_unapplied

    with psycopg.connect(cfg["consumer"]["target_dsn"]) as conn:
        next_offsets = dict(conn.execute("SELECT partition, next_offset FROM _walbridge.progress "
                                         "WHERE consumer_group = %s AND topic = %s",
                                         (cfg["consumer"]["group"], f"{cfg['kafka']['topic_prefix']}.{shape}")))
    return newest_unapplied(Path(cfg["consumer"]["checkpoint_dir"]) / shape, next_offsets) is not None


@pytest.mark.parametrize("apply_mode", ["pipelined", "staged"])
def test_consumer_kill9_mid_apply_restarts_equal_and_nothing_applied_twice(source_db, target_db, kafka_broker,
                                                                         topic_prefix, tmp_path, apply_mode):
    _prepare_source(source_db)
    cfg = e2e_config(source_db, target_db, kafka_broker.bootstrap, topic_prefix, tmp_path)
    if apply_mode == "staged":
        cfg["consumer"]["max_offsets_per_trigger"] = 3000  # many small batches: kills land mid-stream
        cfg["consumer"]["staged_apply"] = True  # executors stage, the driver commits: crash between the two
    else:
        # The driver applies batch N while Spark reads N+1 and has already
        # logged N as done: kill in that window, so the restart must replay N.
        cfg["consumer"]["max_offsets_per_trigger"] = 10000
    path = write_toml(cfg, tmp_path / "wb.toml")
    log = tmp_path / "consumer.log"
    load_done = threading.Event()

    def load():
        pgbench(source_db, "-n", "-c", "2", "-T", "20")
        load_done.set()

    def kill_moment():
        if apply_mode == "staged":
            before = _applied_batches(target_db)
            wait_for(lambda: _applied_batches(target_db) > before, timeout=120, interval=0.1,
                     what="a batch being applied")
        else:
            wait_for(lambda: _committed_not_applied(cfg, "public.pgbench_accounts"), timeout=120, interval=0.01,
                     what="a batch logged by Spark, not yet in the target")

    with ProducerThread(cfg):
        consumer = ConsumerProcess(path, log).start()
        try:
            wait_for(lambda: _applied_batches(target_db) > 5000, timeout=180, interval=0.5,
                     what="consumer applying")
            threading.Thread(target=load, daemon=True).start()
            for _ in range(2):
                kill_moment()
                consumer.kill9()
                consumer = ConsumerProcess(path, log).start()
            load_done.wait(60)
            ok = wait_for(lambda: _verify_ok(cfg)[0], timeout=300, interval=3, what="target == source")
            assert ok
            wait_for(lambda: _caught_up(cfg), timeout=60, what="slot at the last commit")
        finally:
            consumer.stop()
    if apply_mode == "pipelined":
        assert "never committed all of it" in log.read_text()
    assert_applied_once(target_db, kafka_broker.bootstrap, topic_prefix)


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


def test_spark_submit_entry_point_applies_a_shape(source_db, target_db, kafka_broker, topic_prefix, tmp_path):
    """The production entry point: ``spark-submit walbridge/spark_submit.py -c FILE``."""
    import os
    import signal
    import sys
    from pathlib import Path

    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE items (id int PRIMARY KEY, name text, price numeric(8,2))")
        conn.execute("INSERT INTO items SELECT g, 'item ' || g, g * 1.25 FROM generate_series(1, 500) g")
    group = f"{topic_prefix}-submit"
    cfg = make_config(source_db, kafka_broker.bootstrap, topic_prefix, [{"table": "public.items"}],
                      consumer={"group": group, "target_dsn": str(target_db),
                                "checkpoint_dir": str(tmp_path / "ck"), "trigger_interval": 0.5},
                      ack={"consumer_groups": [group], "interval": 0.5})
    path = write_toml(cfg, tmp_path / "wb.toml")
    root = Path(__file__).resolve().parent.parent.parent
    spark_submit = Path(sys.executable).parent / "spark-submit"
    log = open(tmp_path / "spark-submit.log", "wb")
    with ProducerThread(cfg):
        proc = subprocess.Popen([str(spark_submit), "--master", "local[2]", str(root / "walbridge" / "spark_submit.py"),
                                 "-c", str(path)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYSPARK_PYTHON": sys.executable})
        try:
            with psycopg.connect(source_db, autocommit=True) as conn:
                conn.execute("UPDATE items SET price = price + 1 WHERE id <= 10")
                conn.execute("DELETE FROM items WHERE id > 490")
            ok = wait_for(lambda: _verify_ok(cfg)[0] or proc.poll() is not None, timeout=180, interval=2,
                          what="target == source via spark-submit")
            assert ok is True and proc.poll() is None, (tmp_path / "spark-submit.log").read_text()[-3000:]
            wait_for(lambda: _caught_up(cfg), timeout=60, what="slot released by the group's commits")
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
