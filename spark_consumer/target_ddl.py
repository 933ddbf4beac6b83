"""How a shape's target table follows a new writer schema: the table as the
target's catalog has it, and the shape's columns as the new schema has them,
→ the ``ALTER TABLE`` steps (:func:`plan_changes`). Pure: the shell
(:func:`spark_consumer.target_layout.ensure_table`) reads the catalog, runs
the steps in the transaction of the first batch that carries the schema, and
falls back where a step says so.

What each difference becomes, in this order:

=========================================  =========================================================
the new schema                             the target
=========================================  =========================================================
a field whose ``aliases`` name a column    ``RENAME COLUMN old TO new`` (the tombstones' too, for a
the table has, its own name absent         key column)
a different key (primary key changed)      the primary key constraint dropped; the new one added
                                           after the columns changed; no key: the keyless rules
lacks a column                             ``on_dropped_column = "keep"``: kept, made nullable;
                                           ``"drop"``: ``DROP COLUMN``
a new column                               ``ADD COLUMN`` (nullable)
a wider type (:func:`widens`)              ``ALTER COLUMN TYPE``: every value kept
another type                               ``ALTER COLUMN TYPE ... USING col::type``; if the cast
                                           fails, ``USING NULL`` (the producer re-reads the shape);
                                           a key column that cannot cast stops the shape
=========================================  =========================================================

Invariants:
- Nothing here loses a value the new schema still has: renames come before
  anything that compares names, and a column is only dropped when asked to.
- The plan is derived from the catalog, not from the previous schema, so it is
  idempotent: planning again after the steps ran gives no step, and a
  restart that finds the target already changed plans nothing twice.
- Types are compared as the target's ``format_type`` prints them; the shell
  normalises the new schema's ``pg.type`` through the target first.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, Sequence

from psycopg import sql

OnDropped = Literal["keep", "drop"]


@dataclass(frozen=True)
class ExistingColumn:
    """A column of the target table (bookkeeping columns excluded)."""

    name: str
    type: str  # format_type
    not_null: bool = False


@dataclass(frozen=True)
class WantedColumn:
    """A column of the shape as the new writer schema has it."""

    name: str
    type: str  # normalised as the target's format_type prints it
    is_key: bool = False
    aliases: tuple[str, ...] = ()  # earlier names (Avro field aliases: a rename)


@dataclass(frozen=True)
class Step:
    """One statement; ``fallback`` runs instead when it fails (a cast the
    values do not survive); with ``fatal`` set, that failure stops the shape
    with this message instead."""

    kind: str  # rename, drop_key, drop, relax, add, widen, retype, add_key, keyless
    column: str | None
    statement: sql.Composable
    fallback: sql.Composable | None = None
    fatal: str | None = None
    tombstones: bool = False  # the statement is for the tombstone table

    def text(self) -> str:
        return self.statement.as_string()


_INTS = ("smallint", "integer", "bigint")
_VARCHAR = re.compile(r"^character varying(?:\((\d+)\))?$")
_NUMERIC = re.compile(r"^numeric(?:\((\d+),(\d+)\))?$")
_TEMPORAL = re.compile(r"^(timestamp|time)(\(\d\))? (with|without) time zone$")


def widens(old: str, new: str) -> bool:
    """Does every value of type ``old`` cast to ``new`` without loss or failure?
    (int→bigint, varchar(n)→varchar(m≥n)/text, numeric(p,s)→numeric(p',s)
    with p' ≥ p or unbounded, real→double, timestamp→timestamptz, any→text.)"""
    if old == new or new == "text":
        return True
    if old in _INTS and new in _INTS:
        return _INTS.index(new) >= _INTS.index(old)
    if old in _INTS and new == "numeric":
        return True
    if old == "real" and new == "double precision":
        return True
    vo, vn = _VARCHAR.match(old), _VARCHAR.match(new)
    if vo and vn:
        return vn.group(1) is None or (vo.group(1) is not None and int(vn.group(1)) >= int(vo.group(1)))
    if old.startswith("character(") and vn and vn.group(1) is None:
        return False  # char pads with blanks: the cast trims them
    no, nn = _NUMERIC.match(old), _NUMERIC.match(new)
    if no and nn:
        if nn.group(1) is None:
            return True
        if no.group(1) is None:
            return False
        p, s, p2, s2 = (int(x) for x in (no.group(1), no.group(2), nn.group(1), nn.group(2)))
        return s2 == s and p2 >= p or s2 > s and p2 - s2 >= p - s
    to, tn = _TEMPORAL.match(old), _TEMPORAL.match(new)
    if to and tn and to.group(1) == tn.group(1) == "timestamp" and (to.group(3), tn.group(3)) != ("with", "without"):
        return (to.group(2) or "(6)") <= (tn.group(2) or "(6)")
    return False


def plan_changes(table: sql.Identifier, tombstones: sql.Identifier | None, existing: Sequence[ExistingColumn],
                 existing_key: Sequence[str], key_constraint: str | None, wanted: Sequence[WantedColumn],
                 on_dropped: OnDropped = "keep") -> list[Step]:
    """The steps that make ``table`` (with ``existing`` columns, primary key
    ``existing_key`` named ``key_constraint``, and the tombstone table
    ``tombstones`` when keyed) hold ``wanted``. The shell recreates the
    tombstone table and the keyless index where the key changed."""
    steps: list[Step] = []
    names = [c.name for c in existing]
    by_name = {c.name: c for c in existing}
    wanted_names = {c.name for c in wanted}
    key = [c.name for c in wanted if c.is_key]

    def alter(fmt: str, *idents: str, **parts: sql.Composable) -> sql.Composed:
        return sql.SQL("ALTER TABLE {t} " + fmt).format(*map(sql.Identifier, idents), t=table, **parts)

    for col in wanted:
        if col.name in by_name:
            continue
        old = next((a for a in col.aliases if a in by_name and a not in wanted_names), None)
        if old is None:
            continue
        steps.append(Step("rename", col.name, alter("RENAME COLUMN {} TO {}", old, col.name)))
        if tombstones is not None and old in existing_key:
            steps.append(Step("rename", col.name, sql.SQL("ALTER TABLE {} RENAME COLUMN {} TO {}").format(
                tombstones, sql.Identifier(old), sql.Identifier(col.name)), tombstones=True))
        was = by_name.pop(old)
        by_name[col.name] = ExistingColumn(col.name, was.type, was.not_null)
        names[names.index(old)] = col.name
        existing_key = [col.name if k == old else k for k in existing_key]
    key_changed = list(existing_key) != key
    if key_changed and existing_key and key_constraint:
        steps.append(Step("drop_key", None, alter("DROP CONSTRAINT {}", key_constraint)))
    for name in names:
        if name in wanted_names:
            continue
        if on_dropped == "drop":
            steps.append(Step("drop", name, alter("DROP COLUMN {}", name)))
        elif by_name[name].not_null:
            steps.append(Step("relax", name, alter("ALTER COLUMN {} DROP NOT NULL", name)))
    for col in wanted:
        if col.name in by_name and not col.is_key and by_name[col.name].not_null:  # a former key column
            steps.append(Step("relax", col.name, alter("ALTER COLUMN {} DROP NOT NULL", col.name)))
        if col.name not in by_name:
            steps.append(Step("add", col.name, alter("ADD COLUMN {} {typ}", col.name, typ=sql.SQL(col.type))))
            continue
        old_type = by_name[col.name].type
        if old_type == col.type:
            continue
        typ = sql.SQL(col.type)
        in_tombstones = tombstones is not None and col.is_key and col.name in existing_key and not key_changed
        if widens(old_type, col.type):
            steps.append(Step("widen", col.name, alter("ALTER COLUMN {} TYPE {typ}", col.name, typ=typ)))
            if in_tombstones:
                steps.append(Step("widen", col.name, sql.SQL("ALTER TABLE {} ALTER COLUMN {} TYPE {}").format(
                    tombstones, sql.Identifier(col.name), typ), tombstones=True))
            continue
        cast = alter("ALTER COLUMN {} TYPE {typ} USING {}::{typ}", col.name, col.name, typ=typ)
        if col.is_key:
            steps.append(Step("retype", col.name, cast, fatal=(
                f"key column {col.name!r} changed type from {old_type} to {col.type} and the target's values "
                "do not cast: the shape cannot follow (re-create its target table, or backfill it into a new one)")))
            if in_tombstones:
                steps.append(Step("retype", col.name, sql.SQL("ALTER TABLE {} ALTER COLUMN {} TYPE {} USING {}::{}")
                                  .format(tombstones, sql.Identifier(col.name), typ, sql.Identifier(col.name), typ),
                                  tombstones=True, fatal="the tombstones of the key do not cast"))
        else:
            steps.append(Step("retype", col.name, cast,
                              fallback=alter("ALTER COLUMN {} TYPE {typ} USING NULL", col.name, typ=typ)))
    if key_changed:
        if key:
            steps.append(Step("add_key", None, sql.SQL("ALTER TABLE {} ADD PRIMARY KEY ({})").format(
                table, sql.SQL(", ").join(map(sql.Identifier, key)))))
        else:
            steps.append(Step("keyless", None, sql.SQL("")))  # the shell adds the keyless rules' index
    return steps
