"""pgoutput decoding on hand-built protocol messages."""

import struct

import pytest

from producer import pgoutput as po


def cstr(s: str) -> bytes:
    return s.encode() + b"\0"


def tuple_data(*cols) -> bytes:
    out = struct.pack("!h", len(cols))
    for c in cols:
        if c is None:
            out += b"n"
        elif c is po.UNCHANGED_TOAST:
            out += b"u"
        else:
            out += b"t" + struct.pack("!i", len(c)) + c
    return out


def test_lsn_round_trip():
    assert po.lsn_to_int("16/B374D848") == (0x16 << 32) | 0xB374D848
    assert po.lsn_to_str(po.lsn_to_int("0/15288E0")) == "0/15288E0"


def test_begin_commit():
    b = po.decode(b"B" + struct.pack("!QqI", 0x1528B28, 123456789, 735))
    assert b == po.Begin(0x1528B28, 123456789, 735)
    c = po.decode(b"C" + struct.pack("!BQQq", 0, 0x1528B28, 0x1528B58, 42))
    assert c == po.Commit(0x1528B28, 0x1528B58, 42)


def test_relation_and_type():
    body = (b"R" + struct.pack("!I", 16384) + cstr("public") + cstr("orders") + b"d" + struct.pack("!h", 2)
            + b"\x01" + cstr("id") + struct.pack("!Ii", 23, -1)
            + b"\x00" + cstr("total") + struct.pack("!Ii", 1700, 655366))
    rel = po.decode(body)
    assert rel.schema == "public" and rel.name == "orders" and rel.replica_identity == "d"
    assert rel.columns == (po.Column("id", 23, -1, True), po.Column("total", 1700, 655366, False))
    t = po.decode(b"Y" + struct.pack("!I", 99999) + cstr("public") + cstr("mood"))
    assert t == po.TypeMsg(99999, "public", "mood")


def test_insert_update_delete_tuples():
    ins = po.decode(b"I" + struct.pack("!I", 7) + b"N" + tuple_data(b"1", None, po.UNCHANGED_TOAST))
    assert ins == po.Insert(7, (b"1", None, po.UNCHANGED_TOAST))
    upd = po.decode(b"U" + struct.pack("!I", 7) + b"N" + tuple_data(b"2", b"x"))
    assert upd == po.Update(7, None, False, (b"2", b"x"))
    upd_k = po.decode(b"U" + struct.pack("!I", 7) + b"K" + tuple_data(b"1", None) + b"N" + tuple_data(b"2", b"x"))
    assert upd_k.old == (b"1", None) and upd_k.old_is_key_only and upd_k.new == (b"2", b"x")
    upd_o = po.decode(b"U" + struct.pack("!I", 7) + b"O" + tuple_data(b"1", b"y") + b"N" + tuple_data(b"1", b"x"))
    assert upd_o.old == (b"1", b"y") and not upd_o.old_is_key_only
    dele = po.decode(b"D" + struct.pack("!I", 7) + b"K" + tuple_data(b"1", None))
    assert dele == po.Delete(7, (b"1", None), True)


def test_truncate_and_message():
    t = po.decode(b"T" + struct.pack("!iB", 2, 3) + struct.pack("!II", 10, 11))
    assert t == po.Truncate((10, 11), True, True)
    m = po.decode(b"M" + b"\x01" + struct.pack("!Q", 5) + cstr("wb") + struct.pack("!i", 3) + b"abc")
    assert m == po.LogicalMessage(True, 5, "wb", b"abc")


def test_unknown_message_is_an_error():
    with pytest.raises(ValueError, match="unknown message type"):
        po.decode(b"Z\0\0")


def test_frames_and_status():
    ka = po.decode_frame(b"k" + struct.pack("!QqB", 100, 5, 1))
    assert ka == po.Keepalive(100, True)
    x = po.decode_frame(b"w" + struct.pack("!QQq", 1, 2, 3) + b"payload")
    assert x == po.XLogData(1, 2, b"payload")
    st = po.standby_status(10, 9, 8, 7, True)
    assert st[0:1] == b"r" and struct.unpack("!QQQqB", st[1:]) == (10, 9, 8, 7, 1)
