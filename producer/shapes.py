"""From one decoded change to the events each shape must publish, and to
their Kafka messages (``change_messages``, ``truncate_messages``).

Invariants:
- Pure. A relation is planned once (when its Relation message arrives); each
  change is then loaded once (text → Python values, via the column codecs) and
  routed to every shape on its table: many shapes on one table cost one decode.
- Positions: ``op_offset`` counts events within the transaction. An UPDATE that
  changes a row's key is two events (delete of the old key, then insert of the new
  one), so every message a shape sends has its own position and positions strictly
  increase within a topic-partition (the restart de-duplication relies on it).
- Filters use SQL NULL semantics (:mod:`schemas.shape_filter`). Where the old row
  is known (REPLICA IDENTITY FULL) an UPDATE becomes ``c`` when the row moves into a
  shape, ``d`` when it moves out, ``u`` when it stays, nothing when it stays out.
  Where only the new row is known, a matching row is sent as ``u`` (apply is an
  upsert, so a move-in lands) and a non-matching one as ``d`` (deleting a key the
  target does not hold is harmless): correct, at the price of extra deletes, so
  filtered shapes are best given REPLICA IDENTITY FULL. A DELETE without the old
  row is sent to every shape of the table for the same reason.
- A change of a partition (or INHERITS child) that arrives under its own name
  is routed to the shapes of the table above it by column name, with that
  table's column order and name: the same writer schema and ``source.table``
  as a change published through the root.
- Column-limited shapes only see their columns; an UPDATE that changed none of a
  shape's columns is still sent (pgoutput does not say which columns changed).
- A key-changing UPDATE's two events name each other (``Event.peer``), for
  Debezium's ``__debezium.newkey``/``oldkey`` headers.
- Unchanged TOAST values are None in ``after`` and listed in ``unchanged``, never
  sent as placeholders. With REPLICA IDENTITY FULL the old row holds them, so they
  are filled in and sent. A filter that needs one is evaluated on the value read
  back from the source by key (``fetch_current``); without that it counts as
  unknown (not matching).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

from producer.envelope import ShapeCodec, ShapeColumn, SourceBytes
from producer.partitioner import partition_for
from producer.pgoutput import UNCHANGED_TOAST, Delete, Insert, Relation, Update
from producer.pgtypes import ColumnCodec
from schemas import wire
from schemas.kafka import Writer
from schemas.shape_filter import RowFilter


@dataclass(frozen=True)
class ShapeSpec:
    """A configured shape, resolved against its table."""

    name: str
    topic: str
    columns: tuple[str, ...] | None  # None: all columns
    row_filter: RowFilter | None
    # The shape's table, where changes of another relation are routed to it (a
    # partition or INHERITS child arriving under its own name): its name goes
    # in ``source``, and ``columns`` then lists that table's, in its order.
    table: tuple[str, str] | None = None


@dataclass
class ShapeRoute:
    name: str
    topic: str
    codec: ShapeCodec
    row_filter: RowFilter | None


@dataclass(frozen=True)
class Event:
    route: ShapeRoute
    op: str  # c, u, d (r for snapshot reads)
    op_offset: int
    key_values: tuple  # the full relation tuple the key is read from
    before: tuple | None
    after: tuple | None
    unchanged: tuple[int, ...] = ()
    # A primary-key change's other half: the relation tuple of the new key (on
    # the delete) or of the old one (on the create), for Debezium's headers.
    peer: tuple | None = None


class RelationPlan:
    """How changes of one relation are loaded and routed."""

    def __init__(self, relation: Relation, codecs: list[ColumnCodec], key_columns: tuple[str, ...],
                 specs: list[ShapeSpec], topic_prefix: str, db: str, layout: str = "plain",
                 aliases: dict[str, tuple[str, ...]] | None = None,
                 attnums: dict[str, dict[str, int]] | None = None):
        self.relation = relation
        self.names = [c.name for c in relation.columns]
        self.codecs = list(codecs)
        self._loads: list[Callable[[bytes], object]] = [c.load for c in codecs]
        self.routes: list[ShapeRoute] = []
        keys = set(key_columns)
        for spec in specs:
            wanted = spec.columns or self.names
            missing = [c for c in wanted if c not in self.names]
            if missing:
                raise ValueError(f"shape {spec.name!r}: column(s) {', '.join(missing)} are not in "
                                 f"{relation.schema}.{relation.name} any more")
            idx = [self.names.index(c) for c in wanted]
            schema, table = spec.table or (relation.schema, relation.name)
            numbers = (attnums or {}).get(f"{schema}.{table}", {})
            columns = [ShapeColumn(col.name, codecs[i], col.name in keys, (aliases or {}).get(col.name, ()),
                                   numbers.get(col.name), col.type_oid, col.typmod)
                       for i, col in ((i, relation.columns[i]) for i in idx)]
            codec = ShapeCodec(spec.name, topic_prefix, db, schema, table, columns, idx, layout)
            self.routes.append(ShapeRoute(spec.name, spec.topic, codec, spec.row_filter))
        self.filtered = any(r.row_filter is not None for r in self.routes)
        # Its shapes are those of a table above it (see ``ShapeSpec.table``).
        self.routed = any(spec.table is not None for spec in specs)
        self.keyless = not keys
        self._key_idx = [i for i, n in enumerate(self.names) if n in keys]
        self._filter_columns = frozenset(c for r in self.routes if r.row_filter for c in r.row_filter.columns)
        # Reads current column values by key (I/O, supplied by the shell); used
        # only when a filter depends on an unchanged TOAST value.
        self.fetch_current: Callable[[Relation, dict, list[str]], dict | None] | None = None

    def load(self, raw: tuple) -> tuple[tuple, tuple[int, ...]]:
        """Text values → Python values; returns (values, indexes of unchanged TOAST)."""
        values = []
        unchanged = []
        for i, (load, v) in enumerate(zip(self._loads, raw)):
            if v is None:
                values.append(None)
            elif v is UNCHANGED_TOAST:
                values.append(None)
                unchanged.append(i)
            else:
                values.append(load(v))
        return tuple(values), tuple(unchanged)

    def as_row(self, values: tuple, unknown: tuple[int, ...] = ()) -> dict:
        row = dict(zip(self.names, values))
        for i in unknown:
            row.pop(self.names[i], None)  # unknown, not NULL
        return row

    def _matches(self, route: ShapeRoute, row: dict | None) -> bool:
        return route.row_filter is None or (row is not None and _safe_match(route.row_filter, row))

    def events(self, change: Insert | Update | Delete, op_offset: int) -> Iterator[Event]:
        """The events of one change, in order; ``op_offset`` is its first position."""
        if isinstance(change, Insert):
            new, _ = self.load(change.new)
            new_row = self.as_row(new) if self.filtered else None
            for route in self.routes:
                if self._matches(route, new_row):
                    yield Event(route, "c", op_offset, new, None, new)
            return
        if isinstance(change, Delete):
            old, _ = self.load(change.old)
            old_row = self.as_row(old) if self.filtered and not change.old_is_key_only else None
            for route in self.routes:
                if route.row_filter is None or old_row is None or self._matches(route, old_row):
                    yield Event(route, "d", op_offset, old, old, None)
            return
        new, unchanged = self.load(change.new)
        old = None
        if change.old is not None:
            old, _ = self.load(change.old)
            # With a key-only old tuple the other columns are unknown, not NULL.
            if change.old_is_key_only:
                old = tuple(o if self.relation.columns[i].is_key else None for i, o in enumerate(old))
        full_old = change.old is not None and not change.old_is_key_only
        if unchanged and full_old:
            # REPLICA IDENTITY FULL logs the old row detoasted: the unchanged
            # values are known after all, so send them.
            new = tuple(old[i] if i in unchanged else v for i, v in enumerate(new))
            unchanged = ()
        key_changed = old is not None and any(old[i] != new[i] for i in self._key_idx)
        new_row = self.as_row(new, unchanged) if self.filtered else None
        if new_row is not None and unchanged and self._filter_columns.intersection(
                self.names[i] for i in unchanged) and self.fetch_current is not None:
            # A filter needs a value pgoutput did not send: read it from the
            # source. It may be newer than this change; a later change then
            # carries that value, so the shape still converges.
            wanted = [self.names[i] for i in unchanged if self.names[i] in self._filter_columns]
            current = self.fetch_current(self.relation, {self.names[i]: new[i] for i in self._key_idx}, wanted)
            if current is not None:
                new_row.update(current)
        old_row = self.as_row(old) if self.filtered and full_old else None
        for route in self.routes:
            was_in = self._matches(route, old_row) if full_old else None
            now_in = self._matches(route, new_row)
            if key_changed:
                # A new key is a different row: delete the old one, insert the new
                # (each naming the other's key when the shape sees both).
                both = was_in is not False and now_in
                if was_in is not False:
                    yield Event(route, "d", op_offset, old, old, None, (), new if both else None)
                if now_in:
                    yield Event(route, "c", op_offset + 1, new, None, new, unchanged, old if both else None)
                continue
            if was_in is None:  # old row unknown
                if now_in:
                    yield Event(route, "u", op_offset, new, None, new, unchanged)
                else:
                    yield Event(route, "d", op_offset, new, None, None)
            elif was_in and now_in:
                yield Event(route, "u", op_offset, new, old, new, unchanged)
            elif now_in:
                yield Event(route, "c", op_offset, new, None, new, unchanged)
            elif was_in:
                yield Event(route, "d", op_offset, new, old, None)

    def span(self, change: Insert | Update | Delete) -> int:
        """How many positions the change takes (2 for a key-changing UPDATE)."""
        if isinstance(change, Update) and change.old is not None and not self.keyless:
            return 2
        return 1


@dataclass(slots=True)
class StreamTx:
    """The transaction being streamed, as its messages carry it: commit LSN
    (the first half of every position), xid, commit time, and when walbridge
    read it (the envelope's ``ts_ms``); each shape's ``source`` block is
    encoded once per transaction."""

    lsn: int
    xid: int
    ts_ms: int
    seen_ms: int
    sources: dict[str, SourceBytes] = field(default_factory=dict)

    def source(self, route: ShapeRoute) -> SourceBytes:
        source = self.sources.get(route.name)
        if source is None:
            source = self.sources[route.name] = route.codec.source_bytes(self.lsn, self.xid, self.ts_ms)
        return source


#: A streamed change's Kafka message: (writer, key, value, headers, op offset,
#: stat); ``value`` None for a delete's tombstone, whose ``stat`` is None too
#: (it is no event); ``stat`` otherwise (shape, op), as the compiled encoder's.
Message = tuple[Writer, "bytes | None", "bytes | None", list, int, "tuple[str, str] | None"]


def change_messages(plan: RelationPlan, change: Insert | Update | Delete, op_offset: int, tx: StreamTx,
                    change_lsn: int, partitions: dict[str, int], tombstones: bool) -> Iterator[Message]:
    """The Kafka messages of one streamed change at ``op_offset`` of ``tx``,
    whose WAL record sits at ``change_lsn``: each event's message on its key's
    partition (keyless rows spread by position), a primary-key change's halves
    carrying the other key (Debezium's headers), and with ``tombstones`` a
    keyed delete followed by its key's tombstone. This is the reference
    encoding the compiled encoder (:mod:`producer.fastcodec`) reproduces."""
    lsn = tx.lsn
    for event in plan.events(change, op_offset):
        route = event.route
        codec = route.codec
        source = tx.source(route)
        key = codec.encode_key(codec.key_prefix, event.key_values)
        writer = (route.topic, partition_for(key, lsn + event.op_offset, partitions[route.topic]))
        value = codec.encode_change(codec.value_prefix, event.op, event.before, event.after, source,
                                    event.op_offset, tx.seen_ms, event.unchanged, change_lsn)
        position = [(wire.POSITION_HEADER, wire.position_header(lsn, event.op_offset))]
        headers = position
        if event.peer is not None:
            headers = position + [(wire.NEW_KEY_HEADER if event.op == "d" else wire.OLD_KEY_HEADER,
                                   codec.encode_key(codec.key_prefix, event.peer))]
        yield writer, key, value, headers, event.op_offset, (route.name, event.op)
        if event.op == "d" and key is not None and tombstones:
            yield writer, key, None, position, event.op_offset, None


def truncate_messages(route: ShapeRoute, tx: StreamTx, op_offset: int, change_lsn: int, partitions: int,
                      key: bytes, ts_ms: int) -> Iterator[Message]:
    """A TRUNCATE reaches every partition of the shape's topic (rows of every
    key are gone), at one position, keyed by its control key ``key``."""
    codec = route.codec
    value = codec.encode_change(codec.value_prefix, "t", None, None, tx.source(route), op_offset, ts_ms, (),
                                change_lsn)
    headers = [(wire.POSITION_HEADER, wire.position_header(tx.lsn, op_offset))]
    for p in range(partitions):
        yield (route.topic, p), key, value, headers, op_offset, None


def _safe_match(row_filter: RowFilter, row: dict) -> bool:
    try:
        return row_filter.matches(row)
    except (LookupError, TypeError):
        # A referenced column is unknown (unchanged TOAST, key-only old row) or a
        # special value (infinity) is not comparable: SQL would not say TRUE here.
        return False
