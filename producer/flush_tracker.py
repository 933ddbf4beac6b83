"""Track which part of the replication stream is durably flushed by every writer.

The producer reads PostgreSQL logical replication and fans each transaction out to
several writers (in production a writer is a ``(topic, partition)`` pair).  Writers
flush at their own pace and most writers see only some of the transactions, so the
LSN that may be confirmed to PostgreSQL is a minimum across all writers that still
have unflushed data.  :class:`FlushTracker` keeps that minimum cheaply and reports
it, aligned to transaction boundaries, through ``notify_fn(lsn)``.

This follows the algorithm of Electric's ``ShapeLogCollector.FlushTracker``:

* A transaction sets ``last_seen`` to its last offset.  Each writer it touches is
  marked as having been sent data up to that offset.  A writer that had nothing
  pending enters the table as flushed up to ``LogOffset.before_tx(tx_offset)``:
  everything it was sent earlier is already flushed, so that bound is safe.
* If no writer has anything pending after a transaction (the transaction touched no
  writer), the transaction counts as flushed immediately.
* When a writer reports a flushed offset that reaches the last offset it was sent,
  it is caught up and leaves the table.  Otherwise its flushed offset moves up.
* With no writer pending the global flushed offset becomes ``last_seen`` and the
  LSN reported is ``last_seen.tx_offset``.  Otherwise the global offset becomes
  ``max(global, min(flushed offset of the pending writers))`` and the LSN reported
  is its ``tx_offset - 1``: a writer flushed part way into a transaction has
  certainly flushed every earlier transaction, but maybe not that one.

Invariants kept by :class:`FlushTracker`:

1. ``last_seen`` never decreases (a transaction ending before it is rejected).
2. A writer is pending if and only if it was sent data it has not reported as
   flushed; for every pending writer ``last_flushed < last_sent <= last_seen``.
3. A writer's ``last_flushed`` never decreases while it is pending; an older or
   equal flush report changes nothing.
4. ``last_global_flushed`` never decreases and never exceeds ``last_seen``.
5. The LSN passed to ``notify_fn`` strictly increases from call to call (never the
   same LSN twice, never a lower one), and never exceeds the highest LSN ``L``
   such that every transaction with ``tx_offset <= L`` is flushed by every writer
   that is still tracked.
6. When nothing is pending, the last LSN notified is ``last_seen.tx_offset``
   (provided some transaction was seen).
7. The pending writers' flushed offsets are indexed by offset (a dict from offset
   to the set of writers there, plus a min-heap of those offsets with lazy
   deletion), so the minimum costs O(log n) amortised instead of a scan of all
   writers, and the heap never holds many more entries than there are
   distinct offsets.

:class:`WriterAlignment` is the writer-side part of the algorithm: it turns a
writer's own flushed position into a :class:`LogOffset` that is aligned to
transaction boundaries wherever possible, so the tracker can tell when the writer
is fully caught up.

Everything here is pure: no I/O, no threads, no locks, no clock: every method
that needs the time takes it as ``now`` (the caller's monotonic seconds).  The
classes are not thread-safe; drive them from one thread or task.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from typing import Generic, NamedTuple, TypeVar

__all__ = ["LogOffset", "FlushTracker", "WriterAlignment"]


class LogOffset(NamedTuple):
    """A position in the replication log, ordered as a tuple.

    ``tx_offset`` is the commit LSN of the transaction as an integer and
    ``op_offset`` the index of the operation within that transaction.
    """

    tx_offset: int
    op_offset: int

    @classmethod
    def before_tx(cls, tx_offset: int) -> LogOffset:
        """The artificial offset just before every operation of transaction ``tx_offset``."""
        return cls(tx_offset - 1, 0)

    @classmethod
    def before_all(cls) -> LogOffset:
        """An offset lower than any real one."""
        return cls(-1, 0)


Writer = Hashable
K = TypeVar("K")

# Rebuild the heap when it holds more than this many stale entries beyond
# twice the number of live offsets.
_HEAP_SLACK = 64


class FlushTracker:
    """Compute the LSN that is flushed by all writers and report it on change.

    ``notify_fn(lsn)`` is called with the LSN to confirm to PostgreSQL.  If it
    raises, the tracker's state is still updated and the same LSN is offered
    again at the next change that produces it or a higher one.
    """

    def __init__(self, notify_fn: Callable[[int], object]) -> None:
        self._notify_fn = notify_fn
        self._last_seen = LogOffset.before_all()
        self._last_global = LogOffset.before_all()
        self._last_notified: int | None = None
        # writer -> [last_sent, last_flushed]
        self._pending: dict[Writer, tuple[LogOffset, LogOffset]] = {}
        # last_flushed offset -> writers currently flushed exactly up to it
        self._by_flushed: dict[LogOffset, set[Writer]] = {}
        # min-heap over the keys of _by_flushed; may hold stale keys (lazy deletion)
        self._heap: list[LogOffset] = []
        # writer -> time its stall clock started (pending, flush progress or touch)
        self._since: dict[Writer, float] = {}

    # ------------------------------------------------------------------ status

    @property
    def last_global_flushed(self) -> LogOffset:
        """The highest offset known to be flushed by all writers."""
        return self._last_global

    @property
    def last_seen(self) -> LogOffset:
        """The last offset of the latest transaction handled."""
        return self._last_seen

    @property
    def last_notified_lsn(self) -> int | None:
        """The last LSN successfully passed to ``notify_fn``, or None."""
        return self._last_notified

    def pending(self) -> dict[Writer, tuple[LogOffset, LogOffset]]:
        """A copy of ``writer -> (last_sent, last_flushed)`` for writers not caught up."""
        return dict(self._pending)

    def empty(self) -> bool:
        """True when no writer has unflushed data."""
        return not self._pending

    # ------------------------------------------------------------- transitions

    def handle_transaction(
        self,
        last_offset: LogOffset,
        affected_writers: Iterable[Writer],
        now: float,
    ) -> None:
        """Record a transaction whose last operation is at ``last_offset``.

        ``affected_writers`` are the writers that were sent at least one of its
        operations; ``now`` starts the stall clock of those that were not pending.
        Raises ValueError if ``last_offset`` is below ``last_seen``.
        """
        last_offset = LogOffset(*last_offset)
        if last_offset < self._last_seen:
            raise ValueError(
                f"transaction offset {last_offset} is before last seen {self._last_seen}"
            )
        self._last_seen = last_offset
        start = LogOffset.before_tx(last_offset.tx_offset)
        for writer in affected_writers:
            entry = self._pending.get(writer)
            if entry is not None:
                sent, flushed = entry
                if last_offset > sent:
                    self._pending[writer] = (last_offset, flushed)
                continue
            self._pending[writer] = (last_offset, start)
            self._index_add(writer, start)
            self._since[writer] = now
        if not self._pending:
            self._advance()

    def handle_flush_notification(
        self,
        writer: Writer,
        last_flushed: LogOffset,
        now: float,
    ) -> None:
        """Record that ``writer`` has flushed everything up to ``last_flushed``
        (at ``now``: flush progress restarts its stall clock).

        Unknown (caught-up or removed) writers are ignored, and so is a report that
        does not go beyond what the writer already reported.
        """
        entry = self._pending.get(writer)
        if entry is None:
            return
        sent, flushed = entry
        last_flushed = LogOffset(*last_flushed)
        if last_flushed >= sent:
            self._drop(writer, flushed)
        elif last_flushed > flushed:
            self._index_remove(writer, flushed)
            self._index_add(writer, last_flushed)
            self._pending[writer] = (sent, last_flushed)
            self._since[writer] = now
        else:
            return
        self._advance()

    def handle_shape_removed(self, writer: Writer) -> None:
        """Forget ``writer`` (e.g. its shape was dropped); it no longer holds the LSN back."""
        entry = self._pending.get(writer)
        if entry is None:
            return
        self._drop(writer, entry[1])
        self._advance()

    # --------------------------------------------------------- stall detection

    def touch(self, writer: Writer, now: float) -> None:
        """Restart the stall clock of a pending writer (unknown writers are ignored)."""
        if writer in self._since:
            self._since[writer] = now

    def stalled_writers(self, now: float, grace: float) -> list[Writer]:
        """Pending writers without flush progress (or touch) for more than ``grace``.

        The list is ordered from the longest stalled.  A new transaction for a
        writer that is already pending does not restart its clock.
        """
        stalled = [(since, w) for w, since in self._since.items() if now - since > grace]
        stalled.sort(key=lambda item: item[0])
        return [w for _, w in stalled]

    # ---------------------------------------------------------------- internal

    def _drop(self, writer: Writer, flushed: LogOffset) -> None:
        del self._pending[writer]
        del self._since[writer]
        self._index_remove(writer, flushed)

    def _index_add(self, writer: Writer, offset: LogOffset) -> None:
        writers = self._by_flushed.get(offset)
        if writers is None:
            self._by_flushed[offset] = {writer}
            heapq.heappush(self._heap, offset)
        else:
            writers.add(writer)

    def _index_remove(self, writer: Writer, offset: LogOffset) -> None:
        writers = self._by_flushed[offset]
        writers.discard(writer)
        if writers:
            return
        del self._by_flushed[offset]
        if len(self._heap) > 2 * len(self._by_flushed) + _HEAP_SLACK:
            self._heap = list(self._by_flushed)
            heapq.heapify(self._heap)

    def _min_flushed(self) -> LogOffset:
        heap = self._heap
        while heap[0] not in self._by_flushed:
            heapq.heappop(heap)
        return heap[0]

    def _advance(self) -> None:
        if not self._pending:
            self._last_global = self._last_seen
            lsn = self._last_seen.tx_offset
        else:
            lowest = self._min_flushed()
            if lowest > self._last_global:
                self._last_global = lowest
            lsn = self._last_global.tx_offset - 1
        if lsn < 0 or (self._last_notified is not None and lsn <= self._last_notified):
            return
        self._notify_fn(lsn)
        self._last_notified = lsn


class _Entry(NamedTuple, Generic[K]):
    position: K
    tx_last_offset: LogOffset


class WriterAlignment(Generic[K]):
    """Writer-side alignment of flushed positions to transaction boundaries.

    For each transaction a writer takes part in, ``record(writer_pos,
    tx_last_offset)`` stores the writer's position of its last operation of that
    transaction (a Kafka offset in production, or the operation's LogOffset)
    together with the transaction's last offset.  ``aligned(flushed_pos)`` then
    says what to report to :class:`FlushTracker`:

    * entries at or below ``flushed_pos`` are removed;
    * if the last removed entry is exactly ``flushed_pos``, the writer finished that
      transaction, so the transaction's last offset is reported (which lets the
      tracker see the writer as caught up);
    * otherwise the writer is part way into a later transaction and its own
      flushed position is reported, converted by ``to_offset``.  Without
      ``to_offset`` (positions that are not log offsets, such as Kafka offsets) the
      last transaction it fully flushed is reported instead.

    The result never decreases; None means nothing is known to be flushed yet.
    Positions must be recorded in increasing order; recording the same position
    again (the writer got nothing new) moves that entry to the newer transaction.
    """

    def __init__(self, to_offset: Callable[[K], LogOffset] | None = None) -> None:
        self._to_offset = to_offset
        self._entries: deque[_Entry[K]] = deque()
        self._reported: LogOffset | None = None

    @classmethod
    def by_log_offset(cls) -> WriterAlignment[LogOffset]:
        """Alignment for writers whose positions are the LogOffsets of their operations."""
        return cls(to_offset=lambda pos: pos)  # type: ignore[return-value]

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def last_reported(self) -> LogOffset | None:
        return self._reported

    def record(self, writer_pos: K, tx_last_offset: LogOffset) -> None:
        """Remember that ``writer_pos`` is this writer's last position in a transaction."""
        tx_last_offset = LogOffset(*tx_last_offset)
        if self._entries:
            last = self._entries[-1]
            if writer_pos < last.position or tx_last_offset < last.tx_last_offset:  # type: ignore[operator]
                raise ValueError(
                    f"out of order: ({writer_pos}, {tx_last_offset}) after "
                    f"({last.position}, {last.tx_last_offset})"
                )
            if writer_pos == last.position:
                self._entries[-1] = _Entry(writer_pos, tx_last_offset)
                return
        self._entries.append(_Entry(writer_pos, tx_last_offset))

    def aligned(self, flushed_pos: K) -> LogOffset | None:
        """The offset to report to the tracker once ``flushed_pos`` is flushed."""
        entries = self._entries
        removed: _Entry[K] | None = None
        while entries and entries[0].position <= flushed_pos:  # type: ignore[operator]
            removed = entries.popleft()
        if removed is not None and removed.position == flushed_pos:
            candidate: LogOffset | None = removed.tx_last_offset
        elif self._to_offset is not None:
            candidate = LogOffset(*self._to_offset(flushed_pos))
        elif removed is not None:
            candidate = removed.tx_last_offset
        else:
            candidate = None
        if candidate is not None and (self._reported is None or candidate > self._reported):
            self._reported = candidate
        return self._reported
