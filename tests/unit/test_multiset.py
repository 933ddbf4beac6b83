"""Which equal row a keyless removal takes (spark_consumer.multiset, pure)."""

from __future__ import annotations

from spark_consumer.multiset import Candidate, Taker, pair


def streamed(lsn):
    return (lsn, 0, True)


def reread(lsn):
    return (lsn, 0, False)


def test_a_removal_takes_the_newest_older_equal_row():
    rows = [Candidate("pre", "v", streamed(1)), Candidate("re-read", "v", reread(5)),
            Candidate("later", "v", streamed(20))]
    assert pair([Taker("r", "v", streamed(10))], rows) == {"r": rows[1]}


def test_each_row_is_taken_once_and_oldest_removals_choose_first():
    rows = [Candidate(i, "v", streamed(lsn)) for i, lsn in enumerate((7, 12))]
    # The removal at 5 finds nothing older; the one at 10 takes 7 (not left waiting).
    assert pair([Taker("r5", "v", streamed(5)), Taker("r10", "v", streamed(10))], rows) == {"r10": rows[0]}
    rows = [Candidate(i, "v", streamed(lsn)) for i, lsn in enumerate((3, 7, 8))]
    got = pair([Taker("r5", "v", streamed(5)), Taker("r10", "v", streamed(10))], rows)
    assert got == {"r5": rows[0], "r10": rows[2]}


def test_only_equal_rows_are_taken():
    assert pair([Taker("r", "v", streamed(10))], [Candidate("w", "w", streamed(1))]) == {}


def test_a_kept_take_moves_only_to_a_newer_reread_copy_older_than_the_removal():
    kept = Taker("r", "v", streamed(10), took=streamed(1))
    assert pair([kept], [Candidate("a", "v", streamed(5))]) == {}  # a streamed append is another row
    assert pair([kept], [Candidate("b", "v", reread(12), reread=True)]) == {}  # re-read after it: survived
    b = Candidate("b", "v", reread(5), reread=True)
    assert pair([kept], [b]) == {"r": b}
    assert pair([Taker("r", "v", streamed(10), took=reread(5))], [Candidate("b2", "v", reread(5), (0, 9), True)]) == {}


def test_ties_break_by_order():
    rows = [Candidate("x", "v", reread(5), (0, 1), True), Candidate("y", "v", reread(5), (0, 2), True)]
    assert pair([Taker("r", "v", streamed(10))], rows) == {"r": rows[1]}
