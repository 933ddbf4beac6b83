"""Acknowledgement: from Kafka delivery reports and consumer-group commits to
the LSN the producer may confirm to PostgreSQL.

The path of an acknowledgement, top to bottom:

1. At each commit the stream hands over the transaction's last position and the
   writers (topic-partitions) it produced to (:meth:`Acks.commit`): the
   ``FlushTracker`` holds the transaction until each of them has flushed it, and
   the ``DeliveryLedger`` waits for the Kafka offset of its last message on each.
2. Once per round of the stream loop, :meth:`Acks.take_boundaries` collects the
   transaction ends Kafka acknowledged, the latest per writer (it implies the
   earlier ones). Without consumer groups (``[ack] consumer_groups = []``) an
   acknowledged end is flushed; with groups it is remembered in the writer's
   ``WriterAlignment`` (Kafka offset → transaction end).
3. Every ``[ack] interval``, :meth:`Acks.poll` reads the groups' committed
   offsets of the pending writers; the lowest over the groups, aligned to a
   transaction end, is the writer's flush report to the tracker.
4. The tracker's ``notify_fn`` (:meth:`Acks.confirm`) raises ``confirmed_lsn``,
   which the stream sends to PostgreSQL in its standby status updates.

Invariants:
- ``confirmed_lsn`` never decreases and never passes a change that some
  configured consumer group has not committed (or, in delivery mode, the broker
  has not acknowledged).
- Per writer, boundaries reach the alignment in offset order: the boundary of a
  replayed transaction (found in Kafka after a restart) is handed over only
  after this run's earlier ones.
- A group is stalled when writers wait on it and it has committed nothing new
  for ``[ack] stall_timeout``: it is reported and WAL is held for it, unless
  ``[ack] on_stall = "drop"``, which stops waiting for it (and, once no group is
  left, counts everything in Kafka as flushed).
- A shape stopped by a schema change it cannot follow holds WAL from its
  first unpublished change (:meth:`Acks.hold`): ``confirmed_lsn`` stays at or
  below that LSN, whatever the groups commit, so a restart streams it again.
  With ``[ack] on_stall = "drop"`` a hold older than ``stall_timeout`` is let
  go, loudly, as a stalled group is.
- After a restart, the transactions in Kafka that not every group has committed
  are indexed per writer, commit LSN → offset (:meth:`Acks.rebuild`), so a
  replayed transaction is tracked against the offsets where it already is.
- This is the shell around the pure ``FlushTracker``: it reads the clock and
  hands the time to the tracker.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from typing import Any

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from producer import metrics
from producer.flush_tracker import FlushTracker, LogOffset, WriterAlignment
from producer.kafka_io import DeliveryLedger, read_positions
from producer.pgoutput import lsn_to_str
from schemas.config import Config
from schemas.kafka import GroupOffsets, Writer

log = logging.getLogger("walbridge.producer")

_ANY_OFFSET = 2**63 - 1  # past every Kafka offset


class Acks:
    """The ack state of one run: delivery ledger, flush tracker, per-writer
    alignments and what the consumer groups have committed."""

    def __init__(self, config: Config, admin: AdminClient, kafka_conf: dict[str, Any]):
        self._config = config.ack
        self._admin = admin
        self._kafka_conf = kafka_conf
        self.groups = list(config.ack_groups)  # "drop" on stall removes from it
        self.offsets = GroupOffsets(kafka_conf)
        self.ledger = DeliveryLedger()
        self.tracker = FlushTracker(self.confirm)
        self.alignments: dict[Writer, WriterAlignment] = defaultdict(WriterAlignment)
        self.confirmed_lsn = 0
        self.stalled_writers: list[Writer] = []
        self.stalled_groups: list[str] = []
        self._replayed_offsets: dict[Writer, dict[int, int]] = {}  # commit LSN → offset, per writer
        self._commit_times: dict[int, int] = {}  # commit LSN → commit time (ms), until acknowledged
        self._group_seen: dict[str, dict[Writer, int]] = {}
        self._group_progress: dict[str, float] = {}  # group → when its commits last moved
        self._last_poll = 0.0
        self.holds: dict[str, tuple[int, float]] = {}  # stopped shape → (LSN never to confirm past, since)

    def idle(self) -> bool:
        """Nothing produced waits for Kafka or for a group."""
        return self.tracker.empty() and self.ledger.in_flight() == 0

    def confirm(self, lsn: int) -> None:
        if self.holds:
            lsn = min(lsn, min(held for held, _ in self.holds.values()))
        self.confirmed_lsn = max(self.confirmed_lsn, lsn)

    def hold(self, shape: str, lsn: int, now: float) -> None:
        """Never confirm past ``lsn`` for ``shape`` (stopped: its changes from
        there on are not in Kafka)."""
        self.holds.setdefault(shape, (lsn, now))

    def _release_holds(self, now: float) -> None:
        if self._config.on_stall != "drop":
            return
        for shape, (lsn, since) in list(self.holds.items()):
            if now - since >= self._config.stall_timeout:
                log.error("[ack] on_stall = \"drop\": no longer holding WAL for the stopped shape %s (held since "
                          "%.0fs); its changes after %s may be released from WAL: it is re-read once fixed",
                          shape, now - since, lsn_to_str(lsn))
                del self.holds[shape]

    def commit(self, last: LogOffset, writers: set[Writer], replayed_writers: set[Writer], commit_ts_ms: int,
               now: float) -> None:
        """A transaction ends at ``last``: ``writers`` were sent messages of it,
        ``replayed_writers`` already held theirs (a replay after a restart)."""
        lsn = last.tx_offset
        tracked = writers
        # A replayed part counts only if a group has not committed past it yet.
        replayed = {}
        if replayed_writers:
            tracked = set(writers)
            for w in replayed_writers - writers:
                offset = self._replayed_offsets.get(w, {}).get(lsn)
                if offset is not None and self.groups:
                    replayed[w] = offset
                    tracked.add(w)
        if replayed_writers and not tracked:
            log.debug("transaction %s: no writer to wait for (replayed on %s, all committed)", last, replayed_writers)
        self.tracker.handle_transaction(last, tracked, now)
        if writers:
            self._commit_times[lsn] = commit_ts_ms
        for w in writers:
            self.ledger.end_transaction(w, last)
        if replayed:
            self.take_boundaries()  # this run's earlier boundaries first: per writer they must stay in order
            for w, offset in replayed.items():
                self._on_boundary(w, offset, last, now)

    def take_boundaries(self) -> None:
        """Hand the transaction ends Kafka acknowledged since the last round to
        the ack state: the latest per writer (it implies the earlier ones)."""
        boundaries = self.ledger.take_boundaries()
        if not boundaries:
            return
        # Produce latency: source commit → Kafka acknowledgement of the newest
        # transaction's last message on a writer.
        newest = max(tx_last for _, _, tx_last in boundaries)
        while self._commit_times:
            lsn, ts_ms = next(iter(self._commit_times.items()))
            if lsn > newest.tx_offset:
                break
            del self._commit_times[lsn]
            if lsn == newest.tx_offset:
                metrics.PRODUCE_LATENCY.observe(max(time.time() - ts_ms / 1000, 0))
        now = time.monotonic()
        for writer, offset, tx_last in boundaries:
            self._on_boundary(writer, offset, tx_last, now)

    def _on_boundary(self, writer: Writer, offset: int, tx_last: LogOffset, now: float) -> None:
        if not self.groups:
            self.tracker.handle_flush_notification(writer, tx_last, now)
        else:
            self.alignments[writer].record(offset, tx_last)

    def group_offsets(self, writers: list[Writer]) -> dict[str, dict[Writer, int]]:
        return self.offsets.read(self.groups, writers)

    def close(self) -> None:
        self.offsets.close()

    def committed_offsets(self, writers: list[Writer]) -> dict[Writer, int]:
        """Minimum over the ack groups of each writer's committed offset."""
        per_group = self.group_offsets(writers)
        return {w: min(offsets.get(w, 0) for offsets in per_group.values()) for w in writers} if per_group else {}

    def poll(self, now: float) -> None:
        """Read the groups' commits, if ``[ack] interval`` has passed since the last read."""
        if self.holds:
            self._release_holds(now)
        if self.groups and now - self._last_poll >= self._config.interval:
            self._last_poll = now
            self._admin.poll(0)  # serves the admin client's log records (schemas.kafka)
            self._poll_group_offsets()

    def _poll_group_offsets(self) -> None:
        pending = list(self.tracker.pending())
        if not pending:
            return
        try:
            per_group = self.group_offsets(pending)
        except KafkaException as e:
            log.warning("reading committed offsets failed (will retry): %s", e)
            return
        now = time.monotonic()  # after the read, which may take a while
        for group, offsets in per_group.items():
            if offsets != self._group_seen.get(group):
                self._group_seen[group] = offsets
                self._group_progress[group] = now
        for writer in pending:
            c = min(offsets.get(writer, 0) for offsets in per_group.values())
            produced = self.ledger.last_offset.get(writer)
            if produced is not None:
                metrics.WRITER_LAG.labels(*writer).set(max(produced + 1 - c, 0))
            if c > 0:
                flushed = self.alignments[writer].aligned(c - 1)
                if flushed is not None:
                    log.debug("%s[%d]: the groups committed offset %d: flushed to %s", *writer, c, flushed)
                    self.tracker.handle_flush_notification(writer, flushed, now)
        self._check_stalls(now, per_group)

    def _check_stalls(self, now: float, per_group: dict[str, dict[Writer, int]]) -> None:
        """A group is stalled when writers wait on it and it has committed
        nothing new for ``[ack] stall_timeout``. Default: keep holding WAL and
        say so; ``on_stall = "drop"``: stop waiting for that group."""
        timeout = self._config.stall_timeout
        stalled_writers = self.tracker.stalled_writers(now, timeout)
        self.stalled_writers = stalled_writers
        if not stalled_writers:
            self.stalled_groups = []
            return
        lowest = {w: min(o.get(w, 0) for o in per_group.values()) for w in stalled_writers}
        stalled = [g for g, offsets in per_group.items()
                   if now - self._group_progress.get(g, now) >= timeout
                   and any(offsets.get(w, 0) <= lowest[w] for w in stalled_writers)]
        for group in stalled:
            if group not in self.stalled_groups:
                log.warning("consumer group %s is stalled: no commit progress for %.0fs on %d writer(s) "
                            "(e.g. %s[%d]); WAL is held for it", group, timeout, len(stalled_writers),
                            *stalled_writers[0])
        self.stalled_groups = stalled
        if self._config.on_stall == "drop" and stalled:
            for group in stalled:
                log.error("[ack] on_stall = \"drop\": no longer waiting for consumer group %s; changes it has "
                          "not committed may be released from WAL", group)
                self.groups.remove(group)
                self._group_progress.pop(group, None)
            self.stalled_groups = []
            if self.groups:
                for w in stalled_writers:
                    self.tracker.touch(w, now)
            else:
                # No group left to wait for: what the broker holds is flushed. Every
                # recorded boundary is in Kafka (delivered, or found there on restart).
                for writer in list(self.tracker.pending()):
                    flushed = self.alignments[writer].aligned(_ANY_OFFSET)
                    if flushed is not None:
                        self.tracker.handle_flush_notification(writer, flushed, now)

    def rebuild(self, writers: list[Writer]) -> None:
        """After a restart: index, per writer, the offsets of transactions that
        are in Kafka but not yet committed by every group, so replayed
        transactions are tracked against the right offsets."""
        if not self.groups:
            return
        committed = self.committed_offsets(writers)
        self._replayed_offsets = read_positions(self._kafka_conf, committed)
