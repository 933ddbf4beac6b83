"""Spark's Kafka source alone: how long a micro-batch takes to read one new
record from each of many topic-partitions, the consumer's read of an insert
into every table of a many-shape pipeline (``bench/shapes.py``) without the
producer, the decode or the apply.

    flock /tmp/wb-tests.lock .venv/bin/python bench/source_read.py [--topics 200] [--rounds 20]

One embedded Apache Kafka broker, ``--topics`` topics of one partition, and
one streaming query over all of them, made as the consumer makes it (the
session of :func:`spark_consumer.session.spark_session`, the source options
of :func:`schemas.java_client.java_client_options`, its batch coalesced into
as many tasks as the master has slots) on ``--master`` (default
``local[2]``, ``walbridge up`` on this machine). Each round writes one
100-byte record to every topic ``--pause`` s after the previous round was
read (the shapes bench's inserts are 2 s apart); a batch counts its
records. Reported: each round's read (the Spark jobs of the batches its
records fell in), and the median of the rounds after the first five (the
JIT's warm-up).

``--option key=value`` (repeatable) sets a source option after the
consumer's, e.g. ``--option kafka.fetch.max.wait.ms=1``, to compare a
setting in the same session layout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import pyspark.sql.functions as F
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from schemas.java_client import java_client_options  # noqa: E402
from spark_consumer.session import spark_session  # noqa: E402
from walbridge.embedded import KafkaBroker  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--topics", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--pause", type=float, default=0.5, help="seconds between a round's read and the next round")
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--option", action="append", default=[], help="a source option, key=value")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "source_read.json")
    args = ap.parse_args()
    extra = dict(o.split("=", 1) for o in args.option)
    topics = [f"read{i}" for i in range(args.topics)]
    with tempfile.TemporaryDirectory(prefix="wb-bench-read-") as scratch, \
            KafkaBroker(Path(scratch) / "kafka") as broker:
        admin = AdminClient({"bootstrap.servers": broker.bootstrap})
        for future in admin.create_topics([NewTopic(t, 1, 1) for t in topics]).values():
            future.result()
        producer = Producer({"bootstrap.servers": broker.bootstrap, "linger.ms": 5})
        spark = spark_session(args.master, topic_partitions=args.topics)
        slots = spark.sparkContext.defaultParallelism
        batches: list[tuple[float, int]] = []  # (read seconds, records)
        batch_done = threading.Event()

        def read(df, batch_id: int) -> None:
            started = time.monotonic()
            [(records, _)] = df.coalesce(slots).select(F.count("*"), F.sum(F.length("value"))).collect()
            batches.append((time.monotonic() - started, records))
            batch_done.set()

        stream = (spark.readStream.format("kafka").options(**java_client_options(broker.bootstrap, {}))
                  .options(**extra).option("subscribe", ",".join(topics)).option("startingOffsets", "latest"))
        query = stream.load().writeStream.foreachBatch(read).trigger(processingTime="200 milliseconds").start()
        try:
            while query.lastProgress is None:  # the first (empty) batch fixed the starting offsets
                time.sleep(0.1)
            reads = []
            for _ in range(args.rounds):
                time.sleep(args.pause)
                first = len(batches)
                for t in topics:
                    producer.produce(t, b"x" * 100)
                producer.flush()
                # A round's records may land in two batches: its read is theirs.
                while sum(n for _, n in batches[first:]) < args.topics:
                    if not batch_done.wait(60):
                        raise RuntimeError(f"no batch in 60 s; read {batches[first:]}")
                    batch_done.clear()
                reads.append(sum(s for s, _ in batches[first:]))
        finally:
            query.stop()
            spark.stop()
    results = {"topics": args.topics, "master": args.master, "options": extra, "rounds": args.rounds,
               "round_read_s": [round(r, 3) for r in reads],
               "median_read_s": round(statistics.median(reads[5:] or reads), 3)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
