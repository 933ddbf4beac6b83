"""What the stream does when a shape table's schema changes: the shell around
the pure :mod:`producer.schema_changes`.

The path: a shape table's Relation message (``SchemaFollower.relation``, before
the stream plans the relation again) → the catalog's facts read now
(``catalog.relation_facts``) → ``classify`` against the relation as the stream
last planned it — or, before the table's first change in the stream, as the
run's initial snapshot read it (``start_from``), or, in a run resumed from
its slot, as the table's shapes last published it (``resume_from``,
``schema_changes.resumed``); only the table's name (``first_sight``) when
none is known → ``consequences`` → one
INFO line per shape, a backfill of each shape whose rows changed without a
change in the WAL, the aliases of renamed columns for the next plan, and
``stop`` for a shape that cannot follow. Between bursts, ``poll`` notices a
dropped shape table (DROP TABLE leaves nothing in the WAL).

Invariants:
- A stopped shape is never silently filtered: it is left out of every later
  plan (nothing more is produced to it), it holds WAL from its first
  unpublished change (``Acks.hold``; ``[ack] on_stall = "drop"`` lets go), it
  shows in the status (``Stats.stopped_shapes``), the
  ``walbridge_stopped_shapes`` metric and one ERROR line naming shape, table
  and column, and a re-read of it is recorded for the run after the fix, which
  streams again from the held position.
- Shape filters are compiled again for the column types the WAL has now; one
  that no longer compiles stops its shape.
- The shape tables (``tables``, shared with the snapshot and backfills) are
  refreshed from the catalog at every Relation, so a backfill reads a table
  with the columns it has now.
- After an initial snapshot, a table's first Relation in the stream is compared
  with the columns the snapshot read: DDL between the snapshot and the table's
  first change (a table nobody wrote since) is a change like any other, never
  a first sight whose missing default would go unnoticed. Likewise, in a run
  resumed from its slot, with what the shapes last published: DDL made while
  the producer was stopped is a change like any other; what the published
  schemas cannot confirm is re-read.
- Writer schemas carry each column's attnum as the follower last knew it
  (``attnums``), so the next run's comparison is exact.
- It calls nothing of the stream: what it needs comes in as parts (the
  catalog's ``TypeCache``, ``Backfills`` for re-reads now or after a fix) or
  as arguments (the position a stop holds WAL from).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Iterable

import psycopg

from producer import catalog, schema_changes
from producer.acks import Acks
from producer.backfill import Backfills
from producer.catalog import TableInfo
from producer.pgoutput import Column, Relation, lsn_to_str
from producer.schema_changes import RelationShape, ShapeRef
from producer.shapes import ShapeSpec
from producer.status import Stats
from schemas.config import Config
from schemas.shape_filter import FilterError, FilterSource, compile_filter

log = logging.getLogger("walbridge.producer")


def relation_key(rel: Relation, table: TableInfo | None) -> tuple[str, ...]:
    """The key a relation's changes are sent with: the catalog's primary key
    (or replica identity index), else what the Relation flags."""
    if table is None:
        return tuple(c.name for c in rel.columns if c.is_key)
    if not table.primary_key and table.replica_identity == "f":
        return ()  # REPLICA IDENTITY FULL flags every column; that is not a key
    return table.primary_key


def table_relation(table: TableInfo) -> Relation:
    """``table`` as its Relation message would describe it: how a read of the
    whole table (snapshot, backfill) plans it."""
    columns = tuple(Column(c.name, c.type_oid, c.typmod, c.name in table.primary_key) for c in table.columns)
    return Relation(table.oid, table.schema, table.name, table.replica_identity, columns)


class SchemaFollower:
    """The schema changes of the shape tables, for one run of the stream."""

    def __init__(self, config: Config, conn: psycopg.Connection, tables: dict[str, TableInfo],
                 shape_specs: dict[str, list[ShapeSpec]], stats: Stats, acks: Acks, types: catalog.TypeCache,
                 backfills: Backfills, filter_source: FilterSource | None = None):
        self._config = config
        self._filter_source = filter_source  # what the shape filters are compiled against
        self._conn = conn  # the catalog connection
        self._tables = tables
        self._specs = shape_specs
        self._stats = stats
        self._acks = acks
        self._types = types
        self._backfills = backfills  # re-reads: now, or (a stopped shape's) for the run after the fix
        self.shape_tables = {t.oid: q for q, t in tables.items()}  # oid → the shape table's name in the config
        self._relations: dict[int, RelationShape] = {}  # oid → as the stream last planned it
        self._aliases: dict[int, dict[str, tuple[str, ...]]] = {}  # oid → column → its former names
        # oid → the relation as its shapes' last published schemas describe it,
        # and those shapes (a run resumed from its slot; see ``resume_from``).
        self._seeds: dict[int, tuple[RelationShape, list[str]]] = {}

    @property
    def stopped(self) -> dict[str, dict]:
        return self._stats.stopped_shapes

    def aliases(self, oid: int) -> dict[str, tuple[str, ...]] | None:
        return self._aliases.get(oid)

    def relation(self, rel: Relation, hold_lsn: int, reads: catalog.CatalogReads) -> None:
        """A Relation message of a shape table (``rel.oid`` in ``shape_tables``);
        ``hold_lsn``: where a shape it stops holds WAL from (the transaction
        being read, or between transactions what is confirmed); ``reads``:
        the catalog as this message's step reads it."""
        qualified = self.shape_tables[rel.oid]
        facts = reads.facts(rel.oid)
        if facts is None:
            return  # dropped since: its changes up to the drop still go out; ``poll`` stops its shapes
        table = reads.table(facts.schema, facts.name)
        columns = self._columns(rel)
        old = self._relations.get(rel.oid)
        seed = self._seeds.pop(rel.oid, None) if old is None else None
        new = self._relations[rel.oid] = schema_changes.shape_of(rel.schema, rel.name, columns,
                                                                 relation_key(rel, table), rel.replica_identity,
                                                                 facts, old or (seed[0] if seed else None))
        specs = [s for s in self._specs[qualified] if s.name not in self.stopped]
        refs = [ShapeRef(s.name, s.columns, s.row_filter.columns if s.row_filter else frozenset()) for s in specs]
        if old is not None:
            changes = schema_changes.classify(old, new, facts)
        else:
            changes = schema_changes.first_sight(qualified, f"{facts.schema}.{facts.name}")
            if seed is not None:
                changes += schema_changes.resumed(seed[0], new, facts, *self._published_columns(seed[1]))
        out = schema_changes.consequences(changes, refs, qualified, new.key, self._aliases.get(rel.oid))
        self._aliases[rel.oid] = out.aliases
        if changes:
            what = "; ".join(c.describe() for c in changes)
            for spec in specs:
                log.info("schema change of %s, shape %s: %s", qualified, spec.name, what)
        if any(c.kind == schema_changes.KEY_LOST for c in changes):
            log.warning("%s lost its key (%s): its shapes follow the keyless rules from now on (null Kafka "
                        "keys, no key schema), and are re-read", qualified, new.identity)
        stops = {**schema_changes.unknown_columns(refs, [c.name for c in rel.columns], qualified), **out.stop}
        stops.update(self._recompile_filters(qualified, rel, set(stops)))
        if table is not None and not any(c.kind == schema_changes.TABLE_RENAMED for c in changes):
            self._tables[qualified] = table
        for shape, error in stops.items():
            self.stop(shape, error, hold_lsn)
        for shape, why in out.reread.items():
            if shape not in stops:
                self._backfills.request(shape, f"schema change of {qualified}: {why}")

    def start_from(self, tables: Iterable[TableInfo]) -> None:
        """The shape tables as the initial snapshot read them (``tables``): what
        each table's first Relation in the stream is compared with."""
        for table in tables:
            facts = catalog.relation_facts(self._conn, table.oid) if table.oid in self.shape_tables else None
            if facts is not None:  # None: dropped since, which ``poll`` notices
                rel = table_relation(table)
                self._relations[table.oid] = schema_changes.shape_of(
                    table.schema, table.name, self._columns(rel), relation_key(rel, table), table.replica_identity,
                    facts)

    def resume_from(self, published: dict[str, tuple[int, dict, dict | None]]) -> None:
        """A run resumed from its slot: each shape table's first Relation is
        compared with what its shapes last published (``published``: shape →
        (publication order, value schema, key schema or None), see
        ``SchemaPublisher.latest``), so DDL made while the producer was
        stopped is followed like any other."""
        for oid, qualified in self.shape_tables.items():
            shapes = sorted((s.name for s in self._specs[qualified] if s.name in published),
                            key=lambda name: published[name][0])
            facts = catalog.relation_facts(self._conn, oid)
            seed = schema_changes.from_published([published[name][1:] for name in shapes], self._type_name,
                                                 facts.identity if facts else "d")
            if seed is not None:
                self._seeds[oid] = (seed, shapes)

    def attnums(self, oid: int, reads: catalog.CatalogReads) -> dict[str, int]:
        """Each column's attnum (name → attnum) as the stream last planned the
        relation, else (a column the stream has not seen: a read of the whole
        table) as the catalog has it now: what its writer schemas carry."""
        facts = reads.facts(oid)
        shape = self._relations.get(oid)
        planned = {c.name: c.attnum for c in (shape.columns if shape else ())}
        merged = {**{c.name: c.attnum for c in (facts.columns if facts else ())}, **planned}
        return {name: n for name, n in merged.items() if n is not None}  # None: in doubt, published without

    def _published_columns(self, shapes: list[str]) -> tuple[frozenset[str] | None, frozenset[str]]:
        """The columns ``shapes`` carry (None: every column) and those they filter on."""
        specs = [s for q in self._specs for s in self._specs[q] if s.name in shapes]
        carried = None if any(s.columns is None for s in specs) else frozenset(c for s in specs for c in s.columns)
        return carried, frozenset(c for s in specs if s.row_filter for c in s.row_filter.columns)

    def _type_name(self, oid: int, typmod: int) -> str:
        try:
            return self._types(oid, typmod).name
        except catalog.SourceError:  # a type dropped since
            return f"type oid {oid}"

    def _columns(self, rel: Relation) -> list[tuple[str, int, int, str]]:
        """(name, type oid, typmod, type name) of each column of ``rel``."""
        return [(c.name, c.type_oid, c.typmod, self._types(c.type_oid, c.typmod).name) for c in rel.columns]

    def _recompile_filters(self, qualified: str, rel: Relation, skip: set[str]) -> dict[str, str]:
        """The table's shape filters compiled again for ``rel``'s columns (their
        types, collations and enums as the catalog says now); returns the shapes
        whose filter no longer compiles, with the error."""
        wheres = {s.shape_name: s.where for s in self._config.shapes if s.where}
        failed = {}
        specs = self._specs[qualified]
        facts = None
        for i, spec in enumerate(specs):
            if spec.name in wheres and spec.name not in skip:
                if facts is None:
                    now = catalog.filter_columns(self._conn, rel.oid)
                    facts = {c.name: now[c.name] for c in rel.columns if c.name in now}
                    # The catalog can be ahead of the stream: a column this Relation
                    # still has may be dropped since. A filter naming one keeps its
                    # compiled form until the Relation that drops it stops the shape.
                    ahead = {c.name for c in rel.columns if c.name not in now}
                if spec.row_filter is not None and spec.row_filter.columns & ahead:
                    continue
                try:
                    specs[i] = replace(spec, row_filter=compile_filter(wheres[spec.name], facts, shape=spec.name,
                                                                       source=self._filter_source))
                except FilterError as e:
                    failed[spec.name] = f"shape {spec.name}: its where no longer fits {qualified}: {e}"
        return failed

    def stop(self, shape: str, error: str, lsn: int) -> None:
        """``shape`` stops, holding WAL from ``lsn`` (see the module invariants);
        the caller plans its relation again without it."""
        if shape in self.stopped:
            return
        self._acks.hold(shape, lsn, time.monotonic())
        self.stopped[shape] = {"error": error, "held_lsn": lsn_to_str(lsn), "since": time.time()}
        log.error("%s. Shape %s is stopped, the other shapes keep streaming; WAL is held from %s", error, shape,
                  lsn_to_str(lsn))
        self._backfills.defer(shape, f"stopped: {error}")

    def poll(self, hold_lsn: int) -> None:
        """A dropped shape table stops its shapes (holding WAL from ``hold_lsn``)."""
        live = catalog.existing(self._conn, list(self.shape_tables))
        for oid, qualified in self.shape_tables.items():
            if oid not in live:
                for spec in self._specs[qualified]:
                    if spec.name not in self.stopped:
                        self.stop(spec.name, f"shape {spec.name}: table {qualified} was dropped (its target keeps "
                                             "its rows); remove the shape from the config and restart", hold_lsn)
