"""A shape whose target cannot follow its new writer schema is held back
while the others go on in the same query, and rejoins at its target progress
when the consumer next starts (issue 17)."""

from __future__ import annotations

import psycopg

from tests.helpers import ConsumerThread, ProducerThread, make_config, wait_for


def _rows(dsn: str, table: str) -> list[tuple]:
    """(id, v) of every row; [] while the table does not exist yet."""
    with psycopg.connect(dsn) as conn:
        try:
            return conn.execute(f"SELECT id::text, v FROM {table} ORDER BY 1").fetchall()
        except psycopg.errors.UndefinedTable:
            return []


def test_a_shape_that_cannot_follow_is_held_while_the_others_go_on_and_rejoins_at_its_progress(
        source_db, target_db, kafka_broker, topic_prefix, tmp_path, caplog):
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
                      consumer={"group": group, "target_dsn": str(target_db),
                                "checkpoint_dir": str(tmp_path / "checkpoints")},
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
