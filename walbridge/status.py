"""``walbridge status``: what the slot, the topics, the consumer groups and the
running producer say, in one place.

Invariants:
- Read-only: connects to the source and the broker, creates nothing.
- Produced offsets are each partition's last walbridge message (its tail),
  not the end offset, which also counts backfill and foreign messages.
- The producer's own view (pending and stalled writers, snapshot progress) is
  the last record it published to ``<topic_prefix>._status``; its age is shown,
  so a stopped producer is visible as such.
"""

from __future__ import annotations

import json
import time
from typing import Any

from confluent_kafka import Consumer, KafkaError, TopicPartition
from confluent_kafka.admin import AdminClient

from producer import catalog
from producer.backfill_requests import read_states
from producer.kafka_io import read_tails
from producer.replication import connect
from schemas import wire
from schemas.config import Config
from schemas.kafka import client_config, group_offsets
from spark_consumer.progress import read_backfills


def _last_record(conf: dict, topic: str) -> Any:
    consumer = Consumer({**conf, "group.id": wire.reader_group("status"), "enable.auto.commit": False,
                         "enable.partition.eof": True})
    try:
        low, high = consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=5)
        consumer.assign([TopicPartition(topic, 0, max(low, high - 1))])
        last = None
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            if msg.error():
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    break
                continue
            last = msg.value()
        return json.loads(last) if last else None
    except Exception:
        return None
    finally:
        consumer.close()


def collect_status(config: Config) -> dict:
    conf = client_config(config.kafka.bootstrap_servers, config.kafka.client)
    out: dict[str, Any] = {"slot": None, "writers": [], "groups": config.ack_groups, "producer": None}
    with connect(config.source.dsn) as conn:
        slot = catalog.slot_state(conn, config.source.slot)
    if slot is not None:
        out["slot"] = {"name": config.source.slot, "active": slot["active"],
                       "confirmed_flush_lsn": slot["confirmed_flush_lsn"], "restart_lsn": slot["restart_lsn"],
                       "current_wal_lsn": slot["current_wal_lsn"], "retained_wal_bytes": slot["retained_wal_bytes"]}
    admin = AdminClient(conf)
    meta = admin.list_topics(timeout=10).topics
    writers = [(config.topic(s), p) for s in config.shapes if config.topic(s) in meta
               for p in sorted(meta[config.topic(s)].partitions)]
    tails = read_tails(conf, writers, timeout=15) if writers else {}
    committed = group_offsets(conf, config.ack_groups, writers) if writers else {}
    producer_view = _last_record(conf, wire.status_topic(config.kafka.topic_prefix))
    if producer_view:
        producer_view["age_s"] = round(time.time() - producer_view.get("ts", 0), 1)
    out["producer"] = producer_view
    out["backfills"] = _backfills(config, conf)
    stalled = set((producer_view or {}).get("stalled_writers", []))
    for w in writers:
        tail = tails.get(w)
        produced = tail.offset + 1 if tail else 0
        name = f"{w[0]}[{w[1]}]"
        out["writers"].append({
            "writer": name, "produced": produced,
            "committed": {g: committed[g].get(w, 0) for g in committed},
            "lag": max((produced - c.get(w, 0) for c in committed.values()), default=0),
            "stalled": name in stalled,
        })
    return out


def _backfills(config: Config, conf: dict) -> list[dict]:
    """The last requests (``<prefix>._backfills``), each with what the
    consumer group applied of it (``_walbridge.backfills`` on the target)."""
    try:
        states, _ = read_states(conf, wire.backfills_topic(config.kafka.topic_prefix))
    except Exception:
        return []
    records = sorted(states.values(), key=lambda r: r.get("requested_at", 0))[-10:]
    applied: dict[str, dict] = {}
    if config.consumer.target_dsn and records:
        try:
            with connect(config.consumer.target_dsn) as conn:
                for b in read_backfills(conn, config.consumer.group):
                    applied[b["backfill_id"]] = {"partitions_done": len(b["partitions_done"] or ()),
                                                 "partitions": b["partitions"],
                                                 "completed": b["completed_at"] is not None,
                                                 "gc_deleted": b["gc_deleted"]}
        except Exception:
            pass
    for r in records:
        r["applied"] = applied.get(r.get("backfill_id") or "")
    return records
