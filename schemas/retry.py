"""Waiting out transient failures: one retry policy for every walbridge process.

An *outage* is a run of attempts that fail with transient
failures (:class:`~schemas.failures.Failure`); between them walbridge waits a jittered
exponential time (tenacity's ``wait_random_exponential``: uniform between 0
and ``initial * 2**n``, capped at ``max_backoff``), so many processes waiting
for the same server do not knock at once.

Invariants:
- Only a transient :class:`Failure` is retried; a permanent one, or an error
  that is no endpoint's failure, leaves at once.
- Every wait is logged with the endpoint that fails, its redacted address,
  how long the outage has lasted and the wait ahead; the gauge
  ``walbridge_outage_seconds{endpoint}`` says the same to Prometheus, and
  drops to 0 when the outage is over.
- With ``max_elapsed`` (seconds) the outage's last failure is raised once
  the outage has lasted that long; None waits forever.
- Setting ``stop`` ends a wait at once and the outage without an error.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

import tenacity
from prometheus_client import Counter, Gauge

from schemas.failures import Failure

OUTAGE = Gauge("walbridge_outage_seconds",
               "How long this process has been waiting for an endpoint that fails transiently (0: not waiting)",
               ["endpoint"])
RETRIES = Counter("walbridge_retries", "Attempts that failed transiently and were retried", ["endpoint"])


@dataclass(frozen=True)
class RetryPolicy:
    max_backoff: float = 30.0  # seconds, the longest wait between two attempts
    max_elapsed: float | None = None  # seconds an outage may last; None: forever
    initial: float = 0.5  # seconds, the scale of the first waits

    @classmethod
    def of(cls, section: Any) -> RetryPolicy:
        """A config section's policy (``reconnect_max_backoff``, ``reconnect_max_elapsed``)."""
        return cls(section.reconnect_max_backoff, section.reconnect_max_elapsed)

    def wait(self) -> tenacity.wait.wait_base:
        return tenacity.wait_random_exponential(multiplier=self.initial, max=self.max_backoff)

    def delay(self, failures: int) -> float:
        """The wait after the ``failures``-th failure in a row, for loops
        that cannot hand their attempts to :class:`Outage`."""
        state = tenacity.RetryCallState(None, None, (), {})
        state.attempt_number = max(failures, 1)
        return self.wait()(state)


def _transient(error: BaseException) -> bool:
    return isinstance(error, Failure) and not error.permanent


class Outage:
    """The attempts of one outage, as tenacity drives them::

        outage = Outage(policy, stop, log)
        for attempt in outage:
            with attempt:
                ...   # raises a Failure (see schemas.failures.attributed)

    The loop ends when an attempt ends without error (or ``stop`` is set)
    and raises a permanent failure at once, a transient one after
    ``policy.max_elapsed``."""

    def __init__(self, policy: RetryPolicy, stop: threading.Event | None, log: logging.Logger):
        self._policy = policy
        self._stop = stop
        self._log = log
        self._failing: set[str] = set()

    def __iter__(self) -> Iterator[tenacity.AttemptManager]:
        policy, stop = self._policy, self._stop
        give_up = tenacity.stop_after_delay(policy.max_elapsed) if policy.max_elapsed else tenacity.stop_never
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(_transient), wait=policy.wait(),
            stop=give_up | (lambda state: stop is not None and stop.is_set()),
            sleep=stop.wait if stop is not None else time.sleep, before_sleep=self._before_sleep, reraise=True)
        try:
            for attempt in retrying:
                if stop is not None and stop.is_set() and attempt.retry_state.attempt_number > 1:
                    return  # stopped while waiting: no more attempts
                yield attempt
        except GeneratorExit:  # the caller left the loop from a successful attempt
            self.over()
            raise
        except Failure as failure:
            if stop is not None and stop.is_set():
                return
            if not failure.permanent:
                self._log.error("%s; giving up after %.0fs (reconnect_max_elapsed)", failure.headline,
                                policy.max_elapsed or 0)
            raise
        self.over()

    def over(self) -> None:
        """The endpoints answer again (the caller may know before the attempt ends)."""
        for endpoint in self._failing:
            OUTAGE.labels(endpoint).set(0)
        self._failing.clear()

    def _before_sleep(self, state: tenacity.RetryCallState) -> None:
        failure = state.outcome.exception()
        elapsed = state.seconds_since_start or 0.0
        self._failing.add(failure.endpoint)
        OUTAGE.labels(failure.endpoint).set(elapsed)
        RETRIES.labels(failure.endpoint).inc()
        hint = f" — {failure.fix}" if failure.fix else ""
        self._log.warning("%s; retrying in %.1fs (failing for %.0fs)%s", failure.headline,
                          state.next_action.sleep, elapsed, hint)
