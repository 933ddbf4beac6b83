"""A chaos run: the whole pipeline under pgbench while a seeded random
schedule injects faults, many times each, then proves nothing was lost.

Used by ``tests/integration/test_chaos.py`` (short, in CI) and
``bench/chaos.py`` (long). Everything runs on servers of its own, under one
base dir: a source and a target PostgreSQL cluster and an Apache Kafka broker
(KRaft, one node); both clusters are durable (fsync and synchronous commit on),
as production databases are. The
producer and the consumer run as real ``walbridge`` processes; the harness
restarts the ones it killed, as a supervisor would.

Faults (:data:`FAULTS`): ``kill -9`` of the producer, of the consumer (driver
and JVM), of one Spark Python worker (a Python process under the driver's
JVM); ``pg_ctl stop -m immediate`` + start of the source, of the target;
``kill -9`` of the broker and a start (its data kept); the broker losing its
data (stopped, log dirs deleted, formatted again with the same cluster id:
every topic, record and committed offset gone); the broker frozen (SIGSTOP) for longer than the producer's
``message.timeout.ms``, then resumed. One fault at a time, each kind at least
``rounds`` times, in an order and with gaps drawn from the seed.

Invariants the run checks (:attr:`ChaosResult.problems` lists what failed):
- every shape's target equals its source (``walbridge verify``), with no
  manual command: lost rows = missing or differing rows, duplicate rows =
  extra rows (for the keyless ``pgbench_history``: a streamed insert applied
  twice);
- the slot confirmed the source's final LSN;
- no walbridge process exited other than the ones killed.

Recovery time of a fault: from the end of the fault (the process restarted,
the server started, the broker resumed) to the target holding a marker
written to the source right after it (``pgbench_tellers.filler`` of teller
1, a column pgbench never writes). Faults come faster than some recoveries:
a marker seen covers every earlier one.
"""

from __future__ import annotations

import os
import random
import re
import signal
import statistics
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psycopg

from producer.pgoutput import lsn_to_int
from schemas.config import parse_config
from tests.cluster import cmdline
from tests.helpers import ConsumerProcess, ProducerProcess, make_config, read_topic, wait_for, write_toml
from tests.pipeline import SHAPES
from walbridge.embedded import KafkaBroker, PostgresCluster, find_pg_bin
from walbridge.verify import ShapeDiff, verify

FAULTS = ("producer_kill", "consumer_kill", "worker_kill", "source_restart", "target_restart", "broker_kill",
          "broker_wipe", "broker_freeze")

# SHAPES: the 5-shape pgbench set, a filtered, column-limited shape and the
# keyless REPLICA IDENTITY FULL pgbench_history among them.
PREFIX = "chaos"
GROUP = "chaos-spark"


@dataclass
class Injection:
    kind: str
    started: float
    ended: float = 0.0
    recovered: float | None = None

    @property
    def recovery_s(self) -> float | None:
        return None if self.recovered is None else max(self.recovered - self.ended, 0.0)


@dataclass
class ChaosResult:
    seed: int
    injections: list[Injection] = field(default_factory=list)
    lost_rows: int = 0
    duplicate_rows: int = 0
    problems: list[str] = field(default_factory=list)
    diffs: list[ShapeDiff] = field(default_factory=list)

    def table(self) -> str:
        """fault → times injected → recovery p50/max → lost rows → duplicate rows."""
        lines = [f"chaos run, seed {self.seed}",
                 f"{'fault':<16} {'injected':>8} {'recovery p50':>13} {'recovery max':>13} {'lost rows':>10} "
                 f"{'dup rows':>9}"]
        for kind in FAULTS:
            done = [i for i in self.injections if i.kind == kind]
            times = [i.recovery_s for i in done if i.recovery_s is not None]
            p50 = f"{statistics.median(times):.1f}s" if times else "-"
            worst = f"{max(times):.1f}s" if times else "-"
            unrecovered = sum(i.recovery_s is None for i in done)
            if unrecovered:
                worst += f" ({unrecovered}?)"
            lines.append(f"{kind:<16} {len(done):>8} {p50:>13} {worst:>13} {self.lost_rows:>10} "
                         f"{self.duplicate_rows:>9}")
        lines.append("lost/duplicate rows: counted over the whole run (faults overlap), every shape")
        return "\n".join(lines)


def schedule(seed: int, rounds: int, gap: tuple[float, float]) -> list[tuple[float, str]]:
    """``rounds`` of each fault in a seeded random order, each after a seeded
    random pause in ``gap`` seconds: [(pause, kind)]."""
    rng = random.Random(seed)
    kinds = [k for k in FAULTS for _ in range(rounds)]
    rng.shuffle(kinds)
    return [(rng.uniform(*gap), k) for k in kinds]


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            out.append(int(entry))
    return out


def python_workers(driver_pid: int) -> list[int]:
    """Spark's Python workers: the processes ``pyspark.daemon`` forked (the
    daemon is the Python child of the driver's JVM, itself a child of the
    driver, perhaps through a launcher script). Not the daemon: killed, it
    takes every worker with it and Spark runs short-lived workers without
    one for minutes, so a later fault found nothing to kill."""
    found, todo = [], [(driver_pid, "")]
    while todo:
        pid, parent = todo.pop()
        for child in _children(pid):
            cmd = " ".join(cmdline(child))
            if parent == "daemon" and "python" in cmd:
                found.append(child)
            if "java" in cmd.split(" ", 1)[0]:
                todo.append((child, "jvm"))
            elif parent == "jvm" and "python" in cmd:
                todo.append((child, "daemon"))
            else:  # the driver's other children: searched as the driver is; under the JVM: no daemon below
                todo.append((child, "" if not parent else "below"))
    return found


class Chaos:
    """One chaos run under ``base`` (see the module docstring)."""

    def __init__(self, base: Path, seed: int, rounds: int = 3, gap: tuple[float, float] = (3.0, 7.0),
                 rate: int = 20, message_timeout_s: float = 10.0, settle_timeout: float = 240.0,
                 say: Callable[[str], None] = print):
        self.base = base
        self.seed = seed
        self.plan = schedule(seed, rounds, gap)
        self.rate = rate
        self.message_timeout_s = message_timeout_s
        self.settle_timeout = settle_timeout
        self.say = say
        self.result = ChaosResult(seed)
        self._lock = threading.Lock()  # a kill and its restart vs. the supervisor's look
        self._stop = threading.Event()
        self._markers: list[tuple[int, Injection]] = []

    # -- set-up
    def _start_servers(self) -> None:
        # Durable, as production databases are: without synchronous_commit an
        # immediate stop loses commits the apply was told were made, and the
        # consumer then (rightly) stops at the gap in the target's progress.
        self.source = PostgresCluster(self.base / "source", durable=True).start()
        self.target = PostgresCluster(self.base / "target", durable=True).start()
        self.broker = KafkaBroker(self.base / "kafka").start()
        self.source_dsn = self.source.create_database("chaos")
        self.target_dsn = self.target.create_database("warehouse")
        self._pgbench("-i", "-q", "-s", "1")
        with psycopg.connect(self.source_dsn, autocommit=True) as conn:
            conn.execute("ALTER TABLE pgbench_history REPLICA IDENTITY FULL")
            conn.execute("ALTER TABLE pgbench_accounts REPLICA IDENTITY FULL")
        self.config = make_config(
            self.source_dsn, self.broker.bootstrap, PREFIX, SHAPES,
            source={"reconnect_max_backoff": 2.0},
            kafka={"client": {"message.timeout.ms": int(self.message_timeout_s * 1000)}},
            consumer={"group": GROUP, "target_dsn": self.target_dsn,
                      "checkpoint_dir": str(self.base / "checkpoints"), "trigger_interval": 0.5,
                      "reconnect_max_backoff": 2.0},
            ack={"consumer_groups": [GROUP], "interval": 0.5})
        path = write_toml(self.config, self.base / "walbridge.toml")
        self.producer = ProducerProcess(path, self.base / "producer.log")
        self.consumer = ConsumerProcess(path, self.base / "consumer.log")

    def _pgbench(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(find_pg_bin() / "pgbench"), *args, self.source_dsn], capture_output=True)

    # -- the moving parts
    def _load(self) -> None:
        """pgbench at ``rate`` tx/s until the run stops it, started again
        whenever a source restart ends it."""
        while not self._stop.is_set():
            cmd = [str(find_pg_bin() / "pgbench"), "-n", "-c", "2", "-T", "3600", "-R", str(self.rate),
                   self.source_dsn]
            bench = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            while bench.poll() is None and not self._stop.wait(0.5):
                pass
            if bench.poll() is None:
                bench.terminate()
            bench.wait(30)

    def _supervise(self) -> None:
        while not self._stop.wait(0.5):
            with self._lock:
                for name, proc in (("producer", self.producer), ("consumer", self.consumer)):
                    code = proc.proc.poll()
                    if code is not None:
                        tail = proc.log_path.read_text(errors="replace")[-3000:]
                        self.result.problems.append(f"{name} exited by itself (code {code}):\n{tail}")
                        self.say(f"!! {name} exited by itself (code {code}); restarted")
                        proc.start()

    def _marker_value(self) -> int | None:
        try:
            with psycopg.connect(self.target_dsn, connect_timeout=3) as conn:
                row = conn.execute("SELECT filler FROM public.pgbench_tellers WHERE tid = 1").fetchone()
        except psycopg.Error:
            return None
        m = re.match(r"chaos-(\d+)", (row[0] or "").strip()) if row else None
        return int(m.group(1)) if m else None

    def _watch_markers(self) -> None:
        while not self._stop.wait(0.5):
            seen = self._marker_value()
            if seen is None:
                continue
            now = time.monotonic()
            for n, injection in self._markers:
                if n <= seen and injection.recovered is None:
                    injection.recovered = now

    def _write_marker(self, injection: Injection) -> None:
        n = len(self._markers) + 1
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with psycopg.connect(self.source_dsn, autocommit=True, connect_timeout=3) as conn:
                    conn.execute("UPDATE pgbench_tellers SET filler = %s WHERE tid = 1", (f"chaos-{n}",))
                self._markers.append((n, injection))
                return
            except psycopg.Error:
                time.sleep(0.5)

    # -- faults
    def _inject(self, kind: str) -> Injection:
        injection = Injection(kind, time.monotonic())
        if kind == "producer_kill":
            with self._lock:
                self.producer.kill9()
                self.producer.start()
        elif kind == "consumer_kill":
            with self._lock:
                self.consumer.kill9()
                self.consumer.start()
        elif kind == "worker_kill":
            workers = wait_for(lambda: python_workers(self.consumer.proc.pid), timeout=120, interval=0.1,
                               what="a Spark Python worker")
            victim = random.Random(self.seed + len(self.result.injections)).choice(sorted(workers))
            os.kill(victim, signal.SIGKILL)
        elif kind in ("source_restart", "target_restart"):
            cluster = self.source if kind == "source_restart" else self.target
            cluster.stop("immediate")
            cluster.start()
        elif kind == "broker_kill":
            self.broker.kill()
            self.broker.start()
        elif kind == "broker_wipe":
            self.broker.lose_data()
        elif kind == "broker_freeze":
            os.kill(self.broker.pid, signal.SIGSTOP)
            try:
                time.sleep(self.message_timeout_s + 2)
            finally:
                os.kill(self.broker.pid, signal.SIGCONT)
        injection.ended = time.monotonic()
        return injection

    # -- the run
    def run(self) -> ChaosResult:
        self.say(f"chaos run: seed {self.seed}, {len(self.plan)} faults, pgbench -R {self.rate}")
        self._start_servers()
        threads: list[threading.Thread] = []
        try:
            self.producer.start()
            self.consumer.start()
            wait_for(self._equal, timeout=self.settle_timeout, interval=3, what="the initial snapshot applied")
            threads = [threading.Thread(target=self._supervise, daemon=True),
                       threading.Thread(target=self._watch_markers, daemon=True)]
            threads.append(threading.Thread(target=self._load, daemon=True))
            for t in threads:
                t.start()
            for pause, kind in self.plan:
                time.sleep(pause)
                injection = self._inject(kind)
                self.result.injections.append(injection)
                self._write_marker(injection)
                self.say(f"{time.strftime('%H:%M:%S')} {kind} ({len(self.result.injections)}/{len(self.plan)})")
            self._stop.set()  # ends the load, the supervisor's and the marker watch's next round
            for t in threads:
                t.join(60)
            self._stop.clear()
            watch = threading.Thread(target=self._watch_markers, daemon=True)
            watch.start()
            self._settle()
            self._stop.set()
            watch.join(10)
        finally:
            self._stop.set()
            self.producer.stop()
            self.consumer.stop()
            for server in (self.broker, self.source, self.target):
                try:
                    server.stop()
                except Exception as e:  # the next one is stopped anyway
                    self.say(f"stopping {server}: {e}")
        return self.result

    def _equal(self) -> bool:
        try:
            diffs = verify(parse_config(self.config))
        except Exception:  # a server still coming back
            return False
        self.result.diffs = diffs
        return all(d.ok for d in diffs)

    def caught_up(self) -> bool:
        try:
            with psycopg.connect(self.source_dsn) as conn:
                row = conn.execute("SELECT confirmed_flush_lsn::text, pg_current_wal_lsn()::text "
                                   "FROM pg_replication_slots WHERE slot_name = %s",
                                   (self.config["source"]["slot"],)).fetchone()
        except psycopg.Error:
            return False
        return row is not None and row[0] is not None and lsn_to_int(row[0]) >= lsn_to_int(row[1])

    def _log_tails(self, lines: int = 25) -> str:
        tails = []
        for proc in (self.producer, self.consumer):
            text = proc.log_path.read_text(errors="replace").splitlines() if proc.log_path.exists() else []
            tails.append(f"--- {proc.log_path.name}\n" + "\n".join(line[:300] for line in text[-lines:]))
        return "\n".join(tails)

    def _warnings(self, lines: int = 40) -> str:
        """walbridge's own warnings and errors (not librdkafka's) from both logs,
        and the executors' lines on recreated topics: the recoveries a failed
        settle went through."""
        out = []
        for proc in (self.producer, self.consumer):
            text = proc.log_path.read_text(errors="replace").splitlines() if proc.log_path.exists() else []
            said = [line[:300] for line in text if re.search(
                r" (WARNING|ERROR) +walbridge\.(?!librdkafka)|was recreated|messages are gone", line)]
            out.append(f"--- {proc.log_path.name}: walbridge's warnings and errors\n" + "\n".join(said[-lines:]))
        return "\n".join(out)

    def _settle(self) -> None:
        """After the last fault: the target converges and the slot catches up
        by themselves; then every process must still be the one last started."""
        for what, check in (("target == source", self._equal), ("slot confirmed the final LSN", self.caught_up)):
            try:
                wait_for(check, timeout=self.settle_timeout, interval=3, what=what)
            except AssertionError as e:
                self.result.problems.append(f"{e}; the logs end with:\n{self._log_tails()}\n{self._warnings()}")
        if any(not d.ok for d in self.result.diffs):
            self._diagnose()
        for d in self.result.diffs:
            if d.ok:
                continue
            self.result.lost_rows += _count(d.missing) + len(d.changed)
            self.result.duplicate_rows += _count(d.extra)
            self.result.problems.append(f"{d.shape}: {d.error or ''} missing {d.missing[:5]}, extra {d.extra[:5]}, "
                                        f"changed {d.changed[:5]}")
        for name, proc in (("producer", self.producer), ("consumer", self.consumer)):
            if proc.proc.poll() is not None:
                self.result.problems.append(f"{name} exited by itself (code {proc.proc.poll()})")
        history = Counter(i.kind for i in self.result.injections)
        self.say(f"injected: {dict(history)}")


    def _diagnose(self) -> None:
        """After a failed settle: every thread's stack into the processes' logs,
        and into ``diagnosis.txt`` beside them the slot's position, and for a few keys a keyed shape lost, what the
        source holds and every message of that key in the shape's topic (was
        the change never produced, or produced and not applied?)."""
        lines = []
        for proc in (self.producer, self.consumer):
            proc.dump_stacks()
        try:
            with psycopg.connect(self.source_dsn) as conn:
                lines.append("slot (confirmed_flush_lsn, restart_lsn, current): " + repr(conn.execute(
                    "SELECT confirmed_flush_lsn::text, restart_lsn::text, pg_current_wal_lsn()::text "
                    "FROM pg_replication_slots WHERE slot_name = %s", (self.config["source"]["slot"],)).fetchone()))
            for d in self.result.diffs:
                if d.ok or not d.keyed:
                    continue
                keys = [int(k) for e in [*d.missing, *d.changed][:5] for k in re.findall(r"-?\d+", str(e))[:1]]
                records = read_topic(self.broker.bootstrap, f"{PREFIX}.{d.shape}", PREFIX)
                lines.append(f"== {d.shape}: {len(records)} messages in {PREFIX}.{d.shape}")
                with psycopg.connect(self.source_dsn) as conn:
                    for key in keys:
                        column = d.bucket_columns[0] if d.bucket_columns else None
                        if column is not None:
                            lines.append(f"source {d.source_table} {column}={key}: " + repr(conn.execute(
                                f"SELECT * FROM {d.source_table} WHERE {column} = %s", (key,)).fetchall()))
                        for r in records:
                            if r.key is not None and list(r.key.values()) == [key]:
                                lines.append(f"  p{r.partition}@{r.offset} pos {r.position} {r.value}")
        except Exception as e:  # a diagnosis never hides the failure it explains
            lines.append(f"diagnosis failed: {e!r}")
        (self.base / "diagnosis.txt").write_text("\n".join(lines) + "\n")
        self.say(f"diagnosis: {self.base / 'diagnosis.txt'}")


def _count(entries: list) -> int:
    """Rows in a verify list: one per key, or ``row hash H ×N`` (keyless) N."""
    total = 0
    for e in entries:
        m = re.search(r"×(\d+)$", str(e))
        total += int(m.group(1)) if m else 1
    return total
