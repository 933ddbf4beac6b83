"""What walbridge relies on from the embedded PostgreSQL and Apache Kafka broker.

Measured facts, Apache Kafka 4.4 (KRaft, one combined node, jvm/pom.xml),
confluent-kafka 2.16 / librdkafka, on a 2-core machine:

* A node formats and starts in ~2 s (JVM), stops (SIGTERM, controlled
  shutdown) in ~0.5 s; ``lose_data()`` (stop, log dirs deleted, formatted again
  with the same cluster id, start) takes ~3 s.
* Watermarks are exact: ListOffsets (``get_watermark_offsets``,
  ``list_offsets``) and Fetch agree on the end offset.
* ``enable.partition.eof``: the EOF event arrives with offset == the end, once
  per partition, again after new records are read, and for empty partitions.
* read_committed hides aborted records; control markers take offsets.
* Offset commits keep their metadata (walbridge's topic id rides there).
* Topic configs are validated (``cleanup.policy=bogus`` is INVALID_CONFIG);
  DescribeConfigs reports every effective value, defaults included.
* The embedded broker does not auto-create topics (as production clusters
  run; walbridge creates its own): producing to a missing topic fails.
* ``lose_data()`` forgets topics, records and committed offsets but keeps the
  cluster id; ``reformat_as_new_cluster()`` changes it.
* PostgreSQL 15 cluster: initdb + start ~0.8 s, restart on an existing
  data dir ~0.15 s. With the default durable=False (synchronous_commit=off)
  a committed transaction is NOT decodable at once: logical decoding only
  reads flushed WAL, which the WAL writer flushes every wal_writer_delay
  (set to 10 ms in that mode; PostgreSQL's 200 ms default gave a 0.2-0.6 s
  lag). Tests must poll for changes, never read once right after COMMIT.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import psycopg
import pytest
from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    ConsumerGroupTopicPartitions,
    KafkaError,
    KafkaException,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic, OffsetSpec

from tests.helpers import wait_for
from walbridge.embedded import KafkaBroker, PostgresCluster


# -- helpers -----------------------------------------------------------------
def _admin(bootstrap: str) -> AdminClient:
    return AdminClient({"bootstrap.servers": bootstrap})


def _create_topic(admin: AdminClient, name: str, partitions: int = 1, config=None) -> None:
    fut = admin.create_topics(
        [NewTopic(name, num_partitions=partitions, replication_factor=1, config=config or {})]
    )[name]
    fut.result(10)


def _idempotent_producer(bootstrap: str, **extra) -> Producer:
    return Producer(
        {
            "bootstrap.servers": bootstrap,
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 10,
            **extra,
        }
    )


def _produce_batches(p: Producer, topic: str, sizes: list[int], partition: int = 0) -> list[int]:
    """One flush per batch, so each size is one produce request/batch."""
    offsets: list[int] = []

    def cb(err, msg):
        assert err is None, err
        offsets.append(msg.offset())

    n = 0
    for size in sizes:
        for _ in range(size):
            p.produce(topic, key=b"k%d" % n, value=b"v%d" % n, partition=partition, on_delivery=cb)
            n += 1
        assert p.flush(15) == 0
    return offsets


def _read_to_eof(c: Consumer, partitions: int = 1, timeout: float = 20) -> tuple[list, dict]:
    """Poll until every assigned partition reported EOF; returns (msgs, eofs)."""
    msgs, eofs = [], {}
    deadline = time.monotonic() + timeout
    while len(eofs) < partitions:
        assert time.monotonic() < deadline, f"no EOF for all partitions: {eofs}"
        m = c.poll(0.5)
        if m is None:
            continue
        if m.error():
            assert m.error().code() == KafkaError._PARTITION_EOF, m.error()
            eofs[m.partition()] = m.offset()
            continue
        msgs.append(m)
    return msgs, eofs


def _consumer(bootstrap: str, group: str, **extra) -> Consumer:
    return Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": group,
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            **extra,
        }
    )


# -- PostgreSQL ----------------------------------------------------------------
def test_pg_logical_slot_with_pgoutput(pg_cluster, source_db):
    with psycopg.connect(source_db.dsn, autocommit=True) as conn:
        assert conn.execute("SHOW wal_level").fetchone()[0] == "logical"
        assert conn.execute("SHOW server_encoding").fetchone()[0] == "UTF8"
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        conn.execute("CREATE PUBLICATION pub FOR TABLE t")
        slot = "s_" + uuid.uuid4().hex[:8]
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
        row = conn.execute(
            "SELECT plugin, slot_type, database FROM pg_replication_slots WHERE slot_name = %s",
            (slot,),
        ).fetchone()
        assert row == ("pgoutput", "logical", source_db.name)
        conn.execute("INSERT INTO t VALUES (1, 'a')")
        # synchronous_commit=off: the commit is decodable once the WAL writer
        # has flushed it (wal_writer_delay=10ms), not at once.
        deadline = time.monotonic() + 5
        while True:
            changes = conn.execute(
                "SELECT data FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, "
                "'proto_version', '1', 'publication_names', 'pub')",
                (slot,),
            ).fetchall()
            if changes or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        kinds = [bytes(d)[:1] for (d,) in changes]
        assert kinds == [b"B", b"R", b"I", b"C"]  # begin, relation, insert, commit
    # teardown drops the database together with this slot


def test_pg_drop_database_with_open_session_and_slot(pg_cluster):
    name = "d_" + uuid.uuid4().hex[:8]
    pg_cluster.create_database(name)
    conn = psycopg.connect(pg_cluster.dsn(name), autocommit=True)
    conn.execute("SELECT pg_create_logical_replication_slot('dropme_' || md5(random()::text), 'pgoutput')")
    pg_cluster.drop_database(name)
    conn.close()
    with psycopg.connect(pg_cluster.dsn(), autocommit=True) as admin:
        assert admin.execute("SELECT count(*) FROM pg_database WHERE datname = %s", (name,)).fetchone()[0] == 0
        assert admin.execute(
            "SELECT count(*) FROM pg_replication_slots WHERE database = %s", (name,)
        ).fetchone()[0] == 0


def test_source_and_target_are_distinct(source_db, target_db):
    assert source_db.name != target_db.name
    for db in (source_db, target_db):
        with psycopg.connect(db.dsn) as conn:
            assert conn.execute("SELECT current_database()").fetchone()[0] == db.name


def test_pg_reuses_existing_data_dir(pg_base_dir: Path):
    tmp_path = pg_base_dir
    with PostgresCluster(tmp_path / "pg") as pg:
        with psycopg.connect(pg.dsn(), autocommit=True) as conn:
            conn.execute("CREATE TABLE kept (x int)")
            conn.execute("INSERT INTO kept VALUES (42)")
            assert conn.execute("SHOW fsync").fetchone()[0] == "off"
        # A session still open at shutdown is closed by the server, which
        # leaves its side half-closed (FIN_WAIT2) until this client closes; the
        # port must still count as ours, as it does for postgres itself.
        lingering = psycopg.connect(pg.dsn(), autocommit=True)
        port = pg.port
    version_mtime = (tmp_path / "pg" / "data" / "PG_VERSION").stat().st_mtime_ns
    again = PostgresCluster(tmp_path / "pg", durable=True)
    assert again.port == port  # remembered from the reused data dir
    lingering.close()
    with again:
        with psycopg.connect(again.dsn()) as conn:
            assert conn.execute("SELECT x FROM kept").fetchone()[0] == 42
            assert conn.execute("SHOW fsync").fetchone()[0] == "on"
            assert conn.execute("SHOW synchronous_commit").fetchone()[0] == "on"
    assert (tmp_path / "pg" / "data" / "PG_VERSION").stat().st_mtime_ns == version_mtime
    assert not again.is_running()
    again.stop()  # idempotent


# -- Kafka: producing and consuming ----------------------------------------------
def test_idempotent_producer_roundtrip_in_order_with_eof(kafka_broker, topic_prefix):
    topic = f"{topic_prefix}.roundtrip"
    _create_topic(_admin(kafka_broker.bootstrap), topic)
    p = _idempotent_producer(kafka_broker.bootstrap)
    offsets = _produce_batches(p, topic, [5, 7, 3])
    assert offsets == list(range(15))

    c = _consumer(kafka_broker.bootstrap, f"{topic_prefix}.g")
    c.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
    msgs, eofs = _read_to_eof(c)
    assert [(m.offset(), m.key(), m.value()) for m in msgs] == [
        (i, b"k%d" % i, b"v%d" % i) for i in range(15)
    ]
    assert eofs == {0: 15}

    # EOF is reported again after further records are read.
    _produce_batches(p, topic, [2])
    more, eofs = _read_to_eof(c)
    assert [m.offset() for m in more] == [15, 16]
    assert eofs == {0: 17}
    c.close()


def test_partition_eof_for_every_partition_including_empty(kafka_broker, topic_prefix):
    topic = f"{topic_prefix}.eof4"
    _create_topic(_admin(kafka_broker.bootstrap), topic, partitions=4)
    p = _idempotent_producer(kafka_broker.bootstrap)
    _produce_batches(p, topic, [3], partition=2)
    c = _consumer(kafka_broker.bootstrap, f"{topic_prefix}.g")
    c.assign([TopicPartition(topic, i, OFFSET_BEGINNING) for i in range(4)])
    msgs, eofs = _read_to_eof(c, partitions=4)
    assert [(m.partition(), m.offset()) for m in msgs] == [(2, 0), (2, 1), (2, 2)]
    assert eofs == {0: 0, 1: 0, 2: 3, 3: 0}
    c.close()


def test_watermarks_from_list_offsets_and_fetch_agree(kafka_broker, topic_prefix):
    topic = f"{topic_prefix}.hw"
    admin = _admin(kafka_broker.bootstrap)
    _create_topic(admin, topic)
    p = _idempotent_producer(kafka_broker.bootstrap)
    _produce_batches(p, topic, [5, 7, 3])  # batches at base offsets 0, 5, 12
    tp = TopicPartition(topic, 0)

    c = _consumer(kafka_broker.bootstrap, f"{topic_prefix}.g")
    assert c.get_watermark_offsets(tp, timeout=10) == (0, 15)
    assert admin.list_offsets({tp: OffsetSpec.latest()})[tp].result(10).offset == 15
    assert admin.list_offsets({tp: OffsetSpec.earliest()})[tp].result(10).offset == 0
    c.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
    msgs, _ = _read_to_eof(c)
    assert len(msgs) == 15
    assert c.get_watermark_offsets(tp, cached=True) == (0, 15)
    c.close()


def test_read_committed_hides_aborted_records(kafka_broker, topic_prefix):
    topic = f"{topic_prefix}.txn"
    _create_topic(_admin(kafka_broker.bootstrap), topic)
    tp_ = Producer({"bootstrap.servers": kafka_broker.bootstrap, "transactional.id": f"{topic_prefix}.tx"})
    tp_.init_transactions(30)
    for value, commit in ((b"committed1", True), (b"aborted", False), (b"committed2", True)):
        tp_.begin_transaction()
        tp_.produce(topic, value=value)
        tp_.flush(10)
        tp_.commit_transaction(10) if commit else tp_.abort_transaction(10)

    c = _consumer(kafka_broker.bootstrap, f"{topic_prefix}.g", **{"isolation.level": "read_committed"})
    c.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
    msgs, _ = _read_to_eof(c)
    assert [(m.offset(), m.value()) for m in msgs] == [(0, b"committed1"), (4, b"committed2")]
    c.close()


def test_bulk_batches_are_delivered(kafka_broker, topic_prefix):
    topic = f"{topic_prefix}.bulk"
    _create_topic(_admin(kafka_broker.bootstrap), topic)
    p = _idempotent_producer(kafka_broker.bootstrap)
    n = 20_000
    for _ in range(n):
        while True:
            try:
                p.produce(topic, value=b"x" * 100)
                break
            except BufferError:
                p.poll(0.05)
        p.poll(0)
    assert p.flush(60) == 0
    assert _consumer(kafka_broker.bootstrap, f"{topic_prefix}.g").get_watermark_offsets(
        TopicPartition(topic, 0), timeout=10) == (0, n)


# -- Kafka: consumer groups -------------------------------------------------------
def test_consumer_group_commit_metadata_and_admin_offsets(kafka_broker, topic_prefix):
    topic = f"{topic_prefix}.grp"
    group = f"{topic_prefix}.g"
    admin = _admin(kafka_broker.bootstrap)
    _create_topic(admin, topic, partitions=4)
    p = _idempotent_producer(kafka_broker.bootstrap)
    for part in range(4):
        _produce_batches(p, topic, [part + 1], partition=part)

    c = _consumer(kafka_broker.bootstrap, group)
    c.subscribe([topic])
    msgs, eofs = _read_to_eof(c, partitions=4, timeout=30)
    assert len(msgs) == 1 + 2 + 3 + 4
    assert eofs == {0: 1, 1: 2, 2: 3, 3: 4}
    c.commit(offsets=[TopicPartition(topic, i, i + 1, metadata=f"m{i}") for i in range(4)], asynchronous=False)
    assert [(t.partition, t.offset, t.metadata)
            for t in c.committed([TopicPartition(topic, i) for i in range(4)], timeout=10)] == [
        (i, i + 1, f"m{i}") for i in range(4)
    ]

    res = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group)])[group].result(10)
    assert sorted((t.topic, t.partition, t.offset) for t in res.topic_partitions) == [
        (topic, i, i + 1) for i in range(4)
    ]
    c.close()

    # A new member of the group resumes from the committed offsets.
    _produce_batches(p, topic, [1], partition=0)
    c2 = _consumer(kafka_broker.bootstrap, group)
    c2.subscribe([topic])
    msgs, _ = _read_to_eof(c2, partitions=4, timeout=30)
    assert [(m.partition(), m.offset()) for m in msgs] == [(0, 1)]
    c2.close()


# -- Kafka: admin --------------------------------------------------------------
def test_create_topics_partitions_and_validated_configs(kafka_broker, topic_prefix):
    admin = _admin(kafka_broker.bootstrap)
    topic = f"{topic_prefix}.compact"
    _create_topic(admin, topic, partitions=4, config={"cleanup.policy": "compact"})
    md = admin.list_topics(topic, timeout=10)
    assert md.topics[topic].error is None
    assert sorted(md.topics[topic].partitions) == [0, 1, 2, 3]

    res = ConfigResource("topic", topic)
    cfg = admin.describe_configs([res])[res].result(10)
    assert cfg["cleanup.policy"].value == "compact"
    assert cfg["retention.ms"].value == "604800000"  # a default, reported too

    with pytest.raises(KafkaException) as e:
        _create_topic(admin, topic, partitions=4)
    assert e.value.args[0].code() == KafkaError.TOPIC_ALREADY_EXISTS

    with pytest.raises(KafkaException) as e:
        _create_topic(admin, f"{topic_prefix}.bogus", config={"cleanup.policy": "bogus"})
    assert e.value.args[0].code() == KafkaError.INVALID_CONFIG


def test_producing_to_a_missing_topic_fails(kafka_broker, topic_prefix):
    topic = f"{topic_prefix}.auto"
    p = _idempotent_producer(kafka_broker.bootstrap, **{"message.timeout.ms": 3000})
    errors: list = []
    p.produce(topic, b"v", on_delivery=lambda err, msg: errors.append(err))
    p.flush(15)
    assert [e.code() for e in errors] == [KafkaError._MSG_TIMED_OUT]  # never "delivered" elsewhere
    assert topic not in _admin(kafka_broker.bootstrap).list_topics(timeout=10).topics


def test_delete_records_moves_the_low_watermark(kafka_broker, topic_prefix):
    admin = _admin(kafka_broker.bootstrap)
    topic = f"{topic_prefix}.dr"
    _create_topic(admin, topic)
    _produce_batches(_idempotent_producer(kafka_broker.bootstrap), topic, [3])
    tp = TopicPartition(topic, 0, 2)
    admin.delete_records([tp])[tp].result(15)
    c = _consumer(kafka_broker.bootstrap, f"{topic_prefix}.g")
    assert c.get_watermark_offsets(TopicPartition(topic, 0), timeout=10) == (2, 3)
    c.close()


# -- Kafka: faults -------------------------------------------------------------
def _cluster_id(bootstrap: str) -> str:
    admin = _admin(bootstrap)  # held until the answer came: a dropped client cancels its requests
    return admin.describe_cluster().result(10).cluster_id


def test_lose_data_forgets_everything_but_the_cluster_id(private_kafka_broker: KafkaBroker, topic_prefix):
    bootstrap = private_kafka_broker.bootstrap
    topic, group = f"{topic_prefix}.lost", f"{topic_prefix}.g"
    _create_topic(_admin(bootstrap), topic)
    _produce_batches(_idempotent_producer(bootstrap), topic, [3])
    c = _consumer(bootstrap, group)
    c.commit(offsets=[TopicPartition(topic, 0, 3)], asynchronous=False)
    c.close()
    cluster_id = _cluster_id(bootstrap)

    private_kafka_broker.lose_data()
    assert private_kafka_broker.bootstrap == bootstrap
    assert _cluster_id(bootstrap) == cluster_id

    admin = _admin(bootstrap)
    assert topic not in admin.list_topics(timeout=10).topics

    # Read as walbridge reads commits (OffsetFetch by a consumer that never
    # joins), not by the admin client: a failed admin request to a group
    # coordinator can abort the process in librdkafka (see schemas.kafka.GroupOffsets).
    reader = _consumer(bootstrap, group)

    def committed() -> list[int] | None:
        try:
            return [t.offset for t in reader.committed([TopicPartition(topic, 0)], timeout=10)]
        except KafkaException:  # the new offsets topic's coordinator still loading
            return None

    assert wait_for(committed, timeout=60, what="the group coordinator") == [-1001]  # no committed offset
    reader.close()

    private_kafka_broker.reformat_as_new_cluster()
    assert _cluster_id(bootstrap) != cluster_id


def test_kill9_keeps_the_data(private_kafka_broker: KafkaBroker, topic_prefix):
    bootstrap = private_kafka_broker.bootstrap
    topic = f"{topic_prefix}.kept"
    _create_topic(_admin(bootstrap), topic)
    _produce_batches(_idempotent_producer(bootstrap), topic, [3])
    private_kafka_broker.kill()
    private_kafka_broker.start()
    c = _consumer(bootstrap, f"{topic_prefix}.g")
    c.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
    msgs, _ = _read_to_eof(c)
    assert [m.value() for m in msgs] == [b"v0", b"v1", b"v2"]
    c.close()
