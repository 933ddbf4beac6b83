"""Rows read from the source — by the initial snapshot or a backfill — sent as
``op = r`` reads, and the control event that ends them.

Invariants:
- A raw COPY row is loaded once through its relation's ``RelationPlan`` (the
  loaders streamed changes use) and sent to every given shape whose row filter
  it passes, with the caller's headers (the snapshot point's position, the
  snapshot or backfill id).
- A read goes to its key's partition, where a streamed change of that key
  goes; keyless reads are spread over the partitions by the running count of
  reads sent.
- Reads go out through the stream's ``send`` (whose back-pressure keeps the
  replication connection alive) and count as ``r`` events of their shape.
- The control event (``snapshot_end``, ``backfill_end``) goes to each given
  partition after every read sent before it: the idempotent producer keeps
  per-partition order. Its key is a ControlKey naming the event and its id.
"""

from __future__ import annotations

import json
from typing import Callable

from producer.partitioner import partition_for
from producer.shapes import RelationPlan, ShapeRoute
from schemas import wire
from schemas.kafka import Writer

Send = Callable[[Writer, bytes | None, bytes | None, list], None]
# (topic, event, id) → the ControlKey of a control event on that topic, as written.
ControlKey = Callable[[str, str, str], bytes]


class Reads:
    """Sends rows read from the source, and the control event after them."""

    def __init__(self, send: Send, partitions: dict[str, int], events: dict[tuple[str, str], int],
                 control_key: ControlKey):
        self._send = send
        self.partitions = partitions  # topic → partition count
        self._events = events  # (shape, op) → count, the stream's own
        self._control_key = control_key

    def send_rows(self, plan: RelationPlan, routes: list[ShapeRoute], rows: list, sources: dict[str, bytes],
                  headers: list, now_ms: int, sent: int) -> int:
        """Load raw COPY rows through ``plan`` and send each to the ``routes``
        whose filter it passes (``sources``: each route's envelope source block).
        ``sent`` counts the reads sent so far; returns the new count."""
        send, partitions, events = self._send, self.partitions, self._events
        filtered = any(route.row_filter is not None for route in routes)
        for raw in rows:
            values, _ = plan.load(raw)
            row = plan.as_row(values) if filtered else None
            for route in routes:
                if route.row_filter is None or route.row_filter.matches(row):
                    codec = route.codec
                    key = codec.encode_key(codec.key_prefix, values)
                    partition = partition_for(key, sent, partitions[route.topic])
                    value = codec.encode_change(codec.value_prefix, "r", None, values, sources[route.name], 0, now_ms)
                    send((route.topic, partition), key, value, headers)
                    events[(route.name, "r")] += 1
                    sent += 1
        return sent

    def send_end(self, writers: list[Writer], headers: list, control: str, event_id: str, info: dict) -> None:
        """The control event ``control`` of the snapshot or backfill
        ``event_id`` (a Kafka tombstone carrying ``info``) on each of
        ``writers``, after the reads."""
        headers = headers + [(wire.CONTROL_HEADER, control.encode()),
                             (wire.CONTROL_INFO_HEADER, json.dumps(info).encode())]
        for writer in writers:
            self._send(writer, self._control_key(writer[0], control, event_id), None, headers)
