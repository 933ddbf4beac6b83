"""Pure decoder for PostgreSQL's ``pgoutput`` logical replication protocol (v1)
and the replication stream's CopyBoth framing.

Invariants:
- No I/O: functions take ``bytes`` and return plain values.
- Column values stay in their wire form here: ``bytes`` (text format), ``None``
  for SQL NULL, or the :data:`UNCHANGED_TOAST` sentinel for a TOASTed column an
  UPDATE did not change. Turning text into Python values is
  :mod:`producer.pgtypes`' job, done once per change whatever the number of shapes.
- LSNs are integers (``0/16B3748`` → ``0x16B3748``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Union

# Microseconds between the Unix epoch and PostgreSQL's epoch (2000-01-01).
PG_EPOCH_UNIX_US = 946_684_800_000_000


class _UnchangedToast:
    __slots__ = ()

    def __repr__(self) -> str:
        return "UNCHANGED_TOAST"


UNCHANGED_TOAST = _UnchangedToast()

ColumnValue = Union[bytes, None, _UnchangedToast]


def lsn_to_int(lsn: str) -> int:
    hi, lo = lsn.split("/")
    return (int(hi, 16) << 32) | int(lo, 16)


def lsn_to_str(lsn: int) -> str:
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def pg_us_to_unix_ms(pg_us: int) -> int:
    return (pg_us + PG_EPOCH_UNIX_US) // 1000


@dataclass(frozen=True, slots=True)
class Column:
    name: str
    type_oid: int
    typmod: int
    is_key: bool  # part of the replica identity


@dataclass(frozen=True, slots=True)
class Relation:
    oid: int
    schema: str
    name: str
    replica_identity: str  # 'd' default, 'n' nothing, 'f' full, 'i' index
    columns: tuple[Column, ...]


@dataclass(frozen=True, slots=True)
class TypeMsg:
    oid: int
    schema: str
    name: str


@dataclass(frozen=True, slots=True)
class Begin:
    final_lsn: int  # the commit LSN: a transaction's position is known at its start
    commit_ts_us: int  # microseconds since 2000-01-01 UTC
    xid: int


@dataclass(frozen=True, slots=True)
class Commit:
    commit_lsn: int
    end_lsn: int
    commit_ts_us: int


@dataclass(frozen=True, slots=True)
class Insert:
    relation_oid: int
    new: tuple[ColumnValue, ...]


@dataclass(frozen=True, slots=True)
class Update:
    relation_oid: int
    # Old values: key columns only ('K') or the whole row ('O', REPLICA IDENTITY
    # FULL); None when the key did not change and identity is not FULL.
    old: tuple[ColumnValue, ...] | None
    old_is_key_only: bool
    new: tuple[ColumnValue, ...]


@dataclass(frozen=True, slots=True)
class Delete:
    relation_oid: int
    old: tuple[ColumnValue, ...]
    old_is_key_only: bool


@dataclass(frozen=True, slots=True)
class Truncate:
    relation_oids: tuple[int, ...]
    cascade: bool
    restart_identity: bool


@dataclass(frozen=True, slots=True)
class Origin:
    lsn: int
    name: str


@dataclass(frozen=True, slots=True)
class LogicalMessage:
    transactional: bool
    lsn: int
    prefix: str
    content: bytes


Message = Union[Begin, Commit, Relation, TypeMsg, Insert, Update, Delete, Truncate, Origin, LogicalMessage]

_I16 = struct.Struct("!h")
_I32 = struct.Struct("!i")
_U32 = struct.Struct("!I")
_BEGIN = struct.Struct("!QqI")
_COMMIT = struct.Struct("!BQQq")
_REL_HEAD = struct.Struct("!I")
_COL_TAIL = struct.Struct("!Ii")


def _cstring(buf: bytes, pos: int) -> tuple[str, int]:
    end = buf.index(0, pos)
    return buf[pos:end].decode(), end + 1


def _tuple(buf: bytes, pos: int) -> tuple[tuple[ColumnValue, ...], int]:
    (ncols,) = _I16.unpack_from(buf, pos)
    pos += 2
    values: list[ColumnValue] = []
    append = values.append
    for _ in range(ncols):
        kind = buf[pos]
        pos += 1
        if kind == 0x74 or kind == 0x62:  # 't' text, 'b' binary
            (size,) = _I32.unpack_from(buf, pos)
            pos += 4
            append(buf[pos:pos + size])
            pos += size
        elif kind == 0x6E:  # 'n'
            append(None)
        elif kind == 0x75:  # 'u'
            append(UNCHANGED_TOAST)
        else:
            raise ValueError(f"pgoutput: unknown tuple column kind {chr(kind)!r} at byte {pos - 1}")
    return tuple(values), pos


def decode(buf: bytes) -> Message:
    """Decode one pgoutput message (the payload of an XLogData frame)."""
    kind = buf[0]
    if kind == 0x49:  # 'I'
        (rel,) = _U32.unpack_from(buf, 1)
        new, _ = _tuple(buf, 6)  # skip 'N'
        return Insert(rel, new)
    if kind == 0x55:  # 'U'
        (rel,) = _U32.unpack_from(buf, 1)
        pos = 5
        old = None
        key_only = False
        if buf[pos] in (0x4B, 0x4F):  # 'K' / 'O'
            key_only = buf[pos] == 0x4B
            old, pos = _tuple(buf, pos + 1)
        new, _ = _tuple(buf, pos + 1)  # skip 'N'
        return Update(rel, old, key_only, new)
    if kind == 0x44:  # 'D'
        (rel,) = _U32.unpack_from(buf, 1)
        key_only = buf[5] == 0x4B
        old, _ = _tuple(buf, 6)
        return Delete(rel, old, key_only)
    if kind == 0x42:  # 'B'
        final_lsn, ts, xid = _BEGIN.unpack_from(buf, 1)
        return Begin(final_lsn, ts, xid)
    if kind == 0x43:  # 'C'
        _flags, commit_lsn, end_lsn, ts = _COMMIT.unpack_from(buf, 1)
        return Commit(commit_lsn, end_lsn, ts)
    if kind == 0x52:  # 'R'
        (oid,) = _REL_HEAD.unpack_from(buf, 1)
        schema, pos = _cstring(buf, 5)
        name, pos = _cstring(buf, pos)
        identity = chr(buf[pos])
        (ncols,) = _I16.unpack_from(buf, pos + 1)
        pos += 3
        cols = []
        for _ in range(ncols):
            flags = buf[pos]
            colname, pos = _cstring(buf, pos + 1)
            type_oid, typmod = _COL_TAIL.unpack_from(buf, pos)
            pos += 8
            cols.append(Column(colname, type_oid, typmod, bool(flags & 1)))
        return Relation(oid, schema, name, identity, tuple(cols))
    if kind == 0x59:  # 'Y'
        (oid,) = _U32.unpack_from(buf, 1)
        schema, pos = _cstring(buf, 5)
        name, _ = _cstring(buf, pos)
        return TypeMsg(oid, schema, name)
    if kind == 0x54:  # 'T'
        (n,) = _I32.unpack_from(buf, 1)
        opts = buf[5]
        oids = struct.unpack_from(f"!{n}I", buf, 6)
        return Truncate(tuple(oids), bool(opts & 1), bool(opts & 2))
    if kind == 0x4F:  # 'O'
        (lsn,) = struct.unpack_from("!Q", buf, 1)
        name, _ = _cstring(buf, 9)
        return Origin(lsn, name)
    if kind == 0x4D:  # 'M'
        flags = buf[1]
        (lsn,) = struct.unpack_from("!Q", buf, 2)
        prefix, pos = _cstring(buf, 10)
        (size,) = _I32.unpack_from(buf, pos)
        return LogicalMessage(bool(flags & 1), lsn, prefix, bytes(buf[pos + 4:pos + 4 + size]))
    raise ValueError(f"pgoutput: unknown message type {chr(kind)!r}")


# --- CopyBoth framing of the walsender protocol -------------------------------

_XLOGDATA = struct.Struct("!QQq")
_KEEPALIVE = struct.Struct("!QqB")
_STATUS = struct.Struct("!cQQQqB")


@dataclass(frozen=True, slots=True)
class XLogData:
    wal_start: int
    wal_end: int
    payload: bytes


@dataclass(frozen=True, slots=True)
class Keepalive:
    wal_end: int
    reply_requested: bool


def decode_frame(frame: bytes) -> XLogData | Keepalive:
    kind = frame[0]
    if kind == 0x77:  # 'w'
        start, end, _ts = _XLOGDATA.unpack_from(frame, 1)
        return XLogData(start, end, frame[25:])
    if kind == 0x6B:  # 'k'
        end, _ts, reply = _KEEPALIVE.unpack_from(frame, 1)
        return Keepalive(end, bool(reply))
    raise ValueError(f"replication stream: unknown frame type {chr(kind)!r}")


def standby_status(write_lsn: int, flush_lsn: int, apply_lsn: int, now_pg_us: int, reply: bool = False) -> bytes:
    """A Standby Status Update ('r') frame for the replication connection."""
    return _STATUS.pack(b"r", write_lsn, flush_lsn, apply_lsn, now_pg_us, 1 if reply else 0)
