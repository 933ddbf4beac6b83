"""Decoding on the consumer's query, end to end: a table of many types (with
special values, TOASTed and unchanged TOAST columns) reaches the target equal
to the source, written by fingerprint (the ``_schemas`` topic) or by schema id
(a Schema Registry); messages that cannot be decoded go to ``<topic>.dlq``
with their origin, and the query goes on behind them."""

from __future__ import annotations

import psycopg
import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from producer.topics import describe
from schemas import wire
from spark_consumer.dead_letters import read_dead_letters
from tests.helpers import ConsumerThread, ProducerThread, make_config, wait_for
from tests.pipeline import caught_up, pipeline_state, verify_ok

TYPED_DDL = """CREATE TABLE typed (
    id bigint PRIMARY KEY, amount numeric(10,2), day date, at time, local_ts timestamp,
    ts timestamptz, uid uuid, ints int[], body text, raw bytea, "Mixed Case" text
)"""


def _rows(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        try:
            return conn.execute("SELECT count(*) FROM public.typed").fetchone()[0]
        except psycopg.errors.UndefinedTable:
            return 0


@pytest.mark.parametrize("registry", [None, "mock://e2e-decode"])
def test_typed_rows_and_poison_messages_by_fingerprint_or_schema_id(source_db, target_db, kafka_broker, topic_prefix,
                                                                     tmp_path, registry):
    registry = f"{registry}-{topic_prefix}" if registry else None
    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute(TYPED_DDL)
        conn.execute("""INSERT INTO typed VALUES (1, 12.30, '2024-02-29', '13:14:15.123456',
            '2024-01-01 10:00:00.5', '2024-01-01 10:00:00.25+03', 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11',
            '{1,NULL,3}', 'héllo', '\\x00ff', 'mc')""")
    group = f"{topic_prefix}-spark"
    kafka = {"schema_registry_url": registry} if registry else {}
    cfg = make_config(source_db, kafka_broker.bootstrap, topic_prefix, [{"table": "public.typed"}], kafka=kafka,
                      consumer={"group": group, "target_dsn": str(target_db),
                                "checkpoint_dir": str(tmp_path / "checkpoints")},
                      ack={"consumer_groups": [group], "interval": 0.5})
    topic = f"{topic_prefix}.public.typed"
    with ProducerThread(cfg), ConsumerThread(cfg) as consumer:
        wait_for(lambda: _rows(str(target_db)) == 1 or consumer.errors, timeout=180, what="the snapshot applied")
        poison = [(b"not avro", [("origin", b"plain client")]),
                  (wire.single_object_prefix(b"\x07" * 8) + b"\x00" * 20, None),  # a writer schema nobody published
                  (wire.confluent_prefix(987654) + b"\x00" * 20, None)]  # a schema id no registry holds
        plain = Producer({"bootstrap.servers": kafka_broker.bootstrap})
        for value, headers in poison:
            plain.produce(topic, value=value, key=b"k", partition=1, headers=headers)
        assert plain.flush(30) == 0
        with psycopg.connect(source_db, autocommit=True) as conn:  # the stream goes on behind the poison
            conn.execute("""INSERT INTO typed VALUES (2, 'NaN', 'infinity', '24:00:00', '-infinity',
                '0044-03-15 BC', NULL, '{{1,2},{3,4}}', NULL, NULL, NULL)""")
            conn.execute("UPDATE typed SET body = 'changed' WHERE id = 1")
            conn.execute("INSERT INTO typed (id) VALUES (3)")
            conn.execute("DELETE FROM typed WHERE id = 3")
            conn.execute("""INSERT INTO typed (id, body)
                SELECT 4, string_agg(md5(random()::text), '') FROM generate_series(1, 300)""")  # TOASTed
            conn.execute("UPDATE typed SET amount = 1 WHERE id = 4")  # body stays in TOAST: unchanged
        ok = wait_for(lambda: verify_ok(cfg)[0] or consumer.errors, timeout=180, interval=1, what="target == source",
                      explain=lambda: pipeline_state(cfg))
        assert ok is True, [str(e) for e in consumer.errors] or verify_ok(cfg)[1]
        wait_for(lambda: caught_up(cfg), timeout=60, what="the slot confirmed past the poison")
        letters = wait_for(lambda: read_dead_letters(kafka_broker.bootstrap, topic), timeout=60,
                           what="the dead letters")
    assert not consumer.errors
    by_value = {d.value: d for d in letters}  # at-least-once: a retried task may have sent one again
    assert set(by_value) == {v for v, _ in poison}
    assert all(d.origin[:2] == (topic, 1) and d.key == b"k" and d.error for d in letters)
    assert "unknown wire prefix" in by_value[b"not avro"].error
    assert by_value[b"not avro"].headers["origin"] == b"plain client"  # original headers are kept
    # The DLQ keeps every dead letter for good (not compacted: keys repeat).
    settings = describe(AdminClient({"bootstrap.servers": kafka_broker.bootstrap}), [wire.dlq_topic(topic)])
    assert {k: settings[wire.dlq_topic(topic)].get(k) for k in wire.DLQ_TOPIC_CONFIG} == wire.DLQ_TOPIC_CONFIG
    with psycopg.connect(target_db) as conn:
        assert conn.execute("SELECT body FROM public.typed WHERE id = 4").fetchone()[0] is not None
