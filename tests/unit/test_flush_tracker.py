"""Unit tests for producer.flush_tracker (pure, no I/O)."""

from __future__ import annotations

import random

import pytest

from producer.flush_tracker import FlushTracker, LogOffset, WriterAlignment


def make_tracker() -> tuple[FlushTracker, list[int]]:
    calls: list[int] = []
    return FlushTracker(calls.append), calls


def L(tx: int, op: int = 0) -> LogOffset:
    return LogOffset(tx, op)


# --------------------------------------------------------------------- LogOffset


def test_log_offset_orders_lexicographically_and_helpers():
    assert L(1, 9) < L(2, 0) < L(2, 1)
    assert LogOffset.before_tx(10) == L(9, 0)
    assert LogOffset.before_all() < L(0, 0)
    assert max(L(3, 1), L(3, 0)) == L(3, 1)


# ------------------------------------------------------------- seed's scenarios


def test_single_writer_flush_catches_up_notifies_tx_offset():
    t, calls = make_tracker()
    t.handle_transaction(L(10, 3), ["a"], now=0)
    assert not t.empty()
    assert t.pending() == {"a": (L(10, 3), L(9, 0))}
    assert calls == []

    t.handle_flush_notification("a", L(10, 3), now=1)
    assert t.empty()
    assert t.last_global_flushed == L(10, 3)
    assert calls == [10]


def test_partial_flushes_lag_one_transaction():
    t, calls = make_tracker()
    t.handle_transaction(L(10, 5), ["a"], now=0)
    t.handle_transaction(L(20, 5), ["a"], now=0)
    assert t.pending() == {"a": (L(20, 5), L(9, 0))}

    # Part way into tx 10: nothing complete beyond tx 9 yet.
    t.handle_flush_notification("a", L(10, 2), now=1)
    assert t.last_global_flushed == L(10, 2)
    assert calls == [9]

    # Finished tx 10 and part of tx 20: reported as tx 20 - 1.
    t.handle_flush_notification("a", L(20, 1), now=2)
    assert t.last_global_flushed == L(20, 1)
    assert calls == [9, 19]

    t.handle_flush_notification("a", L(20, 5), now=3)
    assert t.empty()
    assert calls == [9, 19, 20]


def test_several_writers_at_same_incomplete_position():
    t, calls = make_tracker()
    t.handle_transaction(L(10, 4), ["a", "b", "c"], now=0)
    t.handle_transaction(L(20, 4), ["a", "b", "c"], now=0)
    t.handle_flush_notification("a", L(20, 1), now=1)
    t.handle_flush_notification("b", L(20, 1), now=1)
    # c has not reported: everyone is still bounded by c's start (9, 0).
    assert t.last_global_flushed == L(9, 0)
    assert calls == [8]
    t.handle_flush_notification("c", L(20, 1), now=1)
    assert t.last_global_flushed == L(20, 1)
    assert calls == [8, 19]

    # Two of three catch up; the third still holds the global offset.
    t.handle_flush_notification("a", L(20, 4), now=2)
    t.handle_flush_notification("b", L(20, 4), now=2)
    assert set(t.pending()) == {"c"}
    assert t.last_global_flushed == L(20, 1)
    assert calls == [8, 19]

    t.handle_flush_notification("c", L(20, 4), now=3)
    assert t.empty()
    assert calls == [8, 19, 20]


def test_new_writer_starts_flushed_just_before_its_transaction():
    t, calls = make_tracker()
    t.handle_transaction(L(10, 2), ["a"], now=0)
    t.handle_transaction(L(20, 2), ["a", "b"], now=0)
    assert t.pending() == {"a": (L(20, 2), L(9, 0)), "b": (L(20, 2), L(19, 0))}

    # a finishes everything; b (which never saw tx 10) bounds the global offset.
    t.handle_flush_notification("a", L(20, 2), now=1)
    assert t.last_global_flushed == L(19, 0)
    assert calls == [18]
    t.handle_flush_notification("b", L(20, 2), now=1)
    assert calls == [18, 20]


def test_existing_writer_last_sent_follows_latest_transaction():
    t, _ = make_tracker()
    t.handle_transaction(L(10, 1), ["a"], now=0)
    t.handle_transaction(L(11, 7), ["a"], now=0)
    assert t.pending() == {"a": (L(11, 7), L(9, 0))}
    assert t.last_seen == L(11, 7)
    # Flushing the old last_sent is no longer enough to catch up.
    t.handle_flush_notification("a", L(10, 1), now=1)
    assert t.pending() == {"a": (L(11, 7), L(10, 1))}


def test_continuous_load_keeps_advancing():
    """Every writer gets every tx and flushes the previous one; the LSN keeps moving."""
    t, calls = make_tracker()
    writers = ["a", "b", "c"]
    previous: LogOffset | None = None
    last_global = t.last_global_flushed
    for i in range(1, 201):
        tx = L(i * 10, 3)
        t.handle_transaction(tx, writers, now=i)
        if previous is not None:
            for w in writers:
                t.handle_flush_notification(w, previous, now=i)
            # Never backwards, never past what every writer flushed.
            true_min = min(flushed for _, flushed in t.pending().values())
            assert last_global <= t.last_global_flushed <= true_min
            last_global = t.last_global_flushed
            # The previous tx is complete everywhere, but the report lags by one.
            assert calls[-1] == previous.tx_offset - 1
        previous = tx
    assert len(calls) >= 190
    assert calls == sorted(set(calls))
    assert not t.empty()
    for w in writers:
        t.handle_flush_notification(w, previous, now=999)
    assert t.empty()
    assert calls[-1] == 2000


def test_transaction_touching_no_writer_flushes_at_once():
    t, calls = make_tracker()
    t.handle_transaction(L(10, 0), [], now=0)
    assert t.empty()
    assert t.last_global_flushed == L(10, 0)
    assert calls == [10]
    t.handle_transaction(L(11, 0), [], now=0)
    assert calls == [10, 11]


def test_transaction_touching_no_writer_waits_for_pending_writers():
    t, calls = make_tracker()
    t.handle_transaction(L(10, 2), ["a"], now=0)
    t.handle_transaction(L(20, 0), [], now=0)  # touches nobody, but a is pending
    assert calls == []
    assert t.last_global_flushed == LogOffset.before_all()
    assert t.last_seen == L(20, 0)

    t.handle_flush_notification("a", L(10, 1), now=1)
    assert calls == [9]
    t.handle_flush_notification("a", L(10, 2), now=1)
    # Once a catches up, the empty tx 20 is flushed too.
    assert calls == [9, 20]
    assert t.last_global_flushed == L(20, 0)


def test_removing_dead_writer_releases_global_offset():
    t, calls = make_tracker()
    t.handle_transaction(L(10, 1), ["a", "dead"], now=0)
    t.handle_transaction(L(20, 1), ["a"], now=0)
    t.handle_flush_notification("a", L(20, 1), now=1)
    assert set(t.pending()) == {"dead"}
    assert calls == [8]  # dead holds the LSN at (9, 0) -> 8

    t.handle_shape_removed("dead")
    assert t.empty()
    assert calls == [8, 20]

    t.handle_shape_removed("dead")  # unknown now: no-op
    t.handle_shape_removed("never-seen")
    assert calls == [8, 20]


def test_removing_lowest_writer_moves_to_next_lowest():
    t, calls = make_tracker()
    t.handle_transaction(L(10, 1), ["a", "b"], now=0)
    t.handle_transaction(L(20, 1), ["a", "b"], now=0)
    t.handle_flush_notification("b", L(20, 0), now=1)
    assert calls == [8]
    t.handle_shape_removed("a")
    assert t.last_global_flushed == L(20, 0)
    assert calls == [8, 19]


def test_flush_from_unknown_writer_is_ignored():
    t, calls = make_tracker()
    t.handle_transaction(L(10, 1), ["a"], now=0)
    t.handle_flush_notification("ghost", L(10, 1), now=1)
    assert t.pending() == {"a": (L(10, 1), L(9, 0))}
    assert calls == []
    # A writer that already caught up is unknown too.
    t.handle_flush_notification("a", L(10, 1), now=1)
    t.handle_flush_notification("a", L(10, 1), now=2)
    assert calls == [10]


def test_older_flush_does_not_move_writer_backwards():
    t, calls = make_tracker()
    t.handle_transaction(L(10, 5), ["a"], now=0)
    t.handle_transaction(L(20, 5), ["a"], now=0)
    t.handle_flush_notification("a", L(20, 2), now=1)
    t.handle_flush_notification("a", L(10, 3), now=2)
    assert t.pending() == {"a": (L(20, 5), L(20, 2))}
    assert t.last_global_flushed == L(20, 2)
    assert calls == [19]


def test_notify_never_repeats_or_goes_down():
    t, calls = make_tracker()
    t.handle_transaction(L(10, 5), ["a", "b"], now=0)
    t.handle_transaction(L(20, 5), ["a", "b"], now=0)
    t.handle_flush_notification("a", L(20, 1), now=1)
    t.handle_flush_notification("b", L(20, 1), now=1)
    assert calls == [8, 19]
    # Same tx, further ops: global offset moves, LSN does not -> no call.
    t.handle_flush_notification("a", L(20, 3), now=2)
    t.handle_flush_notification("b", L(20, 2), now=2)
    assert t.last_global_flushed == L(20, 2)
    assert calls == [8, 19]
    t.handle_flush_notification("a", L(20, 5), now=3)
    t.handle_flush_notification("b", L(20, 5), now=3)
    assert calls == [8, 19, 20]
    # New writer c enters at (20, 0), below the global (20, 5): the global offset
    # stays put and neither 19 (lower) nor 20 (same) is notified again.
    t.handle_transaction(L(21, 5), ["c"], now=4)
    t.handle_flush_notification("c", L(20, 3), now=5)
    assert t.last_global_flushed == L(20, 5)
    t.handle_flush_notification("c", L(21, 2), now=6)
    assert t.last_global_flushed == L(21, 2)
    assert calls == [8, 19, 20]
    t.handle_flush_notification("c", L(21, 5), now=7)
    assert calls == [8, 19, 20, 21]


def test_notify_that_raises_is_offered_again():
    calls: list[int] = []
    fail = [True]

    def notify(lsn: int) -> None:
        if fail[0]:
            fail[0] = False
            raise RuntimeError("connection lost")
        calls.append(lsn)

    t = FlushTracker(notify)
    t.handle_transaction(L(10, 1), ["a"], now=0)
    with pytest.raises(RuntimeError):
        t.handle_flush_notification("a", L(10, 1), now=1)
    assert t.empty() and t.last_notified_lsn is None
    t.handle_transaction(L(11, 0), [], now=2)
    assert calls == [11]
    assert t.last_notified_lsn == 11


def test_transaction_before_last_seen_is_rejected():
    t, _ = make_tracker()
    t.handle_transaction(L(10, 1), ["a"], now=0)
    with pytest.raises(ValueError):
        t.handle_transaction(L(9, 9), ["a"], now=0)
    assert t.last_seen == L(10, 1)


def test_heap_stays_bounded_while_one_writer_is_stuck():
    t, calls = make_tracker()
    t.handle_transaction(L(1, 0), ["stuck"], now=0)
    for i in range(2, 5000):
        t.handle_transaction(L(i, 1), ["busy"], now=0)
        t.handle_flush_notification("busy", L(i, 0), now=0)
        t.handle_flush_notification("busy", L(i, 1), now=0)
    assert set(t.pending()) == {"stuck"}
    assert len(t._heap) < 200  # stale entries get compacted
    assert calls == []
    t.handle_flush_notification("stuck", L(1, 0), now=0)
    assert calls == [4999]


# ------------------------------------------------------------- stall detection


def test_new_transaction_is_not_flush_progress():
    t, _ = make_tracker()
    t.handle_transaction(L(10, 1), ["a"], now=100.0)
    t.handle_transaction(L(20, 1), ["a"], now=150.0)
    t.handle_transaction(L(30, 1), ["a", "b"], now=155.0)
    assert t.stalled_writers(now=159.0, grace=30.0) == ["a"]
    assert t.stalled_writers(now=190.0, grace=30.0) == ["a", "b"]
    assert t.stalled_writers(now=130.0, grace=30.0) == []  # exactly grace: not yet


def test_flush_progress_resets_stall_clock():
    t, _ = make_tracker()
    t.handle_transaction(L(10, 3), ["a"], now=0.0)
    assert t.stalled_writers(now=50.0, grace=30.0) == ["a"]
    t.handle_flush_notification("a", L(10, 1), now=50.0)
    assert t.stalled_writers(now=60.0, grace=30.0) == []
    # A report that is not progress does not reset the clock.
    t.handle_flush_notification("a", L(10, 1), now=75.0)
    t.handle_flush_notification("a", L(10, 0), now=75.0)
    assert t.stalled_writers(now=81.0, grace=30.0) == ["a"]


def test_touch_resets_stall_clock_and_ignores_unknown():
    t, _ = make_tracker()
    t.handle_transaction(L(10, 3), ["a", "b"], now=0.0)
    t.touch("a", now=40.0)
    t.touch("ghost", now=40.0)
    assert t.stalled_writers(now=45.0, grace=30.0) == ["b"]
    assert "ghost" not in t.pending()


def test_caught_up_writers_are_not_stalled():
    t, _ = make_tracker()
    t.handle_transaction(L(10, 3), ["a", "b"], now=0.0)
    t.handle_flush_notification("a", L(10, 3), now=1.0)
    assert t.stalled_writers(now=1000.0, grace=30.0) == ["b"]
    t.handle_shape_removed("b")
    assert t.stalled_writers(now=1000.0, grace=30.0) == []
    # Becoming pending again starts a fresh clock.
    t.handle_transaction(L(20, 0), ["a"], now=990.0)
    assert t.stalled_writers(now=1000.0, grace=30.0) == []


def test_stall_clock_runs_on_the_time_the_caller_passes():
    t, _ = make_tracker()
    t.handle_transaction(L(10, 3), ["a"], now=0.0)
    t.handle_flush_notification("a", L(10, 1), now=1.0)
    assert t.stalled_writers(now=float("inf"), grace=0.0) == ["a"]


# ------------------------------------------------------------ writer alignment


def test_alignment_flush_at_boundary_reports_transaction_end():
    al = WriterAlignment.by_log_offset()
    al.record(L(10, 2), L(10, 9))  # writer saw up to op 2 of a 10-op tx
    al.record(L(20, 4), L(20, 5))
    assert al.aligned(L(10, 2)) == L(10, 9)
    assert len(al) == 1


def test_alignment_mid_transaction_reports_flushed_itself():
    al = WriterAlignment.by_log_offset()
    assert al.aligned(L(5, 0)) == L(5, 0)
    al.record(L(10, 2), L(10, 9))
    al.record(L(20, 4), L(20, 5))
    assert al.aligned(L(10, 1)) == L(10, 1)
    assert al.aligned(L(20, 1)) == L(20, 1)  # passed (10, 2), ended inside tx 20
    assert len(al) == 1
    assert al.aligned(L(20, 4)) == L(20, 5)
    assert len(al) == 0


def test_alignment_with_kafka_positions():
    al: WriterAlignment[int] = WriterAlignment()
    assert al.aligned(0) is None
    al.record(3, L(10, 9))
    al.record(7, L(20, 5))
    al.record(8, L(30, 0))
    assert al.aligned(2) is None  # nothing complete yet
    assert al.aligned(3) == L(10, 9)
    assert al.aligned(5) == L(10, 9)  # part way into tx 20: last complete tx
    assert al.aligned(8) == L(30, 0)
    assert al.aligned(100) == L(30, 0)
    assert len(al) == 0


def test_alignment_never_goes_backwards_and_merges_same_position():
    al: WriterAlignment[int] = WriterAlignment()
    al.record(3, L(10, 9))
    al.record(3, L(11, 0))  # nothing new written for tx 11: same position
    assert len(al) == 1
    assert al.aligned(3) == L(11, 0)
    assert al.aligned(1) == L(11, 0)
    assert al.last_reported == L(11, 0)


def test_alignment_rejects_out_of_order_records():
    al: WriterAlignment[int] = WriterAlignment()
    al.record(5, L(10, 0))
    with pytest.raises(ValueError):
        al.record(4, L(11, 0))
    with pytest.raises(ValueError):
        al.record(6, L(9, 0))


def test_alignment_feeds_tracker_until_caught_up():
    t, calls = make_tracker()
    al: WriterAlignment[int] = WriterAlignment()
    # tx 10 sends Kafka offsets 0..1, tx 20 sends 2..4.
    t.handle_transaction(L(10, 6), ["p0"], now=0)
    al.record(1, L(10, 6))
    t.handle_transaction(L(20, 6), ["p0"], now=0)
    al.record(4, L(20, 6))
    t.handle_flush_notification("p0", al.aligned(1), now=1)
    assert calls == [9]
    assert t.pending() == {"p0": (L(20, 6), L(10, 6))}
    t.handle_flush_notification("p0", al.aligned(4), now=1)
    assert t.empty() and calls == [9, 20]


# ------------------------------------------------- randomized property vs model


class _ModelWriter:
    def __init__(self, name: str, op_level: bool) -> None:
        self.name = name
        self.ops: list[LogOffset] = []  # Kafka position -> op offset
        self.flushed = -1  # highest flushed Kafka position
        self.alignment: WriterAlignment[int] = WriterAlignment(
            (lambda pos: self.ops[pos]) if op_level else None
        )

    def safe_lsn(self) -> int | None:
        """Highest LSN whose transactions this writer fully flushed, None if caught up."""
        if self.flushed + 1 >= len(self.ops):
            return None
        return self.ops[self.flushed + 1].tx_offset - 1


@pytest.mark.parametrize("op_level", [True, False], ids=["op-offsets", "kafka-offsets"])
@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_randomized_against_brute_force_model(seed: int, op_level: bool):
    rng = random.Random(seed)
    calls: list[int] = []
    t = FlushTracker(calls.append)
    writers: dict[str, _ModelWriter] = {}
    next_name = 0
    tx_offset = 100
    last_tx: int | None = None

    def new_writer() -> _ModelWriter:
        nonlocal next_name
        w = _ModelWriter(f"w{next_name}", op_level)
        next_name += 1
        writers[w.name] = w
        return w

    for _ in range(4):
        new_writer()

    def check() -> None:
        assert calls == sorted(set(calls)), "notify repeated or went down"
        bounds = [b for w in writers.values() if (b := w.safe_lsn()) is not None]
        if calls:
            true_bound = min(bounds) if bounds else last_tx
            assert calls[-1] <= true_bound
        if not bounds and last_tx is not None:
            assert calls and calls[-1] == last_tx
            assert t.empty()
        assert t.last_global_flushed <= t.last_seen
        assert set(t.pending()) == {
            w.name for w in writers.values() if w.safe_lsn() is not None
        }

    for _ in range(3000):
        action = rng.random()
        if action < 0.45:
            tx_offset += rng.randint(1, 40)
            n_ops = rng.choice([0, 1, 2, 3, 5, 8])
            live = list(writers.values())
            touched: dict[str, _ModelWriter] = {}
            for op in range(n_ops):
                w = rng.choice(live)
                w.ops.append(L(tx_offset, op))
                touched[w.name] = w
            last = L(tx_offset, max(n_ops - 1, 0))
            for w in touched.values():
                w.alignment.record(len(w.ops) - 1, last)
            t.handle_transaction(last, list(touched), now=0)
            last_tx = tx_offset
        elif action < 0.9:
            candidates = [w for w in writers.values() if w.flushed + 1 < len(w.ops)]
            if not candidates:
                continue
            w = rng.choice(candidates)
            w.flushed = rng.randint(w.flushed + 1, len(w.ops) - 1)
            report = w.alignment.aligned(w.flushed)
            if report is not None:
                t.handle_flush_notification(w.name, report, now=0)
                if rng.random() < 0.2:  # duplicate / late delivery
                    t.handle_flush_notification(w.name, report, now=0)
        elif action < 0.93:
            t.handle_flush_notification("ghost", L(tx_offset + 1000, 0), now=0)
        elif action < 0.96 and len(writers) > 1:
            gone = rng.choice(list(writers))
            del writers[gone]
            t.handle_shape_removed(gone)
        else:
            new_writer()
        check()

    # Drain: every writer flushes everything -> LSN reaches the last transaction.
    for w in list(writers.values()):
        if w.ops:
            w.flushed = len(w.ops) - 1
            report = w.alignment.aligned(w.flushed)
            t.handle_flush_notification(w.name, report, now=0)
        check()
    assert t.empty()
    assert last_tx is not None and calls[-1] == last_tx
    assert t.last_global_flushed == t.last_seen
    assert len(calls) > 50
