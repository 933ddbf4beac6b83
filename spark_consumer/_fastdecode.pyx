# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Compiled envelope reader of the Spark source's executors: the Avro body of
one message (after the wire prefix) → the envelope's parts as the builder
needs them, without a dict per record and without a file object per field.

Invariants:
- Values equal fastavro's ``schemaless_reader`` on the same writer schema with
  the date/time/timestamp/uuid logical types stripped (``decode.strip_logical_types``):
  ints for int/long (and the stripped dates, times, timestamps), floats, bools,
  str (strict UTF-8), bytes, ``Decimal`` built exactly as fastavro builds it,
  lists for arrays, the symbol for enums.
- Stricter than fastavro, never laxer: anything doubtful (truncation, a varint
  longer than 10 bytes, a negative length or block count, a union or enum
  index out of range, invalid UTF-8, bytes after the record) raises
  :class:`CorruptBody`. The caller then decodes the message with fastavro,
  which decides: so a message is undecodable exactly when fastavro says so.
- A node tree is built once per writer schema (``compile_envelope``); it is
  read-only afterwards, so one reader may serve any thread.
- Pure: no I/O.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.float cimport PyFloat_FromDouble
from cpython.long cimport PyLong_FromLongLong
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy

import json
from decimal import Context, Decimal

from schemas import wire


class CorruptBody(ValueError):
    """The compiled reader cannot read these bytes (the reference decides)."""


class UnsupportedWriterSchema(ValueError):
    """The writer schema uses something this reader does not read."""


cdef enum:
    K_NULL = 0
    K_BOOLEAN
    K_INT  # int and long: same encoding, same Python value
    K_FLOAT
    K_DOUBLE
    K_BYTES
    K_STRING
    K_DECIMAL
    K_ARRAY
    K_UNION
    K_RECORD
    K_ENUM
    K_DECIMAL_UNSCALED  # a decimal column of the layout with the same (p <= 18, s): Unscaled values

cdef int64_t[19] _POW10 = [1, 10, 100, 1000, 10000, 100000, 1000000, 10000000, 100000000, 1000000000,
                           10000000000, 100000000000, 1000000000000, 10000000000000, 100000000000000,
                           1000000000000000, 10000000000000000, 100000000000000000, 1000000000000000000]
MAX_UNSCALED_PRECISION = 18

_PRIMITIVE_KINDS = {"null": K_NULL, "boolean": K_BOOLEAN, "int": K_INT, "long": K_INT, "float": K_FLOAT,
                    "double": K_DOUBLE, "bytes": K_BYTES, "string": K_STRING}


cdef class Node:
    """One Avro type of the writer schema."""
    cdef int kind
    cdef Node items  # array
    cdef tuple branches  # union: Node per branch
    cdef tuple fields  # record: Node per field, in writer order
    cdef tuple slots  # record: where each field's value goes in the output list (-1: read and drop)
    cdef Py_ssize_t n_slots
    cdef object context  # decimal: fastavro's Context(prec=precision)
    cdef int scale
    cdef int precision
    cdef tuple symbols  # enum

    def __cinit__(self, int kind):
        self.kind = kind
        self.n_slots = 0


cdef struct Cursor:
    const uint8_t *p
    const uint8_t *end


cdef inline int _need(Cursor *c, Py_ssize_t n) except -1:
    if n < 0 or c.end - c.p < n:
        raise CorruptBody("truncated")
    return 0


cdef inline int64_t _read_long(Cursor *c) except? -1:
    # fastavro's arithmetic (uint64, shift by 7 per byte) for up to 10 bytes;
    # a longer varint is where fastavro's C shifts go undefined: refuse it.
    cdef uint64_t n = 0
    cdef uint64_t byte
    cdef int shift = 0
    while True:
        if c.p >= c.end:
            raise CorruptBody("truncated varint")
        byte = c.p[0]
        c.p += 1
        n |= (byte & 0x7F) << shift
        if not (byte & 0x80):
            break
        shift += 7
        if shift > 63:
            raise CorruptBody("varint longer than 10 bytes")
    return <int64_t>((n >> 1) ^ (-(n & 1)))


cdef class Unscaled:
    """A decimal as its unscaled integer at its column's scale: how the compiled
    reader hands decimal(p <= 18, s) values on, so that ``decimal_column``
    builds their Arrow column from integers instead of ``Decimal`` objects. Never
    reaches pyarrow itself (pyarrow would take an int as the scaled value)."""
    cdef readonly int64_t value
    cdef object context
    cdef int scale

    def to_decimal(self):
        """The ``Decimal`` fastavro gives for the same bytes."""
        return self.context.create_decimal(self.value).scaleb(-self.scale, self.context)

    def __repr__(self):
        return f"Unscaled({self.value}, scale={self.scale})"


cdef object _read_unscaled(Node node, Cursor *c):
    cdef int64_t size = _read_long(c)
    cdef int64_t v
    cdef Py_ssize_t i
    cdef Unscaled out
    _need(c, size)
    if size > 8:
        return _decimal_of(node, c, size)
    v = 0
    if size > 0:
        v = -1 if c.p[0] & 0x80 else 0
        for i in range(size):
            v = <int64_t>((<uint64_t>v << 8) | c.p[i])
    if v >= _POW10[node.precision] or v <= -_POW10[node.precision]:
        return _decimal_of(node, c, size)  # more digits than declared: fastavro rounds, so does the reference
    c.p += size
    out = Unscaled.__new__(Unscaled)
    out.value = v
    out.context = node.context
    out.scale = node.scale
    return out


cdef object _decimal_of(Node node, Cursor *c, int64_t size):
    data = PyBytes_FromStringAndSize(<const char *>c.p, size)
    c.p += size
    context = node.context
    return context.create_decimal(int.from_bytes(data, "big", signed=True)).scaleb(-node.scale, context)


cdef object _read_decimal(Node node, Cursor *c):
    cdef int64_t size = _read_long(c)
    _need(c, size)
    return _decimal_of(node, c, size)


cdef object _read(Node node, Cursor *c):
    cdef int64_t n
    cdef int64_t i
    cdef uint32_t u32
    cdef uint64_t u64
    cdef float f32
    cdef double f64
    cdef int kind = node.kind
    cdef list out
    if kind == K_INT:
        return PyLong_FromLongLong(_read_long(c))
    if kind == K_UNION:
        n = _read_long(c)
        if n < 0 or n >= len(node.branches):
            raise CorruptBody("union branch out of range")
        return _read(<Node>node.branches[n], c)
    if kind == K_STRING:
        n = _read_long(c)
        _need(c, n)
        c.p += n
        return PyUnicode_DecodeUTF8(<const char *>(c.p - n), n, NULL)
    if kind == K_NULL:
        return None
    if kind == K_RECORD:
        out = [None] * node.n_slots
        for i in range(len(node.fields)):
            value = _read(<Node>node.fields[i], c)
            n = <int64_t>node.slots[i]
            if n >= 0:
                out[n] = value
        return out
    if kind == K_BOOLEAN:
        _need(c, 1)
        c.p += 1
        return c.p[-1] != 0
    if kind == K_DOUBLE:
        _need(c, 8)
        u64 = (<uint64_t>c.p[0] | (<uint64_t>c.p[1] << 8) | (<uint64_t>c.p[2] << 16) | (<uint64_t>c.p[3] << 24)
               | (<uint64_t>c.p[4] << 32) | (<uint64_t>c.p[5] << 40) | (<uint64_t>c.p[6] << 48)
               | (<uint64_t>c.p[7] << 56))
        memcpy(&f64, &u64, 8)
        c.p += 8
        return PyFloat_FromDouble(f64)
    if kind == K_FLOAT:
        _need(c, 4)
        u32 = (<uint32_t>c.p[0] | (<uint32_t>c.p[1] << 8) | (<uint32_t>c.p[2] << 16) | (<uint32_t>c.p[3] << 24))
        memcpy(&f32, &u32, 4)
        c.p += 4
        return PyFloat_FromDouble(<double>f32)
    if kind == K_BYTES:
        n = _read_long(c)
        _need(c, n)
        c.p += n
        return PyBytes_FromStringAndSize(<const char *>(c.p - n), n)
    if kind == K_DECIMAL_UNSCALED:
        return _read_unscaled(node, c)
    if kind == K_DECIMAL:
        return _read_decimal(node, c)
    if kind == K_ARRAY:
        out = []
        while True:
            n = _read_long(c)
            if n == 0:
                return out
            if n < 0:  # blocks with a byte size: fastavro reads them, the producer never writes them
                raise CorruptBody("array block with a byte size")
            for i in range(n):
                out.append(_read(node.items, c))
    if kind == K_ENUM:
        n = _read_long(c)
        if n < 0 or n >= len(node.symbols):
            raise CorruptBody("enum index out of range")
        return node.symbols[n]
    raise CorruptBody(f"unknown node kind {kind}")


cdef class EnvelopeReader:
    """Reads envelopes of one writer schema into nested lists (see ``read``)."""
    cdef Node root

    def __cinit__(self, Node root):
        self.root = root

    def read(self, bytes data, Py_ssize_t body_offset):
        """The envelope record at ``data[body_offset:]`` as the list its
        compiled slots describe; every byte must belong to it."""
        cdef Cursor c
        if body_offset < 0 or body_offset > PyBytes_GET_SIZE(data):
            raise CorruptBody("body offset beyond the message")
        c.p = <const uint8_t *>PyBytes_AS_STRING(data) + body_offset
        c.end = <const uint8_t *>PyBytes_AS_STRING(data) + PyBytes_GET_SIZE(data)
        record = _read(self.root, &c)
        if c.p != c.end:
            raise CorruptBody("bytes after the record")
        return record


# ------------------------------------------------------------ compiling
def _full_name(name: str, namespace: str | None) -> str:
    return name if "." in name or not namespace else f"{namespace}.{name}"


def _compile(t, dict named, dict slot_maps, namespace, tuple unscaled=None):
    """``unscaled``: the (precision, scale) of the layout's decimal column this
    type is read into, when its values may travel as :class:`Unscaled`."""
    cdef Node node
    if isinstance(t, str):
        kind = _PRIMITIVE_KINDS.get(t)
        if kind is not None:
            return Node(kind)
        found = named.get(_full_name(t, namespace)) or named.get(t)
        if found is None:
            raise UnsupportedWriterSchema(f"unknown named type {t!r}")
        return found
    if isinstance(t, list):
        node = Node(K_UNION)
        node.branches = tuple(_compile(b, named, slot_maps, namespace, unscaled) for b in t)
        return node
    if not isinstance(t, dict):
        raise UnsupportedWriterSchema(f"unexpected Avro type {t!r}")
    base = t.get("type")
    logical = t.get("logicalType")
    if base == "record":
        full = _full_name(t["name"], t.get("namespace", namespace))
        slot_map = slot_maps.get(full)
        if slot_map is None:
            raise UnsupportedWriterSchema(f"record {full!r} has no place in the output")
        node = Node(K_RECORD)
        named[full] = node
        inner_ns = full.rpartition(".")[0] or None
        fields = t["fields"]
        unscaled_fields = slot_maps.get((full, "unscaled"), {})
        node.fields = tuple(_compile(f["type"], named, slot_maps, inner_ns, unscaled_fields.get(f["name"]))
                            for f in fields)
        node.slots = tuple(slot_map.get(f["name"], -1) for f in fields)
        node.n_slots = max(slot_map.values(), default=-1) + 1
        return node
    if logical is not None:
        if logical == "decimal" and base == "bytes":
            precision, scale = int(t["precision"]), int(t.get("scale", 0))
            same = unscaled == (precision, scale) and 0 < precision <= MAX_UNSCALED_PRECISION
            node = Node(K_DECIMAL_UNSCALED if same else K_DECIMAL)
            node.context = Context(prec=precision)
            node.precision = precision
            node.scale = scale
            return node
        raise UnsupportedWriterSchema(f"logical type {logical!r} on {base!r}")
    if base == "array":
        node = Node(K_ARRAY)
        node.items = _compile(t["items"], named, slot_maps, namespace)
        return node
    if base == "enum":
        node = Node(K_ENUM)
        full = _full_name(t["name"], t.get("namespace", namespace))
        node.symbols = tuple(t["symbols"])
        named[full] = node
        return node
    if isinstance(base, (str, list, dict)) and base not in ("map", "fixed", "error"):
        return _compile(base, named, slot_maps, namespace, unscaled)
    raise UnsupportedWriterSchema(f"Avro type {base!r} is not supported")


def compile_envelope(dict schema, dict slot_maps):
    """The reader of envelopes written with ``schema`` (logical types stripped as
    for fastavro). ``slot_maps``: {record full name: {field name: output slot}}
    for every record the schema holds; a record read becomes a list of its
    slots (missing fields None, unmapped fields read and dropped);
    {(record full name, "unscaled"): {field name: (precision, scale)}}: decimal
    fields read as :class:`Unscaled` where the writer declares that same
    precision (<= 18) and scale. Raises
    :class:`UnsupportedWriterSchema` for anything it does not read."""
    return EnvelopeReader(_compile(schema, {}, slot_maps, schema.get("namespace")))


# ------------------------------------------------------------ decimal columns
def decimal_column(list values, int precision, int scale):
    """The unscaled integers (None for nulls) of a decimal(precision, scale)
    column whose values are :class:`Unscaled`, None, or ``Decimal`` with
    exactly ``scale`` places and at most ``precision`` digits; None when any
    value is something else (the caller then converts value by value)."""
    cdef Py_ssize_t i
    cdef Py_ssize_t n = len(values)
    cdef list out = [None] * n
    for i in range(n):
        v = values[i]
        if v is None:
            continue
        if type(v) is Unscaled:
            out[i] = (<Unscaled>v).value
        elif type(v) is Decimal:
            t = v.as_tuple()
            if t.exponent != -scale or len(t.digits) > precision:
                return None
            out[i] = int(v.scaleb(scale))
        else:
            return None
    return out


# ------------------------------------------------------------ whole rows
cdef object _POSITION_HEADER = wire.POSITION_HEADER
cdef object _CONTROL_HEADER = wire.CONTROL_HEADER
cdef object _SNAPSHOT_HEADER = wire.SNAPSHOT_HEADER
cdef frozenset _OPS = frozenset(("c", "u", "d", "r", "t"))


cdef inline uint64_t _big_endian_u64(const uint8_t *p):
    cdef uint64_t n = 0
    cdef int i
    for i in range(8):
        n = (n << 8) | p[i]
    return n


cdef class RowAssembler:
    """The builder's row of an ordinary change message in one call: headers,
    writer lookup by wire prefix, envelope, special values, bookkeeping
    (``decode.BatchBuilder.add`` spells out the same steps; the unit tests
    hold the two side by side). Returns None for anything else (control
    events, unknown prefixes, damaged headers or bodies, odd ops, deletes whose
    key must come from the message key): the builder then takes its own path,
    which also raises where a message is undecodable."""
    cdef dict by_prefix  # the builder's: wire prefix -> (parsed, body offset, reader or None)
    cdef tuple special  # (column index, column name) of columns with a special (string) branch
    cdef tuple key_indexes
    cdef dict name_by_field
    cdef tuple names
    cdef frozenset column_names
    cdef tuple unscaled_indexes  # columns whose values may be Unscaled (``_wb_before`` holds Decimals)
    cdef Py_ssize_t n_row

    def __cinit__(self, dict by_prefix, special, key_indexes, dict name_by_field, names, unscaled_indexes):
        self.by_prefix = by_prefix
        self.unscaled_indexes = tuple(unscaled_indexes)
        self.special = tuple(special)
        self.key_indexes = tuple(key_indexes)
        self.name_by_field = name_by_field
        self.names = tuple(names)
        self.column_names = frozenset(self.names)
        self.n_row = len(self.names)

    cdef list _take_specials(self, list values):
        """Takes the side field off ``values`` and moves the special values
        (the side field's, and string-branch values of special columns) out:
        their [(column, text)], or None. Raises on a side field that is not a
        JSON object of texts (the builder's own path then decides)."""
        cdef Py_ssize_t i
        cdef list special = None
        side = values.pop()
        for i, name in self.special:
            v = values[i]
            if type(v) is str:
                if special is None:
                    special = []
                special.append((name, v))
                values[i] = None
        if side is not None:
            pairs = json.loads(side)
            if type(pairs) is not dict:
                raise ValueError("side field is not a JSON object")
            for name, text in (<dict>pairs).items():
                if type(text) is not str:
                    raise ValueError("side field value is not a text")
                if name in self.column_names:
                    if special is None:
                        special = []
                    special.append((name, text))
        return special

    def add(self, topic, partition, offset, key, value, headers):
        cdef Py_ssize_t i
        cdef const uint8_t *p
        cdef EnvelopeReader reader
        cdef list values
        if value is None or type(value) is not bytes or PyBytes_GET_SIZE(value) < 5:
            return None
        pos = snapshot = None
        if headers:
            for header in headers:
                name = header[0]
                if name == _POSITION_HEADER:
                    pos = header[1]
                elif name == _SNAPSHOT_HEADER:
                    snapshot = header[1]
                elif name == _CONTROL_HEADER:
                    return None
        lsn = op_index = None
        if pos is not None:
            if type(pos) is not bytes or PyBytes_GET_SIZE(pos) != 16:
                return None
            p = <const uint8_t *>PyBytes_AS_STRING(pos)
            lsn = _big_endian_u64(p)
            op_index = _big_endian_u64(p + 8)
        p = <const uint8_t *>PyBytes_AS_STRING(value)
        head = value[:10] if p[0] == 0xC3 else value[:5]
        found = self.by_prefix.get(head)
        if found is None or (<tuple>found)[2] is None:
            return None
        reader = <EnvelopeReader>(<tuple>found)[2]
        try:
            envelope = reader.read(value, (<tuple>found)[1])
        except Exception:
            return None
        before, after, source, op, ts_ms, unchanged = <list>envelope
        if not (type(op) is str and op in _OPS):
            return None
        if (lsn is None or snapshot is None) and source is not None:
            if lsn is None:
                lsn = (<list>source)[0] if (<list>source)[3] is None else (<list>source)[3]
                op_index = (<list>source)[1]
            if snapshot is None:
                snapshot = (<list>source)[2]
        if op == "d":
            row = before
            if key is not None and self.key_indexes:
                if row is None:
                    return None
                for i in self.key_indexes:
                    if (<list>row)[i] is None:
                        return None
        else:
            row = after
        special = None
        if row is None:
            values = [None] * self.n_row
        else:
            values = <list>row
            try:
                special = self._take_specials(values)
            except ValueError:  # a damaged side field: the builder's path decides
                return None
        if unchanged:
            unchanged = [self.name_by_field.get(f, f) for f in unchanged]
        else:
            unchanged = None
        before_special = None
        if op == "u" and before is not None:
            try:
                before_special = self._take_specials(<list>before)
            except ValueError:
                return None
            for i in self.unscaled_indexes:
                v = (<list>before)[i]
                if type(v) is Unscaled:
                    (<list>before)[i] = (<Unscaled>v).to_decimal()
            before = dict(zip(self.names, <list>before))
        else:
            before = None
        if snapshot is not None and type(snapshot) is not str:
            snapshot = bytes(snapshot).decode("utf-8", "replace")
        values += (op, lsn, op_index, topic, partition, offset, unchanged, special, None, None,
                   snapshot, ts_ms, None, before, before_special)
        return values
