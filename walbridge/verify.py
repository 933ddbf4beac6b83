"""``walbridge verify``: does each shape's target table equal
``SELECT <columns> FROM <table> WHERE <filter>`` at the source? (A Delta
target: :mod:`walbridge.verify_lake`; below, a PostgreSQL one.)

Method (the self-correcting sink's eye, seed 004): compare counts, then a hash
per key bucket, then — only inside buckets that differ — the keys themselves.

Invariants:
- Nothing is loaded into client memory but per-bucket aggregates and the keys
  of differing buckets: both databases compute, in one streaming GROUP BY each,
  ``count(*)`` and the sum of a 64-bit hash of each row's text per bucket, where
  the bucket is a hash of the key's text. Sums are order-independent, so no sort.
- Rows are compared by their PostgreSQL text form with identical session
  settings on both sides (UTC, ISO dates, full float precision); the target
  holds the same types as the source (enums as text, which print the same).
- Keyless shapes are compared as multisets of rows (the bucket is the row hash).
- Buckets are :mod:`schemas.buckets`' (``ShapeDiff.differing``), the very
  scope ``reconcile`` backfills and the consumer garbage-collects.
- Read-only on both sides.
- A database error names the side it came from (source or target, DSN
  redacted), as a :class:`~schemas.failures.Failure`.
"""

from __future__ import annotations

from collections import Counter

import psycopg
from psycopg import sql

from producer.catalog import TableInfo, table_info
from producer.replication import connect
from schemas import buckets, wire
from schemas.config import Config, ConfigError, ShapeConfig
from schemas.failures import SOURCE, TARGET, attributed
from walbridge.shape_diff import ShapeDiff
from walbridge.verify_lake import lake_reader, verify_lake_shape

MAX_KEYS_SHOWN = 20
__all__ = ["ShapeDiff", "as_json", "verify", "verify_shape"]


def _select(schema: str, table: str, columns: list[str], where: str | None) -> sql.Composable:
    q = sql.SQL("SELECT {} FROM {}").format(sql.SQL(", ").join(sql.Identifier(c) for c in columns),
                                            sql.Identifier(schema, table))
    if where:
        q += sql.SQL(" WHERE ") + sql.SQL(where)  # validated at config time (safe subset)
    return q


def _bucket_query(rows: sql.Composable, bucket_columns: list[str], n: int) -> sql.Composable:
    return sql.SQL(
        "SELECT {b} AS b, count(*), sum(hashtextextended(r::text, 0)::numeric) FROM ({rows}) r GROUP BY 1"
    ).format(b=buckets.bucket_of(bucket_columns, n, "r"), rows=rows)


def _keys_query(rows: sql.Composable, bucket_columns: list[str], n: int, which: list[int]) -> sql.Composable:
    scope = {"columns": bucket_columns, "bucket_count": n, "buckets": which}
    return sql.SQL("SELECT {key}, hashtextextended(r::text, 0) FROM ({rows}) r WHERE {cond}").format(
        key=buckets.row_text(bucket_columns, "r"), rows=rows, cond=buckets.in_scope(scope, "r"))


def verify_shape(source: psycopg.Connection, target: psycopg.Connection, shape: ShapeConfig,
                 info: TableInfo) -> ShapeDiff:
    t_schema, t_table = wire.target_table(shape.shape_name)
    diff = ShapeDiff(shape.shape_name, shape.table, f"{t_schema}.{t_table}")
    columns = list(shape.columns) if shape.columns else [c.name for c in info.columns]
    keys = list(info.primary_key)
    # Keyless shapes are multisets: a row's bucket is its whole content.
    diff.bucket_columns = bucket_columns = keys or columns
    diff.keyed = bool(keys)
    if table_info(target, t_schema, t_table) is None:
        diff.error = f"target table {t_schema}.{t_table} does not exist"
        return diff
    src_rows = _select(info.schema, info.name, columns, shape.where)
    tgt_rows = _select(t_schema, t_table, columns, None)
    diff.source_rows = source.execute(sql.SQL("SELECT count(*) FROM ({}) r").format(src_rows)).fetchone()[0]
    diff.target_rows = target.execute(sql.SQL("SELECT count(*) FROM ({}) r").format(tgt_rows)).fetchone()[0]
    diff.buckets = n = max(64, min(65536, max(diff.source_rows, diff.target_rows) // 2000))
    src_b = {b: (c, h) for b, c, h in source.execute(_bucket_query(src_rows, bucket_columns, n))}
    tgt_b = {b: (c, h) for b, c, h in target.execute(_bucket_query(tgt_rows, bucket_columns, n))}
    differing = sorted(b for b in set(src_b) | set(tgt_b) if src_b.get(b) != tgt_b.get(b))
    diff.differing_buckets = len(differing)
    diff.differing = differing
    for i in range(0, len(differing), 256):
        which = differing[i:i + 256]
        src_k = dict(source.execute(_keys_query(src_rows, bucket_columns, n, which)).fetchall()) if keys else None
        tgt_k = dict(target.execute(_keys_query(tgt_rows, bucket_columns, n, which)).fetchall()) if keys else None
        if keys:
            diff.missing += sorted(set(src_k) - set(tgt_k))
            diff.extra += sorted(set(tgt_k) - set(src_k))
            diff.changed += sorted(k for k in set(src_k) & set(tgt_k) if src_k[k] != tgt_k[k])
        else:
            s = Counter(r[1] for r in source.execute(_keys_query(src_rows, bucket_columns, n, which)))
            t = Counter(r[1] for r in target.execute(_keys_query(tgt_rows, bucket_columns, n, which)))
            diff.missing += [f"row hash {h} ×{c}" for h, c in (s - t).items()]
            diff.extra += [f"row hash {h} ×{c}" for h, c in (t - s).items()]
    return diff


class _Side:
    """A connection whose errors name their endpoint (``execute`` is all verify uses)."""

    def __init__(self, endpoint: str, dsn: str):
        self._where = (endpoint, dsn)
        with attributed(database=self._where):
            self.conn = connect(dsn)
            # One snapshot per side for the whole comparison.
            self.conn.autocommit = False
            self.conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")

    def execute(self, *args, **kwargs):
        with attributed(database=self._where):
            return self.conn.execute(*args, **kwargs)


def verify(config: Config, shapes: list[str] | None = None) -> list[ShapeDiff]:
    """Each configured shape (or those named) compared with its target table."""
    kind = config.consumer.target_kind
    if kind is None:
        raise ConfigError(["consumer.target_dsn: is required to verify (the database the consumer applies to), "
                           'unless target = "delta" or "iceberg" names a lakehouse'])
    out = []
    source = _Side(SOURCE, config.source.dsn)
    target = _Side(TARGET, config.consumer.target_dsn) if kind == "postgresql" else None
    try:
        lake = lake_reader(config) if target is None else None  # no reader installed: the connections close
        for shape in config.shapes:
            if shapes and shape.shape_name not in shapes:
                continue
            info = table_info(source, shape.schema_name, shape.table_name)
            if info is None:
                out.append(ShapeDiff(shape.shape_name, shape.table, "-", error=f"source table {shape.table} "
                                     "does not exist"))
            elif target is None:
                out.append(verify_lake_shape(source, lake, shape, info))
            else:
                out.append(verify_shape(source, target, shape, info))
    finally:
        source.conn.close()
        if target is not None:
            target.conn.close()
    return out


def as_json(diffs: list[ShapeDiff]) -> list[dict]:
    return [{"shape": d.shape, "source_table": d.source_table, "target_table": d.target_table,
             "source_rows": d.source_rows, "target_rows": d.target_rows, "buckets": d.buckets,
             "differing_buckets": d.differing_buckets, "missing": d.missing[:MAX_KEYS_SHOWN],
             "extra": d.extra[:MAX_KEYS_SHOWN], "changed": d.changed[:MAX_KEYS_SHOWN],
             "missing_count": len(d.missing), "extra_count": len(d.extra), "changed_count": len(d.changed),
             "ok": d.ok, "error": d.error} for d in diffs]
