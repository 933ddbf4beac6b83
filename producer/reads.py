"""Rows read from the source — by the initial snapshot or a backfill — sent as
``op = r`` reads, and the control event that ends them.

Invariants:
- Rows arrive as chunks of ``COPY ... TO STDOUT`` text (whole lines, the
  relation's columns in order). The compiled encoder (``fastcodec.read_encoder``)
  turns a chunk into messages straight from the text; the reference path parses
  the chunk (:func:`copy_rows`, COPY's own unescaping), loads each row through
  its relation's ``RelationPlan`` (the loaders streamed changes use) and encodes
  it with fastavro. Both give the same bytes; the reference takes a chunk the
  compiled encoder declines, and runs without the extension.
- Each row is sent to every given shape whose row filter it passes, with the
  caller's headers (the snapshot point's position, the snapshot or backfill id).
  A row that is not COPY text of the relation's width stops the read with an
  error naming it: never a row dropped.
- A read goes to its key's partition, where a streamed change of that key
  goes; keyless reads are spread over the partitions by the running count of
  reads sent.
- Reads go out through their own producer (``kafka_io.ReadChannel``: it
  reports failed deliveries only, and its back-pressure keeps the replication
  connection alive) and count as ``r`` events of their shape.
- The control event (``snapshot_end``, ``backfill_end``) goes out through the
  stream's ``send``, once :meth:`Reads.in_flight` is 0: every read sent before it
  is in Kafka ahead of it. Its key is a ControlKey naming the event and its id.
"""

from __future__ import annotations

import json
import re
from typing import Callable

from producer.fastcodec import read_encoder, read_suffix
from producer.kafka_io import ReadChannel
from producer.partitioner import partition_for
from producer.shapes import RelationPlan, ShapeRoute
from schemas import wire
from schemas.kafka import Writer

Send = Callable[[Writer, bytes | None, bytes | None, list], None]
# (topic, event, id) → the ControlKey of a control event on that topic, as written.
ControlKey = Callable[[str, str, str], bytes]


_FIELD = re.compile(rb"(?:[^\\\t]|\\.)*", re.S)
_ESCAPE = re.compile(rb"\\([0-7]{1,3}|x[0-9a-fA-F]{1,2}|.)", re.S)
_SIMPLE_ESCAPES = {b"b": b"\b", b"f": b"\f", b"n": b"\n", b"r": b"\r", b"t": b"\t", b"v": b"\v"}


def _unescape(m: re.Match) -> bytes:
    seq = m.group(1)
    if seq[0] in b"01234567":
        return bytes([int(seq, 8) & 0xFF])
    if seq[0] == 0x78 and len(seq) > 1:  # x + hex digits
        return bytes([int(seq[1:], 16)])
    return _SIMPLE_ESCAPES.get(seq, seq)


def copy_rows(data: bytes) -> list[tuple[bytes | None, ...]]:
    """The rows of COPY text (whole lines) as raw values: text bytes, None for
    ``\\N``; backslash sequences undone as PostgreSQL's COPY FROM reads them."""
    if data and not data.endswith(b"\n"):
        raise ValueError("COPY data ends inside a row (no newline)")
    rows = []
    for line in data.split(b"\n")[:-1]:
        fields, pos = [], 0
        while True:
            field = _FIELD.match(line, pos).group()
            pos += len(field)
            fields.append(None if field == b"\\N" else _ESCAPE.sub(_unescape, field) if b"\\" in field else field)
            if pos == len(line):
                break
            if line[pos] != 0x09:
                raise ValueError(f"a COPY row ends in a lone backslash: {line[:200]!r}")
            pos += 1
        rows.append(tuple(fields))
    return rows


class Reads:
    """Sends rows read from the source, and the control event after them."""

    def __init__(self, channel: ReadChannel, send_control: Send, partitions: dict[str, int],
                 events: dict[tuple[str, str], int], control_key: ControlKey):
        self._channel = channel  # the reads' producer (tests: anything with its send, send_all and in_flight)
        self._send_control = send_control  # the stream's send
        self.partitions = partitions  # topic → partition count
        self._events = events  # (shape, op) → count, the stream's own
        self._control_key = control_key

    def in_flight(self) -> int:
        """Reads sent and not yet in Kafka (raises a failed delivery)."""
        return self._channel.in_flight()

    def encoder(self, plan: RelationPlan):
        """The compiled read encoder of ``plan`` (None: the reference path)."""
        return read_encoder(plan, self.partitions)

    def send_copy(self, plan: RelationPlan, encoder, routes: list[ShapeRoute], data: bytes,
                  sources: dict[str, bytes], headers: list, now_ms: int, sent: int) -> int:
        """Send a chunk of COPY text rows of ``plan``'s relation to ``routes``
        (``encoder``: from :meth:`encoder`), as :meth:`send_rows` does; returns
        the new count of reads sent."""
        if encoder is not None:
            wanted = {route.name for route in routes}
            suffixes = [read_suffix(sources[r.name], now_ms) if r.name in wanted else None for r in plan.routes]
            encoded = encoder.encode_reads(data, suffixes, sent)
            if encoded is not None:
                messages, sent = encoded
                self._channel.send_all(messages, headers, self._events)
                return sent
        rows = copy_rows(data)
        width = len(plan.names)
        for raw in rows:
            if len(raw) != width:
                raise ValueError(f"a COPY row of {plan.relation.schema}.{plan.relation.name} holds {len(raw)} "
                                 f"values, the table {width} columns: {raw!r:.200}")
        return self.send_rows(plan, routes, rows, sources, headers, now_ms, sent)

    def send_rows(self, plan: RelationPlan, routes: list[ShapeRoute], rows: list, sources: dict[str, bytes],
                  headers: list, now_ms: int, sent: int) -> int:
        """Load raw COPY rows through ``plan`` and send each to the ``routes``
        whose filter it passes (``sources``: each route's envelope source block).
        ``sent`` counts the reads sent so far; returns the new count."""
        send, partitions, events = self._channel.send, self.partitions, self._events
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
        ``writers``. Only once :meth:`in_flight` is 0, so that it follows every read."""
        if self.in_flight():
            raise RuntimeError(f"{control} of {event_id} sent while reads are still in flight")
        headers = headers + [(wire.CONTROL_HEADER, control.encode()),
                             (wire.CONTROL_INFO_HEADER, json.dumps(info).encode())]
        for writer in writers:
            self._send_control(writer, self._control_key(writer[0], control, event_id), None, headers)
