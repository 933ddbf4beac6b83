"""What a table's schema change means for its shapes.

When a Relation message arrives for a relation the stream already planned,
the shell (``pipeline.py``) hands this module the relation as it was last
planned, the relation as the message describes it, and the catalog's facts
read now; :func:`classify` says what changed and :func:`consequences` what
each shape of the table must do about it.

Path: previous ``RelationShape`` + new Relation (WAL truth: names, types) +
``CatalogFacts`` (attnum, atthasmissing, atthasdef, key, replica identity) →
:func:`shape_of` → :func:`classify` → ``Change``s → :func:`consequences` →
per shape: re-read (backfill), stop, and the aliases of renamed columns. A
run resumed from its slot compares the table's first Relation with what its
shapes last published: :func:`from_published` → :func:`resumed`.

Invariants:
- Pure: no I/O, no clock.
- The catalog is read later than the message's WAL position (and pgoutput
  repeats an unchanged Relation after some DDL): a column's attnum is the
  catalog's for its name, or, when the catalog no longer has the name (a later
  rename or drop, which a later Relation brings), the one the stream knew.
  A column whose name and type the WAL kept is unchanged unless the catalog
  gives that name another attnum (dropped and added again). A new column's
  default facts are used only when the catalog's column of that name has the
  message's type; otherwise it is *in doubt*, and the shapes carrying it are
  re-read. An added column never reuses an attnum, so a rename (a name gone,
  one new with its attnum) is never guessed.
- pgoutput cannot tell a rename from a drop and an add: a column name that
  went and one that came with the same attnum are a rename; a name kept
  with another attnum is a drop and an add.
- Values the WAL did not carry make the shapes that carry the column re-read:
  a column added with a default (constant: ``atthasmissing``; volatile: the
  table was rewritten), a retype that is not a pure widening (the rewrite may
  have changed values), a column in doubt, and a key change (the rows are
  re-keyed). A widening retype, a plain added column, a dropped column and a
  replica identity change need only the new writer schema.
- A shape whose ``columns`` or ``where`` names a column that is gone (dropped
  or renamed), whose ``columns`` lack the new key, or whose table was renamed,
  stops: it is never silently filtered. A stopped shape is not also re-read
  here (the shell records the re-read for after the fix).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

from schemas import wire

# Type oids (pg_type) that widening knows.
INT2, INT4, INT8, NUMERIC = 21, 23, 20, 1700
TEXT, VARCHAR = 25, 1043
TIMESTAMP, TIMESTAMPTZ = 1114, 1184
_INT_RANK = {INT2: 0, INT4: 1, INT8: 2}
_INT_DIGITS = {INT2: 5, INT4: 10, INT8: 19}  # decimal digits of the largest value
_VARHDR = 4  # varchar and numeric typmods carry this offset

# Change kinds.
TABLE_RENAMED = "table renamed"
ADDED = "column added"
ADDED_CONSTANT_DEFAULT = "column added with a constant default"
ADDED_VOLATILE_DEFAULT = "column added with a volatile default (table rewritten)"
DROPPED = "column dropped"
RENAMED = "column renamed"
RETYPED_WIDENING = "column widened"
RETYPED = "column retyped"
IN_DOUBT = "column changed again since (catalog and WAL disagree)"
RECREATED = "column dropped and added again"
KEY_CHANGED = "key changed"
KEY_LOST = "key lost"
IDENTITY_CHANGED = "replica identity changed"
UNPUBLISHED = "column filtered on but never published (unknown while stopped)"
UNCONFIRMED = "columns unconfirmed (the shape's last published schema has no attribute numbers)"

# Kinds after which the rows of the shapes carrying the column are re-read.
REREAD = frozenset({ADDED_CONSTANT_DEFAULT, ADDED_VOLATILE_DEFAULT, RETYPED, IN_DOUBT, RECREATED, KEY_CHANGED,
                    KEY_LOST, UNCONFIRMED, UNPUBLISHED})
_ADDED_KINDS = frozenset({ADDED, ADDED_CONSTANT_DEFAULT, ADDED_VOLATILE_DEFAULT})


@dataclass(frozen=True)
class ColumnFacts:
    """One live column as the catalog says it now."""

    attnum: int
    name: str
    type_oid: int
    typmod: int
    has_missing: bool  # atthasmissing: existing rows read a stored constant default
    has_default: bool  # atthasdef


@dataclass(frozen=True)
class CatalogFacts:
    schema: str
    name: str
    columns: tuple[ColumnFacts, ...]
    key: tuple[str, ...]
    identity: str  # relreplident: d, n, f, i


@dataclass(frozen=True)
class ColumnShape:
    name: str
    type_oid: int
    typmod: int
    type_name: str
    attnum: int | None  # None: unknown (the catalog's column of this name differs from the message's)


@dataclass(frozen=True)
class RelationShape:
    """A relation as the stream planned it."""

    schema: str
    name: str
    columns: tuple[ColumnShape, ...]
    key: tuple[str, ...]
    identity: str
    # False: read back from a writer schema published before the attribute
    # numbers and type oids were (see :func:`from_published`).
    confirmed: bool = True

    @property
    def qualified(self) -> str:
        return f"{self.schema}.{self.name}"


@dataclass(frozen=True)
class Change:
    kind: str
    column: str | None = None  # the column it is about (a renamed column's new name)
    was: str = ""  # what it was: old name, old type, old key, old table name
    now: str = ""  # what it is

    def describe(self) -> str:
        subject = f"{self.kind} {self.column}" if self.column else self.kind
        if self.was:
            return f"{subject} ({self.was} → {self.now})"
        return f"{subject} ({self.now})" if self.now else subject


@dataclass(frozen=True)
class ShapeRef:
    """What the decision needs of a shape on the table."""

    name: str
    columns: tuple[str, ...] | None  # None: every column
    filter_columns: frozenset[str] = frozenset()

    def carries(self, column: str) -> bool:
        return self.columns is None or column in self.columns

    def names(self, column: str) -> str | None:
        """Where the shape's config names ``column``, if it does."""
        where = [part for part, hit in (("columns", self.columns is not None and column in self.columns),
                                        ("where", column in self.filter_columns)) if hit]
        return " and ".join(where) or None


@dataclass
class Consequences:
    reread: dict[str, str] = field(default_factory=dict)  # shape → why
    stop: dict[str, str] = field(default_factory=dict)  # shape → the error
    aliases: dict[str, tuple[str, ...]] = field(default_factory=dict)  # column → its former names


def shape_of(schema: str, name: str, columns: list[tuple[str, int, int, str]], key: tuple[str, ...],
             identity: str, catalog: CatalogFacts | None, previous: RelationShape | None = None) -> RelationShape:
    """The relation of a Relation message (``columns``: name, type oid,
    typmod, type name), each column with the catalog's attnum for its name,
    else the one ``previous`` (the stream's last) knew."""
    facts = {c.name: c.attnum for c in (catalog.columns if catalog else ())}
    known = {c.name: c.attnum for c in (previous.columns if previous else ())}
    shaped = [ColumnShape(col_name, type_oid, typmod, type_name, facts.get(col_name, known.get(col_name)))
              for col_name, type_oid, typmod, type_name in columns]
    return RelationShape(schema, name, tuple(shaped), key, identity)


def is_widening(old_oid: int, old_mod: int, new_oid: int, new_mod: int) -> bool:
    """Does every value of the old type keep its value, unchanged, in the new one?"""
    if (old_oid, old_mod) == (new_oid, new_mod):
        return True
    if old_oid in _INT_RANK and new_oid in _INT_RANK:
        return _INT_RANK[new_oid] > _INT_RANK[old_oid]
    if old_oid in _INT_RANK and new_oid == NUMERIC:
        if new_mod == -1:
            return True
        precision, scale = _numeric(new_mod)
        return precision - scale >= _INT_DIGITS[old_oid]
    if old_oid == VARCHAR and new_oid == TEXT:
        return True
    if old_oid == VARCHAR and new_oid == VARCHAR:
        return new_mod == -1 or (old_mod != -1 and new_mod >= old_mod)
    if old_oid == NUMERIC and new_oid == NUMERIC:
        if new_mod == -1:
            return True
        if old_mod == -1:
            return False
        (p, s), (p2, s2) = _numeric(old_mod), _numeric(new_mod)
        return s2 == s and p2 >= p
    if old_oid == TIMESTAMP and new_oid == TIMESTAMPTZ:
        return new_mod == -1 or (old_mod != -1 and new_mod >= old_mod)
    return False


def _numeric(typmod: int) -> tuple[int, int]:
    raw = typmod - _VARHDR
    return (raw >> 16) & 0xFFFF, raw & 0xFFFF


def _retype(old: ColumnShape, new: ColumnShape) -> Change | None:
    if old.type_oid == 0:  # known by its type's name only (an unconfirmed seed)
        return None if old.type_name == new.type_name else Change(RETYPED, new.name, old.type_name, new.type_name)
    if (old.type_oid, old.typmod) == (new.type_oid, new.typmod):
        return None
    kind = RETYPED_WIDENING if is_widening(old.type_oid, old.typmod, new.type_oid, new.typmod) else RETYPED
    return Change(kind, new.name, old.type_name, new.type_name)


def _added(col: ColumnShape, facts: dict[str, ColumnFacts]) -> Change:
    fact = facts.get(col.name)
    if fact is None or (fact.type_oid, fact.typmod) != (col.type_oid, col.typmod):
        return Change(IN_DOUBT, col.name)
    if fact.has_missing:
        return Change(ADDED_CONSTANT_DEFAULT, col.name, now=col.type_name)
    if fact.has_default:
        return Change(ADDED_VOLATILE_DEFAULT, col.name, now=col.type_name)
    return Change(ADDED, col.name, now=col.type_name)


def classify(old: RelationShape, new: RelationShape, catalog: CatalogFacts | None) -> list[Change]:
    """Every change from ``old`` to ``new`` (same relation oid), in a stable
    order: table, columns in the new order (then dropped ones), key, identity."""
    changes: list[Change] = []
    if old.qualified != new.qualified:
        changes.append(Change(TABLE_RENAMED, None, old.qualified, new.qualified))
    facts = {c.name: c for c in (catalog.columns if catalog else ())}
    old_by = {c.name: c for c in old.columns}
    new_by = {c.name: c for c in new.columns}
    by_attnum = {c.attnum: c for c in old.columns if c.attnum is not None}
    renamed_from: dict[str, ColumnShape] = {}
    for col in new.columns:
        prior = by_attnum.get(col.attnum) if col.attnum is not None else None
        if col.name not in old_by and prior is not None and prior.name not in new_by:
            renamed_from[col.name] = prior
    renamed_old = {c.name for c in renamed_from.values()}
    for col in new.columns:
        prior = old_by.get(col.name)
        if col.name in renamed_from:
            was = renamed_from[col.name]
            changes.append(Change(RENAMED, col.name, was.name, col.name))
            retype = _retype(was, col)
        elif prior is None:
            changes.append(_added(col, facts) if old.confirmed else Change(IN_DOUBT, col.name))
            continue
        elif None not in (prior.attnum, col.attnum) and prior.attnum != col.attnum:
            # Dropped and added again under the same name: another column,
            # whose values the existing rows got without a row change.
            changes.append(Change(RECREATED, col.name, prior.type_name, col.type_name))
            continue
        else:
            retype = _retype(prior, col)
        if retype is not None:
            changes.append(retype)
    changes += [Change(DROPPED, c.name) for c in old.columns if c.name not in new_by and c.name not in renamed_old]
    if old.key != new.key:
        kind = KEY_LOST if old.key and not new.key else KEY_CHANGED
        changes.append(Change(kind, None, ", ".join(old.key) or "none", ", ".join(new.key) or "none"))
    if old.identity != new.identity:
        changes.append(Change(IDENTITY_CHANGED, None, _IDENTITY.get(old.identity, old.identity),
                              _IDENTITY.get(new.identity, new.identity)))
    if not old.confirmed:
        changes.append(Change(UNCONFIRMED))
    return changes


_IDENTITY = {"d": "default", "n": "nothing", "f": "full", "i": "index"}


def first_sight(table: str, now: str) -> list[Change]:
    """The first Relation of a shape table in a run has nothing to compare
    with, but its name: ``table`` as the config names it, ``now`` as the
    catalog does. (A Relation carrying another name with the catalog agreeing
    with the config is WAL from before a rename the config already follows.)"""
    return [Change(TABLE_RENAMED, None, table, now)] if table != now else []


def consequences(changes: list[Change], shapes: list[ShapeRef], table: str, key: tuple[str, ...],
                 aliases: dict[str, tuple[str, ...]] | None = None) -> Consequences:
    """What each shape of ``table`` (as the config names it; ``key``: its
    key now) must do. ``aliases``: the former names the relation's columns
    already carry (a column renamed twice keeps both). A table renamed to
    what the config names is followed, not stopped."""
    out = Consequences()
    known = dict(aliases or {})
    for change in changes:
        if change.kind == RENAMED:
            out.aliases[change.column] = tuple(dict.fromkeys((*known.pop(change.was, ()), change.was)))
    for col, names in known.items():
        if any(c.column == col and c.kind == DROPPED for c in changes):
            continue
        out.aliases.setdefault(col, names)
    new_key = key if any(c.kind == KEY_CHANGED for c in changes) else None
    for shape in shapes:
        stop = _stop_reason(changes, shape, table, new_key)
        if stop is not None:
            out.stop[shape.name] = stop
            continue
        why = [c.describe() for c in changes if c.kind in REREAD and (c.column is None or shape.carries(c.column))]
        why += [f"{c.describe()} (the shape filters on it)" for c in changes
                if c.kind in REREAD and c.column is not None and not shape.carries(c.column)
                and c.column in shape.filter_columns]
        if why:
            out.reread[shape.name] = "; ".join(why)
    return out


def _stop_reason(changes: list[Change], shape: ShapeRef, table: str, new_key: tuple[str, ...] | None) -> str | None:
    for change in changes:
        if change.kind == TABLE_RENAMED and change.now != table:
            return (f"shape {shape.name}: table {table} was renamed to {change.now}; point the shape at "
                    f"{change.now} in the config and restart")
        if change.kind in (DROPPED, RENAMED):
            gone = change.column if change.kind == DROPPED else change.was
            where = shape.names(gone)
            if where is not None:
                what = "was dropped" if change.kind == DROPPED else f"was renamed to {change.column}"
                return (f"shape {shape.name}: column {gone} of {table} {what}, and the shape's {where} names it; "
                        "fix the shape in the config and restart")
    if new_key and shape.columns is not None:
        lacking = [k for k in new_key if k not in shape.columns]
        if lacking:
            return (f"shape {shape.name}: the key of {table} is now ({', '.join(new_key)}), and the shape's columns "
                    f"lack {', '.join(lacking)}; add them to the shape's columns and restart")
    return None


def unknown_columns(shapes: list[ShapeRef], names: list[str], table: str) -> dict[str, str]:
    """Shapes whose ``columns`` or ``where`` name a column the relation (its
    columns: ``names``) does not have, whatever the change that took it (the
    first Relation of a run has nothing to compare with): shape → the error."""
    out = {}
    have = set(names)
    for shape in shapes:
        missing = sorted(c for c in set(shape.columns or ()) | shape.filter_columns if c not in have)
        if missing:
            where = ", ".join(f"{c} (in its {shape.names(c)})" for c in missing)
            out[shape.name] = (f"shape {shape.name}: {table} has no column {where} any more; fix the shape in the "
                               "config and restart")
    return out


def unannounced(table: str, names: list[str], width: int) -> str | None:
    """A change whose tuple has ``width`` columns while the relation's last
    Relation message named ``names``: a schema change the stream did not
    announce. Reading it by the old names would lose or misplace values, so
    it is an error (the caller restarts the stream, whose new session sends
    every relation again); None when the widths agree."""
    if width == len(names):
        return None
    return (f"a change of {table} carries {width} columns, but its last Relation message named {len(names)} "
            f"({', '.join(names)}): a schema change the stream did not announce; reading the relation again")


def from_published(schemas: list[tuple[dict, dict | None]], type_name: Callable[[int, int], str],
                   identity: str) -> RelationShape | None:
    """A table's relation as its shapes' last published writer schemas
    describe it (``schemas``: (value schema, key schema or None) per shape,
    oldest first; a later shape's field wins): what a run resumed from its
    slot compares the table's first Relation with. Only the columns the
    shapes carry are known. A field without the catalog's attnum, type oid
    and typmod (written before they were published) makes the relation
    unconfirmed: its columns are known by name and type name only, and every
    shape of the table is re-read. ``identity``: the table's now (not
    published). None without any schema."""
    if not schemas:
        return None
    columns: dict[str, ColumnShape] = {}
    key: tuple[str, ...] = ()
    confirmed = True
    for value, key_schema in schemas:
        row = value["fields"][0]["type"][1]  # before: ["null", the row record]
        for f in row["fields"]:
            if f["name"] == wire.SPECIAL_FIELD:
                continue
            name = f.get("pg.column", f["name"])
            attnum, oid, typmod = (f.get(p) for p in (wire.ATTNUM_PROP, wire.TYPE_OID_PROP, wire.TYPMOD_PROP))
            if None in (attnum, oid, typmod):
                confirmed = False
                columns[name] = ColumnShape(name, 0, -1, f.get("pg.type", ""), None)
            else:
                columns[name] = ColumnShape(name, oid, typmod, type_name(oid, typmod), attnum)
        by_field = {f["name"]: f.get("pg.column", f["name"]) for f in row["fields"]}
        key = tuple(by_field.get(k, k) for k in wire.key_fields(row, key_schema))
    ordered = sorted(columns.values(), key=lambda c: c.attnum if c.attnum is not None else 1 << 16)
    return RelationShape("", "", tuple(ordered), key, identity, confirmed)


def resumed(seed: RelationShape, new: RelationShape, catalog: CatalogFacts | None,
            carried: frozenset[str] | None, filtered: frozenset[str]) -> list[Change]:
    """Every change from ``seed`` (:func:`from_published`) to ``new``, the
    table's first Relation in a run resumed from its slot. Its shapes carry
    ``carried`` (None: every column) and filter on ``filtered``. A column the
    shapes do not carry is not compared; one they only filter on was never
    published, so its history is unknown: in doubt (the shapes filtering on
    it are re-read), never taken for unchanged. A Relation older than the
    seed (a column the seed has is missing, but the catalog still has it with
    the seed's attnum) is not compared: the later ones are."""
    known = {c.name for c in seed.columns}
    now = {c.name: c.attnum for c in (catalog.columns if catalog else ())}
    names = {c.name for c in new.columns}
    if any(c.name not in names and c.attnum is not None and now.get(c.name) == c.attnum for c in seed.columns):
        # WAL from before a change the last run already published (it resumes
        # from the confirmed position): not compared; the relation's later
        # Relation messages are compared with this one as usual.
        return []
    compared = replace(new, columns=tuple(c for c in new.columns if c.name in known or carried is None
                                          or c.name in carried or c.name in filtered))
    changes = classify(replace(seed, schema=new.schema, name=new.name), compared, catalog)
    return [Change(UNPUBLISHED, c.column) if c.kind in _ADDED_KINDS and c.column in filtered
            and carried is not None and c.column not in carried else c for c in changes]
