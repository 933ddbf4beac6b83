"""Decode inside Spark, two ways, on the same topic in the same session:
spark-avro's ``from_avro`` (one writer schema per call, the messages grouped
by the schema their prefix names) against walbridge's compiled decoder in
``mapInArrow`` (``spark_consumer.batch_split.decode_shapes``), each collected
to the driver as Arrow, as the consumer's query does.

    flock /tmp/wb-tests.lock .venv/bin/python bench/decode_paths.py [--rows 300000] [--repeat 3]

- The producer snapshots ``bench/consumer.py``'s table (int key, int, text,
  numeric(12,2), timestamptz) into one shape topic (4 partitions,
  registry-less: single-object encoding, a 10-byte prefix), then stops.
- Both paths read the whole topic with Spark's Kafka source as a batch
  (``spark.read.format("kafka")``, the same source and jars as the consumer),
  in ``local[*]`` on this machine.
- ``from_avro``: per writer schema (the distinct prefixes), the value past its
  prefix decoded by ``from_avro`` with the writer schema's JSON, then only
  the envelope's ``op``, ``after.*``, ``source.lsn`` and ``source.op_index``
  kept, plus topic, partition and offset: the least the apply needs, so a
  lower bound of what a full from_avro decode (special values, the side field,
  unchanged TOAST columns, deletes' keys, control events and tombstones,
  older writers cast into the newest layout, the union layout) would cost.
- compiled: the consumer's own decode, everything included.
- The best of ``--repeat`` runs of each, after one warm-up run of each; rows/s.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pyspark.sql import functions as F  # noqa: E402
from pyspark.sql.avro.functions import from_avro  # noqa: E402

from bench.consumer import PARTITIONS, TOPIC, bench_config, fill_topic, make_source  # noqa: E402
from schemas import wire  # noqa: E402
from schemas.config import parse_config  # noqa: E402
from schemas.java_client import java_client_options  # noqa: E402
from spark_consumer.batch_split import DECODED_SCHEMA, decode_shapes, tables_by_topic  # noqa: E402
from spark_consumer.session import spark_session  # noqa: E402
from spark_consumer.shape_schemas import ShapeSource, discover_schemas  # noqa: E402
from walbridge.embedded import KafkaBroker, PostgresCluster  # noqa: E402


def timed(fn) -> tuple[float, int]:
    t0 = time.monotonic()
    n = fn()
    return time.monotonic() - t0, n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=300_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "decode_paths.json")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="wb-bench-decode-"))
    results: dict = {"rows": args.rows, "partitions": PARTITIONS}
    with PostgresCluster(base / "pg") as pg, KafkaBroker(base / "kafka") as broker:
        make_source(pg.dsn("postgres"), args.rows)
        config = parse_config(bench_config(pg.dsn("postgres"), broker.bootstrap, {"target_dsn": pg.dsn("postgres")}))
        fill_topic(config)
        src = ShapeSource.of(config, config.shapes[0])
        schemas = discover_schemas(src)
        spark = spark_session("local[*]")
        raw = (spark.read.format("kafka").options(**java_client_options(broker.bootstrap, {}))
               .option("subscribe", TOPIC).option("startingOffsets", "earliest").option("endingOffsets", "latest")
               .load().select("topic", "partition", "offset", "key", "value", "headers"))
        tasks = spark.sparkContext.defaultParallelism

        def compiled() -> int:
            decode = functools.partial(decode_shapes, {TOPIC: (src, schemas)})
            tables = tables_by_topic(raw.coalesce(tasks).mapInArrow(decode, DECODED_SCHEMA).toArrow())
            return tables[TOPIC].num_rows

        def spark_avro() -> int:
            prefixes = [r[0] for r in raw.where(F.col("value").isNotNull())
                        .select(F.substring("value", 1, 10).alias("p")).distinct().collect()]
            n = 0
            for prefix in prefixes:
                ref = wire.parse_prefix(bytes(prefix))
                writer = json.dumps(schemas.writer_schemas[f"fp:{ref.ref}"])
                part = (raw.where(F.substring("value", 1, 10) == F.lit(bytes(prefix)))
                        .select("topic", "partition", "offset",
                                from_avro(F.expr(f"substring(value, {ref.body_offset + 1})"), writer).alias("e"))
                        .select("topic", "partition", "offset", "e.op", "e.after.*",
                                F.col("e.source.lsn").alias("lsn"), F.col("e.source.op_index").alias("op_index")))
                n += part.coalesce(tasks).toArrow().num_rows
            return n

        for name, fn in (("compiled_mapInArrow", compiled), ("spark_avro_from_avro", spark_avro)):
            fn()  # warm-up: JIT, Python workers, cached consumers
            runs = [timed(fn) for _ in range(args.repeat)]
            best, n = min(runs)
            results[name] = {"best_s": round(best, 2), "rows": n, "rows_per_s": round(n / best),
                             "runs_s": [round(t, 2) for t, _ in runs]}
            print(json.dumps({name: results[name]}), flush=True)
        spark.stop()
    results["compiled_over_from_avro"] = round(results["compiled_mapInArrow"]["rows_per_s"]
                                               / results["spark_avro_from_avro"]["rows_per_s"], 2)
    text = json.dumps(results, indent=2)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
