"""One micro-batch of many shapes, split per shape: the raw rows of the one
query over every shape topic (:mod:`spark_consumer.topics_source`) are
grouped by ``_wb_topic`` and each group decoded with its own shape's writer
schemas, on the executors, in one Spark job (:func:`decode_shapes`).

Each shape's rows have a layout of their own, so one DataFrame cannot carry
them: a task yields one row per shape it read, ``(_wb_topic, _wb_arrow)``, the
shape's decoded rows as an Arrow IPC stream, and the driver reads them back
into one Arrow table per shape (:func:`tables_by_topic`).

Invariants:
- Nothing is lost or moved between shapes: every raw row of a topic the
  decoder is given reaches that topic's table (decoded, or as a ``dlq`` or
  ``new_schema`` control row, as :func:`~spark_consumer.kafka_source.decode_batches`
  makes them); rows of a topic it is not given (a shape the query no longer
  applies) are left out, and the apply moves no progress for them.
- Within a topic-partition, rows keep their offset order (the decoder and
  the splitting both keep input order).
- Pure but for what :func:`~spark_consumer.kafka_source.decode_batches` does
  (the dead-letter topic of an undecodable message).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Mapping

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.types import BinaryType, StringType, StructField, StructType

from schemas import wire
from spark_consumer.kafka_source import TOPIC_ID, ShapeSchemas, SourceOptions, decode_batches

# What the executors hand back: one row per (task, shape), the shape's decoded rows.
DECODED_SCHEMA = StructType([StructField("_wb_topic", StringType(), nullable=False),
                             StructField("_wb_arrow", BinaryType(), nullable=False)])
DECODED_ARROW_SCHEMA = pa.schema([("_wb_topic", pa.string(), False), ("_wb_arrow", pa.binary(), False)])


def split_by_topic(batches: Iterable[Any]) -> dict[str, list[pa.RecordBatch]]:
    """Record batches (any with a ``_wb_topic`` column) regrouped per topic,
    each topic's rows in their input order; topics in order of first appearance."""
    out: dict[str, list[pa.RecordBatch]] = {}
    for batch in batches:
        topics = batch.column("_wb_topic")
        distinct = pc.unique(topics).to_pylist()
        if len(distinct) == 1:
            out.setdefault(distinct[0], []).append(batch)
            continue
        for topic in distinct:
            out.setdefault(topic, []).append(batch.filter(pc.equal(topics, topic)))
    return out


def to_ipc(batches: list[pa.RecordBatch]) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batches[0].schema) as writer:
        for b in batches:
            writer.write_batch(b)
    return sink.getvalue().to_pybytes()


def decode_by_topic(shapes: Mapping[str, tuple[SourceOptions, ShapeSchemas]], batches: Iterable[Any]
                    ) -> dict[str, list[pa.RecordBatch]]:
    """Per topic of ``shapes``, its raw rows of ``batches`` decoded as
    :func:`~spark_consumer.kafka_source.decode_batches` decodes one shape's
    (marking a value schema it does not know); topics not in ``shapes``, or
    whose rows decode to nothing, are left out. What an executor runs
    (:func:`decode_shapes`), and the continuous reader on the driver."""
    out: dict[str, list[pa.RecordBatch]] = {}
    for topic, raw in split_by_topic(batches).items():
        if topic not in shapes:
            continue
        opts, schemas = shapes[topic]
        decoded = [b for b in decode_batches(opts, schemas, True, iter(raw)) if b.num_rows]
        if decoded:
            out[topic] = decoded
    return out


def decode_shapes(shapes: Mapping[str, tuple[SourceOptions, ShapeSchemas]], batches: Iterator[Any]
                  ) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` over the raw rows of many topics (executor side): each
    topic's rows decoded (:func:`decode_by_topic`) as one :data:`DECODED_SCHEMA` row."""
    decoded = decode_by_topic(shapes, batches)
    if decoded:
        yield pa.RecordBatch.from_arrays([pa.array(list(decoded), pa.string()),
                                          pa.array([to_ipc(b) for b in decoded.values()], pa.binary())],
                                         schema=DECODED_ARROW_SCHEMA)


def tables_by_topic(decoded: pa.Table) -> dict[str, pa.Table]:
    """The driver's side of :func:`decode_shapes`: one Arrow table per topic
    (the parts of several tasks concatenated, in task order)."""
    parts: dict[str, list[pa.Table]] = {}
    for topic, blob in zip(decoded.column("_wb_topic").to_pylist(), decoded.column("_wb_arrow").to_pylist()):
        parts.setdefault(topic, []).append(pa.ipc.open_stream(blob).read_all())
    return {t: ts[0] if len(ts) == 1 else pa.concat_tables(ts) for t, ts in parts.items()}


def new_schema_reason(table: pa.Table) -> str | None:
    """Why a topic's decoded rows must be decoded again (a value schema the
    shape's schemas did not hold), or None."""
    marks = table.filter(pc.equal(table.column("_wb_control"), wire.NEW_SCHEMA_CONTROL))
    return marks.column("_wb_error")[0].as_py() if marks.num_rows else None


def starting_offsets(progress: Mapping[tuple[str, int], Any], topics: Iterable[str]) -> dict[str, dict[str, int]]:
    """Where each of ``topics`` starts when it joins the query: the target's
    progress (next offset per partition; ``progress`` as
    :func:`spark_consumer.progress.read_progress` gives it), with the topic id
    the offsets count in when the progress recorded it (the source reads a
    recreated topic from its earliest offsets). A topic without progress, or
    whose partitions' progress counts in different incarnations, is absent
    (it starts at its earliest offsets; the target's progress skips what it
    applied)."""
    wanted = set(topics)
    out: dict[str, dict[str, Any]] = {}
    ids: dict[str, set[str]] = {}
    for (topic, partition), prog in sorted(progress.items()):
        if topic in wanted:
            out.setdefault(topic, {})[str(partition)] = int(prog.next_offset)
            if prog.topic_id:
                ids.setdefault(topic, set()).add(prog.topic_id)
    for topic, seen in ids.items():
        if len(seen) > 1:
            del out[topic]
        else:
            out[topic][TOPIC_ID] = seen.pop()
    return out
