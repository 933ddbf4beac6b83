"""Failover or ordinary reconnect, a good slot copy or a bad one, and whether
Kafka holds changes past the new timeline's fork: the pure judgement of
``producer.failover``."""

from __future__ import annotations

import pytest

from producer.failover import FailoverError, Fork, Server, SlotCopy, check_fork, fork_point, judge
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


# The history file of timeline 2 as PostgreSQL 18 writes it at a promotion.
HISTORY_2 = "1\t0/5A3E2F0\tno recovery target specified\n"
FORK = 0x5A3E2F0


def test_the_fork_is_where_the_slots_timeline_ended_in_the_promoted_servers_history():
    assert fork_point(PRIMARY, PROMOTED, HISTORY_2) == Fork(PRIMARY, PROMOTED, FORK)


def test_after_two_promotions_the_fork_is_the_one_of_the_timeline_the_slot_was_read_on():
    history_3 = "# a comment\n1\t0/5A3E2F0\tno recovery target specified\n\n2\t1/20\tbefore 2026-11-26\n"
    third = Server(PRIMARY.system_id, 3)
    assert fork_point(PRIMARY, third, history_3).lsn == FORK
    assert fork_point(PROMOTED, third, history_3).lsn == (1 << 32) | 0x20


def test_a_timeline_not_in_the_history_leaves_the_fork_unknown():
    sibling = Server(PRIMARY.system_id, 3)
    assert fork_point(PROMOTED, sibling, "1\t0/5A3E2F0\tno recovery target specified\n").lsn is None


def test_nothing_in_kafka_or_everything_below_the_fork_streams_on():
    fork = Fork(PRIMARY, PROMOTED, FORK)
    check_fork(SLOT, fork, None)
    check_fork(SLOT, fork, FORK - 1)


@pytest.mark.parametrize("produced", [FORK, FORK + 0x2000])
def test_a_change_in_kafka_at_or_past_the_fork_stops_the_producer_with_the_way_back(produced):
    """The old primary sent it before the standby received it: the new
    primary never had it, and would see its own changes there skipped."""
    with pytest.raises(FailoverError) as e:
        check_fork(SLOT, Fork(PRIMARY, PROMOTED, FORK), produced)
    failure, upto = e.value, f"0/{produced:X}"
    assert failure.permanent and failure.endpoint == SOURCE
    assert "timeline 1 → 2" in failure.problem and "forked from timeline 1 at 0/5A3E2F0" in failure.problem
    assert f"Kafka holds changes of slot wb up to {upto}" in failure.problem
    assert "synchronized_standby_slots on the old primary was empty" in failure.problem
    assert "skip the new primary's own changes" in failure.problem and "walbridge stops" in failure.problem
    assert f"SELECT pg_current_wal_lsn() > '{upto}'" in failure.fix
    assert "SELECT pg_drop_replication_slot('wb');" in failure.fix
    assert "DELETE FROM _walbridge.producer_slots WHERE slot_name = 'wb';" in failure.fix
    assert "ALTER SYSTEM SET synchronized_standby_slots" in failure.fix


def test_an_unknown_fork_stops_the_producer_once_kafka_holds_anything():
    fork = Fork(PROMOTED, Server(PRIMARY.system_id, 3), None)
    check_fork(SLOT, fork, None)
    with pytest.raises(FailoverError) as e:
        check_fork(SLOT, fork, 0x100)
    assert "timeline 2, which slot wb was read on, is not in timeline 3's history" in e.value.problem
    assert "SELECT pg_current_wal_lsn() > '0/100'" in e.value.fix
