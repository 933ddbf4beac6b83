"""Lakehouse apply benchmark: each lakehouse target's apply of decoded change
rows against a plain Spark ``MERGE`` of the same rows into the same format,
in one run on one Spark session.

    .venv/bin/python bench/lakehouse.py [--keys 100000] [--batch 50000] [--rounds 3] [--formats delta,iceberg]

- The rows: ``--keys`` inserts, then ``--rounds - 1`` rounds of an update of
  every key (one change per key per round), as the decoder hands them to the
  apply (tuples in its column order, positions increasing), in micro-batches
  of ``--batch`` rows.
- walbridge: :class:`spark_consumer.targets.delta.DeltaTarget` (or
  :class:`~spark_consumer.targets.iceberg.IcebergTarget`, a Hadoop catalog)
  applies each micro-batch (plan, stage, one MERGE with the progress in its commit).
- reference: each micro-batch's rows as a DataFrame (from Arrow made before
  the clock starts: the same Arrow the stage is built from) and ``MERGE INTO t USING s ON key WHEN
  MATCHED THEN UPDATE SET * WHEN NOT MATCHED THEN INSERT *`` into a fresh
  table of the format: what a hand-written Debezium → Spark → lakehouse job runs.
- statement: walbridge's own ``MERGE`` statement (``merge_sql.table_merge``:
  the rank conditions, the bookkeeping columns) on the staged rows made
  before the clock starts, into a fresh table of the format: the apply less
  its driver-side work (planning, staging, the progress). walbridge − statement
  is that driver-side share; statement − reference what the statement adds.
- Ratio = reference time / walbridge time (1.0: as fast as the plain MERGE).
  The three run ``--repeats`` times in alternation; the fastest run of each counts.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from schemas.config import IcebergConfig  # noqa: E402
from spark_consumer.apply_plan import plan_batch  # noqa: E402
from spark_consumer.batch import Part  # noqa: E402
from spark_consumer.session import spark_session  # noqa: E402
from spark_consumer.targets.base import ShapeBatch  # noqa: E402
from spark_consumer.targets.delta import SNAPSHOT_PARTITIONS, DeltaTarget  # noqa: E402
from spark_consumer.targets.iceberg import IcebergTarget  # noqa: E402
from spark_consumer.targets.merge_sql import BOOKKEEPING, ddl_columns, shape_fields, stage_table, table_merge  # noqa: E402
from tests.helpers import both_lake_formats  # noqa: E402
from tests.unit.test_apply_plan import as_tuples, keyed_target, row  # noqa: E402

TOPIC = "wb.public.items"


def batches(keys: int, rounds: int, size: int):
    """Micro-batches of decoded rows: (fields, rows) per batch, offsets running on."""
    target = keyed_target()
    out, rows, offset = [], [], 0
    for r in range(rounds):
        for k in range(1, keys + 1):
            rows.append(row("c" if r == 0 else "u", 1000 + offset, off=offset, id=k, body=f"row {k} round {r}",
                            n=None, d=None))
            offset += 1
            if len(rows) == size:
                out.append(as_tuples(target, rows))
                rows = []
    if rows:
        out.append(as_tuples(target, rows))
    return target, out


CATALOG = "bench"
PLAIN, STATEMENT, WALBRIDGE = "plain Spark MERGE", "walbridge's MERGE statement", "walbridge"
_runs = iter(range(1_000_000))  # each run's own Iceberg namespace: fresh tables


def run_walbridge(spark, fmt: str, work: str, target, data) -> float:
    if fmt == "delta":
        shutil.rmtree(f"{work}/walbridge", ignore_errors=True)
        lake = DeltaTarget(spark, f"{work}/walbridge")
    else:
        lake = IcebergTarget(spark, IcebergConfig(warehouse=f"{work}/warehouse", name=CATALOG,
                                                  namespace=f"wb{next(_runs)}"))
    lake.follow(TOPIC, target)
    lake.read_progress("bench")
    t0 = time.monotonic()
    for fields, rows in data:
        offsets = [r[fields.index("_wb_offset")] for r in rows]
        part = Part(TOPIC, 0, min(offsets), max(offsets) + 1, rows, fields)
        lake.apply("bench", [ShapeBatch(TOPIC, target, [part])], on_offset_reset="raise",
                   hold=lambda t, why: (_ for _ in ()).throw(RuntimeError(why)))
    return time.monotonic() - t0


def fresh_table(spark, fmt: str, work: str, name: str, fields) -> str:
    """A new empty table of the format with ``fields``: its name in SQL."""
    if fmt == "delta":
        shutil.rmtree(f"{work}/{name}", ignore_errors=True)
        table = f"delta.`{work}/{name}/{name}`"
        # column mapping: the bench's shape has a column named "body text", as the target makes it
        create = "USING delta TBLPROPERTIES ('delta.columnMapping.mode' = 'name')"
    else:
        ns = f"{CATALOG}.{name}{next(_runs)}"
        spark.sql(f"CREATE NAMESPACE IF NOT EXISTS {ns}")
        table, create = f"{ns}.{name}", "USING iceberg TBLPROPERTIES ('format-version' = '2')"
    spark.sql(f"CREATE TABLE {table} ({ddl_columns(fields)}) {create}")
    return table


def run_merges(spark, table: str, tables, merge: str) -> float:
    """Each Arrow table as the view ``stage``, then ``merge``; the time of all."""
    t0 = time.monotonic()
    for arrow in tables:
        spark.createDataFrame(arrow).createOrReplaceTempView("stage")
        spark.sql(merge).collect()
    return time.monotonic() - t0


def run_plain(spark, fmt: str, work: str, target, tables) -> float:
    table = fresh_table(spark, fmt, work, "plain", shape_fields(target))
    cols = ", ".join(f"`{c}`" for c in target.names)
    return run_merges(spark, table, tables, f"MERGE INTO {table} t USING (SELECT {cols} FROM stage) s ON t.id = s.id "
                                            "WHEN MATCHED THEN UPDATE SET * WHEN NOT MATCHED THEN INSERT *")


def run_statement(spark, fmt: str, work: str, target, stages) -> float:
    table = fresh_table(spark, fmt, work, "statement", shape_fields(target) + list(BOOKKEEPING))
    return run_merges(spark, table, stages, table_merge(target, table, None, "stage", [],
                                                        stage_columns=stages[0].column_names))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=50_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--formats", default="delta,iceberg")
    ap.add_argument("--repeats", type=int, default=2, help="alternations of the three; the fastest run of each counts")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="wb-lakehouse-")
    # The session a local consumer of a lakehouse target gets, with both formats' settings.
    spark = spark_session("local[2]", target_settings=both_lake_formats(f"{work}/warehouse", CATALOG), jvm_applies=True)
    spark.sparkContext.setLogLevel("ERROR")
    # The reference gets the Delta setting the target gives its own session.
    spark.conf.set(SNAPSHOT_PARTITIONS, str(spark.sparkContext.defaultParallelism))
    target, data = batches(args.keys, args.rounds, args.batch)
    rows = sum(len(r) for _, r in data)
    # The inputs made before the clock starts: the walbridge stage as Arrow (the
    # statement's; lean, as the target makes it for these tombstone-free
    # batches), and the same less the bookkeeping, one row per key (the reference's).
    stages = [stage_table(target, plan_batch(target, r, fields=f), lean=True) for f, r in data]
    tables = [stage.select(list(target.names)) for stage in stages]
    # As a consumer does once started (spark_consumer.supervisor.run): what
    # lives for the whole run, here with every batch's rows (a consumer holds
    # one batch at a time), is kept out of the collector's full passes.
    gc.collect()
    gc.freeze()
    try:
        print(f"rows {rows} in {len(data)} micro-batches of {args.batch}")
        for fmt in args.formats.split(","):
            runs = {PLAIN: [], STATEMENT: [], WALBRIDGE: []}
            for _ in range(args.repeats):
                runs[PLAIN].append(run_plain(spark, fmt, work, target, tables))
                runs[STATEMENT].append(run_statement(spark, fmt, work, target, stages))
                runs[WALBRIDGE].append(run_walbridge(spark, fmt, work, target, data))
            best = {name: min(times) for name, times in runs.items()}
            print(f"{fmt}: " + "; ".join(f"{name} {rows / best[name]:,.0f} rows/s (runs "
                                         f"{', '.join(f'{t:.1f}s' for t in times)})" for name, times in runs.items())
                  + f"; ratio {best[PLAIN] / best[WALBRIDGE]:.2f} (the statement alone {best[PLAIN] / best[STATEMENT]:.2f})")
    finally:
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
