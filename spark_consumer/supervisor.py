"""The Spark consumer's run loop: its one query (:mod:`spark_consumer.query`)
started, watched and restarted until ``stop`` is set.

    spark-submit walbridge/spark_submit.py -c walbridge.toml   # production (README: on a cluster)
    walbridge consumer -c walbridge.toml                       # the same, local[*]

The session and whose settings it takes: :mod:`spark_consumer.session`.

Invariants:
- Every start and restart of the query begins at the target's progress
  (:func:`spark_consumer.query.start_query`): a restart is always safe, and
  costs at most the batches read but not yet committed.
- The query is restarted at once when its applier asks for it (a shape held
  back, :attr:`~spark_consumer.query.BatchApplier.needs_restart`; a topic
  recreated while it ran, unless ``[consumer] on_data_loss = "stop"``: then
  the consumer ends); held shapes stay held until the consumer next starts.
- A failed query (an apply error, a Spark task that failed all its attempts)
  is restarted, unless Spark's Kafka source found data lost with
  ``[consumer] on_data_loss = "stop"`` (the consumer ends): an unreachable broker, registry or target (a transient
  :class:`~schemas.failures.Failure`) after a jittered exponential backoff
  (:mod:`schemas.retry`), saying what it waits for, up to ``[consumer]
  reconnect_max_elapsed`` (default: forever); a refusal (the target's login,
  Kafka credentials or ACLs) ends the consumer at once; anything else is
  restarted :data:`QUERY_RESTARTS` times in :data:`QUERY_FAILURE_WINDOW`,
  then ends it.
- The query is stopped only while its foreachBatch is outside Spark
  (:mod:`spark_consumer.pipelined`), and at shutdown the batch in hand gets
  :data:`SETTLE_S` to be handed over. A signal to the whole process group
  (Ctrl-C, a service manager) reaches Spark's JVM too, whose shutdown hook may
  stop Spark first: the query is then stopped already, and the shutdown is a
  clean one (the target's progress is whole; nothing was committed after it).
"""

from __future__ import annotations

import gc
import logging
import re
import threading
import time

import psycopg
from py4j.protocol import Py4JError, Py4JNetworkError
from pyspark.errors import StreamingQueryException

from schemas.config import Config, ConfigError
from schemas.failures import KAFKA, TARGET, Failure, attributed, classify, classify_text
from schemas.java_client import java_client_options
from schemas.kafka import client_config
from schemas.retry import Outage, RetryPolicy
from spark_consumer.query import BatchApplier, start_query
from spark_consumer.session import spark_session
from spark_consumer.shape_schemas import Stopped
from spark_consumer.targets import target_spark_settings

log = logging.getLogger("walbridge.consumer")

QUERY_RESTARTS = 5  # failures of the query tolerated within QUERY_FAILURE_WINDOW (transient ones aside)
QUERY_FAILURE_WINDOW = 600.0
SETTLE_S = 10.0  # at shutdown: how long the batch in hand may take
WATCH_S = 1.0  # how often the loop looks at the query
SPARK_DATA_LOSS = "KAFKA_DATA_LOSS"  # Spark's error class when failOnDataLoss finds offsets gone


def reach_target(config: Config, stop: threading.Event | None = None) -> None:
    """Connect to a PostgreSQL target once before Spark starts: a refused
    password or an unknown database ends the consumer in seconds, an
    unreachable target is waited for."""
    if not config.consumer.has_target:
        raise ConfigError(['consumer.target_dsn: is required by the consumer (the database to apply to), unless '
                           'target = "delta" or "iceberg" names a lakehouse'])
    if config.consumer.target_kind != "postgresql":
        return
    for attempt in Outage(RetryPolicy.of(config.consumer), stop, log):
        with attempt, attributed(database=(TARGET, config.consumer.target_dsn)):
            psycopg.connect(config.consumer.target_dsn, connect_timeout=10).close()


def headline(error: BaseException) -> str:
    """The line of an error that says what went wrong, for a log line
    (Spark's and libpq's run long): the raised exception of a Python
    traceback Spark wraps, else the first line."""
    lines = str(error).strip().splitlines() or ["?"]
    if "Traceback (most recent call last)" in lines[0]:
        raised = [line for line in lines if _RAISED.match(line)]
        if raised:
            return raised[-1][:300]
    return lines[0][:300]


# A Python traceback's last line: "module.Name: message" or "SomeError: message"
# (not the "Identifier: ..." lines Spark appends about the query).
_RAISED = re.compile(r"(?:[A-Za-z_]\w*\.)+[A-Za-z_]\w*: |[A-Za-z_]\w*(?:Error|Exception|Exit): ")


def query_failure(config: Config, error: BaseException) -> Failure | None:
    """A failed query's error as a Failure of its endpoint: raised in the
    apply thread (an exception), or in a Spark task (recognised in its text);
    None when it is neither (counted against ``QUERY_RESTARTS``)."""
    failure = classify(error, database=(TARGET, config.consumer.target_dsn or config.consumer.target_path), kafka=config.kafka.bootstrap_servers,
                       registry=config.kafka.schema_registry_url)
    return failure if failure is not None else classify_text(str(error))


def _wait(stop: threading.Event | None, seconds: float) -> bool:
    """Sleep; True when ``stop`` was set meanwhile."""
    if stop is None:
        time.sleep(seconds)
        return False
    return stop.wait(seconds)


def run(config: Config, master: str | None = None, stop: threading.Event | None = None,
        appliers: list | None = None, ui: bool = False) -> None:
    """Run the query until ``stop`` is set or it fails for good; ``appliers``
    (if given) receives the applier of each run of the query (for counters
    and the query's progress); ``ui``: a local driver keeps Spark's web UI."""
    reach_target(config, stop)
    source_options = java_client_options(config.kafka.bootstrap_servers, config.kafka.client)
    if stop is not None and stop.is_set():
        return
    kafka_conf = client_config(config.kafka.bootstrap_servers, config.kafka.client)
    spark = spark_session(master, ui, target_spark_settings(config),
                          topic_partitions=len(config.shapes) * config.kafka.partitions,
                          jvm_applies=config.consumer.is_lakehouse)
    policy = RetryPolicy.of(config.consumer)
    held: dict[str, str] = {}
    failures: list[float] = []  # when each failure that was not an outage happened
    outages: list[float] = []  # when each transient failure in a row happened
    query = applier = None
    # What lives as long as the run (the modules, Spark's and py4j's objects)
    # is kept out of the collector's full passes: each batch's rows set them
    # off, and walking it all cost ~70 ms a 50,000-row batch (bench/RESULTS.md).
    gc.collect()
    gc.freeze()
    try:
        while not (stop and stop.is_set()):
            query, applier = start_query(spark, config, kafka_conf, source_options, stop, held)
            if appliers is not None:
                appliers.append(applier)
            if query is None:  # every shape held back
                while not _wait(stop, WATCH_S):
                    pass
                return
            delay = _watch(config, query, applier, stop, policy, failures, outages)
            held = dict(applier.held)
            _stop_query(query, applier, SETTLE_S)
            query = applier = None
            if delay is None or _wait(stop, delay):
                return
    except Stopped:
        return
    finally:
        _stop_query(query, applier, SETTLE_S)
        _stop_unless_stopped(spark)
        gc.unfreeze()


def _watch(config: Config, query, applier: BatchApplier, stop: threading.Event | None, policy: RetryPolicy,
           failures: list[float], outages: list[float]) -> float | None:
    """Until the query must be restarted (returns the wait before the
    restart) or ``stop`` is set (None); raises what ends the consumer."""
    while not (stop and stop.is_set()):
        error = None
        if query.isActive:
            # An apply runs after its foreachBatch returned; when it fails and
            # no batch follows to raise it, the query is stopped here.
            error = applier.error
            if error is None and applier.needs_restart:
                if applier.recreated and config.consumer.on_data_loss == "stop":
                    raise Failure(KAFKA, f"Kafka lost data: {'; '.join(sorted(applier.recreated.values()))}",
                                  'set [consumer] on_data_loss = "follow" to read recreated topics from their start',
                                  address=config.kafka.bootstrap_servers)
                log.info("restarting the query (%s)", "; ".join(
                    [f"{applier.states[t].name}: {why}" for t, why in sorted(applier.recreated.items())]
                    + [f"shape {applier.states[t].name} held back" for t in applier.reading if t in applier.held]))
                return 0.0
            if error is None:
                if outages and query.lastProgress is not None:
                    outages.clear()  # batches flow again
                applier.retry_commits()
                try:
                    query.awaitTermination(WATCH_S)
                except StreamingQueryException:
                    pass  # read below
                continue
            if not applier.quiesce():
                _wait(stop, 0.1)
                continue  # the batch being read raises the error and ends the query
            query.stop()
        elif query.exception() is None:
            return None  # stopped from outside
        failure = error or query.exception()
        return _restart_delay(config, failure, policy, failures, outages)
    return None


def _restart_delay(config: Config, failure: BaseException, policy: RetryPolicy, failures: list[float],
                   outages: list[float]) -> float:
    """How long to wait before restarting a failed query, or raise what ends
    the consumer (module docstring)."""
    now = time.monotonic()
    if config.consumer.on_data_loss == "stop" and SPARK_DATA_LOSS in str(failure):
        raise Failure(KAFKA, f"Kafka lost data the consumer had not read ({headline(failure)})",
                      'set [consumer] on_data_loss = "follow" to read on by position',
                      address=config.kafka.bootstrap_servers) from failure
    verdict = query_failure(config, failure)
    if verdict is not None and verdict.permanent and (isinstance(failure, psycopg.OperationalError)
                                                      or verdict.endpoint == KAFKA):
        raise verdict from failure  # refused (target login, Kafka credentials or ACLs): no restart helps
    if verdict is not None and not verdict.permanent:
        outages.append(now)
        elapsed = now - outages[0]
        if policy.max_elapsed and elapsed > policy.max_elapsed:
            log.error("the query failed: %s; giving up after %.0fs (reconnect_max_elapsed)", verdict.headline,
                      elapsed)
            raise verdict from failure
        delay = policy.delay(len(outages))
        log.warning("the query failed: %s; restarting it from the target's progress in %.1fs (failing for %.0fs)",
                    verdict.headline, delay, elapsed)
        return delay
    failures[:] = [t for t in failures if now - t < QUERY_FAILURE_WINDOW] + [now]
    if len(failures) > QUERY_RESTARTS:
        log.error("the query failed %d times in %.0fs", len(failures), QUERY_FAILURE_WINDOW)
        if verdict is not None:
            raise verdict from failure
        raise RuntimeError(f"the query failed {len(failures)} times in {QUERY_FAILURE_WINDOW:.0f}s; last: {failure}")
    delay = min(2.0 ** len(failures), 30.0)
    log.error("the query failed (%s); restarting it from the target's progress in %.0fs", headline(failure), delay)
    return delay


def _stop_query(query, applier: BatchApplier | None, timeout: float) -> None:
    """Stop the query once its applier holds no batch being read (within
    ``timeout``), then finish the batch being applied and release its clients."""
    if applier is not None:
        applier.settle(timeout)
    if query is not None and not _stop_unless_stopped(query):
        log.info("Spark was stopped already (its JVM had the signal too)")
    if applier is not None:
        applier.close()


def _stop_unless_stopped(spark_object) -> bool:
    """``spark_object.stop()`` (a query, the session); False when Spark's JVM
    had stopped its context already, or is gone (module docstring)."""
    try:
        spark_object.stop()
    except Py4JError as e:
        if isinstance(e, Py4JNetworkError) or "stopped SparkContext" in str(e):
            return False
        raise
    return True
