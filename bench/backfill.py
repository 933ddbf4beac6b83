"""Backfill benchmark: live latency while a big shape is backfilled, against the
live latency just before it, in the same run; and backfill rows/s against a raw
``COPY`` of the same table.

    .venv/bin/python bench/backfill.py [--scale 10] [--rate 100] [--baseline-seconds 20]

Method:
- One embedded PostgreSQL and one Apache Kafka broker; ``pgbench -i -s SCALE``; the
  producer (a process, ``[ack] consumer_groups = []``) publishes every pgbench
  table and takes its initial snapshot before the load starts.
- ``pgbench -R RATE`` runs throughout. A probe consumer tails the
  ``pgbench_history`` topic (one insert per pgbench transaction) and records,
  per message, arrival time minus the source commit time (``source.ts_ms``):
  the live latency through the producer and the broker, as a consumer sees it.
- Phase "before": ``--baseline-seconds`` of load alone. Phase "during": a
  ``walbridge backfill`` of ``pgbench_accounts`` (SCALE × 100k rows) from the
  request until the producer reports it done.
- References for throughput, each on one connection as the backfill reads:
  "COPY → Kafka" (``bench/snapshot.py``'s loop: ``COPY`` the table and produce
  each raw row, acknowledged, failed deliveries reported, no Avro) once before
  the load starts, beside the initial snapshot, and once under the load,
  beside the backfill; and
  ``COPY (SELECT * FROM pgbench_accounts) TO STDOUT`` read by psycopg in this
  process, with the load stopped.
Reported: p50/p95/max latency per phase and their ratios (during / before);
backfill rows/s (from the request to "done" seen by this script; the
producer's own, from starting the backfill to its ``backfill_end`` delivered;
and from its first COPY, as the initial snapshot's time is logged), the
initial snapshot's rows/s (no load), and each against its COPY → Kafka
reference: "the same speed" is the backfill under load keeping the ratio the
snapshot keeps without it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psycopg
from confluent_kafka import OFFSET_END, Consumer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.producer import ProducerProc, pgbench_init, write_config  # noqa: E402
from bench.snapshot import SNAPSHOT_DONE, copy_to_kafka  # noqa: E402
from producer.backfill_requests import read_states, request_backfill  # noqa: E402
from schemas import wire  # noqa: E402
from schemas.config import load_config  # noqa: E402
from schemas.reader import SchemaResolver  # noqa: E402
from walbridge.embedded import KafkaBroker, PostgresCluster, find_pg_bin  # noqa: E402


class LatencyProbe(threading.Thread):
    """Tails a topic from its end; ``samples`` gets (arrival, latency_s)."""

    def __init__(self, bootstrap: str, topic: str, prefix: str):
        super().__init__(daemon=True)
        self.conf = {"bootstrap.servers": bootstrap}
        self.consumer = Consumer({**self.conf, "group.id": f"probe-{time.monotonic_ns()}",
                                  "enable.auto.commit": False, "fetch.wait.max.ms": 10})
        # assign, not subscribe: no group join, tail from now.
        parts = self.consumer.list_topics(topic, timeout=10).topics[topic].partitions
        self.consumer.assign([TopicPartition(topic, p, OFFSET_END) for p in parts])
        self.resolver = SchemaResolver(self.conf, prefix, None)
        self.samples: list[tuple[float, float]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            for msg in self.consumer.consume(500, 0.2):
                if msg.error() or msg.value() is None:
                    continue
                now = time.time()
                value = self.resolver.decode(msg.value())
                if value["source"]["snapshot"] == "false":
                    self.samples.append((now, now - value["source"]["ts_ms"] / 1000))
        self.consumer.close()

    def between(self, t0: float, t1: float) -> list[float]:
        return [lat for at, lat in self.samples if t0 <= at < t1]


def summary(lat: list[float]) -> dict:
    if not lat:
        return {"n": 0}
    q = statistics.quantiles(lat, n=20) if len(lat) >= 20 else [max(lat)] * 19
    return {"n": len(lat), "p50_ms": round(statistics.median(lat) * 1000, 1), "p95_ms": round(q[18] * 1000, 1),
            "max_ms": round(max(lat) * 1000, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", type=int, default=10)
    ap.add_argument("--rate", type=int, default=100, help="pgbench transactions/s during the run")
    ap.add_argument("--baseline-seconds", type=float, default=20)
    ap.add_argument("--chunk-rows", type=int, default=None, help="[backfill] chunk_rows (default: the config's)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "backfill.json")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="wb-bench-backfill-"))
    pg_bin = find_pg_bin()
    tables = ["public.pgbench_accounts", "public.pgbench_branches", "public.pgbench_tellers",
              "public.pgbench_history"]
    results: dict = {"args": vars(args) | {"out": str(args.out)}}
    with PostgresCluster(base / "pg") as pg, KafkaBroker(base / "kafka") as broker:
        dsn = pg.dsn("postgres")
        pgbench_init(pg_bin, dsn, args.scale)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("ALTER TABLE pgbench_history REPLICA IDENTITY FULL")
        config_path = write_config(base / "wb.toml", dsn, broker.bootstrap, tables)
        if args.chunk_rows:
            config_path.write_text(config_path.read_text() + f"\n[backfill]\nchunk_rows = {args.chunk_rows}\n")
        config = load_config(config_path)
        producer = ProducerProc(config_path, base / "producer.log")
        load = None
        try:
            producer.wait_streaming(timeout=900)  # the initial snapshot comes first
            snapshot = SNAPSHOT_DONE.search((base / "producer.log").read_text())
            snapshot_rows, snapshot_s = int(snapshot.group(1)), float(snapshot.group(2))
            admin = AdminClient({"bootstrap.servers": broker.bootstrap})
            for topic in ("ref_idle", "ref_load"):
                admin.create_topics([NewTopic(topic, 4, 1)])[topic].result(30)
            n_idle, t_idle = copy_to_kafka(dsn, broker.bootstrap, "ref_idle", [None])
            snapshot_rate = snapshot_rows / snapshot_s
            results["initial_snapshot"] = {
                "rows": snapshot_rows, "seconds": snapshot_s, "rows_per_s": round(snapshot_rate),
                "copy_to_kafka_rows_per_s": round(n_idle / t_idle),
                "vs_copy_to_kafka": round(snapshot_rate / (n_idle / t_idle), 3)}
            probe = LatencyProbe(broker.bootstrap, "bench.public.pgbench_history", "bench")
            probe.start()
            load = subprocess.Popen([str(pg_bin / "pgbench"), "-n", "-c", "2", "-R", str(args.rate), "-T", "3600",
                                     dsn], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(5)  # warm-up
            t0 = time.time()
            time.sleep(args.baseline_seconds)
            t1 = time.time()
            rid = request_backfill(config, "public.pgbench_accounts", reason="bench")
            conf = {"bootstrap.servers": broker.bootstrap}
            while True:
                state = read_states(conf, wire.backfills_topic("bench"))[0].get(rid, {})
                if state.get("state") == "done":
                    break
                if producer.proc.poll() is not None:
                    raise RuntimeError("producer died:\n" + (base / "producer.log").read_text()[-3000:])
                time.sleep(0.5)
            t2 = time.time()
            n_load, t_load = copy_to_kafka(dsn, broker.bootstrap, "ref_load", [None])  # the same load, probe too
            load.terminate()
            load.wait(30)
            probe.stop.set()
            probe.join(10)
            before, during = probe.between(t0, t1), probe.between(t1, t2)
            rows = state["rows"]
            results["latency_before"] = summary(before)
            results["latency_during_backfill"] = summary(during)
            results["latency_ratio_p50"] = round(statistics.median(during) / statistics.median(before), 2)
            results["latency_ratio_p95"] = round(results["latency_during_backfill"]["p95_ms"]
                                                 / results["latency_before"]["p95_ms"], 2)
            own = state["finished_at"] - state["started_at"]  # the producer's: from its start to backfill_end delivered
            reading = state["finished_at"] - state["reading_since"]  # from its first COPY, as the snapshot's
            reading_rate = rows / reading
            results["backfill"] = {"rows": rows, "seconds": round(t2 - t1, 2), "rows_per_s": round(rows / (t2 - t1)),
                                   "producer_seconds": round(own, 2), "producer_rows_per_s": round(rows / own),
                                   "reading_seconds": round(reading, 2), "reading_rows_per_s": round(reading_rate),
                                   "copy_to_kafka_rows_per_s": round(n_load / t_load),
                                   "vs_copy_to_kafka": round(reading_rate / (n_load / t_load), 3)}
            results["backfill_vs_initial_snapshot"] = round(reading_rate / snapshot_rate, 3)
            with psycopg.connect(dsn) as conn:
                started = time.monotonic()
                n = 0
                with conn.cursor().copy("COPY (SELECT * FROM pgbench_accounts) TO STDOUT") as copy:
                    for _ in copy.rows():
                        n += 1
                copy_s = time.monotonic() - started
            results["copy_reference"] = {"rows": n, "seconds": round(copy_s, 2), "rows_per_s": round(n / copy_s)}
            results["backfill_vs_copy"] = round(results["backfill"]["rows_per_s"] / (n / copy_s), 3)
        finally:
            if load is not None and load.poll() is None:
                load.kill()
            producer.stop()
    print(json.dumps(results, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
