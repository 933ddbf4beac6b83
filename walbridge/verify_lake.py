"""``walbridge verify`` against a lakehouse target: does each shape's table
equal ``SELECT <columns> FROM <table> WHERE <filter>`` at the source?

Method: the table is read with the format's own Python reader, not with the
Spark that wrote it: delta-rs (``deltalake``, its DataFusion reader, which
follows column mapping) for Delta, pyiceberg for Iceberg (a Hadoop catalog's
newest ``vN.metadata.json``, or the JDBC catalog's row through pyiceberg's
SQL catalog). Then it is compared row by row with the source.

Invariants:
- Values are compared as the lake's column holds them: a column the decoder
  maps to a Spark string (``time``, ``json``, enums, wide ``numeric``, ...)
  is read from the source as its PostgreSQL text (``col::text``, but the
  string types as psycopg reads them: bpchar padded); other
  columns as typed values (timestamps as instants, numerics as decimals,
  ``real`` as 32-bit floats, NaN equal to NaN).
- Keyed shapes are compared key by key (a key twice in the table is extra);
  keyless ones as multisets of rows (NaN equal to NaN). The whole table is
  read, in the client's memory.
- Read-only on both sides; the source side is one REPEATABLE READ snapshot.
"""

from __future__ import annotations

import math
import re
import struct
from collections import Counter
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

import pyarrow as pa
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from producer.catalog import TableInfo
from schemas import wire
from schemas.config import Config, IcebergConfig, ShapeConfig
from spark_consumer.lake_progress import LakeProgress
from walbridge.shape_diff import ShapeDiff

try:  # the lake extra: pip install 'walbridge[lake]'
    from deltalake import DeltaTable, QueryBuilder
    from deltalake.exceptions import TableNotFoundError
except ImportError:  # pragma: no cover - said when a Delta target is verified
    DeltaTable = QueryBuilder = TableNotFoundError = None
try:
    from pyiceberg.catalog.sql import SqlCatalog
    from pyiceberg.exceptions import NoSuchTableError
    from pyiceberg.table import StaticTable
except ImportError:  # pragma: no cover - said when an Iceberg target is verified
    SqlCatalog = NoSuchTableError = StaticTable = None


# Types psycopg already reads as str (or lists of str), as the decoder writes them
# (bpchar keeps its padding, which ::text would strip): text, varchar, bpchar,
# name, and their arrays.
STRING_OIDS = frozenset({25, 1043, 1042, 19, 1009, 1015, 1014, 1003})
_NAN = float("nan")  # every NaN of a keyless row as this one object: a Counter finds it by identity
_METADATA_VERSION = re.compile(r"v(\d+)\.metadata\.json$")


class MissingLakeReader(RuntimeError):
    """The format's Python reader is not installed."""


class MissingTable(LookupError):
    """The shape has no table in the lake (yet)."""


class LakeReader(Protocol):
    def where(self, shape: ShapeConfig) -> str:
        """The shape's table, for messages."""

    def read(self, shape: ShapeConfig, columns: list[str]) -> pa.Table:
        """The table's rows (those columns; all, when a column is missing);
        :class:`MissingTable` when there is none."""

    def newest_record(self, shape: ShapeConfig, group: str) -> LakeProgress | None:
        """The group's record in the newest commit that carries one."""


class DeltaReader:
    """A Delta target's tables, read with delta-rs."""

    def __init__(self, target_path: str):
        if DeltaTable is None:
            raise MissingLakeReader("reading a Delta target needs delta-rs: pip install 'walbridge[lake]'")
        self.root = target_path.rstrip("/")

    def where(self, shape: ShapeConfig) -> str:
        return f"{self.root}/{shape.shape_name}"

    def table(self, shape: ShapeConfig):
        try:
            return DeltaTable(self.where(shape))
        except TableNotFoundError:
            raise MissingTable(f"no Delta table at {self.where(shape)}") from None

    def read(self, shape: ShapeConfig, columns: list[str]) -> pa.Table:
        table = self.table(shape)
        have = set(pa.schema(table.schema()).names)
        names = ", ".join(f'"{c}"' for c in columns if c in have)
        return pa.table(QueryBuilder().register("t", table).execute(f"SELECT {names} FROM t").read_all())

    def newest_record(self, shape: ShapeConfig, group: str) -> LakeProgress | None:
        try:
            history = self.table(shape).history()
        except MissingTable:
            return None
        for commit in history:  # newest first
            record = LakeProgress.from_json(commit.get("userMetadata"), group)
            if record is not None:
                return record
        return None


class IcebergReader:
    """An Iceberg target's tables, read with pyiceberg."""

    def __init__(self, cfg: IcebergConfig):
        if StaticTable is None:
            raise MissingLakeReader("reading an Iceberg target needs pyiceberg: pip install 'walbridge[lake]'")
        self.cfg = cfg
        self._catalog = SqlCatalog(cfg.name, uri=sqlalchemy_url(cfg.catalog_dsn), init_catalog_tables="false") \
            if cfg.catalog == "jdbc" else None

    def where(self, shape: ShapeConfig) -> str:
        return f"{self.cfg.name}.{self.cfg.namespace}.`{shape.shape_name}`"

    def table(self, shape: ShapeConfig):
        if self._catalog is not None:
            try:
                return self._catalog.load_table((self.cfg.namespace, shape.shape_name))
            except NoSuchTableError:
                raise MissingTable(f"no Iceberg table {self.where(shape)}") from None
        location = f"{self.cfg.warehouse_uri.rstrip('/')}/{self.cfg.namespace.replace('.', '/')}/{shape.shape_name}"
        if location.startswith("file:"):  # the newest metadata file (the version hint is written after it)
            found = [(int(m.group(1)), f) for f in Path(urlparse(location).path, "metadata").glob("v*.metadata.json")
                     if (m := _METADATA_VERSION.search(f.name))]
            if not found:
                raise MissingTable(f"no Iceberg table {self.where(shape)} (nothing at {location})")
            return StaticTable.from_metadata(str(max(found)[1]))
        return StaticTable.from_metadata(location)

    def read(self, shape: ShapeConfig, columns: list[str]) -> pa.Table:
        table = self.table(shape)
        have = {f.name for f in table.schema().fields}
        return table.scan(selected_fields=tuple(c for c in columns if c in have)).to_arrow()

    def newest_record(self, shape: ShapeConfig, group: str) -> LakeProgress | None:
        try:
            table = self.table(shape)
        except MissingTable:
            return None
        snapshot = table.current_snapshot()
        while snapshot is not None:
            record = LakeProgress.from_json((snapshot.summary or {}).get(wire.ICEBERG_PROGRESS_PROPERTY), group)
            if record is not None:
                return record
            snapshot = table.snapshot_by_id(snapshot.parent_snapshot_id) \
                if snapshot.parent_snapshot_id is not None else None
        return None


def sqlalchemy_url(dsn: str) -> str:
    """A PostgreSQL DSN as SQLAlchemy's URL (psycopg 3), for pyiceberg's SQL catalog."""
    from sqlalchemy.engine import URL  # the lake extra

    info = conninfo_to_dict(dsn)
    return URL.create("postgresql+psycopg", username=info.get("user"), password=info.get("password"),
                      host=info.get("host") or "localhost", port=int(info.get("port") or 5432),
                      database=info.get("dbname")).render_as_string(hide_password=False)


def lake_reader(config: Config) -> LakeReader:
    """The reader of the configured lakehouse target."""
    if config.consumer.target_kind == "iceberg":
        return IcebergReader(config.consumer.iceberg)
    return DeltaReader(config.consumer.target_path)


def same_value(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(map(same_value, a, b))
    return a == b


def comparable(value: Any) -> Any:
    """A row as a hashable value that equals another row's when
    :func:`same_value` holds for each column (lists as tuples, NaN as one value)."""
    if isinstance(value, (list, tuple)):
        return tuple(map(comparable, value))
    if isinstance(value, float) and math.isnan(value):
        return _NAN
    return value


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


def verify_lake_shape(source, reader: LakeReader, shape: ShapeConfig, info: TableInfo) -> ShapeDiff:
    diff = ShapeDiff(shape.shape_name, shape.table, reader.where(shape))
    columns = list(shape.columns) if shape.columns else [c.name for c in info.columns]
    keys = list(info.primary_key)
    diff.bucket_columns = keys or columns
    diff.keyed = bool(keys)
    try:
        lake = reader.read(shape, columns)
    except MissingTable as e:
        diff.error = str(e)
        return diff
    fields = {f.name: f.type for f in lake.schema}
    absent = [c for c in columns if c not in fields]
    if absent:
        diff.error = f"the table lacks columns {', '.join(absent)}"
        return diff
    target_rows = [tuple(r[c] for c in columns) for r in lake.to_pylist()]
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
    if not keys:
        src_set, tgt_set = Counter(map(comparable, source_rows)), Counter(map(comparable, target_rows))
        diff.missing += [f"{row} ×{n}" for row, n in (src_set - tgt_set).items()]
        diff.extra += [f"{row} ×{n}" for row, n in (tgt_set - src_set).items()]
        return diff
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
