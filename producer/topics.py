"""The producer's Kafka topics: created with the settings walbridge needs and
checked at every start for settings that could lose data.

Invariants:
- Internal topics (``_schemas``, ``_status``, ``_backfills``, ``_checkpoint``)
  are created compacted with no time limit (``wire.INTERNAL_TOPIC_CONFIG``),
  dead-letter topics keeping everything (``wire.DLQ_TOPIC_CONFIG``). One that
  exists with other settings is reported with the command that fixes it:
  walbridge never alters a topic's settings itself.
- Data topics are created with ``wire.DATA_TOPIC_CONFIG`` overlaid by
  ``[kafka] topic_config``. One whose settings may delete a change before
  every consumer group has read it (time or size retention, or compaction
  that drops delete tombstones) stops the producer, or with ``[kafka]
  on_finite_retention = "warn"`` is logged and tolerated.
- A compacted data topic never receives a message without a key (Kafka
  rejects them): a keyless shape on one stops the producer.
- Topics are created with ``[kafka] replication_factor`` replicas, or, unset,
  the cluster's own ``default.replication.factor`` and ``min.insync.replicas``.
  A topic with fewer replicas than configured, or whose
  ``min.insync.replicas`` exceeds its replicas (no ``acks=all`` write could
  ever be acknowledged), stops the producer; several replicas of which one
  is enough to acknowledge a write (``min.insync.replicas=1``), or one replica
  on a cluster of several brokers, is logged: an acknowledged change can then
  be lost with one broker.
- What the broker does not report is not guessed at: a setting missing from
  DescribeConfigs (a broker may withhold some, e.g. to a client without
  DescribeConfigs rights on defaults) is never a finding by itself; a reported
  retention on a topic whose cleanup.policy is not reported is judged under
  Kafka's default policy, delete.
- The analysis (:func:`internal_findings`, :func:`data_findings`) is pure.
"""

from __future__ import annotations

import logging
from typing import Iterable

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource

from schemas import wire
from schemas.config import Config
from schemas.failures import KAFKA, Failure
from schemas.kafka import METADATA_TIMEOUT, asked_until_complete, ensure_topics, metadata_with

log = logging.getLogger("walbridge.producer")

_DAY_MS = 86_400_000
# Apache Kafka's default delete.retention.ms, when a broker does not report it.
DEFAULT_DELETE_RETENTION_MS = _DAY_MS


class TopicConfigError(Failure):
    """A data topic's settings could lose changes (see the module invariants):
    permanent, a ``kafka`` failure (exit code 4)."""

    def __init__(self, problem: str, fix: str):
        super().__init__(KAFKA, problem, fix)


def _duration(ms: int) -> str:
    if ms % _DAY_MS == 0:
        return f"{ms // _DAY_MS} day{'s' if ms != _DAY_MS else ''}"
    if ms % 3_600_000 == 0:
        return f"{ms // 3_600_000} h"
    return f"{ms / 1000:g} s"


def _policies(config: dict[str, str]) -> set[str] | None:
    policy = config.get("cleanup.policy")
    return None if policy is None else {p.strip() for p in policy.split(",")}


def _deletes(config: dict[str, str]) -> list[str]:
    """What a topic with cleanup.policy ``delete`` removes by time or size."""
    if "delete" not in (_policies(config) or {"delete"}):  # unreported: Kafka's default, delete
        return []
    out = []
    ms, size = config.get("retention.ms"), config.get("retention.bytes")
    if ms is not None and int(ms) >= 0:
        out.append(f"deletes messages after {_duration(int(ms))} (retention.ms={ms})")
    if size is not None and int(size) >= 0:
        out.append(f"deletes the oldest messages beyond {int(size)} bytes per partition (retention.bytes={size})")
    return out


def fix_command(bootstrap: str, topic: str, settings: dict[str, str]) -> str:
    return (f"kafka-configs.sh --bootstrap-server {bootstrap} --alter --entity-type topics --entity-name {topic} "
            f"--add-config {','.join(f'{k}={v}' for k, v in settings.items())}")


def internal_findings(topic: str, config: dict[str, str], wanted: dict[str, str]) -> list[str]:
    """Why ``topic`` (internal, meant to have ``wanted``) may lose records it needs."""
    policies = _policies(config)
    out = []
    if wanted.get("cleanup.policy") == "compact" and policies is not None and "compact" not in policies:
        out.append(f"is not compacted (cleanup.policy={config['cleanup.policy']})")
    out += _deletes(config)
    return out


def data_findings(topic: str, config: dict[str, str], tombstones: bool, bootstrap: str) -> list[str]:
    """How ``topic`` (a data topic) could delete a change before every consumer
    group has read it, each with its remedy."""
    out = [f"{finding}; keep them: {fix_command(bootstrap, topic, {'retention.ms': '-1', 'retention.bytes': '-1'})}"
           for finding in _deletes(config)]
    policies = _policies(config)
    if tombstones and policies is not None and "compact" in policies:
        keep = int(config.get("delete.retention.ms", DEFAULT_DELETE_RETENTION_MS))
        out.append(f"is compacted and drops a deleted key's tombstone, with the delete before it, "
                   f"{_duration(keep)} after compaction (delete.retention.ms={keep}); set [kafka] "
                   "tombstones_on_delete = false to keep every delete as its key's last message")
    return out


def replication_findings(topic: str, replicas: int, config: dict[str, str], wanted: int | None,
                         brokers: int, bootstrap: str) -> tuple[list[str], list[str]]:
    """What is wrong with ``topic``'s replication (``replicas`` per partition,
    the fewest; ``wanted``: ``[kafka] replication_factor``, None for the
    cluster's default; ``brokers``: the cluster's size), as (refused, warned)."""
    refused, warned = [], []
    min_isr = config.get("min.insync.replicas")
    if wanted is not None and replicas < wanted:
        refused.append(f"topic {topic} has {replicas} replica(s), fewer than [kafka] replication_factor = {wanted}: "
                       f"reassign its partitions (kafka-reassign-partitions.sh) or lower the setting")
    if min_isr is not None and int(min_isr) > replicas:
        refused.append(f"topic {topic} has min.insync.replicas={min_isr} but {replicas} replica(s): no write with "
                       f"acks=all can be acknowledged; fix: "
                       f"{fix_command(bootstrap, topic, {'min.insync.replicas': str(replicas)})}")
    elif replicas > 1 and min_isr is not None and int(min_isr) < 2:
        warned.append(f"topic {topic} has {replicas} replicas but min.insync.replicas={min_isr}: a change "
                      "acknowledged by one broker is lost if that broker fails before the others copied it; set "
                      "min.insync.replicas=2")
    elif replicas == 1 and brokers > 1:
        warned.append(f"topic {topic} has one replica on a cluster of {brokers} brokers: losing that broker's disk "
                      "loses its changes; set [kafka] replication_factor (or the cluster's default.replication.factor)")
    return refused, warned


def describe(admin: AdminClient, topics: Iterable[str], timeout: float = 30.0) -> dict[str, dict[str, str]]:
    """The settings the broker reports for each existing topic (Apache Kafka:
    every effective value, defaults included)."""
    resources = [ConfigResource("topic", t) for t in dict.fromkeys(topics)]
    if not resources:
        return {}
    out: dict[str, dict[str, str]] = {}
    for res, fut in admin.describe_configs(resources, request_timeout=timeout).items():
        try:
            entries = fut.result()
        except KafkaException as e:
            if e.args[0].code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
                continue
            raise
        out[res.name] = {name: e.value for name, e in entries.items() if e.value is not None}
    return out


def described(admin: AdminClient, topics: list[str], optional: list[str]) -> dict[str, dict[str, str]]:
    """:func:`describe` of ``topics`` and ``optional``, asked again while the
    broker answering does not know one of ``topics`` yet (just created)."""
    return asked_until_complete(lambda: describe(admin, topics + optional),
                                lambda settings: [t for t in topics if t not in settings],
                                METADATA_TIMEOUT, "no settings reported for topics")


def prepare_topics(admin: AdminClient, config: Config, with_schemas_topic: bool,
                   keyless_topics: set[str]) -> dict[str, int]:
    """Create what is missing and check the settings of every topic of the
    deployment; returns each data topic's partition count. ``keyless_topics``:
    data topics of shapes without a key (their messages have null keys)."""
    k = config.kafka
    data = [config.topic(s) for s in config.shapes]
    replication = k.replication_factor or -1  # -1: the cluster's default
    internal = [t for t in wire.internal_topics(k.topic_prefix)
                if with_schemas_topic or t != wire.schemas_topic(k.topic_prefix)]
    # The internal topics first: a broker makes the logs of new partitions in
    # the order they were created, and a topic created behind 200 shapes' 800
    # partitions was not in its metadata for 2.6-5.5 s (bench/RESULTS.md);
    # the data topics' logs are made while the slot and the schemas are.
    ensure_topics(admin, internal, 1, replication, wire.INTERNAL_TOPIC_CONFIG)
    partitions = ensure_topics(admin, data, k.partitions, replication,
                               {**wire.DATA_TOPIC_CONFIG, **{n: str(v) for n, v in k.topic_config.items()}})
    # Asked again, possibly of another broker: wait until it knows them too.
    cluster = metadata_with(admin, data + internal, METADATA_TIMEOUT)
    dlqs = [wire.dlq_topic(t) for t in data if wire.dlq_topic(t) in cluster.topics]
    settings = described(admin, data + internal, dlqs)
    refused = []
    for topic in data + internal + dlqs:
        replicas = min((len(p.replicas) for p in cluster.topics[topic].partitions.values()), default=0)
        bad, weak = replication_findings(topic, replicas, settings.get(topic, {}), k.replication_factor,
                                         len(cluster.brokers), k.bootstrap_servers)
        refused += bad
        for line in weak:
            log.warning("%s", line)
    if refused:
        raise TopicConfigError(" | ".join(refused), "fix each topic's replication as named, then start again")
    for topic in internal + dlqs:
        wanted = wire.DLQ_TOPIC_CONFIG if topic in dlqs else wire.INTERNAL_TOPIC_CONFIG
        for finding in internal_findings(topic, settings.get(topic, {}), wanted):
            log.warning("topic %s %s: it must keep its records as long as the deployment lives; fix: %s",
                        topic, finding, fix_command(k.bootstrap_servers, topic, wanted))
    for topic in data:
        config_ = settings.get(topic, {})
        if topic in keyless_topics and "compact" in (_policies(config_) or ()):
            raise TopicConfigError(
                f"topic {topic} is compacted, but its shape has no primary key: its messages have no key, "
                "which a compacted topic rejects",
                "give the table a primary key, or set the topic's "
                f"cleanup.policy to delete ({fix_command(k.bootstrap_servers, topic, {'cleanup.policy': 'delete'})})")
        for finding in data_findings(topic, config_, k.tombstones_on_delete, k.bootstrap_servers):
            refused.append(f"topic {topic} {finding}")
    if refused:
        text = ("a consumer group that falls behind further than a data topic keeps its messages loses changes "
                "without noticing: " + " | ".join(refused))
        if k.on_finite_retention == "refuse":
            raise TopicConfigError(text, "run the command named for each topic (it keeps its messages for good), "
                                         'or set [kafka] on_finite_retention = "warn" to run anyway')
        log.warning("%s (on_finite_retention = \"warn\": running anyway)", text)
    return partitions
