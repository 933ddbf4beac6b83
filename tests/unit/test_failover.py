"""Failover or ordinary reconnect, a good slot copy or a bad one: the pure
judgement of ``producer.failover``."""

from __future__ import annotations

import pytest

from producer.failover import FailoverError, Server, SlotCopy, judge
from schemas.failures import SOURCE

SLOT = "wb"
PRIMARY = Server("7712393288383801033", 1)
PROMOTED = Server("7712393288383801033", 2)
SYNCED = SlotCopy(failover=True, synced=True, temporary=False)


def test_a_first_start_records_the_server():
    assert judge(SLOT, None, PRIMARY, None).record
    assert judge(SLOT, None, PRIMARY, SYNCED) == judge(SLOT, None, PRIMARY, None)


def test_a_reconnect_to_the_same_server_is_no_failover_even_without_the_slot():
    """A slot missing on the same server was dropped on purpose: created again, as always."""
    verdict = judge(SLOT, PRIMARY, PRIMARY, None)
    assert not verdict.record and not verdict.failed_over
    assert judge(SLOT, PRIMARY, PRIMARY, SlotCopy(False, False, False)) == verdict


def test_a_promoted_standby_with_a_persistent_synced_copy_carries_on_and_is_recorded():
    verdict = judge(SLOT, PRIMARY, PROMOTED, SYNCED)
    assert verdict.failed_over and verdict.record


def test_a_promoted_standby_without_the_slot_stops_with_the_way_back():
    with pytest.raises(FailoverError) as e:
        judge(SLOT, PRIMARY, PROMOTED, None)
    failure = e.value
    assert failure.permanent and failure.endpoint == SOURCE
    assert "timeline 1 → 2" in failure.problem and "holds no copy of the slot" in failure.problem
    assert "neither creates a new slot nor re-snapshots" in failure.problem
    assert "point [source] dsn at it" in failure.fix
    assert "DELETE FROM _walbridge.producer_slots WHERE slot_name = 'wb'" in failure.fix
    assert "pg_drop_replication_slot" not in failure.fix  # there is none to drop


@pytest.mark.parametrize("copy, said", [
    (SlotCopy(failover=False, synced=False, temporary=False), "created without failover"),
    (SlotCopy(failover=True, synced=False, temporary=False), "not synchronized from the old primary"),
    (SlotCopy(failover=True, synced=True, temporary=True), "only a temporary copy"),
])
def test_a_promoted_standby_whose_slot_is_no_persistent_synced_copy_stops(copy, said):
    with pytest.raises(FailoverError) as e:
        judge(SLOT, PRIMARY, PROMOTED, copy)
    assert said in e.value.problem
    assert "SELECT pg_drop_replication_slot('wb');" in e.value.fix


def test_an_old_primary_back_after_a_failover_is_refused_whatever_slot_it_has():
    with pytest.raises(FailoverError) as e:
        judge(SLOT, PROMOTED, PRIMARY, SYNCED)
    assert "earlier timeline 1" in e.value.problem and "target_session_attrs=read-write" in e.value.fix


def test_another_cluster_is_refused_with_how_to_record_it():
    other = Server("7712000000000000000", 1)
    with pytest.raises(FailoverError) as e:
        judge(SLOT, PRIMARY, other, SYNCED)
    assert "another cluster" in e.value.problem
    assert ("SET system_identifier = '7712000000000000000', timeline = 1 WHERE slot_name = 'wb'"
            in e.value.fix)


def test_a_copy_carries_on_only_when_failover_synced_and_persistent():
    assert SYNCED.carries_on
    assert not SlotCopy(True, True, True).carries_on
    assert not SlotCopy(True, False, False).carries_on
    assert not SlotCopy(False, True, False).carries_on
