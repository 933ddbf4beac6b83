"""check-config --live on a standby: set up to carry the slot, and is its copy one a promotion keeps?"""

from walbridge.check import OK, WARN, standby_readiness

READY = {"sync_replication_slots": "on", "hot_standby_feedback": "on", "primary_slot_name": "standby1",
         "primary_conninfo": "host=10.0.0.1 port=5432 user=replicator dbname=postgres"}


def test_a_persistent_synchronized_copy_is_ready():
    state, detail = standby_readiness("wb", READY, (True, False, "0/3405B98"))
    assert state == OK and "persistent synchronized copy of slot wb (at 0/3405B98)" in detail


def test_a_temporary_copy_is_a_warning_that_says_when_it_becomes_persistent():
    state, detail = standby_readiness("wb", READY, (True, True, None))
    assert state == WARN and "temporary copy of slot wb, which a promotion drops" in detail
    assert "becomes persistent once the primary's slot advances" in detail


def test_no_copy_or_an_unsynchronized_slot_is_a_warning():
    assert standby_readiness("wb", READY, None)[0] == WARN
    state, detail = standby_readiness("wb", READY, (False, False, "0/1"))
    assert state == WARN and "not synchronized from the primary" in detail


def test_missing_settings_are_named_with_how_to_set_them():
    settings = {**READY, "sync_replication_slots": "off", "primary_slot_name": "",
                "primary_conninfo": "host=10.0.0.1 user=replicator"}
    state, detail = standby_readiness("wb", settings, (True, False, "0/1"))
    assert state == WARN
    assert "sync_replication_slots = on" in detail and "primary_slot_name = '<" in detail
    assert "a dbname in primary_conninfo" in detail and "hot_standby_feedback" not in detail


def test_an_unreadable_primary_conninfo_is_not_held_against_the_standby():
    settings = {k: v for k, v in READY.items() if k != "primary_conninfo"}
    assert standby_readiness("wb", settings, (True, False, "0/1"))[0] == OK
