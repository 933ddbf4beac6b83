"""The continuous reader (``[consumer] queries = "continuous"``): the one
query's source (:class:`~spark_consumer.topics_source.TopicsStreamReader`)
and apply (:class:`~spark_consumer.shapes_query.ShapesApplier`), driven by a
loop of the driver's own instead of Spark's micro-batch engine.

Why: about 0.33 s of every Spark micro-batch is Spark's own (the offset and
commit logs, planning, a job, a Python worker's turn), paid whatever the row
count, and a row waits for the batch being read before its own starts: p99
1.6–2.3 s at 1,000 tps on 2 cores (bench/RESULTS.md, "End-to-end latency").
Here a round costs what its rows cost: a look at the ends, one fetch round,
the decode and the apply.

The path of one round, top to bottom:
1. Every topic's ends from where the last round ended
   (:meth:`~spark_consumer.topics_source.TopicsStreamReader.latestOffset`,
   with every protection of the Spark source: a recreated topic, an end below
   what was read, a new partition), at most ``max_offsets_per_trigger``
   (default :data:`ROUND_OFFSETS`) offsets in all, shared fairly among the
   topics with a backlog (a round's memory is bounded whatever the shape
   count).
2. Their ranges read on the driver with one assignment
   (:func:`~spark_consumer.kafka_source.read_offset_ranges`, what the
   executors run: rows handed over only while their topic incarnation stands,
   skipped offsets fetched again).
3. Each shape's rows decoded with its writer schemas
   (:func:`~spark_consumer.batch_split.decode_by_topic`), learning new ones
   as the one query does.
4. The apply thread applies every shape's part in ONE target transaction and
   then commits the group's offsets, each tagged with the topic id its range
   was planned in (:meth:`~spark_consumer.shapes_query.ShapesApplier._apply_tables`);
   meanwhile the next round is read.

Invariants:
- The target's progress is the only record of what is applied: every start
  (and every restart after a failure) begins at it, and nothing else is kept
  (no Spark checkpoint). A crash anywhere, even between the target's commit
  and the group's, is repaired by reading on from the progress; a replayed
  range is skipped part by part by the apply, which refuses a gap.
- Each round starts where the previous one ended: consecutive ranges.
- One round in flight: a round is handed to the apply thread only after the
  previous one committed (:mod:`spark_consumer.pipelined`), and the loop is
  stopped only between rounds.
- At a start, the group's offsets are committed again at the target's
  progress (the producer holds a partition's WAL until its commit lands).
- Reading and decoding happen on the driver only; Spark's executors are not
  used and no SparkSession is started. For a throughput spread over a
  cluster's executors, ``queries = "one"``.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

import pyarrow as pa
from pyspark.sql.streaming.datasource import ReadMaxRows

from schemas.config import Config
from spark_consumer.batch_split import decode_by_topic, starting_offsets
from spark_consumer.kafka_source import TOPIC_ID, SourceOptions, read_offset_ranges
from spark_consumer.shapes_query import ShapesApplier, shape_states
from spark_consumer.topics_source import TopicsStreamReader, topic_options

log = logging.getLogger("walbridge.consumer")
rounds_log = logging.getLogger("walbridge.consumer.rounds")  # DEBUG: each round's look and read times

QUERY_NAME = "walbridge:continuous"
ROUND_OFFSETS = 50_000  # per round, all topics, unless max_offsets_per_trigger says otherwise
# After a look that found nothing new, the wait before the next: at least
# IDLE_LOOK_S, and IDLE_LOOK_SHARE times what the look took, so an idle reader
# over many topics does not spend its time looking (200 topics at a fixed
# 50 ms: 0.63 cores idle; bench/RESULTS.md).
IDLE_LOOK_S = 0.05
IDLE_LOOK_SHARE = 4
STOP_WAIT_S = 30.0  # how long a stop waits for the round being read


@dataclass(frozen=True)
class Round:
    """What one round read: raw record batches of every topic, the topic id
    each topic's offsets were planned in, when the round began."""

    raw: list[pa.RecordBatch]
    topic_ids: dict[str, str | None]
    began: float


class ContinuousApplier(ShapesApplier):
    """The one query's applier, fed rounds read on the driver (module docstring)."""

    def prepare(self, stop: threading.Event | None = None) -> dict[str, dict]:
        """Each topic's starting offsets: the target's progress (none: from
        its earliest offsets); the group's offsets are committed there again."""
        initial = starting_offsets(self._target_progress(stop), self.topics)
        offsets = {(t, int(p)): o for t, offs in initial.items() if offs.get(TOPIC_ID)
                   for p, o in offs.items() if p.isdigit()}
        if offsets:
            self._apply_thread.submit(self._group().commit, offsets, {t: initial[t][TOPIC_ID] for t, _ in offsets})
        return initial

    def _call(self, round_: Round, batch_id: int) -> None:
        tables = self._decode(functools.partial(self._decode_here, round_.raw), batch_id)
        self._hand_over(tables, batch_id, round_.topic_ids, round_.began)

    def _decode_here(self, raw: list[pa.RecordBatch], topics: list[str], first: bool) -> dict[str, pa.Table]:
        return {t: pa.Table.from_batches(batches) for t, batches in decode_by_topic(self._shapes(topics), raw).items()}


class ContinuousQuery:
    """What the consumer's run loop (:func:`spark_consumer.job.run`) sees of
    the reading thread: a StreamingQuery's face (``name``, ``isActive``,
    ``exception()``, ``lastProgress``, ``stop()``)."""

    name = QUERY_NAME

    def __init__(self, opts: dict[str, SourceOptions], applier: ContinuousApplier, max_offsets: int,
                 reader: TopicsStreamReader | None = None):
        self._opts = opts
        self._reader = reader if reader is not None else TopicsStreamReader(opts)
        self._applier = applier
        self._limit = ReadMaxRows(max_offsets)
        self._stopping = threading.Event()
        self._error: BaseException | None = None
        self.lastProgress: dict[str, Any] | None = None
        self._thread = threading.Thread(target=self._run, name="walbridge-continuous", daemon=True)

    def start(self) -> ContinuousQuery:
        self._thread.start()
        return self

    @property
    def isActive(self) -> bool:
        return self._thread.is_alive()

    def exception(self) -> BaseException | None:
        return self._error

    def stop(self) -> None:
        """Stop after the round in hand (its apply is the applier's to finish).
        A round still reading after :data:`STOP_WAIT_S` (a broker that does
        not answer) is left behind: it can hand nothing over any more (the
        applier refuses rounds once quiesced), and a restarted reader reads
        with range consumers of its own."""
        self._stopping.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(STOP_WAIT_S)
            if self._thread.is_alive():
                log.warning("the continuous reader is still in a read after %.0fs; leaving it behind", STOP_WAIT_S)

    def _run(self) -> None:
        try:
            start = self._reader.initialOffset()
            batch_id = 0
            while not self._stopping.is_set():
                began = time.monotonic()
                end = self._reader.latestOffset(start, self._limit)
                ranges = self._reader.ranges(start, end)
                offsets = sum(r.end - r.start for r in ranges)
                if ranges:
                    looked = time.monotonic()
                    raw = list(read_offset_ranges(self._opts.__getitem__, ranges))
                    rounds_log.debug("round %d: %d offsets, look %.3fs, read %.3fs", batch_id, offsets,
                                     looked - began, time.monotonic() - looked)
                    self._applier(Round(raw, {t: o.get(TOPIC_ID) for t, o in end.items()}, began), batch_id)
                    batch_id += 1
                start = end
                self.lastProgress = {"batchId": batch_id, "offsets": offsets}
                if not ranges:
                    self._stopping.wait(max(IDLE_LOOK_S, IDLE_LOOK_SHARE * (time.monotonic() - began)))
        except BaseException as e:  # noqa: BLE001 - the run loop reads it (exception()) and restarts
            self._error = e
        finally:
            self._reader.stop()


def start_continuous(config: Config, kafka_conf: dict[str, Any], stop: threading.Event | None = None,
                     held: dict[str, str] | None = None) -> tuple[ContinuousQuery | None, ContinuousApplier]:
    """The continuous reader over every shape not ``held``, started at the
    target's progress, and its applier; (None, applier) when every shape is held."""
    states = shape_states(config, stop)
    applier = ContinuousApplier(config, states, kafka_conf, None, held)
    starting = applier.prepare(stop)
    topics = applier.reading = applier.topics
    if not topics:
        log.error("every shape is held back; nothing to consume")
        return None, applier
    common = replace(next(iter(states.values())).source, max_offsets_per_task=None)  # one range per partition
    opts = topic_options(common, topics, {t: o for t, o in starting.items() if o})
    query = ContinuousQuery(opts, applier, config.consumer.max_offsets_per_trigger or ROUND_OFFSETS).start()
    log.info("consuming %d shape topics continuously (from the target's progress, no Spark checkpoint)", len(topics))
    return query, applier
