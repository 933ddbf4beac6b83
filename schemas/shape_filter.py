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
  - a boolean column (or boolean literal) used directly as a condition;
  - ``COLLATE "C"`` (``"POSIX"``, ``ucs_basic``) on a text operand.

  Rejected, with a message naming the construct: function calls, arithmetic
  and other operators (``+ - * / %``, ``||``, ``~``, ``SIMILAR TO``, JSON and
  array operators, bitwise operators, other collations, ``IS DISTINCT FROM``), casts
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

* **The rule: exactly PostgreSQL's WHERE, or refused.**  Compiled against
  the source (``columns`` as :class:`FilterColumn` from its catalog, and a
  :class:`FilterSource`), an accepted filter selects exactly the rows the
  source's own ``WHERE`` returns for the values the producer loads (psycopg's
  loaders; values a Python type cannot hold arrive as their text form);
  whatever cannot be evaluated so raises :class:`FilterError` naming the
  fragment, the column's collation and the fix.  In particular:

  - text (and ``char(n)``, ``citext``): ordering only under a code-point
    collation (the column's is ``C``/``POSIX``/``ucs_basic``, or the
    comparison says ``COLLATE "C"``), on a UTF-8 database; ``=``, ``IN`` and
    ``LIKE`` under deterministic collations only (they compare code points);
    ``ILIKE`` and citext lower-case as PostgreSQL's ``lower()`` does under the
    collation (:attr:`Collation.lower`: ASCII under C, Unicode's full mapping
    under ICU), else refused.  ``char(n)`` is compared without trailing
    blanks, but ``LIKE`` sees the padding;
  - numbers: ``NaN`` (float4, float8, numeric) equals itself and sorts above
    every number (:class:`_Beyond`), ``-0 = 0``; ``real`` is compared as its
    float4 value widened to float8; mixed types are compared in the type
    PostgreSQL's operator resolution picks (an IN list: its common type);
  - dates and times: ``±infinity``, BC dates and years past 9999 (text forms
    from the loaders) take their place in the order; ``timetz`` is refused;
    comparisons PostgreSQL would make by converting every row's value are
    refused;
  - enums: equality and ``IN`` only (their order can change under
    ``ALTER TYPE ... ADD VALUE``); other types of unknown semantics: ``IS
    NULL`` only;
  - literals are read by the source (:attr:`FilterSource.cast`: its input
    functions, its ``TimeZone``), once, at compile time; moving ones
    (``'now'``) are refused.

  With type names only (``columns`` as strings) collations count as unknown
  (text ordering is refused) and literals are read by Python's ISO parsers
  in ``session_timezone``; without ``columns`` (the config's syntax check)
  a column compared with a literal is guarded per row by a cheap class check:
  a value of the wrong Python type raises :class:`FilterTypeError` (a
  ``TypeError``) instead of silently comparing unequal.

* **Missing columns.**  ``matches`` needs every referenced column in the row;
  a missing one raises :class:`MissingColumnError` (a ``LookupError``), it is
  never treated as NULL.  :func:`shape_transition` handles a partial *old* row
  (see there).

What is refused, and why, is listed in the README ("Row filters").
"""

from __future__ import annotations

import datetime as _dt
import re
import string
import struct
import uuid
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from typing import Any, Callable, Literal, Mapping, NoReturn, Sequence, Union

import sqlglot
from sqlglot import exp
from sqlglot.errors import SqlglotError
from sqlglot.optimizer.normalize_identifiers import normalize_identifiers

__all__ = [
    "C_COLLATION",
    "Collation",
    "FilterColumn",
    "FilterError",
    "FilterSource",
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

    def __init__(self, reason: str, fragment: str | None = None, shape: str | None = None, fix: str | None = None):
        self.reason = reason
        self.fragment = fragment
        self.shape = shape
        self.fix = fix
        prefix = f"shape {shape!r}: where: " if shape else "where: "
        super().__init__(prefix + reason + (f": {fragment}" if fragment else "") + (f"; fix: {fix}" if fix else ""))


class FilterTypeError(TypeError):
    """Raised by :meth:`RowFilter.matches` when a row value cannot be compared
    with the literal/column it is compared with (only possible for columns whose
    type was not given to :func:`compile_filter`)."""


class MissingColumnError(LookupError):
    """The row lacks a column the filter references.  ``.columns`` lists them."""

    def __init__(self, message: str, columns: tuple[str, ...]):
        super().__init__(message)
        self.columns = columns


# --------------------------------------------------------------------------- source facts


@dataclass(frozen=True)
class Collation:
    """A collation as the source's catalog describes it (``pg_collation``; the
    ``default`` collation resolved to the database's provider and locale)."""

    name: str  # "default", "C", "en-US-x-icu", ...
    provider: str  # "c" libc, "i" ICU, "b" builtin (PostgreSQL 17+)
    locale: str  # libc: LC_COLLATE; ICU and builtin: the locale
    ctype: str = ""  # libc: LC_CTYPE, which decides lower() and ILIKE
    deterministic: bool = True

    @property
    def bytewise(self) -> bool:
        """Orders text by its UTF-8 bytes, i.e. by code point, as Python does."""
        return (self.provider == "c" and self.locale in ("C", "POSIX")) or (
            self.provider == "b" and self.locale in ("C", "C.UTF-8"))

    @property
    def lower(self) -> Callable[[str], str] | None:
        """PostgreSQL's ``lower()`` under this collation (which ILIKE and citext
        use), or None where Python cannot reproduce it exactly."""
        if self.provider == "c":
            return _ascii_lower if self.ctype in ("C", "POSIX") else None  # libc: towlower, per code point
        if self.provider == "b":
            return _ascii_lower if self.locale == "C" else None
        # ICU: Unicode's full lower-case mapping (final sigma, U+0130 -> "i̇"),
        # which str.lower implements; tr, az and lt have rules of their own.
        language = re.split(r"[-_@]", self.locale.lower(), maxsplit=1)[0]
        return None if language in ("tr", "az", "lt") else str.lower

    def describe(self) -> str:
        provider = {"c": "libc", "i": "ICU", "b": "builtin"}.get(self.provider, self.provider)
        nondet = ", nondeterministic" if not self.deterministic else ""
        return f'"{self.name}" ({provider} {self.locale or "root"}{nondet})'


C_COLLATION = Collation("C", "c", "C", "C")
_ASCII_LOWER = str.maketrans(string.ascii_uppercase, string.ascii_lowercase)


def _ascii_lower(s: str) -> str:
    return s.translate(_ASCII_LOWER)


# COLLATE names that mean code-point order (quoted as PostgreSQL spells them).
_BYTEWISE_COLLATIONS = {"C": C_COLLATION, "POSIX": Collation("POSIX", "c", "POSIX", "POSIX"),
                        "ucs_basic": Collation("ucs_basic", "c", "C", "C")}


@dataclass(frozen=True)
class FilterColumn:
    """What the source's catalog says of a column, for :func:`compile_filter`."""

    type: str  # the base type (domains resolved), format_type spelling, e.g. "numeric(12,2)"
    collation: Collation | None = None  # collatable types
    enum: bool = False
    cast_type: str | None = None  # the type literals are read as (no typmod); default ``type``


@dataclass(frozen=True)
class FilterSource:
    """What the source database decides for every filter.

    ``cast(texts, types)``: each text read by the source's own input functions
    as ``types[0]`` (then cast to ``types[1]`` ...) in the source's
    ``TimeZone``, returned in its ISO text form; raises ``ValueError`` with
    PostgreSQL's message.  ``default_collation``: the database's, which
    citext lower-cases with."""

    cast: Callable[[Sequence[str], Sequence[str]], list[str]]
    default_collation: Collation
    encoding: str = "UTF8"


# --------------------------------------------------------------------------- types

# kinds: "int" "numeric" "float4" "float8" "text" "bpchar" "citext" "bool" "date"
# "timestamp" "timestamptz" "time" "uuid" "enum" "opaque" (unknown type name:
# enum/domain/extension, facts not given) "unsupported" (a type we do not
# compare: json, timetz, ...).
_NUM = frozenset({"int", "numeric", "float4", "float8"})
_FLOAT = frozenset({"float4", "float8"})
_TEXT = frozenset({"text", "bpchar", "citext"})
_STRINGY = _TEXT | {"unknown", "opaque", "enum"}
_TEMPORAL = frozenset({"date", "timestamp", "timestamptz", "time"})

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
    "uuid": "uuid",
    "enum": "enum",
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
    "uuid": frozenset({uuid.UUID}),
}


class _Type:
    __slots__ = ("kind", "name", "collation", "cast_name")

    def __init__(self, kind: str, name: str, collation: Collation | None = None, cast_name: str | None = None):
        self.kind = kind
        self.name = name  # for messages
        self.collation = collation
        self.cast_name = cast_name or name  # what the source reads a literal of this type as


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


def _column_type(spec: str | FilterColumn) -> _Type:
    if isinstance(spec, str):
        return _type_from_name(spec)
    t = _type_from_name(spec.type)
    if spec.enum:
        t = _Type("enum", spec.type)
    elif t.kind == "opaque":
        # the catalog says what it is and it is no enum: an extension type whose
        # equality walbridge cannot judge from its text form
        t = _Type("unsupported", spec.type)
    t.collation = spec.collation
    t.cast_name = spec.cast_type or spec.type
    return t


# --------------------------------------------------------------------------- PostgreSQL's order of special values


class _Beyond:
    """A value that PostgreSQL orders outside the range of the Python values of
    its type: ``NaN`` (equal to itself, above every number and +Infinity),
    ``±infinity`` of dates and times, dates and timestamps before year 1 or
    after 9999, and ``24:00:00``.  It compares with the ordinary values by
    ``rank`` alone (the Python types return NotImplemented, so Python asks it)
    and with its own kind by ``(rank, key)``."""

    __slots__ = ("rank", "key", "text")

    def __init__(self, rank: int, key: Any = (), text: str = ""):
        self.rank = rank
        self.key = key
        self.text = text

    def _t(self, other: Any) -> tuple:
        return (other.rank, other.key) if other.__class__ is _Beyond else (0,)

    def __eq__(self, other: Any) -> bool:
        return other.__class__ is _Beyond and (self.rank, self.key) == (other.rank, other.key)

    def __ne__(self, other: Any) -> bool:
        return not self.__eq__(other)

    def __lt__(self, other: Any) -> bool:
        return (self.rank, self.key) < self._t(other)

    def __le__(self, other: Any) -> bool:
        return (self.rank, self.key) <= self._t(other)

    def __gt__(self, other: Any) -> bool:
        return (self.rank, self.key) > self._t(other)

    def __ge__(self, other: Any) -> bool:
        return (self.rank, self.key) >= self._t(other)

    def __hash__(self) -> int:
        return hash((self.rank, self.key))

    def __repr__(self) -> str:
        return self.text or f"_Beyond({self.rank}, {self.key!r})"


_NAN = _Beyond(3, (), "NaN")
_INFINITY = {"infinity": _Beyond(2, (), "infinity"), "-infinity": _Beyond(-2, (), "-infinity")}
_TIME_24 = _Beyond(1, (), "24:00:00")

_DATE_RE = re.compile(r"(\d{4,})-(\d\d)-(\d\d)")
_TIME_RE = re.compile(r" (\d\d):(\d\d):(\d\d)(?:\.(\d{1,6}))?")
_OFFSET_RE = re.compile(r"([+-])(\d\d)(?::?(\d\d))?(?::?(\d\d))?")


def _civil_days(y: int, m: int, d: int) -> int:
    """Days from 1970-01-01 to the proleptic Gregorian date (astronomical year y)."""
    y -= m <= 2
    era = y // 400
    yoe = y - era * 400
    doy = (153 * (m + (-3 if m > 2 else 9)) + 2) // 5 + d - 1
    return era * 146097 + yoe * 365 + yoe // 4 - yoe // 100 + doy - 719468


_UNIX_EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc)


def _beyond(text: str, kind: str) -> Any:
    """A text form the loader could not hold (ISO DateStyle, as the producer's
    sessions print it) as a value ordered as PostgreSQL orders it."""
    s = text.strip()
    if s.lower() in _INFINITY:
        return _INFINITY[s.lower()]
    if kind == "time":
        if s in ("24:00:00", "24:00"):
            return _TIME_24
        raise ValueError(f"cannot order the {kind} value {text!r}")
    bc = s.endswith(" BC")
    body = s[:-3] if bc else s
    m = _DATE_RE.match(body)
    if m is None:
        raise ValueError(f"cannot order the {_KIND_NAME[kind]} value {text!r}")
    y, mo, d = int(m.group(1)), int(m.group(2)), int(m.group(3))
    y = 1 - y if bc else y  # astronomical year: 1 BC is year 0
    rest = body[m.end():]
    if kind == "date":
        if rest:
            raise ValueError(f"cannot order the date value {text!r}")
        return _Beyond(-1 if y < 1 else 1, (y, mo, d), text)
    t = _TIME_RE.match(rest)
    if t is None:
        raise ValueError(f"cannot order the {_KIND_NAME[kind]} value {text!r}")
    hh, mi, ss = int(t.group(1)), int(t.group(2)), int(t.group(3))
    us = int((t.group(4) or "").ljust(6, "0") or 0)
    rest = rest[t.end():]
    if kind == "timestamp":
        if rest:
            raise ValueError(f"cannot order the timestamp value {text!r}")
        return _Beyond(-1 if y < 1 else 1, (y, mo, d, hh, mi, ss, us), text)
    o = _OFFSET_RE.fullmatch(rest)
    if o is None:
        raise ValueError(f"cannot order the timestamptz value {text!r}")
    offset = (int(o.group(2)) * 3600 + int(o.group(3) or 0) * 60 + int(o.group(4) or 0)) * (-1 if o.group(1) == "-" else 1)
    utc_us = ((_civil_days(y, mo, d) * 86400 + hh * 3600 + mi * 60 + ss - offset) * 1_000_000) + us
    try:  # an instant inside Python's range is an ordinary value, however it was printed
        return _UNIX_EPOCH + _dt.timedelta(microseconds=utc_us)
    except OverflowError:
        return _Beyond(-1 if utc_us < 0 else 1, utc_us, text)


def _n_float4(v: Any) -> Any:
    # psycopg may load real 0.1 as the float 0.1; PostgreSQL compares the float4
    # value widened to float8 (0.10000000149...), so widen it too
    v = _float4(v)
    return v if v == v else _NAN


def _n_numeric(v: Any) -> Any:
    # bounded numeric loads as Decimal, NaN/±Infinity and unbounded numeric as text
    if v.__class__ is str:
        v = Decimal(v)
    return v if v == v else _NAN


def _to_float8(v: Any) -> Any:
    # integer and numeric compared with a float: PostgreSQL casts them to float8
    return v if v.__class__ is _Beyond else float(v)


def _temporal_normaliser(kind: str, cls: type) -> Callable[[Any], Any]:
    def normalise(v: Any) -> Any:
        if v.__class__ is cls or v.__class__ is _Beyond:
            return v
        if v.__class__ is str:
            return _beyond(v, kind)
        return v

    return normalise


_NORMALISE = {
    kind: _temporal_normaliser(kind, cls)
    for kind, cls in (("date", _dt.date), ("timestamp", _dt.datetime), ("timestamptz", _dt.datetime),
                      ("time", _dt.time))
}


# --------------------------------------------------------------------------- operands


class _Col:
    __slots__ = ("name", "type", "collate")

    def __init__(self, name: str, type_: _Type | None, collate: Collation | None = None):
        self.name = name
        self.type = type_
        self.collate = collate  # an explicit COLLATE on it

    @property
    def kind(self) -> str | None:
        return self.type.kind if self.type is not None else None


class _Const:
    """A literal value, already converted to the Python value the producer
    loads (special values as :class:`_Beyond`).  kind is one of the column
    kinds, "unknown" (an untyped string literal, which PostgreSQL coerces to
    the other operand's type) or "null".  ``src``: (text, type) of a cast
    string literal, which the source reads again as another type."""

    __slots__ = ("value", "kind", "type_name", "src", "collate")

    def __init__(self, value: Any, kind: str, type_name: str | None = None, src: tuple[str, str] | None = None):
        self.value = value
        self.kind = kind
        self.type_name = type_name
        self.src = src
        self.collate: Collation | None = None

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
# Kinds whose literals the source reads (when it is known): everything whose
# input function does more than take the text as it is.
_SOURCE_READ = frozenset({"int", "numeric", "float4", "float8", "bool", "uuid", "enum", "opaque"}) | _TEMPORAL
_TEMPORAL_CLASS = {"date": _dt.date, "timestamp": _dt.datetime, "timestamptz": _dt.datetime, "time": _dt.time}
# Spellings PostgreSQL reads as "the moment the query runs": never a constant.
_MOVING = re.compile(r"\b(now|today|tomorrow|yesterday)\b", re.IGNORECASE)


def _float4(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


class _Coercer:
    def __init__(self, session_tz: _dt.tzinfo, err: Callable[..., NoReturn], source: FilterSource | None,
                 citext_lower: Callable[[str], str]):
        self.tz = session_tz
        self.err = err
        self.source = source
        self.citext_lower = citext_lower

    def canonical(self, text: str, kind: str) -> Any:
        """The source's text form of a ``kind`` value as the value the producer
        compares (what its loaders and :func:`_beyond` make of it)."""
        if kind == "int":
            return int(text)
        if kind == "numeric":
            return _n_numeric(text)
        if kind == "float8":
            v = float(text)
            return v if v == v else _NAN
        if kind == "float4":
            return _n_float4(float(text))
        if kind == "bool":
            return text in ("t", "true")
        if kind == "uuid":
            return uuid.UUID(text)
        if kind in _TEMPORAL:
            cls = _TEMPORAL_CLASS[kind]
            try:
                v = (_dt.time if kind == "time" else cls).fromisoformat(text)
            except ValueError:
                return _beyond(text, kind)
            return v
        return text

    def read(self, texts: Sequence[str], types: Sequence[str], kind: str, frag: str) -> list[Any]:
        """``texts`` read by the source as ``types`` (see :class:`FilterSource`)."""
        for s in texts:
            if kind in _TEMPORAL and _MOVING.search(s):
                self.err(f"{s!r} is read when a query runs, not once: a filter needs a fixed {types[-1]} value", frag)
        try:
            out = self.source.cast(list(texts), list(types))  # type: ignore[union-attr]
        except ValueError as e:
            self.err(f"the source cannot read the literal as {types[-1]} ({e})", frag)
        return [self.canonical(t, kind) for t in out]

    # text -> kind: by the source's input functions when it is known, else
    # Python's (ISO formats only for date/time)
    def parse(self, s: str, kind: str, frag: str, type_name: str | None = None, cast_name: str | None = None) -> Any:
        def bad(what: str | None = None) -> NoReturn:
            self.err(f"invalid input syntax for type {what or type_name or _KIND_NAME.get(kind, kind)}: {s!r}", frag)

        if kind in ("text", "opaque", "enum") and (self.source is None or kind == "text"):
            return s
        if kind == "bpchar":
            return s.rstrip(" ")
        if kind == "citext":
            return self.citext_lower(s)
        if self.source is not None and kind in _SOURCE_READ:
            return self.read([s], [cast_name or type_name or _KIND_NAME[kind]], kind, frag)[0]
        t = s.strip().lower()
        if kind == "int":
            if not _INT_RE.match(s):
                bad()
            return int(s)
        if kind == "numeric":
            if t in ("nan", "infinity", "+infinity", "-infinity", "inf", "+inf", "-inf"):
                return _n_numeric(t.replace("inity", "").replace("inf", "Infinity"))
            if not _NUM_RE.match(s):
                bad()
            return Decimal(s.strip())
        if kind in _FLOAT:
            if t in ("nan", "infinity", "+infinity", "-infinity", "inf", "+inf", "-inf"):
                v = float(t.replace("inity", ""))
            elif _NUM_RE.match(s):
                v = float(t)
            else:
                bad()
            return _n_float4(v) if kind == "float4" else (v if v == v else _NAN)
        if kind == "bool":
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
        if kind in _TEMPORAL and t in _INFINITY:
            return _INFINITY[t]
        if kind == "time" and t in ("24:00", "24:00:00"):
            return _TIME_24
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
            return self.parse(v, kind, frag, t.name, t.cast_name)
        if kind in _NUM and k in _NUM:
            if kind in _FLOAT and k not in _FLOAT:
                return _to_float8(v)
            return v
        if kind in _TEXT and k in _TEXT:
            return self.parse(v, kind, frag)
        if kind in ("opaque", "enum") and k == "opaque":
            if self.source is not None and c.src is not None and c.type_name != t.name:
                # the literal's type must be the column's, or PostgreSQL finds no operator
                self.read([c.src[0]], [c.src[1], t.cast_name], kind, frag)
            return v
        if kind == k:
            return v
        if (k, kind) in (("date", "timestamp"), ("date", "timestamptz"), ("timestamp", "timestamptz")):
            # PostgreSQL casts the literal to the column's type (in its TimeZone)
            if self.source is not None and c.src is not None:
                return self.read([c.src[0]], [c.src[1], t.cast_name], kind, frag)[0]
            if isinstance(v, _Beyond):
                if v.rank in (-2, 2):
                    return v
                self.err(f"cannot compare {t.name} with this {c.label()} literal", frag)
            if k == "date":
                return _dt.datetime.combine(v, _dt.time(), tzinfo=self.tz if kind == "timestamptz" else None)
            return v.replace(tzinfo=self.tz)
        if kind in _TEMPORAL and k in _TEMPORAL and kind != "time" and k != "time":
            # PostgreSQL would cast every column value to the literal's type
            self.err(f"cannot compare {t.name} with a {c.label()} literal exactly (PostgreSQL would convert "
                     f"every {t.name} value); write the literal as {t.name}", frag)
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
            if self.source is not None:
                v = self.read([v], [t.cast_name], "opaque", frag)[0]
            return _Const(v, "opaque", t.name, (c.value, t.cast_name))
        if k in _STRINGY:
            return _Const(self.parse(v, kind, frag, t.name, t.cast_name), kind, None, (v, t.cast_name))
        if kind in _NUM and k in _NUM:
            if isinstance(v, _Beyond):
                if kind == "int":
                    self.err(f"cannot cast NaN to {t.name}", frag)
                return _Const(v, kind)
            if kind == "int":
                if isinstance(v, Decimal):
                    v = int(v.quantize(Decimal(1), rounding=ROUND_HALF_UP))
                elif isinstance(v, float):
                    v = int(round(v))
            elif kind == "numeric":
                v = Decimal(repr(v)) if isinstance(v, float) else Decimal(v)
            else:
                v = _n_float4(float(v)) if kind == "float4" else float(v)
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
_NUMERIC_RANK = ("int", "numeric", "float4", "float8")  # each converts implicitly to those after it
# kinds whose loaded value is compared as it is (no normalising): r[col] == K suffices
_RAW_EQUAL = frozenset({"int", "text", "bool", "uuid", "enum"})

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


def _backslash_escaped(pattern: str, escape: str | None) -> str:
    """``pattern`` with ``ESCAPE escape`` rewritten to backslash escapes, as
    PostgreSQL's ``like_escape`` does before matching (and before ILIKE lower-cases it)."""
    if escape == "\\":
        return pattern
    if escape is None:
        return pattern.replace("\\", "\\\\")
    out, after = [], False
    for ch in pattern:
        if ch == escape and not after:
            out.append("\\")
            after = True
        elif ch == "\\":
            out.append("\\" if after else "\\\\")
            after = False
        else:
            out.append(ch)
            after = False
    return "".join(out)


def _like_regex(pattern: str, err: Callable[..., NoReturn], frag: str):
    """Translate a LIKE pattern in backslash-escape form.  Returns
    ("eq"|"prefix"|"suffix"|"contains"|"any", text) for the common wildcard
    shapes or ("regex", compiled).  Matching is by code point, as PostgreSQL's
    is for a deterministic collation (ILIKE lower-cases both sides first)."""
    lits: list[tuple[str, str]] = []  # (type, text), type in {"lit", "%", "_"}
    i, n = 0, len(pattern)
    while i < n:
        ch = pattern[i]
        if ch == "\\":
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
    return "regex", re.compile(rx, re.DOTALL)


class _Compiler:
    def __init__(self, columns: Mapping[str, str | FilterColumn] | None, shape: str | None,
                 session_tz: _dt.tzinfo, source: FilterSource | None):
        self.shape = shape
        self.types: dict[str, _Type] | None = (
            None if columns is None else {name: _column_type(t) for name, t in columns.items()}
        )
        self.source = source
        self.consts: list[Any] = []
        self.nvars = 0
        self.referenced: set[str] = set()
        # citext lower-cases with the database's default collation, whatever its own
        self.citext_lower = source.default_collation.lower if source is not None else str.lower
        self.co = _Coercer(session_tz, self.err, source, self.citext_lower or str.lower)
        self.node: exp.Expression | None = None  # the predicate being compiled, for fixes in messages

    # -- helpers
    def err(self, reason: str, fragment: str | None = None, fix: str | None = None) -> NoReturn:
        raise FilterError(reason, fragment, self.shape, fix)

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
            self.err("COLLATE applies only to a text operand of a comparison, IN or LIKE", f)
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
        if isinstance(node, exp.Collate):
            inner = self.operand(node.this)
            if inner is None:
                self.unsupported(node)
            f = self.frag(node)
            if isinstance(inner, _Col):
                if inner.kind is not None and inner.kind not in _TEXT:
                    self.err(f"COLLATE applies to text, not to column {inner.name!r} of type {inner.type.name}", f)
            elif inner.kind not in ("unknown", *_TEXT):
                self.err(f"COLLATE applies to text, not to a {inner.label()} literal", f)
            inner.collate = self.collation_named(node.expression, f)
            return inner
        if isinstance(node, exp.Cast):
            inner = self.operand(node.this)
            if not isinstance(inner, _Const):
                self.unsupported(node)
            dt = node.args.get("to")
            t = _type_from_datatype(dt, dt.sql(dialect="postgres").lower() if dt is not None else "?")
            t.cast_name = dt.sql(dialect="postgres") if dt is not None else "?"
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
            val = self.lowered(self.citext_lower, v)
        elif col.kind == "float4":
            val = f"{self.k(_n_float4)}({v})"
        elif col.kind == "float8":
            val = f"({v} if {v} == {v} else {self.k(_NAN)})"  # NaN: equal to itself, above every number
        elif col.kind == "numeric":
            val = f"{self.k(_n_numeric)}({v})"
        elif col.kind in _TEMPORAL:
            # infinities and years outside 1..9999 load as text: ordered as PostgreSQL orders them
            val = f"({v} if {v}.__class__ is {self.k(_TEMPORAL_CLASS[col.kind])} else {self.k(_NORMALISE[col.kind])}({v}))"
        return setup, val, v

    def lowered(self, lower: Callable[[str], str] | None, src: str) -> str:
        if lower is str.lower or lower is None:
            return f"{src}.lower()"
        return f"{self.k(lower)}({src})"

    # -- collations
    def collation_named(self, node: exp.Expression, frag: str) -> Collation:
        if isinstance(node, exp.Column) and node.args.get("table") is not None:
            if node.table.lower() != "pg_catalog":
                self.err("COLLATE names only the collations \"C\", \"POSIX\" and ucs_basic", frag)
            node = node.this
        if isinstance(node, exp.Identifier):
            name = node.this if node.quoted else node.this.lower()
        else:
            name = node.name.lower()
        coll = _BYTEWISE_COLLATIONS.get(name)
        if coll is None:
            self.err(f"COLLATE {node.sql(dialect='postgres')} is not supported: only \"C\", \"POSIX\" and "
                     "ucs_basic (code-point order) can be evaluated outside PostgreSQL", frag)
        return coll

    def with_collate_c(self, cols: Sequence[_Col]) -> str:
        """The predicate being compiled with COLLATE "C" on ``cols``: the fix to offer."""
        names = {c.name for c in cols}
        node = self.node

        def add(n: exp.Expression) -> exp.Expression:
            if isinstance(n, exp.Column) and not isinstance(n.parent, exp.Collate) and (
                    n.name if n.this.quoted else n.name.translate(_ASCII_LOWER)) in names:
                return exp.Collate(this=n.copy(), expression=exp.Identifier(this="C", quoted=True))
            return n

        return node.transform(add).sql(dialect="postgres") if node is not None else 'COLLATE "C"'

    def text_collation(self, cols: Sequence[_Col], consts: Sequence[_Const], frag: str) -> Collation | None:
        """The collation a text comparison runs under, derived as PostgreSQL
        does: an explicit COLLATE wins, else the columns' (which must agree);
        None when not known."""
        explicit = [o.collate for o in (*cols, *consts) if o.collate is not None]
        if explicit:
            if len({c.name for c in explicit}) > 1:
                self.err("conflicting COLLATE clauses", frag)
            return explicit[0]
        if not cols:
            return self.source.default_collation if self.source is not None else None
        colls = [c.type.collation if c.type is not None else None for c in cols]
        if any(c is None for c in colls):
            return None
        if len({(c.provider, c.locale, c.ctype, c.deterministic) for c in colls}) > 1:
            self.err(f"columns {' and '.join(repr(c.name) for c in cols)} have different collations "
                     f"({' and '.join(c.describe() for c in colls)}), so PostgreSQL cannot choose one", frag,
                     f"write {self.with_collate_c(cols[:1])}")
        return colls[0]

    def check_text(self, purpose: str, cols: Sequence[_Col], consts: Sequence[_Const], frag: str
                   ) -> Callable[[str], str] | None:
        """Refuse a text comparison walbridge cannot evaluate as PostgreSQL does
        under its collation (``purpose``: "order", "equal", "like" or "ilike");
        returns the lower-casing ILIKE uses."""
        if self.types is None:
            return str.lower  # no catalog: a syntax check only
        coll = self.text_collation(cols, consts, frag)
        col = cols[0] if cols else None
        what = f"text column {col.name!r}" if col is not None else "text literals"
        under = f"collation {coll.describe()}" if coll is not None else "a collation not known to walbridge"
        citext = any(c.kind == "citext" for c in cols)
        if coll is not None and not coll.deterministic and purpose != "order":
            # PostgreSQL itself refuses LIKE/ILIKE under them; equality is the collation's, not the bytes'
            self.err(f"{'equality' if purpose == 'equal' else purpose.upper()} on {what} under {under}, which only "
                     "PostgreSQL can evaluate", frag, f"write {self.with_collate_c(cols)}")
        if purpose == "order":
            if coll is None or not coll.bytewise or (self.source is not None and self.source.encoding != "UTF8"):
                self.err(f"ordering comparison on {what} under {under}, whose order only PostgreSQL knows", frag,
                         f"write {self.with_collate_c(cols)} (code-point order), or use = or IN")
        if citext and self.citext_lower is None:
            self.err(f"citext column {col.name!r} compares values lower-cased under the database's collation "
                     f"{self.source.default_collation.describe()}, which only PostgreSQL can do", frag,  # type: ignore[union-attr]
                     "compare a text column, or use a database whose collation is C or ICU")
        if purpose == "ilike":
            lower = coll.lower if coll is not None else str.lower
            if lower is None:
                self.err(f"ILIKE on {what} under {under}, whose lower-casing only PostgreSQL knows", frag,
                         f"write {self.with_collate_c(cols)} (ASCII letters only), or LIKE")
            return lower
        return None

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
        self.node = node
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
        operand = self.operand(node) if not isinstance(node, exp.Collate) else None
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
        stringy = ("unknown", *_TEXT)
        if op not in ("==", "!=") and a.kind in stringy and b.kind in stringy:
            coll = self.text_collation((), (a, b), frag)
            if coll is None or not coll.bytewise:
                self.err("ordering comparison of text literals under the database's collation, whose order only "
                         "PostgreSQL knows", frag, "add COLLATE \"C\" (code-point order)")
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
        if col.kind == "enum":
            self.err(f"ordering comparisons on enum column {col.name!r} ({col.type.name}) are not supported (an "
                     "enum orders by its labels' sort order, which ALTER TYPE ... ADD VALUE can change while "
                     "walbridge runs)", frag, "list the labels wanted with IN (...)")
        if col.kind == "opaque":
            self.err(
                f"ordering comparisons on column {col.name!r} of type {col.type.name} are not supported "
                "(its ordering is not known)",
                frag,
            )

    def compare_const(self, op: str, col: _Col, c: _Const, frag: str) -> _P:
        self.check_orderable(col, op, frag)
        if col.type is not None and col.kind != "opaque":
            if col.kind in _TEXT:
                self.check_text("equal" if op in ("==", "!=") else "order", [col], [c], frag)
            # typed: coerce once, no per-row guard
            value = self.co.coerce(c, col.type, frag)
            setup, val, _ = self.access(col, None, frag)
            widen = col.kind in ("int", "numeric") and c.kind in _FLOAT
            if widen:  # PostgreSQL compares in float8
                val = f"{self.k(_to_float8)}({val})"
            K = self.k(value)
            if op == "==" and col.kind in _RAW_EQUAL and not widen:
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
            # pairs PostgreSQL compares without converting either column's values
            same = ka == kb or {ka, kb} in ({"int", "numeric"}, _FLOAT)
            if ka == "enum" and same and a.type.name != b.type.name:
                same = False
            if not same:
                self.err(f"cannot compare column {a.name!r} ({a.type.name}) with column {b.name!r} ({b.type.name})",
                         frag)
            if ka in _TEXT:
                self.check_text("equal" if op in ("==", "!=") else "order", [a, b], [], frag)
        else:
            for c in (a, b):
                if c.kind == "unsupported":
                    self.err(f"comparisons on columns of type {c.type.name} are not supported", frag)
            check = self.k(self._colcol_check(a, b, frag))
        sa, va, xa = self.access(a, None, frag)
        sb, vb, xb = self.access(b, None, frag)
        if "citext" in (a.kind, b.kind) and check:
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
            if col.kind in _TEXT:
                self.check_text("equal", [col], consts, frag)
            target = col.type
            if col.kind in _NUM:
                # PostgreSQL compares an IN list in the common type of the column and
                # the typed literals (int < numeric < real < double precision)
                common = max((col.kind, *(c.kind for c in consts if c.kind in _NUM)), key=_NUMERIC_RANK.index)
                if common == "float4" and (col.kind != "float4" or any(c.kind == "numeric" for c in consts)):
                    self.err("IN compares these values as real (the list's common type), which walbridge cannot "
                             "round exactly as PostgreSQL does", frag, "write the numbers as strings or as "
                             "double precision ('0.1'::float8)")
                if common != col.kind:
                    target = _Type(common, _KIND_NAME[common])
            values = frozenset(self.co.coerce(c, target, frag) for c in consts)
            setup, val, _ = self.access(col, None, frag)
            widen = target.kind == "float8" and col.kind in ("int", "numeric")
            if widen:  # the column's values are compared as float8
                val = f"{self.k(_to_float8)}({val})"
            K = self.k(values)
            t = f"(r[{col.name!r}] in {K})" if col.kind in _RAW_EQUAL and not widen else f"({setup} and {val} in {K})"
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
        lower: Callable[[str], str] | None = None
        if isinstance(left, _Col):
            if left.kind is not None and left.kind not in _TEXT:
                self.err(f"LIKE requires a text column; {left.name!r} is {left.type.name}", frag)
            icase = icase or left.kind == "citext"  # citext's LIKE is ILIKE
            lower = self.check_text("ilike" if icase else "like", [left], [pat], frag)
        elif left.kind not in ("unknown", "text", "bpchar", "citext"):
            self.err(f"LIKE requires a text operand, not {left.label()}", frag)
        elif icase:
            lower = self.check_text("ilike", [], [left, pat], frag)
        # ILIKE lower-cases the whole pattern (escapes rewritten to backslashes) and the whole value
        pattern = _backslash_escaped(pat.value, escape)
        if icase:
            pattern = (lower or str.lower)(pattern)
        how, arg = _like_regex(pattern, self.err, frag)
        if isinstance(left, _Const):
            s = (lower or str.lower)(left.value) if icase else left.value
            if how == "regex":
                hit = arg.fullmatch(s) is not None
            else:
                hit = {"eq": s == arg, "any": True, "prefix": s.startswith(arg),
                       "suffix": s.endswith(arg), "contains": arg in s}[how]
            return _const_pred(hit)
        setup, val, v = self.access(left, "text", frag, pat)
        # char(n): LIKE (bpcharlike) sees the blank-padded value, unlike =
        val = self.lowered(lower, v) if icase else v
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
    columns: Mapping[str, str | FilterColumn] | None = None,
    *,
    shape: str | None = None,
    session_timezone: _dt.tzinfo = _dt.timezone.utc,
    source: FilterSource | None = None,
) -> RowFilter:
    """Parse ``where`` (PostgreSQL syntax) once and compile it to a :class:`RowFilter`.

    ``columns`` maps column name -> :class:`FilterColumn` (what the source's
    catalog says: base type, collation, enum) or just a PostgreSQL type name
    (``format_type`` spelling; collations then count as unknown).  When given,
    unknown columns and incompatible comparisons are rejected and literals are
    converted to the columns' values now.  ``source``: the source database,
    which reads the literals (its input functions, its ``TimeZone``) and
    whose default collation citext uses; without it literals are read by
    Python's ISO parsers in ``session_timezone``.  ``shape`` only prefixes
    error messages.  Raises :class:`FilterError`.
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

    comp = _Compiler(columns, shape, session_timezone, source)
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
