"""Backfills end to end on real parts (PostgreSQL → producer → Apache Kafka → Spark
consumer → target PostgreSQL) under pgbench: a target damaged behind
walbridge's back is reconciled while the load runs, a shape added to a running
pipeline is filled and then followed, and a broker that lost everything is
recovered from. ``verify`` passes after each."""

from __future__ import annotations

import threading

import psycopg

from schemas.config import parse_config
from spark_consumer.progress import read_backfills
from spark_consumer.query import BatchApplier
from tests.helpers import ConsumerThread, ProducerThread, make_config, wait_for
from tests.pipeline import SHAPES, caught_up, pgbench, pipeline_state, prepare_source, verify_ok
from walbridge.reconcile import reconcile
from walbridge.verify import verify


def _config(source_db, target_db, bootstrap, prefix, tmp_path, shapes=SHAPES):
    group = f"{prefix}-spark"
    return make_config(source_db, bootstrap, prefix, shapes,
                       consumer={"group": group, "target_dsn": str(target_db),
                                 "checkpoint_dir": str(tmp_path / "checkpoints")},
                       ack={"consumer_groups": [group], "interval": 0.5})


def _wait_equal(cfg, consumer: ConsumerThread, timeout: float = 300) -> None:
    try:
        ok = wait_for(lambda: verify_ok(cfg)[0] or consumer.errors, timeout=timeout, interval=3,
                      what="target == source")
    except AssertionError:
        ok = False
    if ok is not True:
        print(pipeline_state(cfg))  # in full: pytest shortens the assertion message
        for error in consumer.errors:
            print(repr(error))
    assert ok is True, [repr(e) for e in consumer.errors] or "target != source (details above)"


def _damage(target_db) -> None:
    """Delete, alter and insert rows behind walbridge's back, in every shape."""
    with psycopg.connect(target_db, autocommit=True) as conn:
        conn.execute("DELETE FROM public.pgbench_accounts WHERE aid <= 40")
        conn.execute("UPDATE public.pgbench_accounts SET abalance = -999999, filler = 'damaged' "
                     "WHERE aid BETWEEN 41 AND 80")
        conn.execute("INSERT INTO public.pgbench_accounts (aid, bid, abalance, filler) "
                     "SELECT g, 1, 7, 'junk' FROM generate_series(900001, 900020) g")
        conn.execute("DELETE FROM public.pgbench_tellers WHERE tid <= 3")
        conn.execute("UPDATE public.pgbench_branches SET bbalance = bbalance + 12345")
        conn.execute("DELETE FROM public.pgbench_history WHERE ctid IN "
                     "(SELECT ctid FROM public.pgbench_history LIMIT 5)")
        conn.execute("INSERT INTO public.pgbench_history (tid, bid, aid, delta, mtime) "
                     "VALUES (1, 1, 1, 424242, now())")
        conn.execute("INSERT INTO public.accounts_b1_positive (aid, bid, abalance) VALUES (950000, 1, 5)")


def test_damaged_target_is_reconciled_while_pgbench_runs(source_db, target_db, kafka_broker, topic_prefix,
                                                         tmp_path):
    prepare_source(source_db)
    cfg = _config(source_db, target_db, kafka_broker.bootstrap, topic_prefix, tmp_path)
    load = threading.Thread(target=pgbench, args=(source_db, "-n", "-c", "2", "-T", "60", "-R", "100"),
                            daemon=True)
    with ProducerThread(cfg), ConsumerThread(cfg) as consumer:
        pgbench(source_db, "-n", "-c", "2", "-T", "3")  # some history for the keyless shape
        _wait_equal(cfg, consumer)
        load.start()
        _damage(target_db)
        before, after = reconcile(parse_config(cfg), timeout=300, on_progress=print)
        damaged = {d.shape for d in before if not d.ok}
        assert damaged == {s.get("name") or s["table"] for s in SHAPES}, [d.shape for d in before if d.ok]
        assert load.is_alive(), "the load ended before the backfills did: not a test of 'while it runs'"
        load.join()
        _wait_equal(cfg, consumer)
        wait_for(lambda: caught_up(cfg), timeout=60, what="slot confirmed to the last commit")
    assert not consumer.errors
    with psycopg.connect(target_db) as conn:
        done = read_backfills(conn, cfg["consumer"]["group"])
        junk = conn.execute("SELECT count(*) FROM public.pgbench_accounts WHERE aid > 100000").fetchone()[0]
    assert {b["shape"] for b in done if b["completed_at"] is not None} == damaged
    assert junk == 0
    # Keyed shapes were backfilled by key bucket only; the keyless one whole.
    scopes = {b["shape"]: b["scope"] for b in done}
    assert scopes["public.pgbench_history"] is None
    assert all(scopes[s] and scopes[s]["buckets"] for s in damaged - {"public.pgbench_history"})


def test_shape_added_to_running_pipeline_is_filled_then_followed(source_db, target_db, kafka_broker,
                                                                  topic_prefix, tmp_path):
    prepare_source(source_db)
    first = [s for s in SHAPES if s["table"] != "public.pgbench_tellers"]
    cfg = _config(source_db, target_db, kafka_broker.bootstrap, topic_prefix, tmp_path, first)
    with ProducerThread(cfg), ConsumerThread(cfg) as consumer:
        pgbench(source_db, "-n", "-c", "2", "-T", "4")  # tellers change while not a shape
        _wait_equal(cfg, consumer)
    cfg["shapes"] = SHAPES  # the deployment rolls out a config with one more shape
    load = threading.Thread(target=pgbench, args=(source_db, "-n", "-c", "2", "-T", "25", "-R", "100"),
                            daemon=True)
    with ProducerThread(cfg), ConsumerThread(cfg) as consumer:
        load.start()
        wait_for(lambda: any(b["shape"] == "public.pgbench_tellers" and b["completed_at"]
                             for b in _backfills(target_db, cfg)), timeout=180, interval=1,
                 what="the new shape backfilled and applied")
        assert load.is_alive()
        load.join()
        _wait_equal(cfg, consumer)
    with psycopg.connect(target_db) as conn:
        live = conn.execute("SELECT count(*) FROM public.pgbench_tellers WHERE _wb_snapshot_id IS NULL").fetchone()[0]
    assert live > 0, "no teller row was written by a streamed change after the backfill"


def test_broker_that_lost_everything_during_pgbench_is_recovered(source_db, target_db, private_kafka_broker,
                                                                 topic_prefix, tmp_path, caplog):
    prepare_source(source_db)
    cfg = _config(source_db, target_db, private_kafka_broker.bootstrap, topic_prefix, tmp_path)
    caplog.set_level("INFO", logger="walbridge.consumer")
    load = threading.Thread(target=pgbench, args=(source_db, "-n", "-c", "2", "-T", "40", "-R", "100"),
                            daemon=True)
    with ProducerThread(cfg), ConsumerThread(cfg) as consumer:
        _wait_equal(cfg, consumer)
        load.start()
        wait_for(lambda: _applied(target_db) > 0, timeout=60, what="live changes applied")
        private_kafka_broker.lose_data()  # every topic, record and committed offset is gone
        load.join()
        # The producer re-snapshots into the re-created topics; the consumer
        # follows them from offset 0 and converges by itself: reconcile finds
        # nothing to do.
        _wait_equal(cfg, consumer, timeout=300)
        wait_for(lambda: caught_up(cfg), timeout=120, what="slot confirmed to the last commit")
        before, _ = reconcile(parse_config(cfg), wait=False, on_progress=print)
        assert all(d.ok for d in before), before
    assert not consumer.errors
    assert all(d.ok for d in verify(parse_config(cfg)))
    # The running query saw its topics recreated by their ids and read the new ones from their start.
    assert "the topic was recreated" in caplog.text or "the topic was deleted" in caplog.text


def _backfills(target_db, cfg) -> list[dict]:
    with psycopg.connect(target_db) as conn:
        return read_backfills(conn, cfg["consumer"]["group"])


def _applied(target_db) -> int:
    with psycopg.connect(target_db) as conn:
        return conn.execute("SELECT count(*) FROM public.pgbench_history WHERE _wb_snapshot_id IS NULL").fetchone()[0]


def test_a_failed_query_is_restarted_at_the_targets_progress(source_db, target_db, kafka_broker, topic_prefix,
                                                              tmp_path, monkeypatch, caplog):
    """A micro-batch that fails (here: the first foreachBatch raises) fails the
    query; the consumer restarts it at the target's progress and the target
    still ends equal."""
    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE items (id int PRIMARY KEY, v int)")
        conn.execute("INSERT INTO items SELECT g, g FROM generate_series(1, 2000) g")
    cfg = _config(source_db, target_db, kafka_broker.bootstrap, topic_prefix, tmp_path, [{"table": "public.items"}])
    real_call, failed = BatchApplier.__call__, []

    def flaky(self, batch_df, batch_id):
        if not failed:
            failed.append(batch_id)
            raise RuntimeError("injected failure of the first micro-batch")
        return real_call(self, batch_df, batch_id)

    monkeypatch.setattr(BatchApplier, "__call__", flaky)
    with ProducerThread(cfg), ConsumerThread(cfg) as consumer:
        _wait_equal(cfg, consumer, timeout=180)
        with psycopg.connect(source_db, autocommit=True) as conn:
            conn.execute("UPDATE items SET v = -v WHERE id <= 10")
        _wait_equal(cfg, consumer, timeout=120)
    assert failed and not consumer.errors
    assert "restarting it from the target's progress" in caplog.text
