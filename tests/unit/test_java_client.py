"""``[kafka.client]`` (librdkafka's names) for the consumer's Spark source, a
Java client (schemas/java_client.py): SASL and TLS translated, nothing
silently dropped."""

from __future__ import annotations

import pytest

from schemas.config import ConfigError, parse_config
from schemas.java_client import JavaClientError, java_client_options
from tests.helpers import make_config


def test_sasl_ssl_in_librdkafka_names_becomes_the_java_clients_settings():
    options = java_client_options("b:9093", {"security.protocol": "sasl_ssl", "sasl.mechanism": "SCRAM-SHA-512",
                                       "sasl.username": "wb", "sasl.password": 'p"w\\d',
                                       "ssl.ca.location": "/etc/ca.pem", "client.id": "me",
                                       "message.timeout.ms": 3000, "fetch.wait.max.ms": 5})
    assert options == {
        "kafka.bootstrap.servers": "b:9093", "kafka.fetch.max.wait.ms": "5", "kafka.security.protocol": "SASL_SSL",
        "kafka.enable.metrics.push": "false", "kafka.auto.include.jmx.reporter": "false",
        "kafka.sasl.mechanism": "SCRAM-SHA-512", "kafka.ssl.truststore.type": "PEM",
        "kafka.ssl.truststore.location": "/etc/ca.pem", "kafka.client.id": "me",
        "kafka.sasl.jaas.config": 'org.apache.kafka.common.security.scram.ScramLoginModule required '
                                  'username="wb" password="p\\"w\\\\d";'}


def test_plain_sasl_and_verification_off():
    options = java_client_options("b:9092", {"sasl.mechanisms": "PLAIN", "sasl.username": "u", "sasl.password": "p",
                                       "ssl.endpoint.identification.algorithm": "none"})
    assert options["kafka.sasl.jaas.config"].startswith("org.apache.kafka.common.security.plain.PlainLoginModule")
    assert options["kafka.ssl.endpoint.identification.algorithm"] == ""


@pytest.mark.parametrize("client, problem", [
    ({"enable.ssl.certificate.verification": False}, "kafka.client.enable.ssl.certificate.verification"),
    ({"sasl.mechanism": "GSSAPI", "sasl.username": "u", "sasl.password": "p"}, "not GSSAPI"),
    ({"sasl.mechanism": "PLAIN", "sasl.username": "u"}, "needs sasl.password"),
    ({"sasl.oauthbearer.config": "x"}, "kafka.client.sasl.oauthbearer.config"),
])
def test_a_setting_without_translation_is_a_config_error_naming_it(client, problem):
    with pytest.raises(JavaClientError, match=problem):
        java_client_options("b:9092", client)
    base = make_config("postgresql://u@h/db", "b:9092", "wb", [{"table": "public.t"}], kafka={"client": client})
    parse_config(base)  # no consumer configured: the producer's clients take it as it is
    with pytest.raises(ConfigError, match=problem):
        parse_config({**base, "consumer": {"target_dsn": "postgresql://u@h/wh"}})
