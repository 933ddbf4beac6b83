"""Broker start-up: how long the embedded Apache Kafka node takes to be ready,
against an embedded PostgreSQL cluster's start in the same run.

    .venv/bin/python bench/broker.py [--runs 5]

Each run, on a new base dir: (a) a first start (storage formatted, JVM started,
until an AdminClient sees the node registered as a broker), (b) a stop and a
start on the same data, (c) ``lose_data()`` (stop, log dirs deleted, formatted
again, start), (d) the stop alone (SIGTERM, controlled shutdown). The reference
is a PostgreSQL cluster's ``initdb`` + ``pg_ctl start`` on a new base dir.
Medians (min-max) are printed, and each against the reference.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from walbridge.embedded import KafkaBroker, PostgresCluster  # noqa: E402


def timed(fn) -> float:
    started = time.monotonic()
    fn()
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    figures: dict[str, list[float]] = {"first start": [], "restart on its data": [], "lose_data()": [],
                                       "stop": [], "reference: PostgreSQL initdb + start": []}
    for _ in range(args.runs):
        base = Path(tempfile.mkdtemp(prefix="wb-bench-broker-"))
        try:
            broker = KafkaBroker(base / "kafka")
            figures["first start"].append(timed(broker.start))
            figures["restart on its data"].append(timed(broker.restart))
            figures["lose_data()"].append(timed(broker.lose_data))
            figures["stop"].append(timed(broker.stop))
            pg = PostgresCluster(base / "pg")
            figures["reference: PostgreSQL initdb + start"].append(timed(pg.start))
            pg.stop()
        finally:
            shutil.rmtree(base, ignore_errors=True)
    reference = statistics.median(figures["reference: PostgreSQL initdb + start"])
    print(f"{'':40} {'median s':>9} {'min-max s':>13} {'vs PostgreSQL':>14}")
    for name, values in figures.items():
        median = statistics.median(values)
        print(f"{name:40} {median:9.2f} {min(values):6.2f}-{max(values):<6.2f} {median / reference:13.2f}x")


if __name__ == "__main__":
    main()
