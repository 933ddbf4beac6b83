"""``walbridge status``: what the slot, the topics, the consumer groups and the
running producer say, in one place.

Invariants:
- Read-only: connects to the source and the broker, creates nothing.
- Produced offsets come from reading each partition's tail, never from the
  broker's reported end offset (wrong on Tansu).
- The producer's own view (pending and stalled writers, snapshot progress) is
  the last record it published to ``<topic_prefix>._status``; its age is shown,
  so a stopped producer is visible as such.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from confluent_kafka import Consumer, KafkaError, TopicPartition
from confluent_kafka.admin import AdminClient

from producer import catalog
from producer.config import Config
from producer.kafka_io import client_config, group_offsets, read_tails
from producer.replication import connect


def _last_record(conf: dict, topic: str) -> Any:
    consumer = Consumer({**conf, "group.id": f"walbridge-status-{uuid.uuid4().hex}", "enable.auto.commit": False,
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
    committed = group_offsets(admin, config.ack_groups, writers) if writers else {}
    producer_view = _last_record(conf, f"{config.kafka.topic_prefix}._status")
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
    from producer.backfill import read_states, requests_topic

    try:
        states, _ = read_states(conf, requests_topic(config.kafka.topic_prefix))
    except Exception:
        return []
    records = sorted(states.values(), key=lambda r: r.get("requested_at", 0))[-10:]
    applied: dict[str, dict] = {}
    if config.consumer.target_dsn and records:
        try:
            with connect(config.consumer.target_dsn) as conn:
                if conn.execute("SELECT to_regclass('_walbridge.backfills')").fetchone()[0] is not None:
                    for bid, done, n, completed, gc in conn.execute(
                            "SELECT backfill_id, coalesce(array_length(partitions_done, 1), 0), partitions, "
                            "completed_at IS NOT NULL, gc_deleted FROM _walbridge.backfills "
                            "WHERE consumer_group = %s", (config.consumer.group,)):
                        applied[bid] = {"partitions_done": done, "partitions": n, "completed": completed,
                                        "gc_deleted": gc}
        except Exception:
            pass
    for r in records:
        r["applied"] = applied.get(r.get("backfill_id") or "")
    return records


def render_status(status: dict):
    from rich.console import Group
    from rich.table import Table

    parts = []
    slot = status["slot"]
    t = Table(title="replication slot", show_header=False)
    if slot is None:
        t.add_row("slot", "not created yet")
    else:
        t.add_row("slot", f"{slot['name']} ({'active' if slot['active'] else 'inactive'})")
        t.add_row("confirmed_flush_lsn", slot["confirmed_flush_lsn"] or "-")
        t.add_row("current WAL", slot["current_wal_lsn"])
        t.add_row("retained WAL", human_bytes(slot["retained_wal_bytes"]))
    parts.append(t)
    w = Table(title="writers (topic-partitions)")
    w.add_column("writer")
    w.add_column("produced", justify="right")
    for g in status["groups"]:
        w.add_column(f"committed by {g}", justify="right")
    w.add_column("lag", justify="right")
    w.add_column("stalled")
    for row in status["writers"]:
        w.add_row(row["writer"], str(row["produced"]), *[str(row["committed"].get(g, 0)) for g in status["groups"]],
                  str(row["lag"]), "STALLED" if row["stalled"] else "")
    parts.append(w)
    p = status["producer"]
    pt = Table(title="producer", show_header=False)
    if p is None:
        pt.add_row("state", "no status published (not running yet?)")
    else:
        pt.add_row("last report", f"{p['age_s']}s ago")
        pt.add_row("confirmed LSN (sent)", p.get("confirmed_lsn") or "-")
        pt.add_row("waiting for groups", ", ".join(p.get("ack_groups") or []) or "(broker acks)")
        pt.add_row("stalled groups", ", ".join(p.get("stalled_groups") or []) or "none")
        snap = p.get("snapshot") or {}
        if snap:
            pt.add_row("snapshot", f"{snap.get('id')}: {snap.get('rows')} rows"
                       + (" (done)" if snap.get("done") else f" of ~{snap.get('total_estimate')}"))
    parts.append(pt)
    from producer.up import backfill_line

    running = (p or {}).get("backfill")
    line = backfill_line(running, len((p or {}).get("backfills_queued") or []),
                         len((p or {}).get("backfills_done") or []))
    if status.get("backfills") or line:
        bt = Table(title="backfills" + (f" — {line}" if line else ""))
        for col in ("request", "shape", "scope", "state", "rows", "applied by the consumer"):
            bt.add_column(col)
        for r in status.get("backfills") or []:
            scope = r.get("scope")
            applied = r.get("applied")
            bt.add_row(r["request_id"], r["shape"],
                       f"{len(scope['buckets'])}/{scope['bucket_count']} buckets" if scope else "whole shape",
                       r["state"], str(r.get("rows", "-")),
                       "-" if not applied else ("complete, GC deleted " + str(applied["gc_deleted"])
                                                if applied["completed"] else
                                                f"{applied['partitions_done']}/{applied['partitions']} partitions"))
        parts.append(bt)
    return Group(*parts)


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"
