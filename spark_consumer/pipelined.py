"""A foreachBatch function that applies one batch while Spark reads the next
(:class:`spark_consumer.query.BatchApplier`).

``__call__`` runs the subclass's ``_call``, which reads batch N (Spark's job),
waits for batch N-1's apply (:meth:`PipelinedApply._finish_pending`) and hands
N to the one apply thread; Spark plans and reads N+1 meanwhile.

Invariants:
- One batch in flight: ``_call`` waits for the previous apply before it
  hands a new one over, so Spark logs at most the newest batch before the
  target has it; a failed apply fails the next batch (or is found by the
  supervisor), and the restarted query begins at the target's progress.
- A query is stopped only while its foreachBatch is outside Spark
  (:meth:`PipelinedApply.quiesce`): an interrupt inside a Spark call returns
  as a Py4J error carrying Java's stack, whose text Spark's interruption
  check scans with a regex that overflows the stream thread's stack
  (``StackOverflowError``). A failed apply found while a batch is being read
  ends the query through that batch instead.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from spark_consumer.group_commits import COMMIT_RETRY_S, OffsetCommitter

log = logging.getLogger("walbridge.consumer")


class PipelinedApply:
    """See the module docstring; ``what`` names the query in errors. It owns
    the query's target (:class:`spark_consumer.targets.Target`) and its
    consumer-group committer, both used on the apply thread."""

    def __init__(self, what: str, thread_name: str, kafka_conf: dict[str, Any], group: str, target: Any):
        self.what = what
        self.kafka_conf = kafka_conf
        self.group = group
        self._apply_thread = ThreadPoolExecutor(1, thread_name_prefix=thread_name)
        self._pending: Future | None = None  # the batch being applied
        self._calls = threading.Lock()
        self._in_call = False
        self._quiesced = False
        self.target = target
        self._committer: OffsetCommitter | None = None
        self.batches = 0
        self.rows = 0
        self.dlq = 0

    def close(self) -> None:
        """Finish the batch being applied, then release the Kafka client and
        the target connection (after the query stopped)."""
        try:
            self._finish_pending()
        except Exception as e:  # noqa: BLE001 - replayed at the next start
            log.error("%s: the last batch's apply failed (it is replayed at the next start): %s", self.what, e)
        self._apply_thread.shutdown()
        if self._committer is not None:
            self._committer.close()
            self._committer = None
        self.target.close()

    def _group(self) -> OffsetCommitter:
        if self._committer is None:
            self._committer = OffsetCommitter(self.kafka_conf, self.group)
        return self._committer

    def retry_commits(self) -> None:
        """Driver loop: hand a failed group commit that no batch retried to
        the apply thread (after the batch being applied, never beside it)."""
        committer, pending = self._committer, self._pending
        if committer is not None and (pending is None or pending.done()):
            self._apply_thread.submit(committer.retry, COMMIT_RETRY_S)

    @property
    def needs_restart(self) -> bool:
        """Must the query be restarted (not failed) before its next batch?"""
        return False

    @property
    def error(self) -> BaseException | None:
        """The error of a finished, failed apply not yet raised to Spark."""
        pending = self._pending
        return pending.exception() if pending is not None and pending.done() else None

    def quiesce(self) -> bool:
        """After a failed apply: refuse every further batch. True when no
        batch is being read now, so the query can be stopped; False when one
        is: that call raises the apply's error itself (ending the query)."""
        with self._calls:
            self._quiesced = True
            return not self._in_call

    def settle(self, timeout: float) -> None:
        """Quiesce, then wait up to ``timeout`` seconds for the batch being
        read to be handed over (before the query is stopped for good)."""
        deadline = time.monotonic() + timeout
        while not self.quiesce() and time.monotonic() < deadline:
            time.sleep(0.05)

    def _finish_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def __call__(self, batch_df, batch_id: int) -> None:
        with self._calls:
            if self._quiesced:
                raise self.error or RuntimeError(f"{self.what}: the query is being restarted")
            self._in_call = True
        try:
            self._call(batch_df, batch_id)
        finally:
            with self._calls:
                self._in_call = False

    def _call(self, batch_df, batch_id: int) -> None:
        raise NotImplementedError
