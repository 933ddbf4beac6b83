"""Prometheus metrics of the Spark consumer's driver (served on
``[metrics] consumer_port`` by the ``walbridge`` command or the spark-submit entry).

Invariants:
- Metrics are process-global and only ever describe this process's driver.
- Names carry the ``walbridge_`` prefix and units in their names.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

# Seconds, from sub-second (a caught-up pipeline) to minutes (a backlog).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

APPLIED_ROWS = Counter("walbridge_apply_rows", "Changes applied to the target, by shape", ["shape"])
APPLY_SKIPPED = Counter("walbridge_apply_replayed_skipped", "Replayed changes skipped by progress", ["shape"])
APPLY_BATCHES = Counter("walbridge_apply_batches", "Micro-batches committed to the target", ["shape"])
APPLY_LATENCY = Histogram("walbridge_apply_latency_seconds",
                          "Time from the producer reading a change to its target commit, newest change of each "
                          "batch", ["shape"], buckets=LATENCY_BUCKETS)
DLQ_MESSAGES = Counter("walbridge_dlq_messages", "Undecodable messages sent to the dead-letter topic", ["shape"])
