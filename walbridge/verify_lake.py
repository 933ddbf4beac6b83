"""``walbridge verify`` against a Delta Lake target: does each shape's Delta
table equal ``SELECT <columns> FROM <table> WHERE <filter>`` at the source?

Method: the table is read with delta-rs (``deltalake``, its DataFusion
reader, which follows column mapping), not with the Spark that wrote it, and
compared row by row with the source, both sorted by key.

Invariants:
- Values are compared as the Delta column holds them: a column the decoder
  maps to a Spark string (``time``, ``json``, enums, wide ``numeric``, ...)
  is read from the source as its PostgreSQL text (``col::text``, but the
  string types as psycopg reads them: bpchar padded); other
  columns as typed values (timestamps as instants, numerics as decimals,
  ``real`` as 32-bit floats, NaN equal to NaN).
- Keyed shapes only (the Delta target applies keyed shapes only); the whole
  table is read, in the client's memory.
- Read-only on both sides; the source side is one REPEATABLE READ snapshot.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import pyarrow as pa
from psycopg import sql

from producer.catalog import TableInfo
from schemas.config import ShapeConfig
from spark_consumer.lake_progress import LakeProgress
from walbridge.shape_diff import ShapeDiff

try:  # the lake extra: pip install 'walbridge[lake]'
    from deltalake import DeltaTable, QueryBuilder
    from deltalake.exceptions import TableNotFoundError
except ImportError:  # pragma: no cover - said when a Delta target is verified
    DeltaTable = QueryBuilder = TableNotFoundError = None


# Types psycopg already reads as str (or lists of str), as the decoder writes them
# (bpchar keeps its padding, which ::text would strip): text, varchar, bpchar,
# name, and their arrays.
STRING_OIDS = frozenset({25, 1043, 1042, 19, 1009, 1015, 1014, 1003})


class MissingLakeReader(RuntimeError):
    """delta-rs is not installed."""


def lake_table(target_path: str, shape: ShapeConfig) -> str:
    """Where the consumer keeps the shape's Delta table."""
    return f"{target_path.rstrip('/')}/{shape.shape_name}"


def newest_record(path: str, group: str) -> LakeProgress | None:
    """The group's record in the table's newest commit that carries one (delta-rs's view)."""
    if DeltaTable is None:
        raise MissingLakeReader("reading a Delta target needs delta-rs: pip install 'walbridge[lake]'")
    try:
        history = DeltaTable(path).history()
    except TableNotFoundError:
        return None
    for commit in history:  # newest first
        record = LakeProgress.from_json(commit.get("userMetadata"), group)
        if record is not None:
            return record
    return None


def same_value(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(map(same_value, a, b))
    return a == b


def as_float32(row: tuple, at: list[int]) -> tuple:
    """The row with its ``real`` values as the 32-bit floats Delta holds
    (PostgreSQL's text of a ``real`` reads as the nearest double)."""
    row = list(row)
    for i in at:
        if row[i] is not None:
            row[i] = struct.unpack("f", struct.pack("f", row[i]))[0]
    return tuple(row)


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def verify_lake_shape(source, target_path: str, shape: ShapeConfig, info: TableInfo) -> ShapeDiff:
    if DeltaTable is None:
        raise MissingLakeReader("verifying a Delta target needs delta-rs: pip install 'walbridge[lake]'")
    path = lake_table(target_path, shape)
    diff = ShapeDiff(shape.shape_name, shape.table, path)
    columns = list(shape.columns) if shape.columns else [c.name for c in info.columns]
    keys = list(info.primary_key)
    diff.bucket_columns = keys
    if not keys:
        diff.error = "a shape without a key is not applied to Delta"
        return diff
    try:
        table = DeltaTable(path)
    except TableNotFoundError:
        diff.error = f"no Delta table at {path}"
        return diff
    fields = {f.name: f.type for f in pa.schema(table.schema())}
    absent = [c for c in columns if c not in fields]
    if absent:
        diff.error = f"the Delta table lacks columns {', '.join(absent)}"
        return diff
    names = ", ".join(f'"{c}"' for c in columns)
    lake = pa.table(QueryBuilder().register("t", table).execute(f"SELECT {names} FROM t").read_all())
    target_rows = [tuple(r.values()) for r in lake.to_pylist()]
    oids = {c.name: c.type_oid for c in info.columns}
    as_text = {c for c in columns if oids.get(c) not in STRING_OIDS and (_is_text(fields[c]) or (
        pa.types.is_list(fields[c]) and _is_text(fields[c].value_type)))}
    select = sql.SQL(", ").join(
        sql.SQL("{}::text{}").format(sql.Identifier(c), sql.SQL("[]" if pa.types.is_list(fields[c]) else ""))
        if c in as_text else sql.Identifier(c) for c in columns)
    query = sql.SQL("SELECT {} FROM {}").format(select, sql.Identifier(info.schema, info.name))
    if shape.where:
        query += sql.SQL(" WHERE ") + sql.SQL(shape.where)  # validated at config time (safe subset)
    singles = [i for i, c in enumerate(columns) if pa.types.is_float32(fields[c])]
    source_rows = [as_float32(r, singles) for r in source.execute(query)] if singles else \
        source.execute(query).fetchall()
    diff.source_rows, diff.target_rows = len(source_rows), len(target_rows)
    at = [columns.index(k) for k in keys]

    def key(row: tuple) -> Any:
        return row[at[0]] if len(at) == 1 else tuple(row[i] for i in at)

    src = {key(r): r for r in source_rows}
    tgt: dict[Any, tuple] = {}
    for r in target_rows:
        if key(r) in tgt:  # a key twice in the table: applied twice
            diff.extra.append(key(r))
        tgt[key(r)] = r
    diff.missing += [k for k in src if k not in tgt]
    diff.extra += [k for k in tgt if k not in src]
    diff.changed += [k for k, r in src.items() if k in tgt and not all(map(same_value, r, tgt[k]))]
    return diff
