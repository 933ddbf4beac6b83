"""``walbridge up``: the whole pipeline on one machine, with a live view.

Without ``--config`` it runs on the embedded default: a throwaway PostgreSQL
(demo schema from ``walbridge/demo.sql``, plus a ``warehouse`` target database),
the Apache Kafka broker (KRaft), the producer, the Spark consumer when the spark extra
is installed (its Structured Streaming query in ``local[*]``, with Spark's UI on
loopback), and a demo workload writing at a steady rate. With ``--config`` it runs the same
against your database and broker (no workload unless ``--rate`` is given).

Invariants:
- Everything ``up`` starts it stops, by handle, on Ctrl-C, SIGTERM or the end of
  ``--duration``; it then says where the data and the logs are.
- The view is rendered from a plain snapshot dict by :func:`render_view` (pure),
  so what it shows can be tested against the real numbers.
- Logs go to a file while the live view owns the terminal.
- A part that fails for good (a permanent failure of the producer or the
  consumer) stops the run; its failure is raised once everything is stopped,
  so the command reports it and exits with its code.
"""

from __future__ import annotations

import logging
import random
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Callable

import psycopg
from confluent_kafka.admin import AdminClient
from rich.console import Console
from rich.live import Live

from producer import catalog
from producer.pgoutput import lsn_to_int
from schemas.config import Config, parse_config, redact_dsn
from schemas.kafka import GroupOffsets, client_config
from walbridge.embedded import KafkaBroker, PostgresCluster
from walbridge.render import render_verify, render_view
from walbridge.runtime import as_failure, consumer_service, producer_service, spark_job
from walbridge.verify import as_json, verify

log = logging.getLogger("walbridge.up")

DEMO_SHAPES = [
    {"table": "public.customers"},
    {"table": "public.orders"},
    {"table": "public.orders", "name": "orders_eu_large", "where": "region = 'eu' AND total > 100",
     "columns": ["id", "region", "total"]},
    {"table": "public.audit_log"},
]


def demo_sql() -> str:
    return resources.files("walbridge").joinpath("demo.sql").read_text()


class Workload(threading.Thread):
    """Demo writes at ``rate`` transactions/s: new customers and orders, order
    updates (some moving rows in and out of the filtered shape), deletes, and
    audit rows in a table without a primary key."""

    def __init__(self, dsn: str, rate: float, seed: int = 1):
        super().__init__(name="workload", daemon=True)
        self.dsn = dsn
        self.rate = rate
        self.stop_event = threading.Event()
        self.transactions = 0
        self.error: BaseException | None = None
        self._rnd = random.Random(seed)

    def run(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                next_id = conn.execute("SELECT coalesce(max(id), 0) + 1 FROM orders").fetchone()[0]
                interval = 1.0 / self.rate if self.rate > 0 else 1.0
                while not self.stop_event.wait(interval):
                    next_id = self._one(conn, next_id)
                    self.transactions += 1
        except BaseException as e:  # shown in the view
            self.error = e

    def _one(self, conn, next_id: int) -> int:
        rnd = self._rnd
        with conn.transaction():
            kind = rnd.random()
            if kind < 0.45:
                conn.execute("INSERT INTO orders (id, customer_id, region, total) VALUES (%s, %s, %s, %s)",
                             (next_id, rnd.randint(1, 1000), rnd.choice(["eu", "us", "apac"]),
                              round(rnd.uniform(1, 500), 2)))
                next_id += 1
            elif kind < 0.85:
                conn.execute("UPDATE orders SET total = %s, status = %s WHERE id = %s",
                             (round(rnd.uniform(1, 500), 2), rnd.choice(["new", "paid", "shipped"]),
                              rnd.randint(1, next_id)))
            elif kind < 0.95:
                conn.execute("DELETE FROM orders WHERE id = %s", (rnd.randint(1, next_id),))
            else:
                conn.execute("UPDATE customers SET profile = jsonb_set(coalesce(profile, '{}'), '{visits}', "
                             "to_jsonb(%s::int)) WHERE id = %s", (rnd.randint(1, 99), rnd.randint(1, 1000)))
            conn.execute("INSERT INTO audit_log (actor, action) VALUES (%s, %s)",
                         (f"user{rnd.randint(1, 20)}", "write"))
        return next_id


@dataclass
class Sampler:
    """Turns successive producer/slot readings into the view's snapshot."""

    config: Config
    started: float = field(default_factory=time.monotonic)
    _last_events: dict[str, int] = field(default_factory=dict)
    _last_snapshot_rows: int = 0
    _last_at: float = field(default_factory=time.monotonic)

    def sample(self, producer_view: dict | None, slot: dict | None, committed: dict[str, int],
               errors: int, dlq: int, workload_tx: int, spark: dict | None = None) -> dict:
        now = time.monotonic()
        dt = max(now - self._last_at, 1e-6)
        self._last_at = now
        producer_view = producer_view or {}
        shapes = []
        produced = producer_view.get("produced", {})
        for shape in self.config.shapes:
            name = shape.shape_name
            total = sum(producer_view.get("events", {}).get(name, {}).values())
            rate = (total - self._last_events.get(name, total)) / dt
            self._last_events[name] = total
            topic = self.config.topic(shape)
            lag = sum(max(n - committed.get(w, 0), 0) for w, n in produced.items() if w.startswith(topic + "["))
            shapes.append({"shape": name, "events": total, "events_per_s": round(rate, 1),
                           "lag": lag if self.config.ack_groups else None})
        writers = [{"writer": w, "produced": n, "committed": committed.get(w)} for w, n in sorted(produced.items())]
        snap = dict(producer_view.get("snapshot") or {})
        if snap:
            rows = snap.get("rows", 0)
            snap["rows_per_s"] = round((rows - self._last_snapshot_rows) / dt, 1)
            self._last_snapshot_rows = rows
            left = max(snap.get("total_estimate", 0) - rows, 0)
            snap["eta_s"] = None if snap.get("done") or not snap["rows_per_s"] else round(left / snap["rows_per_s"])
        return {
            "uptime_s": round(now - self.started), "shapes": shapes, "writers": writers, "spark": spark,
            "slot": slot, "snapshot": snap, "errors": errors, "dlq": dlq, "workload_tx": workload_tx,
            "stalled_groups": producer_view.get("stalled_groups", []),
            "backfill": producer_view.get("backfill"),
            "backfills_queued": len(producer_view.get("backfills_queued") or []),
            "backfills_done": len(producer_view.get("backfills_done") or []),
        }


class _ErrorCounter(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


# The embedded demo's targets (`walbridge up --target`): [consumer] settings
# from the embedded PostgreSQL and the data folder's lake.
TARGETS = {
    "postgresql": lambda pg, lake: {"target_dsn": pg.dsn("warehouse")},
    "delta": lambda pg, lake: {"target": "delta", "target_path": str(lake)},
    "iceberg": lambda pg, lake: {"target": "iceberg", "iceberg": {"catalog": "hadoop", "warehouse": str(lake)}},
}


def embedded_config(base_dir: Path, target: str = "postgresql") -> tuple[dict, list]:
    """Start the embedded PostgreSQL and broker; returns (config dict, things
    to stop). ``target``: ``"postgresql"`` (the ``warehouse`` database),
    ``"delta"`` or ``"iceberg"`` (tables in ``<base_dir>/lake``)."""
    pg = PostgresCluster(base_dir / "pg", durable=True).start()
    broker = KafkaBroker(base_dir / "kafka").start()
    with psycopg.connect(pg.dsn("postgres"), autocommit=True) as conn:
        exists = {r[0] for r in conn.execute("SELECT datname FROM pg_database")}
        for db in ("app", "warehouse"):
            if db not in exists:
                conn.execute(f"CREATE DATABASE {db}")
    with psycopg.connect(pg.dsn("app"), autocommit=True) as conn:
        if conn.execute("SELECT to_regclass('public.orders')").fetchone()[0] is None:
            conn.execute(demo_sql())
    data = {
        "source": {"dsn": pg.dsn("app"), "slot": "walbridge", "publication": "walbridge"},
        "kafka": {"bootstrap_servers": broker.bootstrap, "topic_prefix": "wb"},
        "shapes": DEMO_SHAPES,
        "consumer": {"group": "walbridge-spark", "checkpoint_dir": str(base_dir / "checkpoints"),
                     **TARGETS[target](pg, base_dir / "lake")},
        # WAL is released once the Spark consumer has committed (set to [] to
        # release on broker acknowledgement instead).
        "ack": {"consumer_groups": ["walbridge-spark"], "interval": 0.5},
    }
    return data, [broker, pg]


def run_up(config: Config | None, base_dir: Path, duration: float | None, rate: float,
           headless: bool = False, console=None, before_stop: Callable[[Config], None] | None = None,
           with_consumer: bool = True, target: str = "postgresql") -> dict:
    """Run until Ctrl-C or ``duration``; returns the last view snapshot.
    ``before_stop(config)`` runs after the pipeline stopped, while the embedded
    servers still run (tests inspect them there). Without the Spark extra
    installed, a run that would start the consumer raises ``MissingExtra``
    before anything starts. ``target``: the embedded demo's (:func:`embedded_config`)."""
    if with_consumer and (config is None or config.consumer.has_target):
        spark_job()
    console = console or Console()
    base_dir.mkdir(parents=True, exist_ok=True)
    log_file = base_dir / "walbridge.log"
    handler = logging.FileHandler(log_file)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    errors = _ErrorCounter()
    root = logging.getLogger()
    saved_handlers = root.handlers[:]
    root.handlers[:] = [handler, errors]
    root.setLevel(logging.INFO)
    stoppables: list = []
    stop = threading.Event()
    workload = None
    producer = consumer = None
    admin = offsets = None
    last: dict = {}
    failed: list[BaseException] = []  # what ended a part for good
    signals: list[int] = []  # what stopped the run
    try:
        if config is None:
            # A throwaway demo: each run starts from nothing (the broker keeps no
            # data across restarts, so old checkpoints and progress would not fit).
            for sub in ("pg", "kafka", "checkpoints", "lake"):
                shutil.rmtree(base_dir / sub, ignore_errors=True)
            console.print(f"starting embedded PostgreSQL and Kafka broker in {base_dir} ...")
            data, stoppables = embedded_config(base_dir, target)
            config = parse_config(data)
        console.print(f"source {redact_dsn(config.source.dsn)} → Kafka {config.kafka.bootstrap_servers} "
                      f"(topics {config.kafka.topic_prefix}.*)")
        views: dict[str, dict] = {}
        producer = threading.Thread(target=_guard(lambda: producer_service(
            config, stop, lambda view: views.__setitem__("producer", view)), "producer", stop, failed),
            name="producer", daemon=True)
        producer.start()
        appliers: list = []
        if with_consumer and config.consumer.has_target:
            consumer = threading.Thread(target=_guard(lambda: consumer_service(config, "local[*]", stop, appliers, ui=True),
                                                      "consumer", stop, failed), name="consumer", daemon=True)
            consumer.start()
        if rate > 0:
            workload = Workload(config.source.dsn, rate)
            workload.start()
        sampler = Sampler(config)
        kafka_conf = client_config(config.kafka.bootstrap_servers, config.kafka.client)
        admin, offsets = AdminClient(kafka_conf), GroupOffsets(kafka_conf)
        deadline = time.monotonic() + duration if duration else None

        def on_signal(signum, frame):
            signals.append(signum)
            stop.set()

        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, on_signal)
            signal.signal(signal.SIGTERM, on_signal)
        with Live(console=console, refresh_per_second=2, transient=False, auto_refresh=False) as live:
            while not stop.is_set():
                last = sampler.sample(views.get("producer"), _slot(config), _committed(admin, offsets, config),
                                      errors.count, _dlq(appliers), workload.transactions if workload else 0,
                                      spark_view(appliers))
                if not headless:
                    live.update(render_view(last), refresh=True)
                if deadline and time.monotonic() >= deadline:
                    break
                stop.wait(1.0)
            # Wind down in order: no new writes, let the pipeline catch up, stop it,
            # and show the final numbers.
            if workload:
                workload.stop_event.set()
                workload.join(10)
            if not failed:
                _wait_caught_up(config, timeout=60 if consumer else 15)
            stop.set()
            producer.join(30)
            if consumer:
                consumer.join(60)
            last = sampler.sample(views.get("producer"), _slot(config), _committed(admin, offsets, config),
                                  errors.count, _dlq(appliers), workload.transactions if workload else 0,
                                  spark_view(appliers))
            live.update(render_view(last), refresh=True)
        if failed:
            raise failed[0]
        if consumer and duration:
            diffs = verify(config)
            console.print(render_verify(diffs))
            last["verify"] = as_json(diffs)
        if before_stop is not None:
            before_stop(config)
        if signals:
            last["signal"] = signals[0]
    finally:
        stop.set()
        if workload:
            workload.stop_event.set()
            workload.join(10)
        if producer is not None:
            producer.join(30)
        if consumer is not None:
            consumer.join(60)
        if offsets is not None:
            offsets.close()
        admin = offsets = None  # noqa: F841  (drops the clients before their broker goes)
        for s in stoppables:
            s.stop()
        root.handlers[:] = saved_handlers
        handler.close()
        console.print(f"stopped. logs: {log_file}" + (f"; data: {base_dir}" if stoppables else ""))
    return last


def _guard(fn: Callable[[], None], part: str, stop: threading.Event, failed: list):
    """``fn`` in a thread: an error that ends it is logged, kept in ``failed``
    and stops the whole run."""

    def run() -> None:
        try:
            fn()
        except Exception as e:
            failure = as_failure(e)
            if failure is None:
                log.exception("%s stopped with an error", part)
            else:
                log.error("%s stopped: %s", part, failure)
            failed.append(e)
            stop.set()

    return run


def _dlq(appliers: list) -> int:
    return sum(a.dlq for a in appliers)


def spark_view(appliers: list) -> dict | None:
    """The consumer's query as the view shows it (its newest run): its
    newest batch id, input rows/s and batch duration (Spark's last progress
    report) and the Spark UI's address; None before the query started."""
    applier = appliers[-1] if appliers else None
    query = applier.query if applier is not None else None
    if query is None:
        return None
    view = {"ui": applier.ui_url, "batch": None, "rows_per_s": None, "batch_s": None}
    try:
        progress = query.lastProgress
    except Exception:  # noqa: BLE001 - a query being stopped: show what is known
        progress = None
    if progress:
        view.update(batch=progress.get("batchId"), rows_per_s=round(progress.get("inputRowsPerSecond") or 0.0, 1),
                    batch_s=round((progress.get("durationMs") or {}).get("triggerExecution", 0) / 1000, 2))
    return view


def _wait_caught_up(config: Config, timeout: float) -> None:
    """Until the slot has confirmed the source's current WAL position."""
    deadline = time.monotonic() + timeout
    try:
        with psycopg.connect(config.source.dsn, connect_timeout=3) as conn:
            target = lsn_to_int(conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])
    except psycopg.Error:
        return
    while time.monotonic() < deadline:
        slot = _slot(config)
        if slot and slot["confirmed_int"] >= target:
            return
        time.sleep(0.2)


def _slot(config: Config) -> dict | None:
    try:
        with psycopg.connect(config.source.dsn, connect_timeout=3) as conn:
            state = catalog.slot_state(conn, config.source.slot)
    except psycopg.Error:
        return None
    if state is None:
        return None
    return {"confirmed_flush_lsn": state["confirmed_flush_lsn"], "retained_wal_bytes": state["retained_wal_bytes"],
            "confirmed_int": lsn_to_int(state["confirmed_flush_lsn"]) if state["confirmed_flush_lsn"] else 0}


def _committed(admin: AdminClient, reader: GroupOffsets, config: Config) -> dict[str, int]:
    """Lowest committed offset over the ack groups, per ``topic[partition]``."""
    if not config.ack_groups:
        return {}
    try:
        meta = admin.list_topics(timeout=5).topics
        writers = [(config.topic(s), p) for s in config.shapes if config.topic(s) in meta
                   for p in meta[config.topic(s)].partitions]
        per_group = reader.read(config.ack_groups, writers, timeout=5)
    except Exception:  # the view shows "-" until the broker answers
        return {}
    return {f"{t}[{p}]": min(offsets.get((t, p), 0) for offsets in per_group.values()) for t, p in writers}
