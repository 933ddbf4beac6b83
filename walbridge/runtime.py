"""What every walbridge process does around its data path: logging, stopping
on signals, the metrics endpoint, and the optional Spark extra.

Invariants:
- Log records go to stderr, one line each, as text or as one JSON object per
  line (``--log-format json``).
- SIGINT and SIGTERM set a stop event; the data paths wind down from it.
- At most one metrics endpoint per process (a process running both the
  producer and the consumer, as ``up`` does, serves the first port asked for).
- The Spark consumer is an optional extra: asking for it without pyspark
  installed raises :class:`MissingExtra`, whose message says how to install it.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
import time
from types import ModuleType
from typing import Callable

from prometheus_client import start_http_server

from producer.pipeline import run_producer
from schemas.config import Config

SPARK_EXTRA = "pip install 'walbridge[spark]'"

log = logging.getLogger("walbridge")


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


def setup_logging(fmt: str = "text", level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def stop_on_signals() -> threading.Event:
    stop = threading.Event()

    def handler(signum, frame):
        log.info("received %s, stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    return stop


_metrics_port: int | None = None


def serve_metrics(port: int | None) -> None:
    """Expose /metrics on ``port`` (once per process; 0 or None: off)."""
    global _metrics_port
    if port and _metrics_port is None:
        start_http_server(port, addr="0.0.0.0")
        _metrics_port = port


def spark_job() -> ModuleType:
    """:mod:`spark_consumer.job`, or :class:`MissingExtra` without pyspark."""
    try:
        import pyarrow  # noqa: F401  (optional extra: spark)
        import pyspark  # noqa: F401  (optional extra: spark)
    except ImportError as e:
        raise MissingExtra(f"the Spark consumer needs the spark extra ({e.name} is missing): "
                           f"{SPARK_EXTRA}") from None
    from spark_consumer import job  # optional extra: pyspark

    return job


def producer_service(config: Config, stop: threading.Event | None = None,
                     on_status: Callable[[dict], None] | None = None) -> None:
    """The producer with its metrics endpoint, until ``stop``."""
    serve_metrics(config.metrics.port)
    run_producer(config, stop, on_status)


def consumer_service(config: Config, master: str | None, stop: threading.Event | None = None,
                     appliers: list | None = None) -> None:
    """The Spark consumer with its metrics endpoint, until ``stop``."""
    job = spark_job()
    serve_metrics(config.metrics.consumer_port)
    job.run(config, master, stop, appliers)
