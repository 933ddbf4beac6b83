"""End-to-end latency: source commit → row visible in the target, under load,
as a user of the default config gets it.

    flock /tmp/wb-tests.lock .venv/bin/python bench/latency.py [--rate 1000] [--warmup 20] [--duration 60]
        [--target postgresql|delta|iceberg] [--partitions N] [--master 'local[4]']

- What ``walbridge up`` runs, on the pgbench shapes: a durable local
  PostgreSQL, an Apache Kafka broker, topics of ``[kafka] partitions``
  (default 1; ``--partitions`` overrides it), WAL released on the
  consumer group's commits; the producer as its own process (``walbridge
  producer``), the Spark consumer (``local[*]``) in this one; every
  ``[consumer]`` setting at its default (``--trigger-interval`` and
  ``--max-offsets`` override them, for experiments). Shapes: the 4 pgbench
  tpcb tables plus ``public.tick`` (``id``, ``at timestamptz default
  clock_timestamp()``).
- Once the snapshot is applied, ``pgbench -c --clients -j 2 -R --rate`` runs
  tpcb at ``--scale`` (default 5, as the issue's harness) and a thread inserts
  one tick every ``--tick-every`` s (autocommit: its commit follows ``at`` by
  well under a millisecond). Ticks inserted during the first ``--warmup`` s
  are not counted; then ``--duration`` s are measured.
- ``--target``: the PostgreSQL target (a ``warehouse`` database on the same
  server), or a Delta folder / an Iceberg Hadoop catalog in the run's scratch
  directory, read back with delta-rs / pyiceberg.
- Visibility: on PostgreSQL, a trigger the bench adds to the target's
  ``public.tick`` notifies each row's id and ``at`` at the apply's commit, and
  a listening connection stamps it on arrival (no polling: a poll every few
  milliseconds cost the shared cores what a user's pipeline does not pay).
  On a lake, a thread polls the table's newest version every ``--poll-ms``
  (50) for ids it has not seen yet (below the highest seen too: ticks of
  different partitions can become visible out of order), which adds up to
  ``--poll-ms`` and a lake read to each figure. A row's latency is the wall
  clock it was stamped visible minus its ``at`` (same host clock).
- Breakdown per tick: commit → produced to Kafka (the message's CreateTime,
  read by a side consumer) and Kafka → visible. Per micro-batch (every
  batch with rows that started in the window, from the query's ``recentProgress``):
  Spark's ``durationMs`` (latestOffset, queryPlanning, getBatch, addBatch,
  walCommit, commitOffsets, triggerExecution), the gap between batch starts,
  rows per batch, and the apply thread's read/apply split (its log lines).
  On a lake, per shape table and its commits in the window: Delta's MERGE
  ``executionTimeMs`` and files added (the commit's ``operationMetrics``),
  Iceberg's data files added per snapshot.
- CPU per process over the measured window (read every 5 s, the last read
  ending it), in cores: PostgreSQL (every backend), the broker, the
  producer, the Spark JVM, Spark's Python workers, the driver's Python (this
  process: the bench's own threads are in it too), pgbench. Slot lag is
  ``pg_current_wal_lsn() - confirmed_flush_lsn``, sampled every 0.5 s.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
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
from tests.helpers import write_toml  # noqa: E402
from tests.pipeline import target_settings  # noqa: E402
from walbridge.embedded import KafkaBroker, PostgresCluster, find_pg_bin  # noqa: E402
from walbridge.runtime import consumer_service  # noqa: E402
from walbridge.verify_lake import MissingTable, lake_reader  # noqa: E402

PREFIX = "lat"
GROUP = "walbridge-spark"
SHAPES = ["public.pgbench_accounts", "public.pgbench_branches", "public.pgbench_tellers",
          "public.pgbench_history", "public.tick"]
TICK_TOPIC = f"{PREFIX}.public.tick"
TICK = os.sysconf("SC_CLK_TCK")
CPU_EVERY_S = 5.0
PROGRESS_KEYS = ("triggerExecution", "latestOffset", "queryPlanning", "getBatch", "addBatch", "walCommit",
                 "commitOffsets")
# Sent at the commit that makes a tick visible (a notification is delivered then).
TICK_TRIGGER = """
CREATE FUNCTION public.wb_bench_tick() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  PERFORM pg_notify('wb_tick', NEW.id || ' ' || extract(epoch FROM NEW.at));
  RETURN NULL;
END $$;
CREATE TRIGGER wb_bench_tick AFTER INSERT ON public.tick FOR EACH ROW EXECUTE FUNCTION public.wb_bench_tick();
"""


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
    """Polls the target's tick table; ``seen[id] = (at epoch s, visible epoch s)``.
    ``fetch(last, gaps)``: the (id, at epoch s) of ticks above ``last`` or in ``gaps``."""

    def __init__(self, fetch, poll: float, stop: threading.Event):
        super().__init__(daemon=True)
        self.fetch, self.poll, self.stop = fetch, poll, stop
        self.seen: dict[int, tuple[float, float]] = {}

    def run(self) -> None:
        last = 0
        gaps: set[int] = set()  # ids below ``last`` not visible yet: ticks of other partitions may come later
        while not self.stop.is_set():
            rows = self.fetch(last, gaps)
            now = time.time()
            for i, at in rows:
                self.seen[i] = (at, now)
                gaps.discard(i)
                if i > last:
                    gaps.update(range(last + 1, i))
                    last = i
            time.sleep(self.poll)


class Notified(threading.Thread):
    """Listens for the PostgreSQL target's tick notifications (the trigger
    :data:`TICK_TRIGGER` adds once the consumer made the table); ``seen``
    as :class:`Visible`'s. Ticks applied before the trigger exists (in the
    warm-up) are not seen."""

    def __init__(self, dsn: str, stop: threading.Event):
        super().__init__(daemon=True)
        self.dsn, self.stop = dsn, stop
        self.seen: dict[int, tuple[float, float]] = {}

    def run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while conn.execute("SELECT to_regclass('public.tick')").fetchone()[0] is None:
                if self.stop.wait(0.2):
                    return
            conn.execute(TICK_TRIGGER)
            conn.execute("LISTEN wb_tick")
            while not self.stop.is_set():
                for n in conn.notifies(timeout=0.5):
                    now = time.time()
                    i, at = n.payload.split()
                    self.seen[int(i)] = (float(at), now)


class Target:
    """The bench's target: its ``[consumer]`` settings and how to read it."""

    def __init__(self, kind: str, pg: PostgresCluster, base: Path):
        self.kind = kind
        self.dsn = pg.dsn("warehouse")
        self.settings = target_settings(kind, self.dsn, base)
        self.config = None  # the parsed config, for the lake reader

    def shape(self, name: str):
        return next(s for s in self.config.shapes if s.shape_name == name)

    def count(self, shape: str, column: str) -> int:
        """Rows in the shape's table (0 while there is none)."""
        if self.kind == "postgresql":
            with psycopg.connect(self.dsn) as conn:
                try:
                    return conn.execute(f"SELECT count(*) FROM {shape}").fetchone()[0]
                except psycopg.errors.UndefinedTable:
                    return 0
        try:
            return lake_reader(self.config).read(self.shape(shape), [column]).num_rows
        except MissingTable:
            return 0

    def ticks(self, last: int, gaps: set[int]) -> list[tuple[int, float]]:
        """A lake's ticks (:class:`Visible`; PostgreSQL notifies, :class:`Notified`)."""
        try:
            table = lake_reader(self.config).read(self.shape("public.tick"), ["id", "at"])
        except MissingTable:
            return []
        return sorted((i, at.timestamp()) for i, at in zip(table.column("id").to_pylist(),
                                                           table.column("at").to_pylist()) if i > last or i in gaps)

    def commits(self, since: float, until: float) -> dict:
        """Per shape: the table's commits in the window, what they wrote and took."""
        if self.kind == "postgresql":
            return {}
        reader, out = lake_reader(self.config), {}
        for name in SHAPES:
            if self.kind == "delta":
                history = [c for c in reader.table(self.shape(name)).history()
                           if since * 1000 <= c["timestamp"] <= until * 1000 and c.get("operation") == "MERGE"]
                metrics = [c.get("operationMetrics") or {} for c in history]
                out[name] = {"commits": len(history),
                             "merge_execution": summary([int(m.get("executionTimeMs", 0)) / 1000 for m in metrics]),
                             "files_added_mean": _mean([int(m.get("numTargetFilesAdded", 0)) for m in metrics])}
            else:
                table = reader.table(self.shape(name))
                snaps = [sn for sn in table.snapshots() if since * 1000 <= sn.timestamp_ms <= until * 1000]
                out[name] = {"commits": len(snaps), "files_added_mean": _mean(
                    [int((sn.summary or {}).get("added-data-files", 0)) for sn in snaps])}
        return out


def _mean(values: list[float]) -> float | None:
    return round(statistics.fmean(values), 2) if values else None


class Stamps(threading.Thread):
    """Reads the tick topic: ``stamps[id] = Kafka CreateTime (epoch s)``."""

    def __init__(self, bootstrap: str, stop: threading.Event):
        super().__init__(daemon=True)
        self.bootstrap, self.stop = bootstrap, stop
        self.stamps: dict[int, float] = {}

    def run(self) -> None:
        conf = {"bootstrap.servers": self.bootstrap}
        resolver = SchemaResolver(conf, PREFIX)
        # Librdkafka's fetch wait (500 ms) moves no stamp: the stamp is the message's CreateTime.
        c = Consumer({**conf, "group.id": f"bench-lat-{time.monotonic_ns()}",
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


class BatchLog:
    """The consumer's per-batch log lines ("read X s, apply Y s")."""

    LINE = re.compile(r"batch (\d+): (\d+) rows .* in ([\d.]+)s \(read ([\d.]+)s, apply ([\d.]+)s\)")

    def __init__(self) -> None:
        self.batches: list[dict] = []

    def handle(self, record) -> None:
        m = self.LINE.search(record.getMessage())
        if m:
            self.batches.append({"batch": int(m[1]), "rows": int(m[2]), "total_s": float(m[3]),
                                 "read_s": float(m[4]), "apply_s": float(m[5]), "at": record.created})


class Progress(threading.Thread):
    """Every progress report with rows of the consumer's query, read from the
    query's own record of its recent batches (``recentProgress``, the last 100)
    every ``every`` s and once more at the end. Not a StreamingQueryListener:
    PySpark converts each of its events field by field through the gateway, a
    cost a user's consumer does not pay (at 1,000 tps, 42 % of the Spark JVM's
    JFR execution samples; the JVM took 0.69 cores without it, 0.75 with it)."""

    def __init__(self, stop: threading.Event, every: float = 5.0):
        super().__init__(daemon=True)
        self.stop, self.every = stop, every
        self.events: dict[tuple[str, int], dict] = {}

    def poll(self) -> None:
        from pyspark.sql import SparkSession  # optional Spark extra: the consumer's own session

        for query in SparkSession.builder.getOrCreate().streams.active:
            for p in query.recentProgress:
                if p["numInputRows"] > 0:
                    start = datetime.fromisoformat(p["timestamp"].replace("Z", "+00:00")).timestamp()
                    self.events[(p["runId"], p["batchId"])] = {"start": start, "rows": p["numInputRows"],
                                                                **p["durationMs"]}

    def run(self) -> None:
        while not self.stop.wait(self.every):
            self.poll()


def _proc_table() -> dict[int, tuple[int, str, str, float]]:
    """pid -> (parent pid, command name, cmdline, CPU seconds) of every live process."""
    out = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            text = Path(f"/proc/{p}/stat").read_text()
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        comm = text[text.index("(") + 1:text.rindex(")")]
        fields = text[text.rindex(")") + 2:].split()
        out[int(p)] = (int(fields[1]), comm, cmd, (int(fields[11]) + int(fields[12])) / TICK)
    return out


def cpu_by_part(pg_postmaster: int, broker: int, producer: int) -> dict[str, float]:
    """CPU seconds used so far by each part of the pipeline (live processes)."""
    procs = _proc_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, *_rest) in procs.items():
        children.setdefault(ppid, []).append(pid)

    def tree(root: int) -> list[int]:
        out, todo = [], [root]
        while todo:
            pid = todo.pop()
            if pid in procs:
                out.append(pid)
                todo += children.get(pid, [])
        return out

    me = os.getpid()
    jvm = [p for p in children.get(me, []) if procs[p][1] == "java" and p != broker]  # the broker is a child too
    workers = [p for j in jvm for p in tree(j) if p != j]
    return {
        "postgresql": sum(procs[p][3] for p in tree(pg_postmaster)),
        "broker": sum(procs[p][3] for p in tree(broker)),
        "producer": sum(procs[p][3] for p in tree(producer)),
        "spark_jvm": sum(procs[p][3] for p in jvm),
        "spark_python_workers": sum(procs[p][3] for p in workers),
        "driver_python": procs[me][3],
        "pgbench": sum(v[3] for v in procs.values() if v[1] == "pgbench"),
    }


def config_data(pg: PostgresCluster, bootstrap: str, base: Path, target: Target, trigger: float | None,
                max_offsets: int | None, partitions: int | None) -> dict:
    consumer: dict = {"group": GROUP, "checkpoint_dir": str(base / "checkpoints"), **target.settings}
    if trigger is not None:
        consumer["trigger_interval"] = trigger
    if max_offsets is not None:
        consumer["max_offsets_per_trigger"] = max_offsets
    return {
        "source": {"dsn": pg.dsn("app"), "slot": "walbridge", "publication": "walbridge"},
        "kafka": {"bootstrap_servers": bootstrap, "topic_prefix": PREFIX,
                  **({"partitions": partitions} if partitions is not None else {})},
        "shapes": [{"table": t} for t in SHAPES],
        "consumer": consumer,
        "ack": {"consumer_groups": [GROUP], "interval": 0.5},  # as walbridge up
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=int, default=1000, help="pgbench tpcb transactions/s (-R)")
    ap.add_argument("--scale", type=int, default=5)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--warmup", type=float, default=20)
    ap.add_argument("--duration", type=float, default=60)
    ap.add_argument("--tick-every", type=float, default=0.02)
    ap.add_argument("--poll-ms", type=float, default=50, help="a lake's poll (PostgreSQL notifies)")
    ap.add_argument("--target", choices=("postgresql", "delta", "iceberg"), default="postgresql")
    ap.add_argument("--trigger-interval", type=float, default=None, help="override [consumer] trigger_interval")
    ap.add_argument("--max-offsets", type=int, default=None, help="override [consumer] max_offsets_per_trigger")
    ap.add_argument("--master", default="local[*]", help="Spark master, for experiments")
    ap.add_argument("--partitions", type=int, default=None, help="override [kafka] partitions")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "latency.json")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="wb-bench-latency-"))
    logging.basicConfig(level=logging.INFO, filename=str(base / "walbridge.log"),
                        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s")
    batch_log = BatchLog()
    handler = logging.Handler()
    handler.emit = batch_log.handle
    logging.getLogger().addHandler(handler)
    pg_bin = find_pg_bin()
    results: dict = {k: v for k, v in vars(args).items() if k != "out"}
    stop, measuring_stop = threading.Event(), threading.Event()
    with PostgresCluster(base / "pg", durable=True) as pg, KafkaBroker(base / "kafka") as broker:
        with psycopg.connect(pg.dsn("postgres"), autocommit=True) as conn:
            conn.execute("CREATE DATABASE app")
            conn.execute("CREATE DATABASE warehouse")
            postmaster = conn.execute("SELECT pid FROM pg_stat_activity WHERE backend_type = 'checkpointer'"
                                      ).fetchone()[0]
        postmaster = _proc_table()[postmaster][0]  # the checkpointer's parent
        subprocess.run([str(pg_bin / "pgbench"), "-i", "-q", "-s", str(args.scale), pg.dsn("app")],
                       check=True, capture_output=True)
        with psycopg.connect(pg.dsn("app"), autocommit=True) as conn:
            conn.execute("ALTER TABLE pgbench_history REPLICA IDENTITY FULL")
            conn.execute("CREATE TABLE tick (id bigserial PRIMARY KEY, at timestamptz NOT NULL DEFAULT clock_timestamp())")
        target = Target(args.target, pg, base)
        data = config_data(pg, broker.bootstrap, base, target, args.trigger_interval, args.max_offsets,
                           args.partitions)
        config = target.config = parse_config(data)
        results["trigger_interval"] = config.consumer.trigger_interval
        results["max_offsets_per_trigger"] = config.consumer.max_offsets_per_trigger
        results["partitions"] = config.kafka.partitions
        failed: list = []
        appliers: list = []

        def consume():
            try:
                consumer_service(config, args.master, stop, appliers)
            except BaseException as e:  # noqa: BLE001 - reported at the end
                failed.append(e)
                stop.set()

        path = write_toml(data, base / "wb.toml")
        with open(base / "producer.log", "ab") as plog:
            producer = subprocess.Popen([sys.executable, "-m", "walbridge.cli", "producer", "-c", str(path)],
                                        stdout=plog, stderr=subprocess.STDOUT, cwd=ROOT)
        consumer = threading.Thread(target=consume, daemon=True)
        t0 = time.monotonic()
        consumer.start()
        accounts = args.scale * 100_000
        while target.count("public.pgbench_accounts", "aid") < accounts:
            if failed or producer.poll() is not None:
                raise RuntimeError(f"pipeline failed: {failed or producer.returncode}")
            time.sleep(0.5 if args.target == "postgresql" else 2)
        results["snapshot_applied_s"] = round(time.monotonic() - t0, 1)
        print(json.dumps(results), flush=True)
        progress = Progress(measuring_stop)
        progress.start()
        visible = (Notified(target.dsn, measuring_stop) if args.target == "postgresql"
                   else Visible(target.ticks, args.poll_ms / 1000, measuring_stop))
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
        cpu0 = cpu1 = None
        with psycopg.connect(pg.dsn("app"), autocommit=True) as conn:
            while bench.poll() is None:
                if time.time() >= measure_from:
                    # Every CPU_EVERY_S: reading /proc is this process's work, beside the driver's.
                    now = time.monotonic()
                    if cpu0 is None:
                        cpu0, w0 = cpu_by_part(postmaster, broker.pid, producer.pid), now
                        w1 = now
                    elif now - w1 >= CPU_EVERY_S:
                        cpu1, w1 = cpu_by_part(postmaster, broker.pid, producer.pid), now
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
        progress.join()
        progress.poll()
        results["lake_commits"] = target.commits(measure_from, measure_to)
        stop.set()
        consumer.join(120)
        producer.terminate()
        producer.wait(60)
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
    if cpu0 is not None and cpu1 is not None and w1 > w0:
        results["cpu_cores"] = {k: round((cpu1[k] - cpu0[k]) / (w1 - w0), 3) for k in cpu0}
    batches = [b for b in sorted(progress.events.values(), key=lambda b: b["start"]) if measure_from <= b["start"] <= measure_to]
    starts = [b["start"] for b in batches]
    per_batch = {k: summary([b[k] / 1000 for b in batches if k in b]) for k in PROGRESS_KEYS}
    per_batch["gap_between_starts"] = summary([b - a for a, b in zip(starts, starts[1:])])
    per_batch["rows_per_batch_mean"] = round(statistics.fmean([b["rows"] for b in batches]), 1) if batches else None
    logged = [b for b in batch_log.batches if measure_from <= b["at"] <= measure_to]
    per_batch["apply_thread"] = {k: summary([b[k] for b in logged]) for k in ("read_s", "apply_s", "total_s")}
    results["batches"] = per_batch
    text = json.dumps(results, indent=2)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
