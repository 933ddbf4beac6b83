"""Initial snapshot benchmark: walbridge's snapshot rows/s against a plain loop
that COPYs the same table and produces each raw row to Kafka, and against a raw
COPY to nowhere, with the same number of workers, in the same run.

    .venv/bin/python bench/snapshot.py [--scale 10] [--workers 1 2] [--runs 1]

Method (every number is a ratio against a reference measured in this run):
- One embedded PostgreSQL and one Apache Kafka broker; ``pgbench -i -s SCALE``
  (SCALE × 100k ``pgbench_accounts`` rows). Each measurement runs alone.
- walbridge: a producer (a process, ``[ack] consumer_groups = []``, topics of
  4 partitions) with one shape, ``pgbench_accounts``, a new slot and topic
  prefix per run, ``[source] snapshot_workers = W``. Its time is the one it
  logs for the snapshot: from the first COPY to every read and every
  ``snapshot_end`` acknowledged by Kafka (start-up, slot creation and topic
  creation excluded).
- Reference "COPY → Kafka": W threads, each ``COPY`` of its ctid page range
  (the ranges walbridge's workers read), producing each raw COPY row as the
  value, keyed by the row's id, to a 4-partition topic through one
  confluent-kafka producer; timed to the end of ``flush()``: every row
  acknowledged. No Avro, no types. Measured twice: with a delivery callback
  per row (the reference as the goal was set), and reporting failed
  deliveries only, as walbridge's reads do since they stopped paying a report
  per row (like for like: the cost both paid is gone from both).
- Reference "COPY": the same W threads reading their ranges to nowhere.
Reported per W: rows/s of each and the ratios walbridge / COPY → Kafka
(goal ≥ 0.70; ``..._each_report`` against the first form) and walbridge / COPY.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import psycopg
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.producer import ProducerProc, pgbench_init  # noqa: E402
from walbridge.embedded import KafkaBroker, PostgresCluster, find_pg_bin  # noqa: E402

PARTITIONS = 4
SNAPSHOT_DONE = re.compile(r"snapshot \S+ done: (\d+) rows in ([\d.]+)s")


def page_ranges(conn, workers: int) -> list[tuple[int, int] | None]:
    """The ctid page ranges walbridge's snapshot workers read (``snapshot.plan_pieces``)."""
    pages = conn.execute("SELECT pg_relation_size('pgbench_accounts')").fetchone()[0] // 8192
    if workers == 1:
        return [None]
    step = -(-pages // workers)
    bounds = list(range(0, pages, step))
    return [(lo, bounds[i + 1] if i + 1 < len(bounds) else 2**31 - 1) for i, lo in enumerate(bounds)]


def copy_sql(page_range: tuple[int, int] | None) -> str:
    q = "SELECT aid, bid, abalance, filler FROM pgbench_accounts"
    if page_range is not None:
        q += f" WHERE ctid >= '({page_range[0]},0)' AND ctid < '({page_range[1]},0)'"
    return f"COPY ({q}) TO STDOUT"


def in_threads(dsn: str, ranges: list, body) -> float:
    """Runs ``body(conn, copy_sql)`` in one thread per range; seconds until all end."""
    errors: list[BaseException] = []

    def run(page_range) -> None:
        try:
            with psycopg.connect(dsn) as conn:
                body(conn, copy_sql(page_range))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in ranges]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.monotonic() - t0


def copy_to_nowhere(dsn: str, ranges: list) -> tuple[int, float]:
    rows = [0]
    lock = threading.Lock()

    def body(conn, sql: str) -> None:
        n = 0
        with conn.cursor().copy(sql) as copy:
            for _ in copy:
                n += 1
        with lock:
            rows[0] += n

    elapsed = in_threads(dsn, ranges, body)
    return rows[0], elapsed


def copy_to_kafka(dsn: str, bootstrap: str, topic: str, ranges: list, each_report: bool = False) -> tuple[int, float]:
    """(rows, seconds) of the COPY → Kafka loop; ``each_report``: a delivery
    callback per row, else failed deliveries only."""
    failed = []
    rows = [0]
    lock = threading.Lock()

    def delivered(err, msg) -> None:
        if err is not None:
            failed.append(err)

    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 5,
                         "partitioner": "murmur2_random", "delivery.report.only.error": not each_report,
                         "on_delivery": delivered})

    def body(conn, sql: str) -> None:
        n = 0
        produce = producer.produce
        with conn.cursor().copy(sql) as copy:
            for block in copy:
                row = bytes(block)
                while True:
                    try:
                        produce(topic, row, row[:row.index(b"\t")])
                        break
                    except BufferError:
                        producer.poll(0.05)
                n += 1
                if n % 1000 == 0:
                    producer.poll(0)
        with lock:
            rows[0] += n

    t0 = time.monotonic()
    in_threads(dsn, ranges, body)
    left = producer.flush(300)
    elapsed = time.monotonic() - t0
    if left or failed:
        raise RuntimeError(f"reference producer: {left} undelivered, {len(failed)} failed ({failed[:1]})")
    return rows[0], elapsed


def walbridge_snapshot(base: Path, dsn: str, bootstrap: str, workers: int, run: str) -> tuple[int, float, float]:
    """(rows, snapshot seconds as logged, seconds from process start to streaming)."""
    config = base / f"wb-{run}.toml"
    config.write_text(f"""
[source]
dsn = "{dsn}"
slot = "wb_snap_{run}"
publication = "wb_snap"
snapshot_workers = {workers}
[kafka]
bootstrap_servers = "{bootstrap}"
topic_prefix = "snap{run}"
partitions = {PARTITIONS}
[ack]
consumer_groups = []
[[shapes]]
table = "public.pgbench_accounts"
""")
    log = base / f"producer-{run}.log"
    t0 = time.monotonic()
    proc = ProducerProc(config, log)
    try:
        proc.wait_streaming(timeout=900)
        total = time.monotonic() - t0
    finally:
        proc.stop()
    done = SNAPSHOT_DONE.search(log.read_text())
    if done is None:
        raise RuntimeError("no snapshot in the producer's log:\n" + log.read_text()[-3000:])
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_drop_replication_slot(%s)", (f"wb_snap_{run}",))
    return int(done.group(1)), float(done.group(2)), total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", type=int, default=10)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "snapshot.json")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="wb-bench-snapshot-"))
    pg_bin = find_pg_bin()
    results: dict = {"args": vars(args) | {"out": str(args.out)}, "runs": []}
    with PostgresCluster(base / "pg") as pg, KafkaBroker(base / "kafka") as broker:
        dsn = pg.dsn("postgres")
        pgbench_init(pg_bin, dsn, args.scale)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("VACUUM ANALYZE pgbench_accounts")
        admin = AdminClient({"bootstrap.servers": broker.bootstrap})
        for run in range(args.runs):
            for workers in args.workers:
                with psycopg.connect(dsn) as conn:
                    ranges = page_ranges(conn, workers)
                topic = f"ref{run}w{workers}"
                admin.create_topics([NewTopic(topic, PARTITIONS, 1)])[topic].result(30)
                n_copy, t_copy = copy_to_nowhere(dsn, ranges)
                n_ref, t_ref = copy_to_kafka(dsn, broker.bootstrap, topic, ranges)
                n_each, t_each = copy_to_kafka(dsn, broker.bootstrap, topic, ranges, each_report=True)
                n_wb, t_wb, t_total = walbridge_snapshot(base, dsn, broker.bootstrap, workers, f"{run}w{workers}")
                if not n_copy == n_ref == n_each == n_wb:
                    raise RuntimeError(f"row counts differ: COPY {n_copy}, reference {n_ref}, reference with a report per row "
                                       f"{n_each}, walbridge {n_wb}")
                r = {"run": run + 1, "workers": workers, "rows": n_wb,
                     "copy_rows_per_s": round(n_copy / t_copy), "copy_to_kafka_rows_per_s": round(n_ref / t_ref),
                     "walbridge_rows_per_s": round(n_wb / t_wb), "walbridge_snapshot_s": t_wb,
                     "walbridge_process_s": round(t_total, 2),
                     "copy_to_kafka_each_report_rows_per_s": round(n_each / t_each),
                     "walbridge_vs_copy_to_kafka": round(t_ref / t_wb, 3),
                     "walbridge_vs_copy_to_kafka_each_report": round(t_each / t_wb, 3),
                     "walbridge_vs_copy": round(t_copy / t_wb, 3)}
                results["runs"].append(r)
                print(json.dumps(r), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
