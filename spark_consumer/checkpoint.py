"""Spark's checkpoint of one shape query, checked against the target before the
query starts, so that a batch Spark logged as done but the target never
committed is read and applied again.

Why it can happen: the driver apply is pipelined one batch deep
(:class:`spark_consumer.job.ShapeApplier`): foreachBatch N returns once batch
N is read and batch N-1's apply has committed, and Spark then writes
``commits/N`` while N is still being applied. A crash (``kill -9``, a failed
apply) in that window leaves ``commits/N`` without N in the target, and Spark
alone would resume after N.

Invariants:
- The pipelining leaves only the newest committed batch unapplied:
  foreachBatch N+1 waits for N's apply before it returns, and Spark writes
  ``commits/N+1`` only after that. An older batch is unapplied only when its
  read handed over none of a partition's messages (a source fault): the
  target's progress on that partition is still at or below the batch's
  start, and every later batch that moved it starts above that progress, so
  it fails with a progress gap. :func:`replay_unapplied` replays from the
  earliest such batch of the newest batch's topic incarnation (the log Spark
  retains), else from the newest batch if that one is unapplied: the target's
  progress, not Spark's log, says what was applied.
- A batch counts as applied only when every partition its offset range moved
  shows target progress inside that range (``start < next_offset <= end``):
  one target transaction applies all of a batch's parts, so its progress moves
  on every partition that had rows. Anything else (no progress row, progress
  beyond the batch's end after an offset reset, a recreated topic, an
  unreadable log entry) counts as unapplied: replaying an applied batch is
  harmless (progress skips it part by part), skipping an unapplied one is not.
- Progress is compared in one topic incarnation: the caller passes the
  target's next offsets as the newest batch's incarnation sees them (progress
  recorded for another reads as 0, :meth:`spark_consumer.apply_plan.Progress.for_incarnation`).
  Progress written before the target recorded incarnations cannot be told
  apart, so the first batch of an incarnation counts as applied only with
  progress at or past its end on every partition it moved.
- The repair is what Spark does for a batch it had not committed: with
  ``commits/N`` and every later ``commits/`` and ``offsets/`` entry removed
  (with Hadoop's ``.crc`` side files), the restarted query re-runs batch N
  over the same offset range ``[offsets/N-1, offsets/N)`` and plans the
  batches after it anew.

One query over many topics (:mod:`spark_consumer.topics_source`, offsets
``{"<topic>": <that topic's offsets>}``) is reasoned about per topic, with
the same rules (the ``topics_*`` functions): its newest batch is applied only
when every topic of the query it moved is; a topic that joined in that batch
moved nothing; and the first batch starts where the source was told to start
(the target's progress when the query started), not at offset 0.

Layout read here (Spark's HDFSMetadataLog, format ``v1``): ``offsets/<id>``
is a version line, a metadata line, then one line per source (this query has
one: the source's offset JSON, see :mod:`spark_consumer.kafka_source`);
``commits/<id>`` marks batch ``<id>`` done.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Iterable, Iterator

from spark_consumer.kafka_source import TOPIC_ID, offsets_from_json, recreated
from spark_consumer.topics_source import read_ranges

log = logging.getLogger("walbridge.consumer")


def batch_applied(start: dict | None, end: dict | None, next_offsets: Mapping[int, int]) -> bool:
    """Did the target commit the batch whose source offsets go from ``start``
    (None: the first batch, which starts at the topic's beginning) to ``end``?
    ``next_offsets``: the target's progress per partition of the topic."""
    if end is None or recreated(start, end):
        return False
    begin = offsets_from_json(start)
    for partition, stop in offsets_from_json(end).items():
        first = begin.get(partition, 0)
        if stop > first and not first < next_offsets.get(partition, 0) <= stop:
            return False
    return True


def batch_ids(log_dir: Path) -> list[int]:
    """The batch ids a Spark log directory (``offsets/``, ``commits/``) holds, in order."""
    if not log_dir.is_dir():
        return []
    return sorted(int(f.name) for f in log_dir.iterdir() if f.name.isdigit())


def _source_offsets(checkpoint: Path, batch_id: int) -> dict | None:
    try:
        lines = (checkpoint / "offsets" / str(batch_id)).read_text().splitlines()
        return json.loads(lines[2]) if len(lines) == 3 and lines[0] == "v1" else None
    except (OSError, ValueError):
        return None


def _remove(log_dir: Path, batch_id: int) -> None:
    for name in (str(batch_id), f".{batch_id}.crc"):
        (log_dir / name).unlink(missing_ok=True)


def _skipped_partitions(start: dict | None, end: dict | None, next_offsets: Mapping[int, int]) -> list[int]:
    """The partitions a batch moved of which the target applied nothing, not
    even later: its progress there is still at or below the batch's start."""
    begin = offsets_from_json(start)
    return [p for p, stop in offsets_from_json(end).items()
            if stop > begin.get(p, 0) and next_offsets.get(p, 0) <= begin.get(p, 0)]


def earliest_skipped(checkpoint: Path, next_offsets: Mapping[int, int]) -> int | None:
    """The earliest committed batch before the newest, of the newest batch's
    topic incarnation, that moved a partition the target never applied."""
    committed = batch_ids(checkpoint / "commits")
    if len(committed) < 2:
        return None
    incarnation = batch_topic_id(checkpoint, committed[-1])
    for batch in committed[:-1]:
        start = _source_offsets(checkpoint, batch - 1) if batch > 0 else None
        end = _source_offsets(checkpoint, batch)
        if end is None or (batch > 0 and start is None) or recreated(start, end) or end.get(TOPIC_ID) != incarnation:
            continue  # purged by Spark, unreadable, or of an earlier incarnation: nothing to say
        if _starts_incarnation(checkpoint, batch):
            # The target's progress may still be the earlier incarnation's (it
            # keeps no topic id): only progress at or past its end on every
            # partition it moved says it was applied (a doubt replays it,
            # which is harmless).
            begin = offsets_from_json(start)
            if any(stop > begin.get(p, 0) and next_offsets.get(p, 0) < stop
                   for p, stop in offsets_from_json(end).items()):
                return batch
        elif _skipped_partitions(start, end, next_offsets):
            return batch
    return None


def _starts_incarnation(checkpoint: Path, batch: int) -> bool:
    """Does ``batch`` read the first offsets of a topic incarnation (the batch
    before it is the one that found the topic recreated)?"""
    if batch < 2:
        return False
    before, at = _source_offsets(checkpoint, batch - 2), _source_offsets(checkpoint, batch - 1)
    return before is not None and at is not None and recreated(before, at)


def newest_unapplied(checkpoint: Path, next_offsets: Mapping[int, int]) -> int | None:
    """The newest batch the query's ``checkpoint`` has as committed, if the
    target has not applied it (see the module's invariants); else None."""
    committed = batch_ids(checkpoint / "commits")
    if not committed:
        return None
    newest = committed[-1]
    start = _source_offsets(checkpoint, newest - 1) if newest > 0 else None
    if (newest == 0 or start is not None) and batch_applied(start, _source_offsets(checkpoint, newest),
                                                            next_offsets):
        return None
    return newest


def batch_topic_id(checkpoint: Path, batch_id: int) -> str | None:
    """The id of the topic incarnation batch ``batch_id`` was planned on (in
    its end offsets; None where not recorded)."""
    return (_source_offsets(checkpoint, batch_id) or {}).get(TOPIC_ID)


def newest_topic_id(checkpoint: Path) -> str | None:
    """The topic incarnation the newest committed batch was planned on (None:
    no batch, or not recorded)."""
    committed = batch_ids(checkpoint / "commits")
    return batch_topic_id(checkpoint, committed[-1]) if committed else None


def newest_moved(checkpoint: Path, next_offsets: Mapping[int, int]) -> tuple[str | None, dict[int, int]]:
    """The topic id the newest committed batch was read from, and the target's
    next offset of each partition that batch moved (``start < next <= end``):
    what its group commit was to say. (None, {}) without such a batch."""
    committed = batch_ids(checkpoint / "commits")
    if not committed:
        return None, {}
    newest = committed[-1]
    start = _source_offsets(checkpoint, newest - 1) if newest > 0 else None
    end = _source_offsets(checkpoint, newest)
    if end is None or (newest > 0 and start is None) or recreated(start, end):
        return None, {}
    begin = offsets_from_json(start)
    moved = {p: next_offsets[p] for p, stop in offsets_from_json(end).items()
             if begin.get(p, 0) < next_offsets.get(p, -1) <= stop}
    return end.get(TOPIC_ID), moved


def replay_unapplied(checkpoint: Path, next_offsets: Mapping[int, int]) -> int | None:
    """Un-commit :func:`earliest_skipped`'s batch, or else
    :func:`newest_unapplied`'s, and every batch after it, so that Spark
    re-runs it; returns its id, or None when there was nothing to repair.
    Call it only while the query is stopped."""
    first = earliest_skipped(checkpoint, next_offsets)
    if first is None:
        first = newest_unapplied(checkpoint, next_offsets)
    if first is None:
        return None
    _uncommit(checkpoint, first)
    return first


def _uncommit(checkpoint: Path, first: int) -> None:
    """Make Spark re-run batch ``first`` and plan the ones after it anew:
    its commit, every later commit and every later offsets entry go."""
    for later in batch_ids(checkpoint / "offsets"):
        if later > first:
            _remove(checkpoint / "offsets", later)
    for batch in batch_ids(checkpoint / "commits"):
        if batch >= first:
            _remove(checkpoint / "commits", batch)


Progress = Mapping[str, Mapping[int, int]]  # topic -> partition -> the target's next offset


def _topics_of_newest(checkpoint: Path, initial: Mapping[str, dict]
                      ) -> tuple[int | None, list[tuple[str, dict | None, dict | None]]]:
    """The newest committed batch of a many-topic query and, for each of the
    query's topics (``initial``'s: where the source was told to start each)
    that the batch read, (topic, its start offsets, its end offsets); an
    unreadable entry gives (topic, None, None)."""
    committed = batch_ids(checkpoint / "commits")
    if not committed:
        return None, []
    newest = committed[-1]
    start = _source_offsets(checkpoint, newest - 1) if newest > 0 else None
    end = _source_offsets(checkpoint, newest)
    if end is None or (newest > 0 and start is None):
        return newest, [(t, None, None) for t in initial]
    return newest, list(_topic_ranges(start, end, initial))


def _topic_ranges(start: dict | None, end: dict, initial: Mapping[str, dict]
                  ) -> Iterator[tuple[str, dict | None, dict | None]]:
    """The ranges the batch read, as the source planned them (a topic that
    joined in it read nothing); the first batch starts at ``initial``."""
    for topic, first, last in read_ranges(start, end, initial):
        yield topic, first if start is not None else initial[topic], last


def topics_batch_unapplied(checkpoint: Path, progress: Progress, initial: Mapping[str, dict]) -> int | None:
    """:func:`newest_unapplied` for a many-topic query: the newest committed
    batch if any of the query's topics it moved lacks its target progress."""
    newest, ranges = _topics_of_newest(checkpoint, initial)
    for topic, start, end in ranges:
        if end is None or not batch_applied(start, end, progress.get(topic, {})):
            return newest
    return None


def topics_earliest_skipped(checkpoint: Path, progress: Progress, initial: Mapping[str, dict]) -> int | None:
    """:func:`earliest_skipped` for a many-topic query: the earliest committed
    batch before the newest that moved a partition of one of the query's
    topics (in that topic's incarnation of the newest batch) of which the
    target applied nothing."""
    committed = batch_ids(checkpoint / "commits")
    if len(committed) < 2:
        return None
    newest = _source_offsets(checkpoint, committed[-1]) or {}
    for batch in committed[:-1]:
        start = _source_offsets(checkpoint, batch - 1) if batch > 0 else None
        end = _source_offsets(checkpoint, batch)
        if end is None or (batch > 0 and start is None):
            continue  # purged by Spark or unreadable: nothing to say
        for topic, first, last in _topic_ranges(start, end, initial):
            if recreated(first, last) or last.get(TOPIC_ID) != (newest.get(topic) or {}).get(TOPIC_ID):
                continue
            if _skipped_partitions(first, last, progress.get(topic, {})):
                return batch
    return None


def topics_replay_unapplied(checkpoint: Path, progress: Progress, initial: Mapping[str, dict]) -> int | None:
    """:func:`replay_unapplied` for a many-topic query."""
    first = topics_earliest_skipped(checkpoint, progress, initial)
    if first is None:
        first = topics_batch_unapplied(checkpoint, progress, initial)
    if first is not None:
        _uncommit(checkpoint, first)
    return first


def topics_newest_moved(checkpoint: Path, progress: Progress, initial: Mapping[str, dict]
                        ) -> dict[str, tuple[str | None, dict[int, int]]]:
    """:func:`newest_moved` per topic of a many-topic query: topic -> (the
    topic id its part of the newest batch was read from, the target's next
    offset of each partition that batch moved)."""
    _, ranges = _topics_of_newest(checkpoint, initial)
    out = {}
    for topic, start, end in ranges:
        if end is None or recreated(start, end):
            continue
        begin, nxt = offsets_from_json(start), progress.get(topic, {})
        moved = {p: nxt[p] for p, stop in offsets_from_json(end).items() if begin.get(p, 0) < nxt.get(p, -1) <= stop}
        if moved:
            out[topic] = (end.get(TOPIC_ID), moved)
    return out


def topics_batch_topic_ids(checkpoint: Path, batch_id: int) -> dict[str, str]:
    """:func:`batch_topic_id` of every topic of a many-topic query's batch
    (one read of its offset log; topics whose id is not recorded are absent)."""
    end = _source_offsets(checkpoint, batch_id) or {}
    return {t: o[TOPIC_ID] for t, o in end.items() if isinstance(o, dict) and o.get(TOPIC_ID)}


def topics_newest_topic_ids(checkpoint: Path) -> dict[str, str]:
    """:func:`newest_topic_id` per topic of a many-topic query (topics whose
    id is not recorded are absent)."""
    committed = batch_ids(checkpoint / "commits")
    return topics_batch_topic_ids(checkpoint, committed[-1]) if committed else {}


def topics_ahead_of_target(checkpoint: Path, progress: Progress, topics: Iterable[str]) -> set[str]:
    """The query's ``topics`` whose offsets in the newest committed batch lie
    beyond the target's progress on some partition: Spark would read on from
    there over offsets the target never applied (a shape held back while the
    others went on, then a crash before it left the checkpoint). They must
    rejoin at the target's progress. Call it after the newest batch's repair
    (:func:`topics_replay_unapplied`). An unreadable entry: every topic."""
    committed = batch_ids(checkpoint / "commits")
    if not committed:
        return set()
    end = _source_offsets(checkpoint, committed[-1])
    if end is None:
        return set(topics)
    ahead = set()
    for topic in topics:
        if topic in end:
            nxt = progress.get(topic, {})
            if any(o > nxt.get(p, 0) for p, o in offsets_from_json(end[topic]).items()):
                ahead.add(topic)
    return ahead
