"""What went wrong, where, and whether waiting can mend it: the one error
policy of every walbridge process.

A failure an operator is expected to meet (a password refused, a broker that
does not answer, a table that is not there) becomes a :class:`Failure`: the
endpoint it concerns (``source``, ``kafka``, ``registry``, ``target`` or
``config``), that endpoint's address with any password redacted, what is
wrong, how to fix it, and whether it is *permanent* or *transient*:

- permanent: retrying cannot fix it (authentication, an unknown database or
  role, a missing privilege, ``wal_level``, an unknown table or column, an
  unknown or invalid client property, a malformed address);
- transient: waiting may (connection refused, broker transport failures,
  timeouts, a server starting up or shutting down, too many connections, a
  replication slot still held by a walsender that is going away).

Invariants:
- :func:`classify` is pure: it reads an exception (type, SQLSTATE, librdkafka
  error code, HTTP status, libpq's message) and does no I/O. What it does not
  recognise as an endpoint's failure it returns as None: a bug, not an outage.
- Among PostgreSQL errors, an ``OperationalError`` it cannot place is
  transient (the connection is what failed); any other database error is
  permanent (the same statement would fail again). Among Kafka errors, the
  unknown ones are transient, as librdkafka's own retries treat them.
- Addresses are shown through :func:`schemas.config.redact_dsn`; libpq's and
  librdkafka's messages never carry a password.
"""

from __future__ import annotations

import contextlib
import re
from typing import Iterator

import psycopg
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.schema_registry.error import SchemaRegistryError

from schemas.config import redact_dsn

SOURCE, KAFKA, REGISTRY, TARGET, CONFIG = "source", "kafka", "registry", "target", "config"

# Where the operator changes an endpoint's address, for the fixes.
SETTING = {SOURCE: "[source] dsn", TARGET: "[consumer] target_dsn", KAFKA: "[kafka] bootstrap_servers",
           REGISTRY: "[kafka] schema_registry_url"}


class Failure(Exception):
    """An expected failure, as an operator reads it: ``<endpoint> <address>:
    <problem>`` and, on a line of its own, the fix."""

    def __init__(self, endpoint: str, problem: str, fix: str | None = None, *, address: str | None = None,
                 permanent: bool = True):
        super().__init__(problem)
        self.endpoint = endpoint
        self.problem = problem
        self.fix = fix
        self.address = redact_dsn(address) if address else None
        self.permanent = permanent

    def __reduce__(self):
        # Subclasses take other arguments: rebuild from the state, not __init__
        # (a failure may cross processes, e.g. out of a Spark task).
        return _restore, (type(self), self.args, dict(self.__dict__))

    def at(self, address: str | None) -> Failure:
        """This failure with its endpoint's (redacted) address, if it had none."""
        if self.address is None and address:
            self.address = redact_dsn(address)
        return self

    @property
    def headline(self) -> str:
        where = f"{self.endpoint} {self.address}" if self.address else self.endpoint
        return f"{where}: {self.problem}"

    def __str__(self) -> str:
        return self.headline + (f"\n  fix: {self.fix}" if self.fix else "")


def _restore(cls: type, args: tuple, state: dict) -> Failure:
    failure = cls.__new__(cls)
    Exception.__init__(failure, *args)
    failure.__dict__.update(state)
    return failure


# -- PostgreSQL -------------------------------------------------------------

# SQLSTATEs (or their two-character classes) a retry cannot fix, and the fix.
_PG_PERMANENT = {
    "28": "check the user and password in {setting} (or its password / password_file)",
    "3D000": "create the database, or correct its name in {setting}",
    "42501": "grant the role the privilege named above (for the source: ALTER ROLE <user> WITH REPLICATION "
             "and SELECT on the shapes' tables)",
    "55000": "ALTER SYSTEM SET wal_level = logical; then restart PostgreSQL",
    "53400": "free a replication slot (pg_drop_replication_slot) or raise max_replication_slots",
    "25006": "point {setting} at a primary: this server is read-only",
    "42P01": None, "42703": None, "42704": None, "42883": None, "0A000": None,
}
# SQLSTATEs (or classes) that waiting mends.
_PG_TRANSIENT = {"08", "53300", "55006", "55P03", "57P01", "57P02", "57P03", "57014", "40001", "40P01", "58"}

# libpq's messages for errors that come without a SQLSTATE (most connection
# failures): pattern → (permanent, fix).
_PG_MESSAGES: list[tuple[re.Pattern, bool, str | None]] = [(re.compile(p, re.I), perm, fix) for p, perm, fix in [
    (r"password authentication failed|no password supplied|authentication failed",
     True, "check the user and password in {setting} (or its password / password_file)"),
    (r"role \S+ does not exist", True, "create the role, or correct the user in {setting}"),
    (r"database \S+ does not exist", True, "create the database, or correct its name in {setting}"),
    (r"no pg_hba\.conf entry", True, "add a pg_hba.conf entry for this user and host (the producer also needs "
                                    "one for replication connections), then reload PostgreSQL"),
    (r"must be superuser or replication role|permission denied to start WAL sender|"
     r"must have the REPLICATION attribute",
     True, "ALTER ROLE <user> WITH REPLICATION"),
    (r"invalid port number|invalid integer value|invalid connection option|invalid sslmode|"
     r"missing \"=\"|invalid URI", True, "correct {setting}"),
    (r"is not a logical pgoutput slot", True, "drop that slot or choose another [source] slot name"),
    (r"session is read-only|server is in hot standby mode", False,
     "no server of {setting} accepts writes now: a failover under way? (target_session_attrs=read-write "
     "waits for a primary among its hosts)"),
    (r"Connection refused", False, "is PostgreSQL running and listening on that host and port?"),
    (r"failed to resolve host|could not translate host name", False, "check the host name in {setting}"),
    (r"timeout expired|timed out", False, "is the host reachable from here (firewall, network)?"),
    (r"is in use by another process|is active for PID", False,
     "is another producer running with this slot? (a walsender going away frees it within seconds)"),
    (r"the database system is (starting up|shutting down|in recovery mode)", False, None),
]]


def _pg_problem(message: str) -> str:
    """libpq's message without what the address already says."""
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    text = lines[0] if lines else "connection failed"
    text = re.sub(r"^connection (failed|is bad): ", "", text)
    text = re.sub(r'^connection to server (at "[^"]*"(, port \d+)?|on socket "[^"]*") failed: ', "", text)
    return re.sub(r"^(FATAL|ERROR):\s+", "", text)


def postgres_failure(endpoint: str, message: str, sqlstate: str | None = None,
                     operational: bool = True) -> Failure:
    """A PostgreSQL error at ``endpoint`` (``source`` or ``target``), judged by its
    SQLSTATE or, without one, by libpq's message."""
    problem = _pg_problem(message)
    setting = SETTING.get(endpoint, endpoint)
    permanent, fix = None, None
    for key in (sqlstate, sqlstate[:2]) if sqlstate else ():
        if key in _PG_PERMANENT:
            permanent, fix = True, _PG_PERMANENT[key]
            break
        if key in _PG_TRANSIENT:
            permanent = False
            break
    for pattern, by_message, hint in _PG_MESSAGES:
        if pattern.search(message):
            permanent = by_message if permanent is None else permanent
            fix = fix or hint
            break
    if permanent is None:
        permanent = not operational
    return Failure(endpoint, problem, fix.format(setting=setting) if fix else None, permanent=permanent)


# -- Kafka ------------------------------------------------------------------

_KAFKA_PERMANENT = {
    KafkaError._INVALID_ARG: "correct [kafka.client] (librdkafka's settings are listed in its CONFIGURATION.md)",
    KafkaError._AUTHENTICATION: "check the SASL/SSL settings in [kafka.client]",
    KafkaError.SASL_AUTHENTICATION_FAILED: "check the SASL/SSL settings in [kafka.client]",
    KafkaError.UNSUPPORTED_SASL_MECHANISM: "check sasl.mechanism in [kafka.client]",
    KafkaError.ILLEGAL_SASL_STATE: "check the SASL settings in [kafka.client]",
    KafkaError._SSL: "check the ssl.* settings in [kafka.client]",
    KafkaError.TOPIC_AUTHORIZATION_FAILED: "grant this principal Create, Describe, Read and Write on the "
                                           "walbridge topics (<topic_prefix>.*)",
    KafkaError.GROUP_AUTHORIZATION_FAILED: "grant this principal Read and Describe on the consumer groups, and "
                                           "Describe on the groups prefixed walbridge- (its own readers, which "
                                           "never join nor commit)",
    KafkaError.CLUSTER_AUTHORIZATION_FAILED: "grant this principal Describe (and Create) on the cluster",
    KafkaError.POLICY_VIOLATION: "the broker's topic policy refuses the topics as configured",
    KafkaError.INVALID_REPLICATION_FACTOR: "lower [kafka] replication_factor to at most the number of brokers",
    KafkaError.INVALID_PARTITIONS: "correct [kafka] partitions",
    KafkaError.INVALID_CONFIG: None,
    KafkaError._UNSUPPORTED_FEATURE: None,
}


def kafka_failure(error: KafkaError, endpoint: str = KAFKA) -> Failure:
    code = error.code()
    problem = error.str() or error.name()
    if code in _KAFKA_PERMANENT:
        return Failure(endpoint, problem, _KAFKA_PERMANENT[code])
    if error.fatal():
        return Failure(endpoint, problem, None)
    if code in (KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN, KafkaError._RESOLVE):
        return Failure(endpoint, f"cannot reach the broker ({problem})",
                       f"is Kafka running at {SETTING[KAFKA]}, and reachable from here?", permanent=False)
    return Failure(endpoint, problem, None, permanent=False)


# -- Schema Registry --------------------------------------------------------

def registry_failure(error: BaseException) -> Failure | None:
    if isinstance(error, SchemaRegistryError):
        status = error.http_status_code
        problem = f"HTTP {status}: {error.error_message}"
        if status in (401, 403):
            return Failure(REGISTRY, problem, "check the registry credentials")
        if status >= 500 or status in (408, 429) or status < 0:
            return Failure(REGISTRY, problem, None, permanent=False)
        return Failure(REGISTRY, problem, None)
    # The registry client's HTTP layer (an httpx vendored by confluent-kafka):
    # its transport errors and timeouts are an unreachable registry.
    names = {c.__name__ for c in type(error).__mro__}
    if type(error).__module__.startswith("httpx") and names & {"TransportError", "TimeoutException"}:
        return Failure(REGISTRY, f"cannot reach the schema registry ({error})",
                       f"is it running at {SETTING[REGISTRY]}?", permanent=False)
    return None


# -- all of them ------------------------------------------------------------

def classify(error: BaseException, *, database: tuple[str, str | None] = (SOURCE, None),
             kafka: str | None = None, registry: str | None = None) -> Failure | None:
    """``error`` as a :class:`Failure` with its endpoint's address, or None
    when it is not an endpoint's failure (a bug). PostgreSQL errors are
    attributed to ``database`` (endpoint, DSN)."""
    if isinstance(error, Failure):
        addresses = {database[0]: database[1], KAFKA: kafka, REGISTRY: registry}
        return error.at(addresses.get(error.endpoint))
    if isinstance(error, psycopg.Error):
        failure = postgres_failure(database[0], str(error), getattr(error, "sqlstate", None),
                                   operational=isinstance(error, (psycopg.OperationalError,
                                                                  psycopg.InterfaceError)))
        return failure.at(database[1])
    if isinstance(error, KafkaException) and error.args and isinstance(error.args[0], KafkaError):
        return kafka_failure(error.args[0]).at(kafka)
    if isinstance(error, KafkaError):
        return kafka_failure(error).at(kafka)
    failure = registry_failure(error)
    return failure.at(registry) if failure is not None else None


@contextlib.contextmanager
def attributed(*, database: tuple[str, str | None] = (SOURCE, None), kafka: str | None = None,
               registry: str | None = None) -> Iterator[None]:
    """Within: an endpoint's error leaves as a :class:`Failure` (the original
    as its cause); anything else passes unchanged."""
    try:
        yield
    except Exception as e:
        failure = classify(e, database=database, kafka=kafka, registry=registry)
        if failure is None or failure is e:
            raise
        raise failure from e


# Failures that reach the driver as text (a Spark task's Python traceback, or
# the Java Kafka client's exception from Spark's Kafka source): markers of the
# transient ones, by endpoint.
_TEXT_TRANSIENT = [
    (KAFKA, re.compile(r"_TRANSPORT|_ALL_BROKERS_DOWN|_TIMED_OUT|Broker transport failure|_RESOLVE|"
                       r"NOT_COORDINATOR|COORDINATOR_NOT_AVAILABLE|LEADER_NOT_AVAILABLE|"
                       r"org\.apache\.kafka\.common\.errors\.(?:TimeoutException|DisconnectException|"
                       r"NetworkException|NotLeaderOrFollowerException|LeaderNotAvailableException|"
                       r"NotCoordinatorException|CoordinatorNotAvailableException)")),
    (TARGET, re.compile(r"psycopg\.OperationalError|Connection refused|server closed the connection|"
                        r"the database system is (starting up|shutting down)|terminating connection")),
]


def classify_text(text: str) -> Failure | None:
    """A transient failure recognised in the text of an error raised in
    another process (a Spark task), or None."""
    for endpoint, pattern in _TEXT_TRANSIENT:
        m = pattern.search(text)
        if m:
            return Failure(endpoint, f"a task failed on {m.group(0)}", None, permanent=False)
    return None
