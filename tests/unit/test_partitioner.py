"""Partitions as Java clients choose them: murmur2 against the reference values
of Apache Kafka's ``UtilsTest.testMurmur2`` and librdkafka's ``rdmurmur2.c``
unit test, for the pure-Python hash and the compiled one."""

import pytest

from producer import partitioner
from schemas import compiled_extension

# Apache Kafka clients/src/test/.../utils/UtilsTest.java: Utils.murmur2 as a signed int.
JAVA = {
    b"21": -973932308,
    b"foobar": -790332482,
    b"a-little-bit-long-string": -985981536,
    b"a-little-bit-longer-string": -1486304829,
    b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
    b"abc": 479470107,
}
# librdkafka src/rdmurmur2.c, unittest_murmur2 (java_murmur2_results), unsigned.
LIBRDKAFKA = {
    b"kafka": 0xD067CF64,
    b"giberish123456789": 0x8F552B0C,
    b"1234": 0x9FC97B14,
    b"234": 0xE7C009CA,
    b"34": 0x873930DA,
    b"4": 0x5A4B5CA1,
    b"PreAmbleWillBeRemoved,ThePrePartThatIs": 0x78424F1C,
    b"reAmbleWillBeRemoved,ThePrePartThatIs": 0x4A62B377,
    b"eAmbleWillBeRemoved,ThePrePartThatIs": 0xE0E4E09E,
    b"AmbleWillBeRemoved,ThePrePartThatIs": 0x62B8B43F,
    b"": 0x106E08D9,
}
_compiled = compiled_extension("producer._fastcodec")
HASHES = [pytest.param(partitioner.murmur2_reference, id="python"),
          pytest.param(_compiled.murmur2 if _compiled else None, id="compiled",
                       marks=pytest.mark.skipif(_compiled is None, reason="producer._fastcodec is not built"))]


def signed(h: int) -> int:
    return h - 2**32 if h >= 2**31 else h


@pytest.mark.parametrize("murmur2", HASHES)
def test_murmur2_matches_the_java_client(murmur2):
    assert {k: signed(murmur2(k)) for k in JAVA} == JAVA


@pytest.mark.parametrize("murmur2", HASHES)
def test_murmur2_matches_librdkafka(murmur2):
    assert {k: murmur2(k) for k in LIBRDKAFKA} == LIBRDKAFKA


def test_compiled_and_python_agree_on_every_length():
    if _compiled is None:
        pytest.skip("producer._fastcodec is not built")
    for n in range(70):
        data = bytes((i * 37 + n) & 0xFF for i in range(n))
        assert _compiled.murmur2(data) == partitioner.murmur2_reference(data)


def test_partition_is_javas_positive_hash_modulo():
    # Java: Utils.toPositive(Utils.murmur2(key)) % numPartitions.
    for key, h in JAVA.items():
        for n in (1, 3, 4, 7, 12):
            assert partitioner.partition_for(key, 0, n) == (h & 0x7FFFFFFF) % n
    assert partitioner.partition_for(None, 17, 4) == 1  # keyless: the caller's fallback
