"""`walbridge up` headless on the embedded default: data flows end to end and
the view shows the real numbers."""

from __future__ import annotations

import io
import shutil
import tempfile
from pathlib import Path

from rich.console import Console

from tests.helpers import data_records, read_topic
from walbridge.up import DEMO_SHAPES, run_up


def test_up_headless_flows_and_shows_real_numbers(capfd):
    base = Path(tempfile.mkdtemp(prefix="wb-up-test-"))
    console = Console(record=True, width=140, file=io.StringIO())
    in_topics: dict[str, int] = {}

    def count_topics(config):
        for shape in config.shapes:
            in_topics[shape.shape_name] = len(data_records(read_topic(
                config.kafka.bootstrap_servers, config.topic(shape), config.kafka.topic_prefix)))

    try:
        last = run_up(None, base, duration=25, rate=25, headless=True, console=console, before_stop=count_topics)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    text = console.export_text()
    # Every Kafka client logs through Python logging (to the log file while the
    # view owns the terminal) and stops before the broker: nothing raw follows the view.
    out, err = capfd.readouterr()
    assert "rdkafka#" not in out + err, (out + err)[-2000:]
    assert last["workload_tx"] > 100
    shapes = {s["shape"]: s for s in last["shapes"]}
    assert set(shapes) == {s.get("name") or s["table"] for s in DEMO_SHAPES}
    for name, shown in shapes.items():
        # The numbers shown are the real ones: what the topics hold.
        assert shown["events"] == in_topics[name], name
        assert f"│ {name:<16} │ {shown['events']:>6} │" in text
    assert shapes["public.orders"]["events"] > 5000  # snapshot + live
    assert last["slot"]["confirmed_flush_lsn"] in text
    assert "stopped. logs:" in text
    # The Spark consumer applied everything: verify passes for every shape.
    assert [v["ok"] for v in last["verify"]] == [True] * len(DEMO_SHAPES), last["verify"]
    assert "walbridge verify" in text and "DIFFERENT" not in text
