"""The producer: PostgreSQL logical replication → Avro messages on shape topics,
with the slot confirmed only as far as the FlushTracker allows.

The path of one change, top to bottom:

1. ``ReplicationConnection.read`` returns a CopyData frame;
   ``pgoutput.decode_frame``/``pgoutput.decode`` turn it into a message.
2. ``Begin`` opens a transaction whose position (commit LSN) is known up front,
   so its changes are produced as they arrive: nothing is buffered per
   transaction, whatever its size.
3. A change is loaded once and routed to its shapes by its ``RelationPlan``
   (``shapes.py``), yielding ``Event``s with their positions.
4. ``_produce`` encodes each event (``envelope.py``) and hands it to the
   idempotent Kafka producer on the key's partition, unless that partition already
   holds it (its tail position is at or past the event's: a replay after a crash).
   Steps 1, 3 and 4 are one compiled call (``fastcodec.py``) for relations
   without filtered shapes; the path above is its reference and fallback.
5. At ``Commit`` the transaction is given to the ``FlushTracker`` with the
   partitions (writers) it touched; the ``DeliveryLedger`` learns the Kafka
   offset of the transaction's last message on each writer. Those ends are
   taken once per round of the loop, the latest per writer.
6. Group commits (or, with ``[ack] consumer_groups = []``, delivery reports) are
   turned into flushed positions per writer and fed to the tracker, whose
   ``notify_fn`` raises the flush LSN sent in standby status updates.

Invariants:
- The LSN confirmed to PostgreSQL never passes a change that some configured
  consumer group has not committed (or, in delivery mode, the broker has not
  acknowledged).
- Keepalives are answered whatever Kafka or the groups do; with nothing pending
  the slot is confirmed up to the server's WAL end, so idle databases and
  unrelated tables never hold WAL back.
- A restart (crash or lost connection) takes the same path as a first start:
  read partition tails, rebuild ack state from Kafka, stream from the slot.
- Initial snapshot: taken when the slot is created. A snapshot is complete once a
  ``snapshot_end`` control event sits on every partition of every shape topic; if
  the producer finds the slot but not that (it crashed mid-snapshot, or the broker
  lost its data), it drops the slot and *redoes* the snapshot at a new consistent
  point. The partial rows already in the topics are older (lower position) than
  the redone ones, so apply converges; the ``snapshot_end`` event tells the
  consumer which snapshot is complete. Exception: shapes whose topics hold
  nothing at all while the others are complete were added to the config; they
  are backfilled (``backfill.py``) while the others stream on.
- Backfills run one at a time, in request order, between live traffic
  (``_backfill_tick``); see :mod:`producer.backfill`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

import psycopg
from psycopg import sql
from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from producer import backfill, catalog, metrics, pgoutput
from producer.backfill_requests import publish_state, read_states
from producer.catalog import TableInfo
from producer.fastcodec import CHANGE_KINDS, relation_encoder
from producer.flush_tracker import FlushTracker, LogOffset, WriterAlignment
from producer.kafka_io import DeliveryLedger, Tail, partition_for, producer_config, read_positions, read_tails
from producer.pgoutput import Begin, Commit, Delete, Insert, Keepalive, Relation, Truncate, TypeMsg, Update
from producer.pgtypes import column_codec
from producer.replication import ReplicationConnection, ReplicationError, connect
from producer.shapes import Event, RelationPlan, ShapeSpec, event_message
from producer.snapshot import plan_pieces, relpages, run_snapshot
from schemas import wire
from schemas.config import Config, redact_dsn
from schemas.kafka import Writer, client_config, ensure_topics, group_offsets, scan_consumer
from schemas.publisher import SchemaPublisher
from schemas.shape_filter import compile_filter

log = logging.getLogger("walbridge.producer")

STATUS_INTERVAL = 1.0  # seconds between unsolicited standby status updates
CONFIRM_INTERVAL = 0.1  # when the stream idles, a newly confirmable LSN goes out this soon
_ANY_OFFSET = 2**63 - 1  # past every Kafka offset


@dataclass
class Stats:
    events: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    skipped_replayed: int = 0
    transactions: int = 0
    snapshot_rows: int = 0
    confirmed_lsn: int = 0


class Pipeline:
    """One run of the producer, from connecting to the first fatal error or stop."""

    def __init__(self, config: Config, stop: threading.Event | None = None,
                 on_status: Callable[[dict], None] | None = None):
        self.config = config
        self._on_status = on_status
        self.stats = Stats()
        self._stop = stop or threading.Event()
        kafka_conf = client_config(config.kafka.bootstrap_servers, config.kafka.client)
        self._kafka_conf = kafka_conf
        self.admin = AdminClient(kafka_conf)
        self.kafka = Producer(producer_config(kafka_conf))
        self.schemas = SchemaPublisher(self.kafka, config.kafka.topic_prefix, config.kafka.schema_registry_url)
        self.ack_groups = list(config.ack_groups)
        self.tracker = FlushTracker(self._confirm)
        self.ledger = DeliveryLedger()
        self.alignments: dict[Writer, WriterAlignment] = defaultdict(WriterAlignment)
        self.partitions: dict[str, int] = {}
        self.tails: dict[Writer, Tail | None] = {}
        self._replay_until: tuple[int, int] | None = None  # highest tail position: below it, check for replays
        self.replayed_offsets: dict[Writer, dict[int, int]] = {}
        self.relations: dict[int, RelationPlan] = {}
        self._encoders: dict[int, Any] = {}  # relation oid -> compiled encoder (fastcodec), where one applies
        self.shape_specs: dict[str, list[ShapeSpec]] = defaultdict(list)
        self.tables: dict[str, TableInfo] = {}
        self.repl: ReplicationConnection | None = None
        self.catalog_conn: psycopg.Connection | None = None
        self._type_cache: dict[tuple[int, int], Any] = {}
        # Current transaction.
        self._tx: Begin | None = None
        self._tx_ts_ms = 0
        self._op = 0
        self._tx_writers: set[Writer] = set()
        self._tx_done_writers: set[Writer] = set()
        self._tx_sources: dict[str, Any] = {}
        self._tx_seen_ms = 0
        self._commit_times: dict[int, int] = {}  # commit LSN → commit time (ms), until acknowledged
        self._confirm_lsn = 0
        self._group_seen: dict[str, dict[Writer, int]] = {}
        self._group_progress: dict[str, float] = {}
        self.stalled_writers: list[Writer] = []
        self.stalled_groups: list[str] = []
        self.snapshot_progress: dict[str, Any] = {}
        self.status_topic = wire.status_topic(config.kafka.topic_prefix)
        self.backfills_topic = wire.backfills_topic(config.kafka.topic_prefix)
        self.backfill_requests: dict[str, dict] = {}  # request id -> latest state record
        self._backfill_queue: list[dict] = []
        self._backfill: backfill.Backfill | None = None
        self.backfills_done: list[dict] = []  # the last few finished, for status
        self._requests_consumer: Consumer | None = None
        self._backfill_busy = False
        self._metric_events: dict[tuple[str, str], int] = {}
        self._metric_tx = 0
        self._last_slot_read = 0.0
        self._streaming = False
        self._last_status = 0.0
        self._last_ack_poll = 0.0
        self.db_name = ""

    # ----------------------------------------------------------------- set-up
    def stop(self) -> None:
        self._stop.set()

    def prepare(self) -> None:
        """Validate against the live source and create publication and topics.
        Nothing here creates a slot."""
        cfg = self.config
        self.catalog_conn = connect(cfg.source.dsn)
        self.db_name = self.catalog_conn.info.dbname
        self.tables = catalog.check_source(self.catalog_conn, cfg)
        plan = catalog.plan_publication(list(self.tables.values()), cfg.source.keyless_tables)
        self.publications = catalog.ensure_publications(self.catalog_conn, cfg.source.publication, plan)
        for shape in cfg.shapes:
            table = self.tables[shape.table]
            types = {c.name: c.type_name for c in table.columns}
            row_filter = compile_filter(shape.where, types) if shape.where else None
            if row_filter is not None and table.replica_identity != "f":
                log.warning("shape %s filters on %s, whose REPLICA IDENTITY is not FULL: updates of rows "
                            "outside the filter are sent as deletes (harmless, but extra traffic); "
                            "ALTER TABLE %s REPLICA IDENTITY FULL gives exact move-in/move-out",
                            shape.shape_name, shape.table, shape.table)
            self.shape_specs[shape.table].append(
                ShapeSpec(shape.shape_name, cfg.topic(shape), tuple(shape.columns) if shape.columns else None,
                          row_filter))
        topics = [cfg.topic(s) for s in cfg.shapes]
        self.partitions = ensure_topics(self.admin, topics, cfg.kafka.partitions, cfg.kafka.replication_factor)
        internal = [self.status_topic, self.backfills_topic] + (
            [self.schemas.schemas_topic] if self.schemas.schemas_topic else [])
        ensure_topics(self.admin, internal, 1, cfg.kafka.replication_factor)

    def writers(self) -> list[Writer]:
        return [(t, p) for t, n in self.partitions.items() for p in range(n)]

    def _new_topics(self) -> set[str]:
        """Topics none of whose partitions holds a streamed or snapshot message:
        shapes added to the config since the snapshot (or a broker that lost
        everything, when that is every topic)."""
        tails_of: dict[str, list] = defaultdict(list)
        for w in self.writers():
            tails_of[w[0]].append(self.tails.get(w))
        return {t for t, tails in tails_of.items() if all(x is None for x in tails)}

    def _snapshot_complete(self, ignore: set[str] = frozenset()) -> bool:
        for writer in self.writers():
            if writer[0] in ignore:
                continue
            tail = self.tails.get(writer)
            if tail is None or (tail.snapshot_id is not None and tail.control is None):
                log.info("partition %s[%d] holds no complete snapshot", *writer)
                return False
        return True

    # ------------------------------------------------------------------- run
    def run(self) -> None:
        cfg = self.config
        self.prepare()
        self.repl = ReplicationConnection(cfg.source.dsn, cfg.source.slot)
        slot = catalog.slot_state(self.catalog_conn, cfg.source.slot)
        new_topics: set[str] = set()  # shapes added to a running deployment: backfilled below
        if slot is not None:
            if slot["plugin"] != "pgoutput" or slot["slot_type"] != "logical":
                raise ReplicationError(f"slot {cfg.source.slot} exists but is not a logical pgoutput slot")
            if slot["active"]:
                raise ReplicationError(f"slot {cfg.source.slot} is in use by another process "
                                       f"(pid {slot['active_pid']}); is another producer running?")
            self.tails = read_tails(self._kafka_conf, self.writers())
            new_topics = self._new_topics()
            if new_topics == set(self.partitions) or not self._snapshot_complete(ignore=new_topics):
                log.warning("slot %s exists but the snapshot in Kafka is incomplete: dropping the slot and "
                            "redoing the snapshot", cfg.source.slot)
                self.catalog_conn.execute("SELECT pg_drop_replication_slot(%s)", (cfg.source.slot,))
                slot, new_topics = None, set()
        if slot is None:
            lsn, snapshot_name = self.repl.create_slot()
            log.info("created slot %s at %s (snapshot %s)", cfg.source.slot, pgoutput.lsn_to_str(lsn), snapshot_name)
            self.take_snapshot(lsn, snapshot_name)
            self.tails = {}
            start = lsn
        else:
            start = pgoutput.lsn_to_int(slot["confirmed_flush_lsn"])
            self._rebuild_ack_state()
        self._confirm_lsn = 0
        self._replay_until = max((t.position for t in self.tails.values() if t is not None), default=None)
        self._load_backfill_requests(new_topics)
        self.repl.start(self.publications, start)
        self._streaming = True
        log.info("streaming from slot %s (publications %s) to %s", cfg.source.slot, ", ".join(self.publications),
                 cfg.kafka.bootstrap_servers)
        self._loop()
        self._flush_all()
        self._publish_status()  # the final numbers, for whoever watches

    def close(self) -> None:
        if self._backfill is not None:
            self._backfill.reader.close()
        if self._requests_consumer is not None:
            self._requests_consumer.close()
        try:
            self.kafka.flush(10)
            # What is still queued must never be delivered later: after a broker
            # restart it would land in the topics the next run re-creates, ahead
            # of (and mistaken for) that run's own messages.
            self.kafka.purge()
            self.kafka.flush(0)
        except Exception:
            pass
        # Release the librdkafka handles now rather than at garbage collection.
        self.kafka = self.admin = self.schemas = None
        if self.repl is not None:
            self.repl.close()
        if self.catalog_conn is not None:
            self.catalog_conn.close()

    def _loop(self) -> None:
        repl = self.repl
        decode, decode_frame = pgoutput.decode, pgoutput.decode_frame
        handle, keepalive, fast_change = self._handle, self._on_keepalive, self._fast_change
        while not self._stop.is_set():
            # A burst of frames between housekeeping rounds: delivery reports,
            # acks and status are served every 256 frames or when the stream idles.
            # With a backfill running, an idle stream is its turn: do not wait.
            wait = 0.0 if self._backfill_busy else 0.05
            idle = False
            for _ in range(256):
                frame = repl.read(wait)
                if frame is None:
                    idle = True
                    break
                if frame[0] == 0x77:  # XLogData: a pgoutput message from byte 25 on
                    if len(frame) > 30 and frame[25] in CHANGE_KINDS and fast_change(frame):
                        continue
                    handle(decode(frame[25:]))
                else:
                    keepalive(decode_frame(frame))
            self._backfill_busy = self._backfill is not None and self._backfill_tick(idle)
            self.kafka.poll(0)
            if self.ledger.error is not None:
                raise KafkaException(self.ledger.error)
            self._take_boundaries()
            now = time.monotonic()
            if self.ack_groups and now - self._last_ack_poll >= self.config.ack.interval:
                self._last_ack_poll = now
                self._poll_group_offsets()
            if now - self._last_status >= STATUS_INTERVAL:
                self._send_status()
                self._publish_status()
                self._poll_backfill_requests()
            elif idle and self._confirm_lsn > self.repl.flushed and now - self._last_status >= CONFIRM_INTERVAL:
                # Caught up: release the WAL now rather than at the next periodic update.
                self._send_status()

    # --------------------------------------------------------------- changes
    def _fast_change(self, frame: bytes) -> bool:
        """A change through its relation's compiled encoder (steps 1, 3 and 4 in
        one go); False when it must take the reference path (``_handle``)."""
        tx = self._tx
        encoder = self._encoders.get(int.from_bytes(frame[26:30], "big"))
        if encoder is None or tx is None:
            return False
        lsn, op = tx.final_lsn, self._op
        messages = encoder.encode(frame, 25, op, lsn, tx.xid, self._tx_ts_ms, self._tx_seen_ms)
        if messages is None:
            return False
        self._op = op + 1
        headers = [(wire.POSITION_HEADER, wire.position_header(lsn, op))]
        replay = self._replay_until is not None and (lsn, op) <= self._replay_until
        events, tx_writers = self.stats.events, self._tx_writers
        produce, on_delivery, produced = self.kafka.produce, self.ledger.on_delivery, self.ledger.produced
        for writer, key, value, stat in messages:
            if replay and self._already_in_kafka(writer, lsn, op):
                continue
            try:  # _send, unrolled: this runs once per message
                produce(writer[0], value, key, partition=writer[1], headers=headers, on_delivery=on_delivery)
                produced[writer] = produced.get(writer, 0) + 1
            except BufferError:
                self._send(writer, key, value, headers)
            tx_writers.add(writer)
            events[stat] += 1
        return True

    def _handle(self, msg: pgoutput.Message) -> None:
        if isinstance(msg, (Insert, Update, Delete)):
            plan = self.relations[msg.relation_oid]
            for event in plan.events(msg, self._op):
                self._produce(event)
            self._op += plan.span(msg)
        elif isinstance(msg, Begin):
            self._tx = msg
            self._tx_ts_ms = pgoutput.pg_us_to_unix_ms(msg.commit_ts_us)
            self._op = 0
            # Reused, not reallocated: nothing keeps them past the transaction's commit.
            self._tx_writers.clear()
            self._tx_done_writers.clear()
            self._tx_sources.clear()
            self._tx_seen_ms = int(time.time() * 1000)  # envelope ts_ms: when walbridge read the transaction
        elif isinstance(msg, Commit):
            self._commit(msg)
        elif isinstance(msg, Relation):
            plan = self.relations[msg.oid] = self._plan_relation(msg)
            encoder = relation_encoder(plan, self.partitions)
            if encoder is not None:
                self._encoders[msg.oid] = encoder
            else:
                self._encoders.pop(msg.oid, None)
        elif isinstance(msg, Truncate):
            for oid in msg.relation_oids:
                plan = self.relations.get(oid)
                for route in plan.routes if plan else ():
                    self._produce_truncate(route)
            self._op += 1
        elif isinstance(msg, TypeMsg):
            pass  # types are read from the catalog when a Relation needs them

    def _plan_relation(self, rel: Relation) -> RelationPlan:
        qualified = f"{rel.schema}.{rel.name}"
        table = catalog.table_info(self.catalog_conn, rel.schema, rel.name)
        key = table.primary_key if table else tuple(c.name for c in rel.columns if c.is_key)
        if table and not table.primary_key and table.replica_identity == "f":
            key = ()  # REPLICA IDENTITY FULL flags every column; that is not a key
        codecs = [column_codec(self._type_info(c.type_oid, c.typmod), self.catalog_conn) for c in rel.columns]
        plan = RelationPlan(rel, codecs, key, self.shape_specs.get(qualified, []), self.config.kafka.topic_prefix,
                            self.db_name)
        plan.fetch_current = self._fetch_current
        for route in plan.routes:
            self._register(route.codec, route.topic)
        return plan

    def _fetch_current(self, rel: Relation, key: dict, columns: list[str]) -> dict | None:
        if not key:
            return None
        query = sql.SQL("SELECT {} FROM {} WHERE {}").format(
            sql.SQL(", ").join(sql.Identifier(c) for c in columns), sql.Identifier(rel.schema, rel.name),
            sql.SQL(" AND ").join(sql.SQL("{} = {}").format(sql.Identifier(k), sql.Literal(v)) for k, v in key.items()))
        row = self.catalog_conn.execute(query).fetchone()
        return dict(zip(columns, row)) if row is not None else None

    def _type_info(self, oid: int, typmod: int):
        key = (oid, typmod)
        if key not in self._type_cache:
            self._type_cache[key] = catalog.type_info(self.catalog_conn, oid, typmod)
        return self._type_cache[key]

    def _register(self, codec, topic: str) -> None:
        codec.value_prefix = self.schemas.prefix(f"{topic}-value", codec.value_schema)
        codec.key_prefix = (self.schemas.prefix(f"{topic}-key", codec.key_schema)
                            if codec.key_schema is not None else None)

    def _produce(self, event: Event) -> None:
        tx = self._tx
        lsn = tx.final_lsn
        route = event.route
        source = self._tx_sources.get(route.name)
        if source is None:
            source = self._tx_sources[route.name] = route.codec.source_bytes(lsn, tx.xid, self._tx_ts_ms)
        writer, key, value = event_message(event, lsn, source, self._tx_seen_ms, self.partitions[route.topic])
        if self._already_in_kafka(writer, lsn, event.op_offset):
            return
        self._send(writer, key, value, [(wire.POSITION_HEADER, wire.position_header(lsn, event.op_offset))])
        self._tx_writers.add(writer)
        self.stats.events[(route.name, event.op)] += 1

    def _produce_truncate(self, route) -> None:
        """TRUNCATE reaches every partition of the shape's topic (rows of every
        key are gone), at one position."""
        tx = self._tx
        codec = route.codec
        source = codec.source_bytes(tx.final_lsn, tx.xid, self._tx_ts_ms)
        value = codec.encode_change(codec.value_prefix, "t", None, None, source, self._op, int(time.time() * 1000))
        headers = [(wire.POSITION_HEADER, wire.position_header(tx.final_lsn, self._op))]
        for p in range(self.partitions[route.topic]):
            writer = (route.topic, p)
            if not self._already_in_kafka(writer, tx.final_lsn, self._op):
                self._send(writer, None, value, headers)
                self._tx_writers.add(writer)
        self.stats.events[(route.name, "t")] += 1

    def _already_in_kafka(self, writer: Writer, lsn: int, op: int) -> bool:
        tail = self.tails.get(writer)
        if tail is not None and (lsn, op) <= tail.position:
            self.stats.skipped_replayed += 1
            self._tx_done_writers.add(writer)
            return True
        return False

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
        writers = self._tx_writers
        # Writers whose part of this transaction was already in Kafka (a replay):
        # they count only if a group has not committed past it yet.
        replayed = {}
        if self._tx_done_writers:
            writers = set(writers)
            for w in self._tx_done_writers - self._tx_writers:
                offset = self.replayed_offsets.get(w, {}).get(commit.commit_lsn)
                if offset is not None and self.ack_groups:
                    replayed[w] = offset
                    writers.add(w)
        self.tracker.handle_transaction(last, writers)
        if self._tx_writers:
            self._commit_times[commit.commit_lsn] = self._tx_ts_ms
        for w in self._tx_writers:
            self.ledger.end_transaction(w, last)
        if replayed:
            self._take_boundaries()  # this run's earlier boundaries first: per writer they must stay in order
            for w, offset in replayed.items():
                self._on_boundary(w, offset, last)
        self._tx = None
        self.stats.transactions += 1

    # ------------------------------------------------------------------ acks
    def _take_boundaries(self) -> None:
        """Hand the transaction ends Kafka acknowledged since the last round to
        the ack state: the latest per writer (it implies the earlier ones)."""
        boundaries = self.ledger.take_boundaries()
        if not boundaries:
            return
        # Produce latency: source commit → Kafka acknowledgement of the newest
        # transaction's last message on a writer.
        newest = max(tx_last for _, _, tx_last in boundaries)
        while self._commit_times:
            lsn, ts_ms = next(iter(self._commit_times.items()))
            if lsn > newest.tx_offset:
                break
            del self._commit_times[lsn]
            if lsn == newest.tx_offset:
                metrics.PRODUCE_LATENCY.set(max(time.time() - ts_ms / 1000, 0))
        for writer, offset, tx_last in boundaries:
            self._on_boundary(writer, offset, tx_last)

    def _on_boundary(self, writer: Writer, offset: int, tx_last: LogOffset) -> None:
        if not self.ack_groups:
            self.tracker.handle_flush_notification(writer, tx_last)
        else:
            self.alignments[writer].record(offset, tx_last)

    def _confirm(self, lsn: int) -> None:
        self._confirm_lsn = max(self._confirm_lsn, lsn)
        self.stats.confirmed_lsn = self._confirm_lsn

    def group_offsets(self, writers: list[Writer]) -> dict[str, dict[Writer, int]]:
        return group_offsets(self.admin, self.ack_groups, writers)

    def committed_offsets(self, writers: list[Writer]) -> dict[Writer, int]:
        """Minimum over the ack groups of each writer's committed offset."""
        per_group = self.group_offsets(writers)
        return {w: min(offsets.get(w, 0) for offsets in per_group.values()) for w in writers} if per_group else {}

    def _poll_group_offsets(self) -> None:
        pending = list(self.tracker.pending())
        if not pending:
            return
        try:
            per_group = self.group_offsets(pending)
        except KafkaException as e:
            log.warning("reading committed offsets failed (will retry): %s", e)
            return
        now = time.monotonic()
        for group, offsets in per_group.items():
            if offsets != self._group_seen.get(group):
                self._group_seen[group] = offsets
                self._group_progress[group] = now
        for writer in pending:
            c = min(offsets.get(writer, 0) for offsets in per_group.values())
            produced = self.ledger.last_offset.get(writer)
            if produced is not None:
                metrics.WRITER_LAG.labels(*writer).set(max(produced + 1 - c, 0))
            if c > 0:
                flushed = self.alignments[writer].aligned(c - 1)
                if flushed is not None:
                    self.tracker.handle_flush_notification(writer, flushed, now)
        self._check_stalls(now, per_group)

    def _check_stalls(self, now: float, per_group: dict[str, dict[Writer, int]]) -> None:
        """A group is stalled when writers wait on it and it has committed
        nothing new for ``[ack] stall_timeout``. Default: keep holding WAL and
        say so; ``on_stall = "drop"``: stop waiting for that group."""
        timeout = self.config.ack.stall_timeout
        stalled_writers = self.tracker.stalled_writers(now, timeout)
        self.stalled_writers = stalled_writers
        if not stalled_writers:
            self.stalled_groups = []
            return
        lowest = {w: min(o.get(w, 0) for o in per_group.values()) for w in stalled_writers}
        stalled = [g for g, offsets in per_group.items()
                   if now - self._group_progress.get(g, now) >= timeout
                   and any(offsets.get(w, 0) <= lowest[w] for w in stalled_writers)]
        for group in stalled:
            if group not in self.stalled_groups:
                log.warning("consumer group %s is stalled: no commit progress for %.0fs on %d writer(s) "
                            "(e.g. %s[%d]); WAL is held for it", group, timeout, len(stalled_writers),
                            *stalled_writers[0])
        self.stalled_groups = stalled
        if self.config.ack.on_stall == "drop" and stalled:
            for group in stalled:
                log.error("[ack] on_stall = \"drop\": no longer waiting for consumer group %s; changes it has "
                          "not committed may be released from WAL", group)
                self.ack_groups.remove(group)
                self._group_progress.pop(group, None)
            self.stalled_groups = []
            if self.ack_groups:
                for w in stalled_writers:
                    self.tracker.touch(w, now)
            else:
                # No group left to wait for: what the broker holds is flushed. Every
                # recorded boundary is in Kafka (delivered, or found there on restart).
                for writer in list(self.tracker.pending()):
                    flushed = self.alignments[writer].aligned(_ANY_OFFSET)
                    if flushed is not None:
                        self.tracker.handle_flush_notification(writer, flushed, now)

    def _rebuild_ack_state(self) -> None:
        """After a restart: index, per writer, the offsets of transactions that
        are in Kafka but not yet committed by every group, so replayed
        transactions are tracked against the right offsets."""
        if not self.ack_groups:
            return
        committed = self.committed_offsets(self.writers())
        self.replayed_offsets = read_positions(self._kafka_conf, committed)

    # ---------------------------------------------------- replication upkeep
    def _on_keepalive(self, ka: Keepalive) -> None:
        if self._tx is None and self.tracker.empty() and self.ledger.in_flight() == 0:
            # Nothing of ours is pending: everything up to the server's WAL end
            # has been seen and needs nothing from us.
            self._confirm(ka.wal_end)
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
        idle = self._tx is None and self.tracker.empty() and self.ledger.in_flight() == 0
        self.repl.send_status(flush_lsn=self._confirm_lsn or None, reply=idle)
        self._last_status = time.monotonic()

    # -------------------------------------------------------------- snapshot
    def take_snapshot(self, lsn: int, snapshot_name: str) -> None:
        cfg = self.config
        snapshot_id = f"{cfg.source.slot}@{pgoutput.lsn_to_str(lsn)}"
        now_ms = int(time.time() * 1000)
        plans: dict[str, RelationPlan] = {}
        work = []
        for qualified, table in self.tables.items():
            rel = Relation(table.oid, table.schema, table.name, table.replica_identity, tuple(
                pgoutput.Column(c.name, c.type_oid, c.typmod, c.name in table.primary_key) for c in table.columns))
            plans[qualified] = plan = self._plan_relation(rel)
            work.append((table, tuple(plan.names), relpages(self.catalog_conn, table)))
        total = sum(self._row_estimate(t) for t in self.tables.values())
        self.snapshot_progress = {"id": snapshot_id, "rows": 0, "total_estimate": total, "started": time.time(),
                                  "done": False}
        sources = {route.name: route.codec.source_bytes(lsn, None, now_ms, True, snapshot_id)
                   for plan in plans.values() for route in plan.routes}
        snap_header = (wire.SNAPSHOT_HEADER, snapshot_id.encode())
        pos_header = (wire.POSITION_HEADER, wire.position_header(lsn, 0))
        started = time.monotonic()

        def emit(table: TableInfo, rows: list) -> None:
            plan = plans[table.qualified]
            for raw in rows:
                values, _ = plan.load(raw)
                row = plan.as_row(values) if plan.filtered else None
                for route in plan.routes:
                    if route.row_filter is None or route.row_filter.matches(row):
                        self._send_read(route, values, sources[route.name], now_ms, [pos_header, snap_header],
                                        self.stats.snapshot_rows)
                self.stats.snapshot_rows += 1
            self.snapshot_progress["rows"] = self.stats.snapshot_rows
            metrics.SNAPSHOT_ROWS.inc(len(rows))
            self.kafka.poll(0)
            if time.monotonic() - self._last_status >= STATUS_INTERVAL:
                self._last_status = time.monotonic()
                self._publish_status()
            if self.ledger.error is not None:
                raise KafkaException(self.ledger.error)

        pieces = plan_pieces(work, cfg.source.snapshot_workers)
        rows = run_snapshot(cfg.source.dsn, snapshot_name, pieces, cfg.source.snapshot_workers, emit)
        self._flush_all()
        info = f'{{"snapshot_id": "{snapshot_id}", "lsn": {lsn}, "rows": {rows}}}'.encode()
        for writer in self.writers():
            self._send(writer, None, None, [pos_header, snap_header, (wire.CONTROL_HEADER, wire.SNAPSHOT_END.encode()),
                                            (wire.CONTROL_INFO_HEADER, info)])
        self._flush_all()
        self.snapshot_progress.update(rows=rows, done=True, finished=time.time())
        log.info("snapshot %s done: %d rows in %.1fs", snapshot_id, rows, time.monotonic() - started)

    def _send_read(self, route, values: tuple, source, now_ms: int, headers: list, seq: int) -> None:
        """One snapshot or backfill read (op ``r``) on its key's partition;
        keyless rows are spread by ``seq``."""
        codec = route.codec
        key_body = codec.encode_key(b"", values)
        partition = partition_for(key_body, seq, self.partitions[route.topic])
        value = codec.encode_change(codec.value_prefix, "r", None, values, source, 0, now_ms)
        key = codec.key_prefix + key_body if key_body is not None else None
        self._send((route.topic, partition), key, value, headers)
        self.stats.events[(route.name, "r")] += 1

    # ------------------------------------------------------------- backfills
    def _load_backfill_requests(self, new_topics: set[str]) -> None:
        """Requests not done yet are (re)started; shapes whose topics are new get one."""
        states, end = read_states(self._kafka_conf, self.backfills_topic)
        self.backfill_requests = states
        shapes = {s.shape_name: s for s in self.config.shapes}
        for record in sorted(states.values(), key=lambda r: r.get("requested_at", 0)):
            if record["state"] in ("requested", "running"):
                if record["shape"] not in shapes:
                    self._set_state(record, "failed", error=f"shape {record['shape']!r} is not in the config")
                    continue
                self._backfill_queue.append(record)
        if self.config.backfill.new_shapes == "backfill":
            requested = {r["shape"] for r in states.values()}
            for shape in self.config.shapes:
                if self.config.topic(shape) in new_topics and shape.shape_name not in requested:
                    log.info("shape %s is new (its topic holds nothing): backfilling it", shape.shape_name)
                    record = {"request_id": f"new-shape-{shape.shape_name}-{int(time.time())}",
                              "shape": shape.shape_name, "scope": None, "reason": "new shape",
                              "state": "requested", "requested_at": time.time()}
                    self._set_state(record, "requested")
                    self._backfill_queue.append(record)
        consumer = scan_consumer(self._kafka_conf, "backfill-requests")
        consumer.assign([TopicPartition(self.backfills_topic, 0, end)])
        self._requests_consumer = consumer

    def _poll_backfill_requests(self) -> None:
        """New requests (``walbridge backfill``/``reconcile``) from the requests topic."""
        while self._requests_consumer is not None:
            msg = self._requests_consumer.poll(0)
            if msg is None or msg.error():
                break
            try:
                record = json.loads(msg.value())
                rid = record["request_id"]
            except (TypeError, ValueError, KeyError):
                continue
            known = rid in self.backfill_requests
            self.backfill_requests[rid] = record
            if record.get("state") == "requested" and not known:
                log.info("backfill of shape %s requested (%s)", record["shape"], rid)
                self._backfill_queue.append(record)
        if self._backfill is None and self._backfill_queue:
            self._start_backfill(self._backfill_queue.pop(0))

    def _set_state(self, record: dict, state: str, **extra) -> None:
        record = {**record, **extra, "state": state, "updated_at": time.time()}
        self.backfill_requests[record["request_id"]] = record
        publish_state(self.kafka, self.backfills_topic, record)

    def _start_backfill(self, request: dict) -> None:
        shape = next((s for s in self.config.shapes if s.shape_name == request["shape"]), None)
        if shape is None:
            self._set_state(request, "failed", error=f"shape {request['shape']!r} is not in the config")
            return
        table = self.tables[shape.table]
        rel = Relation(table.oid, table.schema, table.name, table.replica_identity, tuple(
            pgoutput.Column(c.name, c.type_oid, c.typmod, c.name in table.primary_key) for c in table.columns))
        plan = self._plan_relation(rel)
        route = next(r for r in plan.routes if r.name == shape.shape_name)
        scope = request.get("scope")
        reader = backfill.SnapshotReader(self.config.source.dsn, backfill.temp_slot_name(self.config.source.slot),
                                         backfill.backfill_query(table, tuple(plan.names), scope),
                                         self.config.backfill.chunk_rows)
        estimate = self._row_estimate(table)
        if scope:
            estimate = estimate * len(scope["buckets"]) // max(int(scope["bucket_count"]), 1)
        self._backfill = backfill.Backfill(request, table, route, plan, reader, estimate)
        reader.start()
        self._set_state(request, "running", started_at=time.time())
        log.info("backfill of shape %s started (%s, %s)", shape.shape_name, request["request_id"],
                 f"{len(scope['buckets'])} of {scope['bucket_count']} key buckets" if scope else "whole shape")

    def _backfill_tick(self, idle: bool) -> bool:
        """One step of the running backfill, if it is its turn: a chunk of rows,
        or its ``backfill_end`` events, or noticing they were delivered.
        Returns whether there is more to do at once."""
        bf = self._backfill
        now = time.monotonic()
        if bf.end_counts:
            delivered = all(self.ledger.delivered.get(w, 0) >= n for w, n in bf.end_counts.items())
            if delivered:
                self._finish_backfill(bf)
            return False
        if not idle and now - bf.last_chunk < self.config.backfill.force_after:
            return False
        try:
            chunk = bf.reader.take()
        except psycopg.OperationalError:
            raise  # connection trouble: the pipeline restarts, and so does the backfill
        except psycopg.Error as e:
            log.error("backfill %s of shape %s failed: %s", bf.request["request_id"], bf.shape, e)
            bf.reader.close()
            self._set_state(bf.request, "failed", error=str(e).strip())
            self._backfill = None
            return False
        if chunk is None and not bf.reader.finished:
            return False  # the reader is behind (or still creating its slot)
        lsn = bf.reader.lsn
        if not bf.backfill_id:
            bf.backfill_id = f"bf:{bf.request['request_id']}@{pgoutput.lsn_to_str(lsn)}"
            bf.source = bf.route.codec.source_bytes(lsn, None, int(time.time() * 1000), "incremental",
                                                    bf.backfill_id)
            bf.headers = [(wire.POSITION_HEADER, wire.position_header(lsn, 0)),
                          (wire.SNAPSHOT_HEADER, bf.backfill_id.encode()),
                          (wire.BACKFILL_HEADER, bf.backfill_id.encode())]
        bf.last_chunk = now
        if chunk is not None:
            plan, route = bf.plan, bf.route
            now_ms = int(time.time() * 1000)
            for raw in chunk:
                values, _ = plan.load(raw)
                if route.row_filter is None or route.row_filter.matches(plan.as_row(values)):
                    self._send_read(route, values, bf.source, now_ms, bf.headers, bf.sent)
                    bf.sent += 1
            bf.rows += len(chunk)
            metrics.SNAPSHOT_ROWS.inc(len(chunk))
            return True
        # Every read is produced: end the backfill on every partition, after its reads.
        topic = bf.route.topic
        info = json.dumps({"backfill_id": bf.backfill_id, "shape": bf.shape, "lsn": lsn,
                           "partitions": self.partitions[topic], "rows": bf.sent,
                           "scope": bf.request.get("scope")}).encode()
        headers = bf.headers + [(wire.CONTROL_HEADER, wire.BACKFILL_END.encode()), (wire.CONTROL_INFO_HEADER, info)]
        for p in range(self.partitions[topic]):
            self._send((topic, p), None, None, headers)
        bf.end_counts = {(topic, p): self.ledger.produced[(topic, p)] for p in range(self.partitions[topic])}
        return False

    def _finish_backfill(self, bf: backfill.Backfill) -> None:
        bf.finished = time.time()
        bf.reader.close()
        done = {**bf.progress(), "state": "done", "finished": bf.finished}
        self.backfills_done = (self.backfills_done + [done])[-10:]
        self._set_state(bf.request, "done", backfill_id=bf.backfill_id, lsn=bf.reader.lsn, rows=bf.sent,
                        read=bf.rows, finished_at=bf.finished)
        log.info("backfill %s of shape %s done: %d rows read, %d produced in %.1fs", bf.backfill_id, bf.shape,
                 bf.rows, bf.sent, bf.finished - bf.started)
        self._backfill = None
        if self._backfill_queue:
            self._start_backfill(self._backfill_queue.pop(0))

    # ---------------------------------------------------------------- status
    def status_view(self) -> dict:
        """The producer's own view, for ``walbridge status``, ``up`` and metrics."""

        def name(w: Writer) -> str:
            return f"{w[0]}[{w[1]}]"

        events: dict[str, dict[str, int]] = defaultdict(dict)
        for (shape, op), n in self.stats.events.items():
            events[shape][op] = n
        return {
            "ts": time.time(),
            "slot": self.config.source.slot,
            "confirmed_lsn": pgoutput.lsn_to_str(self._confirm_lsn) if self._confirm_lsn else None,
            "last_seen": list(self.tracker.last_seen),
            "pending": {name(w): {"last_sent": list(s), "last_flushed": list(f)}
                        for w, (s, f) in self.tracker.pending().items()},
            "produced": {name(w): o + 1 for w, o in self.ledger.last_offset.items()},
            "ack_groups": list(self.ack_groups),
            "stalled_writers": [name(w) for w in self.stalled_writers],
            "stalled_groups": list(self.stalled_groups),
            "events": dict(events),
            "transactions": self.stats.transactions,
            "skipped_replayed": self.stats.skipped_replayed,
            "snapshot": dict(self.snapshot_progress),
            "backfill": self._backfill.progress() if self._backfill is not None else None,
            "backfills_queued": [{"request_id": r["request_id"], "shape": r["shape"]} for r in self._backfill_queue],
            "backfills_done": list(self.backfills_done),
        }

    def _publish_status(self) -> None:
        view = self.status_view()
        self._sync_metrics(view)
        if self._on_status is not None:
            self._on_status(view)
        try:
            self.kafka.produce(self.status_topic, json.dumps(view).encode(), b"producer")
        except BufferError:
            pass  # status is best effort; data is not

    def _sync_metrics(self, view: dict) -> None:
        for key, n in self.stats.events.items():
            delta = n - self._metric_events.get(key, 0)
            if delta:
                metrics.EVENTS.labels(*key).inc(delta)
                self._metric_events[key] = n
        metrics.TRANSACTIONS.inc(self.stats.transactions - self._metric_tx)
        self._metric_tx = self.stats.transactions
        metrics.CONFIRMED_LSN.set(self._confirm_lsn)
        metrics.STALLED_WRITERS.set(len(self.stalled_writers))
        metrics.STALLED_GROUPS.set(len(self.stalled_groups))
        if self.snapshot_progress:
            metrics.SNAPSHOT_PROGRESS.set(self.snapshot_progress.get("rows", 0))
            metrics.SNAPSHOT_TOTAL.set(self.snapshot_progress.get("total_estimate", 0))
        now = time.monotonic()
        if now - self._last_slot_read >= 10:  # retained WAL: a cheap catalog read, not every second
            self._last_slot_read = now
            try:
                state = catalog.slot_state(self.catalog_conn, self.config.source.slot)
                if state and state["retained_wal_bytes"] is not None:
                    metrics.RETAINED_WAL.set(state["retained_wal_bytes"])
            except psycopg.Error:
                pass

    def _row_estimate(self, table: TableInfo) -> int:
        """Rows to expect: the planner's estimate, or a count for small
        never-analysed tables (progress and ETA only)."""
        reltuples, size = self.catalog_conn.execute(
            "SELECT reltuples::bigint, pg_relation_size(oid) FROM pg_class WHERE oid = %s", (table.oid,)).fetchone()
        if reltuples >= 0:
            return reltuples
        if size < 64 * 1024 * 1024:
            return self.catalog_conn.execute(
                sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table.schema, table.name))).fetchone()[0]
        return size // 100

    def _flush_all(self) -> None:
        """Wait for every produced message's delivery report. Bounded: a message
        is delivered or fails within ``message.timeout.ms``; a failure raises."""
        while self.kafka.flush(1.0):
            if self.ledger.error is not None:
                break
            self._keep_stream_alive()
        if self.ledger.error is not None:
            raise KafkaException(self.ledger.error)
        self._take_boundaries()


def run_producer(config: Config, stop: threading.Event | None = None,
                 on_status: Callable[[dict], None] | None = None) -> None:
    """Run until ``stop`` is set, reconnecting with exponential backoff after lost
    connections; every restart resumes from the slot and the partition tails."""
    stop = stop or threading.Event()
    backoff = 0.5
    while not stop.is_set():
        pipeline = Pipeline(config, stop, on_status)
        try:
            pipeline.run()
            return
        except (psycopg.OperationalError, ReplicationError, KafkaException) as e:
            first_line = (str(e).strip().splitlines() or [""])[0]
            log.warning("connection lost (%s: %s); reconnecting to %s in %.1fs", type(e).__name__, first_line,
                        redact_dsn(config.source.dsn), backoff)
        finally:
            pipeline.close()
        if stop.wait(backoff):
            return
        backoff = min(backoff * 2, config.source.reconnect_max_backoff)
