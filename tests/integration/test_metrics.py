"""Prometheus metrics of the producer, scraped over HTTP."""

from __future__ import annotations

import urllib.request

import psycopg

from tests.helpers import ProducerThread, make_config, wait_for
from walbridge.embedded import free_port


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def _value(text: str, name: str, labels: str = "") -> float | None:
    for line in text.splitlines():
        if line.startswith(name + (("{" + labels) if labels else " ")) or (
                not labels and line.startswith(name + "{")):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_producer_metrics_show_events_snapshot_and_confirmed_lsn(source_db, kafka_broker, topic_prefix):
    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE m (id int PRIMARY KEY)")
        conn.execute("INSERT INTO m SELECT generate_series(1, 50)")
    port = free_port()
    cfg = make_config(source_db, kafka_broker.bootstrap, topic_prefix, [{"table": "public.m", "name": "m_shape"}],
                      metrics={"port": port})
    with ProducerThread(cfg), psycopg.connect(source_db, autocommit=True) as conn:
        wait_for(lambda: conn.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s AND active",
                                      (cfg["source"]["slot"],)).fetchone(), what="slot")
        conn.execute("INSERT INTO m VALUES (51), (52)")
        text = wait_for(lambda: (lambda t: t if (_value(t, "walbridge_events_total", 'op="c",shape="m_shape"') or 0)
                                 >= 2 else None)(_scrape(port)), timeout=30, what="events metric")
    assert _value(text, "walbridge_events_total", 'op="r",shape="m_shape"') >= 50
    assert _value(text, "walbridge_confirmed_lsn") > 0
    assert _value(text, "walbridge_snapshot_rows_read") >= 50
    assert "walbridge_stalled_groups" in text
    count = _value(text, "walbridge_produce_latency_seconds_count")
    assert count >= 1 and 0 < _value(text, "walbridge_produce_latency_seconds_sum") / count < 30
    assert _value(text, "walbridge_produce_latency_seconds_bucket", 'le="+Inf"') == count
    assert 0 <= _value(text, "walbridge_source_lag_seconds") < 30
    assert _value(text, "walbridge_build_info") == 1.0 and 'version="' in text
