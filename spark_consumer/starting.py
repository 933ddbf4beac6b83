"""What a streaming query needs before it starts, whichever way the shapes
are spread over queries (:mod:`spark_consumer.job`: one per shape;
:mod:`spark_consumer.shapes_query`: one over all): each shape's source
options, its writer schemas (waited for: the producer publishes them before
its first message), and the waits for unreachable endpoints.

Invariants:
- A wait ends when ``stop`` is set (:class:`Stopped`), when the endpoint
  answers, or when the retry policy gives up (``[consumer]
  reconnect_max_elapsed``; default: never).
- The source's ``on_data_loss`` and the apply's ``on_offset_reset`` both
  follow ``[consumer] on_data_loss``.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

from schemas.config import Config, ShapeConfig
from schemas.failures import attributed
from schemas.retry import Outage, RetryPolicy
from spark_consumer.kafka_source import SourceOptions

log = logging.getLogger("walbridge.consumer")

OFFSET_RESET = {"follow": "follow", "stop": "raise"}  # [consumer] on_data_loss -> apply's on_offset_reset
SOURCE_ON_DATA_LOSS = {"follow": "follow", "stop": "fail"}  # ... -> the source's on_data_loss
NEW_SCHEMA_ROUNDS = 3  # lookups of the schemas for one batch (the producer publishes before it writes)


class Stopped(Exception):
    """``stop`` was set while a start waited."""


def retry_policy(config: Config) -> RetryPolicy:
    return RetryPolicy(config.consumer.reconnect_max_backoff, config.consumer.reconnect_max_elapsed)


def pause(stop: threading.Event | None, seconds: float) -> bool:
    """Sleep; True when ``stop`` was set meanwhile."""
    if stop is None:
        time.sleep(seconds)
        return False
    return stop.wait(seconds)


def source_options(config: Config, shape: ShapeConfig) -> SourceOptions:
    """The Kafka source's options for ``shape``'s topic; every call is a new
    run, read with range consumers of its own (none an earlier run left)."""
    registry_client = {k: v for k, v in config.kafka.registry_client_config().items() if k != "url"}
    return SourceOptions(topic=config.topic(shape), bootstrap_servers=config.kafka.bootstrap_servers,
                         topic_prefix=config.kafka.topic_prefix,
                         schema_registry_url=config.kafka.schema_registry_url,
                         schema_registry_client=registry_client,
                         subject_name_strategy=config.kafka.subject_name_strategy,
                         kafka_client=dict(config.kafka.client),
                         max_offsets_per_trigger=config.consumer.max_offsets_per_trigger,
                         on_data_loss=SOURCE_ON_DATA_LOSS[config.consumer.on_data_loss],
                         run=uuid.uuid4().hex)


def wait_for_schemas(opts, discover, policy: RetryPolicy, stop: threading.Event | None = None,
                     timeout: float = 600.0):
    """The producer publishes a shape's schema before its first message; a
    consumer started first waits for it (up to ``timeout``), and for an
    unreachable broker or registry as long as ``policy`` says."""
    deadline = time.monotonic() + timeout
    for attempt in Outage(policy, stop, log):
        with attempt, attributed(kafka=opts.bootstrap_servers, registry=opts.schema_registry_url):
            while True:
                try:
                    return discover(opts)
                except LookupError:
                    if time.monotonic() > deadline:
                        raise
                    log.info("waiting for the producer to publish the schema of %s", opts.topic)
                    if pause(stop, 2.0):
                        raise Stopped() from None
    raise Stopped()
