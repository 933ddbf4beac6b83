"""The one query over every shape (``[consumer] queries = "one"``), its pure
parts: a batch split per shape and decoded per shape, the many-topic source's
offsets (topics joining, rejoining, bundled), and the checkpoint reasoning
over many topics (issue 17)."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

from schemas import wire
from schemas.config import parse_config
from spark_consumer import batch_split, topics_source
from spark_consumer.apply_plan import Progress
from spark_consumer.batch_split import (
    decode_shapes,
    new_schema_reason,
    split_by_topic,
    starting_offsets,
    tables_by_topic,
)
from spark_consumer.checkpoint import (
    topics_ahead_of_target,
    topics_batch_topic_ids,
    topics_newest_moved,
    topics_newest_topic_ids,
    topics_replay_unapplied,
)
from spark_consumer.kafka_source import (
    RAW_ARROW_SCHEMA,
    OffsetRange,
    OffsetRanges,
    PartitionEnds,
    ProbeClients,
    SourceOptions,
    fair_shares,
    offsets_from_json,
)
from spark_consumer.topics_source import (
    JOINED,
    TopicsStreamReader,
    options_from_spark,
    options_to_spark,
    read_ranges,
    share_read_limit,
    topic_options,
)
from tests.unit.test_checkpoint import names, write_batches
from tests.unit.test_spark_decode import FakeEnds

A, B, C, D = "wb.public.a", "wb.public.b", "wb.public.c", "wb.public.d"


def raw(rows: list[tuple[str, int, int]]) -> pa.RecordBatch:
    """A raw record batch of (topic, partition, offset) rows."""
    n = len(rows)
    return pa.RecordBatch.from_arrays([
        pa.array([r[0] for r in rows], pa.string()), pa.array([r[1] for r in rows], pa.int32()),
        pa.array([r[2] for r in rows], pa.int64()), pa.array([b"k"] * n, pa.binary()),
        pa.array([b"v"] * n, pa.binary()), pa.array([[]] * n, RAW_ARROW_SCHEMA.field(5).type)],
        schema=RAW_ARROW_SCHEMA)


def rows_of(batches) -> list[tuple]:
    return [(t, p, o) for b in batches for t, p, o in zip(*(b.column(i).to_pylist() for i in range(3)))]


# -- a batch split per shape

def test_split_keeps_every_row_once_in_its_topic_in_input_order():
    batches = [raw([(A, 0, 1), (B, 0, 7), (A, 1, 2), (A, 0, 2)]), raw([(B, 0, 8)]), raw([(C, 3, 0), (A, 0, 3)])]
    split = split_by_topic(batches)
    assert list(split) == [A, B, C]
    assert rows_of(split[A]) == [(A, 0, 1), (A, 1, 2), (A, 0, 2), (A, 0, 3)]
    assert rows_of(split[B]) == [(B, 0, 7), (B, 0, 8)]
    assert rows_of(split[C]) == [(C, 3, 0)]
    assert sum(len(rows_of(v)) for v in split.values()) == 7


def test_decode_shapes_decodes_each_topic_with_its_own_shape_and_leaves_out_the_others(monkeypatch):
    seen = {}

    def fake_decode(opts, schemas, mark, batches):  # echoes the rows, tagged with the shape it was given
        batches = list(batches)
        seen[opts.topic] = (schemas, mark)
        for b in batches:
            yield pa.RecordBatch.from_pydict({"_wb_topic": b.column(0), "_wb_offset": b.column(2),
                                              "shape": [schemas] * b.num_rows})
        yield pa.RecordBatch.from_pydict({"_wb_topic": pa.array([], pa.string()),
                                          "_wb_offset": pa.array([], pa.int64()), "shape": pa.array([], pa.string())})

    monkeypatch.setattr(batch_split, "decode_batches", fake_decode)
    shapes = {A: (SourceOptions(A, "unused:9092"), "shape-a"), B: (SourceOptions(B, "unused:9092"), "shape-b")}
    out = list(decode_shapes(shapes, iter([raw([(A, 0, 1), (C, 0, 5), (B, 1, 4)]), raw([(A, 0, 2)])])))
    tables = tables_by_topic(pa.Table.from_batches(out))
    assert set(tables) == {A, B}  # C is no shape of this query: left out, not applied
    assert tables[A].column("_wb_offset").to_pylist() == [1, 2]
    assert set(tables[A].column("shape").to_pylist()) == {"shape-a"}
    assert tables[B].column("shape").to_pylist() == ["shape-b"]
    assert seen == {A: ("shape-a", True), B: ("shape-b", True)}  # new writer schemas are marked
    assert list(decode_shapes(shapes, iter([raw([(C, 0, 1)])]))) == []


def test_parts_of_several_tasks_are_concatenated_in_task_order():
    def blob(offsets):
        return batch_split.to_ipc([pa.RecordBatch.from_pydict({"_wb_offset": pa.array(offsets, pa.int64())})])

    decoded = pa.Table.from_pydict({"_wb_topic": [A, B, A], "_wb_arrow": [blob([1, 2]), blob([9]), blob([3])]},
                                   schema=batch_split.DECODED_ARROW_SCHEMA)
    tables = tables_by_topic(decoded)
    assert tables[A].column("_wb_offset").to_pylist() == [1, 2, 3]
    assert tables[B].column("_wb_offset").to_pylist() == [9]


def test_new_schema_reason_names_the_mark():
    t = pa.table({"_wb_control": [None, wire.NEW_SCHEMA_CONTROL], "_wb_error": [None, "value schema fp:1"]})
    assert new_schema_reason(t) == "value schema fp:1"
    assert new_schema_reason(t.slice(0, 1)) is None


def test_topics_start_at_the_targets_progress():
    progress = {(A, 0): Progress(10, None, None), (A, 1): Progress(4, None, None), (B, 0): Progress(3, None, None)}
    assert starting_offsets(progress, [A, C]) == {A: {"0": 10, "1": 4}}
    # With the incarnation the offsets count in; partitions that disagree: from the earliest.
    progress = {(A, 0): Progress(10, topic_id="ia"), (A, 1): Progress(4), (B, 0): Progress(3, topic_id="ib1"),
                (B, 1): Progress(5, topic_id="ib2")}
    assert starting_offsets(progress, [A, B]) == {A: {"0": 10, "1": 4, "topic_id": "ia"}}


# -- the many-topic source

def _reader(ends: dict[str, dict[int, int]], starting=None, rejoin=None, max_per_task=None) -> TopicsStreamReader:
    common = SourceOptions(A, "unused:9092", topic_prefix="wb", max_offsets_per_task=max_per_task)
    r = TopicsStreamReader(topic_options(common, list(ends), starting), rejoin)
    for t, reader in r._each().items():
        reader._ends = FakeEnds({p: 0 for p in ends[t]}, ends[t], topic_id=f"id-{t}")
    r._clients.prefetch = lambda topics: None  # no broker: each topic's fake probe answers
    r._clients.probe_ends = lambda ends: None
    return r


def test_options_round_trip():
    common = SourceOptions(A, "broker:9092", topic_prefix="wb", max_offsets_per_trigger=100, on_data_loss="follow")
    opts, rejoin = options_from_spark(options_to_spark(common, [A, B], {B: {"0": 5}}, [B]))
    assert list(opts) == [A, B] and rejoin == {B}
    assert opts[A].starting_offsets == "earliest" and json.loads(opts[B].starting_offsets) == {"0": 5}
    assert opts[B].topic == B and opts[B].max_offsets_per_trigger == 100 and opts[B].on_data_loss == "follow"
    with pytest.raises(ValueError, match="names no topic"):
        options_from_spark({"bootstrap_servers": "b:1", "topics": "[]"})


def test_offsets_are_per_topic_each_with_its_id_and_small_batches_are_one_task():
    r = _reader({A: {0: 10, 1: 5}, B: {0: 3}})
    start = r.initialOffset()
    assert start == {A: {"0": 0, "1": 0, "topic_id": f"id-{A}"}, B: {"0": 0, "topic_id": f"id-{B}"}}
    end = r.latestOffset(start, ReadAllAvailable())
    assert end == {A: {"0": 10, "1": 5, "topic_id": f"id-{A}"}, B: {"0": 3, "topic_id": f"id-{B}"}}
    [task] = r.partitions(start, end)
    assert task == OffsetRanges((OffsetRange(A, 0, 0, 10, f"id-{A}"), OffsetRange(A, 1, 0, 5, f"id-{A}"),
                                 OffsetRange(B, 0, 0, 3, f"id-{B}")))
    # the limit is the batch's, shared fairly: B wants 3 of 6, A gets the other 3 (by backlog 2 + 1)
    assert r.latestOffset(start, ReadMaxRows(6)) == {A: {"0": 2, "1": 1, "topic_id": f"id-{A}"},
                                                     B: {"0": 3, "topic_id": f"id-{B}"}}
    cut = _reader({A: {0: 10, 1: 5}, B: {0: 3}}, max_per_task=100).partitions(start, end)
    assert [(t.topic, t.partition) for t in cut] == [(A, 0), (A, 1), (B, 0)]  # a per-task cut: no bundling


def test_fair_shares_serve_small_wants_whole_and_split_the_rest_evenly():
    assert fair_shares({"big": 1000, "small": 3, "mid": 40}, 100) == {"small": 3, "mid": 40, "big": 57}
    assert fair_shares({"a": 10, "b": 10}, 15) == {"a": 7, "b": 8}  # the remainder is not left unused
    assert fair_shares({"a": 5}, 100) == {"a": 5}
    assert fair_shares({"a": 50, "b": 50, "c": 50}, 2) == {"a": 0, "b": 1, "c": 1}


def test_a_shared_limit_cuts_only_partitions_read_on_and_keeps_joins_and_new_incarnations():
    start = {A: {"0": 100, "1": 0, "topic_id": "a1"}, B: {"0": 0, "topic_id": "b1"},
             C: {"0": 10, "topic_id": "c1"}}
    end = {A: {"0": 1100, "1": 0, "2": 0, "topic_id": "a1"},  # partition 2 is new: it joins at 0
           B: {"0": 500, "topic_id": "b2"},  # recreated: read from 0 in the new incarnation, not cut
           C: {"0": 14, "topic_id": "c1"}, D: {"0": 7, "topic_id": "d1", JOINED: True}}
    cut = share_read_limit(start, end, 104)
    assert cut[A] == {"0": 200, "1": 0, "2": 0, "topic_id": "a1"} and cut[C] == {"0": 14, "topic_id": "c1"}
    assert cut[B] == end[B] and cut[D] == end[D]
    assert share_read_limit(start, end, 1004) is end  # within the limit: untouched


def test_a_topic_joins_at_its_starting_offsets_with_an_empty_range():
    r = _reader({A: {0: 10}, B: {0: 30}}, starting={B: {"0": 20}})
    start = {A: {"0": 4, "topic_id": f"id-{A}"}}  # the checkpoint knows only A
    end = r.latestOffset(start, ReadAllAvailable())
    assert end[B] == {"0": 20, "topic_id": f"id-{B}", JOINED: True}
    assert [(t.topic, t.start, t.end) for t in r.partitions(start, end)] == [(A, 4, 10)]
    later = r.latestOffset(end, ReadAllAvailable())
    assert later[B] == {"0": 30, "topic_id": f"id-{B}"}
    assert [(t.topic, t.start, t.end) for t in r.partitions(end, later)] == [(B, 20, 30)]
    assert offsets_from_json(end[B]) == {0: 20}  # the mark is no partition


def test_a_topic_told_to_rejoin_is_not_read_from_its_checkpointed_offsets():
    r = _reader({A: {0: 50}, B: {0: 50}}, starting={B: {"0": 7}}, rejoin={B})
    logged_start = {A: {"0": 0, "topic_id": f"id-{A}"}, B: {"0": 20, "topic_id": f"id-{B}"}}
    logged_end = {A: {"0": 10, "topic_id": f"id-{A}"}, B: {"0": 40, "topic_id": f"id-{B}"}}
    # Spark re-runs a logged batch before asking for new offsets: B's range is beyond the target (gap)
    assert [(t.topic, t.start, t.end) for t in r.partitions(logged_start, logged_end)] == [(A, 0, 10)]
    end = r.latestOffset(logged_end, ReadAllAvailable())
    assert end[B] == {"0": 7, "topic_id": f"id-{B}", JOINED: True}
    nxt = r.latestOffset(end, ReadAllAvailable())  # rejoined once, then read on as usual
    assert nxt[B] == {"0": 50, "topic_id": f"id-{B}"}
    assert [(t.topic, t.start, t.end) for t in r.partitions(end, nxt)] == [(B, 7, 50)]


def test_starting_offsets_the_broker_no_longer_holds_follow_or_fail(monkeypatch):
    # The target's progress says 9; the topic (recreated) holds 5 messages.
    with pytest.raises(ValueError, match="outside what the broker holds"):
        _reader({A: {0: 5}}, starting={A: {"0": 9}}).initialOffset()

    class Probed(topics_source.ShapeStreamReader):  # every reader of the source sees that topic
        def _probe(self):
            return FakeEnds({0: 0}, {0: 5}, topic_id="x")

    monkeypatch.setattr(topics_source, "ShapeStreamReader", Probed)
    common = SourceOptions(A, "unused:9092", topic_prefix="wb", on_data_loss="follow")
    r = TopicsStreamReader(topic_options(common, [A], {A: {"0": 9}}))
    r._each()
    r._clients.prefetch = lambda topics: None  # no broker
    r._clients.probe_ends = lambda ends: None
    assert r.initialOffset() == {A: {"0": 0, "topic_id": "x"}}  # from the earliest, applied by position


def test_one_round_of_prefetched_answers_serves_every_topics_probe():
    clients = ProbeClients({"bootstrap.servers": "unused:9092"})
    clients.round_ids = {A: "ia", B: LookupError(f"topic {B} does not exist")}
    clients.round_reported = {A: {0: (0, 5), 1: (2, 2)}}
    a = PartitionEnds(SourceOptions(A, "unused:9092"), clients=clients)
    assert a.topic_id() == "ia" and a.reported() == {0: (0, 5), 1: (2, 2)}
    with pytest.raises(LookupError, match="does not exist"):
        PartitionEnds(SourceOptions(B, "unused:9092"), clients=clients).topic_id()
    clients.end_round()
    assert clients.round_ids is None and clients.round_reported is None


class _Msg:
    def __init__(self, topic, partition, offset):
        self._t, self._p, self._o = topic, partition, offset

    def topic(self):
        return self._t

    def partition(self):
        return self._p

    def offset(self):
        return self._o

    def error(self):
        return None


class _LogsConsumer:
    """Partitions' logs (topic, partition) -> high watermark: a fetch from an
    existing offset answers with that message and the watermark."""

    def __init__(self, hwm):
        self.hwm, self.assigns, self.queue, self.seen = hwm, [], [], {}

    def assign(self, tps):
        self.assigns.append(sorted((tp.topic, tp.partition, tp.offset) for tp in tps))
        self.queue = [_Msg(tp.topic, tp.partition, tp.offset) for tp in tps]

    def unassign(self):
        self.queue = []

    def poll(self, timeout):
        if not self.queue:
            return None
        m = self.queue.pop(0)
        self.seen[(m.topic(), m.partition())] = self.hwm[(m.topic(), m.partition())]
        return m

    def get_watermark_offsets(self, tp, cached=False):
        return 0, self.seen[(tp.topic, tp.partition)]


def test_one_round_probes_every_topics_moved_ends_in_one_assignment():
    # ListOffsets reports each partition's last batch base + 1 (Tansu); the fetch tells the true end
    clients = ProbeClients({"bootstrap.servers": "unused:9092"})
    fake = clients._consumer = _LogsConsumer({(A, 0): 12, (A, 1): 7, (B, 0): 30})
    clients.round_ids = {A: "ia", B: "ib", C: "ic"}
    clients.round_reported = {A: {0: (0, 10), 1: (0, 5), 2: (3, 3)}, B: {0: (0, 28)}, C: {0: (0, 4)}}
    ends = {t: PartitionEnds(SourceOptions(t, "unused:9092"), clients=clients) for t in (A, B, C)}
    ends[C]._probed = {0: (4, 9)}  # C's reported end has not moved since its last probe: no fetch
    clients.probe_ends(ends)
    assert fake.assigns == [[(A, 0, 9), (A, 1, 4), (B, 0, 27)]]  # one assignment for every topic
    assert ends[A].lows_and_ends() == ({0: 0, 1: 0, 2: 3}, {0: 12, 1: 7, 2: 3})
    assert ends[B].lows_and_ends() == ({0: 0}, {0: 30})
    assert ends[C].lows_and_ends() == ({0: 0}, {0: 9})
    assert len(fake.assigns) == 1  # no topic fetched again on its own
    clients.end_round()
    assert clients.round_probed is None
    # the next round: unmoved reports keep their probed ends, nothing is fetched
    clients.round_reported = {A: {0: (0, 10), 1: (0, 5), 2: (3, 3)}, B: {0: (0, 28)}, C: {0: (0, 4)}}
    clients.probe_ends(ends)
    assert len(fake.assigns) == 1 and ends[B].lows_and_ends() == ({0: 0}, {0: 30})


def test_a_partition_the_round_probe_did_not_get_is_probed_by_its_topic():
    clients = ProbeClients({"bootstrap.servers": "unused:9092"})
    fake = clients._consumer = _LogsConsumer({(A, 0): 12})
    clients.round_reported = {A: {0: (0, 10)}}
    clients.round_probed = {}  # the round's probe did not answer for it
    assert PartitionEnds(SourceOptions(A, "unused:9092"), clients=clients).lows_and_ends() == ({0: 0}, {0: 12})
    assert fake.assigns == [[(A, 0, 9)]]


def test_read_ranges_skip_joined_and_foreign_topics():
    start = {A: {"0": 1}, C: {"0": 1}}
    end = {A: {"0": 5}, B: {"0": 3, JOINED: True}, C: {"0": 9}}
    assert list(read_ranges(start, end, [A, B])) == [(A, {"0": 1}, {"0": 5})]
    assert list(read_ranges(None, {A: {"0": 5}}, [A])) == [(A, None, {"0": 5})]


# -- the checkpoint of the one query

def test_newest_batch_is_applied_only_when_every_topic_it_moved_is(tmp_path):
    batches = [{A: {"0": 5}, B: {"0": 3}}, {A: {"0": 9}, B: {"0": 3}, C: {"0": 4, JOINED: True}},
               {A: {"0": 12}, B: {"0": 6}, C: {"0": 8}}]
    write_batches(tmp_path, batches, committed=2)
    initial = {A: {}, B: {}, C: {"0": 4}}
    assert topics_replay_unapplied(tmp_path, {A: {0: 12}, B: {0: 6}, C: {0: 8}}, initial) is None
    assert topics_replay_unapplied(tmp_path, {A: {0: 12}, B: {0: 6}, C: {0: 4}}, initial) == 2  # C lacks it
    assert names(tmp_path / "commits") == [".0.crc", ".1.crc", "0", "1"]
    # batch 1: A moved and has it; B did not move; C joined (read nothing)
    assert topics_replay_unapplied(tmp_path, {A: {0: 9}, B: {0: 3}}, initial) is None


def test_an_earlier_batch_the_target_never_applied_is_replayed_with_every_later_one(tmp_path):
    batches = [{A: {"0": 5}, B: {"0": 3}}, {A: {"0": 9}, B: {"0": 7}}, {A: {"0": 12}, B: {"0": 9}}]
    write_batches(tmp_path, batches, committed=2)
    # B's part of batch 1 never reached the target (a read that handed over
    # nothing); batch 2's apply then failed on the gap
    assert topics_replay_unapplied(tmp_path, {A: {0: 12}, B: {0: 3}}, {A: {}, B: {}}) == 1
    assert names(tmp_path / "commits") == [".0.crc", "0"]
    assert names(tmp_path / "offsets") == [".0.crc", ".1.crc", "0", "1"]


def test_an_earlier_incarnations_batch_decides_nothing(tmp_path):
    batches = [{A: {"0": 5, "topic_id": "old"}}, {A: {"0": 2, "topic_id": "new"}},
               {A: {"0": 4, "topic_id": "new"}}]
    write_batches(tmp_path, batches, committed=2)
    assert topics_replay_unapplied(tmp_path, {A: {0: 4}}, {A: {}}) is None


def test_the_first_batch_starts_where_the_source_was_told(tmp_path):
    write_batches(tmp_path, [{A: {"0": 600}}], committed=0)
    # started at the target's progress 500: progress still 500 means unapplied
    assert topics_replay_unapplied(tmp_path, {A: {0: 500}}, {A: {"0": 500}}) == 0


def test_a_topic_no_longer_in_the_query_decides_nothing(tmp_path):
    write_batches(tmp_path, [{A: {"0": 5}, B: {"0": 3}}, {A: {"0": 9}, B: {"0": 7}}], committed=1)
    assert topics_replay_unapplied(tmp_path, {A: {0: 9}}, {A: {}}) is None  # B held back: not the query's


def test_group_commit_at_start_per_topic_with_the_id_it_was_read_from(tmp_path):
    write_batches(tmp_path, [{A: {"0": 5, "topic_id": "ia"}, B: {"0": 3, "topic_id": "ib"}},
                             {A: {"0": 9, "topic_id": "ia"}, B: {"0": 3, "topic_id": "ib"}}], committed=1)
    assert topics_newest_moved(tmp_path, {A: {0: 9}, B: {0: 3}}, {A: {}, B: {}}) == {A: ("ia", {0: 9})}
    assert topics_batch_topic_ids(tmp_path, 1) == {A: "ia", B: "ib"}
    assert topics_batch_topic_ids(tmp_path, 7) == {}
    assert topics_newest_topic_ids(tmp_path) == {A: "ia", B: "ib"}


def test_topics_ahead_of_the_target_must_rejoin(tmp_path):
    write_batches(tmp_path, [{A: {"0": 5, "1": 2}, B: {"0": 3}}, {A: {"0": 9, "1": 2}, B: {"0": 8}}], committed=1)
    # B was held back at 3 while A went on, then the consumer died before B left the checkpoint
    assert topics_ahead_of_target(tmp_path, {A: {0: 9, 1: 2}, B: {0: 3}}, [A, B]) == {B}
    assert topics_ahead_of_target(tmp_path, {A: {0: 9, 1: 2}, B: {0: 8}}, [A, B]) == set()
    assert topics_ahead_of_target(tmp_path, {A: {0: 9}}, [A]) == {A}  # partition 1: no progress at all


def test_one_query_config():
    base = {"source": {"dsn": "postgresql://u@h/db"}, "kafka": {"bootstrap_servers": "b:9092"},
            "shapes": [{"table": "public.a"}]}
    assert parse_config(base).consumer.queries == "per_shape"
    assert parse_config({**base, "consumer": {"queries": "one"}}).consumer.queries == "one"
    with pytest.raises(Exception, match="staged_apply"):
        parse_config({**base, "consumer": {"queries": "one", "staged_apply": True}})
