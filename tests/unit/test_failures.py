"""The failure policy: which errors are permanent, which transient, and what
the operator reads about each (endpoint, redacted address, problem, fix)."""

from __future__ import annotations

import concurrent.futures
import pickle

import httpx2
import psycopg
import pytest
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.schema_registry.error import SchemaRegistryError

from producer.catalog import SourceError
from producer.replication import ReplicationError
from schemas.failures import KAFKA, REGISTRY, SOURCE, TARGET, Failure, attributed, classify, classify_text
from schemas.kafka import topic_ids

DSN = "postgresql://app:s3cr3t@db:5432/app"
REFUSED = ('connection failed: connection to server at "127.0.0.1", port 1 failed: Connection refused\n'
           '\tIs the server running on that host and accepting TCP/IP connections?')

PG_CASES = [
    # (libpq's message, SQLSTATE, permanent, problem as shown, fragment of the fix)
    ('connection failed: connection to server at "10.0.0.5", port 5432 failed: FATAL:  password authentication '
     'failed for user "app"', None, True, 'password authentication failed for user "app"', "password"),
    ('connection failed: connection to server at "10.0.0.5", port 5432 failed: FATAL:  database "nodb" does not '
     'exist', None, True, 'database "nodb" does not exist', "create the database"),
    ('connection failed: connection to server at "10.0.0.5", port 5432 failed: FATAL:  role "x" does not exist',
     None, True, 'role "x" does not exist', "create the role"),
    ('connection is bad: invalid port number: "99999"', None, True, 'invalid port number: "99999"', "correct"),
    ('connection failed: ... FATAL:  no pg_hba.conf entry for replication connection from host "10.0.0.9"',
     None, True, None, "pg_hba.conf"),
    (REFUSED, None, False, "Connection refused", "is PostgreSQL running"),
    # A multi-host DSN mid-failover: the old primary is gone, the standby not yet promoted.
    (REFUSED + '\nconnection to server at "127.0.0.1", port 2 failed: session is read-only', None, False, None,
     "no server of [source] dsn accepts writes now"),
    ("failed to resolve host 'db.invalid': [Errno -2] Name or service not known", None, False, None, "host name"),
    ("terminating connection due to administrator command", "57P01", False, None, None),
    ("replication slot \"wb\" is active for PID 4242", "55006", False, None, "another producer"),
    ("logical decoding requires wal_level >= logical", "55000", True, None, "wal_level = logical"),
    ("must be superuser or replication role to start walsender", "42501", True, None, "REPLICATION"),
]


@pytest.mark.parametrize("message,sqlstate,permanent,problem,fix", PG_CASES, ids=[c[0][-40:] for c in PG_CASES])
def test_postgres_errors_are_judged_by_sqlstate_or_message(message, sqlstate, permanent, problem, fix):
    error = psycopg.errors.lookup(sqlstate)(message) if sqlstate else psycopg.OperationalError(message)
    failure = classify(error, database=(SOURCE, DSN))
    assert failure.endpoint == SOURCE and failure.permanent is permanent
    assert failure.address == "postgresql://app:***@db:5432/app"
    if problem:
        assert failure.problem == problem
    if fix:
        assert fix in failure.fix
    assert "s3cr3t" not in str(failure)


def test_the_target_is_named_as_the_target():
    failure = classify(psycopg.OperationalError(REFUSED), database=(TARGET, "host=wh password=hunter2 dbname=w"))
    assert str(failure).startswith("target host=wh password=*** dbname=w: Connection refused")
    assert "[consumer] target_dsn" not in (failure.fix or "") or "hunter2" not in str(failure)


def test_a_statement_error_is_permanent_and_an_unknown_connection_error_transient():
    assert classify(psycopg.errors.lookup("42P01")('relation "x" does not exist')).permanent
    assert classify(psycopg.errors.lookup("23505")("duplicate key")).permanent
    assert not classify(psycopg.OperationalError("something odd happened to the socket")).permanent


KAFKA_CASES = [
    (KafkaError._TRANSPORT, "Failed to get metadata: Local: Broker transport failure", False, "cannot reach the broker"),
    (KafkaError._ALL_BROKERS_DOWN, "1/1 brokers are down", False, "cannot reach the broker"),
    (KafkaError._MSG_TIMED_OUT, "Local: Message timed out", False, "Message timed out"),
    (KafkaError._INVALID_ARG, 'No such configuration property: "foo.bar"', True, "foo.bar"),
    (KafkaError.SASL_AUTHENTICATION_FAILED, "Authentication failed", True, "Authentication failed"),
    (KafkaError.TOPIC_AUTHORIZATION_FAILED, "Topic authorization failed", True, "authorization"),
]


@pytest.mark.parametrize("code,text,permanent,problem", KAFKA_CASES, ids=[c[1][:30] for c in KAFKA_CASES])
def test_kafka_errors_are_judged_by_code(code, text, permanent, problem):
    failure = classify(KafkaException(KafkaError(code, text)), kafka="broker-1:9092")
    assert failure.endpoint == KAFKA and failure.permanent is permanent
    assert problem in failure.problem and failure.address == "broker-1:9092"


class _SilentAdmin:
    """An admin client of a broker that accepts and never answers (SIGSTOP)."""

    def describe_topics(self, topics):
        return {name: concurrent.futures.Future() for name in topics.topic_names}


def test_a_topic_description_that_never_comes_is_a_transient_kafka_failure():
    found = topic_ids(_SilentAdmin(), ["wb.app.items"], timeout=0.01)["wb.app.items"]
    assert isinstance(found, KafkaException)
    failure = classify(found, kafka="broker-1:9092")
    assert failure.endpoint == KAFKA and not failure.permanent and "describing topic wb.app.items" in failure.problem


def test_registry_errors_by_status_and_transport():
    url = "http://registry:8081"
    assert classify(SchemaRegistryError(401, 40101, "Unauthorized"), registry=url).permanent
    assert not classify(SchemaRegistryError(503, 50301, "Service unavailable"), registry=url).permanent
    refused = classify(httpx2.ConnectError("[Errno 111] Connection refused"), registry=url)
    assert refused.endpoint == REGISTRY and not refused.permanent and "cannot reach the schema registry" in refused.problem


def test_anything_else_is_not_a_failure():
    assert classify(ZeroDivisionError()) is None
    assert classify(KeyError("x")) is None


def test_attributed_turns_endpoint_errors_into_failures_and_lets_bugs_pass():
    with pytest.raises(Failure) as e, attributed(database=(TARGET, DSN)):
        raise psycopg.OperationalError(REFUSED)
    assert e.value.endpoint == TARGET and isinstance(e.value.__cause__, psycopg.OperationalError)
    with pytest.raises(ZeroDivisionError), attributed(database=(TARGET, DSN)):
        raise ZeroDivisionError()


def test_failures_from_spark_tasks_are_recognised_in_their_text():
    text = ("pyspark.errors.exceptions.captured.StreamingQueryException: ... File \"batch_split.py\", line 40\n"
            "cimpl.KafkaException: KafkaError{code=_TRANSPORT,val=-195,str=\"Failed to get metadata\"}")
    assert classify_text(text).endpoint == KAFKA and not classify_text(text).permanent
    assert classify_text("psycopg.OperationalError: connection failed: Connection refused").endpoint == TARGET
    assert classify_text("ZeroDivisionError: division by zero") is None


def test_the_java_kafka_clients_outages_are_transient_kafka_failures():
    """Spark's Kafka source fails a task with the Java client's exception: not
    counted against the query's restart budget, an outage cannot end the consumer through it."""
    text = ("org.apache.spark.SparkException: Job aborted due to stage failure: ... "
            "org.apache.kafka.common.errors.TimeoutException: Timeout of 60000ms expired before the position "
            "for partition t.public.items-2 could be determined")
    failure = classify_text(text)
    assert failure.endpoint == KAFKA and not failure.permanent


def test_a_failure_survives_pickling_whatever_its_class():
    for failure in (Failure(KAFKA, "down", "start it", address="k:1", permanent=False),
                    SourceError("table public.x does not exist"),
                    ReplicationError("replication stream ended: closed", "57P01")):
        back = pickle.loads(pickle.dumps(failure))
        assert type(back) is type(failure) and str(back) == str(failure) and back.permanent == failure.permanent
