"""What every walbridge process does around its data path: logging, stopping
on signals, the error boundary and exit codes, the metrics endpoint, and the
optional Spark extra.

Invariants:
- Log records go to stderr, one line each, as text or as one JSON object per
  line (``--log-format json``); librdkafka's records too (through
  :data:`schemas.kafka.LIBRDKAFKA_LOG`).
- SIGINT and SIGTERM set a stop event; the data paths wind down from it and
  the command exits 130 or 143. A second signal stops at once.
- Every command runs inside :func:`run_command`, its error boundary: an
  expected failure (config, source, Kafka or registry, target) is reported in
  one or two lines naming the endpoint (DSN redacted), the problem and the
  fix, and the command exits with that endpoint's code (:data:`EXIT_CODES`);
  a traceback is shown only with ``--log-level debug``. Anything else is a
  bug: its traceback is shown and the exit code is 70.
- At most one metrics endpoint per process (a process running both the
  producer and the consumer, as ``up`` does, serves the first port asked for).
- The Spark consumer is an optional extra: asking for it without pyspark
  installed raises :class:`MissingExtra`, whose message says how to install it.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import platform
import signal
import sys
import threading
import time
import traceback
from importlib import metadata
from types import ModuleType
from typing import Callable

import confluent_kafka
from prometheus_client import Info, start_http_server

from producer.pipeline import run_producer
from schemas.config import Config, ConfigError
from schemas.failures import CONFIG, KAFKA, REGISTRY, SOURCE, TARGET, Failure, classify
from schemas.jvm import MissingJars

SPARK_EXTRA = "pip install 'walbridge[spark]'"

log = logging.getLogger("walbridge")

EXIT_OK = 0
EXIT_DIFFERENCES = 1  # verify/reconcile found differences; a backfill or pack did not complete
EXIT_USAGE = 2  # bad command line or config
EXIT_CODES = {CONFIG: EXIT_USAGE, SOURCE: 3, KAFKA: 4, REGISTRY: 4, TARGET: 5}
EXIT_BUG = 70  # an unexpected error: a bug in walbridge (sysexits' EX_SOFTWARE)
EXIT_SIGNAL = 128  # + the signal's number: 130 SIGINT, 143 SIGTERM


def version() -> str:
    try:
        return metadata.version("walbridge")
    except metadata.PackageNotFoundError:
        return "unknown"


BUILD_INFO = Info("walbridge_build", "walbridge's version and what it runs on")
BUILD_INFO.info({"version": version(), "python": platform.python_version(),
                 "librdkafka": confluent_kafka.libversion()[0], "confluent_kafka": confluent_kafka.version()[0]})


class MissingExtra(RuntimeError):
    """An optional part of walbridge is not installed."""


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
               "level": record.levelname.lower(), "logger": record.name, "msg": record.getMessage()}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


TEXT_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_log_format = "text"


def setup_logging(fmt: str = "text", level: str = "INFO") -> None:
    global _log_format
    _log_format = fmt
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


class Stop(threading.Event):
    """Set by SIGINT or SIGTERM; ``signum`` says which."""

    signum: int | None = None

    def exit_code(self) -> int:
        return EXIT_SIGNAL + self.signum if self.signum else EXIT_OK


def stop_on_signals() -> Stop:
    stop = Stop()

    def handler(signum, frame):
        if stop.is_set():
            raise SystemExit(EXIT_SIGNAL + signum)  # asked twice: stop now
        log.info("received %s, stopping", signal.Signals(signum).name)
        stop.signum = signum
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    # SIGUSR1: every thread's stack on stderr, the process going on (a stuck
    # process explains itself, as a JVM does on SIGQUIT).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    return stop


def as_failure(error: BaseException) -> Failure | None:
    """The expected failure ``error`` stands for, or None (a bug)."""
    if isinstance(error, ConfigError):
        return Failure(CONFIG, str(error))
    if isinstance(error, (MissingExtra, MissingJars)):
        return Failure(CONFIG, str(error))
    return classify(error)


def report(failure: Failure, error: BaseException | None = None, debug: bool = False) -> None:
    """One or two lines on stderr (one JSON record with ``--log-format json``)."""
    text = failure.problem if failure.endpoint == CONFIG else str(failure)
    if _log_format == "json":
        log.error("%s", text, exc_info=error if debug else None)
        return
    print(f"walbridge: {text}", file=sys.stderr)
    if debug and error is not None:
        traceback.print_exception(error, file=sys.stderr)


def run_command(command: Callable[[], int], debug: bool = False) -> int:
    """A command inside the error boundary: its exit code, or the code of the
    failure that ended it (reported as :func:`report` says)."""
    try:
        return command()
    except KeyboardInterrupt:
        return EXIT_SIGNAL + signal.SIGINT
    except Exception as error:  # noqa: BLE001 - this is the boundary
        failure = as_failure(error)
        if failure is None:
            log.critical("internal error (a bug in walbridge %s; please report it with this traceback)",
                         version(), exc_info=error)
            return EXIT_BUG
        report(failure, error, debug)
        return EXIT_CODES.get(failure.endpoint, EXIT_BUG)


_metrics_port: int | None = None


def serve_metrics(port: int | None) -> None:
    """Expose /metrics on ``port`` (once per process; 0 or None: off)."""
    global _metrics_port
    if port and _metrics_port is None:
        start_http_server(port, addr="0.0.0.0")
        _metrics_port = port


def spark_job() -> ModuleType:
    """:mod:`spark_consumer.supervisor`, or :class:`MissingExtra` without pyspark."""
    try:
        import pyarrow  # noqa: F401  (optional extra: spark)
        import pyspark  # noqa: F401  (optional extra: spark)
    except ImportError as e:
        raise MissingExtra(f"the Spark consumer needs the spark extra ({e.name} is missing): "
                           f"{SPARK_EXTRA}") from None
    from spark_consumer import supervisor  # optional extra: pyspark

    return supervisor


def producer_service(config: Config, stop: threading.Event | None = None,
                     on_status: Callable[[dict], None] | None = None) -> None:
    """The producer with its metrics endpoint, until ``stop``."""
    serve_metrics(config.metrics.port)
    run_producer(config, stop, on_status)


def consumer_service(config: Config, master: str | None, stop: threading.Event | None = None,
                     appliers: list | None = None, ui: bool = False) -> None:
    """The Spark consumer with its metrics endpoint, until ``stop``."""
    job = spark_job()
    serve_metrics(config.metrics.consumer_port)
    job.run(config, master, stop, appliers, ui)
