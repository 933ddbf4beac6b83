"""Consumer benchmark: end-to-end apply rows/s (topic → target committed) against
references measured in the same run on the same rows.

    .venv/bin/python bench/consumer.py [--rows 300000] [--batch 50000]

- The producer fills one shape topic (snapshot of ``--rows`` rows, Avro,
  registry-less) on an embedded Apache Kafka broker, then stops.
- (a) reference, the issue's plain loop: confluent-kafka + fastavro + ``COPY``
  without Spark, one thread: it reads and decodes the same topic and COPYs each
  ``--batch`` rows' ``after`` images into a plain table of the same target,
  one transaction each. Its read-and-decode alone (no ``COPY``) is reported
  beside it as (a') (the stricter bar the earlier tables use).
- (b) reference: raw ``COPY`` of the same rows into a plain table in the same
  target database.
- walbridge: the Spark consumer (local[*]) applies the topic to the target with
  ``max_offsets_per_trigger = --batch``. It is measured once warm: from the
  commit of micro-batch ``--warmup-batches`` (counted from 1) to the commit of
  the last (rows applied in between / time). JVM start-up, the first batch's
  planning and the JIT's first compilations (the first batches take up to 1.5x
  as long as later ones) are excluded; the cold total is reported too.
- The plain loop runs twice and the faster run is the reference (it varies by
  up to 30% between runs on this machine; the faster one is the harder bar).
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import operator
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import psycopg
from confluent_kafka import Consumer, KafkaError, TopicPartition
from fastavro import schemaless_reader

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from producer.pipeline import run_producer  # noqa: E402
from schemas import wire  # noqa: E402
from schemas.config import parse_config  # noqa: E402
from schemas.reader import SchemaResolver  # noqa: E402
from spark_consumer.supervisor import run  # noqa: E402
from walbridge.embedded import KafkaBroker, PostgresCluster  # noqa: E402

TOPIC = "bench.public.bench_rows"
COLUMNS = "id int PRIMARY KEY, a int, b text, c numeric(12,2), d timestamptz"
NAMES = ("id", "a", "b", "c", "d")


def plain_loop(bootstrap: str, topic: str, prefix: str, expected: int, target_dsn: str | None = None,
               batch: int = 50_000) -> float:
    """Seconds the plain loop takes over the topic; with ``target_dsn``, each
    ``batch`` decoded rows are COPYed into ``plain_rows`` there and committed."""
    conf = {"bootstrap.servers": bootstrap}
    resolver = SchemaResolver(conf, prefix)
    c = Consumer({**conf, "group.id": f"bench-plain-{time.monotonic_ns()}", "enable.partition.eof": True,
                  "auto.offset.reset": "earliest"})
    parts = c.list_topics(topic).topics[topic].partitions
    c.assign([TopicPartition(topic, p, 0) for p in parts])
    target = None
    if target_dsn:
        target = psycopg.connect(target_dsn)
        target.execute("DROP TABLE IF EXISTS plain_rows")
        target.execute(f"CREATE TABLE plain_rows ({COLUMNS})")
        target.commit()
    rows: list = []
    after_values = operator.itemgetter(*NAMES)  # the image holds walbridge's own fields too

    def flush() -> None:
        with target.cursor().copy("COPY plain_rows FROM STDIN") as into:
            for row in rows:
                into.write_row(row)
        target.commit()
        rows.clear()

    n = eof = 0
    t0 = time.monotonic()
    while eof < len(parts):
        for msg in c.consume(1000, 1.0):
            if msg.error():
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    eof += 1
                continue
            value = msg.value()
            if value is None:
                continue
            ref = wire.parse_prefix(value)
            record = schemaless_reader(io.BytesIO(value[ref.body_offset:]), resolver.writer_schema(ref), None)
            n += 1
            if target is not None:
                rows.append(after_values(record["after"]))
                if len(rows) >= batch:
                    flush()
    if target is not None:
        if rows:
            flush()
        copied = target.execute("SELECT count(*) FROM plain_rows").fetchone()[0]
        target.close()
        assert copied == expected, (copied, expected)
    elapsed = time.monotonic() - t0
    c.close()
    assert n == expected, (n, expected)
    return elapsed


def raw_copy(source_dsn: str, target_dsn: str) -> float:
    with psycopg.connect(target_dsn, autocommit=True) as t:
        t.execute("DROP TABLE IF EXISTS bench_copy")
        t.execute(f"CREATE TABLE bench_copy ({COLUMNS})")
    buf = io.BytesIO()
    with psycopg.connect(source_dsn) as s, s.cursor().copy("COPY bench_rows TO STDOUT") as out:
        for block in out:
            buf.write(block)
    data = buf.getvalue()
    t0 = time.monotonic()
    with psycopg.connect(target_dsn, autocommit=True) as t, t.cursor().copy("COPY bench_copy FROM STDIN") as into:
        into.write(data)
    return time.monotonic() - t0


def make_source(dsn: str, rows: int) -> None:
    """The benchmark's table: ``rows`` rows of an int key, int, text, numeric(12,2), timestamptz."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE bench_rows ({COLUMNS})")
        conn.execute(f"INSERT INTO bench_rows SELECT g, g, md5(g::text), g / 7.0, now()"
                     f" FROM generate_series(1, {rows}) g")


def bench_config(source_dsn: str, bootstrap: str, consumer: dict, partitions: int | None = None) -> dict:
    return {
        "source": {"dsn": source_dsn, "slot": "bench", "publication": "bench"},
        "kafka": {"bootstrap_servers": bootstrap, "topic_prefix": "bench",
                  **({"partitions": partitions} if partitions is not None else {})},
        "shapes": [{"table": "public.bench_rows"}],
        "consumer": consumer,
        "ack": {"consumer_groups": []},
    }


def fill_topic(config) -> None:
    """The producer snapshots the table into its shape topic (:data:`TOPIC`), then stops."""
    stop = threading.Event()
    views: dict = {}
    producer = threading.Thread(target=run_producer, args=(config, stop, lambda v: views.update(v)))
    producer.start()
    while not (views.get("snapshot") or {}).get("done"):
        time.sleep(0.2)
    stop.set()
    producer.join()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=300_000)
    ap.add_argument("--batch", type=int, default=50_000)
    ap.add_argument("--warmup-batches", type=int, default=2,
                    help="micro-batches before the warm measurement starts (at least 1)")
    ap.add_argument("--verbose", action="store_true", help="the consumer's log (a line per batch: read and apply)")
    ap.add_argument("--partitions", type=int, default=None, help="override [kafka] partitions")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "consumer.json")
    args = ap.parse_args()
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        logging.getLogger("py4j").setLevel(logging.WARNING)
    base = Path(tempfile.mkdtemp(prefix="wb-bench-consumer-"))
    results: dict = {"rows": args.rows, "batch": args.batch, "warmup_batches": args.warmup_batches}
    with PostgresCluster(base / "pg") as pg, KafkaBroker(base / "kafka") as broker:
        with psycopg.connect(pg.dsn("postgres"), autocommit=True) as conn:
            conn.execute("CREATE DATABASE target")
        make_source(pg.dsn("postgres"), args.rows)
        config = parse_config(bench_config(pg.dsn("postgres"), broker.bootstrap, {
            "group": "bench-spark", "target_dsn": pg.dsn("target"), "checkpoint_dir": str(base / "checkpoints"),
            "max_offsets_per_trigger": args.batch}, args.partitions))
        fill_topic(config)
        topic = TOPIC

        t_read = min(plain_loop(broker.bootstrap, topic, "bench", args.rows) for _ in range(2))
        t_plain = min(plain_loop(broker.bootstrap, topic, "bench", args.rows, pg.dsn("target"), args.batch)
                      for _ in range(2))
        t_copy = raw_copy(pg.dsn("postgres"), pg.dsn("target"))
        results["plain_loop_rows_per_s"] = round(args.rows / t_plain)
        results["plain_read_decode_rows_per_s"] = round(args.rows / t_read)
        results["raw_copy_rows_per_s"] = round(args.rows / t_copy)
        print(json.dumps(results), flush=True)

        appliers: list = []
        stop = threading.Event()
        marks: list[tuple[float, int]] = []
        t0 = time.monotonic()
        consumer = threading.Thread(target=run, args=(config, "local[*]", stop, appliers))
        consumer.start()
        total = args.rows + config.kafka.partitions  # + the snapshot_end control event on each partition
        while True:
            rows = sum(a.rows for a in appliers)
            if not marks or rows != marks[-1][1]:
                marks.append((time.monotonic(), rows))
            if rows >= total:
                break
            if not consumer.is_alive():
                raise RuntimeError("consumer stopped")
            time.sleep(0.05)
        cold = time.monotonic() - t0
        stop.set()
        consumer.join(60)
        warm_from = min(max(args.warmup_batches, 1), args.rows // args.batch) * args.batch
        first = next(m for m in marks if m[1] >= max(warm_from, 1))
        warm_rows = total - first[1]
        warm_s = marks[-1][0] - first[0]
        results.update({
            "walbridge_cold_total_s": round(cold, 2),
            "walbridge_warm_rows_per_s": round(warm_rows / warm_s) if warm_s > 0 else None,
            "walbridge_batches": sum(a.batches for a in appliers),
        })
        results["ratio_vs_plain_loop"] = round(results["walbridge_warm_rows_per_s"] / results["plain_loop_rows_per_s"], 3)
        results["ratio_vs_plain_read_decode"] = round(
            results["walbridge_warm_rows_per_s"] / results["plain_read_decode_rows_per_s"], 3)
        results["ratio_vs_raw_copy"] = round(results["walbridge_warm_rows_per_s"] / results["raw_copy_rows_per_s"], 3)
        with psycopg.connect(pg.dsn("target")) as conn:
            assert conn.execute("SELECT count(*) FROM public.bench_rows").fetchone()[0] == args.rows
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
