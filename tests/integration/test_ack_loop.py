"""The loop: consumer-group commits → FlushTracker → confirmed_flush_lsn.

A plain confluent-kafka consumer committing offsets stands in for the Spark
consumer here."""

from __future__ import annotations

import time

import psycopg
from confluent_kafka import Consumer, TopicPartition

from producer.pgoutput import lsn_to_int
from schemas import wire
from schemas.kafka import group_offsets
from tests.helpers import ConsumerThread, ProducerProcess, ProducerThread, make_config, wait_for, write_toml


def slot_lsns(dsn: str, slot: str) -> tuple[int, int]:
    """(confirmed_flush_lsn, retained WAL bytes) of the slot."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT confirmed_flush_lsn::text, pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)"
                           " FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone()
    return lsn_to_int(row[0]), int(row[1])


def current_lsn(conn) -> int:
    """Past every commit made so far on ``conn``, and written. The test servers
    commit with synchronous_commit off, so a commit's record may not be written
    yet when it returns: a keepalive may then rightly confirm WAL up to the
    write position before it. A synchronous commit flushes everything before
    it, but only for a transaction that wrote WAL before its commit record
    (PostgreSQL commits one that did not asynchronously, xid or not): a
    non-transactional logical message is that WAL (pgoutput passes messages
    on only when asked to)."""
    with conn.transaction():
        conn.execute("SET LOCAL synchronous_commit = on")
        conn.execute("SELECT pg_current_xact_id(), pg_logical_emit_message(false, 'walbridge-test', '')")
    return lsn_to_int(conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])


class GroupStandIn:
    """Consumes a topic in a consumer group and commits what it has read."""

    def __init__(self, bootstrap: str, group: str, topic: str, partitions: int = 3):
        self.consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False,
                                  "auto.offset.reset": "earliest"})
        self.topic = topic
        self.partitions = partitions
        self.consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        self.next: dict[int, int] = {}
        self.positions: dict[int, list[tuple[int, tuple[int, int]]]] = {p: [] for p in range(partitions)}

    def drain(self, timeout: float = 30.0) -> None:
        """Read everything the topic holds when called (without committing):
        up to each partition's end offset then (an end-of-partition event can
        be one from before the latest messages arrived)."""
        deadline = time.monotonic() + timeout
        ends = {p: self.consumer.get_watermark_offsets(TopicPartition(self.topic, p), timeout=timeout)[1]
                for p in range(self.partitions)}
        while any(self.next.get(p, 0) < end for p, end in ends.items()) and time.monotonic() < deadline:
            msg = self.consumer.poll(0.5)
            if msg is None or msg.error():
                continue
            self.next[msg.partition()] = msg.offset() + 1
            pos = wire.header(msg.headers(), wire.POSITION_HEADER)
            self.positions[msg.partition()].append((msg.offset(), wire.parse_position(pos)))

    def commit(self, upto: dict[int, int] | None = None) -> None:
        offsets = upto if upto is not None else self.next
        self.consumer.commit(offsets=[TopicPartition(self.topic, p, o) for p, o in offsets.items()],
                             asynchronous=False)

    def close(self) -> None:
        self.consumer.close()


def _setup(source_db):
    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE watched (id int PRIMARY KEY, v int)")
        conn.execute("CREATE TABLE unrelated (id serial PRIMARY KEY, pad text)")
        conn.execute("INSERT INTO watched SELECT g, 0 FROM generate_series(1, 10) g")


def _config(source_db, bootstrap, prefix, groups):
    return make_config(source_db, bootstrap, prefix, [{"table": "public.watched"}],
                       ack={"consumer_groups": groups, "interval": 0.2})


def test_group_not_committing_holds_the_slot_then_commits_release_it(source_db, kafka_broker, topic_prefix):
    _setup(source_db)
    group = f"{topic_prefix}-apply"
    cfg = _config(source_db, kafka_broker.bootstrap, topic_prefix, [group])
    slot = cfg["source"]["slot"]
    topic = f"{topic_prefix}.public.watched"
    stand_in = GroupStandIn(kafka_broker.bootstrap, group, topic)
    with ProducerThread(cfg), psycopg.connect(source_db, autocommit=True) as conn:
        wait_for(lambda: conn.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s AND active",
                                      (slot,)).fetchone(), what="slot active")
        before_change = current_lsn(conn)
        conn.execute("UPDATE watched SET v = 1 WHERE id = 1")  # the first unapplied change

        def changes_after(lsn: int) -> list[int]:
            stand_in.drain(5)
            return [pos[0] for ps in stand_in.positions.values() for _, pos in ps if pos[0] > lsn]

        first_unapplied = min(wait_for(lambda: changes_after(before_change), what="v=1 in Kafka"))
        # (1) however much unrelated traffic flows and however long we wait, the
        # slot never passes the first unapplied change.
        for i in range(40):
            conn.execute("INSERT INTO unrelated (pad) SELECT repeat('u', 100) FROM generate_series(1, 200)")
            time.sleep(0.05)
            confirmed, _ = slot_lsns(source_db, slot)
            assert confirmed < first_unapplied, f"slot confirmed {confirmed} past unapplied {first_unapplied}"
        time.sleep(2.0)
        assert slot_lsns(source_db, slot)[0] < first_unapplied
        # (2) once the group commits, it advances to (at least) the last commit.
        conn.execute("UPDATE watched SET v = 2 WHERE id = 2")
        last_commit = current_lsn(conn)
        wait_for(lambda: (stand_in.drain(5) or True) and any(
            pos[0] >= last_commit - 200 for ps in stand_in.positions.values() for _, pos in ps), what="v=2 read")
        stand_in.commit()
        wait_for(lambda: slot_lsns(source_db, slot)[0] >= last_commit, timeout=30,
                 what="confirmed_flush_lsn reaching the last commit")
    stand_in.close()


def test_unrelated_traffic_only_keeps_the_slot_advancing(source_db, kafka_broker, topic_prefix):
    _setup(source_db)
    group = f"{topic_prefix}-apply"
    cfg = _config(source_db, kafka_broker.bootstrap, topic_prefix, [group])
    slot = cfg["source"]["slot"]
    with ProducerThread(cfg), psycopg.connect(source_db, autocommit=True) as conn:
        wait_for(lambda: conn.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s AND active",
                                      (slot,)).fetchone(), what="slot active")
        retained = []
        for round_ in range(6):
            for _ in range(10):
                conn.execute("INSERT INTO unrelated (pad) SELECT repeat('u', 500) FROM generate_series(1, 500)")
            mark = current_lsn(conn)
            conn.execute("CHECKPOINT")  # lets PostgreSQL recycle WAL the slot no longer needs
            wait_for(lambda: slot_lsns(source_db, slot)[0] >= mark, timeout=30, what="slot following unrelated WAL")
            retained.append(slot_lsns(source_db, slot)[1])
    # Bounded: retained WAL does not grow with the traffic (~2.5 MB per round).
    assert max(retained[2:]) < 8 * 1024 * 1024, retained


def test_kill9_with_uncommitted_messages_confirms_nothing_uncommitted(source_db, kafka_broker, topic_prefix,
                                                                      tmp_path):
    _setup(source_db)
    group = f"{topic_prefix}-apply"
    cfg = _config(source_db, kafka_broker.bootstrap, topic_prefix, [group])
    slot = cfg["source"]["slot"]
    topic = f"{topic_prefix}.public.watched"
    path = write_toml(cfg, tmp_path / "wb.toml")
    stand_in = GroupStandIn(kafka_broker.bootstrap, group, topic)
    proc = ProducerProcess(path, tmp_path / "producer.log").start()
    try:
        with psycopg.connect(source_db, autocommit=True) as conn:
            wait_for(lambda: conn.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s AND active",
                                          (slot,)).fetchone(), timeout=60, what="slot active")
            start = current_lsn(conn)
            for i in range(30):
                conn.execute("UPDATE watched SET v = v + 1 WHERE id = %s", (1 + i % 10,))
            wait_for(lambda: (stand_in.drain(5) or True) and sum(len(p) for p in stand_in.positions.values()) >= 40,
                     what="30 updates read")
            # The group commits only the first half of each partition's updates (a
            # partition may hold no key of the ten, hence no update).
            updates = {p: [(o, pos) for o, pos in msgs if pos[0] > start] for p, msgs in stand_in.positions.items()}
            upto = {p: msgs[len(msgs) // 2][0] for p, msgs in updates.items() if msgs}
            first_uncommitted = min(dict(msgs)[upto[p]][0] for p, msgs in updates.items() if msgs)
            stand_in.commit(upto)
            for i in range(30):  # more uncommitted changes in flight
                conn.execute("UPDATE watched SET v = v + 1 WHERE id = %s", (1 + i % 10,))
            time.sleep(1.0)
            proc.kill9()
            assert slot_lsns(source_db, slot)[0] < first_uncommitted
            proc = ProducerProcess(path, tmp_path / "producer.log").start()
            wait_for(lambda: conn.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s AND active",
                                          (slot,)).fetchone(), timeout=60, what="slot active again")
            for i in range(10):
                conn.execute("INSERT INTO unrelated (pad) VALUES ('x')")
                time.sleep(0.3)
                assert slot_lsns(source_db, slot)[0] < first_uncommitted
            # Committing the rest releases it all.
            stand_in.drain(5)
            stand_in.commit()
            last = current_lsn(conn)
            wait_for(lambda: slot_lsns(source_db, slot)[0] >= last, timeout=30, what="slot released after commit")
    finally:
        proc.stop()
        stand_in.close()


def test_spark_consumer_and_a_plain_group_release_wal_only_once_both_committed(source_db, target_db, kafka_broker,
                                                                              topic_prefix, tmp_path):
    """``[ack] consumer_groups`` names the Spark consumer's group and a plain
    Kafka consumer group: the Spark consumer applies a change and commits,
    yet the slot stays before it until the plain group commits it too."""
    _setup(source_db)
    spark_group, plain_group = f"{topic_prefix}-spark", f"{topic_prefix}-plain"
    cfg = make_config(source_db, kafka_broker.bootstrap, topic_prefix, [{"table": "public.watched"}],
                      consumer={"group": spark_group, "target_dsn": str(target_db),
                                "checkpoint_dir": str(tmp_path / "checkpoints"), "trigger_interval": 0.2},
                      ack={"consumer_groups": [spark_group, plain_group], "interval": 0.2})
    slot = cfg["source"]["slot"]
    topic = f"{topic_prefix}.public.watched"
    plain = GroupStandIn(kafka_broker.bootstrap, plain_group, topic)
    writers = [(topic, p) for p in range(3)]

    def applied(v: int) -> bool:
        with psycopg.connect(target_db) as t:
            try:
                return t.execute("SELECT v FROM public.watched WHERE id = 1").fetchone() == (v,)
            except psycopg.errors.UndefinedTable:
                return False

    with ProducerThread(cfg), ConsumerThread(cfg) as consumer, psycopg.connect(source_db, autocommit=True) as conn:
        wait_for(lambda: conn.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s AND active",
                                      (slot,)).fetchone(), what="slot active")
        before_change = current_lsn(conn)
        conn.execute("UPDATE watched SET v = 1 WHERE id = 1")
        wait_for(lambda: applied(1) or consumer.errors, timeout=180, what="the Spark consumer applying v = 1")
        assert not consumer.errors, consumer.errors
        plain.drain()
        change = min(pos[0] for ps in plain.positions.values() for _, pos in ps if pos[0] > before_change)
        # The Spark group has committed everything there is; the plain group nothing.
        wait_for(lambda: group_offsets({"bootstrap.servers": kafka_broker.bootstrap}, [spark_group], writers)[spark_group] == {
            (topic, p): n for p, n in plain.next.items()} | {w: 0 for w in writers if w[1] not in plain.next},
            timeout=60, what="the Spark group's offsets at the topic's end")
        for _ in range(10):  # ten ack intervals
            time.sleep(0.2)
            assert slot_lsns(source_db, slot)[0] < change, "confirmed a change the plain group has not committed"
        plain.commit()
        wait_for(lambda: slot_lsns(source_db, slot)[0] >= change, timeout=30,
                 what="the slot passing the change once both groups committed it")
    plain.close()
    assert not consumer.errors


def test_stalled_group_is_reported_and_held_then_dropped_on_request(source_db, kafka_broker, topic_prefix, caplog):
    import json as _json

    from schemas.config import parse_config
    from walbridge.status import collect_status

    _setup(source_db)
    group = f"{topic_prefix}-stuck"
    cfg = make_config(source_db, kafka_broker.bootstrap, topic_prefix, [{"table": "public.watched"}],
                      ack={"consumer_groups": [group], "interval": 0.2, "stall_timeout": 1.5})
    slot = cfg["source"]["slot"]
    with ProducerThread(cfg), psycopg.connect(source_db, autocommit=True) as conn:
        wait_for(lambda: conn.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s AND active",
                                      (slot,)).fetchone(), what="slot active")
        before = current_lsn(conn)
        conn.execute("UPDATE watched SET v = 1 WHERE id = 1")
        wait_for(lambda: "consumer group " + group + " is stalled" in caplog.text, timeout=20, what="stall log line")
        status = wait_for(lambda: (lambda s: s if s["producer"] and s["producer"]["stalled_groups"] else None)(
            collect_status(parse_config(cfg))), timeout=10, what="stall in status")
        assert status["producer"]["stalled_groups"] == [group]
        assert any(w["stalled"] for w in status["writers"])
        assert _json.dumps(status, default=str)  # --json renders
        conn.execute("INSERT INTO unrelated (pad) VALUES ('x')")
        time.sleep(1.0)
        assert slot_lsns(source_db, slot)[0] <= before  # default policy: hold WAL
    # on_stall = "drop": stop waiting for the group, loudly, and release WAL.
    cfg["ack"]["on_stall"] = "drop"
    with ProducerThread(cfg), psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute("UPDATE watched SET v = 2 WHERE id = 2")
        wait_for(lambda: "no longer waiting for consumer group " + group in caplog.text, timeout=20,
                 what="drop log line")
        last = current_lsn(conn)
        wait_for(lambda: slot_lsns(source_db, slot)[0] >= last, timeout=20, what="WAL released after drop")


def test_keepalives_answered_while_the_group_stalls(source_db, kafka_broker, topic_prefix, pg_cluster, caplog):
    """With wal_sender_timeout at 2 s and a group that never commits, the
    replication connection survives (same walsender, no reconnect) for many
    timeouts, and the slot stays held."""
    _setup(source_db)
    group = f"{topic_prefix}-never"
    cfg = _config(source_db, kafka_broker.bootstrap, topic_prefix, [group])
    slot = cfg["source"]["slot"]
    admin_dsn = pg_cluster.dsn("postgres")
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        admin.execute("ALTER SYSTEM SET wal_sender_timeout = '2s'")
        admin.execute("SELECT pg_reload_conf()")
    try:
        with ProducerThread(cfg), psycopg.connect(source_db, autocommit=True) as conn:
            pid = wait_for(lambda: conn.execute("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s"
                                                " AND active", (slot,)).fetchone(), what="slot active")[0]
            # Everything before the UPDATE may still be confirmed (an idle
            # keepalive in flight); the UPDATE itself never, as no group commits it.
            held_at = current_lsn(conn)
            conn.execute("UPDATE watched SET v = 1 WHERE id = 1")
            deadline = time.monotonic() + 8  # four wal_sender_timeouts
            while time.monotonic() < deadline:
                assert slot_lsns(source_db, slot)[0] <= held_at
                time.sleep(0.5)
            assert conn.execute("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s",
                                (slot,)).fetchone()[0] == pid
        assert "connection lost" not in caplog.text
    finally:
        with psycopg.connect(admin_dsn, autocommit=True) as admin:
            admin.execute("ALTER SYSTEM RESET wal_sender_timeout")
            admin.execute("SELECT pg_reload_conf()")
