"""End to end on real parts: PostgreSQL → producer → Apache Kafka → Spark consumer →
target PostgreSQL, with pgbench as the workload."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psycopg
import pytest
from prometheus_client import REGISTRY

from spark_consumer.session import SPARK_PACKAGES
from spark_consumer.targets import postgresql as pg_target
from tests.helpers import ConsumerProcess, ConsumerThread, ProducerThread, make_config, wait_for, write_toml
from tests.pipeline import (
    SHAPES,
    applied_offsets,
    applying,
    assert_applied_once,
    caught_up,
    consumer_sessions,
    e2e_config,
    pgbench,
    pipeline_state,
    prepare_source,
    verify_ok,
)


def test_pgbench_end_to_end_equal_and_slot_released(source_db, target_db, kafka_broker, topic_prefix, tmp_path):
    prepare_source(source_db)
    cfg = e2e_config(source_db, target_db, kafka_broker.bootstrap, topic_prefix, tmp_path)
    with ProducerThread(cfg), ConsumerThread(cfg) as consumer:
        pgbench(source_db, "-n", "-c", "2", "-T", "8")
        ok = wait_for(lambda: verify_ok(cfg)[0] or consumer.errors, timeout=240, interval=2,
                      what="target == source", explain=lambda: pipeline_state(cfg))
        assert ok is True, [str(e) for e in consumer.errors] or verify_ok(cfg)[1]
        # Once the consumer caught up, the slot is confirmed to the last commit.
        wait_for(lambda: caught_up(cfg), timeout=60, what="confirmed_flush_lsn at the last commit")
    assert not consumer.errors
    applied = REGISTRY.get_sample_value("walbridge_apply_rows_total", {"shape": "public.pgbench_accounts"})
    assert applied and applied >= 100000  # consumer metrics: the snapshot alone is 100k rows
    with psycopg.connect(target_db) as conn:
        # Bookkeeping: every live row carries the position and Kafka origin of its last change.
        assert conn.execute("SELECT count(*) FROM public.pgbench_accounts WHERE _wb_lsn IS NULL").fetchone()[0] == 0
        # Keyless: each streamed insert once (snapshot rows share the snapshot's position).
        history = conn.execute("SELECT count(*), count(DISTINCT (_wb_lsn, _wb_op_index)) FROM public.pgbench_history"
                               " WHERE _wb_snapshot_id IS NULL").fetchone()
        assert history[0] == history[1] > 0


@pytest.mark.parametrize("fault", ["apply fails", "a part is lost"])
def test_a_failed_apply_restarts_the_query_at_the_targets_progress(source_db, target_db, kafka_broker, topic_prefix,
                                                                   tmp_path, monkeypatch, caplog, fault):
    """The pipelined apply fails after Spark logged its batch, or an apply
    leaves a partition's part out (the next batch then starts past the
    target's progress and fails with a progress gap): the query restarts at
    the target's progress, nothing is lost."""
    prepare_source(source_db)
    cfg = e2e_config(source_db, target_db, kafka_broker.bootstrap, topic_prefix, tmp_path)
    cfg["shapes"] = [s for s in SHAPES if s["table"] == "public.pgbench_accounts" and "name" not in s]
    cfg["consumer"]["max_offsets_per_trigger"] = 20000
    calls = []
    real_apply = pg_target.apply_shapes

    def faulty_third_apply(conn, group, batches, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            if fault == "apply fails":
                raise RuntimeError("injected: the target went away mid-apply")
            batches = [(t, parts[1:]) for t, parts in batches]  # as if one partition's part was never read
        return real_apply(conn, group, batches, **kwargs)

    monkeypatch.setattr(pg_target, "apply_shapes", faulty_third_apply)
    caplog.set_level("INFO", logger="walbridge.consumer")
    with ProducerThread(cfg), ConsumerThread(cfg) as consumer:
        ok = wait_for(lambda: verify_ok(cfg)[0] or consumer.errors, timeout=240, interval=2,
                      what="target == source", explain=lambda: pipeline_state(cfg))
        assert ok is True, [str(e) for e in consumer.errors] or verify_ok(cfg)[1]
    assert not consumer.errors
    assert len(calls) > 3
    messages = [r.getMessage() for r in caplog.records]
    assert any("restarting it from the target's progress" in m for m in messages), messages[-20:]
    if fault == "a part is lost":
        assert any("were never applied" in m for m in messages), messages[-20:]


def test_consumer_kill9_mid_apply_restarts_equal_and_nothing_applied_twice(source_db, target_db, kafka_broker,
                                                                          topic_prefix, tmp_path):
    """``kill -9`` of the driver (and its JVM) while a target transaction of
    its has written and not committed, twice, under pgbench."""
    prepare_source(source_db)
    cfg = e2e_config(source_db, target_db, kafka_broker.bootstrap, topic_prefix, tmp_path)
    cfg["consumer"]["max_offsets_per_trigger"] = 10000
    path = write_toml(cfg, tmp_path / "wb.toml")
    log = tmp_path / "consumer.log"
    load_done = threading.Event()

    def load():
        pgbench(source_db, "-n", "-c", "2", "-T", "20")
        load_done.set()

    with ProducerThread(cfg):
        consumer = ConsumerProcess(path, log).start()
        try:
            wait_for(lambda: applied_offsets(target_db) > 5000, timeout=180, interval=0.5,
                     what="consumer applying")
            threading.Thread(target=load, daemon=True).start()
            for starts in (1, 2):
                # The query of this start running first: a transaction of its
                # set-up (before the query) is not an apply.
                wait_for(lambda: log.read_text().count("from the target's progress") >= starts, timeout=180,
                         what=f"start {starts} reading from the target's progress")
                wait_for(lambda: applying(target_db), timeout=120, interval=0.01,
                         what="an apply written and not committed")
                consumer.kill9()
                # The killed apply rolled back: its session is gone (it is not the next one's).
                wait_for(lambda: consumer_sessions(target_db) == 0, timeout=60, what="the killed session gone")
                consumer = ConsumerProcess(path, log).start()
            load_done.wait(60)
            ok = wait_for(lambda: verify_ok(cfg)[0], timeout=300, interval=3, what="target == source",
                          explain=lambda: pipeline_state(cfg))
            assert ok
            wait_for(lambda: caught_up(cfg), timeout=60, what="slot at the last commit")
        finally:
            consumer.stop()
    assert log.read_text().count("from the target's progress") >= 3  # each start began there
    assert_applied_once(target_db, kafka_broker.bootstrap, topic_prefix)


def test_spark_submit_entry_point_applies_a_shape(source_db, target_db, kafka_broker, topic_prefix, tmp_path):
    """The production entry point: ``spark-submit --packages ... walbridge/spark_submit.py -c FILE``."""
    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE items (id int PRIMARY KEY, name text, price numeric(8,2))")
        conn.execute("INSERT INTO items SELECT g, 'item ' || g, g * 1.25 FROM generate_series(1, 500) g")
    group = f"{topic_prefix}-submit"
    cfg = make_config(source_db, kafka_broker.bootstrap, topic_prefix, [{"table": "public.items"}],
                      consumer={"group": group, "target_dsn": str(target_db),
                                "checkpoint_dir": str(tmp_path / "ck")},
                      ack={"consumer_groups": [group], "interval": 0.5})
    path = write_toml(cfg, tmp_path / "wb.toml")
    root = Path(__file__).resolve().parent.parent.parent
    spark_submit = Path(sys.executable).parent / "spark-submit"
    log = open(tmp_path / "spark-submit.log", "wb")
    with ProducerThread(cfg):
        proc = subprocess.Popen([str(spark_submit), "--master", "local[2]", "--packages", SPARK_PACKAGES,
                                 str(root / "walbridge" / "spark_submit.py"), "-c", str(path)],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYSPARK_PYTHON": sys.executable})
        try:
            with psycopg.connect(source_db, autocommit=True) as conn:
                conn.execute("UPDATE items SET price = price + 1 WHERE id <= 10")
                conn.execute("DELETE FROM items WHERE id > 490")
            ok = wait_for(lambda: verify_ok(cfg)[0] or proc.poll() is not None, timeout=180, interval=2,
                          what="target == source via spark-submit", explain=lambda: pipeline_state(cfg))
            assert ok is True and proc.poll() is None, (tmp_path / "spark-submit.log").read_text()[-3000:]
            wait_for(lambda: caught_up(cfg), timeout=60, what="slot released by the group's commits")
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
