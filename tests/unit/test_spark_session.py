"""Whose settings the consumer's Spark session takes (spark_consumer/session.py):
walbridge's local defaults where it starts the driver itself, spark-submit's
and spark-defaults.conf's otherwise; Spark's log quiet unless configured or
asked for; the apply path by deploy mode."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

import pytest

from schemas.config import parse_config
from spark_consumer import session
from spark_consumer.job import ShapeApplier

# What only spark-submit and spark-defaults.conf may decide on a cluster.
CLUSTER_OWNED = ("spark.master", "spark.driver.host", "spark.driver.bindAddress", "spark.ui.enabled",
                 "spark.ui.showConsoleProgress", "spark.sql.shuffle.partitions", "spark.driver.defaultJavaOptions",
                 "spark.executor.memory", "spark.pyspark.python")


def test_own_driver_keeps_the_local_defaults_and_starts_quiet():
    settings = session.own_driver_settings("local[2]", "file:///x/log4j2-quiet.properties")
    assert settings["spark.driver.host"] == settings["spark.driver.bindAddress"] == "127.0.0.1"
    assert settings["spark.ui.enabled"] == settings["spark.ui.showConsoleProgress"] == "false"
    assert settings["spark.sql.shuffle.partitions"] == "2"
    assert settings["spark.sql.session.timeZone"] == "UTC"
    assert settings["spark.driver.defaultJavaOptions"] == (
        "-XX:TieredStopAtLevel=1 -Dlog4j2.configurationFile=file:///x/log4j2-quiet.properties")


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


@pytest.mark.parametrize(("master", "staged"), [("local", False), ("local[*]", False), ("local[2]", False),
                                                ("spark://10.0.0.1:7077", True), ("yarn", True),
                                                ("k8s://https://api:443", True)])
def test_staged_apply_is_the_default_on_a_cluster_only(master, staged):
    assert session.staged_apply_default(master) is staged


@pytest.mark.parametrize(("configured", "by_mode", "staged"),
                         [(None, True, True), (None, False, False), (False, True, False), (True, False, True)])
def test_the_config_decides_the_apply_path_when_set(configured, by_mode, staged):
    data = {"source": {"dsn": "postgresql://a@127.0.0.1:1/a"}, "kafka": {"bootstrap_servers": "127.0.0.1:1"},
            "shapes": [{"table": "public.t"}], "consumer": {"target_dsn": "postgresql://a@127.0.0.1:1/b"}}
    if configured is not None:
        data["consumer"]["staged_apply"] = configured
    cfg = parse_config(data)
    applier = ShapeApplier(cfg, cfg.shapes[0], None, {}, staged=by_mode)  # no target needed before a batch
    try:
        assert applier.staged is staged
    finally:
        applier.close()
