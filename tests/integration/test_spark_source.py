"""The Spark source on real parts: Apache Kafka, the producer's own encoding (or the
real producer), pyspark in local mode.

One Spark session for the module (local[2], small): every test runs its
queries one after the other on it. Spark's Python workers must run this
virtualenv's interpreter, so PYSPARK_PYTHON is set while the session starts
(the data source planner takes it from there, not from spark.pyspark.python).
"""

from __future__ import annotations

import datetime as dt
import sys
import threading
import uuid
from collections import Counter
from decimal import Decimal
from pathlib import Path

import psycopg
import pytest
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from producer.envelope import ShapeCodec, ShapeColumn
from producer.kafka_io import producer_config
from producer.partitioner import partition_for
from producer.pgtypes import PgTypeInfo, column_codec
from producer.topics import describe
from schemas import wire
from schemas.kafka import ensure_topics
from schemas.publisher import SchemaPublisher
from spark_consumer.kafka_source import (
    RAW_SCHEMA,
    SOURCE_NAME,
    ShapeSchemas,
    ShapeTopicDataSource,
    SourceOptions,
    discover_schemas,
    read_dead_letters,
    read_shape_stream,
)
from tests.helpers import ProducerThread, make_config, read_topic, wait_for

WHERE = ["_wb_partition", "_wb_offset"]


@pytest.fixture(scope="module")
def spark():
    from pyspark.sql import SparkSession

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYSPARK_PYTHON", sys.executable)
        session = (SparkSession.builder.master("local[2]").appName("walbridge-spark-source-tests")
                   .config("spark.ui.enabled", "false")
                   .config("spark.sql.shuffle.partitions", "2")
                   .config("spark.sql.streaming.stopTimeout", "30s")
                   .getOrCreate())
    session.sparkContext.setLogLevel("WARN")
    yield session
    session.stop()


# -- a shape topic written with the producer's codec -----------------------------
def _col(name: str, oid: int, type_name: str, typmod: int = -1, key: bool = False) -> ShapeColumn:
    return ShapeColumn(name, column_codec(PgTypeInfo(oid, type_name, oid, type_name, typmod, "b")), key)


class ShapeTopic:
    """``<prefix>.public.t`` (id bigint key, v text, amount numeric(10,2),
    at timestamptz), filled the way the producer fills it: batched, idempotent,
    partitioned by key, schema published first."""

    def __init__(self, bootstrap: str, prefix: str, registry_url: str | None = None, partitions: int = 3):
        self.bootstrap, self.prefix, self.partitions = bootstrap, prefix, partitions
        self.columns = [_col("id", 20, "bigint", key=True), _col("v", 25, "text"),
                        _col("amount", 1700, "numeric(10,2)", ((10 << 16) | 2) + 4),
                        _col("at", 1184, "timestamp with time zone")]
        self.topic = f"{prefix}.public.t"
        admin = AdminClient({"bootstrap.servers": bootstrap})
        ensure_topics(admin, [self.topic], partitions, 1)
        ensure_topics(admin, [prefix + wire.SCHEMAS_TOPIC_SUFFIX], 1, 1)
        self.producer = Producer(producer_config({"bootstrap.servers": bootstrap}))
        self.publisher = SchemaPublisher(self.producer, prefix, {"url": registry_url} if registry_url else None)
        self._new_codec()
        self.lsn = 1000

    def _new_codec(self) -> None:
        self.codec = ShapeCodec("public.t", self.prefix, "db", "public", "t", self.columns,
                                list(range(len(self.columns))))
        self.codec.value_prefix = self.publisher.prefix(self.topic, self.codec.value_schema)
        self.codec.key_prefix = self.publisher.prefix(self.topic, self.codec.key_schema, is_key=True)

    def add_column(self, name: str) -> None:
        """ALTER TABLE ADD COLUMN <name> text: a new writer schema, published."""
        self.columns = self.columns + [_col(name, 25, "text")]
        self._new_codec()

    def row(self, i: int) -> tuple:
        base = (i, f"row {i}", Decimal(i) / 100, dt.datetime(2024, 1, 1, tzinfo=dt.timezone.utc) + dt.timedelta(seconds=i))
        return base + tuple(f"{c.name} {i}" for c in self.columns[4:])

    def _produce(self, partition: int, key: bytes | None, value: bytes | None, headers: list) -> None:
        while True:
            try:
                self.producer.produce(self.topic, value, key, partition=partition, headers=headers)
                return
            except BufferError:
                self.producer.poll(0.05)

    def changes(self, ids, op: str = "c") -> None:
        for i in ids:
            self.lsn += 1
            values = self.row(i)
            key = self.codec.encode_key(self.codec.key_prefix, values)
            envelope = self.codec.envelope(op, values if op == "d" else None, None if op == "d" else values,
                                           self.codec.source(self.lsn, 0, i, 0), 0)
            self._produce(partition_for(key, 0, self.partitions), key,
                          self.codec.encode_value(self.codec.value_prefix, envelope),
                          [(wire.POSITION_HEADER, wire.position_header(self.lsn, 0))])

    def control(self, name: str) -> None:
        for p in range(self.partitions):
            self._produce(p, None, None, [(wire.POSITION_HEADER, wire.position_header(self.lsn, 0)),
                                          (wire.CONTROL_HEADER, name.encode()),
                                          (wire.CONTROL_INFO_HEADER, b"{}")])

    def flush(self) -> None:
        assert self.producer.flush(60) == 0


def all_offsets(bootstrap: str, topic: str, timeout: float = 60) -> Counter:
    """Every (partition, offset) holding a message, read to end-of-partition."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"offsets-{uuid.uuid4().hex}",
                  "enable.auto.commit": False, "enable.partition.eof": True})
    try:
        parts = sorted(c.list_topics(topic, timeout=10).topics[topic].partitions)
        c.assign([TopicPartition(topic, p, 0) for p in parts])
        seen: Counter = Counter()
        done: set[int] = set()
        wait_for(lambda: _drain(c, seen, done) or len(done) == len(parts), timeout=timeout, interval=0,
                 what=f"end of {topic}")
        return seen
    finally:
        c.close()


def _drain(c: Consumer, seen: Counter, done: set) -> None:
    for m in c.consume(10000, 0.5):
        if m.error():
            if m.error().code() == KafkaError._PARTITION_EOF:
                done.add(m.partition())
                continue
            raise RuntimeError(m.error())
        seen[(m.partition(), m.offset())] += 1


# -- running queries -------------------------------------------------------------
def run_available_now(df, checkpoint: Path, columns: list[str], timeout: float = 300) -> list[tuple[int, list]]:
    """(batch id, rows) of every micro-batch of an availableNow run."""
    batches: list[tuple[int, list]] = []

    def sink(batch_df, batch_id):
        batches.append((batch_id, [tuple(r) for r in batch_df.select(*columns).collect()]))

    query = (df.writeStream.foreachBatch(sink).option("checkpointLocation", str(checkpoint))
             .trigger(availableNow=True).start())
    try:
        assert query.awaitTermination(timeout), "the availableNow query did not finish"
    finally:
        if query.isActive:
            query.stop()
    return batches


class RunningQuery:
    """A processingTime query collecting the selected columns of every row."""

    def __init__(self, df, checkpoint: Path, columns: list[str], interval: str = "300 milliseconds"):
        self.rows: list[tuple] = []
        self.batches = 0
        self._lock = threading.Lock()

        def sink(batch_df, batch_id):
            rows = [tuple(r) for r in batch_df.select(*columns).collect()]
            with self._lock:
                self.rows.extend(rows)
                self.batches += 1

        self.query = (df.writeStream.foreachBatch(sink).option("checkpointLocation", str(checkpoint))
                      .trigger(processingTime=interval).start())

    def snapshot(self) -> list[tuple]:
        if self.query.exception() is not None:
            raise AssertionError(f"query failed: {self.query.exception()}")
        with self._lock:
            return list(self.rows)

    def stop(self) -> None:
        self.query.stop()


# -- tests -------------------------------------------------------------------------
def test_every_message_exactly_once_across_limited_batches(spark, kafka_broker, topic_prefix, tmp_path):
    shape = ShapeTopic(kafka_broker.bootstrap, topic_prefix)
    shape.changes(range(3000))
    shape.control("snapshot_end")
    shape.flush()
    expected = all_offsets(kafka_broker.bootstrap, shape.topic)
    assert sum(expected.values()) == 3003

    def stream():
        return read_shape_stream(spark, shape.topic, kafka_broker.bootstrap, topic_prefix, max_offsets_per_trigger=400)

    checkpoint = tmp_path / "ck"
    columns = WHERE + ["id", "v", "amount", "_wb_op", "_wb_lsn", "_wb_control"]
    batches = run_available_now(stream(), checkpoint, columns)
    rows = [r for _, rows in batches for r in rows]
    assert Counter((p, o) for p, o, *_ in rows) == expected  # each message exactly once
    assert len(batches) >= 8 and all(len(b) <= 400 for _, b in batches)
    data = [r for r in rows if r[7] is None]
    assert sorted(r[2] for r in data) == list(range(3000))
    assert all(r[3] == f"row {r[2]}" and r[4] == Decimal(r[2]) / 100 and r[5] == "c" and r[6] == 1001 + r[2]
               for r in data)
    assert Counter(r[7] for r in rows if r[7] is not None) == {"snapshot_end": 3}

    # Restarted on the same checkpoint: nothing again; then only what is new.
    assert sum(len(b) for _, b in run_available_now(stream(), checkpoint, columns)) == 0
    shape.changes(range(3000, 3500))
    shape.flush()
    more = [r for _, b in run_available_now(stream(), checkpoint, columns) for r in b]
    assert Counter((p, o) for p, o, *_ in more) == all_offsets(kafka_broker.bootstrap, shape.topic) - expected
    assert sorted(r[2] for r in more) == list(range(3000, 3500))

    # A batch that was planned but not committed (a crash) is replayed with
    # exactly its recorded range: same messages, nothing more.
    shape.changes(range(3500, 3600))
    shape.flush()
    replay_checkpoint = tmp_path / "ck-replay"
    first = run_available_now(stream(), replay_checkpoint, columns)
    last_id, last = first[-1]
    for name in (str(last_id), f".{last_id}.crc"):  # forget that the last batch was committed
        (replay_checkpoint / "commits" / name).unlink(missing_ok=True)
    replayed = run_available_now(stream(), replay_checkpoint, columns)
    assert replayed[0][0] == last_id and Counter(replayed[0][1]) == Counter(last)
    replayed_rest = [r for _, b in replayed[1:] for r in b]
    assert replayed_rest == []


def test_poison_messages_go_to_the_dlq_and_the_stream_goes_on(spark, kafka_broker, topic_prefix, tmp_path):
    shape = ShapeTopic(kafka_broker.bootstrap, topic_prefix)
    shape.changes(range(300))
    shape.flush()
    query = RunningQuery(read_shape_stream(spark, shape.topic, kafka_broker.bootstrap, topic_prefix,
                                           max_offsets_per_trigger=250),
                         tmp_path / "ck", WHERE + ["id", "_wb_control", "_wb_error"])
    try:
        wait_for(lambda: len(query.snapshot()) == 300, timeout=120, what="the first 300 rows")
        good_value = shape.codec.encode_value(shape.codec.value_prefix, shape.codec.envelope(
            "c", None, shape.row(1), shape.codec.source(1, 0, 1, 0), 0))
        poison = [
            (b"not avro", [("origin", b"plain client")]),
            (wire.single_object_prefix(b"\x07" * 8) + good_value[10:], None),  # unknown schema
            (shape.codec.value_prefix + b"\xff" * 12, None),  # corrupt body
            (None, None),  # a tombstone that is no control event: skipped, as a delete's is
        ]
        plain = Producer({"bootstrap.servers": kafka_broker.bootstrap})
        for value, headers in poison:
            plain.produce(shape.topic, value=value, key=b"k", partition=1, headers=headers)
        assert plain.flush(30) == 0
        shape.changes(range(300, 600))  # the stream goes on behind the poison
        shape.flush()
        expected = all_offsets(kafka_broker.bootstrap, shape.topic)
        assert sum(expected.values()) == 604
        wait_for(lambda: len(query.snapshot()) >= 604, timeout=120, what="every message")
        assert query.query.isActive
        rows = query.snapshot()
    finally:
        query.stop()
    assert Counter((p, o) for p, o, *_ in rows) == expected
    assert sorted(r[2] for r in rows if r[3] is None) == list(range(600))
    dlq_rows = sorted((o, err) for p, o, _, control, err in rows if control == "dlq")
    assert len(dlq_rows) == 3 and all(p == 1 for p, _, _, control, _ in rows if control == "dlq")
    assert "unknown wire prefix" in dlq_rows[0][1] and "fingerprint" in dlq_rows[1][1]
    assert "corrupt Avro body" in dlq_rows[2][1]
    assert [control for _, _, _, control, _ in rows if control not in (None, "dlq")] == ["tombstone"]

    letters = read_dead_letters(kafka_broker.bootstrap, shape.topic)
    assert len(letters) == 3  # the count, readable from anywhere
    assert [(d.origin, d.value) for d in letters] == [
        ((shape.topic, 1, o), v) for (o, _), (v, _) in zip(dlq_rows, poison)]
    # The DLQ keeps every dead letter for good (not compacted: keys repeat).
    settings = describe(AdminClient({"bootstrap.servers": kafka_broker.bootstrap}), [wire.dlq_topic(shape.topic)])
    dlq_settings = settings[wire.dlq_topic(shape.topic)]
    assert {k: dlq_settings.get(k) for k in wire.DLQ_TOPIC_CONFIG} == wire.DLQ_TOPIC_CONFIG
    assert all(d.key == b"k" and d.error for d in letters)
    assert letters[0].headers["origin"] == b"plain client"  # original headers are kept


def test_a_newer_schema_stops_the_stream_and_a_restart_reads_it(spark, kafka_broker, topic_prefix, tmp_path):
    shape = ShapeTopic(kafka_broker.bootstrap, topic_prefix)
    shape.changes(range(100))
    shape.flush()
    checkpoint = tmp_path / "ck"
    query = RunningQuery(read_shape_stream(spark, shape.topic, kafka_broker.bootstrap, topic_prefix),
                         checkpoint, WHERE + ["id"])
    try:
        wait_for(lambda: len(query.snapshot()) == 100, timeout=120, what="the first 100 rows")
        shape.add_column("note")
        shape.changes(range(100, 150))
        shape.flush()
        wait_for(lambda: query.query.exception() is not None, timeout=120, what="the query to stop")
        assert "adds column 'note'" in str(query.query.exception())
        before = list(query.rows)
    finally:
        query.stop()
    assert sorted(i for _, _, i in before) == list(range(100))  # nothing of the new schema was let through

    df = read_shape_stream(spark, shape.topic, kafka_broker.bootstrap, topic_prefix)
    assert df.columns[:5] == ["id", "v", "amount", "at", "note"]
    after = [r for _, b in run_available_now(df, checkpoint, WHERE + ["id", "note"]) for r in b]
    assert Counter((p, o) for p, o, _ in before) + Counter((p, o) for p, o, *_ in after) == \
        all_offsets(kafka_broker.bootstrap, shape.topic)
    assert sorted((i, note) for _, _, i, note in after) == [(i, f"note {i}") for i in range(100, 150)]


def test_real_producer_keyless_update_carries_the_old_row(spark, source_db, kafka_broker, topic_prefix, tmp_path):
    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE log (a int, day date, note text)")
        conn.execute("ALTER TABLE log REPLICA IDENTITY FULL")
        conn.execute("INSERT INTO log VALUES (1, '2024-01-01', 'first')")
    cfg = make_config(source_db, kafka_broker.bootstrap, topic_prefix, [{"table": "public.log"}])
    topic = f"{topic_prefix}.public.log"
    with ProducerThread(cfg):
        wait_for(lambda: len([r for r in read_topic(kafka_broker.bootstrap, topic, topic_prefix)
                              if r.control]) == 3, what="snapshot_end on every partition")
        with psycopg.connect(source_db, autocommit=True) as conn:
            conn.execute("UPDATE log SET day = 'infinity', note = 'second'")
            conn.execute("UPDATE log SET day = '2024-02-02'")
            conn.execute("DELETE FROM log")
        wait_for(lambda: len(read_topic(kafka_broker.bootstrap, topic, topic_prefix)) == 7,
                 what="4 changes and 3 control events")
    df = read_shape_stream(spark, topic, kafka_broker.bootstrap, topic_prefix)
    assert df.schema["a"].metadata["wb.key"] is False
    columns = ["a", "day", "note", "_wb_op", "_wb_lsn", "_wb_special", "_wb_before", "_wb_before_special"]
    rows = [dict(zip(columns, r)) for _, b in run_available_now(df, tmp_path / "ck", columns) for r in b
            if r[3] is not None]
    rows.sort(key=lambda r: r["_wb_lsn"])
    day = dt.date
    assert [(r["_wb_op"], r["a"], r["day"], r["note"]) for r in rows] == [
        ("r", 1, day(2024, 1, 1), "first"), ("u", 1, None, "second"), ("u", 1, day(2024, 2, 2), "second"),
        ("d", 1, day(2024, 2, 2), "second")]
    _, to_infinity, from_infinity, delete = rows
    assert to_infinity["_wb_special"] == {"day": "infinity"}
    assert to_infinity["_wb_before"].asDict() == {"a": 1, "day": day(2024, 1, 1), "note": "first"}
    assert to_infinity["_wb_before_special"] is None
    assert from_infinity["_wb_before"].asDict() == {"a": 1, "day": None, "note": "second"}
    assert from_infinity["_wb_before_special"] == {"day": "infinity"}
    assert delete["_wb_special"] is None
    assert delete["_wb_before"] is None  # a delete's row columns are its old row


TYPED_DDL = """
CREATE TABLE typed (
    id bigint PRIMARY KEY, amount numeric(10,2), day date, at time, local_ts timestamp,
    ts timestamptz, uid uuid, ints int[], body text, raw bytea, "Mixed Case" text
)"""


@pytest.mark.parametrize("registry", [None, "mock://spark-source"])
def test_real_producer_topic_typed_rows(spark, source_db, kafka_broker, topic_prefix, tmp_path, registry):
    registry = f"{registry}-{topic_prefix}" if registry else None
    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute(TYPED_DDL)
        conn.execute("""INSERT INTO typed VALUES (1, 12.30, '2024-02-29', '13:14:15.123456',
            '2024-01-01 10:00:00.5', '2024-01-01 10:00:00.25+03', 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11',
            '{1,NULL,3}', 'héllo', '\\x00ff', 'mc')""")
    kafka = {"schema_registry_url": registry} if registry else {}
    cfg = make_config(source_db, kafka_broker.bootstrap, topic_prefix, [{"table": "public.typed"}], kafka=kafka)
    topic = f"{topic_prefix}.public.typed"
    with ProducerThread(cfg):
        wait_for(lambda: len([r for r in read_topic(kafka_broker.bootstrap, topic, topic_prefix, registry)
                              if r.control]) == 3, what="snapshot_end on every partition")
        with psycopg.connect(source_db, autocommit=True) as conn:
            conn.execute("""INSERT INTO typed VALUES (2, 'NaN', 'infinity', '24:00:00', '-infinity',
                '0044-03-15 BC', NULL, '{{1,2},{3,4}}', NULL, NULL, NULL)""")
            conn.execute("UPDATE typed SET body = 'changed' WHERE id = 1")
            conn.execute("INSERT INTO typed (id) VALUES (3)")
            conn.execute("DELETE FROM typed WHERE id = 3")
            conn.execute("""INSERT INTO typed (id, body)
                SELECT 4, string_agg(md5(random()::text), '') FROM generate_series(1, 300)""")  # TOASTed
            conn.execute("UPDATE typed SET amount = 1 WHERE id = 4")
        wait_for(lambda: len(read_topic(kafka_broker.bootstrap, topic, topic_prefix, registry)) == 11,
                 what="7 changes, the delete's tombstone and 3 control events")

    if registry:
        # A mock:// registry is per process: Spark's Python workers cannot see
        # it. The source itself needs no schema (its rows are the raw
        # messages), but executors given no writer schemas cannot resolve a
        # single id (every message goes to the DLQ). read_shape_stream
        # discovers in this process and hands every version over, which is
        # what makes registry mode work here.
        spark.dataSource.register(ShapeTopicDataSource)
        raw = (spark.readStream.format(SOURCE_NAME).option("topic", topic)
               .option("bootstrap_servers", kafka_broker.bootstrap)
               .option("schema_registry_url", registry).load())
        assert raw.schema == RAW_SCHEMA
        found = discover_schemas(SourceOptions(topic=topic, bootstrap_servers=kafka_broker.bootstrap,
                                               schema_registry_url=registry))
        blind = ShapeSchemas(found.value_schema, found.key_schema, found.known_value_refs, writer_schemas={})
        df = read_shape_stream(spark, topic, kafka_broker.bootstrap, topic_prefix, schema_registry_url=registry,
                               schemas=blind)
        rows = [r for _, b in run_available_now(df, tmp_path / "ck-blind", ["_wb_control", "_wb_error"]) for r in b]
        assert Counter(c for c, _ in rows) == {"dlq": 7, "snapshot_end": 3, "tombstone": 1}
        assert all("mock:// registry lives in one process" in e for c, e in rows if c == "dlq")

    df = read_shape_stream(spark, topic, kafka_broker.bootstrap, topic_prefix, schema_registry_url=registry)
    schema = df.schema
    assert [f.name for f in schema.fields][:11] == ["id", "amount", "day", "at", "local_ts", "ts", "uid", "ints",
                                                    "body", "raw", "Mixed Case"]
    assert schema["id"].metadata["wb.key"] is True and schema["amount"].metadata["pg.type"] == "numeric(10,2)"
    columns = [f.name for f in schema.fields]
    rows = [dict(zip(columns, r)) for _, b in run_available_now(df, tmp_path / "ck", columns) for r in b]
    assert len(rows) == 11
    assert [r["_wb_control"] for r in rows].count("tombstone") == 1
    controls = [r for r in rows if r["_wb_control"] and r["_wb_control"] != "tombstone"]
    assert {r["_wb_control"] for r in controls} == {"snapshot_end"} and len(controls) == 3
    snapshot_id = controls[0]["_wb_snapshot_id"]
    assert snapshot_id and all(r["_wb_snapshot_id"] == snapshot_id and r["id"] is None for r in controls)
    changes = sorted((r for r in rows if not r["_wb_control"]), key=lambda r: (r["_wb_lsn"], r["_wb_op_index"]))
    assert [(r["_wb_op"], r["id"]) for r in changes] == [
        ("r", 1), ("c", 2), ("u", 1), ("c", 3), ("d", 3), ("c", 4), ("u", 4)]
    snap, special, update, _, delete, toasted, toast_update = changes
    assert snap["_wb_snapshot_id"] == snapshot_id
    assert snap["amount"] == Decimal("12.30") and snap["day"] == dt.date(2024, 2, 29)
    assert snap["at"] == "13:14:15.123456" and snap["local_ts"] == dt.datetime(2024, 1, 1, 10, 0, 0, 500000)
    assert snap["ts"].astimezone(dt.timezone.utc) == dt.datetime(2024, 1, 1, 7, 0, 0, 250000, tzinfo=dt.timezone.utc)
    assert snap["uid"] == "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11" and snap["ints"] == [1, None, 3]
    assert snap["body"] == "héllo" and bytes(snap["raw"]) == b"\x00\xff" and snap["Mixed Case"] == "mc"
    assert snap["_wb_special"] is None and snap["_wb_unchanged"] is None
    assert all(special[c] is None for c in ("amount", "day", "at", "local_ts", "ts", "ints"))
    assert special["_wb_special"] == {"amount": "NaN", "day": "infinity", "at": "24:00:00",
                                      "local_ts": "-infinity", "ts": special["_wb_special"]["ts"],
                                      "ints": "{{1,2},{3,4}}"}
    assert special["_wb_special"]["ts"].startswith("0044-03-15") and special["_wb_special"]["ts"].endswith(" BC")
    assert update["body"] == "changed" and update["amount"] == Decimal("12.30")
    assert delete["id"] == 3 and delete["_wb_lsn"] > 0
    assert len(toasted["body"]) == 9600
    assert toast_update["body"] is None and toast_update["_wb_unchanged"] == ["body"]
    assert toast_update["amount"] == Decimal("1.00")
    assert all(r["_wb_topic"] == topic and r["_wb_ts_ms"] for r in changes)
