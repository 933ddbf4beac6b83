"""The one query over every shape (``[consumer] queries = "one"``) end to
end on real parts: PostgreSQL → producer → Apache Kafka → Spark (one streaming
query over the pgbench shapes) → target, killed with -9 while Spark has a
batch logged that the target has not committed yet; and a shape whose
target cannot follow held back while the others go on, in the one query and
in the continuous reader (issue 17)."""

from __future__ import annotations

import threading
from pathlib import Path

import psycopg
import pytest

from spark_consumer.checkpoint import batch_ids, topics_batch_unapplied
from spark_consumer.shapes_query import CHECKPOINT_NAME
from tests.helpers import (
    ConsumerProcess,
    ConsumerThread,
    ProducerThread,
    make_config,
    wait_for,
    write_toml,
)
from tests.integration.test_e2e import (
    _applied_batches,
    _caught_up,
    _prepare_source,
    _verify_ok,
    assert_applied_once,
    e2e_config,
    pgbench_until,
)


def _one_query_unapplied(cfg, conn) -> bool:
    """Has Spark logged a batch of the one query that the target lacks?
    (``conn``: an autocommit connection to the target, kept open so that the
    look is quick and the kill after it lands before the window closes.)
    The checkpoint is looked at before the target's progress: progress read
    first could be overtaken by the apply before Spark logs the batch as done,
    and the look would see a window already closed (10 kills missed it in CI)."""
    checkpoint = Path(cfg["consumer"]["checkpoint_dir"]) / CHECKPOINT_NAME
    done = batch_ids(checkpoint / "commits")
    if not done:
        return False
    progress: dict[str, dict[int, int]] = {}
    for topic, partition, nxt in conn.execute("SELECT topic, partition, next_offset FROM _walbridge.progress "
                                              "WHERE consumer_group = %s", (cfg["consumer"]["group"],)):
        progress.setdefault(topic, {})[partition] = nxt
    topics = {f"{cfg['kafka']['topic_prefix']}.{s.get('name') or s['table']}": {} for s in cfg["shapes"]}
    return topics_batch_unapplied(checkpoint, progress, topics) == done[-1]  # not one logged since


def test_one_query_kill9_mid_apply_restarts_equal_and_nothing_applied_twice(source_db, target_db, kafka_broker,
                                                                            topic_prefix, tmp_path):
    _prepare_source(source_db)
    cfg = e2e_config(source_db, target_db, kafka_broker.bootstrap, topic_prefix, tmp_path)
    cfg["consumer"]["queries"] = "one"
    # Per batch, shared by all topics: many batches, so kills land mid-stream, yet the
    # pgbench backlog drains in time (at 5,000 a batch it outran the consumer in CI).
    cfg["consumer"]["max_offsets_per_trigger"] = 20000
    path = write_toml(cfg, tmp_path / "wb.toml")
    log = tmp_path / "consumer.log"
    kills_done = threading.Event()
    loader = threading.Thread(target=pgbench_until, args=(source_db, kills_done), daemon=True)

    with ProducerThread(cfg):
        consumer = ConsumerProcess(path, log).start()
        try:
            wait_for(lambda: _applied_batches(target_db) > 5000, timeout=180, interval=0.5,
                     what="consumer applying")
            loader.start()
            # At least two kills; more (up to 10) until one lands in the window (Spark has the batch as
            # done, the target not yet), which can still close between the look and the kill.
            for kill in range(10):
                with psycopg.connect(target_db, autocommit=True) as look:
                    wait_for(lambda: _one_query_unapplied(cfg, look), timeout=120, interval=0.005,
                             what="a batch logged by Spark, not yet in the target")
                    consumer.kill9()
                started = log.read_text().count("in one query")
                consumer = ConsumerProcess(path, log).start()
                wait_for(lambda: log.read_text().count("in one query") > started, timeout=120,
                         what="the restarted consumer past its recovery")
                if kill >= 1 and "read and applied again" in log.read_text():
                    break
            kills_done.set()
            loader.join(60)
            ok = wait_for(lambda: _verify_ok(cfg)[0], timeout=300, interval=3, what="target == source")
            assert ok, _verify_ok(cfg)[1]
            wait_for(lambda: _caught_up(cfg), timeout=60, what="slot at the last commit")
        finally:
            consumer.stop()
    text = log.read_text()
    assert "in one query" in text and "shapes batch" in text  # the one-query mode ran
    assert "read and applied again" in text  # a kill landed in the window and the batch was replayed
    assert_applied_once(target_db, kafka_broker.bootstrap, topic_prefix)
    with psycopg.connect(target_db) as conn:
        topics = {t for (t,) in conn.execute("SELECT DISTINCT topic FROM _walbridge.progress")}
    assert topics == {f"{topic_prefix}.{s.get('name') or s['table']}" for s in cfg["shapes"]}


def _rows(dsn: str, table: str) -> list[tuple]:
    """(id, v) of every row; [] while the table does not exist yet."""
    with psycopg.connect(dsn) as conn:
        try:
            return conn.execute(f"SELECT id::text, v FROM {table} ORDER BY 1").fetchall()
        except psycopg.errors.UndefinedTable:
            return []


@pytest.mark.parametrize("queries", ["one", "continuous"])
def test_a_shape_that_cannot_follow_is_held_while_the_others_go_on_and_rejoins_at_its_progress(
        source_db, target_db, kafka_broker, topic_prefix, tmp_path, caplog, queries):
    with psycopg.connect(source_db, autocommit=True) as conn:
        for t in ("held", "free"):
            conn.execute(f"CREATE TABLE {t} (id int PRIMARY KEY, v int)")
            conn.execute(f"INSERT INTO {t} SELECT g, g FROM generate_series(1, 50) g")
    with psycopg.connect(target_db, autocommit=True) as conn:
        # A target whose text key holds a value that no integer cast takes.
        conn.execute("CREATE TABLE public.held (id text PRIMARY KEY, v int)")
        conn.execute("INSERT INTO public.held VALUES ('not a number', 0)")
    group = f"{topic_prefix}-spark"
    cfg = make_config(source_db, kafka_broker.bootstrap, topic_prefix,
                      [{"table": "public.held"}, {"table": "public.free"}],
                      consumer={"group": group, "target_dsn": str(target_db), "queries": queries,
                                "checkpoint_dir": str(tmp_path / "checkpoints"), "trigger_interval": 0.5},
                      ack={"consumer_groups": [group], "interval": 0.5})
    caplog.set_level("INFO", logger="walbridge.consumer")
    with ProducerThread(cfg):
        with ConsumerThread(cfg) as consumer:
            wait_for(lambda: len(_rows(str(target_db), "public.free")) == 50 or consumer.errors, timeout=180,
                     what="the free shape applied")
            with psycopg.connect(source_db, autocommit=True) as conn:
                conn.execute("INSERT INTO held VALUES (51, 51)")
                conn.execute("INSERT INTO free VALUES (51, 51)")
            wait_for(lambda: len(_rows(str(target_db), "public.free")) == 51 or consumer.errors, timeout=60,
                     what="the free shape goes on")
            assert not consumer.errors, consumer.errors
            assert _rows(str(target_db), "public.held") == [("not a number", 0)]  # untouched, nothing lost
        messages = [r.getMessage() for r in caplog.records]
        assert any("shape public.held stopped" in m and "key column 'id'" in m for m in messages), messages[-20:]
        # The operator repairs the target; at the next start the shape rejoins where its progress is.
        with psycopg.connect(target_db, autocommit=True) as conn:
            conn.execute("DELETE FROM public.held")
        with ConsumerThread(cfg) as consumer:
            wait_for(lambda: len(_rows(str(target_db), "public.held")) == 51 or consumer.errors, timeout=180,
                     what="the held shape caught up")
            assert not consumer.errors, consumer.errors
    assert _rows(str(target_db), "public.held") == _rows(source_db, "held")
    assert _rows(str(target_db), "public.free") == _rows(source_db, "free")
