"""The consumer's SparkSession: who decides Spark's settings, and how much
Spark says in walbridge's log.

Two ways a driver starts, told apart by ``PYSPARK_GATEWAY_PORT`` (set by
spark-submit for the Python driver it launches):

- **walbridge starts the driver JVM itself** (``walbridge consumer``, ``walbridge
  up``, the tests): :func:`own_driver_settings` applies — the jars of Spark's
  Kafka source and spark-avro from ``.jvm/spark`` (:mod:`schemas.jvm`), no
  console progress bar, Spark's log quiet (:data:`QUIET_LOG4J`) and, in local
  mode (one machine), a loopback driver, no UI unless asked for
  (``walbridge up`` shows its address), few shuffle partitions, a driver JVM
  tuned for many small queries (:data:`DRIVER_JAVA_OPTIONS`,
  :data:`LOCAL_SMALL_QUERIES`; :data:`C1_ONLY`,
  :data:`INTERPRETED_PROJECTIONS` and checkpoint writes that start two
  processes, not five (:data:`SCRATCH_CHECKPOINT`), unless the target applies
  in the JVM), task retries (:func:`local_master`) and a Kafka consumer pool
  that holds a consumer for every topic-partition the query reads
  (:func:`consumer_pool_size`).
- **spark-submit started it** (:mod:`walbridge.spark_submit`, on a cluster or
  not): master, driver host and bind address, UI, shuffle, memory, Python,
  jars (``--packages``) — everything comes from spark-submit's flags and
  ``spark-defaults.conf``; walbridge sets only :data:`DEFAULTS` keys those
  left unset, and fails at once, naming the ``--packages`` to add, when
  Spark's Kafka source is not on the classpath; a consumer pool smaller than
  the topic-partitions read is a warning naming the ``--conf`` to add.

Invariants:
- Under spark-submit no setting given by spark-submit or spark-defaults.conf is
  overridden, and walbridge sets no master, host, bind address, UI or shuffle
  setting at all.
- Spark's logging is walbridge's to quiet only where nobody configured it: a
  log4j2 file in Spark's conf dir or ``-Dlog4j2.configurationFile`` wins; with
  ``--log-level debug`` Spark keeps its own (INFO) defaults.
- A task that fails in local mode (a Python worker slow to connect back on a
  loaded machine) is retried, as on a cluster, instead of failing its batch.
- Executors run ``spark.pyspark.python`` when it is set (a packed environment,
  ``walbridge pack``), else the driver's own interpreter path
  (``PYSPARK_PYTHON``).
"""

from __future__ import annotations

import logging
import os
import re
import sys
from importlib import resources
from pathlib import Path
from typing import Collection, Mapping

import pyspark
from pyspark.sql import SparkSession

from schemas.jvm import MissingJars, jvm_jars

log = logging.getLogger("walbridge.consumer")

APP_NAME = "walbridge-consumer"
# Where walbridge starts a local driver JVM (bench/RESULTS.md): the throughput
# collector, since G1 took each stage's broadcast task binary as humongous allocations.
DRIVER_JAVA_OPTIONS = "-XX:+UseParallelGC"
# ...and C1 only when the target applies outside the JVM (PostgreSQL): the JVM's
# share of a batch is small there, and C2's long warm-up takes the cores from the
# Python workers; a lakehouse MERGE runs in the JVM, where C2's code is the faster.
C1_ONLY = "-XX:TieredStopAtLevel=1"
# A local driver runs many small queries per batch (a lake MERGE's are Delta's
# and Iceberg's own): compiling each new plan whole costs more than it saves,
# and task binaries broadcast in small blocks are ordinary allocations.
LOCAL_SMALL_QUERIES = {"spark.sql.codegen.wholeStage": "false", "spark.broadcast.blockSize": "256k"}
# ...and, with C1_ONLY, rows converted by interpreted projections: Spark's Kafka
# source builds a new projection for every topic-partition of every batch, and
# generating its Java source again each time (the compiled class is cached) is
# most of a partition's read (bench/RESULTS.md: 200 shapes' batch read halved).
# Spark calls the setting internal; its interpreted path is the one Spark falls
# back to, and the one its own tests run beside the generated one.
INTERPRETED_PROJECTIONS = {"spark.sql.codegen.factoryMode": "NO_CODEGEN"}
# The query's checkpoint is scratch (removed at every start; the target's
# progress is the record), written twice a batch. Through Hadoop's FileContext,
# each write starts ~5 processes (readlink, chmod: Hadoop shells out where its
# native library is missing), 0.1-0.3 s a batch on busy cores; through
# FileSystem, two (chmod of the file and of its checksum).
SCRATCH_CHECKPOINT = {
    "spark.sql.streaming.checkpointFileManagerClass":
        "org.apache.spark.sql.execution.streaming.checkpointing.FileSystemBasedCheckpointFileManager",
}
QUIET_LOG4J = "log4j2-quiet.properties"  # in this package: warnings and errors, one line each
SPARK_DEFAULT_LOG4J = "org/apache/spark/log4j2-defaults.properties"  # Spark's built-in profile
_LOG4J_FILES = ("log4j2.properties", "log4j2.xml", "log4j2.yaml", "log4j2.yml", "log4j2.json")

# Given to Spark in either case unless already set: UTC makes Arrow hand the
# apply timestamps it converts without a zone lookup (any zone is correct).
DEFAULTS = {"spark.sql.session.timeZone": "UTC"}
# Attempts of a task in local mode, as spark.task.maxFailures' default on a cluster.
LOCAL_TASK_ATTEMPTS = 4
KAFKA_SOURCE_CLASS = "org.apache.spark.sql.kafka010.KafkaSourceProvider"
# What spark-submit users add (the versions jvm/pom.xml pins; README, "Running on a Spark cluster").
SPARK_PACKAGES = ("org.apache.spark:spark-sql-kafka-0-10_2.13:{v},org.apache.spark:spark-avro_2.13:{v}"
                  .format(v=pyspark.__version__))
_LOCAL = re.compile(r"local(?:\[(\d+|\*)\])?")
# Spark's Kafka source keeps one cached consumer per (group, topic-partition)
# in each executor, 64 by default; past that every read closes one and opens
# another (a connection, metadata, a "Pool exceeds its soft max size" line).
CONSUMER_POOL = "spark.kafka.consumer.cache.capacity"
CONSUMER_POOL_DEFAULT = 64


def launched_by_spark_submit() -> bool:
    """Is this Python process the driver spark-submit launched (its JVM is up)?"""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def local_master(master: str) -> str:
    """A local master whose failed tasks are retried (``local[N]`` ->
    ``local[N,F]``); any other master as it is."""
    m = _LOCAL.fullmatch(master)
    return f"local[{m.group(1) or 1},{LOCAL_TASK_ATTEMPTS}]" if m else master


def consumer_pool_size(topic_partitions: int) -> int:
    """Spark's Kafka consumer pool for a query over ``topic_partitions``: one
    each, twice over (a restarted query reads under a new group id while the
    old one's consumers wait out their idle timeout)."""
    return max(CONSUMER_POOL_DEFAULT, 2 * topic_partitions)


def own_driver_settings(master: str, quiet_log4j_uri: str | None, jars: list[str] = (), ui: bool = False,
                        topic_partitions: int = 0, jvm_applies: bool = False) -> dict[str, str]:
    """Settings where walbridge starts the driver JVM; with ``quiet_log4j_uri``,
    Spark logs through that log4j2 file from its first line; ``jars``: what
    Spark lacks (the Kafka source); ``ui``: a local driver keeps its web UI;
    ``topic_partitions``: what the query reads (a local executor's consumer pool);
    ``jvm_applies``: the target's apply runs in the JVM (no :data:`C1_ONLY`).
    User ``extraJavaOptions`` come after the default ones and win. A master
    that is not local gets no host, UI or shuffle setting (Spark's and
    spark-defaults.conf's apply, as under spark-submit)."""
    local = master.startswith("local")
    java = ([DRIVER_JAVA_OPTIONS] if jvm_applies else [C1_ONLY, DRIVER_JAVA_OPTIONS]) if local else []
    if quiet_log4j_uri:
        java.append(f"-Dlog4j2.configurationFile={quiet_log4j_uri}")
    settings = {"spark.ui.showConsoleProgress": "false", **DEFAULTS}  # the bar is on for a Python-launched driver
    if jars:
        settings["spark.jars"] = ",".join(jars)
    if java:
        settings["spark.driver.defaultJavaOptions"] = " ".join(java)
    if local:
        settings.update({
            "spark.driver.host": "127.0.0.1",  # one machine: stay on loopback
            "spark.driver.bindAddress": "127.0.0.1",
            "spark.ui.enabled": "true" if ui else "false",
            "spark.sql.shuffle.partitions": "2",
            CONSUMER_POOL: str(consumer_pool_size(topic_partitions)),
            **LOCAL_SMALL_QUERIES,
            **({} if jvm_applies else {**INTERPRETED_PROJECTIONS, **SCRATCH_CHECKPOINT}),
        })
    return settings


def unset_defaults(set_by_user: Collection[str]) -> dict[str, str]:
    """Under spark-submit: the :data:`DEFAULTS` it and spark-defaults.conf left unset."""
    return {k: v for k, v in DEFAULTS.items() if k not in set_by_user}


def quiet_spark_logs(verbose: bool, user_log4j: bool) -> bool:
    """Should walbridge quiet Spark's log? Not when asked for debug output, and
    never over a log4j2 configuration someone made."""
    return not verbose and not user_log4j


def quiet_log4j_uri() -> str:
    return Path(str(resources.files("spark_consumer").joinpath(QUIET_LOG4J))).as_uri()


def _conf_dir_has_log4j() -> bool:
    """A log4j2 file in Spark's conf dir (``SPARK_CONF_DIR``, else ``$SPARK_HOME/conf``)."""
    home = os.environ.get("SPARK_HOME") or os.path.dirname(pyspark.__file__)  # pip's pyspark is a Spark home
    conf_dir = os.environ.get("SPARK_CONF_DIR") or os.path.join(home, "conf")
    return any(os.path.isfile(os.path.join(conf_dir, name)) for name in _LOG4J_FILES)


def _verbose() -> bool:
    return logging.getLogger("walbridge").isEnabledFor(logging.DEBUG)


def spark_session(master: str | None = None, ui: bool = False, target_settings: Mapping[str, str] | None = None,
                  topic_partitions: int = 0, jvm_applies: bool = False) -> SparkSession:
    """The session (see the module's docstring for whose settings apply);
    ``target_settings``: what the target needs (Delta's SQL extension), set
    where walbridge starts the driver and checked under spark-submit;
    ``topic_partitions``: how many the query reads; ``jvm_applies``: the
    target applies in the JVM (a lakehouse)."""
    # Python workers run this interpreter unless spark.pyspark.python names
    # another (spark-submit exports that as PYSPARK_PYTHON).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    if launched_by_spark_submit():
        builder = SparkSession.builder
        if master:
            builder = builder.master(master)
        spark = builder.getOrCreate()
        for key, value in unset_defaults({k for k, _ in spark.sparkContext.getConf().getAll()}).items():
            spark.conf.set(key, value)
        # Spark's start-up lines are out by now (Spark re-applies its built-in
        # profile when the context starts); what follows is quiet.
        jvm = spark.sparkContext._jvm  # log4j is reachable only through the gateway
        location = jvm.org.apache.logging.log4j.LogManager.getContext(False).getConfiguration() \
            .getConfigurationSource().getLocation()
        quiet = quiet_spark_logs(_verbose(), user_log4j=not str(location or "").endswith(SPARK_DEFAULT_LOG4J))
        if quiet:
            jvm.org.apache.logging.log4j.core.config.Configurator.reconfigure(jvm.java.net.URI(quiet_log4j_uri()))
        loader = jvm.java.lang.Thread.currentThread().getContextClassLoader()
        try:
            jvm.java.lang.Class.forName(KAFKA_SOURCE_CLASS, False, loader)
        except Exception:  # noqa: BLE001 - Py4J's error for a missing class
            spark.stop()
            raise MissingJars(f"Spark's Kafka source is not on the classpath: start spark-submit with "
                              f"--packages {SPARK_PACKAGES}") from None
        conf = spark.sparkContext.getConf()
        missing = {k: v for k, v in (target_settings or {}).items() if v not in (conf.get(k) or "")}
        if missing:
            spark.stop()
            raise MissingJars("the target needs " + " ".join(
                f"--conf {k}={'<password>' if k.endswith('password') else v}" for k, v in missing.items())
                + " on spark-submit's command line")
        pool = int(conf.get(CONSUMER_POOL, str(CONSUMER_POOL_DEFAULT)))
        if pool < topic_partitions:
            log.warning("Spark's Kafka consumer pool holds %d consumers and the query reads %d topic-partitions: "
                        "each batch reopens consumers; add --conf %s=%d to spark-submit", pool, topic_partitions,
                        CONSUMER_POOL, consumer_pool_size(topic_partitions))
    else:
        quiet = quiet_spark_logs(_verbose(), user_log4j=_conf_dir_has_log4j())
        master = local_master(master or "local[*]")
        jars = [str(j) for j in jvm_jars("spark")]
        builder = SparkSession.builder.appName(APP_NAME).master(master)
        settings = {**own_driver_settings(master, quiet_log4j_uri() if quiet else None, jars, ui, topic_partitions,
                                          jvm_applies),
                    **(target_settings or {})}
        for key, value in settings.items():
            builder = builder.config(key, value)
        spark = builder.getOrCreate()
    if quiet:
        logging.getLogger("py4j").setLevel(logging.WARNING)  # the gateway's own INFO lines
    return spark
