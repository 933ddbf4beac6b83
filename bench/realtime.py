"""Spark's real-time mode (4.1, ``Trigger.RealTime``) against the micro-batch
trigger walbridge runs, on the Kafka source alone: the floor each engine puts
under commit → visible, before any decode or apply.

    flock /tmp/wb-tests.lock .venv/bin/python bench/realtime.py [--rate 1000] [--partitions 20]
        [--warmup 8] [--duration 30]

- One Apache Kafka broker (embedded), 5 topics of ``--partitions / 5``
  partitions each (the 5-shape pgbench set at 4 partitions is 20). A
  confluent-kafka producer sends ``--rate`` records/s round-robin over them,
  each record's value its send time (``time.time()``, same host clock).
- One SparkSession, ``local[partitions + 2]`` for every run: real-time mode
  keeps one long-running task per source partition and refuses to start with
  fewer task slots; the micro-batch runs get the same slots, so the engines
  differ only in the trigger.
- Runs, one after another on the same broker, each a fresh query from the
  topics' ends:
  - ``micro → kafka``: micro-batch, ``processingTime`` 0.25 s (walbridge's
    default trigger), the rows written to an output topic by Spark's Kafka
    sink (in the JVM);
  - ``real-time → kafka``: the same query under ``Trigger.RealTime("5
    minutes")`` (the duration is the checkpoint interval, not a latency);
  - ``real-time → python foreach``: real-time mode into a Python
    ``ForeachWriter`` (the only sink in the mode's allow-list that runs
    Python code, where walbridge's decode and apply would have to go); a
    row's time is when ``process()`` saw it.
- Latency: a side consumer on the output topic (``linger.ms`` 0 on the sink),
  or ``process()``; records sent in the first ``--warmup`` s are not counted
  (real-time mode takes a few seconds to start its tasks). Records not seen
  within 5 s of the last send count as not seen. CPU over the sending window,
  in cores: the broker, the Spark JVM, Spark's Python workers.

PySpark 4.1 has no ``realTime`` keyword on ``trigger()``; the JVM trigger is
set through the writer's gateway object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient, NewTopic

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.latency import cpu_by_part, pct  # noqa: E402
from spark_consumer.session import spark_session  # noqa: E402
from walbridge.embedded import KafkaBroker  # noqa: E402

TOPICS = [f"rt{i}" for i in range(5)]
RUNS = ("micro → kafka", "real-time → kafka", "real-time → python foreach")


class SeenWriter:
    """Python ForeachWriter: appends (latency, seen at) per row to a file of its
    own per task, flushed per row."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def open(self, partition_id: int, epoch_id: int) -> bool:
        self.file = open(f"{self.out_dir}/{os.getpid()}-{partition_id}-{epoch_id}", "a")  # noqa: SIM115
        return True

    def process(self, row) -> None:
        now = time.time()
        self.file.write(f"{now - float(row.value):.6f} {now:.3f}\n")
        self.file.flush()

    def close(self, error) -> None:
        self.file.close()


def cpu_seconds(broker_pid: int) -> dict[str, float]:
    """The broker's, the Spark JVM's and its Python workers' CPU seconds so
    far (latency.py's split; this bench runs no PostgreSQL and no producer)."""
    parts = cpu_by_part(pg_postmaster=0, broker=broker_pid, producer=0)
    return {k: parts[k] for k in ("broker", "spark_jvm", "spark_python_workers")}


def send(bootstrap: str, rate: int, seconds: float, per_topic: int) -> tuple[float, int]:
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0})
    start, n = time.time(), 0
    while time.time() - start < seconds:
        producer.produce(TOPICS[n % 5], repr(time.time()).encode(), partition=(n // 5) % per_topic)
        producer.poll(0)
        n += 1
        time.sleep(max(0.0, start + n / rate - time.time()))
    producer.flush()
    return start, n


def read_output(bootstrap: str, topic: str, seen: list[tuple[float, float]], stop: threading.Event) -> None:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-{topic}",
                         "auto.offset.reset": "earliest", "fetch.wait.max.ms": 5})
    consumer.subscribe([topic])
    while not stop.is_set():
        msg = consumer.poll(0.05)
        if msg is not None and msg.error() is None:
            now = time.time()
            seen.append((now - float(msg.value()), now))
    consumer.close()


def run(spark, broker: KafkaBroker, admin: AdminClient, base: Path, name: str, args, per_topic: int) -> dict:
    slug = "".join(c if c.isalnum() else "-" for c in name)
    source = (spark.readStream.format("kafka").option("kafka.bootstrap.servers", broker.bootstrap)
              .option("subscribe", ",".join(TOPICS)).option("startingOffsets", "latest").load()
              .selectExpr("CAST(value AS STRING) AS value"))
    writer = source.writeStream.option("checkpointLocation", str(base / f"ckpt-{slug}")).outputMode("update")
    seen: list[tuple[float, float]] = []
    stop = threading.Event()
    out_dir = base / f"seen-{slug}"
    out_dir.mkdir()
    if name.endswith("kafka"):
        out = f"out-{slug}"
        admin.create_topics([NewTopic(out, 1, 1)])[out].result()
        writer = (writer.format("kafka").option("kafka.bootstrap.servers", broker.bootstrap)
                  .option("topic", out).option("kafka.linger.ms", "0"))
        reader = threading.Thread(target=read_output, args=(broker.bootstrap, out, seen, stop), daemon=True)
        reader.start()
    else:
        writer = writer.foreach(SeenWriter(str(out_dir)))
    if name.startswith("real-time"):
        trigger = spark.sparkContext._jvm.org.apache.spark.sql.streaming.Trigger.RealTime("5 minutes")
        writer._jwrite = writer._jwrite.trigger(trigger)
    else:
        writer = writer.trigger(processingTime="0.25 seconds")
    query = writer.start()
    while not query.status["isTriggerActive"] and not query.recentProgress and query.isActive:
        time.sleep(0.2)
    time.sleep(2)  # the query's first plan
    cpu_before = cpu_seconds(broker._proc.pid)
    start, sent = send(broker.bootstrap, args.rate, args.warmup + args.duration, per_topic)
    elapsed = time.time() - start
    cpu = {k: round((v - cpu_before[k]) / elapsed, 2) for k, v in cpu_seconds(broker._proc.pid).items()}
    time.sleep(5)
    stop.set()
    query.stop()
    for path in out_dir.iterdir():
        seen += [tuple(map(float, line.split())) for line in path.read_text().splitlines() if line]
    counted = sorted(lat for lat, at in seen if at - lat >= start + args.warmup)
    expected = sent - int(args.warmup * args.rate)
    per_second = [0] * (int(args.warmup + args.duration) + 6)
    for _lat, at in seen:
        per_second[min(len(per_second) - 1, max(0, int(at - start)))] += 1
    return {"run": name, "sent": sent, "counted": expected, "seen": len(counted),
            "p50_ms": round(1000 * pct(counted, 50), 1) if counted else None,
            "p99_ms": round(1000 * pct(counted, 99), 1) if counted else None,
            "max_ms": round(1000 * counted[-1], 1) if counted else None,
            "cores": cpu, "seen_per_second": per_second}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=int, default=1000)
    ap.add_argument("--partitions", type=int, default=20)
    ap.add_argument("--warmup", type=float, default=8)
    ap.add_argument("--duration", type=float, default=30)
    ap.add_argument("--runs", default=",".join(RUNS), help="comma-separated, of: " + ", ".join(RUNS))
    args = ap.parse_args()
    per_topic = max(1, args.partitions // len(TOPICS))
    partitions = per_topic * len(TOPICS)
    base = Path(tempfile.mkdtemp(prefix="wb-realtime-"))
    results = []
    with KafkaBroker(base / "kafka") as broker:
        admin = AdminClient({"bootstrap.servers": broker.bootstrap})
        for future in admin.create_topics([NewTopic(t, per_topic, 1) for t in TOPICS]).values():
            future.result()
        spark = spark_session(master=f"local[{partitions + 2}]", topic_partitions=partitions)
        try:
            for name in args.runs.split(","):
                result = run(spark, broker, admin, base, name.strip(), args, per_topic)
                print(json.dumps(result, ensure_ascii=False), flush=True)
                results.append(result)
        finally:
            spark.stop()
    print("\n| run | seen / counted | p50 | p99 | max | broker | Spark JVM | Python workers |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        c = r["cores"]
        print(f"| {r['run']} | {r['seen']:,} / {r['counted']:,} | {r['p50_ms']} ms | {r['p99_ms']} ms "
              f"| {r['max_ms']} ms | {c['broker']} | {c['spark_jvm']} | {c['spark_python_workers']} |")


if __name__ == "__main__":
    main()
