# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Compiled hot path of the producer: one pgoutput change message (the bytes of
its XLogData frame), or a chunk of ``COPY ... TO STDOUT`` text rows (snapshot
and backfill reads), → the Kafka messages of every shape of its relation, Avro
encoded straight from PostgreSQL's text values.

Invariants:
- Byte-identical to the reference path (``RelationPlan.events`` → psycopg
  loaders → ``ShapeCodec.encode_key``/``encode_change`` with fastavro). The
  unit test ``tests/unit/test_fastcodec.py`` holds the two side by side.
- Only text forms this module parses completely are encoded here (see
  ``_value``); any other value of a column (infinities, BC dates, ``24:00``,
  NaN, long numerics, escape-format bytea, arrays, ...) is handed to the
  column's Python encoder, which is the reference path for one field. A value
  this module accepts is one whose Python form it reproduces exactly.
- ``RelationEncoder.encode`` returns None whenever the change is not one it
  handles as a whole (a key-changing UPDATE, an old tuple with unchanged
  TOAST, a filter needing an unchanged TOAST value, a column count that does
  not match the relation, a NULL or unchanged key column, binary values): the
  caller then takes the reference path for the whole change, so correctness
  never depends on this module recognising a case. What it takes it routes as
  ``RelationPlan.events`` does: row filters (the reference's own functions,
  over the filter's columns loaded by the reference loaders), move-in/move-out
  with a full old row (REPLICA IDENTITY FULL, whose unchanged TOAST values the
  old row holds), upsert-or-delete without one.
- COPY text rows are the same text forms pgoutput sends (both come from the
  types' output functions under the same session settings) behind COPY's
  escaping: ``\\N`` alone is NULL, backslash sequences are undone (``\\b \\f
  \\n \\r \\t \\v``, octal ``\\ddd``, hex ``\\xhh``, any other character
  stands for itself), as PostgreSQL's COPY FROM reads them.
  ``RelationEncoder.encode_reads`` returns None for a chunk with a row it does
  not take whole (a NULL key column: the reference path decides), and raises
  ValueError naming a row that is not COPY text of the relation's width.
- Special values (the column's Python encoder returns their text, a str,
  in the plain layout) make their field null and are collected per record;
  a record with a side field gets it from ``envelope.special_field`` (the
  reference's own function) over its columns' collected values.
- Pure: no I/O. Buffers are reused between calls; an encoder is used by one
  thread at a time.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc, realloc, strtod
from libc.string cimport memchr, memcmp, memcpy

# Column kinds (``ColumnCodec.wire``).
cdef enum:
    W_PY = 0
    W_TEXT
    W_BOOL
    W_INT
    W_LONG
    W_FLOAT
    W_DOUBLE
    W_BYTEA
    W_DATE
    W_TIME
    W_TIMESTAMP
    W_TIMESTAMPTZ
    W_DECIMAL

WIRE = {"py": W_PY, "text": W_TEXT, "bool": W_BOOL, "int": W_INT, "long": W_LONG, "float": W_FLOAT,
        "double": W_DOUBLE, "bytea": W_BYTEA, "date": W_DATE, "time": W_TIME, "timestamp": W_TIMESTAMP,
        "timestamptz": W_TIMESTAMPTZ, "decimal": W_DECIMAL}

# Column states in a pgoutput tuple.
cdef enum:
    S_NULL = 0x6E  # 'n'
    S_TOAST = 0x75  # 'u' unchanged TOAST
    S_TEXT = 0x74  # 't'

cdef enum:
    MAX_DECIMAL_DIGITS = 18  # the unscaled value must fit an int64

cdef int64_t US_PER_DAY = 86400000000LL

# COPY text's one-letter escapes (\\b \\f \\n \\r \\t \\v) and the bytes they stand for.
cdef const char* _ESCAPE_LETTERS = b"bfnrtv"
cdef const char* _ESCAPED_BYTES = b"\x08\x0c\x0a\x0d\x09\x0b"


# ------------------------------------------------------------ murmur2 (Java's)
# Partitions are chosen by Kafka's Java murmur2 of the whole key (partitioner.py).
cdef inline uint32_t _murmur2(const uint8_t* p, Py_ssize_t n):
    cdef uint32_t m = 0x5BD1E995
    cdef uint32_t h = 0x9747B28C ^ <uint32_t>n
    cdef uint32_t k
    cdef Py_ssize_t i, end = n - n % 4
    for i in range(0, end, 4):
        k = (<uint32_t>p[i] | (<uint32_t>p[i + 1] << 8) | (<uint32_t>p[i + 2] << 16)
             | (<uint32_t>p[i + 3] << 24))
        k *= m
        k ^= k >> 24
        k *= m
        h = (h * m) ^ k
    i = n - end
    if i == 3:
        h ^= <uint32_t>p[end + 2] << 16
    if i >= 2:
        h ^= <uint32_t>p[end + 1] << 8
    if i >= 1:
        h ^= <uint32_t>p[end]
        h *= m
    h ^= h >> 13
    h *= m
    h ^= h >> 15
    return h


def murmur2(bytes data):
    """Java's ``Utils.murmur2`` of ``data``, unsigned (``partitioner.murmur2``)."""
    return _murmur2(<const uint8_t*>PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data))


# ------------------------------------------------------------- output buffer
cdef struct Buf:
    char* data
    Py_ssize_t len
    Py_ssize_t cap


cdef int _reserve(Buf* b, Py_ssize_t extra) except -1:
    cdef Py_ssize_t cap
    cdef char* data
    if b.len + extra <= b.cap:
        return 0
    cap = b.cap * 2 if b.cap else 256
    while cap < b.len + extra:
        cap *= 2
    data = <char*>realloc(b.data, cap)
    if data == NULL:
        raise MemoryError()
    b.data = data
    b.cap = cap
    return 0


cdef inline int _put(Buf* b, const char* p, Py_ssize_t n) except -1:
    _reserve(b, n)
    memcpy(b.data + b.len, p, n)
    b.len += n
    return 0


cdef inline int _byte(Buf* b, uint8_t c) except -1:
    _reserve(b, 1)
    b.data[b.len] = <char>c
    b.len += 1
    return 0


cdef inline int _long(Buf* b, int64_t n) except -1:
    """Avro long: zig-zag, then base-128 varint."""
    cdef uint64_t z = (<uint64_t>n << 1) ^ <uint64_t>(n >> 63)
    _reserve(b, 10)
    while z > 0x7F:
        b.data[b.len] = <char>((z & 0x7F) | 0x80)
        b.len += 1
        z >>= 7
    b.data[b.len] = <char>z
    b.len += 1
    return 0


cdef inline int _string(Buf* b, const char* p, Py_ssize_t n) except -1:
    _long(b, n)
    return _put(b, p, n)


cdef inline int _bytes_obj(Buf* b, bytes data) except -1:
    return _put(b, PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data))


# ------------------------------------------------------- text-form parsers
# Each returns 1 and sets its result when the text is exactly the form psycopg's
# loader turns into a value fastavro encodes the same way, else 0.

cdef inline bint _digits(const char* p, Py_ssize_t n, int* out):
    cdef int v = 0
    cdef Py_ssize_t i
    for i in range(n):
        if p[i] < 48 or p[i] > 57:
            return 0
        v = v * 10 + (p[i] - 48)
    out[0] = v
    return 1


cdef bint _parse_int(const char* p, Py_ssize_t n, int64_t* out):
    cdef bint neg = 0
    cdef uint64_t v = 0, limit
    cdef Py_ssize_t i = 0
    if n and p[0] == 45:  # '-'
        neg = 1
        i = 1
    if i == n or n - i > 19:
        return 0
    while i < n:
        if p[i] < 48 or p[i] > 57:
            return 0
        v = v * 10 + <uint64_t>(p[i] - 48)
        i += 1
    limit = (<uint64_t>1 << 63) if neg else ((<uint64_t>1 << 63) - 1)
    if v > limit:
        return 0
    out[0] = <int64_t>(0 - v) if neg else <int64_t>v
    return 1


cdef int64_t _days_from_civil(int y, int m, int d):
    """Days since 1970-01-01 of a proleptic Gregorian date."""
    cdef int64_t yy = y - (1 if m <= 2 else 0)
    cdef int64_t era = (yy if yy >= 0 else yy - 399) // 400
    cdef int64_t yoe = yy - era * 400
    cdef int64_t doy = (153 * (m + (-3 if m > 2 else 9)) + 2) // 5 + d - 1
    cdef int64_t doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
    return era * 146097 + doe - 719468


cdef int _month_days(int y, int m):
    if m == 2:
        return 29 if (y % 4 == 0 and (y % 100 != 0 or y % 400 == 0)) else 28
    return 30 if m in (4, 6, 9, 11) else 31


cdef bint _parse_date(const char* p, Py_ssize_t n, int64_t* days):
    """``YYYY-MM-DD`` (ISO DateStyle), years 1..9999 as Python's ``date``."""
    cdef int y, m, d
    if n != 10 or p[4] != 45 or p[7] != 45:
        return 0
    if not (_digits(p, 4, &y) and _digits(p + 5, 2, &m) and _digits(p + 8, 2, &d)):
        return 0
    if y < 1 or m < 1 or m > 12 or d < 1 or d > _month_days(y, m):
        return 0
    days[0] = _days_from_civil(y, m, d)
    return 1


cdef bint _parse_time(const char* p, Py_ssize_t n, int64_t* micros, Py_ssize_t* used):
    """``HH:MM:SS[.ffffff]`` with hour < 24 (Python's ``time``); ``used`` is how
    many bytes it took (the rest may be a time zone)."""
    cdef int h, mi, s, f = 0, digit
    cdef Py_ssize_t i = 8, nf = 0
    if n < 8 or p[2] != 58 or p[5] != 58:
        return 0
    if not (_digits(p, 2, &h) and _digits(p + 3, 2, &mi) and _digits(p + 6, 2, &s)):
        return 0
    if h > 23 or mi > 59 or s > 59:
        return 0
    if n > 8 and p[8] == 46:  # '.'
        i = 9
        while i < n and p[i] >= 48 and p[i] <= 57:
            if nf == 6:
                return 0
            f = f * 10 + (p[i] - 48)
            nf += 1
            i += 1
        if nf == 0:
            return 0
        while nf < 6:
            f *= 10
            nf += 1
    micros[0] = ((<int64_t>h * 60 + mi) * 60 + s) * 1000000 + f
    used[0] = i
    return 1


cdef bint _parse_timestamp(const char* p, Py_ssize_t n, bint with_tz, int64_t* micros):
    """``YYYY-MM-DD HH:MM:SS[.ffffff]``, plus ``+00`` for timestamptz (the
    replication session runs with TimeZone=UTC; other offsets go the Python way)."""
    cdef int64_t days, t
    cdef Py_ssize_t used
    if n < 19 or p[10] != 32:
        return 0
    if not _parse_date(p, 10, &days):
        return 0
    if not _parse_time(p + 11, n - 11, &t, &used):
        return 0
    used += 11
    if with_tz:
        if n - used != 3 or p[used] != 43 or p[used + 1] != 48 or p[used + 2] != 48:  # "+00"
            return 0
    elif used != n:
        return 0
    micros[0] = days * US_PER_DAY + t
    return 1


cdef bint _parse_double(const char* p, Py_ssize_t n, double* out):
    cdef char tmp[64]
    cdef char* end
    if n == 0 or n >= 64:
        return 0
    memcpy(tmp, p, n)
    tmp[n] = 0
    out[0] = strtod(tmp, &end)
    return end == tmp + n


cdef extern from *:
    int __builtin_clzll(unsigned long long)


cdef inline int _bitlen(uint64_t v):
    return 0 if v == 0 else 64 - __builtin_clzll(v)


cdef bint _write_decimal(Buf* b, const char* p, Py_ssize_t n, int precision, int scale) except -1:
    """numeric(p,s) text → fastavro's decimal bytes: the unscaled integer, big-endian
    two's complement, in (bit_length(|u|) + 8) // 8 bytes. Returns 0 (nothing
    written) when the text is not a plain finite number that fits an int64."""
    cdef bint neg = 0
    cdef Py_ssize_t i = 0, frac = -1
    cdef int significant = 0, total = 0, nbytes, k
    cdef uint64_t u = 0
    cdef int64_t v
    if n and p[0] == 45:
        neg = 1
        i = 1
    if i == n:
        return 0
    while i < n:
        if p[i] == 46:  # '.'
            if frac >= 0:
                return 0
            frac = 0
        elif p[i] >= 48 and p[i] <= 57:
            if frac >= 0:
                frac += 1
            if significant or p[i] != 48:
                significant += 1
            u = u * 10 + <uint64_t>(p[i] - 48)
            total += 1
            if total > MAX_DECIMAL_DIGITS:
                return 0
        else:
            return 0  # NaN, Infinity, exponent forms: Python's way
        i += 1
    if frac < 0:
        frac = 0
    if frac > scale or significant > precision or total == 0:
        return 0
    while frac < scale:
        if total == MAX_DECIMAL_DIGITS:
            return 0
        u *= 10
        frac += 1
        total += 1
    nbytes = (_bitlen(u) + 8) // 8
    v = -<int64_t>u if neg else <int64_t>u
    _long(b, nbytes)
    _reserve(b, nbytes)
    for k in range(nbytes - 1, -1, -1):
        b.data[b.len + k] = <char>(v & 0xFF)
        v >>= 8
    b.len += nbytes
    return 1


cdef inline int _hexval(char c):
    if c >= 48 and c <= 57:
        return c - 48
    if c >= 97 and c <= 102:
        return c - 87
    if c >= 65 and c <= 70:
        return c - 55
    return -1


cdef inline uint64_t _big_endian_u64(const uint8_t* p):
    cdef uint64_t n = 0
    cdef int i
    for i in range(8):
        n = (n << 8) | p[i]
    return n


# ------------------------------------------------------------------ encoders
cdef class Route:
    """One shape of the relation: its columns, key, prefixes and the constant
    parts of its ``source`` block."""

    cdef int ncols
    cdef int* cols  # relation column index of each shape column, in shape order
    cdef int nkeys
    cdef int* keys  # relation column index of each key field, in key-schema order
    cdef bytes value_prefix
    cdef bytes key_prefix
    cdef bytes source_head  # version, connector, name (before source.ts_ms)
    cdef bytes source_mid  # snapshot .. shape (between source.ts_ms and txId)
    cdef int partitions
    cdef list writers  # writer tuple per partition
    cdef dict stats  # op -> stats key
    cdef list toast_names  # per relation column: Avro string bytes of its field name, or None
    cdef bint tombstones  # a delete is followed by its key's tombstone
    cdef tuple row_side  # plain layout: (relation column index, column name) of the row's special columns
    cdef tuple key_side  # ... of the key's; None: the record has no side field
    cdef object special_field  # [(name, text)] -> the side field's bytes
    cdef object row_filter  # reads: {column: loaded value} -> bool, or None (no filter)

    def __cinit__(self):
        self.cols = NULL
        self.keys = NULL

    def __init__(self, cols, keys, bytes value_prefix, key_prefix, bytes source_head, bytes source_mid,
                 list writers, dict stats, list toast_names, bint tombstones, row_side, key_side, special_field,
                 row_filter=None):
        cdef int i
        self.ncols = len(cols)
        self.nkeys = len(keys)
        self.cols = <int*>malloc(max(self.ncols, 1) * sizeof(int))
        self.keys = <int*>malloc(max(self.nkeys, 1) * sizeof(int))
        if self.cols == NULL or self.keys == NULL:
            raise MemoryError()
        for i in range(self.ncols):
            self.cols[i] = cols[i]
        for i in range(self.nkeys):
            self.keys[i] = keys[i]
        self.value_prefix = value_prefix
        self.key_prefix = key_prefix if key_prefix is not None else b""
        self.source_head = source_head
        self.source_mid = source_mid
        self.writers = writers
        self.partitions = len(writers)
        self.stats = stats
        self.toast_names = toast_names
        self.tombstones = tombstones
        self.row_side = tuple(row_side) if row_side is not None else None
        self.key_side = tuple(key_side) if key_side is not None else None
        self.special_field = special_field
        self.row_filter = row_filter

    def __dealloc__(self):
        free(self.cols)
        free(self.keys)


cdef class RelationEncoder:
    """Encodes the changes of one relation (all its shapes, none filtered)."""

    cdef readonly unsigned int oid
    cdef int ncols
    cdef int* wire
    cdef int* key_branch  # branch of the typed value in the key field: -1 (bare type), 0 or 1
    cdef int* typed_branch  # branch of the typed value in the row field: 1 or 2
    cdef int* precision
    cdef int* scale
    cdef list value_fallback  # per column: raw text bytes -> encoded row field, or a special value's text
    cdef list key_fallback  # per column: raw text bytes -> encoded key field, or a special value's text
    cdef list special  # per column: the change's special value (text), or None
    cdef int n_special  # how many are set
    cdef list routes
    cdef tuple filter_columns  # reads: (relation column index, name, loader) of the columns row filters read
    # Scratch, reused between calls.
    cdef uint8_t* state
    cdef Py_ssize_t* start
    cdef Py_ssize_t* size
    cdef uint8_t* old_state  # an UPDATE's old tuple
    cdef Py_ssize_t* old_start
    cdef Py_ssize_t* old_size
    cdef int nkeys
    cdef int* keys  # the relation's key columns
    cdef readonly int span  # positions the last encoded change takes (2: an UPDATE with an old tuple, keyed)
    cdef Buf out
    cdef Buf key
    cdef Buf line  # a COPY row's fields, unescaped

    def __cinit__(self):
        self.wire = self.key_branch = self.typed_branch = self.precision = self.scale = NULL
        self.state = self.old_state = NULL
        self.start = self.size = self.old_start = self.old_size = NULL
        self.keys = NULL
        self.out.data = self.key.data = self.line.data = NULL
        self.out.len = self.out.cap = self.key.len = self.key.cap = self.line.len = self.line.cap = 0

    def __init__(self, unsigned int oid, list columns, list routes, filter_columns=()):
        """``columns``: per relation column ``(wire kind, typed branch in the row
        field, in the key field (-1: none), precision, scale, value fallback,
        key fallback)``; ``filter_columns``: (index, name, loader) of the
        columns the routes' row filters read."""
        cdef int i, n = len(columns)
        self.oid = oid
        self.ncols = n
        m = max(n, 1)
        self.wire = <int*>malloc(m * sizeof(int))
        self.key_branch = <int*>malloc(m * sizeof(int))
        self.typed_branch = <int*>malloc(m * sizeof(int))
        self.precision = <int*>malloc(m * sizeof(int))
        self.scale = <int*>malloc(m * sizeof(int))
        self.state = <uint8_t*>malloc(m)
        self.start = <Py_ssize_t*>malloc(m * sizeof(Py_ssize_t))
        self.size = <Py_ssize_t*>malloc(m * sizeof(Py_ssize_t))
        self.old_state = <uint8_t*>malloc(m)
        self.old_start = <Py_ssize_t*>malloc(m * sizeof(Py_ssize_t))
        self.old_size = <Py_ssize_t*>malloc(m * sizeof(Py_ssize_t))
        keys = sorted({(<Route>r).keys[j] for r in routes for j in range((<Route>r).nkeys)})
        self.nkeys = len(keys)
        self.keys = <int*>malloc(max(self.nkeys, 1) * sizeof(int))
        if (self.wire == NULL or self.key_branch == NULL or self.typed_branch == NULL or self.precision == NULL
                or self.scale == NULL or self.state == NULL or self.start == NULL or self.size == NULL
                or self.old_state == NULL or self.old_start == NULL or self.old_size == NULL or self.keys == NULL):
            raise MemoryError()
        for i in range(self.nkeys):
            self.keys[i] = keys[i]
        self.span = 1
        self.value_fallback = []
        self.key_fallback = []
        for i, (kind, branch, key_branch, precision, scale, value_fb, key_fb) in enumerate(columns):
            self.wire[i] = WIRE[kind]
            self.key_branch[i] = key_branch
            self.typed_branch[i] = branch
            self.precision[i] = precision
            self.scale[i] = scale
            self.value_fallback.append(value_fb)
            self.key_fallback.append(key_fb)
        self.routes = list(routes)
        self.filter_columns = tuple(filter_columns)
        self.special = [None] * n
        self.n_special = 0

    def __dealloc__(self):
        free(self.wire)
        free(self.key_branch)
        free(self.typed_branch)
        free(self.precision)
        free(self.scale)
        free(self.state)
        free(self.start)
        free(self.size)
        free(self.old_state)
        free(self.old_start)
        free(self.old_size)
        free(self.keys)
        free(self.out.data)
        free(self.key.data)
        free(self.line.data)

    cdef Py_ssize_t _tuple(self, const char* p, Py_ssize_t n, Py_ssize_t pos, uint8_t* state, Py_ssize_t* start,
                           Py_ssize_t* size):
        """Index a pgoutput TupleData at ``pos`` into ``state``/``start``/``size``;
        returns the position after it, or -1 if it is not text-only or not of
        this relation's width."""
        cdef int i, ncols
        cdef uint8_t kind
        cdef uint32_t length
        if pos + 2 > n:
            return -1
        ncols = ((<uint8_t>p[pos]) << 8) | <uint8_t>p[pos + 1]
        if ncols != self.ncols:
            return -1
        pos += 2
        for i in range(ncols):
            if pos >= n:
                return -1
            kind = <uint8_t>p[pos]
            pos += 1
            state[i] = kind
            if kind == S_TEXT:
                if pos + 4 > n:
                    return -1
                length = ((<uint32_t>(<uint8_t>p[pos]) << 24) | (<uint32_t>(<uint8_t>p[pos + 1]) << 16)
                          | (<uint32_t>(<uint8_t>p[pos + 2]) << 8) | <uint32_t>(<uint8_t>p[pos + 3]))
                pos += 4
                if length > <uint32_t>(n - pos):
                    return -1
                start[i] = pos
                size[i] = length
                pos += length
            elif kind != S_NULL and kind != S_TOAST:
                return -1  # binary values (never asked for) or unknown
        return pos

    cdef void _swap_old(self):
        """Makes the old tuple the current one (and back): records are encoded
        from ``state``/``start``/``size``."""
        cdef uint8_t* st = self.state
        cdef Py_ssize_t* sa = self.start
        cdef Py_ssize_t* sz = self.size
        self.state, self.start, self.size = self.old_state, self.old_start, self.old_size
        self.old_state, self.old_start, self.old_size = st, sa, sz

    cdef void _clear_special(self):
        cdef int j
        if self.n_special:
            for j in range(self.ncols):
                self.special[j] = None
            self.n_special = 0

    cdef int _value(self, Buf* b, const char* base, int i, bint as_key) except -1:
        """Column ``i``'s value (state 't') as the nullable row field, or as the
        key field (its typed branch per ``key_branch``)."""
        cdef const char* p = base + self.start[i]
        cdef Py_ssize_t n = self.size[i], k, used
        cdef int w = self.wire[i]
        cdef int64_t iv = 0
        cdef double dv
        cdef float fv
        cdef uint32_t f32
        cdef uint64_t f64
        cdef int hi, lo
        cdef int branch = self.typed_branch[i]
        cdef Py_ssize_t mark = b.len
        if as_key:
            branch = self.key_branch[i]
        if w == W_PY:
            return self._fallback(b, p, n, i, as_key)
        if branch >= 0:
            _long(b, branch)
        if w == W_TEXT:
            return _string(b, p, n)
        if w == W_INT or w == W_LONG:
            if _parse_int(p, n, &iv) and (w == W_LONG or -2147483648 <= iv <= 2147483647):
                return _long(b, iv)
        elif w == W_BOOL:
            if n == 1 and (p[0] == 116 or p[0] == 102):  # 't' / 'f'
                return _byte(b, 1 if p[0] == 116 else 0)
        elif w == W_DOUBLE or w == W_FLOAT:
            if _parse_double(p, n, &dv):
                _reserve(b, 8)
                if w == W_FLOAT:
                    fv = <float>dv
                    memcpy(&f32, &fv, 4)
                    for k in range(4):
                        b.data[b.len + k] = <char>((f32 >> (8 * k)) & 0xFF)
                    b.len += 4
                else:
                    memcpy(&f64, &dv, 8)
                    for k in range(8):
                        b.data[b.len + k] = <char>((f64 >> (8 * k)) & 0xFF)
                    b.len += 8
                return 0
        elif w == W_DATE:
            if _parse_date(p, n, &iv):
                return _long(b, iv)
        elif w == W_TIME:
            if _parse_time(p, n, &iv, &used) and used == n:
                return _long(b, iv)
        elif w == W_TIMESTAMP or w == W_TIMESTAMPTZ:
            if _parse_timestamp(p, n, w == W_TIMESTAMPTZ, &iv):
                return _long(b, iv)
        elif w == W_DECIMAL:
            if _write_decimal(b, p, n, self.precision[i], self.scale[i]):
                return 0
        elif w == W_BYTEA:
            if n >= 2 and p[0] == 92 and p[1] == 120 and n % 2 == 0:  # "\x" + hex pairs
                _long(b, (n - 2) // 2)
                _reserve(b, (n - 2) // 2)
                k = 2
                while k < n:
                    hi = _hexval(p[k])
                    lo = _hexval(p[k + 1])
                    if hi < 0 or lo < 0:
                        break
                    b.data[b.len] = <char>((hi << 4) | lo)
                    b.len += 1
                    k += 2
                if k == n:
                    return 0
        # Not a form parsed here: undo the branch and let Python encode the field.
        b.len = mark
        return self._fallback(b, p, n, i, as_key)

    cdef int _fallback(self, Buf* b, const char* p, Py_ssize_t n, int i, bint as_key) except -1:
        encode = (self.key_fallback if as_key else self.value_fallback)[i]
        encoded = encode(PyBytes_FromStringAndSize(p, n))
        if type(encoded) is str:  # a special value (plain layout): a null field, the text to the side field
            if self.special[i] is None:
                self.special[i] = encoded
                self.n_special += 1
            return _byte(b, 0)
        return _bytes_obj(b, encoded)

    cdef int _side(self, Buf* b, tuple side, special_field) except -1:
        """A record's side field over the special values of its ``side`` columns."""
        cdef list pairs = None
        if self.n_special:
            for i, name in side:
                text = self.special[i]
                if text is not None:
                    if pairs is None:
                        pairs = []
                    pairs.append((name, text))
        if pairs is None:
            return _byte(b, 0)
        return _bytes_obj(b, special_field(pairs))

    cdef int _row(self, Buf* b, const char* base, Route route) except -1:
        cdef int j, i
        self._clear_special()  # a record's side field holds its own special values
        for j in range(route.ncols):
            i = route.cols[j]
            if self.state[i] == S_TEXT:
                self._value(b, base, i, 0)
            else:
                _byte(b, 0)  # null branch (NULL, or unchanged TOAST listed separately)
        if route.row_side is not None:
            self._side(b, route.row_side, route.special_field)
        return 0

    cdef bint _key(self, const char* base, Route route) except -1:
        """``route``'s key (prefix and record) into ``self.key``; False if a key
        column has no value."""
        cdef int j, i
        self._clear_special()
        self.key.len = 0
        _bytes_obj(&self.key, route.key_prefix)
        for j in range(route.nkeys):
            i = route.keys[j]
            if self.state[i] != S_TEXT:
                return 0
            self._value(&self.key, base, i, 1)
        if route.key_side is not None:
            self._side(&self.key, route.key_side, route.special_field)
        return 1

    cdef int _before(self, Buf* b, const char* base, Route route, bint old) except -1:
        """``before`` from the old tuple (``old``) or the current one."""
        if not old:
            return self._row(b, base, route)
        self._swap_old()
        try:
            return self._row(b, base, route)
        finally:
            self._swap_old()

    cdef object _match(self, Route route, row):
        return route.row_filter is None or route.row_filter(row)

    def encode(self, bytes frame, Py_ssize_t at, int64_t op_index, int64_t lsn, int64_t xid, int64_t ts_ms,
               int64_t seen_ms):
        """The messages of the change whose pgoutput message starts at byte ``at``
        of ``frame``, an XLogData frame (the change's own LSN at ``at - 24``),
        in the transaction committed at ``lsn``: a list of ``(writer, key,
        value, stats key)``, at most one per shape in shape order, each passing
        its shape's row filter as ``RelationPlan.events`` decides, a keyed
        delete followed by its tombstone ``(writer, key, None, None)`` where
        the route wants them; None if this change must take the reference
        path (a key change among them). ``span``: the positions it took."""
        cdef const char* base = PyBytes_AS_STRING(frame)
        cdef Py_ssize_t n = PyBytes_GET_SIZE(frame)
        cdef Py_ssize_t pos
        cdef const char* p
        cdef uint8_t kind, old_kind = 0
        cdef unsigned int oid
        cdef int j, i, unchanged, r, nroutes = len(self.routes)
        cdef uint32_t partition
        cdef Route route
        cdef Buf* b
        cdef bint before, after, before_old, filtered = 0, was_in, now_in
        cdef int64_t change_lsn
        if at < 24 or at + 6 > n:
            return None
        p = base + at - 24
        change_lsn = <int64_t>_big_endian_u64(<const uint8_t*>p)
        p = base + at
        kind = <uint8_t>p[0]
        oid = ((<unsigned int>(<uint8_t>p[1]) << 24) | (<unsigned int>(<uint8_t>p[2]) << 16)
               | (<unsigned int>(<uint8_t>p[3]) << 8) | <unsigned int>(<uint8_t>p[4]))
        if oid != self.oid:
            return None
        pos = at + 6
        if kind == 0x55 and (p[5] == 0x4B or p[5] == 0x4F):  # Update with an old tuple: key 'K' or full 'O'
            old_kind = <uint8_t>p[5]
            pos = self._tuple(base, n, pos, self.old_state, self.old_start, self.old_size)
            if pos < 0 or pos + 1 > n or base[pos] != 0x4E:
                return None
            pos += 1
        elif not ((kind == 0x49 or kind == 0x55) and p[5] == 0x4E) and not (
                kind == 0x44 and (p[5] == 0x4B or p[5] == 0x4F)):  # Insert / Update 'N', Delete 'K' / 'O'
            return None
        if self._tuple(base, n, pos, self.state, self.start, self.size) < 0:
            return None
        for r in range(nroutes):
            if (<Route>self.routes[r]).row_filter is not None:
                filtered = 1
        self.span = 1
        if old_kind:
            for j in range(self.nkeys):
                i = self.keys[j]
                if (self.old_state[i] != S_TEXT or self.state[i] != S_TEXT or self.old_size[i] != self.size[i]
                        or memcmp(base + self.old_start[i], base + self.start[i], self.size[i]) != 0):
                    return None  # a key change: two events, each naming the other
            if old_kind == 0x4F:
                for j in range(self.ncols):
                    if self.old_state[j] == S_TOAST:
                        return None
                    if self.state[j] == S_TOAST:  # FULL logs the old row detoasted: the value is known
                        self.state[j] = self.old_state[j]
                        self.start[j] = self.old_start[j]
                        self.size[j] = self.old_size[j]
            if self.nkeys:
                self.span = 2
        new_row = old_row = None
        if filtered:
            if kind == 0x44:
                if p[5] == 0x4F:
                    old_row = self._filter_row(base, self.state, self.start, self.size)
            else:
                for i, name, load in self.filter_columns:
                    if self.state[i] == S_TOAST:
                        return None  # the filter needs a value pgoutput did not send: read from the source
                new_row = self._filter_row(base, self.state, self.start, self.size)
                if old_kind == 0x4F:
                    old_row = self._filter_row(base, self.old_state, self.old_start, self.old_size)
        out = []
        for route in self.routes:
            before_old = 0
            if kind == 0x49:
                if not self._match(route, new_row):
                    continue
                before, after, op = 0, 1, "c"
            elif kind == 0x44:
                if old_row is not None and not self._match(route, old_row):
                    continue
                before, after, op = 1, 0, "d"
            elif old_kind == 0x4F:  # the old row is known: move in, move out, stay
                was_in = self._match(route, old_row)
                now_in = self._match(route, new_row)
                if was_in and now_in:
                    before, after, before_old, op = 1, 1, 1, "u"
                elif now_in:
                    before, after, op = 0, 1, "c"
                elif was_in:
                    before, after, before_old, op = 1, 0, 1, "d"
                else:
                    continue
            elif self._match(route, new_row):  # old row unknown: an upsert, or a delete of what it may hold
                before, after, op = 0, 1, "u"
            else:
                before, after, op = 0, 0, "d"
            # The key, prefix and body: what the partition is chosen by.
            if route.nkeys:
                if not self._key(base, route):
                    return None  # a key column without a value: the reference path decides
                partition = (_murmur2(<const uint8_t*>self.key.data, self.key.len) & 0x7FFFFFFF) \
                    % <uint32_t>route.partitions
                key = PyBytes_FromStringAndSize(self.key.data, self.key.len)
            else:
                partition = <uint32_t>((lsn + op_index) % route.partitions)
                key = None
            b = &self.out
            b.len = 0
            _bytes_obj(b, route.value_prefix)
            if before:
                _byte(b, 2)
                self._before(b, base, route, before_old)
            else:
                _byte(b, 0)
            if after:
                _byte(b, 2)
                self._row(b, base, route)
            else:
                _byte(b, 0)
            _bytes_obj(b, route.source_head)
            _long(b, ts_ms)
            _bytes_obj(b, route.source_mid)
            _byte(b, 2)
            _long(b, xid)
            _byte(b, 2)
            _long(b, lsn)  # commit_lsn
            _byte(b, 2)
            _long(b, change_lsn)  # lsn: the change's own
            _long(b, op_index)
            _byte(b, 0)  # snapshot_id: null
            _byte(b, 2)  # op: a 1-character string
            _byte(b, <uint8_t>ord(op))
            _byte(b, 2)  # ts_ms: the long branch
            _long(b, seen_ms)
            # unchanged_toast: names of this shape's columns an UPDATE left in TOAST.
            unchanged = 0
            if kind == 0x55 and after:
                for j in range(self.ncols):
                    if self.state[j] == S_TOAST and route.toast_names[j] is not None:
                        unchanged += 1
            if unchanged:
                _long(b, unchanged)
                for j in range(self.ncols):
                    if self.state[j] == S_TOAST and route.toast_names[j] is not None:
                        _bytes_obj(b, route.toast_names[j])
            _byte(b, 0)
            value = PyBytes_FromStringAndSize(b.data, b.len)
            out.append((route.writers[partition], key, value, route.stats[op]))
            if op == "d" and key is not None and route.tombstones:
                out.append((route.writers[partition], key, None, None))
        return out

    cdef bint _copy_line(self, const char* p, Py_ssize_t k, Py_ssize_t end) except -1:
        """Index the COPY text row ``p[k:end]`` (without its newline): each
        field unescaped into ``self.line``, NULLs marked. False if it has not
        exactly this relation's number of fields or ends in a lone backslash."""
        cdef int i = 0, digits, v, h
        cdef char c
        cdef const char* hit
        cdef Buf* line = &self.line
        line.len = 0
        _reserve(line, end - k)  # unescaping never lengthens
        while True:
            if i >= self.ncols:
                return 0
            if p[k] == 92 and k + 1 < end and p[k + 1] == 78 and (k + 2 == end or p[k + 2] == 9):  # \N
                self.state[i] = S_NULL
                k += 2
            else:
                self.state[i] = S_TEXT
                self.start[i] = line.len
                while k < end and p[k] != 9:
                    c = p[k]
                    k += 1
                    if c == 92:  # backslash
                        if k == end:
                            return 0
                        c = p[k]
                        k += 1
                        hit = <const char*>memchr(_ESCAPE_LETTERS, c, 6)
                        if hit != NULL:
                            c = _ESCAPED_BYTES[hit - _ESCAPE_LETTERS]
                        elif 48 <= c <= 55:  # octal, up to 3 digits
                            v = c - 48
                            digits = 1
                            while digits < 3 and k < end and 48 <= p[k] <= 55:
                                v = v * 8 + (p[k] - 48)
                                k += 1
                                digits += 1
                            c = <char>(v & 0xFF)
                        elif c == 120 and k < end and _hexval(p[k]) >= 0:  # hex, up to 2 digits
                            v = _hexval(p[k])
                            k += 1
                            if k < end and _hexval(p[k]) >= 0:
                                v = v * 16 + _hexval(p[k])
                                k += 1
                            c = <char>v
                    line.data[line.len] = c
                    line.len += 1
                self.size[i] = line.len - self.start[i]
            i += 1
            if k >= end:
                return i == self.ncols
            k += 1  # the tab

    def encode_reads(self, bytes data, list suffixes, int64_t sent):
        """The messages of a chunk of ``COPY ... TO STDOUT`` text rows (whole
        lines, in relation column order), each an ``op = r`` read: ``suffixes``
        holds per route the envelope's bytes after ``after`` (the read's
        ``source``, op, ts_ms, unchanged_toast), or None for a route not read.
        A read passes its route's row filter; keyless reads are spread by the
        running count ``sent`` of reads sent. Returns ``([(writer, key, value,
        stats key)], sent)``, or None if a row must take the reference path."""
        cdef const char* base = PyBytes_AS_STRING(data)
        cdef Py_ssize_t n = PyBytes_GET_SIZE(data)
        cdef Py_ssize_t pos = 0, end
        cdef const char* eol
        cdef const char* p
        cdef int j, r, nroutes = len(self.routes)
        cdef uint32_t partition
        cdef Route route
        cdef Buf* b = &self.out
        cdef bint filtered = 0
        if len(suffixes) != nroutes:
            raise ValueError(f"{len(suffixes)} suffixes for {nroutes} routes")
        for r in range(nroutes):
            if suffixes[r] is not None and (<Route>self.routes[r]).row_filter is not None:
                filtered = 1
        out = []
        while pos < n:
            eol = <const char*>memchr(base + pos, 10, n - pos)
            if eol == NULL:
                raise ValueError("COPY data ends inside a row (no newline)")
            end = eol - base
            if not self._copy_line(base, pos, end):
                raise ValueError(f"a COPY row does not hold the relation's {self.ncols} columns: "
                                 f"{PyBytes_FromStringAndSize(base + pos, min(end - pos, 200))!r}")
            p = self.line.data
            if self.n_special:
                for j in range(self.ncols):
                    self.special[j] = None
                self.n_special = 0
            row = self._filter_row(p, self.state, self.start, self.size) if filtered else None
            for r in range(nroutes):
                suffix = suffixes[r]
                if suffix is None:
                    continue
                route = <Route>self.routes[r]
                if route.row_filter is not None and not route.row_filter(row):
                    continue
                if route.nkeys:
                    if not self._key(p, route):
                        return None
                    partition = (_murmur2(<const uint8_t*>self.key.data, self.key.len) & 0x7FFFFFFF) \
                        % <uint32_t>route.partitions
                    key = PyBytes_FromStringAndSize(self.key.data, self.key.len)
                else:
                    partition = <uint32_t>(sent % route.partitions)
                    key = None
                b.len = 0
                _bytes_obj(b, route.value_prefix)
                _byte(b, 0)  # before: null
                _byte(b, 2)
                self._row(b, p, route)
                _bytes_obj(b, <bytes>suffix)
                out.append((route.writers[partition], key, PyBytes_FromStringAndSize(b.data, b.len),
                            route.stats["r"]))
                sent += 1
            pos = end + 1
        return out, sent

    cdef dict _filter_row(self, const char* p, uint8_t* state, Py_ssize_t* start, Py_ssize_t* size):
        """The row filters' columns of a row, loaded as the reference loads them."""
        row = {}
        for i, name, load in self.filter_columns:
            row[name] = load(PyBytes_FromStringAndSize(p + start[i], size[i])) if state[i] == S_TEXT else None
        return row
