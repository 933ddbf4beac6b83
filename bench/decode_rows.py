"""Executor-side decode cost per row, without Kafka or Spark: the batch
builder's ``add`` and ``to_record_batch`` on ``bench/consumer.py``'s table
(int key, int, text, numeric(12,2), timestamptz; snapshot reads), with the
compiled reader and with fastavro only, beside the plain loop's decode
(``schemaless_reader`` on a ``BytesIO``).

    .venv/bin/python bench/decode_rows.py [--rows 50000] [--repeat 5]

Single core; the best of ``--repeat`` runs is reported (µs per row).
"""

from __future__ import annotations

import argparse
import datetime as dt
import io
import sys
import time
from decimal import Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fastavro import parse_schema, schemaless_reader  # noqa: E402

from producer.envelope import ShapeCodec, ShapeColumn  # noqa: E402
from producer.pgtypes import PgTypeInfo, column_codec  # noqa: E402
from schemas import wire  # noqa: E402
from spark_consumer import fastdecode  # noqa: E402
from spark_consumer.decode import BatchBuilder, ShapeLayout, WriterSchemas  # noqa: E402


def _column(name: str, oid: int, type_name: str, typmod: int = -1, key: bool = False) -> ShapeColumn:
    return ShapeColumn(name, column_codec(PgTypeInfo(oid, type_name, oid, type_name, typmod, "b")), key)


COLUMNS = [_column("id", 23, "integer", key=True), _column("a", 23, "integer"), _column("b", 25, "text"),
           _column("c", 1700, "numeric(12,2)", ((12 << 16) | 2) + 4), _column("d", 1184, "timestamp with time zone")]


def messages(n: int) -> tuple[ShapeCodec, dict, list[tuple]]:
    codec = ShapeCodec("public.bench_rows", "wb", "db", "public", "bench_rows", COLUMNS, list(range(len(COLUMNS))))
    fp = wire.schema_fingerprint(codec.value_schema)
    prefix = wire.single_object_prefix(fp)
    at = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    out = []
    for i in range(n):
        row = (i, i * 7, f"row {i} text", Decimal(i % 100000) / 100, at + dt.timedelta(seconds=i))
        source = codec.source(1000, 0, None, 1_700_000_000_000, True, "slot@0/1")
        value = codec.encode_value(prefix, codec.envelope("r", None, row, source, 1_700_000_000_001))
        headers = [(wire.POSITION_HEADER, wire.position_header(1000, 0)), (wire.SNAPSHOT_HEADER, b"slot@0/1")]
        out.append((codec.encode_key(prefix, row), value, headers))
    return codec, {fp: codec.value_schema}, out


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=50_000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    codec, by_fp, msgs = messages(args.rows)
    layout = ShapeLayout.from_schemas(codec.value_schema, codec.key_schema)
    n = len(msgs)

    parsed = parse_schema(codec.value_schema)

    def plain() -> None:
        for _, value, _ in msgs:
            schemaless_reader(io.BytesIO(value[10:]), parsed, None)

    def lookup(ref, data):
        return by_fp[ref.ref]

    results = {"plain loop decode (fastavro)": best(plain, args.repeat) / n}
    for name, compiled in (("fastavro", False), ("compiled", True)):
        if compiled and not fastdecode.AVAILABLE:
            continue
        schemas = WriterSchemas(layout, lookup, frozenset(), compiled=compiled)
        builder = BatchBuilder(layout, schemas)

        def add(builder=builder) -> None:
            for offset, (key, value, headers) in enumerate(msgs):
                builder.add("wb.public.bench_rows", 0, offset, key, value, headers)

        add_times, batch_times = [], []
        for _ in range(args.repeat):
            add_times.append(best(add, 1))
            batch_times.append(best(builder.to_record_batch, 1))
        results[f"builder.add ({name})"] = min(add_times) / n
        results[f"to_record_batch ({name})"] = min(batch_times) / n
    for label, seconds in results.items():
        print(f"{label:36s} {seconds * 1e6:6.2f} µs/row")


if __name__ == "__main__":
    main()
