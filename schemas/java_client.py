"""``[kafka.client]`` for a Java Kafka client: the settings are written in
librdkafka's names (the producer's and the consumer's own clients, all
confluent-kafka, take them as they are); Spark's Kafka source, the one Java
client, gets their translation (:func:`java_client_options`).

Invariants:
- Nothing is silently dropped: a setting with no Java counterpart is an
  error naming it (:class:`JavaClientError`, a config error wherever the
  consumer is configured), except the settings that only tune a librdkafka
  client or a producer (:data:`NOT_FOR_SPARK`), which the Java consumer has
  no use for.
- Credentials become the JAAS login of the SASL mechanism
  (:data:`LOGIN_MODULES`); a CA file becomes a PEM trust store.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping


class JavaClientError(ValueError):
    """``[kafka.client]`` settings with no Java client setting (``problems``: one line each)."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))


# What the consumer's Spark source (a Java client) sets unless [kafka.client] says otherwise.
# fetch.max.wait.ms: after each poll a cached consumer sends a prefetch, which
# waits this long at the broker; the broker answers a connection's requests in
# order, so the offset lookups Spark's source makes next for that partition
# wait behind it (bench/RESULTS.md: 500 ms by default, 0.4 s per idle
# partition's task; 20 ms, 200 shapes' inserts 4.2-4.7 s; 1 ms, 2.6-2.9 s;
# none, a 200-partition read ~0.3 s against 0.43 s at 1 ms). Spark only reads
# offsets it has seen exist (each read is a fetch and then Spark 4.1's two
# offset lookups), so the wait buys nothing.
# enable.metrics.push, auto.include.jmx.reporter: Spark's source keeps a Java
# consumer per topic-partition, and each registers its few hundred metrics
# with JMX and with the client telemetry reporter when made; on 200 shapes'
# 800 partitions that was ~4 s of a fresh consumer's first batch
# (bench/RESULTS.md). Spark's own metrics and the consumer's are unaffected.
JAVA_DEFAULTS = {"kafka.fetch.max.wait.ms": "0", "kafka.enable.metrics.push": "false",
                 "kafka.auto.include.jmx.reporter": "false"}

# librdkafka settings whose Java client setting has the same name and meaning.
SAME_NAME = frozenset({
    "client.id", "client.rack", "request.timeout.ms", "retry.backoff.ms", "retry.backoff.max.ms",
    "reconnect.backoff.ms", "reconnect.backoff.max.ms", "metadata.max.age.ms", "connections.max.idle.ms",
    "socket.connection.setup.timeout.ms", "fetch.min.bytes", "fetch.max.bytes", "max.partition.fetch.bytes",
    "isolation.level", "sasl.kerberos.service.name", "ssl.keystore.location", "ssl.keystore.password",
    "ssl.cipher.suites", "enable.metrics.push",
})
# librdkafka settings with another name in the Java client.
RENAMED = {
    "fetch.wait.max.ms": "fetch.max.wait.ms",
    "socket.receive.buffer.bytes": "receive.buffer.bytes",
    "socket.send.buffer.bytes": "send.buffer.bytes",
    "sasl.mechanisms": "sasl.mechanism",
    "sasl.mechanism": "sasl.mechanism",
    "ssl.key.password": "ssl.key.password",
}
# librdkafka settings that tune librdkafka itself or a producer: Spark's Java
# consumers have nothing they would mean (the producer, the DLQ and the group
# commits still use them).
NOT_FOR_SPARK = frozenset({
    "acks", "request.required.acks", "enable.idempotence", "linger.ms", "queue.buffering.max.ms",
    "queue.buffering.max.messages", "queue.buffering.max.kbytes", "batch.num.messages", "batch.size",
    "compression.type", "compression.codec", "compression.level", "message.timeout.ms", "delivery.timeout.ms",
    "message.send.max.retries", "retries", "message.max.bytes", "max.in.flight.requests.per.connection",
    "max.in.flight", "partitioner", "sticky.partitioning.linger.ms", "transaction.timeout.ms",
    "debug", "log_level", "log.queue", "log.thread.name", "log.connection.close", "statistics.interval.ms",
    "socket.keepalive.enable", "socket.nagle.disable", "socket.timeout.ms", "api.version.request",
    "api.version.fallback.ms", "broker.version.fallback", "topic.metadata.refresh.interval.ms",
    "topic.metadata.refresh.sparse", "enable.partition.eof", "enable.auto.commit", "auto.commit.interval.ms",
    "enable.auto.offset.store", "auto.offset.reset", "queued.min.messages", "queued.max.messages.kbytes",
    "fetch.queue.backoff.ms", "fetch.error.backoff.ms", "session.timeout.ms", "heartbeat.interval.ms",
    "max.poll.interval.ms", "coordinator.query.interval.ms", "group.instance.id", "group.protocol",
    "partition.assignment.strategy", "internal.termination.signal", "enable.sasl.oauthbearer.unsecure.jwt",
    "ssl.ca.certificate.stores", "ssl.engine.location",
})
# The JAAS login module of each SASL mechanism a username and password log in with.
LOGIN_MODULES = {
    "PLAIN": "org.apache.kafka.common.security.plain.PlainLoginModule",
    "SCRAM-SHA-256": "org.apache.kafka.common.security.scram.ScramLoginModule",
    "SCRAM-SHA-512": "org.apache.kafka.common.security.scram.ScramLoginModule",
}


def _jaas_quoted(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def java_client_options(bootstrap: str, client: Mapping[str, Any]) -> dict[str, str]:
    """``[kafka.client]`` (librdkafka's names) as the ``kafka.*`` options of
    Spark's Kafka source (the Java client's names). Raises
    :class:`JavaClientError` naming every setting that has no translation;
    settings that only tune a librdkafka client or a producer
    (:data:`NOT_FOR_SPARK`) are left to those."""
    out = {"kafka.bootstrap.servers": bootstrap, **JAVA_DEFAULTS}
    problems = []
    user = password = None
    for key, value in client.items():
        text = str(value).lower() if isinstance(value, bool) else str(value)
        if key in SAME_NAME:
            out[f"kafka.{key}"] = text
        elif key in RENAMED:
            out[f"kafka.{RENAMED[key]}"] = text
        elif key == "security.protocol":
            out["kafka.security.protocol"] = text.upper()
        elif key == "sasl.username":
            user = text
        elif key == "sasl.password":
            password = text
        elif key == "ssl.ca.location":
            out.update({"kafka.ssl.truststore.type": "PEM", "kafka.ssl.truststore.location": text})
        elif key == "ssl.ca.pem":
            out.update({"kafka.ssl.truststore.type": "PEM", "kafka.ssl.truststore.certificates": text})
        elif key in ("ssl.certificate.location", "ssl.key.location", "ssl.certificate.pem", "ssl.key.pem"):
            # The Java client takes the client certificate and key as PEM text.
            pem = Path(text).read_text() if key.endswith(".location") else text
            out["kafka.ssl.keystore.type"] = "PEM"
            out["kafka.ssl.keystore.certificate.chain" if "certificate" in key else "kafka.ssl.keystore.key"] = pem
        elif key == "ssl.endpoint.identification.algorithm":
            out["kafka.ssl.endpoint.identification.algorithm"] = "" if text == "none" else text
        elif key in NOT_FOR_SPARK:
            continue
        else:
            problems.append(f"kafka.client.{key}: Spark's Kafka source (a Java client) has no setting for this "
                            "librdkafka setting; remove it, or ask for its translation")
    if user is not None or password is not None:
        mechanism = out.get("kafka.sasl.mechanism", "GSSAPI").upper()
        module = LOGIN_MODULES.get(mechanism)
        if module is None or user is None or password is None:
            problems.append(f"kafka.client.sasl.username: a username and password log in with "
                            f"{', '.join(LOGIN_MODULES)} (sasl.mechanism), not {mechanism}"
                            if module is None else "kafka.client.sasl.username: needs sasl.password too")
        else:
            out["kafka.sasl.jaas.config"] = (f"{module} required username={_jaas_quoted(user)} "
                                             f"password={_jaas_quoted(password)};")
    if problems:
        raise JavaClientError(problems)
    return out
