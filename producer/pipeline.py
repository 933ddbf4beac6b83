"""The producer's stream: PostgreSQL logical replication → Avro messages on shape
topics, with the slot confirmed only as far as the acknowledgements allow.

The path of one change, top to bottom:

1. ``ReplicationConnection.read`` returns a CopyData frame;
   ``pgoutput.decode_frame``/``pgoutput.decode`` turn it into a message.
2. ``Begin`` opens a transaction whose position (commit LSN) is known up front,
   so its changes are produced as they arrive: nothing is buffered per
   transaction, whatever its size.
3. A change is loaded once, routed to its shapes by its ``RelationPlan`` and
   encoded (``envelope.py``) into its Kafka messages on their keys' partitions,
   all in ``shapes.change_messages`` with the transaction's ``StreamTx``.
4. ``_produce`` hands each message to the idempotent Kafka producer, unless that
   partition already holds it (its tail position is at or past the message's:
   a replay after a crash or a failover). After a run whose deliveries
   failed, a tail proves nothing about the positions that run produced
   (``_Runs``): the whole replay is sent again, and Kafka may hold a change twice.
   Steps 1, 3 and 4 are one compiled call (``fastcodec.py``) for every change
   but key changes and a few rarer cases; the path above is its reference and
   fallback.
5. At ``Commit`` the transaction goes to the ack state (``acks.py``) with the
   partitions (writers) it touched.
6. There, group commits (or, with ``[ack] consumer_groups = []``, delivery
   reports) become flushed positions per writer, and the ``FlushTracker`` raises
   the flush LSN that ``_send_status`` sends in standby status updates.

Between bursts of frames (every 256 frames, or when the stream idles) the loop
serves the rest: a step of the running backfill (``backfill.py``), delivery
reports and group commits (``acks.py``), standby status, the producer's status
and metrics (``status.py``), new backfill requests and the partitioned shape
tables' leaves (``partitions.py``: a table attached with rows is backfilled).

Schema changes: a shape table's Relation message goes to the
``SchemaFollower`` (``schema_follow.py``) before the relation is planned
again: the changed shapes are logged, backfilled where rows changed without a
change in the WAL (it asks ``backfill.py``), given the aliases of renamed
columns, or stopped (left out of the plan, WAL held from the position the
stream passes it); a new schema the registry refuses stops its shape too.

Invariants:
- The LSN confirmed to PostgreSQL never passes a change that some configured
  consumer group has not committed (or, in delivery mode, the broker has not
  acknowledged).
- Keepalives are answered whatever Kafka or the groups do; with nothing pending
  the slot is confirmed up to the server's WAL end, so idle databases and
  unrelated tables never hold WAL back.
- A restart (crash or lost connection) takes the same path as a first start:
  read partition tails, rebuild ack state from Kafka, stream from the slot.
  The slot is found, judged and created in ``slot_setup.py``: a reconnect
  that reaches another server (a failover, told by ``IDENTIFY_SYSTEM``'s
  system identifier and timeline) goes on only from a synchronized copy of
  the slot (``failover.py``), never from a new slot and snapshot, and only
  when Kafka (the partition tails, the snapshot's and backfills' points,
  read before anything is recorded) holds nothing past the point where the
  new timeline forked: what is skipped as a replay is then the same change
  on both timelines.
- Initial snapshot (``snapshot.py``): taken when the slot is created, which is
  recorded in the source database (``slot_binding.py``: the topic prefix and
  Kafka cluster the slot's data goes to), and in ``<prefix>._checkpoint``
  before it starts and once Kafka acknowledged every ``snapshot_end``
  (``checkpoint_store.py``). A producer that finds its slot decides with
  ``recovery.py``: a slot bound to other topics stops it; a snapshot Kafka
  does not hold completely (it crashed mid-snapshot, the broker lost its data,
  records no consumer group had read are gone) makes it drop the slot and
  *redo* the snapshot at a new consistent point. The partial rows already in
  the topics are older (lower position) than the redone ones, so apply
  converges; the ``snapshot_end`` event tells the consumer which snapshot is
  complete. Topics the checkpoint does not cover belong to shapes added to the
  config; they are backfilled (``backfill.py``) while the others stream on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from dataclasses import replace
from typing import Any, Callable, Iterable

import psycopg
from confluent_kafka import KafkaException, Producer
from confluent_kafka.admin import AdminClient
from psycopg import sql

from producer import catalog, pgoutput, recovery, schema_changes, slot_binding
from producer.acks import Acks
from producer.backfill import Backfills
from producer.catalog import TableInfo
from producer.checkpoint_store import CheckpointStore
from producer.envelope import control_key
from producer.failover import Server
from producer.fastcodec import CHANGE_KINDS, relation_encoder
from producer.flush_tracker import LogOffset
from producer.kafka_io import ReadChannel, Tail, producer_config, read_partitions
from producer.partitions import PartitionWatch
from producer.pgoutput import Begin, Commit, Delete, Insert, Keepalive, Relation, Truncate, TypeMsg, Update
from producer.pgtypes import column_codec
from producer.reads import Reads
from producer.replication import ReplicationConnection, connect
from producer.schema_follow import SchemaFollower, relation_key, table_relation
from producer.shapes import Message, RelationPlan, ShapeSpec, StreamTx, change_messages, truncate_messages
from producer.slot_setup import FoundSlot, find_slot
from producer.snapshot import InitialSnapshot, snapshot_id
from producer.status import Stats, StatusPublisher
from producer.topics import prepare_topics
from schemas import wire
from schemas.config import Config
from schemas.failures import KAFKA, SOURCE, Failure, attributed
from schemas.kafka import METADATA_TIMEOUT, Writer, client_config, cluster_metadata, topic_ids
from schemas.publisher import SchemaPublisher, SchemaRegistrationError
from schemas.retry import Outage, RetryPolicy
from schemas.shape_filter import compile_filter

log = logging.getLogger("walbridge.producer")

STATUS_INTERVAL = 1.0  # seconds between unsolicited standby status updates
CONFIRM_INTERVAL = 0.1  # when the stream idles, a newly confirmable LSN goes out this soon
BACKFILL_BEHIND_WAIT_S = 0.002  # a frame wait while a running backfill's reader has no chunk ready


class Pipeline:
    """One run of the producer, from connecting to the first fatal error or stop."""

    def __init__(self, config: Config, stop: threading.Event | None = None,
                 on_status: Callable[[dict], None] | None = None, previous_server: Server | None = None,
                 resend_until: int | None = None):
        self.config = config
        self._resend_until = resend_until  # an earlier run's deliveries failed up to this commit LSN (see _Runs)
        self._on_status = on_status
        self.stats = Stats()
        self._stop = stop or threading.Event()
        kafka_conf = client_config(config.kafka.bootstrap_servers, config.kafka.client)
        self._kafka_conf = kafka_conf
        self.admin = AdminClient(kafka_conf)
        self.kafka = Producer(producer_config(kafka_conf))
        self.read_channel = ReadChannel(kafka_conf, self._keep_stream_alive)  # snapshot and backfill rows
        self.schemas = SchemaPublisher(self.kafka, config.kafka.topic_prefix,
                                       config.kafka.registry_client_config() if config.kafka.schema_registry_url
                                       else None, config.kafka.subject_name_strategy)
        self.acks = Acks(config, self.admin, kafka_conf)
        self.ledger = self.acks.ledger  # the stream's own reference: it counts every message
        self.checkpoints = CheckpointStore(kafka_conf, self.kafka, self.acks.offsets, config.kafka.topic_prefix,
                                           list(config.ack_groups))
        self._previous_server = previous_server
        self.slot: FoundSlot | None = None  # the slot as found at start (``slot_setup.py``)
        self._cluster_id: str | None = None
        self.partitions: dict[str, int] = {}
        self.tails: dict[Writer, Tail | None] = {}
        self._replay_until: tuple[int, int] | None = None  # highest tail position: below it, check for replays
        self.relations: dict[int, RelationPlan] = {}
        self._encoders: dict[int, Any] = {}  # relation oid -> compiled encoder (fastcodec), where one applies
        self.shape_specs: dict[str, list[ShapeSpec]] = defaultdict(list)
        self.tables: dict[str, TableInfo] = {}
        self.filter_source = None  # the source as shape filters see it (catalog.filter_source)
        self.publications: list[str] = []
        self.repl: ReplicationConnection | None = None
        self.catalog_conn: psycopg.Connection | None = None
        self.types: catalog.TypeCache | None = None
        self.db_name = ""
        # The parts around the stream, made once the source is known (``_assemble``).
        self.snapshot: InitialSnapshot | None = None
        self.backfills: Backfills | None = None
        self.status: StatusPublisher | None = None
        self.partition_watch: PartitionWatch | None = None
        self.schema: SchemaFollower | None = None
        # Current transaction.
        self._tx: StreamTx | None = None
        self._op = 0
        self._tx_writers: set[Writer] = set()
        self._tx_done_writers: set[Writer] = set()
        self._change_lsn = 0  # WAL position of the message being handled (source.lsn)
        self._tombstones = config.kafka.tombstones_on_delete
        self._streaming = False
        self._last_status = 0.0

    def stop(self) -> None:
        self._stop.set()

    def prepare(self) -> None:
        """Validate against the live source (and an existing slot against the
        server it was read on and what its data went to, ``slot_setup.py``)
        and create publication and topics. Nothing here creates a slot."""
        cfg = self.config
        self.catalog_conn = connect(cfg.source.dsn)
        self.db_name = self.catalog_conn.info.dbname
        self.types = catalog.TypeCache(self.catalog_conn)
        # Filters are compiled against the source itself: its collations, its reading of literals
        self.filter_source = catalog.filter_source(self.catalog_conn, cfg.source.dsn) if any(
            s.where for s in cfg.shapes) else None
        self.tables = catalog.check_source(self.catalog_conn, cfg, self.filter_source)
        self._cluster_id = cluster_metadata(self.admin, self._kafka_conf, METADATA_TIMEOUT, self._stop).cluster_id
        self.repl = ReplicationConnection(cfg.source.dsn, cfg.source.slot)
        self.slot = find_slot(cfg, self.catalog_conn, self.repl, self._cluster_id, self._previous_server)
        plan = catalog.plan_publication(list(self.tables.values()), cfg.source.keyless_tables)
        self.publications = catalog.ensure_publications(self.catalog_conn, cfg.source.publication, plan)
        for shape in cfg.shapes:
            table = self.tables[shape.table]
            row_filter = compile_filter(shape.where, catalog.filter_columns(self.catalog_conn, table.oid),
                                        shape=shape.shape_name, source=self.filter_source) if shape.where else None
            if row_filter is not None and table.replica_identity != "f":
                log.warning("shape %s filters on %s, whose REPLICA IDENTITY is not FULL: updates of rows "
                            "outside the filter are sent as deletes (harmless, but extra traffic); "
                            "ALTER TABLE %s REPLICA IDENTITY FULL gives exact move-in/move-out",
                            shape.shape_name, shape.table, shape.table)
            self.shape_specs[shape.table].append(
                ShapeSpec(shape.shape_name, cfg.topic(shape), tuple(shape.columns) if shape.columns else None,
                          row_filter))
        keyless = {cfg.topic(s) for s in cfg.shapes if self.tables[s.table].keyless}
        self.partitions = prepare_topics(self.admin, cfg, self.schemas.schemas_topic is not None, keyless)

    def _assemble(self) -> None:
        """The parts around the stream, on the prepared source and topics."""
        cfg = self.config
        reads = Reads(self.read_channel, self._send, self.partitions, self.stats.events, self._control_key)
        self.snapshot = InitialSnapshot(cfg, self.catalog_conn, self.tables, self._plan_tables, reads)
        self.backfills = Backfills(cfg, self.kafka, self._kafka_conf, self.catalog_conn, self.tables,
                                   self._plan_table, reads, self.ledger)
        self.status = StatusPublisher(cfg, self.kafka, self.catalog_conn, self.stats, self.acks, self.snapshot,
                                      self.backfills, self._on_status)
        shapes = defaultdict(list)
        for shape in cfg.shapes:
            shapes[shape.table].append(shape.shape_name)
        self.partition_watch = PartitionWatch(self.catalog_conn, self.tables, shapes, self.backfills.request)
        self.schema = SchemaFollower(cfg, self.catalog_conn, self.tables, self.shape_specs, self.stats, self.acks,
                                     self.types, self.backfills, self.filter_source)

    def writers(self) -> list[Writer]:
        return [(t, p) for t, n in self.partitions.items() for p in range(n)]

    def run(self) -> None:
        cfg = self.config
        self.prepare()
        self._assemble()
        slot = self.slot.state
        decision = recovery.Decision(False)
        if slot is not None:
            decision = self._recover()
            self.slot.record(self.catalog_conn, self.repl)
            if decision.resnapshot:
                log.warning("slot %s: %s: dropping the slot and redoing the snapshot", cfg.source.slot,
                            decision.reason)
                self.catalog_conn.execute("SELECT pg_drop_replication_slot(%s)", (cfg.source.slot,))
                slot, decision = None, recovery.Decision(True)
        if slot is None:
            lsn, snapshot_name = self.slot.create(self.catalog_conn, self.repl, cfg.kafka.topic_prefix,
                                                  self._cluster_id)
            log.info("created slot %s at %s (snapshot %s%s)", cfg.source.slot, pgoutput.lsn_to_str(lsn), snapshot_name,
                     ", failover" if self.slot.failover else "")
            self._take_snapshot(lsn, snapshot_name)
            self.schema.start_from(self.tables.values())
            self.tails = {}
            start = lsn
        else:
            start = pgoutput.lsn_to_int(slot["confirmed_flush_lsn"])
            self.acks.rebuild(self.writers())
            self._resume_schemas()
        marks = [m for m in (self._resend_until, self.slot.resend_until) if m is not None]
        self._resend_until = max(marks, default=None)
        if self._resend_until is not None and self._resend_until >= start:
            # All of it, not only what the failed run produced: a change skipped
            # at its old offset after changes re-sent at new ones would reach a
            # partition's alignment out of offset order. Without tails nothing
            # is taken for already in Kafka.
            self.tails = {}
            log.warning("an earlier run's deliveries failed (up to %s): Kafka may hold later messages of a "
                        "partition without earlier ones, so nothing from %s on is skipped as already there "
                        "(consumers skip the duplicates by position)", pgoutput.lsn_to_str(self._resend_until),
                        pgoutput.lsn_to_str(start))
        self._replay_until = max((t.position for t in self.tails.values() if t is not None), default=None)
        self.backfills.load(set(decision.new_topics))
        if decision.checkpoint is not None:
            # After the new shapes' backfill requests are in Kafka: a topic the
            # checkpoint covers is never taken for a new one again.
            self._flush_all()
            self.checkpoints.write(decision.checkpoint, wait=True)
        self.repl.start(self.publications, start)
        self._streaming = True
        log.info("streaming from slot %s (publications %s) to %s", cfg.source.slot, ", ".join(self.publications),
                 cfg.kafka.bootstrap_servers)
        self._loop()
        self._flush_all()
        self.status.publish()  # the final numbers, for whoever watches

    @property
    def delivery_failed(self) -> bool:
        return self.ledger.error is not None

    @property
    def resend_until(self) -> int | None:
        """The resend mark this run started with: the given one, raised to the
        slot's recorded one once the slot is found (never lower than given)."""
        return self._resend_until

    @property
    def produced_upto(self) -> int:
        """The highest commit LSN this run sent messages of, the transaction
        being streamed included (its messages go out before its commit); -1: none."""
        tx = self._tx
        return max(self.acks.tracker.last_seen.tx_offset, tx.lsn if tx is not None else -1)

    def _recover(self) -> recovery.Decision:
        """What to do with the existing slot (:mod:`producer.recovery`), from
        what Kafka holds: the checkpoint and each partition's bounds and tail.
        After a failover, first whether Kafka holds anything past the new
        timeline's fork (``FoundSlot.check_fork``)."""
        cfg = self.config
        read = read_partitions(self._kafka_conf, self.writers())
        self.tails = {w: tail for w, (_, _, tail) in read.items()}
        checkpoint = self.checkpoints.read()
        self.slot.check_fork(self._kafka_conf, cfg.kafka.topic_prefix, self.tails, checkpoint)
        ids = self._topic_ids()
        committed = self.checkpoints.committed(checkpoint) if checkpoint and cfg.ack_groups else None
        decision = recovery.decide(
            slot=cfg.source.slot, database=self.db_name, checkpoint=checkpoint, topics=dict(self.partitions),
            partitions={w: recovery.PartitionFacts(low, end, tail, ids.get(w[0])) for w, (low, end, tail) in read.items()},
            committed=committed)
        for note in decision.notes:
            log.info("slot %s: %s", cfg.source.slot, note)
        if decision.new_topics and not decision.resnapshot:
            log.info("topics new to the deployment: %s", ", ".join(sorted(decision.new_topics)))
        return decision

    def _resume_schemas(self) -> None:
        """What each shape last published, for the schema follower to compare
        the tables' first Relations with (DDL made while the producer was stopped)."""
        topics = {self.config.topic(shape): shape.shape_name for shape in self.config.shapes}
        latest = self.schemas.latest(self._kafka_conf, list(topics))
        self.schema.resume_from({topics[t]: found for t, found in latest.items()})

    def _topic_ids(self) -> dict[str, str | None]:
        ids = topic_ids(self.admin, self.partitions)
        for found in ids.values():
            if isinstance(found, Exception):
                raise found
        return ids

    def _take_snapshot(self, lsn: int, snapshot_name: str) -> None:
        """The initial snapshot at the new slot's consistent point, recorded in
        the checkpoint before it starts and once Kafka holds all of it."""
        cfg = self.config
        started = recovery.Checkpoint(cfg.source.slot, self.db_name, snapshot_id(cfg.source.slot, lsn), lsn,
                                      topics=dict(self.partitions))
        self.checkpoints.write(started, wait=True)
        self.snapshot.take(lsn, snapshot_name, self.writers(), self._between_snapshot_chunks, self._flush_all)
        ends = {t: [self.ledger.last_offset[(t, p)] + 1 for p in range(n)] for t, n in self.partitions.items()}
        self.checkpoints.write(replace(started, complete=True, ends=ends, topic_ids=self._topic_ids(),
                                       consumed=not cfg.ack_groups), wait=True)

    def close(self) -> None:
        if self.backfills is not None:
            self.backfills.close()
        try:
            self.kafka.flush(10)
            # What is still queued must never be delivered later: after a broker
            # restart it would land in the topics the next run re-creates, ahead
            # of (and mistaken for) that run's own messages.
            self.kafka.purge()
            self.kafka.flush(0)
        except Exception:
            pass
        if self.read_channel is not None:
            self.read_channel.close()
        # Release the librdkafka handles now rather than at garbage collection.
        self.acks.close()
        self.kafka = self.admin = self.schemas = self.read_channel = None
        if self.repl is not None:
            self.repl.close()
        if self.catalog_conn is not None:
            self.catalog_conn.close()

    def _loop(self) -> None:
        repl, acks, backfills, status = self.repl, self.acks, self.backfills, self.status
        decode, decode_frame = pgoutput.decode, pgoutput.decode_frame
        handle, keepalive, fast_change = self._handle, self._on_keepalive, self._fast_change
        backfill_busy = False
        while not self._stop.is_set():
            # A burst of frames between housekeeping rounds: delivery reports,
            # acks and status are served every 256 frames or when the stream idles.
            # With a backfill running, an idle stream is its turn: do not wait,
            # or only briefly while its reader is behind (a 50 ms wait for a
            # frame each time its queue ran dry halved its rate).
            wait = 0.0 if backfill_busy else BACKFILL_BEHIND_WAIT_S if backfills.running else 0.05
            idle = False
            for _ in range(256):
                frame = repl.read(wait)
                if frame is None:
                    idle = True
                    break
                if frame[0] == 0x77:  # XLogData: the message's own LSN at byte 1, a pgoutput message from 25 on
                    if len(frame) > 30 and frame[25] in CHANGE_KINDS and fast_change(frame):
                        continue
                    self._change_lsn = int.from_bytes(frame[1:9], "big")
                    handle(decode(frame[25:]))
                else:
                    keepalive(decode_frame(frame))
            backfill_busy = backfills.tick(idle)
            if idle:
                self.stats.stream_idle = True
            self.kafka.poll(0)
            if self.ledger.error is not None:
                raise KafkaException(self.ledger.error)
            acks.take_boundaries()
            now = time.monotonic()
            acks.poll(now)
            if now - self._last_status >= STATUS_INTERVAL:
                self._send_status()
                status.publish()
                self.read_channel.in_flight()  # raises a failed read
                backfills.poll()
                self.partition_watch.poll()
                self.schema.poll(self._hold_position())
                self.checkpoints.watch_consumed(now)
            elif idle and acks.confirmed_lsn > repl.flushed and now - self._last_status >= CONFIRM_INTERVAL:
                # Caught up: release the WAL now rather than at the next periodic update.
                self._send_status()

    def _fast_change(self, frame: bytes) -> bool:
        """A change through its relation's compiled encoder (steps 1, 3 and 4 in
        one go); False when it must take the reference path (``_handle``)."""
        tx = self._tx
        encoder = self._encoders.get(int.from_bytes(frame[26:30], "big"))
        if encoder is None or tx is None:
            return False
        lsn, op = tx.lsn, self._op
        messages = encoder.encode(frame, 25, op, lsn, tx.xid, tx.ts_ms, tx.seen_ms)
        if messages is None:
            return False
        self._op = op + encoder.span
        headers = [(wire.POSITION_HEADER, wire.position_header(lsn, op))]
        replay = self._replay_until is not None and (lsn, op) <= self._replay_until
        events, tx_writers = self.stats.events, self._tx_writers
        produce, on_delivery, produced = self.kafka.produce, self.ledger.on_delivery, self.ledger.produced
        for writer, key, value, stat in messages:
            if replay and self._already_in_kafka(writer, lsn, op, value is None):
                continue
            try:  # _send, unrolled: this runs once per message
                produce(writer[0], value, key, partition=writer[1], headers=headers, on_delivery=on_delivery)
                produced[writer] = produced.get(writer, 0) + 1
            except BufferError:
                self._send(writer, key, value, headers)
            tx_writers.add(writer)
            if stat is not None:  # None: a delete's tombstone, not an event
                events[stat] += 1
        return True

    def _handle(self, msg: pgoutput.Message) -> None:
        if isinstance(msg, (Insert, Update, Delete)):
            plan = self.relations[msg.relation_oid]
            rel = plan.relation
            unannounced = schema_changes.unannounced(f"{rel.schema}.{rel.name}", plan.names,
                                                     len(msg.old if isinstance(msg, Delete) else msg.new))
            if unannounced is not None:
                raise Failure(SOURCE, unannounced, permanent=False)
            self._produce(change_messages(plan, msg, self._op, self._tx, self._change_lsn, self.partitions,
                                          self._tombstones))
            self._op += plan.span(msg)
        elif isinstance(msg, Begin):
            # The envelope's ts_ms: when walbridge read the transaction.
            self._tx = StreamTx(msg.final_lsn, msg.xid, pgoutput.pg_us_to_unix_ms(msg.commit_ts_us),
                                int(time.time() * 1000))
            self._op = 0
            # Reused, not reallocated: nothing keeps them past the transaction's commit.
            self._tx_writers.clear()
            self._tx_done_writers.clear()
        elif isinstance(msg, Commit):
            self._commit(msg)
        elif isinstance(msg, Relation):
            # What the catalog says of it must include the transaction's own DDL.
            if self._tx is not None and not catalog.await_visible(self.catalog_conn, self._tx.xid):
                log.warning("transaction %s is decoded but not yet visible to other sessions after %.0f s; "
                            "reading the catalog for %s.%s anyway (a column it lacks is re-read)", self._tx.xid,
                            catalog.VISIBLE_TIMEOUT, msg.schema, msg.name)
            reads = catalog.CatalogReads(self.catalog_conn)
            if msg.oid in self.schema.shape_tables:
                self.schema.relation(msg, self._hold_position(), reads)
            plan = self.relations[msg.oid] = self._plan_relation(msg, reads)
            encoder = relation_encoder(plan, self.partitions, self._tombstones)
            if encoder is not None:
                self._encoders[msg.oid] = encoder
            else:
                self._encoders.pop(msg.oid, None)
        elif isinstance(msg, Truncate):
            plans = [p for p in map(self.relations.get, msg.relation_oids) if p is not None]
            truncated = set()
            tx, now_ms = self._tx, int(time.time() * 1000)
            for plan in plans:
                if not plan.routed:
                    for route in plan.routes:
                        key = self._control_key(route.topic, wire.TRUNCATE_KEY_EVENT,
                                                f"{pgoutput.lsn_to_str(tx.lsn)}:{self._op}")
                        self._produce(truncate_messages(route, tx, self._op, self._change_lsn,
                                                        self.partitions[route.topic], key, now_ms))
                        self.stats.events[(route.name, "t")] += 1
                        truncated.add(route.name)
            for plan in plans:
                if plan.routed:
                    self._truncated_below(plan, [r.name for r in plan.routes if r.name not in truncated])
            self._op += 1
        elif isinstance(msg, TypeMsg):
            pass  # types are read from the catalog when a Relation needs them

    def _plan_relation(self, rel: Relation, reads: catalog.CatalogReads) -> RelationPlan:
        # By oid first: a shape table's changes from before a RENAME TABLE
        # still carry the old name when the config names the new one.
        qualified = self.schema.shape_tables.get(rel.oid, f"{rel.schema}.{rel.name}")
        table = reads.table(rel.schema, rel.name)
        key = relation_key(rel, table)
        stopped = self.schema.stopped
        specs = [s for s in self.shape_specs.get(qualified, []) if s.name not in stopped]
        if not specs and table is not None and qualified not in self.shape_specs:
            specs, key = self._routed_specs(table, key)
        codecs = [column_codec(self.types(c.type_oid, c.typmod), self.catalog_conn) for c in rel.columns]
        # The shape table's attnums, which a routed plan's writer schemas carry too.
        above = {spec.table for spec in specs if spec.table}
        attnums = {t.qualified: self.schema.attnums(t.oid, reads) for t in self.tables.values()
                   if (t.schema, t.name) in above}
        if rel.oid in self.schema.shape_tables:
            attnums[f"{rel.schema}.{rel.name}"] = self.schema.attnums(rel.oid, reads)
        plan = RelationPlan(rel, codecs, key, specs, self.config.kafka.topic_prefix, self.db_name,
                            self.config.kafka.value_layout, self.schema.aliases(rel.oid), attnums)
        plan.fetch_current = self._fetch_current
        for route in plan.routes:
            try:
                self._register(route.codec, route.topic)
            except SchemaRegistrationError as e:
                if not self._streaming:
                    raise
                # That shape stops; the others are planned again without it.
                self.schema.stop(route.name, f"shape {route.name}: {e.headline} (fix: {e.fix})",
                                 self._hold_position())
                return self._plan_relation(rel, reads)
        return plan

    def _routed_specs(self, table: TableInfo, key: tuple[str, ...]) -> tuple[list[ShapeSpec], tuple[str, ...]]:
        """The shapes of the tables above ``table`` (its partition root, its
        INHERITS parents), for its changes arriving under its own name, and
        the key they are sent with (theirs)."""
        specs = []
        for above in catalog.routed_to(table.ancestors, self.shape_specs):
            info = self.tables[above]
            names = tuple(c.name for c in info.columns)
            specs += [replace(spec, columns=spec.columns or names, table=(info.schema, info.name))
                      for spec in self.shape_specs[above]]
            key = info.primary_key or key
        if specs:
            log.warning("changes of %s arrive under its own name (a partition published without "
                        "publish_via_partition_root, or an INHERITS child): routed to the shape(s) %s of %s",
                        table.qualified, ", ".join(s.name for s in specs),
                        ", ".join(catalog.routed_to(table.ancestors, self.shape_specs)))
        return specs, key

    def _truncated_below(self, plan: RelationPlan, shapes: list[str]) -> None:
        """A TRUNCATE of a partition or child alone, arriving under its own name,
        empties part of its shapes' tables: they are re-read (a backfill drops
        the rows it does not see), since a shape-wide truncate would drop the
        other partitions' rows too."""
        for shape in shapes:
            self.backfills.request(shape, f"truncate of {plan.relation.schema}.{plan.relation.name}")

    def _hold_position(self) -> int:
        """Where a shape stopped now holds WAL from: the transaction being
        read, or (between transactions) what is confirmed."""
        return self._tx.lsn if self._tx is not None else self.acks.confirmed_lsn

    def _fetch_current(self, rel: Relation, key: dict, columns: list[str]) -> dict | None:
        if not key:
            return None
        query = sql.SQL("SELECT {} FROM {} WHERE {}").format(
            sql.SQL(", ").join(sql.Identifier(c) for c in columns), sql.Identifier(rel.schema, rel.name),
            sql.SQL(" AND ").join(sql.SQL("{} = {}").format(sql.Identifier(k), sql.Literal(v)) for k, v in key.items()))
        row = self.catalog_conn.execute(query).fetchone()
        return dict(zip(columns, row)) if row is not None else None

    def _register(self, codec, topic: str) -> None:
        # The key schema first: a consumer that finds the value schema must find
        # the key schema too, or it would take a keyed shape for a keyless one.
        codec.key_prefix = (self.schemas.prefix(topic, codec.key_schema, is_key=True)
                            if codec.key_schema is not None else None)
        codec.value_prefix = self.schemas.prefix(topic, codec.value_schema)

    def _plan_table(self, table: TableInfo) -> RelationPlan:
        """The plan of a table read whole (snapshot, backfill), as if its Relation message had arrived."""
        return self._plan_relation(table_relation(table), catalog.CatalogReads(self.catalog_conn, [table]))

    def _plan_tables(self, tables: Iterable[TableInfo]) -> list[RelationPlan]:
        """:meth:`_plan_table` of each, their schemas published together."""
        with self.schemas.together():
            return [self._plan_table(t) for t in tables]

    def _produce(self, messages: Iterable[Message]) -> None:
        """A change's messages to Kafka, but those a partition already holds (a replay)."""
        lsn, tx_writers, events = self._tx.lsn, self._tx_writers, self.stats.events
        for writer, key, value, headers, op, stat in messages:
            if self._already_in_kafka(writer, lsn, op, value is None):
                continue
            self._send(writer, key, value, headers)
            tx_writers.add(writer)
            if stat is not None:
                events[stat] += 1

    def _already_in_kafka(self, writer: Writer, lsn: int, op: int, tombstone: bool = False) -> bool:
        """Does ``writer`` hold the message at (lsn, op) already (a replay)? A
        delete's tombstone shares its position and comes after it."""
        tail = self.tails.get(writer)
        if tail is not None and ((lsn, op) < tail.position
                                 or ((lsn, op) == tail.position and (tail.tombstone or not tombstone))):
            self.stats.skipped_replayed += 1
            self._tx_done_writers.add(writer)
            return True
        return False

    def _control_key(self, topic: str, event: str, event_id: str) -> bytes:
        return control_key(self.schemas.control_key_prefix(topic), event, event_id)

    def _send(self, writer: Writer, key: bytes | None, value: bytes | None, headers: list) -> None:
        while True:
            try:
                self.kafka.produce(writer[0], value, key, partition=writer[1], headers=headers,
                                   on_delivery=self.ledger.on_delivery)
                break
            except BufferError:
                # Local queue full: let deliveries drain (bounded memory), keep the stream alive.
                self.kafka.poll(0.05)
                self._keep_stream_alive()
        self.ledger.count_produce(writer)

    def _commit(self, commit: Commit) -> None:
        last = LogOffset(commit.commit_lsn, max(self._op - 1, 0))
        ts_ms = self._tx.ts_ms
        self.acks.commit(last, self._tx_writers, self._tx_done_writers, ts_ms, time.monotonic())
        self._tx = None
        stats = self.stats
        stats.transactions += 1
        stats.last_commit_ts_ms, stats.stream_idle = ts_ms, False

    def _on_keepalive(self, ka: Keepalive) -> None:
        if self._tx is None and self.acks.idle():
            # Nothing of ours is pending: everything up to the server's WAL end
            # has been seen and needs nothing from us.
            if ka.wal_end > self.acks.confirmed_lsn:
                log.debug("keepalive: nothing pending, confirming the server's WAL end %s",
                          pgoutput.lsn_to_str(ka.wal_end))
            self.acks.confirm(ka.wal_end)
        if ka.reply_requested:
            self._send_status()

    def _keep_stream_alive(self) -> None:
        # Before START_REPLICATION (during the snapshot) there is no stream to
        # keep alive, and the connection must stay idle for the exported snapshot.
        if self._streaming and time.monotonic() - self._last_status >= STATUS_INTERVAL:
            self._send_status()

    def _send_status(self) -> None:
        # When nothing of ours is pending, ask the server to answer with a
        # keepalive: its WAL end is what we may confirm next (otherwise an idle
        # walsender reports it only every wal_sender_timeout / 2).
        idle = self._tx is None and self.acks.idle()
        self.repl.send_status(flush_lsn=self.acks.confirmed_lsn or None, reply=idle)
        self._last_status = time.monotonic()

    def _between_snapshot_chunks(self) -> None:
        """What the producer serves while the snapshot runs: delivery reports,
        status now and then, and a delivery error as soon as it shows."""
        self.kafka.poll(0)
        if time.monotonic() - self._last_status >= STATUS_INTERVAL:
            self._last_status = time.monotonic()
            self.status.publish()
            self.read_channel.in_flight()  # raises a failed read
        if self.ledger.error is not None:
            raise KafkaException(self.ledger.error)

    def _flush_all(self) -> None:
        """Wait for every produced message's delivery report. Bounded: a message
        is delivered or fails within ``message.timeout.ms``; a failure raises."""
        while self.read_channel.flush(1.0) or self.kafka.flush(1.0):
            if self.ledger.error is not None:
                break
            self._keep_stream_alive()
        if self.ledger.error is not None:
            raise KafkaException(self.ledger.error)
        self.acks.take_boundaries()


class _Runs:
    """The producer's pipeline runs, each from connecting to a stop or a failure.

    A run that got going (published its status: source and broker answered)
    and then failed transiently ends the outage it belonged to; the next
    failures start a new one, so its waits start short again. Each run is told
    the server the last one bound its slot to, so a reconnect that reaches
    another server (a failover) is judged as one (``failover.py``); a run
    that ended before binding it (say, before Kafka was checked for changes
    past a failover's fork) leaves the judgement to the next."""

    def __init__(self, config: Config, stop: threading.Event, on_status: Callable[[dict], None] | None,
                 outage: Callable[[], Outage]):
        self._config = config
        self._stop = stop
        self._on_status = on_status
        self._new_outage = outage
        self._outage: Outage | None = None
        self.lost: Failure | None = None  # the transient failure that ended a run that had got going
        self.server: Server | None = None  # where the last run bound the slot
        # After a run whose Kafka deliveries failed, partition tails are no
        # prefix marks up to what it produced: librdkafka's idempotent producer
        # bumps its epoch when a message times out and goes on delivering the
        # partition's later messages, so a partition may hold them without the
        # failed ones (and messages the broker had buffered may land after the
        # next run's). Until a run has confirmed past the highest commit LSN
        # such a run produced, runs skip nothing of their replay as already
        # there. The mark is recorded with the slot too (a process killed
        # before the re-send must not forget it).
        self.resend_until: int | None = None

    def outage(self) -> Outage:
        self._outage = self._new_outage()
        self.lost = None
        return self._outage

    def once(self) -> None:
        if self._stop.is_set():
            return
        cfg = self._config
        running = False

        def on_status(view: dict) -> None:
            nonlocal running
            if not running:
                running = True
                self._outage.over()
            if self._on_status is not None:
                self._on_status(view)

        pipeline, kafka_failed = None, False
        try:
            with attributed(database=(SOURCE, cfg.source.dsn), kafka=cfg.kafka.bootstrap_servers,
                            registry=cfg.kafka.schema_registry_url):
                pipeline = Pipeline(cfg, self._stop, on_status, self.server, self.resend_until)
                pipeline.run()
        except Failure as failure:
            kafka_failed = failure.endpoint == KAFKA
            if running and not failure.permanent:
                self.lost = failure
                return
            raise
        finally:
            if pipeline is not None:
                bound = pipeline.slot is not None and pipeline.slot.bound
                if bound:
                    self.server = pipeline.slot.server
                upto, mark = pipeline.produced_upto, pipeline.resend_until  # the mark: ours and the slot's
                if (kafka_failed or pipeline.delivery_failed) and upto >= 0:
                    self.resend_until = max(mark or upto, upto)
                    if bound:
                        self._record(pipeline, slot_binding.mark_resend, upto)
                elif mark is not None and pipeline.acks.confirmed_lsn >= mark:
                    self.resend_until = None
                    if bound:
                        self._record(pipeline, slot_binding.clear_resend, pipeline.acks.confirmed_lsn)
                pipeline.close()

    def _record(self, pipeline: Pipeline, write: Callable[[psycopg.Connection, str, int], None], lsn: int) -> None:
        """The resend mark into the slot's binding, where the source still
        answers (else this process's memory of it is all there is)."""
        try:
            write(pipeline.catalog_conn, self._config.source.slot, lsn)
        except psycopg.Error as e:
            log.warning("could not record the resend mark %s with slot %s (%s): a restart of this process before "
                        "the replay is re-sent would trust the partition tails", pgoutput.lsn_to_str(lsn),
                        self._config.source.slot, str(e).strip())


def run_producer(config: Config, stop: threading.Event | None = None,
                 on_status: Callable[[dict], None] | None = None) -> None:
    """Run until ``stop`` is set. Transient failures (a lost connection, an
    unreachable broker or registry) are waited out with jittered exponential
    backoff (:mod:`schemas.retry`), each wait logged with the endpoint that
    fails; every restart resumes from the slot and the partition tails. A
    permanent failure, or an outage longer than ``[source]
    reconnect_max_elapsed``, raises :class:`~schemas.failures.Failure`."""
    stop = stop or threading.Event()
    policy = RetryPolicy.of(config.source)
    runs = _Runs(config, stop, on_status, lambda: Outage(policy, stop, log))
    while not stop.is_set():
        for attempt in runs.outage():
            with attempt:
                runs.once()
        if runs.lost is None:
            return
        log.warning("connection lost (%s); reconnecting", runs.lost.headline)
