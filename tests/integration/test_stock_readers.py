"""Every topic of a producer run, read with stock tools only, as a user's own
consumer would: with a registry, confluent-kafka's ``AvroDeserializer``; without
one, the README's recipe ("Decoding the topics with a plain Kafka consumer"),
executed as the README writes it. Both must give what walbridge's own reader
gives, keys, values and primary-key change headers alike, and the rows folded
from them must be the source's, special values included.

The registry is confluent-kafka's in-process ``mock://`` one, which lives in
its client object: the deserializer is handed the client the producer
registered with (``schemas.registry.registry_client`` keeps one per settings),
as a real registry would be shared over HTTP."""

from __future__ import annotations

import datetime as dt
import json
import re
from decimal import Decimal
from pathlib import Path

import psycopg
import pytest
from confluent_kafka.admin import AdminClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext

from schemas import wire
from schemas.reader import SchemaResolver
from schemas.registry import registry_client
from tests.helpers import ProducerThread, make_config, read_topic, wait_for, wait_snapshot_done

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_recipe() -> str:
    """The Python block of the README's section on plain consumers, as written."""
    text = README.read_text()
    section = text[text.index("### Decoding the topics with a plain Kafka consumer"):]
    section = section[:section.index("\n## ")]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1
    return blocks[0]


def _fold(events: list[tuple[dict | None, dict | None]], row) -> dict:
    """Keys and values (decoded) in partition order → the rows by id."""
    state = {}
    for key, value in events:
        if value is None:
            continue  # a delete's tombstone, or a control event
        if value["op"] == "d":
            state.pop(key["id"], None)
        else:
            state[key["id"]] = row(value["after"])
    return state


@pytest.mark.parametrize("registry", [None, "mock://stock-readers"])
def test_every_topic_decodes_with_stock_tools(source_db, kafka_broker, topic_prefix, registry):
    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, amount numeric(10,2), day date, note text)")
        conn.execute("INSERT INTO t VALUES (1, 1.50, '2024-02-29', 'a'), (2, 2.00, '2024-03-01', 'b'), "
                     "(3, 3.25, NULL, NULL)")
    kafka = {"schema_registry_url": registry} if registry else {}
    cfg = make_config(source_db, kafka_broker.bootstrap, topic_prefix, [{"table": "public.t"}], kafka=kafka)
    topic = f"{topic_prefix}.public.t"
    with ProducerThread(cfg):
        wait_snapshot_done(kafka_broker.bootstrap, topic, topic_prefix, registry_url=registry)
        with psycopg.connect(source_db, autocommit=True) as conn:
            conn.execute("INSERT INTO t VALUES (4, 'NaN', 'infinity', 'special')")
            conn.execute("UPDATE t SET note = 'b2' WHERE id = 2")
            conn.execute("DELETE FROM t WHERE id = 1")
            conn.execute("UPDATE t SET id = 30 WHERE id = 3")  # a primary-key change
        wait_for(lambda: len(read_topic(kafka_broker.bootstrap, topic, topic_prefix, registry)) == 3 + 3 + 7,
                 what="3 snapshot rows, 3 snapshot_end, insert, update, 2 deletes with their tombstones, create")

    # The recipe's read_all serves both modes: it is plain confluent-kafka.
    recipe: dict = {"BOOTSTRAP": kafka_broker.bootstrap, "PREFIX": topic_prefix}
    exec(compile(readme_recipe(), "README.md", "exec"), recipe)
    read_all = recipe["read_all"]
    if registry:
        deserialize = AvroDeserializer(registry_client(registry))  # the producer's client (see above)

        def decode(data, topic_, field):
            return deserialize(data, SerializationContext(topic_, field))

        def row(record):
            special = json.loads(record.get("_wb_special") or "{}")
            return {k: special.get(k, v) for k, v in record.items() if k != "_wb_special"}
    else:
        def decode(data, topic_, field):
            return recipe["decode"](data)

        row = recipe["row"]

    topics = sorted(t for t in AdminClient({"bootstrap.servers": kafka_broker.bootstrap}).list_topics(
        timeout=10).topics if t.startswith(topic_prefix + "."))
    expected_internal = [t for t in wire.internal_topics(topic_prefix)
                         if not (registry and t == wire.schemas_topic(topic_prefix))]
    assert topics == sorted([topic, *expected_internal])

    ours = SchemaResolver({"bootstrap.servers": kafka_broker.bootstrap}, topic_prefix, registry)
    messages = read_all(kafka_broker.bootstrap, topic)
    assert len(messages) == 13
    events = []
    for m in sorted(messages, key=lambda m: (m.partition(), m.offset())):
        key, value = decode(m.key(), topic, MessageField.KEY), decode(m.value(), topic, MessageField.VALUE)
        assert key == ours.decode(m.key()) and value == ours.decode(m.value())
        headers = dict(m.headers() or [])
        if wire.CONTROL_HEADER in headers:
            assert value is None and key == {"event": "snapshot_end", "id": headers[wire.SNAPSHOT_HEADER].decode()}
            continue
        for name in (wire.NEW_KEY_HEADER, wire.OLD_KEY_HEADER):
            if name in headers:
                other = decode(headers[name], topic, MessageField.KEY)
                assert other == ({"id": 30} if name == wire.NEW_KEY_HEADER else {"id": 3}), (name, key)
        events.append((key, value))
    assert sum(v is None for _, v in events) == 2  # the deletes' tombstones
    assert sorted(k["id"] for k, v in events if v is None) == [1, 3]
    assert _fold(events, row) == {
        2: {"id": 2, "amount": Decimal("2.00"), "day": dt.date(2024, 3, 1), "note": "b2"},
        4: {"id": 4, "amount": "NaN", "day": "infinity", "note": "special"},
        30: {"id": 30, "amount": Decimal("3.25"), "day": None, "note": None},
    }
    with psycopg.connect(source_db) as conn:
        assert [r[0] for r in conn.execute("SELECT id FROM t ORDER BY id")] == [2, 4, 30]

    # The internal topics: JSON records (and, without a registry, the schemas the recipe read).
    for internal in expected_internal:
        records = read_all(kafka_broker.bootstrap, internal)
        assert all(m.key() for m in records), internal  # compacted: keyed
        values = [json.loads(m.value()) for m in records]
        if internal == wire.checkpoint_topic(topic_prefix):
            assert values[-1]["complete"] and values[-1]["topics"] == {topic: 3}
        elif internal == wire.status_topic(topic_prefix):
            assert values and all(isinstance(v, dict) for v in values)
        elif internal == wire.schemas_topic(topic_prefix):
            assert {m.key().decode() for m in records} == set(recipe["schemas"])
            assert {v["name"].rsplit(".", 1)[-1] for v in values} >= {"Envelope", "Key", "ControlKey"}

