"""Whose settings the consumer's Spark session takes (spark_consumer/session.py):
walbridge's local defaults where it starts the driver itself, spark-submit's
and spark-defaults.conf's otherwise; Spark's log quiet unless configured or
asked for."""

from __future__ import annotations

import re
import zipfile
from pathlib import Path
from urllib.parse import urlparse

import pyspark
import pytest

from spark_consumer import session

# What only spark-submit and spark-defaults.conf may decide on a cluster.
CLUSTER_OWNED = ("spark.master", "spark.driver.host", "spark.driver.bindAddress", "spark.ui.enabled",
                 "spark.ui.showConsoleProgress", "spark.sql.shuffle.partitions", "spark.driver.defaultJavaOptions",
                 "spark.executor.memory", "spark.pyspark.python", *session.LOCAL_SMALL_QUERIES,
                 *session.INTERPRETED_PROJECTIONS, *session.SCRATCH_CHECKPOINT)


def test_own_driver_keeps_the_local_defaults_and_starts_quiet():
    settings = session.own_driver_settings("local[2]", "file:///x/log4j2-quiet.properties")
    assert settings["spark.driver.host"] == settings["spark.driver.bindAddress"] == "127.0.0.1"
    assert settings["spark.ui.enabled"] == settings["spark.ui.showConsoleProgress"] == "false"
    assert settings["spark.sql.shuffle.partitions"] == "2"
    assert settings["spark.sql.session.timeZone"] == "UTC"
    assert settings["spark.driver.defaultJavaOptions"] == (
        "-XX:TieredStopAtLevel=1 -XX:+UseParallelGC -Dlog4j2.configurationFile=file:///x/log4j2-quiet.properties")
    assert settings["spark.sql.codegen.wholeStage"] == "false" and settings["spark.broadcast.blockSize"] == "256k"
    assert settings["spark.sql.codegen.factoryMode"] == "NO_CODEGEN"


def test_a_driver_whose_target_applies_in_the_jvm_keeps_the_full_jit():
    settings = session.own_driver_settings("local[2]", None, jvm_applies=True)
    java = settings["spark.driver.defaultJavaOptions"]
    assert java == session.DRIVER_JAVA_OPTIONS and session.C1_ONLY not in java
    assert "spark.sql.codegen.factoryMode" not in settings  # a lakehouse MERGE's projections stay generated
    assert not set(session.SCRATCH_CHECKPOINT) & set(settings)  # measured on the PostgreSQL target only


def test_own_driver_without_quieting_leaves_spark_logging_alone():
    assert "log4j" not in session.own_driver_settings("local[*]", None)["spark.driver.defaultJavaOptions"]


def test_own_driver_for_a_cluster_master_sets_nothing_a_cluster_owns_but_the_progress_bar():
    settings = session.own_driver_settings("spark://10.0.0.1:7077", "file:///x/q.properties")
    assert settings == {"spark.ui.showConsoleProgress": "false", "spark.sql.session.timeZone": "UTC",
                        "spark.driver.defaultJavaOptions": "-Dlog4j2.configurationFile=file:///x/q.properties"}
    assert "spark.driver.defaultJavaOptions" not in session.own_driver_settings("yarn", None)


def test_under_spark_submit_only_unset_defaults_are_given_and_none_a_cluster_owns():
    assert session.unset_defaults(set()) == {"spark.sql.session.timeZone": "UTC"}
    assert session.unset_defaults({"spark.sql.session.timeZone", "spark.master"}) == {}
    assert not set(session.DEFAULTS) & set(CLUSTER_OWNED)


@pytest.mark.parametrize(("verbose", "user_log4j", "quiet"),
                         [(False, False, True), (True, False, False), (False, True, False), (True, True, False)])
def test_spark_is_quieted_only_when_nobody_configured_it_and_no_debug_was_asked(verbose, user_log4j, quiet):
    assert session.quiet_spark_logs(verbose, user_log4j) is quiet


def test_the_quiet_profile_ships_with_the_package():
    path = Path(urlparse(session.quiet_log4j_uri()).path)
    text = path.read_text()
    assert "rootLogger.level = warn" in text and "SYSTEM_ERR" in text


def test_own_driver_gets_the_kafka_source_jars_and_a_ui_only_when_asked():
    settings = session.own_driver_settings("local[2,4]", None, ["/j/a.jar", "/j/b.jar"])
    assert settings["spark.jars"] == "/j/a.jar,/j/b.jar" and settings["spark.ui.enabled"] == "false"
    assert session.own_driver_settings("local[2,4]", None, ui=True)["spark.ui.enabled"] == "true"
    assert "spark.ui.enabled" not in session.own_driver_settings("spark://h:7077", None, ["/j/a.jar"], ui=True)


def test_one_spark_version_everywhere_it_is_named():
    """The pyspark pin, jvm/pom.xml's spark.version (the Kafka source's jars)
    and the README's --packages for spark-submit users name the same Spark
    (and, where they add Delta or Iceberg, jvm/pom.xml's)."""
    root = Path(__file__).resolve().parents[2]
    version = pyspark.__version__
    pom = (root / "jvm" / "pom.xml").read_text()
    assert f'"pyspark=={version}"' in (root / "pyproject.toml").read_text()
    assert f"<spark.version>{version}</spark.version>" in pom
    delta = re.search(r"<delta.version>([^<]+)</delta.version>", pom)[1]
    iceberg = re.search(r"<iceberg.version>([^<]+)</iceberg.version>", pom)[1]
    spark_minor = ".".join(version.split(".")[:2])
    readme = (root / "README.md").read_text()
    packages = re.findall(r"--packages (org\.[^\s`]+)", readme)
    assert packages and all(p.startswith(session.SPARK_PACKAGES) for p in packages)
    extra = {c for p in packages for c in p[len(session.SPARK_PACKAGES):].split(",") if c}
    assert extra <= {f"io.delta:delta-spark_2.13:{delta}",
                     f"org.apache.iceberg:iceberg-spark-runtime-{spark_minor}_2.13:{iceberg}"}, extra


def test_a_local_executor_pools_a_kafka_consumer_for_every_topic_partition_read():
    """Spark's pool holds 64 by default: 200 shapes of 4 partitions would
    reopen consumers every batch."""
    assert session.own_driver_settings("local[2]", None, topic_partitions=800)[session.CONSUMER_POOL] == "1600"
    assert session.own_driver_settings("local[2]", None, topic_partitions=5)[session.CONSUMER_POOL] == "64"
    assert session.CONSUMER_POOL not in session.own_driver_settings("spark://h:7077", None, topic_partitions=800)


def test_the_postgresql_target_s_local_driver_writes_its_scratch_checkpoint_without_hadoop_s_processes():
    """The class is named by its path, which Spark has moved between
    versions: it must be in the pinned Spark's jar, or every query fails at
    its start."""
    settings = session.own_driver_settings("local[2]", None)
    assert {k: settings[k] for k in session.SCRATCH_CHECKPOINT} == session.SCRATCH_CHECKPOINT
    manager = session.SCRATCH_CHECKPOINT["spark.sql.streaming.checkpointFileManagerClass"]
    (sql_jar,) = (Path(pyspark.__file__).parent / "jars").glob(f"spark-sql_2.13-{pyspark.__version__}.jar")
    assert manager.replace(".", "/") + ".class" in zipfile.ZipFile(sql_jar).namelist()
    assert not set(session.SCRATCH_CHECKPOINT) & set(session.own_driver_settings("spark://h:7077", None))
