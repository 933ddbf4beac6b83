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
- Shape filters are compiled against what the catalog says (base types,
  collations, enums; :func:`filter_columns`) and the source itself
  (:func:`filter_source`: its default collation, encoding, and its own reading
  of each literal in the ``TimeZone`` its ordinary sessions get), so a filter
  either selects exactly what the source's ``WHERE`` would or is refused. A
  refused filter is a config problem (:data:`~schemas.failures.CONFIG`).
- Partitioned tables: the publication publishes through the partition root
  (``publish_via_partition_root = true``), so every change of every leaf,
  including leaves created or attached later, arrives under the root a shape
  names. A publication walbridge may not align that lacks the option (or a
  table) is refused, naming it and the fix, never used as is. A shape on a
  leaf works alone; a shape on a leaf *and* one on its root are refused, since
  PostgreSQL then publishes the leaf's changes only under the root.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import psycopg
from psycopg import sql

from producer.pgtypes import PgTypeInfo
from producer.schema_changes import CatalogFacts, ColumnFacts
from schemas.config import Config
from schemas.failures import CONFIG, SOURCE, Failure
from schemas.shape_filter import Collation, FilterColumn, FilterError, FilterSource, compile_filter


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
    config: bool = False  # a problem of the config itself (a refused filter), not of the source


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
    partitioned: bool = False  # a partitioned table (relkind p)
    is_partition: bool = False  # a partition of one
    # Tables it belongs to, nearest first: partition parents (pg_inherits) up
    # to the partition root, or INHERITS parents.
    ancestors: tuple[str, ...] = ()

    @property
    def qualified(self) -> str:
        return f"{self.schema}.{self.name}"

    @property
    def keyless(self) -> bool:
        return not self.primary_key


_TABLE_SQL = """
SELECT c.oid, c.relreplident::text, c.relkind::text, c.relispartition
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
    oid, identity, relkind, is_partition = row
    if relkind not in ("r", "p"):
        raise SourceError(f"{schema}.{table} is not a table (relkind {relkind!r}); only tables can be shapes")
    cols = tuple(TableColumn(*r) for r in conn.execute(_COLUMNS_SQL, (oid,)))
    key_row = conn.execute(_KEY_SQL, (oid,)).fetchone()
    ancestors = tuple(r[0] for r in conn.execute(_ANCESTORS_SQL, (oid,)))
    return TableInfo(oid, schema, table, cols, tuple(key_row[0]) if key_row else (), identity, relkind == "p",
                     is_partition, ancestors)


_FACTS_SQL = """
SELECT a.attnum, a.attname, a.atttypid::int, a.atttypmod, a.atthasmissing, a.atthasdef
FROM pg_attribute a
WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = ''
ORDER BY a.attnum
"""


def relation_facts(conn: psycopg.Connection, oid: int) -> CatalogFacts | None:
    """What the catalog says of relation ``oid`` now, for
    :mod:`producer.schema_changes`; None once it is dropped."""
    row = conn.execute("SELECT n.nspname, c.relname, c.relreplident::text FROM pg_class c "
                       "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = %s", (oid,)).fetchone()
    if row is None:
        return None
    schema, name, identity = row
    columns = tuple(ColumnFacts(*r) for r in conn.execute(_FACTS_SQL, (oid,)))
    key_row = conn.execute(_KEY_SQL, (oid,)).fetchone()
    return CatalogFacts(schema, name, columns, tuple(key_row[0]) if key_row else (), identity)


class CatalogReads:
    """The catalog as one step of the stream reads it (a Relation message,
    the plan of a table read whole): each relation's facts and each table's
    info asked once, however many parts of the step need them. Made anew
    for each step, so nothing read here outlives the step it was read for."""

    def __init__(self, conn: psycopg.Connection, known: Sequence[TableInfo] = ()):
        self._conn = conn
        self._facts: dict[int, CatalogFacts | None] = {}
        self._tables: dict[tuple[str, str], TableInfo | None] = {(t.schema, t.name): t for t in known}

    def facts(self, oid: int) -> CatalogFacts | None:
        """:func:`relation_facts`."""
        if oid not in self._facts:
            self._facts[oid] = relation_facts(self._conn, oid)
        return self._facts[oid]

    def table(self, schema: str, name: str) -> TableInfo | None:
        """:func:`table_info`."""
        if (schema, name) not in self._tables:
            self._tables[(schema, name)] = table_info(self._conn, schema, name)
        return self._tables[(schema, name)]


# Whether transaction ``xid`` (32 bits, as the stream gives it) is visible to
# a snapshot taken now: its 64-bit id from the epoch of the snapshot's xmax,
# one epoch back when the xid is above xmax's low half (it wrapped since).
_VISIBLE_SQL = """
SELECT pg_visible_in_snapshot(((((x >> 32) - (%(xid)s > (x & 4294967295))::int) << 32) | %(xid)s)::text::xid8, s)
FROM (SELECT s, pg_snapshot_xmax(s)::text::bigint AS x FROM pg_current_snapshot() AS s) AS now
"""


VISIBLE_TIMEOUT = 10.0  # seconds; a commit leaves the proc array within microseconds on a quiet server


def await_visible(conn: psycopg.Connection, xid: int, timeout: float = VISIBLE_TIMEOUT) -> bool:
    """Wait until transaction ``xid``, decoded from the stream, is visible to
    ``conn``'s next statements (False: not within ``timeout`` seconds).
    PostgreSQL flushes a commit record, which lets the walsender decode the
    transaction, a moment before other sessions' snapshots see it; a catalog
    read for its Relation message in that moment finds the schema from before
    its DDL."""
    deadline = time.monotonic() + timeout
    while not conn.execute(_VISIBLE_SQL, {"xid": xid}).fetchone()[0]:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def existing(conn: psycopg.Connection, oids: list[int]) -> set[int]:
    """Which of the relations ``oids`` exist (not dropped)."""
    return {r[0] for r in conn.execute("SELECT oid::int FROM pg_class WHERE oid = ANY(%s)", (oids,))}


# Partition parents and INHERITS parents alike, nearest first.
_ANCESTORS_SQL = """
WITH RECURSIVE up(relid, depth) AS (
    SELECT inhparent, 1 FROM pg_inherits WHERE inhrelid = %s
    UNION ALL
    SELECT i.inhparent, up.depth + 1 FROM pg_inherits i JOIN up ON i.inhrelid = up.relid
)
SELECT n.nspname || '.' || c.relname
FROM up JOIN pg_class c ON c.oid = up.relid JOIN pg_namespace n ON n.oid = c.relnamespace
ORDER BY up.depth
"""


def routed_to(ancestors: tuple[str, ...], shape_tables) -> tuple[str, ...]:
    """The shape tables among a relation's ``ancestors`` (nearest first): where
    its changes belong when they arrive under its own name (a partition
    published without ``publish_via_partition_root``, an INHERITS child),
    since a SELECT of each of them reads its rows."""
    return tuple(a for a in ancestors if a in shape_tables)


_TYPE_SQL = """
SELECT t.typtype::text, t.typbasetype::int, t.typtypmod, t.typelem::int, t.typcategory::text,
       e.typtype::text, format_type(t.oid, %s)
FROM pg_type t LEFT JOIN pg_type e ON e.oid = t.typelem
WHERE t.oid = %s
"""


class TypeCache:
    """Type facts (:func:`type_info`) by (oid, typmod), each read from the catalog once."""

    def __init__(self, conn: psycopg.Connection):
        self._conn = conn
        self._known: dict[tuple[int, int], PgTypeInfo] = {}

    def __call__(self, oid: int, typmod: int) -> PgTypeInfo:
        info = self._known.get((oid, typmod))
        if info is None:
            info = self._known[(oid, typmod)] = type_info(self._conn, oid, typmod)
        return info


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


_FILTER_COLUMNS_SQL = """
SELECT a.attname, a.atttypid::int, a.atttypmod, a.attcollation::int, to_jsonb(co)
FROM pg_attribute a LEFT JOIN pg_collation co ON co.oid = a.attcollation
WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = ''
ORDER BY a.attnum
"""
_DEFAULT_COLLATION = 100  # pg_collation's "default": the database's own


def _collation(row: dict, name: str) -> Collation:
    """A pg_collation or pg_database row (as JSON; the column names moved
    between PostgreSQL 15 and 17) as a :class:`Collation`."""
    prefix = "coll" if "collname" in row else "dat"
    provider = row.get(f"{prefix}provider") or row.get("datlocprovider") or "c"
    locale = row.get(f"{prefix}iculocale") or row.get(f"{prefix}locale") or ""
    collate, ctype = row.get(f"{prefix}collate") or "", row.get(f"{prefix}ctype") or ""
    return Collation(name, provider, locale if provider != "c" else collate, ctype,
                     row.get("collisdeterministic", True))


def default_collation(conn: psycopg.Connection) -> Collation:
    row = conn.execute("SELECT to_jsonb(d) FROM pg_database d WHERE datname = current_database()").fetchone()[0]
    return _collation(row, "default")


def filter_columns(conn: psycopg.Connection, oid: int) -> dict[str, FilterColumn]:
    """What a shape filter on relation ``oid`` needs of each column: its base
    type (domains resolved), its collation (``default`` resolved to the
    database's) and whether it is an enum."""
    default = None
    out = {}
    for name, type_oid, typmod, coll_oid, coll in conn.execute(_FILTER_COLUMNS_SQL, (oid,)).fetchall():
        info = type_info(conn, type_oid, typmod)
        collation = None
        if coll_oid == _DEFAULT_COLLATION:
            default = default or default_collation(conn)
            collation = default
        elif coll is not None:
            collation = _collation(coll, coll["collname"])
        cast_type = conn.execute("SELECT format_type(%s, NULL)", (info.base_oid,)).fetchone()[0]
        out[name] = FilterColumn(info.base_name, collation, info.kind == "e", cast_type)
    return out


def filter_source(conn: psycopg.Connection, dsn: str) -> FilterSource:
    """The source as shape filters see it. Literals are read in the
    ``TimeZone`` an ordinary session of this role gets (server, database and
    role settings), which walbridge's own sessions override with UTC; it is
    read once, from a connection without walbridge's options."""
    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as plain:
            timezone = plain.execute("SHOW TimeZone").fetchone()[0]
    except psycopg.Error as e:
        raise SourceError(f"cannot read the source's TimeZone for the shape filters: {e}") from None
    encoding = conn.execute("SHOW server_encoding").fetchone()[0]
    return FilterSource(literal_reader(conn, timezone), default_collation(conn), encoding)


def literal_reader(conn: psycopg.Connection, timezone: str) -> Callable[[Sequence[str], Sequence[str]], list[str]]:
    """``FilterSource.cast`` on ``conn``: the source's input functions read
    each literal, in ``timezone``; the ISO text of the value comes back."""
    cache: dict[tuple, list[str]] = {}

    def cast(texts: Sequence[str], types: Sequence[str]) -> list[str]:
        key = (tuple(texts), tuple(types))
        if key not in cache:
            expr: sql.Composable = sql.SQL("u.x")
            try:
                with conn.transaction():
                    for t in types:
                        name = conn.execute("SELECT format_type(to_regtype(%s), NULL)", (t,)).fetchone()[0]
                        if name is None:
                            raise ValueError(f"type {t} does not exist")
                        expr = sql.SQL("CAST({} AS {})").format(expr, sql.SQL(name))  # a name the server printed
                    conn.execute("SELECT set_config('TimeZone', %s, true)", (timezone,))
                    query = sql.SQL("SELECT ({})::text FROM unnest(%s::text[]) WITH ORDINALITY AS u(x, i) "
                                    "ORDER BY u.i").format(expr)
                    cache[key] = [r[0] for r in conn.execute(query, (list(texts),))]
            except psycopg.Error as e:
                raise ValueError(e.diag.message_primary or str(e)) from None
        return cache[key]

    return cast


@dataclass(frozen=True)
class PublicationPlan:
    full_tables: tuple[str, ...]  # INSERT/UPDATE/DELETE/TRUNCATE
    insert_only_tables: tuple[str, ...]
    partitioned: tuple[str, ...] = ()  # of those, partitioned tables: published through their root


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
    return PublicationPlan(tuple(sorted(set(full))), tuple(sorted(set(inserts))),
                           tuple(sorted({t.qualified for t in tables if t.partitioned})))


_IDENTITY = {"d": "default", "n": "nothing", "f": "full", "i": "using index"}


def inspect_source(conn: psycopg.Connection, config: Config, source: FilterSource | None = None
                   ) -> tuple[dict[str, TableInfo], list[Finding]]:
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
        roots = routed_to(info.ancestors, {s.table for s in config.shapes}) if info.is_partition else ()
        if roots:
            findings.append(Finding(f"{where}.table", False, f"{shape.table} is a partition of {roots[-1]}, which "
                                    "a shape names too: PostgreSQL publishes a partition's changes once, under "
                                    f"its root, so this shape would receive nothing (drop it and give the shape on "
                                    f"{roots[-1]} a where filter, or use a second walbridge with its own "
                                    "publication for the partition)"))
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
            source = source or filter_source(conn, config.source.dsn)
            try:
                compile_filter(shape.where, filter_columns(conn, info.oid), shape=shape.shape_name, source=source)
            except FilterError as e:
                findings.append(Finding(f"{where}.where", False, str(e), config=True))
        has_select = conn.execute("SELECT has_table_privilege(%s, 'SELECT')", (info.oid,)).fetchone()[0]
        if not has_select:
            findings.append(Finding(f"{where}.table", False, f"the connecting role cannot SELECT from "
                                    f"{shape.table} (needed for the snapshot; GRANT SELECT ON {shape.table} "
                                    f"TO {user})"))
    return tables, findings


def check_source(conn: psycopg.Connection, config: Config, source: FilterSource | None = None
                 ) -> dict[str, TableInfo]:
    """Validate the shapes against the live catalog; returns table infos by
    ``schema.table``. Read-only; raises a :data:`CONFIG` failure for refused
    filters (one line each), else :class:`SourceError` naming every problem."""
    tables, findings = inspect_source(conn, config, source)
    refused = [f.detail for f in findings if f.config]
    if refused:
        raise Failure(CONFIG, "\n".join(refused))
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
    """Create or align the publication(s); returns the publication names to
    stream. Every one publishes through partition roots. One the role may not
    alter (another role owns it) is used as it is if it serves the plan, else
    refused with what it lacks."""
    names = []
    for pub, tables, publish in ((name, plan.full_tables, PUBLISH_FULL),
                                 (f"{name}_inserts", plan.insert_only_tables, ("insert",))):
        if not tables:
            continue
        ident = sql.Identifier(pub)
        options = sql.SQL("publish = {}, publish_via_partition_root = true").format(sql.Literal(", ".join(publish)))
        table_list = sql.SQL(", ").join(_table_ident(t) for t in tables)
        owned = conn.execute("SELECT pg_has_role(pubowner, 'USAGE') FROM pg_publication WHERE pubname = %s",
                             (pub,)).fetchone()
        if owned is None:
            conn.execute(sql.SQL("CREATE PUBLICATION {} FOR TABLE {} WITH ({})").format(ident, table_list, options))
        elif owned[0]:
            conn.execute(sql.SQL("ALTER PUBLICATION {} SET TABLE {}").format(ident, table_list))
            conn.execute(sql.SQL("ALTER PUBLICATION {} SET ({})").format(ident, options))
        else:
            lacks = publication_gaps(_published(conn, pub), tables, publish, plan.partitioned)
            if lacks:
                raise SourceError(
                    f"publication {pub} exists, belongs to another role (so walbridge may not align it) and "
                    f"{'; '.join(lacks)}",
                    f"as its owner run ALTER PUBLICATION {pub} SET TABLE {', '.join(tables)}; ALTER PUBLICATION "
                    f"{pub} SET (publish = '{', '.join(publish)}', publish_via_partition_root = true); "
                    "or set [source] publication to a name walbridge may create")
        names.append(pub)
    return names


PUBLISH_FULL = ("insert", "update", "delete", "truncate")


@dataclass(frozen=True)
class Published:
    """What an existing publication publishes."""

    all_tables: bool
    via_root: bool
    actions: frozenset[str]
    tables: frozenset[str]  # named in it (pg_publication_rel)


def _published(conn: psycopg.Connection, pub: str) -> Published:
    all_tables, via_root, ins, upd, dele, trunc = conn.execute(
        "SELECT puballtables, pubviaroot, pubinsert, pubupdate, pubdelete, pubtruncate FROM pg_publication "
        "WHERE pubname = %s", (pub,)).fetchone()
    tables = conn.execute(
        "SELECT n.nspname || '.' || c.relname FROM pg_publication p JOIN pg_publication_rel r ON r.prpubid = p.oid "
        "JOIN pg_class c ON c.oid = r.prrelid JOIN pg_namespace n ON n.oid = c.relnamespace WHERE p.pubname = %s",
        (pub,)).fetchall()
    actions = frozenset(a for a, on in zip(PUBLISH_FULL, (ins, upd, dele, trunc)) if on)
    return Published(all_tables, via_root, actions, frozenset(t for (t,) in tables))


def publication_gaps(published: Published, tables: tuple[str, ...], publish: tuple[str, ...],
                     partitioned: tuple[str, ...]) -> list[str]:
    """What an existing publication lacks to serve ``tables`` with ``publish``
    (empty: it serves them). A partitioned table needs
    ``publish_via_partition_root``: without it its changes arrive under each
    leaf's name."""
    lacks = []
    missing = [t for t in tables if not published.all_tables and t not in published.tables]
    if missing:
        lacks.append(f"does not publish {', '.join(missing)}")
    actions = [a for a in publish if a not in published.actions]
    if actions:
        lacks.append(f"does not publish {', '.join(actions)}")
    roots = [t for t in tables if t in partitioned]
    if roots and not published.via_root:
        lacks.append(f"lacks publish_via_partition_root = true, which the partitioned table(s) {', '.join(roots)} "
                     "need (without it their changes arrive under each partition's name)")
    return lacks


def row_estimate(conn: psycopg.Connection, table: TableInfo) -> int:
    """Rows to expect in ``table``: the planner's estimate, or a count for small
    never-analysed tables (for progress and ETA only). A partitioned table
    holds no rows itself: its leaves' estimates add up."""
    if table.partitioned:
        reltuples, size = conn.execute(
            "SELECT sum(greatest(c.reltuples, 0))::bigint, coalesce(sum(pg_relation_size(c.oid)), 0) "
            "FROM pg_partition_tree(%s) t JOIN pg_class c ON c.oid = t.relid WHERE t.isleaf",
            (table.oid,)).fetchone()
        reltuples = reltuples if reltuples else -1
    else:
        reltuples, size = conn.execute(
            "SELECT reltuples::bigint, pg_relation_size(oid) FROM pg_class WHERE oid = %s", (table.oid,)).fetchone()
    if reltuples >= 0:
        return reltuples
    if size < 64 * 1024 * 1024:
        return conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table.schema, table.name))
                            ).fetchone()[0]
    return size // 100


def slot_state(conn: psycopg.Connection, slot: str) -> dict | None:
    """The slot as ``pg_replication_slots`` shows it (None: no such slot);
    ``failover`` and ``synced`` (PostgreSQL 17+) are false before 17."""
    row = conn.execute(
        """SELECT plugin, slot_type, database, active, active_pid, confirmed_flush_lsn::text,
                  restart_lsn::text, pg_current_wal_lsn()::text,
                  pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint, temporary,
                  coalesce((to_jsonb(s) ->> 'failover')::bool, false),
                  coalesce((to_jsonb(s) ->> 'synced')::bool, false)
           FROM pg_replication_slots s WHERE slot_name = %s""", (slot,)).fetchone()
    if row is None:
        return None
    keys = ("plugin", "slot_type", "database", "active", "active_pid", "confirmed_flush_lsn",
            "restart_lsn", "current_wal_lsn", "retained_wal_bytes", "temporary", "failover", "synced")
    return dict(zip(keys, row))


def standby_slots(conn: psycopg.Connection) -> tuple[list[str], list[str]]:
    """On a primary: the physical slots standbys stream through, and those
    ``synchronized_standby_slots`` names (PostgreSQL 17+; empty before)."""
    physical = [r[0] for r in conn.execute(
        "SELECT slot_name FROM pg_replication_slots WHERE slot_type = 'physical' ORDER BY slot_name")]
    setting = conn.execute("SELECT current_setting('synchronized_standby_slots', true)").fetchone()[0] or ""
    return physical, [s.strip() for s in setting.split(",") if s.strip()]
