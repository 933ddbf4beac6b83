"""spark_consumer.checkpoint: which committed batch the target lacks, and the
un-commit that makes Spark replay it (on a checkpoint laid out as Spark's)."""

import json

import pytest

from spark_consumer.apply_plan import Progress
from spark_consumer.checkpoint import batch_applied, newest_moved, replay_unapplied

META = '{"batchWatermarkMs":0,"batchTimestampMs":1795361932090,"conf":{}}'


def write_batches(checkpoint, offsets: list[dict], committed: int):
    """``offsets[i]``: the source offsets of batch i; batches 0..committed have commits."""
    (checkpoint / "offsets").mkdir(parents=True)
    (checkpoint / "commits").mkdir()
    for i, off in enumerate(offsets):
        (checkpoint / "offsets" / str(i)).write_text(f"v1\n{META}\n{json.dumps(off)}")
        (checkpoint / "offsets" / f".{i}.crc").write_bytes(b"crc")
    for i in range(committed + 1):
        (checkpoint / "commits" / str(i)).write_text('v1\n{"nextBatchWatermarkMs":0}')
        (checkpoint / "commits" / f".{i}.crc").write_bytes(b"crc")


def names(d):
    return sorted(p.name for p in d.iterdir())


@pytest.mark.parametrize("start,end,progress,applied", [
    # progress inside the range on every partition that moved
    ({"0": 10, "1": 5}, {"0": 20, "1": 5}, {0: 20, 1: 5}, True),
    ({"0": 10, "1": 5}, {"0": 20, "1": 9}, {0: 20, 1: 9}, True),
    ({"0": 10, "1": 5}, {"0": 20, "1": 9}, {0: 15, 1: 6}, True),  # offsets without rows at the end
    # not applied: progress still at the batch's start on a moved partition
    ({"0": 10, "1": 5}, {"0": 20, "1": 9}, {0: 10, 1: 5}, False),
    ({"0": 10, "1": 5}, {"0": 20, "1": 9}, {0: 20, 1: 5}, False),
    ({"0": 10}, {"0": 20}, {}, False),  # no progress row at all
    # progress beyond the batch's end: offsets were reset; replay (apply decides by position)
    ({"0": 10}, {"0": 20}, {0: 500}, False),
    # the first batch (no start): from offset 0
    (None, {"0": 3, "1": 0}, {0: 3}, True),
    (None, {"0": 3, "1": 0}, {}, False),
    # nothing moved: nothing to apply
    ({"0": 10}, {"0": 10}, {}, True),
    # a recreated topic, an unreadable entry
    ({"0": 10, "topic_id": "a"}, {"0": 20, "topic_id": "b"}, {0: 20}, False),
    ({"0": 10}, None, {0: 20}, False),
    # the topic ids themselves are not partitions
    ({"0": 10, "topic_id": "a"}, {"0": 20, "topic_id": "a"}, {0: 20}, True),
])
def test_batch_applied(start, end, progress, applied):
    assert batch_applied(start, end, progress) is applied


def test_applied_newest_batch_leaves_the_checkpoint_alone(tmp_path):
    write_batches(tmp_path, [{"0": 5}, {"0": 9}, {"0": 12}], committed=1)
    before = {d: names(tmp_path / d) for d in ("offsets", "commits")}
    assert replay_unapplied(tmp_path, {0: 9}) is None
    assert {d: names(tmp_path / d) for d in ("offsets", "commits")} == before


def test_unapplied_newest_batch_is_uncommitted_with_every_later_offset_entry(tmp_path):
    # Spark committed batch 1 and planned batch 2; the target only has batch 0.
    write_batches(tmp_path, [{"0": 5}, {"0": 9}, {"0": 12}], committed=1)
    assert replay_unapplied(tmp_path, {0: 5}) == 1
    # Spark now re-runs batch 1 over [offsets/0, offsets/1).
    assert names(tmp_path / "commits") == [".0.crc", "0"]
    assert names(tmp_path / "offsets") == [".0.crc", ".1.crc", "0", "1"]
    assert replay_unapplied(tmp_path, {0: 5}) is None  # the newest committed is now batch 0, applied


def test_a_batch_read_as_empty_is_replayed_with_every_batch_after_it(tmp_path):
    # Batch 1 moved partition 0 over [5, 9) but the target never got those
    # offsets (the read handed over nothing): batch 2 then failed with a
    # progress gap. Applied: batch 0, and partition 1 of batch 2.
    write_batches(tmp_path, [{"0": 5, "1": 1}, {"0": 9, "1": 1}, {"0": 12, "1": 4}, {"0": 14, "1": 4}],
                  committed=2)
    assert replay_unapplied(tmp_path, {0: 5, 1: 4}) == 1
    assert names(tmp_path / "commits") == [".0.crc", "0"]
    assert names(tmp_path / "offsets") == [".0.crc", ".1.crc", "0", "1"]  # Spark re-runs 1, plans 2.. anew


def test_the_first_batch_of_an_incarnation_is_replayed_unless_progress_reached_its_end(tmp_path):
    # bench/chaos.py seed 2118098054: two broker wipes 40 s apart, the
    # consumer killed after Spark logged a batch and before its apply, twice.
    # The target's progress (667) is the second incarnation's; batch 4 read
    # [0, 18094) of the third and was never applied: 667 is above its start.
    write_batches(tmp_path, [
        {"0": 0, "topic_id": "b"}, {"0": 667, "topic_id": "b"}, {"0": 17410, "topic_id": "b"},
        {"0": 0, "topic_id": "c"}, {"0": 18094, "topic_id": "c"}, {"0": 18169, "topic_id": "c"}], committed=5)
    assert replay_unapplied(tmp_path, {0: 667}) == 4
    assert names(tmp_path / "commits") == [".0.crc", ".1.crc", ".2.crc", ".3.crc", "0", "1", "2", "3"]


def test_an_applied_first_batch_of_an_incarnation_is_left_alone(tmp_path):
    write_batches(tmp_path, [{"0": 9, "topic_id": "b"}, {"0": 0, "topic_id": "c"}, {"0": 40, "topic_id": "c"},
                             {"0": 50, "topic_id": "c"}], committed=3)
    assert replay_unapplied(tmp_path, {0: 50}) is None


@pytest.mark.parametrize("offsets,progress", [
    # an older batch whose partition moved and was applied later (rows only at its end)
    ([{"0": 5}, {"0": 9}, {"0": 12}], {0: 12}),
    # an older batch of an earlier topic incarnation: its offsets mean nothing now
    ([{"0": 5, "topic_id": "a"}, {"0": 9, "topic_id": "a"}, {"0": 3, "topic_id": "b"}, {"0": 5, "topic_id": "b"}],
     {0: 5}),
])
def test_older_batches_the_target_holds_are_left_alone(tmp_path, offsets, progress):
    write_batches(tmp_path, offsets, committed=len(offsets) - 1)
    assert replay_unapplied(tmp_path, progress) is None
    assert len(names(tmp_path / "commits")) == 2 * len(offsets)


def test_a_purged_older_batch_is_passed_over(tmp_path):
    # Spark keeps a bounded log: batch 0's offsets are gone, so batch 1's range is unknown.
    write_batches(tmp_path, [{"0": 5}, {"0": 9}, {"0": 12}, {"0": 15}], committed=3)
    for name in ("0", ".0.crc"):
        (tmp_path / "offsets" / name).unlink()
    # The target lacks everything from 5: batch 1 cannot be judged, batch 2 can.
    assert replay_unapplied(tmp_path, {0: 5}) == 2


def test_unapplied_first_batch(tmp_path):
    write_batches(tmp_path, [{"0": 5, "1": 2}], committed=0)
    assert replay_unapplied(tmp_path, {}) == 0
    assert names(tmp_path / "commits") == []
    assert names(tmp_path / "offsets") == [".0.crc", "0"]


def test_unreadable_entry_counts_as_unapplied(tmp_path):
    write_batches(tmp_path, [{"0": 5}, {"0": 9}], committed=1)
    (tmp_path / "offsets" / "0").write_text("garbage")
    assert replay_unapplied(tmp_path, {0: 9}) == 1


def test_empty_or_missing_checkpoint(tmp_path):
    assert replay_unapplied(tmp_path / "missing", {}) is None
    write_batches(tmp_path, [{"0": 5}], committed=-1)  # planned, never committed: Spark re-runs it anyway
    assert replay_unapplied(tmp_path, {}) is None
    assert names(tmp_path / "offsets") == [".0.crc", "0"]


def test_newest_moved_names_the_partitions_the_newest_batch_moved_and_its_topic_id(tmp_path):
    write_batches(tmp_path, [{"0": 5, "1": 3, "topic_id": "a"}, {"0": 9, "1": 3, "2": 4, "topic_id": "a"}],
                  committed=1)
    # partition 1 did not move in batch 1 (its commit was batch 0's); 2 moved from 0
    assert newest_moved(tmp_path, {0: 9, 1: 3, 2: 4}) == ("a", {0: 9, 2: 4})
    assert newest_moved(tmp_path, {0: 7, 1: 3, 2: 4}) == ("a", {0: 7, 2: 4})  # offsets without rows at the end
    assert newest_moved(tmp_path, {0: 5, 1: 3}) == ("a", {})  # not applied: nothing to commit


def test_newest_moved_says_nothing_across_a_recreated_topic_or_without_batches(tmp_path):
    write_batches(tmp_path / "recreated", [{"0": 5, "topic_id": "a"}, {"0": 2, "topic_id": "b"}], committed=1)
    assert newest_moved(tmp_path / "recreated", {0: 2}) == (None, {})
    (tmp_path / "empty").mkdir()
    assert newest_moved(tmp_path / "empty", {0: 2}) == (None, {})


def test_progress_of_another_incarnation_reads_as_nothing_applied():
    prog = Progress(667, (10, 0), (5, 0), "old")
    assert prog.for_incarnation("old") is prog and prog.for_incarnation(None) is prog
    assert Progress(667).for_incarnation("new").next_offset == 667  # not recorded: taken as is
    assert prog.for_incarnation("new") == Progress(0, (10, 0), (5, 0), "old")  # positions and floor hold
