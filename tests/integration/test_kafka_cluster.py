"""A three-broker Apache Kafka cluster under the pipeline (issue 29): KRaft,
three combined nodes on loopback ports of their own, every topic replicated
three times with ``min.insync.replicas=2`` (the cluster's defaults, which
walbridge's topic creation follows), the producer idempotent with ``acks=all``.

While pgbench runs on the 5-shape pgbench set, the brokers are hurt in turn:
the leader of the most partitions killed with -9 (twice), a rolling restart of
all three, then two of three down for 30 s (no quorum: nothing can be written,
the producer waits) and back. Afterwards the target equals the source row by
row, no streamed insert was applied twice, the slot is confirmed to the last
change, and no walbridge process ended by itself."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import psycopg
import pytest
from confluent_kafka.admin import AdminClient

from tests.helpers import ConsumerProcess, ProducerProcess, stacks_on_failure, wait_for, write_toml
from tests.pipeline import FEW_ACCOUNTS, caught_up, e2e_config, pgbench, pipeline_state, prepare_source, verify_ok
from walbridge.embedded import KafkaCluster

OUTAGE_S = 30
# A restarted node registers once the quorum has settled: on a loaded disk its
# re-elections (slow durable writes) took longer than a node's own 90 s once.
RESTART_S = 180


@pytest.fixture
def cluster(tmp_path: Path):
    with KafkaCluster(tmp_path / "kafka", size=3, extra_config={"min.insync.replicas": "2"}) as cluster:
        yield cluster


def _topics(admin: AdminClient, prefix: str) -> dict:
    return {name: t for name, t in admin.list_topics(timeout=10).topics.items() if name.startswith(prefix)}


def _busiest_leader(admin: AdminClient, prefix: str) -> int:
    leaders = Counter(p.leader for t in _topics(admin, prefix).values() for p in t.partitions.values())
    return leaders.most_common(1)[0][0]


def _led_without(admin: AdminClient, prefix: str, node_id: int) -> bool:
    try:
        topics = _topics(admin, prefix)
    except Exception:  # metadata from a node that is going: ask again
        return False
    return all(p.leader not in (node_id, -1) for t in topics.values() for p in t.partitions.values())


def _fully_replicated(admin: AdminClient, prefix: str) -> bool:
    try:
        topics = _topics(admin, prefix)
    except Exception:  # a broker on its way back: ask again
        return False
    return bool(topics) and all(len(p.isrs) == 3 for t in topics.values() for p in t.partitions.values())


def test_three_brokers_killed_restarted_and_without_quorum_lose_and_double_nothing(
        source_db, target_db, cluster, topic_prefix, tmp_path):
    prepare_source(source_db, FEW_ACCOUNTS)
    cfg = e2e_config(source_db, target_db, cluster.bootstrap, topic_prefix, tmp_path)
    cfg["consumer"]["max_offsets_per_trigger"] = 20000
    path = write_toml(cfg, tmp_path / "wb.toml")
    admin = AdminClient({"bootstrap.servers": cluster.bootstrap})
    done = threading.Event()

    def load():
        try:
            while not done.is_set():
                pgbench(source_db, "-n", "-c", "2", "-T", "5", "-R", "50", accounts=FEW_ACCOUNTS)
        finally:
            done.set()

    with ProducerProcess(path, tmp_path / "producer.log") as producer, \
            ConsumerProcess(path, tmp_path / "consumer.log") as consumer, stacks_on_failure(producer, consumer):
        wait_for(lambda: verify_ok(cfg)[0], timeout=300, interval=2, what="the snapshot applied",
                 explain=lambda: pipeline_state(cfg))
        topics = _topics(admin, topic_prefix)
        assert topics and all(len(p.replicas) == 3 for t in topics.values() for p in t.partitions.values())
        loader = threading.Thread(target=load, daemon=True)
        loader.start()

        for _ in range(2):
            victim = cluster.node(_busiest_leader(admin, topic_prefix))
            victim.kill()
            wait_for(lambda: _led_without(admin, topic_prefix, victim.node_id), timeout=120, interval=0.5,
                     what=f"every partition led by a node other than {victim.node_id}")
            victim.start(RESTART_S)
            wait_for(lambda: _fully_replicated(admin, topic_prefix), timeout=180, interval=1,
                     what=f"node {victim.node_id} back in every ISR")

        for node in cluster.nodes:  # rolling restart
            node.restart(RESTART_S)
            wait_for(lambda: _fully_replicated(admin, topic_prefix), timeout=180, interval=1,
                     what=f"node {node.node_id} back in every ISR after its restart")

        down = cluster.nodes[1:]
        for node in down:
            node.stop()
        time.sleep(OUTAGE_S)  # the outage itself is the fault being tested
        for node in down:
            node.start(wait=False)
        for node in down:
            node.wait_ready(RESTART_S)
        wait_for(lambda: _fully_replicated(admin, topic_prefix), timeout=180, interval=1,
                 what="every ISR whole again after the outage")

        done.set()
        loader.join(60)
        ok = wait_for(lambda: verify_ok(cfg)[0], timeout=420, interval=2, what="target == source",
                      explain=lambda: pipeline_state(cfg))
        assert ok is True, verify_ok(cfg)[1]
        wait_for(lambda: caught_up(cfg), timeout=120, what="confirmed_flush_lsn at the last commit")
        assert producer.proc.poll() is None, "the producer ended by itself"
        assert consumer.proc.poll() is None, "the consumer ended by itself"

    with psycopg.connect(target_db) as conn:
        # Keyless: each streamed insert applied once (snapshot rows share the snapshot's position).
        history = conn.execute("SELECT count(*), count(DISTINCT (_wb_lsn, _wb_op_index)) FROM public.pgbench_history"
                               " WHERE _wb_snapshot_id IS NULL").fetchone()
    assert history[0] == history[1] > 0
