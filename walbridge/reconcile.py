"""``walbridge backfill`` and ``walbridge reconcile``: ask the running producer
for a backfill and follow it until the consumer has applied it.

``reconcile`` is verify → backfill of exactly the key buckets that differ
(:mod:`schemas.buckets`) → wait → verify again. Under live load a bucket may
differ only because the consumer lags; backfilling it is harmless (its rows
lose to newer live changes by position), so no attempt is made to tell the two
apart.

Invariants:
- Nothing here writes to the source or the target: requests go to the
  ``<prefix>._backfills`` topic, progress is read from it and from the target's
  ``_walbridge.backfills`` table (written by the consumer).
- A request that cannot be served (unknown shape) fails before anything is sent.
"""

from __future__ import annotations

import time
from typing import Callable

from producer.backfill_requests import read_states, request_backfill
from producer.replication import connect
from schemas import wire
from schemas.config import Config
from schemas.kafka import client_config
from spark_consumer.progress import read_backfills
from walbridge.verify import ShapeDiff, verify
from walbridge.verify_lake import lake_reader


def consumer_completed(config: Config, backfill_id: str, shape: str) -> bool:
    """Has the consumer group applied ``backfill_end`` of ``backfill_id`` on every partition?"""
    if config.consumer.is_lakehouse:
        shape_config = next(s for s in config.shapes if s.shape_name == shape)
        record = lake_reader(config).newest_record(shape_config, config.consumer.group)
        return record is not None and record.complete(backfill_id)
    with connect(config.consumer.target_dsn) as conn:
        return any(b["backfill_id"] == backfill_id and b["completed_at"] is not None
                   for b in read_backfills(conn, config.consumer.group))


def wait_for(config: Config, request_ids: list[str], timeout: float = 1800.0,
             on_progress: Callable[[str], None] = print) -> dict[str, dict]:
    """Wait until each request is done at the producer and (with a target
    configured) complete at the consumer. Returns the final request records;
    raises TimeoutError or RuntimeError (a failed request)."""
    conf = client_config(config.kafka.bootstrap_servers, config.kafka.client)
    topic = wire.backfills_topic(config.kafka.topic_prefix)
    deadline = time.monotonic() + timeout
    last_said: dict[str, str] = {}
    while True:
        states, _ = read_states(conf, topic)
        pending = []
        for rid in request_ids:
            record = states.get(rid, {"state": "requested"})
            state = record["state"]
            if state == "failed":
                raise RuntimeError(f"backfill {rid} of shape {record.get('shape')} failed: {record.get('error')}")
            if state == "done" and config.consumer.has_target:
                state = "applied" if consumer_completed(config, record["backfill_id"], record["shape"]) \
                    else "done, applying"
            if last_said.get(rid) != state:
                extra = f" ({record.get('rows')} rows)" if record.get("rows") is not None else ""
                on_progress(f"backfill {rid} of shape {record.get('shape')}: {state}{extra}")
                last_said[rid] = state
            if state not in ("applied", "done") or (state == "done" and config.consumer.has_target):
                pending.append(rid)
        if not pending:
            return {rid: states[rid] for rid in request_ids}
        if time.monotonic() > deadline:
            raise TimeoutError(f"backfills not complete after {timeout:.0f}s: {', '.join(pending)} "
                               "(is the producer running? `walbridge status` shows its backfills)")
        time.sleep(1.0)


def reconcile(config: Config, shapes: list[str] | None = None, wait: bool = True, timeout: float = 1800.0,
              on_progress: Callable[[str], None] = print) -> tuple[list[ShapeDiff], list[ShapeDiff] | None]:
    """Verify; backfill the differing buckets of each differing shape; with
    ``wait``, follow the backfills to the target and verify again. Returns
    (the first verify, the second or None)."""
    before = verify(config, shapes)
    requests = []
    for d in before:
        if d.error:
            on_progress(f"{d.shape}: cannot reconcile: {d.error}")
        elif d.ok:
            on_progress(f"{d.shape}: equal to the source, nothing to do")
        else:
            # A keyless shape is a multiset without keys to order by: a scoped
            # backfill could not tell a late streamed append from its own copy,
            # so it is backfilled whole (the consumer then drops what is older).
            # A lakehouse target is backfilled whole too (it compares no buckets).
            scope = ({"columns": d.bucket_columns, "bucket_count": d.buckets, "buckets": d.differing}
                     if d.keyed and d.buckets else None)
            rid = request_backfill(config, d.shape, scope, reason="reconcile")
            on_progress(f"{d.shape}: {d.differing_buckets} of {d.buckets} key buckets differ "
                        f"({len(d.missing)} missing, {len(d.extra)} extra, {len(d.changed)} changed rows); "
                        f"backfill {rid} of {'those buckets' if scope else 'the whole shape'} requested")
            requests.append(rid)
    if not wait or not requests:
        return before, None
    wait_for(config, requests, timeout, on_progress)
    return before, verify(config, shapes)
