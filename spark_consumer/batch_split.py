"""One micro-batch of many shapes, split per shape and decoded: the raw
messages Spark's Kafka source read (:data:`RAW_COLUMNS`, one row per message
as it is on the wire) are grouped by topic and each group decoded with its
own shape's writer schemas (:mod:`spark_consumer.decode`), on the executors,
in one Spark job (:func:`decode_shapes`, a ``mapInArrow``).

Each shape's rows have a layout of their own, so one DataFrame cannot carry
them: a task yields one row per shape it read, ``(topic, Arrow IPC stream of
the shape's decoded rows)``, and the driver reads them back into one Arrow
table per shape (:func:`tables_by_topic`).

Invariants:
- Nothing is lost or moved between shapes: every raw row of a topic the
  decoder is given reaches that topic's table, decoded, or as a ``dlq`` row
  (the message went to ``<topic>.dlq``, :mod:`spark_consumer.dead_letters`),
  or as the one ``new_schema`` row that ends a part written with a value
  schema the shape's schemas did not know (the driver learns them again and
  decodes that part anew). Rows of a topic the decoder is not given (a shape
  the query no longer applies) are left out, and the apply moves no progress
  for them.
- Within a topic-partition, rows keep their offset order: Spark's source,
  the decoder and the splitting keep input order within a task, and the
  driver sorts what several tasks return (Spark may split one partition's
  range between them, ``minPartitions``).
- Pure but for the dead letters.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Mapping

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.types import BinaryType, StringType, StructField, StructType

from schemas import wire
from spark_consumer.dead_letters import DeadLetters
from spark_consumer.decode import BatchBuilder, SchemaChangedError, UndecodableMessage
from spark_consumer.shape_schemas import ShapeSchemas, ShapeSource, writer_schemas_for
from spark_consumer.worker_imports import settle_worker

# The raw columns the decoder reads, named as Spark's Kafka source names them.
RAW_COLUMNS = ("topic", "partition", "offset", "key", "value", "headers")
ARROW_BATCH_ROWS = 8192
POSITION_ORDER = [(wire.PARTITION_COLUMN, "ascending"), (wire.OFFSET_COLUMN, "ascending")]

# What the executors hand back: one row per (task, shape), the shape's decoded rows.
DECODED_SCHEMA = StructType([StructField(wire.TOPIC_COLUMN, StringType(), nullable=False),
                             StructField(wire.ARROW_COLUMN, BinaryType(), nullable=False)])
DECODED_ARROW_SCHEMA = pa.schema([(wire.TOPIC_COLUMN, pa.string(), False), (wire.ARROW_COLUMN, pa.binary(), False)])


def raw_messages(batch: Any) -> Iterator[tuple]:
    """(topic, partition, offset, key, value, headers) of each row of a raw
    record batch; headers as confluent-kafka gives them (a list of (name,
    value) pairs, or None)."""
    topics, partitions, offsets, keys, values = (batch.column(name).to_pylist() for name in RAW_COLUMNS[:5])
    hcol = batch.column("headers")
    bounds = hcol.offsets.to_pylist()
    flat = hcol.flatten()  # the slice's headers, from bounds[0] on
    pairs = list(zip(flat.field(0).to_pylist(), flat.field(1).to_pylist()))
    base = bounds[0]
    for i in range(len(offsets)):
        lo, hi = bounds[i] - base, bounds[i + 1] - base
        yield topics[i], partitions[i], offsets[i], keys[i], values[i], pairs[lo:hi] if hi > lo else None


def decode_batches(src: ShapeSource, schemas: ShapeSchemas, batches: Iterable[Any]) -> Iterator[pa.RecordBatch]:
    """One shape's raw record batches decoded into ``schemas.layout()``
    (:mod:`spark_consumer.decode`): undecodable messages sent to the DLQ
    (flushed before the last batch is yielded) and given a ``dlq`` row; a
    message written with a value schema not among the known ones ends the
    output with one ``new_schema`` row (what was decoded before it is dropped)."""
    writers = writer_schemas_for(src, schemas)  # cached per worker, its layout with it
    builder = BatchBuilder(writers.layout, writers)
    dead_letters = DeadLetters(src.topic, src.client_conf())
    for batch in batches:
        for topic, partition, offset, key, value, headers in raw_messages(batch):
            try:
                builder.add(topic, partition, offset, key, value, headers)
            except UndecodableMessage as e:
                dead_letters.send(topic, partition, offset, key, value, headers, str(e))
                builder.add_dlq(topic, partition, offset, headers, str(e))
            except SchemaChangedError as e:  # a value schema the layout was not derived with
                builder.to_record_batch()  # dropped: the part is decoded again
                builder.add_control(topic, partition, offset, wire.NEW_SCHEMA_CONTROL, str(e), info=e.ref)
                dead_letters.flush()
                yield builder.to_record_batch()
                return
            if builder.count >= ARROW_BATCH_ROWS:
                yield builder.to_record_batch()
    dead_letters.flush()
    if builder.count:
        yield builder.to_record_batch()


def split_by_topic(batches: Iterable[Any]) -> dict[str, list[pa.RecordBatch]]:
    """Record batches (any with a ``topic`` column) regrouped per topic, each
    topic's rows in their input order; topics in order of first appearance."""
    out: dict[str, list[pa.RecordBatch]] = {}
    for batch in batches:
        topics = batch.column("topic")
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


def decode_by_topic(shapes: Mapping[str, tuple[ShapeSource, ShapeSchemas]], batches: Iterable[Any]
                    ) -> dict[str, list[pa.RecordBatch]]:
    """Per topic of ``shapes``, its raw rows of ``batches`` decoded
    (:func:`decode_batches`); topics not in ``shapes``, or whose rows decode
    to nothing, are left out."""
    out: dict[str, list[pa.RecordBatch]] = {}
    for topic, raw in split_by_topic(batches).items():
        if topic not in shapes:
            continue
        src, schemas = shapes[topic]
        decoded = [b for b in decode_batches(src, schemas, raw) if b.num_rows]
        if decoded:
            out[topic] = decoded
    return out


def decode_shapes(shapes: Mapping[str, tuple[ShapeSource, ShapeSchemas]], batches: Iterator[Any]
                  ) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` over raw rows of many topics (executor side): each
    topic's rows decoded (:func:`decode_by_topic`) as one :data:`DECODED_SCHEMA` row."""
    settle_worker()  # for this worker's next tasks
    decoded = decode_by_topic(shapes, batches)
    if decoded:
        yield pa.RecordBatch.from_arrays([pa.array(list(decoded), pa.string()),
                                          pa.array([to_ipc(b) for b in decoded.values()], pa.binary())],
                                         schema=DECODED_ARROW_SCHEMA)


def tables_by_topic(decoded: pa.Table) -> dict[str, pa.Table]:
    """The driver's side of :func:`decode_shapes`: one Arrow table per topic,
    its rows in (partition, offset) order. A task's rows of a partition are
    in offset order; the parts of several tasks are sorted, since Spark may
    split one partition's range between tasks and hand them back in any order."""
    parts: dict[str, list[pa.Table]] = {}
    for topic, blob in zip(decoded.column(wire.TOPIC_COLUMN).to_pylist(),
                           decoded.column(wire.ARROW_COLUMN).to_pylist()):
        parts.setdefault(topic, []).append(pa.ipc.open_stream(blob).read_all())
    return {t: ts[0] if len(ts) == 1 else pa.concat_tables(ts).sort_by(POSITION_ORDER) for t, ts in parts.items()}


def new_schema_reason(table: pa.Table) -> tuple[str, str | None] | None:
    """Why a topic's decoded rows must be decoded again (a value schema the
    shape's schemas did not hold) and that schema's ref, or None."""
    marks = table.filter(pc.equal(table.column(wire.CONTROL_COLUMN), wire.NEW_SCHEMA_CONTROL))
    if not marks.num_rows:
        return None
    return marks.column(wire.ERROR_COLUMN)[0].as_py(), marks.column(wire.CONTROL_INFO_COLUMN)[0].as_py()
