"""A consumer group's commit made for a topic before it was re-created (a
retried or in-flight commit landing after the broker lost the topic) is not
progress on the new topic: the producer neither confirms WAL past what the
group really read nor marks the re-done snapshot read (issue 16).

The race is made deterministic: the old offsets are committed by hand onto the
re-created topic, with no topic id in their metadata (as another tool would
commit), so the sign here is the offset beyond the partition's end; the
topic-id metadata is unit-tested."""

from __future__ import annotations

import logging
import time

import psycopg

from tests.helpers import ProducerThread, make_config, read_topic, wait_for
from tests.integration.test_ack_loop import GroupStandIn, current_lsn, slot_lsns


def test_old_offsets_committed_on_a_recreated_topic_release_nothing(source_db, private_kafka_broker, topic_prefix,
                                                                    caplog):
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.DEBUG, logger="walbridge.producer")  # the acks' decisions, if it fails
    broker = private_kafka_broker
    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, v int)")
        conn.execute("INSERT INTO t SELECT g, 0 FROM generate_series(1, 300) g")
    group = f"{topic_prefix}-apply"
    cfg = make_config(source_db, broker.bootstrap, topic_prefix, [{"table": "public.t"}],
                      ack={"consumer_groups": [group], "interval": 0.2})
    slot, topic = cfg["source"]["slot"], f"{topic_prefix}.public.t"

    def snapshot_ids():
        try:
            return {r.headers["wb.snapshot"] for r in read_topic(broker.bootstrap, topic, topic_prefix, timeout=20)
                    if r.control == "snapshot_end"}
        except Exception:  # topic not there (yet)
            return set()

    with ProducerThread(cfg), psycopg.connect(source_db, autocommit=True) as conn:
        first = wait_for(lambda: snapshot_ids(), what="first snapshot")
        for i in range(1, 4):
            conn.execute("UPDATE t SET v = %s", (i,))
        old = GroupStandIn(broker.bootstrap, group, topic)
        wait_for(lambda: (old.drain(5) or True) and sum(old.next.values()) >= 1200, what="the updates in Kafka")
        old_ends = dict(old.next)
        old.close()

        broker.lose_data()  # the topic is lost; the producer re-creates it and redoes the snapshot
        wait_for(lambda: snapshot_ids() - first, timeout=120, what="snapshot redone")
        # Streaming on the new slot: the redone snapshot is complete in the checkpoint, so a run that
        # fails from here on resumes the slot (one failing earlier would make a new slot, which may
        # start after the UPDATE below and rightly confirm it: its snapshot holds the UPDATE).
        wait_for(lambda: caplog.text.count("streaming from slot") >= 2
                 and caplog.text.rindex("streaming from slot") > caplog.text.rindex("created slot"),
                 timeout=60, what="streaming on the new slot")
        stale = GroupStandIn(broker.bootstrap, group, topic)
        stale.commit(old_ends)  # the old incarnation's offsets, landing on the new topic
        stale.close()
        conn.execute("UPDATE t SET v = 100 WHERE id = 1")
        change = current_lsn(conn)
        time.sleep(7.0)  # > [ack] interval and the checkpoint's 5 s look at the groups
        history = "\n".join(ln for ln in caplog.text.splitlines() if any(w in ln for w in (
            "created slot", "redoing", "streaming from", "reconnecting", "nothing pending", "no writer to wait for",
            "the groups committed")))
        assert slot_lsns(source_db, slot)[0] < change, (
            f"WAL confirmed on the strength of a stale commit (the UPDATE ends at {change:X}):\n{history}")
        assert "every consumer group has read snapshot" not in caplog.text  # nor the first: nothing was committed
        assert "beyond the partition's end" in caplog.text

        # What the group really reads of the new topic is trusted as before.
        real = GroupStandIn(broker.bootstrap, group, topic)
        wait_for(lambda: (real.drain(5) or True) and any(
            pos[0] >= change - 200 for ps in real.positions.values() for _, pos in ps), what="v=100 read")
        real.commit()
        real.close()
        wait_for(lambda: slot_lsns(source_db, slot)[0] >= change, timeout=30, what="confirmed after a real commit")
        wait_for(lambda: "every consumer group has read snapshot" in caplog.text, timeout=30,
                 what="the snapshot marked read after a real commit")
