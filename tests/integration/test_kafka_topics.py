"""Topics as a production Kafka cluster keeps them for years: their settings,
keys on every message a compacted topic gets, Java's partitioner, and restart
recovery that never needs a message retention may delete.

Apache Kafka reports every effective setting (its defaults too): the tests
check the settings walbridge set among them. It rejects a keyless message on a
compacted topic, and the tests check every key themselves as well."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from producer.partitioner import partition_for
from producer.pipeline import Pipeline
from producer.recovery import Checkpoint
from producer.topics import TopicConfigError, describe
from schemas import wire
from schemas.config import parse_config
from schemas.publisher import CONTROL_KEY_SCHEMA
from schemas.reader import SchemaResolver
from tests.helpers import (
    ProducerThread,
    data_records,
    make_config,
    raw_messages,
    read_topic,
    wait_for,
    wait_snapshot_done,
    write_toml,
)

ROOT = Path(__file__).resolve().parents[2]
KEEP = {"cleanup.policy": "compact", "retention.ms": "-1"}


def _create(bootstrap: str, topic: str, partitions: int, config: dict) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})  # alive until the answer came
    admin.create_topics([NewTopic(topic, partitions, 1, config=config)])[topic].result(10)


def test_internal_topics_are_compacted_and_kept_and_an_old_one_is_reported(source_db, kafka_broker, topic_prefix,
                                                                           caplog):
    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    # An existing deployment's status topic, created with the broker's defaults.
    _create(kafka_broker.bootstrap, wire.status_topic(topic_prefix), 1,
            {"cleanup.policy": "delete", "retention.ms": "604800000"})
    cfg = make_config(source_db, kafka_broker.bootstrap, topic_prefix, [{"table": "public.t"}])
    with ProducerThread(cfg):
        wait_snapshot_done(kafka_broker.bootstrap, f"{topic_prefix}.public.t", topic_prefix)
    settings = describe(AdminClient({"bootstrap.servers": kafka_broker.bootstrap}),
                        wire.internal_topics(topic_prefix) + [f"{topic_prefix}.public.t"])
    for topic in (wire.schemas_topic(topic_prefix), wire.backfills_topic(topic_prefix),
                  wire.checkpoint_topic(topic_prefix)):
        assert {k: settings[topic].get(k) for k in KEEP} == KEEP, topic
    data = settings[f"{topic_prefix}.public.t"]
    assert (data["retention.ms"], data["retention.bytes"], data["cleanup.policy"]) == ("-1", "-1", "delete")
    warning = " ".join(r.getMessage() for r in caplog.records if wire.status_topic(topic_prefix) in r.getMessage())
    assert "is not compacted (cleanup.policy=delete)" in warning and "deletes messages after 7 days" in warning
    assert (f"kafka-configs.sh --bootstrap-server {kafka_broker.bootstrap} --alter --entity-type topics "
            f"--entity-name {wire.status_topic(topic_prefix)} --add-config cleanup.policy=compact,retention.ms=-1"
            in warning)


def test_a_data_topic_that_may_delete_unread_changes_is_refused_or_warned(source_db, kafka_broker, topic_prefix,
                                                                          caplog):
    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        conn.execute("CREATE TABLE log (at int, what text)")
    topic = f"{topic_prefix}.public.t"
    _create(kafka_broker.bootstrap, topic, 3, {"retention.ms": "3600000"})
    cfg = make_config(source_db, kafka_broker.bootstrap, topic_prefix, [{"table": "public.t"}])

    def prepare(data: dict) -> None:
        pipeline = Pipeline(parse_config(data))
        try:
            pipeline.prepare()
        finally:
            pipeline.close()

    with pytest.raises(TopicConfigError) as e:
        prepare(cfg)
    assert f"topic {topic} deletes messages after 1 h (retention.ms=3600000)" in str(e.value)
    assert f"--entity-name {topic} --add-config retention.ms=-1,retention.bytes=-1" in str(e.value)
    assert 'on_finite_retention = "warn"' in str(e.value)
    cfg["kafka"]["on_finite_retention"] = "warn"
    prepare(cfg)
    assert "running anyway" in caplog.text
    # A compacted topic rejects messages without a key: a keyless shape on one is refused.
    compact = make_config(source_db, kafka_broker.bootstrap, topic_prefix, [{"table": "public.log"}],
                          source={"keyless_tables": "inserts_only"},
                          kafka={"topic_config": {"cleanup.policy": "compact"}, "on_finite_retention": "warn"})
    with pytest.raises(TopicConfigError, match="compacted, but its shape has no primary key"):
        prepare(compact)


def test_a_compacted_topic_gets_a_key_on_every_message(source_db, kafka_broker, topic_prefix):
    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        conn.execute("INSERT INTO t SELECT g, 'x' FROM generate_series(1, 20) g")
    cfg = make_config(source_db, kafka_broker.bootstrap, topic_prefix, [{"table": "public.t"}],
                      kafka={"topic_config": {"cleanup.policy": "compact"}, "on_finite_retention": "warn"})
    topic = f"{topic_prefix}.public.t"
    with ProducerThread(cfg):
        wait_snapshot_done(kafka_broker.bootstrap, topic, topic_prefix)
        with psycopg.connect(source_db, autocommit=True) as conn:
            conn.execute("UPDATE t SET v = 'y' WHERE id = 1")
            conn.execute("DELETE FROM t WHERE id = 2")
            conn.execute("UPDATE t SET id = 100 WHERE id = 3")  # a primary-key change
            conn.execute("TRUNCATE t")
        wait_for(lambda: sum(r.value is not None and r.value["op"] == "t"
                             for r in read_topic(kafka_broker.bootstrap, topic, topic_prefix)) == 3,
                 what="the truncate on every partition")
    settings = describe(AdminClient({"bootstrap.servers": kafka_broker.bootstrap}), [topic])[topic]
    assert settings["cleanup.policy"] == "compact"
    raw = raw_messages(kafka_broker.bootstrap, topic)
    assert raw and all(m.key() is not None for m in raw)  # Apache Kafka rejects a keyless one here
    records = read_topic(kafka_broker.bootstrap, topic, topic_prefix)
    ends = [r for r in records if r.control == "snapshot_end"]
    snapshot_id = ends[0].headers[wire.SNAPSHOT_HEADER].decode()
    assert all(r.key == {"event": "snapshot_end", "id": snapshot_id} for r in ends)
    resolver = SchemaResolver({"bootstrap.servers": kafka_broker.bootstrap}, topic_prefix)
    assert resolver.raw_schema(next(m.key() for m in raw if wire.header(m.headers(), wire.CONTROL_HEADER))) \
        == CONTROL_KEY_SCHEMA
    # Deletes are followed by their key's tombstone, at their position (the key change's delete too).
    by_partition = {}
    for r in records:
        by_partition.setdefault(r.partition, []).append(r)
    tombstones = [r for r in records if r.value is None and r.control is None]
    assert sorted(r.key["id"] for r in tombstones) == [2, 3]
    for t in tombstones:
        before = by_partition[t.partition][by_partition[t.partition].index(t) - 1]
        assert before.value["op"] == "d" and before.key == t.key and before.position == t.position
    # Debezium's primary-key change headers: the other key, as written.
    moved_out = next(r for r in data_records(records) if r.value["op"] == "d" and r.key == {"id": 3})
    moved_in = next(r for r in data_records(records) if r.value["op"] == "c" and r.key == {"id": 100})
    assert resolver.decode(moved_out.headers[wire.NEW_KEY_HEADER]) == {"id": 100}
    assert resolver.decode(moved_in.headers[wire.OLD_KEY_HEADER]) == {"id": 3}
    assert wire.NEW_KEY_HEADER not in next(r for r in tombstones if r.key == {"id": 2}).headers


def test_partitions_are_those_a_java_client_picks(source_db, kafka_broker, topic_prefix):
    """librdkafka's murmur2_random partitioner (Java's default for keyed
    messages) places our keys, as written, on the partitions we chose."""
    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, name text)")
        conn.execute("INSERT INTO t SELECT g, 'n' || g FROM generate_series(1, 200) g")
    cfg = make_config(source_db, kafka_broker.bootstrap, topic_prefix, [{"table": "public.t"}],
                      kafka={"partitions": 7})
    topic = f"{topic_prefix}.public.t"
    with ProducerThread(cfg):
        wait_snapshot_done(kafka_broker.bootstrap, topic, topic_prefix, partitions=7)
    ours = {m.key(): m.partition() for m in raw_messages(kafka_broker.bootstrap, topic)
            if not wire.header(m.headers(), wire.CONTROL_HEADER)}
    assert len(ours) == 200 and len(set(ours.values())) == 7
    java = Producer({"bootstrap.servers": kafka_broker.bootstrap, "partitioner": "murmur2_random"})
    check = f"{topic_prefix}.java"
    _create(kafka_broker.bootstrap, check, 7, {})
    picked = {}
    for key in ours:
        java.produce(check, b"", key, on_delivery=lambda err, msg: picked.__setitem__(msg.key(), msg.partition()))
    assert java.flush(30) == 0
    assert picked == ours == {k: partition_for(k, 0, 7) for k in ours}


def _checkpoint(bootstrap: str, prefix: str) -> Checkpoint | None:
    found = [Checkpoint.from_json(m.value()) for m in raw_messages(bootstrap, wire.checkpoint_topic(prefix))]
    return found[-1] if found else None


def _slot_exists(dsn: str, slot: str) -> bool:
    with psycopg.connect(dsn) as conn:
        return conn.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone() is not None


def test_restart_after_an_idle_topic_lost_its_data_keeps_the_snapshot_when_every_group_read_it(
        source_db, kafka_broker, topic_prefix, caplog):
    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE busy (id int PRIMARY KEY, v int)")
        conn.execute("CREATE TABLE idle (id int PRIMARY KEY, v int)")
        conn.execute("INSERT INTO busy SELECT g, 0 FROM generate_series(1, 30) g")
        conn.execute("INSERT INTO idle SELECT g, 0 FROM generate_series(1, 5) g")
    group = f"{topic_prefix}-apply"
    cfg = make_config(source_db, kafka_broker.bootstrap, topic_prefix,
                      [{"table": "public.busy"}, {"table": "public.idle"}],
                      ack={"consumer_groups": [group], "interval": 0.2})
    busy, idle = f"{topic_prefix}.public.busy", f"{topic_prefix}.public.idle"
    reader = Consumer({"bootstrap.servers": kafka_broker.bootstrap, "group.id": group, "enable.auto.commit": False})
    with ProducerThread(cfg):
        wait_snapshot_done(kafka_broker.bootstrap, idle, topic_prefix)
        wait_snapshot_done(kafka_broker.bootstrap, busy, topic_prefix)
        # The consumer group reads (and commits) everything there is.
        ends = {(m.topic(), m.partition()): m.offset() + 1 for t in (busy, idle) for m in raw_messages(kafka_broker.bootstrap, t)}
        reader.commit(offsets=[TopicPartition(t, p, o) for (t, p), o in ends.items()], asynchronous=False)
        recorded = wait_for(lambda: (lambda cp: cp if cp and cp.consumed else None)(
            _checkpoint(kafka_broker.bootstrap, topic_prefix)), timeout=30, what="the snapshot recorded as read")
    # Kafka loses the idle topic's data (the topic re-created: new topic id, offsets from 0).
    admin = AdminClient({"bootstrap.servers": kafka_broker.bootstrap})
    admin.delete_topics([idle])[idle].result(10)
    wait_for(lambda: idle not in admin.list_topics(timeout=10).topics, what="topic deleted")
    snapshot_rows = len([r for r in read_topic(kafka_broker.bootstrap, busy, topic_prefix) if r.value
                         and r.value["op"] == "r"])
    caplog.set_level("INFO", logger="walbridge.producer")
    with ProducerThread(cfg):
        with psycopg.connect(source_db, autocommit=True) as conn:
            conn.execute("UPDATE idle SET v = 1 WHERE id = 1")
            conn.execute("UPDATE busy SET v = 1 WHERE id = 1")
        wait_for(lambda: any(r.value and r.value["op"] == "u" for r in read_topic(
            kafka_broker.bootstrap, idle, topic_prefix)), what="the idle table's update in its new topic")
    assert "every consumer group had read them: streaming on" in caplog.text
    assert "redoing the snapshot" not in caplog.text
    assert _checkpoint(kafka_broker.bootstrap, topic_prefix).snapshot_id == recorded.snapshot_id
    assert len([r for r in read_topic(kafka_broker.bootstrap, busy, topic_prefix)
                if r.value and r.value["op"] == "r"]) == snapshot_rows  # no second snapshot
    reader.close()


def test_a_changed_topic_prefix_stops_with_the_explanation_and_keeps_the_slot(source_db, kafka_broker, topic_prefix,
                                                                              tmp_path):
    """Through the real ``walbridge producer``: a permanent source failure
    (exit 3, README "Failures and exit codes"), the slot and its data kept."""
    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        conn.execute("INSERT INTO t VALUES (1, 'a')")
    cfg = make_config(source_db, kafka_broker.bootstrap, topic_prefix, [{"table": "public.t"}])
    slot = cfg["source"]["slot"]
    with ProducerThread(cfg):
        wait_snapshot_done(kafka_broker.bootstrap, f"{topic_prefix}.public.t", topic_prefix)
    moved = write_toml({**cfg, "kafka": {**cfg["kafka"], "topic_prefix": topic_prefix + "x"}}, tmp_path / "wb.toml")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "walbridge", "producer", "-c", str(moved)], cwd=ROOT,
                          capture_output=True, text=True, timeout=90)
    out = done.stdout + done.stderr
    assert done.returncode == 3, out
    assert time.monotonic() - started < 30  # permanent: no retries
    assert "Traceback" not in out
    headline, fix = [ln for ln in out.splitlines() if ln.startswith(("walbridge: ", "  fix: "))]
    assert headline.startswith("walbridge: source postgresql://")
    assert f"slot {slot} streams into the topics of prefix {topic_prefix!r}" in headline
    assert f"topic_prefix = {topic_prefix + 'x'!r}" in headline and "never held this slot's data" in headline
    assert f"set topic_prefix = {topic_prefix!r} again" in fix
    assert f"SELECT pg_drop_replication_slot('{slot}');" in fix and "a full re-snapshot, on purpose" in fix
    assert _slot_exists(source_db, slot)
    topics = AdminClient({"bootstrap.servers": kafka_broker.bootstrap}).list_topics(timeout=10).topics
    assert not [t for t in topics if t.startswith(topic_prefix + "x.")]  # nothing made for the wrong prefix
    # The way back: the old prefix streams on from the same slot, no second snapshot.
    with ProducerThread(cfg):
        with psycopg.connect(source_db, autocommit=True) as conn:
            conn.execute("INSERT INTO t VALUES (2, 'b')")
        wait_for(lambda: len(data_records(read_topic(kafka_broker.bootstrap, f"{topic_prefix}.public.t",
                                                      topic_prefix))) == 2, what="the insert")
