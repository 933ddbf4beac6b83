"""A shape's writer schemas: which exist (discovered on the driver, from the
Schema Registry or the ``<prefix>._schemas`` topic), and how an executor
finds one it was not handed (by schema id, or by fingerprint without a
registry).

Invariants:
- The newest value schema (and key schema) of a shape defines the layout its
  batches are decoded into (:meth:`ShapeSchemas.layout`). Every value schema
  that exists at discovery is *known*; a message written with another makes
  its decode end with a ``new_schema`` row, and the driver discovers again
  between two decodes of the batch: a schema change never restarts the query.
- Every schema found at discovery travels to the executors with the decode
  function; they look up (and cache, per Python worker) only those published
  later. A lookup that finds nothing makes the message undecodable (it goes
  to the DLQ); a lookup that fails (registry or broker unreachable)
  propagates: infrastructure is never taken for a bad message.
- The producer publishes a shape's schema before its first message: a start
  that finds none waits (:func:`wait_for_schemas`), and a ref a message names
  that discovery does not find is no new schema but an undecodable message
  (``ShapeSchemas.unpublished``: it goes to the DLQ).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from confluent_kafka.schema_registry.error import SchemaRegistryError

from schemas import wire
from schemas.config import Config, ShapeConfig, redact_dsn
from schemas.failures import attributed
from schemas.kafka import client_config
from schemas.reader import SchemaResolver, read_schemas_topic
from schemas.registry import data_subjects, subject_versions
from schemas.retry import Outage, RetryPolicy
from spark_consumer.decode import ShapeLayout, UndecodableMessage, WriterSchemas, schema_ref_key

log = logging.getLogger("walbridge.consumer")

SCHEMAS_WAIT_S = 600.0  # a start waits this long for the producer to publish a shape's first schema


class Stopped(Exception):
    """``stop`` was set while a start waited."""


@dataclass(frozen=True)
class ShapeSource:
    """Where a shape's messages and schemas are: what its decode needs on an
    executor (plain values: it is pickled with the decode function)."""

    topic: str
    bootstrap_servers: str
    topic_prefix: str | None = None
    schema_registry_url: str | None = None
    schema_registry_client: dict[str, Any] = field(default_factory=dict)  # credentials among them
    subject_name_strategy: str = "topic"
    kafka_client: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, config: Config, shape: ShapeConfig) -> ShapeSource:
        registry_client = {k: v for k, v in config.kafka.registry_client_config().items() if k != "url"}
        return cls(config.topic(shape), config.kafka.bootstrap_servers, config.kafka.topic_prefix,
                   config.kafka.schema_registry_url, registry_client, config.kafka.subject_name_strategy,
                   dict(config.kafka.client))

    def client_conf(self) -> dict[str, Any]:
        """Settings of a librdkafka client made where it runs (driver or
        executor): it logs through Python logging there."""
        return client_config(self.bootstrap_servers, self.kafka_client)

    def registry(self) -> dict[str, Any] | None:
        """The Schema Registry client settings, or None without a registry."""
        if not self.schema_registry_url:
            return None
        return {"url": self.schema_registry_url, **self.schema_registry_client}


@dataclass(frozen=True)
class ShapeSchemas:
    """What a shape's batches are decoded with: the layout's value/key
    schemas, the refs (``id:<n>`` / ``fp:<hex>``) of the value schemas known
    at discovery, every value/key writer schema found then, by ref, and the
    refs that messages named and discovery did not find (``unpublished``)."""

    value_schema: dict
    key_schema: dict | None = None
    known_value_refs: tuple[str, ...] = ()
    writer_schemas: dict[str, dict] = field(default_factory=dict)
    # Refs messages named that discovery did not find: no new schema, poison (the DLQ's).
    unpublished: tuple[str, ...] = ()

    def layout(self) -> ShapeLayout:
        return ShapeLayout.from_schemas(self.value_schema, self.key_schema)


def discover_schemas(src: ShapeSource, timeout: float = 30.0,
                     records: list[tuple[str, str, dict]] | None = None) -> ShapeSchemas:
    """The shape's schemas now, from the registry or the ``<prefix>._schemas``
    topic (or ``records`` already read from it: :func:`read_schemas_records`).
    Raises ``LookupError`` when the topic has no value schema yet."""
    value_subject, key_subject = f"{src.topic}-value", f"{src.topic}-key"
    registry = src.registry()
    if registry is not None:
        value_subject, key_subject = data_subjects(src.subject_name_strategy, src.topic)
        values = subject_versions(registry, value_subject)
        if not values:
            raise LookupError(f"no schema under subject {value_subject!r} in {redact_dsn(registry['url'])}: "
                              "has the producer published this shape yet?")
        keys = subject_versions(registry, key_subject)
        return ShapeSchemas(values[-1][2], keys[-1][2] if keys else None,
                            tuple(f"id:{i}" for _, i, _ in values),
                            {f"id:{schema_id}": schema for _, schema_id, schema in values + keys})
    if not src.topic_prefix:
        raise ValueError("without a schema registry the topic prefix is needed "
                         "(schemas live in <topic_prefix>._schemas)")
    if records is None:
        records = read_schemas_records(src, timeout)
    values = [(fp, s) for subject, fp, s in records if subject == value_subject]
    keys = [(fp, s) for subject, fp, s in records if subject == key_subject]
    if not values:
        raise LookupError(f"no schema for subject {value_subject!r} in {wire.schemas_topic(src.topic_prefix)}: "
                          "has the producer published this shape yet?")
    return ShapeSchemas(values[-1][1], keys[-1][1] if keys else None,
                        tuple(dict.fromkeys(f"fp:{fp}" for fp, _ in values)),
                        {f"fp:{fp}": schema for fp, schema in values + keys})


def read_schemas_records(src: ShapeSource, timeout: float = 30.0) -> list[tuple[str, str, dict]]:
    """Every record of ``<prefix>._schemas`` (:func:`schemas.reader.read_schemas_topic`)."""
    return read_schemas_topic(src.client_conf(), wire.schemas_topic(src.topic_prefix), timeout)


def wait_for_schemas(src: ShapeSource, discover: Callable[[ShapeSource], ShapeSchemas], policy: RetryPolicy,
                     stop: threading.Event | None = None, timeout: float = SCHEMAS_WAIT_S) -> ShapeSchemas:
    """``discover(src)``, waiting up to ``timeout`` for the producer to publish
    the shape's first schema, and for an unreachable broker or registry as
    long as ``policy`` says."""
    deadline = time.monotonic() + timeout
    for attempt in Outage(policy, stop, log):
        with attempt, attributed(kafka=src.bootstrap_servers, registry=src.schema_registry_url):
            while True:
                try:
                    return discover(src)
                except LookupError:
                    if time.monotonic() > deadline:
                        raise
                    log.info("waiting for the producer to publish the schema of %s", src.topic)
                    if stop is not None and stop.wait(2.0):
                        raise Stopped() from None
    raise Stopped()


def schema_lookup(src: ShapeSource, preloaded: dict[str, dict]) -> Callable[[wire.SchemaRef, bytes], dict]:
    """Writer schema (JSON) by wire reference: handed-over schemas first, then
    the registry (by id) or the schemas topic (by fingerprint). Not found:
    :class:`~spark_consumer.decode.UndecodableMessage`; failures propagate."""
    resolver = SchemaResolver(src.client_conf(), src.topic_prefix, src.registry())

    def lookup(ref: wire.SchemaRef, data: bytes) -> dict:
        found = preloaded.get(schema_ref_key(ref))
        if found is not None:
            return found
        try:
            return resolver.raw_schema(data)
        except SchemaRegistryError as e:
            if e.http_status_code == 404:
                hint = (" (a mock:// registry lives in one process: executors only know the schemas "
                        "handed over at the query's start)") if src.schema_registry_url.startswith("mock://") else ""
                raise UndecodableMessage(f"unknown schema id {ref.ref}{hint}") from None
            raise
        except ValueError as e:  # no registry, no schemas topic, or a fingerprint it does not hold
            raise UndecodableMessage(str(e)) from None

    return lookup


_writer_schemas: dict[str, WriterSchemas] = {}  # per Python worker: parsed schemas outlive a task


def writer_schemas_for(src: ShapeSource, schemas: ShapeSchemas) -> WriterSchemas:
    """The (cached) writer schemas a decode of ``src`` with ``schemas`` reads
    with; any value schema not known at discovery marks the batch for a new
    discovery (``only_known``)."""
    # Keyed by content, since each task unpickles the shapes anew. The plain
    # data's repr costs ~1/10 of a sorted JSON of the dataclasses (per shape
    # of every task); equal content in another dict order only misses.
    key = hashlib.sha256(repr((src, schemas)).encode()).hexdigest()
    ws = _writer_schemas.get(key)
    if ws is None:
        ws = _writer_schemas[key] = WriterSchemas(schemas.layout(), schema_lookup(src, schemas.writer_schemas),
                                                  frozenset(schemas.known_value_refs), only_known=True,
                                                  unpublished=frozenset(schemas.unpublished))
    return ws
