"""Catalog reads and the source-side set-up: tables, keys, types, publication
and slot checks. A thin I/O shell; the decisions it makes are spelled out in
:func:`plan_publication`.

Invariants:
- :func:`inspect_source` and :func:`check_source` read only; they run before
  anything is created, and every problem they find names the shape, table or
  column concerned and says how to fix it. ``check-config --live`` prints the
  same findings as a checklist.
- Their problems are permanent failures (:class:`~schemas.failures.Failure`) of the
  source: retrying cannot fix a missing table or privilege.
- A table without a primary key whose replica identity is DEFAULT is never added
  to a publication that publishes UPDATE/DELETE: PostgreSQL would then reject the
  application's own UPDATE and DELETE on it. Depending on
  ``[source] keyless_tables`` walbridge refuses (default) or publishes only its
  inserts through a second, insert-only publication ``<publication>_inserts``.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg
from psycopg import sql

from producer.pgtypes import PgTypeInfo
from schemas.config import Config
from schemas.failures import SOURCE, Failure
from schemas.shape_filter import FilterError, compile_filter


class SourceError(Failure):
    """The source database cannot serve the configuration as it stands
    (permanent: a change of the database or the config fixes it)."""

    def __init__(self, problem: str, fix: str | None = None):
        super().__init__(SOURCE, problem, fix)


@dataclass(frozen=True)
class Finding:
    """One item of what the source was checked for."""

    item: str  # e.g. "wal_level", "shapes[0] (public.orders).columns"
    ok: bool
    detail: str


@dataclass(frozen=True)
class TableColumn:
    name: str
    type_oid: int
    typmod: int
    type_name: str
    not_null: bool


@dataclass(frozen=True)
class TableInfo:
    oid: int
    schema: str
    name: str
    columns: tuple[TableColumn, ...]
    primary_key: tuple[str, ...]  # or the replica-identity index columns
    replica_identity: str  # d, n, f, i

    @property
    def qualified(self) -> str:
        return f"{self.schema}.{self.name}"

    @property
    def keyless(self) -> bool:
        return not self.primary_key


_TABLE_SQL = """
SELECT c.oid, c.relreplident::text, c.relkind::text
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = %s AND c.relname = %s
"""
_COLUMNS_SQL = """
SELECT a.attname, a.atttypid::int, a.atttypmod, format_type(a.atttypid, a.atttypmod), a.attnotnull
FROM pg_attribute a
WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = ''
ORDER BY a.attnum
"""
# Primary key first; else the replica identity index (REPLICA IDENTITY USING INDEX).
_KEY_SQL = """
SELECT array_agg(a.attname ORDER BY k.ord)
FROM pg_index i
CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord)
JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
WHERE i.indrelid = %s AND (i.indisprimary OR i.indisreplident)
GROUP BY i.indexrelid, i.indisprimary
ORDER BY i.indisprimary DESC
LIMIT 1
"""


def table_info(conn: psycopg.Connection, schema: str, table: str) -> TableInfo | None:
    row = conn.execute(_TABLE_SQL, (schema, table)).fetchone()
    if row is None:
        return None
    oid, identity, relkind = row
    if relkind not in ("r", "p"):
        raise SourceError(f"{schema}.{table} is not a table (relkind {relkind!r}); only tables can be shapes")
    cols = tuple(TableColumn(*r) for r in conn.execute(_COLUMNS_SQL, (oid,)))
    key_row = conn.execute(_KEY_SQL, (oid,)).fetchone()
    return TableInfo(oid, schema, table, cols, tuple(key_row[0]) if key_row else (), identity)


_TYPE_SQL = """
SELECT t.typtype::text, t.typbasetype::int, t.typtypmod, t.typelem::int, t.typcategory::text,
       e.typtype::text, format_type(t.oid, %s)
FROM pg_type t LEFT JOIN pg_type e ON e.oid = t.typelem
WHERE t.oid = %s
"""


def type_info(conn: psycopg.Connection, oid: int, typmod: int) -> PgTypeInfo:
    """Resolve domains (possibly stacked) down to their base type."""
    row = conn.execute(_TYPE_SQL, (typmod, oid)).fetchone()
    if row is None:
        raise SourceError(f"type oid {oid} not found in pg_type")
    name = row[6]
    base_oid, base_typmod = oid, typmod
    while row[0] == "d":
        base_oid, base_typmod = row[1], row[2]
        row = conn.execute(_TYPE_SQL, (base_typmod, base_oid)).fetchone()
    kind, _, _, elem, category, elem_kind, base_name = row
    is_array = category == "A" and elem != 0
    return PgTypeInfo(
        oid=oid, name=name, base_oid=base_oid, base_name=base_name, base_typmod=base_typmod,
        kind=kind, elem_oid=elem if is_array else 0, elem_kind=(elem_kind or "") if is_array else "",
        elem_typmod=base_typmod if is_array else -1,
    )


@dataclass(frozen=True)
class PublicationPlan:
    full_tables: tuple[str, ...]  # INSERT/UPDATE/DELETE/TRUNCATE
    insert_only_tables: tuple[str, ...]


def plan_publication(tables: list[TableInfo], keyless_policy: str) -> PublicationPlan:
    """Which tables go to the full publication and which to the insert-only one.
    Raises :class:`SourceError` for keyless tables under the ``refuse`` policy."""
    full, inserts = [], []
    refused = []
    for t in tables:
        if t.keyless and t.replica_identity in ("d", "n"):
            if keyless_policy == "inserts_only":
                inserts.append(t.qualified)
            else:
                refused.append(t.qualified)
        else:
            full.append(t.qualified)
    if refused:
        raise SourceError(
            f"table(s) {', '.join(refused)} have no primary key and REPLICA IDENTITY DEFAULT: publishing "
            "their UPDATE/DELETE would make PostgreSQL reject the application's own UPDATE/DELETE on them. "
            "Either run ALTER TABLE ... REPLICA IDENTITY FULL (updates and deletes then flow, keyed by the "
            "whole row), or set [source] keyless_tables = \"inserts_only\" to stream only their inserts.")
    return PublicationPlan(tuple(sorted(set(full))), tuple(sorted(set(inserts))))


_IDENTITY = {"d": "default", "n": "nothing", "f": "full", "i": "using index"}


def inspect_source(conn: psycopg.Connection, config: Config) -> tuple[dict[str, TableInfo], list[Finding]]:
    """What the live catalog says of the config: table infos by
    ``schema.table`` and one finding per thing checked. Read-only."""
    findings: list[Finding] = []
    wal_level = conn.execute("SHOW wal_level").fetchone()[0]
    findings.append(Finding("wal_level", wal_level == "logical", f"wal_level is {wal_level!r}" + (
        "" if wal_level == "logical" else "; logical replication needs wal_level = logical "
        "(ALTER SYSTEM SET wal_level = logical; then restart PostgreSQL)")))
    user, can_replicate = conn.execute(
        "SELECT rolname, rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user").fetchone()
    findings.append(Finding("REPLICATION", can_replicate, f"role {user} may replicate" if can_replicate else
                            f"role {user} lacks the REPLICATION attribute (ALTER ROLE {user} WITH REPLICATION)"))
    tables: dict[str, TableInfo] = {}
    for i, shape in enumerate(config.shapes):
        where = f"shapes[{i}] ({shape.shape_name})"
        info = tables.get(shape.table) or table_info(conn, shape.schema_name, shape.table_name)
        if info is None:
            findings.append(Finding(f"{where}.table", False, f"table {shape.table} does not exist "
                                    "(create it, or correct the shape's table)"))
            continue
        tables[shape.table] = info
        key = ", ".join(info.primary_key) or "none"
        findings.append(Finding(f"{where}.table", True, f"{shape.table}: key ({key}), replica identity "
                                f"{_IDENTITY.get(info.replica_identity, info.replica_identity)}, "
                                f"{len(info.columns)} columns"))
        known = [c.name for c in info.columns]
        if shape.columns is not None:
            missing = [c for c in shape.columns if c not in known]
            if missing:
                findings.append(Finding(f"{where}.columns", False, f"{', '.join(missing)} not in {shape.table} "
                                        f"(columns: {', '.join(known)})"))
            lacking_key = [k for k in info.primary_key if k not in shape.columns]
            if lacking_key:
                findings.append(Finding(f"{where}.columns", False, f"must include the primary key column(s) "
                                        f"{', '.join(lacking_key)} of {shape.table}"))
        if shape.where is not None:
            try:
                compile_filter(shape.where, {c.name: c.type_name for c in info.columns})
            except FilterError as e:
                findings.append(Finding(f"{where}.where", False, str(e)))
        has_select = conn.execute("SELECT has_table_privilege(%s, 'SELECT')", (info.oid,)).fetchone()[0]
        if not has_select:
            findings.append(Finding(f"{where}.table", False, f"the connecting role cannot SELECT from "
                                    f"{shape.table} (needed for the snapshot; GRANT SELECT ON {shape.table} "
                                    f"TO {user})"))
    return tables, findings


def check_source(conn: psycopg.Connection, config: Config) -> dict[str, TableInfo]:
    """Validate the shapes against the live catalog; returns table infos by
    ``schema.table``. Read-only; raises :class:`SourceError` naming every problem."""
    tables, findings = inspect_source(conn, config)
    problems = [f for f in findings if not f.ok]
    if problems:
        raise SourceError("the source database does not match the config:\n"
                          + "\n".join(f"  - {p.item}: {p.detail}" for p in problems))
    plan_publication(list(tables.values()), config.source.keyless_tables)
    return tables


def _table_ident(qualified: str) -> sql.Composable:
    schema, name = qualified.split(".", 1)
    return sql.Identifier(schema, name)


def ensure_publications(conn: psycopg.Connection, name: str, plan: PublicationPlan) -> list[str]:
    """Create or align the publication(s); returns the publication names to stream."""
    names = []
    for pub, tables, publish in ((name, plan.full_tables, "insert, update, delete, truncate"),
                                 (f"{name}_inserts", plan.insert_only_tables, "insert")):
        exists = conn.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (pub,)).fetchone()
        if not tables:
            continue
        table_list = sql.SQL(", ").join(_table_ident(t) for t in tables)
        if exists:
            conn.execute(sql.SQL("ALTER PUBLICATION {} SET TABLE {}").format(sql.Identifier(pub), table_list))
            conn.execute(sql.SQL("ALTER PUBLICATION {} SET (publish = {})").format(
                sql.Identifier(pub), sql.Literal(publish)))
        else:
            conn.execute(sql.SQL("CREATE PUBLICATION {} FOR TABLE {} WITH (publish = {})").format(
                sql.Identifier(pub), table_list, sql.Literal(publish)))
        names.append(pub)
    return names


def row_estimate(conn: psycopg.Connection, table: TableInfo) -> int:
    """Rows to expect in ``table``: the planner's estimate, or a count for small
    never-analysed tables (for progress and ETA only)."""
    reltuples, size = conn.execute(
        "SELECT reltuples::bigint, pg_relation_size(oid) FROM pg_class WHERE oid = %s", (table.oid,)).fetchone()
    if reltuples >= 0:
        return reltuples
    if size < 64 * 1024 * 1024:
        return conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table.schema, table.name))
                            ).fetchone()[0]
    return size // 100


def slot_state(conn: psycopg.Connection, slot: str) -> dict | None:
    row = conn.execute(
        """SELECT plugin, slot_type, database, active, active_pid, confirmed_flush_lsn::text,
                  restart_lsn::text, pg_current_wal_lsn()::text,
                  pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint
           FROM pg_replication_slots WHERE slot_name = %s""", (slot,)).fetchone()
    if row is None:
        return None
    keys = ("plugin", "slot_type", "database", "active", "active_pid", "confirmed_flush_lsn",
            "restart_lsn", "current_wal_lsn", "retained_wal_bytes")
    return dict(zip(keys, row))

