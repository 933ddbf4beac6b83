"""walbridge's own tables in the target database (schema ``_walbridge``): what
each consumer group has applied, per topic-partition and per backfill.

Layout
------
- ``_walbridge.progress(consumer_group, topic, partition, next_offset,
  applied_lsn, applied_op_index, floor_lsn, floor_op_index, updated_at,
  topic_id)``: per consumer group and topic-partition, the next Kafka offset
  to apply, the highest position applied, the highest cut applied, and the
  topic incarnation the offset counts in (NULL: written before walbridge
  recorded it). Written in the same transaction as the rows it covers.
- ``_walbridge.backfills(consumer_group, topic, backfill_id, shape, start_lsn,
  partitions, partitions_done, scope, rows, started_at, updated_at,
  completed_at, gc_deleted, gc_tombstones)``: per backfill, the partitions
  whose ``backfill_end`` is applied (written in the batch's transaction; a
  replay adds nothing) and, once all are, when its final GC ran and what it
  removed (:func:`read_backfills`; written by
  :func:`spark_consumer.statements.record_backfills`).

Invariants:
- An apply locks the progress rows of its batch's parts, creating missing
  ones at the part's start, in (topic, partition) order before it writes
  anything (:func:`lock_progress`), so appliers of the same partitions wait
  for each other and never deadlock; it moves them (:func:`write_progress`)
  in the transaction that writes the batch's rows.
- A part that starts after its partition's next offset would leave offsets
  never applied: :func:`check_gap` refuses it (:class:`ProgressGapError`)
  unless told to accept the gap.
- Offsets are compared only within one topic incarnation: progress recorded
  for another (the broker lost the topic and it was recreated) reads as next
  offset 0 to a part of this one, its positions and floor unchanged
  (:meth:`Progress.for_incarnation`). A new
  incarnation's batch that is not its first therefore fails with a gap when
  its first batch was never applied, instead of passing on offsets that
  counted in the lost topic.
- walbridge's DDL (these tables, the shapes' tables) runs under one advisory
  lock (:func:`lock_ddl`): appliers on executors and driver start at once.

Why no replication origins: an origin records one remote LSN per origin and
transaction (``pg_replication_origin_xact_setup``), and a session can drive one
origin at a time. A walbridge batch commits many topic-partitions (and shapes)
at once, each at its own position, and partitions do not share an LSN order
that would make one "applied up to" LSN true for all of them; what must be
exact is the Kafka offset per partition, which an origin cannot hold. The
progress table carries both, and since it is written once per partition per
micro-batch (not per source transaction), the bloat that origins avoid is a
few HOT updates per batch (the table has fillfactor 50). Origins also need
superuser (or explicit grants) on the target.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import psycopg
from psycopg.rows import dict_row

from schemas import wire

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Progress:
    """What the target has applied of one (topic, partition) for one group:
    the next offset, the highest position applied, the highest cut applied,
    and the topic incarnation ``next_offset`` counts in (None: not recorded)."""

    next_offset: int
    applied: tuple[int, int] | None = None
    floor: tuple[int, int] | None = None
    topic_id: str | None = None

    def for_incarnation(self, topic_id: str | None) -> Progress:
        """This progress as seen by a part read from incarnation ``topic_id``:
        offsets counted in another incarnation say nothing of it (next offset
        0); the positions and the floor still hold (they are the source's)."""
        if topic_id is None or self.topic_id is None or topic_id == self.topic_id:
            return self
        return Progress(0, self.applied, self.floor, self.topic_id)


class PartRange(Protocol):
    """The offsets a part of a batch covers (:class:`spark_consumer.batch.Part`)."""

    topic: str
    partition: int
    start: int
    topic_id: str | None

    @property
    def tp(self) -> tuple[str, int]: ...

_META_DDL = f"""
CREATE SCHEMA IF NOT EXISTS {wire.META_SCHEMA};
CREATE TABLE IF NOT EXISTS {wire.META_SCHEMA}.progress (
    consumer_group text NOT NULL,
    topic text NOT NULL,
    partition integer NOT NULL,
    next_offset bigint NOT NULL,
    applied_lsn bigint,
    applied_op_index bigint,
    floor_lsn bigint,
    floor_op_index bigint,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_group, topic, partition)
) WITH (fillfactor = 50);
DO $$ BEGIN  -- added later: targets made before have the table without it
    IF NOT EXISTS (SELECT FROM pg_attribute WHERE attrelid = '{wire.META_SCHEMA}.progress'::regclass
                   AND attname = 'topic_id' AND NOT attisdropped) THEN
        ALTER TABLE {wire.META_SCHEMA}.progress ADD COLUMN topic_id text;
    END IF;
END $$;
CREATE TABLE IF NOT EXISTS {wire.META_SCHEMA}.backfills (
    consumer_group text NOT NULL,
    topic text NOT NULL,
    backfill_id text NOT NULL,
    shape text NOT NULL,
    start_lsn bigint NOT NULL,
    partitions integer NOT NULL,
    partitions_done integer[] NOT NULL DEFAULT '{{}}',
    scope jsonb,
    rows bigint,
    started_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    completed_at timestamptz,
    gc_deleted bigint,
    gc_tombstones bigint,
    PRIMARY KEY (consumer_group, topic, backfill_id)
);
"""
# A progress row as :func:`_progress` reads it.
_PROGRESS_COLUMNS = "next_offset, applied_lsn, applied_op_index, floor_lsn, floor_op_index, topic_id"


class ProgressGapError(RuntimeError):
    """A part starts after the partition's applied offsets end: messages in
    between would never be applied."""


def lock_ddl(conn: psycopg.Connection) -> None:
    """Take walbridge's DDL lock for the current transaction."""
    conn.execute("SELECT pg_advisory_xact_lock(hashtext('walbridge.ddl'))")


def ensure_progress(conn: psycopg.Connection) -> None:
    """Create ``_walbridge.progress`` and ``_walbridge.backfills`` if missing."""
    with conn.transaction():
        lock_ddl(conn)
        conn.execute(_META_DDL)


def read_progress(conn: psycopg.Connection, group: str, topic: str | None = None
                  ) -> dict[tuple[str, int], Progress]:
    """The group's progress per (topic, partition) (e.g. to resume a source
    whose checkpoint is gone)."""
    q = (f"SELECT topic, partition, {_PROGRESS_COLUMNS} "
         f"FROM {wire.META_SCHEMA}.progress WHERE consumer_group = %s")
    params: list[Any] = [group]
    if topic is not None:
        q += " AND topic = %s"
        params.append(topic)
    return {(r[0], r[1]): _progress(r[2:]) for r in conn.execute(q, params)}


def read_backfills(conn: psycopg.Connection, group: str | None = None) -> list[dict]:
    """The ``_walbridge.backfills`` rows (of ``group``, or all) as dicts, oldest
    first; ``[]`` if the table does not exist yet."""
    if not conn.execute(f"SELECT to_regclass('{wire.META_SCHEMA}.backfills') IS NOT NULL").fetchone()[0]:
        return []
    q = ("SELECT consumer_group, topic, backfill_id, shape, start_lsn, partitions, partitions_done, scope, rows, "
         "started_at, updated_at, completed_at, gc_deleted, gc_tombstones "
         f"FROM {wire.META_SCHEMA}.backfills")
    params: list[Any] = []
    if group is not None:
        q += " WHERE consumer_group = %s"
        params.append(group)
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(q + " ORDER BY consumer_group, topic, started_at, backfill_id", params).fetchall()


def _progress(r: Sequence) -> Progress:
    nxt, al, ao, fl, fo, tid = r
    return Progress(nxt, (al, ao) if al is not None else None, (fl, fo) if fl is not None else None, tid)


def lock_progress(conn: psycopg.Connection, group: str, parts: Sequence[PartRange]
                  ) -> tuple[dict[tuple[str, int], Progress], set[tuple[str, int]]]:
    """Create missing progress rows (at the part's start) and lock all of them,
    in (topic, partition) order. Returns the progress, as each part's
    incarnation sees it, and the set of rows that existed before."""
    ordered = sorted({p.tp: p for p in parts}.values(), key=lambda p: p.tp)
    topics = [p.topic for p in ordered]
    partitions = [p.partition for p in ordered]
    created = conn.execute(
        f"INSERT INTO {wire.META_SCHEMA}.progress AS g (consumer_group, topic, partition, next_offset, topic_id) "
        "SELECT %s, t, p, s, i FROM unnest(%s::text[], %s::int[], %s::bigint[], %s::text[]) AS u(t, p, s, i) "
        "ON CONFLICT DO NOTHING RETURNING topic, partition",
        (group, topics, partitions, [p.start for p in ordered], [p.topic_id for p in ordered])).fetchall()
    rows = conn.execute(
        f"SELECT topic, partition, {_PROGRESS_COLUMNS} "
        f"FROM {wire.META_SCHEMA}.progress WHERE consumer_group = %s "
        "AND (topic, partition) IN (SELECT * FROM unnest(%s::text[], %s::int[])) "
        "ORDER BY topic, partition FOR UPDATE", (group, topics, partitions)).fetchall()
    incarnations = {p.tp: p.topic_id for p in ordered}
    progress = {(r[0], r[1]): _progress(r[2:]).for_incarnation(incarnations[(r[0], r[1])]) for r in rows}
    new = {(t, p) for t, p in created}
    return progress, set(progress) - new


def check_gap(part: PartRange, progress: Progress, on_gap: str) -> None:
    """``on_gap``: ``"raise"`` (:class:`ProgressGapError`) or ``"ignore"``
    (logged) when ``part`` starts after the offsets ``progress`` has applied."""
    if part.start > progress.next_offset:
        msg = (f"{part.topic}[{part.partition}]: the batch starts at offset {part.start} but offsets from "
               f"{progress.next_offset} on were never applied")
        if on_gap == "raise":
            raise ProgressGapError(msg + " (pass on_gap='ignore' to accept the gap)")
        log.warning("%s; accepting the gap", msg)


def write_progress(conn: psycopg.Connection, group: str, updates: list[tuple]) -> None:
    """``updates``: (topic, partition, next_offset, applied, floor,
    topic_id), as :func:`spark_consumer.batch.progress_update` gives them."""
    if not updates:
        return
    cols = list(zip(*[(t, p, n, a[0] if a else None, a[1] if a else None, f[0] if f else None,
                       f[1] if f else None, i) for t, p, n, a, f, i in updates]))
    conn.execute(
        f"UPDATE {wire.META_SCHEMA}.progress AS g SET next_offset = u.n, applied_lsn = u.al, "
        "applied_op_index = u.ao, floor_lsn = u.fl, floor_op_index = u.fo, topic_id = u.i, updated_at = now() "
        "FROM unnest(%s::text[], %s::int[], %s::bigint[], %s::bigint[], %s::bigint[], %s::bigint[], %s::bigint[], "
        "%s::text[]) AS u(t, p, n, al, ao, fl, fo, i) "
        "WHERE g.consumer_group = %s AND g.topic = u.t AND g.partition = u.p",
        (*[list(c) for c in cols], group))
