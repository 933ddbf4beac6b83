"""One outage, as schemas.retry waits it out: transient failures retried with
jittered exponential backoff, permanent ones raised at once, a time limit,
a stop that ends the waiting, and the outage gauge."""

from __future__ import annotations

import logging
import threading

import pytest

from schemas.failures import KAFKA, SOURCE, Failure
from schemas.retry import OUTAGE, Outage, RetryPolicy

log = logging.getLogger("test.retry")
FAST = RetryPolicy(max_backoff=0.02, initial=0.001)


def transient(endpoint: str = KAFKA) -> Failure:
    return Failure(endpoint, "cannot reach the broker", "is Kafka running?", address="k:9092", permanent=False)


def run(outage: Outage, outcomes: list) -> int:
    """Attempts until the outage ends; each pops its outcome (an error to raise, or None)."""
    attempts = 0
    for attempt in outage:
        with attempt:
            attempts += 1
            error = outcomes.pop(0)
            if error is not None:
                raise error
    return attempts


def test_transient_failures_are_retried_until_an_attempt_succeeds(caplog):
    caplog.set_level(logging.WARNING, logger="test.retry")
    assert run(Outage(FAST, None, log), [transient(), transient(), None]) == 3
    waits = [r.getMessage() for r in caplog.records]
    assert len(waits) == 2
    assert waits[0].startswith("kafka k:9092: cannot reach the broker; retrying in ")
    assert waits[0].endswith(" — is Kafka running?")
    assert OUTAGE.labels(KAFKA)._value.get() == 0  # over


def test_a_permanent_failure_is_raised_at_once():
    refused = Failure(SOURCE, 'password authentication failed for user "app"')
    with pytest.raises(Failure) as e:
        run(Outage(FAST, None, log), [refused, None])
    assert e.value is refused


def test_an_error_that_is_no_failure_is_not_retried():
    with pytest.raises(ZeroDivisionError):
        run(Outage(FAST, None, log), [ZeroDivisionError(), None])


def test_an_outage_longer_than_max_elapsed_raises_its_last_failure():
    policy = RetryPolicy(max_backoff=0.01, max_elapsed=0.05, initial=0.005)
    with pytest.raises(Failure, match="cannot reach the broker"):
        run(Outage(policy, None, log), [transient() for _ in range(10_000)])


def test_stop_ends_the_outage_without_an_error():
    stop = threading.Event()
    policy = RetryPolicy(max_backoff=60.0, initial=30.0)  # the wait would be long
    outcomes = [transient(), transient()]
    threading.Timer(0.1, stop.set).start()
    assert run(Outage(policy, stop, log), outcomes) == 1


def test_the_gauge_says_how_long_an_endpoint_has_been_failing():
    seen = []
    outage = Outage(FAST, None, log)
    for attempt in outage:
        with attempt:
            seen.append(OUTAGE.labels(SOURCE)._value.get())
            if len(seen) < 3:
                raise transient(SOURCE)
    assert seen[0] == 0 and seen[2] > 0
    assert OUTAGE.labels(SOURCE)._value.get() == 0


def test_waits_are_jittered_and_capped():
    policy = RetryPolicy(max_backoff=4.0, initial=0.5)
    for failures, bound in ((1, 1.0), (2, 2.0), (3, 4.0), (10, 4.0)):
        delays = [policy.delay(failures) for _ in range(200)]
        assert all(0 <= d <= bound for d in delays)
        assert len(set(delays)) > 100  # jitter: not one fixed wait
