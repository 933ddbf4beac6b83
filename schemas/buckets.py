"""Key buckets: the one hash both databases compute to name a slice of a shape.

``verify`` compares shapes bucket by bucket; ``reconcile`` backfills exactly the
buckets that differ, and the consumer garbage-collects exactly those buckets
when the backfill ends. All three must agree on which bucket a row is in, so
the expression lives here, once.

Invariants:
- A row's bucket is ``abs(mod(hashtextextended(ROW(<columns>)::text, 0), n))``:
  the PostgreSQL text of the row built from the bucket columns (the key
  columns of a keyed shape; every shape column, in shape order, of a keyless
  one), hashed by PostgreSQL itself on whichever side evaluates it. Source and
  target hold the same types, so the text — and the bucket — is the same on
  both, given the same session settings (walbridge sets ``TimeZone`` UTC,
  ``DateStyle`` ISO and ``extra_float_digits`` 3 wherever it buckets).
- A scope (``{"columns": [...], "bucket_count": n, "buckets": [...]}``) is what
  a ``backfill_end`` control event's ``scope`` holds; ``None`` means the whole shape.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from psycopg import sql

SESSION_SETTINGS = (("TimeZone", "UTC"), ("DateStyle", "ISO"), ("extra_float_digits", "3"))


def row_text(columns: Sequence[str], alias: str | None = None) -> sql.Composable:
    """``ROW(<alias>.c1, ...)::text``."""
    cols = [sql.Identifier(alias, c) if alias else sql.Identifier(c) for c in columns]
    return sql.SQL("ROW({})::text").format(sql.SQL(", ").join(cols))


def bucket_of(columns: Sequence[str], bucket_count: int, alias: str | None = None) -> sql.Composable:
    """The bucket number (0 .. bucket_count-1) of a row, as a SQL expression."""
    return sql.SQL("abs(mod(hashtextextended({}, 0), {}))").format(row_text(columns, alias), sql.Literal(bucket_count))


def in_scope(scope: Mapping[str, Any] | None, alias: str | None = None) -> sql.Composable:
    """A condition true for the rows a scope covers (``TRUE`` for no scope)."""
    if not scope:
        return sql.SQL("TRUE")
    return sql.SQL("{} = ANY({})").format(bucket_of(scope["columns"], int(scope["bucket_count"]), alias),
                                          sql.Literal([int(b) for b in scope["buckets"]]))


def set_session(conn) -> None:
    """The session settings under which row text (and so buckets) is comparable."""
    for name, value in SESSION_SETTINGS:
        conn.execute(sql.SQL("SELECT set_config({}, {}, false)").format(sql.Literal(name), sql.Literal(value)))
