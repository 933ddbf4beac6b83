"""One micro-batch of many shapes split per shape and decoded (spark_consumer/batch_split.py):
nothing lost or moved between shapes, offset order kept, topics that are no
shape of the query left out."""

from __future__ import annotations

import pyarrow as pa

from schemas import wire
from spark_consumer import batch_split
from spark_consumer.batch_split import decode_shapes, new_schema_reason, split_by_topic, tables_by_topic
from spark_consumer.shape_schemas import ShapeSource
from tests.unit.test_schema_changes import raw_batch

A, B, C = "wb.public.a", "wb.public.b", "wb.public.c"


def raw(rows: list[tuple[str, int, int]]) -> pa.RecordBatch:
    """A raw record batch of (topic, partition, offset) rows."""
    return pa.concat_batches([raw_batch(t, p, [(o, b"k", b"v", [])]) for t, p, o in rows])


def rows_of(batches) -> list[tuple]:
    return [(t, p, o) for b in batches for t, p, o in zip(*(b.column(c).to_pylist()
                                                            for c in ("topic", "partition", "offset")))]


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

    def fake_decode(src, schemas, batches):  # echoes the rows, tagged with the shape it was given
        seen[src.topic] = schemas
        for b in batches:
            yield pa.RecordBatch.from_pydict({wire.TOPIC_COLUMN: b.column("topic"),
                                              wire.OFFSET_COLUMN: b.column("offset"), "shape": [schemas] * b.num_rows})
        yield pa.RecordBatch.from_pydict({wire.TOPIC_COLUMN: pa.array([], pa.string()),
                                          wire.OFFSET_COLUMN: pa.array([], pa.int64()),
                                          "shape": pa.array([], pa.string())})

    monkeypatch.setattr(batch_split, "decode_batches", fake_decode)
    shapes = {A: (ShapeSource(A, "unused:9092"), "shape-a"), B: (ShapeSource(B, "unused:9092"), "shape-b")}
    out = list(decode_shapes(shapes, iter([raw([(A, 0, 1), (C, 0, 5), (B, 1, 4)]), raw([(A, 0, 2)])])))
    tables = tables_by_topic(pa.Table.from_batches(out))
    assert set(tables) == {A, B}  # C is no shape of this query: left out, not applied
    assert tables[A].column(wire.OFFSET_COLUMN).to_pylist() == [1, 2]
    assert set(tables[A].column("shape").to_pylist()) == {"shape-a"}
    assert tables[B].column("shape").to_pylist() == ["shape-b"]
    assert seen == {A: "shape-a", B: "shape-b"}
    assert list(decode_shapes(shapes, iter([raw([(C, 0, 1)])]))) == []


def test_parts_of_several_tasks_come_back_in_partition_and_offset_order():
    def blob(partition, offsets):
        return batch_split.to_ipc([pa.RecordBatch.from_pydict({
            wire.PARTITION_COLUMN: pa.array([partition] * len(offsets), pa.int32()),
            wire.OFFSET_COLUMN: pa.array(offsets, pa.int64())})])

    # Spark split partition 0's range between two tasks and returned the later half first.
    decoded = pa.Table.from_pydict({wire.TOPIC_COLUMN: [A, B, A, A],
                                    wire.ARROW_COLUMN: [blob(0, [3, 4]), blob(0, [9]), blob(1, [0]), blob(0, [1, 2])]},
                                   schema=batch_split.DECODED_ARROW_SCHEMA)
    tables = tables_by_topic(decoded)
    assert list(zip(tables[A].column(wire.PARTITION_COLUMN).to_pylist(),
                    tables[A].column(wire.OFFSET_COLUMN).to_pylist())) == [(0, 1), (0, 2), (0, 3), (0, 4), (1, 0)]
    assert tables[B].column(wire.OFFSET_COLUMN).to_pylist() == [9]


def test_new_schema_reason_names_the_mark_and_its_schema():
    t = pa.table({wire.CONTROL_COLUMN: [None, wire.NEW_SCHEMA_CONTROL], wire.ERROR_COLUMN: [None, "value schema fp:1"],
                  wire.CONTROL_INFO_COLUMN: [None, "fp:1"]})
    assert new_schema_reason(t) == ("value schema fp:1", "fp:1")
    assert new_schema_reason(t.slice(0, 1)) is None
