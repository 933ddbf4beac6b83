"""The consumer on a real Spark cluster, started as the README says.

Topology (``tests/cluster.py``): a network namespace is the second host. On
this host, listening on our end of the veth pair: PostgreSQL (source and
target), the Apache Kafka broker, the Spark standalone master, the producer and the
consumer's driver (spark-submit, client mode). Inside the namespace: the Spark
worker and its executors. The consumer's Python environment reaches the
executors only as the README ships it: ``walbridge pack``, then
``spark-submit --archives ...#env`` with ``spark.pyspark.python=./env/bin/python``;
the worker's own environment names no Python of ours.

Servers, cluster and archive are shared by the module's tests; each test has
its own databases, topics and consumer application. A Delta target's folder
or an Iceberg warehouse is in the test's run dir: the namespace shares this
host's file system, as a cluster shares an object store.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from pathlib import Path

import psycopg
import pytest

from tests.cluster import (
    ROOT,
    NetworkNamespace,
    SparkStandalone,
    cmdline,
    group_processes,
    mapped_files,
    namespaces_unavailable,
    readme_commands,
    user_env,
)
from tests.helpers import ProducerThread, wait_for, write_toml
from tests.pipeline import (
    FEW_ACCOUNTS,
    applying,
    caught_up,
    data_files,
    e2e_config,
    newest_commit,
    pgbench,
    pipeline_state,
    prepare_source,
    verify_ok,
    writing_uncommitted,
)
from walbridge.embedded import KafkaBroker, PostgresCluster


@pytest.fixture(scope="module")
def netns():
    reason = namespaces_unavailable()
    if reason:
        pytest.skip(f"the Spark cluster tests put a worker in a network namespace: {reason}")
    with NetworkNamespace() as ns:
        yield ns


@pytest.fixture(scope="module")
def servers(netns, tmp_path_factory):
    """PostgreSQL and the broker on this host's veth address, trusted from the namespace."""
    base = Path(tempfile.mkdtemp(prefix="walbridge-test-cluster-pg-"))  # see conftest._pg_scratch_dir
    try:
        with PostgresCluster(base, host=netns.host_ip, trusted_networks=(netns.network,)) as pg, \
                KafkaBroker(tmp_path_factory.mktemp("cluster-kafka"), host=netns.host_ip) as broker:
            yield pg, broker
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def spark_cluster(netns, tmp_path_factory):
    with SparkStandalone(netns, tmp_path_factory.mktemp("spark")) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """The README's pack block, run once: ``walbridge-env.tar.gz`` and ``env/``."""
    where = tmp_path_factory.mktemp("packed")
    started = time.monotonic()
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", readme_commands()["pack"]], cwd=where,
                            env=user_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    print(f"walbridge pack + unpack: {time.monotonic() - started:.1f}s")
    return where


class Cluster:
    """Databases, config and the consumer application of one test."""

    def __init__(self, pg: PostgresCluster, broker: KafkaBroker, spark: SparkStandalone, packed: Path,
                 run_dir: Path):
        self.pg, self.spark = pg, spark
        tag = uuid.uuid4().hex[:8]
        self.source = pg.create_database(f"src_{tag}")
        self.target = pg.create_database(f"tgt_{tag}")
        self.run_dir = run_dir
        for name in ("env", "walbridge-env.tar.gz"):  # what the pack block left where spark-submit runs
            (run_dir / name).symlink_to(packed / name)
        self.cfg = e2e_config(self.source, self.target, broker.bootstrap, f"c{tag}", run_dir)
        self.command = "standalone"
        self.accounts: Path | None = None  # a lake target's accounts table
        self.env = {"SPARK_MASTER": spark.url, "DRIVER_HOST": spark.netns.host_ip,
                    "SPARK_CONF_DIR": str(spark.conf_dir)}
        self.log = run_dir / "spark-submit.log"
        self.proc: subprocess.Popen | None = None

    def into_lake(self, kind: str) -> Path:
        """Apply into Delta tables or an Iceberg Hadoop catalog under the run
        dir (one file system for the driver and the worker's executors), with
        the README's command for that format; the accounts table's folder."""
        consumer = self.cfg["consumer"]
        del consumer["target_dsn"]
        self.command = f"standalone-{kind}"
        if kind == "delta":
            consumer.update(target="delta", target_path=str(self.run_dir / "lake"))
            self.accounts = self.run_dir / "lake" / "public.pgbench_accounts"
        else:
            warehouse = self.run_dir / "warehouse"
            consumer.update(target="iceberg", iceberg={"warehouse": warehouse.as_uri()})
            self.env["WAREHOUSE"] = warehouse.as_uri()
            self.accounts = warehouse / "cdc" / "public.pgbench_accounts"
        return self.accounts

    def submit(self) -> None:
        """The README's standalone command, as written, from the run dir."""
        write_toml(self.cfg, self.run_dir / "walbridge.toml")
        env = user_env(**self.env)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(["bash", "-c", readme_commands()[self.command]], cwd=self.run_dir, env=env,
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def applied(self) -> bool:
        """Has the consumer applied a first thousand rows (into a lake: written
        a first MERGE's files into the accounts table, past creating it)?"""
        if self.accounts is not None:
            return bool(data_files(self.accounts))
        return _applied_offsets(self.target) > 1000

    def submit_and_wait_applying(self) -> None:
        """Submit, then wait until the consumer has applied a first batch."""
        self.submit()
        wait_for(lambda: self.applied() or not self.alive(), timeout=240, interval=1, what="the consumer applying")
        assert self.alive(), self.tail()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else "(no log)"

    def converged(self) -> bool:
        ok, _ = verify_ok(self.cfg)
        return ok and caught_up(self.cfg)

    def stop(self) -> None:
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)

    def drop(self) -> None:
        for db in (self.source, self.target):
            self.pg.drop_database(db.rsplit("/", 1)[1])


@pytest.fixture
def cluster(servers, spark_cluster, packed, tmp_path):
    pg, broker = servers
    c = Cluster(pg, broker, spark_cluster, packed, tmp_path)
    try:
        yield c
    finally:
        c.stop()
        c.drop()


def _applied_offsets(target: str) -> int:
    try:
        with psycopg.connect(target) as conn:
            return conn.execute("SELECT coalesce(sum(next_offset), 0) FROM _walbridge.progress").fetchone()[0]
    except psycopg.Error:
        return 0


def _executor_pythons(spark: SparkStandalone) -> dict[int, set[str]]:
    """Python processes inside the namespace (the executors' workers) and the files they have mapped."""
    return {pid: mapped_files(pid) for pid in spark.netns.pids()
            if any(a.endswith("/python") or "pyspark" in a for a in cmdline(pid)[:3])
            and not any("CoarseGrainedExecutorBackend" in a for a in cmdline(pid))}


def _spark_state(c: Cluster) -> str:
    """The application's active stages and its executors, from Spark's REST
    API: whether a batch is still running, and where."""
    try:
        stages = [f"stage {s['stageId']}.{s['attemptId']} {s['name'][:60]!r}: {s['numCompleteTasks']}/{s['numTasks']} "
                  f"tasks done, {s['numActiveTasks']} active" for s in c.spark.app_rest("/stages?status=active")]
        executors = [f"executor {e['id']} {'active' if e['isActive'] else 'gone'}, {e['activeTasks']} tasks running, "
                     f"{e['completedTasks']} done, {e['failedTasks']} failed" for e in c.spark.app_rest("/allexecutors")]
    except Exception as e:  # noqa: BLE001 - an explanation, not a check
        return f"Spark's REST API did not answer: {e!r}"
    return "\n".join([f"{len(stages)} active stages: " + ("; ".join(stages[:10]) or "none"), *executors])


STUCK_THREADS = re.compile(r"stream execution|dag-scheduler|Executor task launch|py4j|walbridge")


def _thread_dumps(c: Cluster) -> str:
    """Where every part of the application waits, for a test that timed out:
    the driver's Python threads (SIGUSR1: faulthandler writes them into the
    consumer's log), the threads of the driver's and executors' JVMs that run
    the query, its scheduler, a task or a Python call (``jcmd
    Thread.print``), and this process's threads (the producer's among them)."""
    try:
        group = group_processes(c.proc.pid)
        # The driver JVM's arguments name the Python script too; a JVM has no SIGUSR1 handler and would die of it.
        java = {p for p, argv in group.items() if Path(argv[0]).name == "java"}
        drivers = [p for p, argv in group.items() if p not in java and any(a.endswith("spark_submit.py") for a in argv)]
        jvms = {p: "driver" for p in java if any(a.endswith("SparkSubmit") for a in group[p])}
        jvms.update((p, "executor") for p in c.spark.executor_pids())
        logged = c.log.stat().st_size
        for pid in drivers:
            os.kill(pid, signal.SIGUSR1)
        out = []
        for pid, role in jvms.items():
            dump = subprocess.run(["jcmd", str(pid), "Thread.print"], capture_output=True, text=True, timeout=60).stdout
            threads = [t for t in dump.split("\n\n") if t.startswith('"') and STUCK_THREADS.search(t)]
            out.append(f"--- the {role}'s JVM ({pid}): {len(threads)} threads\n" + "\n\n".join(threads)[:12000])
        with c.log.open("rb") as log:  # faulthandler wrote while jcmd ran
            log.seek(logged)
            out.insert(0, "--- the driver's Python threads\n" + log.read(12000).decode(errors="replace"))
        frames = sys._current_frames()
        out += [f"--- this process: {t.name}\n" + "".join(traceback.format_stack(frames[t.ident]))[-3000:]
                for t in threading.enumerate() if t is not threading.current_thread() and t.ident in frames]
        return "\n".join(out)
    except Exception as e:  # noqa: BLE001 - an explanation, not a check: it must not hide the rest of it
        return f"no thread dumps: {e!r}"


def _wait_converged(c: Cluster, timeout: float = 300) -> None:
    ok = wait_for(lambda: c.converged() or not c.alive(), timeout=timeout, interval=3,
                  what="target == source on every shape, slot at the last commit",
                  explain=lambda: f"{pipeline_state(c.cfg)}\n{_spark_state(c)}\n{c.tail()}\n{_thread_dumps(c)}")
    assert ok is True and c.alive(), c.tail()
    ok, diffs = verify_ok(c.cfg)
    assert ok, diffs


def test_consumer_on_a_standalone_cluster_runs_on_the_worker_and_survives_a_kill9_of_its_executor(cluster):
    """spark-submit to the master as the README says; the executors on the
    other host read (Spark's Kafka source) and decode every shape with the
    packed Python, the driver applies. The executor dies while the driver
    applies a batch and the executor reads and decodes the next one: Spark
    reruns its tasks on a new one and nothing is lost or applied twice."""
    c = cluster
    prepare_source(c.source, FEW_ACCOUNTS)
    with ProducerThread(c.cfg):
        c.submit_and_wait_applying()
        # While the executors work: what their Python workers have loaded.
        pythons = wait_for(lambda: {p: m for p, m in _executor_pythons(c.spark).items()
                                    if any("_fastdecode" in f for f in m)},
                           timeout=60, what="an executor Python worker with walbridge loaded")
        environment = c.spark.app_rest("/environment")
        load = threading.Thread(target=pgbench, args=(c.source, "-n", "-c", "2", "-R", "150", "-T", "20"),
                                kwargs={"accounts": FEW_ACCOUNTS}, daemon=True)  # at a set rate: the same work on a loaded machine as on a quiet one
        load.start()
        wait_for(lambda: applying(c.target), timeout=120, interval=0.01,
                 what="an apply written and not committed, under load")
        killed = c.spark.executor_pids()
        assert killed, "no executor JVM in the namespace"
        before = _applied_offsets(c.target)
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        # The worker starts a new executor; Spark reruns the lost tasks on it.
        wait_for(lambda: set(c.spark.executor_pids()) - set(killed), timeout=120, what="a new executor")
        load.join(120)
        _wait_converged(c)
        assert _applied_offsets(c.target) > before
        executors = c.spark.app_rest("/allexecutors")

    # Tasks ran on the worker in the namespace, none on the driver.
    workers = [e for e in executors if e["id"] != "driver"]
    assert workers and all(e["hostPort"].split(":")[0] == c.spark.netns.peer_ip for e in workers), executors
    assert all(e["totalTasks"] == 0 for e in executors if e["id"] == "driver"), executors
    assert len(workers) >= 2, executors
    replacement = [e for e in workers if e["isActive"]]
    assert replacement and sum(e["completedTasks"] for e in replacement) > 0, executors
    # The settings came from spark-submit and spark-defaults.conf, not from walbridge.
    props = dict(environment["sparkProperties"])
    assert props["spark.master"] == c.spark.url
    assert props["spark.driver.host"] == c.spark.netns.host_ip
    assert props.get("spark.ui.enabled", "true") == "true"
    assert props["spark.pyspark.python"] == "./env/bin/python"
    # Their Python is the packed environment Spark unpacked in the executor's
    # work dir: walbridge's extension and confluent-kafka come from there,
    # nothing from this checkout or its .venv. (The executors never connect
    # to the target: the driver applies.)
    for pid, files in pythons.items():
        ours = [f for f in files if f.startswith(str(ROOT))]
        assert not ours, (pid, ours)
        for needle in ("spark_consumer/_fastdecode", "confluent_kafka/cimpl"):
            found = [f for f in files if needle in f]
            assert found and all(f.startswith(str(c.spark.work_dir)) and "/env/lib/" in f for f in found), \
                (pid, needle, found)
    with psycopg.connect(c.target) as conn:
        history = conn.execute("SELECT count(*), count(DISTINCT (_wb_lsn, _wb_op_index)) FROM public.pgbench_history"
                               " WHERE _wb_snapshot_id IS NULL").fetchone()
    assert history[0] == history[1] > 0  # no streamed insert applied twice


@pytest.mark.parametrize("lake", ["delta", "iceberg"])
def test_kill9_of_the_executor_mid_merge_into_a_lake_is_rescheduled_and_loses_nothing(cluster, lake):
    """Into a Delta or Iceberg target the MERGE runs on the worker: its
    executor dies while it writes a batch's data files, before the driver
    commits them. The tables, read back with delta-rs or pyiceberg, end equal
    to the source."""
    c = cluster
    accounts = c.into_lake(lake)
    prepare_source(c.source, FEW_ACCOUNTS)
    with ProducerThread(c.cfg):
        c.submit_and_wait_applying()
        # At a rate the MERGEs keep up with while the worker shares 2 cores with everything else.
        load = threading.Thread(target=pgbench, args=(c.source, "-n", "-c", "2", "-R", "40", "-T", "20"),
                                kwargs={"accounts": FEW_ACCOUNTS}, daemon=True)
        load.start()
        wait_for(lambda: writing_uncommitted(accounts), timeout=120, interval=0.01,
                 what="a MERGE's files written, not committed, under load")
        killed = c.spark.executor_pids()
        assert killed, "no executor JVM in the namespace"
        committed = newest_commit(accounts)
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: set(c.spark.executor_pids()) - set(killed), timeout=120, what="a new executor")
        load.join(120)
        _wait_converged(c)
        assert newest_commit(accounts) > committed
        executors = [e for e in c.spark.app_rest("/allexecutors") if e["id"] != "driver"]
    assert len(executors) >= 2, executors
    replacement = [e for e in executors if e["isActive"]]
    assert replacement and sum(e["completedTasks"] for e in replacement) > 0, executors
    assert c.alive(), c.tail()  # the lost tasks were rerun; the query went on
    # SIGTERM to spark-submit's process group reaches the JVM too: its shutdown
    # hook may stop Spark before walbridge stops the query. A clean stop still.
    c.stop()
    assert "internal error" not in c.log.read_text(), c.tail()
