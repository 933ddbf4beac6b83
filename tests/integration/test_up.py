"""`walbridge up` headless on the embedded default: data flows end to end
through the producer and the Spark consumer's query, the view shows the real
numbers (the query's among them), and verify passes."""

from __future__ import annotations

import io
import re
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
        log = (base / "walbridge.log").read_text()
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
    # The consumer is a Spark Structured Streaming query: its progress is in
    # the log and in the view (batch id, input rows/s, batch duration, UI).
    assert "consuming 4 shape topics in one query" in log
    assert len(re.findall(r"walbridge\.consumer: batch \d+: \d+ rows of \d+ shapes", log)) > 5, log[-3000:]
    spark = last["spark"]
    assert spark["batch"] > 5 and spark["batch_s"] is not None and spark["rows_per_s"] is not None
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", spark["ui"]) and spark["ui"] in text
    assert re.search(rf"spark batch +{spark['batch']} +input rows/s", text), text[-3000:]
    # The Spark consumer applied everything: verify passes for every shape.
    assert [v["ok"] for v in last["verify"]] == [True] * len(DEMO_SHAPES), last["verify"]
    assert "walbridge verify" in text and "DIFFERENT" not in text


def test_up_with_a_delta_target_ends_with_verify_ok():
    """``walbridge up --target delta``: the demo (the keyless audit_log too)
    merged into Delta tables in the data folder, verified with delta-rs."""
    base = Path(tempfile.mkdtemp(prefix="wb-up-delta-"))
    console = Console(record=True, width=140, file=io.StringIO())
    try:
        last = run_up(None, base, duration=25, rate=25, headless=True, console=console, target="delta")
        tables = sorted(p.name for p in (base / "lake").iterdir() if not p.name.startswith("_"))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert tables == sorted(s.get("name") or s["table"] for s in DEMO_SHAPES)
    assert last["workload_tx"] > 100
    assert [v["ok"] for v in last["verify"]] == [True] * len(DEMO_SHAPES), last["verify"]
    text = console.export_text()
    assert "walbridge verify" in text and "DIFFERENT" not in text
