"""A consumer group's commit lost after the target applied its batch (the
consumer killed between the two commits) is made at the consumer's next
start, without new data: the producer would otherwise hold that partition's
WAL until a new row reached it (issue 16)."""

from __future__ import annotations

import time

import psycopg

from spark_consumer.group_commits import OffsetCommitter
from tests.helpers import ConsumerThread, ProducerThread, make_config, wait_for
from tests.pipeline import caught_up, pipeline_state, verify_ok


def test_a_group_commit_lost_after_the_apply_is_made_at_the_next_start(source_db, target_db, kafka_broker,
                                                                       topic_prefix, tmp_path, monkeypatch):
    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, v int)")
        conn.execute("INSERT INTO t SELECT g, 0 FROM generate_series(1, 200) g")
    group = f"{topic_prefix}-spark"
    cfg = make_config(source_db, kafka_broker.bootstrap, topic_prefix, [{"table": "public.t"}],
                      consumer={"group": group, "target_dsn": str(target_db),
                                "checkpoint_dir": str(tmp_path / "checkpoints"), "trigger_interval": 0.5},
                      ack={"consumer_groups": [group], "interval": 0.3})
    with ProducerThread(cfg), psycopg.connect(source_db, autocommit=True) as conn:
        with ConsumerThread(cfg) as consumer:
            wait_for(lambda: verify_ok(cfg)[0] and caught_up(cfg), timeout=180, what="snapshot applied",
                     explain=lambda: pipeline_state(cfg))
            with monkeypatch.context() as patch:
                # The group never hears of the next batches: as if killed after each target commit.
                patch.setattr(OffsetCommitter, "_commit", lambda self, *args: None)
                conn.execute("UPDATE t SET v = 1 WHERE id <= 50")
                wait_for(lambda: verify_ok(cfg)[0], timeout=60, what="the update applied",
                         explain=lambda: pipeline_state(cfg))
                consumer.stop.set()
                consumer.thread.join(120)
        assert not consumer.errors
        time.sleep(2.0)  # > [ack] interval: the producer had its chance to confirm
        assert not caught_up(cfg), "WAL confirmed without the group's commit"
        with ConsumerThread(cfg) as restarted:  # no new data: only the start can commit
            wait_for(lambda: caught_up(cfg), timeout=90, what="the slot confirmed after the consumer's restart")
        assert not restarted.errors
