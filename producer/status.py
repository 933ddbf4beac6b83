"""The producer's own view of itself: for ``walbridge status`` and ``up`` (the
``<prefix>._status`` topic and the ``on_status`` callback) and for the
Prometheus metrics of :mod:`producer.metrics`.

Invariants:
- Status is best effort, data is not: a full local producer queue drops a
  status record, never holds a change back.
- The metrics follow the same counters as the view, brought up to date each
  time status is published; counters only ever grow (by what was counted
  since the last publish).
- The slot's retained WAL is a catalog read: at most every
  ``RETAINED_WAL_INTERVAL`` seconds, and a failed read leaves the gauge as it was.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import psycopg
from confluent_kafka import Producer

from producer import catalog, metrics
from producer.acks import Acks
from producer.backfill import Backfills
from producer.pgoutput import lsn_to_str
from producer.snapshot import InitialSnapshot
from schemas import wire
from schemas.config import Config
from schemas.kafka import Writer

RETAINED_WAL_INTERVAL = 10.0  # seconds between reads of the slot's retained WAL


@dataclass
class Stats:
    """What the stream has counted since the producer started this run."""

    events: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))  # (shape, op) → count
    skipped_replayed: int = 0
    transactions: int = 0
    last_commit_ts_ms: int = 0  # source commit time of the last transaction read
    stream_idle: bool = True  # the stream had nothing more to give since that transaction
    # Shapes stopped by a schema change they cannot follow: name → {"error", "held_lsn", "since"}.
    stopped_shapes: dict[str, dict] = field(default_factory=dict)


class StatusPublisher:
    """Builds the producer's view and publishes it with the metrics."""

    def __init__(self, config: Config, kafka: Producer, conn: psycopg.Connection, stats: Stats, acks: Acks,
                 snapshot: InitialSnapshot, backfills: Backfills, on_status: Callable[[dict], None] | None):
        self._slot = config.source.slot
        self._topic = wire.status_topic(config.kafka.topic_prefix)
        self._kafka = kafka
        self._conn = conn  # the catalog connection: the slot's retained WAL
        self._stats = stats
        self._acks = acks
        self._snapshot = snapshot
        self._backfills = backfills
        self._on_status = on_status
        self._metric_events: dict[tuple[str, str], int] = {}
        self._metric_tx = 0
        self._last_slot_read = 0.0

    def view(self) -> dict:
        """The producer's own view, for ``walbridge status``, ``up`` and metrics."""

        def name(w: Writer) -> str:
            return f"{w[0]}[{w[1]}]"

        acks, stats, backfills = self._acks, self._stats, self._backfills
        events: dict[str, dict[str, int]] = defaultdict(dict)
        for (shape, op), n in stats.events.items():
            events[shape][op] = n
        return {
            "ts": time.time(),
            "slot": self._slot,
            "confirmed_lsn": lsn_to_str(acks.confirmed_lsn) if acks.confirmed_lsn else None,
            "last_seen": list(acks.tracker.last_seen),
            "pending": {name(w): {"last_sent": list(s), "last_flushed": list(f)}
                        for w, (s, f) in acks.tracker.pending().items()},
            "produced": {name(w): o + 1 for w, o in acks.ledger.last_offset.items()},
            "ack_groups": list(acks.groups),
            "stalled_writers": [name(w) for w in acks.stalled_writers],
            "stalled_groups": list(acks.stalled_groups),
            "stopped_shapes": {shape: {**stop, "wal_held": shape in acks.holds}
                               for shape, stop in stats.stopped_shapes.items()},
            "events": dict(events),
            "transactions": stats.transactions,
            "skipped_replayed": stats.skipped_replayed,
            "snapshot": dict(self._snapshot.progress),
            "backfill": backfills.running.progress() if backfills.running is not None else None,
            "backfills_queued": [{"request_id": r["request_id"], "shape": r["shape"]} for r in backfills.queue],
            "backfills_done": list(backfills.done),
        }

    def publish(self) -> None:
        view = self.view()
        self._sync_metrics()
        if self._on_status is not None:
            self._on_status(view)
        try:
            self._kafka.produce(self._topic, json.dumps(view).encode(), b"producer")
        except BufferError:
            pass  # status is best effort; data is not

    def _sync_metrics(self) -> None:
        stats, acks, snapshot = self._stats, self._acks, self._snapshot.progress
        for key, n in stats.events.items():
            delta = n - self._metric_events.get(key, 0)
            if delta:
                metrics.EVENTS.labels(*key).inc(delta)
                self._metric_events[key] = n
        metrics.TRANSACTIONS.inc(stats.transactions - self._metric_tx)
        self._metric_tx = stats.transactions
        metrics.CONFIRMED_LSN.set(acks.confirmed_lsn)
        metrics.SOURCE_LAG.set(0.0 if stats.stream_idle or not stats.last_commit_ts_ms
                               else max(time.time() - stats.last_commit_ts_ms / 1000, 0.0))
        metrics.STALLED_WRITERS.set(len(acks.stalled_writers))
        metrics.STALLED_GROUPS.set(len(acks.stalled_groups))
        metrics.STOPPED_SHAPES.set(len(stats.stopped_shapes))
        if snapshot:
            metrics.SNAPSHOT_PROGRESS.set(snapshot.get("rows", 0))
            metrics.SNAPSHOT_TOTAL.set(snapshot.get("total_estimate", 0))
        now = time.monotonic()
        if now - self._last_slot_read >= RETAINED_WAL_INTERVAL:
            self._last_slot_read = now
            try:
                state = catalog.slot_state(self._conn, self._slot)
                if state and state["retained_wal_bytes"] is not None:
                    metrics.RETAINED_WAL.set(state["retained_wal_bytes"])
            except psycopg.Error:
                pass
