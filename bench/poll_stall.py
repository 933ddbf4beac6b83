"""A read planned past a partition's log end, as when the broker lost its data
between Spark's planning of a micro-batch (on the old topic) and the
executors' read (of the recreated, shorter one): how long Spark's Kafka
source waits, with its own default poll timeout and with walbridge's
``[consumer] poll_timeout``.

    .venv/bin/python bench/poll_stall.py

One embedded broker, a topic of three partitions holding 100 messages each,
and a Spark batch read (the same source as the consumer's query) of offsets
0-150 on two of them and 0-100 on the third, ``failOnDataLoss`` false. A
partition read past its end returns nothing until the poll times out; only
then does Spark see the offsets are gone and skip them. The reference is the
same read of what the partitions hold.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from schemas.config import ConsumerConfig  # noqa: E402
from spark_consumer.session import spark_session  # noqa: E402
from walbridge.embedded import KafkaBroker  # noqa: E402

TOPIC, PARTITIONS, HELD = "stall", 3, 100


def main() -> None:
    with tempfile.TemporaryDirectory() as scratch, KafkaBroker(Path(scratch) / "kafka") as broker:
        admin = AdminClient({"bootstrap.servers": broker.bootstrap})
        admin.create_topics([NewTopic(TOPIC, PARTITIONS, 1)])[TOPIC].result()
        producer = Producer({"bootstrap.servers": broker.bootstrap})
        for i in range(PARTITIONS * HELD):
            producer.produce(TOPIC, str(i).encode(), partition=i % PARTITIONS)
        producer.flush()
        spark = spark_session("local[2]")

        def read(ends: dict[str, int], poll_ms: int | None) -> tuple[int, float]:
            options = {"kafka.bootstrap.servers": broker.bootstrap, "assign": json.dumps({TOPIC: list(range(PARTITIONS))}),
                       "startingOffsets": json.dumps({TOPIC: {str(p): 0 for p in range(PARTITIONS)}}),
                       "endingOffsets": json.dumps({TOPIC: ends}), "failOnDataLoss": "false"}
            if poll_ms is not None:
                options["kafkaConsumer.pollTimeoutMs"] = str(poll_ms)
            started = time.monotonic()
            rows = spark.read.format("kafka").options(**options).load().count()
            return rows, time.monotonic() - started

        held = {str(p): HELD for p in range(PARTITIONS)}
        past = {**held, "0": HELD + 50, "1": HELD + 50}
        walbridge_ms = round(ConsumerConfig().poll_timeout * 1000)
        read(held, None)  # the JVM's warm-up
        for what, ends, poll_ms in (("what the partitions hold", held, None),
                                    ("past the end, Spark's default poll timeout", past, None),
                                    (f"past the end, [consumer] poll_timeout = {walbridge_ms / 1000:g}", past,
                                     walbridge_ms)):
            rows, seconds = read(ends, poll_ms)
            print(f"{what:55s} {rows:4d} rows {seconds:7.1f} s", flush=True)
        spark.stop()


if __name__ == "__main__":
    main()
