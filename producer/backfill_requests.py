"""Backfill requests: how ``walbridge backfill``/``reconcile`` ask the producer
for a backfill, and how both follow its state.

Invariants:
- Requests and their state live in ``<prefix>._backfills`` (one partition, a
  JSON record keyed by the request id; the latest record of an id wins):
  ``requested`` → ``running`` → ``done`` or ``failed``.
- A request names a shape of the config; any other is refused before anything
  is sent.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from schemas import wire
from schemas.config import Config
from schemas.kafka import client_config, ensure_topics, read_to_end, timed_out

log = logging.getLogger("walbridge.backfill")

STATES = ("requested", "running", "done", "failed")
DELIVERY_TIMEOUT_S = 30.0


def publish_state(producer: Producer, topic: str, record: dict) -> None:
    producer.produce(topic, json.dumps(record).encode(), record["request_id"].encode())


def request_backfill(config: Config, shape: str, scope: dict | None = None, reason: str = "manual") -> str:
    """Ask the producer (running or not) to backfill ``shape``; returns the request id."""
    names = [s.shape_name for s in config.shapes]
    if shape not in names:
        raise ValueError(f"no shape named {shape!r} in the config (shapes: {', '.join(names)})")
    request_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"
    record = {"request_id": request_id, "shape": shape, "scope": scope, "reason": reason, "state": "requested",
              "requested_at": time.time()}
    conf = client_config(config.kafka.bootstrap_servers, config.kafka.client)
    ensure_topics(AdminClient(conf), [wire.backfills_topic(config.kafka.topic_prefix)], 1,
                  config.kafka.replication_factor or -1, wire.INTERNAL_TOPIC_CONFIG)
    producer = Producer(conf)
    publish_state(producer, wire.backfills_topic(config.kafka.topic_prefix), record)
    if producer.flush(DELIVERY_TIMEOUT_S):
        raise timed_out(f"the backfill request could not be delivered to Kafka within {DELIVERY_TIMEOUT_S:.0f}s")
    return request_id


def read_states(kafka_conf: dict[str, Any], topic: str) -> tuple[dict[str, dict], int]:
    """The latest record of every request, and the offset after the last one read."""
    states: dict[str, dict] = {}
    end = 0
    for msg in read_to_end(kafka_conf, topic, "backfills"):
        end = msg.offset() + 1
        try:
            record = json.loads(msg.value())
            states[record["request_id"]] = record
        except (TypeError, ValueError, KeyError):
            log.warning("ignoring an unreadable record at %s[0]@%d", topic, msg.offset())
    return states, end
