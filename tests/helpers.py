"""Shared helpers for tests on real parts: run the producer, read topics back."""

from __future__ import annotations

import faulthandler
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from confluent_kafka import Consumer, KafkaError, TopicPartition

from schemas import wire
from schemas.config import Config, IcebergConfig, parse_config
from schemas.reader import SchemaResolver
from spark_consumer.supervisor import run
from spark_consumer.targets import delta, iceberg
from tests.cluster import group_processes
from walbridge.runtime import producer_service

LOG_TAIL_LINES = 120  # of a process's log printed when its test fails


def make_config(source_dsn: str, bootstrap: str, prefix: str, shapes: list[dict], **sections: dict) -> dict:
    data: dict[str, Any] = {
        "source": {"dsn": source_dsn, "slot": f"wb_{prefix}".lower()[:63], "publication": f"wb_{prefix}".lower()},
        "kafka": {"bootstrap_servers": bootstrap, "topic_prefix": prefix, "partitions": 3},
        "shapes": shapes,
        "ack": {"consumer_groups": []},
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return data


def both_lake_formats(warehouse: str, catalog: str) -> dict[str, str]:
    """The Spark settings of Delta and of an Iceberg Hadoop catalog ``catalog``
    on ``warehouse``, in one session (a consumer has one target; the lake
    tests and bench run both)."""
    return {**delta.SPARK_SETTINGS, **iceberg.spark_settings(IcebergConfig(warehouse=warehouse, name=catalog)),
            "spark.sql.extensions": f"{delta.SPARK_SETTINGS['spark.sql.extensions']},{iceberg.EXTENSIONS}"}


def write_toml(data: dict, path: Path) -> Path:
    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return str(v)
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'

    lines = []
    for section, body in data.items():
        if section == "shapes":
            continue
        lines.append(f"[{section}]")
        lines += [f"{k} = {value(v)}" for k, v in body.items() if not isinstance(v, dict)]
        for name, table in body.items():  # e.g. [kafka.client]
            if isinstance(table, dict):
                lines.append(f"[{section}.{name}]")
                lines += [f'"{k}" = {value(v)}' for k, v in table.items()]
    for shape in data.get("shapes", []):
        lines.append("[[shapes]]")
        lines += [f"{k} = {value(v)}" for k, v in shape.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def wait_for(predicate: Callable[[], Any], timeout: float = 60.0, interval: float = 0.2, what: str = "condition",
             explain: Callable[[], str] | None = None):
    """``predicate()`` once it is true; on timeout an AssertionError that
    carries ``explain()`` (the state a reader of a failed CI run needs)."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            detail = ""
            if explain is not None:
                try:
                    detail = "\n" + explain()
                except Exception as e:  # the explanation must not hide the timeout
                    detail = f"\n(no explanation: {e!r})"
            raise AssertionError(f"timed out after {timeout}s waiting for {what}{detail}")
        time.sleep(interval)


class ProducerThread:
    """The producer in-process (for tests that need no crash)."""

    def __init__(self, config: Config | dict):
        self.config = config if isinstance(config, Config) else parse_config(config)
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            producer_service(self.config, self.stop)
        except BaseException as e:  # surfaced by __exit__
            self.error = e

    def __enter__(self) -> ProducerThread:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(30)
        assert not self.thread.is_alive(), "producer thread did not stop"
        if self.error is not None and exc[0] is None:
            raise self.error


class ConsumerThread:
    """The Spark consumer in-process (``local[2]``); ``errors`` holds what ended it."""

    def __init__(self, config: Config | dict):
        self.config = config if isinstance(config, Config) else parse_config(config)
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            run(self.config, "local[2]", self.stop)
        except BaseException as e:  # surfaced by the test
            self.errors.append(e)

    def __enter__(self) -> ConsumerThread:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(120)
        if self.thread.is_alive():
            # Left running, its query would hold this process's Spark slots
            # (and stop the next test's session when it ends): say so loudly.
            faulthandler.dump_traceback(sys.stderr)
            if exc[0] is None:
                raise AssertionError("the consumer thread did not stop within 120 s of being asked")


class ProducerProcess:
    """``walbridge producer`` as a real process, for kill -9 tests."""

    def __init__(self, config_path: Path, log_path: Path):
        self.config_path = config_path
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> ProducerProcess:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "walbridge.cli", "producer", "-c", str(self.config_path)],
                                     stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).parent.parent)
        return self

    def kill9(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def dump_stacks(self) -> None:
        """Every thread's stack into its log (SIGUSR1, see walbridge.runtime),
        the process going on: how a process that stopped making progress
        explains itself before a test tears it down."""
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGUSR1)

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"".join(f.readlines()[-lines:]).decode(errors="replace")
        except OSError as e:
            return f"(no log: {e})"

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill9()

    def __enter__(self) -> ProducerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@contextmanager
def stacks_on_failure(*procs: ProducerProcess):
    """A block whose failure first has ``procs`` write every thread's stack
    into their logs (:meth:`ProducerProcess.dump_stacks`)."""
    try:
        yield
    except BaseException:
        for proc in procs:
            proc.dump_stacks()
        time.sleep(2)  # the processes write their dumps on their own time
        for proc in procs:  # onto the test's stdout: what a failed CI run prints
            print(f"--- the last {LOG_TAIL_LINES} lines of {proc.log_path}")
            print(proc.log_tail())
        raise


class ConsumerProcess(ProducerProcess):
    """``walbridge consumer`` as a real process (Spark local mode), in a
    session of its own: ``kill9`` ends the driver and its JVM at once."""

    def start(self) -> ConsumerProcess:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "walbridge.cli", "consumer", "-c", str(self.config_path),
                                      "--master", "local[2]"], stdout=log, stderr=subprocess.STDOUT,
                                     cwd=Path(__file__).parent.parent, start_new_session=True)
        return self

    def kill9(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def dump_stacks(self) -> None:
        """The driver's Python threads and its JVM's (SIGQUIT: a thread dump on
        the JVM's stdout, the same log)."""
        super().dump_stacks()
        if not self.proc or self.proc.poll() is not None:
            return
        for pid, argv in group_processes(self.proc.pid).items():
            if argv[0].endswith("java"):
                try:
                    os.kill(pid, signal.SIGQUIT)
                except OSError:
                    continue


@dataclass
class Record:
    topic: str
    partition: int
    offset: int
    position: tuple[int, int] | None
    control: str | None
    key: Any
    value: Any
    headers: dict


def raw_messages(bootstrap: str, topic: str, timeout: float = 30.0) -> list:
    """Every message of a topic as the broker holds it, in partition/offset order."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"test-read-{time.monotonic_ns()}",
                         "enable.auto.commit": False, "enable.partition.eof": True, "auto.offset.reset": "earliest"})
    try:
        parts = sorted(consumer.list_topics(topic, timeout=10).topics[topic].partitions)
        consumer.assign([TopicPartition(topic, p, 0) for p in parts])
        done: set[int] = set()
        out = []
        deadline = time.monotonic() + timeout
        while len(done) < len(parts):
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading {topic} timed out")
            msg = consumer.poll(1.0)
            if msg is None:
                continue
            if msg.error():
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    done.add(msg.partition())
                    continue
                raise RuntimeError(msg.error())
            out.append(msg)
        out.sort(key=lambda m: (m.partition(), m.offset()))
        return out
    finally:
        consumer.close()


def read_topic(bootstrap: str, topic: str, prefix: str, registry_url: str | None = None,
               timeout: float = 30.0) -> list[Record]:
    """Every message of a topic, decoded, in partition/offset order."""
    resolver = SchemaResolver({"bootstrap.servers": bootstrap}, prefix, registry_url)
    out: list[Record] = []
    for msg in raw_messages(bootstrap, topic, timeout):
        headers = dict(msg.headers() or [])
        pos = headers.get(wire.POSITION_HEADER)
        control = headers.get(wire.CONTROL_HEADER)
        out.append(Record(topic, msg.partition(), msg.offset(), wire.parse_position(pos) if pos else None,
                          control.decode() if control else None, resolver.decode(msg.key()),
                          resolver.decode(msg.value()), headers))
    return out


def wait_snapshot_done(bootstrap: str, topic: str, prefix: str, partitions: int = 3,
                       registry_url: str | None = None) -> None:
    """Until ``topic`` has its ``snapshot_end`` on every partition."""
    wait_for(lambda: sum(r.control == "snapshot_end" for r in read_topic(bootstrap, topic, prefix, registry_url))
             == partitions, what=f"snapshot_end on every partition of {topic}")


def data_records(records: list[Record]) -> list[Record]:
    """The changes: neither control events nor deletes' tombstones."""
    return [r for r in records if r.control is None and r.value is not None]


def latest_rows(records: list[Record], key_fn: Callable[[Record], Any] | None = None) -> dict:
    """Fold a topic into its current rows by key (highest position wins):
    what a consumer applying it would hold."""
    state: dict[Any, tuple] = {}
    for r in data_records(records):
        v = r.value
        if v["op"] == "t":
            state = {k: s for k, s in state.items() if s[0] > r.position}
            continue
        k = key_fn(r) if key_fn else tuple(sorted(r.key.items()))
        if k in state and state[k][0] > r.position:
            continue
        state[k] = (r.position, v["after"] if v["op"] != "d" else None)
    return {k: row for k, (_, row) in state.items() if row is not None}
