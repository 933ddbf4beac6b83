"""Spark's Kafka source as the consumer reads it (spark_consumer/source.py),
pure parts: where a run starts (the target's progress, per topic
incarnation), and how a recreated topic is told apart."""

from __future__ import annotations

import pytest

from schemas.kafka import Described
from spark_consumer.progress import Progress
from spark_consumer.source import EARLIEST, incarnation_changes, plan_start

A, B, C = "wb.public.a", "wb.public.b", "wb.public.c"


def test_a_run_starts_at_the_targets_progress_naming_every_partition():
    progress = {(A, 0): Progress(10, topic_id="ia"), (A, 1): Progress(4, topic_id="ia"), (B, 0): Progress(3)}
    plan = plan_start([A, B], progress, {A: Described("ia", (0, 1, 2)), B: Described("ib", (0,))})
    # Spark needs every partition of a subscription once any is named: the one without progress at its earliest.
    assert plan.starting_offsets == {A: {"0": 10, "1": 4, "2": EARLIEST}, B: {"0": 3}}
    assert plan.starts == {(A, 0): 10, (A, 1): 4, (A, 2): 0, (B, 0): 3}
    assert plan.topic_ids == {A: "ia", B: "ib"} and plan.reread == frozenset()


def test_a_topic_recreated_while_the_consumer_was_down_is_read_whole():
    progress = {(A, 0): Progress(500, (7, 0), None, "old"), (A, 1): Progress(20, topic_id="old")}
    plan = plan_start([A], progress, {A: Described("new", (0, 1))})
    assert plan.starting_offsets == {A: {"0": EARLIEST, "1": EARLIEST}}
    assert plan.starts == {(A, 0): 0, (A, 1): 0}  # never at offsets that counted in the lost topic
    assert plan.topic_ids == {A: "new"} and plan.reread == {A}


def test_a_missing_topic_is_subscribed_and_read_from_its_start_once_it_exists():
    plan = plan_start([A, C], {(C, 0): Progress(9, topic_id="ic")}, {A: Described("ia", (0,)), C: None})
    assert C not in plan.starting_offsets and plan.topic_ids[C] is None
    assert (C, 0) not in plan.starts  # a part of a partition the run did not start counts from offset 0


def test_a_broker_without_topic_ids_resumes_at_the_progress():
    plan = plan_start([A], {(A, 0): Progress(5, topic_id="x")}, {A: Described(None, (0,))})
    assert plan.starting_offsets == {A: {"0": 5}} and plan.reread == frozenset()


def test_a_topic_recreated_or_deleted_under_the_run_is_told_apart_from_one_that_appeared():
    read_in = {A: "ia", B: "ib", C: None}
    changed, appeared = incarnation_changes(read_in, {A: "ia", B: "ib2", C: "ic"})
    assert changed == {B: "the topic was recreated (id ib, now ib2)"} and appeared == {C: "ic"}
    changed, appeared = incarnation_changes(read_in, {A: LookupError("gone"), B: "ib", C: LookupError("still")})
    assert changed == {A: "the topic was deleted"} and appeared == {}


def test_a_read_whose_incarnation_cannot_be_confirmed_is_not_applied():
    with pytest.raises(TimeoutError):
        incarnation_changes({A: "ia"}, {A: TimeoutError("no answer")})
