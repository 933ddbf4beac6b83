"""End-to-end latency: source commit → row visible in the target, under load.

    flock /tmp/wb-tests.lock .venv/bin/python bench/latency.py [--rate 1000] [--warmup 20] [--duration 60]

- The embedded default config as ``walbridge up`` runs it (durable local
  PostgreSQL, Apache Kafka broker, 4 partitions, producer and consumer in one
  process, the consumer's continuous reader (``--queries`` picks a Spark
  mode instead, ``local[*]``), WAL released on the consumer group's commits,
  ``[consumer]`` defaults unless ``--trigger-interval`` overrides them), on the
  4 pgbench tpcb shapes plus ``public.tick`` (``id``, ``at timestamptz default
  clock_timestamp()``).
- Once the snapshot is applied, ``pgbench -R --rate`` runs tpcb and a thread
  inserts one tick every ``--tick-every`` s (autocommit: its commit follows
  ``at`` by well under a millisecond). Ticks inserted during the first
  ``--warmup`` s are not counted; then ``--duration`` s are measured.
- Visibility: a thread polls the target's ``public.tick`` every
  ``--poll-ms`` for ids it has not seen yet (below the highest seen too:
  ticks of different partitions can become visible out of order; until
  2026-11-25 the poll missed those, ~3 % of ticks and the slowest of them,
  so earlier p99 figures read low); a row's latency is the wall clock
  when the poll returned it minus its ``at`` (same host clock). The poll adds
  up to ``--poll-ms`` to each figure; a target column default set on apply
  would measure the apply transaction's statement, not its commit, so it is
  not used.
- Breakdown per tick: commit → produced to Kafka (the message's CreateTime,
  stamped by librdkafka when the producer hands the row over, read by a side
  consumer) and Kafka → visible. Per micro-batch of the tick shape: Spark's
  progress (``durationMs``: latestOffset, queryPlanning, getBatch, addBatch,
  walCommit, commitOffsets, triggerExecution) and the gap between batch
  starts; of a round of the continuous reader: its look at the ends and its
  read (the consumer's DEBUG lines), the apply thread's read/apply split. Slot lag is ``pg_current_wal_lsn() - confirmed_flush_lsn``, sampled
  every 0.5 s.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

import psycopg
from confluent_kafka import Consumer, TopicPartition

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from schemas.config import parse_config  # noqa: E402
from schemas.reader import SchemaResolver  # noqa: E402
from spark_consumer.shapes_query import QUERY_NAME  # noqa: E402
from walbridge.embedded import KafkaBroker, PostgresCluster, find_pg_bin  # noqa: E402
from walbridge.runtime import consumer_service, producer_service  # noqa: E402

PREFIX = "lat"
GROUP = "walbridge-spark"
SHAPES = ["public.pgbench_accounts", "public.pgbench_branches", "public.pgbench_tellers",
          "public.pgbench_history", "public.tick"]
TICK_TOPIC = f"{PREFIX}.public.tick"


def pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]


def summary(values: list[float]) -> dict:
    ms = [v * 1000 for v in values]
    return {"n": len(ms), "p50_ms": _r(pct(ms, 50)), "p99_ms": _r(pct(ms, 99)), "max_ms": _r(max(ms, default=None)),
            "mean_ms": _r(statistics.fmean(ms) if ms else None)}


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 1)


class Ticks(threading.Thread):
    """Inserts one tick row every ``every`` s until stopped."""

    def __init__(self, dsn: str, every: float, stop: threading.Event):
        super().__init__(daemon=True)
        self.dsn, self.every, self.stop = dsn, every, stop

    def run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            nxt = time.monotonic()
            while not self.stop.is_set():
                conn.execute("INSERT INTO tick DEFAULT VALUES")
                nxt += self.every
                time.sleep(max(0.0, nxt - time.monotonic()))


class Visible(threading.Thread):
    """Polls the target's tick table; ``seen[id] = (at epoch s, visible epoch s)``."""

    def __init__(self, dsn: str, poll: float, stop: threading.Event):
        super().__init__(daemon=True)
        self.dsn, self.poll, self.stop = dsn, poll, stop
        self.seen: dict[int, tuple[float, float]] = {}

    def run(self) -> None:
        last = 0
        gaps: set[int] = set()  # ids below ``last`` not visible yet: ticks of other partitions may come later
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self.stop.is_set():
                try:
                    rows = conn.execute("SELECT id, extract(epoch FROM at)::float8 FROM public.tick"
                                        " WHERE id > %s OR id = ANY(%s) ORDER BY id", (last, list(gaps))).fetchall()
                except psycopg.errors.UndefinedTable:
                    rows = []
                now = time.time()
                for i, at in rows:
                    self.seen[i] = (at, now)
                    gaps.discard(i)
                    if i > last:
                        gaps.update(range(last + 1, i))
                        last = i
                time.sleep(self.poll)


class Stamps(threading.Thread):
    """Reads the tick topic: ``stamps[id] = Kafka CreateTime (epoch s)``."""

    def __init__(self, bootstrap: str, stop: threading.Event):
        super().__init__(daemon=True)
        self.bootstrap, self.stop = bootstrap, stop
        self.stamps: dict[int, float] = {}

    def run(self) -> None:
        conf = {"bootstrap.servers": self.bootstrap}
        resolver = SchemaResolver(conf, PREFIX)
        c = Consumer({**conf, "group.id": f"bench-lat-{time.monotonic_ns()}", "fetch.wait.max.ms": 10,
                      "auto.offset.reset": "earliest"})
        while not self.stop.is_set() and TICK_TOPIC not in c.list_topics(timeout=5).topics:
            time.sleep(0.2)
        parts = c.list_topics(TICK_TOPIC, timeout=5).topics[TICK_TOPIC].partitions
        c.assign([TopicPartition(TICK_TOPIC, p, 0) for p in parts])
        while not self.stop.is_set():
            for msg in c.consume(100, 0.2):
                if msg.error() or msg.value() is None:
                    continue
                env = resolver.decode(msg.value())
                if isinstance(env, dict) and env.get("after"):
                    self.stamps[env["after"]["id"]] = msg.timestamp()[1] / 1000
        c.close()


class RoundLog:
    """The continuous reader's DEBUG lines: each round's look and read times."""

    LINE = re.compile(r"round (\d+): (\d+) offsets, look ([\d.]+)s, read ([\d.]+)s")

    def __init__(self) -> None:
        self.rounds: list[dict] = []

    def handle(self, record) -> None:
        m = self.LINE.search(record.getMessage())
        if m:
            self.rounds.append({"offsets": int(m[2]), "look_s": float(m[3]), "read_s": float(m[4]),
                                "at": record.created})


class BatchLog:
    """The consumer's per-batch log lines of the tick shape ("read X s, apply Y s")."""

    LINE = re.compile(r"(?:shape public\.tick|shapes) batch (\d+): (\d+) rows .* in ([\d.]+)s \(read ([\d.]+)s, apply ([\d.]+)s\)")

    def __init__(self) -> None:
        self.batches: list[dict] = []

    def handle(self, record) -> None:
        m = self.LINE.search(record.getMessage())
        if m:
            self.batches.append({"batch": int(m[1]), "rows": int(m[2]), "total_s": float(m[3]),
                                 "read_s": float(m[4]), "apply_s": float(m[5]), "at": record.created})


def tick_progress(since: float, query: str) -> list[dict]:
    """Spark's progress of the query reading the tick shape, batches started after ``since`` (epoch s)."""
    from pyspark.sql import SparkSession  # optional Spark extra

    spark = SparkSession.builder.getOrCreate()
    out = []
    for q in spark.streams.active:
        if q.name != query:
            continue
        for p in q.recentProgress:
            start = datetime.fromisoformat(p["timestamp"].replace("Z", "+00:00")).timestamp()
            if start >= since and p.get("numInputRows", 0) > 0:
                out.append({"start": start, "rows": p["numInputRows"], **p["durationMs"]})
    return sorted(out, key=lambda b: b["start"])


def config_data(pg: PostgresCluster, bootstrap: str, base: Path, trigger: float | None, queries: str) -> dict:
    consumer = {"group": GROUP, "target_dsn": pg.dsn("warehouse"), "checkpoint_dir": str(base / "checkpoints"),
                "queries": queries}
    if trigger is not None:
        consumer["trigger_interval"] = trigger
    return {
        "source": {"dsn": pg.dsn("app"), "slot": "walbridge", "publication": "walbridge"},
        "kafka": {"bootstrap_servers": bootstrap, "topic_prefix": PREFIX, "partitions": 4},
        "shapes": [{"table": t} for t in SHAPES],
        "consumer": consumer,
        "ack": {"consumer_groups": [GROUP], "interval": 0.5},  # as walbridge up
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=int, default=1000, help="pgbench tpcb transactions/s (-R)")
    ap.add_argument("--scale", type=int, default=10)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--warmup", type=float, default=20)
    ap.add_argument("--duration", type=float, default=60)
    ap.add_argument("--tick-every", type=float, default=0.02)
    ap.add_argument("--poll-ms", type=float, default=5)
    ap.add_argument("--trigger-interval", type=float, default=None, help="override [consumer] trigger_interval")
    ap.add_argument("--queries", choices=("per_shape", "one", "continuous"), default="continuous",
                    help="[consumer] queries (default: as walbridge up)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "latency.json")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="wb-bench-latency-"))
    logging.basicConfig(level=logging.INFO, filename=str(base / "walbridge.log"),
                        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s")
    batch_log = BatchLog()
    handler = logging.Handler()
    handler.emit = batch_log.handle
    logging.getLogger().addHandler(handler)
    round_log = RoundLog()
    rounds = logging.getLogger("walbridge.consumer.rounds")
    rounds.setLevel(logging.DEBUG)
    rounds.addHandler(logging.Handler())
    rounds.handlers[-1].emit = round_log.handle
    pg_bin = find_pg_bin()
    results: dict = {k: v for k, v in vars(args).items() if k != "out"}
    stop, measuring_stop = threading.Event(), threading.Event()
    with PostgresCluster(base / "pg", durable=True) as pg, KafkaBroker(base / "kafka") as broker:
        with psycopg.connect(pg.dsn("postgres"), autocommit=True) as conn:
            conn.execute("CREATE DATABASE app")
            conn.execute("CREATE DATABASE warehouse")
        subprocess.run([str(pg_bin / "pgbench"), "-i", "-q", "-s", str(args.scale), pg.dsn("app")],
                       check=True, capture_output=True)
        with psycopg.connect(pg.dsn("app"), autocommit=True) as conn:
            conn.execute("ALTER TABLE pgbench_history REPLICA IDENTITY FULL")
            conn.execute("CREATE TABLE tick (id bigserial PRIMARY KEY, at timestamptz NOT NULL DEFAULT clock_timestamp())")
        config = parse_config(config_data(pg, broker.bootstrap, base, args.trigger_interval, args.queries))
        results["trigger_interval"] = config.consumer.trigger_interval
        failed: list = []

        def guard(fn):
            def run():
                try:
                    fn()
                except BaseException as e:  # noqa: BLE001 - reported at the end
                    failed.append(e)
                    stop.set()
            return run

        producer = threading.Thread(target=guard(lambda: producer_service(config, stop, lambda v: None)), daemon=True)
        consumer = threading.Thread(target=guard(lambda: consumer_service(config, "local[*]", stop, [])), daemon=True)
        t0 = time.monotonic()
        producer.start()
        consumer.start()
        accounts = args.scale * 100_000
        with psycopg.connect(pg.dsn("warehouse"), autocommit=True) as conn:
            while True:
                try:
                    if conn.execute("SELECT count(*) FROM public.pgbench_accounts").fetchone()[0] >= accounts:
                        break
                except psycopg.errors.UndefinedTable:
                    pass
                if failed:
                    raise RuntimeError(f"pipeline failed: {failed[0]!r}")
                time.sleep(0.5)
        results["snapshot_applied_s"] = round(time.monotonic() - t0, 1)
        print(json.dumps(results), flush=True)

        visible = Visible(pg.dsn("warehouse"), args.poll_ms / 1000, measuring_stop)
        stamps = Stamps(broker.bootstrap, measuring_stop)
        ticks = Ticks(pg.dsn("app"), args.tick_every, measuring_stop)
        for t in (visible, stamps):
            t.start()
        total = args.warmup + args.duration
        bench = subprocess.Popen([str(pg_bin / "pgbench"), "-n", "-c", str(args.clients), "-j", "2",
                                  "-R", str(args.rate), "-T", str(round(total)), pg.dsn("app")],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        ticks.start()
        start = time.time()
        measure_from = start + args.warmup
        lag_max = 0
        with psycopg.connect(pg.dsn("app"), autocommit=True) as conn:
            while bench.poll() is None:
                if time.time() >= measure_from:
                    lag = conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint"
                                       " FROM pg_replication_slots WHERE slot_name = 'walbridge'").fetchone()[0]
                    lag_max = max(lag_max, lag or 0)
                time.sleep(0.5)
            measure_to = time.time()
            last_tick = conn.execute("SELECT max(id) FROM tick WHERE at <= to_timestamp(%s)",
                                     (measure_to,)).fetchone()[0]
        out, _ = bench.communicate()
        tps = re.search(r"tps = ([\d.]+)", out)
        deadline = time.monotonic() + 60
        while (last_tick not in visible.seen or last_tick not in stamps.stamps) and time.monotonic() < deadline:
            time.sleep(0.1)
        measuring_stop.set()
        progress = [] if args.queries == "continuous" else tick_progress(  # continuous: no Spark query
            measure_from, QUERY_NAME if args.queries == "one" else "walbridge:public.tick")
        stop.set()
        producer.join(60)
        consumer.join(120)
        if failed:
            raise RuntimeError(f"pipeline failed: {failed[0]!r}")

    rows = {i: v for i, v in visible.seen.items() if measure_from <= v[0] <= measure_to}
    expected = [i for i, v in visible.seen.items() if i <= last_tick and v[0] >= measure_from]
    results.update({
        "achieved_tps": float(tps[1]) if tps else None,
        "max_slot_lag_bytes": lag_max,
        "commit_to_visible": summary([vis - at for at, vis in rows.values()]),
        "commit_to_kafka": summary([stamps.stamps[i] - at for i, (at, _) in rows.items() if i in stamps.stamps]),
        "kafka_to_visible": summary([vis - stamps.stamps[i] for i, (_, vis) in rows.items() if i in stamps.stamps]),
        "ticks_missing": last_tick - min(expected, default=last_tick) + 1 - len(expected) if expected else None,
    })
    starts = [b["start"] for b in progress]
    per_batch = {k: summary([b[k] / 1000 for b in progress if k in b])
                 for k in ("triggerExecution", "latestOffset", "queryPlanning", "getBatch", "addBatch",
                           "walCommit", "commitOffsets")}
    per_batch["gap_between_starts"] = summary([b - a for a, b in zip(starts, starts[1:])])
    per_batch["rows_per_batch_mean"] = round(statistics.fmean([b["rows"] for b in progress]), 1) if progress else None
    logged = [b for b in batch_log.batches if b["at"] >= measure_from]
    per_batch["apply_thread"] = {k: summary([b[k] for b in logged]) for k in ("read_s", "apply_s", "total_s")}
    per_batch["apply_thread"]["gap_between_applied"] = summary([b["at"] - a["at"] for a, b in zip(logged, logged[1:])])
    results["tick_batches"] = per_batch
    measured = [r for r in round_log.rounds if r["at"] >= measure_from]
    if measured:  # the continuous reader: where a round's read time goes
        results["rounds"] = {k: summary([r[k] for r in measured]) for k in ("look_s", "read_s")}
        results["rounds"]["offsets_mean"] = round(statistics.fmean([r["offsets"] for r in measured]), 1)
    text = json.dumps(results, indent=2)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
