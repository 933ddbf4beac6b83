"""Prometheus metrics of the producer (served on ``[metrics] port`` by the
``walbridge`` command).

Invariants:
- Metrics are process-global (prometheus-client's default registry) and only
  ever describe this process; several pipelines in one process (tests) share them.
- Names carry the ``walbridge_`` prefix and units in their names.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

# Seconds, from sub-second (a caught-up pipeline) to minutes (a backlog).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

EVENTS = Counter("walbridge_events", "Change events produced, by shape and op", ["shape", "op"])
TRANSACTIONS = Counter("walbridge_transactions", "Source transactions streamed")
SNAPSHOT_ROWS = Counter("walbridge_snapshot_rows", "Rows read by snapshots")
CONFIRMED_LSN = Gauge("walbridge_confirmed_lsn", "LSN last confirmed to PostgreSQL (flush)")
RETAINED_WAL = Gauge("walbridge_slot_retained_wal_bytes", "WAL retained by the slot, bytes")
WRITER_LAG = Gauge("walbridge_writer_lag_messages", "Produced minus committed messages per writer",
                   ["topic", "partition"])
STALLED_WRITERS = Gauge("walbridge_stalled_writers", "Writers with no flush progress for [ack] stall_timeout")
STALLED_GROUPS = Gauge("walbridge_stalled_groups", "Consumer groups holding WAL with no commit progress")
STOPPED_SHAPES = Gauge("walbridge_stopped_shapes",
                       "Shapes stopped by a schema change they cannot follow (their WAL is held unless on_stall = drop)")
PRODUCE_LATENCY = Histogram("walbridge_produce_latency_seconds",
                            "Source commit time to Kafka acknowledgement, per acknowledged transaction end",
                            buckets=LATENCY_BUCKETS)
SOURCE_LAG = Gauge("walbridge_source_lag_seconds",
                   "How far behind the source the producer reads: now minus the commit time of the last "
                   "transaction read (0 once the stream has nothing more to give)")
SNAPSHOT_PROGRESS = Gauge("walbridge_snapshot_rows_read", "Rows read by the running (or last) snapshot")
SNAPSHOT_TOTAL = Gauge("walbridge_snapshot_rows_estimate", "Rows the running (or last) snapshot expects")
