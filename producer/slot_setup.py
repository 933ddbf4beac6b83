"""The slot the producer streams from, on whichever server ``[source] dsn``
reaches: what is found and decided about the slot between connecting and
``START_REPLICATION``.

The path: the server (``pg_is_in_recovery``, ``IDENTIFY_SYSTEM``), the slot's
row in ``pg_replication_slots`` and its recorded binding → ``failover.judge``
against the server the slot was last read on (a failover, an ordinary
reconnect, or a server that cannot carry the slot on); after a failover, the
new timeline's fork from the old one (``TIMELINE_HISTORY``,
``failover.fork_point``) → ``recovery.check_binding`` (the topics and Kafka
cluster the slot's data went to) → the slot checked for use (logical,
pgoutput, not in use) → :class:`FoundSlot`, which the stream checks against
what Kafka holds (``check_fork``: nothing past the fork), then records
(``record``) and streams from, or creates (``create``) and snapshots.

Invariants:
- Every check runs before anything is created or recorded: a refused server
  or slot leaves the source as it was. (``check_fork`` needs the topics'
  partitions, so it runs after the publication is brought up to the config,
  as at every start: neither slot nor binding is touched before it.)
- A standby (in recovery) is never given a slot nor streamed from: a
  transient failure, waited out until it is promoted or the DSN reaches the
  primary (``target_session_attrs=read-write`` picks it among several hosts).
- With ``[source] slot_failover`` on PostgreSQL 17+, the slot is a failover
  slot: created so, or altered so before streaming (a slot from before).
- The binding records the server the slot is read on: after a failover, the
  promoted server (same database and topics), and only once ``check_fork``
  found nothing in Kafka past the fork; until then (``bound``) neither the
  binding nor the next run takes the new server for the slot's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import psycopg

from producer import catalog, failover, slot_binding
from producer.backfill_requests import read_states
from producer.failover import Fork, Server, SlotCopy
from producer.kafka_io import Tail
from producer.pgoutput import lsn_to_str
from producer.recovery import Binding, Checkpoint, check_binding
from producer.replication import ReplicationConnection, ReplicationError
from schemas import wire
from schemas.config import Config
from schemas.failures import SOURCE, Failure
from schemas.kafka import Writer

log = logging.getLogger("walbridge.producer")

FAILOVER_SLOTS_SINCE = 170000  # server_version_num of PostgreSQL 17


@dataclass
class FoundSlot:
    """The slot as found on the server the producer reached."""

    name: str
    server: Server
    state: dict | None  # its pg_replication_slots row (None: to be created)
    bind: Binding | None  # the binding to record before streaming (None: the recorded one stands)
    failover: bool  # it is to be a failover slot
    failed_over: bool  # the server is a promoted standby whose synchronized copy carries the slot on
    fork: Fork | None = None  # after a failover: where the new timeline left the one the slot was read on
    bound: bool = False  # the slot is recorded as read on ``server`` (``record`` or ``create`` ran)
    resend_until: int | None = None  # the recorded resend mark (``slot_binding.mark_resend``)

    def check_fork(self, kafka_conf: dict, topic_prefix: str, tails: dict[Writer, Tail | None],
                   checkpoint: Checkpoint | None) -> None:
        """After a failover, before anything is recorded: Kafka holds nothing
        at or past the fork (``failover.check_fork``). What it holds reaches
        as far as the highest of the partition ``tails`` (streamed changes,
        the initial snapshot), the ``checkpoint``'s snapshot and the
        backfills' snapshot points (recorded before their first row)."""
        if self.fork is None:
            return
        states, _ = read_states(kafka_conf, wire.backfills_topic(topic_prefix))
        positions = [t.position[0] for t in tails.values() if t is not None]
        positions += [checkpoint.lsn] if checkpoint is not None else []
        positions += [int(r["lsn"]) for r in states.values() if r.get("lsn") is not None]
        produced = max(positions, default=None)
        failover.check_fork(self.name, self.fork, produced)
        fork = self.fork
        log.warning("slot %s: the source failed over (system %s, timeline %s → %s, forked at %s; Kafka holds %s): "
                    "streaming on from the promoted server's synchronized copy of the slot, at %s", self.name,
                    self.server.system_id, fork.previous.timeline, fork.current.timeline,
                    "an unknown point" if fork.lsn is None else lsn_to_str(fork.lsn),
                    "nothing" if produced is None else f"changes up to {lsn_to_str(produced)}",
                    self.state["confirmed_flush_lsn"])

    def record(self, conn: psycopg.Connection, repl: ReplicationConnection) -> None:
        """Before streaming from an existing slot: its binding, and failover enabled where wanted."""
        if self.bind is not None:
            slot_binding.write(conn, self.name, self.bind)
        self.bound = True
        if self.failover and not self.state["failover"]:
            repl.enable_failover()
            log.info("slot %s: failover enabled (a standby with sync_replication_slots keeps a copy of it)",
                     self.name)

    def create(self, conn: psycopg.Connection, repl: ReplicationConnection, topic_prefix: str,
               cluster_id: str | None) -> tuple[int, str]:
        """A new slot, recorded as streaming into ``topic_prefix`` of Kafka
        cluster ``cluster_id``: (consistent LSN, exported snapshot name)."""
        lsn, snapshot_name = repl.create_slot(failover=self.failover)
        slot_binding.write(conn, self.name, Binding(topic_prefix, cluster_id, self.server), new_slot=True)
        self.resend_until = None
        self.bound = True
        return lsn, snapshot_name


def find_slot(config: Config, conn: psycopg.Connection, repl: ReplicationConnection, cluster_id: str | None,
              previous: Server | None) -> FoundSlot:
    """The slot ``[source] slot`` on the server ``conn`` and ``repl`` reached;
    ``previous``: the server this process last streamed from (None: none yet).
    Raises what stops the producer (see the module docstring)."""
    name = config.source.slot
    if conn.execute("SELECT pg_is_in_recovery()").fetchone()[0]:
        raise Failure(SOURCE, "the server [source] dsn reaches is a standby (in recovery): walbridge reads its "
                              "slot on the primary",
                      "point [source] dsn at the primary; listing the standby too (host=primary,standby with "
                      "target_session_attrs=read-write) lets the producer follow a failover", permanent=False)
    server = repl.identify()
    state = catalog.slot_state(conn, name)
    binding = slot_binding.read(conn, name)
    copy = SlotCopy(state["failover"], state["synced"], state["temporary"]) if state is not None else None
    was = previous or (binding.server if binding else None)
    verdict = failover.judge(name, was, server, copy)
    fork = failover.fork_point(was, server, repl.timeline_history(server.timeline)) if verdict.failed_over else None
    bind = None
    if state is not None:
        bind = check_binding(name, binding, config.kafka.topic_prefix, cluster_id)
        if state["plugin"] != "pgoutput" or state["slot_type"] != "logical":
            raise ReplicationError(f"slot {name} exists but is not a logical pgoutput slot")
        if state["active"]:
            raise ReplicationError(f"slot {name} is in use by another process (pid {state['active_pid']}); is "
                                   "another producer running?")
        if bind is not None or verdict.record:
            bind = Binding(config.kafka.topic_prefix, cluster_id or (binding.cluster_id if binding else None),
                           server)
    wants_failover = config.source.slot_failover and conn.info.server_version >= FAILOVER_SLOTS_SINCE
    if config.source.slot_failover and not wants_failover:
        log.info("slot %s: PostgreSQL %s keeps logical slots on the primary only (failover slots need 17 or "
                 "later): after a failover the producer stops rather than re-snapshot", name,
                 conn.info.server_version // 10000)
    elif wants_failover:
        _warn_unsynchronized_standbys(conn, name)
    return FoundSlot(name, server, state, bind, wants_failover, verdict.failed_over, fork,
                     resend_until=binding.resend_until if state is not None and binding is not None else None)


def _warn_unsynchronized_standbys(conn: psycopg.Connection, slot: str) -> None:
    """A primary whose standbys stream through physical slots that
    ``synchronized_standby_slots`` does not name may send changes a standby
    has not received: after a failover to it they are in Kafka but not on the
    new primary, and the producer stops there (``FoundSlot.check_fork``)."""
    standby_slots, synchronized = catalog.standby_slots(conn)
    if standby_slots and not synchronized:
        log.warning("slot %s: standbys stream through the physical slots %s, but synchronized_standby_slots is "
                    "empty: the producer may read changes a standby has not received yet; after a failover to it "
                    "they are in Kafka but not at the source, and the producer stops (exit 3) until a full "
                    "re-snapshot. On the primary: ALTER SYSTEM SET synchronized_standby_slots = '%s'; SELECT "
                    "pg_reload_conf();", slot, ", ".join(standby_slots), ",".join(standby_slots))
