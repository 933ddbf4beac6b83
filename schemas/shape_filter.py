"""Shape row filters: a PostgreSQL ``WHERE`` expression compiled to a Python predicate.

A shape may restrict the rows it publishes with a filter such as
``region = 'eu' AND total > 100``.  This module turns that text into a
:class:`RowFilter` whose :meth:`RowFilter.matches` is called once per changed
row, so it is written to be cheap per row.  Pure module: no I/O, no logging.

Invariants
----------
* **Parsed once.**  :func:`compile_filter` parses the text with sqlglot
  (dialect ``postgres``), validates it, coerces literals, and generates the
  source of one Python function which it ``compile()``\\ s.  Evaluating a row
  runs only that function: no AST walk, no parsing, no literal coercion and no
  regex compilation per row.  Literals, sets and regexes are bound as closure
  constants; column names are embedded with ``repr()`` so no user text is ever
  executed as code.

* **Accepted subset** (anything else raises :class:`FilterError` naming the
  construct and the offending fragment):

  - column references, unqualified; unquoted identifiers are folded to lower
    case (ASCII only, as PostgreSQL does), quoted identifiers are kept verbatim;
  - literals: integers, decimals (become ``int`` / ``Decimal``), strings
    (``'..'``, ``E'..'``, ``$$..$$``), ``TRUE``, ``FALSE``, ``NULL``, unary
    minus on a number, and casts *of a literal* (``'2024-01-01'::date``,
    ``CAST('1' AS integer)``, ``DATE '2024-01-01'``, ``'paid'::order_status``);
  - comparisons ``= <> != < <= > >=`` between a column and a literal, two
    columns or two literals;
  - ``AND``, ``OR``, ``NOT``, parentheses;
  - ``IN (literal, ...)`` / ``NOT IN``; ``BETWEEN`` / ``NOT BETWEEN``;
  - ``IS [NOT] NULL`` (also ``ISNULL`` / ``NOTNULL`` / ``IS [NOT] UNKNOWN``),
    ``IS [NOT] TRUE``, ``IS [NOT] FALSE``;
  - ``LIKE`` / ``NOT LIKE`` / ``ILIKE`` / ``NOT ILIKE`` with a string-literal
    pattern, ``%`` and ``_`` wildcards, backslash escapes by default and an
    optional ``ESCAPE 'c'`` (``ESCAPE ''`` disables escaping);
  - a boolean column (or boolean literal) used directly as a condition.

  Rejected, with a message naming the construct: function calls, arithmetic
  and other operators (``+ - * / %``, ``||``, ``~``, ``SIMILAR TO``, JSON and
  array operators, bitwise operators, ``COLLATE``, ``IS DISTINCT FROM``), casts
  of anything but a literal, casts with type modifiers, subqueries and
  ``EXISTS``, ``ANY``/``ALL``, ``CASE``, intervals, bit/hex strings, row
  values, parameters, table-qualified columns, aliases / trailing junk, empty
  text and more than one statement.

* **SQL three-valued logic, exactly.**  Every sub-expression is TRUE, FALSE or
  NULL (unknown).  A comparison with a NULL operand is unknown; ``NOT unknown``
  is unknown; ``AND``/``OR`` follow Kleene logic; ``x IN (1, NULL)`` is TRUE
  if ``x = 1`` and unknown otherwise, so ``x NOT IN (1, NULL)`` is never TRUE;
  ``x BETWEEN a AND b`` is ``a <= x AND x <= b``; ``IS ...`` is never unknown.
  :meth:`RowFilter.matches` returns ``True`` only when the whole expression is
  TRUE (a row whose filter is unknown is *not* in the shape, as in a SQL
  ``WHERE``).  Internally each node is compiled twice -- "is TRUE" and "is
  FALSE" -- which gives short-circuiting two-valued Python code with exact
  Kleene semantics (``NOT p`` is TRUE iff ``p`` is FALSE).

* **Typing.**  With ``columns`` (column -> PostgreSQL type name) unknown
  columns are rejected, incompatible comparisons (``integer`` column vs
  ``'abc'``, ``text`` vs ``5``, ``LIKE`` on a number, ordering on an enum or
  other type of unknown ordering, anything but ``IS NULL`` on json / bytea /
  array / interval ...) are rejected at compile time, and literals are coerced
  once, at compile time, to the Python type psycopg loads for the column:
  ``'2024-01-01'`` -> ``date``, ``'100.5'`` -> ``Decimal``, uuid text ->
  ``UUID``, timestamptz text -> aware ``datetime``, ``0.1`` vs ``double
  precision`` -> ``float`` and so on.  ``char(n)`` values are compared without
  trailing blanks (but ``LIKE`` sees the padding), ``real`` values as float4
  and ``citext`` values case-insensitively, as PostgreSQL does.
  Type names that sqlglot does not know (enums, domains, extension types) are
  "opaque": equality, ``IN`` and ``IS NULL`` are allowed, ordering is not.

* **Incomparable values -- the decision.**  Whatever can be detected at compile
  time raises :class:`FilterError` (always with ``columns``; literal-vs-literal
  always).  Without a type for a column, a column compared with a literal is
  guarded per row by a cheap class check: a value of the wrong Python type
  (e.g. ``int`` for ``total = '100'``, or a ``datetime`` compared with the
  untyped string ``'2024-01-01'``) raises :class:`FilterTypeError` (a
  ``TypeError``) naming the column, the value's type and the fragment, instead
  of silently comparing unequal.  The fix is to pass ``columns`` or to write a
  typed literal (``'2024-01-01'::date``).  Untyped column-vs-column
  comparisons are checked the same way.

* **Missing columns.**  ``matches`` needs every referenced column in the row;
  a missing one raises :class:`MissingColumnError` (a ``LookupError``), it is
  never treated as NULL.  :func:`shape_transition` handles a partial *old* row
  (see there).

Known deviations: string ordering (``<``, ``BETWEEN``) uses code-point order,
i.e. ``COLLATE "C"``, not the database collation; ``ILIKE`` uses Python case
folding; float ``NaN`` compares as unknown-like (neither ``<`` nor ``>=`` is
TRUE) and numeric ``NaN`` literals are rejected; ``timestamp``/``date`` text
without an offset compared with ``timestamptz`` is read in ``session_timezone``
(UTC by default) -- PostgreSQL uses the session's ``TimeZone``.
"""

from __future__ import annotations

import datetime as _dt
import re
import string
import struct
import uuid
from decimal import ROUND_HALF_UP, Decimal
from typing import Any, Callable, Literal, Mapping, NoReturn, Union

import sqlglot
from sqlglot import exp
from sqlglot.errors import SqlglotError
from sqlglot.optimizer.normalize_identifiers import normalize_identifiers

__all__ = [
    "FilterError",
    "FilterTypeError",
    "MissingColumnError",
    "RowFilter",
    "Transition",
    "compile_filter",
    "shape_transition",
]

Transition = Literal["insert", "update", "delete"]


# --------------------------------------------------------------------------- errors


class FilterError(ValueError):
    """A filter that cannot be compiled: bad syntax, unsupported construct,
    unknown column or incompatible types.  ``str()`` reads like
    ``shape 'orders_eu': where: function calls are not supported: LOWER(region)``."""

    def __init__(self, reason: str, fragment: str | None = None, shape: str | None = None):
        self.reason = reason
        self.fragment = fragment
        self.shape = shape
        prefix = f"shape {shape!r}: where: " if shape else "where: "
        super().__init__(prefix + reason + (f": {fragment}" if fragment else ""))


class FilterTypeError(TypeError):
    """Raised by :meth:`RowFilter.matches` when a row value cannot be compared
    with the literal/column it is compared with (only possible for columns whose
    type was not given to :func:`compile_filter`)."""


class MissingColumnError(LookupError):
    """The row lacks a column the filter references.  ``.columns`` lists them."""

    def __init__(self, message: str, columns: tuple[str, ...]):
        super().__init__(message)
        self.columns = columns


# --------------------------------------------------------------------------- types

# kinds: "int" "numeric" "float4" "float8" "text" "bpchar" "citext" "bool" "date"
# "timestamp" "timestamptz" "time" "timetz" "uuid" "opaque" (unknown type name:
# enum/domain/extension) "unsupported" (known type we do not compare: json...).
_NUM = frozenset({"int", "numeric", "float4", "float8"})
_TEXT = frozenset({"text", "bpchar", "citext"})
_STRINGY = _TEXT | {"unknown", "opaque"}

_DTYPE_KIND = {
    **dict.fromkeys(
        ("TINYINT", "SMALLINT", "MEDIUMINT", "INT", "BIGINT", "SERIAL", "SMALLSERIAL", "BIGSERIAL"),
        "int",
    ),
    **dict.fromkeys(("DECIMAL", "BIGDECIMAL"), "numeric"),
    "FLOAT": "float4",
    "DOUBLE": "float8",
    **dict.fromkeys(("TEXT", "VARCHAR", "NVARCHAR", "NAME"), "text"),
    **dict.fromkeys(("CHAR", "NCHAR", "BPCHAR"), "bpchar"),
    "BOOLEAN": "bool",
    "DATE": "date",
    **dict.fromkeys(("TIMESTAMP", "DATETIME"), "timestamp"),
    **dict.fromkeys(("TIMESTAMPTZ", "TIMESTAMPLTZ"), "timestamptz"),
    "TIME": "time",
    "TIMETZ": "timetz",
    "UUID": "uuid",
}

_KIND_NAME = {
    "int": "integer",
    "numeric": "numeric",
    "float4": "real",
    "float8": "double precision",
    "text": "text",
    "bpchar": "character",
    "citext": "citext",
    "bool": "boolean",
    "date": "date",
    "timestamp": "timestamp without time zone",
    "timestamptz": "timestamp with time zone",
    "time": "time without time zone",
    "timetz": "time with time zone",
    "uuid": "uuid",
    "unknown": "string",
    "null": "NULL",
}

# Python classes psycopg loads for each kind (used by the per-row guards of
# untyped columns; exact-class checks so bool is not taken for int and datetime
# is not taken for date).
_KIND_CLASSES: dict[str, frozenset[type]] = {
    **dict.fromkeys(_NUM, frozenset({int, float, Decimal})),
    **dict.fromkeys(_STRINGY, frozenset({str})),
    "bool": frozenset({bool}),
    "date": frozenset({_dt.date}),
    "timestamp": frozenset({_dt.datetime}),
    "timestamptz": frozenset({_dt.datetime}),
    "time": frozenset({_dt.time}),
    "timetz": frozenset({_dt.time}),
    "uuid": frozenset({uuid.UUID}),
}


class _Type:
    __slots__ = ("kind", "name")

    def __init__(self, kind: str, name: str):
        self.kind = kind
        self.name = name  # for messages


def _type_from_datatype(dt: exp.Expression, name: str) -> _Type:
    if not isinstance(dt, exp.DataType):
        return _Type("opaque", name)
    tname = dt.this.name if hasattr(dt.this, "name") else str(dt.this)
    if tname == "USERDEFINED":
        udt = dt.args.get("kind")
        uname = udt.sql(dialect="postgres") if isinstance(udt, exp.Expression) else name
        if uname.lower() in ("citext", "public.citext"):
            return _Type("citext", "citext")
        return _Type("opaque", uname)
    kind = _DTYPE_KIND.get(tname)
    if kind is None:
        return _Type("unsupported", name)
    return _Type(kind, name)


def _type_from_name(name: str) -> _Type:
    low = " ".join(name.strip().lower().split())
    if low in ("citext", "public.citext"):
        return _Type("citext", name)
    if low == "array" or low.endswith("]"):
        return _Type("unsupported", name)
    if low in ("user-defined", ""):
        return _Type("opaque", name)
    try:
        dt = exp.DataType.build(name, dialect="postgres")
    except (SqlglotError, ValueError, TypeError):
        return _Type("opaque", name)
    return _type_from_datatype(dt, name)


# --------------------------------------------------------------------------- operands


class _Col:
    __slots__ = ("name", "type")

    def __init__(self, name: str, type_: _Type | None):
        self.name = name
        self.type = type_

    @property
    def kind(self) -> str | None:
        return self.type.kind if self.type is not None else None


class _Const:
    """A literal value, already converted to the Python value psycopg would
    load.  kind is one of the column kinds, "unknown" (an untyped string
    literal, which PostgreSQL coerces to the other operand's type) or "null"."""

    __slots__ = ("value", "kind", "type_name")

    def __init__(self, value: Any, kind: str, type_name: str | None = None):
        self.value = value
        self.kind = kind
        self.type_name = type_name

    def label(self) -> str:
        if self.kind == "opaque":
            return self.type_name or "opaque"
        return _KIND_NAME.get(self.kind, self.kind)


_Operand = Union[_Col, _Const]

# --------------------------------------------------------------------------- literal parsing

_INT_RE = re.compile(r"\s*[+-]?[0-9]+\s*\Z")
_NUM_RE = re.compile(r"\s*[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?\s*\Z")
_BOOL_TRUE = ("true", "yes")
_BOOL_FALSE = ("false", "no")


def _float4(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


class _Coercer:
    def __init__(self, session_tz: _dt.tzinfo, err: Callable[..., NoReturn]):
        self.tz = session_tz
        self.err = err

    # text -> kind (PostgreSQL input functions, ISO formats only for date/time)
    def parse(self, s: str, kind: str, frag: str, type_name: str | None = None) -> Any:
        def bad(what: str | None = None) -> NoReturn:
            self.err(f"invalid input syntax for type {what or type_name or _KIND_NAME.get(kind, kind)}: {s!r}", frag)

        if kind in ("text", "opaque"):
            return s
        if kind == "bpchar":
            return s.rstrip(" ")
        if kind == "citext":
            return s.lower()
        if kind == "int":
            if not _INT_RE.match(s):
                bad()
            return int(s)
        if kind == "numeric":
            if not _NUM_RE.match(s):
                bad()
            return Decimal(s.strip())
        if kind in ("float4", "float8"):
            t = s.strip().lower()
            if t in ("infinity", "+infinity", "inf", "+inf"):
                v = float("inf")
            elif t in ("-infinity", "-inf"):
                v = float("-inf")
            elif _NUM_RE.match(s):
                v = float(t)
            else:
                bad()
            return _float4(v) if kind == "float4" else v
        if kind == "bool":
            t = s.strip().lower()
            if t and any(w.startswith(t) for w in _BOOL_TRUE) or t in ("on", "1"):
                return True
            if t and any(w.startswith(t) for w in _BOOL_FALSE) or t in ("of", "off", "0"):
                return False
            bad()
        if kind == "uuid":
            try:
                return uuid.UUID(s.strip())
            except ValueError:
                bad()
        try:
            if kind == "date":
                return _dt.date.fromisoformat(s.strip())
            if kind == "timestamp":
                return _dt.datetime.fromisoformat(s.strip()).replace(tzinfo=None)
            if kind == "timestamptz":
                v = _dt.datetime.fromisoformat(s.strip())
                return v if v.tzinfo is not None else v.replace(tzinfo=self.tz)
            if kind == "time":
                return _dt.time.fromisoformat(s.strip()).replace(tzinfo=None)
            if kind == "timetz":
                v = _dt.time.fromisoformat(s.strip())
                if v.tzinfo is None:
                    if not isinstance(self.tz, _dt.timezone):
                        self.err(f"time with time zone literal needs an explicit UTC offset: {s!r}", frag)
                    v = v.replace(tzinfo=self.tz)
                return v
        except ValueError:
            bad(f"{_KIND_NAME[kind]} (expected ISO 8601, e.g. 2024-01-31 12:00:00+00)")
        self.err(f"comparisons with {type_name or kind} values are not supported", frag)

    def coerce(self, c: _Const, t: _Type, frag: str) -> Any:
        """Convert constant ``c`` for comparison with a value of type ``t``
        (what PostgreSQL's operator resolution would do), or raise."""
        kind, k, v = t.kind, c.kind, c.value
        if kind == "unsupported":
            self.err(f"comparisons on columns of type {t.name} are not supported", frag)
        if k == "unknown":
            return self.parse(v, kind, frag, t.name)
        if kind in _NUM and k in _NUM:
            if kind in ("float4", "float8") and k not in ("float4", "float8"):
                return float(v)
            return v
        if kind in _TEXT and k in _TEXT:
            return self.parse(v, kind, frag)
        if kind == "opaque" and k == "opaque":
            return v
        if kind == k:
            return v
        if k == "date" and kind == "timestamp":
            return _dt.datetime.combine(v, _dt.time())
        if k == "date" and kind == "timestamptz":
            return _dt.datetime.combine(v, _dt.time(), tzinfo=self.tz)
        if k == "timestamp" and kind == "timestamptz":
            return v.replace(tzinfo=self.tz)
        if k == "timestamptz" and kind == "timestamp":
            return v.astimezone(self.tz).replace(tzinfo=None)
        self.err(f"cannot compare {t.name} with {c.label()} literal", frag)

    def cast(self, c: _Const, t: _Type, frag: str) -> _Const:
        kind, k, v = t.kind, c.kind, c.value
        if k == "null":
            return c
        if kind in ("unsupported", "bpchar"):
            self.err(f"casts to {t.name} are not supported", frag)
        if kind == "opaque":
            if k not in _STRINGY:
                self.err(f"cannot cast {c.label()} to {t.name}", frag)
            return _Const(v, "opaque", t.name)
        if k in _STRINGY:
            return _Const(self.parse(v, kind, frag, t.name), kind)
        if kind in _NUM and k in _NUM:
            if kind == "int":
                if isinstance(v, Decimal):
                    v = int(v.quantize(Decimal(1), rounding=ROUND_HALF_UP))
                elif isinstance(v, float):
                    v = int(round(v))
            elif kind == "numeric":
                v = Decimal(repr(v)) if isinstance(v, float) else Decimal(v)
            else:
                v = float(v)
                if kind == "float4":
                    v = _float4(v)
            return _Const(v, kind)
        if kind in _TEXT and k == "int":
            return _Const(str(v), kind)
        if kind in _TEXT and k == "bool":
            return _Const("true" if v else "false", kind)
        return _Const(self.coerce(c, t, frag), kind)


# --------------------------------------------------------------------------- code generation

_OPS = {exp.EQ: "==", exp.NEQ: "!=", exp.LT: "<", exp.LTE: "<=", exp.GT: ">", exp.GTE: ">="}
_NEG_OP = {"==": "!=", "!=": "==", "<": ">=", ">=": "<", "<=": ">", ">": "<="}
_FLIP_OP = {"==": "==", "!=": "!=", "<": ">", ">": "<", "<=": ">=", ">=": "<="}
_PY_OPS = {
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
    "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b,
    ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b,
}

_TRUE, _FALSE = "True", "False"

# the predicate node types compiled by _Compiler.pred (not usable as operands)
_PREDICATES = (exp.And, exp.Or, exp.Not, *_OPS, exp.In, exp.Between, exp.Like, exp.ILike, exp.Escape, exp.Is)


class _P:
    """A compiled predicate: Python source that is true iff the SQL expression
    is TRUE (``t``) / is FALSE (``f``).  Neither true means NULL (unknown)."""

    __slots__ = ("t", "f")

    def __init__(self, t: str, f: str):
        self.t = t
        self.f = f


def _and(parts: list[str]) -> str:
    out = []
    for p in parts:
        if p == _FALSE:
            return _FALSE
        if p != _TRUE:
            out.append(p)
    if not out:
        return _TRUE
    return out[0] if len(out) == 1 else "(" + " and ".join(out) + ")"


def _or(parts: list[str]) -> str:
    out = []
    for p in parts:
        if p == _TRUE:
            return _TRUE
        if p != _FALSE:
            out.append(p)
    if not out:
        return _FALSE
    return out[0] if len(out) == 1 else "(" + " or ".join(out) + ")"


def _not(s: str) -> str:
    if s == _TRUE:
        return _FALSE
    if s == _FALSE:
        return _TRUE
    return f"(not {s})"


def _const_pred(v: bool | None) -> _P:
    return _P(_TRUE if v is True else _FALSE, _TRUE if v is False else _FALSE)


_UNKNOWN = _P(_FALSE, _FALSE)


def _family(v: Any) -> Any:
    c = v.__class__
    if c in (int, float, Decimal):
        return "num"
    if c is _dt.datetime or c is _dt.time:
        return (c, v.tzinfo is None)
    return c


_ASCII_LOWER = str.maketrans(string.ascii_uppercase, string.ascii_lowercase)


def _like_regex(pattern: str, escape: str | None, icase: bool, err: Callable[..., NoReturn], frag: str):
    """Translate a LIKE pattern.  Returns ("eq"|"prefix"|"suffix"|"contains", text)
    for the common wildcard shapes (case-sensitive only) or ("regex", compiled)."""
    lits: list[tuple[str, str]] = []  # (type, text), type in {"lit", "%", "_"}
    i, n = 0, len(pattern)
    while i < n:
        ch = pattern[i]
        if escape and ch == escape:
            if i + 1 >= n:
                err("LIKE pattern must not end with escape character", frag)
            lits.append(("lit", pattern[i + 1]))
            i += 2
            continue
        if ch == "%":
            if not lits or lits[-1][0] != "%":
                lits.append(("%", ""))
        elif ch == "_":
            lits.append(("_", ""))
        else:
            lits.append(("lit", ch))
        i += 1
    # merge literal runs
    parts: list[tuple[str, str]] = []
    for typ, text in lits:
        if typ == "lit" and parts and parts[-1][0] == "lit":
            parts[-1] = ("lit", parts[-1][1] + text)
        else:
            parts.append((typ, text))
    shape = tuple(p[0] for p in parts)
    if not icase:
        if shape == ():
            return "eq", ""
        if shape == ("lit",):
            return "eq", parts[0][1]
        if shape == ("%",):
            return "any", ""
        if shape == ("lit", "%"):
            return "prefix", parts[0][1]
        if shape == ("%", "lit"):
            return "suffix", parts[1][1]
        if shape == ("%", "lit", "%"):
            return "contains", parts[1][1]
    rx = "".join(".*" if t == "%" else "." if t == "_" else re.escape(s) for t, s in parts)
    return "regex", re.compile(rx, re.DOTALL | (re.IGNORECASE if icase else 0))


class _Compiler:
    def __init__(self, columns: Mapping[str, str] | None, shape: str | None, session_tz: _dt.tzinfo):
        self.shape = shape
        self.types: dict[str, _Type] | None = (
            None if columns is None else {name: _type_from_name(t) for name, t in columns.items()}
        )
        self.consts: list[Any] = []
        self.nvars = 0
        self.referenced: set[str] = set()
        self.co = _Coercer(session_tz, self.err)

    # -- helpers
    def err(self, reason: str, fragment: str | None = None) -> NoReturn:
        raise FilterError(reason, fragment, self.shape)

    def k(self, value: Any) -> str:
        self.consts.append(value)
        return f"_k{len(self.consts) - 1}"

    def var(self) -> str:
        self.nvars += 1
        return f"_v{self.nvars}"

    @staticmethod
    def frag(node: exp.Expression) -> str:
        return node.sql(dialect="postgres", comments=False)

    # -- unsupported constructs
    def unsupported(self, node: exp.Expression) -> NoReturn:
        f = self.frag(node)
        if isinstance(node, (exp.Subquery, exp.Query, exp.Exists)) or (
            isinstance(node, exp.In) and (node.args.get("query") or node.args.get("unnest"))
        ):
            self.err("subqueries are not supported", f)
        if isinstance(node, (exp.Any, exp.All)) or (
            isinstance(node, exp.Anonymous) and str(node.this).upper() in ("ANY", "ALL", "SOME")
        ):
            self.err("ANY/ALL are not supported", f)
        if isinstance(node, exp.Cast):
            self.err("casts are only supported on literals", f)
        if isinstance(node, (exp.NullSafeEQ, exp.NullSafeNEQ)):
            self.err("IS [NOT] DISTINCT FROM is not supported", f)
        if isinstance(node, (exp.RegexpLike, exp.RegexpILike)):
            self.err("regular-expression operators (~, ~*) are not supported", f)
        if isinstance(node, exp.SimilarTo):
            self.err("SIMILAR TO is not supported", f)
        if isinstance(node, exp.DPipe):
            self.err("string concatenation (||) is not supported", f)
        if isinstance(node, exp.Collate):
            self.err("COLLATE is not supported", f)
        if type(node).__name__.upper().startswith("JSON"):
            self.err("JSON operators are not supported", f)
        if isinstance(node, (exp.Array, exp.Bracket)) or type(node).__name__.startswith("Array"):
            self.err("array operators are not supported", f)
        if type(node).__name__.startswith("Bitwise"):
            self.err("bitwise operators are not supported", f)
        if isinstance(node, (exp.Add, exp.Sub, exp.Mul, exp.Div, exp.Mod, exp.IntDiv, exp.Pow, exp.Neg)):
            self.err("arithmetic is not supported", f)
        if isinstance(node, exp.Case):
            self.err("CASE expressions are not supported", f)
        if isinstance(node, exp.Interval):
            self.err("interval literals are not supported", f)
        if isinstance(node, (exp.HexString, exp.BitString)):
            self.err("bit/hex string literals are not supported", f)
        if isinstance(node, (exp.Parameter, exp.Placeholder)):
            self.err("query parameters are not supported", f)
        if isinstance(node, exp.Tuple):
            self.err("row values are not supported", f)
        if isinstance(node, exp.Alias):
            self.err("unexpected alias or trailing text", f)
        if isinstance(node, exp.Star):
            self.err("* is not supported", f)
        if isinstance(node, exp.Func):
            self.err("function calls are not supported", f)
        self.err(f"unsupported construct ({type(node).__name__})", f)

    # -- operands
    def column(self, node: exp.Column) -> _Col:
        if node.args.get("table") or node.args.get("db") or node.args.get("catalog"):
            self.err("qualified column references are not supported", self.frag(node))
        ident = node.this
        if not isinstance(ident, exp.Identifier):
            self.unsupported(ident)
        name = ident.this if ident.quoted else ident.this.translate(_ASCII_LOWER)
        t = None
        if self.types is not None:
            if name not in self.types:
                hint = ""
                near = sorted(c for c in self.types if c.lower() == name.lower())
                if near:
                    hint = (f"; did you mean {' or '.join(map(repr, near))}? "
                            "(unquoted identifiers are folded to lower case; double-quote to keep case)")
                known = ", ".join(sorted(self.types)) or "(none)"
                self.err(f"unknown column {name!r} (known columns: {known}){hint}", self.frag(node))
            t = self.types[name]
        self.referenced.add(name)
        return _Col(name, t)

    def operand(self, node: exp.Expression) -> _Operand | None:
        """Column or constant for ``node``; None if ``node`` is a predicate."""
        while isinstance(node, exp.Paren):
            node = node.this
        if isinstance(node, exp.Column):
            return self.column(node)
        if isinstance(node, exp.Literal):
            if node.is_string:
                return _Const(node.this, "unknown")
            s = node.this
            return _Const(int(s), "int") if s.isdigit() else _Const(Decimal(s), "numeric")
        if isinstance(node, (exp.RawString, exp.National, exp.ByteString)):
            return _Const(str(node.this), "unknown")
        if isinstance(node, exp.Boolean):
            return _Const(bool(node.this), "bool")
        if isinstance(node, exp.Null):
            return _Const(None, "null")
        if isinstance(node, exp.Neg):
            inner = self.operand(node.this)
            if isinstance(inner, _Const):
                if inner.kind == "null":
                    return inner
                if inner.kind in _NUM:
                    return _Const(-inner.value, inner.kind)
                self.err("unary minus is only supported on numbers", self.frag(node))
            self.unsupported(node)
        if isinstance(node, exp.Cast):
            inner = self.operand(node.this)
            if not isinstance(inner, _Const):
                self.unsupported(node)
            dt = node.args.get("to")
            t = _type_from_datatype(dt, dt.sql(dialect="postgres").lower() if dt is not None else "?")
            if t.kind in _KIND_NAME:
                t.name = _KIND_NAME[t.kind]
            if t.kind not in ("unsupported", "opaque") and isinstance(dt, exp.DataType) and dt.expressions:
                self.err("type modifiers in casts are not supported", self.frag(node))
            return self.co.cast(inner, t, self.frag(node))
        if isinstance(node, _PREDICATES):
            return None
        self.unsupported(node)

    # -- column access source
    def access(self, col: _Col, guard_kind: str | None, frag: str, literal: _Const | None = None):
        """Return (setup, value_src, var): ``setup`` is true iff the value is
        not NULL (and, for an untyped column, of a Python type comparable with
        ``guard_kind``, else it raises FilterTypeError); ``value_src`` is the
        value as compared (blank-trimmed for char(n), lower-cased for citext)."""
        v = self.var()
        setup = f"({v} := r[{col.name!r}]) is not None"
        if (col.kind is None or col.kind == "opaque") and guard_kind is not None:
            bad = self.k(self._bad_value(col, guard_kind, literal, frag))
            if guard_kind in ("timestamp", "timestamptz", "time", "timetz"):
                cls = self.k(_dt.datetime if guard_kind.startswith("timestamp") else _dt.time)
                aware = "is not None" if guard_kind.endswith("tz") else "is None"
                setup += f" and (({v}.__class__ is {cls} and {v}.tzinfo {aware}) or {bad}({v}))"
            else:
                classes = _KIND_CLASSES[guard_kind]
                if len(classes) == 1:
                    setup += f" and ({v}.__class__ is {self.k(next(iter(classes)))} or {bad}({v}))"
                else:
                    setup += f" and ({v}.__class__ in {self.k(classes)} or {bad}({v}))"
        val = v
        if col.kind == "bpchar":
            val = f"{v}.rstrip(' ')"
        elif col.kind == "citext":
            val = f"{v}.lower()"
        elif col.kind == "float4":
            # psycopg may load real 0.1 as the float 0.1; PostgreSQL compares the
            # float4 value widened to float8 (0.10000000149...), so widen it too
            val = f"{self.k(_float4)}({v})"
        return setup, val, v

    def _bad_value(self, col: _Col, guard_kind: str, literal: _Const | None, frag: str) -> Callable[[Any], NoReturn]:
        prefix = f"shape {self.shape!r}: where: " if self.shape else "where: "
        if literal is not None and literal.kind == "unknown":
            what = f"the untyped string literal {literal.value!r}"
            fix = "pass the column's type to compile_filter(columns=...) or write a typed literal such as '...'::date"
        elif literal is not None:
            what = f"a {literal.label()} literal"
            fix = "pass the column's type to compile_filter(columns=...)"
        else:
            what = f"a {_KIND_NAME.get(guard_kind, guard_kind)} operation"
            fix = "pass the column's type to compile_filter(columns=...)"

        def bad(value: Any) -> NoReturn:
            raise FilterTypeError(
                f"{prefix}column {col.name!r} holds a {type(value).__name__} value ({value!r}) "
                f"that cannot be compared with {what} in {frag}; {fix}"
            )

        return bad

    def _colcol_check(self, a: _Col, b: _Col, frag: str) -> Callable[[Any, Any], bool]:
        prefix = f"shape {self.shape!r}: where: " if self.shape else "where: "

        def check(x: Any, y: Any) -> bool:
            if _family(x) == _family(y):
                return True
            raise FilterTypeError(
                f"{prefix}cannot compare column {a.name!r} ({type(x).__name__} {x!r}) with column "
                f"{b.name!r} ({type(y).__name__} {y!r}) in {frag}"
            )

        return check

    # -- predicates
    def pred(self, node: exp.Expression) -> _P:
        while isinstance(node, exp.Paren):
            node = node.this
        if isinstance(node, exp.And):
            a, b = self.pred(node.this), self.pred(node.expression)
            return _P(_and([a.t, b.t]), _or([a.f, b.f]))
        if isinstance(node, exp.Or):
            a, b = self.pred(node.this), self.pred(node.expression)
            return _P(_or([a.t, b.t]), _and([a.f, b.f]))
        if isinstance(node, exp.Not):
            p = self.pred(node.this)
            return _P(p.f, p.t)
        op = _OPS.get(type(node))
        if op is not None:
            return self.compare(op, node.this, node.expression, self.frag(node))
        if isinstance(node, exp.In):
            return self.negate(node, self.in_list(node))
        if isinstance(node, exp.Between):
            if node.args.get("symmetric"):
                self.err("BETWEEN SYMMETRIC is not supported", self.frag(node))
            f = self.frag(node)
            lo = self.compare(">=", node.this, node.args["low"], f)
            hi = self.compare("<=", node.this, node.args["high"], f)
            return self.negate(node, _P(_and([lo.t, hi.t]), _or([lo.f, hi.f])))
        if isinstance(node, exp.Escape):
            like = node.this
            if not isinstance(like, (exp.Like, exp.ILike)):
                self.unsupported(node)
            esc = self.operand(node.expression)
            if not isinstance(esc, _Const) or esc.kind not in ("unknown", "text"):
                self.err("ESCAPE must be a string literal", self.frag(node))
            if len(esc.value) > 1:
                self.err("invalid escape string: must be empty or one character", self.frag(node))
            return self.negate(like, self.like(like, esc.value or None, self.frag(node)))
        if isinstance(node, (exp.Like, exp.ILike)):
            esc_node = node.args.get("escape")
            esc = "\\"
            if esc_node is not None:
                c = self.operand(esc_node)
                if not isinstance(c, _Const) or c.kind not in ("unknown", "text") or len(c.value) > 1:
                    self.err("ESCAPE must be an empty or one-character string literal", self.frag(node))
                esc = c.value or None
            return self.negate(node, self.like(node, esc, self.frag(node)))
        if isinstance(node, exp.Is):
            return self.negate(node, self.is_(node))
        operand = self.operand(node)
        if operand is None:
            self.unsupported(node)
        return self.as_condition(operand, node)

    @staticmethod
    def negate(node: exp.Expression, p: _P) -> _P:
        return _P(p.f, p.t) if node.args.get("negate") else p

    def as_condition(self, operand: _Operand, node: exp.Expression) -> _P:
        f = self.frag(node)
        if isinstance(operand, _Const):
            if operand.kind == "null":
                return _UNKNOWN
            if operand.kind == "unknown":
                return _const_pred(self.co.parse(operand.value, "bool", f))
            if operand.kind != "bool":
                self.err(f"argument of WHERE/AND/OR/NOT must be boolean, not {operand.label()}", f)
            return _const_pred(operand.value)
        if operand.kind is not None and operand.kind != "bool":
            self.err(f"column {operand.name!r} of type {operand.type.name} used as a condition", f)
        setup, val, _ = self.access(operand, "bool", f)
        return _P(f"({setup} and {val})", f"({setup} and not {val})")

    def is_(self, node: exp.Is) -> _P:
        target = node.expression
        if isinstance(target, exp.Null):
            operand = self.operand(node.this)
            if isinstance(operand, _Col):
                src = f"r[{operand.name!r}]"
                return _P(f"({src} is None)", f"({src} is not None)")
            if isinstance(operand, _Const):
                return _const_pred(operand.kind == "null")
            p = self.pred(node.this)
            unknown = _and([_not(p.t), _not(p.f)])
            return _P(unknown, _not(unknown))
        if isinstance(target, exp.Boolean):
            p = self.pred(node.this)
            src = p.t if target.this else p.f
            return _P(src, _not(src))
        self.unsupported(node)

    def compare(self, op: str, left_node: exp.Expression, right_node: exp.Expression, frag: str) -> _P:
        left, right = self.operand(left_node), self.operand(right_node)
        for side, n in ((left, left_node), (right, right_node)):
            if side is None:
                self.err("comparison operands must be columns or literals, not conditions", self.frag(n))
        if (isinstance(left, _Const) and left.kind == "null") or (isinstance(right, _Const) and right.kind == "null"):
            return _UNKNOWN
        if isinstance(left, _Const) and isinstance(right, _Const):
            return _const_pred(self.fold(op, left, right, frag))
        if isinstance(left, _Const):
            left, right, op = right, left, _FLIP_OP[op]
        assert isinstance(left, _Col)
        if isinstance(right, _Col):
            return self.compare_cols(op, left, right, frag)
        return self.compare_const(op, left, right, frag)

    def fold(self, op: str, a: _Const, b: _Const, frag: str) -> bool:
        """Evaluate literal <op> literal at compile time (neither is NULL)."""
        if op not in ("==", "!=") and "opaque" in (a.kind, b.kind):
            self.err(f"ordering comparisons on {a.label() if a.kind == 'opaque' else b.label()} are not supported", frag)
        ta, tb = _Type(a.kind, a.label()), _Type(b.kind, b.label())
        if a.kind == "unknown" and b.kind == "unknown":
            x, y = a.value, b.value
        elif a.kind == "unknown":
            x, y = self.co.coerce(a, tb, frag), b.value
        elif b.kind == "unknown":
            x, y = a.value, self.co.coerce(b, ta, frag)
        else:
            # both typed: convert one side to the other's type (whichever direction
            # PostgreSQL's implicit casts allow: int -> float, date -> timestamp ...)
            try:
                x, y = self.co.coerce(a, tb, frag), b.value
            except FilterError:
                x, y = a.value, self.co.coerce(b, ta, frag)
            if a.kind in _TEXT and b.kind in _TEXT:
                x, y = self.co.parse(a.value, b.kind, frag), self.co.parse(b.value, a.kind, frag)
        try:
            return bool(_PY_OPS[op](x, y))
        except TypeError:
            self.err(f"cannot compare {a.label()} with {b.label()}", frag)

    def check_orderable(self, col: _Col, op: str, frag: str) -> None:
        if op in ("==", "!=") or col.type is None:
            return
        if col.kind == "opaque":
            self.err(
                f"ordering comparisons on column {col.name!r} of type {col.type.name} are not supported "
                "(its ordering is not known)",
                frag,
            )

    def compare_const(self, op: str, col: _Col, c: _Const, frag: str) -> _P:
        self.check_orderable(col, op, frag)
        if col.type is not None and col.kind != "opaque":
            # typed: coerce once, no per-row guard
            K = self.k(self.co.coerce(c, col.type, frag))
            setup, val, _ = self.access(col, None, frag)
            if op == "==" and col.kind not in ("bpchar", "citext", "float4"):
                # None == K is False for a non-NULL K: no separate NULL test needed
                return _P(f"(r[{col.name!r}] == {K})", f"({setup} and {val} != {K})")
            return _P(f"({setup} and {val} {op} {K})", f"({setup} and {val} {_NEG_OP[op]} {K})")
        # untyped (or opaque) column: literal kept as written, value class guarded per row
        if col.kind == "opaque":
            value = self.co.coerce(c, col.type, frag)
            guard = "opaque"
        else:
            value = c.value
            guard = c.kind
            if op not in ("==", "!=") and c.kind == "opaque":
                self.err(f"ordering comparisons on {c.label()} are not supported", frag)
        setup, val, v = self.access(col, guard, frag, c)
        K = self.k(value)
        if isinstance(value, Decimal) and value != value.to_integral_value():
            # psycopg float values vs a decimal literal: PostgreSQL compares in float8
            Kf, flt = self.k(float(value)), self.k(float)
            t = f"({val} {op} {Kf} if {v}.__class__ is {flt} else {val} {op} {K})"
            nop = _NEG_OP[op]
            f = f"({val} {nop} {Kf} if {v}.__class__ is {flt} else {val} {nop} {K})"
            return _P(f"({setup} and {t})", f"({setup} and {f})")
        return _P(f"({setup} and {val} {op} {K})", f"({setup} and {val} {_NEG_OP[op]} {K})")

    def compare_cols(self, op: str, a: _Col, b: _Col, frag: str) -> _P:
        self.check_orderable(a, op, frag)
        self.check_orderable(b, op, frag)
        check = None
        if a.type is not None and b.type is not None and "opaque" not in (a.kind, b.kind):
            ka, kb = a.kind, b.kind
            if "unsupported" in (ka, kb):
                self.err("comparisons on columns of type "
                         f"{a.type.name if ka == 'unsupported' else b.type.name} are not supported", frag)
            same = ka == kb or (ka in _NUM and kb in _NUM) or (ka in _TEXT and kb in _TEXT)
            if not same:
                self.err(f"cannot compare column {a.name!r} ({a.type.name}) with column {b.name!r} ({b.type.name})", frag)
        else:
            for c in (a, b):
                if c.kind == "unsupported":
                    self.err(f"comparisons on columns of type {c.type.name} are not supported", frag)
            check = self.k(self._colcol_check(a, b, frag))
        sa, va, xa = self.access(a, None, frag)
        sb, vb, xb = self.access(b, None, frag)
        if "citext" in (a.kind, b.kind):
            va, vb = f"{xa}.lower()", f"{xb}.lower()"
        guard = f" and {check}({xa}, {xb})" if check else ""
        return _P(
            f"({sa} and {sb}{guard} and {va} {op} {vb})",
            f"({sa} and {sb}{guard} and {va} {_NEG_OP[op]} {vb})",
        )

    def in_list(self, node: exp.In) -> _P:
        frag = self.frag(node)
        if node.args.get("query") or node.args.get("unnest") or node.args.get("field"):
            self.unsupported(node)
        items = node.expressions
        if not items:
            self.err("empty IN list", frag)
        left = self.operand(node.this)
        if left is None:
            self.err("IN operand must be a column or literal", self.frag(node.this))
        consts: list[_Const] = []
        for it in items:
            c = self.operand(it)
            if not isinstance(c, _Const):
                self.err("IN lists may contain only literals", self.frag(it))
            consts.append(c)
        has_null = any(c.kind == "null" for c in consts)
        consts = [c for c in consts if c.kind != "null"]
        if isinstance(left, _Const):
            if left.kind == "null":
                return _UNKNOWN
            hit = any(self.fold("==", left, c, frag) for c in consts)
            return _const_pred(True if hit else (None if has_null else False))
        col = left
        if not consts:
            return _UNKNOWN
        if col.type is not None and col.kind != "opaque":
            values = frozenset(self.co.coerce(c, col.type, frag) for c in consts)
            K = self.k(values)
            setup, val, _ = self.access(col, None, frag)
            t = f"(r[{col.name!r}] in {K})" if col.kind not in ("bpchar", "citext", "float4") else f"({setup} and {val} in {K})"
            return _P(t, _FALSE if has_null else f"({setup} and {val} not in {K})")
        # untyped/opaque: unify the literal kinds (typed literals win over untyped strings)
        typed = [c for c in consts if c.kind != "unknown"]
        if col.kind == "opaque":
            guard = "opaque"
            values_l = [self.co.coerce(c, col.type, frag) for c in consts]
        elif typed:
            target = typed[0]
            tt = _Type(target.kind, target.label())
            values_l = []
            for c in consts:
                if c.kind in _NUM and target.kind in _NUM:
                    values_l.append(c.value)
                else:
                    values_l.append(self.co.coerce(c, tt, frag))
            guard = target.kind
        else:
            values_l = [c.value for c in consts]
            guard = "unknown"
        extra = [float(x) for x in values_l if isinstance(x, Decimal) and x != x.to_integral_value()]
        K = self.k(frozenset(values_l + extra))
        setup, val, _ = self.access(col, guard, frag, typed[0] if typed else consts[0])
        return _P(f"({setup} and {val} in {K})", _FALSE if has_null else f"({setup} and {val} not in {K})")

    def like(self, node: exp.Expression, escape: str | None, frag: str) -> _P:
        icase = isinstance(node, exp.ILike)
        left, pat = self.operand(node.this), self.operand(node.expression)
        if left is None:
            self.err("LIKE operand must be a column or literal", self.frag(node.this))
        if not isinstance(pat, _Const):
            if isinstance(node.expression, (exp.Any, exp.All)):
                self.unsupported(node.expression)
            self.err("LIKE pattern must be a string literal", self.frag(node.expression))
        if pat.kind == "null" or (isinstance(left, _Const) and left.kind == "null"):
            return _UNKNOWN
        if pat.kind not in ("unknown", "text", "bpchar", "citext"):
            self.err(f"LIKE pattern must be a string literal, not {pat.label()}", frag)
        pattern = pat.value
        if isinstance(left, _Col):
            if left.kind is not None and left.kind not in _TEXT:
                self.err(f"LIKE requires a text column; {left.name!r} is {left.type.name}", frag)
            if left.kind == "citext":
                icase = True
        elif left.kind not in ("unknown", "text", "bpchar", "citext"):
            self.err(f"LIKE requires a text operand, not {left.label()}", frag)
        how, arg = _like_regex(pattern, escape, icase, self.err, frag)
        if isinstance(left, _Const):
            s = left.value
            if how == "regex":
                hit = arg.fullmatch(s) is not None
            else:
                hit = {"eq": s == arg, "any": True, "prefix": s.startswith(arg),
                       "suffix": s.endswith(arg), "contains": arg in s}[how]
            return _const_pred(hit)
        setup, val, v = self.access(left, "text", frag, pat)
        if left.kind in ("citext", "bpchar"):
            # citext: the pattern is matched case-insensitively already;
            # char(n): LIKE (bpcharlike) sees the blank-padded value, unlike =
            val = v
        if how == "regex":
            rx = self.k(arg.fullmatch)
            test = f"{rx}({val}) is not None"
            ntest = f"{rx}({val}) is None"
        elif how == "any":
            test, ntest = _TRUE, _FALSE
        else:
            K = self.k(arg)
            test = {"eq": f"{val} == {K}", "prefix": f"{val}.startswith({K})",
                    "suffix": f"{val}.endswith({K})", "contains": f"{K} in {val}"}[how]
            ntest = f"not {test}"
        return _P(f"({setup} and {test})", f"({setup} and {ntest})")


# --------------------------------------------------------------------------- public API


class RowFilter:
    """A compiled shape row filter.

    ``matches(row)`` -> ``True`` iff the WHERE expression is TRUE for ``row``
    (a mapping column -> value as psycopg loads it).  NULL/unknown -> False.
    Raises :class:`MissingColumnError` if a referenced column is absent and
    :class:`FilterTypeError` for incomparable values of untyped columns.

    ``columns``: frozenset of the column names the expression references.
    ``sql``: the normalised expression text (for logs).
    ``where``: the text as given.
    """

    matches: Callable[[Mapping[str, Any]], bool]

    def __init__(self, where: str, sql: str, columns: frozenset[str], fn: Callable[[Mapping[str, Any]], bool],
                 source: str, shape: str | None):
        self.where = where
        self.sql = sql
        self.columns = columns
        self.shape = shape
        self.source = source  # generated Python, for debugging
        self.matches = fn  # instance attribute: no bound-method indirection per row

    def __call__(self, row: Mapping[str, Any]) -> bool:
        return self.matches(row)

    def __repr__(self) -> str:
        return f"RowFilter({self.sql!r})"


def compile_filter(
    where: str,
    columns: Mapping[str, str] | None = None,
    *,
    shape: str | None = None,
    session_timezone: _dt.tzinfo = _dt.timezone.utc,
) -> RowFilter:
    """Parse ``where`` (PostgreSQL syntax) once and compile it to a :class:`RowFilter`.

    ``columns`` maps column name -> PostgreSQL type name (``format_type`` or
    ``information_schema`` spelling).  When given, unknown columns and
    incompatible comparisons are rejected and literals are coerced to the
    columns' Python types now.  ``shape`` only prefixes error messages.
    ``session_timezone`` is used where PostgreSQL would use the session's
    ``TimeZone`` (a timestamptz literal without an offset, date/timestamp vs
    timestamptz).  Raises :class:`FilterError`.
    """
    if not isinstance(where, str) or not where.strip():
        raise FilterError("empty filter expression", None, shape)
    try:
        statements = sqlglot.parse(where, read="postgres")
    except SqlglotError as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise FilterError(f"cannot parse ({msg})", where.strip(), shape) from None
    statements = [s for s in statements if s is not None]
    if not statements:
        raise FilterError("empty filter expression", None, shape)
    if len(statements) > 1:
        raise FilterError("multiple statements are not allowed", where.strip(), shape)
    tree = statements[0]

    comp = _Compiler(columns, shape, session_timezone)
    p = comp.pred(tree)
    names = [f"_k{i}" for i in range(len(comp.consts))]
    columns_ref = frozenset(comp.referenced)
    sql = normalize_identifiers(tree.copy(), dialect="postgres").sql(dialect="postgres", comments=False)
    prefix = f"shape {shape!r}: where: " if shape else "where: "

    def missing(row: Mapping[str, Any], e: KeyError) -> MissingColumnError:
        absent = tuple(sorted(c for c in columns_ref if c not in row)) or (str(e.args[0]) if e.args else "?",)
        return MissingColumnError(
            f"{prefix}row has no column(s) {', '.join(map(repr, absent))} referenced by the filter {sql}",
            absent,
        )

    def type_error(row: Mapping[str, Any], e: TypeError) -> FilterTypeError:
        kinds = ", ".join(f"{c}={type(row.get(c)).__name__}" for c in sorted(columns_ref))
        return FilterTypeError(f"{prefix}cannot evaluate {sql} ({e}); column value types: {kinds}")

    src = (
        f"def _build({', '.join(names + ['_missing', '_type_error', '_FilterTypeError'])}):\n"
        f"    def matches(r):\n"
        f"        try:\n"
        f"            return {p.t}\n"
        f"        except KeyError as e:\n"
        f"            raise _missing(r, e) from None\n"
        f"        except _FilterTypeError:\n"
        f"            raise\n"
        f"        except TypeError as e:\n"
        f"            raise _type_error(r, e) from e\n"
        f"    return matches\n"
    )
    ns: dict[str, Any] = {}
    builtins = {"KeyError": KeyError, "TypeError": TypeError}
    exec(compile(src, f"<shape filter {shape or ''}>", "exec"), {"__builtins__": builtins}, ns)
    fn = ns["_build"](*comp.consts, missing, type_error, FilterTypeError)
    return RowFilter(where, sql, columns_ref, fn, src, shape)


def shape_transition(
    filter: RowFilter | None,
    old_row: Mapping[str, Any] | None,
    new_row: Mapping[str, Any] | None,
) -> Transition | None:
    """What a change does to a filtered shape.

    * INSERT (``old_row is None``): ``"insert"`` if the new row matches, else None.
    * DELETE (``new_row is None``): ``"delete"`` if the old row matched, else
      None.  If ``old_row`` lacks a column the filter references (e.g. only the
      replica-identity key is known), returns ``"delete"``: deleting a key the
      target may not hold is harmless, missing a delete is not.
    * UPDATE: in -> in ``"update"``; out -> in ``"insert"`` (moves in);
      in -> out ``"delete"`` (moves out); out -> out None.  If ``old_row``
      lacks a referenced column its membership is unknown: ``"insert"`` when
      the new row matches (consumers apply inserts as upserts by key -- they
      must anyway under at-least-once delivery), ``"delete"`` when it does not.
    * ``new_row`` must carry every referenced column (else MissingColumnError).
    * ``filter`` None means "no row filter": every row is in the shape.
    """
    if old_row is None and new_row is None:
        raise ValueError("shape_transition needs old_row or new_row")
    if filter is None:
        return "insert" if old_row is None else "delete" if new_row is None else "update"
    if old_row is None:
        return "insert" if filter.matches(new_row) else None  # type: ignore[arg-type]
    old_known = all(c in old_row for c in filter.columns)
    old_in = filter.matches(old_row) if old_known else None
    if new_row is None:
        return "delete" if old_in is not False else None
    new_in = filter.matches(new_row)
    if new_in:
        return "update" if old_in is True else "insert"
    return "delete" if old_in is not False else None
