"""Cost and latency against the number of shapes, for the consumer's one
query over every shape topic.

    flock /tmp/wb-tests.lock .venv/bin/python bench/shapes.py [--counts 5,50,200]

For each shape count N, on a fresh embedded PostgreSQL (durable) and
Apache Kafka broker (topics of ``[kafka] partitions``, default 1):
- N tables ``public.t<i> (id int primary key, v text)`` of ``--rows`` rows
  each (default 1,000), one shape each.
- The producer runs as its own process (``walbridge producer``), the Spark
  consumer ``local[*]`` in this one, both as ``walbridge up`` configures them.
- ``snapshot_applied_s``: from the start of both to every target table
  holding its rows (polled every 0.25 s).
- ``idle_cpu_cores``: after ``--settle`` s, the CPU the consumer (this
  process, its Spark JVM and Python workers; not PostgreSQL, the broker or
  the producer) uses over ``--idle`` s, read from /proc.
- ``insert_visible_s``: one transaction inserting one row into every table,
  from its commit to the last table showing its row (polled every 0.05 s,
  one index probe a table: a poll that counted every table's rows loaded
  the target PostgreSQL by ~0.1 core at 200 shapes, beside the pipeline).
  It includes the producer's first sight of every table since it started
  (pgoutput sends each table's Relation message before its first change:
  catalog lookups, ~4 ms a table).
- ``insert_in_kafka_s``: the same transactions, from the commit to the last
  of their rows in Kafka (as a side consumer, waiting at the broker, receives
  it): the producer's share of ``insert_visible_s``.
- ``insert_again_visible_s``: the median of ``--inserts`` more such
  transactions, 2 s apart (tables known; where a 1 s trigger falls varies).
  ``insert_again_in_kafka_s``: their producer's share, as above.
- ``--master``: the consumer's master (default ``local[*]``, as ``walbridge
  up``). With more than one count, each runs in a process of its own, so
  each gets the Spark JVM a user's consumer of that many shapes starts with
  (its Kafka consumer pool sized for its topic-partitions when the JVM
  starts, and no JIT warmed by another count).
- ``--verbose``: the consumer's log (a line per micro-batch, with its read
  and apply times) on stderr.
Results go to bench/out/shapes.json and are printed; ratios against the
5-shape figures are added when 5 is among the counts.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psycopg
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec
from psycopg import sql

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from schemas.config import parse_config  # noqa: E402
from tests.helpers import write_toml  # noqa: E402
from walbridge.embedded import KafkaBroker, PostgresCluster  # noqa: E402
from walbridge.runtime import consumer_service  # noqa: E402

PREFIX = "shp"
GROUP = "walbridge-spark"
TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, str, float] | None:
    """(parent pid, command name, CPU seconds) of a live process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    comm = text[text.index("(") + 1:text.rindex(")")]
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[1]), comm, (int(fields[11]) + int(fields[12])) / TICK


def consumer_cpu(exclude: set[int]) -> float:
    """CPU seconds of this process and its descendants, but the subtrees of
    ``exclude`` (PostgreSQL, the broker, the producer)."""
    procs = {int(p): s for p in os.listdir("/proc") if p.isdigit() and (s := _stat(int(p))) is not None}
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0.0, [os.getpid()]
    while todo:
        pid = todo.pop()
        if pid in exclude or pid not in procs:
            continue
        if procs[pid][1].startswith("postgres"):
            continue
        total += procs[pid][2]
        todo += children.get(pid, [])
    return total


def counts(conn, n: int) -> list[int]:
    """Rows of every target table (0 for one not created yet)."""
    query = sql.SQL(" UNION ALL ").join(
        sql.SQL("SELECT {i}, count(*) FROM public.{t}").format(i=sql.Literal(i), t=sql.Identifier(f"t{i}"))
        for i in range(n))
    try:
        return [c for _, c in sorted(conn.execute(query).fetchall())]
    except psycopg.errors.UndefinedTable:
        return [0] * n


def holding(conn, n: int, row: int) -> int:
    """How many target tables hold ``row``: one index probe each, so polling
    it every 50 ms does not load the target as counting every table would."""
    query = sql.SQL("SELECT count(*) FROM ({}) AS found").format(sql.SQL(" UNION ALL ").join(
        sql.SQL("(SELECT 1 FROM public.{t} WHERE id = %(row)s)").format(t=sql.Identifier(f"t{i}"))
        for i in range(n)))
    return conn.execute(query, {"row": row}).fetchone()[0]


class SideReader:
    """A consumer of every shape topic from its end, in a thread of its own:
    when (``time.monotonic()``) each row produced since it started arrived.
    A fetch waiting at the broker returns as soon as a row is appended, so an
    arrival is the row's time in Kafka plus one fetch."""

    def __init__(self, bootstrap: str, n: int, partitions: int):
        self.consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "bench-side",
                                  "enable.auto.commit": False})
        tps = [TopicPartition(f"{PREFIX}.public.t{i}", p) for i in range(n) for p in range(partitions)]
        admin = AdminClient({"bootstrap.servers": bootstrap})  # held while its futures are pending
        ends = admin.list_offsets({tp: OffsetSpec.latest() for tp in tps}, request_timeout=60)
        self.consumer.assign([TopicPartition(tp.topic, tp.partition, f.result(timeout=90).offset)
                              for tp, f in ends.items()])
        self.arrivals: list[float] = []
        self._arrived = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            first = self.consumer.poll(0.2)  # consume() would wait out its timeout for a full batch
            if first is None:
                continue
            got = [m for m in [first, *self.consumer.consume(1000, 0)] if m.error() is None]
            if got:
                now = time.monotonic()
                with self._arrived:
                    self.arrivals.extend([now] * len(got))
                    self._arrived.notify_all()

    def arrival(self, count: int, timeout: float = 120.0) -> float:
        """When the ``count``-th row since the start arrived."""
        with self._arrived:
            if not self._arrived.wait_for(lambda: len(self.arrivals) >= count, timeout):
                raise RuntimeError(f"only {len(self.arrivals)} of {count} rows reached Kafka in {timeout} s")
            return self.arrivals[count - 1]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.consumer.close()


def run_one(n: int, rows: int, settle: float, idle: float, inserts: int, master: str = "local[*]") -> dict:
    base = Path(tempfile.mkdtemp(prefix=f"wb-bench-shapes-{n}-"))
    out: dict = {"shapes": n}
    stop = threading.Event()
    failed: list = []
    with PostgresCluster(base / "pg", durable=True) as pg, KafkaBroker(base / "kafka") as broker:
        with psycopg.connect(pg.dsn("postgres"), autocommit=True) as conn:
            conn.execute("CREATE DATABASE app")
            conn.execute("CREATE DATABASE warehouse")
        with psycopg.connect(pg.dsn("app"), autocommit=True) as conn:
            for i in range(n):
                conn.execute(sql.SQL("CREATE TABLE {} (id int PRIMARY KEY, v text)").format(sql.Identifier(f"t{i}")))
                conn.execute(sql.SQL("INSERT INTO {} SELECT g, md5(g::text) FROM generate_series(1, %s) g").format(
                    sql.Identifier(f"t{i}")), (rows,))
        data = {
            "source": {"dsn": pg.dsn("app"), "slot": "walbridge", "publication": "walbridge"},
            "kafka": {"bootstrap_servers": broker.bootstrap, "topic_prefix": PREFIX},
            "shapes": [{"table": f"public.t{i}"} for i in range(n)],
            "consumer": {"group": GROUP, "target_dsn": pg.dsn("warehouse"), "checkpoint_dir": str(base / "cp")},
            "ack": {"consumer_groups": [GROUP], "interval": 0.5},
        }
        path = write_toml(data, base / "wb.toml")
        config = parse_config(data)
        with open(base / "producer.log", "ab") as plog:
            producer = subprocess.Popen([sys.executable, "-m", "walbridge.cli", "producer", "-c", str(path)],
                                        stdout=plog, stderr=subprocess.STDOUT, cwd=ROOT)

        def consume():
            try:
                consumer_service(config, master, stop, [])
            except BaseException as e:  # noqa: BLE001 - reported below
                failed.append(e)

        consumer = threading.Thread(target=consume, daemon=True)
        t0 = time.monotonic()
        consumer.start()
        try:
            with psycopg.connect(pg.dsn("warehouse"), autocommit=True) as conn:
                while min(counts(conn, n)) < rows:
                    if failed or producer.poll() is not None:
                        raise RuntimeError(f"pipeline failed: {failed or producer.returncode}")
                    time.sleep(0.25)
                out["snapshot_applied_s"] = round(time.monotonic() - t0, 1)
                time.sleep(settle)
                exclude = {producer.pid, broker.pid}
                c0, w0 = consumer_cpu(exclude), time.monotonic()
                time.sleep(idle)
                out["idle_cpu_cores"] = round((consumer_cpu(exclude) - c0) / (time.monotonic() - w0), 3)
                visible, in_kafka = [], []
                side = SideReader(broker.bootstrap, n, config.kafka.partitions)
                for row in range(rows + 1, rows + 2 + inserts):
                    with psycopg.connect(pg.dsn("app")) as src:
                        for i in range(n):
                            src.execute(sql.SQL("INSERT INTO {} VALUES (%s, 'new')").format(
                                sql.Identifier(f"t{i}")), (row,))
                        src.commit()
                    committed = time.monotonic()
                    while holding(conn, n, row) < n:
                        if failed:
                            raise RuntimeError(f"pipeline failed: {failed}")
                        time.sleep(0.05)
                    visible.append(round(time.monotonic() - committed, 2))
                    in_kafka.append(round(side.arrival(n * len(visible)) - committed, 2))
                    time.sleep(2)
                side.close()
                out["insert_visible_s"], out["insert_in_kafka_s"] = visible[0], in_kafka[0]
                if inserts:
                    out["insert_again_visible_s"] = statistics.median(visible[1:])
                    out["insert_again_all_s"] = visible[1:]
                    out["insert_again_in_kafka_s"] = statistics.median(in_kafka[1:])
        finally:
            stop.set()
            consumer.join(180)
            producer.terminate()
            producer.wait(60)
    shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(out), flush=True)
    return out


def run_alone(n: int, argv: list[str]) -> dict:
    """One count's figures from a run of this bench in a process of its own,
    with this run's options (``argv``); the count and output given last win."""
    with tempfile.TemporaryDirectory(prefix="wb-bench-shapes-") as tmp:
        out = Path(tmp) / "shapes.json"
        subprocess.run([sys.executable, __file__, *argv, "--counts", str(n), "--out", str(out)], check=True)
        return json.loads(out.read_text())[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--counts", default="5,50,200")
    ap.add_argument("--rows", type=int, default=1000)
    ap.add_argument("--settle", type=float, default=10.0)
    ap.add_argument("--idle", type=float, default=20.0)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "shapes.json")
    ap.add_argument("--inserts", type=int, default=5)
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--master", default="local[*]", help="the consumer's Spark master (local[N]: N task slots)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    if args.verbose:
        logging.getLogger("walbridge.consumer").setLevel(logging.INFO)
    counts = [int(n) for n in args.counts.split(",")]
    if len(counts) == 1:
        results = [run_one(counts[0], args.rows, args.settle, args.idle, args.inserts, args.master)]
    else:
        results = [run_alone(n, sys.argv[1:]) for n in counts]
    ref = next((r for r in results if r["shapes"] == 5), None)
    for r in results:
        if ref is not None:
            r["snapshot_ratio_to_5"] = round(r["snapshot_applied_s"] / ref["snapshot_applied_s"], 2)
            r["visible_ratio_to_5"] = round(r["insert_visible_s"] / ref["insert_visible_s"], 2)
            if "insert_again_visible_s" in r:
                r["again_ratio_to_5"] = round(r["insert_again_visible_s"] / ref["insert_again_visible_s"], 2)
    text = json.dumps(results, indent=2)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
