"""Source failover: is the server the producer reaches the one its slot was
read on, a promoted standby holding a synchronized copy of the slot, or a
server it cannot go on from?

A server is known by its system identifier and timeline (``IDENTIFY_SYSTEM``):
a physical standby shares its primary's system identifier, and a promotion
starts a new, higher timeline. Against the server the slot was last read on
(this process's previous run, else the one recorded with the slot's binding,
:mod:`producer.slot_binding`):

- same system, same timeline: the same server (an ordinary reconnect or
  restart). A slot missing there was dropped on purpose: it is created and
  the tables snapshotted, as at a first start.
- same system, a later timeline: a failover (or a point-in-time recovery).
  Only a synchronized copy of the slot carries on: ``failover`` and ``synced``
  set, not ``temporary`` (PostgreSQL 17+; a temporary copy is dropped at
  promotion, and a slot made on the new server by hand is not ``synced``).
  The producer then streams on from the copy's confirmed position (what it
  replays Kafka already holds, and is skipped) and the binding records the
  new server. Any other slot, or none: :class:`FailoverError`.
  Even a good copy carries on only where the new timeline holds everything
  Kafka holds: the promoted server's timeline history (``TIMELINE_HISTORY``)
  says where it forked from the timeline the slot was read on
  (:func:`fork_point`), and anything produced at or past that point (a
  commit, snapshot or backfill position) is a change the old primary sent
  before the standby received it (``synchronized_standby_slots`` did not
  hold it back): :func:`check_fork` refuses with :class:`FailoverError`.
- same system, an earlier timeline: a server behind the one the slot was read
  on (an old primary back after a failover): :class:`FailoverError`.
- another system: another PostgreSQL cluster: :class:`FailoverError`.

Invariants:
- Never a silent new slot and snapshot after a server change: positions are
  LSNs, comparable only along one WAL history, and the changes between the
  slot's last confirmed position and the failover are read from that slot or
  not at all.
- After a failover, no position on the new timeline is taken for one on the
  old timeline: positions below the fork point are the same changes on both;
  from the fork point on, the old timeline's changes are not the new one's,
  so with any of them in Kafka the new primary's changes at those positions
  would be skipped as replays (lost) and the old ones would stay in Kafka
  and the target (a divergence). The producer stops instead.
- Every refusal is permanent (a ``source`` failure, exit code 3) and says the
  way back.

Pure: the facts come in as arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

from producer.pgoutput import lsn_to_int, lsn_to_str
from schemas import wire
from schemas.failures import SOURCE, Failure


@dataclass(frozen=True)
class Server:
    """A PostgreSQL server as ``IDENTIFY_SYSTEM`` names it."""

    system_id: str
    timeline: int

    def __str__(self) -> str:
        return f"system {self.system_id}, timeline {self.timeline}"


@dataclass(frozen=True)
class SlotCopy:
    """The slot's failover state as ``pg_replication_slots`` shows it
    (``failover`` and ``synced`` are false before PostgreSQL 17)."""

    failover: bool
    synced: bool
    temporary: bool

    @property
    def carries_on(self) -> bool:
        """A copy synchronized from the old primary that survived promotion."""
        return self.failover and self.synced and not self.temporary


class FailoverError(Failure):
    """The server reached cannot carry the slot on (permanent; exit code 3)."""

    def __init__(self, problem: str, fix: str):
        super().__init__(SOURCE, problem, fix)


@dataclass(frozen=True)
class Verdict:
    record: bool  # the server is to be recorded with the slot's binding
    failed_over: bool = False  # a promoted standby's synchronized copy carries the slot on


def judge(slot: str, previous: Server | None, current: Server, copy: SlotCopy | None) -> Verdict:
    """What the producer may do on ``current``, where the slot was last read on
    ``previous`` (None: nothing recorded yet) and ``current`` holds ``copy``
    of it (None: no slot of that name); raises :class:`FailoverError`."""
    if previous is None:
        return Verdict(record=True)
    if previous == current:
        return Verdict(record=False)
    binding = f"{wire.META_SCHEMA}.{wire.SLOT_BINDING_TABLE}"
    forget = (f"DELETE FROM {binding} WHERE slot_name = '{slot}'; in the source "
              "database, then start the producer again")
    if current.system_id != previous.system_id:
        raise FailoverError(
            f"slot {slot} was read on PostgreSQL {previous}, but [source] dsn now reaches another cluster "
            f"({current}): its WAL positions are not comparable with the ones the topics hold, so walbridge "
            "neither streams nor re-snapshots here by itself",
            f"point [source] dsn at the server of system {previous.system_id}. If this server is the source "
            f"now and holds the slot at the position walbridge left it (an upgrade that kept the slot), "
            f"record it: UPDATE {binding} SET system_identifier = "
            f"'{current.system_id}', timeline = {current.timeline} WHERE slot_name = '{slot}'; "
            f"to start over with a full snapshot on purpose, drop the slot if it exists and run {forget}")
    if current.timeline < previous.timeline:
        raise FailoverError(
            f"slot {slot} was last read on timeline {previous.timeline} of system {current.system_id}, but "
            f"[source] dsn now reaches a server on the earlier timeline {current.timeline}: an old primary "
            "back after a failover? Its slot is behind the changes already in Kafka",
            "point [source] dsn at the current primary (host=a,b with target_session_attrs=read-write "
            "reaches whichever is writable), and keep the old primary from accepting writes")
    if copy is not None and copy.carries_on:
        return Verdict(record=True, failed_over=True)
    if copy is None:
        found = "holds no copy of the slot"
    elif not copy.failover:
        found = "holds a slot of that name created without failover, not a copy synchronized from the old primary"
    elif not copy.synced:
        found = "holds a slot of that name that was not synchronized from the old primary"
    else:
        found = "holds only a temporary copy of the slot (one the old primary's slot never advanced past)"
    drop = f"drop that slot (SELECT pg_drop_replication_slot('{slot}');) and " if copy is not None else ""
    raise FailoverError(
        f"the source failed over (system {current.system_id}: timeline {previous.timeline} → "
        f"{current.timeline}) and the promoted server {found}: the changes since the slot's last confirmed "
        "position cannot be read here, so walbridge neither creates a new slot nor re-snapshots by itself",
        "if the old primary still runs, point [source] dsn at it. Otherwise, to start over with a full "
        f"snapshot on purpose, {drop}run {forget}. To keep the slot across the next failover: PostgreSQL 17 or "
        "later, [source] slot_failover = true, and a standby set up as walbridge check-config --live says")


@dataclass(frozen=True)
class Fork:
    """Where the promoted server's timeline left the one the slot was read
    on: WAL below ``lsn`` is the same on both, from ``lsn`` on it differs."""

    previous: Server  # the server the slot was read on
    current: Server  # the promoted server
    lsn: int | None  # the switch point of ``previous.timeline`` in ``current``'s history; None: not in it


def fork_point(previous: Server, current: Server, history: str) -> Fork:
    """The fork of ``current`` (a later timeline of ``previous``'s system)
    from ``previous``, read from ``current.timeline``'s history file (lines
    ``<parent timeline>\t<switch LSN>\t<reason>``, one per ancestor). A
    ``previous.timeline`` that is no ancestor (a sibling branch) leaves the
    fork unknown: ``lsn`` None."""
    for line in history.splitlines():
        fields = line.split()
        if len(fields) >= 2 and fields[0].isdigit() and int(fields[0]) == previous.timeline:
            return Fork(previous, current, lsn_to_int(fields[1]))
    return Fork(previous, current, None)


def check_fork(slot: str, fork: Fork, produced: int | None) -> None:
    """Raises :class:`FailoverError` when Kafka holds anything of ``slot``
    at or past ``fork`` (``produced``: the highest position in Kafka, its
    LSN: a commit, snapshot or backfill point; None: nothing)."""
    if produced is None or (fork.lsn is not None and produced < fork.lsn):
        return
    old, new, system = fork.previous.timeline, fork.current.timeline, fork.current.system_id
    upto = lsn_to_str(produced)
    failed_over = f"the source failed over (system {system}: timeline {old} → {new})"
    if fork.lsn is None:
        problem = (f"{failed_over}, but timeline {old}, which slot {slot} was read on, is not in timeline {new}'s "
                   f"history (a server restored or promoted from another branch), so none of the changes in Kafka "
                   f"(up to {upto}) is known to be on the new primary. Streaming on could skip its own changes as "
                   "replays and leave in Kafka and the target rows the source does not have: walbridge stops")
    else:
        problem = (f"{failed_over}, and timeline {new} forked from timeline {old} at {lsn_to_str(fork.lsn)}, but "
                   f"Kafka holds changes of slot {slot} up to {upto}: the old primary sent them before the promoted "
                   "standby received them (synchronized_standby_slots on the old primary was empty or did not "
                   "name this standby's physical slot), so the new primary never had them. Streaming on would "
                   f"skip the new primary's own changes up to {upto} as replays and leave in Kafka and the target "
                   "rows the source does not have: walbridge stops")
    binding = f"{wire.META_SCHEMA}.{wire.SLOT_BINDING_TABLE}"
    raise FailoverError(
        problem,
        f"start over with a full snapshot on purpose, once the new primary's WAL is past {upto} (on it, SELECT "
        f"pg_current_wal_lsn() > '{upto}'; must return true; writes get it there, and so does SELECT "
        "pg_switch_wal(); after any write, a WAL segment at a time): there run SELECT "
        f"pg_drop_replication_slot('{slot}'); DELETE FROM {binding} WHERE slot_name = '{slot}'; and start the "
        "producer. The new snapshot and every change after it sit past what "
        "the old primary sent, so they replace it in the target, and the consumer drops the rest at the "
        "snapshot's snapshot_end. Next time: on the primary, ALTER SYSTEM SET synchronized_standby_slots = "
        "'<the standbys' physical slots>'; SELECT pg_reload_conf(); (walbridge check-config --live names them)")
