"""A secured Apache Kafka broker, as production runs it (issue 29): clients
reach it only on a ``SASL_SSL`` listener (SCRAM-SHA-512 over TLS, with a CA the
test makes), and an authorizer lets each principal do only what its ACLs say.

The pipeline runs end to end over it with credentials from a file (the
producer's admin calls, the producer, and the Spark consumer alike). A wrong
password, a certificate from a CA the client does not trust, and ACLs that deny
a topic or the consumer's group each end the process within seconds, with one
line naming the broker and the problem (never the secret), and the Kafka exit
code."""

from __future__ import annotations

import datetime
import ipaddress
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from confluent_kafka.admin import (
    AclBinding,
    AclOperation,
    AclPermissionType,
    AdminClient,
    ResourcePatternType,
    ResourceType,
)
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import pkcs12
from cryptography.x509.oid import NameOID

from schemas import wire
from schemas.config import load_config
from tests.helpers import ConsumerThread, ProducerThread, make_config, wait_for, write_toml
from tests.pipeline import pipeline_state, verify_ok
from walbridge.embedded import KafkaBroker, free_port

PASSWORDS = {"admin": "admin-secret", "wb": "wb-secret-7f3a", "outsider": "outsider-secret"}
KEYSTORE_PASSWORD = "keystore-secret"
EXIT_KAFKA = 4
DENIED_EXIT_WITHIN_S = 60


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_ca(common_name: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(_name(common_name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def make_server_cert(ca_key, ca_cert, host: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name("walbridge-test-broker")).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(host))]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return key, cert


@dataclass
class SecuredBroker:
    broker: KafkaBroker
    bootstrap: str  # the SASL_SSL listener, the only one clients use
    ca_file: Path  # the CA that signed the broker's certificate
    other_ca_file: Path  # a CA that did not

    def client(self, user: str, password: str | None = None, ca_file: Path | None = None) -> dict:
        return {"bootstrap.servers": self.bootstrap, "security.protocol": "SASL_SSL",
                "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": user,
                "sasl.password": password if password is not None else PASSWORDS[user],
                "ssl.ca.location": str(ca_file or self.ca_file)}


@pytest.fixture(scope="module")
def secured(tmp_path_factory) -> SecuredBroker:
    base = tmp_path_factory.mktemp("kafka-sasl-ssl")
    host = "127.0.0.1"
    ca_key, ca_cert = make_ca("walbridge test CA")
    key, cert = make_server_cert(ca_key, ca_cert, host)
    (base / "ca.pem").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    (base / "other-ca.pem").write_bytes(make_ca("some other CA")[1].public_bytes(serialization.Encoding.PEM))
    (base / "broker.p12").write_bytes(pkcs12.serialize_key_and_certificates(
        b"broker", key, cert, [ca_cert],
        serialization.BestAvailableEncryption(KEYSTORE_PASSWORD.encode())))
    broker = KafkaBroker(base / "broker", host=host, scram_users=PASSWORDS)
    secure_port = free_port(host)
    broker.extra_config = {
        # PLAINTEXT stays for the broker's own traffic (its node-local
        # readiness check included); clients are given only SASL_SSL.
        "listeners": f"PLAINTEXT://{host}:{broker.port},CONTROLLER://{host}:{broker.controller_port},"
                     f"SASL_SSL://{host}:{secure_port}",
        "advertised.listeners": f"PLAINTEXT://{host}:{broker.port},SASL_SSL://{host}:{secure_port}",
        "sasl.enabled.mechanisms": "SCRAM-SHA-512",
        "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config":
            "org.apache.kafka.common.security.scram.ScramLoginModule required;",
        "ssl.keystore.type": "PKCS12",
        "ssl.keystore.location": str(base / "broker.p12"),
        "ssl.keystore.password": KEYSTORE_PASSWORD,
        "ssl.key.password": KEYSTORE_PASSWORD,
        "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "super.users": "User:ANONYMOUS;User:admin",
    }
    with broker:
        yield SecuredBroker(broker, f"{host}:{secure_port}", base / "ca.pem", base / "other-ca.pem")


def grant(secured: SecuredBroker, user: str, prefix: str, *, group: bool = True) -> None:
    """What walbridge needs (README, "Secured clusters"): everything on its
    topics (and, with ``group``, its consumer group), Describe on its readers'
    groups, and on the cluster Describe, DescribeConfigs and IdempotentWrite."""
    admin = AdminClient(secured.client("admin"))
    principal = f"User:{user}"
    prefixed = [(ResourceType.TOPIC, prefix)] + ([(ResourceType.GROUP, prefix)] if group else [])
    bindings = [AclBinding(kind, name, ResourcePatternType.PREFIXED, principal, "*", AclOperation.ALL,
                           AclPermissionType.ALLOW) for kind, name in prefixed]
    bindings.append(AclBinding(ResourceType.GROUP, wire.READER_GROUP_PREFIX, ResourcePatternType.PREFIXED, principal,
                               "*", AclOperation.DESCRIBE, AclPermissionType.ALLOW))
    bindings += [AclBinding(ResourceType.BROKER, "kafka-cluster", ResourcePatternType.LITERAL, principal, "*", op,
                            AclPermissionType.ALLOW)
                 for op in (AclOperation.DESCRIBE, AclOperation.DESCRIBE_CONFIGS, AclOperation.IDEMPOTENT_WRITE)]
    for future in admin.create_acls(bindings).values():
        future.result(30)


def secured_config(secured: SecuredBroker, source_db, target_db, prefix: str, tmp_path: Path, **client) -> dict:
    group = f"{prefix}-spark"
    cfg = make_config(source_db, secured.bootstrap, prefix, [{"table": "public.items"}],
                      consumer={"group": group, "target_dsn": str(target_db),
                                "checkpoint_dir": str(tmp_path / "checkpoints"), "trigger_interval": 0.5},
                      ack={"consumer_groups": [group], "interval": 0.5})
    cfg["kafka"]["client"] = {"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512",
                              "sasl.username": "wb", "ssl.ca.location": str(secured.ca_file), **client}
    return cfg


def _items(source_db, rows: int = 200) -> None:
    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE items (id int PRIMARY KEY, name text)")
        conn.execute("INSERT INTO items SELECT g, 'item ' || g FROM generate_series(1, %s) g", (rows,))


def test_the_pipeline_runs_end_to_end_over_sasl_ssl(secured, source_db, target_db, topic_prefix, tmp_path):
    grant(secured, "wb", topic_prefix)
    _items(source_db)
    password_file = tmp_path / "kafka-password"
    password_file.write_text(PASSWORDS["wb"] + "\n")
    cfg = secured_config(secured, source_db, target_db, topic_prefix, tmp_path,
                         **{"sasl.password_file": str(password_file)})
    config = load_config(write_toml(cfg, tmp_path / "wb.toml"))  # the file is read as the commands read it
    assert config.kafka.client["sasl.password"] == PASSWORDS["wb"]
    cfg["kafka"]["client"] = dict(config.kafka.client)  # for verify's own clients
    with ProducerThread(config), ConsumerThread(config) as consumer:
        wait_for(lambda: verify_ok(cfg)[0] or consumer.errors, timeout=180, interval=1, what="the snapshot applied",
                 explain=lambda: pipeline_state(cfg))
        with psycopg.connect(source_db, autocommit=True) as conn:
            conn.execute("UPDATE items SET name = 'renamed' WHERE id <= 50")
            conn.execute("DELETE FROM items WHERE id > 150")
        ok = wait_for(lambda: verify_ok(cfg)[0] or consumer.errors, timeout=180, interval=1,
                      what="target == source", explain=lambda: pipeline_state(cfg))
        assert ok is True, [str(e) for e in consumer.errors] or verify_ok(cfg)[1]
    assert not consumer.errors


def _run_producer(cfg: dict, tmp_path: Path, env: dict | None = None, timeout: float = 120) -> tuple[int, str, float]:
    path = write_toml(cfg, tmp_path / "wb.toml")
    started = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "walbridge.cli", "producer", "-c", str(path)],
                         capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})},
                         cwd=Path(__file__).parent.parent.parent)
    return res.returncode, res.stdout + res.stderr, time.monotonic() - started


def test_a_wrong_password_ends_the_producer_at_once_naming_the_broker(secured, source_db, topic_prefix, tmp_path):
    _items(source_db)
    cfg = secured_config(secured, source_db, None, topic_prefix, tmp_path, **{"sasl.password": "${WB_KAFKA_PASSWORD}"})
    cfg.pop("consumer")
    wrong = "not-the-password-5e1d"
    code, output, took = _run_producer(cfg, tmp_path, env={"WB_KAFKA_PASSWORD": wrong})
    assert code == EXIT_KAFKA, output
    assert took < DENIED_EXIT_WITHIN_S, output
    failure = [line for line in output.splitlines() if line.startswith("walbridge: kafka")]
    assert len(failure) == 1, output
    assert secured.bootstrap in failure[0] and "SASL authentication" in failure[0], failure
    assert wrong not in output and PASSWORDS["wb"] not in output
    assert "retrying" not in output, output


def test_an_untrusted_certificate_ends_the_producer_at_once_naming_the_broker(secured, source_db, topic_prefix,
                                                                              tmp_path):
    _items(source_db)
    cfg = secured_config(secured, source_db, None, topic_prefix, tmp_path,
                         **{"sasl.password": PASSWORDS["wb"], "ssl.ca.location": str(secured.other_ca_file)})
    cfg.pop("consumer")
    code, output, took = _run_producer(cfg, tmp_path)
    assert code == EXIT_KAFKA, output
    assert took < DENIED_EXIT_WITHIN_S, output
    failure = [line for line in output.splitlines() if line.startswith("walbridge: kafka")]
    assert len(failure) == 1, output
    assert secured.bootstrap in failure[0] and "certificate verify failed" in failure[0], failure
    assert PASSWORDS["wb"] not in output


def test_acls_that_deny_the_topics_are_reported_as_such(secured, source_db, topic_prefix, tmp_path):
    _items(source_db)
    cfg = secured_config(secured, source_db, None, topic_prefix, tmp_path, **{"sasl.username": "outsider",
                                                                             "sasl.password": PASSWORDS["outsider"]})
    cfg.pop("consumer")
    code, output, took = _run_producer(cfg, tmp_path)
    assert code == EXIT_KAFKA, output
    assert took < DENIED_EXIT_WITHIN_S, output
    failure = [line for line in output.splitlines() if line.startswith("walbridge: kafka")]
    assert len(failure) == 1 and "authoriz" in failure[0].lower(), output
    assert "grant this principal" in output, output


def test_acls_that_deny_the_consumer_group_are_reported_as_such(secured, source_db, target_db, topic_prefix,
                                                                tmp_path):
    grant(secured, "wb", topic_prefix, group=False)  # its topics, not its group
    _items(source_db, rows=20)
    cfg = secured_config(secured, source_db, target_db, topic_prefix, tmp_path,
                         **{"sasl.password": PASSWORDS["wb"]})
    cfg["consumer"]["group"] = f"denied-{topic_prefix}"
    cfg["ack"]["consumer_groups"] = []
    with ProducerThread(cfg), ConsumerThread(cfg) as consumer:
        wait_for(lambda: consumer.errors or not consumer.thread.is_alive(), timeout=DENIED_EXIT_WITHIN_S + 60,
                 interval=0.5, what="the consumer to stop on the denied group")
    assert consumer.errors, "the consumer went on without its group"
    text = str(consumer.errors[0])
    assert text.startswith(f"kafka {secured.bootstrap}: ") and "group authorization failed" in text.lower(), text
    assert "grant this principal Read and Describe on the consumer groups" in text, text
